"""The draft executor with the reference providers against the reference draft step.

Bound: bit for bit (tokens, bf16 logits, probabilities, the draft cache's pages).
On the CPU both sides run the same functions in the same order on the same random
numbers (vLLM's hash of the request's seed, step and position), so any difference
is the executor's: its buffers, its step layout (8 context rows, the rows past the
accepted ones storing nothing into the null page), its Markov provider's loop, or
the order it runs the blocks in.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from sparkdecode.deployment import DeploymentError
from sparkdecode.draft.executor import DraftConfig, DraftDecode
from sparkdecode.draft.harness import DraftHarness
from sparkdecode.draft.model import ReferenceDraft
from sparkdecode.draft.providers import DRAFT_PROVIDERS, ReferenceMarkov
from sparkdecode.draft.spec import DraftSpec
from sparkdecode.draft.weights import random_draft_weights
from sparkdecode.layout import LayoutError, needed_kinds, resolve
from sparkdecode.plugins import Registered, Registry, discover
from sparkdecode.protocols import DRAFT_KINDS, KINDS, Deployment
from sparkdecode.reference.kvcache import NULL_PAGE
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import ModelWeights, random_weights

MAX_CONTEXT = 320
TARGET = ModelSpec.preset("tiny")


def target_stub(spec: ModelSpec, seed: int = 0) -> ModelWeights:
    """The target tensors a draft reads (embedding, LM head), no layers."""
    g = torch.Generator().manual_seed(seed)
    return ModelWeights(
        spec=spec,
        embed=torch.randn(spec.vocab_size, spec.hidden_size, generator=g).to(torch.bfloat16),
        layers=[],
        final_norm=torch.ones(spec.hidden_size, dtype=torch.bfloat16),
        lm_head=(torch.randn(spec.vocab_size, spec.hidden_size, generator=g) * spec.hidden_size**-0.5).to(
            torch.bfloat16
        ),
    )


@pytest.fixture(scope="module")
def target() -> ModelWeights:
    return target_stub(TARGET)


@pytest.fixture(scope="module")
def weights(target):
    return random_draft_weights(DraftSpec.preset("tiny"), target, seed=10)


def make_harness(
    weights, prompt_len=40, seed=0, temperature=1.0, target_model=None, registry=None, max_context=MAX_CONTEXT
) -> DraftHarness:
    executor = DraftDecode(weights, DraftConfig(max_context=max_context), registry=registry)
    harness = DraftHarness(
        ReferenceDraft(weights, max_context),
        executor,
        max_prompt=prompt_len,
        target=target_model,
        seed=seed,
        temperature=temperature,
        request_seed=1000 + seed,
    )
    prompt = torch.randint(0, weights.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    harness.prefill(prompt)
    return harness


def assert_same(result) -> None:
    assert torch.equal(result.reference.tokens, result.executor.tokens)
    assert torch.equal(result.reference.logits, result.executor.logits)
    assert torch.equal(result.reference.probs, result.executor.probs)
    assert torch.isfinite(result.reference.logits.float()).all()
    assert ((result.reference.probs > 0) & (result.reference.probs <= 1)).all()


def assert_same_caches(harness: DraftHarness) -> None:
    """Every page but the null page (where both sides' rows that store nothing go),
    bit for bit (released pages hold NaN)."""
    for a, b in zip(harness.reference_cache.kv(), harness.executor_cache.kv()):
        keep = torch.arange(a.k.shape[0]) != NULL_PAGE
        for x, y in ((a.k, b.k), (a.v, b.v)):
            assert torch.equal(x[keep].view(torch.int16), y[keep].view(torch.int16))


@pytest.mark.parametrize("seed, prompt_len", [(0, 5), (1, 58), (2, 130)])
def test_bitwise_equal_to_reference(weights, seed, prompt_len):
    """Contexts below and above the sliding layer's window (64), steps crossing page
    (16) and window edges with random acceptance, released pages and the null page
    poisoned, the rejected context rows NaN; seeds vary the prompt, the acceptance
    and the request's sampling seed."""
    harness = make_harness(weights, prompt_len=prompt_len, seed=seed)
    pages = set()
    for _ in range(5):
        result = harness.step()
        assert_same(result)
        pages.add(result.host.anchor_position // 16)
        harness.verify(result)
    assert_same_caches(harness)
    assert len(pages) > 1


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_temperatures(weights, temperature):
    harness = make_harness(weights, prompt_len=30, seed=4, temperature=temperature)
    for _ in range(2):
        result = harness.step()
        assert_same(result)
        if temperature == 0:
            assert result.reference.probs.tolist() == [1.0] * 7
        harness.verify(result, accepted=8)


def test_seeds_change_the_draw_not_the_logits(weights):
    a = make_harness(weights, prompt_len=20, seed=6)
    b = make_harness(weights, prompt_len=20, seed=6)
    b.seed.fill_(987654321)
    ra, rb = a.step(), b.step()
    assert_same(ra)
    assert_same(rb)
    assert torch.equal(ra.reference.logits[0], rb.reference.logits[0])  # the first row precedes any draw
    assert not torch.equal(ra.reference.tokens, rb.reference.tokens)


VARIANTS = {
    "bf16 stream, plain sums, plain norms": dict(
        residual_dtype="bf16",
        use_residual_gate=False,
        norm_zero_centered_gamma=False,
        post_norm_affine=True,
        use_ffn_learnable_scales=False,
    ),
    "o-gate only, bf16 RoPE tables, tuned global layer": dict(
        use_attn_o_norm=False,
        rope_use_fp32_in_outer_product=False,
        attn_temperature_tuning_floor_scale=8.0,
        attn_temperature_tuning_q_scale_constant=0.2,
        attn_temperature_tuning_layers="global",
    ),
    "NoPE, o-norm only, sqrt scaling, no soft cap, muP": dict(
        use_rope=False,
        use_attn_o_gate=False,
        use_sqrt_attn_scaling=True,
        output_soft_cap_temp=None,
        metap={"use_metap": True, "metap_mode": "mup", "base_width": 256},
    ),
    "three sliding layers of 16, residual-index gain centres": dict(
        num_hidden_layers=3,
        global_attn_cfg=[16],
        post_norm_gain_center_type="inverse_residual_index",
        post_norm_affine=True,
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants(target, variant):
    config = DraftSpec.preset("tiny").to_config()
    config.update(VARIANTS[variant])
    spec = DraftSpec.from_config(config, TARGET)
    weights = random_draft_weights(spec, target, seed=7)
    harness = make_harness(weights, prompt_len=50, seed=7)
    for _ in range(2):
        result = harness.step()
        assert_same(result)
        harness.verify(result)
    assert_same_caches(harness)


def test_with_the_stock_target_forward():
    """The aux streams come from the target's stock forward (its prefill and verify
    steps) and the anchors from its greedy tokens."""
    spec = ModelSpec.preset("tiny", num_layers=1)
    target_weights = random_weights(spec, seed=3)
    weights = random_draft_weights(DraftSpec.preset("tiny", target=spec), target_weights, seed=3)
    assert weights.spec.aux_layers == (1,)  # target layer 0's output: the final stream
    harness = make_harness(weights, prompt_len=6, seed=3, target_model=ReferenceModel(target_weights, MAX_CONTEXT))
    for _ in range(2):
        result = harness.step()
        assert_same(result)
        harness.verify(result)


def test_plan_declines_what_it_does_not_take(weights, caplog):
    harness = make_harness(weights, prompt_len=10)
    executor, cache = harness.executor, harness.executor_cache
    ok = (cache.context_positions[:8], cache.positions, harness.anchor, harness.seed, harness.temperature)
    assert executor.plan(*ok) is not None
    with caplog.at_level(logging.INFO, logger="sparkdecode.draft.executor"):
        assert executor.plan(cache.context_positions[:5], *ok[1:]) is None
        assert executor.plan(ok[0], cache.positions.int(), *ok[2:]) is None
        assert executor.plan(*ok[:2], torch.zeros(1, dtype=torch.int32), *ok[3:]) is None
        assert executor.plan(*ok[:4], torch.ones(1, dtype=torch.float64)) is None
        other = cache.clone()
        assert executor.plan(*ok, kv=other.kv()) is None
    assert "not a layout of 8 context and 7 query rows" in caplog.text
    assert "sampling inputs not in device buffers" in caplog.text
    assert "another than the bound one" not in caplog.text and "other than the bound one" in caplog.text
    fresh = DraftDecode(weights, DraftConfig(max_context=MAX_CONTEXT))
    assert fresh.plan(*ok) is None


def test_executor_refuses_what_the_draft_step_does_not_serve(target):
    config = DraftSpec.preset("tiny").to_config()
    config["sample_from_anchor"] = False
    weights = random_draft_weights(DraftSpec.from_config(config, TARGET), target, seed=1)
    with pytest.raises(DeploymentError, match="sample_from_anchor"):
        DraftDecode(weights, DraftConfig(max_context=MAX_CONTEXT))
    with pytest.raises(ValueError, match="sample_from_anchor"):
        ReferenceDraft(weights, MAX_CONTEXT)
    good = random_draft_weights(DraftSpec.preset("tiny"), target, seed=1)
    with pytest.raises(DeploymentError, match="drafted tokens"):
        DraftDecode(good, DraftConfig(num_query=5, max_context=MAX_CONTEXT))
    good.d2t[3] = 1
    with pytest.raises(DeploymentError, match="d2t"):
        DraftDecode(good, DraftConfig(max_context=MAX_CONTEXT))


# The draft's layout over the shared registry.


def test_target_layout_ignores_the_draft_kinds():
    registry = discover()
    assert {p.block for p in registry.providers} >= set(DRAFT_KINDS)
    deployment = Deployment(spec=TARGET)
    assert not set(needed_kinds(deployment)) & set(DRAFT_KINDS)
    layout = resolve(registry, deployment, pins={"markov": "reference.markov"})
    assert set(layout.classes()) == set(needed_kinds(deployment)) and set(KINDS) >= set(layout.classes())


def test_draft_layout_priority_and_pins(weights):
    class FastMarkov(ReferenceMarkov):
        name = "fast.markov"
        priority = 10
        runs = 0

        def run(self, *args):
            FastMarkov.runs += 1
            super().run(*args)

    registry = Registry(
        [Registered(cls, "reference", "sparkdecode", "0") for cls in DRAFT_PROVIDERS]
        + [Registered(FastMarkov, "fast", "fast", "1")]
    )
    executor = DraftDecode(weights, DraftConfig(max_context=MAX_CONTEXT), registry=registry)
    assert executor.layout.provider("markov") is FastMarkov
    assert set(executor.layout.classes()) == set(DRAFT_KINDS)
    harness = make_harness(weights, prompt_len=8, registry=registry)
    assert_same(harness.step())
    assert FastMarkov.runs == 1
    pinned = DraftDecode(
        weights,
        DraftConfig(max_context=MAX_CONTEXT, pins={"markov": "reference.markov", "moe": "reference.moe"}),
        registry=registry,
    )
    assert pinned.layout.provider("markov") is ReferenceMarkov
    with pytest.raises(LayoutError, match="nope.markov"):
        DraftDecode(weights, DraftConfig(max_context=MAX_CONTEXT, pins={"markov": "nope.markov"}), registry=registry)
    missing = Registry([Registered(cls, "reference", "sparkdecode", "0") for cls in DRAFT_PROVIDERS[:-1]])
    with pytest.raises(LayoutError, match="markov"):
        DraftDecode(weights, DraftConfig(max_context=MAX_CONTEXT), registry=missing)


def test_draft_layers_keep_their_own_cache_groups(target):
    spec = DraftSpec.from_config(
        {**DraftSpec.preset("tiny").to_config(), "num_hidden_layers": 3, "global_attn_cfg": [32, 0, 16]}, TARGET
    )
    assert [spec.window(i) for i in range(3)] == [None, 16, 32]  # L = 4, 5, 6: entries 1, 2, 0
    weights = random_draft_weights(spec, target, seed=9)
    harness = make_harness(weights, prompt_len=70, seed=9)
    windows = {layer.window for layer in harness.reference_cache.kv()}
    assert windows == {None, 16, 32} and len(harness.reference_cache.paged.groups) == 3
    for _ in range(2):
        result = harness.step()
        assert_same(result)
        harness.verify(result)
    with pytest.raises(ValueError, match="window"):
        bad = list(harness.executor_cache.kv())
        bad[0], bad[1] = bad[1], bad[0]
        harness.executor.prepare_kv(tuple(bad))


def test_weights_are_not_modified(target, weights):
    before = [t.clone() for t in (weights.fc, weights.markov_w2, weights.layers[0].qkv, target.embed)]
    harness = make_harness(weights, prompt_len=16)
    harness.verify(harness.step())
    harness.step()
    after = (weights.fc, weights.markov_w2, weights.layers[0].qkv, target.embed)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert weights.lm_head is target.lm_head and weights.lm_head_is_target
    assert replace(weights.spec, mask_token_id=3).mask_token_id == 3


def test_long_contexts_are_stored_eagerly_as_the_reference_stores_them(weights):
    """A prompt's context rows (more than a step's 8) go through ``store_context``,
    the reference math outside any graph."""
    harness = make_harness(weights, prompt_len=48)
    executor, cache = harness.executor, harness.executor_cache.clone()
    reference = harness.reference_cache.clone()
    aux = [
        torch.randn(40, weights.spec.target_hidden_size, generator=torch.Generator().manual_seed(i)) for i in range(3)
    ]
    for c in (cache, reference):
        c.begin_step(48, 40, 40)
    executor.store_context(aux, cache.context_positions[:40], cache.kv(), cache.context_slots(40))
    harness.draft.context(aux, reference.context_positions[:40], reference.kv(), reference.context_slots(40))
    for a, b in zip(cache.kv(), reference.kv()):
        assert torch.equal(a.k.view(torch.int16), b.k.view(torch.int16))


def test_floor_counts_every_weight_once_and_the_markov_projection_per_step(weights):
    from sparkdecode.draft.floor import draft_block_bytes, draft_step_bytes

    blocks = {b.name: b.bytes for b in draft_block_bytes(weights, context=200)}
    assert list(blocks)[0] == "draft_context" and list(blocks)[-1] == "markov"
    w2 = weights.markov_w2.numel() * 2
    assert blocks["markov"] == weights.lm_head.numel() * 2 + 7 * (w2 + weights.spec.markov_rank * 2)
    # Layer 0 slides (window 64: 70 keys seen by the block), layer 1 reads the whole context.
    kv_row = 2 * weights.spec.num_key_value_heads * weights.spec.head_dim * 2
    assert blocks["draft_attention.0"] - blocks["draft_attention.1"] == (70 - 200) * kv_row
    assert draft_step_bytes(weights, 200) == sum(blocks.values())


def test_bench_record_on_the_cpu(weights):
    """The draft step's record (on the CPU: eager, a smoke figure)."""
    from sparkdecode.draft.bench import bench_draft_step

    record = bench_draft_step(weights, context=100, name="draft-tiny", replays=2, command="draft bench, tiny")
    assert record["kind"] == "draft_step" and record["graph"] is False and record["context"] == 100
    assert record["command"] == "draft bench, tiny"
    assert set(record["layout"]) == set(DRAFT_KINDS)
    assert record["step"]["count"] == 2 and record["floor"]["bytes"] == sum(record["floor"]["blocks"].values())
    assert 0 < record["floor"]["fraction"]


def test_the_reference_step_refuses_a_draft_to_target_map(weights):
    """vLLM scatters the draft's logits to the target ids arange + d2t; the reference
    keeps the draft's ids, so a map other than the identity is refused by name."""
    d2t = weights.d2t.clone()
    d2t[3] = 1
    with pytest.raises(ValueError, match=r"identity draft-to-target map \(d2t all zeros\)"):
        ReferenceDraft(replace(weights, d2t=d2t), 256)
