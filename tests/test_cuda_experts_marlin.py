"""The Marlin-layout experts kernels' addressing and decode (experts.cu, FMT 2), emulated
on the CPU: every lane's loads, nibbles, scale bytes and fp32 operations, placed
where the m16n8k16 A fragment puts them, rebuild nvfp4_marlin.dequantize's bf16
weights bit for bit, with the registered decode and with EXPERTS_V2's (codes as e4m3
bytes, scale bytes as fp32 bits; also checked for every code at every nibble under
every finite scale byte and a range of global scales, signed zeros included); and the torch-only Marlin packer (the GPU tests' and the streams bench's)
(nvfp4_marlin.marlin_form, pack_weight, pack_scales) inverts nvfp4_marlin's unpacking.
"""

from __future__ import annotations

import pytest
import torch

from marlin_pack import random_marlin
from sparkdecode import nvfp4, nvfp4_marlin
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


def decode(word: torch.Tensor, nibble: torch.Tensor, byte: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """bf16 of code ``nibble`` of ``word`` (int64) under scale ``byte`` and Marlin's
    fp32 global: experts.cu's dequant_pair and marlin_scale_to_float."""
    code = (word >> (4 * nibble)) & 0xF
    s126 = (marlin_scale_to_float(byte) * (glob.float() * 2.0**-119).float()) * 2.0**126
    return (f32(((code & 7) << 22) | ((code & 8) << 28)) * s126).to(torch.bfloat16)


def decode_v2(word: torch.Tensor, nibble: torch.Tensor, byte: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """The same under EXPERTS_V2: marlin_word_v2 (the code's e4m3 byte, through fp16
    to fp32) and marlin_s64 (the scale byte at fp32 bits 20..27)."""
    even = ((word << 2) & 0x1C1C1C1C) | ((word << 4) & 0x80808080)
    odd = ((word >> 2) & 0x1C1C1C1C) | (word & 0x80808080)
    e4m3 = ((torch.where(nibble % 2 == 0, even, odd) >> (8 * (nibble // 2))) & 0xFF).to(torch.uint8)
    value = e4m3.view(torch.float8_e4m3fn).to(torch.float16).float()  # cvt.rn.f16x2.e4m3x2, cvt.f32.f16
    g105 = (glob.float() * 2.0**-119).float() * 2.0**105
    s64 = (f32(byte.long() << 20) * g105) * 2.0**6
    return (value * s64).to(torch.bfloat16)


def emulate_gemm_weights(
    words: torch.Tensor,
    scales: torch.Tensor,
    glob: torch.Tensor,
    k: int,
    n: int,
    decoder=decode,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[N, K] of ``dtype``: the A operands warp_gemm_marlin feeds the MMA for one expert's
    GEMM (words int32 [K / 16, 2N], scale bytes [K / 16, N], Marlin's fp32 global),
    each placed at its (row, k) by ``decoder``; every element must be fed exactly once."""
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
    value = decoder(word, torch.tensor(NIBBLES)[reg, hl], byte, glob)
    row = blk0 + 16 * j + g + 8 * h
    col = kt * 16 + 2 * t + 8 * torch.tensor(K_HALF)[reg] + hl
    out = torch.zeros(n, k, dtype=dtype)
    count = torch.zeros(n * k, dtype=torch.int32)
    index = (row * k + col).flatten()
    count.index_add_(0, index, torch.ones_like(index, dtype=torch.int32))
    assert torch.equal(count, torch.ones_like(count)), "an element is fed more or less than once"
    out.view(-1)[index] = value.flatten()
    return out


def emulate(experts: ExpertWeights, decoder=decode) -> tuple[torch.Tensor, torch.Tensor]:
    m = experts.marlin
    assert m is not None
    hidden, inter = m.w13_scale.shape[1] * 16, m.w2_scale.shape[1] * 16
    w13 = torch.stack(
        [
            emulate_gemm_weights(experts.w13[e], m.w13_scale[e], m.w13_global[e], hidden, 2 * inter, decoder)
            for e in range(len(m.w13_global))
        ]
    )
    w2 = torch.stack(
        [
            emulate_gemm_weights(experts.w2[e], m.w2_scale[e], m.w2_global[e], inter, hidden, decoder)
            for e in range(len(m.w2_global))
        ]
    )
    return w13, w2


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("decoder", [decode, decode_v2])
@pytest.mark.parametrize("hidden,inter", [(64, 64), (128, 64), (256, 192)])
def test_kernel_addressing_decodes_random_marlin_tensors_bit_exact(hidden, inter, decoder):
    experts = random_marlin(2, hidden, inter, torch.Generator().manual_seed(hidden + inter))
    want13, want2 = nvfp4_marlin.dequantize(experts)
    got13, got2 = emulate(experts, decoder)
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
    back = nvfp4_marlin.from_marlin(marlin)
    assert torch.equal(back.w13, q.w13) and torch.equal(back.w2, q.w2)


@pytest.mark.parametrize("decoder", [decode, decode_v2])
def test_kernel_addressing_decodes_packed_experts_bit_exact(decoder):
    marlin = nvfp4_marlin.marlin_form(quantized(2, 128, 64, seed=4))
    want13, want2 = marlin.dequantized()
    got13, got2 = emulate(marlin, decoder)
    assert torch.equal(bits(got13), bits(want13)) and torch.equal(bits(got2), bits(want2))


def test_v2_decode_is_marlins_dequantize_for_every_code_scale_byte_and_nibble():
    """Every code at every nibble of a word (the words c * 0x11111111, then random ones),
    under every finite scale byte (0xf8.. are inf / NaN, which the provider refuses) and
    Marlin globals of checkpoint globals over ModelOpt's range times 2^119 / sf (sf up to
    2^8), tiny and negative ones: decode_v2 gives the bf16 bits of nvfp4.dequantize of
    Marlin's scale value (unpack_scales' byte << 7 as fp16 over 2^7) and global / 2^119,
    as nvfp4_marlin.dequantize composes them."""
    g = torch.Generator().manual_seed(0)
    bytes_ = torch.arange(0xF8, dtype=torch.int64)
    checkpoint = torch.cat(
        (
            torch.tensor([1.0, -1.0, 2.0**-20, 1.7e-4, -2.5e-4, 3.1e-6, 2.0**-140, 0.0]),
            torch.exp(torch.empty(40).uniform_(-18.0, -5.0, generator=g)),
            -torch.exp(torch.empty(8).uniform_(-18.0, -5.0, generator=g)),
        )
    )
    sf = 2.0 ** torch.randint(0, 9, (len(checkpoint),), generator=g)
    sf[:8] = 1.0  # the edge globals as they are (2^-140: bf16 subnormal weights)
    globals_ = (checkpoint * nvfp4_marlin.GLOBAL_SHIFT / sf).float()
    words = torch.cat((torch.arange(16, dtype=torch.int64) * 0x11111111, torch.randint(0, 2**32, (48,), generator=g)))
    nibble = torch.arange(8)
    got = decode_v2(
        words[None, None, :, None], nibble, bytes_[:, None, None, None], globals_[None, :, None, None]
    )  # [bytes, globals, words, 8]
    scale = (bytes_.to(torch.int16) << 7).view(torch.float16).float() / nvfp4_marlin.SCALE_SHIFT
    packed = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
    packed = torch.cat((packed, packed), dim=-1)  # one 16-value block
    want = nvfp4.dequantize(
        packed[None, None].expand(len(bytes_), len(globals_), -1, -1),
        scale[:, None, None, None].expand(-1, len(globals_), len(words), 1),
        globals_ / nvfp4_marlin.GLOBAL_SHIFT,
    )[..., :8]
    want_bits, got_bits = bits(want).long() & 0xFFFF, bits(got).long() & 0xFFFF
    assert torch.equal(got_bits, want_bits)
    assert (want_bits == 0).any() and (want_bits == 0x8000).any()  # signed zeros were compared
    assert ((want_bits & 0x7F80) == 0).logical_and((want_bits & 0x7F) != 0).any()  # bf16 subnormals too
