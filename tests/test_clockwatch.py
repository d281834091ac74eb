"""The clock watch (sparkdecode.bench.clockwatch) on the CPU: nvidia-smi's lines parsed, the
reasons named, the samples put in their phases, and the reasons field an older driver names,
against a stand-in nvidia-smi."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_smi import fake_smi as write_fake
from fake_smi import write_script

from sparkdecode.bench.clockwatch import (
    ClockWatch,
    ClockWatchError,
    Sample,
    clocks_record,
    energy_text,
    parse_line,
    power_budget,
    query_fields,
    reason_names,
    summarize,
    windows,
)


def test_parse_line_reads_the_fields():
    sample = parse_line("1980, 2619, 512.31, 700.00, 45, 0x0000000000000004\n", 3.0)
    assert sample == Sample(3.0, 1980.0, 2619.0, 512.31, 700.0, 45.0, 0x4)


@pytest.mark.parametrize("line", ["", "1980, 2619, [N/A], 700.00, 45, 0x0", "1980, 2619, 5", "a, b, c, d, e, f"])
def test_parse_line_skips_what_is_not_a_sample(line):
    assert parse_line(line, 0.0) is None


def test_reason_names():
    assert reason_names(0) == "none"
    assert reason_names(0x4) == "power cap"
    assert reason_names(0x4 | 0x20) == "power cap+sw thermal"
    assert reason_names(0x1000 | 0x1) == "idle+0x1000"


def test_summarize_takes_medians_and_reason_shares():
    samples = [
        Sample(float(i), mhz, 2619.0, w, 700.0, 40.0 + i, r)
        for i, (mhz, w, r) in enumerate(
            [(1980.0, 600.0, 0x0), (1755.0, 699.0, 0x4), (1800.0, 690.0, 0x4), (1980.0, 650.0, 0x0)]
        )
    ]
    s = summarize("x", 1.0, samples)
    assert (s.samples, s.sm_mhz_median, s.sm_mhz_min, s.power_w_max, s.temp_c_max) == (4, 1890.0, 1755.0, 699.0, 43.0)
    assert s.reasons == {"none": 0.5, "power cap": 0.5}
    assert "power cap 50%" in s.line()
    with pytest.raises(ClockWatchError, match="no samples"):
        summarize("empty", 0.01, [])


@pytest.fixture
def fake_smi(tmp_path: Path) -> str:
    return write_fake(tmp_path)


def test_query_fields_falls_back_to_the_older_names(fake_smi):
    fields = query_fields(fake_smi, 0)
    assert (fields[2], fields[-1]) == ("power.draw", "clocks_throttle_reasons.active")


def test_query_fields_takes_the_instant_power_where_known(tmp_path):
    path = write_script(tmp_path, "#!/usr/bin/env bash\necho '1980, 2619, 80.1, 700.00, 40, 0x1'\n")
    fields = query_fields(path, 0)
    assert (fields[2], fields[-1]) == ("power.draw.instant", "clocks_event_reasons.active")


def test_summary_settles_past_the_phase_start():
    watch = ClockWatch.__new__(ClockWatch)
    watch.samples = [Sample(float(i), 1980.0, 2619.0, 100.0 * i, 700.0, 40.0, 0) for i in range(10)]
    watch.phases = {"p": (0.0, 9.0)}
    assert watch.summary("p").samples == 10
    settled = watch.summary("p", settle=5.0)
    assert (settled.samples, settled.power_w_median, settled.seconds) == (5, 700.0, 4.0)


def test_watch_puts_samples_in_their_phase(fake_smi):
    with ClockWatch(interval_ms=10, smi=fake_smi) as watch:
        with watch.phase("busy"):
            time.sleep(0.3)
    s = watch.summary("busy")
    assert watch.power_field == "power.draw"
    assert s.samples >= 3
    assert (s.sm_mhz_median, s.power_w_max, s.reasons) == (1755.0, 698.5, {"power cap": 1.0})


def test_watch_needs_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(ClockWatchError, match="nvidia-smi is not on PATH"):
        ClockWatch()


def test_query_fields_names_what_it_could_not_read(tmp_path):
    path = write_script(tmp_path, "#!/usr/bin/env bash\necho 'No devices were found'; exit 6\n")
    with pytest.raises(ClockWatchError, match="--id=0 cannot report .* said: No devices were found"):
        query_fields(path, 0)


def test_windows_split_the_samples():
    samples = [Sample(10.0 + 0.1 * i, 1980.0 - i, 2619.0, 500.0, 700.0, 40.0, 0) for i in range(10)]
    parts = windows(samples, 10.0, 11.0, 0.5)
    assert [p.samples for p in parts] == [5, 5]
    assert parts[1].sm_mhz_median == 1973.0


def test_clock_watch_script_runs_a_command(fake_smi):
    script = Path(__file__).resolve().parents[1] / "scripts" / "clock-watch"
    env = {**os.environ, "PATH": f"{Path(fake_smi).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, str(script), "--window", "0.1", "--", sys.executable, "-c", "import time; time.sleep(0.3)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "(exit 0)" in done.stdout
    assert "power cap 100%" in done.stdout.splitlines()[-1]


def test_clocks_record_of_a_phase_without_samples():
    watch = ClockWatch.__new__(ClockWatch)
    watch.samples, watch.fields = [], ("clocks.sm", "clocks.mem", "power.draw.instant")
    watch.phases = {"short": (1.0, 1.001)}
    assert clocks_record(watch, "short") == {"power_field": "power.draw.instant", "samples": 0}


def test_nvidia_smi_index_names_the_gpu_by_uuid(monkeypatch):
    import types

    import torch

    from sparkdecode.bench.clockwatch import nvidia_smi_index

    bare = "58f79d8b-1c2a-4d3e-8f90-0123456789ab"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid=bare))
    assert nvidia_smi_index(torch.device("cuda", 1)) == f"GPU-{bare}"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace())
    assert nvidia_smi_index(torch.device("cuda", 1)) == "1"


def _watch_of(phases: dict[str, tuple[float, float, float]]) -> ClockWatch:
    """A watch whose phases (name: start, end, watts) each hold a sample every 0.1 s at a
    700 W limit."""
    watch = ClockWatch.__new__(ClockWatch)
    watch.samples, watch.phases = [], {}
    for name, (start, end, watts) in phases.items():
        watch.phases[name] = (start, end)
        watch.samples += [
            Sample(start + 0.1 * i, 1980.0, 2619.0, watts, 700.0, 50.0, 0) for i in range(int((end - start) * 10))
        ]
    return watch


def test_energy_text_takes_off_the_idle_power():
    """energy_text: the phase's power over the bytes a second, and with an idle phase the
    part above it; without one, the total alone."""
    stream = _watch_of({"stream": (10.0, 12.0, 620.0)})
    assert energy_text(stream, stream.summary("stream"), 2.5e12) == " 248 pJ/B"
    both = _watch_of({"idle": (0.0, 2.0, 120.0), "stream": (10.0, 12.0, 620.0)})
    assert energy_text(both, both.summary("stream"), 2.5e12) == " 248 pJ/B ( 200 above idle)"
    assert energy_text(both, both.summary("idle"), 2.5e12) == "  48 pJ/B"


def test_power_budget_is_the_limit_less_idle_over_the_stream():
    """power_budget: (limit - idle) over fraction x copy, named with its figures."""
    watch = _watch_of({"idle": (0.0, 2.0, 124.0)})
    line = power_budget(watch, 4.25e12)
    assert line == "at the 700 W limit, 80% of the copy (3.40 TB/s) may spend at most 169 pJ/B above idle (124 W)"
    assert "(3.02 TB/s) may spend at most 191 pJ/B" in power_budget(watch, 3.02e12, fraction=1.0)
