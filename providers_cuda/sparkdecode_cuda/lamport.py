"""Lamport mailboxes over unicast peer memory, and the one-shot all-reduce on them
(kernels/lamport.cuh, kernels/all_reduce.cu). No NVLink multicast: every rank maps
every peer's buffer through CUDA IPC and writes into it with ordinary stores.

Layout. Each rank owns one buffer (``cuMemAlloc``, so its IPC handle covers it
exactly) of GENERATIONS x tp slots of ``capacity`` bf16. Slot (g, s) of rank r is
written only by rank s, in a call of generation g, and read only by rank r. Every
element starts as the sentinel (bf16 0xffff, a negative NaN with every payload bit
set: arithmetic produces the canonical NaN 0x7fff, and the producer maps any NaN to
0x7fff before it publishes, so data never equals the sentinel; a NaN stays a NaN).

A call (one kernel): read the generation g from the device control block (so graph
replays need no per-step host constant); each thread pushes its 16 bytes to slot
(g, rank) of every peer; reads slot (g, s) of its own buffer for s = 0..tp-1 in
rank order, spinning until no element is the sentinel (the data is its own flag),
summing in fp32 from rank 0's value (comm.Collectives's order: the same bits on
every rank and the same as the reference transport, -0.0 sums included; a NaN may
carry another payload than torch's, a NaN still), writing the sentinel back
into each slot it consumed; rounds once to bf16. The last block to finish advances
g to (g + 1) mod 3. Every rank makes the same calls in the same order (stream
order; the generation is per executor, shared by its all-reduce sub-ops, fused
boundaries and fused MoE tails), so the generations agree without any host exchange after the build.

Memory ordering (the argument; one GPU cannot falsify a scope bug, so it is on
paper). Stores to peers and spin loads are ``st/ld.volatile.global`` (relaxed at
system scope: strong, never served from a stale L1 line, each 32-bit element
single-copy atomic, so a torn 16-byte vector shows the sentinel in some element
and is read again, never mixed bits within one bf16 pair). Every thread executes
``fence.acq_rel.sys`` before its pushes and after its reads.

1. Data: a value's only consumer is the spinning reader, and it is its own flag: no
   other payload depends on it, so no release/acquire is needed for the value.
2. Reuse of a slot: rank r consumes slot (g, s) at call k and clears it (a store by
   the same thread to the same address after reading s's value: coherence orders
   the clear after s's write). Rank s writes that slot again at call k + 3 at the
   earliest, and only after it has read rank r's push of call k + 1 (s cannot
   finish call k + 1 without it). r's push of k + 1 follows r's fence.acq_rel.sys
   (release), which follows the clear in r's program order (the clear's kernel
   completed before the next call passed pdl_wait; a fence is cumulative over the
   writes ordered before it); s's read of that push is followed by s's fence
   (acquire) before any later store of s. So the clear happens-before s's next
   write and cannot overwrite it. Two generations would satisfy this argument;
   the third leaves a whole call of slack, as TensorRT-LLM's Lamport buffers do.
3. Inputs: a call reads its local block after ``pdl_wait`` (griddepcontrol.wait
   makes the previous grid's writes visible), and the generation likewise.
4. Scope: every fence and strong access is ``.sys``. With ``.gpu`` the argument
   holds on one GPU (all ranks share one L2) and fails across GPUs: a peer's L2
   could keep a line the fence did not order. Do not narrow it.

Publishing from a producer. A call's push may come from the kernel that produces
the values instead of the consumer: ``cuda.linear``'s o_proj built with PUBLISH
(linear.cu) pushes this rank's partial from its epilogue, 16 bytes a thread at the
offsets the consumer reads, and ``attention_boundary_all_reduce_kernel`` with
``published`` only gathers (``CudaAttentionBoundary.pair_attention`` sets both up at
the build). The producer reads the generation after ``pdl_wait`` and does not advance
it; the consumer, the next Lamport kernel in stream order, reads the same value (no
other Lamport kernel runs between them), so the push lands in the slot the consumer
takes. Argument 2 holds unchanged: the producer's push of call k + 1 follows its
``fence.acq_rel.sys`` and, in stream order, the completed kernel that cleared call
k's slots. The consumer's own block still comes from the partial, which the producer
wrote with the same (not yet canonicalized) bits it pushed, so the sum is the same
bits as when the consumer pushes. A published producer must run only where its
consumer follows it (the executor's layer order); run alone, its pushes would fill
slots nobody clears.

Liveness. A slow rank only delays the others (they spin). The spin traps with a
message after LAMPORT_SPIN_LIMIT_NS (ten minutes) instead of hanging forever; a
rank that stops making calls (a crash) is the only way to reach it.

Release. A workspace's finalizer waits for this rank's own kernels
(``cuCtxSynchronize``), closes the peers' mappings and frees this rank's buffer,
with no exchange with the peers. That is safe when the ranks stop after the same
calls, as they do (the same calls in the same order, above): when rank r's last call
has finished, every peer's push of that call into r's buffer has landed (r read each
one), and a peer writes r's buffer only in a call, so no later write comes. A rank
that stops after fewer calls than its peers (a crash) leaves them spinning toward
the trap, and their pushes of the calls it never makes go to a buffer it may have
freed.

The build is collective: every rank allocates, fills with the sentinel, then
exchanges IPC handles with ``all_gather_object`` over the TP group (gloo or NCCL)
at the same point of the build (the executor's first build of a provider that
needs the mailbox), and opens every peer's handle. A rank with a TP shard and no
group (detached) has no mailbox: its all-reduce is left out, as the reference's.
"""

