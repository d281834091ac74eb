"""Sub-op ``linear`` in the CuTe DSL on Hopper's TMA and warpgroup MMA: the layer's
bf16 dense GEMMs as gemv_tma.py's weight stream (W loaded by TMA into a ring of
shared-memory buffers, ``wgmma.m64n8k16`` on 64 weight rows against the 8 rows of
x staged once per CTA, the splits over K added in a fixed order by the last CTA of
each tile), the fp32 router as cute.linear_splitk's CUDA-core stream
(gemv_splitk.py) on a plan whose CTAs fit beside the pooler's (``router_plan``); all
launched with programmatic dependent launch.

Numerics as cute.linear's: the same products (exact in fp32) accumulated in fp32 in
another order (in the tensor cores over the CTA's chunk, then the splits in split
order), rounded once to the output dtype; results are identical from run to run.
Checked on the H200 by tests/test_gpu_cute_linear_tma.py.

At TP > 1 its ``publish(name, mailbox)`` switches a bf16 weight to gemv_tma's
``PublishingTmaGemv``: its epilogue also pushes the output into the cuda pack's
Lamport mailbox (duck-typed: ``peers``, ``control``, ``rank``, ``tp``,
``capacity``), as cuda.linear's ``publish``; the same plan, so the same bits
(tests/test_gpu_cute_publish.py on the H200: TP 2, 4 and 8 on one GPU, bit for bit
against the pushing boundary). The cuda pack's attention asks it for the o_proj
when the layer's attention boundary gathers (``pair_attention``).
"""

from __future__ import annotations

from typing import Any

import torch

from .common import compiled, current_stream, pointer
from .linear import VECTOR_BYTES
from .linear_mma import CuteLinearMma, MmaWeight
from .linear_splitk import XFirstSplitKWeight


def mailbox_reason(mailbox: Any, device: torch.device) -> str | None:
    """Why ``mailbox`` is not a Lamport mailbox the published epilogue can push into
    on ``device``, if so (its attributes as the cuda pack's LamportWorkspace's)."""
    from . import gemv_tma

    peers, control = getattr(mailbox, "peers", None), getattr(mailbox, "control", None)
    tp, rank = getattr(mailbox, "tp", 0), getattr(mailbox, "rank", -1)
    if not (isinstance(peers, torch.Tensor) and isinstance(control, torch.Tensor)):
        return "no peers and control tensors"
    if not 1 <= tp <= gemv_tma.MAX_TP or not 0 <= rank < tp:
        return f"rank {rank} of {tp} (1..{gemv_tma.MAX_TP} ranks)"
    if peers.dtype != torch.int64 or peers.shape != (tp,) or control.dtype != torch.int32 or control.numel() < 1:
        return f"peers {peers.dtype} {tuple(peers.shape)}, control {control.dtype} {tuple(control.shape)}"
    if peers.device != device or control.device != device:
        return f"peers and control on {peers.device} and {control.device}, the weight on {device}"
    return None


class TmaWeight(MmaWeight):
    """One bf16 weight's compiled TMA kernel, its pointer and the shared workspace;
    ``publish`` switches it to the published epilogue (gemv_tma's ``PublishingTmaGemv``,
    the same plan), whose pointers after out are the workspace, the counters and the
    mailbox's."""

    provider = "cute.linear_tma"
    kind = "TMA"

    @staticmethod
    def make_plan(w: torch.Tensor, fp32: bool, max_rows: int, sms: int) -> Any:
        from . import gemv_tma

        return gemv_tma.plan_tma(w.shape[0], w.shape[1], max_rows, w.stride(0), sms)

    @staticmethod
    def compile(plan: Any) -> Any:
        from . import gemv_tma

        return compiled(("gemv_tma", plan), lambda: gemv_tma.compile_tma(plan))

    def __init__(self, name: str, w: torch.Tensor, max_rows: int, sms: int, plan: Any = None):
        super().__init__(name, w, max_rows, sms, plan)
        self.mailbox: Any = None  # set by publish()
        self.mailbox_args: tuple = ()

    @staticmethod
    def compile_publishing(plan: Any) -> Any:
        """The compiled published kernel of ``plan``, once per process."""
        from . import gemv_tma

        return compiled(("gemv_tma_publish", plan), lambda: gemv_tma.compile_tma_publishing(plan))

    def share(self, workspace: torch.Tensor, counters: torch.Tensor) -> None:
        super().share(workspace, counters)
        self.buffers += self.mailbox_args

    def publish(self, mailbox: Any) -> bool:
        """From now on every call also publishes its output into ``mailbox`` (this
        rank's slot of the current generation in every peer, at row * N + column) for
        the next Lamport kernel to gather. False (nothing changes) where it cannot:
        no plan of the published epilogue, a slot smaller than max_rows x N, or not
        a mailbox on this weight's device."""
        import cutlass
        import cutlass.cute as cute

        from . import gemv_tma

        p = self.plan
        if gemv_tma.publish_reason(p) or p.max_rows * p.n > getattr(mailbox, "capacity", 0):
            return False
        if mailbox_reason(mailbox, self.w.device):
            return False
        peers = cute.runtime.make_ptr(cutlass.Int64, mailbox.peers.data_ptr(), cute.AddressSpace.gmem, assumed_align=8)
        self.kernel = self.compile_publishing(p)
        self.mailbox = mailbox  # held: the kernel has only its tensors' addresses
        self.mailbox_args = (
            peers,
            pointer(mailbox.control, 4),
            cutlass.Int32(mailbox.rank),
            cutlass.Int32(mailbox.tp),
            cutlass.Int64(mailbox.capacity),
        )
        self.buffers = self.buffers[:2] + self.mailbox_args
        return True

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.mailbox is None:
            super().__call__(x, out)
            return
        from cutlass import Int32

        self.check(x, out)
        if out.stride(0) % self.vector:
            raise ValueError(f"{self.provider} {self.name}: a published output takes rows of whole 16-byte vectors")
        self.kernel(
            self.w_ptr,
            pointer(x, VECTOR_BYTES),
            pointer(out, VECTOR_BYTES),
            *self.buffers,
            Int32(x.shape[0]),
            Int32(x.stride(0)),
            Int32(out.stride(0)),
            current_stream(),
        )


