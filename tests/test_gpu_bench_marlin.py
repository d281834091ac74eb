"""The step bench on NVFP4 experts in vLLM's SM90 Marlin layout, on a CUDA GPU: a tiny
detached rank of TP 2 (I-slices of 256, Marlin tiles) captured in CUDA graphs, the
executor's experts pinned to cuda.experts_nvfp4_marlin, the baseline decoding Marlin's
layout per route inside its graph. Skipped without a GPU or the cuda pack.

The whole step is not compared with a bound (random weights route chaotically, see
test_gpu_bench.py); the experts kernel's own bound is tests/test_gpu_cuda_experts.py.
What must hold: both graphs capture and replay, the outputs are finite, the attention
check stays within test_gpu_bench.py's 2e-2, and the record names the Marlin form."""

from __future__ import annotations

import pytest
import torch
from test_bench_marlin import tiny_marlin

from sparkdecode.bench.runner import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_tiny_marlin_rank_in_cuda_graphs():
    pytest.importorskip("sparkdecode_cuda")
    pins = {"experts_nvfp4": "cuda.experts_nvfp4_marlin"}
    record = run(tiny_marlin(), device=torch.device("cuda"), replays=5, block_replays=2, pins=pins)
    assert record["mode"] == "CUDA graphs" and record["shard"]["expert_format"] == "nvfp4_marlin"
    assert record["executor"]["layout"]["experts_nvfp4"].startswith("cuda.experts_nvfp4_marlin")
    assert len(record["runs"]) == 2
    for r in record["runs"]:
        assert r["check"]["finite"] and r["check"]["attention_relative_error"] < 2e-2, r["check"]
        for side in ("baseline", "executor"):
            assert 0 < r[side]["min_s"] <= r[side]["median_s"] <= r[side]["max_s"]
        assert all(b["executor"]["median_s"] > 0 and b["baseline"]["median_s"] > 0 for b in r["blocks"].values())
