"""Tensor parallelism with one rank per GPU (marker gpu; each TP size skipped below tp
GPUs): test_gpu_tp_one_device.py's variants and assertions with rank r on cuda:r, so
the cuda pack's Lamport mailboxes, fused TP attention boundary, fused MoE tail and
publishing o_proj (cuda.linear's, and cute.linear_tma's where the CuTe DSL is
installed) move data between GPUs through CUDA IPC peer memory, as served:

- the executor with only the pack's all-reduce equal to the TP stock forward (the
  reference transport over gloo) bit for bit at every step; with the fused blocks
  within 3e-2 relative per row and greedy tokens agreeing where decided;
- every rank's hidden states and aux streams the same bits;
- the TP output within bf16 rounding of the TP-1 model;
- the all-reduce op bit for bit the reference transport's sum on edge values, eagerly
  and replaying one graph, and the fused kernels at the tiny and real widths;
- the CuTe publishing o_proj bit for bit the pushing boundary.

Every run is under the one-device tests' watchdog: a rank that hangs fails the test.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]

pytest.importorskip("sparkdecode_cuda.lamport")

import tp_gpu_worker  # noqa: E402
from test_gpu_tp_one_device import CASES, OP_SHAPES, check_all_reduce_op, check_variants, watched  # noqa: E402


def enough_gpus(tp: int) -> None:
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs, one a rank ({torch.cuda.device_count()} here)")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_one_rank_per_gpu(tp, tmp_path):
    enough_gpus(tp)
    check_variants(tp, CASES[tp], watched(tp_gpu_worker.main, tp, tmp_path, CASES[tp], True))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_all_reduce_op_one_rank_per_gpu(tp, tmp_path):
    enough_gpus(tp)
    check_all_reduce_op(watched(tp_gpu_worker.all_reduce_op, tp, tmp_path, OP_SHAPES, 10, True))


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) is not None for m in ("sparkdecode_cute", "cutlass")),
    reason="the cute pack or the CuTe DSL is not installed",
)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_cute_publishing_o_proj_one_rank_per_gpu(tp, tmp_path):
    enough_gpus(tp)
    ranks = watched(tp_gpu_worker.cute_published_partial, tp, tmp_path, True)
    for rank, r in enumerate(ranks):
        assert r["published"] == [True, True], (rank, r["published"])
        assert r["published_ok"] == [True, True], (rank, r["shapes"], r["published_ok"])
