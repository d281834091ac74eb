"""providers_cuda on a Hopper GPU against the reference (marker gpu).

Bounds, and why: the kernels do the reference's fp32 elementwise operations in the
same order (no FMA contraction); only the two row reductions sum in another order.
So the fp32 stream agrees to 1e-5 relative (a few fp32 ulps through rsqrt), the aux
stream equals the stream exactly, and a bf16 output differs by at most one bf16 ulp
(2^-7 relative) where the fp32 value sits at a rounding boundary.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.harness import DecodeHarness
from sparkdecode.reference import functional as fn
from sparkdecode.reference import model
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]

boundary = pytest.importorskip("sparkdecode_cuda.boundary")


def one_ulp_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out.float()).all()
    diff = (out.float() - ref.float()).abs()
    assert (diff <= ref.float().abs() * 2**-7 + 1e-30).all(), diff.max()


def random_norms(width: int, g: torch.Generator) -> SimpleNamespace:
    def vec(std: float) -> torch.Tensor:
        return (torch.randn(width, generator=g) * std).to(torch.bfloat16).cuda()

    alpha, beta = fn.gate_coefficients(torch.randn(width, generator=g).cuda(), 0.3)
    return SimpleNamespace(
        post_ffn_norm=vec(0.1),
        ffn_alpha=alpha,
        ffn_beta=beta,
        pre_qkv_norm=vec(0.1),
        pre_ffn_norm=vec(0.1),
        attn_alpha=alpha,
        attn_beta=beta,
    )


@pytest.mark.parametrize("width", [1024, 2048, 4096, 8192])  # a row over 1, 2, 4, 8 blocks
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_boundary_kernel_equals_reference(width, rows, mode):
    """Every mode at every cluster size, x a strided view (a mailbox's rows)."""
    spec = ModelSpec.preset("muse-spark-open")
    g = torch.Generator().manual_seed(width * 10 + rows + mode)
    w = random_norms(width, g)
    ctx = SimpleNamespace(spec=SimpleNamespace(H=width), device=torch.device("cuda"))
    kernel = boundary._BoundaryKernel(ctx)
    x = (torch.randn(rows, width + 64, generator=g) * 3).to(torch.bfloat16).cuda()[:, :width]
    stream = torch.randn(rows, width, generator=g).cuda()
    out = torch.full((rows, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    aux = torch.full((rows, width), float("nan"), device="cuda")
    s0 = stream.clone()
    eps = spec.rms_norm_eps
    if mode == 0:
        ref_s = fn.embed_norm(x, eps)
        ref_out = fn.pre_norm(ref_s, w.pre_qkv_norm, eps).to(torch.bfloat16)
        args = (None, None, None, w.pre_qkv_norm, eps, eps, 1.0)
    elif mode == 1:
        ref_s = x.float()
        ref_out = fn.pre_norm(ref_s, w.pre_qkv_norm, eps).to(torch.bfloat16)
        args = (None, None, None, w.pre_qkv_norm, eps, eps, 1.0)
    elif mode == 2:
        ref_s, ref_out = model.input_boundary(spec, s0, x, w, w)
        args = (w.post_ffn_norm, w.ffn_alpha, w.ffn_beta, w.pre_qkv_norm, spec.post_norm_eps, eps, 1.0)
    else:
        ref_s, ref_out = model.attention_boundary(spec, w, s0, x)
        args = (None, w.attn_alpha, w.attn_beta, w.pre_ffn_norm, spec.post_norm_eps, eps, 1.0)
    kernel(mode, x, stream, out, aux, *args)
    torch.cuda.synchronize()
    torch.testing.assert_close(stream, ref_s, rtol=1e-5, atol=1e-6)
    assert torch.equal(aux, stream)
    one_ulp_close(out, ref_out)


@pytest.mark.parametrize("width", [1024, 8192])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("mode", [2, 3])
def test_late_trigger_boundary_is_bit_for_bit(width, rows, mode):
    """boundary_kernel with PDL_TRIGGER 1 (cuda.attention_boundary_late_trigger, not
    registered) writes the stream and the
    output of the registered kernel bit for bit, eagerly and replayed in a graph."""
    g = torch.Generator().manual_seed(width + rows + mode)
    w = random_norms(width, g)
    ctx = SimpleNamespace(spec=SimpleNamespace(H=width), device=torch.device("cuda"))
    x = (torch.randn(rows, width + 64, generator=g) * 3).to(torch.bfloat16).cuda()[:, :width]
    stream0 = torch.randn(rows, width, generator=g).cuda()
    post = w.post_ffn_norm if mode == 2 else None
    args = (post, w.ffn_alpha, w.ffn_beta, w.pre_qkv_norm, 1e-5, 1e-6, 1.0)
    results = []
    for trigger in (0, 1):
        kernel = boundary._BoundaryKernel(ctx, trigger)
        stream = stream0.clone()
        out = torch.full((rows, width), float("nan"), dtype=torch.bfloat16, device="cuda")
        kernel(mode, x, stream, out, None, *args)
        eager = (stream.clone(), out.clone())
        stream.copy_(stream0)
        out.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernel(mode, x, stream, out, None, *args)
        stream.copy_(stream0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(stream, eager[0]) and torch.equal(out, eager[1]), trigger
        results.append(eager)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_final_kernel_equals_reference():
    spec = ModelSpec.preset("tiny")
    g = torch.Generator().manual_seed(5)
    w = random_norms(spec.H, g)
    norm = (1 + torch.randn(spec.H, generator=g) * 0.1).to(torch.bfloat16).cuda()
    kernel = boundary._BoundaryKernel(SimpleNamespace(spec=spec, device=torch.device("cuda")))
    x = torch.randn(8, spec.H, generator=g).to(torch.bfloat16).cuda()
    stream = torch.randn(8, spec.H, generator=g).cuda()
    ref_s, ref_out = model.final_boundary(spec, stream.clone(), x, w, norm)
    out = torch.empty(8, spec.H, dtype=torch.bfloat16, device="cuda")
    kernel(
        2,
        x,
        stream,
        out,
        None,
        w.post_ffn_norm,
        w.ffn_alpha,
        w.ffn_beta,
        norm,
        spec.post_norm_eps,
        spec.rms_norm_eps,
        0.0,
    )
    torch.cuda.synchronize()
    torch.testing.assert_close(stream, ref_s, rtol=1e-5, atol=1e-6)
    one_ulp_close(out, ref_out)


@pytest.mark.parametrize("graph", [False, True])
def test_executor_with_cuda_boundaries(graph):
    """The whole step with the pack's boundaries pinned, eagerly and in one captured
    graph replayed over steps: close to the stock forward. One-ulp differences can
    flip a near-tied route of a random model and move a row far, so this runs with
    every expert routed (top-k = E: no discrete choice) over two layers, where the
    boundaries' roundings carried through stay at a few bf16 ulps; greedy tokens
    agree wherever the stock top-2 margin exceeds 4x the logit difference."""
    spec = dataclasses.replace(ModelSpec.preset("tiny", 2), num_experts_per_tok=16)
    weights = random_weights(spec, seed=2, device="cuda")
    pins = {"boundary": "cuda.boundary", "attention_boundary": "cuda.attention_boundary", "final": "cuda.final"}
    executor = SpecializedDecode(weights, DecodeConfig(max_context=1024, aux_layers=(0, 1, 2), pins=pins))
    assert executor.layout.choices["boundary"].chosen.name == "cuda.boundary"
    harness = DecodeHarness(ReferenceModel(weights, 1024), executor, max_prompt=70, graph=graph)
    harness.prefill(torch.randint(0, spec.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).cuda())
    for _ in range(12):
        r = harness.verify()
        err = (r.executor_hidden.float() - r.stock_hidden.float()).norm(dim=-1) / r.stock_hidden.float().norm(dim=-1)
        assert err.max() < 3e-2, err
        torch.testing.assert_close(r.executor_aux[0], r.stock_aux[0], rtol=1e-5, atol=1e-6)
        diff = (r.executor_logits - r.stock_logits).abs().max()
        top2 = r.stock_logits.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 4 * diff
        assert torch.equal(r.executor_logits.argmax(-1)[decided], r.stock_logits.argmax(-1)[decided])


moe_kernels = pytest.importorskip("sparkdecode_cuda.moe")


@pytest.mark.parametrize("experts,top_k", [(16, 4), (256, 8)])
@pytest.mark.parametrize("coarse", [False, True])
def test_routing_kernel_is_bitwise(experts, top_k, coarse):
    """Same fp32 operations in the same order, the same choices (ties to the lowest index):
    ids and weights equal the reference's bits."""
    spec = dataclasses.replace(
        ModelSpec.preset("muse-spark-open"), num_local_experts=experts, num_experts_per_tok=top_k
    )
    kernels = moe_kernels.MoEKernels(SimpleNamespace(spec=spec, device=torch.device("cuda")))
    g = torch.Generator().manual_seed(experts + coarse)
    logits = torch.randn(8, experts, generator=g)
    if coarse:  # many exact ties
        logits = torch.round(logits * 2) / 2
    bias = torch.zeros(experts) if coarse else torch.randn(experts, generator=g) * 0.01
    logits, bias = logits.cuda(), bias.cuda()
    ids = torch.full((8, top_k), -1, dtype=torch.int32, device="cuda")
    weights = torch.full((8, top_k), float("nan"), device="cuda")
    kernels.route(logits, bias, 1.0, moe_kernels.RoutedTopk(ids, weights))
    ref_ids, ref_weights = fn.route(logits, bias, top_k, 1.0)
    torch.cuda.synchronize()
    assert torch.equal(ids, ref_ids)
    assert torch.equal(weights, ref_weights)


@pytest.mark.parametrize("width,top_k", [(512, 4), (4096, 8)])
def test_tail_and_norm_kernels(width, top_k):
    spec = dataclasses.replace(ModelSpec.preset("muse-spark-open"), moe_hidden_size=width, num_experts_per_tok=top_k)
    kernels = moe_kernels.MoEKernels(SimpleNamespace(spec=spec, device=torch.device("cuda")))
    g = torch.Generator().manual_seed(width)
    rows = (torch.randn(8, top_k, width, generator=g) * 2).to(torch.bfloat16).cuda()
    weights = torch.rand(8, top_k, generator=g).cuda()
    norm = (torch.randn(width, generator=g) * 0.1).to(torch.bfloat16).cuda()
    out = torch.full((8, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.finish(rows, weights, norm, 1e-8, out)
    one_ulp_close(out, fn.moe_tail(rows, weights, norm, 1e-8))
    x = rows[:, 0]
    normed = torch.full((8, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.pre_norm(x, norm, 1e-5, normed)
    one_ulp_close(normed, fn.pre_norm(x, norm, 1e-5).to(torch.bfloat16))


def cuda_moe(shape: str) -> tuple:
    """(spec, weights, executor, its layer-0 cuda.moe, x) at a tiny or a TP-8 rank's shape."""
    from sparkdecode.weights import Sharding

    if shape == "tiny":
        spec, sharding = ModelSpec.preset("tiny", 1), None
    else:
        spec, sharding = ModelSpec.preset("muse-spark-open", 1), Sharding(8, 0, "tp")
    weights = random_weights(spec, seed=1, device="cuda", sharding=sharding)
    executor = SpecializedDecode(weights, DecodeConfig(max_context=256, pins={"moe": "cuda.moe"}))
    x = torch.randn(8, spec.H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    return spec, weights, executor, executor.layers[0].moe, x


@pytest.mark.parametrize("shape", ["tiny", "tp8-rank"])
def test_cuda_moe_provider(shape):
    """The block against reference.model.moe on the provider's own router logits: the
    routing must be the reference's for those logits (bitwise), and the output close
    (the two norms' one-ulp differences through the unpooler GEMM: 2e-2 relative)."""
    spec, weights, executor, provider, x = cuda_moe(shape)
    provider.run(None, x)
    got = executor.mailboxes[0].gather(8).clone()
    ref_ids, ref_w = fn.route(provider.logits[:8], weights.layers[0].expert_bias, spec.top_k, 1.0)
    assert torch.equal(provider.ids[:8], ref_ids)
    assert torch.equal(provider.weights[:8], ref_w)
    torch.testing.assert_close(provider.logits[:8], model.router_logits(weights.layers[0], x), rtol=1e-5, atol=1e-5)
    ref = model.moe(spec, weights.layers[0], x, executor.collectives)
    err = (got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
    assert err.max() < 2e-2, err


@pytest.mark.parametrize("shape", ["tiny", "tp8-rank"])
def test_cuda_moe_side_stream_keeps_the_bits(shape):
    """The router GEMM and routing kernel on the side stream (beside the pooler and
    the pre-expert norm), eagerly and replayed from a CUDA graph, give the bits of the
    same block run on one stream."""
    _, _, executor, provider, x = cuda_moe(shape)
    out = executor.mailboxes[0]
    assert provider.side is not None

    def result(run) -> list[torch.Tensor]:
        for t, fill in ((provider.logits, float("nan")), (provider.ids, -1), (provider.weights, float("nan"))):
            t.fill_(fill)
        out.publish(8).fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        return [t[:8].clone() for t in (provider.logits, provider.ids, provider.weights)] + [out.gather(8).clone()]

    side, provider.side = provider.side, None  # one stream: the block as it ran before
    serial = result(lambda: provider.run(None, x))
    provider.side = side
    eager = result(lambda: provider.run(None, x))
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        provider.run(None, x)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # fails unless the side stream is joined back
        provider.run(None, x)
    replayed = result(graph.replay)
    assert not any(t.float().isnan().any() for t in serial)  # every output written
    for got in (eager, replayed):
        assert all(torch.equal(a, b) for a, b in zip(got, serial))


@pytest.mark.parametrize("shape", ["tiny", "tp8-rank"])
@pytest.mark.parametrize("layer_index", [0, 1])  # sliding (RoPE, window), full (NoPE)
def test_cuda_attention_provider(shape, layer_index):
    """Against reference.model.attention on a copy of the same random cache, at a
    context past the window and a page edge: the K/V written agree (V bitwise, K to
    one ulp), the o_proj partial to 2e-2 relative per row (one-ulp differences in q,
    k and the gated output through the softmax and o_proj). The ``linear`` sub-op is pinned
    to ``reference.linear`` (cuBLAS, as the reference computes the QKV+gate GEMM), so the
    block's own kernels are what is compared; the faster linears have their own tests."""
    from sparkdecode.reference.kvcache import PagedKVCache
    from sparkdecode.weights import Sharding

    if shape == "tiny":
        spec, sharding = ModelSpec.preset("tiny", 2), None
    else:
        spec, sharding = ModelSpec.preset("muse-spark-open", 2), Sharding(8, 0, "tp")
    weights = random_weights(spec, seed=3, device="cuda", sharding=sharding)
    max_context = 4096
    executor = SpecializedDecode(
        weights,
        DecodeConfig(max_context=max_context, pins={"attention": "cuda.attention", "linear": "reference.linear"}),
    )
    lw = weights.layers[layer_index]
    caches = []
    for _ in range(2):
        cache = PagedKVCache(spec, 300, max_context, 8, "cuda", num_kv_heads=lw.num_kv_heads)
        g = torch.Generator(device="cuda").manual_seed(9)
        for t in cache.tensors:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        host = cache.begin_step(3000 - 8 - 3000 % 16 + 5, 8)  # rows crossing a page edge, far past the window
        caches.append(cache)
    executor.prepare_kv(caches[0].kv())
    first = 3000 - 8 - 3000 % 16 + 5
    positions = torch.arange(first, first + 8, device="cuda")
    step = executor.plan(positions)
    executor.prepare_step(host)  # the attention core's host work, where it has any
    x = torch.randn(8, spec.H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    partial = torch.full((8, spec.H), float("nan"), dtype=torch.bfloat16, device="cuda")
    executor.layers[layer_index].attention.run(step, x, partial)
    table = weights.rope_table(lw.rope_theta, max_context) if lw.rope_theta > 0 else None
    kv_ref = caches[1].kv()[layer_index]
    ref = model.attention(spec, lw, x, positions, kv_ref, table, max_context)
    torch.cuda.synchronize()
    kv = caches[0].kv()[layer_index]
    assert torch.equal(kv.v, kv_ref.v)
    one_ulp_close(kv.k, kv_ref.k)
    err = (partial.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)
    assert err.max() < 2e-2, err


@pytest.mark.parametrize("layer_index", [0, 1])
def test_cuda_attention_skips_padding_slots(layer_index):
    """Rows whose slot is negative (vLLM's PAD_SLOT_ID, as a dummy run's padding
    rows carry) write no K/V: the whole cache is its old contents except the valid
    rows' slots, which hold what the reference writes there (V bitwise, K to one ulp)."""
    from sparkdecode.reference.kvcache import BLOCK_SIZE, PagedKVCache

    spec = ModelSpec.preset("tiny", 2)
    weights = random_weights(spec, seed=3, device="cuda")
    executor = SpecializedDecode(
        weights, DecodeConfig(max_context=1024, pins={"attention": "cuda.attention", "linear": "reference.linear"})
    )
    lw = weights.layers[layer_index]
    first = 200
    caches, befores = [], []
    for _ in range(2):
        cache = PagedKVCache(spec, 80, 1024, 8, "cuda", num_kv_heads=lw.num_kv_heads)
        g = torch.Generator(device="cuda").manual_seed(9)
        for t in cache.tensors:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        host = cache.begin_step(first, 8)
        slots = cache.kv()[layer_index].group.slot_mapping
        slots[3:8] = -1
        befores.append([t.clone() for t in cache.tensors])
        caches.append(cache)
    valid = caches[0].kv()[layer_index].group.slot_mapping[:3].tolist()
    executor.prepare_kv(caches[0].kv())
    positions = torch.arange(first, first + 8, device="cuda")
    step = executor.plan(positions)
    executor.prepare_step(host)
    x = torch.randn(8, spec.H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    partial = torch.empty((8, spec.H), dtype=torch.bfloat16, device="cuda")
    executor.layers[layer_index].attention.run(step, x, partial)
    table = weights.rope_table(lw.rope_theta, 1024) if lw.rope_theta > 0 else None
    model.attention(spec, lw, x, positions, caches[1].kv()[layer_index], table, 1024)
    torch.cuda.synchronize()
    kv, kv_ref = caches[0].kv()[layer_index], caches[1].kv()[layer_index]
    assert torch.equal(kv.v, kv_ref.v)
    one_ulp_close(kv.k, kv_ref.k)
    # Only this layer's valid rows' slots moved, in K and in V.
    for layer, (now, old) in enumerate(zip(caches[0].tensors, befores[0], strict=True)):
        moved = (now != old).flatten(3).any(-1).nonzero().tolist()  # (k|v, page, offset)
        slots = {page * BLOCK_SIZE + offset for _, page, offset in moved}
        assert slots <= (set(valid) if layer == layer_index else set()), (layer, sorted(slots - set(valid)))
