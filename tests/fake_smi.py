"""A stand-in nvidia-smi for the clock watch's CPU tests: it answers like an older driver (no
``clocks_event_reasons``, no ``power.draw.instant``) and, looping, reports the power cap."""

from __future__ import annotations

import stat
from pathlib import Path

FAKE_SMI = """#!/usr/bin/env bash
case "$*" in
  *clocks_event_reasons*|*power.draw.instant*) echo 'Field is not a valid field to query.'; exit 2 ;;
esac
case "$*" in
  *-lms=*) while true; do echo "1755, 2619, 698.5, 700.00, 52, 0x0000000000000004"; sleep 0.01; done ;;
  *) echo "1980, 2619, 80.1, 700.00, 40, 0x0000000000000001" ;;
esac
"""


def write_script(folder: Path, text: str, name: str = "nvidia-smi") -> str:
    """``text`` as an executable ``folder/name``; its path."""
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def fake_smi(folder: Path) -> str:
    return write_script(folder, FAKE_SMI)
