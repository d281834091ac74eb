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


def _routing(rows: int, experts: int, top_k: int, seed: int):
    """Random selection bias, 0.5 scaling and NaN-filled routing buffers."""
    from sparkdecode.protocols import RoutedTopk

    g = torch.Generator(device="cuda").manual_seed(seed)
    bias = torch.randn(experts, generator=g, device="cuda") * 0.01
    topk = RoutedTopk(
        torch.full((rows, top_k), -1, dtype=torch.int32, device="cuda"),
        torch.full((rows, top_k), float("nan"), device="cuda"),
    )
    return bias, 0.5, topk


def _check_routing(logits, bias, scaling, topk) -> None:
    """The routing is reference.functional.route's of the kernel's own logits, bit for bit."""
    from sparkdecode.reference import functional as fn

    ids, weights = fn.route(logits, bias, topk.ids.shape[1], scaling)
    assert torch.equal(topk.ids, ids), "routed ids differ from the reference's"
    assert torch.equal(topk.weights, weights), "route weights differ from the reference's bits"


@pytest.mark.parametrize("case", list(SMALLEST))
def test_routed_smallest_equals_reference(case):
    """The router and the routing beside four tiles of W [256, K] (32 experts over the
    CTAs: 8 router rows a CTA unsplit, 4 in two splits; K / 4 vectors a row over 96
    helpers, the last step a partial one); twice, so the counter's reset is used."""
    from sparkdecode_cute.gemv_tma import TmaPlan

    k, splits = SMALLEST[case]
    plan = TmaPlan(256, k, k, 8, splits, 128, 2)
    g = torch.Generator(device="cuda").manual_seed(10 + splits)
    w = torch.randn(256, k, generator=g, device="cuda").to(torch.bfloat16)
    wr = torch.randn(32, k, generator=g, device="cuda")
    x = torch.randn(3, k, generator=g, device="cuda").to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pooler = split_weight(TmaWeight, "pooler", w, sms, plan)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    routed = RoutedPooler(pooler, wr, 8, counter)
    alone = torch.empty(3, 256, dtype=torch.bfloat16, device="cuda")
    pooler(x, alone)
    for _ in range(2):
        pooled = torch.empty(3, 256, dtype=torch.bfloat16, device="cuda")
        logits = torch.full((4, 32), float("nan"), device="cuda")
        bias, scaling, topk = _routing(3, 32, 8, splits)
        routed(x, logits[:3], pooled, bias, scaling, topk)
        torch.cuda.synchronize()
        assert torch.equal(pooled, alone), "the pooler's bits differ from its kernel alone"
        check_close(f"router [32, {k}] beside {plan}", x, wr, logits[:3], x.float() @ wr.t())
        assert torch.isnan(logits[3]).all(), "a row past b written"
        _check_routing(logits[:3], bias, scaling, topk)
        assert not pooler.shared[1].any() and not counter.any(), "counters not back at 0"


@pytest.mark.parametrize("shape", ["tp1", "tp8-rank"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_routed_pooler_equals_reference(shape, rows):
    """``run_router_pooler`` at Muse Spark's shapes: the pooler's bits as cute.linear_tma
    runs it alone, the router within the bounds against the reference, the routing
    the reference's of those logits bit for bit, rows past b untouched, the same bits
    replayed from a CUDA graph, the counters back at 0."""
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
    bias, scaling, topk = _routing(rows, 256, ctx.spec.top_k, rows)
    op.run_router_pooler(x, logits[:rows], pooled[:rows], bias, scaling, topk)
    alone = torch.empty(rows, 4096, dtype=torch.bfloat16, device="cuda")
    op.run("pooler", x, alone)
    ref_logits = torch.empty(rows, 256, device="cuda")
    ref.run("router", x, ref_logits)
    torch.cuda.synchronize()
    assert torch.equal(pooled[:rows], alone), "the pooler's bits differ from its kernel alone"
    assert torch.isnan(pooled[rows:].float()).all() and torch.isnan(logits[rows:]).all(), "rows past b written"
    check_close("router", x, lw.router, logits[:rows], ref_logits)
    _check_routing(logits[:rows], bias, scaling, topk)
    first = [t.clone() for t in (logits[:rows], pooled[:rows], topk.ids, topk.weights)]

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            op.run_router_pooler(x, logits[:rows], pooled[:rows], bias, scaling, topk)
    torch.cuda.current_stream().wait_stream(stream)
    for t in (logits, topk.weights):
        t.fill_(float("nan"))
    pooled.fill_(0)
    topk.ids.fill_(-1)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    again = (logits[:rows], pooled[:rows], topk.ids, topk.weights)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "replay differs"
    assert not op.counters.any() and not op.routed.counter.any(), "counters not back at 0"


# A layer too small for the routed kernel: the pooler's 8 CTAs would take 32 router rows each.
SMALL = {
    "qkvg": (256, 1024),
    "o_proj": (1024, 256),
    "router": (256, 1024),
    "pooler": (256, 1024),
    "unpooler": (1024, 256),
}


def test_routed_declines_what_it_cannot_fuse():
    """Where the pooler's CTAs are too few for the router's rows: not fused, and
    ``run_router_pooler`` says so; a TP-8 rank's column-sharded pooler is fused."""
    assert CuteLinearTmaRouted.build(
        streams.linear_context(SHAPES["tp8-rank-sharded-pooler"], torch.device("cuda")), 0
    ).fuses_router_pooler()
    op = CuteLinearTmaRouted.build(streams.linear_context(SMALL, torch.device("cuda")), 0)
    assert not op.fuses_router_pooler()
    x = torch.randn(2, 1024, device="cuda").to(torch.bfloat16)
    logits, pooled = torch.empty(2, 256, device="cuda"), torch.empty(2, 256, dtype=torch.bfloat16, device="cuda")
    bias, scaling, topk = _routing(2, 256, 8, 0)
    with pytest.raises(ValueError, match="not fused"):
        op.run_router_pooler(x, logits, pooled, bias, scaling, topk)
