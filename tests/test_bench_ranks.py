"""``sparkdecode bench`` for a config of every rank (bench/ranks.py) on the CPU: the
tiny preset at TP 2, one process a rank over gloo, end to end into a record with
both ranks' times; the refusals (NCCL on the CPU, --one-gpu on the CPU or on a
one-rank config, too few GPUs, a shard that does not fit); the replicated
weights every rank draws alike. The CUDA-graph runs are in test_gpu_bench_ranks.py."""

from __future__ import annotations

import json

import pytest
import torch

from sparkdecode.bench.configs import BenchConfigError, named
from sparkdecode.bench.ranks import Placement
from sparkdecode.bench.steer import draw_weights
from sparkdecode.cli import main
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import Sharding, random_weights


def test_tiny_tp2_on_the_cpu_times_both_ranks_with_their_collectives(tmp_path, capfd):
    code = main(["bench", "tiny-tp2", "--device", "cpu", "--replays", "2", "--out", str(tmp_path), "--quiet"])
    assert code == 0
    (path,) = tmp_path.glob("tiny-tp2_*.json")
    record = json.loads(path.read_text())
    out = capfd.readouterr().out  # rank 0's table, from its own process
    assert f"record: {path}" in out
    assert "NOT A SPEED CLAIM (eager on the CPU)" in out and "ranks: 2 processes on the CPU over gloo" in out
    assert record["speed_claim"] is False and record["label"] is None
    assert record["ranks"]["tp"] == 2 and record["ranks"]["backend"] == "gloo"
    assert record["ranks"]["devices"] == ["cpu", "cpu"]
    assert record["shard"]["rank"] == "all" and len(record["shard"]["weights_bytes_by_rank"]) == 2
    assert record["baseline"]["name"] == "none" and record["collectives_left_out"] == []
    assert len(record["collectives_timed"]) == 2
    assert record["executor"]["layout"]["all_reduce"].startswith("reference.all_reduce")
    assert record["executor"]["layout_identical_across_ranks"]
    assert len(record["commit"]) == 40 and record["command"].startswith("sparkdecode bench tiny-tp2")
    spec = ModelSpec.preset("tiny")
    assert [(r["context"], r["routing"]) for r in record["runs"]] == [(300, "random"), (300, "correlated")]
    for r in record["runs"]:
        # The collectives leave both ranks the same bits; the routers are replicated.
        assert r["check"] == {"finite": True, "replicated_output_identical": True, "routing_identical": True}
        assert len(r["distinct_experts"]) == spec.num_layers and r["routing_read_from"] == "executor"
        for side in ("executor", "detached"):
            times = r[side]["by_rank"]
            assert len(times) == 2 and all(t["count"] == 2 and t["median_s"] > 0 for t in times)
            assert r[side]["median_s"] == max(t["median_s"] for t in times)
            assert r[side]["median_s"] == times[r[side]["slowest_rank"]]["median_s"]
        assert r["collectives_s"] == pytest.approx(r["executor"]["median_s"] - r["detached"]["median_s"])
        assert len(r["bytes_by_rank"]) == 2 and r["floor_s"] == max(r["floor_s_by_rank"])
        bandwidths = [b["bytes_per_s"] for b in record["copy_bandwidth_by_rank"]]
        assert r["floor_s_by_rank"] == pytest.approx([b / w for b, w in zip(r["bytes_by_rank"], bandwidths)])
        assert r["executor"]["fraction_of_floor"] == pytest.approx(r["floor_s"] / r["executor"]["median_s"])


def test_tiny_tp2_in_marlins_layout_runs_on_every_rank(tmp_path):
    """The served Hopper layout on every rank: the middle layers' experts repacked into
    Marlin's layout on each rank's I-slice, run through the layout's NVFP4 experts, the
    ranks' outputs and routing alike."""
    code = main(
        ["bench", "tiny-tp2-nvfp4-marlin", "--device", "cpu", "--replays", "2", "--out", str(tmp_path), "--quiet"]
    )
    assert code == 0
    (path,) = tmp_path.glob("tiny-tp2-nvfp4-marlin_*.json")
    record = json.loads(path.read_text())
    assert record["shard"]["expert_format"] == "nvfp4_marlin" and record["ranks"]["tp"] == 2
    assert "experts_nvfp4" in record["executor"]["layout"]
    for r in record["runs"]:
        assert r["check"] == {"finite": True, "replicated_output_identical": True, "routing_identical": True}