from __future__ import annotations

import ctypes
import sys
import weakref

import torch
import torch.distributed as dist

from sparkdecode.deployment import on_every_rank
from sparkdecode.protocols import BuildContext, Deployment
from sparkdecode.release import release_deferred, release_outside_capture

from .launch import Kernel, _check, _ensure_context, i32, i64, ptr

SOURCE = "all_reduce.cu"
COMPILE_OPTIONS = ("--fmad=false",)
GENERATIONS = 3
MAX_TP = 8
SENTINEL = 0xFFFF
THREADS = 256  # AR_THREADS in all_reduce.cu


def lamport_unsupported(d: Deployment) -> str | None:
    if d.tp > MAX_TP:
        return f"the Lamport mailbox serves at most {MAX_TP} ranks, not {d.tp}"
    if d.tp > 1 and not sys.platform.startswith("linux"):
        return f"the Lamport mailbox maps peers' memory with CUDA IPC, which needs Linux (this is {sys.platform})"
    return None


def capacity(ctx: BuildContext) -> int:
    """Elements per slot: the largest reduction of a step (the attention partial
    [b, H], the expert-TP route rows [b, k, P], the EP tail [b, P]), in 16 bytes."""
    s = ctx.spec
    n = ctx.max_rows * max(s.H, s.top_k * s.P, s.P)
    return -(-n // 8) * 8


def _close(peers: list, local: object) -> None:
    from cuda.bindings import driver

    driver.cuCtxSynchronize()  # this rank's own kernels done with the buffers (result unchecked, as below)
    for p in peers:  # at interpreter exit the context may be gone: nothing left to release
        driver.cuIpcCloseMemHandle(p)
    driver.cuMemFree(local)


def _release(opened: list, held: list) -> None:
    """The finalizer of a workspace, finished or not: the peers' mappings and this
    rank's buffer, where it was allocated (after any capture this thread is in)."""
    if held:
        release_outside_capture(_close, opened, held[0])


class LamportWorkspace:
    """This rank's buffer, every peer's mapped buffer, the device pointer table and
    the control block (generation, blocks done, trap flag)."""

    def __init__(self, device: torch.device, group: object, tp: int, rank: int, capacity: int):
        self.tp, self.rank, self.capacity = tp, rank, capacity
        # Each rank's local work (the allocation, the handle; then the peers' mappings
        # and the compile) is agreed before the next collective step, so one rank
        # failing there stops every rank instead of leaving them in the exchange or
        # in the first all-reduce.
        # What this rank holds (its buffer, the peers' mappings), released by the
        # finalizer whether or not the workspace is finished.
        held: list = []
        opened: list = []
        self._finalizer = weakref.finalize(self, _release, opened, held)
        local, mine = on_every_rank(lambda: self._local_buffer(device, held), group, "the Lamport buffer")
        handles: list[bytes | None] = [None] * tp
        # Collective, at the same point of the build on every rank; it is also the
        # barrier after which every buffer holds only sentinels.
        dist.all_gather_object(handles, mine, group=group)
        on_every_rank(lambda: self._map_peers(device, handles, local, opened), group, "mapping the Lamport peers")

    def _local_buffer(self, device: torch.device, held: list) -> tuple[object, bytes]:
        """This rank's buffer (into ``held``), all sentinels, and its IPC handle."""
        from cuda.bindings import driver

        _ensure_context(device)
        release_deferred()
        nbytes = GENERATIONS * self.tp * self.capacity * 2
        (local,) = _check(driver.cuMemAlloc(nbytes), "cuMemAlloc of the Lamport buffer")
        held.append(local)
        _check(driver.cuMemsetD16(local, SENTINEL, nbytes // 2), "cuMemsetD16")
        _check(driver.cuCtxSynchronize(), "cuCtxSynchronize")
        (handle,) = _check(driver.cuIpcGetMemHandle(local), "cuIpcGetMemHandle (CUDA IPC)")
        return local, ctypes.string_at(handle.getPtr(), driver.CU_IPC_HANDLE_SIZE)

    def _map_peers(self, device: torch.device, handles: list, local: object, opened: list) -> None:
        """Every peer's buffer mapped (into ``opened``, which the finalizer closes), the
        pointer table, the control block, the kernel."""
        from cuda.bindings import driver

        bases = []
        for r, h in enumerate(handles):
            if r == self.rank:
                bases.append(int(local))
                continue
            theirs = driver.CUipcMemHandle()
            ctypes.memmove(theirs.getPtr(), h, driver.CU_IPC_HANDLE_SIZE)
            flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            (p,) = _check(driver.cuIpcOpenMemHandle(theirs, flags), f"cuIpcOpenMemHandle of rank {r}'s buffer")
            opened.append(p)
            bases.append(int(p))
        self.peers = torch.tensor(bases, dtype=torch.int64, device=device)
        self.control = torch.zeros(4, dtype=torch.int32, device=device)
        self.kernel = Kernel(SOURCE, "all_reduce_kernel", device, None, COMPILE_OPTIONS)

    def args(self) -> list:
        """The kernel arguments every Lamport kernel ends with."""
        return [ptr(self.peers), ptr(self.control), i32(self.rank), i32(self.tp), i64(self.capacity)]

    def all_reduce(self, x: torch.Tensor) -> None:
        """x (bf16, contiguous, 16-byte aligned) summed over the group in place."""
        n = x.numel()
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or n % 8 or x.data_ptr() % 16:
            raise ValueError(f"the Lamport all-reduce takes contiguous 16-byte-aligned bf16, got {x.dtype} {x.shape}")
        if n > self.capacity:
            raise ValueError(f"{n} elements exceed the Lamport slot of {self.capacity}")
        chunks = n // 8
        self.kernel.launch((-(-chunks // THREADS), 1, 1), (THREADS, 1, 1), [ptr(x), i64(chunks), *self.args()])


# The name of the workspace's marker in the executor's buffers (BuildContext.shared).
_MARKER = "lamport_workspace"


def collective_setup(cls: type, ctx: BuildContext) -> None:
    """The ``collective_setup`` of a provider that uses the executor's Lamport
    workspace: the workspace made (collectively) before any build."""
    workspace(ctx)


def device_gather(ctx: BuildContext) -> LamportWorkspace | None:
    """The executor's Lamport workspace where the resolved ``all_reduce`` sub-op says
    it gathers on the device (its ``device_gather``): the kernels that read a
    column-sharded result (a sharded pooler's output, a sharded unpooler's mailbox)
    exchange the ranks' blocks over it themselves. None otherwise (TP 1, a detached
    rank, another transport): the reference transport's gather."""
    if not getattr(ctx.ops.get("all_reduce"), "device_gather", False):
        return None
    return workspace(ctx)


def workspace(ctx: BuildContext) -> LamportWorkspace | None:
    """The executor's one workspace (shared by every build from its buffers), built
    at the first ask, collectively. None at TP 1 and on a detached rank."""
    if ctx.tp == 1 or ctx.group is None:
        return None
    return ctx.shared(_MARKER, lambda: LamportWorkspace(ctx.device, ctx.group, ctx.tp, ctx.rank, capacity(ctx)))
