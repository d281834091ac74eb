"""The MoE block with this pack's kernels (kernels/moe.cu) between the GEMMs of the
resolved ``linear`` sub-op:

    router GEMM (fp32) -> routing kernel -> pooler GEMM (bf16)
    -> pre_expert_norm kernel -> routed experts (the resolved ``experts`` sub-op)
    -> [expert TP: all-reduce of the route rows] -> tail kernel
    -> [EP over ranks: all-reduce of m] -> unpooler GEMM into the next mailbox

At TP > 1 with ``cuda.all_reduce`` as the resolved sub-op, the reduction and the
tail are one kernel (tail_all_reduce_kernel, the same Lamport call and the same
bits as the sub-op's); with another all-reduce, the sub-op runs between kernels.

Against the reference: the routing kernel computes the same fp32 operations in the
same order (sigmoid as 1 / (1 + exp(-z)), the sum in selection order), so ids and
weights are bitwise equal for the same logits; the norms' row reductions sum in
another order (fp32 rounding, so a bf16 output may move by one ulp).
"""

from __future__ import annotations

import torch

from sparkdecode.protocols import BuildContext, Deployment, ExpertsInput, RoutedTopk, Step
from sparkdecode.reference.providers import experts_kind

from .all_reduce import CudaAllReduce
from .boundary import ITEMS, _Cuda
from .lamport import LamportWorkspace, workspace
from .launch import Kernel, f32, i32, ptr

SOURCE = "moe.cu"
COMPILE_OPTIONS = ("--fmad=false",)


class MoEKernels:
    """routing_kernel, rmsnorm_kernel and tail_kernel compiled for one spec."""

    def __init__(self, ctx: BuildContext):
        spec = ctx.spec
        self.width, self.threads, self.top_k = spec.P, spec.P // ITEMS, spec.top_k
        defines = {"WIDTH": spec.P, "THREADS": self.threads, "EXPERTS": spec.E}
        self.routing = Kernel(SOURCE, "routing_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.norm = Kernel(SOURCE, "rmsnorm_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.tail = Kernel(SOURCE, "tail_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.tail_all_reduce = Kernel(SOURCE, "tail_all_reduce_kernel", ctx.device, defines, COMPILE_OPTIONS)

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

    def pre_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        self.norm.launch(
            (x.shape[0], 1, 1),
            (self.threads, 1, 1),
            [ptr(x), i32(x.stride(0)), ptr(weight), f32(eps), f32(1.0), ptr(out)],
        )

    def finish(
        self, rows: torch.Tensor, weights: torch.Tensor, norm: torch.Tensor, eps: float, out: torch.Tensor
    ) -> None:
        self.tail.launch(
            (rows.shape[0], 1, 1),
            (self.threads, 1, 1),
            [ptr(rows), ptr(weights), ptr(norm), f32(eps), i32(self.top_k), ptr(out)],
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
        self.tail_all_reduce.launch(
            (rows.shape[0], 1, 1),
            (self.threads, 1, 1),
            [ptr(rows), ptr(weights), ptr(norm), f32(eps), i32(self.top_k), ptr(out), i32(reduce_rows), *ws.args()],
        )


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
        rows = ctx.max_rows
        self.logits = ctx.scratch("cuda_moe_logits", (rows, spec.E), torch.float32)
        self.ids = ctx.scratch("cuda_moe_ids", (rows, spec.top_k), torch.int32)
        self.weights = ctx.scratch("cuda_moe_weights", (rows, spec.top_k), torch.float32)
        pooled = self.layer.pooler.shape[0]  # P, or this rank's P / tp columns
        self.pooled = ctx.scratch(f"cuda_moe_pooled_{pooled}", (rows, pooled), torch.bfloat16)
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

    def run(self, step: Step, x: torch.Tensor) -> None:
        spec, layer, b = self.spec, self.layer, x.shape[0]
        logits = self.logits[:b]
        self.linear.run("router", x, logits)
        topk = RoutedTopk(self.ids[:b], self.weights[:b])
        self.kernels.route(logits, layer.expert_bias, spec.routed_scaling_factor, topk)
        pooled = self.pooled[:b]
        self.linear.run("pooler", x, pooled)
        if pooled.shape[1] != spec.P:  # a column-sharded pooler
            pooled = self.collectives.gather_columns(pooled, spec.P)
        h = self.h[:b]
        self.kernels.pre_norm(pooled, layer.pre_expert_norm, spec.rms_norm_eps, h)
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
