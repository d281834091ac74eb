"""A paged KV cache for one request, grouped as vLLM groups it.

Pages of ``BLOCK_SIZE`` tokens; one KV-cache group for the full-attention layers
and one per sliding window size (the target has one; a DSpark draft may have
several), each with its own pages and block table. Page 0 is
the null page: never handed out, and what a sliding group's block table points
to once a page has left the window (vLLM's null block). The metadata the step
reads lives in device buffers of a fixed size that ``begin_step`` refills, so a
graph captured over them replays with new contents.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from ..protocols import HostStep, KVGroupMetadata, LayerKV
from ..spec import ModelSpec

BLOCK_SIZE = 16
NULL_PAGE = 0


@dataclass
class _Group:
    layers: list[int]
    window: int | None
    free: list[int]
    pages: list[int] = field(default_factory=list)  # this request's pages, NULL_PAGE where released
    metadata: KVGroupMetadata | None = None


class PagedKVCache:
    """bf16 K and V per layer in the layout [2, pages, BLOCK_SIZE, Hkv, d] (K then V)."""

    def __init__(
        self,
        spec: ModelSpec,
        num_pages: int,
        max_context: int,
        max_rows: int,
        device: torch.device | str = "cpu",
        num_kv_heads: int | None = None,
        poison_released: bool = False,
    ):
        self.spec, self.max_context, self.max_rows = spec, max_context, max_rows
        self.device = torch.device(device)
        self.poison_released = poison_released
        kv_heads = spec.num_key_value_heads if num_kv_heads is None else num_kv_heads
        self.max_pages = math.ceil(max_context / BLOCK_SIZE)
        self.tensors = [
            torch.zeros(2, num_pages, BLOCK_SIZE, kv_heads, spec.head_dim, dtype=torch.bfloat16, device=self.device)
            for _ in range(spec.num_layers)
        ]
        self.groups: list[_Group] = []
        self.layer_group: list[int] = [0] * spec.num_layers
        windows = sorted({w for w in map(spec.window, range(spec.num_layers)) if w is not None})
        for window in (None, *windows):
            layers = [i for i in range(spec.num_layers) if spec.window(i) == window]
            if not layers:
                continue
            for i in layers:
                self.layer_group[i] = len(self.groups)
            group = _Group(layers, window, free=list(range(num_pages - 1, NULL_PAGE, -1)))
            group.metadata = KVGroupMetadata(
                block_table=torch.zeros(1, self.max_pages, dtype=torch.int32, device=self.device),
                seq_lens=torch.zeros(1, dtype=torch.int32, device=self.device),
                slot_mapping=torch.zeros(max_rows, dtype=torch.int64, device=self.device),
            )
            self.groups.append(group)
        self.context_len = 0

    def layer_kv(self, layer: int) -> LayerKV:
        kv = self.tensors[layer]
        group = self.groups[self.layer_group[layer]]
        assert group.metadata is not None
        return LayerKV(kv[0], kv[1], group.metadata, group.window)

    def kv(self) -> tuple[LayerKV, ...]:
        return tuple(self.layer_kv(i) for i in range(self.spec.num_layers))

    def begin_step(self, first_position: int, rows: int) -> HostStep:
        """Make room for tokens at ``first_position .. first_position + rows - 1``:
        release the sliding pages no query of this step can see, allocate pages up to
        the last position and refill the device metadata (block tables, sequence
        length, slot mapping; unused slot rows point at the null page)."""
        last = first_position + rows - 1
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows exceed the cache's {self.max_rows}")
        if last >= self.max_context:
            raise ValueError(f"position {last} is past the cache's max context {self.max_context}")
        for group in self.groups:
            if group.window is not None:
                self._release(group, first_position - group.window + 1)
            while len(group.pages) <= last // BLOCK_SIZE:
                if not group.free:
                    raise RuntimeError("the KV cache is out of pages")
                group.pages.append(group.free.pop())
            table = torch.full((self.max_pages,), NULL_PAGE, dtype=torch.int32)
            table[: len(group.pages)] = torch.tensor(group.pages, dtype=torch.int32)
            positions = torch.arange(first_position, last + 1)
            slots = torch.full((self.max_rows,), NULL_PAGE * BLOCK_SIZE, dtype=torch.int64)
            slots[:rows] = table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
            assert group.metadata is not None
            group.metadata.block_table[0].copy_(table)
            group.metadata.seq_lens.fill_(last + 1)
            group.metadata.slot_mapping.copy_(slots)
        self.context_len = last + 1
        return HostStep(first_position=first_position, rows=rows, context_len=last + 1)

    def _release(self, group: _Group, first_visible: int) -> None:
        """Pages wholly below ``first_visible`` go back to the free list (poisoned when
        asked) and the block table points at the null page instead."""
        for index in range(min(first_visible // BLOCK_SIZE, len(group.pages)) if first_visible > 0 else 0):
            page = group.pages[index]
            if page == NULL_PAGE:
                continue
            group.pages[index] = NULL_PAGE
            group.free.append(page)
            if self.poison_released:
                for layer in group.layers:
                    self.tensors[layer][:, page].fill_(float("nan"))

    def poison_null_page(self) -> None:
        """NaN in the null page of every layer: a kernel that reads it shows."""
        for kv in self.tensors:
            kv[:, NULL_PAGE].fill_(float("nan"))

    def clone(self) -> PagedKVCache:
        """An independent copy: the same pages, contents and metadata."""
        other = copy.copy(self)
        other.tensors = [t.clone() for t in self.tensors]
        other.groups = []
        for group in self.groups:
            assert group.metadata is not None
            other.groups.append(
                _Group(
                    list(group.layers),
                    group.window,
                    list(group.free),
                    list(group.pages),
                    KVGroupMetadata(*(t.clone() for t in group.metadata)),
                )
            )
        return other
