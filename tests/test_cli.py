"""The command line: demo, providers and check, as a user runs them."""

from __future__ import annotations

import subprocess
import sys

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
