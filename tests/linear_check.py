"""The checks of the ``linear`` providers on a Hopper GPU, shared by their GPU tests
(tests/test_gpu_cute_pack.py, test_gpu_cute_linear_*.py, test_gpu_cuda_linear.py).
Imports no pack and no CuTe DSL, so a pack's test skips only on what it needs.

Bounds, and why: a provider and reference.linear (cuBLAS) both accumulate the
products in fp32 and round once to the output dtype; only the order of the sum
differs. So against the exact (fp64) product each is within half a bf16 ulp of the
result (2^-8 relative) plus the fp32 accumulation error, bounded by
K * 2^-24 * sum_k |w_k x_k|; against each other, twice that (one bf16 ulp where
the two fp32 sums straddle a rounding boundary). The fp32 router has no output
rounding beyond fp32: only the accumulation term.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sparkdecode.bench import streams
from sparkdecode.bench.floor import copy_bandwidth
from sparkdecode.bench.timing import Timer
from sparkdecode.protocols import LINEAR_WEIGHTS
from sparkdecode.reference.providers import ReferenceLinear

HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
)

# name -> (N, K) of Muse Spark's dense weights (H 8192, 128 q / 16 kv heads of 64,
# E 256, P 4096) at TP1 and on one rank of TP8 (the router is fp32).
SHAPES = {
    "tp1": {
        "qkvg": (2 * 8192 + 2 * 1024, 8192),
        "o_proj": (8192, 8192),
        "router": (256, 8192),
        "pooler": (4096, 8192),
        "unpooler": (8192, 4096),
    },
    "tp8-rank": {
        "qkvg": (2 * 1024 + 2 * 128, 8192),
        "o_proj": (8192, 1024),
        "router": (256, 8192),
        "pooler": (4096, 8192),
        "unpooler": (8192, 4096),
    },
    "tp8-rank-sharded-pooler": {
        "qkvg": (2 * 1024 + 2 * 128, 8192),
        "o_proj": (8192, 1024),
        "router": (256, 8192),
        "pooler": (512, 8192),
        "unpooler": (1024, 4096),
    },
}


def check_close(name: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ref: torch.Tensor) -> None:
    """``out`` and ``ref`` against the fp64 product within the module docstring's bounds."""
    exact = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    accumulation = w.shape[1] * 2.0**-24 * magnitude
    rounding = 0.0 if w.dtype == torch.float32 else 2.0**-8 * exact.abs()
    assert torch.isfinite(out.float()).all(), name
    for label, got in (("provider", out), ("reference", ref)):
        excess = (got.double() - exact).abs() - (rounding + accumulation)
        assert (excess <= 0).all(), f"{name} {label}: {excess.max().item()} past the bound"
    excess = (out.double() - ref.double()).abs() - 2 * (rounding + accumulation)
    assert (excess <= 0).all(), f"{name}: {excess.max().item()} past the bound against the reference"


def equals_reference(cls: type, shape: str, rows: int) -> None:
    """Every weight at b rows (x a view with a row stride wider than K, out a view
    into a wider buffer) by the provider ``cls``: within the bounds, the same bits on
    a second run and in a replayed CUDA graph, and the rows past b untouched."""
    ctx = streams.linear_context(SHAPES[shape], torch.device("cuda"))
    op = cls.build(ctx, 0)
    ref = ReferenceLinear.build(ctx, 0)
    g = torch.Generator(device="cuda").manual_seed(rows)
    lw = ctx.layer(0)
    outs, refs, inputs = {}, {}, {}
    for name in LINEAR_WEIGHTS:
        w = getattr(lw, name)
        n, k = w.shape
        wide = torch.randn(8, k + 64, generator=g, device="cuda").to(torch.bfloat16)
        x = inputs[name] = wide[:rows, 32 : 32 + k]
        out_buffer = torch.full((8, n + 8), float("nan"), dtype=w.dtype, device="cuda")
        outs[name] = out_buffer[:, 8:]
        refs[name] = torch.empty(rows, n, dtype=w.dtype, device="cuda")
        op.run(name, x, outs[name][:rows])
        ref.run(name, x, refs[name])
    torch.cuda.synchronize()
    first = {name: out.clone() for name, out in outs.items()}
    for name in LINEAR_WEIGHTS:
        out = outs[name]
        assert torch.isnan(out[rows:].float()).all(), f"{name}: rows past b written"
        check_close(name, inputs[name], getattr(lw, name), out[:rows], refs[name])

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for name in LINEAR_WEIGHTS:
            outs[name].fill_(0)
        with torch.cuda.graph(graph, stream=stream):
            for name in LINEAR_WEIGHTS:
                op.run(name, inputs[name], outs[name][:rows])
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for name in LINEAR_WEIGHTS:
        assert torch.equal(outs[name][:rows], first[name][:rows]), f"{name}: replay differs from the eager run"


