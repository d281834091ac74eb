"""Mailboxes and the reference transport over torch.distributed.

A mailbox is where a producer publishes its block of a [b, H] result for the
next boundary to gather. At TP 1 a mailbox is one buffer.
Over a process group every reduction sums in a fixed rank order (0, 1, ...,
tp - 1), so every rank holds the same bits; fast transports (peer memory,
Lamport flags) live in the packs.
"""

from __future__ import annotations

import torch


class LocalMailbox:
    """TP 1: the producer writes the whole bf16 [b, H] into one buffer the consumer reads."""

    def __init__(self, rows: int, width: int, device: torch.device, dtype: torch.dtype = torch.bfloat16):
        self.buffer = torch.empty(rows, width, dtype=dtype, device=device)

    def publish(self, b: int) -> torch.Tensor:
        return self.buffer[:b]

    def gather(self, b: int) -> torch.Tensor:
        return self.buffer[:b]