class CuteLinearTma(CuteLinearMma):
    """Sub-op ``linear``: the bf16 weights on the TMA + WGMMA GEMV, the fp32 router on
    the split-K CUDA-core GEMV; workspace and counters shared as cute.linear_splitk's.
    A bf16 weight can publish its output into a Lamport mailbox from the epilogue
    (``publish``), for the attention boundary at TP > 1."""

    name = "cute.linear_tma"
    # Above the pack's other linears (20): the fastest of them in the H200's 62-layer
    # step, so the resolver starts from it and times the other kinds beside it.
    priority = 30
    bf16_weight = TmaWeight

    @staticmethod
    def router_plans(w: torch.Tensor, pooler: Any, max_rows: int, sms: int) -> list:
        """The fp32 router ``w``'s split-K plans whose CTAs fit on an SM beside one of
        ``pooler``'s (a TmaWeight), best first (gemv_splitk's ``beside_plans``)."""
        from . import gemv_splitk, gemv_tma

        room = gemv_tma.SM_SMEM_BYTES - pooler.plan.resident * (pooler.plan.smem_bytes + gemv_splitk.CTA_RESERVED_BYTES)
        return gemv_splitk.beside_plans(w.shape[0], w.shape[1], True, max_rows, room, w.stride(0), sms)

    @staticmethod
    def router_plan(name: str, w: torch.Tensor, bf16: dict[str, Any], max_rows: int, sms: int) -> Any:
        """The router's split-K plan whose CTAs fit on an SM beside one of the pooler's
        (the best of ``router_plans``): cuda.moe runs the router on a side stream beside
        the pooler, whose 1-CTA-an-SM tilings leave about 33 KB of an SM's shared memory.
        At the driver's default carveout the router's CTAs in fact start only as the
        pooler's leave their SMs (bench/NOTES.md v46-v49); this plan is still the fastest
        measured there (v11's 62-layer step on the H200: 10.22 ms against 10.35 with the
        planner's). The planner's where there is no pooler plan or none fits."""
        pooler = bf16.get("pooler")
        if not isinstance(pooler, TmaWeight):
            return None
        fits = CuteLinearTma.router_plans(w, pooler, max_rows, sms)
        return fits[0] if fits else None

    def publish(self, name: str, mailbox: Any) -> bool:
        """Weight ``name``'s output published into ``mailbox`` by its epilogue from now
        on (``TmaWeight.publish``); whether it will be (never the fp32 router, which
        runs on the split-K CUDA-core kernel)."""
        weight = self.weights[name]
        return isinstance(weight, TmaWeight) and weight.publish(mailbox)


class CoresidentTmaWeight(TmaWeight):
    """A bf16 weight on the TMA kernel with the best tiling whose CTA takes at most half an
    SM's shared memory (gemv_tma's ``CORESIDENT_SMEM_BYTES``): in a chain of GEMMs the next
    kernel's CTAs fit beside the previous kernel's last ones, so its producer's first loads
    (issued before the PDL wait) overlap their drain instead of waiting for the SM to empty,
    where the default planner's 1-CTA-an-SM tilings (up to 194 KB) cannot."""

    provider = "cute.linear_tma_coresident"

    @staticmethod
    def make_plan(w: torch.Tensor, fp32: bool, max_rows: int, sms: int) -> Any:
        from . import gemv_tma

        return gemv_tma.plan_tma(
            w.shape[0], w.shape[1], max_rows, w.stride(0), sms, max_smem=gemv_tma.CORESIDENT_SMEM_BYTES
        )


class CuteLinearTmaCoresident(CuteLinearTma):
    """cute.linear_tma planned for co-resident CTAs of consecutive kernels
    (``CoresidentTmaWeight``). Not registered: slower on the H200 (bench/NOTES.md v9: the
    chain 5%; v14: in the step the o_proj 12.3-13.7 us a layer against 5.9-6.3, the unpooler
    18.4-19.4 against 15.1-16.9, the router with the pooler 20.7-21.8 against 22.4-23.6)."""

    name = "cute.linear_tma_coresident"
    bf16_weight = CoresidentTmaWeight


