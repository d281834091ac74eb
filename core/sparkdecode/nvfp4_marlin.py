"""NVFP4 experts as vLLM 0.33 holds them on SM90 after its Marlin repack, read back
into the core's NVFP4 form (nvfp4.py, ``ExpertWeights("nvfp4")``).

vLLM's Muse Spark experts method (``_process_hopper_marlin_weights``) hands
Marlin the gate's global scale for both halves of W13 and W2's global scale times
up/gate; ``prepare_nvfp4_moe_layer_for_marlin`` then, per expert:

- codes: the [N, K / 2] bytes viewed as GPTQ int32 words along K, permuted into
  Marlin's 16 x 64 tiles (``gptq_marlin_repack``): int32 [K / 16, 2 N], eight
  codes a word;
- block scales: transposed to [K / 16, N], permuted (``marlin_permute_scales``),
  pairs swapped within groups of four, multiplied by a power of two ``sf`` (one
  per layer and projection) and by 2^7 in fp16, values below 2 zeroed, and kept as
  the fp16's exponent and top three mantissa bits (one byte, no sign);
- global scales: fp32 times 2^119 (bf16 activations) divided by ``sf``.

``marlin_form`` does all of it to ``ExpertWeights("nvfp4")`` with torch alone: a
model of vLLM's repack (``pack_weight`` of ``gptq_marlin_repack``, ``pack_scales``
and ``scale_factor`` of the scale handling), the inverse of the unpacking here,
for where vLLM's CUDA op is absent (the streams bench, the tests; vLLM's own
repack is what serving reads). ``from_marlin`` inverts all of it (a copy, for
tests); ``marlin_experts`` holds
vLLM's tensors as they are (``ExpertWeights("nvfp4_marlin")``, views, no copy)
and ``dequantize`` decodes them straight from Marlin's layout, capturably (the
permutations are device tensors made once), to the same bits. The block scale times the global scale of every
block is Marlin's exactly, so the dequantized weights are the ones Marlin
computes with; the split between the two differs from the checkpoint's by a power
of two, and W13's up half and W2 carry the gate's global scale and the up/gate
ratio as vLLM folded them. Blocks whose scales Marlin zeroed decode as zeros, as
Marlin computes them. Unpadded widths only (vLLM pads N per shard to a multiple
of 64 where K % 128 == 0; the Muse Spark widths need none).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import nvfp4
from .weights import ExpertWeights, Nvfp4MarlinScales, Nvfp4Scales

TILE = 16
# 2^(bf16 exponent bias - fp4 exponent bias - 7): what Marlin multiplies the global scale by.
GLOBAL_SHIFT = 2.0 ** (2**7 - 2**1 - 7)
SCALE_SHIFT = 2.0**7


def _weight_perm() -> torch.Tensor:
    """Marlin's permutation of each 1024 codes of a row of 16 x 64 tiles (vLLM's
    ``get_weight_perm(4)``)."""
    perm: list[int] = []
    for i in range(32):
        col = i // 4
        first = [
            16 * row + col + 8 * block
            for block in (0, 1)
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1)
        ]
        for j in range(4):
            perm.extend(p + 256 * j for p in first)
    interleave = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    return torch.tensor(perm).reshape(-1, 8)[:, interleave].flatten()


def _scale_perm() -> torch.Tensor:
    return torch.tensor([i + 8 * j for i in range(8) for j in range(8)])


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    return torch.argsort(perm)


class MarlinPerms(NamedTuple):
    """Where each value of a row-major block sits in Marlin's order, as device
    index tensors (made once, so a decode under graph capture makes no host tensor)."""

    weight: torch.Tensor  # int64 [1024]: codes of a 16-row tile row, by their row-major position
    scale: torch.Tensor  # int64 [64]: block scales (pair swap and scale permutation undone)


def marlin_perms(device: torch.device | str = "cpu") -> MarlinPerms:
    """The inverse permutations of Marlin's NVFP4 layout on ``device``."""
    # The scales were pair-swapped within fours ([0, 2, 1, 3]) after the 64-wide
    # permutation: undo both with one index per 64.
    inverse = _inverse(_scale_perm())
    swap = torch.tensor([0, 2, 1, 3])
    scale = 4 * (inverse // 4) + swap[inverse % 4]
    return MarlinPerms(_inverse(_weight_perm()).to(device), scale.to(device))


def unpack_weight(marlin: torch.Tensor, size_k: int, size_n: int, perms: MarlinPerms | None = None) -> torch.Tensor:
    """int32 [..., K / 16, 2 N] Marlin codes -> uint8 [..., N, K / 2], the
    checkpoint's layout (element 2i of a row in the low nibble)."""
    lead = marlin.shape[:-2]
    if tuple(marlin.shape[-2:]) != (size_k // TILE, size_n * TILE // 8) or marlin.dtype != torch.int32:
        raise ValueError(
            f"Marlin NVFP4 codes of K={size_k}, N={size_n} are int32 [..., {size_k // TILE}, {size_n * TILE // 8}], "
            f"got {marlin.dtype} {list(marlin.shape)}"
        )
    if size_k % 64 or size_n % 64:
        raise ValueError(f"K={size_k} and N={size_n} must be multiples of 64 (padded Marlin widths are not read)")
    perms = perms or marlin_perms(marlin.device)
    codes = torch.stack([(marlin >> (4 * i)) & 0xF for i in range(8)], dim=-1).flatten(-2)  # [..., K/16, 16 N]
    chunks = codes.unflatten(-1, (-1, perms.weight.numel()))
    codes = chunks[..., perms.weight].flatten(-2)
    codes = codes.unflatten(-1, (size_n // TILE, TILE, TILE)).transpose(-3, -2)  # [..., K/16, 16, N/16, 16]
    codes = codes.reshape(*lead, size_k, size_n).transpose(-2, -1)  # [..., N, K]
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).contiguous()


def unpack_scales(marlin: torch.Tensor, size_k: int, size_n: int, perms: MarlinPerms | None = None) -> torch.Tensor:
    """Marlin's one-byte block scales [..., K / 16, N] -> fp32 [..., N, K / 16]: the
    checkpoint's e4m3 scale times Marlin's power of two ``sf`` (0 where Marlin
    zeroed it)."""
    if tuple(marlin.shape[-2:]) != (size_k // nvfp4.BLOCK, size_n) or marlin.element_size() != 1:
        raise ValueError(
            f"Marlin NVFP4 scales of K={size_k}, N={size_n} are bytes [..., {size_k // nvfp4.BLOCK}, {size_n}], "
            f"got {marlin.dtype} {list(marlin.shape)}"
        )
    perms = perms or marlin_perms(marlin.device)
    half = (marlin.view(torch.uint8).to(torch.int16) << 7).view(torch.float16).float() / SCALE_SHIFT
    lead = half.shape[:-2]
    half = half.unflatten(-1, (-1, perms.scale.numel()))[..., perms.scale]
    return half.reshape(*lead, size_k // nvfp4.BLOCK, size_n).transpose(-2, -1).contiguous()


def _e4m3_split(scale: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 block scales [E, rows, blocks] -> (e4m3 scales, fp32 [E] powers of two
    p) with e4m3 * p == scale exactly: p the smallest power of two bringing each
    expert's largest scale to at most 448."""
    amax = scale.amax(dim=(-2, -1)).clamp(min=nvfp4.E4M3_MAX)
    power = torch.exp2(torch.ceil(torch.log2(amax / nvfp4.E4M3_MAX)))
    e4m3 = (scale / power[:, None, None]).to(torch.float8_e4m3fn)
    if not torch.equal(e4m3.float() * power[:, None, None], scale):
        raise ValueError(f"{where}: Marlin's block scales are not e4m3 values times a power of two")
    return e4m3, power


def from_marlin(experts: ExpertWeights) -> ExpertWeights:
    """Experts held in vLLM's SM90 Marlin layout (``marlin_experts``) copied back into
    the checkpoint's form, ``ExpertWeights("nvfp4")``, that dequantizes to Marlin's
    weights bit for bit. W13's two halves share one global scale
    (``w13_global[:, 0] == w13_global[:, 1]``); input scales are not kept (Marlin
    runs W4A16)."""
    m = experts.marlin
    if m is None:
        raise ValueError(f"{experts.format} experts are not in Marlin's layout")
    num = experts.w13.shape[0]
    hidden, intermediate = m.w13_scale.shape[1] * nvfp4.BLOCK, m.w2_scale.shape[1] * nvfp4.BLOCK
    codes13 = unpack_weight(experts.w13, hidden, 2 * intermediate, m.perms)
    codes2 = unpack_weight(experts.w2, intermediate, hidden, m.perms)
    scale13, power13 = _e4m3_split(unpack_scales(m.w13_scale, hidden, 2 * intermediate, m.perms), "w13_weight_scale")
    scale2, power2 = _e4m3_split(unpack_scales(m.w2_scale, intermediate, hidden, m.perms), "w2_weight_scale")
    g13 = m.w13_global.float().reshape(num) / GLOBAL_SHIFT * power13
    g2 = m.w2_global.float().reshape(num) / GLOBAL_SHIFT * power2
    scales = Nvfp4Scales(scale13, torch.stack([g13, g13], dim=1), scale2, g2)
    return ExpertWeights("nvfp4", codes13, codes2, experts.first_expert, experts.intermediate_slice, scales)


def marlin_experts(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    hidden: int,
    intermediate: int,
    first_expert: int = 0,
    intermediate_slice: tuple[int, int] | None = None,
) -> ExpertWeights:
    """vLLM's Marlin-repacked NVFP4 experts (its ``w13_weight``, ``w13_weight_scale``,
    ``w13_weight_scale_2``, ``w2_*``; ``hidden`` the experts' width P,
    ``intermediate`` this rank's I) held as they are: ``ExpertWeights("nvfp4_marlin")`` of the tensors themselves
    (no copy), after checking each one's shape and type; raises ValueError naming
    the first that differs."""
    num = w13.shape[0]
    for name, t, shape, dtype in (
        ("w13_weight", w13, (num, hidden // TILE, 4 * intermediate), torch.int32),
        ("w13_weight_scale", w13_scale, (num, hidden // nvfp4.BLOCK, 2 * intermediate), None),
        ("w13_weight_scale_2", w13_global, (num,), torch.float32),
        ("w2_weight", w2, (num, intermediate // TILE, 2 * hidden), torch.int32),
        ("w2_weight_scale", w2_scale, (num, intermediate // nvfp4.BLOCK, hidden), None),
        ("w2_weight_scale_2", w2_global, (num,), torch.float32),
    ):
        kind = "one-byte" if dtype is None else str(dtype)
        if tuple(t.shape) != shape or (t.element_size() != 1 if dtype is None else t.dtype != dtype):
            raise ValueError(f"Marlin's {name} is {t.dtype} {list(t.shape)}, expected {kind} {list(shape)}")
        if not t.is_contiguous():
            raise ValueError(f"Marlin's {name} is not contiguous")
    if hidden % 64 or intermediate % 64:
        raise ValueError(
            f"P={hidden}, I={intermediate}: the unpadded Marlin layout needs multiples of 64 "
            "(vLLM pads other widths, and padded layouts are not read)"
        )
    scales = Nvfp4MarlinScales(w13_scale, w13_global, w2_scale, w2_global, marlin_perms(w13.device))
    return ExpertWeights("nvfp4_marlin", w13, w2, first_expert, intermediate_slice, marlin=scales)


def pack_weight(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K / 2] checkpoint codes -> Marlin's int32 [..., K / 16, 2 N]
    (``unpack_weight`` inverted; ``gptq_marlin_repack`` of the codes viewed as GPTQ words)."""
    *lead, n, half = codes.shape
    k = 2 * half
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)  # [..., N, K]
    tiles = nibbles.transpose(-2, -1).reshape(*lead, k // 16, 16, n // 16, 16).transpose(-3, -2)
    chunks = tiles.reshape(*lead, k // 16, n // 64, 1024)
    marlin = chunks[..., _weight_perm().to(codes.device)].flatten(-2)  # [..., K/16, 16 N]
    return (marlin[..., 0::2] | (marlin[..., 1::2] << 4)).to(torch.uint8).contiguous().view(torch.int32)


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp32 block scales [..., N, K / 16] (e4m3 values times a power of two, at most
    448) -> Marlin's bytes [..., K / 16, N]: fp16(scale * 2^7), 0 below 2, its bits
    14..7, permuted per 64 (``unpack_scales`` inverted)."""
    half = (scale.transpose(-2, -1) * SCALE_SHIFT).to(torch.float16)
    half = torch.where(half < 2, torch.zeros_like(half), half)
    if not torch.equal(half.float(), torch.where(half == 0, 0.0, scale.transpose(-2, -1) * 2**7)):
        raise ValueError("block scales must be e4m3 values times a power of two, at most 448")
    byte = ((half.view(torch.int16) >> 7) & 0xFF).to(torch.uint8)
    inverse = torch.argsort(marlin_perms(scale.device).scale)
    lead = byte.shape[:-1]
    return byte.unflatten(-1, (-1, 64))[..., inverse].reshape(*lead, -1).contiguous()


def scale_factor(scale: torch.Tensor) -> float:
    """vLLM's ``sf`` of a projection: the power of two bringing its largest block
    scale to at most 448 (1 where it is already above)."""
    largest = scale.float().amax().item()
    return (
        1.0
        if largest >= nvfp4.E4M3_MAX or largest == 0
        else 2.0 ** int(torch.tensor(nvfp4.E4M3_MAX / largest).log2().floor())
    )


def marlin_form(experts: ExpertWeights) -> ExpertWeights:
    """``ExpertWeights("nvfp4")`` -> the ``nvfp4_marlin`` experts vLLM's SM90 Marlin
    repack makes of them: W13 with the gate's global scale for both halves and W2's
    global times up / gate (as vLLM folds them), each projection's scales times its
    ``sf`` and the globals divided by it, times 2^119."""
    q = experts.nvfp4
    if experts.format != "nvfp4" or q is None:
        raise ValueError(f"{experts.format} experts: Marlin's form is made of NVFP4 ones")
    inter, hidden = experts.w2.shape[2] * 2, experts.w2.shape[1]
    gate, up = q.w13_global[:, 0].float(), q.w13_global[:, 1].float()
    sf13, sf2 = scale_factor(q.w13_scale), scale_factor(q.w2_scale)
    return marlin_experts(
        pack_weight(experts.w13),
        pack_scales(q.w13_scale.float() * sf13).view(torch.float8_e4m3fn),
        (gate * GLOBAL_SHIFT / sf13).contiguous(),
        pack_weight(experts.w2),
        pack_scales(q.w2_scale.float() * sf2).view(torch.float8_e4m3fn),
        (q.w2_global.float() * (up / gate) * GLOBAL_SHIFT / sf2).contiguous(),
        hidden,
        inter,
        experts.first_expert,
        experts.intermediate_slice,
    )


def dequantize(experts: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (w13 [E, 2I, P], w2 [E, P, I]) of experts in Marlin's layout: the
    weights Marlin computes with, the same bits as ``from_marlin``'s dequantized.
    Each block decodes as e2m1 * (Marlin's scale / 2^7 * Marlin's global / 2^119):
    the checkpoint's scale and the global times the powers of two vLLM moved
    between them, so the fp32 product is the same. Capturable: no host tensor."""
    m = experts.marlin
    if m is None:
        raise ValueError(f"{experts.format} experts are not in Marlin's layout")
    hidden, inter = m.w13_scale.shape[1] * nvfp4.BLOCK, m.w2_scale.shape[1] * nvfp4.BLOCK
    w13 = nvfp4.dequantize(
        unpack_weight(experts.w13, hidden, 2 * inter, m.perms),
        unpack_scales(m.w13_scale, hidden, 2 * inter, m.perms),
        m.w13_global / GLOBAL_SHIFT,
    )
    w2 = nvfp4.dequantize(
        unpack_weight(experts.w2, inter, hidden, m.perms),
        unpack_scales(m.w2_scale, inter, hidden, m.perms),
        m.w2_global / GLOBAL_SHIFT,
    )
    return w13, w2
