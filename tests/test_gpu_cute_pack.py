"""providers_cute on a Hopper GPU against the reference (marker gpu).

Bounds, and why: cute.linear and reference.linear (cuBLAS) both accumulate the
products in fp32 and round once to the output dtype; only the order of the sum
differs. So against the exact (fp64) product each is within half a bf16 ulp of the
result (2^-8 relative) plus the fp32 accumulation error, bounded by
K * 2^-24 * sum_k |w_k x_k|; against each other, twice that (one bf16 ulp where
the two fp32 sums straddle a rounding boundary). The fp32 router has no output
rounding beyond fp32: only the accumulation term.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparkdecode.bench.streams import linear_context
from sparkdecode.protocols import LINEAR_WEIGHTS
from sparkdecode.reference.providers import ReferenceLinear
from sparkdecode.spec import ModelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
    ),
]

linear = pytest.importorskip("sparkdecode_cute.linear")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

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
    for label, got in (("cute", out), ("reference", ref)):
        excess = (got.double() - exact).abs() - (rounding + accumulation)
        assert (excess <= 0).all(), f"{name} {label}: {excess.max().item()} past the bound"
    excess = (out.double() - ref.double()).abs() - 2 * (rounding + accumulation)
    assert (excess <= 0).all(), f"{name}: {excess.max().item()} past the bound against the reference"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_cute_linear_equals_reference(shape, rows):
    equals_reference(linear.CuteLinear, shape, rows)


def equals_reference(cls: type, shape: str, rows: int) -> None:
    """Every weight at b rows (x a view with a row stride wider than K, out a view
    into a wider buffer) by the provider ``cls``: within the bounds, the same bits on
    a second run and in a replayed CUDA graph, and the rows past b untouched."""
    ctx = linear_context(SHAPES[shape], torch.device("cuda"))
    cute = cls.build(ctx, 0)
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
        cute.run(name, x, outs[name][:rows])
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
                cute.run(name, inputs[name], outs[name][:rows])
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for name in LINEAR_WEIGHTS:
        assert torch.equal(outs[name][:rows], first[name][:rows]), f"{name}: replay differs from the eager run"


def test_bad_input_is_an_error():
    ctx = linear_context(SHAPES["tp8-rank"], torch.device("cuda"))
    cute = linear.CuteLinear.build(ctx, 0)
    x = torch.zeros(9, 8192, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="9 rows"):
        cute.run("pooler", x, torch.empty(9, 4096, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="not bf16"):
        cute.run("pooler", x[:2].float(), torch.empty(2, 4096, dtype=torch.bfloat16, device="cuda"))


def test_executor_with_cute_linear():
    """The whole step (tiny spec, the cuda pack's attention and MoE, so the GEMMs go
    through the ``linear`` sub-op) with cute.linear pinned, in one captured graph
    replayed over steps, against the stock forward. With every expert routed
    (top-k = E: no discrete choice a one-ulp difference could flip) over two layers,
    one-ulp GEMM and norm differences carried through stay at a few bf16 ulps: 3e-2
    relative per row on the final hidden state (the bound the cuda pack's executor
    test holds with cuBLAS)."""
    from sparkdecode.executor import DecodeConfig, SpecializedDecode
    from sparkdecode.harness import DecodeHarness
    from sparkdecode.reference.model import ReferenceModel
    from sparkdecode.weights import random_weights

    pytest.importorskip("sparkdecode_cuda.moe")
    spec = dataclasses.replace(ModelSpec.preset("tiny", 2), num_experts_per_tok=16)
    weights = random_weights(spec, seed=2, device="cuda")
    pins = {"attention": "cuda.attention", "moe": "cuda.moe", "linear": "cute.linear"}
    executor = SpecializedDecode(weights, DecodeConfig(max_context=1024, pins=pins))
    assert executor.layout.choices["linear"].chosen.name == "cute.linear"
    harness = DecodeHarness(ReferenceModel(weights, 1024), executor, max_prompt=70, graph=True)
    harness.prefill(torch.randint(0, spec.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).cuda())
    for _ in range(12):
        r = harness.verify()
        err = (r.executor_hidden.float() - r.stock_hidden.float()).norm(dim=-1) / r.stock_hidden.float().norm(dim=-1)
        assert err.max() < 3e-2, err
