"""``sparkdecode bench`` on the CPU: the named configs, the byte accounting of
the floor, the record and its table, a detached TP-8 rank, the plot. On the CPU
the bench runs eagerly and says it is not a speed claim; the CUDA-graph timing
and the FlashInfer baseline are tested in test_gpu_bench.py."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch

from sparkdecode.bench import configs
from sparkdecode.bench.configs import BenchConfig, BenchConfigError, named
from sparkdecode.bench.floor import block_bytes, expert_bytes, expert_tensors, kv_keys
from sparkdecode.bench.runner import run
from sparkdecode.bench.steer import CORRELATED_EXPERTS, draw_weights
from sparkdecode.cli import main
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import random_weights


@pytest.fixture(scope="module")
def tiny_record(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench")
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(
            ["bench", "tiny", "--device", "cpu", "--context", "300", "--replays", "2", "--block-replays", "1"]
            + ["--candidates", "attention_core", "--out", str(out), "--quiet"]
        )
    assert code == 0
    (path,) = out.glob("tiny_*.json")
    return path, text.getvalue()


def test_tiny_on_the_cpu_is_labelled_and_recorded(tiny_record):
    path, text = tiny_record
    assert "NOT A SPEED CLAIM (eager on the CPU)" in text
    assert "copy bandwidth" in text and "per block" in text
    record = json.loads(path.read_text())
    assert record["speed_claim"] is False and record["mode"] == "eager on the CPU"
    assert record["config"] == "tiny" and record["command"].startswith("sparkdecode bench")
    assert len(record["commit"]) == 40
    assert record["copy_bandwidth"]["bytes_per_s"] > 0
    assert [(r["context"], r["routing"]) for r in record["runs"]] == [(300, "random"), (300, "correlated")]
    spec = ModelSpec.preset("tiny")
    for r in record["runs"]:
        assert len(r["distinct_experts"]) == spec.num_layers
        assert r["routing_read_from"] == "executor"
        # Both sides run the reference attention on the CPU: the same ops, the same bits.
        assert r["check"] == {
            "attention_relative_error": 0.0,
            "relative_error_baseline_vs_executor": 0.0,
            "layers_routed_alike": spec.num_layers,
            "finite": True,
        }
        assert r["bytes"] == sum(b["bytes"] for b in r["blocks"].values())
        assert r["floor_s"] == pytest.approx(r["bytes"] / record["copy_bandwidth"]["bytes_per_s"])
        for side in ("baseline", "executor"):
            assert r[side]["min_s"] <= r[side]["median_s"] <= r[side]["max_s"]
            assert r[side]["fraction_of_floor"] == pytest.approx(r["floor_s"] / r[side]["median_s"])
        assert all("baseline" in b and "executor" in b for b in r["blocks"].values())
        assert len(r["blocks"]) == 1 + 4 * spec.num_layers + 1
    _, correlated = record["runs"]
    assert max(correlated["distinct_experts"]) <= CORRELATED_EXPERTS
    assert len(record["routing_method"]["favoured_experts"]) == spec.num_layers


def test_a_slow_baseline_is_timed_fewer_times(tmp_path, monkeypatch):
    """A baseline step slower than SLOW_BASELINE_S is timed SLOW_BASELINE_REPLAYS
    times (the executor still over --replays), and the table says so."""
    from sparkdecode.bench import runner

    monkeypatch.setattr(runner, "SLOW_BASELINE_S", 0.0)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = main(
            ["bench", "tiny", "--device", "cpu", "--context", "40", "--replays", "7", "--no-blocks"]
            + ["--routing", "random", "--out", str(tmp_path), "--quiet"]
        )
    assert code == 0
    (path,) = tmp_path.glob("tiny_*.json")
    (run,) = json.loads(path.read_text())["runs"]
    assert (run["baseline"]["count"], run["executor"]["count"]) == (runner.SLOW_BASELINE_REPLAYS, 7)
    assert f"baseline: timed over {runner.SLOW_BASELINE_REPLAYS} replays only" in text.getvalue()


def test_candidates_are_timed_per_layer(tiny_record):
    """--candidates: every provider that supports the kind here (on the CPU, the
    reference's), on every layer, in the record and the table."""
    path, text = tiny_record
    record = json.loads(path.read_text())
    (entry,) = record["candidates"]
    assert entry["context"] == 300
    layers = record["model"]["layers"]
    assert sorted(entry["blocks"]) == [f"attention_core.{i}" for i in range(layers)]
    for providers in entry["blocks"].values():
        assert list(providers) == ["reference.attention_core"]
        assert providers["reference.attention_core"]["median_s"] > 0
    assert "candidates, context 300" in text and "reference.attention_core" in text


def test_floor_counts_what_the_step_reads():
    spec = ModelSpec.preset("tiny")
    weights = random_weights(spec, seed=1)
    context, rows = 1000, 8
    distinct = [3, 5, 7, 9]
    blocks = {b.name: b for b in block_bytes(weights, context, rows, distinct)}
    H, P, I, E, d = spec.H, spec.P, spec.I, spec.E, spec.head_dim  # noqa: E741
    kv = spec.num_key_value_heads
    assert expert_bytes(weights.layers[0]) == (2 * I * P + P * I) * 2
    for i, layer in enumerate(weights.layers):
        keys = context if layer.window is None else spec.sliding_window + rows - 1
        assert kv_keys(layer, context, rows) == keys
        qkvg = (2 * spec.q_size + 2 * spec.kv_size) * H * 2
        assert blocks[f"attention.{i}"].bytes == qkvg + H * spec.q_size * 2 + 2 * keys * kv * d * 2
        moe = E * H * 4 + E * 4 + 2 * P * H * 2 + 2 * P * 2 + distinct[i] * expert_bytes(layer)
        assert blocks[f"moe.{i}"].bytes == moe
        assert blocks[f"boundary.{i}"].bytes == H * 2 + (H * 2 + 2 * H * 4 if i else 0)
        assert blocks[f"attention_boundary.{i}"].bytes == 2 * H * 4 + H * 2
    assert blocks["final"].bytes == H * 2 + 2 * H * 4 + H * 2
    assert blocks["embed"].bytes == rows * H * 2
    assert blocks["attention.1"].kind == "attention (full)" and blocks["attention.0"].kind == "attention (sliding)"
    # A context shorter than the window: the sliding layers see it all.
    assert kv_keys(weights.layers[0], 40, rows) == 40


def test_a_detached_tp8_rank_runs_and_lists_its_collectives():
    cfg = BenchConfig("tiny-tp8-rank", "tiny-tp8", 2, (200,), tp=8, rank=5, expert_parallel="tp", speed_claim=False)
    record = run(cfg, device=torch.device("cpu"), replays=1, blocks=False, routings=("random",))
    assert record["shard"]["tp"] == 8 and record["shard"]["rank"] == 5
    assert len(record["collectives_left_out"]) == 2
    assert any("detached" in note for note in record["executor"]["notes"])
    (r,) = record["runs"]
    assert r["check"]["finite"] and r["check"]["relative_error_baseline_vs_executor"] == 0.0
    spec = ModelSpec.preset("tiny-tp8", 2)
    # Only the rank's shard is drawn. Expert TP: every expert, an eighth of its intermediate rows.
    experts = draw_weights(cfg, torch.device("cpu"), 0).layers[0].experts
    assert experts.w13.shape == (spec.E, 2 * spec.I // 8, spec.P) and experts.w2.shape == (spec.E, spec.P, spec.I // 8)


def test_a_detached_sharded_tp8_rank_matches_its_baseline():
    """The pooler and the unpooler column-sharded (``-sharded``): the rank draws its
    columns of both, its gathers are left out like its all-reduces, and the executor
    matches the torch baseline of the same shard bit for bit."""
    base = BenchConfig("tiny-tp8-rank", "tiny-tp8", 2, (200,), tp=8, rank=5, expert_parallel="tp", speed_claim=False)
    cfg = dataclasses.replace(base, name="tiny-tp8-rank-sharded", shard_projections=True)
    record = run(cfg, device=torch.device("cpu"), replays=1, blocks=False, routings=("random",))
    assert record["shard"]["pooler_unpooler"] == "column-sharded"
    assert len(record["collectives_left_out"]) == 3
    assert "column gathers of the sharded pooler" in record["collectives_left_out"][2]
    (r,) = record["runs"]
    assert r["check"]["finite"] and r["check"]["relative_error_baseline_vs_executor"] == 0.0
    spec = ModelSpec.preset("tiny-tp8", 2)
    moe = draw_weights(cfg, torch.device("cpu"), 0).layers[0]
    assert moe.pooler.shape == (spec.P // 8, spec.H) and moe.unpooler.shape == (spec.H // 8, spec.P)
    replicated = run(base, device=torch.device("cpu"), replays=1, blocks=False, routings=("random",))
    assert record["runs"][0]["floor_s"] < replicated["runs"][0]["floor_s"]


def test_named_configs():
    assert named("tp1-real-L2").contexts == (4096, 32768)
    cfg = named("tp8-rank-L36-bf16")
    assert (cfg.tp, cfg.layers, cfg.expert_parallel, cfg.spec().hidden_size) == (8, 36, "tp", 8192)
    assert named("tiny").speed_claim is False
    with pytest.raises(BenchConfigError):
        named("tp8-rank-L63-bf16")
    with pytest.raises(BenchConfigError):
        named("huge")
    assert configs.ROWS == 8


def test_sharded_configs_cut_the_pooler_and_the_unpooler():
    cfg, replicated = named("tp8-rank-L40-nvfp4-marlin-sharded"), named("tp8-rank-L40-nvfp4-marlin")
    assert cfg.shard_projections and not replicated.shard_projections
    assert dataclasses.replace(cfg, name=replicated.name, shard_projections=False) == replicated
    s = cfg.spec()
    # Each layer's pooler [P, H] and unpooler [H, P] in bf16: an eighth of each a rank.
    assert replicated.weights_bytes() - cfg.weights_bytes() == 40 * 2 * (2 * s.P * s.H) * 7 // 8
    assert named("tp4-L2-bf16-sharded").all_ranks and named("tiny-tp2-sharded").shard_projections
    assert named("tp8-rank-Lmax-bf16-sharded").fitting(200 << 30).shard_projections
    for name, why in (("tiny-sharded", "is TP 1"), ("tp1-real-L2-sharded", "is TP 1"), ("-sharded", "unknown")):
        with pytest.raises(BenchConfigError, match=why):
            named(name)


def test_bench_cli_errors(capsys):
    assert main(["bench", "huge"]) == 2
    assert "unknown bench config" in capsys.readouterr().err
    assert main(["bench"]) == 2
    assert main(["bench", "tiny", "--device", "cpu", "--provider", "no-colon"]) == 2
    assert "--provider: 'no-colon' is not module:Class" in capsys.readouterr().err
    assert main(["bench", "tiny", "--device", "cpu", "--provider", "sparkdecode.reference.providers:NoSuch"]) == 2
    assert "--provider" in capsys.readouterr().err
    registered = "sparkdecode.reference.providers:ReferenceLinear"
    assert main(["bench", "tiny", "--device", "cpu", "--provider", registered, "--quiet"]) == 2
    assert "reference.linear is already registered" in capsys.readouterr().err
    assert main(["bench", "tiny-tp2-nvfp4-marlin", "--provider", registered]) == 2
    assert "--provider is for configs of one rank, not tiny-tp2-nvfp4-marlin" in capsys.readouterr().err
    assert main(["bench", "tiny-tp2-nvfp4-marlin", "--watch"]) == 2
    assert "--watch is for configs of one rank, not tiny-tp2-nvfp4-marlin" in capsys.readouterr().err
    assert main(["bench", "streams-tp8-rank", "--watch"]) == 2
    assert "--watch is for the step's configs, not streams-tp8-rank" in capsys.readouterr().err
    assert main(["bench", "tiny", "--device", "cpu", "--watch", "--quiet"]) == 2
    assert "--watch samples a GPU's clocks: it needs --device cuda" in capsys.readouterr().err


def test_a_watched_run_records_its_clocks(tmp_path, monkeypatch):
    """run() with a clock watch (here over a stand-in nvidia-smi) holds each run's clocks
    through the executor's replays, and the table prints them."""
    import time

    from fake_smi import fake_smi

    from sparkdecode.bench import runner
    from sparkdecode.bench.clockwatch import ClockWatch
    from sparkdecode.bench.report import table

    timed = runner.Timer.time

    def slow(self, work, replays):  # outlasts several samples
        time.sleep(0.2)
        return timed(self, work, replays)

    monkeypatch.setattr(runner.Timer, "time", slow)
    with ClockWatch(interval_ms=10, smi=fake_smi(tmp_path)) as watch:
        record = run(
            named("tiny"), device=torch.device("cpu"), contexts=(40,), replays=1, blocks=False, routings=("random",),
            watch=watch,
        )  # fmt: skip
    (r,) = record["runs"]
    clocks = r["clocks"]
    assert clocks["power_field"] == "power.draw" and clocks["samples"] >= 5
    assert (clocks["sm_mhz_median"], clocks["power_w_max"], clocks["reasons"]) == (1755.0, 698.5, {"power cap": 1.0})
    assert "clocks, context 40 random: SM 1755 MHz" in table(record)
    assert run(named("tiny"), device=torch.device("cpu"), contexts=(40,), replays=1, blocks=False,
               routings=("random",))["runs"][0]["clocks"] is None  # fmt: skip


def test_max_context_builds_the_executor_as_served(tmp_path, monkeypatch):
    """--max-context: the executor is built for vLLM's max_model_len while the step times
    a shorter context; the record names it. Below a context or above the model's
    positions, or for a streams config: a clear error."""
    from sparkdecode.bench import runner

    built = []

    class Recording(runner.SpecializedDecode):
        def __init__(self, weights, config, **kw):
            built.append(config.max_context)
            super().__init__(weights, config, **kw)

    monkeypatch.setattr(runner, "SpecializedDecode", Recording)
    args = ["bench", "tiny", "--device", "cpu", "--context", "40", "--replays", "1", "--no-blocks"]
    args += ["--routing", "random", "--out", str(tmp_path), "--quiet"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main([*args, "--max-context", "600"]) == 0
    (path,) = tmp_path.glob("tiny_*.json")
    assert built == [600] and json.loads(path.read_text())["max_context"] == 600
    assert "built for a max context of 600 (as served)" in text.getvalue()
    path.unlink()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0
    (path,) = tmp_path.glob("tiny_*.json")
    assert built == [600, 40] and json.loads(path.read_text())["max_context"] is None


def test_max_context_errors(capsys):
    assert main(["bench", "tiny", "--device", "cpu", "--context", "300", "--max-context", "200"]) == 2
    assert "--max-context 200 is below the context 300" in capsys.readouterr().err
    positions = ModelSpec.preset("tiny").max_position_embeddings
    assert main(["bench", "tiny", "--device", "cpu", "--max-context", str(positions + 1)]) == 2
    assert f"is above the model's {positions} positions" in capsys.readouterr().err
    assert main(["bench", "tiny-tp2", "--device", "cpu", "--context", "300", "--max-context", "200"]) == 2
    assert "--max-context 200 is below the context 300" in capsys.readouterr().err
    assert main(["bench", "streams-tp8-rank", "--max-context", "4096"]) == 2
    assert "--max-context is for the step configs" in capsys.readouterr().err


def test_an_unregistered_provider_is_offered_and_recorded(tmp_path, monkeypatch):
    """``--provider module:Class``: a class no pack registers, pinned like a registered
    one, and named in the record."""
    (tmp_path / "extra_linear.py").write_text(
        "from sparkdecode.reference.providers import ReferenceLinear\n\n\n"
        "class ExtraLinear(ReferenceLinear):\n    name = 'extra.linear'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(
            ["bench", "tiny", "--device", "cpu", "--context", "300", "--replays", "1", "--no-blocks"]
            + ["--routing", "random", "--provider", "extra_linear:ExtraLinear", "--pin", "linear=extra.linear"]
            + ["--out", str(out), "--quiet"]
        )
    assert code == 0
    (path,) = out.glob("tiny_*.json")
    executor = json.loads(path.read_text())["executor"]
    assert executor["layout"]["linear"].startswith("extra.linear")
    assert executor["unregistered_providers"] == {"extra.linear": "extra_linear:ExtraLinear"}


def test_plot_from_a_record(tiny_record, tmp_path):
    path, _ = tiny_record
    copy = tmp_path / path.name
    copy.write_text(path.read_text())
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["bench", "--plot-from", str(copy)]) == 2
        return
    assert main(["bench", "--plot-from", str(copy)]) == 0
    png = copy.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nvfp4_configs_count_and_draw_nvfp4_experts():
    cfg = named("tp8-rank-L62-nvfp4")
    assert (cfg.layers, cfg.expert_format, cfg.expert_parallel) == (62, "nvfp4", "tp")
    assert [cfg.nvfp4_layer(i) for i in (0, 1, 60, 61)] == [False, True, True, False]
    assert cfg.weights_bytes() < named("tp8-rank-L62-bf16").weights_bytes() * 0.4
    assert named("tp8-rank-Lmax-nvfp4").fitting(141 << 30).name.endswith("-nvfp4")
    # At the tiny widths: the NVFP4 bytes the config counts are the bytes drawn.
    sizes = {}
    for fmt in ("bf16", "nvfp4"):
        small = BenchConfig("x", "tiny", 4, (200,), tp=2, expert_parallel="tp", expert_format=fmt, speed_claim=False)
        weights = draw_weights(small, torch.device("cpu"), 0)
        formats = [layer.experts.format for layer in weights.layers]
        assert formats == (["bf16", "nvfp4", "nvfp4", "bf16"] if fmt == "nvfp4" else ["bf16"] * 4)
        drawn = sum(t.numel() * t.element_size() for layer in weights.layers for t in expert_tensors(layer.experts))
        sizes[fmt] = (small.weights_bytes(), drawn)
    assert sizes["bf16"][0] - sizes["nvfp4"][0] == sizes["bf16"][1] - sizes["nvfp4"][1]


def test_the_floor_counts_nvfp4_experts_with_their_scales():
    spec = ModelSpec.preset("tiny")
    weights = random_weights(spec, seed=1, expert_format="nvfp4")
    P, I = spec.P, spec.I  # noqa: E741, N806
    assert expert_bytes(weights.layers[0]) == 3 * I * P * 2  # bf16 edge layer
    assert expert_bytes(weights.layers[1]) == 3 * I * P // 2 + 3 * I * P // 16 + 3 * 4


def test_an_nvfp4_tp8_rank_runs_against_the_baseline():
    """The torch baseline's NVFP4 path (per route dequantized, batched GEMVs) against
    the executor's reference experts_nvfp4 (dequantized, grouped GEMMs): the same
    bf16 weights and roundings, GEMMs of another shape."""
    cfg = BenchConfig(
        "tiny-tp8-rank-nvfp4", "tiny-tp8", 3, (200,), tp=8, expert_parallel="tp", expert_format="nvfp4",
        speed_claim=False,
    )  # fmt: skip
    record = run(cfg, device=torch.device("cpu"), replays=1, blocks=False, routings=("random",))
    (r,) = record["runs"]
    assert record["shard"]["expert_format"] == "nvfp4"
    assert r["check"]["finite"] and r["check"]["relative_error_baseline_vs_executor"] < 1e-2
    assert r["check"]["layers_routed_alike"] == 3


def test_bound_step_runs_the_executor_as_the_bench_does():
    """steer.bound_step (the scripts' step) binds and plans the executor as the bench's
    runner does (prepare_kv, plan at the context's end, prepare_step): the same step
    rows and the same hidden states, bit for bit, on the tiny config."""
    from sparkdecode.bench.configs import ROWS
    from sparkdecode.bench.steer import bound_step, filled_cache
    from sparkdecode.executor import DecodeConfig, SpecializedDecode
    from sparkdecode.protocols import HostStep

    weights = draw_weights(named("tiny"), torch.device("cpu"), 0)
    context, tokens = 64, torch.arange(ROWS)
    outputs = []
    for helper in (True, False):
        cache = filled_cache(weights, context, ROWS, 0)
        executor = SpecializedDecode(weights, DecodeConfig(q=ROWS, max_rows=ROWS, max_context=context))
        if helper:
            step = bound_step(executor, cache, context, ROWS)
        else:
            executor.prepare_kv(cache.kv())
            step = executor.plan(torch.arange(context - ROWS, context))
            executor.prepare_step(HostStep(first_position=context - ROWS, rows=ROWS, context_len=context))
        assert step is not None and step.rows == ROWS
        out = executor.run(step, input_ids=tokens)
        outputs.append((out[0] if isinstance(out, tuple) else out).clone())
    assert torch.equal(outputs[0], outputs[1]) and outputs[0].isfinite().all()
