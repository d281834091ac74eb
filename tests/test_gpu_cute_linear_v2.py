"""cute.linear_splitk (gemv_splitk.py) on a Hopper GPU (marker gpu): against the
reference within linear_check's bounds (the same numerics as cute.linear: fp32 sums
in another order, rounded once), eager and in a replayed graph, at TP1 and TP8-rank
shapes; the split-K counters back at 0; and the weight streams of torch.mm,
cute.linear and cute.linear_splitk printed side by side (run with -s; nothing
asserted about speed).
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

from sparkdecode_cute.linear import CuteLinear  # noqa: E402
from sparkdecode_cute.linear_splitk import CuteLinearSplitK, SplitKWeight  # noqa: E402


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_splitk_equals_reference(shape, rows):
    equals_reference(CuteLinearSplitK, shape, rows)


@pytest.mark.parametrize("shape", ["tp1"])
def test_splitk_counters_return_to_zero(shape):
    """Every weight split over K at TP1."""
    counters_return_to_zero(CuteLinearSplitK, shape, SplitKWeight)


def test_print_streams():
    print_streams([CuteLinear, CuteLinearSplitK])


def test_tilings_equal_reference_and_print_their_streams():
    """Each TP8-rank weight under the planner's first four tilings (rows per lane,
    splits, batch depth)."""
    from sparkdecode_cute.gemv_splitk import splitk_plans

    def tilings(name, w, sms):
        for plan in splitk_plans(*w.shape, w.dtype == torch.float32, 8, sms=sms)[:4]:
            head = f"rows/lane {plan.rows} splits {plan.splits:>2} depth {plan.depth} CTAs {plan.ctas:>4}"
            yield Tiling(plan, split_weight(SplitKWeight, name, w, sms, plan), head)

    tilings_equal_reference(tilings)
