"""Sub-op ``linear`` in the CuTe DSL on the tensor cores: the layer's bf16 dense
GEMMs as gemv_mma.py's weight stream (``mma.sync.m16n8k16``, x staged once per CTA
in shared memory as the B operand, the splits over K added in a fixed order by the
last CTA of each tile), the fp32 router as cute.linear_splitk's CUDA-core stream
(gemv_splitk.py, which beats cuBLAS on it); all launched with programmatic
dependent launch.

Numerics as cute.linear's: the same products (exact in fp32) accumulated in fp32 in
another order (per MMA, over a warp's K, the warps, then the splits in split
order), rounded once to the output dtype; results are identical from run to run.
Not registered until its GPU test passes (tests/test_gpu_cute_linear_mma.py); the
streams bench takes it by import path
(``--linear-provider sparkdecode_cute.linear_mma:CuteLinearMma``).
"""

from __future__ import annotations

from typing import Any

import torch

from sparkdecode.protocols import LINEAR_WEIGHTS, BuildContext

from .common import compiled, pointer
from .linear import VECTOR_BYTES, weight_fp32
from .linear_splitk import X_VECTOR, CuteLinearSplitK, SplitKWeight


class MmaWeight(SplitKWeight):
    """One bf16 weight's compiled MMA kernel, its pointer and the shared workspace."""

    provider = "cute.linear_mma"

    def __init__(self, name: str, w: torch.Tensor, max_rows: int, sms: int, plan: Any = None):
        """``plan`` (an ``MmaPlan`` of ``w``'s shape) in place of the planner's."""
        from . import gemv_mma

        if weight_fp32(name, w):
            raise ValueError(f"{self.provider}: {name} is fp32; the MMA kernel takes bf16 weights")
        if plan is None:
            plan = gemv_mma.plan_mma(w.shape[0], w.shape[1], max_rows, w.stride(0), sms)
        if isinstance(plan, str):
            raise ValueError(f"{self.provider}: {name} {tuple(w.shape)}: {plan}")
        self.name, self.plan, self.w = name, plan, w
        self.vector = X_VECTOR
        self.out_dtype = w.dtype
        self.kernel = compiled(("gemv_mma", plan), lambda: gemv_mma.compile_mma(plan))
        self.w_ptr = pointer(w, VECTOR_BYTES)
        self.buffers = ()  # share() sets the workspace and the counters


class CuteLinearMma(CuteLinearSplitK):
    """Sub-op ``linear``: the bf16 weights on the tensor-core GEMV, the fp32 router on
    the split-K CUDA-core GEMV; workspace and counters shared as cute.linear_splitk's."""

    name = "cute.linear_mma"
    bf16_weight: type[SplitKWeight] = MmaWeight  # the bf16 weights' kernel

    def __init__(self, ctx: BuildContext, layer: int):
        lw = ctx.layer(layer)
        sms = torch.cuda.get_device_properties(lw.qkvg.device).multi_processor_count
        self.weights = {}
        for name in LINEAR_WEIGHTS:
            w = getattr(lw, name)
            cls = SplitKWeight if weight_fp32(name, w) else self.bf16_weight
            self.weights[name] = cls(name, w, ctx.max_rows, sms)
        self.share_scratch(ctx)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CuteLinearMma:
        assert layer is not None
        return cls(ctx, layer)
