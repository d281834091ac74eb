"""experts.cu's EXPERTS_V3 decodes (EXPERTS_V2 = 2), emulated on the CPU instruction by
instruction: Marlin's (marlin_scales_v3, marlin_word_v3, mul.rn.bf16x2) gives A =
-e2m1 * F * 2^-14 EXACTLY for every code at every nibble under every scale byte vLLM's
repack makes (0 and 0x80..0xf7: F >= 2), so A times Marlin's global * -2^-112 (the
kernels' output factor) is e2m1 * scale * global, the exact quantized weight; the bytes
it does not decode so are exactly those the provider refuses. The checkpoint layout's
(make_lut_v3 with lut_quad) gives e2m1 * scale exactly for every code and every finite
e4m3 scale. The Marlin kernels' addressing with this decode rebuilds the exact weights
of random Marlin tensors.
"""

from __future__ import annotations

import re

import pytest
import torch
from ptxas_check import Usage, blocks_per_sm, kernel_ptx, kernel_usage, ptx_entry
from test_cuda_experts_marlin import emulate_gemm_weights
from test_cuda_experts_nvfp4_lut import MASK, bf16x2, decode_word, prmt

from expert_check import exact_weights
from marlin_pack import random_marlin
from sparkdecode import nvfp4

experts_mod = pytest.importorskip("sparkdecode_cuda.experts")

E2M1 = torch.tensor(nvfp4.E2M1, dtype=torch.float64)
BYTES = torch.arange(256, dtype=torch.int64)
VALID = (BYTES == 0) | ((BYTES >= 0x80) & (BYTES < 0xF8))  # vLLM's repack: 0, or values >= 2


def bf16_of(bits: torch.Tensor) -> torch.Tensor:
    """fp64 value of 16-bit patterns (int64)."""
    return (bits & 0xFFFF).to(torch.int16).view(torch.bfloat16).double()


def e2m1(code: torch.Tensor) -> torch.Tensor:
    value = E2M1[code & 7]
    return torch.where((code & 8) != 0, -value, value)


def marlin_f(byte: torch.Tensor) -> torch.Tensor:
    """Marlin's fp16 scale value of a byte (bits 14..7 of an fp16; unpack_scales' F before / 2^7)."""
    return (byte.to(torch.int16) << 7).view(torch.float16).double()


def marlin_scales_v3(v: torch.Tensor, k: int) -> torch.Tensor:
    """experts.cu's marlin_scales_v3: (prmt(v, 0, sel) << 4) & 0xfff0fff0."""
    return (prmt(v, torch.zeros_like(v), 0xB391 if k else 0xA280) << 4) & 0xFFF0FFF0


def mul_bcast(a: torch.Tensor, s: torch.Tensor, hi: int) -> torch.Tensor:
    """mul_bf16x2_bcast: both halves of a times s's low (hi = 0) or high half, as fp64
    products (the kernel rounds each once to bf16; exactness is asserted separately)."""
    scale = bf16_of(s >> (16 * hi))
    return torch.stack((bf16_of(a) * scale, bf16_of(a >> 16) * scale), dim=-1)


def marlin_word_v3(w: torch.Tensor, s2: torch.Tensor) -> list[torch.Tensor]:
    """experts.cu's marlin_word_v3: [a0, a1, a2, a3], each fp64 [..., 2] (low, high half)."""
    m = 0x81C081C0
    h = (w & MASK) >> 8
    c0 = ((w & 0x000F000F) * 0x1040) & MASK & m
    c1 = ((h & 0x000F000F) * 0x1040) & MASK & m
    c2 = ((w & 0x00F000F0) * 0x104) & MASK & m
    c3 = ((h & 0x00F000F0) * 0x104) & MASK & m
    return [mul_bcast(c0, s2, 0), mul_bcast(c1, s2, 1), mul_bcast(c2, s2, 0), mul_bcast(c3, s2, 1)]


# the nibbles of a0..a3's low and high halves, and their row half (g or g + 8)
NIBBLES = ((0, 4), (2, 6), (1, 5), (3, 7))
ROW_HALF = (0, 1, 0, 1)


