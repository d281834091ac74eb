"""Sub-op ``linear`` in the CuTe DSL: the layer's five dense GEMMs as the
weight-streaming GEMV of gemv.py (one compiled kernel per weight shape, shared by
the layers), launched with programmatic dependent launch so each weight streams
while the kernel before it finishes.

Against ``reference.linear`` (cuBLAS): the same products accumulated in fp32 in
another order, rounded once to the output dtype; a bf16 output differs by at most
about one bf16 ulp of the largest partial sums, the fp32 router by fp32 rounding
(relative ~1e-6 of the row's magnitude). Results are identical from run to run.
"""

from __future__ import annotations

import torch

from sparkdecode.protocols import LINEAR_WEIGHTS, BuildContext, Deployment

from .common import CuteProvider, compiled, current_stream, pointer

VECTOR_BYTES = 16


def weight_fp32(name: str, w: torch.Tensor) -> bool:
    """Whether ``w`` is the fp32 router (else bf16); an error for any other form."""
    if w.dim() != 2 or w.stride(1) != 1 or w.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"cute.linear: {name} is {tuple(w.shape)} {w.dtype} strides {w.stride()}")
    return w.dtype == torch.float32


class _Weight:
    """One weight's compiled kernel and its pointer."""

    def __init__(self, name: str, w: torch.Tensor, max_rows: int):
        from . import gemv

        fp32 = weight_fp32(name, w)
        plan = gemv.plan_gemv(w.shape[0], w.shape[1], fp32, max_rows, w.stride(0))
        if isinstance(plan, str):
            raise ValueError(f"cute.linear: {name} {tuple(w.shape)}: {plan}")
        self.name, self.plan, self.w = name, plan, w
        self.vector = plan.vector
        self.out_dtype = w.dtype
        self.kernel = compiled(("gemv", plan), lambda: gemv.compile_gemv(plan))
        self.w_ptr = pointer(w, VECTOR_BYTES)
        self.buffers: tuple = ()  # the kernel's pointers after out, if any

    def check(self, x: torch.Tensor, out: torch.Tensor) -> None:
        b, p = x.shape[0], self.plan
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != p.k or x.stride(1) != 1:
            raise ValueError(f"cute.linear {self.name}: x {tuple(x.shape)} {x.dtype} is not bf16 [b, {p.k}] rows")
        if x.stride(0) % self.vector:
            raise ValueError(f"cute.linear {self.name}: x rows {x.stride(0)} apart, not whole 16-byte vectors")
        if out.dtype != self.out_dtype or tuple(out.shape) != (b, p.n) or out.stride(1) != 1:
            raise ValueError(
                f"cute.linear {self.name}: out {tuple(out.shape)} {out.dtype} is not {self.out_dtype} [{b}, {p.n}] rows"
            )
        if not 1 <= b <= p.max_rows:
            raise ValueError(f"cute.linear {self.name}: {b} rows (1..{p.max_rows})")

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        from cutlass import Int32

        self.check(x, out)
        self.kernel(
            self.w_ptr,
            pointer(x, VECTOR_BYTES),
            pointer(out, out.element_size()),
            *self.buffers,
            Int32(x.shape[0]),
            Int32(x.stride(0)),
            Int32(out.stride(0)),
            current_stream(),
        )


def _shapes_unsupported(d: Deployment) -> str | None:
    """The widths every layer's K takes (the per-layer shapes are checked in build)."""
    if not 1 <= d.max_rows <= 8:
        return f"{d.max_rows} rows a step: the GEMV takes 1..8"
    for label, width in (("hidden size", d.spec.H), ("moe_hidden_size", d.spec.P)):
        if width % 256:
            return f"{label} {width}: the GEMV takes K in multiples of 256"
    return None


class CuteLinear(CuteProvider):
    """Sub-op ``linear``: every dense weight of the layer streamed by the CuTe DSL GEMV."""

    block = "linear"
    name = "cute.linear"

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        return super().unsupported(deployment) or _shapes_unsupported(deployment)

    def __init__(self, ctx: BuildContext, layer: int):
        lw = ctx.layer(layer)
        self.weights = {name: _Weight(name, getattr(lw, name), ctx.max_rows) for name in LINEAR_WEIGHTS}

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CuteLinear:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        self.weights[name](x, out)
