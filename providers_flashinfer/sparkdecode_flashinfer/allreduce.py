"""``flashinfer.trtllm_all_reduce``: the TP all-reduce on FlashInfer's TensorRT-LLM
one-shot Lamport kernel.

FlashInfer 0.7.2 keeps TensorRT-LLM's custom all-reduce as the ``kAllReduce``
pattern of ``trtllm_allreduce_fusion`` (flashinfer/comm/trtllm_ar.py; kernel
``allreduce_fusion_kernel_oneshot_lamport`` in
include/flashinfer/comm/trtllm_allreduce_fusion.cuh; JIT module ``trtllm_comm``,
built for SM90, SM100 and SM120). The older ``trtllm_custom_all_reduce`` and its
``trtllm_create_ipc_workspace_for_all_reduce`` have no Python wrapper left in
0.7.2; the fusion kernel is what FlashInfer and vLLM call.

- Workspace (``flashinfer.comm.TRTLLMAllReduceFusionWorkspace``, built once per
  ``BuildContext``, collectively): three buffers per rank in CUDA VMM memory, each
  rank's mapped into every other rank's address space (POSIX file descriptors over
  a Unix socket, or fabric handles where the GPU has them; the handles travel by
  ``all_gather_object`` over the TP group, gloo or NCCL), no NVLink multicast.
  All ranks must be on one host.
- One-shot: every rank writes its rows into every rank's Lamport buffer (a slot
  per source rank), then each rank polls its own buffer until no slot holds the
  sentinel -0.0 and sums the slots in rank order 0..tp-1 in fp32
  (``allreduce_sum<..., Fp32Acc=true>``), rounded to bf16 once: the reference
  transport's order and rounding (comm.Collectives.all_reduce), so every rank holds
  the same bits and the executor equals the TP stock forward. One difference: the
  kernel sends a -0.0 input as +0.0 (-0.0 is its "not arrived" mark), so an element
  that is -0.0 on every rank sums to +0.0 where the reference gives -0.0 (equal as
  numbers; no other bit differs).
- In place: each thread reads its input elements before it writes their sums.
- Capturable: the flags that rotate the three Lamport buffers and clear the
  previous call's live in device memory; the launch reads nothing from the host
  per call. Every rank must issue the same sequence of all-reduces (the executor
  does).

The layers' all-reduces are bf16 rows of width H (attention o_proj partials) and P
(the MoE tail's route rows ``[b, top_k, P]`` under expert TP, its ``[b, P]``
partials under EP); the workspace is sized for the largest.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from sparkdecode.deployment import on_every_rank
from sparkdecode.protocols import BuildContext, Deployment
from sparkdecode.release import release_deferred, release_outside_capture

from .support import flashinfer_gpu_unsupported

RANKS = (2, 4, 8, 16)  # the kernel's NRanks instantiations
# The name of the workspace's marker in the executor's buffers (BuildContext.shared).
_MARKER = "flashinfer_all_reduce_workspace"
VEC = 8  # bf16 elements per 16-byte access
MAX_CLUSTER = 8
MAX_BLOCK = 1024


def width_unsupported(width: int) -> str | None:
    """Why the one-shot launch cannot take rows of ``width`` bf16 elements: one
    thread per 8 elements, a row per thread-block cluster of at most 8 CTAs of at
    most 1024 threads, the cluster a power of two dividing the row's threads."""
    if width % VEC:
        return f"rows of {width} elements (the one-shot kernel reads 8 bf16 at a time)"
    threads = width // VEC
    cluster = MAX_CLUSTER
    while threads % cluster:
        cluster //= 2
    if threads // cluster > MAX_BLOCK:
        return f"rows of {width} elements: more than {MAX_BLOCK} threads a CTA in a cluster of {cluster}"
    return None


def reduced_widths(d: Deployment) -> tuple[int, ...]:
    """The row widths the blocks all-reduce: H, and P (the MoE tail)."""
    return tuple(sorted({d.spec.H, d.spec.P}))


