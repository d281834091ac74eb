"""The mailboxes' gathers (comm.py): a reader's device gather (``Mailbox.gather(b,
columns)``) takes the place of the reference transport's on a column-sharded mailbox
of a rank in a group, and is left out where there is nothing to gather across."""

from __future__ import annotations

import torch

from sparkdecode.comm import Collectives, ColumnMailbox, LocalMailbox


def _in_a_group(tp: int, rank: int) -> Collectives:
    """A rank's collectives as in a TP group (its group a placeholder: nothing here may
    reach torch.distributed)."""
    c = object.__new__(Collectives)
    c.tp, c.rank, c.group = tp, rank, object()
    return c


def test_a_readers_gather_fills_the_whole_from_the_published_block():
    box = ColumnMailbox(8, 64, _in_a_group(4, 1), torch.device("cpu"))
    box.publish(3).copy_(torch.arange(3 * 16, dtype=torch.bfloat16).view(3, 16))
    calls = []

    def columns(block: torch.Tensor, whole: torch.Tensor) -> None:
        calls.append((block, whole))
        whole.copy_(block.repeat(1, 4))

    out = box.gather(3, columns)
    ((block, whole),) = calls
    assert block.data_ptr() == box.block.data_ptr() and tuple(block.shape) == (3, 16)
    assert whole.data_ptr() == box.whole.data_ptr() and tuple(whole.shape) == (3, 64)
    assert out.data_ptr() == box.whole.data_ptr() and torch.equal(out, box.block[:3].repeat(1, 4))


def test_a_detached_rank_and_a_replicated_mailbox_ignore_a_readers_gather():
    def columns(block: torch.Tensor, whole: torch.Tensor) -> None:
        raise AssertionError("no gather across ranks here")

    detached = ColumnMailbox(8, 64, Collectives(4, 2, None), torch.device("cpu"))
    detached.publish(2).fill_(1.0)
    out = detached.gather(2, columns)
    assert torch.equal(out[:, 32:48], torch.ones(2, 16, dtype=torch.bfloat16))
    assert out[:, :32].eq(0).all() and out[:, 48:].eq(0).all()
    local = LocalMailbox(8, 64, torch.device("cpu"))
    assert local.gather(5, columns).data_ptr() == local.publish(5).data_ptr()
