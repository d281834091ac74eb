"""L2 prefetch of weights that a later kernel of the step streams (kernels/prefetch.cu),
for a block to issue on a side stream where the step leaves the memory idle.

A ``Region`` is ``rows`` runs of ``nbytes`` bytes, ``stride`` bytes apart, from a
tensor's first byte plus ``offset``: a whole contiguous weight is one run, the first
bytes a kernel reads of each row of a K-split weight are one run a row. ``L2Prefetch``
holds them as the kernel's table (made once, at build) and launches the kernel on the
current stream. A prefetch writes nothing, so it changes no result; it only moves bytes
into L2 earlier than the kernel that reads them would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .launch import Kernel, i32, i64, ptr

SOURCE = "prefetch.cu"
CHUNK = 16384  # bytes a bulk prefetch at most (prefetch.cu's CHUNK)
THREADS = 32
MAX_BLOCKS = 132  # one an SM of an H200: small enough to sit beside the kernels running then


@dataclass(frozen=True)
class Region:
    """``rows`` runs of ``nbytes`` bytes, ``stride`` bytes apart, from ``tensor``'s first
    byte plus ``offset``."""

    tensor: torch.Tensor
    nbytes: int
    rows: int = 1
    stride: int = 0
    offset: int = 0

    def reason(self) -> str | None:
        """Why a bulk prefetch cannot take this region, if so (16-byte multiples, inside
        the tensor's storage)."""
        base = self.tensor.data_ptr() + self.offset
        if base % 16 or self.nbytes % 16 or self.stride % 16 or self.nbytes <= 0 or self.rows <= 0:
            return f"base {base:#x}, {self.nbytes} bytes, stride {self.stride}: not multiples of 16 bytes"
        end = self.offset + (self.rows - 1) * self.stride + self.nbytes
        size = self.tensor.untyped_storage().nbytes() - self.tensor.storage_offset() * self.tensor.element_size()
        if self.offset < 0 or end > size:
            return f"bytes {self.offset} .. {end} past the tensor's {size}"
        return None


def whole(t: torch.Tensor) -> Region:
    """All of a tensor: one run where it is contiguous, else a run a row of a 2-D tensor
    whose rows are contiguous (a view of a wider weight)."""
    size = t.element_size()
    if t.is_contiguous():
        return Region(t, t.numel() * size)
    if t.dim() == 2 and t.stride(1) == 1:
        return Region(t, t.shape[1] * size, t.shape[0], t.stride(0) * size)
    raise ValueError(f"a whole-tensor prefetch takes contiguous rows, not strides {t.stride()}")


def table(regions: list[Region]) -> tuple[list[list[int]], int]:
    """The kernel's table (base, stride, bytes, rows, chunks a row, first chunk) and the
    chunks in all."""
    rows, first = [], 0
    for region in regions:
        reason = region.reason()
        if reason:
            raise ValueError(f"L2 prefetch: {reason}")
        per_row = -(-region.nbytes // CHUNK)
        base = region.tensor.data_ptr() + region.offset
        rows.append([base, region.stride, region.nbytes, region.rows, per_row, first])
        first += per_row * region.rows
    return rows, first


class L2Prefetch:
    """The prefetch of ``regions`` (kept alive here: the table holds their addresses);
    ``evict_last``: under an evict-last L2 policy, so the weights streamed between the
    prefetch and the kernel that reads the lines (normal priority) are evicted first."""

    def __init__(self, device: torch.device, regions: list[Region], evict_last: bool = False):
        if not regions:
            raise ValueError("L2 prefetch: no regions")
        self.regions = regions
        rows, self.chunks = table(regions)
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        self.nbytes = sum(r.nbytes * r.rows for r in regions)
        self.blocks = min(MAX_BLOCKS, -(-self.chunks // THREADS))
        self.evict_last = evict_last
        self.kernel = Kernel(SOURCE, "l2_prefetch_kernel", device, {"CHUNK": CHUNK, "EVICT_LAST": int(evict_last)}, ())

    def launch(self) -> None:
        """The prefetches, on the current stream (no PDL: nothing it reads is written in
        the step)."""
        self.kernel.launch(
            (self.blocks, 1, 1), (THREADS, 1, 1), [ptr(self.table), i32(len(self.regions)), i64(self.chunks)], pdl=False
        )
