"""The pack's plug-in module (entry point `sparkdecode.providers`: cuda).

It registers only providers that are done and tested against the reference; the
table in this pack's README lists them.
"""

from sparkdecode.plugins import hookimpl

from .all_reduce import CudaAllReduce
from .attention import CudaAttention
from .attention_core import CudaAttentionCore
from .boundary import CudaAttentionBoundary, CudaBoundary, CudaFinal
from .experts import (
    CudaExperts,
    CudaExpertsNvfp4,
    CudaExpertsNvfp4Marlin,
    CudaExpertsNvfp4MarlinV2,
    CudaExpertsNvfp4MarlinV3,
    CudaExpertsNvfp4MarlinV3Half,
    CudaExpertsNvfp4MarlinV3Half4,
    CudaExpertsNvfp4MarlinV3Half4Early,
    CudaExpertsNvfp4MarlinV3Half4Lean,
    CudaExpertsNvfp4MarlinV3Half4ScatterUp,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNa,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpare,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2,
    CudaExpertsNvfp4MarlinV3Occ,
    CudaExpertsNvfp4MarlinV3Ring,
    CudaExpertsNvfp4MarlinV3Slice,
    CudaExpertsNvfp4V2,
    CudaExpertsSlice2,
)
from .experts_bulk import CudaExpertsNvfp4MarlinBulk
from .linear import CudaLinear
from .markov import CudaMarkov
from .moe import CudaMoE

PROVIDERS: tuple[type, ...] = (
    CudaBoundary,
    CudaAttention,
    CudaAttentionCore,
    CudaAttentionBoundary,
    CudaMoE,
    CudaExperts,
    CudaExpertsNvfp4,
    CudaExpertsNvfp4Marlin,
    CudaExpertsNvfp4V2,
    CudaExpertsNvfp4MarlinV2,
    CudaExpertsNvfp4MarlinV3,
    CudaExpertsNvfp4MarlinV3Occ,
    CudaExpertsNvfp4MarlinV3Ring,
    CudaExpertsNvfp4MarlinV3Slice,
    CudaExpertsNvfp4MarlinV3Half,
    CudaExpertsNvfp4MarlinV3Half4,
    CudaExpertsNvfp4MarlinV3Half4Lean,
    CudaExpertsNvfp4MarlinV3Half4Early,
    CudaExpertsNvfp4MarlinV3Half4ScatterUp,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNa,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpare,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry,
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2,
    CudaExpertsSlice2,
    CudaExpertsNvfp4MarlinBulk,
    CudaLinear,
    CudaFinal,
    CudaAllReduce,
    CudaMarkov,
)


@hookimpl
def sparkdecode_providers() -> tuple[type, ...]:
    return PROVIDERS
