"""A weight read into L2 ahead of the kernel that streams it (kernels/read_ahead.cu),
for a block to launch on a side stream where the step leaves the memory idle.

``ReadAhead`` holds contiguous weights (checked at build) and launches one kernel a
weight on the current stream: every thread's 16-byte loads, ``depth`` in flight, over
``blocks_per_sm`` blocks of 256 threads an SM. It reads, and writes nothing a result
depends on (a scratch word, only if the loads' fold equals a constant), so it changes no
result; it only moves a weight's bytes into L2 before the kernel that reads them.
"""

from __future__ import annotations

import torch

from .launch import Kernel, i64, ptr

SOURCE = "read_ahead.cu"
THREADS = 256


class ReadAhead:
    """The read-ahead of ``weights`` (kept here: the launches hold their addresses)."""

    def __init__(self, device: torch.device, weights: list[torch.Tensor], blocks_per_sm: int = 1, depth: int = 16):
        if not weights:
            raise ValueError("read-ahead: no weights")
        for w in weights:
            nbytes = w.numel() * w.element_size()
            if not w.is_contiguous() or w.data_ptr() % 16 or nbytes % 16:
                raise ValueError(
                    f"read-ahead: a weight {tuple(w.shape)} {w.dtype} strides {w.stride()} is not contiguous "
                    "whole 16-byte vectors"
                )
        if blocks_per_sm < 1 or not 1 <= depth <= 32:
            raise ValueError(f"read-ahead: {blocks_per_sm} blocks an SM, {depth} loads a thread")
        self.weights = weights
        self.nbytes = sum(w.numel() * w.element_size() for w in weights)
        self.blocks = torch.cuda.get_device_properties(device).multi_processor_count * blocks_per_sm
        self.sink = torch.zeros(1, dtype=torch.int32, device=device)
        self.kernel = Kernel(SOURCE, "read_ahead_kernel", device, {"DEPTH": depth}, ())

    def launch(self) -> None:
        """The reads, on the current stream (no PDL: nothing they read is written in the step)."""
        for w in self.weights:
            vectors = w.numel() * w.element_size() // 16
            self.kernel.launch((self.blocks, 1, 1), (THREADS, 1, 1), [ptr(w), i64(vectors), ptr(self.sink)], pdl=False)
