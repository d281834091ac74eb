"""Sub-op ``linear`` in the CuTe DSL on Hopper's TMA and warpgroup MMA: the layer's
bf16 dense GEMMs as gemv_tma.py's weight stream (W loaded by TMA into a ring of
shared-memory buffers, ``wgmma.m64n8k16`` on 64 weight rows against the 8 rows of
x staged once per CTA, the splits over K added in a fixed order by the last CTA of
each tile), the fp32 router as cute.linear_splitk's CUDA-core stream
(gemv_splitk.py); all launched with programmatic dependent launch.

Numerics as cute.linear's: the same products (exact in fp32) accumulated in fp32 in
another order (in the tensor cores over the CTA's chunk, then the splits in split
order), rounded once to the output dtype; results are identical from run to run.
Not registered until its GPU test passes (tests/test_gpu_cute_linear_tma.py); the
streams bench takes it by import path
(``--linear-provider sparkdecode_cute.linear_tma:CuteLinearTma``).
"""

from __future__ import annotations

from typing import Any

import torch

from sparkdecode.protocols import BuildContext

from .common import compiled, pointer
from .linear import VECTOR_BYTES, weight_fp32
from .linear_mma import CuteLinearMma
from .linear_splitk import X_VECTOR, SplitKWeight


class TmaWeight(SplitKWeight):
    """One bf16 weight's compiled TMA kernel, its pointer and the shared workspace."""

    provider = "cute.linear_tma"

    def __init__(self, name: str, w: torch.Tensor, max_rows: int, sms: int, plan: Any = None):
        """``plan`` (a ``TmaPlan`` of ``w``'s shape) in place of the planner's."""
        from . import gemv_tma

        if weight_fp32(name, w):
            raise ValueError(f"{self.provider}: {name} is fp32; the TMA kernel takes bf16 weights")
        if plan is None:
            plan = gemv_tma.plan_tma(w.shape[0], w.shape[1], max_rows, w.stride(0), sms)
        if isinstance(plan, str):
            raise ValueError(f"{self.provider}: {name} {tuple(w.shape)}: {plan}")
        self.name, self.plan, self.w = name, plan, w
        self.vector = X_VECTOR
        self.out_dtype = w.dtype
        self.kernel = compiled(("gemv_tma", plan), lambda: gemv_tma.compile_tma(plan))
        self.w_ptr = pointer(w, VECTOR_BYTES)  # TMA's global address: 16-byte aligned
        self.buffers = ()  # share() sets the workspace and the counters


class CuteLinearTma(CuteLinearMma):
    """Sub-op ``linear``: the bf16 weights on the TMA + WGMMA GEMV, the fp32 router on
    the split-K CUDA-core GEMV; workspace and counters shared as cute.linear_splitk's."""

    name = "cute.linear_tma"
    bf16_weight = TmaWeight

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CuteLinearTma:
        assert layer is not None
        return cls(ctx, layer)