def test_marlin_v3_decode_is_exact_for_every_code_and_scale_byte():
    """Every code at every nibble (the words c * 0x11111111, then random words), every
    scale byte in both rows and both selectors: A is a bf16 number (the one rounding of
    mul.rn.bf16x2 is exact) equal to -e2m1 * F * 2^-14 where the byte is one vLLM makes;
    every other byte decodes to something else and is refused by the provider."""
    g = torch.Generator().manual_seed(0)
    words = torch.cat((torch.arange(16, dtype=torch.int64) * 0x11111111, torch.randint(0, 2**32, (48,), generator=g)))
    for k in (0, 1):
        for row in (0, 1):
            # the byte under test at byte k + 2 row of the scale word, other bytes random
            other = torch.randint(0, 2**32, (256,), generator=g)
            shift = 8 * (k + 2 * row)
            v = (other & ~(0xFF << shift) & MASK) | (BYTES << shift)
            s2 = marlin_scales_v3(v, k)
            a = marlin_word_v3(words[:, None], s2[None, :])  # each [words, bytes, 2]
            for r in range(4):
                if ROW_HALF[r] != row:
                    continue
                for half in (0, 1):
                    nibble = NIBBLES[r][half]
                    got = a[r][..., half]
                    code = (words[:, None] >> (4 * nibble)) & 0xF
                    want = -e2m1(code) * marlin_f(BYTES)[None, :] * 2.0**-14
                    exact = got.to(torch.bfloat16).double() == got  # the product needs no rounding
                    same = got == want
                    assert (exact & same)[:, VALID].all(), (k, row, r, half)
                    assert not same[:, ~VALID].all(dim=0).any(), "a refused byte decodes exactly"
    # the bf16 subnormal codes (0.5 * 2^-126) and signed zeros went through the multiply
    assert bf16_of(torch.tensor(0x0040)) == 2.0**-127


def test_marlin_v3_refuses_exactly_the_bytes_it_does_not_decode():
    scale = BYTES.to(torch.uint8).view(torch.float8_e4m3fn)
    glob = torch.ones(1)
    for byte in range(256):
        why = experts_mod.marlin_v3_unsupported(scale[byte : byte + 1], glob)
        assert (why is None) == bool(VALID[byte]), (byte, why)
    assert "below" in experts_mod.marlin_v3_unsupported(scale[:1], torch.tensor([2.0**-20]))
    assert experts_mod.marlin_v3_unsupported(scale[:1], torch.tensor([0.0, 2.0**120])) is None