def counters_return_to_zero(cls: type, shape: str, split: type) -> None:
    """After eager runs and graph replays of every weight by the split-K provider
    ``cls`` at ``shape`` (some weight of kind ``split`` split over K), every tile
    counter is back at 0, ready for the next launch."""
    ctx = streams.linear_context(SHAPES[shape], torch.device("cuda"))
    op = cls.build(ctx, 0)
    assert any(isinstance(w, split) and w.plan.splits > 1 for w in op.weights.values())
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


def print_streams(providers: list[type]) -> None:
    """Isolated and chained bandwidth of ``providers`` over the TP8-rank weights, as
    ``sparkdecode bench streams-tp8-rank`` measures them (nothing asserted about speed)."""
    device = torch.device("cuda")
    timer = Timer(device)
    copy = copy_bandwidth(device).bytes_per_s
    config = "streams-tp8-rank"
    record = streams.linear_streams(timer, [ReferenceLinear, *providers], streams.SHAPES[config], streams.REPLAYS)
    print()
    print(streams.report(config, copy, record))


@dataclass(frozen=True)
class Tiling:
    """One tiling of a weight: its plan, the weight's op under it (``op(x, out)``)
    and the words of its printed line before (``head``) and after (``tail``) the
    timing."""

    plan: Any
    op: Callable[[torch.Tensor, torch.Tensor], None]
    head: str
    tail: str = ""


def split_weight(cls: type, name: str, w: torch.Tensor, sms: int, plan: Any) -> Any:
    """A cute split-K weight op ``cls`` under ``plan``, with a workspace and zeroed
    counters of its own."""
    op = cls(name, w, 8, sms, plan)
    op.share(
        torch.zeros(max(1, plan.workspace), device=w.device),
        torch.zeros(plan.tiles, dtype=torch.int32, device=w.device),
    )
    return op


def tilings_equal_reference(
    tilings: Callable[[str, torch.Tensor, int], Iterable[Tiling]], bf16_only: bool = False, same_bits: bool = False
) -> None:
    """Each TP8-rank weight (the bf16 ones with ``bf16_only``) at 8 rows under each
    of ``tilings(name, w, sms)``: within the bounds against the reference (with
    ``same_bits``, the same bits on a second run), and its isolated bandwidth
    printed (for tuning the planner; nothing asserted about speed)."""
    device = torch.device("cuda")
    timer = Timer(device)
    ctx = streams.linear_context(streams.SHAPES["streams-tp8-rank"], device)
    ref = ReferenceLinear.build(ctx, 0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    lines = []
    for name in LINEAR_WEIGHTS:
        w = getattr(ctx.layer(0), name)
        if bf16_only and w.dtype == torch.float32:
            continue
        x = torch.randn(8, w.shape[1], device=device).to(torch.bfloat16)
        expected = torch.empty(8, w.shape[0], dtype=w.dtype, device=device)
        ref.run(name, x, expected)
        for tiling in tilings(name, w, sms):
            op = tiling.op
            out = torch.empty_like(expected)
            op(x, out)
            check_close(f"{name} {tiling.plan}", x, w, out, expected)
            if same_bits:
                again = torch.empty_like(expected)
                op(x, again)
                assert torch.equal(out, again), tiling.plan
            seconds = timer.time(timer.capture(lambda op=op, x=x, out=out: op(x, out)), streams.REPLAYS).median_s
            bandwidth = w.numel() * w.element_size() / seconds
            lines.append(f"{name:<9} {tiling.head}: {seconds * 1e6:7.1f} us {bandwidth / 1e12:5.2f} TB/s{tiling.tail}")
    print("\n" + "\n".join(lines))
