"""The L2 prefetches (providers_cuda prefetch.py, marker gpu) on a Hopper GPU:
cuda.attention_prefetch and _prefetch_pooler against cuda.attention, cuda.moe_prefetch
and _prefetch_normal against cuda.moe (none registered). A prefetch writes nothing, so
the block's outputs must equal the plain block's to the bit, in a CUDA graph (the side
stream's fork and join captured), at a TP-8 rank's shapes, with cute.linear_tma as the
linear sub-op (its ``read_first`` gives the pooler's and the unpooler's runs)."""

from __future__ import annotations

import pytest
import torch

from sparkdecode.bench.timing import Timer
from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.plugins import discover
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
moe = pytest.importorskip("sparkdecode_cuda.moe")
pytest.importorskip("sparkdecode_cute.linear_tma")

PINS = {"linear": "cute.linear_tma", "attention_core": "cuda.attention_core"}
MAX_CONTEXT = 4096


VARIANTS = (
    attention.CudaAttentionPrefetch,
    attention.CudaAttentionPrefetchPooler,
    moe.CudaMoEPrefetch,
    moe.CudaMoEPrefetchNormal,
)


def _pair(layers: int, seed: int, block: str, plain: str, variant: type) -> tuple:
    """(spec, weights, the executors with ``plain`` and with ``variant`` pinned for
    ``block``, the variant's layer-0 block) at a TP-8 rank's shapes."""
    spec = ModelSpec.preset("muse-spark-open", layers)
    weights = random_weights(spec, seed=seed, device="cuda", sharding=Sharding(8, 0, "tp"))
    registry = discover()
    registry = registry.adding([cls for cls in VARIANTS if registry.find(cls.name) is None])
    executors = []
    for name in (plain, variant.name):
        config = DecodeConfig(max_context=MAX_CONTEXT, pins={**PINS, block: name})
        executors.append(SpecializedDecode(weights, config, registry=registry))
        assert executors[-1].layout.choices[block].chosen.name == name
    provider = getattr(executors[1].layers[0], block)
    assert isinstance(provider, variant)
    return spec, weights, executors, provider


@pytest.mark.parametrize("variant", [attention.CudaAttentionPrefetch, attention.CudaAttentionPrefetchPooler])
def test_prefetch_changes_no_bit(variant):
    spec, weights, executors, block = _pair(2, 3, "attention", "cuda.attention", variant)
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


@pytest.mark.parametrize("variant", [moe.CudaMoEPrefetch, moe.CudaMoEPrefetchNormal])
def test_moe_prefetch_changes_no_bit(variant):
    spec, _, executors, block = _pair(1, 1, "moe", "cuda.moe", variant)
    assert block.prefetch is not None
    assert block.prefetch.evict_last == variant.evict_last
    runs = block.linear.read_first("unpooler", variant.unpooler_head)
    assert block.prefetch.nbytes == sum(n * rows for _, n, rows, _ in runs) > 0
    x = torch.randn(8, spec.H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    outs = []
    for executor in executors:
        provider, mailbox = executor.layers[0].moe, executor.mailboxes[0]
        graph = Timer(torch.device("cuda")).capture(lambda provider=provider: provider.run(None, x))
        mailbox.publish(8).fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        outs.append([mailbox.gather(8).clone(), provider.ids[:8].clone(), provider.weights[:8].clone()])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert torch.isfinite(outs[0][0]).all()
