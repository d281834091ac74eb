"""Tensor parallelism on the CPU: several processes over gloo.

Per TP size, variants of the two tails (EP, expert TP) and of the pooler/unpooler
(replicated, column-sharded). Asserted:
- on every rank, the executor equals the TP stock forward bit for bit;
- every replicated value (hidden states, aux streams, logits, router logits,
  routing) is bit-identical on all ranks (collectives sum in a fixed rank order);
- the TP output equals the TP-1 model within bf16 rounding. bf16 partial sums round
  differently from a whole GEMM; with top-k < E a rounding can flip a near-tied
  route and move that row far, and random weights are full of near-ties, so the
  TP-1 comparison runs on variants that route every expert (top-k = E: the MoE is
  then continuous). The bound, 3e-2 relative per row over two layers, is a few bf16
  ulps (2^-8 = 3.9e-3) compounded: one layer measures about 5e-3, two about 1.5e-2
  (the attention's logits reach tens, so its softmax amplifies rounding); greedy tokens must agree wherever TP-1's top-2
  margin exceeds 4x the largest logit difference seen (a closer call is decided by
  rounding, not by the sharding);
- one rank failing the deployment gate makes every rank raise that rank's reason;
- one rank's failed build makes every rank raise (none waits in a collective), and
  ranks that see different providers raise before choosing apart.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

import tp_worker

V = dict  # a variant


def variant(preset, experts, shard_pooler, shard_unpooler, smooth, seed=1):
    return V(
        preset=preset,
        experts=experts,
        shard_pooler=shard_pooler,
        shard_unpooler=shard_unpooler,
        smooth=smooth,
        seed=seed,
        compare_tp1=smooth,
    )


CASES = {
    2: [
        variant("tiny", "ep", False, False, smooth=False),
        variant("tiny", "tp", True, True, smooth=True),
        variant("tiny", "ep", False, True, smooth=True),
    ],
    4: [
        variant("tiny-tp8", "ep", True, True, smooth=True),
        variant("tiny-tp8", "tp", False, False, smooth=True),
    ],
    8: [
        variant("tiny-tp8", "tp", True, True, smooth=True),
        variant("tiny-tp8", "ep", False, False, smooth=False),
    ],
}


# Every block and sub-op on the reference: on a GPU the resolver could otherwise pick a
# pack's provider, whose results are checked against the reference in its own tests
# (within bounds), while these checks are bit for bit.
REFERENCE_PINS = {
    kind: f"reference.{kind}"
    for kind in ("boundary", "attention", "attention_boundary", "moe", "final", "experts", "attention_core")
    + ("all_reduce", "linear")
}


def spawn(tp: int, tmp_path, gate: bool, backend: str = "gloo", pins: dict[str, str] | None = None) -> list[dict]:
    init = f"file://{tmp_path / 'store'}"
    cases = [dict(case, pins=pins) for case in CASES[tp]] if pins else CASES[tp]
    mp.spawn(tp_worker.main, args=(tp, init, str(tmp_path), cases, gate, backend), nprocs=tp, join=True)
    return [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(tp)]


def relative_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel(tp, tmp_path):
    check(tp, spawn(tp, tmp_path, gate=tp == 2))


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_on_gpus(tp, tmp_path):
    """The same checks with one rank per GPU over NCCL (the reference transport)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    check(tp, spawn(tp, tmp_path, gate=tp == 2, backend="nccl", pins=REFERENCE_PINS))


def check(tp: int, ranks: list[dict]) -> None:
    for index, case in enumerate(CASES[tp]):
        runs = [r["variants"][index] for r in ranks]
        for run in runs:  # the executor is the stock forward, rank by rank
            for a, b in zip(run["stock_hidden"], run["exec_hidden"]):
                assert torch.equal(a, b), case
            for a, b in zip(run["stock_aux"], run["exec_aux"]):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), case
        first = runs[0]
        for other in runs[1:]:  # replicated values: the same bits on every rank
            for key in ("exec_hidden", "exec_logits", "tokens"):
                assert all(torch.equal(x, y) for x, y in zip(first[key], other[key])), (case, key)
            for x, y in zip(first["exec_aux"], other["exec_aux"]):
                assert all(torch.equal(a, b) for a, b in zip(x, y)), case
            assert len(first["routes"]) == len(other["routes"]) > 0
            assert all(torch.equal(x, y) for x, y in zip(first["routes"], other["routes"])), case
        if not case["compare_tp1"]:
            continue
        for hidden, tp1, logits, tp1_logits in zip(
            first["exec_hidden"], first["tp1_hidden"], first["exec_logits"], first["tp1_logits"]
        ):
            assert relative_rows(hidden, tp1).max() < 3e-2, case
            diff = (logits - tp1_logits).abs().max()
            top2 = tp1_logits.topk(2, dim=-1).values
            decided = (top2[:, 0] - top2[:, 1]) > 4 * diff
            assert decided.any()
            assert torch.equal(logits.argmax(-1)[decided], tp1_logits.argmax(-1)[decided]), case
    if tp == 2:
        for r in ranks:
            assert "rank 1: max context 1000000" in r["gate"]
        rank0, rank1 = (r["failures"] for r in ranks)
        assert rank1["build"] == "ValueError: rank 1's build failed"
        assert (
            rank0["build"]
            == "RankFailedError: building the providers failed on rank 1: ValueError: rank 1's build failed"
        )
        for r in (rank0, rank1):
            assert r["providers"].startswith("LayoutError: the ranks see different providers: rank 1 has "), r
        assert rank1["chain"] == "ValueError: rank 1's build failed"
        assert (
            rank0["chain"] == "RankFailedError: the timing's builds failed on rank 1: ValueError: rank 1's build failed"
        )
