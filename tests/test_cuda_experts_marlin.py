"""The Marlin-layout experts kernels' addressing and decode (experts.cu, FMT 2), emulated
on the CPU: every lane's loads, nibbles, scale bytes and fp32 operations, placed
where the m16n8k16 A fragment puts them, rebuild nvfp4_marlin.dequantize's bf16
weights bit for bit; and the torch-only Marlin packer (the GPU tests' and the streams bench's)
(nvfp4_marlin.marlin_form, pack_weight, pack_scales) inverts nvfp4_marlin's unpacking.
"""

from __future__ import annotations

import pytest
import torch

from marlin_pack import random_marlin
from sparkdecode import nvfp4_marlin
from sparkdecode.weights import ExpertWeights, Nvfp4Scales, quantize_experts

# experts.cu's fragment registers a0..a3 of a Marlin word: the nibbles of their low and
# high bf16, the row half (row g or g + 8) and the k half (2t or 2t + 8).
NIBBLES = ((0, 4), (2, 6), (1, 5), (3, 7))
ROW_HALF = (0, 1, 0, 1)
K_HALF = (0, 0, 1, 1)


def f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def marlin_scale_to_float(byte: torch.Tensor) -> torch.Tensor:
    """experts.cu's marlin_scale_to_float."""
    exp, man = (byte >> 3).long(), (byte & 7).long()
    normal = f32(((exp + 105) << 23) | (man << 20))
    special = f32(0x7F800000 | (man << 20))
    return torch.where(exp == 31, special, torch.where(exp == 0, man.float() * 2.0**-24, normal))


def emulate_gemm_weights(words: torch.Tensor, scales: torch.Tensor, glob: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """bf16 [N, K]: the A operands warp_gemm_marlin feeds the MMA for one expert's
    GEMM (words int32 [K / 16, 2N], scale bytes [K / 16, N], Marlin's fp32 global),
    each placed at its (row, k); every element must be fed exactly once."""
    flat_words, flat_scales = words.flatten(), scales.view(torch.uint8).flatten()
    kt, blk0, lane, j, reg, hl = torch.meshgrid(
        torch.arange(k // 16),
        torch.arange(0, n, 64),
        torch.arange(32),
        torch.arange(4),
        torch.arange(4),
        torch.arange(2),
        indexing="ij",
    )
    g, t = lane >> 2, lane & 3
    h = torch.tensor(ROW_HALF)[reg]
    # the kernel's loads: uint4 (kt * 2N + 2 blk0) / 4 + lane, word j; uint2 g at kt * N + blk0
    word = flat_words[(kt * 2 * n + 2 * blk0) + 4 * lane + j].long() & 0xFFFFFFFF
    scale_word = (kt * n + blk0 + 8 * g).long()
    byte = flat_scales[scale_word + 4 * (j >> 1) + (j & 1) + 2 * h]
    nibble = torch.tensor(NIBBLES)[reg, hl]
    code = (word >> (4 * nibble)) & 0xF
    glob = (glob.float() * 2.0**-119).float()
    s126 = (marlin_scale_to_float(byte) * glob) * 2.0**126
    value = (f32(((code & 7) << 22) | ((code & 8) << 28)) * s126).to(torch.bfloat16)
    row = blk0 + 16 * j + g + 8 * h
    col = kt * 16 + 2 * t + 8 * torch.tensor(K_HALF)[reg] + hl
    out = torch.zeros(n, k, dtype=torch.bfloat16)
    count = torch.zeros(n * k, dtype=torch.int32)
    index = (row * k + col).flatten()
    count.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    assert torch.equal(count, torch.ones_like(count)), "an element is fed more or less than once"
    out.view(-1)[index] = value.flatten()
    return out


def emulate(experts: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    m = experts.marlin
    assert m is not None
    hidden, inter = m.w13_scale.shape[1] * 16, m.w2_scale.shape[1] * 16
    w13 = torch.stack(
        [
            emulate_gemm_weights(experts.w13[e], m.w13_scale[e], m.w13_global[e], hidden, 2 * inter)
            for e in range(len(m.w13_global))
        ]
    )
    w2 = torch.stack(
        [
            emulate_gemm_weights(experts.w2[e], m.w2_scale[e], m.w2_global[e], inter, hidden)
            for e in range(len(m.w2_global))
        ]
    )
    return w13, w2


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("hidden,inter", [(64, 64), (128, 64), (256, 192)])
def test_kernel_addressing_decodes_random_marlin_tensors_bit_exact(hidden, inter):
    experts = random_marlin(2, hidden, inter, torch.Generator().manual_seed(hidden + inter))
    want13, want2 = nvfp4_marlin.dequantize(experts)
    got13, got2 = emulate(experts)
    assert torch.equal(bits(got13), bits(want13)) and torch.equal(bits(got2), bits(want2))


def quantized(num: int, hidden: int, inter: int, seed: int) -> ExpertWeights:
    """NVFP4 experts quantized from random bf16 ones, W13's halves sharing the gate's
    global scale (as Marlin holds them)."""
    g = torch.Generator().manual_seed(seed)
    bf16 = ExpertWeights(
        "bf16",
        (torch.randn(num, 2 * inter, hidden, generator=g) * hidden**-0.5).to(torch.bfloat16),
        (torch.randn(num, hidden, inter, generator=g) * inter**-0.5).to(torch.bfloat16),
    )
    q = quantize_experts(bf16)
    s = q.nvfp4
    assert s is not None
    gate = s.w13_global[:, :1].expand(-1, 2).contiguous()
    return ExpertWeights("nvfp4", q.w13, q.w2, nvfp4=Nvfp4Scales(s.w13_scale, gate, s.w2_scale, s.w2_global))


def test_packer_inverts_nvfp4_marlins_unpacking():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (3, 192, 128 // 2), generator=g, dtype=torch.uint8)
    assert torch.equal(nvfp4_marlin.unpack_weight(nvfp4_marlin.pack_weight(codes), 128, 192), codes)
    scale = (
        torch.randint(0, 0x7F, (3, 192, 128 // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    )
    want = torch.where(scale * 2**7 < 2, 0.0, scale)  # Marlin zeroes the scales below 2^-6
    assert torch.equal(nvfp4_marlin.unpack_scales(nvfp4_marlin.pack_scales(scale), 128, 192), want)


def test_marlin_form_dequantizes_to_the_checkpoints_weights():
    """With W13's halves on one global scale and no scale below Marlin's floor, the
    packed form's weights are the checkpoint's, bit for bit."""
    q = quantized(3, 256, 128, seed=2)
    marlin = nvfp4_marlin.marlin_form(q)
    assert marlin.format == "nvfp4_marlin"
    for got, want in zip(marlin.dequantized(), q.dequantized(), strict=True):
        assert torch.equal(bits(got), bits(want))
    m = marlin.marlin
    assert m is not None
    back = nvfp4_marlin.from_marlin(marlin.w13, m.w13_scale, m.w13_global, marlin.w2, m.w2_scale, m.w2_global, 256, 128)
    assert torch.equal(back.w13, q.w13) and torch.equal(back.w2, q.w2)


def test_kernel_addressing_decodes_packed_experts_bit_exact():
    marlin = nvfp4_marlin.marlin_form(quantized(2, 128, 64, seed=4))
    want13, want2 = marlin.dequantized()
    got13, got2 = emulate(marlin)
    assert torch.equal(bits(got13), bits(want13)) and torch.equal(bits(got2), bits(want2))
