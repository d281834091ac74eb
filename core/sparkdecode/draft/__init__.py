"""The Muse Spark DSpark draft: its spec, weights, reference step and specialized
draft step.

Each verify step of the target (1 + 7 tokens) is preceded by one draft step that
proposes the 7 tokens: the target's aux streams of the rows it just accepted
become the draft's context K/V (``fc``, hidden norm, each layer's K/V rows), the
anchor and 6 mask tokens run through the draft's dense Muse layers, and the LM head
and a low-rank Markov bias are sampled left to right (Gumbel-max with vLLM's
counter-based noise), handing the rejection sampler the 7 tokens and their bf16
logits. The math is vLLM 0.33's (``model`` states it with its rounding points).

| module | what |
| --- | --- |
| ``spec`` | ``DraftSpec`` from the draft's config.json (validated against the target), presets |
| ``weights`` | ``DraftWeights`` (the target's embedding and, where equal, LM head), random weights |
| ``checkpoint`` | draft checkpoints under vLLM's tensor names: save, load |
| ``functional`` | the draft's formulas beside ``reference.functional`` (norms, residuals, RoPE, noise) |
| ``model`` | the reference draft step (``ReferenceDraft``): the oracle and the fallback |
| ``kvcache`` | ``DraftCache``: the draft's paged cache and the step's metadata layout |
| ``protocols`` | the draft blocks' contracts, ``DraftStep``, ``DraftBuildContext`` |
| ``providers`` | the reference provider of every draft block |
| ``executor`` | ``DraftDecode``: the draft's layout, build, plan, run |
| ``gate`` | ``draft_requirements`` / ``draft_unsupported``: the gate's draft sentences |
| ``harness`` | the reference draft and the executor side by side over draft / verify rounds |
| ``floor`` | the bytes one draft step must read |
| ``bench`` | the draft step's time (a CUDA graph, L2 flushed) against its floor: a record |
"""

from .executor import DraftConfig, DraftDecode
from .gate import draft_requirements, draft_unsupported
from .model import DraftOutput, ReferenceDraft
from .spec import DraftSpec, DraftSpecError
from .weights import DraftWeights, random_draft_weights

__all__ = [
    "DraftConfig",
    "DraftDecode",
    "DraftOutput",
    "DraftSpec",
    "DraftSpecError",
    "DraftWeights",
    "ReferenceDraft",
    "draft_requirements",
    "draft_unsupported",
    "random_draft_weights",
]
