"""``sparkdecode bench streams-tp8-rank`` on the CPU: it refuses without a GPU, and
the routed-expert streams' accounting and checks run eagerly at the tiny TP-8
widths (times meaningless here; the GPU record is the claim)."""

from __future__ import annotations

import pytest
import torch

from sparkdecode.bench import streams
from sparkdecode.bench.floor import expert_bytes
from sparkdecode.bench.timing import Timer
from sparkdecode.cli import main
from sparkdecode.plugins import discover


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_streams_config_refuses_without_a_gpu(capsys):
    assert main(["bench", "streams-tp8-rank", "--device", "cpu"]) == 2
    assert "GPU" in capsys.readouterr().err


def test_expert_streams_account_and_check_every_provider():
    timer = Timer(torch.device("cpu"))
    out = streams.expert_streams(
        timer, discover(), 1e12, 1, preset="tiny-tp8", layers=2, routings=("correlated",), log=lambda m: None
    )
    assert [(s["stream"], s["routing"]) for s in out] == [(e.name, "correlated") for e in streams.EXPERT_STREAMS]
    for s in out:
        reference = "reference.experts_nvfp4" if s["kind"] == "experts_nvfp4" else "reference.experts"
        assert set(s["providers"]) == {streams.TORCH, reference}
        assert "needs a CUDA GPU" in s["unsupported"][f"cuda.{s['kind']}"]
        assert 1 <= min(s["distinct_experts"]) and max(s["distinct_experts"]) <= streams.CORRELATED_EXPERTS
        for figures in s["providers"].values():
            assert figures["isolated"]["bytes"] == s["distinct_experts"][0] * s["expert_bytes"]
            assert figures["chained"]["bytes"] == sum(s["distinct_experts"]) * s["expert_bytes"]
            assert figures["relative_error_vs_torch"] < 1e-2
    nvfp4_tp = next(s for s in out if s["stream"] == "experts nvfp4 expert-TP")
    bf16_tp = next(s for s in out if s["stream"] == "experts bf16 expert-TP")
    # an NVFP4 expert: codes (half a byte), an e4m3 scale per 16 values, 3 fp32 globals
    assert nvfp4_tp["expert_bytes"] == bf16_tp["expert_bytes"] // 4 + bf16_tp["expert_bytes"] // 32 + 12


def test_draw_experts_shard_forms():
    spec = streams.ModelSpec.preset("tiny-tp8", 1)
    g = torch.Generator().manual_seed(0)
    ep = streams.draw_experts(spec, streams.EXPERT_STREAMS[3], g, torch.device("cpu"))
    assert ep.format == "nvfp4" and ep.num_local == spec.E // 8 and ep.w2.shape == (spec.E // 8, spec.P, spec.I // 2)
    tp = streams.draw_experts(spec, streams.EXPERT_STREAMS[0], g, torch.device("cpu"))
    assert tp.intermediate_slice == (0, spec.I // 8) and tp.w13.shape == (spec.E, 2 * spec.I // 8, spec.P)
    assert expert_bytes(type("L", (), {"experts": tp})) == 3 * (spec.I // 8) * spec.P * 2
