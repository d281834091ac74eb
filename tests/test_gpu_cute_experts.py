"""cute.experts and its tensor-core variant cute.experts_mma on a
Hopper GPU against reference.experts (marker gpu); each test runs for both
(``-k experts_mma`` picks the variant's).

Bounds, and why (the same for both): the kernels round where ``fn.expert_rows`` rounds (gate/up GEMM to
bf16, ``silu(gate) * up`` in fp32 to bf16, W2 GEMM to bf16) but accumulate the fp32
products in another order and take exp as ex2.approx. So an fp32 sum near a bf16
rounding boundary lands on the neighbouring value: an output element may differ by
one bf16 ulp (<= 2^-7 of its magnitude), and an h element that flipped moves the W2
sums by far less than 2^-10 of the row's RMS. Routes to experts other ranks hold
(EP) are exactly zero in both.

The timing test (``-k bandwidth -s``) prints the weight-stream bandwidth of the
experts chained over distinct layers in one CUDA graph; it asserts nothing about speed.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from expert_check import assert_experts_close
from sparkdecode.protocols import ExpertsInput, RoutedTopk, scratch_buffer
from sparkdecode.reference import functional as fn
from sparkdecode.weights import ExpertWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
    ),
]

experts_mod = pytest.importorskip("sparkdecode_cute.experts", reason="providers_cute is not installed")
mma_mod = pytest.importorskip("sparkdecode_cute.experts_mma", reason="providers_cute is not installed")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

PROVIDERS = [experts_mod.CuteExperts, mma_mod.CuteExpertsMma]
COPY_TBPS = 4.27  # the H200's device-to-device copy bandwidth (the weight streams' target: >= 85%)

# name -> (P, I-slice, experts held, E, top-k, first expert held, I-slice given)
SHAPES = {
    "tiny": (512, 512, 16, 16, 4, 0, False),
    "tp8-rank-expert-tp": (4096, 512, 256, 256, 8, 0, True),
    "tp8-rank-ep": (4096, 4096, 32, 256, 8, 96, False),
}
# TP 1 holds all 256 experts whole: their offsets pass 2**31 elements (W13 from expert
# 64 on, W2 from 128), so the kernels must index the experts in 64 bits.
TP1 = {"tp1": (4096, 4096, 256, 256, 8, 0, False)}


def make_experts(name: str, seed: int = 0) -> ExpertWeights:
    p, i, held, _, _, first, sliced = {**SHAPES, **TP1}[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(held, 2 * i, p, generator=g, device="cuda", dtype=torch.bfloat16) * p**-0.5
    w2 = torch.randn(held, p, i, generator=g, device="cuda", dtype=torch.bfloat16) * i**-0.5
    return ExpertWeights("bf16", w13, w2, first, (i, 2 * i) if sliced else None)


@pytest.fixture(params=PROVIDERS, ids=[cls.name for cls in PROVIDERS])
def provider_cls(request) -> type:
    return request.param


def build(
    experts_by_layer: list[ExpertWeights], top_k: int, max_rows: int = 8, buffers=None, cls=experts_mod.CuteExperts
):
    """``cls`` (cute.experts or its variant) of each layer, from a BuildContext with
    only what they read."""
    buffers = {} if buffers is None else buffers
    layers = [SimpleNamespace(experts=e) for e in experts_by_layer]
    ctx = SimpleNamespace(
        spec=SimpleNamespace(top_k=top_k),
        max_rows=max_rows,
        device=torch.device("cuda"),
        layer=lambda index: layers[index],
        scratch=lambda name, shape, dtype: scratch_buffer(buffers, torch.device("cuda"), name, shape, dtype),
    )
    return [cls.build(ctx, index) for index in range(len(layers))]


def random_ids(name: str, b: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """int32 [b, k] global ids: ``distinct`` draws each row's k experts from all E;
    ``duplicate`` from a pool of k + 2 (most rows share most experts; under EP the
    pool straddles the held range, so some routes are another rank's)."""
    _, _, held, e, k, first, _ = SHAPES[name]
    if kind == "distinct":
        rows = [torch.randperm(e, generator=g)[:k] for _ in range(b)]
        if held < e:  # the rank holds at least row 0's first expert
            mine = first + int(torch.randint(0, held, (1,), generator=g))
            others = torch.randperm(e, generator=g)
            rows[0] = torch.cat([torch.tensor([mine]), others[others != mine][: k - 1]])
    else:
        base = first + held - 2 if held < e else 0
        pool = (torch.arange(k + 2) + base) % e
        rows = [pool[torch.randperm(k + 2, generator=g)[:k]] for _ in range(b)]
    return torch.stack(rows).to(torch.int32).cuda()


def check(got: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, e: ExpertWeights) -> None:
    """The kernel's rows against the reference's, both measured against exact sums
    (tests/expert_check.py says why and how)."""
    ref = fn.expert_rows(x, ids, e.w13, e.w2, e.first_expert)
    assert_experts_close(got, ref, x, ids, e.w13, e.w2, e.first_expert)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("kind", ["distinct", "duplicate"])
def test_experts_equal_reference(provider_cls, name, b, kind):
    e = make_experts(name)
    k = SHAPES[name][4]
    (provider,) = build([e], k, cls=provider_cls)
    g = torch.Generator().manual_seed(b * 7 + len(kind))
    x = torch.randn(b, e.w13.shape[2], generator=g).to(torch.bfloat16).cuda()
    ids = random_ids(name, b, kind, g)
    rows = torch.full((b, k, e.w13.shape[2]), float("nan"), dtype=torch.bfloat16, device="cuda")
    provider.run(ExpertsInput(x), RoutedTopk(ids, torch.ones(b, k, device="cuda")), rows)
    check(rows, x, ids, e)


@pytest.mark.parametrize("b", [1, 8])
def test_experts_past_2_31_elements(provider_cls, b):
    """TP 1 (all 256 whole experts, 26 GB of weights): rows routed to the last
    experts read them where they are."""
    e = make_experts("tp1")
    k, p = TP1["tp1"][4], e.w13.shape[2]
    (provider,) = build([e], k, cls=provider_cls)
    g = torch.Generator().manual_seed(5 + b)
    x = torch.randn(b, p, generator=g).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(128, generator=g)[:k] + 128 for _ in range(b)])
    ids[0, :4] = torch.tensor([255, 191, 127, 63])
    ids = ids.to(torch.int32).cuda()
    rows = torch.full((b, k, p), float("nan"), dtype=torch.bfloat16, device="cuda")
    provider.run(ExpertsInput(x), RoutedTopk(ids, torch.ones(b, k, device="cuda")), rows)
    check(rows, x, ids, e)
    del e, provider
    torch.cuda.empty_cache()


