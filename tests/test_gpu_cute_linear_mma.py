"""cute.linear_mma (gemv_mma.py on the tensor cores, the fp32 router on
gemv_splitk.py) on a Hopper GPU (marker gpu): against the reference within
linear_check's bounds (the same numerics as cute.linear: exact products summed in
fp32 in another order, rounded once), eager and in a replayed graph, at TP1 and
TP8-rank shapes; the split-K counters back at 0; and the weight streams of
torch.mm, cute.linear_splitk and cute.linear_mma printed side by side (run with -s;
nothing asserted about speed).
"""

from __future__ import annotations

import pytest
import torch
from linear_check import (
    HOPPER,
    SHAPES,
    Tiling,
    counters_return_to_zero,
    equals_reference,
    print_streams,
    split_weight,
    tilings_equal_reference,
)

pytestmark = [pytest.mark.gpu, HOPPER]

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from sparkdecode.bench import streams  # noqa: E402
from sparkdecode_cute.linear_mma import CuteLinearMma, MmaWeight  # noqa: E402
from sparkdecode_cute.linear_splitk import CuteLinearSplitK  # noqa: E402


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_mma_equals_reference(shape, rows):
    equals_reference(CuteLinearMma, shape, rows)


@pytest.mark.parametrize("shape", ["tp1", "tp8-rank"])
def test_mma_counters_return_to_zero(shape):
    """Splits over K at TP1 and on a TP-8 rank's qkvg."""
    counters_return_to_zero(CuteLinearMma, shape, MmaWeight)


def test_mma_weight_takes_no_fp32():
    ctx = streams.linear_context(SHAPES["tp8-rank"], torch.device("cuda"))
    with pytest.raises(ValueError, match="fp32"):
        MmaWeight("router", ctx.layer(0).router, 8, 132)


def test_print_streams():
    print_streams([CuteLinearSplitK, CuteLinearMma])


def test_tilings_equal_reference_and_print_their_streams():
    """Each bf16 TP8-rank weight under the planner's first four tilings (groups,
    splits, batch depth)."""
    from sparkdecode_cute.gemv_mma import mma_plans

    def tilings(name, w, sms):
        for plan in mma_plans(*w.shape, 8, sms=sms)[:4]:
            head = f"groups {plan.groups} splits {plan.splits:>2} depth {plan.depth} CTAs {plan.ctas:>4}"
            yield Tiling(plan, split_weight(MmaWeight, name, w, sms, plan), head)

    tilings_equal_reference(tilings, bf16_only=True)
