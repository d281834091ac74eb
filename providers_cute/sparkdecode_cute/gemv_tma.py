"""The weight-streaming GEMM for a few rows on Hopper's TMA and warpgroup MMA:
``out[b, N] = x[b, K] @ W[N, K]^T``, b <= ``max_rows`` <= 8, bf16 W and x, in the
CuTe DSL. Imports no torch: the kernels compile (``compile_tma``) from fake
pointers on a machine without a GPU.

gemv_mma.py's products with the weight moved by the TMA unit rather than through
registers, so the bytes in flight per SM are bounded by shared memory, not by the
register file:

- a CTA owns a tile of 64 weight rows by a ``chunk`` of K; the grid (tiles x
  ``splits``) is chosen for the SM count (``tma_plans``);
- warp 4 (the producer) loads the tile's K in ``stage_k`` steps by TMA (one
  descriptor of W, 128-byte swizzled, the layout WGMMA reads) into a ring of
  ``stages`` shared-memory buffers, an mbarrier pair per buffer
  (``PipelineTmaAsync``): the first ``stages`` loads are issued before
  ``griddepcontrol.wait`` (PDL; the weight is constant for the step), the rest as
  buffers are released;
- the CTA stages its chunk of x (8 rows, bf16; rows past b repeat row b - 1) once in
  shared memory after the wait, with ordinary 16-byte loads, in the swizzled K-major
  layout of WGMMA's B operand;
- warpgroup 0 (warps 0-3) multiplies each buffer as it lands:
  ``wgmma.m64n8k16`` (bf16 in, fp32 accumulate), A the 64 weight rows and B the 8
  rows of x, both read from shared memory; C is the tile's 64 x 8 fp32 sums, each
  held by one thread;
- the sums go through gemv_splitk's ``finish_tile``: with ``splits`` > 1 the CTA
  writes them to a workspace and the last CTA of the tile to arrive adds the splits
  in split order (gemv_splitk's counters), rounding once into bf16. Results are
  identical from run to run.

b is a runtime argument: rows past b are never stored.

``PublishingTmaGemv`` (cute.linear_tma's ``publish``) is the same kernel
whose epilogue also publishes its bf16 output into the cuda pack's Lamport mailbox
for the next Lamport kernel to gather, as cuda.linear's PUBLISH (linear.cu; the
protocol and its ordering in providers_cuda/sparkdecode_cuda/lamport.py,
"Publishing from a producer"). Only the CTA that ends a tile (after split-K's
last-CTA sum) publishes: its threads round the sums into a bf16 staging tile in the
drained ring, then 64 threads each take 8 consecutive output columns of one row i of
x, store them to ``out`` as 16 bytes and push the same bits, NaNs canonicalized as
lamport.cuh's ``canonical_nan2``, after a ``fence.acq_rel.sys``, by
``st.volatile.global.v4.u32`` to element ``i * N + column`` of slot (g, rank) of
every peer, g read from the control block after ``griddepcontrol.wait`` and not
advanced (the consumer advances it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.utils import LayoutEnum

from .gemv import VECTOR_BYTES, compile_for, fake_pointer
from .gemv_splitk import (
    CTA_RESERVED_BYTES,
    H200_SMS,
    WARPS,
    SplitGrid,
    SplitKKernel,
    best_first,
    compile_split,
    first_plan,
    split_counts,
    stage_x,
    tiling_reason,
    wave_key,
)

VECTOR = VECTOR_BYTES // 2  # bf16 elements per 16-byte load
TILE_ROWS = 64  # WGMMA's M: one warpgroup's weight rows
MMA_N, MMA_K = 8, 16
SWIZZLE_K = 64  # bf16 of one 128-byte swizzled row: the K granule of the stages
PRODUCER_WARP = 4  # warps 0-3 are the MMA warpgroup; 5-7 help stage x and finish
STAGE_KS = (128, 256)  # K of one ring buffer (16 or 32 KB of weight)
MAX_STAGES = 8
RING_BYTES = 128 * 1024  # weight in flight per CTA at most
MIN_CTA_BYTES = 64 * 1024  # weight one CTA streams at least (its fill and epilogue are fixed costs)
MAX_CHUNK_BYTES = 128 * 1024  # x's chunk in shared memory (bf16, 8 rows)
SM_SMEM_BYTES = 228 * 1024  # shared memory of an H200 SM
CTA_SMEM_BYTES = 227 * 1024  # the most one CTA may take
BARRIER_BYTES = 2048  # the mbarriers (padded to the ring's 1024-byte alignment) and finish_tile's flag
SUMS_BYTES = WARPS * TILE_ROWS * MMA_N * 4  # the epilogue's fp32 sums in the drained ring
STAGING_BYTES = MMA_N * TILE_ROWS * 2  # the published epilogue's bf16 tile, after the sums
MAX_TP = 8  # ranks of a Lamport mailbox (lamport.py's MAX_TP)


@dataclass(frozen=True)
class TmaPlan(SplitGrid):
    """The compile-time shape of one kernel: bf16 W [n, k] (row stride
    ``w_stride``), up to ``max_rows`` rows of x, and the tiling."""

    n: int
    k: int
    w_stride: int
    max_rows: int
    splits: int  # K chunks, one CTA each
    stage_k: int  # K of one ring buffer
    stages: int  # ring buffers

    @property
    def tile_rows(self) -> int:
        return TILE_ROWS

    @property
    def k_tiles(self) -> int:
        """Ring buffers of weight one CTA loads."""
        return self.chunk // self.stage_k

    @property
    def stage_bytes(self) -> int:
        return TILE_ROWS * self.stage_k * 2

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA: the ring, x's chunk, the barriers."""
        return self.stages * self.stage_bytes + MMA_N * self.chunk * 2 + BARRIER_BYTES

    @property
    def resident(self) -> int:
        """CTAs one SM holds at once (by shared memory)."""
        return min(SM_SMEM_BYTES // (self.smem_bytes + CTA_RESERVED_BYTES), 2048 // self.threads)

    @property
    def cols(self) -> int:
        """Rows of x the tile sums (the MMA's N; those past b are never stored)."""
        return MMA_N


# A CTA's shared memory at most this, so that any two such CTAs (of consecutive kernels)
# fit one SM together: the next kernel's CTAs become resident, and issue their first
# loads before their PDL wait, while the previous kernel's drain (CoresidentTmaWeight).
CORESIDENT_SMEM_BYTES = SM_SMEM_BYTES // 2 - CTA_RESERVED_BYTES


def plan_tma(
    n: int,
    k: int,
    max_rows: int,
    w_stride: int | None = None,
    sms: int = H200_SMS,
    max_smem: int = CTA_SMEM_BYTES,
) -> TmaPlan | str:
    """The tiling for bf16 W [n, k] (rows ``w_stride`` apart, default k) on ``sms``
    SMs (the first of ``tma_plans``), or why the kernel does not take the shape."""
    return first_plan(tma_plans(n, k, max_rows, w_stride, sms, max_smem))


def tma_plans(
    n: int,
    k: int,
    max_rows: int,
    w_stride: int | None = None,
    sms: int = H200_SMS,
    max_smem: int = CTA_SMEM_BYTES,
) -> list[TmaPlan] | str:
    """Every tiling of W [n, k] whose shared memory (ring and x's chunk) fits a CTA
    (at most ``max_smem``) and whose CTAs stream at least ``MIN_CTA_BYTES`` of weight
    (unless unsplit), best first: those balanced over the SMs (mean / most CTAs per SM
    at least ``MIN_BALANCE``), then the fewest waves (``resident`` CTAs per SM), the
    best balance, the most weight in flight per SM, the fewest splits, the larger
    buffers; or why the kernel does not take the shape."""
    w_stride = k if w_stride is None else w_stride
    reason = tiling_reason(n, k, VECTOR, max_rows, w_stride, STAGE_KS[0], TILE_ROWS)
    if reason:
        return reason
    ranked = []
    for stage_k in STAGE_KS:
        for splits in split_counts(k, stage_k, MMA_N * 2, MAX_CHUNK_BYTES):
            if splits > 1 and TILE_ROWS * (k // splits) * 2 < MIN_CTA_BYTES:
                continue
            k_tiles = k // splits // stage_k
            for stages in range(2, min(MAX_STAGES, k_tiles) + 1):
                plan = TmaPlan(n, k, w_stride, max_rows, splits, stage_k, stages)
                if stages * plan.stage_bytes > RING_BYTES or plan.smem_bytes > min(max_smem, CTA_SMEM_BYTES):
                    continue
                in_flight = min(math.ceil(plan.ctas / sms), plan.resident) * stages * plan.stage_bytes
                key = (*wave_key(plan.ctas, sms, plan.resident), -in_flight, splits, -stage_k)
                ranked.append((key, plan))
    if not ranked:
        return f"K {k}: x's chunk of {MMA_N} rows and a ring of 2 buffers do not fit {min(max_smem, CTA_SMEM_BYTES)} bytes of shared memory"
    return best_first(ranked)


class TmaGemv(SplitKKernel):
    """One compiled shape: ``__call__(w, x, out, workspace, counters, b, x_stride,
    out_stride, stream)`` on pointers, as gemv_splitk's ``SplitKGemv`` (W [n, k]
    bf16 with contiguous rows, 16-byte aligned; x and out bf16 rows contiguous, row
    strides in elements, x's a multiple of 8; ``workspace`` fp32 of
    ``plan.workspace`` elements and ``counters`` int32 of ``plan.tiles``, zero
    before the first launch, both unused without a split)."""

    # The L2 cache hint of the weight's TMA loads (an ``L2::cache_hint`` policy word), or
    # None for none (the DSL's default word 0): ``EvictFirstTmaGemv`` streams the weight
    # evict-first so that it does not push the step's activations out of L2.
    weight_cache_hint: int | None = None
    # How many of the ring's buffers the producer fills before ``griddepcontrol.wait``, or
    # None for all of them (every registered kernel): ``ShallowEvictFirstTmaGemv`` issues
    # fewer, so a boundary kernel before it is not queued behind all of its first loads.
    pre_wait_stages: int | None = None
    # x's chunk staged with all of a thread's loads issued before its shared stores
    # (``XFirstEvictFirstTmaGemv``); else a load and its store at a time, which ptxas
    # interleaves in 5-7 dependent groups where a thread has 16 (the replicated pooler and
    # unpooler at a TP-8 rank).
    x_loads_first = False

    def __init__(self, plan: TmaPlan):
        # The epilogue's fp32 [WARPS, 64 * 8] sums reuse the ring once it is drained.
        if plan.stages * plan.stage_bytes < SUMS_BYTES:
            raise ValueError(f"{plan}: a ring of {plan.stages * plan.stage_bytes} bytes cannot hold the tile's sums")
        self.plan = plan

    @property
    def prefetch(self) -> int:
        """The buffers the producer fills before ``griddepcontrol.wait``."""
        p = self.plan
        return min(p.stages, p.k_tiles, p.stages if self.pre_wait_stages is None else self.pre_wait_stages)

    def layouts(self):
        """The swizzled shared-memory layouts: the weight ring (64, stage_k, stages)
        and x's chunk (8, chunk, 1), both K-major as WGMMA reads them."""
        p = self.plan
        a = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_ROWS, MMA_N, p.stage_k), BFloat16, p.stages)
        b = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_ROWS, MMA_N, p.chunk), BFloat16, 1)
        return a, b

    @cute.jit
    def __call__(
        self,
        w: cute.Pointer,
        x: cute.Pointer,
        out: cute.Pointer,
        workspace: cute.Pointer,
        counters: cute.Pointer,
        b: Int32,
        x_stride: Int32,
        out_stride: Int32,
        stream: cuda.CUstream,
    ):
        p = self.plan
        tma_atom, tma_w = self.tma_of(w)
        self.kernel(tma_atom, tma_w, x, out, workspace, counters, b, x_stride, out_stride).launch(
            grid=[p.ctas, 1, 1], block=[p.threads, 1, 1], stream=stream, **self.launch_options()
        )

    def tma_of(self, w: cute.Pointer):
        """The TMA atom and tensor of W: (64, stage_k) boxes into a ring buffer."""
        p = self.plan
        mW = cute.make_tensor(w, cute.make_layout((p.n, p.k), stride=(p.w_stride, 1)))
        ring, _ = self.layouts()
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mW,
            cute.slice_(ring, (None, None, 0)),
            (TILE_ROWS, p.stage_k),
        )

    def produce(self, ring, state, tma_atom, tWgW, tWsW, k_tile0):
        """The producer warp: the chunk's K step ``state.count`` of W into ring
        buffer ``state.index`` once the MMA warps have released it. The caller
        advances ``state``: in a ``cutlass.range`` loop the DSL carries only the
        variables the loop body itself assigns or calls a method on, so an advance
        in here would be traced once and every iteration would reload one buffer."""
        ring.producer_acquire(state)
        hint = {} if self.weight_cache_hint is None else {"cache_policy": Int64(self.weight_cache_hint)}
        cute.copy(
            tma_atom,
            tWgW[(None, k_tile0 + state.count)],
            tWsW[(None, state.index)],
            tma_bar_ptr=ring.producer_get_barrier(state),
            **hint,
        )

    @cute.kernel
    def kernel(
        self,
        tma_atom: cute.CopyAtom,
        tma_w: cute.Tensor,
        x: cute.Pointer,
        out: cute.Pointer,
        workspace: cute.Pointer,
        counters: cute.Pointer,
        b: Int32,
        x_stride: Int32,
        out_stride: Int32,
    ):
        self.stream_tile(tma_atom, tma_w, x, out, workspace, counters, b, x_stride, out_stride, None)

    @cute.jit
    def stream_tile(
        self,
        tma_atom: cute.CopyAtom,
        tma_w: cute.Tensor,
        x: cute.Pointer,
        out: cute.Pointer,
        workspace: cute.Pointer,
        counters: cute.Pointer,
        b: Int32,
        x_stride: Int32,
        out_stride: Int32,
        publisher: cutlass.Constexpr,
    ):
        """The kernel's body: the CTA's tile and split of K, ended by ``finish_tile``
        (with ``publisher``'s store, a ``Publisher`` of the ring, where given)."""
        p = self.plan
        TK, KB = p.chunk, p.stage_k // MMA_K
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile = bidx // p.splits
        split = bidx - tile * p.splits
        prefetch = self.prefetch
        self.mark(counters, 0)

        if warp == PRODUCER_WARP:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom)

        ring_layout, x_layout = self.layouts()
        smem = cutlass.memory.SmemAllocator()
        barriers = smem.allocate_array(cutlass.Int64, 2 * p.stages)
        sW = smem.allocate_tensor(BFloat16, ring_layout.outer, 1024, ring_layout.inner)
        sX = smem.allocate_tensor(BFloat16, x_layout.outer, 1024, x_layout.inner)

        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers,
            num_stages=p.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),  # a lane of each MMA warp
            tx_count=p.stage_bytes,
        )

        # The tile's K steps of W: (64, stage_k) boxes, the chunk's k_tiles of them.
        gW = cute.local_tile(tma_w, (TILE_ROWS, p.stage_k), (tile, None))
        tWsW, tWgW = cute.nvgpu.cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2)
        )
        k_tile0 = split * p.k_tiles

        # The weight first: constant for the step, so loaded before the wait.
        if warp == PRODUCER_WARP:
            ahead = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, p.stages)
            for _ in cutlass.range_constexpr(prefetch):
                self.produce(ring, ahead, tma_atom, tWgW, tWsW, k_tile0)
                ahead.advance()
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        self.mark(counters, 1)

        # x's chunk, 16-byte vectors in the swizzled B layout; rows past b repeat row b - 1.
        xs = cute.assume(x_stride, divby=VECTOR)
        mX = cute.make_tensor(x, cute.make_layout((p.max_rows, p.k), stride=(xs, 1)))
        sX2 = sX[(None, None, 0)]
        x_vectors = TK // VECTOR
        stage_x(mX, sX2, b, split * x_vectors, MMA_N, x_vectors, self.x_loads_first, None)
        cute.arch.fence_proxy("async.shared", space="cta")  # x is read by WGMMA (the async proxy)
        cute.arch.sync_threads()

        mma = sm90.make_trivial_tiled_mma(
            BFloat16,
            BFloat16,
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            Float32,
            (1, 1, 1),
            tiler_mn=(TILE_ROWS, MMA_N),
        )
        thr = mma.get_slice(tidx % 128)
        tAW = mma.make_fragment_A(thr.partition_A(sW))  # (mma, 1, stage_k / 16, stages)
        tBX = mma.make_fragment_B(thr.partition_B(sX))  # (mma, 1, chunk / 16, 1)
        cC = thr.partition_C(cute.make_identity_tensor((TILE_ROWS, MMA_N)))
        acc = cute.make_rmem_tensor(cC.shape, Float32)
        acc.fill(0.0)
        mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

        if warp == PRODUCER_WARP:
            # The producer's state after the prefetch (its phase starts at 1, flips on wrapping).
            produced = pipeline.PipelineState(
                p.stages, Int32(prefetch), Int32(prefetch % p.stages), Int32(1 if prefetch < p.stages else 0)
            )
            for _ in cutlass.range(prefetch, p.k_tiles, unroll=1):
                self.produce(ring, produced, tma_atom, tWgW, tWsW, k_tile0)
                produced.advance()  # here, in the loop body: carried from one iteration to the next
        elif warp < PRODUCER_WARP:
            consumed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, p.stages)
            for kt in cutlass.range(p.k_tiles, unroll=1):
                ring.consumer_wait(consumed)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range_constexpr(KB):
                    cute.gemm(mma, acc, tAW[(None, None, kb, consumed.index)], tBX[(None, None, kt * KB + kb, 0)], acc)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
                ring.consumer_release(consumed)
                consumed.advance()
        cute.arch.sync_threads()

        # The ring is free: partial[0, row * 8 + i] holds the tile's sums (each from
        # one thread), finish_tile's other warp rows are zeros.
        partial = cute.make_tensor(
            cute.recast_ptr(sW.iterator, dtype=Float32),
            cute.make_layout((WARPS, TILE_ROWS * MMA_N), stride=(TILE_ROWS * MMA_N, 1)),
        )
        if warp < PRODUCER_WARP:
            for e in cutlass.range_constexpr(cute.size(acc)):
                row, i = cC[e]
                partial[0, row * MMA_N + i] = acc[e]
        zeros = cute.make_tensor(
            partial.iterator + TILE_ROWS * MMA_N, cute.make_layout(((WARPS - 1) * TILE_ROWS * MMA_N,))
        )
        for it in cutlass.range_constexpr((WARPS - 1) * TILE_ROWS * MMA_N // p.threads):
            zeros[it * p.threads + tidx] = Float32(0.0)
        cute.arch.sync_threads()

        store = None if publisher is None else publisher.store_at(sW.iterator)
        self.finish(smem, partial, out, workspace, counters, b, out_stride, tile, split, store)
        self.mark(counters, 2)


def compile_tma(plan: TmaPlan, arch: str | None = None, options: str = "", cls: type[TmaGemv] = TmaGemv):
    """The compiled kernel (``cls``, by default ``TmaGemv``) of ``plan`` for ``arch`` (e.g.
    ``sm_90a``; by default ``CUTE_DSL_ARCH`` or the GPU's), with further ``options`` for
    ``cute.compile`` (e.g. ``remarks{ptx}``)."""
    return compile_split(cls(plan), arch, options)


# CUTLASS's SM90 TMA cache-hint policy words (cute/arch/copy_sm90_tma.hpp, CacheHintSm90).
EVICT_FIRST = 0x12F0000000000000


class EvictFirstTmaGemv(TmaGemv):
    """``TmaGemv`` with the weight's TMA loads hinted evict-first in L2 (``EVICT_FIRST``):
    the same loads and products, so the same bits (cute.linear_tma_evict_first)."""

    weight_cache_hint = EVICT_FIRST


class XFirstEvictFirstTmaGemv(EvictFirstTmaGemv):
    """``EvictFirstTmaGemv`` with x's chunk staged all loads first (``x_loads_first``): the
    same values in the same places, so the same bits."""

    x_loads_first = True


class ShallowEvictFirstTmaGemv(EvictFirstTmaGemv):
    """``EvictFirstTmaGemv`` whose producer fills one buffer of the ring before the PDL wait
    and the rest after it: the same loads in the same order, so the same bits."""

    pre_wait_stages = 1


class TracedTmaGemv(TmaGemv):
    """``TmaGemv`` writing each CTA's record (gemv_splitk's ``SplitKKernel.trace``)."""

    trace = True


def publish_reason(plan: TmaPlan) -> str | None:
    """Why ``PublishingTmaGemv`` does not take ``plan``, if so: a tile's rows in whole
    16-byte vectors, and the sums and the bf16 staging tile in the drained ring."""
    if plan.tile_rows % VECTOR:
        return f"{plan}: tiles of {plan.tile_rows} rows are not whole 16-byte vectors"
    if plan.stages * plan.stage_bytes < SUMS_BYTES + STAGING_BYTES:
        return f"{plan}: a ring of {plan.stages * plan.stage_bytes} bytes cannot hold the sums and the staging tile"
    return None


@dsl_user_op
def load_volatile(address: Int64, *, loc=None, ip=None) -> Int32:
    """``ld.volatile.global`` of the 32 bits at ``address`` (strong, never a stale L1 line)."""
    value = llvm.inline_asm(
        T.i32(),
        [Int64(address).ir_value(loc=loc, ip=ip)],
        "ld.volatile.global.u32 $0, [$1];",
        "=r,l,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    return Int32(value)


@dsl_user_op
def store_volatile_v4(address: Int64, words: list, *, loc=None, ip=None) -> None:
    """``st.volatile.global.v4.u32`` of four 32-bit ``words`` at ``address`` (16-byte
    aligned): relaxed at system scope, each 32-bit element single-copy atomic."""
    llvm.inline_asm(
        None,
        [Int64(address).ir_value(loc=loc, ip=ip), *(Int32(w).ir_value(loc=loc, ip=ip) for w in words)],
        "st.volatile.global.v4.u32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def canonical_nan2(w: Int32) -> Int32:
    """lamport.cuh's ``canonical_nan2`` of a bf16 pair: each NaN half becomes 0x7fff,
    so a pushed value never equals the mailbox's sentinel 0xffff."""
    w = cutlass.select_((w & 0x7FFF) > 0x7F80, (w & Int32(-0x10000)) | 0x7FFF, w)
    return cutlass.select_(((w >> 16) & 0x7FFF) > 0x7F80, (w & 0xFFFF) | Int32(0x7FFF0000), w)


@dataclass(frozen=True)
class Publisher:
    """The published epilogue of one launch: the mailbox (``peers``: int64 [tp] every
    rank's buffer base address; ``control``: int32, [0] the generation; this ``rank``
    of ``tp``; ``cap`` elements a slot), the output's width ``n`` and, once placed
    (``store_at``), the bf16 staging tile [8, 64] in shared memory."""

    peers: cute.Pointer
    control: cute.Pointer
    rank: Int32
    tp: Int32
    cap: Int64
    n: int
    staging: cute.Pointer | None = None

    def store_at(self, ring: cute.Pointer):
        """``finish_tile``'s ``store``, staging in the drained ring (bf16 ``ring``)
        past the fp32 sums. The ring's pointer carries its 128-byte swizzle, a
        bijection within each 1024-byte block that keeps 16-byte vectors whole: the
        staging tile's element and vector accesses agree, and it stays clear of the
        sums."""
        return dataclasses.replace(self, staging=ring + SUMS_BYTES // 2).store

    @cute.jit
    def store(
        self,
        mO: cute.Tensor,
        total: cutlass.Constexpr,
        b: Int32,
        n0: Int32,
        tile_rows: cutlass.Constexpr,
        cols: cutlass.Constexpr,
        out_dtype: cutlass.Constexpr,
    ):
        """``store_elements``'s sums and roundings, published: every thread rounds its
        elements into the staging tile [i, row]; then thread i * tile_rows / 8 + g (of
        the first cols * tile_rows / 8) stores row i's columns n0 + 8 g .. + 7 to
        ``mO`` as 16 bytes and pushes the same bits (``push``)."""
        tidx, _, _ = cute.arch.thread_idx()
        threads = 32 * WARPS
        sT = cute.make_tensor(self.staging, cute.make_layout((cols, tile_rows), stride=(tile_rows, 1)))
        for u in cutlass.range_constexpr((tile_rows * cols + threads - 1) // threads):
            q = u * threads + tidx
            row = q // cols
            i = q - row * cols
            if q < tile_rows * cols and i < b:
                sT[i, row] = total(q).to(out_dtype)
        cute.arch.sync_threads()
        groups = tile_rows // VECTOR
        mV = cute.make_tensor(
            mO.iterator, cute.make_layout((cols, self.n), stride=(cute.assume(mO.stride[0], divby=VECTOR), 1))
        )
        for u in cutlass.range_constexpr((groups * cols + threads - 1) // threads):
            v = u * threads + tidx
            i = v // groups
            g = v - i * groups
            if v < groups * cols and i < b:
                vector = cute.make_rmem_tensor((VECTOR,), out_dtype)
                vector.store(cute.local_tile(sT, (1, VECTOR), (i, g)).load())
                cute.local_tile(mV, (1, VECTOR), (i, n0 // VECTOR + g)).store(vector.load())
                self.push(vector, i * self.n + n0 + g * VECTOR)

    @cute.jit
    def push(self, vector: cute.Tensor, offset: Int32):
        """lamport.cuh's ``lamport_push`` of 8 bf16 (``vector``, registers) at element
        ``offset`` of this rank's slot of the current generation in every peer: the
        generation read now (after the kernel's griddepcontrol.wait; not advanced),
        NaNs canonicalized, then ``fence.acq_rel.sys`` (release: every write this rank
        made before, earlier calls' clears included, is ordered before the data a peer
        observes), then the volatile stores."""
        words = cute.recast_tensor(vector, Int32)
        canonical = [canonical_nan2(words[j]) for j in range(4)]
        gen = load_volatile(self.control.toint())
        slot = (gen.to(Int64) * self.tp.to(Int64) + self.rank.to(Int64)) * self.cap + offset.to(Int64)
        mP = cute.make_tensor(self.peers, cute.make_layout((MAX_TP,)))
        cute.arch.fence_acq_rel_sys()
        for r in cutlass.range_constexpr(MAX_TP):
            if r < self.tp and r != self.rank:
                store_volatile_v4(mP[r] + slot * 2, canonical)


class PublishingTmaGemv(TmaGemv):
    """``TmaGemv`` whose epilogue also publishes its output (``Publisher``):
    ``__call__(w, x, out, workspace, counters, peers, control, rank, tp, cap, b,
    x_stride, out_stride, stream)``, ``out`` 16-byte aligned with rows a multiple of 8
    elements apart, ``peers`` int64 [tp] and ``control`` int32 device pointers, the
    slot of ``cap`` elements holding b x n."""

    def __init__(self, plan: TmaPlan):
        reason = publish_reason(plan)
        if reason:
            raise ValueError(reason)
        super().__init__(plan)

    @cute.jit
    def __call__(
        self,
        w: cute.Pointer,
        x: cute.Pointer,
        out: cute.Pointer,
        workspace: cute.Pointer,
        counters: cute.Pointer,
        peers: cute.Pointer,
        control: cute.Pointer,
        rank: Int32,
        tp: Int32,
        cap: Int64,
        b: Int32,
        x_stride: Int32,
        out_stride: Int32,
        stream: cuda.CUstream,
    ):
        p = self.plan
        tma_atom, tma_w = self.tma_of(w)
        self.kernel(
            tma_atom, tma_w, x, out, workspace, counters, peers, control, rank, tp, cap, b, x_stride, out_stride
        ).launch(grid=[p.ctas, 1, 1], block=[p.threads, 1, 1], stream=stream, **self.launch_options())

    @cute.kernel
    def kernel(
        self,
        tma_atom: cute.CopyAtom,
        tma_w: cute.Tensor,
        x: cute.Pointer,
        out: cute.Pointer,
        workspace: cute.Pointer,
        counters: cute.Pointer,
        peers: cute.Pointer,
        control: cute.Pointer,
        rank: Int32,
        tp: Int32,
        cap: Int64,
        b: Int32,
        x_stride: Int32,
        out_stride: Int32,
    ):
        publisher = Publisher(peers, control, rank, tp, cap, self.plan.n)
        self.stream_tile(tma_atom, tma_w, x, out, workspace, counters, b, x_stride, out_stride, publisher)


class EvictFirstPublishingTmaGemv(PublishingTmaGemv):
    """``PublishingTmaGemv`` with the weight's TMA loads hinted evict-first, as
    ``EvictFirstTmaGemv``."""

    weight_cache_hint = EVICT_FIRST


class XFirstEvictFirstPublishingTmaGemv(EvictFirstPublishingTmaGemv):
    """``EvictFirstPublishingTmaGemv`` with x staged all loads first, as
    ``XFirstEvictFirstTmaGemv``."""

    x_loads_first = True


def compile_tma_publishing(
    plan: TmaPlan, arch: str | None = None, options: str = "", cls: type[PublishingTmaGemv] = PublishingTmaGemv
):
    """``cls(plan)`` (``PublishingTmaGemv`` or ``EvictFirstPublishingTmaGemv``) compiled on
    fake pointers (out 16-byte aligned) for ``arch``, with further ``options``, as
    ``compile_tma``."""
    return compile_for(
        cls(plan),
        fake_pointer(BFloat16),
        fake_pointer(BFloat16),
        fake_pointer(BFloat16),
        fake_pointer(Float32),
        fake_pointer(Int32, 4),
        fake_pointer(Int64, 8),
        fake_pointer(Int32, 4),
        Int32(0),
        Int32(2),
        Int64(plan.max_rows * plan.n),
        Int32(1),
        Int32(plan.k),
        Int32(plan.n),
        cute.runtime.make_fake_stream(),
        arch=arch,
        options=options,
    )
