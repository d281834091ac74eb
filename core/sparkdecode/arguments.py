"""The command line's argument types and checks, shared by ``sparkdecode`` and its
``bench``: a value the command cannot take is a ``UsageError`` naming it (exit
status 2), never a failure deep inside the run."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch


class UsageError(ValueError):
    """A command-line value the command cannot take (exit status 2, as argparse's own)."""


def parse_pins(values: list[str]) -> dict[str, str]:
    """``--pin BLOCK=PROVIDER`` values as a kind -> provider map (one pin a kind)."""
    pins: dict[str, str] = {}
    for value in values:
        kind, sep, name = (part.strip() for part in value.partition("="))
        if not sep or not kind or not name:
            raise UsageError(f"--pin takes BLOCK=PROVIDER, got {value!r}")
        if kind in pins and pins[kind] != name:
            raise UsageError(f"--pin {kind} given twice ({pins[kind]!r} and {name!r})")
        pins[kind] = name
    return pins


def at_least(low: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int of at least ``low`` (and at most ``most``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{value}: at most {most}")
        return value

    parse.__name__ = f"integer >= {low}" if most is None else f"integer in {low}..{most}"
    return parse


def device_of(text: str | None) -> torch.device:
    """``--device``: cpu, cuda or cuda:N, one this machine has (default: cuda when
    there is one). A CUDA device becomes torch's current device: CUDA graphs capture
    on the current device's streams, so work on another device would escape them."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise UsageError(f"--device {text!r}: cpu or cuda[:N] ({e})") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {text!r}: cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {text}: this machine has no CUDA GPU (or this torch has no CUDA)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        if device.index is not None:  # "cuda" is the current device already
            torch.cuda.set_device(device)
    return device
