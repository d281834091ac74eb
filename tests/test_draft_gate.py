"""The gate's draft requirements: one sentence per unmet requirement, over the
plain values vLLM's configs hold."""

from __future__ import annotations

import pytest
import torch

from sparkdecode.draft.gate import draft_requirements, draft_unsupported

SERVED = dict(
    method="dspark",
    draft_sample_method="probabilistic",
    sample_from_anchor=True,
    draft_vocab_size=202048,
    vocab_size=202048,
    dspark_draft_topk=None,
    head_dtype=torch.bfloat16,
    use_fp64_gumbel=False,
)


def test_the_served_draft_passes():
    assert draft_requirements(**SERVED) == []
    assert draft_unsupported(**SERVED) is None
    # vLLM's defaults where a field is unset: sample_from_anchor True, draft_vocab_size None.
    assert draft_unsupported(method="dspark", draft_sample_method="probabilistic", draft_vocab_size=None) is None
    assert draft_unsupported(**{**SERVED, "head_dtype": "bfloat16"}) is None


@pytest.mark.parametrize(
    "change, sentence",
    [
        ({"method": "eagle3"}, "The speculative method is 'eagle3': the specialized draft step runs a DSpark draft"),
        ({"method": None}, "The speculative method is None"),
        ({"draft_sample_method": "greedy"}, "The draft sampling method is 'greedy'"),
        ({"sample_from_anchor": False}, "The draft does not sample from its anchor (sample_from_anchor false)"),
        ({"draft_vocab_size": 32000}, "The draft vocabulary is reduced (32000 of 202048 tokens)"),
        ({"dspark_draft_topk": 64}, "The draft samples from its top 64 candidates (dspark_draft_topk)"),
        ({"head_dtype": torch.float32}, "The draft logits are torch.float32 (head_dtype)"),
        ({"use_fp64_gumbel": True}, "Gumbel sampling is in fp64 (use_fp64_gumbel)"),
    ],
)
def test_each_requirement_fails_with_its_sentence(change, sentence):
    reasons = draft_requirements(**{**SERVED, **change})
    assert len(reasons) == 1
    assert reasons[0].startswith(sentence)
    assert reasons[0].endswith(".")
    assert draft_unsupported(**{**SERVED, **change}) == reasons[0]


def test_every_failure_is_listed_in_order():
    reasons = draft_requirements(
        method="mtp",
        draft_sample_method="greedy",
        sample_from_anchor=False,
        draft_vocab_size=1000,
        vocab_size=2000,
        dspark_draft_topk=8,
    )
    assert [r.split(" ")[1] for r in reasons] == ["speculative", "draft", "draft", "draft", "draft"]
    assert len(reasons) == 5