def test_tiny_tp2_sharded_gathers_the_pooler_and_the_unpooler_on_every_rank(tmp_path):
    """The pooler and the unpooler column-sharded: each rank draws half of each, the
    column gathers run over gloo in the step, and the ranks' outputs and routing agree."""
    code = main(["bench", "tiny-tp2-sharded", "--device", "cpu", "--replays", "2", "--out", str(tmp_path), "--quiet"])
    assert code == 0
    (path,) = tmp_path.glob("tiny-tp2-sharded_*.json")
    record = json.loads(path.read_text())
    assert record["shard"]["pooler_unpooler"] == "column-sharded" and record["ranks"]["tp"] == 2
    assert any("column gathers" in c for c in record["collectives_timed"])
    spec = ModelSpec.preset("tiny")
    layer = draw_weights(named("tiny-tp2-sharded"), torch.device("cpu"), 0).layers[0]
    assert layer.pooler.shape == (spec.P // 2, spec.H) and layer.unpooler.shape == (spec.H // 2, spec.P)
    for r in record["runs"]:
        assert r["check"] == {"finite": True, "replicated_output_identical": True, "routing_identical": True}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tiny-tp2", "--device", "cpu", "--backend", "nccl"], "NCCL runs on GPUs only"),
        (["tiny-tp2", "--device", "cpu", "--one-gpu"], "on the CPU leave it out"),
        (["tiny", "--one-gpu"], "configs of every rank, not tiny"),
        (["tp8-Lmax-bf16", "--device", "cpu"], "sizes itself to a GPU's memory"),
        (["tiny-tp2", "--device", "cpu", "--candidates", "attention"], "--candidates is not measured"),
    ],
)
def test_refusals(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_too_few_gpus_and_shards_that_do_not_fit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(BenchConfigError, match="TP 8 runs one rank per GPU and this machine has 4; --one-gpu"):
        Placement(8, "cuda", one_gpu=False, backend=None)
    with pytest.raises(BenchConfigError, match="NCCL refuses two ranks on one GPU"):
        Placement(2, "cuda", one_gpu=True, backend="nccl")
    placement = Placement(4, "cuda", one_gpu=False, backend=None)
    assert placement.backend == "nccl" and placement.device(3) == torch.device("cuda", 3)
    assert placement.times_layouts
    free = {0: 141e9, 1: 141e9, 2: 40e9, 3: 141e9}  # the smallest GPU decides
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (int(free[i]), int(141e9)))
    with pytest.raises(BenchConfigError, match="tp4-L8-bf16 needs .* GB are free"):
        placement.check_fits(named("tp4-L8-bf16"))
    cfg = placement.check_fits(named("tp4-Lmax-bf16"))
    assert cfg.name == f"tp4-L{cfg.layers}-bf16" and cfg.weights_bytes() + (16 << 30) <= 40e9
    # On one GPU every rank's shard and reserve share its memory.
    one = Placement(8, "cuda", one_gpu=True, backend=None)
    assert (one.backend, one.device(5)) == ("gloo", torch.device("cuda", 0))
    assert not one.times_layouts  # time-sliced: the resolver goes by priority
    with pytest.raises(BenchConfigError, match="not one layer"):
        one.check_fits(named("tp8-Lmax-bf16"))
    assert one.check_fits(named("tiny-tp8")).layers == 2


def test_named_configs_of_every_rank():
    cfg = named("tp4-L6-nvfp4")
    assert (cfg.tp, cfg.layers, cfg.expert_format, cfg.expert_parallel, cfg.all_ranks) == (4, 6, "nvfp4", "tp", True)
    assert not named("tp8-rank-L6-bf16").all_ranks
    assert (named("tiny-tp2").preset, named("tiny-tp4").preset, named("tiny-tp8").spec().num_layers) == (
        "tiny",
        "tiny-tp8",
        2,
    )
    marlin = named("tp8-L4-nvfp4-marlin")
    assert (marlin.tp, marlin.expert_format, marlin.all_ranks) == (8, "nvfp4_marlin", True)
    assert [marlin.nvfp4_layer(i) for i in range(4)] == [False, True, True, False]
    tiny = named("tiny-tp4-nvfp4-marlin")
    assert (tiny.expert_format, tiny.layers) == ("nvfp4_marlin", 3) and tiny.nvfp4_layer(1)
    assert named("tiny-tp2").expert_format == "bf16"
    for bad in ("tp3-L2-bf16", "tp8-L63-bf16", "tiny-tp16", "tiny-tp2-nvfp4"):
        with pytest.raises(BenchConfigError):
            named(bad)
    with pytest.raises(BenchConfigError, match="multiples of 64"):  # the tiny widths' I-slice at TP 8
        named("tiny-tp8-nvfp4-marlin")


def test_every_rank_draws_the_same_replicated_weights():
    """Each rank draws only its shard: the replicated tensors (norms, gates, router,
    pooler and unpooler, embedding) alike on every rank, the sharded ones its own."""
    spec = ModelSpec.preset("tiny", 2)
    a, b = (random_weights(spec, seed=3, sharding=Sharding(2, r, "tp")) for r in (0, 1))
    for la, lb in zip(a.layers, b.layers):
        for name in ("pre_qkv_norm", "router", "expert_bias", "pooler", "unpooler", "post_ffn_norm", "attn_alpha"):
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
        assert not torch.equal(la.qkvg, lb.qkvg) and not torch.equal(la.experts.w13, lb.experts.w13)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.lm_head, b.lm_head)
