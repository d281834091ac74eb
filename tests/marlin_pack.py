"""vLLM's SM90 Marlin form of NVFP4 experts made with torch alone (no ``gptq_marlin_repack``):
the inverse of nvfp4_marlin's unpacking, and the scale and global handling of
``prepare_nvfp4_moe_layer_for_marlin``, so a GPU without vLLM's ops can test kernels
that read Marlin's layout. tests/test_cuda_experts_marlin.py checks it against
nvfp4_marlin's decode.
"""

from __future__ import annotations

import torch

from sparkdecode import nvfp4, nvfp4_marlin
from sparkdecode.weights import ExpertWeights


def pack_weight(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K / 2] checkpoint codes -> Marlin's int32 [..., K / 16, 2 N]
    (nvfp4_marlin.unpack_weight inverted)."""
    *lead, n, half = codes.shape
    k = 2 * half
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)  # [..., N, K]
    tiles = nibbles.transpose(-2, -1).reshape(*lead, k // 16, 16, n // 16, 16).transpose(-3, -2)
    chunks = tiles.reshape(*lead, k // 16, n // 64, 1024)
    marlin = chunks[..., nvfp4_marlin._weight_perm().to(codes.device)].flatten(-2)  # [..., K/16, 16 N]
    return (marlin[..., 0::2] | (marlin[..., 1::2] << 4)).to(torch.uint8).contiguous().view(torch.int32)


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp32 block scales [..., N, K / 16] (e4m3 values times a power of two, at most
    448) -> Marlin's bytes [..., K / 16, N]: fp16(scale * 2^7), 0 below 2, its bits
    14..7, permuted per 64 (nvfp4_marlin.unpack_scales inverted)."""
    half = (scale.transpose(-2, -1) * nvfp4_marlin.SCALE_SHIFT).to(torch.float16)
    half = torch.where(half < 2, torch.zeros_like(half), half)
    if not torch.equal(half.float(), torch.where(half == 0, 0.0, scale.transpose(-2, -1) * 2**7)):
        raise ValueError("block scales must be e4m3 values times a power of two, at most 448")
    byte = ((half.view(torch.int16) >> 7) & 0xFF).to(torch.uint8)
    inverse = torch.argsort(nvfp4_marlin.marlin_perms(scale.device).scale)
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
    return nvfp4_marlin.marlin_experts(
        pack_weight(experts.w13),
        pack_scales(q.w13_scale.float() * sf13).view(torch.float8_e4m3fn),
        (gate * nvfp4_marlin.GLOBAL_SHIFT / sf13).contiguous(),
        pack_weight(experts.w2),
        pack_scales(q.w2_scale.float() * sf2).view(torch.float8_e4m3fn),
        (q.w2_global.float() * (up / gate) * nvfp4_marlin.GLOBAL_SHIFT / sf2).contiguous(),
        hidden,
        inter,
        experts.first_expert,
        experts.intermediate_slice,
    )


def random_marlin(num: int, hidden: int, inter: int, g: torch.Generator, device: str = "cpu") -> ExpertWeights:
    """Any Marlin tensors (drawn on the CPU, then moved to ``device``): random words, scale bytes of every finite value (zero,
    fp16 subnormals, normals) and globals keeping block scales below experts.cu's bound."""

    def words(k: int, n: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31, (num, k // 16, 2 * n), generator=g, dtype=torch.int64).to(torch.int32)

    def scales(k: int, n: int) -> torch.Tensor:
        return torch.randint(0, 0xF8, (num, k // 16, n), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)

    def glob() -> torch.Tensor:  # the largest byte is 480: 480 * 2^-9 * 2 < 4
        return (1 + torch.rand(num, generator=g)) * 2.0**-9 * nvfp4_marlin.GLOBAL_SHIFT

    tensors = (
        words(hidden, 2 * inter),
        scales(hidden, 2 * inter),
        glob(),
        words(inter, hidden),
        scales(inter, hidden),
        glob(),
    )
    return nvfp4_marlin.marlin_experts(*(x.to(device) for x in tensors), hidden, inter)
