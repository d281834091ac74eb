"""The weight-streaming GEMM for a few rows, split over K: ``out[b, N] = x[b, K] @
W[N, K]^T``, b <= ``max_rows`` (a handful), in the CuTe DSL. Imports no torch: the
kernels compile (``compile_splitk``) from fake pointers on a machine without a GPU.

The second form of gemv.py's kernel, laid out for the copy bandwidth:

- a CTA owns a tile of ``8 * rows`` weight rows by a ``chunk`` of K, and the grid
  (tiles x ``splits``) is chosen for the SM count (``plan_splitk``): every SM gets
  the same number of equal tiles where the shape allows, in as few waves as it can;
- the CTA stages its chunk of x once in shared memory, as fp32 (rows past b repeat
  row b - 1), and every weight row of the tile reuses it: a lane holds one step's x
  (max_rows x 8 values) in registers across its ``rows`` weight rows;
- lane (g, t) of a warp reads rows g, g + 8, ... of the tile, the 16-byte vectors
  ``t + 4 * warp + 32 * step`` of the chunk (each row's 512 contiguous bytes per step
  over the CTA), ``depth`` steps a batch, in two register buffers: a buffer is
  refilled with the batch after next as soon as it is multiplied;
- the first two batches are issued before ``griddepcontrol.wait`` (PDL): the weight
  is constant for the step, x (which the kernel before may write) is staged after it;
- every product accumulates in fp32; the four lanes of a row are summed by
  butterfly shuffles, the warps in index order through shared memory; with
  ``splits`` > 1 the CTA writes its fp32 sums to a workspace and the last CTA of the
  tile to arrive (an atomic counter per tile, set back to 0 by that CTA for the next
  launch) adds the splits in split order and rounds once into the output. Results
  are identical from run to run.

bf16 weights take bf16 x and write bf16; the fp32 router takes bf16 x (exact in
fp32) and writes fp32. b is a runtime argument: rows past b are never stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .gemv import VECTOR_BYTES, compile_fake, fake_pointer, operands_reason

WARPS = 8  # per CTA, all along K
ROW_LANES = 8  # lanes of a warp on distinct rows; the other 4 split K
K_LANES = 4
MAX_ROWS_PER_LANE = 9  # Muse Spark's TP8-rank qkvg (2304 = 9 x 256) in one wave
MAX_BATCH_LOADS = 8  # 16-byte weight vectors of one register buffer (two are in flight)
MAX_CHUNK_BYTES = 128 * 1024  # x's chunk in shared memory (fp32, max_rows rows)
H200_SMS = 132
MIN_BALANCE = 0.9  # mean / most CTAs per SM taken before fewer waves
CTA_RESERVED_BYTES = 1024  # the system's share of each CTA's shared memory
# A traced kernel's record a CTA (``SplitKKernel.trace``): int32 words of its SM and one
# unused, then %globaltimer (ns, low and high words) at its start, after its PDL wait, at
# its end, and (SplitKGemv only; else 0) once x is staged and once thread 0 has its products.
TRACE_WORDS = 12


class SplitGrid:
    """The grid of a split-K plan (a dataclass of ``n``, ``k``, ``splits``, and
    ``tile_rows`` and ``cols``): ``tiles`` of ``tile_rows`` weight rows by ``splits``
    chunks of K, a CTA of ``threads`` each, the output's ``cols`` rows of x in the
    workspace between the splits."""

    @property
    def tiles(self) -> int:
        return self.n // self.tile_rows

    @property
    def chunk(self) -> int:
        return self.k // self.splits

    @property
    def ctas(self) -> int:
        return self.tiles * self.splits

    @property
    def threads(self) -> int:
        return 32 * WARPS

    @property
    def workspace(self) -> int:
        """fp32 elements of the split-K workspace (0 without a split)."""
        return 0 if self.splits == 1 else self.splits * self.n * self.cols


@dataclass(frozen=True)
class SplitKPlan(SplitGrid):
    """The compile-time shape of one kernel: W [n, k] (row stride ``w_stride``) of
    ``weight_fp32`` (else bf16), up to ``max_rows`` rows of x, and the tiling."""

    n: int
    k: int
    w_stride: int
    weight_fp32: bool
    max_rows: int
    rows: int  # weight rows per lane; a tile has ROW_LANES * rows
    splits: int  # K chunks, one CTA each
    depth: int  # steps per register batch

    @property
    def vector(self) -> int:
        """Elements per 16-byte weight vector (8 bf16, 4 fp32)."""
        return VECTOR_BYTES // (4 if self.weight_fp32 else 2)

    @property
    def tile_rows(self) -> int:
        return ROW_LANES * self.rows

    @property
    def steps(self) -> int:
        """Weight vectors of one row per lane over the chunk."""
        return self.chunk // (self.vector * K_LANES * WARPS)

    @property
    def batches(self) -> int:
        return self.steps // self.depth

    @property
    def cols(self) -> int:
        return self.max_rows

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA as the kernel allocates it: x's chunk (fp32), the
        warps' sums, and the split-K flag."""
        return self.max_rows * self.chunk * 4 + WARPS * self.tile_rows * self.cols * 4 + (4 if self.splits > 1 else 0)


