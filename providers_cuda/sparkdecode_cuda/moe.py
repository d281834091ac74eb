"""The MoE block with this pack's kernels (kernels/moe.cu) between the GEMMs of the
resolved ``linear`` sub-op:

    router GEMM (fp32) -> routing kernel -> pooler GEMM (bf16)
    -> pre_expert_norm kernel -> routed experts (the resolved ``experts`` sub-op)
    -> [expert TP: all-reduce of the route rows] -> tail kernel
    -> [EP over ranks: all-reduce of m] -> unpooler GEMM into the next mailbox

At TP > 1 with ``cuda.all_reduce`` as the resolved sub-op, the reduction and the
tail are one kernel (tail_all_reduce_kernel, the same Lamport call and the same
bits as the sub-op's); with another all-reduce, the sub-op runs between kernels.

On CUDA the router GEMM and the routing kernel run on a side stream, beside the
pooler GEMM and the pre-expert norm on the current stream (issue 8: 31 us and 30 us
at a TP-8 rank, back to back before): the side stream waits on an event recorded on
the current stream (the fork), and the current stream waits on an event recorded
after the routing kernel (the join) before the experts read the routing. The same
launches in the same order per stream, so the same bits; in a CUDA graph the fork
and join become edges (the capture needs every forked stream joined, which it is).
The router runs through its own ``linear`` op, built from a context with its own
scratch (shared by the layers' side ops), so a linear provider that shares scratch
between its weights (a split-K workspace) never sees two of them at once.

PDL (launch.py launches every pack kernel with programmatic stream serialization):
that attribute relaxes only a kernel's dependency on the kernel before it in the
same stream, and every pack kernel calls ``pdl_wait()`` (griddepcontrol.wait:
until every grid it depends on has finished and its writes are visible) before it
reads anything earlier work wrote. A launch right after the join's event wait (the
experts, on the current stream) therefore cannot read the routing early: the event
wait is a full dependency, and were it captured as a programmatic edge the kernel
would still block in ``pdl_wait()`` until the routing kernel completes. The same
holds for the first launch on the side stream after the fork.

Against the reference: the routing kernel computes the same fp32 operations in the
same order (sigmoid as 1 / (1 + exp(-z)), the sum in selection order), so ids and
weights are bitwise equal for the same logits; the norms' row reductions sum in
another order (fp32 rounding, so a bf16 output may move by one ulp).
"""

from __future__ import annotations

import dataclasses

import torch

from sparkdecode.protocols import BuildContext, Deployment, ExpertsInput, RoutedTopk, Step
from sparkdecode.reference.providers import experts_kind
from sparkdecode.spec import ModelSpec

from .all_reduce import CudaAllReduce
from .boundary import ITEMS, _Cuda, check_aligned
from .lamport import LamportWorkspace, device_gather, workspace
from .launch import Kernel, f32, i32, ptr

SOURCE = "moe.cu"
COMPILE_OPTIONS = ("--fmad=false",)


def kernel_defines(spec: ModelSpec) -> dict[str, int]:
    """moe.cu's defines for a spec (the tail's routes loaded and reduced up to 8 at a
    time: TAIL_GROUP)."""
    return {
        "WIDTH": spec.P,
        "THREADS": spec.P // ITEMS,
        "EXPERTS": spec.E,
        "TOP_K": spec.top_k,
        "TAIL_GROUP": min(8, spec.top_k),
    }


