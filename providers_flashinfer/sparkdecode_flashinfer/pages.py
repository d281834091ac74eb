"""The pages a verify step can see on a sliding layer, and the state that the
attention cores built from one set of build buffers share per KV-cache group.

Why a sliding layer needs its own page table: the cache releases the pages wholly
below the window of the step's first query and points the block table at the
null page instead; a released or null page may hold anything, NaN included
(reference.kvcache poisons them). Both FlashInfer kernels read whole tiles of keys
(XQA: 256 tokens) and mask the scores of the keys outside a query's window, so
the masked probability (exactly 0) still multiplies the V rows they loaded, and
0 * NaN is NaN. So the kernels get the block table cut at the first page any
query of the step sees, and the context length shortened by what was cut:

    first_page = max(seq_len - rows - window + 1, 0) // page_size
    pages[i]   = block_table[first_page + i]
    seq_len'   = seq_len - first_page * page_size

Every key the kernels then read is on a page that holds written K/V. Positions
shift by a whole number of pages; the causal and window masks are relative to
the last query, so they are unchanged.

``VisiblePages.update`` computes the cut on the device (a few small kernels in the
graph, no host work): once per step and group, by the group's lowest layer (its
owner, which the executor runs first), and every other layer of the group reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sparkdecode.protocols import BuildContext, KVGroupMetadata, LayerKV


def first_visible_page(context: int, rows: int, window: int, page_size: int) -> int:
    """The host form of ``VisiblePages``' cut: the first page any of the ``rows``
    queries ending at position ``context - 1`` sees through a window of ``window`` keys."""
    return max(context - rows - window + 1, 0) // page_size


class VisiblePages:
    """One sliding group's block table cut at the step's first visible page (see the
    module docstring). ``pages`` int32 [1, max_pages] and ``seq_lens`` int32 [1, 1]
    are fixed buffers that ``update`` rewrites in place (capturable)."""

    def __init__(self, group: KVGroupMetadata, window: int, page_size: int):
        table = group.block_table
        self.group, self.window, self.page_size = group, window, page_size
        self.max_pages = table.shape[1]
        device = table.device
        self.pages = torch.zeros_like(table)
        self.seq_lens = torch.zeros(1, 1, dtype=torch.int32, device=device)
        self.first = torch.zeros(1, dtype=torch.int32, device=device)
        self.arange = torch.arange(self.max_pages, dtype=torch.int64, device=device)
        self.index = torch.zeros(self.max_pages, dtype=torch.int64, device=device)

    def update(self, rows: int) -> None:
        """Recompute the cut from the group's device metadata (7 small kernels)."""
        seq = self.group.seq_lens
        torch.sub(seq, rows + self.window - 1, out=self.first)
        self.first.clamp_(min=0)
        self.first.div_(self.page_size, rounding_mode="floor")
        torch.add(self.arange, self.first, out=self.index)
        self.index.clamp_(max=self.max_pages - 1)  # entries past the context are never read
        torch.index_select(self.group.block_table[0], 0, self.index, out=self.pages[0])
        torch.sub(seq, self.first, alpha=self.page_size, out=self.seq_lens[0])


class SharedGroups:
    """What the providers of one class built from one set of build buffers share
    (``shared_groups``): the layers built, and per KV-cache group (block table,
    window) one state object."""

    def __init__(self) -> None:
        self.layers: set[int] = set()
        self.groups: dict[tuple[int, int | None], Any] = {}

    def owner(self, kv: tuple[LayerKV, ...], layer: int) -> int:
        """The lowest built layer of ``layer``'s group (its block table and window,
        the key of ``group``): the one that runs first in the step."""
        key = _key(kv[layer])
        return min(i for i in self.layers if _key(kv[i]) == key)

    def group(self, kv: LayerKV, make: Callable[[], Any]) -> Any:
        """The state of ``kv``'s group, made at the first ask."""
        key = _key(kv)
        state = self.groups.get(key)
        if state is None:
            state = self.groups[key] = make()
        return state


def _key(kv: LayerKV) -> tuple[int, int | None]:
    return kv.group.block_table.data_ptr(), kv.window


def shared_groups(ctx: BuildContext, name: str) -> SharedGroups:
    """The ``SharedGroups`` of provider ``name`` among the builds from ``ctx``'s buffers
    (``BuildContext.shared``: the executor builds every layer from its buffers, a
    measurement its layers from its own). The providers hold it after."""
    return ctx.shared(f"flashinfer_groups:{name}", SharedGroups)
