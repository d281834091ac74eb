"""Sub-op ``linear`` in the CuTe DSL on Hopper's TMA and warpgroup MMA: the layer's
bf16 dense GEMMs as gemv_tma.py's weight stream (W loaded by TMA into a ring of
shared-memory buffers, ``wgmma.m64n8k16`` on 64 weight rows against the 8 rows of
x staged once per CTA, the splits over K added in a fixed order by the last CTA of
each tile), the fp32 router as cute.linear_splitk's CUDA-core stream
(gemv_splitk.py); all launched with programmatic dependent launch.

Numerics as cute.linear's: the same products (exact in fp32) accumulated in fp32 in
another order (in the tensor cores over the CTA's chunk, then the splits in split
order), rounded once to the output dtype; results are identical from run to run.
Checked on the H200 by tests/test_gpu_cute_linear_tma.py.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import compiled
from .linear_mma import CuteLinearMma, MmaWeight


class TmaWeight(MmaWeight):
    """One bf16 weight's compiled TMA kernel, its pointer and the shared workspace."""

    provider = "cute.linear_tma"
    kind = "TMA"

    @staticmethod
    def make_plan(w: torch.Tensor, fp32: bool, max_rows: int, sms: int) -> Any:
        from . import gemv_tma

        return gemv_tma.plan_tma(w.shape[0], w.shape[1], max_rows, w.stride(0), sms)

    @staticmethod
    def compile(plan: Any) -> Any:
        from . import gemv_tma

        return compiled(("gemv_tma", plan), lambda: gemv_tma.compile_tma(plan))


class CuteLinearTma(CuteLinearMma):
    """Sub-op ``linear``: the bf16 weights on the TMA + WGMMA GEMV, the fp32 router on
    the split-K CUDA-core GEMV; workspace and counters shared as cute.linear_splitk's."""

    name = "cute.linear_tma"
    bf16_weight = TmaWeight
