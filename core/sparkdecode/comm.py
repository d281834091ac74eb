"""Mailboxes and the reference transport over torch.distributed.

A mailbox is where a producer publishes its block of a [b, H] result for the
next boundary to gather (protocols.Mailbox). The reference transport here is
correct and slow: an all-gather or all-reduce over the TP group's process group
(gloo on the CPU, NCCL on GPUs), with every reduction summed in a fixed rank
order (0, 1, ..., tp - 1) in fp32 and rounded once, so every rank holds the same
bits. Fast transports (peer memory, Lamport flags) live in the packs.

A rank with a TP shard but no group is *detached* (one rank of a TP deployment
benchmarked alone): its collectives are left out (an all-reduce returns the local
value, a gather returns the local block in place), and it says so.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Collectives:
    """The reference collectives of one rank of a TP group (None: TP 1 or detached)."""

    def __init__(self, tp: int, rank: int, group: Any = None):
        self.tp, self.rank, self.group = tp, rank, group
        if group is not None and dist.get_world_size(group) != tp:
            raise ValueError(f"a TP-{tp} shard in a process group of {dist.get_world_size(group)} ranks")

    @property
    def detached(self) -> bool:
        """A TP shard with no group: its collectives are left out."""
        return self.tp > 1 and self.group is None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, accumulated in fp32 in rank order and
        rounded once to x's dtype (as one-shot all-reduce kernels sum)."""
        if self.tp == 1 or self.group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        return total.to(x.dtype)

    def gather_columns(self, block: torch.Tensor, width: int) -> torch.Tensor:
        """The [b, width] whole of every rank's [b, width / tp] column block, in rank
        order (detached: the local block in its place, zeros elsewhere)."""
        if self.tp == 1:
            return block
        if self.group is None:
            out = torch.zeros(block.shape[0], width, dtype=block.dtype, device=block.device)
            out[:, self.rank * block.shape[1] : (self.rank + 1) * block.shape[1]] = block
            return out
        parts = [torch.empty_like(block) for _ in range(self.tp)]
        dist.all_gather(parts, block.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


class LocalMailbox:
    """A replicated producer (every rank computes the whole bf16 [b, H]): one buffer,
    nothing to gather."""

    def __init__(self, rows: int, width: int, device: torch.device, dtype: torch.dtype = torch.bfloat16):
        self.buffer = torch.empty(rows, width, dtype=dtype, device=device)

    def publish(self, b: int) -> torch.Tensor:
        return self.buffer[:b]

    def gather(self, b: int) -> torch.Tensor:
        return self.buffer[:b]


class ColumnMailbox:
    """A column-sharded producer: each rank publishes its bf16 [b, H / tp] block; the
    gather lays every rank's block out in rank order (reference: an all-gather)."""

    def __init__(self, rows: int, width: int, collectives: Collectives, device: torch.device):
        self.width, self.collectives = width, collectives
        self.block = torch.empty(rows, width // collectives.tp, dtype=torch.bfloat16, device=device)
        self.whole = torch.empty(rows, width, dtype=torch.bfloat16, device=device)

    def publish(self, b: int) -> torch.Tensor:
        return self.block[:b]

    def gather(self, b: int) -> torch.Tensor:
        """The whole over the reference transport."""
        whole = self.whole[:b]
        whole.copy_(self.collectives.gather_columns(self.block[:b], self.width))
        return whole
