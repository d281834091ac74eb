"""Sub-op ``experts`` in the CuTe DSL on the tensor cores: ``cute.experts``'s routing
and kernels with each work item's products on ``mma.sync.m16n8k16`` (bf16 in, fp32
accumulate; experts_mma_kernels.py), where ``cute.experts`` spends 8 fp32 FMAs per
weight element and row and is bound by instruction issue.

Against ``reference.experts`` (``fn.expert_rows``): the same roundings to bf16 (the
gate/up GEMM output, ``silu(gate) * up`` computed in fp32, the W2 GEMM output), each
on an fp32 sum of the same products in another order (the MMA's within a warp, then
the CTA's 8 warps in index order) and exp as ``ex2.approx``: a result moves by about
one bf16 ulp where an fp32 sum sits near a rounding boundary, which can carry through
h into the W2 sums, as between the reference and exact sums (tests/expert_check.py's
bounds). Results are identical from run to run.

Two persistent CTAs a multiprocessor, as ``cute.experts``: each of 8 warps of at most
128 registers (ptxas at sm_90a) and at most 75 KB of shared memory (the staged rows,
padded, and the warps' sums).

Correct on the H200 (tests/test_gpu_cute_experts.py), compute-sanitizer memcheck and
racecheck clean; 78% of the copy bandwidth chained on the TP8-rank expert-TP stream
(bench/NOTES.md v7).
"""

from __future__ import annotations

from typing import Any

from .experts import CuteExperts
from .experts_shape import ExpertsShape


class CuteExpertsMma(CuteExperts):
    """Sub-op ``experts`` (bf16 weights): W13 + SwiGLU, then W2, on the tensor cores."""

    block = "experts"
    name = "cute.experts_mma"

    @staticmethod
    def compile(shape: ExpertsShape) -> Any:
        from .experts_mma_kernels import compile_experts_mma

        return compile_experts_mma(shape)
