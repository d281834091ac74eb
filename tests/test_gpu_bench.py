"""The bench on a CUDA GPU: the torch baseline's FlashInfer attention against the
reference attention (over caches whose released pages hold NaN), and the bench
end to end in CUDA graphs (tiny widths; a detached TP-8 rank of small widths).
Skipped without a GPU; the FlashInfer tests also without FlashInfer.

Tolerance: FlashInfer computes the softmax in tiles with bf16 P @ V operands,
the reference in fp32 over gathered keys; both round the output to bf16, so
they differ by a few bf16 ulps: ||fi - ref|| / ||ref|| below 1e-2; the
attention block's output (o-norm, gate, o_proj on top) below 2e-2. Whole steps
are not compared with a bound: where a difference flips one expert choice of
the random-weight router, the outputs part by O(1) (the bench records it)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from sparkdecode.bench.baseline import FlashInferAttention, flashinfer_version
from sparkdecode.bench.configs import BenchConfig
from sparkdecode.bench.runner import run
from sparkdecode.bench.steer import filled_cache
from sparkdecode.cli import main
from sparkdecode.reference import functional as fn
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import Sharding, random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_flashinfer = pytest.mark.skipif(flashinfer_version() is None, reason="needs FlashInfer")

ROWS = 8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_flashinfer
@pytest.mark.parametrize(
    ("preset", "tp", "context"),
    [("tiny", 1, 300), ("tiny", 1, 40), ("muse-spark-open", 1, 4096), ("muse-spark-open", 8, 32768)],
)
def test_flashinfer_attention_equals_the_reference(preset, tp, context):
    # Layer 0 sliding, layer 1 full; few experts: the attention is what this test reads.
    spec = replace(ModelSpec.preset(preset, 2), num_local_experts=8, num_experts_per_tok=4)
    sharding = Sharding(tp=tp, expert_parallel="tp")
    weights = random_weights(spec, device="cuda", keep_unfolded_router=False, sharding=sharding)
    cache = filled_cache(weights, context, ROWS, seed=3)
    first = context - ROWS
    positions = torch.arange(first, context, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    for index in (0, 1):
        layer, kv = weights.layers[index], cache.layer_kv(index)
        group = cache.groups[cache.layer_group[index]]
        q = torch.randn(ROWS, layer.num_heads, spec.head_dim, generator=g, device="cuda").to(torch.bfloat16)
        attn = FlashInferAttention(layer.num_heads, layer.num_kv_heads, spec.head_dim, cache.max_pages, ROWS, "cuda")
        first_visible = 0 if layer.window is None else first - layer.window + 1
        attn.plan(group.pages, first_visible, context, layer.window, spec.softmax_scale)
        ref = fn.paged_attention(
            q, positions, kv.k, kv.v, kv.group.block_table[0], layer.window, spec.softmax_scale, context
        )
        eager = attn.run(q, kv).clone()
        assert torch.isfinite(eager.float()).all()
        assert rel(eager, ref) < 1e-2
        graph = torch.cuda.CUDAGraph()
        static_q = q.clone()
        with torch.cuda.graph(graph):
            out = attn.run(static_q, kv)
        attn.out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_bench_tiny_in_cuda_graphs(tmp_path, capsys):
    code = main(
        ["bench", "tiny", "--replays", "10", "--block-replays", "3", "--out", str(tmp_path), "--quiet", "--plot"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "NOT A SPEED CLAIM (the tiny config is a smoke run)" in out
    (path,) = tmp_path.glob("tiny_*.json")
    record = json.loads(path.read_text())
    assert record["mode"] == "CUDA graphs" and record["gpu"] and record["speed_claim"] is False
    if flashinfer_version() is not None:
        assert "FlashInfer" in record["baseline"]["what"]
    assert record["copy_bandwidth"]["bytes_per_s"] > 1e11
    assert len(record["runs"]) == 4
    for r in record["runs"]:
        assert r["check"]["finite"], r
        assert r["check"]["attention_relative_error"] < 2e-2, r["check"]
        for side in ("baseline", "executor"):
            assert 0 < r[side]["min_s"] <= r[side]["median_s"] <= r[side]["max_s"]
        assert all(b["executor"]["median_s"] > 0 and b["baseline"]["median_s"] > 0 for b in r["blocks"].values())


@needs_flashinfer
def test_bench_a_detached_tp8_rank_in_cuda_graphs():
    cfg = BenchConfig("tiny-tp8-rank", "tiny-tp8", 2, (1024,), tp=8, rank=0, expert_parallel="tp", speed_claim=False)
    record = run(cfg, device=torch.device("cuda"), replays=5, block_replays=2)
    assert len(record["collectives_left_out"]) == 2
    for r in record["runs"]:
        assert r["check"]["finite"] and r["check"]["attention_relative_error"] < 2e-2, r["check"]