class EvictFirstTmaWeight(TmaWeight):
    """A bf16 weight on gemv_tma's ``EvictFirstTmaGemv``, and on ``EvictFirstPublishingTmaGemv``
    once it publishes: its loads hinted evict-first."""

    provider = "cute.linear_tma_evict_first"

    @staticmethod
    def compile(plan: Any) -> Any:
        from . import gemv_tma

        return compiled(
            ("gemv_tma_evict_first", plan), lambda: gemv_tma.compile_tma(plan, cls=gemv_tma.EvictFirstTmaGemv)
        )

    @staticmethod
    def compile_publishing(plan: Any) -> Any:
        from . import gemv_tma

        return compiled(
            ("gemv_tma_publish_evict_first", plan),
            lambda: gemv_tma.compile_tma_publishing(plan, cls=gemv_tma.EvictFirstPublishingTmaGemv),
        )


class XFirstEvictFirstTmaWeight(EvictFirstTmaWeight):
    """An evict-first bf16 weight on gemv_tma's ``XFirstEvictFirstTmaGemv`` (its published
    form ``XFirstEvictFirstPublishingTmaGemv``): x staged with all of a thread's loads in
    flight at once."""

    provider = "cute.linear_tma_evict_first_x_first"

    @staticmethod
    def compile(plan: Any) -> Any:
        from . import gemv_tma

        return compiled(
            ("gemv_tma_evict_first_x_first", plan),
            lambda: gemv_tma.compile_tma(plan, cls=gemv_tma.XFirstEvictFirstTmaGemv),
        )

    @staticmethod
    def compile_publishing(plan: Any) -> Any:
        from . import gemv_tma

        return compiled(
            ("gemv_tma_publish_evict_first_x_first", plan),
            lambda: gemv_tma.compile_tma_publishing(plan, cls=gemv_tma.XFirstEvictFirstPublishingTmaGemv),
        )


# The weights a boundary kernel runs just before (the input boundary's qkvg, the attention
# boundary's pooler), which ``ShallowEvictFirstTmaWeight`` loads shallow.
SHALLOW_WEIGHTS = frozenset({"qkvg", "pooler"})


class ShallowEvictFirstTmaWeight(EvictFirstTmaWeight):
    """An evict-first weight of ``SHALLOW_WEIGHTS`` on gemv_tma's ``ShallowEvictFirstTmaGemv``
    (one buffer of its ring loaded before the PDL wait, so the boundary's reads before it
    queue behind less); the other weights as ``EvictFirstTmaWeight``."""

    provider = "cute.linear_tma_evict_first_shallow"

    def compile(self, plan: Any) -> Any:  # type: ignore[override]  # by the weight's name
        from . import gemv_tma

        if self.name not in SHALLOW_WEIGHTS:
            return EvictFirstTmaWeight.compile(plan)
        return compiled(
            ("gemv_tma_evict_first_shallow", plan),
            lambda: gemv_tma.compile_tma(plan, cls=gemv_tma.ShallowEvictFirstTmaGemv),
        )


class CuteLinearTmaEvictFirst(CuteLinearTma):
    """cute.linear_tma with the bf16 weights' TMA loads hinted evict-first in L2, so that
    the weight stream leaves the step's activations (the residual stream the boundaries
    read, the mailboxes) in L2. The same kernels' products, so the same bits."""

    name = "cute.linear_tma_evict_first"
    # Above cute.linear_tma (30): ahead of it in every interleaved 40-layer step on the
    # H100, by 0.5-1.7 us a layer (bench/NOTES.md v50, v51).
    priority = 31
    bf16_weight = EvictFirstTmaWeight


class CuteLinearTmaEvictFirstShallow(CuteLinearTmaEvictFirst):
    """cute.linear_tma_evict_first with the qkvg and the pooler loading one buffer of their
    ring before the PDL wait (``ShallowEvictFirstTmaWeight``). The same bits. Not registered:
    level with cute.linear_tma_evict_first in the 40-layer step on an H100 (bench/NOTES.md v53)."""

    name = "cute.linear_tma_evict_first_shallow"
    bf16_weight = ShallowEvictFirstTmaWeight


class CuteLinearTmaEvictFirstXFirst(CuteLinearTmaEvictFirst):
    """cute.linear_tma_evict_first with every weight's x staged all loads first: after its
    PDL wait each thread issues all of its loads of x, then a barrier, then its shared
    stores (``XFirstSplitKGemv`` for the fp32 router, ``XFirstEvictFirstTmaGemv`` for the
    bf16 weights). ptxas otherwise waits for a load's value before the next loads: three
    dependent L2 round trips for the router at its planner plan (the column-sharded cut's),
    5-7 groups for the replicated pooler and unpooler; the other bf16 weights already issue
    theirs at once. The same bits. Not registered."""

    name = "cute.linear_tma_evict_first_x_first"
    bf16_weight = XFirstEvictFirstTmaWeight
    router_weight = XFirstSplitKWeight