class MoEKernels:
    """routing_kernel, rmsnorm_kernel and tail_kernel compiled for one spec."""

    def __init__(self, ctx: BuildContext):
        spec = ctx.spec
        defines = kernel_defines(spec)
        self.width, self.threads, self.top_k = spec.P, defines["THREADS"], spec.top_k
        self.routing = Kernel(SOURCE, "routing_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.norm = Kernel(SOURCE, "rmsnorm_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.tail = Kernel(SOURCE, "tail_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.tail_all_reduce = Kernel(SOURCE, "tail_all_reduce_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.norm_columns = Kernel(SOURCE, "rmsnorm_columns_kernel", ctx.device, defines, COMPILE_OPTIONS)

    def route(self, logits: torch.Tensor, bias: torch.Tensor, scaling: float, topk: RoutedTopk) -> None:
        b = logits.shape[0]
        self.routing.launch(
            (b, 1, 1),
            (32, 1, 1),
            [
                ptr(logits),
                i32(logits.stride(0)),
                ptr(bias),
                ptr(topk.ids),
                ptr(topk.weights),
                i32(self.top_k),
                f32(scaling),
                f32(1e-15),
            ],
        )

    @staticmethod
    def _norm_arguments(x_name: str, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> list:
        """The arguments rmsnorm_kernel and rmsnorm_columns_kernel begin with (the rows,
        named ``x_name`` in an error, their stride, the weight, eps, the weight's centre,
        the output), each tensor checked for the kernels' 16-byte accesses."""
        check_aligned(x_name, x, strided=True)
        check_aligned("weight", weight)
        check_aligned("out", out)
        return [ptr(x), i32(x.stride(0)), ptr(weight), f32(eps), f32(1.0), ptr(out)]

    def pre_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        self.norm.launch((x.shape[0], 1, 1), (self.threads, 1, 1), self._norm_arguments("x", x, weight, eps, out))

    def pre_norm_columns(
        self,
        block: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        ws: LamportWorkspace,
        published: bool,
    ) -> None:
        """pre_norm of the whole whose column ``block`` this rank holds (a sharded
        pooler's output), the blocks exchanged over the Lamport mailbox in the same
        kernel (``published``: the pooler's epilogue pushed this rank's)."""
        args = [*self._norm_arguments("block", block, weight, eps, out), i32(published), *ws.args()]
        self.norm_columns.launch((block.shape[0], 1, 1), (self.threads, 1, 1), args)

    def finish(
        self, rows: torch.Tensor, weights: torch.Tensor, norm: torch.Tensor, eps: float, out: torch.Tensor
    ) -> None:
        for name, t in (("rows", rows), ("norm", norm), ("out", out)):
            check_aligned(name, t)
        self.tail.launch(
            (rows.shape[0], 1, 1),
            (self.threads, 1, 1),
            [ptr(rows), ptr(weights), ptr(norm), f32(eps), ptr(out)],
        )

    def finish_all_reduce(
        self,
        rows: torch.Tensor,
        weights: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        reduce_rows: bool,
        ws: LamportWorkspace,
    ) -> None:
        """The tail with its TP reduction: the route rows (in place, expert TP) or the
        output (EP) all-reduced over the Lamport mailbox."""
        for name, t in (("rows", rows), ("norm", norm), ("out", out)):
            check_aligned(name, t)
        self.tail_all_reduce.launch(
            (rows.shape[0], 1, 1),
            (self.threads, 1, 1),
            [ptr(rows), ptr(weights), ptr(norm), f32(eps), ptr(out), i32(reduce_rows), *ws.args()],
        )


_SIDE_MARKER = "cuda_moe_side_scratch"


def side_context(ctx: BuildContext) -> BuildContext:
    """``ctx`` with its own scratch for the ops that run on the side stream: one
    buffers dict shared by every build from ``ctx`` (``BuildContext.shared``)."""
    side: dict[str, torch.Tensor] = ctx.shared(_SIDE_MARKER, dict)
    return dataclasses.replace(ctx, buffers=side)


def _moe_width_unsupported(d: Deployment) -> str | None:
    s = d.spec
    if s.P % (ITEMS * 32) or s.P // ITEMS > 1024:
        return f"moe_hidden_size {s.P}: the MoE kernels take multiples of {ITEMS * 32} up to {1024 * ITEMS}"
    if s.E > 1024:
        return f"{s.E} experts: the routing kernel takes at most 1024"
    if s.top_k > 32:
        return f"top-{s.top_k}: the routing kernel takes at most 32"
    return None


class CudaMoE(_Cuda):
    block = "moe"
    name = "cuda.moe"

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        return super().unsupported(deployment) or _moe_width_unsupported(deployment)

    def __init__(self, ctx: BuildContext, layer: int):
        spec = self.spec = ctx.spec
        self.layer = ctx.layer(layer)
        self.collectives = ctx.collectives
        self.kernels = MoEKernels(ctx)
        self.experts = ctx.ops[experts_kind(self.layer)].build(ctx, layer)
        self.all_reduce = ctx.ops["all_reduce"].build(ctx, None) if ctx.tp > 1 else None
        self.reduce_rows = self.layer.experts.intermediate_slice is not None  # expert TP
        self.reduce_out = self.layer.experts.num_local != spec.E  # EP over ranks
        fusable = ctx.tp > 1 and ctx.ops.get("all_reduce") is CudaAllReduce and self.reduce_rows != self.reduce_out
        self.workspace = workspace(ctx) if fusable else None
        self.linear = ctx.ops["linear"].build(ctx, layer)
        # The router on a side stream (CUDA only): its own linear op and scratch, the
        # stream and the fork/join events made here, outside any capture.
        self.side: torch.cuda.Stream | None = None
        self.router_linear = self.linear
        if ctx.device.type == "cuda":
            self.side = torch.cuda.Stream(ctx.device)
            self.fork, self.join = torch.cuda.Event(), torch.cuda.Event()
            self.router_linear = ctx.ops["linear"].build(side_context(ctx), layer)
        rows = ctx.max_rows
        self.logits = ctx.scratch("cuda_moe_logits", (rows, spec.E), torch.float32)
        self.ids = ctx.scratch("cuda_moe_ids", (rows, spec.top_k), torch.int32)
        self.weights = ctx.scratch("cuda_moe_weights", (rows, spec.top_k), torch.float32)
        pooled = self.layer.pooler.shape[0]  # P, or this rank's P / tp columns
        self.pooled = ctx.scratch(f"cuda_moe_pooled_{pooled}", (rows, pooled), torch.bfloat16)
        # A column-sharded pooler's output exchanged inside the pre-expert norm's kernel
        # where the transport gathers on the device, the pooler's epilogue pushing this
        # rank's block where the linear provider can; else the reference gather.
        self.pooled_exchange: LamportWorkspace | None = device_gather(ctx) if pooled != spec.P else None
        self.pooled_published = False
        if self.pooled_exchange is not None:
            publish = getattr(self.linear, "publish", None)
            self.pooled_published = bool(publish is not None and publish("pooler", self.pooled_exchange))
        self.h = ctx.scratch("cuda_moe_h", (rows, spec.P), torch.bfloat16)
        self.rows = ctx.scratch("moe_rows", (rows, spec.top_k, spec.P), torch.bfloat16)
        self.m = ctx.scratch("cuda_moe_m", (rows, spec.P), torch.bfloat16)
        self.mailbox = ctx.mailboxes[layer]

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CudaMoE:
        assert layer is not None
        return cls(ctx, layer)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            self.all_reduce.run(x)
        return x

    def _route(self, x: torch.Tensor, topk: RoutedTopk) -> None:
        logits = self.logits[: x.shape[0]]
        self.router_linear.run("router", x, logits)
        self.kernels.route(logits, self.layer.expert_bias, self.spec.routed_scaling_factor, topk)

    def publish_columns(self, mailbox: object) -> bool:
        """A column-sharded unpooler's output is this rank's block of the next
        boundary's input as it stands (nothing after it in this block), so its GEMM may
        push the block into that boundary's Lamport mailbox from its epilogue, where the
        ``linear`` provider can (``publish``); whether it will. Never for a replicated
        unpooler (nothing to exchange)."""
        if self.mailbox.publish(1).shape[1] == self.spec.H:
            return False
        publish = getattr(self.linear, "publish", None)
        return bool(publish is not None and publish("unpooler", mailbox))

    def run(self, step: Step, x: torch.Tensor) -> None:
        spec, layer, b = self.spec, self.layer, x.shape[0]
        # behind the side stream's join the routing is complete when the experts launch
        topk = RoutedTopk(self.ids[:b], self.weights[:b], final=self.side is not None)
        side, current = self.side, None
        if side is None:
            self._route(x, topk)
        else:  # fork: the side stream starts where the current one is
            current = torch.cuda.current_stream(x.device)
            self.fork.record(current)
            side.wait_event(self.fork)
            with torch.cuda.stream(side):
                self._route(x, topk)
                self.join.record(side)
        pooled, h = self.pooled[:b], self.h[:b]
        self.linear.run("pooler", x, pooled)
        if self.pooled_exchange is not None:  # a column-sharded pooler, exchanged in the norm
            ex, pub = self.pooled_exchange, self.pooled_published
            self.kernels.pre_norm_columns(pooled, layer.pre_expert_norm, spec.rms_norm_eps, h, ex, pub)
        else:
            if pooled.shape[1] != spec.P:  # a column-sharded pooler, the reference gather
                pooled = self.collectives.gather_columns(pooled, spec.P)
            self.kernels.pre_norm(pooled, layer.pre_expert_norm, spec.rms_norm_eps, h)
        if current is not None:  # join: the routing is read from here on
            current.wait_event(self.join)
        rows = self.rows[:b]
        self.experts.run(ExpertsInput(h), topk, rows)
        m = self.m[:b]
        if self.workspace is not None:
            self.kernels.finish_all_reduce(
                rows, topk.weights, layer.post_expert_norm, spec.post_norm_eps, m, self.reduce_rows, self.workspace
            )
        else:
            if self.reduce_rows:
                self._all_reduce(rows)
            self.kernels.finish(rows, topk.weights, layer.post_expert_norm, spec.post_norm_eps, m)
            if self.reduce_out:
                self._all_reduce(m)
        self.linear.run("unpooler", m, self.mailbox.publish(b))
