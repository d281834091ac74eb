"""``sparkdecode bench`` for a config of every rank on GPUs (bench/ranks.py), in CUDA
graphs: with ``--one-gpu`` every rank on cuda:0 over gloo (the emulation, labelled
and never a speed claim), and one rank per GPU over NCCL where there are enough
GPUs. The tiny widths: these show the mode runs and checks (the collectives leave
every rank the same bits of the stream); the speed figures come from the real-width
configs (``tp{2,4,8}-L<N>-bf16``, ``-nvfp4-marlin``). Skipped without a GPU; the NCCL runs without
tp GPUs. The fast all-reduce transports come from the cuda pack."""

from __future__ import annotations

import json

import pytest
import torch

from sparkdecode.cli import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def bench(tmp_path, config: str, *extra: str) -> dict:
    argv = ["bench", config, "--replays", "5", "--out", str(tmp_path), "--quiet", *extra]
    assert main(argv) == 0
    (path,) = tmp_path.glob("*.json")
    return json.loads(path.read_text())


def check_runs(record: dict, tp: int) -> None:
    assert record["ranks"]["tp"] == tp and record["mode"].startswith("CUDA graphs")
    assert record["executor"]["layout_identical_across_ranks"]
    assert not record["executor"]["layout"]["all_reduce"].startswith("reference.")
    for run in record["runs"]:
        assert run["check"] == {"finite": True, "replicated_output_identical": True, "routing_identical": True}
        for side in ("executor", "detached"):
            assert len(run[side]["by_rank"]) == tp and all(t["median_s"] > 0 for t in run[side]["by_rank"])


def test_one_gpu_emulation_is_labelled_and_never_a_speed_claim(tmp_path):
    pytest.importorskip("sparkdecode_cuda")
    record = bench(tmp_path, "tiny-tp2", "--one-gpu")
    assert record["config"] == "tiny-tp2-one-gpu" and record["speed_claim"] is False
    assert "one-GPU emulation" in record["label"] and record["ranks"]["backend"] == "gloo"
    assert record["ranks"]["devices"] == ["cuda:0", "cuda:0"]
    # time-sliced, the resolver does not time its candidates: every choice by priority
    assert all(choice.endswith("(priority)") for choice in record["executor"]["layout"].values())
    check_runs(record, 2)


def test_one_gpu_emulation_in_marlins_layout(tmp_path):
    """The served Hopper layout on every rank (the middle layers' experts in Marlin's
    layout on each rank's I-slice) through the cuda pack's kernels and collectives."""
    pytest.importorskip("sparkdecode_cuda")
    record = bench(tmp_path, "tiny-tp2-nvfp4-marlin", "--one-gpu")
    assert record["shard"]["expert_format"] == "nvfp4_marlin" and record["speed_claim"] is False
    assert not record["executor"]["layout"]["experts_nvfp4"].startswith("reference.")
    check_runs(record, 2)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_one_rank_per_gpu_over_nccl(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    pytest.importorskip("sparkdecode_cuda")
    record = bench(tmp_path, f"tiny-tp{tp}")
    assert record["ranks"]["backend"] == "nccl" and record["label"] is None
    assert record["ranks"]["devices"] == [f"cuda:{r}" for r in range(tp)]
    assert record["speed_claim"] is False  # the tiny widths are a smoke run
    check_runs(record, tp)
