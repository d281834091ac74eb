"""cuda.attention_read_ahead (not registered) on a Hopper GPU (marker gpu): its o_proj read
into L2 on a side stream beside the attention core writes nothing a result depends on, so
the whole step, captured in a CUDA graph with the fork and join and replayed, gives the
bits of the same step with cuda.attention (every kind pinned, so only the block differs)."""

from __future__ import annotations

import pytest
import torch

from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.harness import DecodeHarness
from sparkdecode.plugins import discover
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]

attention = pytest.importorskip("sparkdecode_cuda.attention")

# Every other kind pinned (the reference's, which take every shape), so the two
# executors differ in the attention block alone.
PINS = {
    kind: f"reference.{kind}"
    for kind in ("boundary", "attention_boundary", "moe", "final", "attention_core", "linear", "experts")
}


def _steps(weights, block: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    registry = discover().adding([attention.CudaAttentionReadAhead])
    config = DecodeConfig(max_context=1024, pins={**PINS, "attention": block})
    executor = SpecializedDecode(weights, config, registry=registry)
    assert executor.layout.choices["attention"].chosen.name == block
    harness = DecodeHarness(ReferenceModel(weights, 1024), executor, max_prompt=70, graph=True)
    harness.prefill(torch.randint(0, weights.spec.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).cuda())
    out = []
    for _ in range(steps):
        r = harness.verify()
        out.append((r.executor_hidden.clone(), r.executor_logits.clone()))
    return out


def test_read_ahead_changes_no_bit():
    spec = ModelSpec.preset("tiny", 2)
    weights = random_weights(spec, seed=4, device="cuda")
    plain = _steps(weights, "cuda.attention", 4)
    read_ahead = _steps(weights, attention.CudaAttentionReadAhead.name, 4)
    for (h0, l0), (h1, l1) in zip(plain, read_ahead):
        assert torch.equal(h0, h1) and torch.equal(l0, l1)


def test_read_ahead_covers_the_o_proj():
    spec = ModelSpec.preset("muse-spark-open", 1)
    from sparkdecode.weights import Sharding

    weights = random_weights(spec, seed=1, device="cuda", sharding=Sharding(8, 0, "tp"))
    registry = discover().adding([attention.CudaAttentionReadAhead])
    config = DecodeConfig(max_context=256, pins={**PINS, "attention": attention.CudaAttentionReadAhead.name})
    block = SpecializedDecode(weights, config, registry=registry).layers[0].attention
    assert block.read_ahead.nbytes == weights.layers[0].o_proj.numel() * 2 == 8192 * 1024 * 2