def decode_v3(word: torch.Tensor, nibble: torch.Tensor, byte: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """One code as the V3 kernels weigh it, for emulate_gemm_weights: marlin_word_v3's A
    (its nibble's register and half, the scale byte at the register's row half) times
    the output factor Marlin's global * -2^-112, fp64."""
    reg = torch.tensor([[r for r in range(4) if n in NIBBLES[r]][0] for n in range(8)])[nibble]
    half = (nibble >= 4).long()
    v = byte.long() | (byte.long() << 16)  # the row's byte at both rows: a0..a3 take their own half
    s2 = marlin_scales_v3(v, 0)
    a = marlin_word_v3(word, s2)
    value = torch.zeros(torch.broadcast_shapes(word.shape, nibble.shape, byte.shape), dtype=torch.float64)
    for r in range(4):
        value = torch.where((reg == r) & (half == 0), a[r][..., 0], value)
        value = torch.where((reg == r) & (half == 1), a[r][..., 1], value)
    return value * (glob.double() * -(2.0**-112))


@pytest.mark.parametrize("hidden,inter", [(64, 64), (128, 64), (256, 192)])
def test_marlin_v3_addressing_rebuilds_the_exact_weights(hidden, inter):
    """The Marlin kernels' loads and fragments (test_cuda_experts_marlin) with the V3
    decode and output factor give exact_weights (e2m1 * scale * global in fp64)."""
    experts = random_marlin(2, hidden, inter, torch.Generator().manual_seed(hidden + inter), floor=True)
    m = experts.marlin
    assert m is not None
    want13, want2 = exact_weights(experts)
    f64 = torch.float64
    got13 = torch.stack(
        [
            emulate_gemm_weights(experts.w13[e], m.w13_scale[e], m.w13_global[e], hidden, 2 * inter, decode_v3, f64)
            for e in range(2)
        ]
    )
    got2 = torch.stack(
        [
            emulate_gemm_weights(experts.w2[e], m.w2_scale[e], m.w2_global[e], inter, hidden, decode_v3, f64)
            for e in range(2)
        ]
    )
    assert torch.equal(got13, want13) and torch.equal(got2, want2)


def make_lut_v3(sc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """experts.cu's make_lut_v3: the bf16 of e2m1 * sc (fp32 products), packed as make_lut."""
    e = torch.tensor(nvfp4.E2M1, dtype=torch.float32)
    p = [bf16x2(e[2 * c] * sc, e[2 * c + 1] * sc) for c in range(4)]
    return prmt(p[0], p[1], 0x6420), prmt(p[2], p[3], 0x6420), prmt(p[0], p[1], 0x7531), prmt(p[2], p[3], 0x7531)


def test_nvfp4_v3_table_is_exact_for_every_code_and_finite_scale():
    """Every code at every nibble, every finite e4m3 scale byte (subnormals included):
    the table decode gives the bf16 of e2m1 * scale, which equals it exactly."""
    scale_bytes = torch.tensor([v for v in range(256) if v & 0x7F != 0x7F], dtype=torch.uint8)
    sc = scale_bytes.view(torch.float8_e4m3fn).float()  # e4m3x2_to_float2: exact
    g = torch.Generator().manual_seed(1)
    words = torch.cat((torch.arange(16, dtype=torch.int64) * 0x11111111, torch.randint(0, 2**32, (48,), generator=g)))
    got = bf16_of(decode_word(make_lut_v3(sc[:, None]), words[None, :]))  # [scales, words, 8]
    codes = torch.stack([(words >> (4 * n)) & 0xF for n in range(8)], dim=-1)
    want = e2m1(codes)[None] * sc.double()[:, None, None]
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # signed zeros too


def ptxas_usage(defines: dict[str, int]) -> dict[str, Usage]:
    """Per kernel of experts.cu under these defines: its Usage (ptxas_check)."""
    return kernel_usage(experts_mod.SOURCE, defines, experts_mod.COMPILE_OPTIONS)


def ptx_of(defines: dict[str, int]) -> str:
    """experts.cu's PTX under these defines."""
    return kernel_ptx(experts_mod.SOURCE, defines, experts_mod.COMPILE_OPTIONS)


# SM90's shared memory: 228 KB an SM, at most 227 KB a block, 1 KB of each block's reserved
SM_SHARED, BLOCK_SHARED_MAX, BLOCK_RESERVED = 228 * 1024, 227 * 1024, 1024


def blocks_per_sm_smem(nbytes: int) -> int:
    """Blocks an SM's shared memory holds at ``nbytes`` (static + dynamic) a block."""
    return SM_SHARED // (nbytes + BLOCK_RESERVED) if nbytes <= BLOCK_SHARED_MAX else 0


def assert_kernels_fit(defines: dict[str, int], cls: type, up_shared: int = 0) -> None:
    """Both kernels under ``defines``: no stack or spills, and the registers and shared
    memory (static, plus ``up_shared`` dynamic for the up kernel) of the blocks an SM ``cls``
    launches each on."""
    usage = ptxas_usage(defines)
    for kernel, blocks, shared in (
        ("experts_up_kernel", cls.up_blocks, up_shared),
        ("experts_down_kernel", cls.down_blocks, 0),
    ):
        u = usage[kernel]
        assert u.stack == 0 and u.spills == 0, (kernel, usage)
        assert blocks_per_sm(u.registers) >= blocks, (kernel, u, blocks)
        assert blocks_per_sm_smem(u.smem + shared) >= blocks, (kernel, u, shared, blocks)


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096)])
def test_marlin_v3_occ_compiles_spill_free(width, intermediate):
    """The Marlin V3 _occ variant (registered) at the TP8 rank's expert-TP slice (I 512) and
    EP (whole experts): no stack or spills, and registers that fit the blocks an SM each
    kernel is launched on (down: 4; up: 2)."""
    from sparkdecode_cuda import nvrtc, plugin

    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    cls = experts_mod.CudaExpertsNvfp4MarlinV3Occ
    assert cls in plugin.PROVIDERS and cls.variant == 2 and cls.format == "nvfp4_marlin"
    assert experts_mod.shape_unsupported(width, intermediate, cls.format, 8, 8) is None
    usage = ptxas_usage(cls.kernel_defines(width, intermediate, 8))
    for kernel, blocks in (("experts_up_kernel", cls.up_blocks), ("experts_down_kernel", cls.down_blocks)):
        regs, frame, spills, _ = usage[kernel]
        assert frame == 0 and spills == 0, (kernel, usage)
        assert blocks_per_sm(regs) >= blocks, (kernel, regs, blocks)
    assert (cls.up_blocks, cls.down_blocks) == (2, 4)


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096)])
def test_marlin_v3_ring_compiles_spill_free_and_fits(width, intermediate):
    """The EXPERTS_RING variant (registered) at the TP8 rank's expert-TP slice and EP: no
    stack or spills; the up kernel's registers and its static plus dynamic shared memory
    (the warps' rings of 4 stages, 8 x 4 x 1408 bytes, the K reduction's 32 KB over them)
    fit its 3 blocks an SM, the down kernel's (V3 occ's) its 4."""
    from sparkdecode_cuda import nvrtc, plugin

    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    cls = experts_mod.CudaExpertsNvfp4MarlinV3Ring
    assert cls in plugin.PROVIDERS and (cls.up_blocks, cls.down_blocks, cls.ring) == (3, 4, 4)
    defines = cls.kernel_defines(width, intermediate, 8)
    assert defines["EXPERTS_RING"] == 4 and defines["EXPERTS_V2"] == 2 and defines["EXPERTS_UP_BLOCKS"] == 3
    dynamic = experts_mod.ring_smem_bytes(width, cls.ring)
    assert dynamic == 8 * 4 * (2 * (512 + 64) + 256) and dynamic >= 8 * 8 * 4 * 32 * 4
    assert_kernels_fit(defines, cls, dynamic)


