"""The NVFP4 (FMT 1) experts kernels' table decode (experts.cu: e4m3x2_to_float2,
make_lut, lut_quad), emulated on the CPU instruction by instruction (prmt included):
every code at every nibble of a word, under every e4m3 scale byte (but the NaN bytes,
which the provider refuses) and a range of global scales, gives nvfp4.dequantize's
bf16 bits exactly, signed zeros included.
"""

from __future__ import annotations

import torch

from sparkdecode import nvfp4

MASK = 0xFFFFFFFF


def f32(bits: torch.Tensor) -> torch.Tensor:
    return (bits & MASK).to(torch.int64).to(torch.int32).view(torch.float32)


def bf16x2(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """cvt.rn.bf16x2.f32: two fp32 rounded to bf16 (nearest even), lo in the low half."""
    bits = torch.stack((lo, hi)).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return bits[0] | (bits[1] << 16)


def prmt(a: torch.Tensor, b: torch.Tensor, sel: torch.Tensor | int) -> torch.Tensor:
    """prmt.b32 (default mode): byte n of the result is byte (sel >> 4n) & 7 of a's bytes
    0..3 then b's, or that byte's bit 7 replicated where the selector nibble's bit 3 is set."""
    sel = torch.as_tensor(sel, dtype=torch.int64)
    source = (a & MASK) | ((b & MASK) << 32)
    out = torch.zeros(torch.broadcast_shapes(source.shape, sel.shape), dtype=torch.int64)
    for n in range(4):
        nibble = (sel >> (4 * n)) & 0xF
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        byte = torch.where((nibble & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out |= byte << (8 * n)
    return out


def make_lut(s126: torch.Tensor) -> tuple[torch.Tensor, ...]:
    p = [bf16x2(f32(torch.tensor((2 * c) << 22)) * s126, f32(torch.tensor((2 * c + 1) << 22)) * s126) for c in range(4)]
    return prmt(p[0], p[1], 0x6420), prmt(p[2], p[3], 0x6420), prmt(p[0], p[1], 0x7531), prmt(p[2], p[3], 0x7531)


def lut_quad(lut: tuple[torch.Tensor, ...], w: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    lo0, lo1, hi0, hi1 = lut
    sel = ((w >> 16) if q else w) & 0x7777
    sign = prmt((w << 4) & MASK, w, 0x7362 if q else 0x5140)
    lo = prmt(lo0, lo1, sel)
    hi = prmt(hi0, hi1, sel) ^ (sign & 0x80808080)
    return prmt(lo, hi, 0x5140), prmt(lo, hi, 0x7362)


def decode_word(lut: tuple[torch.Tensor, ...], w: torch.Tensor) -> torch.Tensor:
    """int64 [..., 8]: the bf16 bits of w's 8 codes, in k order (as warp_gemm feeds them)."""
    halves = []
    for q in (0, 1):
        for r in lut_quad(lut, w, q):
            halves += [r & 0xFFFF, r >> 16]
    return torch.stack(halves, dim=-1)


def test_table_decode_is_nvfp4_dequantize_bit_for_bit():
    scale_bytes = torch.tensor([v for v in range(256) if v & 0x7F != 0x7F], dtype=torch.uint8)
    scale = scale_bytes.view(torch.float8_e4m3fn)
    # e4m3x2_to_float2: through fp16, exact
    assert torch.equal(scale.to(torch.float16).float().view(torch.int32), scale.float().view(torch.int32))
    g = torch.Generator().manual_seed(0)
    globals_ = torch.cat(
        (
            torch.tensor([1.0, -1.0, 2.0**-20, 1.7e-4, -2.5e-4, 3.1e-6, 2.0**-140, 0.0]),
            torch.exp(torch.empty(48).uniform_(-18.0, -5.0, generator=g)),  # ModelOpt's amax / 2688 range
            -torch.exp(torch.empty(8).uniform_(-18.0, -5.0, generator=g)),
        )
    ).float()
    # every code at every nibble: the 16 words c * 0x11111111, then words of mixed codes
    words = torch.cat((torch.arange(16, dtype=torch.int64) * 0x11111111, torch.randint(0, 2**32, (48,), generator=g)))
    s = scale.float()[:, None] * globals_[None, :]  # fp32, as the kernel's product
    ok = s.abs() < 4.0  # the provider refuses larger (s * 2^126 would overflow)
    s126 = torch.where(ok, s, 0.0) * 2.0**126
    lut = make_lut(s126[..., None])
    got = decode_word(lut, words)  # [scales, globals, words, 8]
    # nvfp4.dequantize of the same words (two bytes of a row each 16-value block: pad to 16 codes)
    packed = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
    packed = torch.cat((packed, packed), dim=-1)  # [words, 8 bytes] = 16 codes, one block
    want = nvfp4.dequantize(
        packed[None, None].expand(len(scale), len(globals_), -1, -1),
        scale[:, None, None, None].expand(-1, len(globals_), len(words), 1),
        globals_[None, :].expand(len(scale), -1),
    )[..., :8]
    want = want.view(torch.int16).to(torch.int64) & 0xFFFF
    assert ok.sum() > 0.9 * ok.numel()
    assert torch.equal(got[ok], want[ok])
    assert (want[ok] & 0x7FFF == 0).any() and (want[ok] == 0x8000).any()  # signed zeros were compared
