"""One function per formula of the DSpark draft step that the target's
``reference.functional`` does not already hold.

Each states its dtypes and where it rounds; the rounding points are vLLM 0.33's
stock draft path (``models/muse_spark/common/dspark.py``, the is_draft branches of
``models/muse_spark/nvidia/model.py``, ``v1/worker/gpu/spec_decode/dspark/`` and the
Gumbel sampler ``v1/worker/gpu/sample/gumbel.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..reference import functional as fn

BF16, FP32 = fn.BF16, fn.FP32
MASK32 = 0xFFFFFFFF
# vLLM adds this to a draft's sampling position so its noise stream is disjoint
# from the target's (gumbel.py: _DRAFT_NOISE_SALT).
DRAFT_NOISE_SALT = 1 << 30


class Norm(NamedTuple):
    """One of the draft's RMS norms as vLLM's ``MuseSpark1xRMSNorm`` holds it."""

    weight: torch.Tensor | None  # bf16 [n] as stored; None: weightless
    center: float | None  # added to the weight (zero-centred gamma); None: the weight as stored
    eps: float
    input_scale: bool = False  # the weight multiplies before normalizing (RMSNormWithInputScale)


class Residual(NamedTuple):
    """A draft layer's residual connection: gated (vLLM's norm-preserving
    connection, coefficients of gate / 0.3 in fp32) or a plain sum (all None)."""

    gate: torch.Tensor | None  # bf16 [H], the raw gate as stored
    alpha: torch.Tensor | None  # fp32 [H]
    beta: torch.Tensor | None  # fp32 [H]


def norm(n: Norm, x: torch.Tensor, out_dtype: torch.dtype = BF16) -> torch.Tensor:
    """RMS norm in fp32, rounded once to ``out_dtype`` (vLLM's ``forward_native``):
    ``rms(x) * g`` or, with an input scale, ``rms(x * g)``; g = w + centre (zero-centred
    gamma) or w, in fp32; no weight: ``rms(x)``."""
    x = x.float()
    gain = None
    if n.weight is not None:
        gain = n.weight.float()
        if n.center is not None:
            gain = gain + n.center
    if n.input_scale:
        return fn.rms(x if gain is None else x * gain, n.eps).to(out_dtype)
    x = fn.rms(x, n.eps)
    return (x if gain is None else x * gain).to(out_dtype)


def residual_add(stream: torch.Tensor, branch: torch.Tensor, r: Residual) -> torch.Tensor:
    """The branch (bf16, already post-normed and rounded) into the stream, in the
    stream's dtype: ``alpha * s + beta * b`` in fp32 then rounded to the stream dtype,
    or ``s + b`` in the stream dtype."""
    b = branch.to(stream.dtype)
    if r.alpha is None:
        return stream + b
    return (r.alpha * stream + r.beta * b).to(stream.dtype)


def silu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """vLLM's ``silu_and_mul`` kernel on bf16 [n, 2I]: ``silu(g) = g / (1 + exp(-g))``
    in fp32 rounded to bf16, then times ``up`` rounded to bf16 (two roundings)."""
    g = gate_up[:, :intermediate].float()
    up = gate_up[:, intermediate:]
    act = (g / (1.0 + torch.exp(-g))).to(BF16)
    return act * up


def rope_gptj_bf16(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """vLLM's rotary op on bf16 (``RotaryEmbedding.forward_cuda`` with the table
    converted to the query's dtype): GPT-J pairs, cos/sin rounded to bf16, every
    product and every sum rounded to bf16. x bf16 [b, n, d]; table fp32 [*, d]."""
    half = x.shape[-1] // 2
    cos_sin = table.index_select(0, positions).to(BF16)
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return out.flatten(-2)


def temperature_scale(positions: torch.Tensor, floor_scale: float, q_scale: float) -> torch.Tensor:
    """fp32 [b, 1] query scale of a tuned global layer: 1 up to ``floor_scale``,
    ``log((p + 1) / floor) * q_scale + 1`` above it."""
    scaling = torch.log((positions.float() + 1.0) / floor_scale) * q_scale + 1.0
    return scaling.clamp_min(1.0).unsqueeze(-1)


def o_norm_gate(o: torch.Tensor, gate: torch.Tensor | None, eps: float, use_norm: bool) -> torch.Tensor:
    """The attention output before o_proj, bf16 [b, n, d]: with both the o-norm and
    the o-gate, ``rms(o) * sigmoid(g)`` in fp32 rounded once (vLLM's fused kernel);
    the o-norm alone rounds ``rms(o)``; the gate alone rounds ``sigmoid(g)`` then the
    product (bf16 torch ops)."""
    if use_norm and gate is not None:
        return fn.o_norm_gate(o, gate, eps)
    if use_norm:
        return fn.weightless_norm(o, eps).to(BF16)
    if gate is not None:
        return gate.reshape(o.shape).sigmoid() * o
    return o


def output_transform(logits: torch.Tensor, multiplier: float, cap: float | None) -> torch.Tensor:
    """fp32 ``cap * tanh(fp32(l) * m / cap)`` (no cap: ``fp32(l) * m``) of bf16 logits:
    ``MuseSparkDSparkForCausalLM.apply_output_logit_transform``."""
    x = logits.float() * multiplier
    return x if cap is None else cap * torch.tanh(x / cap)


# ---------------------------------------------------------------- Gumbel noise
# vLLM's counter-based noise (gumbel.py): a MurmurHash3 of (seed, position, token)
# per draw, no random state. Emulated in int64 holding uint32 values; every product
# is split into 16-bit halves so no int64 product overflows.


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 of uint32 values a (int64 tensor) and a constant c."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (a_lo * c_lo + (((a_hi * c_lo + a_lo * c_hi) & 0xFFFF) << 16)) & MASK32


def _rotl32(v: torch.Tensor, shift: int) -> torch.Tensor:
    return ((v << shift) | (v >> (32 - shift))) & MASK32


def _mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(key, 0xCC9E2D51)
    key = _rotl32(key, 15)
    key = _mul32(key, 0x1B873593)
    h = h ^ key
    h = _rotl32(h, 13)
    return (_mul32(h, 5) + 0xE6546B64) & MASK32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur3_hash32(seed: torch.Tensor, pos: torch.Tensor, offsets: torch.Tensor, domain: int = 0) -> torch.Tensor:
    """vLLM's ``murmur3_hash32``: int64 seed and position (broadcast, e.g. [1]) and
    uint32 offsets (int64 [V]) -> uint32 hashes (int64 [V])."""
    h = torch.zeros_like(seed) ^ domain
    h = _mix(h, seed & MASK32)
    h = _mix(h, (seed >> 32) & MASK32)  # arithmetic shift, as Triton's on int64
    h = _mix(h, pos & MASK32)
    h = _mix(h, offsets & MASK32)
    return _fmix(h ^ 16)


def uniform32(random32: torch.Tensor) -> torch.Tensor:
    """vLLM's ``murmur3_uniform32`` mapping: fp32 ``(r + 0.5) * 2^-32`` from the two
    16-bit halves (each exact in fp32, their sum rounded once) -> (0, 1)."""
    hi = (random32 >> 16).to(FP32) * 1.52587890625e-05
    lo = ((random32 & 0xFFFF).to(FP32) + 0.5) * 2.3283064365386963e-10
    return hi + lo


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once, as Triton contracts ``c + a * b`` into an FMA
    (its default ``enable_fp_fusion``): the product is exact in float64."""
    c64 = c.double() if isinstance(c, torch.Tensor) else c
    return (a.double() * b.double() + c64).to(FP32)


# The series' coefficients 1/7 .. 1/1 as fp32 constants (Triton's literals are fp32).
_HORNER = tuple(float(torch.tensor(1.0 / k, dtype=FP32)) for k in (7, 6, 5, 4, 3, 2, 1))


def log1p_neg_stable(u: torch.Tensor) -> torch.Tensor:
    """vLLM's ``_log1p_neg_stable``: fp32 ``log(1 - u)``; below 0.25 the degree-8
    series ``-u (1 + u/2 + ... + u^7/8)`` evaluated by Horner's rule (each step an FMA),
    elsewhere ``log(max(1 - u, 2^-24))``."""
    p = torch.full_like(u, 1.0 / 8.0)
    for c in _HORNER:
        p = _fma32(u, p, c)
    series = -u * p
    direct = torch.log(torch.clamp(1.0 - u, min=5.960464477539063e-08))
    return torch.where(u < 0.25, series, direct)


def gumbel_noise(seed: torch.Tensor, step: int, position: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """fp32 [V] Gumbel noise of one draft sampling step (vLLM's draft path, fp32):
    seed ``s ^ (step << 32)`` (``spec_step_seed``), position ``p + 2^30`` (the draft
    salt; p is the position before the sampled token), one draw per token id;
    ``-log(-log(1 - u))``. ``seed`` and ``position`` int64 [1] device tensors."""
    u = uniform32(murmur3_hash32(seed ^ (step << 32), position + DRAFT_NOISE_SALT, offsets))
    return -torch.log(-log1p_neg_stable(u))


def gumbel_argmax(logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """int64 [1]: vLLM's ``gumbel_sample`` of bf16 logits [1, V] (pre-temperature):
    ``argmax(fp32(l) / T + noise)``, plain ``argmax(l)`` at T = 0; ties to the lowest
    id. Decided on the device (no host sync): both are computed, one is kept."""
    x = logits.float()
    t = temperature.reshape(1, 1)
    noisy = torch.argmax(x / t + noise, dim=-1)
    greedy = torch.argmax(x, dim=-1)
    return torch.where(temperature.reshape(1) == 0, greedy, noisy)


def token_probability(logits: torch.Tensor, token: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """fp32 [1]: the draft's probability of ``token`` as vLLM's rejection sampler
    reads it from the cached bf16 logits: ``softmax(fp32(l) / T)[token]``; 1 at T = 0
    (a greedy draft is one-hot)."""
    t = temperature.reshape(1, 1)
    safe = torch.where(t == 0, torch.ones_like(t), t)
    log_probs = torch.log_softmax(logits.float() / safe, dim=-1)
    chosen = log_probs.gather(1, token.reshape(1, 1)).reshape(1).exp()
    return torch.where(temperature.reshape(1) == 0, torch.ones_like(chosen), chosen)
