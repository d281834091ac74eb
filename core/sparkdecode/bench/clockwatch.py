"""The GPU's clocks, power and clock-event reasons while work runs, sampled by ``nvidia-smi``.

A benchmark times short bursts (twenty replays of a graph); a served step runs back to back
for as long as requests come. Whether the SMs keep their clock under a sustained stream (or
the power cap takes it down) is what this tells::

    with ClockWatch(index=0) as watch:
        with watch.phase("experts"):
            ...  # work queued and finished inside the phase
    print(watch.summary("experts"))

The sampler is ``nvidia-smi --query-gpu=... -lms N`` in a subprocess; a thread stamps each
line with the host's monotonic clock as it arrives, so a sample belongs to the phase whose
interval holds its stamp (a line arrives within milliseconds of its reading).
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# nvidia-smi's names. ``power.draw`` is, on recent drivers, an average over a second, so a
# phase's first second also reads the one before; ``power.draw.instant`` (newer drivers) is
# the reading itself and is taken where the driver has it. Drivers before 535 call the
# reasons ``clocks_throttle_reasons``.
FIELDS = ("clocks.sm", "clocks.mem", "{power}", "enforced.power.limit", "temperature.gpu")
POWER_FIELDS = ("power.draw.instant", "power.draw")
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")

# Seconds of a phase left out of its figures where ``power.draw`` is the averaged reading
SETTLE_S = 1.0

# NVML's nvmlClocksEventReasons bits
REASONS = {
    0x1: "idle",
    0x2: "applications clocks",
    0x4: "power cap",
    0x8: "hw slowdown",
    0x10: "sync boost",
    0x20: "sw thermal",
    0x40: "hw thermal",
    0x80: "hw power brake",
    0x100: "display clocks",
}


class ClockWatchError(RuntimeError):
    pass


def reason_names(mask: int) -> str:
    """``mask``'s reasons by name ("none" for 0; unknown bits in hex)."""
    if mask == 0:
        return "none"
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    if rest:
        names.append(hex(rest))
    return "+".join(names)


@dataclass(frozen=True)
class Sample:
    at: float  # host monotonic seconds when the line arrived
    sm_mhz: float
    mem_mhz: float
    power_w: float
    limit_w: float
    temp_c: float
    reasons: int


def parse_line(line: str, at: float) -> Sample | None:
    """One ``--format=csv,noheader,nounits`` line of FIELDS and a reasons field, or None
    for a line that is not one (a blank, or ``[N/A]`` where a number belongs)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS) + 1:
        return None
    try:
        numbers = [float(p) for p in parts[:-1]]
        reasons = int(parts[-1], 16)
    except ValueError:
        return None
    return Sample(at, *numbers, reasons)


@dataclass(frozen=True)
class Summary:
    phase: str
    seconds: float
    samples: int
    sm_mhz_median: float
    sm_mhz_min: float
    mem_mhz_median: float
    power_w_median: float
    power_w_max: float
    limit_w: float
    temp_c_max: float
    reasons: dict[str, float]  # each reasons mask's name and its share of the samples

    def pj_per_byte(self, bytes_per_s: float) -> float:
        """The median power over a rate of bytes a second: pJ a byte (W over TB/s)."""
        return pj_per_byte(self.power_w_median, bytes_per_s)

    def line(self) -> str:
        reasons = reasons_text(self.reasons)
        return (
            f"{self.phase:<40} {self.seconds:5.2f} s {self.samples:4d}  SM {self.sm_mhz_median:5.0f} MHz "
            f"(min {self.sm_mhz_min:5.0f})  mem {self.mem_mhz_median:5.0f}  power {self.power_w_median:4.0f} W "
            f"(max {self.power_w_max:4.0f} of {self.limit_w:4.0f})  {self.temp_c_max:3.0f} C  {reasons}"
        )


def reasons_text(reasons: dict[str, float]) -> str:
    """A summary's reasons, each with its share of the samples ("power cap 86%, none 14%")."""
    return ", ".join(f"{name} {share:.0%}" for name, share in reasons.items())


def pj_per_byte(watts: float, bytes_per_s: float) -> float:
    """Energy a byte, in pJ, of ``watts`` spent moving ``bytes_per_s``."""
    return watts / bytes_per_s * 1e12


IDLE_PHASE = "idle"  # the phase whose power energy_text takes off (the GPU at rest, its clocks up)


def energy_text(watch: ClockWatch, summary: Summary, bytes_per_s: float, settle: float = 0.0) -> str:
    """A phase's energy a byte at ``bytes_per_s`` (``summary``: the phase's, from ``watch``),
    and, where the watch has an IDLE_PHASE, the part above the idle GPU's power: what the
    stream itself adds, the figure that carries from one GPU to another of the same chip."""
    text = f"{summary.pj_per_byte(bytes_per_s):4.0f} pJ/B"
    if IDLE_PHASE in watch.phases and summary.phase != IDLE_PHASE:
        idle = watch.summary(IDLE_PHASE, settle).power_w_median
        text += f" ({pj_per_byte(summary.power_w_median - idle, bytes_per_s):4.0f} above idle)"
    return text


