"""The reference math against independent formulations (dense, fp64, brute force)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkdecode.reference import functional as fn
from sparkdecode.reference.kvcache import BLOCK_SIZE, PagedKVCache
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import deinterleave_qk_rows, interleave_qk_rows, random_weights


def brute_force_route(logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float):
    ids, weights = [], []
    for row in logits.tolist():
        p = [1 / (1 + math.exp(-z)) for z in row]
        score = [pi + bi for pi, bi in zip(p, bias.tolist())]
        # Highest score first, the lowest index among equals.
        chosen = sorted(range(len(row)), key=lambda e: (-score[e], e))[:k]
        total = sum(p[e] for e in chosen)
        ids.append(chosen)
        weights.append([p[e] * scaling / (total + 1e-15) for e in chosen])
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float64)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 8),
    st.sampled_from([(16, 4), (32, 8), (256, 8)]),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_routing_ties_go_to_the_lowest_index(rows, shape, seed, coarse):
    experts, k = shape
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, experts, generator=g)
    if coarse:  # few distinct values: many exact ties in p + bias
        logits = torch.round(logits * 2) / 2
    bias = torch.zeros(experts) if coarse else torch.randn(experts, generator=g) * 0.01
    ids, weights = fn.route(logits, bias, k, 1.0)
    ref_ids, ref_weights = brute_force_route(logits, bias, k, 1.0)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-6, atol=1e-7)


def test_norm_conventions():
    x = torch.randn(3, 64)
    w = torch.randn(64).to(torch.bfloat16)
    r = x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    torch.testing.assert_close(fn.pre_norm(x, w, 1e-5), r * (1 + w.float()))
    torch.testing.assert_close(fn.final_norm(x, w, 1e-5), r * w.float())
    y = x * (1 + w.float())
    torch.testing.assert_close(fn.input_scale_norm(x, w, 1e-8), y / y.pow(2).mean(-1, keepdim=True).add(1e-8).sqrt())


def test_gate_coefficients_preserve_the_norm():
    gate = torch.linspace(-1, 1, 101)
    alpha, beta = fn.gate_coefficients(gate, 0.3)
    torch.testing.assert_close(alpha**2 + beta**2, torch.ones(101), rtol=1e-6, atol=1e-6)
    alpha, _ = fn.gate_coefficients(torch.tensor([30.0]), 0.3)
    assert alpha.item() == pytest.approx(math.sqrt(1e-3))  # the clamp


def test_rope_is_a_rotation_of_interleaved_pairs():
    d, positions = 64, torch.tensor([0, 1, 17, 2047])
    x = torch.randn(4, 3, d).to(torch.bfloat16)
    table = fn.rope_table(500000.0, d, 4096, "cpu")
    out = fn.rope_gptj(x, positions, table)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angle = positions.double()[:, None, None] * inv_freq
    pairs = torch.complex(x.double()[..., 0::2], x.double()[..., 1::2]) * torch.exp(1j * angle)
    ref = torch.stack((pairs.real, pairs.imag), dim=-1).flatten(-2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)  # one bf16 rounding
    assert torch.equal(fn.rope_gptj(x, torch.zeros(4, dtype=torch.long), table), x)


def test_qk_row_order_matches_vllm_at_load():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of head_dim 8
    vllm = w.reshape(-1, 2, 4, 3).transpose(1, 2).reshape(16, 3)
    assert torch.equal(interleave_qk_rows(w, 8), vllm)
    assert torch.equal(deinterleave_qk_rows(vllm, 8), w)
    # Head 0's rows after the re-order: even/odd halves interleaved into pairs.
    assert interleave_qk_rows(w, 8)[:, 0].tolist()[:8] == [0, 12, 3, 15, 6, 18, 9, 21]


def test_kv_insert_skips_padding_rows():
    """Rows with a negative slot (vLLM's PAD_SLOT_ID) write nothing, whatever the
    cache's strides; the other rows land at their slots."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(5, BLOCK_SIZE, 2, 2, 8, generator=g).to(torch.bfloat16)  # [pages, slots, Hkv, (k|v), d]
    k_cache, v_cache = cache[:, :, :, 0], cache[:, :, :, 1]
    before = cache.clone()
    slots = torch.tensor([-1, 3 * BLOCK_SIZE + 2, -1, 17, -1], dtype=torch.int64)
    k = torch.randn(5, 2, 8, generator=g).to(torch.bfloat16)
    v = torch.randn(5, 2, 8, generator=g).to(torch.bfloat16)
    fn.kv_insert(k_cache, v_cache, slots, k, v)
    expected = before.clone()
    for row, slot in ((1, 3 * BLOCK_SIZE + 2), (3, 17)):
        expected[slot // BLOCK_SIZE, slot % BLOCK_SIZE, :, 0] = k[row]
        expected[slot // BLOCK_SIZE, slot % BLOCK_SIZE, :, 1] = v[row]
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("window", [None, 24])
def test_paged_attention_equals_dense_attention(window):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d, context, rows = 8, 2, 64, 80, 8
    pages = context // BLOCK_SIZE + 2
    order = torch.randperm(pages - 1, generator=g) + 1  # scattered pages; page 0 unused
    k_all = torch.randn(context, kv_heads, d, generator=g).to(torch.bfloat16)
    v_all = torch.randn(context, kv_heads, d, generator=g).to(torch.bfloat16)
    k_cache = torch.full((pages, BLOCK_SIZE, kv_heads, d), float("nan"), dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    table = order.to(torch.int32)
    for p in range(context):
        k_cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = k_all[p]
        v_cache[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = v_all[p]
    positions = torch.arange(context - rows, context)
    q = torch.randn(rows, heads, d, generator=g).to(torch.bfloat16)
    out = fn.paged_attention(q, positions, k_cache, v_cache, table, window, 0.7, 256)
    kk = k_all.double().repeat_interleave(heads // kv_heads, dim=1)
    vv = v_all.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("bhd,nhd->bhn", q.double(), kk) * 0.7
    kpos = torch.arange(context)
    mask = kpos[None] <= positions[:, None]
    if window is not None:
        mask &= kpos[None] > positions[:, None] - window
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    ref = torch.einsum("bhn,nhd->bhd", scores.softmax(-1), vv)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=1e-2)  # bf16 output


def test_expert_rows_equal_per_route_dense_math():
    g = torch.Generator().manual_seed(1)
    E, P, I, b, k = 6, 32, 48, 5, 3
    w13 = torch.randn(E, 2 * I, P, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, P, I, generator=g).to(torch.bfloat16)
    h = torch.randn(b, P, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (b, k), generator=g, dtype=torch.int32)
    rows = fn.expert_rows(h, ids, w13, w2)
    for r in range(b):
        for j in range(k):
            e = int(ids[r, j])
            gu = h[r].double() @ w13[e].double().T
            ref = (torch.nn.functional.silu(gu[:I]) * gu[I:]) @ w2[e].double().T
            torch.testing.assert_close(rows[r, j].double(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
    # EP: experts outside this rank's range give zero rows.
    half = fn.expert_rows(h, ids, w13[3:], w2[3:], first_expert=3)
    held = (ids >= 3)[..., None]
    assert torch.equal(torch.where(held, rows, 0), half)


def test_softcap():
    x = torch.tensor([0.0, 100.0, -1e4]).to(torch.bfloat16)
    out = fn.softcap_logits(x, 2**-2.5, 20.0)
    torch.testing.assert_close(out, 20 * torch.tanh(x.float() * 2**-2.5 / 20))
    assert out.abs().max() <= 20


def test_activations_stay_order_one_through_62_layers():
    spec = ModelSpec.preset("tiny", 62)
    weights = random_weights(spec, seed=3)
    model = ReferenceModel(weights, 256)
    cache = PagedKVCache(spec, 20, 256, 16)
    hidden, aux = model.step(cache, torch.arange(16), 0, aux_layers=tuple(range(0, 63, 10)))
    for stream in aux:
        rms = stream.pow(2).mean(-1).sqrt()
        assert torch.isfinite(rms).all() and (rms > 0.3).all() and (rms < 3).all()
    logits = model.logits(hidden)
    assert torch.isfinite(logits).all() and logits.std() > 0.05


def test_decode_after_prefill_matches_one_long_prefill():
    """The paged cache and positions: 8 tokens decoded after a prefill give the hidden
    states of one prefill of the whole sequence. GEMMs of other row counts round
    differently, so this is a bound, not bits: bf16 ulp flips grow layer by layer and
    one flipped routing choice moves a row by tens of percent, hence two layers (one
    sliding, one full) and a 1e-2 bound (measured 5e-3)."""
    spec = ModelSpec.preset("tiny", 2)
    weights = random_weights(spec, seed=4)
    model = ReferenceModel(weights, 512)
    tokens = torch.randint(0, spec.vocab_size, (88,), generator=torch.Generator().manual_seed(0))
    whole = PagedKVCache(spec, 40, 512, 128)
    full, _ = model.step(whole, tokens, 0)
    parts = PagedKVCache(spec, 40, 512, 128)
    model.step(parts, tokens[:80], 0)
    tail, _ = model.step(parts, tokens[80:], 80)
    err = (tail.float() - full[80:].float()).norm() / full[80:].float().norm()
    assert err < 1e-2


def test_released_pages_are_never_read():
    """Sliding pages leave the window and go back poisoned (NaN), as does the null
    page: the outputs are the same bits as with clean pages."""
    spec = ModelSpec.preset("tiny")
    weights = random_weights(spec, seed=5)
    model = ReferenceModel(weights, 512)
    clean = PagedKVCache(spec, 40, 512, 200)
    dirty = PagedKVCache(spec, 40, 512, 200, poison_released=True)
    dirty.poison_null_page()
    tokens = torch.randint(0, spec.vocab_size, (200,), generator=torch.Generator().manual_seed(1))
    model.step(clean, tokens[:150], 0)
    model.step(dirty, tokens[:150], 0)
    for first in range(150, 190, 8):
        a, _ = model.step(clean, tokens[first : first + 8], first)
        b, _ = model.step(dirty, tokens[first : first + 8], first)
        assert torch.equal(a, b)
    sliding = dirty.groups[dirty.layer_group[0]]
    assert sliding.window == spec.sliding_window
    assert sliding.pages[: (190 - spec.sliding_window) // BLOCK_SIZE - 1].count(0) > 0  # pages were released
