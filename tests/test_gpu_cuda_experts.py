"""providers_cuda's routed experts (cuda.experts, cuda.experts_nvfp4, and
cuda.experts_nvfp4_marlin on vLLM's SM90 Marlin layout, made by nvfp4_marlin.marlin_form)
on a Hopper GPU against the reference (marker gpu).

Bounds, and why: the NVFP4 values are dequantized to the reference's bf16 bits
(checked exactly below), x and the weights are the same bf16 numbers, and both GEMM
outputs and SwiGLU round to bf16 where the reference rounds; only the GEMMs' fp32
sums run in another order (the MMA's 16-value steps, the warps' K-slices added in
warp order, against cuBLAS's order). So each output is within a few fp32 roundings
of the reference before its bf16 rounding: one bf16 ulp (2^-8 relative) where that
crosses a rounding boundary, and after the SwiGLU of such a flipped value, a few
ulps in rare elements. Asserted: relative Frobenius error below 2^-8 and every
element within 4 ulps of the reference's magnitude plus 1e-3 of the row's scale.
With inputs whose products and sums are exact in fp32 (small integers times powers
of two), the orders cannot differ and the outputs are asserted bit for bit: that
checks the in-register dequantization against nvfp4.dequantize (Marlin's layout:
nvfp4_marlin.dequantize) exactly.

The "-v3" formats (EXPERTS_V3: the weights e2m1 * block scale exact in bf16, the global
on the fp32 sums, as vLLM's Marlin kernel computes) are not rounded weight by weight,
so they are held to the exact quantized model instead (expert_check's
assert_experts_close_exact: error against exact weights at most the reference's), and
their single-term outputs to the bf16 of the fp32 rounding of the exact products.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from expert_check import assert_experts_close, assert_experts_close_exact, exact_weights
from marlin_pack import random_marlin
from sparkdecode.bench.timing import Timer
from sparkdecode.nvfp4_marlin import marlin_form
from sparkdecode.protocols import BuildContext, ExpertsInput, RoutedTopk
from sparkdecode.reference import functional as fn
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import ExpertWeights, Nvfp4Scales, Sharding, quantize_experts
from sparkdecode.weights import _shard_experts as shard_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]

experts_mod = pytest.importorskip("sparkdecode_cuda.experts")
bulk_mod = pytest.importorskip("sparkdecode_cuda.experts_bulk")


def context(spec: ModelSpec, experts: ExpertWeights, max_rows: int = 8) -> BuildContext:
    layer = dataclasses.make_dataclass("L", [("experts", ExpertWeights)])(experts)
    weights = dataclasses.make_dataclass("W", [("layers", list)])([layer])
    return BuildContext(
        spec=spec,
        weights=weights,
        tp=1,
        rank=0,
        device=torch.device("cuda"),
        group=None,
        deployment=None,
        buffers={},
        aux_layers=(),
        max_rows=max_rows,
        max_context=1024,
        mailboxes=[],
        ops={},
    )


def random_experts(spec: ModelSpec, fmt: str, sharding: Sharding, seed: int) -> ExpertWeights:
    """A TP-1 draw of the full experts (quantized as the checkpoint is), cut as
    shard_weights cuts them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, P, I = spec.E, spec.P, spec.I  # noqa: E741, N806
    w13 = torch.empty(E, 2 * I, P, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(E, P, I, dtype=torch.bfloat16, device="cuda")
    for e in range(E):  # an expert at a time: no full-size fp32 temporary at the real widths
        w13[e].copy_(torch.randn(2 * I, P, generator=g, device="cuda") * P**-0.5)
        w2[e].copy_(torch.randn(P, I, generator=g, device="cuda") * I**-0.5)
    full = ExpertWeights("bf16", w13, w2)
    if fmt != "bf16":
        full = quantize_experts(full)
    rank = full if sharding.tp == 1 else shard_experts(spec, full, sharding)
    return marlin_form(rank) if fmt == "nvfp4_marlin" else rank  # vLLM repacks each rank's experts


def routing(b: int, k: int, experts: int, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "distinct":
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(b)])
    else:  # every row picks among the same few experts: duplicates across rows
        pool = torch.randperm(experts, generator=g)[: max(k, 3)]
        ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(b)])
    return ids.to(torch.int32).cuda()