def power_budget(watch: ClockWatch, copy_bytes_per_s: float, fraction: float = 0.8, settle: float = 0.0) -> str:
    """The most energy a byte above idle that a stream at ``fraction`` of the copy
    bandwidth may spend inside the GPU's power limit: (limit - idle power) over the
    stream's bytes a second, with the watch's IDLE_PHASE."""
    idle = watch.summary(IDLE_PHASE, settle)
    rate = fraction * copy_bytes_per_s
    return (
        f"at the {idle.limit_w:.0f} W limit, {fraction:.0%} of the copy ({rate / 1e12:.2f} TB/s) may spend at most "
        f"{pj_per_byte(idle.limit_w - idle.power_w_median, rate):.0f} pJ/B above idle ({idle.power_w_median:.0f} W)"
    )


def summarize(phase: str, seconds: float, samples: list[Sample]) -> Summary:
    if not samples:
        raise ClockWatchError(f"phase {phase!r}: no samples in {seconds:.2f} s (run it longer than the interval)")
    sm = [s.sm_mhz for s in samples]
    power = [s.power_w for s in samples]
    counts = Counter(s.reasons for s in samples)
    return Summary(
        phase,
        seconds,
        len(samples),
        statistics.median(sm),
        min(sm),
        statistics.median(s.mem_mhz for s in samples),
        statistics.median(power),
        max(power),
        samples[-1].limit_w,
        max(s.temp_c for s in samples),
        {reason_names(mask): n / len(samples) for mask, n in counts.most_common()},
    )


def nvidia_smi_index(device) -> str:
    """nvidia-smi's ``--id`` for a torch CUDA device: its UUID (CUDA's device order and
    CUDA_VISIBLE_DEVICES need not match nvidia-smi's indices), else its index."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return str(device.index or 0)
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def query_fields(smi: str, index: int | str) -> tuple[str, ...]:
    """FIELDS with the first power field and reasons field this driver's nvidia-smi knows."""
    for power, reasons in [(p, r) for r in REASON_FIELDS for p in POWER_FIELDS]:
        fields = (*(f.format(power=power) for f in FIELDS), reasons)
        done = subprocess.run(
            [smi, f"--id={index}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines and parse_line(lines[0], 0.0) is not None:
            return fields
        said = (done.stdout + done.stderr).strip().splitlines()
    raise ClockWatchError(
        f"nvidia-smi --id={index} cannot report {', '.join(FIELDS)} with power one of {', '.join(POWER_FIELDS)} "
        f"and reasons one of {', '.join(REASON_FIELDS)} (it said: {said[-1] if said else 'nothing'})"
    )


class ClockWatch:
    """Samples GPU ``index`` (nvidia-smi's index or UUID) every ``interval_ms`` while open;
    ``phase`` marks intervals."""

    def __init__(self, index: int | str = 0, interval_ms: int = 20, smi: str | None = None):
        self.smi = smi or shutil.which("nvidia-smi")
        if self.smi is None:
            raise ClockWatchError("nvidia-smi is not on PATH: the clock watch needs it")
        self.index, self.interval_ms = index, interval_ms
        self.samples: list[Sample] = []
        self.fields: tuple[str, ...] = ()
        self.phases: dict[str, tuple[float, float]] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> ClockWatch:
        self.fields = fields = query_fields(self.smi, self.index)
        self._proc = subprocess.Popen(
            [
                self.smi,
                f"--id={self.index}",
                f"--query-gpu={','.join(fields)}",
                "--format=csv,noheader,nounits",
                f"-lms={self.interval_ms}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        time.sleep(0.2)  # the first lines in
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_line(line, time.monotonic())
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=10)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The samples stamped between entering and leaving belong to ``name``; the work
        inside must be finished (synchronized) before the block ends."""
        start = time.monotonic()
        yield
        self.phases[name] = (start, time.monotonic())

    @property
    def power_field(self) -> str:
        """The power field read (see POWER_FIELDS)."""
        return self.fields[2] if self.fields else ""

    def summary(self, name: str, settle: float = 0.0) -> Summary:
        """Phase ``name``'s samples, less its first ``settle`` seconds (where an averaged
        power reading still holds the phase before)."""
        start, end = self.phases[name]
        start = min(start + settle, end)
        return summarize(name, end - start, [s for s in self.samples if start <= s.at <= end])


def windows(samples: list[Sample], start: float, end: float, width: float) -> list[Summary]:
    """The samples from ``start`` to ``end`` in windows of ``width`` seconds, a summary each
    (named by its start, in seconds from ``start``); windows with no sample are left out."""
    out = []
    at = start
    while at < end:
        inside = [s for s in samples if at <= s.at < min(at + width, end)]
        if inside:
            out.append(summarize(f"{at - start:7.2f} s", min(width, end - at), inside))
        at += width
    return out


def clocks_record(watch: ClockWatch, phase: str) -> dict[str, object]:
    """Phase ``phase``'s summary as a bench record holds it, with the power field read; a
    phase shorter than the sampling interval gives ``samples`` 0 and nothing else."""
    try:
        summary = watch.summary(phase)
    except ClockWatchError:
        return {"power_field": watch.power_field, "samples": 0}
    return {"power_field": watch.power_field, **dataclasses.asdict(summary)}
