"""The routed experts' two kernels with their products on the tensor cores
(``mma.sync.m16n8k16``, bf16 in, fp32 accumulate), in the CuTe DSL (Hopper).

experts_kernels.py's ``RoutedExperts`` does the routing (the distinct experts found
on the device, a CTA's contiguous share of the (expert, tile) items, the routed rows
staged in shared memory, zero rows for other ranks' experts, PDL); this subclass
replaces its work items' products, which 8 fp32 FMAs per weight element and row
bound by instruction issue, with gemv_mma.py's MMA fragments:

- an MMA's A is 16 weight rows, B the staged rows as its 8 columns (rows past the
  expert's m repeating row m - 1; their sums are never stored), C the 16 x 8 fp32
  sums. ``gate_up``: an item is 16 intermediate columns, two MMA groups, group a's
  rows g the gate rows ``n0 + 8a + g`` and rows g + 8 the matching up rows, so a lane
  holds the gate and up sums of the same column and row; ``down``: an item is 32 W2
  rows, two groups of 16 consecutive rows;
- the CTA's 8 warps split K: lane (g, t) of warp w reads 16 bytes (8 consecutive k)
  of its rows g and g + 8 at the vector ``t + 4 w + 32 step`` straight into A (the
  K order permuted within the MMA step, gemv_mma's ``mma_vector``) and the staged
  row g's same 8 k as B; two register batches of loads in flight;
- the staged rows are ``PAD`` elements longer than a row, so that the 8 rows a warp
  reads at once lie in different banks;
- the warps' C go through shared memory and are added in warp order, one thread an
  output (``gate_up``: a gate/up pair, rounded each to bf16, then
  ``bf16(silu(gate) * up)`` into h; ``down``: rounded to bf16 into every route row of
  the staged row).

Numerics: the same roundings to bf16 as ``fn.expert_rows`` (gate and up, h, the W2
output), each on an fp32 sum of the same products in another order (the MMA's within
a warp, then the 8 warps in index order); exp as ``ex2.approx``. Each sum's fp32
error is of the size of the reference's own (K products, relative 2^-24 each), so a
result differs from the reference by at most one bf16 ulp where a sum lies that close
to a rounding point, and an h element so flipped moves W2's sums as it does between
the reference and the exact sums: tests/expert_check.py's bounds (the kernel's error
against the exact-sum rows at most 1.5x the reference's in L2, 2x in the largest
element) hold as for experts_kernels.py. Results are identical from run to run.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from .experts_kernels import RoutedExperts, compile_experts, round_bf16, store_route, swiglu
from .experts_shape import LANES, VEC, WARPS, ExpertsShape
from .gemv_mma import K_LANES, MMA_K, MMA_M, MMA_N, load_half, mma_vector

GROUPS = 2  # 16-row MMA groups of an item
GATE_UP_COLS = GROUPS * MMA_M // 2  # intermediate columns of a gate_up item (gate and up rows)
DOWN_ROWS = GROUPS * MMA_M  # W2 rows of a down item
C_FLOATS = GROUPS * 4 * LANES  # a warp's C: 4 fp32 a lane a group
BATCH_LOADS = 8  # 16-byte weight vectors a lane in one register batch (two are in flight)
PAD = 32  # bf16 after each staged row: rows g and g + 1 64 bytes apart in the banks


class RoutedExpertsMma(RoutedExperts):
    """``RoutedExperts`` with its items on ``mma.sync.m16n8k16``."""

    def __init__(self, shape: ExpertsShape):
        super().__init__(shape)
        assert shape.max_rows <= MMA_N and C_FLOATS == WARPS * LANES
        self.gate_up_cols, self.down_rows = GATE_UP_COLS, DOWN_ROWS
        self.pad = PAD
        self.reduce_floats = WARPS * C_FLOATS
        self.mma = cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (MMA_M, MMA_N, MMA_K))

    def _warp_lane(self):
        """The thread's warp (``warp_idx``: uniform in the warp, so the first tile's
        prefetch addresses are a warp's) and lane; the items here read their own."""
        return cute.arch.warp_idx(), cute.arch.lane_idx()

    @cute.jit
    def _load(self, w: cute.Tensor, e: Int64, top: list, bottom: list, buffer: list, batch: Int32, depth: int):
        """Batch ``batch`` (``depth`` steps) of the lane's weight vectors into
        ``buffer``: for each step and group a, rows ``top[a]`` and ``bottom[a]``."""
        lane_vector = cute.arch.warp_idx() * K_LANES + cute.arch.lane_idx() % K_LANES
        for d in cutlass.range_constexpr(depth):
            c = lane_vector + (batch * depth + d) * (K_LANES * WARPS)
            for a in cutlass.range_constexpr(GROUPS):
                load_half(buffer[d * GROUPS + a], 0, w[e, top[a], None, c])
                load_half(buffer[d * GROUPS + a], 1, w[e, bottom[a], None, c])

    @cute.jit
    def _multiply(self, atom, staged: cute.Tensor, x_row: Int32, acc: list, buffer: list, batch: Int32, depth: int):
        """``acc[a] += A[a] B`` over batch ``batch``: B the staged row ``x_row``."""
        lane_vector = cute.arch.warp_idx() * K_LANES + cute.arch.lane_idx() % K_LANES
        xv = cute.make_rmem_tensor((VEC,), BFloat16)
        for d in cutlass.range_constexpr(depth):
            xv.store(staged[x_row, None, lane_vector + (batch * depth + d) * (K_LANES * WARPS)].load())
            for a in cutlass.range_constexpr(GROUPS):
                mma_vector(atom, acc[a], buffer[d * GROUPS + a], xv)

    @cute.jit
    def _products(self, w: cute.Tensor, local: Int32, top: list, bottom: list, staged: cute.Tensor, m: Int32, red):
        """red[warp] = this warp's C over its share of K: group a's rows ``top[a]``
        (A rows g) and ``bottom[a]`` (A rows g + 8) against the m staged rows;
        then the CTA waits for every warp's."""
        steps = const_expr(w.shape[3] // (K_LANES * WARPS))
        depth = const_expr(max(d for d in range(1, steps + 1) if steps % d == 0 and 2 * GROUPS * d <= BATCH_LOADS))
        batches = const_expr(steps // depth)
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        e = Int64(local)  # an expert's offset passes 2**31 elements at TP 1 (256 experts)
        x_row = cutlass.min(lane // K_LANES, m - 1)
        atom = cute.make_mma_atom(self.mma)
        buffers = [[cute.make_rmem_tensor((2 * VEC,), BFloat16) for _ in range(GROUPS * depth)] for _ in range(2)]
        self._load(w, e, top, bottom, buffers[0], Int32(0), depth)
        if const_expr(batches > 1):
            self._load(w, e, top, bottom, buffers[1], Int32(1), depth)
        acc = [cute.make_rmem_tensor(((2, 2), 1, 1), Float32) for _ in range(GROUPS)]
        for a in cutlass.range_constexpr(GROUPS):
            acc[a].fill(0.0)
        # Two batches in flight: each buffer is refilled as soon as it is multiplied.
        for pair in cutlass.range(batches // 2, unroll=1):
            batch = pair * 2
            self._multiply(atom, staged, x_row, acc, buffers[0], batch, depth)
            if batch + 2 < batches:
                self._load(w, e, top, bottom, buffers[0], batch + 2, depth)
            self._multiply(atom, staged, x_row, acc, buffers[1], batch + 1, depth)
            if batch + 3 < batches:
                self._load(w, e, top, bottom, buffers[1], batch + 3, depth)
        if const_expr(batches % 2 == 1):
            self._multiply(atom, staged, x_row, acc, buffers[0], Int32(batches - 1), depth)
        cute.arch.sync_threads()  # the previous item's sums are read
        # C of group a: (A row g + 8h, staged row 2t + e) at acc[a][e + 2h].
        for a in cutlass.range_constexpr(GROUPS):
            for q in cutlass.range_constexpr(4):
                red[warp, (a * 4 + q) * LANES + lane] = acc[a][q, 0, 0]
        cute.arch.sync_threads()

    @cute.jit
    def _sum(self, red: cute.Tensor, v: Int32) -> Float32:
        """The warps' sums of C value ``v`` (``_products``' order), in warp order."""
        total = red[0, v]
        for w in cutlass.range_constexpr(1, WARPS):
            total = total + red[w, v]
        return total

    @cute.jit
    def _gate_up_item(self, _warp, _lane, w13, local, tile, xs, m, meta, h, red):
        s, big = self.s, self.s.max_rows
        n0 = tile * GATE_UP_COLS
        g = cute.arch.lane_idx() // K_LANES
        top = [n0 + MMA_N * a + g for a in range(GROUPS)]
        self._products(w13, local, top, [s.intermediate + r for r in top], xs, m, red)
        # Thread (a, e, lane (g, t)): column n0 + 8a + g of staged row 2t + e.
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < GROUPS * 2 * LANES:
            a, e, lane = tidx // (2 * LANES), (tidx // LANES) % 2, tidx % LANES
            i = 2 * (lane % K_LANES) + e
            if i < m:
                gate = self._sum(red, (a * 4 + e) * LANES + lane)
                up = self._sum(red, (a * 4 + 2 + e) * LANES + lane)
                h[meta[2 * big + i], n0 + MMA_N * a + lane // K_LANES] = swiglu(round_bf16(gate), round_bf16(up)).to(
                    BFloat16
                )

    @cute.jit
    def _down_item(self, _warp, _lane, w2, local, tile, hs, m, meta, rows, red):
        p0 = tile * DOWN_ROWS
        g = cute.arch.lane_idx() // K_LANES
        top = [p0 + MMA_M * a + g for a in range(GROUPS)]
        self._products(w2, local, top, [r + MMA_N for r in top], hs, m, red)
        # Thread (a, q = e + 2h, lane (g, t)): W2 row p0 + 16a + g + 8h of staged row 2t + e.
        tidx, _, _ = cute.arch.thread_idx()
        a, q, lane = tidx // (4 * LANES), (tidx // LANES) % 4, tidx % LANES
        i = 2 * (lane % K_LANES) + q % 2
        if i < m:
            y = self._sum(red, tidx).to(BFloat16)
            p = p0 + MMA_M * a + lane // K_LANES + MMA_N * (q // 2)
            for j in cutlass.range_constexpr(self.s.top_k):
                store_route(rows, meta, i, j, p, y, self.s.top_k)


def compile_experts_mma(shape: ExpertsShape, arch: str | None = None, options: str = ""):
    """experts_kernels.py's ``compile_experts`` of ``RoutedExpertsMma``."""
    return compile_experts(shape, arch, options, RoutedExpertsMma)
