"""Sub-op ``experts`` in the CuTe DSL: the bf16 routed experts as the two kernels of
experts_kernels.py (W13 with SwiGLU, then W2 into the route rows), each distinct
expert's weights streamed once for every row routed to it, the distinct experts
found on the device (no host sync: the ids change from replay to replay), both
kernels persistent and launched with programmatic dependent launch.

Against ``reference.experts`` (``fn.expert_rows``): the same roundings to bf16 (the
gate/up GEMM output, ``silu(gate) * up`` computed in fp32, the W2 GEMM output),
with the products accumulated in fp32 in another order (per lane in column order,
then a fixed butterfly across the warp) and exp taken as ``ex2.approx``. A result
moves by about one bf16 ulp where an fp32 sum sits near a rounding boundary, which
can carry through h into the W2 sums. Results are identical from run to run.
"""

from __future__ import annotations

from typing import Any

import torch

from sparkdecode.protocols import BuildContext, Deployment, ExpertsInput, RoutedTopk

from .common import CuteProvider, compiled, current_stream, pointer
from .experts_shape import ExpertsShape, shape_unsupported

VECTOR_BYTES = 16
# Persistent CTAs a multiprocessor: two fit beside each other at every shape (8 warps
# of <= 104 registers, <= 66 KB of shared memory), 16 warps with 4 KB of loads each
# in flight, which covers the memory latency at the copy bandwidth.
CTAS_PER_SM = 2


def _deployment_shape(d: Deployment) -> ExpertsShape:
    """The kernels' shape a rank of ``d`` holds (EP: whole experts, a share of them;
    expert TP: every expert's I-slice)."""
    s = d.spec
    ep = d.expert_parallel == "ep"
    return ExpertsShape(
        width=s.P,
        intermediate=s.I if ep else s.I // d.tp,
        num_local=s.E // d.tp if ep else s.E,
        top_k=s.top_k,
        max_rows=d.max_rows,
    )


class CuteExperts(CuteProvider):
    """Sub-op ``experts`` (bf16 weights): W13 + SwiGLU, then W2, in the CuTe DSL."""

    block = "experts"
    name = "cute.experts"

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        reason = super().unsupported(deployment)
        if reason:
            return reason
        if deployment.expert_format != "bf16":
            return f"serves bf16 experts, not {deployment.expert_format}"
        return shape_unsupported(_deployment_shape(deployment))

    @staticmethod
    def compile(shape: ExpertsShape) -> Any:
        """The compiled kernels of ``shape`` for the GPU at hand."""
        from .experts_kernels import compile_experts

        return compile_experts(shape)

    def __init__(self, ctx: BuildContext, layer: int):
        e = ctx.layer(layer).experts
        if e.format != "bf16":
            raise ValueError(f"layer {layer}: {self.name} serves bf16 experts, not {e.format}")
        num_local, rows13, width = e.w13.shape
        intermediate = e.w2.shape[2]
        if rows13 != 2 * intermediate or tuple(e.w2.shape[:2]) != (num_local, width):
            raise ValueError(f"layer {layer}: w13 {tuple(e.w13.shape)} and w2 {tuple(e.w2.shape)} do not pair")
        for label, w in (("w13", e.w13), ("w2", e.w2)):
            if w.dtype != torch.bfloat16 or not w.is_contiguous():
                raise ValueError(
                    f"layer {layer}: {self.name} takes contiguous bf16 {label}, got {w.dtype} {w.stride()}"
                )
        shape = ExpertsShape(width, intermediate, num_local, ctx.spec.top_k, ctx.max_rows)
        reason = shape_unsupported(shape)
        if reason:
            raise ValueError(f"layer {layer}: {self.name}: {reason}")
        self.shape, self.first_expert = shape, e.first_expert
        self.kernel = compiled((self.name, shape), lambda: self.compile(shape))
        self.w13, self.w2 = pointer(e.w13, VECTOR_BYTES), pointer(e.w2, VECTOR_BYTES)
        self.weights = (e.w13, e.w2)  # keep the storage the pointers name alive
        # h of each routed row, at the row's first slot with the expert: layers share it.
        self.h = ctx.scratch(
            f"cute_experts_h_{intermediate}", (ctx.max_rows * shape.top_k, intermediate), torch.bfloat16
        )
        self.h_ptr = pointer(self.h, VECTOR_BYTES)
        self.ctas = CTAS_PER_SM * torch.cuda.get_device_properties(ctx.device).multi_processor_count
        self._warm_up(ctx.device)

    def _warm_up(self, device: torch.device) -> None:
        """One launch before any capture (the module loads on the first call): a row
        routed to no expert this rank holds, so only its zero rows are written."""
        s = self.shape
        x = torch.zeros(1, s.width, dtype=torch.bfloat16, device=device)
        ids = torch.full((1, s.top_k), -1, dtype=torch.int32, device=device)
        rows = torch.empty(1, s.top_k, s.width, dtype=torch.bfloat16, device=device)
        self.run(ExpertsInput(x), RoutedTopk(ids, torch.zeros(1, s.top_k, device=device)), rows)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CuteExperts:
        assert layer is not None
        return cls(ctx, layer)

    def check(self, x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        s, b = self.shape, x.shape[0]
        if not 1 <= b <= s.max_rows:
            raise ValueError(f"{self.name}: {b} rows (1..{s.max_rows})")
        if x.dtype != torch.bfloat16 or tuple(x.shape) != (b, s.width) or x.stride(1) != 1 or x.stride(0) % 8:
            raise ValueError(f"{self.name}: x {tuple(x.shape)} {x.dtype} {x.stride()} is not bf16 [b, {s.width}] rows")
        if ids.dtype != torch.int32 or tuple(ids.shape) != (b, s.top_k) or not ids.is_contiguous():
            raise ValueError(
                f"{self.name}: ids {tuple(ids.shape)} {ids.dtype} are not contiguous int32 [{b}, {s.top_k}]"
            )
        if rows.dtype != torch.bfloat16 or tuple(rows.shape) != (b, s.top_k, s.width) or not rows.is_contiguous():
            raise ValueError(f"{self.name}: rows {tuple(rows.shape)} {rows.dtype} are not contiguous bf16 [b, k, P]")

    def run(self, inputs: ExpertsInput, topk: RoutedTopk, rows: torch.Tensor) -> None:
        from cutlass import Int32

        x, ids = inputs.x, topk.ids
        self.check(x, ids, rows)
        self.kernel(
            pointer(x, VECTOR_BYTES),
            Int32(x.stride(0) // 8),
            pointer(ids, 4),
            self.w13,
            self.w2,
            self.h_ptr,
            pointer(rows, VECTOR_BYTES),
            Int32(x.shape[0]),
            Int32(self.first_expert),
            Int32(self.ctas),
            current_stream(),
        )
