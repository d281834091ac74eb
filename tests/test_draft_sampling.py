"""The Markov bias and the draft's sampling against an independent formulation.

The brute force re-derives vLLM's noise in pure Python integers (MurmurHash3 as
``gumbel.py`` writes it, uint32 by masking) and float64 logarithms, the Markov
bias as a float64 dot product per token, and samples by an explicit argmax; the
model's vectorized int64 / fp32 torch path must give the same hashes, the same
uniforms bit for bit, noise within fp32 rounding, logits within one bf16 rounding
and the same tokens. Gumbel-max must sample softmax(l / T): checked by frequency
over many seeds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparkdecode.draft import functional as dfn
from sparkdecode.draft import model
from sparkdecode.draft.spec import DraftSpec
from sparkdecode.draft.weights import random_draft_weights
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import ModelWeights

M = 0xFFFFFFFF


def _rotl(v: int, s: int) -> int:
    return ((v << s) | (v >> (32 - s))) & M


def _mix(h: int, k: int) -> int:
    k = (k * 0xCC9E2D51) & M
    k = _rotl(k, 15)
    k = (k * 0x1B873593) & M
    h ^= k
    h = _rotl(h, 13)
    return (h * 5 + 0xE6546B64) & M


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def brute_hash(seed: int, pos: int, offset: int, domain: int = 0) -> int:
    """vLLM's murmur3_hash32 over Python ints (seed and pos int64, offset uint32)."""
    h = 0 ^ domain
    h = _mix(h, seed & M)
    h = _mix(h, (seed >> 32) & M)
    h = _mix(h, pos & M)
    h = _mix(h, offset & M)
    return _fmix(h ^ 16)


def brute_uniform(r: int) -> float:
    """(r + 0.5) * 2^-32, its two exact halves summed once in fp32."""
    return float(np.float32(np.float32((r >> 16) * 2.0**-16) + np.float32(((r & 0xFFFF) + 0.5) * 2.0**-32)))


def brute_gumbel(seed: int, step: int, pos: int, vocab: int) -> np.ndarray:
    """float64 -log(-log(1 - u)) of the draft's draw at (seed ^ step << 32, pos + 2^30)."""
    s = seed ^ (step << 32)
    p = pos + (1 << 30)
    return np.array([-math.log(-math.log1p(-brute_uniform(brute_hash(s, p, v)))) for v in range(vocab)])


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


@pytest.mark.parametrize("seed", [0, 1, 12345, -7, 2**62 + 3, -(2**63)])
def test_hash_and_uniform_equal_brute_force(seed):
    offsets = torch.arange(0, 4096, 37, dtype=torch.int64)
    for pos in (0, 5, 2**31 + 11, 123456789):
        got = dfn.murmur3_hash32(torch.tensor([seed]), torch.tensor([pos]), offsets)
        want = [brute_hash(seed, pos, int(o)) for o in offsets]
        assert got.tolist() == want
        u = dfn.uniform32(got)
        assert u.tolist() == [brute_uniform(r) for r in want]
        assert (u > 0).all() and (u < 1).all()


def test_uniform_extremes():
    """The top hashes round to 1.0 in fp32 (as in vLLM); the log's clamp keeps the
    noise finite there."""
    r = torch.tensor([0, 1, 0xFFFF, 0x10000, M - 1, M])
    u = dfn.uniform32(r)
    assert u.tolist() == [brute_uniform(int(x)) for x in r]
    assert u[0] == 2.0**-33 and u[-1] == 1.0
    assert torch.isfinite(-torch.log(-dfn.log1p_neg_stable(u))).all()


def test_gumbel_noise_within_fp32_rounding():
    noise = dfn.gumbel_noise(torch.tensor([99]), 3, torch.tensor([40]), torch.arange(2048))
    want = brute_gumbel(99, 3, 40, 2048)
    assert np.abs(noise.double().numpy() - want).max() < 2e-5
    # The series branch (u < 0.25) and the direct one both appear.
    u = dfn.uniform32(
        dfn.murmur3_hash32(torch.tensor([99 ^ (3 << 32)]), torch.tensor([40 + 2**30]), torch.arange(2048))
    )
    assert (u < 0.25).any() and (u >= 0.25).any()
    x = torch.linspace(1e-7, 0.9999, 20001, dtype=torch.float32)
    assert (dfn.log1p_neg_stable(x).double() - torch.log1p(-x.double())).abs().max() < 2e-6