def test_marlin_v3_ring_stages_clip_to_a_warps_steps():
    """ring_smem_bytes as experts.cu's UP_SMEM_BYTES: the stages at most a warp's steps (P 512:
    4 warps along K, 8 steps; P 64: 1 warp, 4 steps), never below the K reduction's sums."""
    stage = 2 * (512 + 64) + 256
    assert experts_mod.ring_smem_bytes(512, 4) == 8 * 4 * stage
    assert experts_mod.ring_smem_bytes(64, 8) == 8 * 4 * stage
    assert experts_mod.ring_smem_bytes(4096, 2) == 8 * 8 * 4 * 32 * 4  # 2 stages: the sums are larger


@pytest.mark.parametrize("wk", [1, 2])
def test_down_wk_refuses_what_it_cannot_tile(wk):
    """EXPERTS_DOWN_WK (the down kernel's warps along K): a width its 64 x 8 / wk rows an item
    do not divide, or an I-slice under one chunk a warp, is refused by name before any compile."""
    fmt = experts_mod.CudaExpertsNvfp4MarlinV3Slice.format
    assert experts_mod.shape_unsupported(4096, 512, fmt, 8, 8, down_wk=wk) is None
    assert "moe_hidden_size 128" in experts_mod.shape_unsupported(128, 512, fmt, 8, 8, down_wk=wk)
    assert "moe_intermediate_size 32" in experts_mod.shape_unsupported(4096, 32, fmt, 8, 8, down_wk=wk)


def test_marlin_v3_slice_builds_one_warp_along_k_or_the_occ_kernel():
    """The Slice variant compiles `_occ`'s kernels with the down kernel on one warp along K
    (EXPERTS_DOWN_WK = 1) at the TP8 rank's expert-TP slice (I 512), spill-free at 4 blocks an
    SM, and exactly `_occ`'s for whole experts (EP, I 4096) and where the width does not tile
    512 rows an item."""
    from sparkdecode_cuda import nvrtc

    cls, occ = experts_mod.CudaExpertsNvfp4MarlinV3Slice, experts_mod.CudaExpertsNvfp4MarlinV3Occ
    assert cls.kernel_defines(4096, 512, 8) == {**occ.kernel_defines(4096, 512, 8), "EXPERTS_DOWN_WK": 1}
    assert cls.kernel_defines(4096, 4096, 8) == occ.kernel_defines(4096, 4096, 8)
    assert cls.kernel_defines(256, 512, 8) == occ.kernel_defines(256, 512, 8)
    assert (cls.down_warps_k(4096, 512), cls.down_warps_k(4096, 4096), cls.down_warps_k(256, 512)) == (1, 8, 4)
    assert occ.down_warps_k(4096, 512) == 4 and cls.down_blocks == 4
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    u = ptxas_usage(cls.kernel_defines(4096, 512, 8))["experts_down_kernel"]
    assert u.stack == 0 and u.spills == 0 and blocks_per_sm(u.registers) >= 4, u


