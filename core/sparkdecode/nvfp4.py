"""NVFP4 (ModelOpt) weights: e2m1 codes two per byte, e4m3 scales per 16 values,
an fp32 global scale per expert and projection.

Layout, as the released Muse Spark checkpoint stores the routed experts of layers
1..60 (row-major, scales not swizzled):

    gate_up_proj                uint8 [E, 2I, P / 2]   (gate rows first)
    gate_up_proj_weight_scale   e4m3  [E, 2I, P / 16]
    gate_up_proj_weight_scale_2 fp32  [E, 2]           (gate's, up's global decode scale)
    gate_up_proj_input_scale    fp32  [E, 2]
    down_proj                   uint8 [E, P, I / 2]
    down_proj_weight_scale      e4m3  [E, P, I / 16]
    down_proj_weight_scale_2    fp32  [E]
    down_proj_input_scale       fp32  [E]

A byte holds element 2i in its low nibble and 2i + 1 in its high nibble; a nibble
is sign (bit 3) and a magnitude index into E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6).
Dequantization, as vLLM defines it (``dequantize_to_dtype``): in fp32,
``value = e2m1 * (float(scale) * global)``, then rounded to the target dtype.
Quantization, as ModelOpt defines it: ``global = amax / (6 * 448)``; a block's
scale ``e4m3(block_amax / (6 * global))`` (1 where the block is all zero); codes
``round_e2m1(w / (float(scale) * global))`` to the nearest value, ties to even.
"""

from __future__ import annotations

import torch

BLOCK = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
E2M1_MAX = 6.0


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] -> fp32 e2m1 values [..., K]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed NVFP4 must be uint8, got {packed.dtype}")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    # A chain of selects over the eight magnitudes, not a lookup table: a table
    # tensor built here would be a host copy, which a CUDA graph cannot capture.
    magnitude = codes & 0x07
    values = torch.zeros(codes.shape, dtype=torch.float32, device=packed.device)
    for index, value in enumerate(E2M1[1:], start=1):
        values = torch.where(magnitude == index, value, values)
    return torch.where((codes & 0x08) != 0, -values, values)


def pack(values: torch.Tensor) -> torch.Tensor:
    """fp32 e2m1 values [..., K] (each exactly one of +-E2M1) -> uint8 [..., K / 2]."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=values.device)
    magnitude = (values.abs()[..., None] == table).int().argmax(-1)
    codes = (magnitude | torch.where(torch.signbit(values), 8, 0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """[..., rows, K / 2] codes, [..., rows, K / 16] e4m3 scales and a global scale
    broadcast over [..., 1, 1] (one per leading index) -> [..., rows, K] in ``dtype``."""
    values = unpack(packed)
    blocks = values.unflatten(-1, (-1, BLOCK))
    factor = scale.float() * global_scale.float()[..., None, None]
    return (blocks * factor[..., None]).flatten(-2).to(dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The nearest E2M1 value of fp32 x in [-6, 6], ties to the even code."""
    magnitude = x.abs()
    # Boundaries between neighbours and which side a tie takes (the even code).
    out = torch.zeros_like(magnitude)
    for low, high, mid_goes_up in (
        (0.0, 0.5, False),
        (0.5, 1.0, True),
        (1.0, 1.5, False),
        (1.5, 2.0, True),
        (2.0, 3.0, False),
        (3.0, 4.0, True),
        (4.0, 6.0, False),
    ):
        mid = (low + high) / 2
        above = magnitude >= mid if mid_goes_up else magnitude > mid
        out = torch.where((magnitude > low) & above, high, out)
    return torch.where(x < 0, -out, out)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 of w [..., rows, K] with one global scale per leading index:
    (uint8 codes [..., rows, K / 2], e4m3 scales [..., rows, K / 16], fp32 global [...]).
    One departure: an all-zero tensor gets global 1 (ModelOpt's 0 gives NaN scales)."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {BLOCK}, got {w.shape[-1]}")
    w32 = w.float()
    amax = w32.abs().amax(dim=(-2, -1))
    global_scale = amax / (E2M1_MAX * E4M3_MAX)
    global_scale = torch.where(global_scale > 0, global_scale, torch.ones_like(global_scale))
    blocks = w32.unflatten(-1, (-1, BLOCK))
    # One division by 6 * global, as ModelOpt computes it: dividing by 6 and then by
    # the global rounds twice and can land the other side of an e4m3 tie.
    block_scale = blocks.abs().amax(-1) / (E2M1_MAX * global_scale[..., None, None])
    block_scale = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
    scale = block_scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (scale.float() * global_scale[..., None, None])[..., None]
    # A block whose scale rounds to zero in e4m3 (its largest value under about
    # 2.2e-6 of the tensor's) divides by zero: ModelOpt's rounding takes the NaN of
    # 0 / 0 to code 7 (+6), as here; the dequantized block is zero either way.
    scaled = torch.where(scaled.isnan(), E2M1_MAX, scaled)
    codes = pack(round_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2))
    return codes, scale, global_scale
