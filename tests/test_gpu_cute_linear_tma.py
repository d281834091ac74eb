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
    CuteLinearTma,
    CuteLinearTmaCoresident,
    CuteLinearTmaEvictFirst,
    CuteLinearTmaEvictFirstShallow,
    CuteLinearTmaEvictFirstXFirst,
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
    [
        CuteLinearTma,
        CuteLinearTmaCoresident,
        CuteLinearTmaEvictFirst,
        CuteLinearTmaEvictFirstShallow,
        CuteLinearTmaEvictFirstXFirst,
    ],
    ids=["plan", "coresident", "evictfirst", "shallow", "xfirst"],
)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_tma_equals_reference(shape, rows, cls):
    """cute.linear_tma, cute.linear_tma_coresident (its tilings within half an SM's
    shared memory; not registered), cute.linear_tma_evict_first (its weight loads hinted
    evict-first) and cute.linear_tma_evict_first_shallow (the qkvg and the pooler loading
    one buffer before the PDL wait; not registered) and cute.linear_tma_evict_first_x_first
    (every weight's x loads issued before its shared stores; not registered)."""
    equals_reference(cls, shape, rows)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_x_first_keeps_the_bits(shape, rows):
    """cute.linear_tma_evict_first_x_first (every weight's x staged all loads first) gives
    cute.linear_tma_evict_first's bits for every weight on the same plans: the router on
    the plan beside the replicated pooler and on the planner's (the column-sharded cut's),
    the pooler and unpooler with 16 x loads a thread and with 2."""
    ctx = streams.linear_context(SHAPES[shape], torch.device("cuda"))
    ops = [cls.build(ctx, 0) for cls in (CuteLinearTmaEvictFirst, CuteLinearTmaEvictFirstXFirst)]
    g = torch.Generator(device="cuda").manual_seed(rows)
    for name, weight in ops[0].weights.items():
        assert ops[1].weights[name].plan == weight.plan
        n, k = weight.w.shape
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        outs = []
        for op in ops:
            out = torch.full((rows, n), float("nan"), dtype=weight.w.dtype, device="cuda")
            op.run(name, x, out)
            outs.append(out)
        torch.cuda.synchronize()
        assert not outs[0].float().isnan().any() and torch.equal(outs[0], outs[1]), name


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