@pytest.mark.parametrize("blocks", [3, 4])
@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096), (512, 512)])
def test_marlin_v3_half_compiles_spill_free(width, intermediate, blocks):
    """EXPERTS_HALF (unregistered): with a warp on the gate or the up rows only, the up kernel
    fits 3 (_half) or 4 (_half4) blocks an SM in registers and shared memory with no stack or
    spills (the down kernel as _occ's, 4 blocks); it refuses a width with one warp along K."""
    from sparkdecode_cuda import nvrtc

    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    cls = experts_mod.CudaExpertsNvfp4MarlinV3Half if blocks == 3 else experts_mod.CudaExpertsNvfp4MarlinV3Half4
    defines = cls.kernel_defines(width, intermediate, 8)
    assert defines["EXPERTS_HALF"] == 1 and defines["EXPERTS_UP_BLOCKS"] == blocks and cls.down_blocks == 4
    assert_kernels_fit(defines, cls)
    import dataclasses

    from sparkdecode.protocols import Deployment
    from sparkdecode.spec import ModelSpec

    tiny = ModelSpec.preset("tiny")
    narrow = dataclasses.replace(tiny, moe_hidden_size=128)
    assert "moe_hidden_size 128" in cls.unsupported(Deployment(narrow, tp=1, device="cuda"))


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096)])
def test_marlin_v3_route_mask_variant_adds_only_its_define(width, intermediate):
    """_half4_mask: _half4's defines plus EXPERTS_ROUTE_MASK, spill-free and fitting; every
    class outside it and its subclasses leaves the define out (their cubins as before)."""
    from sparkdecode_cuda import nvrtc

    cls, parent = experts_mod.CudaExpertsNvfp4MarlinV3Half4Mask, experts_mod.CudaExpertsNvfp4MarlinV3Half4
    defines = cls.kernel_defines(width, intermediate, 8)
    assert defines == {**parent.kernel_defines(width, intermediate, 8), "EXPERTS_ROUTE_MASK": 1}
    others = [c for c in vars(experts_mod).values() if isinstance(c, type) and issubclass(c, experts_mod.CudaExperts)]
    assert [c.name for c in others if c.route_mask and not issubclass(c, cls)] == []
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    assert_kernels_fit(defines, cls)


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096)])
def test_marlin_v3_lean_variant_adds_only_its_define(width, intermediate):
    """_half4_lean: _half4_mask's defines plus EXPERTS_LEAN, spill-free and fitting; no class
    outside it and its subclasses sets the define (every other cubin as before)."""
    from sparkdecode_cuda import nvrtc

    cls, parent = experts_mod.CudaExpertsNvfp4MarlinV3Half4Lean, experts_mod.CudaExpertsNvfp4MarlinV3Half4Mask
    defines = cls.kernel_defines(width, intermediate, 8)
    assert defines == {**parent.kernel_defines(width, intermediate, 8), "EXPERTS_LEAN": 1}
    others = [c for c in vars(experts_mod).values() if isinstance(c, type) and issubclass(c, experts_mod.CudaExperts)]
    assert [c.name for c in others if c.lean and not issubclass(c, cls)] == []
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    assert_kernels_fit(defines, cls)


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096), (512, 256)])
def test_bf16_slice_variant(width, intermediate):
    """cuda.experts_slice2: cuda.experts' defines plus 2 warps along K for the down kernel at
    expert TP's slice (at most SLICE_WK1), cuda.experts' own elsewhere; spill-free and
    fitting 2 blocks an SM."""
    from sparkdecode_cuda import nvrtc

    cls, base = experts_mod.CudaExpertsSlice2, experts_mod.CudaExperts
    defines = cls.kernel_defines(width, intermediate, 8)
    if intermediate <= experts_mod.SLICE_WK1:
        assert defines == {**base.kernel_defines(width, intermediate, 8), "EXPERTS_DOWN_WK": 2}
    else:
        assert defines == base.kernel_defines(width, intermediate, 8)
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    assert_kernels_fit(defines, cls)


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096)])
def test_marlin_v3_early_variant(width, intermediate):
    """_half4_early: _half4_lean's defines plus EXPERTS_EARLY, spill-free and fitting; its up
    kernel takes one more argument, whether the routing is final (RoutedTopk.final), which
    no other class passes."""
    from sparkdecode.protocols import RoutedTopk
    from sparkdecode_cuda import nvrtc

    cls, parent = experts_mod.CudaExpertsNvfp4MarlinV3Half4Early, experts_mod.CudaExpertsNvfp4MarlinV3Half4Lean
    assert cls.kernel_defines(width, intermediate, 8) == {
        **parent.kernel_defines(width, intermediate, 8),
        "EXPERTS_EARLY": 1,
    }
    others = [c for c in vars(experts_mod).values() if isinstance(c, type) and issubclass(c, experts_mod.CudaExperts)]
    assert [c for c in others if c.early and not issubclass(c, cls)] == []  # _half4_scatter is one
    topk = RoutedTopk(torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, 8))
    assert topk.final is False and RoutedTopk(topk.ids, topk.weights, final=True).final is True
    op = cls.__new__(cls)
    assert [a.value for a in op._routing_args(topk._replace(final=True))] == [1]
    assert parent.__new__(parent)._routing_args(topk) == []
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    assert_kernels_fit(cls.kernel_defines(width, intermediate, 8), cls)


