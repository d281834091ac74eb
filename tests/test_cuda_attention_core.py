"""cuda.attention_core on the CPU: its kernels compile spill-free for the shapes it
takes, it says which deployments it does not take, and the split-KV algorithm of
kernels/attention_core.cu, emulated step for step in torch (the key range, the tiles
of 64 aligned positions, each split's run of tiles, the per-row masks, the online
softmax in exp2, the probabilities as two bf16 terms, the combine in runs of splits met by a butterfly),
equals the reference core. The kernel itself (its MMA fragments) is checked against
the reference on the GPU (tests/test_gpu_cuda_attention_core.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from sparkdecode.deployment import detect
from sparkdecode.reference import functional as fn
from sparkdecode.spec import ModelSpec

core_mod = pytest.importorskip("sparkdecode_cuda.attention_core")
TILE, MROWS = core_mod.TILE, core_mod.MROWS


def emulate(q, k, v, table, seq_len, rows, window, scale, splits, group, per=1):
    """attention_split_kernel then attention_combine_kernel, in torch (fp32), built with
    a grid of ``splits`` blocks a KV head (the step uses active_splits of them, about
    ``per`` tiles each)."""
    hkv, d = k.shape[2], k.shape[3]
    page_size = k.shape[1]
    scale_log2 = scale * math.log2(math.e)
    first, hi = seq_len - rows, seq_len - 1
    lo = max(first - window + 1, 0) if window else 0
    base0 = lo & ~(TILE - 1)
    tiles = (hi - base0) // TILE + 1
    active = core_mod.active_splits(tiles, splits, per)
    r = torch.arange(MROWS)
    tok, head = r // group, r % group
    ok = tok < rows
    pos = first + tok
    row_lo = pos - window + 1 if window else torch.zeros_like(pos)
    out = torch.zeros(rows, hkv * group, d)
    neg = torch.tensor(float("-inf"))
    for h in range(hkv):
        qh = torch.zeros(MROWS, d)
        qh[ok] = q[tok[ok], h * group + head[ok]].float()
        splits_out = []
        for s in range(active):
            m, l, o = torch.full((MROWS,), float("-inf")), torch.zeros(MROWS), torch.zeros(MROWS, d)
            for tile in range(s * tiles // active, (s + 1) * tiles // active):
                kp = base0 + tile * TILE + torch.arange(TILE)
                seen = (kp >= lo) & (kp <= hi)
                kt, vt = torch.zeros(TILE, d), torch.zeros(TILE, d)
                page, off = table[kp[seen] // page_size].long(), kp[seen] % page_size
                kt[seen], vt[seen] = k[page, off, h].float(), v[page, off, h].float()
                visible = ok[:, None] & (kp[None, :] <= pos[:, None]) & (kp[None, :] >= row_lo[:, None])
                x = torch.where(visible, (qh @ kt.T) * scale_log2, neg)
                n = torch.maximum(m, x.max(dim=1).values)
                empty = n == float("-inf")
                a = torch.where(empty, 1.0, torch.exp2(m - n))
                p = torch.where(empty[:, None], 0.0, torch.exp2(x - n[:, None]))
                l, o, m = l * a + p.sum(dim=1), o * a[:, None], n
                p_hi = p.to(torch.bfloat16).float()
                p_lo = (p - p_hi).to(torch.bfloat16).float()
                o = o + p_hi @ vt + p_lo @ vt
            splits_out.append((m, l, o))
        res = combine_parts(splits_out, core_mod.PARTS)
        out[tok[ok], h * group + head[ok]] = res[ok]
    return out.to(torch.bfloat16)


def combine_parts(splits, parts):
    """attention_combine_kernel: each part's contiguous run of splits
    summed scaled to the run's max, then the parts met by the butterfly over lanes (xor 1,
    2, 4), each side rescaled to the larger max; part 0's result."""
    active, neg = len(splits), float("-inf")
    state = []
    for p in range(parts):
        run = splits[p * active // parts : (p + 1) * active // parts]
        m_loc = torch.stack([m for m, _, _ in run]).max(dim=0).values if run else torch.full_like(splits[0][1], neg)
        l, acc = torch.zeros_like(splits[0][1]), torch.zeros_like(splits[0][2])
        for m, ls, o in run:
            w = torch.where(m == neg, 0.0, torch.exp2(m - m_loc))
            l, acc = l + w * ls, acc + w[:, None] * o
        state.append((m_loc, l, acc))
    off = 1
    while off < parts:
        new = []
        for p in range(parts):
            (m, l, acc), (mo, lo, ao) = state[p], state[p ^ off]
            mn = torch.maximum(m, mo)
            a = torch.where(m == neg, 0.0, torch.exp2(m - mn))
            b = torch.where(mo == neg, 0.0, torch.exp2(mo - mn))
            new.append((mn, a * l + b * lo, a[:, None] * acc + b[:, None] * ao))
        state, off = new, off * 2
    _, l, acc = state[0]
    return acc / l[:, None]


def paged_cache(pages: int, page_size: int, hkv: int, d: int, g: torch.Generator):
    k = torch.randn(pages, page_size, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(pages, page_size, hkv, d, generator=g).to(torch.bfloat16)
    table = torch.randperm(pages, generator=g).to(torch.int32)  # pages in no order
    return k, v, table


@pytest.mark.parametrize("per", [1, 2])  # key tiles a split: the core's (TILES_A_SPLIT), and two
@pytest.mark.parametrize("window", [None, 64, 200])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_split_kv_algorithm_equals_the_reference(window, rows, per):
    """Contexts at tile and window edges, fewer tiles than splits and more; grids of 16
    blocks a KV head, the provider's at this max context, and 3 (fewer than most lengths
    ask for, so more tiles a split)."""
    g = torch.Generator().manual_seed(rows * 7 + (window or 0))
    hkv, group, d, page_size, max_context = 2, 8, 64, 16, 1024
    k, v, table = paged_cache(max_context // page_size, page_size, hkv, d, g)
    scale = 64**-0.5
    worst = 0.0
    for seq_len in (8, 9, 63, 64, 65, 70, 128, 129, 200, 201, 263, 500, 1000, 1024):
        if seq_len < rows:
            continue
        q = torch.randn(rows, hkv * group, d, generator=g).to(torch.bfloat16)
        positions = torch.arange(seq_len - rows, seq_len)
        ref = fn.paged_attention(q, positions, k, v, table, window, scale, max_context)
        for splits in (16, core_mod.splits_for(max_context, per), 3):
            got = emulate(q, k, v, table, seq_len, rows, window, scale, splits, group, per)
            err = ((got.float() - ref.float()).flatten(1).norm(dim=1) / ref.float().flatten(1).norm(dim=1)).max()
            worst = max(worst, err.item())
            assert err < 4e-3, (seq_len, splits, err)  # the output's bf16 rounding, a few ulps at most
    print(f"\nlargest row error {worst:.2e}")


def test_active_splits_follow_the_length():
    """The splits a step uses: about two tiles each, at least 16 where there are as many
    tiles, never a split without a tile, at most the grid; the same at a grid of 128 (a
    long max_model_len) as at the grid a build for the context itself has."""
    act = core_mod.active_splits
    assert [act(t, 128, 2) for t in (1, 2, 15, 16, 17, 32, 33, 64, 65, 255, 256, 300)] == [
        1, 2, 15, 16, 16, 16, 17, 32, 33, 128, 128, 128,
    ]  # fmt: skip
    assert act(65, 33, 2) == 33 and act(300, 16) == 16
    assert [act(t, 128) for t in (1, 15, 16, 17, 64, 65, 128, 129)] == [1, 15, 16, 17, 64, 65, 128, 128]
    for per in (1, 2):
        for context in range(9, 20000, 37):
            tiles = (context - 1) // TILE + 1  # a full layer's tiles at this length
            active = act(tiles, 128, per)
            assert active == act(tiles, core_mod.splits_for(context, per), per) and 1 <= active <= tiles
            assert all((s + 1) * tiles // active > s * tiles // active for s in range(active))


def test_a_long_build_runs_a_short_context_alike():
    """The emulated kernels at a grid of 128 (the served max_model_len) and at the grid of
    a build for the context: the same bits."""
    g = torch.Generator().manual_seed(5)
    hkv, group, d, page_size, pages = 2, 8, 64, 16, 200
    k, v, table = paged_cache(pages, page_size, hkv, d, g)
    for seq_len, window in ((700, None), (3000, None), (3000, 512)):
        q = torch.randn(8, hkv * group, d, generator=g).to(torch.bfloat16)
        short = emulate(q, k, v, table, seq_len, 8, window, 0.125, core_mod.splits_for(seq_len), group)
        assert torch.equal(emulate(q, k, v, table, seq_len, 8, window, 0.125, core_mod.MAX_SPLITS, group), short)


def test_kernel_constants_match():
    """The provider's launch shapes are the kernel's defines."""
    from sparkdecode_cuda import nvrtc

    text = nvrtc.source(core_mod.SOURCE)
    constants = (
        ("MROWS", MROWS),
        ("TILE", TILE),
        ("PARTS", core_mod.PARTS),
        ("WARPS", 4),
        ("MIN_SPLITS", core_mod.MIN_SPLITS),
    )
    for name, value in constants:
        assert f"#define {name} {value}\n" in text, name
    assert [core_mod.splits_for(c) for c in (64, 1024, 4096, 8192, 32768)] == [16, 17, 65, 128, 128]
    assert [core_mod.splits_for(c, 2) for c in (64, 1024, 4096, 32768, 131072)] == [16, 16, 33, 128, 128]
    # a sliding layer's splits cover its window and the step's rows, a full layer's the context
    assert core_mod.keys_seen(32768, 2048, 8) == 2056 and core_mod.splits_for(2056) == 33
    assert core_mod.keys_seen(32768, None, 8) == 32768 and core_mod.keys_seen(1024, 2048, 8) == 1024


@pytest.mark.parametrize("max_context", [1000, 2056, 4096, 32768])  # 16 to 128 splits
def test_kernels_compile_spill_free(max_context):
    nvrtc = pytest.importorskip("sparkdecode_cuda.nvrtc")
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    from ptxas_check import assert_spill_free

    defines = core_mod.kernel_defines(8, max_context, core_mod.CudaAttentionCore.tiles_a_split)
    usage = assert_spill_free(core_mod.SOURCE, defines, core_mod.COMPILE_OPTIONS)
    assert set(usage) == {"attention_split_kernel", "attention_combine_kernel", "attention_gated_combine_kernel"}
    assert usage["attention_split_kernel"].registers <= 255 and usage["attention_split_kernel"].smem <= 48 * 1024
    assert usage["attention_combine_kernel"].registers <= 255


def test_registered():
    from sparkdecode_cuda import plugin

    assert core_mod.CudaAttentionCore in plugin.PROVIDERS


def test_unsupported_names_the_shape():
    """Off Hopper, another head_dim, more query rows a KV head than one tile of 64: a
    sentence naming it; the TP8 rank's and TP1's Muse Spark shapes at 8 rows: taken."""
    nvrtc = pytest.importorskip("sparkdecode_cuda.nvrtc")
    cls = core_mod.CudaAttentionCore
    spec = ModelSpec.preset("muse-spark-open")
    cpu = detect(spec, device="cpu", max_rows=8)
    assert cls.unsupported(cpu) == "needs a CUDA GPU"
    hopper = dataclasses.replace(cpu, device="cuda", capability=(9, 0))
    if nvrtc.nvrtc_unavailable() is None:
        assert cls.unsupported(hopper) is None
        assert cls.unsupported(dataclasses.replace(hopper, tp=8)) is None
        wide = dataclasses.replace(spec, head_dim=128, num_attention_heads=64, num_key_value_heads=8)
        assert "head_dim 128" in cls.unsupported(dataclasses.replace(hopper, spec=wide))
        assert "16 rows x 8 query heads" in cls.unsupported(dataclasses.replace(hopper, max_rows=16))
    # head layouts a valid spec can carry that the kernel cannot: groups of 6, uneven groups
    assert "GQA groups of 6" in core_mod._group_unsupported(48, 8, 8)
    assert "whole GQA groups" in core_mod._group_unsupported(100, 8, 1)
    assert core_mod._group_unsupported(128, 16, 8) is None and core_mod._group_unsupported(16, 2, 8) is None
