"""A pytest plugin for scripts/gpu-check: ``--part I/N`` keeps only the I-th of N equal runs
of the selected tests, in pytest's order, so a test file longer than one command's time
limit is run whole by N commands. Loaded with ``-p pytest_part`` (scripts/ on PYTHONPATH)."""

from __future__ import annotations

import re

import pytest


def parse_part(text: str) -> tuple[int, int]:
    """``"I/N"`` as (I, N) with 1 <= I <= N."""
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ValueError(f"--part {text!r}: expected I/N with 1 <= I <= N, e.g. 1/2")
    return int(match[1]), int(match[2])


def part_slice(count: int, i: int, n: int) -> slice:
    """The I-th of N contiguous runs of ``count`` items; together the N cover each item once."""
    return slice((i - 1) * count // n, i * count // n)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--part", default=None, metavar="I/N", help="run only the I-th of N equal runs of the tests")


def pytest_configure(config: pytest.Config) -> None:
    text = config.getoption("--part")
    if text is not None:
        try:
            parse_part(text)
        except ValueError as error:
            raise pytest.UsageError(str(error)) from None


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    text = config.getoption("--part")
    if text is None:
        return
    part = part_slice(len(items), *parse_part(text))
    dropped = items[: part.start] + items[part.stop :]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = items[part]
