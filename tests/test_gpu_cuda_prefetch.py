"""The L2 prefetch beside the attention core (providers_cuda prefetch.py, marker gpu):
cuda.attention_prefetch and cuda.attention_prefetch_pooler (not registered) against
cuda.attention on a Hopper GPU. A prefetch writes nothing, so the block's o_proj
partial and its K/V writes must equal cuda.attention's to the bit, in a CUDA graph (the
side stream's fork and join captured), at a TP-8 rank's shapes on a sliding and a full
layer, with cute.linear_tma as the linear sub-op (its ``read_first`` gives the pooler's
runs)."""

from __future__ import annotations

import pytest
import torch

from sparkdecode.bench.timing import Timer
from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.plugins import Registered, discover
from sparkdecode.reference.kvcache import PagedKVCache
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import Sharding, random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
    ),
]

attention = pytest.importorskip("sparkdecode_cuda.attention")
pytest.importorskip("sparkdecode_cute.linear_tma")

PINS = {"linear": "cute.linear_tma", "attention_core": "cuda.attention_core"}
MAX_CONTEXT = 4096


def _executor(weights, attention_name: str) -> SpecializedDecode:
    registry = discover()
    for cls in (attention.CudaAttentionPrefetch, attention.CudaAttentionPrefetchPooler):
        if registry.find(cls.name) is None:
            registry.providers.append(Registered(cls, "test", "test", "0"))
    pins = {**PINS, "attention": attention_name}
    executor = SpecializedDecode(weights, DecodeConfig(max_context=MAX_CONTEXT, pins=pins), registry=registry)
    assert executor.layout.choices["attention"].chosen.name == attention_name
    return executor


@pytest.mark.parametrize("variant", [attention.CudaAttentionPrefetch, attention.CudaAttentionPrefetchPooler])
def test_prefetch_changes_no_bit(variant):
    spec = ModelSpec.preset("muse-spark-open", 2)
    weights = random_weights(spec, seed=3, device="cuda", sharding=Sharding(8, 0, "tp"))
    executors = [_executor(weights, "cuda.attention"), _executor(weights, variant.name)]
    block = executors[1].layers[0].attention
    assert isinstance(block, variant)
    lw = weights.layers[0]
    runs = block.linear.read_first("pooler", variant.pooler_head) if variant.pooler_head else []
    assert bool(runs) == bool(variant.pooler_head)
    pooler_head = sum(n * rows for _, n, rows, _ in runs)
    assert pooler_head <= max(variant.pooler_head, 0)
    assert block.prefetch.nbytes == lw.o_proj.numel() * 2 + lw.router.numel() * 4 + pooler_head
    first = 3000 - 8 - 3000 % 16 + 5  # rows crossing a page edge, past the window
    positions = torch.arange(first, first + 8, device="cuda")
    x = torch.randn(8, spec.H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).cuda()
    outs = []
    for executor in executors:
        cache = PagedKVCache(spec, 300, MAX_CONTEXT, 8, "cuda", num_kv_heads=lw.num_kv_heads)
        g = torch.Generator(device="cuda").manual_seed(9)
        for t in cache.tensors:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        host = cache.begin_step(first, 8)
        executor.prepare_kv(cache.kv())
        step = executor.plan(positions)
        executor.prepare_step(host)
        partials = [torch.full((8, spec.H), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(2)]

        def both(step=step, executor=executor, partials=partials) -> None:
            for i in range(2):
                executor.layers[i].attention.run(step, x, partials[i])

        graph = Timer(torch.device("cuda")).capture(both)  # warm-ups on a side stream, then the capture
        for p in partials:
            p.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        outs.append((partials, [t.clone() for t in cache.tensors]))
    (p0, c0), (p1, c1) = outs
    for a, b in zip(p0, p1, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    for a, b in zip(c0, c1, strict=True):
        assert torch.equal(a, b)
