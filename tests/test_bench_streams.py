"""``sparkdecode bench streams-tp8-rank`` on the CPU: it refuses without a GPU, and
the routed-expert streams' accounting and checks run eagerly at tiny widths over
TP 8 (times meaningless here; the GPU record is the claim)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sparkdecode import plugins
from sparkdecode.bench import streams
from sparkdecode.bench.floor import expert_bytes
from sparkdecode.bench.timing import Timer
from sparkdecode.cli import main
from sparkdecode.plugins import discover
from sparkdecode.protocols import LINEAR_WEIGHTS
from sparkdecode.reference.providers import ReferenceExpertsNvfp4


class UnregisteredExperts(ReferenceExpertsNvfp4):
    """An experts_nvfp4 provider outside the registry (--experts-provider's kind)."""

    name = "test.unregistered_experts_nvfp4"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_streams_config_refuses_without_a_gpu(capsys):
    assert main(["bench", "streams-tp8-rank", "--device", "cpu"]) == 2
    assert "GPU" in capsys.readouterr().err


def test_expert_streams_account_and_check_every_provider():
    timer = Timer(torch.device("cpu"))
    log: list[str] = []
    out = streams.expert_streams(
        timer,
        discover(),
        1e12,
        1,
        preset="tiny",  # P 512, I 512: a TP-8 rank's I-slice of 64 is a Marlin width
        layers=2,
        routings=("correlated",),
        slow_s=float("inf"),
        log=log.append,
        extra=(UnregisteredExperts,),
    )
    assert [(s["stream"], s["routing"]) for s in out] == [(e.name, "correlated") for e in streams.EXPERT_STREAMS]
    # a progress line per stream with the seconds elapsed
    assert all(any(line.startswith("[") and e.name in line for line in log) for e in streams.EXPERT_STREAMS)
    for s in out:
        # the tiny experts never fill CHAIN_BYTES: the chain is every layer drawn
        assert s["chain_layers"] == 2 and len(s["distinct_experts"]) == 2
        reference = "reference.experts_nvfp4" if s["kind"] == "experts_nvfp4" else "reference.experts"
        # Marlin's layout: the torch path's rows on the NVFP4 layers are the baseline, timed there
        torch_path = set() if s["expert_format"] == "nvfp4_marlin" else {streams.TORCH}
        extra = {UnregisteredExperts.name} if s["kind"] == "experts_nvfp4" else set()  # measured in its kind's streams
        assert set(s["providers"]) == torch_path | {reference} | extra
        assert "needs a CUDA GPU" in s["unsupported"][f"cuda.{s['kind']}"]
        if s["kind"] == "experts_nvfp4":
            assert "needs a CUDA GPU" in s["unsupported"]["cuda.experts_nvfp4_marlin"]
        assert 1 <= min(s["distinct_experts"]) and max(s["distinct_experts"]) <= streams.CORRELATED_EXPERTS
        for figures in s["providers"].values():
            assert figures["isolated"]["bytes"] == s["distinct_experts"][0] * s["expert_bytes"]
            assert figures["chained"]["bytes"] == sum(s["distinct_experts"]) * s["expert_bytes"]
            assert figures["relative_error_vs_torch"] < 1e-2 and figures["checked_layers"] == 2
    # the streams of one shard form see the same routing
    for parallel in ("expert-TP", "EP"):
        forms = [s["distinct_experts"] for s in out if s["stream"].endswith(parallel)]
        assert len(forms) == 3 and forms[0] == forms[1] == forms[2]
    report = streams.experts_report(out, 1e12)
    assert "isolated only (slow)" not in report
    assert all(f"{s['stream']} {s['routing']}" in " ".join(report.split()) for s in out)
    named = {s["stream"]: s for s in out}
    bf16, nvfp4, marlin = (named[f"experts {f} expert-TP"] for f in ("bf16", "nvfp4", "nvfp4-marlin"))
    # an NVFP4 expert: codes (half a byte), an e4m3 scale per 16 values, 3 fp32 globals;
    # in Marlin's layout the same codes and scale bytes, 2 fp32 globals (W13's halves share one)
    assert nvfp4["expert_bytes"] == bf16["expert_bytes"] // 4 + bf16["expert_bytes"] // 32 + 12
    assert marlin["expert_bytes"] == nvfp4["expert_bytes"] - 4


def test_draw_experts_shard_forms():
    spec = streams.ModelSpec.preset("tiny-tp8", 1)
    g = torch.Generator().manual_seed(0)
    stream = {s.name: s for s in streams.EXPERT_STREAMS}
    ep = streams.draw_experts(spec, stream["experts nvfp4 EP"], g, torch.device("cpu"))
    assert ep.format == "nvfp4" and ep.num_local == spec.E // 8 and ep.w2.shape == (spec.E // 8, spec.P, spec.I // 2)
    ep = streams.draw_experts(spec, stream["experts nvfp4-marlin EP"], g, torch.device("cpu"))
    assert ep.format == "nvfp4_marlin" and ep.w2.shape == (spec.E // 8, spec.I // 16, 2 * spec.P)
    tp = streams.draw_experts(spec, stream["experts bf16 expert-TP"], g, torch.device("cpu"))
    assert tp.intermediate_slice == (0, spec.I // 8) and tp.w13.shape == (spec.E, 2 * spec.I // 8, spec.P)
    assert expert_bytes(type("L", (), {"experts": tp})) == 3 * (spec.I // 8) * spec.P * 2


def test_slow_paths_are_timed_isolated_only():
    timer, runs = Timer(torch.device("cpu")), []
    works = [lambda: runs.append(0), lambda: runs.append(1)]
    isolated, chained = streams._timed(timer, works, 7, slow_s=0.0)
    assert chained is None and isolated.count == streams.SLOW_REPLAYS and set(runs) == {0}
    isolated, chained = streams._timed(timer, works, 7, slow_s=float("inf"))
    assert isolated.count == 7 and chained is not None and chained.count == 7 and 1 in runs
    entry = streams._entry(10, isolated, 1e12)
    stream = {"stream": "s", "routing": "random", "chain_layers": 2, "unsupported": {}}
    stream["providers"] = {"slow": {"isolated": entry, "chained": None, "relative_error_vs_torch": 0.0}}
    assert "isolated only (slow)" in streams.experts_report([stream], 1e12)


def test_spread_ids_hold_exactly_the_distinct_experts_asked():
    from sparkdecode.spec import ModelSpec

    spec = ModelSpec.preset("muse-spark-open", 1)
    for d in (spec.top_k, 33, 55, streams.ROWS * spec.top_k):
        ids = streams.spread_ids(spec, d, torch.Generator().manual_seed(d))
        assert ids.shape == (streams.ROWS, spec.top_k) and ids.dtype == torch.int32
        assert int(torch.unique(ids).numel()) == d
        assert all(int(torch.unique(row).numel()) == spec.top_k for row in ids)  # a row's k distinct
        assert int(ids.min()) >= 0 and int(ids.max()) < spec.E
    for d in (spec.top_k - 1, streams.ROWS * spec.top_k + 1):
        with pytest.raises(ValueError, match=f"distinct experts {d}: from top-k {spec.top_k} to"):
            streams.spread_ids(spec, d, torch.Generator())


def test_script_ids_are_the_draw_asked_and_name_it():
    """The expert scripts' ids: spread_ids' with --distinct (its refusal too), route_ids'
    otherwise, each named as drawn."""
    from sparkdecode.spec import ModelSpec

    spec = ModelSpec.preset("muse-spark-open", 1)
    ids, label = streams.script_ids(spec, 33, "random", torch.Generator().manual_seed(1))
    assert torch.equal(ids, streams.spread_ids(spec, 33, torch.Generator().manual_seed(1))) and label == "--distinct 33"
    ids, label = streams.script_ids(spec, None, "correlated", torch.Generator().manual_seed(2))
    assert torch.equal(ids, streams.route_ids(spec, "correlated", torch.Generator().manual_seed(2)))
    assert label == "correlated routing"
    with pytest.raises(ValueError, match="distinct experts 7"):
        streams.script_ids(spec, 7, "random", torch.Generator())


def test_chain_length_reads_three_l2s_with_the_fewest_layers():
    mb = 1_000_000
    assert streams.chain_length([1, 1, 1, 1, 1], 50 * mb) == 3
    assert streams.chain_length([10, 10, 10], 100 * mb) == 2  # a chain is at least 2 layers
    assert streams.chain_length([0, 1, 0], 50 * mb) == 3  # never enough: all the layers there are


def test_part_experts_is_streams_tp8_rank_only(capsys):
    assert main(["bench", "streams-tp1", "--part", "experts"]) == 2
    assert "streams-tp8-rank only" in capsys.readouterr().err


def _fake_gpu(monkeypatch) -> None:
    """main's GPU-only pieces replaced, so its parts and records run on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(plugins, "discover", lambda: SimpleNamespace(of=lambda kind: []))
    monkeypatch.setattr(streams, "Timer", lambda device: Timer(torch.device("cpu")))
    monkeypatch.setattr(streams, "copy_bandwidth", lambda device: SimpleNamespace(bytes_per_s=1e12))


def test_each_part_writes_the_record_when_it_finishes(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch)
    linear = {"p": {name: (1e-6, 1e12) for name in (*LINEAR_WEIGHTS, "chain")}}
    monkeypatch.setattr(streams, "linear_streams", lambda *a: linear)

    def timed_out(*args, **kwargs):
        raise TimeoutError("the experts part ran out of time")

    monkeypatch.setattr(streams, "expert_streams", timed_out)
    with pytest.raises(TimeoutError):
        main(["bench", "streams-tp8-rank", "--out", str(tmp_path / "both"), "--quiet"])
    (path,) = (tmp_path / "both").glob("streams-tp8-rank_*.json")
    record = json.loads(path.read_text())
    assert record["parts"] == ["linear"] and record["experts"] is None
    assert record["linear"]["p"]["chain"] == {"median_s": 1e-6, "bytes_per_s": 1e12}

    def not_run(*args):
        raise AssertionError("--part experts ran the linear part")

    monkeypatch.setattr(streams, "linear_streams", not_run)
    monkeypatch.setattr(streams, "expert_streams", lambda *a, **k: [])
    assert main(["bench", "streams-tp8-rank", "--part", "experts", "--out", str(tmp_path / "experts"), "--quiet"]) == 0
    (path,) = (tmp_path / "experts").glob("streams-tp8-rank_*.json")
    record = json.loads(path.read_text())
    assert record["parts"] == ["experts"] and record["linear"] is None and record["experts"] == []


def test_the_sharded_streams_read_an_eighth_of_the_pooler_and_the_unpooler(monkeypatch, capsys, tmp_path):
    _fake_gpu(monkeypatch)
    seen = []

    def linear_streams(timer, providers, shapes, replays):
        seen.append(shapes)
        return {}

    monkeypatch.setattr(streams, "linear_streams", linear_streams)
    assert main(["bench", "streams-tp8-rank-sharded", "--part", "linear", "--out", str(tmp_path), "--quiet"]) == 0
    (shapes,) = seen
    whole = streams.SHAPES["streams-tp8-rank"]
    assert shapes["pooler"] == (whole["pooler"][0] // 8, whole["pooler"][1])
    assert shapes["unpooler"] == (whole["unpooler"][0] // 8, whole["unpooler"][1])
    assert {k: v for k, v in shapes.items() if k not in ("pooler", "unpooler")} == {
        k: v for k, v in whole.items() if k not in ("pooler", "unpooler")
    }
    assert main(["bench", "streams-tp8-rank-sharded", "--part", "experts"]) == 2
    assert "streams-tp8-rank only" in capsys.readouterr().err


def test_linear_provider_by_import_path(monkeypatch, capsys, tmp_path):
    """--linear-provider measures a class by its import path beside the registered
    ones (none here); a path that is not module:Class is an error."""
    _fake_gpu(monkeypatch)
    measured = []

    def linear_streams(timer, providers, shapes, replays):
        measured.extend(providers)
        return {cls.name: {name: (1e-6, 1e12) for name in (*LINEAR_WEIGHTS, "chain")} for cls in providers}

    monkeypatch.setattr(streams, "linear_streams", linear_streams)
    path = "sparkdecode.reference.providers:ReferenceLinear"
    args = ["bench", "streams-tp1", "--linear-provider", path, "--part", "linear", "--out", str(tmp_path), "--quiet"]
    assert main(args) == 0
    assert [cls.name for cls in measured] == ["reference.linear"]
    assert main(["bench", "streams-tp1", "--linear-provider", "sparkdecode.reference.providers"]) == 2
    assert "not module:Class" in capsys.readouterr().err


def test_experts_provider_by_import_path(monkeypatch, capsys, tmp_path):
    """--experts-provider hands the class at an import path to the experts part (measured
    beside the registered ones, as above); a path that is not module:Class, or a config
    without the experts, is an error."""
    _fake_gpu(monkeypatch)
    given = {}

    def expert_streams(*args, **kwargs):
        given.update(kwargs)
        return []

    monkeypatch.setattr(streams, "expert_streams", expert_streams)
    path = "test_bench_streams:UnregisteredExperts"
    args = ["bench", "streams-tp8-rank", "--experts-provider", path, "--part", "experts", "--out", str(tmp_path)]
    assert main([*args, "--quiet"]) == 0
    assert given["extra"] == (UnregisteredExperts,)
    assert main(["bench", "streams-tp8-rank", "--experts-provider", "sparkdecode.reference.providers"]) == 2
    assert "not module:Class" in capsys.readouterr().err
    assert main(["bench", "streams-tp1", "--experts-provider", path, "--part", "linear"]) == 2
    assert "streams-tp8-rank only" in capsys.readouterr().err


def test_linear_streams_time_the_chain_as_the_step_runs_it():
    """Both chains on the CPU (the step's: the router through its own op, in line where
    there is no side stream), each over the same bytes, and the report prints both."""
    from sparkdecode.reference.providers import ReferenceLinear

    shapes = {"qkvg": (96, 64), "o_proj": (64, 32), "router": (16, 64), "pooler": (32, 64), "unpooler": (64, 32)}
    record = streams.linear_streams(Timer(torch.device("cpu")), [ReferenceLinear], shapes, 1)
    row = record["reference.linear"]
    assert set(row) == {*LINEAR_WEIGHTS, "chain", "chain_step"}
    total = streams.CHAIN_LAYERS * sum(streams.weight_bytes(shapes, w) for w in LINEAR_WEIGHTS)
    for key in ("chain", "chain_step"):
        seconds, bw = row[key]
        assert seconds > 0 and bw == pytest.approx(total / seconds)
    streams.SHAPES["test-shapes"] = shapes
    try:
        text = streams.report("test-shapes", 1e12, record)
    finally:
        del streams.SHAPES["test-shapes"]
    assert "\nchain " in text and "\nchain_step " in text