@pytest.mark.parametrize(
    "cls,parent,define",
    [
        ("CudaExpertsNvfp4MarlinV3Half4Scatter", "CudaExpertsNvfp4MarlinV3Half4Early", "EXPERTS_DOWN_SCATTER"),
        ("CudaExpertsNvfp4MarlinV3Half4ScatterMasks", "CudaExpertsNvfp4MarlinV3Half4Scatter", "EXPERTS_SLOT_MASKS"),
        ("CudaExpertsNvfp4MarlinV3Half4ScatterUp", "CudaExpertsNvfp4MarlinV3Half4ScatterMasks", "EXPERTS_UP_SCATTER"),
        ("CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue", "CudaExpertsNvfp4MarlinV3Half4ScatterUp", "EXPERTS_DOWN_QUEUE"),
    ],
)
@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096)])
def test_marlin_v3_down_scatter_variants(width, intermediate, cls, parent, define):
    """_half4_scatter (_half4_early's defines plus EXPERTS_DOWN_SCATTER), _half4_scatter_masks
    (that plus EXPERTS_SLOT_MASKS), _half4_scatter_up (that plus EXPERTS_UP_SCATTER) and
    _half4_scatter_up_queue (that plus EXPERTS_DOWN_QUEUE, its down kernel taking the counter
    after the rows): spill-free and fitting at expert TP's slice (the down kernel's 4 warps
    along K, one tile each) and under EP (8 warps along K, four of them owning a tile);
    _half4_scatter_up and _queue registered, _queue above it (faster in the H200's step), the
    other two not (no faster on the H200)."""
    from sparkdecode_cuda import nvrtc, plugin

    cls, parent = getattr(experts_mod, cls), getattr(experts_mod, parent)
    assert cls.kernel_defines(width, intermediate, 8) == {**parent.kernel_defines(width, intermediate, 8), define: 1}
    registered = cls in (
        experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUp,
        experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue,
    )
    assert (cls in plugin.PROVIDERS) == registered
    assert (cls.name in {c.name for c in plugin.PROVIDERS}) == registered
    if cls is experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue:
        assert cls.priority > parent.priority
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    assert_kernels_fit(cls.kernel_defines(width, intermediate, 8), cls)


