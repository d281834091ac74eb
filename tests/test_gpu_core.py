"""The core on a CUDA GPU: the executor against the stock forward, eagerly and in a
CUDA graph captured once and replayed over steps whose buffers change; the
resolver's measured choice. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.harness import DecodeHarness
from sparkdecode.layout import resolve
from sparkdecode.plugins import Registered, discover
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.reference.providers import ReferenceAttentionBoundary
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_CONTEXT = 1024


def harness_on_gpu(graph: bool, prompt_len: int, seed: int = 0) -> DecodeHarness:
    spec = ModelSpec.preset("tiny")
    weights = random_weights(spec, seed=seed, device="cuda")
    executor = SpecializedDecode(
        weights, DecodeConfig(max_context=MAX_CONTEXT, aux_layers=(0, 2, 4)), registry=discover().only("reference")
    )
    harness = DecodeHarness(
        ReferenceModel(weights, MAX_CONTEXT), executor, max_prompt=prompt_len, seed=seed, graph=graph
    )
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    harness.prefill(prompt.cuda())
    return harness


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("prompt_len", [5, 70])
def test_executor_equals_stock_on_gpu(graph, prompt_len):
    """One graph, captured at the first step, replayed over 24 steps that grow the
    context by 1..8 tokens, cross pages and the window, overwrite rejected slots."""
    harness = harness_on_gpu(graph, prompt_len)
    for _ in range(24):
        r = harness.verify()
        assert torch.equal(r.stock_hidden, r.executor_hidden), r.hidden_diff
        assert all(torch.equal(a, b) for a, b in zip(r.stock_aux, r.executor_aux))
        assert r.greedy_agree
    assert harness.position > prompt_len + 24
    if graph:
        assert harness.graph is not None


class SlowerBoundary(ReferenceAttentionBoundary):
    """The reference attention boundary, run twenty times: a slower candidate."""

    name = "test.slower_attention_boundary"
    priority = 5

    def run(self, partial, stream, out):
        saved = stream.clone()
        for _ in range(20):
            stream.copy_(saved)
            super().run(partial, stream, out)


def test_measured_choice_and_cache(tmp_path):
    spec = ModelSpec.preset("tiny")
    weights = random_weights(spec, device="cuda")
    registry = discover().only("reference")
    registry.providers.append(Registered(SlowerBoundary, "test", "test", "0"))
    config = DecodeConfig(max_context=MAX_CONTEXT)
    executor = SpecializedDecode(weights, config, registry=registry, cache_dir=tmp_path)
    choice = executor.layout.choices["attention_boundary"]
    assert choice.how == "measured"
    assert choice.chosen.name == "reference.attention_boundary"  # by priority it would be the slower one
    times = {c.name: c.seconds for c in choice.candidates}
    assert times["test.slower_attention_boundary"] > times["reference.attention_boundary"] > 0
    print(executor.layout.table())
    again = resolve(registry, executor.deployment, {}, measure=executor._measure, cache_dir=tmp_path)
    assert again.choices["attention_boundary"].how == "cached"
