"""The executor at the REAL widths of Muse Spark (2 layers of muse-spark-open: one
sliding, one full) against the stock forward, on a CUDA GPU: unsharded (26 GB of
bf16 experts a layer) and one detached rank of a TP-8 shard with expert TP.

Bit for bit: with the core's reference providers alone (whatever packs are installed:
the packs' kernels are checked against the reference in their own tests) both sides run the same torch ops on
the same shapes (the same cuBLAS and grouped-GEMM calls), eagerly and in a CUDA
graph captured once and replayed over steps that cross pages and the 2048-token
window. Skipped without a GPU."""

from __future__ import annotations

import traceback

import pytest
import torch

from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.harness import DecodeHarness
from sparkdecode.plugins import discover
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import Sharding, random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_CONTEXT = 2304  # past the 2048-token window


def real_harness(sharding: Sharding, graph: bool, prompt_len: int, seed: int = 0) -> DecodeHarness:
    spec = ModelSpec.preset("muse-spark-open", 2)
    weights = random_weights(spec, seed=seed, device="cuda", keep_unfolded_router=False, sharding=sharding)
    executor = SpecializedDecode(
        weights, DecodeConfig(max_context=MAX_CONTEXT, aux_layers=(0, 1, 2)), registry=discover().only("reference")
    )
    model = ReferenceModel(weights, MAX_CONTEXT)
    harness = DecodeHarness(model, executor, max_prompt=prompt_len, seed=seed, graph=graph)
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    harness.prefill(prompt.cuda())
    return harness


def check_steps(harness: DecodeHarness, steps: int) -> None:
    for _ in range(steps):
        r = harness.verify()
        assert torch.isfinite(r.stock_hidden.float()).all()
        assert torch.equal(r.stock_hidden, r.executor_hidden), r.hidden_diff
        assert all(torch.equal(a, b) for a, b in zip(r.stock_aux, r.executor_aux))
        assert r.greedy_agree


TP1 = Sharding()
TP8_RANK = Sharding(tp=8, rank=3, expert_parallel="tp")


@pytest.mark.parametrize(
    ("sharding", "graph", "prompt_len", "steps"),
    [(TP1, False, 70, 4), (TP1, True, 2040, 24), (TP8_RANK, True, 2040, 24)],
    ids=["tp1-eager", "tp1-graph-window", "tp8-rank3-graph-window"],
)
def test_executor_equals_stock_at_real_widths(sharding, graph, prompt_len, steps):
    harness = real_harness(sharding, graph, prompt_len)
    try:
        if sharding.tp > 1:
            assert harness.executor.collectives.detached
        check_steps(harness, steps)
        if prompt_len > 2000:
            assert harness.position > 2048  # the window has left the first pages
        if graph:
            assert harness.graph is not None
    except BaseException as e:
        # a failure's frames (check_steps's harness) must not hold the weights into the next case
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        del harness
        torch.cuda.empty_cache()
