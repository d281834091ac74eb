"""cute.linear_tma (gemv_tma.py: TMA into a shared-memory ring and wgmma.m64n8k16,
the fp32 router on gemv_splitk.py) on a Hopper GPU (marker gpu): against the
reference within test_gpu_cute_pack's bounds (the same numerics as cute.linear:
exact products summed in fp32 in another order, rounded once), eager and in a
replayed graph, at TP1 and TP8-rank shapes; the split-K counters back at 0; every
tiling of the planner's first few within the bounds; and the weight streams of
torch.mm, cute.linear_mma and cute.linear_tma, and of each tiling, printed (run
with -s; nothing asserted about speed).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
    ),
]

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from test_gpu_cute_pack import SHAPES, check_close, equals_reference  # noqa: E402

from sparkdecode.bench import streams  # noqa: E402
from sparkdecode.bench.floor import copy_bandwidth  # noqa: E402
from sparkdecode.bench.timing import Timer  # noqa: E402
from sparkdecode.protocols import LINEAR_WEIGHTS  # noqa: E402
from sparkdecode.reference.providers import ReferenceLinear  # noqa: E402
from sparkdecode_cute.linear_mma import CuteLinearMma  # noqa: E402
from sparkdecode_cute.linear_tma import CuteLinearTma, TmaWeight  # noqa: E402

TILINGS = 6  # the planner's first tilings measured per weight


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_tma_equals_reference(shape, rows):
    equals_reference(CuteLinearTma, shape, rows)


def test_tma_counters_return_to_zero():
    """After eager runs and graph replays of every weight (splits over K at TP1 and
    on a TP-8 rank's qkvg), every tile counter is back at 0, ready for the next
    launch."""
    for shape in ("tp1", "tp8-rank"):
        ctx = streams.linear_context(SHAPES[shape], torch.device("cuda"))
        op = CuteLinearTma.build(ctx, 0)
        assert any(isinstance(w, TmaWeight) and w.plan.splits > 1 for w in op.weights.values())
        io = {}
        for name in LINEAR_WEIGHTS:
            w = getattr(ctx.layer(0), name)
            io[name] = (
                torch.randn(8, w.shape[1], device="cuda").to(torch.bfloat16),
                torch.empty(8, w.shape[0], dtype=w.dtype, device="cuda"),
            )
            op.run(name, *io[name])
        torch.cuda.synchronize()
        assert not op.counters.any()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for name in LINEAR_WEIGHTS:
                op.run(name, *io[name])
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert not op.counters.any()


def test_tma_weight_takes_no_fp32():
    ctx = streams.linear_context(SHAPES["tp8-rank"], torch.device("cuda"))
    with pytest.raises(ValueError, match="fp32"):
        TmaWeight("router", ctx.layer(0).router, 8, 132)


def test_print_streams():
    """Isolated and chained bandwidth of torch.mm, cute.linear_mma and
    cute.linear_tma over the TP8-rank weights, as ``sparkdecode bench
    streams-tp8-rank`` measures them."""
    device = torch.device("cuda")
    timer = Timer(device)
    copy = copy_bandwidth(device).bytes_per_s
    config = "streams-tp8-rank"
    record = streams.linear_streams(
        timer, [ReferenceLinear, CuteLinearMma, CuteLinearTma], streams.SHAPES[config], streams.REPLAYS
    )
    print()
    print(streams.report(config, copy, record))


def test_tilings_equal_reference_and_print_their_streams():
    """Each bf16 TP8-rank weight under the planner's first ``TILINGS`` tilings
    (splits, buffer K, stages): within the bounds against the reference, the same
    bits on a second run, and its isolated bandwidth printed (for tuning the
    planner; nothing asserted about speed)."""
    from sparkdecode_cute.gemv_tma import tma_plans

    device = torch.device("cuda")
    timer = Timer(device)
    ctx = streams.linear_context(streams.SHAPES["streams-tp8-rank"], device)
    ref = ReferenceLinear.build(ctx, 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    lines = []
    for name in LINEAR_WEIGHTS:
        w = getattr(ctx.layer(0), name)
        if w.dtype == torch.float32:
            continue
        x = torch.randn(8, w.shape[1], device=device).to(torch.bfloat16)
        expected = torch.empty(8, w.shape[0], dtype=w.dtype, device=device)
        ref.run(name, x, expected)
        for plan in tma_plans(*w.shape, 8, sms=sms)[:TILINGS]:
            op = TmaWeight(name, w, 8, sms, plan)
            op.share(
                torch.zeros(max(1, plan.workspace), device=device),
                torch.zeros(plan.tiles, dtype=torch.int32, device=device),
            )
            out = torch.empty_like(expected)
            op(x, out)
            check_close(f"{name} {plan}", x, w, out, expected)
            again = torch.empty_like(expected)
            op(x, again)
            assert torch.equal(out, again), plan
            seconds = timer.time(timer.capture(lambda op=op, x=x, out=out: op(x, out)), streams.REPLAYS).median_s
            bandwidth = w.numel() * w.element_size() / seconds
            lines.append(
                f"{name:<9} splits {plan.splits:>2} stage_k {plan.stage_k} stages {plan.stages} CTAs {plan.ctas:>4} "
                f"({plan.resident}/SM, {plan.smem_bytes // 1024} KB): {seconds * 1e6:7.1f} us "
                f"{bandwidth / 1e12:5.2f} TB/s"
            )
    print("\n" + "\n".join(lines))
