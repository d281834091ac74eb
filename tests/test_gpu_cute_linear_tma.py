"""cute.linear_tma (gemv_tma.py: TMA into a shared-memory ring and wgmma.m64n8k16,
the fp32 router on gemv_splitk.py) on a Hopper GPU (marker gpu): against the
reference within linear_check's bounds (the same numerics as cute.linear: exact
products summed in fp32 in another order, rounded once), first at the smallest
launches (one tile of 64 rows, one row of x: ``-k smallest`` under
compute-sanitizer is short), then eager and in a replayed graph at TP1 and
TP8-rank shapes (cute.linear_tma_coresident's tilings, within half an SM's shared
memory, too); the split-K counters back at 0; every tiling of the planner's
first few within the bounds; and the weight streams of torch.mm, cute.linear_mma
and cute.linear_tma, and of each tiling, printed (run with -s; nothing asserted
about speed). cute.linear_tma_routed's router inside the pooler's kernel: the
pooler's bits, the router's logits within the same bounds.
"""

from __future__ import annotations

import pytest
import torch
from linear_check import (
    HOPPER,
    SHAPES,
    Tiling,
    check_close,
    counters_return_to_zero,
    equals_reference,
    print_streams,
    split_weight,
    tilings_equal_reference,
)

pytestmark = [pytest.mark.gpu, HOPPER]

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from sparkdecode.bench import streams  # noqa: E402
from sparkdecode_cute.linear_mma import CuteLinearMma  # noqa: E402
from sparkdecode_cute.linear_tma import (  # noqa: E402
    CuteLinearTma,
    CuteLinearTmaCoresident,
    CuteLinearTmaRouted,
    RoutedPooler,
    TmaWeight,
)

TILINGS = 6  # the planner's first tilings measured per weight

# K and splits of the smallest launches: one tile of W [64, K], each CTA's chunk of K
# in 8 steps of 128 through a ring of 2 buffers (so the producer's loop past its
# prefetch runs); unsplit, and in two splits (added by the last CTA).
SMALLEST = {"one-split": (1024, 1), "two-splits": (2048, 2)}


