"""The command line: demo, providers and check, as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sparkdecode.cli import main


def test_demo_runs_and_agrees(capsys):
    assert main(["demo", "--steps", "4", "--prompt", "70", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "reference.attention" in out
    assert "greedy tokens agree: 4/4 steps" in out
    assert "largest |hidden stock - executor|: 0" in out


def test_demo_as_installed_command():
    result = subprocess.run(
        [sys.executable, "-m", "sparkdecode.cli", "demo", "--steps", "2", "--prompt", "16", "--layers", "2"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "greedy tokens agree: 2/2 steps" in result.stdout


def test_providers_lists_the_reference(capsys):
    assert main(["providers", "--preset", "tiny", "--max-context", "1024"]) == 0
    out = capsys.readouterr().out
    for block in ("boundary", "attention", "attention_boundary", "moe", "final", "experts"):
        assert f"reference.{block}" in out
    assert "supported" in out


def test_check_names_what_is_unsupported(capsys):
    assert main(["check", "--preset", "tiny", "--max-context", "1024"]) == 0
    assert "supported" in capsys.readouterr().out
    assert main(["check", "--preset", "tiny", "--tp", "3", "--max-context", "1024"]) == 1
    assert "tensor parallel size 3" in capsys.readouterr().out
    assert main(["check", "--preset", "tiny", "--max-context", "1024", "--pin", "moe=nope.moe"]) == 1
    assert "'nope.moe'" in capsys.readouterr().out
    assert main(["check", "--preset", "tiny", "--max-context", "1024", "--expert-format", "nvfp4"]) == 0
    assert "reference.experts_nvfp4" in capsys.readouterr().out
    assert main(["check", "--preset", "tiny", "--max-context", "1024", "--expert-format", "int3"]) == 1
    assert "expert format 'int3'" in capsys.readouterr().out


def test_bad_spec_is_a_clean_error(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    assert main(["check", "--config", str(tmp_path)]) == 2
    assert "config is missing" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["demo", "--prompt", "0"], "argument --prompt: 0 is below 1"),
        (["demo", "--steps", "-1"], "argument --steps: -1 is below 1"),
        (["demo", "--layers", "1000"], "at most 62"),
        (["--log", "LOUD", "providers"], "argument --log: invalid choice"),
        (["check", "--preset", "tiny", "--tp", "0"], "argument --tp: 0 is below 1"),
        (["providers", "--preset", "tiny", "--tp", "x"], "argument --tp: 'x' is not an integer"),
        (["check", "--preset", "tiny", "--max-context", "0"], "argument --max-context: 0 is below 1"),
        (["bench", "tiny", "--replays", "-5"], "argument --replays: -5 is below 1"),
        (["bench", "tiny", "--context", "5"], "argument --context: 5 is below 9"),
    ],
)
def test_a_value_out_of_range_is_a_usage_error(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["demo", "--prompt", "1000", "--steps", "10"], "need a context of 1080, above --max-context 1024"),
        (["demo", "--max-context", "99999"], "above the tiny model's 4096 positions"),
        (["demo", "--device", "tpu"], "--device 'tpu': cpu or cuda[:N]"),
        (["check", "--preset", "tiny", "--pin", "moe=a.moe", "--pin", "moe=b.moe"], "--pin moe given twice"),
        (["check", "--preset", "tiny", "--pin", "moe"], "--pin takes BLOCK=PROVIDER, got 'moe'"),
        (["bench", "tiny", "--out", "/proc/no-such-folder"], "--out /proc/no-such-folder"),
        (["bench", "--plot-from", "/no/such/record.json"], "no such file: /no/such/record.json"),
    ],
)
def test_inconsistent_values_are_named_before_the_run(capsys, argv, words):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


def test_an_unreadable_config_is_named(capsys, tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    assert main(["check", "--config", str(tmp_path)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    assert main(["check", "--config", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_providers_names_what_the_executor_refuses(capsys):
    assert main(["providers", "--preset", "tiny", "--max-context", "1024", "--expert-format", "int3"]) == 0
    assert "the executor does not take this deployment: expert format 'int3'" in capsys.readouterr().out


def test_a_pin_of_a_kind_this_layout_does_not_resolve_is_still_checked(capsys):
    """The draft's kinds are resolved by the draft's executor, but a pin naming no
    installed provider is a mistake found now."""
    argv = ["check", "--preset", "tiny", "--max-context", "1024", "--pin", "draft_mlp=nope.mlp"]
    assert main(argv) == 1
    assert "draft_mlp is pinned to 'nope.mlp', which no installed pack provides" in capsys.readouterr().out


def test_a_named_cuda_device_is_made_current(monkeypatch):
    """``--device cuda:N`` becomes torch's current device (graphs capture on its
    streams); ``--device cuda`` names the current one and changes nothing."""
    import torch

    from sparkdecode.arguments import device_of

    made: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    assert device_of("cuda") == torch.device("cuda") and made == []
    assert device_of("cuda:1") == torch.device("cuda", 1) and made == [torch.device("cuda", 1)]
