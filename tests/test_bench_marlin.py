"""The step bench on NVFP4 experts in vLLM's SM90 Marlin layout (``tp8-rank-L<N>-nvfp4-marlin``)
on the CPU: the name, the bytes it counts, the draw (the nvfp4 config's experts repacked
by marlin_form), the torch baseline's Marlin path, and a tiny variant end to end against
the baseline. The CUDA-graph run is the real config on the GPU box."""

from __future__ import annotations

import pytest
import torch

from sparkdecode.bench.baseline import stock_expert_rows
from sparkdecode.bench.configs import BenchConfig, BenchConfigError, named
from sparkdecode.bench.floor import expert_bytes, expert_tensors
from sparkdecode.bench.runner import run
from sparkdecode.bench.steer import draw_weights
from sparkdecode.nvfp4_marlin import marlin_form
from sparkdecode.reference import functional as fn
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import Sharding, random_weights


def tiny_marlin(layers: int = 3) -> BenchConfig:
    """A detached rank of TP 2 at the tiny widths: I-slices of 256 (Marlin needs multiples of 64;
    ``tiny-tp8``'s are 32)."""
    return BenchConfig(
        "tiny-tp2-rank-nvfp4-marlin", "tiny", layers, (200,), tp=2, expert_parallel="tp",
        expert_format="nvfp4_marlin", speed_claim=False,
    )  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_marlin_config_is_named_and_counted():
    cfg, nvfp4 = named("tp8-rank-L62-nvfp4-marlin"), named("tp8-rank-L62-nvfp4")
    assert (cfg.layers, cfg.expert_format, cfg.expert_parallel, cfg.all_ranks) == (62, "nvfp4_marlin", "tp", False)
    assert [cfg.nvfp4_layer(i) for i in (0, 1, 60, 61)] == [False, True, True, False]
    # The same codes and one-byte scales; two fp32 globals an expert, not 3 globals + 3 input scales.
    assert nvfp4.weights_bytes() - cfg.weights_bytes() == 60 * 256 * 4 * 4
    assert named("tp8-rank-Lmax-nvfp4-marlin").fitting(141 << 30).name.endswith("-nvfp4-marlin")
    every = named("tp8-L62-nvfp4-marlin")  # every rank in the served layout (bench/ranks.py)
    assert (every.all_ranks, every.expert_format, every.layers) == (True, "nvfp4_marlin", 62)
    with pytest.raises(BenchConfigError):
        named("tp8-rank-L62-marlin")
    # tiny-tp8's I-slices (256 / 8 = 32) are not Marlin tiles: refused before anything is drawn.
    with pytest.raises(BenchConfigError, match="multiples of 64"):
        BenchConfig("x", "tiny-tp8", 2, (200,), tp=8, expert_parallel="tp", expert_format="nvfp4_marlin")


def test_the_draw_is_the_nvfp4_draw_repacked():
    cfg = tiny_marlin(4)
    weights = draw_weights(cfg, torch.device("cpu"), 0)
    assert [layer.experts.format for layer in weights.layers] == ["bf16", "nvfp4_marlin", "nvfp4_marlin", "bf16"]
    assert weights.expert_format == "nvfp4_marlin"
    checkpoint = draw_weights(BenchConfig("y", "tiny", 4, (200,), tp=2, expert_parallel="tp", expert_format="nvfp4"),
                              torch.device("cpu"), 0)  # fmt: skip
    for served, drawn in zip(weights.layers[1:3], checkpoint.layers[1:3], strict=True):
        packed = marlin_form(drawn.experts)
        assert torch.equal(served.experts.w13, packed.w13) and torch.equal(served.experts.w2, packed.w2)
        assert served.experts.intermediate_slice == drawn.experts.intermediate_slice == (0, 256)
    # The bytes the config counts are the bytes drawn; the floor counts each expert's codes, scales, globals.
    drawn_bytes = sum(t.numel() * t.element_size() for layer in weights.layers for t in expert_tensors(layer.experts))
    bf16 = BenchConfig("z", "tiny", 4, (200,), tp=2, expert_parallel="tp")
    bf16_drawn = sum(
        t.numel() * t.element_size()
        for layer in draw_weights(bf16, torch.device("cpu"), 0).layers
        for t in expert_tensors(layer.experts)
    )
    assert bf16.weights_bytes() - cfg.weights_bytes() == bf16_drawn - drawn_bytes
    spec, inter = cfg.spec(), cfg.spec().I // 2
    assert expert_bytes(weights.layers[1]) == 3 * inter * spec.P // 2 + 3 * inter * spec.P // 16 + 2 * 4


@pytest.mark.parametrize("parallel", ["tp", "ep"])
def test_the_baseline_reads_marlin_experts(parallel):
    """The baseline's Marlin path (each route's expert gathered in Marlin's layout, decoded,
    batched GEMVs) equals the reference's grouped GEMMs on Marlin's decoded weights up to the
    GEMMs' order (1e-2: a few bf16 ulps of the outputs), and the checkpoint layout's rows up to
    the folded scales' bf16 rounding (W13's up rows and W2 held at other values, 2e-2; 5e-3 here); under
    EP, the routes to experts of other ranks are zero."""
    spec = ModelSpec.preset("tiny", 3)
    weights = random_weights(spec, seed=2, expert_format="nvfp4", sharding=Sharding(tp=2, expert_parallel=parallel))
    experts = weights.layers[1].experts
    marlin = marlin_form(experts)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(8, spec.P, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(spec.E, generator=g)[: spec.top_k] for _ in range(8)]).to(torch.int32)
    rows = stock_expert_rows(h, ids, marlin)
    w13, w2 = marlin.dequantized()
    assert rel(rows, fn.expert_rows(h, ids, w13, w2, marlin.first_expert)) < 1e-2
    assert 0 < rel(rows, stock_expert_rows(h, ids, experts)) < 2e-2
    if parallel == "ep":
        held = (ids >= marlin.first_expert) & (ids < marlin.first_expert + marlin.num_local)
        assert not held.all() and held.any()
        assert not rows[~held].any() and rows[held].abs().sum(-1).all()


def test_a_tiny_marlin_rank_runs_against_the_baseline():
    """Both sides read the Marlin experts (the baseline through its per-route decode, the
    executor through reference.experts_nvfp4 on the CPU): the same bf16 weights, GEMMs of
    another shape, so the step's outputs agree (1e-2) and every layer routes alike."""
    record = run(tiny_marlin(), device=torch.device("cpu"), replays=1, blocks=False, routings=("random",))
    assert record["shard"]["expert_format"] == "nvfp4_marlin"
    assert "marlin_form" in record["shard"]["expert_form"]
    assert "Marlin's layout" in record["baseline"]["what"]
    assert "reference.experts_nvfp4" in record["executor"]["layout"]["experts_nvfp4"]
    (r,) = record["runs"]
    assert r["check"]["finite"] and r["check"]["relative_error_baseline_vs_executor"] < 1e-2
    assert r["check"]["layers_routed_alike"] == 3
