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
about speed).
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
    ClusterTmaWeight,
    CuteLinearTma,
    CuteLinearTmaCluster,
    CuteLinearTmaCoresident,
    CuteLinearTmaEvictFirst,
    CuteLinearTmaEvictFirstShallow,
    TmaWeight,
)

TILINGS = 6  # the planner's first tilings measured per weight

# K and splits of the smallest launches: one tile of W [64, K], each CTA's chunk of K
# in 8 steps of 128 through a ring of 2 buffers (so the producer's loop past its
# prefetch runs); unsplit, and in two splits (added by the last CTA).
SMALLEST = {"one-split": (1024, 1), "two-splits": (2048, 2)}
# The cluster sum's smallest launches: one tile in a cluster of 2 and of 16 CTAs (the
# most a cluster holds), each CTA's chunk in 2 steps of 128.
SMALLEST_CLUSTERS = {"cluster-2": (512, 2), "cluster-16": (4096, 16)}


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


@pytest.mark.parametrize("case", list(SMALLEST_CLUSTERS))
def test_tma_smallest_cluster_sums_are_the_workspace_sums(case):
    """gemv_tma's ClusterSum on one tile: the splits' sums added in a cluster through
    distributed shared memory give the workspace path's bits (the same fp32 sums in split
    order), at 1 and 8 rows; its counter is never touched."""
    from sparkdecode_cute.gemv_tma import TmaPlan

    k, splits = SMALLEST_CLUSTERS[case]
    plan = TmaPlan(64, k, k, 8, splits, 128, 2)
    assert (plan.ctas, plan.k_tiles) == (splits, 2), plan
    g = torch.Generator(device="cuda").manual_seed(splits)
    w = torch.randn(64, k, generator=g, device="cuda").to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cluster = split_weight(ClusterTmaWeight, "qkvg", w, sms, plan)
    workspace = split_weight(TmaWeight, "qkvg", w, sms, plan)
    for rows in (1, 8):
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        out, expected = (torch.full((rows, 64), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2))
        cluster(x, out)
        workspace(x, expected)
        torch.cuda.synchronize()
        check_close(f"W [64, {k}] {plan} at {rows} rows", x, w, out, torch.nn.functional.linear(x, w))
        assert torch.equal(out, expected), f"{plan} at {rows} rows: not the workspace path's bits"
    assert not cluster.shared[1].any()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 8])
def test_tma_cluster_is_bit_for_bit_evict_first(shape, rows):
    """cute.linear_tma_cluster against cute.linear_tma_evict_first at every shape (the
    TP-8 rank's sharded pooler and unpooler included): the same plans, so the same bits
    for every weight."""
    ctx = streams.linear_context(SHAPES[shape], torch.device("cuda"))
    cluster, evict_first = CuteLinearTmaCluster.build(ctx, 0), CuteLinearTmaEvictFirst.build(ctx, 0)
    g = torch.Generator(device="cuda").manual_seed(rows)
    for name, weight in cluster.weights.items():
        assert weight.plan == evict_first.weights[name].plan, name
        n, k = SHAPES[shape][name]
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        dtype = getattr(ctx.layer(0), name).dtype  # the router's fp32
        out, expected = (torch.full((rows, n), float("nan"), dtype=dtype, device="cuda") for _ in range(2))
        cluster.run(name, x, out)
        evict_first.run(name, x, expected)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"{shape} {name} at {rows} rows"


@pytest.mark.parametrize(
    "cls",
    [
        CuteLinearTma,
        CuteLinearTmaCoresident,
        CuteLinearTmaEvictFirst,
        CuteLinearTmaEvictFirstShallow,
        CuteLinearTmaCluster,
    ],
    ids=["plan", "coresident", "evictfirst", "shallow", "cluster"],
)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_tma_equals_reference(shape, rows, cls):
    """cute.linear_tma, cute.linear_tma_coresident (its tilings within half an SM's
    shared memory; not registered), cute.linear_tma_evict_first (its weight loads hinted
    evict-first) and cute.linear_tma_evict_first_shallow (the qkvg and the pooler loading
    one buffer before the PDL wait; not registered)."""
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