def close(out: torch.Tensor, experts: ExpertWeights, x: torch.Tensor, ids: torch.Tensor, exact: bool = False) -> None:
    """The kernel's rows against the reference's, both measured against exact sums
    (tests/expert_check.py says why and how); ``exact``: a V3 kernel, against the exact
    quantized weights."""
    w13, w2 = experts.dequantized()
    ref = fn.expert_rows(x, ids, w13, w2, experts.first_expert)
    if exact:
        assert_experts_close_exact(out, ref, x, ids, experts)
    else:
        assert_experts_close(out, ref, x, ids, w13, w2, experts.first_expert)


SHAPES = {
    # name: (spec, sharding)
    "tiny": (ModelSpec.preset("tiny"), Sharding()),
    "tiny-ep2": (ModelSpec.preset("tiny"), Sharding(tp=2, rank=1, expert_parallel="ep")),
    "tp8-rank-expert-tp": (ModelSpec.preset("muse-spark-open"), Sharding(tp=8, rank=3, expert_parallel="tp")),
    "tp8-rank-ep": (ModelSpec.preset("muse-spark-open"), Sharding(tp=8, rank=5, expert_parallel="ep")),
}


def provider(fmt: str):
    """A format's provider; "bf16-slice2": bf16 with the down kernel on 2 warps along K at expert TP's
    slice, "-v2": its EXPERTS_V2 variant, "-bulk": the bulk-copy kernels, "-v3": its EXPERTS_V3
    variant, "-v3occ": Marlin V3 with the down kernel on 4 blocks an SM, "-v3ring": -v3occ with
    EXPERTS_RING (the up kernel's loads through shared-memory rings, 3 blocks an SM),
    "-v3slice": -v3occ with the down kernel on one warp along K (EXPERTS_DOWN_WK = 1) at expert
    TP's slice, "-v3half": -v3occ with EXPERTS_HALF (each up warp on the gate or the up rows, 3
    blocks an SM), "-v3half4": the same on 4 blocks an SM, "-v3half4mask": -v3half4 with
    EXPERTS_ROUTE_MASK, "-v3half4lean": that with EXPERTS_LEAN, "-v3half4early": -v3half4lean
    with EXPERTS_EARLY (the experts found before the PDL wait when the routing is final at
    launch), "-v3half4scatter": -v3half4early with EXPERTS_DOWN_SCATTER (the down kernel's K
    reduction as a reduce-scatter), "-v3half4scattermasks": that with EXPERTS_SLOT_MASKS (the
    route masks made once a block), "-v3half4scatterup": that with EXPERTS_UP_SCATTER (the up
    kernel's item tail shared too), "-v3half4scatterupk2" / "-v3half4scatterupk1": that with the
    down kernel's warps 2 or 1 along K at expert TP's slice, "-v3half4scatterupqueue":
    -v3half4scatterup with EXPERTS_DOWN_QUEUE (the down kernel's items claimed from a counter),
    "-v3half4scatterupqueuena": that with EXPERTS_STREAM_LOADS (the code words' loads past L1),
    "-v3half4scatterupqueuenaspare": that with the down kernel's L2 prefetches only its
    blocks' first items' (EXPERTS_DOWN_SPARE), "-v3half4scatterupqueuenasparecarry": that with
    each down warp's next item's first batch carried in registers (EXPERTS_DOWN_CARRY),
    "-v3half4scatterupqueuenasparecarry2": that with one barrier an item fewer
    (EXPERTS_DOWN_CARRY = 2), "-v3half4scatterupqueuenasparecarry2evict": that with the code
    words' loads hinted evict-first in L2 (EXPERTS_STREAM_LOADS = 2),
    "-v3bulk" / "-v3bulk2": the bulk-copy kernels with the V3 decode, on 1 / 2 blocks an SM (the
    checkpoint layout's V3, _half4_mask, _half4_scatter, _half4_scatter_masks, _k2, _k1 and the
    two V3 bulk unregistered)."""
    return {
        "bf16": experts_mod.CudaExperts,
        "bf16-slice2": experts_mod.CudaExpertsSlice2,
        "nvfp4": experts_mod.CudaExpertsNvfp4,
        "nvfp4_marlin": experts_mod.CudaExpertsNvfp4Marlin,
        "nvfp4-v2": experts_mod.CudaExpertsNvfp4V2,
        "nvfp4_marlin-v2": experts_mod.CudaExpertsNvfp4MarlinV2,
        "nvfp4_marlin-bulk": bulk_mod.CudaExpertsNvfp4MarlinBulk,
        "nvfp4-v3": experts_mod.CudaExpertsNvfp4V3,
        "nvfp4_marlin-v3": experts_mod.CudaExpertsNvfp4MarlinV3,
        "nvfp4_marlin-v3occ": experts_mod.CudaExpertsNvfp4MarlinV3Occ,
        "nvfp4_marlin-v3ring": experts_mod.CudaExpertsNvfp4MarlinV3Ring,
        "nvfp4_marlin-v3slice": experts_mod.CudaExpertsNvfp4MarlinV3Slice,
        "nvfp4_marlin-v3half": experts_mod.CudaExpertsNvfp4MarlinV3Half,
        "nvfp4_marlin-v3half4": experts_mod.CudaExpertsNvfp4MarlinV3Half4,
        "nvfp4_marlin-v3half4mask": experts_mod.CudaExpertsNvfp4MarlinV3Half4Mask,
        "nvfp4_marlin-v3half4lean": experts_mod.CudaExpertsNvfp4MarlinV3Half4Lean,
        "nvfp4_marlin-v3half4early": experts_mod.CudaExpertsNvfp4MarlinV3Half4Early,
        "nvfp4_marlin-v3half4scatter": experts_mod.CudaExpertsNvfp4MarlinV3Half4Scatter,
        "nvfp4_marlin-v3half4scattermasks": experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterMasks,
        "nvfp4_marlin-v3half4scatterup": experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUp,
        "nvfp4_marlin-v3half4scatterupk2": experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpK2,
        "nvfp4_marlin-v3half4scatterupk1": experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpK1,
        "nvfp4_marlin-v3half4scatterupqueue": experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue,
        "nvfp4_marlin-v3half4scatterupqueuena": experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNa,
        "nvfp4_marlin-v3half4scatterupqueuenaspare": experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpare,
        "nvfp4_marlin-v3half4scatterupqueuenasparecarry": (
            experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry
        ),
        "nvfp4_marlin-v3half4scatterupqueuenasparecarry2": (
            experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2
        ),
        "nvfp4_marlin-v3half4scatterupqueuenasparecarry2evict": (
            experts_mod.CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2Evict
        ),
        "nvfp4_marlin-v3bulk": bulk_mod.CudaExpertsNvfp4MarlinBulkV3,
        "nvfp4_marlin-v3bulk2": bulk_mod.CudaExpertsNvfp4MarlinBulkV3x2,
    }[fmt]


