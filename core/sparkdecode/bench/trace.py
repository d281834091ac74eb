"""A traced graph replay's kernels as scripts/profile-step prints them, and the same
kernels cut into layers.

A kernel row is its start offset, its duration and how much later it ends than every
kernel before it (``after``: with programmatic dependent launch a kernel starts before
the one ahead of it ends and waits in griddepcontrol.wait, so its duration includes that
wait; ``after`` is what it adds to the critical path). ``by_layer`` cuts the rows at
each kernel whose name holds a marker (the first kernel of a layer's attention block,
e.g. ``qkv_front``): a segment is one layer, its period the time from its marker to the
next. Kernels of one name within a segment are told apart by their order (``#2``, ...).
``windows`` gives the same segments as each kernel's start and end against one anchor
kernel's end (e.g. the attention boundary's): when a kernel's blocks start and when it
ends, whatever the order of capture. ``parse`` reads the rows back from profile-step's
printed listing.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

HEADER = "start us, duration us, end after the kernels before (us), kernel:"


class KernelRow(NamedTuple):
    start_us: float
    duration_us: float
    after_us: float
    name: str


class Layer(NamedTuple):
    period_us: float  # from this segment's marker kernel's start to the next one's
    kernels: list[tuple[str, float]]  # (label, after_us) in order


def rows(spans: Iterable[tuple[float, float, str]]) -> list[KernelRow]:
    """Kernel rows from (start, end, name) spans in start order, offsets from the first
    start; ``after`` against every span before (the first span: its duration)."""
    ordered = sorted(spans, key=lambda s: s[0])
    if not ordered:
        return []
    t0, latest, out = ordered[0][0], ordered[0][0], []
    for start, end, name in ordered:
        out.append(KernelRow(start - t0, end - start, max(0.0, end - latest), name))
        latest = max(latest, end)
    return out


def short(name: str) -> str:
    """A kernel's name without its template arguments and argument list; a CuTe DSL
    kernel's its module and class (``cute:gemv_tmaTmaGemv``)."""
    cute = re.match(r"kernel_cutlass_kernel_sparkdecode_cute(\w+?)_object_at", name)
    if cute:
        return f"cute:{cute[1]}"
    name = name.removeprefix("void ")
    return re.split(r"[<(]", name, maxsplit=1)[0].strip()


def _segments(kernel_rows: list[KernelRow], marker: str) -> list[tuple[list[KernelRow], list[str], float]]:
    """The rows between two kernels whose name holds ``marker``, their labels (repeats
    numbered) and the period (the first marker's start to the next one's)."""
    marks = [i for i, r in enumerate(kernel_rows) if marker in r.name]
    out = []
    for a, b in zip(marks, marks[1:]):
        seen: Counter[str] = Counter()
        labels = []
        for r in kernel_rows[a:b]:
            label = short(r.name)
            seen[label] += 1
            labels.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
        out.append((kernel_rows[a:b], labels, kernel_rows[b].start_us - kernel_rows[a].start_us))
    return out


def by_layer(kernel_rows: list[KernelRow], marker: str) -> list[Layer]:
    """The rows cut at each kernel whose name holds ``marker``: one Layer a segment
    between two markers (the rows before the first marker and from the last one on are
    left out: they are not a whole layer)."""
    return [
        Layer(period, [(label, r.after_us) for r, label in zip(seg, labels)])
        for seg, labels, period in _segments(kernel_rows, marker)
    ]


def windows(kernel_rows: list[KernelRow], marker: str, anchor: str) -> list[list[tuple[str, float, float]]]:
    """The segments ``by_layer`` cuts, each as (label, start, end) a kernel, both against
    the end of the segment's first kernel whose label is ``anchor`` (a label as
    ``by_layer`` numbers them, e.g. ``boundary_kernel#2``). A segment without it is left
    out."""
    out = []
    for seg, labels, _ in _segments(kernel_rows, marker):
        if anchor not in labels:
            continue
        ref = seg[labels.index(anchor)]
        t = ref.start_us + ref.duration_us
        out.append([(label, r.start_us - t, r.start_us + r.duration_us - t) for r, label in zip(seg, labels)])
    return out


def format_windows(segments: list[list[tuple[str, float, float]]]) -> str:
    """One line a layer: each kernel's label, start and end (``label=start..end``)."""
    return "\n".join(" ".join(f"{label}={a:.1f}..{b:.1f}" for label, a, b in seg) for seg in segments)


def format_layers(layers: list[Layer]) -> str:
    """One line a layer: its period, then each kernel's label and ``after``."""
    return "\n".join(
        f"{layer.period_us:7.1f} us: " + " ".join(f"{label}={after:.1f}" for label, after in layer.kernels)
        for layer in layers
    )


def format_row(row: KernelRow) -> str:
    """A row as the listing after ``HEADER`` prints it (``parse`` reads it back)."""
    return f"{row.start_us:9.1f} {row.duration_us:7.1f} {row.after_us:7.1f}  {row.name[:90]}"


def parse(text: str) -> list[KernelRow]:
    """The kernel rows of profile-step's listing (the lines after ``HEADER``)."""
    if HEADER not in text:
        raise ValueError("no kernel listing: the header line is missing")
    out = []
    for line in text.split(HEADER, 1)[1].splitlines():
        m = re.match(r"\s*([-\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S.*)$", line)
        if m:
            out.append(KernelRow(float(m[1]), float(m[2]), float(m[3]), m[4].strip()))
        elif line.strip():
            break
    return out


__all__ = [
    "HEADER",
    "KernelRow",
    "Layer",
    "by_layer",
    "format_layers",
    "format_row",
    "format_windows",
    "parse",
    "rows",
    "short",
    "windows",
]