@pytest.mark.parametrize(
    "cls,parent",
    [
        ("CudaExpertsNvfp4MarlinV3Half4ScatterUpK2", "CudaExpertsNvfp4MarlinV3Half4ScatterUp"),
        ("CudaExpertsNvfp4MarlinV3Half4ScatterUpK1", "CudaExpertsNvfp4MarlinV3Half4ScatterUp"),
    ],
)
@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096)])
def test_marlin_v3_scatter_up_down_wk_variants(width, intermediate, cls, parent):
    """_half4_scatter_up_k2 / _k1: _half4_scatter_up's defines plus
    EXPERTS_DOWN_WK (2 or 1) at expert TP's slice, the parent's own under EP; spill-free and
    fitting; not registered (no faster in the H200 step)."""
    from sparkdecode_cuda import nvrtc, plugin

    cls, parent = getattr(experts_mod, cls), getattr(experts_mod, parent)
    defines, base = cls.kernel_defines(width, intermediate, 8), parent.kernel_defines(width, intermediate, 8)
    if intermediate <= experts_mod.SLICE_WK1:
        assert defines == {**base, "EXPERTS_DOWN_WK": cls.slice_wk}
    else:
        assert defines == base
    assert cls not in plugin.PROVIDERS and cls.name not in {c.name for c in plugin.PROVIDERS}
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    assert_kernels_fit(defines, cls)


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096)])
def test_marlin_v3_stream_loads(width, intermediate):
    """_queue_na (registered above _queue: faster on the H100): _queue's defines plus
    EXPERTS_STREAM_LOADS; spill-free and fitting; the code words' 16-byte loads in the PTX
    past L1, and none without the define; the define outside the V3 Marlin loop is a
    compile error that names it."""
    from sparkdecode_cuda import nvrtc, plugin

    cls, parent = (
        experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNa,
        experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue,
    )
    defines = cls.kernel_defines(width, intermediate, 8)
    assert defines == {**parent.kernel_defines(width, intermediate, 8), "EXPERTS_STREAM_LOADS": 1}
    assert cls in plugin.PROVIDERS and cls.priority > parent.priority
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    assert_kernels_fit(defines, cls)
    assert "no_allocate" not in ptx_of(parent.kernel_defines(width, intermediate, 8))
    # a batch's code words: SB steps of NBLK blocks, in both kernels
    assert len(re.findall(r"ld\.global\.nc\.L1::no_allocate\.v4\.u32", ptx_of(defines))) >= 2
    bf16 = {**experts_mod.CudaExpertsSlice2.kernel_defines(width, intermediate, 8), "EXPERTS_STREAM_LOADS": 1}
    with pytest.raises(AssertionError, match="EXPERTS_STREAM_LOADS is for the V3 Marlin loop"):
        ptx_of(bf16)


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096), (512, 256)])
def test_down_spare(width, intermediate):
    """_queue_na_spare (registered above _queue_na): _queue_na's defines plus
    EXPERTS_DOWN_SPARE; spill-free and fitting; the up kernel's PTX is _queue_na's, the down
    kernel keeps only the L2 prefetches of a block's first item (fewer, but some)."""
    from sparkdecode_cuda import nvrtc, plugin

    cls = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpare
    parent = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNa
    defines, base = cls.kernel_defines(width, intermediate, 8), parent.kernel_defines(width, intermediate, 8)
    assert defines == {**base, "EXPERTS_DOWN_SPARE": 1}
    assert cls in plugin.PROVIDERS and cls.priority > parent.priority
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    assert_kernels_fit(defines, cls)
    variant, plain = ptx_of(defines), ptx_of(base)
    assert ptx_entry(variant, "experts_up_kernel") == ptx_entry(plain, "experts_up_kernel")

    def prefetches(ptx: str) -> int:
        return len(re.findall(r"prefetch\.global\.L2", ptx_entry(ptx, "experts_down_kernel")))

    assert prefetches(plain) > prefetches(variant) > 0  # the first item's, before the PDL wait


def test_down_spare_refuses_other_kernels():
    """EXPERTS_DOWN_SPARE outside the lean V3 Marlin kernels is a compile error naming it."""
    from sparkdecode_cuda import nvrtc

    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    with pytest.raises(AssertionError, match="EXPERTS_DOWN_SPARE is for"):
        ptx_of({**experts_mod.CudaExpertsSlice2.kernel_defines(4096, 512, 8), "EXPERTS_DOWN_SPARE": 1})


@pytest.mark.parametrize("width,intermediate,spills", [(4096, 512, 0), (4096, 4096, 16), (512, 256, 32)])
def test_down_carry(width, intermediate, spills):
    """_queue_na_spare_carry (registered above _queue_na_spare): _queue_na_spare's defines plus
    EXPERTS_DOWN_CARRY. The up kernel's PTX is _queue_na_spare's. In the down kernel a
    batch's MMAs appear twice (the carried first batch's, then the K loop's), and a batch's
    code-word loads three times (the first item's before the PDL wait, the next item's after
    each K loop, the K loop's own). Spill-free at expert TP's
    slice; under EP and at the tiny shape ptxas spills a word or two a thread outside the K
    loop (the carried batch held through the item's tail at 64 registers)."""
    from sparkdecode_cuda import nvrtc, plugin

    cls = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry
    parent = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpare
    defines, base = cls.kernel_defines(width, intermediate, 8), parent.kernel_defines(width, intermediate, 8)
    assert defines == {**base, "EXPERTS_DOWN_CARRY": 1}
    assert cls in plugin.PROVIDERS and cls.priority > parent.priority
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    usage = ptxas_usage(defines)["experts_down_kernel"]
    assert usage.spills <= spills and blocks_per_sm(usage.registers) >= cls.down_blocks, usage
    assert blocks_per_sm_smem(usage.smem) >= cls.down_blocks, usage
    variant, plain = ptx_of(defines), ptx_of(base)
    assert ptx_entry(variant, "experts_up_kernel") == ptx_entry(plain, "experts_up_kernel")
    down, down_plain = ptx_entry(variant, "experts_down_kernel"), ptx_entry(plain, "experts_down_kernel")
    assert down.count("mma.sync") == 2 * down_plain.count("mma.sync") > 0

    def code_loads(ptx: str) -> int:
        return len(re.findall(r"ld\.global\.nc\.L1::no_allocate\.v4\.u32", ptx))

    steps = intermediate // cls.down_warps_k(width, intermediate) // 16
    assert code_loads(down) == code_loads(down_plain) + 2 * min(steps, 4)


