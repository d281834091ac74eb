"""The gate's draft requirements: whether the specialized draft step can serve a
deployment's DSpark draft.

Plain values only, named after vLLM 0.33's config fields, so the vLLM integration
passes them straight from its configs and the CLI or a test from anywhere:

| parameter | vLLM field |
| --- | --- |
| ``method`` | ``speculative_config.method`` |
| ``draft_sample_method`` | ``speculative_config.draft_sample_method`` |
| ``sample_from_anchor`` | the draft ``hf_config.sample_from_anchor`` (vLLM's default True) |
| ``draft_vocab_size``, ``vocab_size`` | the draft ``hf_config``'s (``draft_vocab_size`` None: the full vocabulary) |
| ``dspark_draft_topk`` | ``speculative_config.dspark_draft_topk`` or the draft ``hf_config``'s |
| ``head_dtype`` | ``model_config.head_dtype`` (the dtype of vLLM's draft-logits buffer) |
| ``use_fp64_gumbel`` | ``model_config.use_fp64_gumbel`` |

Each unmet requirement is one sentence saying what was found and what the draft
step needs.
"""

from __future__ import annotations

from typing import Any


def draft_requirements(
    *,
    method: str | None,
    draft_sample_method: str | None,
    sample_from_anchor: bool | None = True,
    draft_vocab_size: int | None = None,
    vocab_size: int | None = None,
    dspark_draft_topk: int | None = None,
    head_dtype: Any = "bfloat16",
    use_fp64_gumbel: bool = False,
) -> list[str]:
    """Every unmet draft requirement, one sentence each (empty: supported)."""
    out: list[str] = []
    if method != "dspark":
        out.append(f"The speculative method is {method!r}: the specialized draft step runs a DSpark draft ('dspark').")
    if draft_sample_method != "probabilistic":
        out.append(
            f"The draft sampling method is {draft_sample_method!r}: the fused Markov loop samples each draft "
            "token from its distribution (draft_sample_method 'probabilistic')."
        )
    if sample_from_anchor is False:
        out.append(
            "The draft does not sample from its anchor (sample_from_anchor false): the draft step takes the "
            "anchor-first block of 7 query rows, where the anchor's row predicts the first draft token."
        )
    if draft_vocab_size is not None and vocab_size is not None and draft_vocab_size != vocab_size:
        out.append(
            f"The draft vocabulary is reduced ({draft_vocab_size} of {vocab_size} tokens): the draft step samples "
            "over the full vocabulary (draft_vocab_size equal to vocab_size)."
        )
    if dspark_draft_topk is not None:
        out.append(
            f"The draft samples from its top {dspark_draft_topk} candidates (dspark_draft_topk): the fused Markov "
            "loop biases and samples the full vocabulary (dspark_draft_topk unset)."
        )
    if str(head_dtype).removeprefix("torch.") not in ("bfloat16", "bf16"):
        out.append(
            f"The draft logits are {head_dtype} (head_dtype): the Markov loop hands the rejection sampler bf16 logits."
        )
    if use_fp64_gumbel:
        out.append("Gumbel sampling is in fp64 (use_fp64_gumbel): the Markov loop draws fp32 Gumbel noise.")
    return out


def draft_unsupported(**values: Any) -> str | None:
    """The first unmet draft requirement (``draft_requirements``), or None."""
    reasons = draft_requirements(**values)
    return reasons[0] if reasons else None
