"""The weight-streaming GEMM for a few rows on the tensor cores: ``out[b, N] = x[b,
K] @ W[N, K]^T``, b <= ``max_rows`` <= 8, bf16 W and x, in the CuTe DSL. Imports no
torch: the kernels compile (``compile_mma``) from fake pointers on a machine without
a GPU.

gemv_splitk.py's stream with the products on ``mma.sync.m16n8k16`` (bf16 in, fp32
accumulate) in place of 8 fp32 FMAs per weight element, which bound the CUDA-core
GEMV by instruction issue rather than by the copy bandwidth:

- the MMA's A is 16 weight rows, B is x^T (the 8 rows of x as its 8 columns, rows
  past b repeating row b - 1), C the 16 x 8 fp32 sums;
- a CTA owns a tile of ``16 * groups`` weight rows by a ``chunk`` of K; the grid
  (tiles x ``splits``) is chosen for the SM count as gemv_splitk's (``mma_plans``);
- lane (g, t) of a warp reads 16 bytes (8 consecutive k) of rows g and g + 8 of each
  16-row group at the chunk's 16-byte vector ``t + 4 * warp + 32 * step``: the A
  fragments of two MMAs, the K order permuted within the MMA's 16 k (MMA j takes the
  elements 4j .. 4j + 3 of each lane's 8 as its k 2t, 2t + 1, 2t + 8, 2t + 9); B is
  read with the same permutation (lane (g, t) holds x row g at the same 8 k), so the
  sum covers each k once. ``depth`` steps a register batch, two batches in flight,
  the first two issued before ``griddepcontrol.wait`` (PDL);
- the CTA stages its chunk of x (bf16, 8 rows) once in shared memory after the wait,
  laid out per 32 k as [8 rows][32 k] so that the warp's B reads (row g, 16 bytes
  at 16t) are 512 contiguous bytes;
- the warps' fp32 sums are added in index order through shared memory; with
  ``splits`` > 1 the CTA writes them to a workspace and the last CTA of the tile to
  arrive adds the splits in split order (gemv_splitk's counters), rounding once into
  bf16. Results are identical from run to run.

b is a runtime argument: rows past b are never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .gemv import VECTOR_BYTES
from .gemv_splitk import (
    H200_SMS,
    WARPS,
    SplitGrid,
    SplitKKernel,
    best_first,
    compile_split,
    first_plan,
    split_counts,
    tiling_reason,
    wave_key,
)

VECTOR = VECTOR_BYTES // 2  # bf16 elements per 16-byte load
MMA_M, MMA_N, MMA_K = 16, 8, 16
K_LANES = 4  # lanes of a warp along K (t); the other 8 (g) take rows g and g + 8
STEP = VECTOR * K_LANES * WARPS  # k of one step of the CTA: 256
X_STEP = MMA_N * K_LANES * WARPS  # staged x vectors of one step (8 rows of 32 k per warp)
MAX_GROUPS = 4  # 16-row groups per tile
MAX_BATCH_LOADS = 8  # 16-byte weight vectors of one register batch (two are in flight)
MAX_CHUNK_BYTES = 64 * 1024  # x's chunk in shared memory (bf16, 8 rows)


@dataclass(frozen=True)
class MmaPlan(SplitGrid):
    """The compile-time shape of one kernel: bf16 W [n, k] (row stride
    ``w_stride``), up to ``max_rows`` rows of x, and the tiling."""

    n: int
    k: int
    w_stride: int
    max_rows: int
    groups: int  # 16-row groups per tile
    splits: int  # K chunks, one CTA each
    depth: int  # steps per register batch

    @property
    def tile_rows(self) -> int:
        return MMA_M * self.groups

    @property
    def steps(self) -> int:
        """16-byte vectors of one row per lane over the chunk."""
        return self.chunk // STEP

    @property
    def batches(self) -> int:
        return self.steps // self.depth

    @property
    def cols(self) -> int:
        """Rows of x the tile sums (the MMA's N; those past b are never stored)."""
        return MMA_N


def plan_mma(n: int, k: int, max_rows: int, w_stride: int | None = None, sms: int = H200_SMS) -> MmaPlan | str:
    """The tiling for bf16 W [n, k] (rows ``w_stride`` apart, default k) on ``sms``
    SMs (the first of ``mma_plans``), or why the kernel does not take the shape."""
    return first_plan(mma_plans(n, k, max_rows, w_stride, sms))


def mma_plans(n: int, k: int, max_rows: int, w_stride: int | None = None, sms: int = H200_SMS) -> list[MmaPlan] | str:
    """Every tiling of W [n, k] whose chunk of x fits ``MAX_CHUNK_BYTES``, best
    first: those balanced over the SMs (mean / most CTAs per SM at least
    ``MIN_BALANCE``), then the fewest waves (one CTA per SM), the best balance, the
    fewest splits, the most groups per tile (x read once for more rows); or why the
    kernel does not take the shape."""
    w_stride = k if w_stride is None else w_stride
    reason = tiling_reason(n, k, VECTOR, max_rows, w_stride, STEP, MMA_M)
    if reason:
        return reason
    ranked = []
    for groups in range(1, MAX_GROUPS + 1):
        if n % (MMA_M * groups):
            continue
        for splits in split_counts(k, STEP, MMA_N * 2, MAX_CHUNK_BYTES):
            ctas = n // (MMA_M * groups) * splits
            steps = k // splits // STEP
            depth = max(d for d in range(1, steps + 1) if steps % d == 0 and 2 * groups * d <= MAX_BATCH_LOADS)
            key = (*wave_key(ctas, sms), splits, -groups)
            ranked.append((key, MmaPlan(n, k, w_stride, max_rows, groups, splits, depth)))
    if not ranked:
        return f"K {k}: x's chunk of {MMA_N} rows does not fit {MAX_CHUNK_BYTES} bytes of shared memory"
    return best_first(ranked)


def load_half(pair: cute.Tensor, h: int, vector: cute.Tensor) -> None:
    """Half ``h`` of a lane's A ``pair`` (h 0: row g, 1: row g + 8) = the 16-byte
    ``vector`` of that row."""
    cute.local_tile(pair, (VECTOR,), (h,)).store(vector.load())


def mma_vector(atom, acc: cute.Tensor, pair: cute.Tensor, xv: cute.Tensor) -> None:
    """``acc += A B`` over one 16-byte vector a lane (two MMAs of 16 k): ``pair``
    the lane's 8 k of rows g and g + 8 (A), ``xv`` its same 8 k of x row g (B)."""
    # A of MMA j: elements 4j + (0, 1) of row g, of row g + 8, then 4j + (2, 3) of each.
    a_layout = cute.make_layout(((2, 2, 2), 1, 1), stride=((1, VECTOR, 2), 0, 0))
    b_layout = cute.make_layout(((2, 2), 1, 1), stride=((1, 2), 0, 0))
    for j in range(2):
        a = cute.make_tensor(pair.iterator + 4 * j, a_layout)
        bx = cute.make_tensor(xv.iterator + 4 * j, b_layout)
        cute.gemm(atom, acc, a, bx, acc)


class MmaGemv(SplitKKernel):
    """One compiled shape: ``__call__(w, x, out, workspace, counters, b, x_stride,
    out_stride, stream)`` on pointers, as gemv_splitk's ``SplitKGemv`` (W [n, k]
    bf16 with contiguous rows; x and out bf16 rows contiguous, row strides in
    elements, x's a multiple of 8; ``workspace`` fp32 of ``plan.workspace`` elements
    and ``counters`` int32 of ``plan.tiles``, zero before the first launch, both
    unused without a split)."""

    def __init__(self, plan: MmaPlan):
        self.plan = plan
        self.mma = cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (MMA_M, MMA_N, MMA_K))

    def load(self, mW, buffer, batch, row, vector):
        """Batch ``batch`` of the lane's weight vectors into the register ``buffer``:
        for each step and group, rows ``row + 16 m`` and ``row + 16 m + 8`` (the
        halves of one 16-element register tensor), the chunk's vector ``vector + 32
        step``."""
        p = self.plan
        for d in range(p.depth):
            kv = vector + (batch * p.depth + d) * (K_LANES * WARPS)
            for m in range(p.groups):
                pair = buffer[d * p.groups + m]
                for h in range(2):
                    load_half(pair, h, cute.local_tile(mW, (1, VECTOR), (row + MMA_M * m + 8 * h, kv)))

    def multiply(self, atom, sX, acc, buffer, batch, x_vector):
        """``acc[m] += A[m] B`` over batch ``batch``: per step, the lane's 8 k of x
        row g (``x_vector`` of the staged chunk) against each group's two rows."""
        p = self.plan
        xv = cute.make_rmem_tensor((VECTOR,), BFloat16)
        for d in range(p.depth):
            kv = x_vector + (batch * p.depth + d) * X_STEP
            xv.store(cute.local_tile(sX, (VECTOR,), (kv,)).load())
            for m in range(p.groups):
                mma_vector(atom, acc[m], buffer[d * p.groups + m], xv)

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
        G, B, TN, TK = p.groups, p.max_rows, p.tile_rows, p.chunk
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        g = lane // K_LANES
        t = lane - g * K_LANES
        tile = bidx // p.splits
        split = bidx - tile * p.splits
        n0 = tile * TN
        x_vectors = TK // VECTOR
        lane_vector = warp * K_LANES + t  # of each step's K_LANES * WARPS
        atom = cute.make_mma_atom(self.mma)

        mW = cute.make_tensor(w, cute.make_layout((p.n, p.k), stride=(p.w_stride, 1)))
        buffers = [[cute.make_rmem_tensor((2 * VECTOR,), BFloat16) for _ in range(G * p.depth)] for _ in range(2)]

        # The weight first: constant for the step, so read before the wait.
        w_row, w_vector = n0 + g, split * x_vectors + lane_vector
        self.load(mW, buffers[0], 0, w_row, w_vector)
        if cutlass.const_expr(p.batches > 1):
            self.load(mW, buffers[1], 1, w_row, w_vector)
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()

        # x's chunk, bf16, in shared memory: vector (i, kv) at (kv // 4, i, kv % 4),
        # so that thread q stores vector q of that order; rows past b repeat row b - 1.
        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(BFloat16, cute.make_layout((MMA_N * TK,)), 16)
        xs = cute.assume(x_stride, divby=VECTOR)
        mX = cute.make_tensor(x, cute.make_layout((B, p.k), stride=(xs, 1)))
        for it in cutlass.range_constexpr((MMA_N * x_vectors + p.threads - 1) // p.threads):
            q = it * p.threads + tidx
            if q < MMA_N * x_vectors:
                block = q // (MMA_N * K_LANES)
                i = (q // K_LANES) % MMA_N
                kv = block * K_LANES + q % K_LANES
                x_row = cutlass.min(i, b - 1)
                xv = cute.local_tile(mX, (1, VECTOR), (x_row, split * x_vectors + kv)).load()
                cute.local_tile(sX, (VECTOR,), (q,)).store(xv)
        cute.arch.sync_threads()

        acc = [cute.make_rmem_tensor(((2, 2), 1, 1), Float32) for _ in range(G)]
        for m in cutlass.range_constexpr(G):
            acc[m].fill(0.0)
        # Lane (g, t)'s vector of a step in the staged order: block warp, row g, t.
        x_vector = (warp * MMA_N + g) * K_LANES + t

        # Two batches in flight: each buffer is refilled as soon as it is multiplied.
        for pair in cutlass.range(p.batches // 2, unroll=1):
            batch = pair * 2
            self.multiply(atom, sX, acc, buffers[0], batch, x_vector)
            if batch + 2 < p.batches:
                self.load(mW, buffers[0], batch + 2, w_row, w_vector)
            self.multiply(atom, sX, acc, buffers[1], batch + 1, x_vector)
            if batch + 3 < p.batches:
                self.load(mW, buffers[1], batch + 3, w_row, w_vector)
        if p.batches % 2 == 1:
            self.multiply(atom, sX, acc, buffers[0], p.batches - 1, x_vector)

        # C of group m: (row 16m + g + 8h, x row 2t + e) at acc[m][e + 2h]; the warps
        # in index order. partial[warp, row * 8 + i].
        partial = smem.allocate_tensor(Float32, cute.make_layout((WARPS, TN * MMA_N), stride=(TN * MMA_N, 1)), 16)
        for m in cutlass.range_constexpr(G):
            for h in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    partial[warp, (MMA_M * m + g + 8 * h) * MMA_N + 2 * t + e] = acc[m][e + 2 * h, 0, 0]
        cute.arch.sync_threads()

        self.finish(smem, partial, out, workspace, counters, b, out_stride, tile, split)


def compile_mma(plan: MmaPlan, arch: str | None = None, options: str = ""):
    """The compiled kernel of ``plan`` for ``arch`` (e.g. ``sm_90a``; by default
    ``CUTE_DSL_ARCH`` or the GPU's), with further ``options`` for ``cute.compile``
    (e.g. ``remarks{ptx}``)."""
    return compile_split(MmaGemv(plan), arch, options)