def weight_format(fmt: str) -> str:
    return fmt.split("-")[0]


def exact(fmt: str) -> bool:
    """Whether the kernels keep the weights unrounded (EXPERTS_V3 and its variants)."""
    return "-v3" in fmt


def dequantized(experts: ExpertWeights, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights a format's kernels compute a one-term output of: the reference's bf16
    ones, or for V3 the bf16 of the fp32 of the exact ones (the sum times the global,
    rounded once in fp32, then to bf16)."""
    if not exact(fmt):
        return experts.dequantized()
    w13, w2 = exact_weights(experts)
    return w13.float().to(torch.bfloat16), w2.float().to(torch.bfloat16)


NVFP4_FORMATS = [f"nvfp4{v}" for v in ("", "-v2", "-v3")] + [
    f"nvfp4_marlin{v}"
    for v in (
        "",
        "-v2",
        "-bulk",
        "-v3",
        "-v3occ",
        "-v3ring",
        "-v3slice",
        "-v3half",
        "-v3half4",
        "-v3half4mask",
        "-v3half4lean",
        "-v3half4early",
        "-v3half4scatter",
        "-v3half4scattermasks",
        "-v3half4scatterup",
        "-v3half4scatterupk2",
        "-v3half4scatterupk1",
        "-v3half4scatterupqueue",
        "-v3bulk",
        "-v3bulk2",
    )
]
FORMATS = ["bf16", "bf16-slice2", *NVFP4_FORMATS]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_experts_equal_reference(fmt, shape):
    spec, sharding = SHAPES[shape]
    experts = random_experts(spec, weight_format(fmt), sharding, seed=len(shape))
    ctx = context(spec, experts)
    op = provider(fmt).build(ctx, 0)
    g = torch.Generator().manual_seed(7)
    for b in (1, 3, 8):
        for kind in ("distinct", "duplicates"):
            x = torch.randn(b, spec.P, generator=g).to(torch.bfloat16).cuda()
            ids = routing(b, spec.top_k, spec.E, kind, g)
            rows = torch.full((b, spec.top_k, spec.P), float("nan"), dtype=torch.bfloat16, device="cuda")
            op.run(ExpertsInput(x), RoutedTopk(ids, torch.ones(b, spec.top_k, device="cuda")), rows)
            torch.cuda.synchronize()
            close(rows, experts, x, ids, exact(fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_replay_with_changing_ids(fmt):
    """One graph capture, replayed with new ids and x each time (no host sync)."""
    spec, sharding = SHAPES["tp8-rank-expert-tp"]
    experts = random_experts(spec, weight_format(fmt), sharding, seed=3)
    op = provider(fmt).build(context(spec, experts), 0)
    b, k = 8, spec.top_k
    x = torch.zeros(b, spec.P, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(b, k, dtype=torch.int32, device="cuda")
    weights = torch.ones(b, k, device="cuda")
    rows = torch.zeros(b, k, spec.P, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op.run(ExpertsInput(x), RoutedTopk(ids, weights), rows)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.run(ExpertsInput(x), RoutedTopk(ids, weights), rows)
    g = torch.Generator().manual_seed(11)
    for i in range(6):
        x.copy_(torch.randn(b, spec.P, generator=g).to(torch.bfloat16))
        ids.copy_(routing(b, k, spec.E, "distinct" if i % 2 else "duplicates", g))
        rows.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        close(rows, experts, x, ids, exact(fmt))


def exact_nvfp4_experts(spec: ModelSpec, num: int, intermediate: int, g: torch.Generator) -> ExpertWeights:
    """NVFP4 experts with random codes, random finite e4m3 scales (subnormals too) and
    random fp32 globals: their dequantized values round in fp32 and in bf16."""
    P = spec.P  # noqa: N806

    def part(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (num, rows, cols // 2), generator=g, dtype=torch.uint8)
        scale = torch.randint(1, 0x7F, (num, rows, cols // 16), generator=g, dtype=torch.uint8)
        return codes.cuda(), scale.view(torch.float8_e4m3fn).cuda()

    w13, w13_scale = part(2 * intermediate, P)
    w2, w2_scale = part(P, intermediate)
    w13_global = ((1 + torch.rand(num, 2, generator=g)) * 2**-9).cuda()
    w2_global = ((1 + torch.rand(num, generator=g)) * 2**-9).cuda()
    return ExpertWeights("nvfp4", w13, w2, nvfp4=Nvfp4Scales(w13_scale, w13_global, w2_scale, w2_global))


@pytest.mark.parametrize("fmt", NVFP4_FORMATS)
def test_nvfp4_dequantization_bit_exact(fmt):
    """x one-hot at column c: the up GEMM's sum has one term, so gate and up are the
    dequantized W13 column c itself and the act buffer (bf16(silu(gate) * up), one
    slot per expert in route order) must equal the reference's SwiGLU of
    nvfp4.dequantize's bf16 values bit for bit, at columns across scale blocks.
    Marlin's layout: random words, every finite scale byte, random globals (V3: the
    bytes vLLM's repack makes, 0 and 0x80..0xf7; its weights: ``dequantized``)."""
    spec = dataclasses.replace(ModelSpec.preset("muse-spark-open"), moe_intermediate_size=512)
    g = torch.Generator().manual_seed(5)
    if weight_format(fmt) == "nvfp4":
        experts = exact_nvfp4_experts(spec, 4, 512, g)
    else:
        experts = random_marlin(4, spec.P, 512, g, device="cuda", floor=exact(fmt))
    op = provider(fmt).build(context(spec, experts), 0)
    w13, _ = dequantized(experts, fmt)
    k = spec.top_k
    ids = (torch.arange(k, dtype=torch.int32) % 4)[None].cuda()  # experts 0..3, each twice
    for col in (0, 1, 15, 16, 17, 31, 32, 100, 2049, spec.P - 1):
        x = torch.zeros(1, spec.P, dtype=torch.bfloat16, device="cuda")
        x[0, col] = 1.0
        rows = torch.empty(1, k, spec.P, dtype=torch.bfloat16, device="cuda")
        op.run(ExpertsInput(x), RoutedTopk(ids, torch.ones(1, k, device="cuda")), rows)
        torch.cuda.synchronize()
        for slot in range(4):
            want = fn.swiglu(w13[slot][:, col][None], 512)[0]
            assert torch.equal(op.act[slot, 0], want), (col, slot)  # values: -0 == +0
        close(rows, experts, x, ids, exact(fmt))


@pytest.mark.parametrize("fmt", NVFP4_FORMATS)
def test_nvfp4_down_projection_bit_exact(fmt):
    """act with one nonzero column per row: the down GEMM's sum has one term, so the
    rows are W2's dequantized column times an exact bf16 value: bit for bit (V3: the
    exact column times it, rounded to fp32, then to bf16)."""
    spec = dataclasses.replace(ModelSpec.preset("muse-spark-open"), moe_intermediate_size=512)
    g = torch.Generator().manual_seed(9)
    experts = exact_nvfp4_experts(spec, 4, 512, g)
    # W13 of zeros except gate = up = 1 at column 0 of intermediate column c:
    # act[c] = bf16(silu(1) * 1) for x = e_0; everything else 0.
    w13 = torch.full_like(experts.w13, 0)
    w13_scale = torch.ones_like(experts.nvfp4.w13_scale.float()).to(torch.float8_e4m3fn)
    c = 37
    w13[:, c, 0] = 0x2  # code 2 = 1.0 in the low nibble (column 0)
    w13[:, 512 + c, 0] = 0x2
    q = experts.nvfp4
    experts = ExpertWeights(
        "nvfp4", w13, experts.w2, nvfp4=Nvfp4Scales(w13_scale, torch.ones_like(q.w13_global), q.w2_scale, q.w2_global)
    )
    if weight_format(fmt) == "nvfp4_marlin":
        experts = marlin_form(experts)
    op = provider(fmt).build(context(spec, experts), 0)
    _, w2 = experts.dequantized() if not exact(fmt) else exact_weights(experts)
    k = spec.top_k
    x = torch.zeros(8, spec.P, dtype=torch.bfloat16, device="cuda")
    x[:, 0] = 1.0
    ids = torch.tensor([[(r + j) % 4 for j in range(k)] for r in range(8)], dtype=torch.int32).cuda()
    rows = torch.full((8, k, spec.P), float("nan"), dtype=torch.bfloat16, device="cuda")
    op.run(ExpertsInput(x), RoutedTopk(ids, torch.ones(8, k, device="cuda")), rows)
    torch.cuda.synchronize()
    act = fn.swiglu(torch.ones(1, 2, dtype=torch.bfloat16, device="cuda"), 1)[0, 0].float()
    for r in range(8):
        for j in range(k):
            want = (w2[ids[r, j]][:, c].double() * act.double()).float().to(torch.bfloat16)  # one fp32 rounding
            assert torch.equal(rows[r, j], want), (r, j)


@pytest.mark.parametrize("fmt", ["nvfp4_marlin-bulk", "nvfp4_marlin-v3bulk", "nvfp4_marlin-v3bulk2"])
@pytest.mark.parametrize("shape", ["tp8-rank-expert-tp", "tp8-rank-ep"])
def test_experts_bulk_split_k_deterministic(fmt, shape):
    """The bulk kernels with few experts routed (their K split over blocks, the splits
    added by the last to arrive): against the reference (V3: the exact weights), and bit
    for bit the same rows over repeated launches whichever block arrives last."""
    spec, sharding = SHAPES[shape]
    experts = random_experts(spec, "nvfp4_marlin", sharding, seed=13)
    op = provider(fmt).build(context(spec, experts), 0)
    b, k = 8, spec.top_k
    g = torch.Generator().manual_seed(17)
    x = torch.randn(b, spec.P, generator=g).to(torch.bfloat16).cuda()
    first, num = experts.first_expert, experts.num_local
    held = torch.arange(first, first + num)
    others = torch.tensor([e for e in range(spec.E) if not first <= e < first + num], dtype=torch.long)
    few = 2 if len(others) else k  # EP: 2 held experts and routes to other ranks' (zero rows)
    pool = torch.cat(
        [held[torch.randperm(num, generator=g)[:few]], others[torch.randperm(len(others), generator=g)[: k - few]]]
    )
    ids = torch.stack([pool[torch.randperm(k, generator=g)] for _ in range(b)]).to(torch.int32).cuda()
    work = bulk_mod.work_items(few, spec.P, op.intermediate, op.grid)
    assert max(work["up"][1], work["down"][1]) > 1, work  # the split path runs
    once = None
    for _ in range(4):
        rows = torch.full((b, k, spec.P), float("nan"), dtype=torch.bfloat16, device="cuda")
        op.run(ExpertsInput(x), RoutedTopk(ids, torch.ones(b, k, device="cuda")), rows)
        torch.cuda.synchronize()
        if once is None:
            once = rows.clone()
            close(rows, experts, x, ids, exact=exact(fmt))
        assert torch.equal(rows.view(torch.int16), once.view(torch.int16))


@pytest.mark.parametrize(
    "fmt",
    [
        "nvfp4_marlin-v3half4mask",
        "nvfp4_marlin-v3half4lean",
    ],
)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_route_mask_is_the_scan_bit_for_bit(fmt, shape):
    """EXPERTS_ROUTE_MASK changes how the down kernel finds a value's routes, not the
    values, and EXPERTS_LEAN (how the Marlin loop prefetches and shifts) not what it
    computes: the rows equal the variant without them bit for bit (the EP shapes cover
    the zeros for routes to experts not held), for distinct experts, experts shared
    across rows, and a row routing twice to one expert."""
    assert_same_rows(shape, fmt, fmt.removesuffix("mask").removesuffix("lean"))


@pytest.mark.parametrize(
    "fmt", ["nvfp4_marlin-v3half4scatter", "nvfp4_marlin-v3half4scattermasks", "nvfp4_marlin-v3half4scatterup"]
)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_down_scatter_is_half4_early_bit_for_bit(fmt, shape):
    """EXPERTS_DOWN_SCATTER moves the down kernel's sums and stores to the warps that own
    each tile, in the same warp order, EXPERTS_SLOT_MASKS makes the route masks once a
    block, and EXPERTS_UP_SCATTER shares the up kernel's sums and SwiGLU the same way: the
    rows equal _half4_early's bit for bit (expert TP's slice: 4 warps along K, a
    tile each; EP: 8 warps, four owning a tile; the EP shapes cover the zeros for routes
    to experts not held)."""
    assert_same_rows(shape, fmt, "nvfp4_marlin-v3half4early")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_down_queue_is_half4_scatter_up_bit_for_bit(shape):
    """EXPERTS_DOWN_QUEUE changes which block runs a down item, not what the item sums: the
    rows equal _half4_scatter_up's bit for bit."""
    assert_same_rows(shape, "nvfp4_marlin-v3half4scatterupqueue", "nvfp4_marlin-v3half4scatterup")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_stream_loads_are_queue_bit_for_bit(shape):
    """EXPERTS_STREAM_LOADS changes how the code words' loads are cached, not what they
    load: the rows equal _half4_scatter_up_queue's bit for bit."""
    assert_same_rows(shape, "nvfp4_marlin-v3half4scatterupqueuena", "nvfp4_marlin-v3half4scatterupqueue")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_down_spare_is_queue_na_bit_for_bit(shape):
    """EXPERTS_DOWN_SPARE drops L2 prefetches only: the rows equal _half4_scatter_up_queue_na's
    bit for bit."""
    assert_same_rows(shape, "nvfp4_marlin-v3half4scatterupqueuenaspare", "nvfp4_marlin-v3half4scatterupqueuena")


@pytest.mark.parametrize(
    "fmt",
    [
        "v3half4scatterupqueuenasparecarry",
        "v3half4scatterupqueuenasparecarry2",
        "v3half4scatterupqueuenasparecarry2evict",
    ],
)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_down_carry_is_spare_bit_for_bit(shape, fmt):
    """EXPERTS_DOWN_CARRY loads a down warp's next item's first batch before its item's tail
    and decodes the same words in the same order: the rows equal _queue_na_spare's bit for
    bit (the EP shapes cover the zeros for routes to experts not held), also with one
    barrier an item fewer (= 2), and with the loads hinted evict-first in L2."""
    assert_same_rows(shape, f"nvfp4_marlin-{fmt}", "nvfp4_marlin-v3half4scatterupqueuenaspare")


def replays_over_distinct(op, spec, seed: int):
    """One graph of ``op.run`` at 8 rows (captured after an eager run on a side stream),
    replayed 40 times with new x and ids (1 to 64 distinct experts, so the count of items
    changes), rows set to NaN before each. Yields (replay, x, topk, rows) after each."""
    b, k = 8, spec.top_k
    x = torch.zeros(b, spec.P, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(b, k, dtype=torch.int32, device="cuda")
    topk = RoutedTopk(ids, torch.ones(b, k, device="cuda"))
    rows = torch.zeros(b, k, spec.P, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op.run(ExpertsInput(x), topk, rows)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    yield -1, x, topk, rows
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.run(ExpertsInput(x), topk, rows)
    g = torch.Generator().manual_seed(seed)
    for i in range(40):
        distinct = 1 + (i * 13) % 64
        pool = torch.randperm(spec.E, generator=g)[:distinct]
        ids.copy_(pool[torch.randint(0, distinct, (b, k), generator=g)].to(torch.int32))
        x.copy_(torch.randn(b, spec.P, generator=g).to(torch.bfloat16))
        rows.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield i, x, topk, rows


def same_rows_as(op, x: torch.Tensor, topk: RoutedTopk, rows: torch.Tensor) -> bool:
    """Whether ``op`` (run now, eagerly) makes ``rows`` bit for bit."""
    want = torch.full_like(rows, float("nan"))
    op.run(ExpertsInput(x), topk, want)
    torch.cuda.synchronize()
    return torch.equal(rows.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize(
    "fmt",
    [
        "v3half4scatterupqueue",
        "v3half4scatterupqueuenaspare",
        "v3half4scatterupqueuenasparecarry",
        "v3half4scatterupqueuenasparecarry2",
    ],
)
def test_down_queue_resets_over_replays(fmt):
    """The queue's counter and count of finished blocks are back at zero after every
    launch: over 40 replays of one graph with new ids (1 to 64 distinct experts, so the
    count of items changes), each replay's rows equal _half4_scatter_up's (for _queue, for
    _queue_na_spare, whose down kernel warms only its first item, and for the carry forms,
    whose warps load their next claimed item's first batch, or the whole item, before the
    item's tail, _carry2 with the claim shown by the barrier after the K loop)."""
    spec, sharding = SHAPES["tp8-rank-expert-tp"]
    experts = random_experts(spec, "nvfp4_marlin", sharding, seed=37)
    queued = provider(f"nvfp4_marlin-{fmt}").build(context(spec, experts), 0)
    plain = provider("nvfp4_marlin-v3half4scatterup").build(context(spec, experts), 0)
    for i, x, topk, rows in replays_over_distinct(queued, spec, seed=41):
        assert queued.queue.tolist() == [0, 0], i
        if i >= 0:
            assert same_rows_as(plain, x, topk, rows), i


def assert_same_rows(shape: str, fmt: str, base: str) -> None:
    """``fmt``'s rows equal ``base``'s bit for bit at 1, 3 and 8 rows, for distinct
    experts, experts shared across rows, and a row routing twice to one expert."""
    spec, sharding = SHAPES[shape]
    experts = random_experts(spec, weight_format(base), sharding, seed=19)
    variant = provider(fmt).build(context(spec, experts), 0)
    reference = provider(base).build(context(spec, experts), 0)
    g = torch.Generator().manual_seed(23)
    k = spec.top_k
    for b in (1, 3, 8):
        for kind in ("distinct", "duplicates", "twice"):
            x = torch.randn(b, spec.P, generator=g).to(torch.bfloat16).cuda()
            if kind == "twice":  # each row's routes over k / 2 experts, each of them twice
                ids = routing(b, k // 2, spec.E, "distinct", g).repeat(1, 2)
            else:
                ids = routing(b, k, spec.E, kind, g)
            topk = RoutedTopk(ids, torch.ones(b, k, device="cuda"))
            want = torch.full((b, k, spec.P), float("nan"), dtype=torch.bfloat16, device="cuda")
            rows = torch.full_like(want, float("nan"))
            reference.run(ExpertsInput(x), topk, want)
            variant.run(ExpertsInput(x), topk, rows)
            torch.cuda.synchronize()
            assert torch.equal(rows.view(torch.int16), want.view(torch.int16)), (b, kind)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_early_routing_is_half4_bit_for_bit(shape):
    """EXPERTS_EARLY as cuda.moe runs it: the ids written on a side stream (the routing)
    joined back by an event, so they are final when the experts launch; the up kernel reads
    them before its PDL wait. Eagerly and over replays of one graph with new ids each time,
    and with final False, the rows are _half4's bit for bit."""
    spec, sharding = SHAPES[shape]
    experts = random_experts(spec, "nvfp4_marlin", sharding, seed=29)
    early = provider("nvfp4_marlin-v3half4early").build(context(spec, experts), 0)
    plain = provider("nvfp4_marlin-v3half4").build(context(spec, experts), 0)
    g = torch.Generator().manual_seed(31)
    b, k = 8, spec.top_k
    x = torch.randn(b, spec.P, generator=g).to(torch.bfloat16).cuda()
    weights = torch.ones(b, k, device="cuda")
    source = torch.empty(b, k, dtype=torch.int32, device="cuda")
    ids = torch.empty_like(source)
    rows = torch.empty(b, k, spec.P, dtype=torch.bfloat16, device="cuda")
    side, fork, join = torch.cuda.Stream(), torch.cuda.Event(), torch.cuda.Event()

    def step() -> None:
        current = torch.cuda.current_stream()
        fork.record(current)
        side.wait_event(fork)
        with torch.cuda.stream(side):
            ids.copy_(source)  # the routing, on the side stream
            join.record(side)
        current.wait_event(join)
        early.run(ExpertsInput(x), RoutedTopk(ids, weights, final=True), rows)

    def check(i: int) -> None:
        want = torch.full_like(rows, float("nan"))
        plain.run(ExpertsInput(x), RoutedTopk(source, weights), want)
        torch.cuda.synchronize()
        assert torch.equal(rows.view(torch.int16), want.view(torch.int16)), i

    source.copy_(routing(b, k, spec.E, "distinct", g))
    rows.fill_(float("nan"))
    step()
    check(-1)
    rows.fill_(float("nan"))
    early.run(ExpertsInput(x), RoutedTopk(source, weights), rows)  # final False: the wait first
    check(-2)
    graph = Timer(torch.device("cuda")).capture(step)  # warm-ups on a side stream, then the capture
    for i in range(10):
        source.copy_(routing(b, k, spec.E, "distinct" if i % 2 else "duplicates", g))
        rows.fill_(float("nan"))
        graph.replay()
        check(i)