def test_down_carry_refuses_other_kernels():
    """EXPERTS_DOWN_CARRY without the spare prefetches and the queue is a compile error
    naming it."""
    from sparkdecode_cuda import nvrtc

    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    defines = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNa.kernel_defines(4096, 512, 8)
    with pytest.raises(AssertionError, match="EXPERTS_DOWN_CARRY is for"):
        ptx_of({**defines, "EXPERTS_DOWN_CARRY": 1})


@pytest.mark.parametrize("width,intermediate,spills", [(4096, 512, 0), (4096, 4096, 16), (512, 256, 32)])
def test_down_carry2(width, intermediate, spills):
    """_queue_na_spare_carry2 (registered): _carry's defines with EXPERTS_DOWN_CARRY = 2.
    The up kernel's PTX is _carry's. The down kernel has the same MMAs and loads, and one
    plain barrier fewer in its item: the claim's and the K reduction's first barriers
    become one barrier-reduction on a sum of the K loop (the barrier of a launch holding
    no expert stays plain)."""
    from sparkdecode_cuda import nvrtc, plugin

    cls = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2
    parent = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry
    defines, base = cls.kernel_defines(width, intermediate, 8), parent.kernel_defines(width, intermediate, 8)
    assert defines == {**base, "EXPERTS_DOWN_CARRY": 2}
    assert cls in plugin.PROVIDERS and cls.priority > parent.priority
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    usage = ptxas_usage(defines)["experts_down_kernel"]
    assert usage.spills <= spills and blocks_per_sm(usage.registers) >= cls.down_blocks, usage
    variant, plain = ptx_of(defines), ptx_of(base)
    assert ptx_entry(variant, "experts_up_kernel") == ptx_entry(plain, "experts_up_kernel")
    down, down_plain = ptx_entry(variant, "experts_down_kernel"), ptx_entry(plain, "experts_down_kernel")
    for op in ("mma.sync", "ld.global.nc.L1::no_allocate.v4.u32"):
        assert down.count(op) == down_plain.count(op) > 0, op
    assert down.count("bar.sync") == down_plain.count("bar.sync") - 1
    assert down.count("bar.red.or") == 1 and "bar.red" not in down_plain


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (512, 256)])
def test_carry2_evict_hints_the_code_loads(width, intermediate):
    """_carry2_evict (not registered): _carry2's defines with EXPERTS_STREAM_LOADS = 2. Both
    kernels' code-word loads (every one past L1) carry the evict-first L2 policy word, and
    nothing else changes: the same count of those loads and of MMAs as _carry2's, no more
    spills, the down kernel's blocks an SM kept."""
    from sparkdecode_cuda import nvrtc, plugin

    cls = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2Evict
    parent = experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2
    defines, base = cls.kernel_defines(width, intermediate, 8), parent.kernel_defines(width, intermediate, 8)
    assert defines == {**base, "EXPERTS_STREAM_LOADS": 2}
    assert cls not in plugin.PROVIDERS
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    usage, base_usage = ptxas_usage(defines), ptxas_usage(base)
    down = usage["experts_down_kernel"]
    assert down.spills <= base_usage["experts_down_kernel"].spills, down
    assert blocks_per_sm(down.registers) >= cls.down_blocks, down
    assert usage["experts_up_kernel"].spills <= base_usage["experts_up_kernel"].spills
    variant, plain = ptx_of(defines), ptx_of(base)
    for kernel in ("experts_up_kernel", "experts_down_kernel"):
        hinted, unhinted = ptx_entry(variant, kernel), ptx_entry(plain, kernel)
        loads = re.findall(r"ld\.global\.nc\.L1::no_allocate[^;]*;", hinted)
        assert loads and all(".L2::cache_hint.v4.u32" in load for load in loads), kernel
        assert len(loads) == unhinted.count("ld.global.nc.L1::no_allocate.v4.u32") > 0, kernel
        assert "L2::cache_hint" not in unhinted
        assert hinted.count("mma.sync") == unhinted.count("mma.sync") > 0, kernel
        words = set(re.findall(r"mov\.[ub]64\s+%rd\d+, (-?\d+);", hinted))
        assert str(0x12F0000000000000) in words, kernel