@pytest.mark.parametrize("case", list(SMALLEST))
def test_tma_smallest_equals_reference(case):
    from sparkdecode_cute.gemv_tma import TmaPlan

    k, splits = SMALLEST[case]
    plan = TmaPlan(64, k, k, 8, splits, 128, 2)
    assert (plan.ctas, plan.k_tiles) == (splits, 8), plan
    g = torch.Generator(device="cuda").manual_seed(splits)
    w = torch.randn(64, k, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(1, k, generator=g, device="cuda").to(torch.bfloat16)
    op = split_weight(TmaWeight, "qkvg", w, torch.cuda.get_device_properties(0).multi_processor_count, plan)
    out = torch.empty(1, 64, dtype=torch.bfloat16, device="cuda")
    op(x, out)
    torch.cuda.synchronize()
    check_close(f"W [64, {k}] {plan}", x, w, out, torch.nn.functional.linear(x, w))
    assert not op.shared[1].any(), "tile counter not back at 0"


@pytest.mark.parametrize(
    "cls",
    [CuteLinearTma, CuteLinearTmaCoresident],
    ids=["plan", "coresident"],
)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_tma_equals_reference(shape, rows, cls):
    """cute.linear_tma and cute.linear_tma_coresident (its tilings within half an SM's
    shared memory; unregistered)."""
    equals_reference(cls, shape, rows)


@pytest.mark.parametrize("shape", ["tp1", "tp8-rank"])
def test_tma_counters_return_to_zero(shape):
    """Splits over K at TP1 and on a TP-8 rank's qkvg."""
    counters_return_to_zero(CuteLinearTma, shape, TmaWeight)


def test_tma_weight_takes_no_fp32():
    ctx = streams.linear_context(SHAPES["tp8-rank"], torch.device("cuda"))
    with pytest.raises(ValueError, match="fp32"):
        TmaWeight("router", ctx.layer(0).router, 8, 132)


def test_print_streams():
    print_streams([CuteLinearMma, CuteLinearTma])


def test_tilings_equal_reference_and_print_their_streams():
    """Each bf16 TP8-rank weight under the planner's first ``TILINGS`` tilings
    (splits, buffer K, stages), the same bits on a second run."""
    from sparkdecode_cute.gemv_tma import tma_plans

    def tilings(name, w, sms):
        for plan in tma_plans(*w.shape, 8, sms=sms)[:TILINGS]:
            head = (
                f"splits {plan.splits:>2} stage_k {plan.stage_k} stages {plan.stages} CTAs {plan.ctas:>4} "
                f"({plan.resident}/SM, {plan.smem_bytes // 1024} KB)"
            )
            yield Tiling(plan, split_weight(TmaWeight, name, w, sms, plan), head)

    tilings_equal_reference(tilings, bf16_only=True, same_bits=True)


@pytest.mark.parametrize("case", list(SMALLEST))
def test_routed_smallest_equals_reference(case):
    """The router beside one tile of W [64, K] (4 router rows a tile, 256 vectors a
    split's chunk: 3 helper steps, the last a partial one), unsplit and in two splits."""
    from sparkdecode_cute.gemv_tma import TmaPlan

    k, splits = SMALLEST[case]
    plan = TmaPlan(64, k, k, 8, splits, 128, 2)
    g = torch.Generator(device="cuda").manual_seed(10 + splits)
    w = torch.randn(64, k, generator=g, device="cuda").to(torch.bfloat16)
    wr = torch.randn(4, k, generator=g, device="cuda")
    x = torch.randn(3, k, generator=g, device="cuda").to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pooler = split_weight(TmaWeight, "pooler", w, sms, plan)
    routed = RoutedPooler(pooler, wr, torch.empty(splits * 4 * 8, device="cuda"))
    pooled = torch.empty(3, 64, dtype=torch.bfloat16, device="cuda")
    logits = torch.full((4, 4), float("nan"), device="cuda")
    routed(x, logits[:3], pooled)
    alone = torch.empty_like(pooled)
    pooler(x, alone)
    torch.cuda.synchronize()
    assert torch.equal(pooled, alone), "the pooler's bits differ from its kernel alone"
    check_close(f"router [4, {k}] beside {plan}", x, wr, logits[:3], x.float() @ wr.t())
    assert torch.isnan(logits[3]).all(), "a row past b written"
    assert not pooler.shared[1].any(), "tile counter not back at 0"


@pytest.mark.parametrize("shape", ["tp1", "tp8-rank"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_routed_pooler_equals_reference(shape, rows):
    """``run_router_pooler`` at Muse Spark's shapes: the pooler's bits as cute.linear_tma
    runs it alone, the router within the bounds against the reference, rows past b
    untouched, the same bits replayed from a CUDA graph, the counters back at 0."""
    from sparkdecode.reference.providers import ReferenceLinear

    ctx = streams.linear_context(SHAPES[shape], torch.device("cuda"))
    op = CuteLinearTmaRouted.build(ctx, 0)
    assert op.fuses_router_pooler()
    ref = ReferenceLinear.build(ctx, 0)
    lw = ctx.layer(0)
    g = torch.Generator(device="cuda").manual_seed(20 + rows)
    wide = torch.randn(8, 8192 + 64, generator=g, device="cuda").to(torch.bfloat16)
    x = wide[:rows, 32 : 32 + 8192]
    logits = torch.full((8, 256 + 4), float("nan"), device="cuda")[:, 4:]
    pooled = torch.full((8, 4096 + 8), float("nan"), dtype=torch.bfloat16, device="cuda")[:, 8:]
    op.run_router_pooler(x, logits[:rows], pooled[:rows])
    alone = torch.empty(rows, 4096, dtype=torch.bfloat16, device="cuda")
    op.run("pooler", x, alone)
    ref_logits = torch.empty(rows, 256, device="cuda")
    ref.run("router", x, ref_logits)
    torch.cuda.synchronize()
    assert torch.equal(pooled[:rows], alone), "the pooler's bits differ from its kernel alone"
    assert torch.isnan(pooled[rows:].float()).all() and torch.isnan(logits[rows:]).all(), "rows past b written"
    check_close("router", x, lw.router, logits[:rows], ref_logits)
    first = (logits[:rows].clone(), pooled[:rows].clone())

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        logits.fill_(0)
        pooled.fill_(0)
        with torch.cuda.graph(graph, stream=stream):
            op.run_router_pooler(x, logits[:rows], pooled[:rows])
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(logits[:rows], first[0]) and torch.equal(pooled[:rows], first[1]), "replay differs"
    assert not op.counters.any(), "tile counters not back at 0"


def test_routed_declines_what_it_cannot_fuse():
    """A column-sharded pooler of 8 tiles would need 32 router rows a tile: not fused,
    and ``run_router_pooler`` is then the two kernels of cute.linear_tma."""
    ctx = streams.linear_context(SHAPES["tp8-rank-sharded-pooler"], torch.device("cuda"))
    op = CuteLinearTmaRouted.build(ctx, 0)
    assert not op.fuses_router_pooler()
    x = torch.randn(2, 8192, device="cuda").to(torch.bfloat16)
    logits, pooled = torch.empty(2, 256, device="cuda"), torch.empty(2, 512, dtype=torch.bfloat16, device="cuda")
    op.run_router_pooler(x, logits, pooled)
    ref_logits, ref_pooled = torch.empty_like(logits), torch.empty_like(pooled)
    op.run("router", x, ref_logits)
    op.run("pooler", x, ref_pooled)
    torch.cuda.synchronize()
    assert torch.equal(logits, ref_logits) and torch.equal(pooled, ref_pooled)
