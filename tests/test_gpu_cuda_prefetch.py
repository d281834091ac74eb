"""The L2 prefetches (providers_cuda prefetch.py, marker gpu) on a Hopper GPU:
cuda.attention_prefetch and _prefetch_pooler against cuda.attention, cuda.moe_prefetch
and _prefetch_normal against cuda.moe (none registered). A prefetch writes nothing, so
the block's outputs must equal the plain block's to the bit, in a CUDA graph (the side
stream's fork and join captured), at a TP-8 rank's shapes, with cute.linear_tma as the
linear sub-op (its ``read_first`` gives the pooler's and the unpooler's runs)."""

from __future__ import annotations

import pytest
import torch
from attention_check import assert_same_bits, attention_blocks_in_graph, executor_pair

from sparkdecode.bench.timing import Timer
from sparkdecode.plugins import discover
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
REPLAYS = 8


VARIANTS = (
    attention.CudaAttentionPrefetch,
    attention.CudaAttentionPrefetchPooler,
    moe.CudaMoEPrefetch,
    moe.CudaMoEPrefetchNormal,
)


def _pair(layers: int, seed: int, block: str, plain: str, variant: type) -> tuple:
    """(spec, weights, the executors with ``plain`` and with ``variant`` pinned for
    ``block`` and every other kind as the first chose, the variant's layer-0 block) at a
    TP-8 rank's shapes."""
    spec = ModelSpec.preset("muse-spark-open", layers)
    weights = random_weights(spec, seed=seed, device="cuda", sharding=Sharding(8, 0, "tp"))
    registry = discover()
    registry = registry.adding([cls for cls in VARIANTS if registry.find(cls.name) is None])
    executors = executor_pair(weights, MAX_CONTEXT, PINS, block, (plain, variant.name), registry)
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
    plain, prefetched = (attention_blocks_in_graph(executor, first, seed=9) for executor in executors)
    assert_same_bits(plain, prefetched)


def _replayed(graph, outputs, refill, replays: int = REPLAYS) -> list[dict[str, torch.Tensor]]:
    """``outputs()`` (named clones) after each of ``replays`` replays of ``graph``, with
    ``refill()`` (NaNs into the outputs) before each."""
    runs = []
    for _ in range(replays):
        refill()
        graph.replay()
        torch.cuda.synchronize()
        runs.append(outputs())
    return runs


def _same_bits(plain: list[dict[str, torch.Tensor]], variant: list[dict[str, torch.Tensor]]) -> None:
    """Each block's replays agree with its first, then the variant's first with the plain
    block's, naming the tensor and the replays that differ."""
    for which, runs in (("plain", plain), ("variant", variant)):
        for name, first in runs[0].items():
            differ = [i for i, run in enumerate(runs) if not torch.equal(run[name], first)]
            assert not differ, f"the {which} block's {name}: replays {differ} differ from replay 0"
    for name, first in plain[0].items():
        a, b = first, variant[0][name]
        where = (a != b) & ~(a.isnan() & b.isnan())
        assert not where.any(), (
            f"{name}: {int(where.sum())} elements differ, the first at {where.nonzero()[0].tolist()}"
        )


@pytest.mark.parametrize("variant", [moe.CudaMoEPrefetch, moe.CudaMoEPrefetchNormal])
def test_moe_prefetch_changes_no_bit(variant):
    spec, _, executors, block = _pair(1, 1, "moe", "cuda.moe", variant)
    assert block.prefetch is not None
    assert block.prefetch.evict_last == variant.evict_last
    runs = block.linear.read_first("unpooler", variant.unpooler_head)
    assert block.prefetch.nbytes == sum(n * rows for _, n, rows, _ in runs) > 0
    x = torch.randn(8, spec.H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    results = []
    for executor in executors:
        provider, mailbox = executor.layers[0].moe, executor.mailboxes[0]
        graph = Timer(torch.device("cuda")).capture(lambda provider=provider: provider.run(None, x))

        def refill(provider=provider, mailbox=mailbox) -> None:
            for t in (mailbox.publish(8), provider.logits, provider.weights):
                t.fill_(float("nan"))
            provider.ids.fill_(-1)

        def outputs(provider=provider, mailbox=mailbox) -> dict[str, torch.Tensor]:
            named = {"out": mailbox.gather(8), "logits": provider.logits, "ids": provider.ids}
            named |= {"weights": provider.weights, "pooled": provider.pooled, "h": provider.h, "m": provider.m}
            return {name: t[:8].clone() for name, t in named.items()}

        results.append(_replayed(graph, outputs, refill))
    _same_bits(*results)
    assert torch.isfinite(results[0][0]["out"]).all()
