"""flashinfer.trtllm_all_reduce on Hopper GPUs (marker gpu).

1. The op alone, built from a BuildContext over the TP group: several processes on
   one GPU over a gloo group (the workspace's handles travel by gloo; the kernel's
   peer writes land in the same GPU's memory), and one process per GPU over NCCL
   where there are enough GPUs. Eagerly on the shapes the blocks all-reduce, then in
   one CUDA graph (two layers' sequence) replayed with new inputs. Each result must
   equal, bit for bit, the reference transport's sum (fp32 in rank order, rounded
   once), except that a sum of -0.0 on every rank comes back +0.0 (the kernel's
   -0.0 is its not-arrived mark; equal as numbers); every rank holds the same bits.
2. The executor, every block the reference's except the all-reduce, equal
   (torch.equal) to the TP stock forward, whose collectives are the reference
   transport's, at every step on every rank: on one GPU shared by 2, 4 and 8
   processes (test_gpu_tp_one_device.py's harness, eagerly and replaying one graph),
   and at TP 2 and 4 over NCCL, one rank per GPU.

Every multi-process run is under test_gpu_tp_one_device.py's watchdog: a rank that
hangs (a Lamport wait that never ends) fails the test.
"""

from __future__ import annotations

import pytest
import torch

from sparkdecode.protocols import KINDS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
    ),
]

pytest.importorskip("flashinfer")
import flashinfer_allreduce_worker  # noqa: E402
import tp_gpu_worker  # noqa: E402
from test_gpu_tp_one_device import variant as one_gpu_variant  # noqa: E402
from test_gpu_tp_one_device import watched  # noqa: E402

import tp_worker  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    """The kernel's JIT module built here, once, so no rank spends the watchdog's time
    compiling it (the ranks then load it)."""
    from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

    get_trtllm_comm_module()


def enough_gpus(tp: int) -> None:
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")


@pytest.mark.parametrize(
    "tp,one_gpu", [(2, True), (4, True), (2, False), (8, False)], ids=["tp2-one-gpu", "tp4-one-gpu", "tp2", "tp8"]
)
def test_op_equals_the_reference_sum(tp, one_gpu, tmp_path):
    if not one_gpu:
        enough_gpus(tp)
    ranks = watched(flashinfer_allreduce_worker.main, tp, tmp_path, one_gpu)
    for rank, r in enumerate(ranks):
        assert r["shared_workspace"] and r["released"], rank
        checks = r["eager"] + r["graph"]
        assert len(r["graph"]) == 6 * flashinfer_allreduce_worker.REPLAYS
        for i, c in enumerate(checks):
            assert c["differ"] == 0, (rank, i, c["differ"])
            assert c["negative_zero_sums"] > 0 and c["zero_where_negative_zero"], (rank, i)
    for other in ranks[1:]:  # the same bits on every rank
        for a, b in zip(ranks[0]["eager"] + ranks[0]["graph"], other["eager"] + other["graph"], strict=True):
            assert torch.equal(a["out"].view(torch.int16), b["out"].view(torch.int16))


REFERENCE_PINS = {kind: f"reference.{kind}" for kind in KINDS if kind not in ("all_reduce", "experts_nvfp4")}


def variant(preset: str, experts: str) -> dict:
    return dict(
        preset=preset,
        experts=experts,
        shard_pooler=False,
        shard_unpooler=False,
        smooth=False,
        seed=3,
        compare_tp1=False,
        pins={**REFERENCE_PINS, "all_reduce": "flashinfer.trtllm_all_reduce"},
    )


ONE_GPU_CASES = {
    2: [
        one_gpu_variant("tiny", "ep", "flashinfer_all_reduce", 4, False, smooth=False),
        one_gpu_variant("tiny", "tp", "flashinfer_all_reduce", 20, True),
    ],
    4: [one_gpu_variant("tiny-tp8", "ep", "flashinfer_all_reduce", 8, True)],
    8: [one_gpu_variant("tiny-tp8", "tp", "flashinfer_all_reduce", 8, True)],
}


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_executor_on_one_gpu_equals_tp_stock_forward(tp, tmp_path):
    """Both tails: EP (the [b, P] partials) and expert TP (the [b, k, P] route rows)."""
    assert tp_gpu_worker.PINS["flashinfer_all_reduce"]["all_reduce"] == "flashinfer.trtllm_all_reduce"
    ranks = watched(tp_gpu_worker.main, tp, tmp_path, ONE_GPU_CASES[tp])
    for index, case in enumerate(ONE_GPU_CASES[tp]):
        runs = [r["variants"][index] for r in ranks]
        for run in runs:
            assert len(run["exact"]) == case["steps"]
            assert all(run["exact"]), (case, run["exact"].index(False))
        for other in runs[1:]:
            assert torch.equal(runs[0]["hidden"], other["hidden"]), case


@pytest.mark.parametrize("tp,preset", [(2, "tiny"), (4, "tiny-tp8")])
def test_executor_equals_tp_stock_forward(tp, preset, tmp_path):
    """Over NCCL, one rank per GPU; both tails."""
    enough_gpus(tp)
    variants = [variant(preset, "ep"), variant(preset, "tp")]
    ranks = watched(tp_worker.main, tp, tmp_path, variants, False, "nccl")
    for index, case in enumerate(variants):
        runs = [r["variants"][index] for r in ranks]
        for run in runs:
            for a, b in zip(run["stock_hidden"], run["exec_hidden"], strict=True):
                assert torch.equal(a, b), case
            for a, b in zip(run["stock_aux"], run["exec_aux"], strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), case
        for other in runs[1:]:
            for a, b in zip(runs[0]["exec_logits"], other["exec_logits"], strict=True):
                assert torch.equal(a, b), case