class FlashInferAllReduce:
    """Sub-op ``all_reduce``: bf16 rows summed over the TP group in place."""

    block = "all_reduce"
    name = "flashinfer.trtllm_all_reduce"
    priority = 10

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        # flashinfer.comm needs cuda-python, which importing flashinfer alone does not.
        reason = flashinfer_gpu_unsupported(deployment, "flashinfer.comm")
        if reason is not None:
            return reason
        if deployment.tp == 1:
            return "TP 1: there is nothing to all-reduce"
        if deployment.tp not in RANKS:
            return f"TP {deployment.tp}: FlashInfer's one-shot all-reduce is built for 2, 4, 8 or 16 ranks"
        for width in reduced_widths(deployment):
            reason = width_unsupported(width)
            if reason is not None:
                return reason
        return None

    def __init__(self, ctx: BuildContext, workspace: Any):
        self.tp, self.rank = ctx.tp, ctx.rank
        self.widths = reduced_widths(ctx.deployment)
        self.workspace = workspace
        self.capacity = capacity(ctx)
        if workspace is not None:
            from flashinfer.comm.trtllm_ar import AllReduceFusionPattern, get_trtllm_comm_module

            self.op = get_trtllm_comm_module().trtllm_allreduce_fusion
            self.pattern = AllReduceFusionPattern.kAllReduce

    @classmethod
    def collective_setup(cls, ctx: BuildContext) -> None:
        """The shared workspace (collective), made before any build."""
        if ctx.group is not None:
            ctx.shared(_MARKER, lambda: create_workspace(ctx))

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> FlashInferAllReduce:
        """Every layer's all-reduce shares one workspace, made collectively by
        ``collective_setup`` (and its kernel JIT-compiled and run once); a rank with
        no group (detached) leaves its collectives out, as the reference does."""
        if ctx.group is None:
            return cls(ctx, None)
        return cls(ctx, ctx.shared(_MARKER, lambda: create_workspace(ctx)))

    def prepare_kv(self, kv: tuple) -> None:
        pass

    def run(self, x: torch.Tensor) -> None:
        if self.workspace is None:
            return
        width = x.shape[-1]
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or width not in self.widths or x.numel() > self.capacity:
            raise ValueError(
                f"{self.name}: takes contiguous bf16 rows of {self.widths} elements, at most {self.capacity} in all; "
                f"got {tuple(x.shape)} {x.dtype}{'' if x.is_contiguous() else ' (not contiguous)'}"
            )
        self.op(
            allreduce_in=x,
            world_size=self.tp,
            world_rank=self.rank,
            token_num=x.numel() // width,
            hidden_dim=width,
            workspace_ptrs=self.workspace.workspace_tensor,
            launch_with_pdl=False,
            use_oneshot=True,
            trigger_completion_at_end=True,
            fp32_acc=True,
            pattern_code=self.pattern,
            allreduce_out=x,
            residual_in=None,
            residual_out=None,
            norm_out=None,
            quant_out=None,
            scale_out=None,
            rms_gamma=None,
            rms_eps=None,
            scale_factor=None,
            layout_code=None,
        )


def capacity(ctx: BuildContext) -> int:
    """The most elements one all-reduce carries: ``max_rows`` rows of H, or of
    top_k x P (the route rows under expert TP)."""
    spec = ctx.spec
    return ctx.max_rows * max(spec.H, spec.top_k * spec.P)


def _destroy(ipc_handles: list, device: torch.device) -> None:
    from flashinfer.comm import trtllm_destroy_ipc_workspace_for_all_reduce_fusion

    torch.cuda.synchronize(device)  # this rank's last all-reduce on it has finished
    trtllm_destroy_ipc_workspace_for_all_reduce_fusion(ipc_handles)


def _release(ipc_handles: list, device: torch.device) -> None:
    """A workspace's memory, once no provider holds it (after any capture this thread
    is in): FlashInfer keeps its buffers in a module-level table until told to drop
    them (its workspace object's own ``destroy`` does not)."""
    release_outside_capture(_destroy, ipc_handles, device)


def create_workspace(ctx: BuildContext) -> Any:
    """The IPC workspace of this rank (collective over ``ctx.group``), then one
    all-reduce of zeros on every rank: the kernel's JIT build and its first launch
    (launch-shape queries cached in the library) happen here, not under capture.
    Its memory goes back to FlashInfer when the last provider holding it goes."""
    spec = ctx.spec

    def jit_build() -> Any:
        from flashinfer.comm import TRTLLMAllReduceFusionWorkspace
        from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

        release_deferred()
        get_trtllm_comm_module()  # the kernel's JIT build (or load), on each rank alone
        return TRTLLMAllReduceFusionWorkspace

    with torch.cuda.device(ctx.device):
        # Agreed before FlashInfer's exchange: a rank whose module cannot be built or
        # loaded stops every rank here.
        make = on_every_rank(jit_build, ctx.group, "FlashInfer's all-reduce module")
        # FlashInfer's own exchange is inside this step: a failure on every rank (no
        # shareable memory handles, say) is agreed, but one rank failing midway leaves
        # the others in FlashInfer's collectives until its own timeouts.
        workspace = on_every_rank(
            lambda: make(
                tp_size=ctx.tp,
                tp_rank=ctx.rank,
                max_token_num=math.ceil(capacity(ctx) / spec.H),
                hidden_dim=spec.H,
                dtype=torch.bfloat16,
                group=ctx.group,
            ),
            ctx.group,
            "FlashInfer's all-reduce workspace",
        )
        finalizer = weakref.finalize(workspace, _release, workspace.ipc_handles, torch.device(ctx.device))
        finalizer.atexit = False  # at exit the process's memory goes anyway
        try:
            warm = on_every_rank(lambda: FlashInferAllReduce(ctx, workspace), ctx.group, "FlashInfer's all-reduce")
            for width in warm.widths:
                warm.run(torch.zeros(ctx.max_rows, width, dtype=torch.bfloat16, device=ctx.device))
            torch.cuda.synchronize(ctx.device)
        except BaseException:
            try:
                finalizer()
            except Exception:  # a sticky CUDA error fails the synchronize too: keep the first error
                pass
            raise
    return workspace
