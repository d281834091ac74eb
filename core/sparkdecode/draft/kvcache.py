"""The draft's paged KV cache and the metadata of a draft step.

The pages are ``reference.kvcache.PagedKVCache``'s (16-token pages, one KV-cache
group for the full layers and one per sliding window, the null page 0). A draft
step writes two sets of rows into every layer: the context rows (the K/V of the
positions the target just accepted, from its aux streams) and the query block (the
anchor and the mask tokens after them). Each group's ``slot_mapping`` holds them in
one fixed layout, so a graph captured over it replays with new contents:

    slot_mapping[:context_rows]                          the context rows' slots; the null
                                                         page's slot 0 for rows that store
                                                         nothing (vLLM writes nothing for
                                                         them: PAD_SLOT_ID)
    slot_mapping[context_rows : context_rows + num_query] the query rows' slots

``context_positions`` [context_rows] and ``positions`` [num_query] are device
buffers refilled by ``begin_step``; ``seq_lens`` is the last query position + 1.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from ..protocols import LayerKV
from ..reference.kvcache import BLOCK_SIZE, NULL_PAGE, PagedKVCache
from .spec import DraftSpec

CONTEXT_ROWS = 8  # one verify step of 1 + 7 tokens
NUM_QUERY = 7  # num_speculative_tokens: the anchor and 6 mask tokens


class DraftHostStep(NamedTuple):
    """The host's view of one draft step (plain ints)."""

    context_first: int  # position of the first context row
    context_count: int  # context rows that store K/V (the rest of the layout stores nothing)
    context_rows: int  # the layout's context rows
    anchor_position: int  # P + 1: the first query position

    @property
    def last_position(self) -> int:
        return self.anchor_position + NUM_QUERY - 1


class DraftCache:
    """bf16 K and V per draft layer, paged, with the draft step's metadata buffers."""

    def __init__(
        self,
        spec: DraftSpec,
        num_pages: int,
        max_context: int,
        max_context_rows: int = CONTEXT_ROWS,
        device: torch.device | str = "cpu",
        poison_released: bool = False,
    ):
        self.spec, self.max_context = spec, max_context
        self.context_rows = CONTEXT_ROWS
        self.max_context_rows = max(max_context_rows, CONTEXT_ROWS)
        self.paged = PagedKVCache(
            spec,  # type: ignore[arg-type]  # the cache reads only the shapes and windows
            num_pages,
            max_context,
            self.max_context_rows + NUM_QUERY,
            device,
            poison_released=poison_released,
        )
        self.device = self.paged.device
        self.context_positions = torch.zeros(self.max_context_rows, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(NUM_QUERY, dtype=torch.int64, device=self.device)

    def kv(self) -> tuple[LayerKV, ...]:
        return self.paged.kv()

    def poison_null_page(self) -> None:
        self.paged.poison_null_page()

    def begin_step(self, context_first: int, context_count: int, context_rows: int | None = None) -> DraftHostStep:
        """Make room for ``context_count`` context rows at ``context_first ..`` and the
        query block right after them (anchor at ``context_first + context_count``), and
        refill the metadata in the layout above with ``context_rows`` context rows
        (``CONTEXT_ROWS`` by default, more for a longer context such as a prompt)."""
        rows = context_rows if context_rows is not None else max(context_count, CONTEXT_ROWS)
        if not 0 <= context_count <= rows <= self.max_context_rows:
            raise ValueError(
                f"{context_count} context rows in a layout of {rows} (at most {self.max_context_rows} in this cache)"
            )
        anchor = context_first + context_count
        self.paged.begin_step(context_first, context_count + NUM_QUERY)
        for group in self.paged.groups:
            assert group.metadata is not None
            slots = group.metadata.slot_mapping
            host = slots.cpu()
            layout = torch.full_like(host, NULL_PAGE * BLOCK_SIZE)
            layout[:context_count] = host[:context_count]
            layout[rows : rows + NUM_QUERY] = host[context_count : context_count + NUM_QUERY]
            slots.copy_(layout)
        context = torch.zeros(self.max_context_rows, dtype=torch.int64)
        context[:context_count] = torch.arange(context_first, anchor)
        self.context_positions.copy_(context)
        self.positions.copy_(torch.arange(anchor, anchor + NUM_QUERY))
        return DraftHostStep(context_first, context_count, rows, anchor)

    def context_slots(self, rows: int) -> list[torch.Tensor]:
        """Per layer: the context rows' slots (its group's)."""
        return [layer.group.slot_mapping[:rows] for layer in self.kv()]

    def query_slots(self, rows: int) -> list[torch.Tensor]:
        """Per layer: the query rows' slots after ``rows`` context rows."""
        return [layer.group.slot_mapping[rows : rows + NUM_QUERY] for layer in self.kv()]

    def clone(self) -> DraftCache:
        """An independent copy: the same pages, contents and metadata."""
        other = copy.copy(self)
        other.paged = self.paged.clone()
        other.context_positions = self.context_positions.clone()
        other.positions = self.positions.clone()
        return other
