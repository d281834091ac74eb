"""Sub-op ``linear`` in the CuTe DSL on the tensor cores: the layer's bf16 dense
GEMMs as gemv_mma.py's weight stream (``mma.sync.m16n8k16``, x staged once per CTA
in shared memory as the B operand, the splits over K added in a fixed order by the
last CTA of each tile), the fp32 router as cute.linear_splitk's CUDA-core stream
(gemv_splitk.py, which beats cuBLAS on it); all launched with programmatic
dependent launch.

Numerics as cute.linear's: the same products (exact in fp32) accumulated in fp32 in
another order (per MMA, over a warp's K, the warps, then the splits in split
order), rounded once to the output dtype; results are identical from run to run.
Checked on the H200 by tests/test_gpu_cute_linear_mma.py.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import compiled
from .linear import weight_fp32
from .linear_splitk import CuteLinearSplitK, SplitKWeight


class MmaWeight(SplitKWeight):
    """One bf16 weight's compiled MMA kernel, its pointer and the shared workspace."""

    provider = "cute.linear_mma"
    kind = "MMA"  # in error messages

    def __init__(self, name: str, w: torch.Tensor, max_rows: int, sms: int, plan: Any = None):
        """``plan`` (a plan of ``w``'s shape for this kernel) in place of the planner's."""
        if weight_fp32(name, w):
            raise ValueError(f"{self.provider}: {name} is fp32; the {self.kind} kernel takes bf16 weights")
        super().__init__(name, w, max_rows, sms, plan)

    @staticmethod
    def make_plan(w: torch.Tensor, fp32: bool, max_rows: int, sms: int) -> Any:
        from . import gemv_mma

        return gemv_mma.plan_mma(w.shape[0], w.shape[1], max_rows, w.stride(0), sms)

    @staticmethod
    def compile(plan: Any) -> Any:
        from . import gemv_mma

        return compiled(("gemv_mma", plan), lambda: gemv_mma.compile_mma(plan))


class CuteLinearMma(CuteLinearSplitK):
    """Sub-op ``linear``: the bf16 weights on the tensor-core GEMV, the fp32 router on
    the split-K CUDA-core GEMV; workspace and counters shared as cute.linear_splitk's."""

    name = "cute.linear_mma"
    bf16_weight = MmaWeight
