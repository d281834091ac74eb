"""cute.linear_tma's, cute.linear_tma_evict_first's and cute.linear_tma_evict_first_x_first's
o_proj publishing its partial into the cuda pack's Lamport mailbox from the TMA GEMV's
epilogue (gemv_tma.PublishingTmaGemv, EvictFirstPublishingTmaGemv,
XFirstEvictFirstPublishingTmaGemv), on ONE GPU shared
by 2, 4 and 8 processes (marker gpu; skipped without a Hopper GPU, the cuda pack or
the CuTe DSL), the host side of the group over gloo (tp_gpu_worker.py). Each rank
runs tp_gpu_worker.cute_published_partial: the publishing o_proj with the fused
attention boundary only gathering against the same o_proj not publishing (the same
plan) with the boundary pushing, bit for bit (partial, stream, output) at 8, 3 and 1 rows,
eagerly and replaying one CUDA graph, at a tiny width and muse-spark-open's (TP 4
covers the split-K plans: its o_proj is 8192 x 2048, 2 splits, and tiny-tp8's 4096 x
1024). A rank hanging on a mailbox (a push to the wrong slot) fails under the watchdog.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]

pytest.importorskip("sparkdecode_cuda.lamport", reason="the cuda pack is not installed")
pytest.importorskip("sparkdecode_cute.gemv_tma", reason="nvidia-cutlass-dsl is not installed")

import tp_gpu_worker  # noqa: E402
from test_gpu_tp_one_device import watched  # noqa: E402


@pytest.mark.parametrize("weight", ["TmaWeight", "EvictFirstTmaWeight", "XFirstEvictFirstTmaWeight"])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_cute_publishing_o_proj_is_the_pushing_boundary(tp, weight, tmp_path):
    ranks = watched(tp_gpu_worker.cute_published_partial, tp, tmp_path, False, weight)
    for rank, r in enumerate(ranks):
        print(f"TP {tp} rank {rank}: (H, K, splits) {r['shapes']}")
        assert r["published"] == [True, True], (rank, r["published"])
        assert r["published_ok"] == [True, True], (rank, r["shapes"], r["published_ok"])