def test_gumbel_max_samples_the_softmax():
    """20000 seeds, one draw each over 8 tokens: frequencies within 5 sigma of softmax(l / T)."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.25]]).to(torch.bfloat16)
    temperature = torch.tensor([0.8])
    seeds = torch.arange(20000, dtype=torch.int64)[:, None]
    u = dfn.uniform32(dfn.murmur3_hash32(seeds, torch.tensor([[17 + 2**30]]), torch.arange(8)[None]))
    noise = -torch.log(-dfn.log1p_neg_stable(u))
    draws = torch.argmax(logits.float() / temperature + noise, dim=-1)
    freq = torch.bincount(draws, minlength=8).double() / seeds.shape[0]
    p = torch.softmax(logits.double() / 0.8, dim=-1)[0]
    sigma = (p * (1 - p) / seeds.shape[0]).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-4).all(), (freq, p)
    q = dfn.token_probability(logits, torch.tensor([4]), temperature)
    assert q.item() == pytest.approx(p[4].item(), rel=1e-5)


def test_greedy_at_temperature_zero():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0]]).to(torch.bfloat16)
    noise = torch.tensor([[9.0, 0.0, 0.0, 9.0]])
    zero = torch.tensor([0.0])
    assert dfn.gumbel_argmax(logits, noise, zero).tolist() == [1]  # ties to the lowest id, no noise
    assert dfn.gumbel_argmax(logits, noise, torch.tensor([1.0])).tolist() == [0]
    assert dfn.token_probability(logits, torch.tensor([1]), zero).item() == 1.0


@pytest.fixture(scope="module")
def draft():
    target = target_stub(ModelSpec.preset("tiny"))
    return random_draft_weights(DraftSpec.preset("tiny"), target, seed=3)


def brute_markov(weights, base: torch.Tensor, anchor: int, positions: list[int], seed: int, temperature: float):
    """The Markov loop independently: float64 dot products per token, rounding to
    bf16 where vLLM rounds, the brute-force noise, an explicit argmax."""
    spec = weights.spec
    w1, w2 = weights.markov_w1.double(), weights.markov_w2.double()
    vocab = w2.shape[0]
    prev, tokens, rows = anchor, [], []
    for i, pos in enumerate(positions):
        bias = torch.tensor([float(torch.dot(w2[v], w1[prev])) for v in range(vocab)], dtype=torch.float64)
        summed = (base[i].double() + bias.to(torch.bfloat16).double()).to(torch.bfloat16).double()
        x = summed * spec.output_multiplier
        cap = spec.output_soft_cap_temp
        row = (cap * torch.tanh(x / cap)).to(torch.bfloat16)
        rows.append(row)
        if temperature == 0:
            prev = int(torch.argmax(row.double()))
        else:
            scores = row.double().numpy() / temperature + brute_gumbel(seed, i, pos, vocab)
            prev = int(np.argmax(scores))
        tokens.append(prev)
    return tokens, torch.stack(rows)


@pytest.mark.parametrize("seed, temperature", [(5, 1.0), (77, 0.6), (2**40 + 1, 1.3), (5, 0.0)])
def test_markov_loop_equals_brute_force(draft, seed, temperature):
    g = torch.Generator().manual_seed(seed % 1000)
    hidden = torch.randn(7, draft.spec.hidden_size, generator=g).to(torch.bfloat16)
    base = model.base_logits(draft, hidden)
    positions = list(range(300, 307))
    anchor = 17
    out = model.markov_loop(
        draft,
        hidden,
        torch.tensor([anchor]),
        torch.tensor(positions),
        torch.tensor([seed]),
        torch.tensor([temperature]),
    )
    tokens, rows = brute_markov(draft, base, anchor, positions, seed, temperature)
    assert out.tokens.tolist() == tokens
    # One bf16 rounding apart at most (float64 vs fp32 before the same rounding).
    ulp = rows.double().abs().clamp_min(2.0**-120) * 2.0**-7
    assert ((out.logits.double() - rows.double()).abs() <= ulp).all()
    want = torch.softmax(out.logits.double() / temperature, dim=-1).gather(1, out.tokens[:, None])[:, 0]
    if temperature == 0:
        assert out.probs.tolist() == [1.0] * 7
    else:
        assert torch.allclose(out.probs.double(), want, rtol=1e-5)
    # The bias depends on the previous token: a different anchor changes the first row.
    other = model.markov_loop(
        draft, hidden, torch.tensor([anchor + 1]), torch.tensor(positions), torch.tensor([seed]), torch.tensor([1.0])
    )
    assert not torch.equal(other.logits[0], out.logits[0])
