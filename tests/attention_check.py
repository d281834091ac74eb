"""Attention cores on a Hopper GPU against the reference core: the checks every
``attention_core`` provider's GPU test runs (tests/test_gpu_flashinfer_pack.py,
tests/test_gpu_cuda_attention_core.py).

Each core runs in one CUDA graph, captured at the first step and replayed at every
later context (the metadata buffers change, the graph does not), for a sliding and a
full layer, against ``reference.functional.paged_attention`` on the same cache. The
cache is paged as vLLM pages it, with NaN in the null page and in every released
page, and every written position holds random K/V.

Bounds, and why: both sides read the same bf16 q, K and V and compute scores and the
softmax in fp32; FlashInfer's kernels round the probabilities to bf16 before the PV
product (and take the row sum from the rounded values), the reference keeps them in
fp32; both round the output to bf16 once. Each of these is a relative error of at most
2^-9 per term, averaging down over the keys, so a row's output (all heads, in fp32)
differs by a few 1e-3 relative (on an H200: fa2 up to 3.6e-3, XQA up to 5.0e-3; fa3
within the same bound); the bound is 1e-2, and nothing may be NaN. Positions outside a
query's window or after it must not count at all: a key wrongly in or out moves a row
by far more than the bound (the keys are random).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import torch

from sparkdecode.deployment import detect
from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.harness import DecodeHarness
from sparkdecode.plugins import Registered, discover
from sparkdecode.protocols import BuildContext, Step
from sparkdecode.reference import functional as fn
from sparkdecode.reference.kvcache import BLOCK_SIZE, NULL_PAGE, PagedKVCache
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import random_weights

ROWS = 8
BOUND = 1e-2
WINDOW = 2048  # Muse Spark's
MAX_CONTEXT = 32768
# Contexts (last position + 1) in the order the steps take them: the first step,
# page edges, the window's edges for the first and the last row (the first row's
# window leaves position 0 at context 2056, page 0 at 2071, page 1 at 2087), and
# long contexts up to 32768.
CONTEXTS = (
    8, 9, 15, 16, 17, 31, 32, 33, 100,
    2047, 2048, 2049, 2054, 2055, 2056, 2057, 2063, 2064, 2070, 2071, 2072, 2087, 2088,
    3000, 4095, 4096, 4097, 8191, 8192, 16385, 30001, 32767, 32768,
)  # fmt: skip


def core_context(spec: ModelSpec, heads: int, kv_heads: int, max_context: int) -> BuildContext:
    """A BuildContext with what an attention core reads: the spec, each layer's head
    counts and window, the deployment, shared buffers."""
    layers = [SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, window=spec.window(i)) for i in range(2)]
    return BuildContext(
        spec=spec,
        weights=SimpleNamespace(layers=layers),
        tp=spec.num_attention_heads // heads,
        rank=0,
        device=torch.device("cuda"),
        group=None,
        deployment=detect(spec, device="cuda", max_rows=ROWS, max_context=max_context),
        buffers={},
        aux_layers=(),
        max_rows=ROWS,
        max_context=max_context,
        mailboxes=[],
        ops={},
    )


def write_positions(cache: PagedKVCache, begin: int, end: int, g: torch.Generator) -> None:
    """Random K/V at positions begin .. end - 1 of every layer (what the prefill and
    earlier steps wrote), skipping released pages."""
    positions = torch.arange(begin, end)
    for layer, kv in enumerate(cache.tensors):
        table = torch.tensor(cache.groups[cache.layer_group[layer]].pages)
        page = table[positions // BLOCK_SIZE]
        keep = page != NULL_PAGE
        slots = (page * BLOCK_SIZE + positions % BLOCK_SIZE)[keep].cuda()
        for t in (kv[0], kv[1]):
            rows = t.view(-1, *t.shape[2:])
            rows[slots] = torch.randn((len(slots), *t.shape[2:]), generator=g, device="cuda").to(torch.bfloat16)


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """||out - ref|| / ||ref|| per row (all heads), in fp32."""
    o, r = out.float().flatten(1), ref.float().flatten(1)
    return (o - r).norm(dim=1) / r.norm(dim=1)


def check_core_over_contexts(cls: type, kv_heads: int, bound: float = BOUND) -> dict[int, float]:
    """``cls`` (an attention core) on a sliding and a full layer with ``kv_heads`` KV
    heads (GQA 8), one graph replayed over CONTEXTS; the largest row error per layer."""
    spec = ModelSpec.preset("muse-spark-open", 2)  # layer 0 sliding (window 2048), layer 1 full (NoPE)
    heads = 8 * kv_heads
    contexts = CONTEXTS if kv_heads == 2 else CONTEXTS[::3] + (MAX_CONTEXT,)
    ctx = core_context(spec, heads, kv_heads, MAX_CONTEXT)
    assert cls.unsupported(ctx.deployment) is None
    cores = [cls.build(ctx, layer) for layer in (0, 1)]
    pages = math.ceil(MAX_CONTEXT / BLOCK_SIZE) + 2
    cache = PagedKVCache(spec, pages, MAX_CONTEXT, ROWS, "cuda", num_kv_heads=kv_heads, poison_released=True)
    cache.poison_null_page()
    for c in cores:
        c.prepare_kv(cache.kv())
    assert getattr(cores[0], "owner", True) and cores[0].window == WINDOW and cores[1].window is None
    g = torch.Generator(device="cuda").manual_seed(kv_heads)
    positions = torch.zeros(ROWS, dtype=torch.int64, device="cuda")
    step = Step(ROWS, ROWS, positions, cache.kv(), False)
    q = [torch.empty(ROWS, heads, 64, dtype=torch.bfloat16, device="cuda") for _ in cores]
    out = [torch.empty_like(t) for t in q]

    def attention() -> None:
        for c, qi, oi in zip(cores, q, out):
            c.run(step, qi, oi)

    graph, written, worst = None, 0, {0: 0.0, 1: 0.0}
    for context in contexts:
        first = context - ROWS
        host = cache.begin_step(first, ROWS)
        write_positions(cache, min(written, first), context, g)
        written = context
        positions.copy_(torch.arange(first, context, device="cuda"))
        for t in q:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        for t in out:
            t.fill_(float("nan"))
        for c in cores:
            if hasattr(c, "prepare_step"):
                c.prepare_step(host)
        if graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                attention()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                attention()
            for t in out:
                t.fill_(float("nan"))
        graph.replay()
        for layer, kv in enumerate(cache.kv()):
            ref = fn.paged_attention(
                q[layer], positions, kv.k, kv.v, kv.group.block_table[0], kv.window, spec.softmax_scale, MAX_CONTEXT
            )
            assert torch.isfinite(out[layer]).all(), f"layer {layer}, context {context}: not finite"
            err = row_errors(out[layer], ref).max().item()
            worst[layer] = max(worst[layer], err)
            assert err < bound, f"layer {layer}, context {context}: {err:.2e}"
    print(f"\n{cls.name} Hkv {kv_heads}: largest row error sliding {worst[0]:.2e}, full {worst[1]:.2e}")
    return worst


def check_executor_with_core(cls: type, pins: dict[str, str] | None = None) -> None:
    """The whole step with the core pinned, in one graph replayed over steps that
    grow the context unevenly, cross pages and the window (64), overwrite rejected
    slots, with NaN in released pages; the harness calls prepare_step before each
    replay (``pins``: other blocks pinned beside it). Every expert routed (top-k = E) so the core's bf16-level differences
    cannot flip a route of the random model; close to the stock forward."""
    spec = dataclasses.replace(ModelSpec.preset("tiny", 2), num_experts_per_tok=16)
    weights = random_weights(spec, seed=4, device="cuda")
    registry = discover()
    name = cls.name
    if registry.find(name) is None:  # a core built but not registered: this test adds it
        registry.providers.append(Registered(cls, "test", "test", "0"))
    pins = {**(pins or {}), "attention_core": name}
    executor = SpecializedDecode(weights, DecodeConfig(max_context=1024, pins=pins), registry=registry)
    for block, provider in pins.items():
        assert executor.layout.choices[block].chosen.name == provider
    harness = DecodeHarness(ReferenceModel(weights, 1024), executor, max_prompt=70, graph=True)
    harness.prefill(torch.randint(0, spec.vocab_size, (70,), generator=torch.Generator().manual_seed(1)).cuda())
    for _ in range(16):
        r = harness.verify()
        err = row_errors(r.executor_hidden, r.stock_hidden)
        assert err.max() < 3e-2, err
    assert harness.position >= 70 + 16