def test_same_expert_twice_in_a_row(provider_cls):
    """A row may name an expert in two slots: both slots get its output (tiny)."""
    e = make_experts("tiny")
    (provider,) = build([e], 4, cls=provider_cls)
    ids = torch.tensor([[3, 3, 5, 3], [5, 1, 1, 2]], dtype=torch.int32, device="cuda")
    x = torch.randn(2, 512, device="cuda").to(torch.bfloat16)
    rows = torch.full((2, 4, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    provider.run(ExpertsInput(x), RoutedTopk(ids, torch.ones(2, 4, device="cuda")), rows)
    check(rows, x, ids, e)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("b", [1, 8])
def test_graph_replays_with_changing_ids(provider_cls, name, b):
    """One captured graph, replayed with new ids (and x) each time: the distinct
    experts are found on the device at every replay."""
    e = make_experts(name, seed=1)
    k, p = SHAPES[name][4], e.w13.shape[2]
    (provider,) = build([e], k, cls=provider_cls)
    g = torch.Generator().manual_seed(11 + b)
    x = torch.zeros(b, p, dtype=torch.bfloat16, device="cuda")
    ids = random_ids(name, b, "distinct", g)
    rows = torch.zeros(b, k, p, dtype=torch.bfloat16, device="cuda")
    inputs, topk = ExpertsInput(x), RoutedTopk(ids, torch.ones(b, k, device="cuda"))
    provider.run(inputs, topk, rows)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        provider.run(inputs, topk, rows)
    for step in range(6):
        x.copy_(torch.randn(b, p, generator=g).to(torch.bfloat16))
        ids.copy_(random_ids(name, b, "distinct" if step % 2 else "duplicate", g))
        rows.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(rows, x, ids, e)


def test_executor_with_cute_experts():
    """The whole step with cute.experts pinned, close to the stock forward. As in the
    cuda pack's executor test, every expert is routed (top-k = E: no near-tied route
    that a one-ulp difference could flip); the experts' one-ulp differences carried
    through two layers stay at a few bf16 ulps of the hidden state."""
    from sparkdecode.executor import DecodeConfig, SpecializedDecode
    from sparkdecode.harness import DecodeHarness
    from sparkdecode.reference.model import ReferenceModel
    from sparkdecode.spec import ModelSpec
    from sparkdecode.weights import random_weights

    spec = dataclasses.replace(ModelSpec.preset("tiny", 2), num_experts_per_tok=16)
    weights = random_weights(spec, seed=3, device="cuda")
    executor = SpecializedDecode(weights, DecodeConfig(max_context=1024, pins={"experts": "cute.experts"}))
    assert executor.layout.choices["experts"].chosen.name == "cute.experts"
    harness = DecodeHarness(ReferenceModel(weights, 1024), executor, max_prompt=70, graph=True)
    harness.prefill(torch.randint(0, spec.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).cuda())
    for _ in range(8):
        r = harness.verify()
        err = (r.executor_hidden.float() - r.stock_hidden.float()).norm(dim=-1) / r.stock_hidden.float().norm(dim=-1)
        assert err.max() < 3e-2, err


def time_experts_chain(
    name: str,
    b: int,
    layers: int = 4,
    replays: int = 20,
    ctas_per_sm: int | None = None,
    cls: type = experts_mod.CuteExperts,
) -> dict[str, float]:
    """The experts of ``layers`` distinct layers (each layer's weights its own,
    together far beyond L2) chained back to back in one CUDA graph, each launch a
    programmatic dependent of the one before: microseconds a layer and the weight
    bytes streamed a second (each distinct held expert's W13 and W2 once)."""
    experts = [make_experts(name, seed=100 + i) for i in range(layers)]
    k, p = SHAPES[name][4], experts[0].w13.shape[2]
    providers = build(experts, k, cls=cls)
    if ctas_per_sm is not None:  # a tuning sweep: the persistent grid's size
        for provider in providers:
            provider.ctas = ctas_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator().manual_seed(5)
    x = torch.randn(b, p, generator=g).to(torch.bfloat16).cuda()
    ids = random_ids(name, b, "distinct", g)
    rows = torch.empty(b, k, p, dtype=torch.bfloat16, device="cuda")
    inputs, topk = ExpertsInput(x), RoutedTopk(ids, torch.ones(b, k, device="cuda"))
    for provider in providers:
        provider.run(inputs, topk, rows)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for provider in providers:
            provider.run(inputs, topk, rows)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / replays / layers
    e = experts[0]
    local = ids.long().unique() - e.first_expert
    distinct = int(((local >= 0) & (local < e.num_local)).sum())
    per_expert = (e.w13[0].numel() + e.w2[0].numel()) * 2
    return {"us_per_layer": seconds * 1e6, "distinct": distinct, "TBps": distinct * per_expert / seconds / 1e12}


@pytest.mark.parametrize("name", ["tp8-rank-expert-tp", "tp8-rank-ep"])
@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("ctas_per_sm", [None, 1, 3])
def test_bandwidth(provider_cls, name, b, ctas_per_sm):
    r = time_experts_chain(name, b, ctas_per_sm=ctas_per_sm, cls=provider_cls)
    grid = "default grid" if ctas_per_sm is None else f"{ctas_per_sm} CTAs/SM"
    print(
        f"\n{provider_cls.name} {name} b={b} ({grid}): {r['distinct']} experts, {r['us_per_layer']:.1f} us/layer, "
        f"{r['TBps']:.2f} TB/s = {r['TBps'] / COPY_TBPS:.0%} of the H200's copy bandwidth"
    )
    assert r["us_per_layer"] > 0