def tiling_reason(n: int, k: int, vector: int, max_rows: int, w_stride: int, k_step: int, n_step: int) -> str | None:
    """Why a split-K GEMV of ``k_step``-wide K steps and ``n_step``-row tiles does
    not take W [n, k] (rows ``w_stride`` apart) or ``max_rows`` rows of x, if so."""
    reason = operands_reason(k, vector, max_rows, w_stride)
    if reason:
        return reason
    if k % k_step:
        return f"K {k} is not a multiple of {k_step}"
    if n % n_step:
        return f"N {n} is not a multiple of {n_step}"
    return None


def split_counts(k: int, k_step: int, x_bytes: int, max_chunk_bytes: int) -> list[int]:
    """The splits of K (powers of two up to 2048) into chunks of whole ``k_step``s
    whose x in shared memory (``x_bytes`` per k) fits ``max_chunk_bytes``."""
    splits = (1 << s for s in range(12))
    return [s for s in splits if not k % (s * k_step) and x_bytes * (k // s) <= max_chunk_bytes]


def wave_key(ctas: int, sms: int, resident: int = 1) -> tuple[bool, int, float]:
    """The split-K planners' first ranking keys for ``ctas`` CTAs on ``sms`` SMs of
    ``resident`` CTAs at once: balanced grids first (mean / most CTAs per SM at
    least ``MIN_BALANCE``), then the fewest waves, then the best balance."""
    per_sm = math.ceil(ctas / sms)
    balance = round(ctas / sms / per_sm, 2)
    return (balance < MIN_BALANCE, math.ceil(per_sm / resident), -balance)


def best_first(ranked: list[tuple[tuple, Any]]) -> list[Any]:
    """The plans of (key, plan) pairs by key, smallest first (ties in their order)."""
    return [plan for _, plan in sorted(ranked, key=lambda r: r[0])]


def first_plan(plans: list[Any] | str) -> Any:
    """The first of a planner's plans, or its reason."""
    return plans if isinstance(plans, str) else plans[0]


def plan_splitk(
    n: int, k: int, weight_fp32: bool, max_rows: int, w_stride: int | None = None, sms: int = H200_SMS
) -> SplitKPlan | str:
    """The tiling for W [n, k] (rows ``w_stride`` apart, default k) on ``sms`` SMs
    (the first of ``splitk_plans``), or why the kernel does not take the shape."""
    return first_plan(splitk_plans(n, k, weight_fp32, max_rows, w_stride, sms))


def splitk_plans(
    n: int, k: int, weight_fp32: bool, max_rows: int, w_stride: int | None = None, sms: int = H200_SMS
) -> list[SplitKPlan] | str:
    """Every tiling of W [n, k] whose chunk of x fits ``MAX_CHUNK_BYTES``, best
    first: those balanced over the SMs (mean / most CTAs per SM at least
    ``MIN_BALANCE``), then the fewest waves (one CTA per SM), the best balance, the
    fewest splits, the fewest rows per lane; or why the kernel does not take the
    shape."""
    vector = VECTOR_BYTES // (4 if weight_fp32 else 2)
    w_stride = k if w_stride is None else w_stride
    step = vector * K_LANES * WARPS
    reason = tiling_reason(n, k, vector, max_rows, w_stride, step, ROW_LANES)
    if reason:
        return reason
    ranked = []
    for rows in range(1, MAX_ROWS_PER_LANE + 1):
        if n % (ROW_LANES * rows):
            continue
        for splits in split_counts(k, step, max_rows * 4, MAX_CHUNK_BYTES):
            ctas = n // (ROW_LANES * rows) * splits
            steps = k // splits // step
            depth = max(d for d in range(1, steps + 1) if steps % d == 0 and (d == 1 or rows * d <= MAX_BATCH_LOADS))
            key = (*wave_key(ctas, sms), splits, rows)
            ranked.append((key, SplitKPlan(n, k, w_stride, weight_fp32, max_rows, rows, splits, depth)))
    if not ranked:
        return f"K {k}: x's chunk of {max_rows} rows does not fit {MAX_CHUNK_BYTES} bytes of shared memory"
    return best_first(ranked)


def beside_plans(
    n: int, k: int, weight_fp32: bool, max_rows: int, room: int, w_stride: int | None = None, sms: int = H200_SMS
) -> list[SplitKPlan]:
    """The plans of ``splitk_plans`` (best first) whose CTAs are one an SM and take at
    most ``room`` bytes of an SM's shared memory (the system's share of a CTA included):
    kernels whose every CTA fits on an SM beside one CTA of another that leaves ``room``."""
    plans = splitk_plans(n, k, weight_fp32, max_rows, w_stride, sms)
    if isinstance(plans, str):
        return []
    return [p for p in plans if p.ctas <= sms and p.smem_bytes + CTA_RESERVED_BYTES <= room]


def trace_offset(tiles: int) -> int:
    """Where a traced kernel's records start in its counters (int32 elements): past the
    ``tiles`` tile counters, 32-byte aligned."""
    return (tiles + 7) // 8 * 8


def trace_counters(plan: Any) -> int:
    """The int32 counters a traced launch of ``plan`` takes: the tiles' and a record a CTA."""
    return trace_offset(plan.tiles) + TRACE_WORDS * plan.ctas


class SplitKKernel:
    """The host side of the split-K GEMVs (this module's, gemv_mma's, gemv_tma's):
    ``__call__(w, x, out, workspace, counters, b, x_stride, out_stride, stream)`` on
    pointers launches ``kernel`` with the same arguments (but the stream) on
    ``plan.ctas`` CTAs of ``plan.threads`` threads, with PDL; ``finish`` ends a CTA
    by ``finish_tile``. A subclass sets ``plan`` and defines ``kernel``.

    With ``trace`` (a subclass's, for scripts/beside-trace; no registered kernel sets it)
    the kernel also writes each CTA's record into ``counters`` past the tile counters
    (``trace_offset``; ``trace_counters`` in all): the kernel's ``mark`` calls at its
    start, after its PDL wait and at its end compile to nothing without it."""

    plan: Any
    weight_dtype: Any = BFloat16
    out_dtype: Any = BFloat16
    trace = False
    # Launched with PDL (programmatic stream serialization), as every registered kernel;
    # a subclass turns it off (scripts/beside-trace's ``nopdl`` form), so that the launch
    # waits for the whole of the work before it and the kernel's PDL wait does nothing.
    pdl = True

    def launch_options(self) -> dict[str, Any]:
        """The launch's options past its grid, block and stream: PDL (``pdl``)."""
        return {"use_pdl": self.pdl}

    @cute.jit
    def mark(self, counters: cute.Pointer, slot: cutlass.Constexpr):
        """Thread 0's record of its CTA in a traced kernel: at ``slot`` 0 the SM and the
        time, at 1 to 4 the time (``TRACE_WORDS``)."""
        if cutlass.const_expr(self.trace):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            if tidx == 0:
                p = self.plan
                records = cute.make_tensor(counters, cute.make_layout((trace_counters(p),)))
                base = trace_offset(p.tiles) + bidx * TRACE_WORDS
                now = cute.arch.globaltimer()
                if cutlass.const_expr(slot == 0):
                    records[base] = cute.arch.smid()
                records[base + 2 + 2 * slot] = Int32(now & 0xFFFFFFFF)
                records[base + 3 + 2 * slot] = Int32(now >> 32)

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
        self.kernel(w, x, out, workspace, counters, b, x_stride, out_stride).launch(
            grid=[p.ctas, 1, 1], block=[p.threads, 1, 1], stream=stream, **self.launch_options()
        )

    def finish(self, smem, partial, out, workspace, counters, b, out_stride, tile, split, store=None):
        """``finish_tile`` of the CTA's tile and split: ``partial`` [WARPS, tile_rows
        * plan.cols] into ``out``, in ``out_dtype``; ``store`` in place of
        ``store_elements`` where given."""
        p = self.plan
        finish_tile(
            smem,
            partial,
            out,
            workspace,
            counters,
            b,
            out_stride,
            tile,
            split,
            p.n,
            p.tile_rows,
            p.cols,
            p.splits,
            p.tiles,
            self.out_dtype,
            store_elements if store is None else store,
        )


class SplitKGemv(SplitKKernel):
    """One compiled shape: ``__call__(w, x, out, workspace, counters, b, x_stride,
    out_stride, stream)`` on pointers (W [n, k] with contiguous rows; x and out rows
    contiguous, row strides in elements, x's a multiple of the vector; pointers
    16-byte aligned; ``workspace`` fp32 of ``plan.workspace`` elements and
    ``counters`` int32 of ``plan.tiles``, zero before the first launch, both
    unused without a split)."""

    # x's chunk staged with all of a thread's global loads issued before its shared
    # stores (``XFirstSplitKGemv``); else a load and its stores at a time, which ptxas
    # schedules as three dependent L2 round trips at the router's planner plan (8 loads a
    # thread) with the weight's 16 vectors a thread held in registers.
    x_loads_first = False

    def __init__(self, plan: SplitKPlan):
        self.plan = plan
        self.weight_dtype = Float32 if plan.weight_fp32 else BFloat16
        self.out_dtype = self.weight_dtype

    def load(self, mW, buffer, batch, row, vector):
        """Batch ``batch`` of the lane's weight vectors (rows ``row + 8 r``, the
        chunk's vectors ``vector + 32 step``) into the register ``buffer``."""
        p = self.plan
        for d in range(p.depth):
            kv = vector + (batch * p.depth + d) * (K_LANES * WARPS)
            for r in range(p.rows):
                tile = cute.local_tile(mW, (1, p.vector), (row + ROW_LANES * r, kv))
                buffer[r * p.depth + d].store(tile.load())

    def multiply(self, sX, acc, buffer, batch, vector):
        """``acc[r, i] += w[r] . x[i]`` over batch ``batch``: a step's x (max_rows
        vectors of fp32) held across the lane's rows."""
        p = self.plan
        V, B = p.vector, p.max_rows
        for d in range(p.depth):
            kv = vector + (batch * p.depth + d) * (K_LANES * WARPS)
            xv = [cute.local_tile(sX, (1, V), (i, kv)).load() for i in range(B)]
            for r in range(p.rows):
                wv = buffer[r * p.depth + d].load().to(Float32)
                for i in range(B):
                    total = acc[r * B + i]
                    for e in range(V):
                        total = total + wv[e] * xv[i][e]
                    acc[r * B + i] = total

    @cute.kernel
    def kernel(
        self,
        w: cute.Pointer,
        x: cute.Pointer,
        out: cute.Pointer,
        workspace: cute.Pointer,
        counters: cute.Pointer,
        b: Int32,
        x_stride: Int32,
        out_stride: Int32,
    ):
        p = self.plan
        V, R, D, B, TN, TK = p.vector, p.rows, p.depth, p.max_rows, p.tile_rows, p.chunk
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        g = lane // K_LANES
        t = lane - g * K_LANES
        tile = bidx // p.splits
        split = bidx - tile * p.splits
        n0 = tile * TN
        chunk0 = split * (TK // V)  # the chunk's first vector
        lane_vector = warp * K_LANES + t  # of each step's K_LANES * WARPS

        self.mark(counters, 0)
        mW = cute.make_tensor(w, cute.make_layout((p.n, p.k), stride=(p.w_stride, 1)))
        buffers = [[cute.make_rmem_tensor((V,), self.weight_dtype) for _ in range(R * D)] for _ in range(2)]

        # The weight first: constant for the step, so read before the wait.
        w_row, w_vector = n0 + g, chunk0 + lane_vector
        self.load(mW, buffers[0], 0, w_row, w_vector)
        if cutlass.const_expr(p.batches > 1):
            self.load(mW, buffers[1], 1, w_row, w_vector)
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        self.mark(counters, 1)

        # x's chunk, fp32, in shared memory; rows past b repeat row b - 1.
        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(Float32, cute.make_layout((B, TK), stride=(TK, 1)), 16)
        xs = cute.assume(x_stride, divby=8)
        mX = cute.make_tensor(x, cute.make_layout((B, p.k), stride=(xs, 1)))
        x_vectors = TK // 8
        stage_x(mX, sX, b, split * x_vectors, B, x_vectors, self.x_loads_first, Float32)
        cute.arch.sync_threads()
        self.mark(counters, 3)

        acc = cute.make_rmem_tensor((R * B,), Float32)
        acc.fill(0.0)

        # Two batches in flight: each buffer is refilled as soon as it is multiplied.
        for pair in cutlass.range(p.batches // 2, unroll=1):
            batch = pair * 2
            self.multiply(sX, acc, buffers[0], batch, lane_vector)
            if batch + 2 < p.batches:
                self.load(mW, buffers[0], batch + 2, w_row, w_vector)
            self.multiply(sX, acc, buffers[1], batch + 1, lane_vector)
            if batch + 3 < p.batches:
                self.load(mW, buffers[1], batch + 3, w_row, w_vector)
        if p.batches % 2 == 1:
            self.multiply(sX, acc, buffers[0], p.batches - 1, lane_vector)
        self.mark(counters, 4)

        # The four K lanes of a row, then the warps in index order.
        partial = smem.allocate_tensor(Float32, cute.make_layout((WARPS, TN * B), stride=(TN * B, 1)), 16)
        for r in cutlass.range_constexpr(R):
            for i in cutlass.range_constexpr(B):
                lanes = acc[r * B + i]
                lanes = lanes + cute.arch.shuffle_sync_bfly(lanes, offset=1)
                lanes = lanes + cute.arch.shuffle_sync_bfly(lanes, offset=2)
                if t == i % K_LANES:
                    partial[warp, (g + ROW_LANES * r) * B + i] = lanes
        cute.arch.sync_threads()

        self.finish(smem, partial, out, workspace, counters, b, out_stride, tile, split)
        self.mark(counters, 2)


def warp_sum(partial: cute.Tensor, q) -> Float32:
    """Tile element ``q`` of ``partial`` (fp32 [WARPS, ...]) summed over the warps in
    index order, from 0.0."""
    total = Float32(0.0)
    for wi in range(WARPS):
        total = total + partial[wi, q]
    return total


def split_sum(mWs: cute.Tensor, base, splits: int, q) -> Float32:
    """Element ``base + q`` of the workspace (fp32 [splits, ...]) summed over the
    splits in split order, from 0.0."""
    total = Float32(0.0)
    for s in range(splits):
        total = total + mWs[s, base + q]
    return total


@cute.jit
def stage_x(
    mX: cute.Tensor,
    sX: cute.Tensor,
    b: Int32,
    first: Int32,
    rows: cutlass.Constexpr,
    x_vectors: cutlass.Constexpr,
    loads_first: cutlass.Constexpr,
    dtype: cutlass.Constexpr,
):
    """A CTA's chunk of x into shared memory: ``rows`` rows of ``x_vectors`` 8-element
    vectors, from vector ``first`` of each row of ``mX``, rows past b repeating row
    b - 1, stored in ``sX`` as ``dtype`` (None: as loaded); vector q = tidx, tidx +
    threads, ... a thread. ``loads_first``: every load of the thread issued, then a CTA
    barrier, then its stores (ptxas issues no load after a barrier it was before, and left
    to itself it waits for each load's value before issuing the next loads); else a load
    and its store at a time."""
    tidx, _, _ = cute.arch.thread_idx()
    threads = 32 * WARPS
    total = rows * x_vectors
    rounds = (total + threads - 1) // threads
    if cutlass.const_expr(loads_first):
        staged = []
        for it in cutlass.range_constexpr(rounds):
            q = it * threads + tidx
            if cutlass.const_expr(total % threads):  # the last round's spare threads: a valid vector
                q = cutlass.min(q, total - 1)
            xr = q // x_vectors
            xk = q - xr * x_vectors
            staged.append(cute.local_tile(mX, (1, 8), (cutlass.min(xr, b - 1), first + xk)).load())
        cute.arch.sync_threads()
        for it in cutlass.range_constexpr(rounds):
            q = it * threads + tidx
            if q < total:
                xr = q // x_vectors
                xv = staged[it] if cutlass.const_expr(dtype is None) else staged[it].to(dtype)
                cute.local_tile(sX, (1, 8), (xr, q - xr * x_vectors)).store(xv)
    else:
        for it in cutlass.range_constexpr(rounds):
            q = it * threads + tidx
            if q < total:
                xr = q // x_vectors
                xk = q - xr * x_vectors
                x_row = cutlass.min(xr, b - 1)
                xv = cute.local_tile(mX, (1, 8), (x_row, first + xk)).load()
                if cutlass.const_expr(dtype is not None):
                    xv = xv.to(dtype)
                cute.local_tile(sX, (1, 8), (xr, xk)).store(xv)


@cute.jit
def store_elements(
    mO: cute.Tensor,
    total: cutlass.Constexpr,
    b: Int32,
    n0: Int32,
    tile_rows: cutlass.Constexpr,
    cols: cutlass.Constexpr,
    out_dtype: cutlass.Constexpr,
):
    """``finish_tile``'s output stage: each thread rounds tile elements q = tidx,
    tidx + threads, ... ((row, i) = divmod(q, cols); ``total(q)`` their fp32 sums)
    into ``mO[i, n0 + row]`` (``cols`` rows of n) for i < b, one value a thread."""
    tidx, _, _ = cute.arch.thread_idx()
    threads = 32 * WARPS
    for u in cutlass.range_constexpr((tile_rows * cols + threads - 1) // threads):
        q = u * threads + tidx
        row = q // cols
        i = q - row * cols
        if q < tile_rows * cols and i < b:
            mO[i, n0 + row] = total(q).to(out_dtype)


@cute.jit
def finish_tile(
    smem: cutlass.Constexpr,
    partial: cute.Tensor,
    out: cute.Pointer,
    workspace: cute.Pointer,
    counters: cute.Pointer,
    b: Int32,
    out_stride: Int32,
    tile: Int32,
    split: Int32,
    n: cutlass.Constexpr,
    tile_rows: cutlass.Constexpr,
    cols: cutlass.Constexpr,
    splits: cutlass.Constexpr,
    tiles: cutlass.Constexpr,
    out_dtype: cutlass.Constexpr,
    store: cutlass.Constexpr = store_elements,
):
    """The end of a CTA of the split-K GEMVs: ``partial`` (shared, fp32 [WARPS,
    tile_rows * cols], (row, i) = divmod(q, cols) of the tile) summed over the warps
    in index order into rows < b of ``out`` (``cols`` rows of n, ``out_stride``
    apart); with ``splits`` > 1 through the workspace (fp32 [splits, n * cols]),
    the tile's last CTA to arrive (its counter, back at 0 for the next launch)
    adding the splits in split order; one rounding into ``out_dtype``. ``store``
    (``store_elements``'s signature) writes the sums: only the CTA that ends the
    tile calls it, every thread of it."""
    tidx, _, _ = cute.arch.thread_idx()
    threads = 32 * WARPS
    n0 = tile * tile_rows
    mO = cute.make_tensor(out, cute.make_layout((cols, n), stride=(out_stride, 1)))
    rounds = (tile_rows * cols + threads - 1) // threads
    if cutlass.const_expr(splits == 1):
        store(mO, partial_sums(partial), b, n0, tile_rows, cols, out_dtype)
    else:
        mWs = cute.make_tensor(workspace, cute.make_layout((splits, n * cols), stride=(n * cols, 1)))
        mC = cute.make_tensor(counters, cute.make_layout((tiles,)))
        for u in cutlass.range_constexpr(rounds):
            q = u * threads + tidx
            if q < tile_rows * cols:
                mWs[split, n0 * cols + q] = warp_sum(partial, q)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        last = smem.allocate_tensor(Int32, cute.make_layout((1,)), 4)
        if tidx == 0:
            last[0] = cute.arch.atomic_add(mC.iterator + tile, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.sync_threads()
        if last[0] == splits - 1:
            cute.arch.fence_acq_rel_gpu()
            if tidx == 0:
                mC[tile] = Int32(0)  # for the next launch
            store(mO, workspace_sums(mWs, n0 * cols, splits), b, n0, tile_rows, cols, out_dtype)


def partial_sums(partial: cute.Tensor):
    """``total(q)`` for ``store``: ``warp_sum`` of ``partial``."""
    return lambda q: warp_sum(partial, q)


def workspace_sums(mWs: cute.Tensor, base, splits: int):
    """``total(q)`` for ``store``: ``split_sum`` of the tile's workspace."""
    return lambda q: split_sum(mWs, base, splits, q)


def formed(cls: type[SplitKKernel], pdl: bool = True) -> type[SplitKKernel]:
    """``cls`` launched with PDL or not. (A carveout is the driver's kernel attribute, set
    once the kernel is loaded: ``common.set_carveout``; the DSL 4.8.1's
    ``preferred_smem_carveout`` launch option does not reach the loaded library.)"""
    if pdl:
        return cls
    return type(f"Formed{cls.__name__}", (cls,), {"pdl": pdl})


def compile_split(gemv: SplitKKernel, arch: str | None = None, options: str = ""):
    """``gemv`` compiled on fake pointers (``compile_fake``; the workspace and
    counters after out) for ``arch``, with further ``options``."""
    return compile_fake(gemv, fake_pointer(Float32), fake_pointer(Int32, 4), arch=arch, options=options)


def compile_splitk(plan: SplitKPlan, arch: str | None = None, cls: type[SplitKGemv] | None = None):
    """The compiled kernel of ``plan`` (as ``cls``, by default ``SplitKGemv``) for
    ``arch`` (e.g. ``sm_90a``; by default ``CUTE_DSL_ARCH`` or the GPU's)."""
    return compile_split((SplitKGemv if cls is None else cls)(plan), arch)


class XFirstSplitKGemv(SplitKGemv):
    """``SplitKGemv`` with x's chunk staged all loads first (``x_loads_first``): the same
    values in the same places, so the same bits."""

    x_loads_first = True


class TracedSplitKGemv(SplitKGemv):
    """``SplitKGemv`` writing each CTA's record (``SplitKKernel.trace``)."""

    trace = True


class TracedXFirstSplitKGemv(TracedSplitKGemv):
    """``XFirstSplitKGemv`` writing each CTA's record."""

    x_loads_first = True
