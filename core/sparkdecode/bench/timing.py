"""Timing a piece of work: captured once in a CUDA graph and replayed, or (on
the CPU) run eagerly, which is a smoke figure and never a speed claim.

On a GPU every replay is timed alone (an event pair around it) after a write
of ``FLUSH_BYTES`` that evicts L2, so no replay finds the previous one's weights
in L2; the figures are the median and the min-max of the replays. Where the
work holds collectives across processes, ``barrier`` lines the ranks up before
each timing (``ranks.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

# Larger than the L2 of any GPU the bench runs on (H200: 50 MB).
FLUSH_BYTES = 256 << 20
WARMUP = 2


class Times(NamedTuple):
    median_s: float
    min_s: float
    max_s: float
    count: int

    def as_dict(self) -> dict[str, Any]:
        return self._asdict()


def summarize(seconds: list[float]) -> Times:
    return Times(statistics.median(seconds), min(seconds), max(seconds), len(seconds))


class Timer:
    """Captures and times work on one device. ``graph`` is False on the CPU.
    ``barrier``: called before each timing (every rank of a group starts together)."""

    def __init__(self, device: torch.device, barrier: Callable[[], None] | None = None):
        self.device, self.barrier = device, barrier
        self.graph = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.graph else None
        self.pool = torch.cuda.graph_pool_handle() if self.graph else None

    def capture(self, fn: Callable[[], Any], shared_pool: bool = False) -> Any:
        """A CUDA graph of ``fn`` after warm-ups on a side stream (library handles and
        lazy inits happen outside the capture); on the CPU, ``fn`` itself.
        ``shared_pool``: allocate from the timer's pool (for short-lived graphs
        replayed one after another, so their temporaries share memory)."""
        if not self.graph:
            return fn
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool if shared_pool else None):
            fn()
        torch.cuda.synchronize(self.device)
        return graph

    def time(self, work: Any, replays: int) -> Times:
        """Each of ``replays`` replays (or eager runs) timed alone."""
        if self.barrier is not None:
            self.barrier()
        if not self.graph:
            seconds = []
            for _ in range(replays):
                start = time.perf_counter()
                work()
                seconds.append(time.perf_counter() - start)
            return summarize(seconds)
        assert self.flush is not None
        work.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            work.replay()
            end.record()
        torch.cuda.synchronize(self.device)
        return summarize([start.elapsed_time(end) / 1e3 for start, end in events])

    def run(self, work: Any) -> None:
        """One replay (or eager run), finished."""
        if self.graph:
            work.replay()
            torch.cuda.synchronize(self.device)
        else:
            work()
