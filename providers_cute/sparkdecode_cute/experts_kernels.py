"""The routed experts' two kernels in the CuTe DSL (bf16 weights, Hopper).

Both kernels are persistent (a few CTAs a multiprocessor). Each CTA first finds, from
the ids on the device, the distinct experts this rank holds (each one's first slot,
in slot order); the work is (distinct expert, tile of weight rows), split into
contiguous equal shares over the CTAs, so each distinct expert's weights are read
once and applied to every row routed to it (at most ``max_rows``).

- ``gate_up``: it prefetches its first W13 tile into L2, then a work item is a tile of gate rows and the matching up rows of W13
  (16-byte loads, eight in flight a lane), dotted with the expert's routed x rows
  (staged in shared memory when the CTA moves to another expert), each dot reduced
  across its warp in a fixed butterfly order; gate and up rounded to bf16, then
  ``bf16(silu(gate) * up)`` in fp32: h of each routed row goes to the scratch
  ``h[r * k + j, I]`` (j: the row's first slot with the expert).
- ``down``: a work item is a tile of W2 rows dotted with the routed h rows, written as
  ``rows[r, j, p]`` (bf16) for every slot j of row r with the expert; slots of
  experts other ranks hold (EP) get zero rows. It finds its work and prefetches its
  first W2 tile into L2 before it waits on ``gate_up``.

Both are launched as programmatic dependents (PDL) and let their dependents launch
once they have read the ids (``gate_up`` after its wait: so the ids are complete
when ``down`` starts).

Shapes are compile-time (one compile serves every layer of a rank); the pointers,
``b``, the x row stride, the first expert held and the CTA count are run-time.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from .experts_shape import LANES, VEC, WARPS, ExpertsShape, Plan, shape_unsupported
from .gemv import compile_for, fake_pointer


def _warp_sum(v: Float32) -> Float32:
    for i in range(5):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=1 << (4 - i))
    return v


def _scalars(vectors: list) -> list:
    """The fp32 elements of bf16 vectors, extracted once (outside any branch)."""
    out = []
    for v in vectors:
        f = v.to(Float32)
        out.append([f[t] for t in range(VEC)])
    return out


@cute.jit
def _accumulate(acc: cute.Tensor, weights: list, x: cute.Tensor, i: cutlass.Constexpr[int]):
    """acc[q, i] += dot(weights[q], x) over one 16-byte chunk (fp32, in element order)."""
    xv = x.load().to(Float32)
    for q in cutlass.range_constexpr(len(weights)):
        a = acc[q, i]
        for t in cutlass.range_constexpr(VEC):
            a = a + weights[q][t] * xv[t]
        acc[q, i] = a


@cute.jit
def _stream_dot(
    w: cute.Tensor, local: Int32, rows: list, chunks: cutlass.Constexpr[int], staged: cute.Tensor, m: Int32, acc
):
    """acc[q, i] = this lane's part of dot(w[local, rows[q]], staged[i]) for i < m:
    the weight rows streamed ``chunks`` 16-byte loads a row at a time (all issued
    before any is used), the staged rows read from shared memory."""
    lane = cute.arch.lane_idx()
    n = len(rows)
    e = Int64(local)  # an expert's offset passes 2**31 elements at TP 1 (256 experts)
    for g in cutlass.range(w.shape[3] // (LANES * chunks), unroll=1):
        loaded = []
        for u in cutlass.range_constexpr(chunks):
            c = (g * chunks + u) * LANES + lane
            for q in cutlass.range_constexpr(n):
                loaded.append(w[e, rows[q], None, c].load())
        for u in cutlass.range_constexpr(chunks):
            c = (g * chunks + u) * LANES + lane
            weights = _scalars(loaded[u * n : (u + 1) * n])
            for i in cutlass.range_constexpr(staged.shape[0]):
                if i < m:
                    _accumulate(acc, weights, staged[i, None, c], i)


@cute.jit
def round_bf16(v: Float32) -> Float32:
    """``v`` rounded to bf16 (as the reference rounds the gate/up GEMM's output)."""
    return v.to(BFloat16).to(Float32)


@cute.jit
def swiglu(gate: Float32, up: Float32) -> Float32:
    """``silu(gate) * up`` in fp32 (of the sums rounded by ``round_bf16``); h is its
    rounding to bf16."""
    return gate / (1.0 + cute.math.exp(-gate)) * up


@cute.jit
def store_route(rows: cute.Tensor, meta: cute.Tensor, i: Int32, j: int, p: Int32, y: BFloat16, top_k: int):
    """rows[r * k + j, p] = y where staged row i (routed row r) holds the expert in
    slot j (``meta``: ``RoutedExperts._route``'s)."""
    big = (cute.size(meta) - 1) // 3
    if ((meta[big + i] >> j) & 1) != 0:
        rows[meta[i] * top_k + j, p % VEC, p // VEC] = y


@cute.jit
def _prefetch_rows(w: cute.Tensor, local: Int32, row0: Int32, rows: cutlass.Constexpr[int]):
    """Prefetch rows ``row0 .. row0 + rows - 1`` of expert ``local`` of ``w``
    (E, N, VEC, K / VEC) into L2, one 128-byte line a lane at a time."""
    lane = cute.arch.lane_idx()
    line = const_expr(128 // (VEC * 2))
    e = Int64(local)
    for q in cutlass.range_constexpr(rows):
        for c in cutlass.range(lane * line, w.shape[3], LANES * line, unroll=1):
            cute.arch.prefetch(w[e, row0 + q, None, c].iterator.llvm_ptr, cache_level="L2")


class RoutedExperts:
    """The compiled pair of kernels for one ``ExpertsShape``; ``__call__`` is the
    ``cute.jit`` host function (compile it with ``cute.compile``).

    The routing (distinct experts, staging, zero rows, PDL, the persistent split of
    the work) is this class's; a work item's products are ``_gate_up_item`` and
    ``_down_item`` (here on the CUDA cores; experts_mma_kernels.py's subclass puts
    them on the tensor cores), over tiles of ``gate_up_cols`` intermediate columns
    and ``down_rows`` W2 rows a CTA."""

    def __init__(self, shape: ExpertsShape):
        reason = shape_unsupported(shape)
        if reason:
            raise ValueError(reason)
        self.s = shape
        self.plan = Plan.of(shape)
        self.gate_up_cols = self.plan.gate_up_pairs
        self.down_rows = self.plan.down_rows
        self.pad = 0  # elements after each staged row
        self.reduce_floats = 0  # fp32 shared memory of the items' reductions
        self.slots = shape.max_rows * shape.top_k
        # Shared memory after the staged rows: the ids, the distinct experts' first
        # slots, a count a warp, and the routing of the expert at hand.
        self.meta_ints = 3 * shape.max_rows + 1

    def _smem_bytes(self, width: int) -> int:
        ints = 2 * self.slots + WARPS + self.meta_ints
        return self.s.max_rows * (width + self.pad) * 2 + 4 * (ints + self.reduce_floats) + 256

    def _smem(self, width: int):
        """The staged rows (row stride ``width + pad``), the ids, the distinct
        experts, the warps' counts, the routing, and the reduction's floats (or None)."""
        smem = cutlass.memory.SmemAllocator()
        big = self.s.max_rows
        layout = cute.make_layout((big, VEC, width // VEC), stride=(width + self.pad, 1, VEC))
        rows = smem.allocate_tensor(BFloat16, layout, 16)
        ids = smem.allocate_tensor(Int32, cute.make_layout(self.slots), 16)
        distinct = smem.allocate_tensor(Int32, cute.make_layout(self.slots), 16)
        counts = smem.allocate_tensor(Int32, cute.make_layout(WARPS), 16)
        meta = smem.allocate_tensor(Int32, cute.make_layout(self.meta_ints), 16)
        red = None
        if self.reduce_floats:
            red = smem.allocate_tensor(
                Float32,
                cute.make_layout((WARPS, self.reduce_floats // WARPS), stride=(self.reduce_floats // WARPS, 1)),
                16,
            )
        return rows, ids, distinct, counts, meta, red

    # ---- the distinct experts and their routes, from the ids (every CTA) ------------

    @cute.jit
    def _distinct(
        self, ids: cute.Tensor, b: Int32, first_expert: Int32, ids_s: cute.Tensor, distinct: cute.Tensor, counts
    ) -> Int32:
        """Stages the ids in ``ids_s`` and writes ``distinct[d]``, the first slot of
        the d-th distinct expert this rank holds (in slot order); returns their count."""
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = tidx // LANES, tidx % LANES
        n_slots = b * self.s.top_k
        if tidx < n_slots:  # at the L2: the ids may be newer than a line some L1 holds
            ids_s[tidx] = cute.arch.load((ids.iterator + tidx).llvm_ptr, Int32, cop="cg")
        cute.arch.sync_threads()
        first = tidx < n_slots
        if first:
            e = ids_s[tidx]
            local = e - first_expert
            first = (local >= 0) & (local < self.s.num_local)
            for t in cutlass.range(tidx, unroll=4):
                if ids_s[t] == e:
                    first = False
        ballot = cute.arch.vote_ballot_sync(first)
        if lane == 0:
            counts[warp] = cute.arch.popc(ballot)
        cute.arch.sync_threads()
        before = Int32(0)
        total = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            if w < warp:
                before = before + counts[w]
            total = total + counts[w]
        if first:
            distinct[before + cute.arch.popc(ballot & Int32(cute.arch.lanemask_lt()))] = tidx
        cute.arch.sync_threads()
        return total

    @cute.jit
    def _route(self, ids_s: cute.Tensor, b: Int32, e: Int32, meta: cute.Tensor):
        """Warp 0 writes meta: [0, R) the rows routed to ``e``, [R, 2R) each row's
        slot mask, [2R, 3R) each row's first slot with ``e``, then their count."""
        s, big = self.s, self.s.max_rows
        lane = cute.arch.lane_idx()
        cute.arch.sync_threads()  # the previous expert's staged rows are no longer read
        if cute.arch.warp_idx() == 0:
            m = Int32(0)
            for r in cutlass.range(b, unroll=1):
                j = cutlass.min(lane, s.top_k - 1)
                hit = (ids_s[r * s.top_k + j] == e) & (lane < s.top_k)
                mask = cute.arch.vote_ballot_sync(hit)
                if mask != 0:
                    if lane == 0:
                        meta[m] = r
                        meta[big + m] = mask
                        meta[2 * big + m] = r * s.top_k + cute.arch.popc((mask & (-mask)) - 1)
                    m = m + 1
            if lane == 0:
                meta[3 * big] = m
        cute.arch.sync_threads()

    @cute.jit
    def _stage(self, src: cute.Tensor, src_row: cute.Tensor, m: Int32, dst: cute.Tensor):
        """dst[i] = src[src_row[i]] for i < m, 16 bytes a thread at a time."""
        vecs = dst.shape[2]
        tidx, _, _ = cute.arch.thread_idx()
        for v in cutlass.range(tidx, m * vecs, WARPS * LANES, unroll=1):
            i = v // vecs
            c = v - i * vecs
            dst[i, None, c].store(src[src_row[i], None, c].load())
        cute.arch.sync_threads()

    @cute.jit
    def _span(self, items: Int32):
        """This CTA's contiguous share of ``items`` work items (shares differ by <= 1)."""
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        return (cta * items) // ctas, ((cta + 1) * items) // ctas

    # ---- a work item's products (CUDA cores) ------------------------------------------

    def _warp_lane(self):
        """The thread's warp and lane as the kernels and items take them: here
        ``tidx // 32`` and ``tidx % 32``, one ``tid.x`` read (the code these kernels
        were checked and measured with on the H200)."""
        tidx, _, _ = cute.arch.thread_idx()
        return tidx // LANES, tidx % LANES

    @cute.jit
    def _gate_up_item(self, warp, lane, w13, local, tile, xs, m, meta, h, red):
        """h of the m staged rows at the intermediate columns of tile ``tile`` (``warp``
        and ``lane``: the thread's): warp w takes ``gate_up_warp_pairs`` columns, each
        dot reduced across the warp."""
        s, plan, big = self.s, self.plan, self.s.max_rows
        pw = const_expr(plan.gate_up_warp_pairs)
        acc = cute.make_rmem_tensor(cute.make_layout((2 * pw, big)), Float32)
        acc.fill(0.0)
        n0 = tile * plan.gate_up_pairs + warp * pw
        rows = []
        for q in cutlass.range_constexpr(pw):
            rows += [n0 + q, s.intermediate + n0 + q]
        _stream_dot(w13, local, rows, plan.gate_up_chunks, xs, m, acc)
        for i in cutlass.range_constexpr(big):
            if i < m:
                for q in cutlass.range_constexpr(pw):
                    act = swiglu(round_bf16(_warp_sum(acc[2 * q, i])), round_bf16(_warp_sum(acc[2 * q + 1, i])))
                    if lane == i:
                        h[meta[2 * big + i], n0 + q] = act.to(BFloat16)

    @cute.jit
    def _down_item(self, warp, lane, w2, local, tile, hs, m, meta, rows, red):
        """The W2 rows of tile ``tile`` of the m staged h rows into their route rows
        (``warp`` and ``lane``: the thread's): warp w takes ``down_warp_rows`` rows,
        each dot reduced across the warp."""
        s, plan, big = self.s, self.plan, self.s.max_rows
        rw = const_expr(plan.down_warp_rows)
        acc = cute.make_rmem_tensor(cute.make_layout((rw, big)), Float32)
        acc.fill(0.0)
        p0 = tile * plan.down_rows + warp * rw
        _stream_dot(w2, local, [p0 + q for q in range(rw)], plan.down_chunks, hs, m, acc)
        for i in cutlass.range_constexpr(big):
            if i < m:
                r = meta[i]
                mask = meta[big + i]
                for q in cutlass.range_constexpr(rw):
                    y = _warp_sum(acc[q, i]).to(BFloat16)
                    p = p0 + q
                    for j in cutlass.range_constexpr(s.top_k):
                        if (lane == j) & (((mask >> j) & 1) != 0):
                            rows[r * s.top_k + j, p % VEC, p // VEC] = y

    # ---- kernel 1: W13 tiles, SwiGLU, h -------------------------------------------

    @cute.kernel
    def gate_up_kernel(
        self,
        x: cute.Tensor,  # bf16 (b, VEC, P / VEC)
        ids: cute.Tensor,  # int32 (b * k)
        w13: cute.Tensor,  # bf16 (E_local, 2I, VEC, P / VEC)
        h: cute.Tensor,  # bf16 (max_rows * k, I)
        b: Int32,
        first_expert: Int32,
    ):
        s, big = self.s, self.s.max_rows
        warp, lane = self._warp_lane()
        xs, ids_s, distinct, counts, meta, red = self._smem(s.width)
        cols = const_expr(self.gate_up_cols)
        tiles = const_expr(s.intermediate // cols)

        cute.arch.griddepcontrol_wait()  # x and ids come from the kernels before
        n = self._distinct(ids, b, first_expert, ids_s, distinct, counts)
        cute.arch.griddepcontrol_launch_dependents()
        start, end = self._span(n * tiles)
        if start < end:  # the first W13 tile streams in while x is staged
            d = start // tiles
            local = ids_s[distinct[d]] - first_expert
            n0 = (start - d * tiles) * cols + warp * (cols // WARPS)
            _prefetch_rows(w13, local, n0, cols // WARPS)
            _prefetch_rows(w13, local, s.intermediate + n0, cols // WARPS)
        current = Int32(-1)
        for item in cutlass.range(start, end, unroll=1):
            d = item // tiles
            slot = distinct[d]
            local = ids_s[slot] - first_expert
            if d != current:
                self._route(ids_s, b, ids_s[slot], meta)
                self._stage(x, meta, meta[3 * big], xs)
                current = d
            m = meta[3 * big]
            self._gate_up_item(warp, lane, w13, local, item - d * tiles, xs, m, meta, h, red)

    # ---- kernel 2: W2 tiles into the route rows --------------------------------------

    @cute.kernel
    def down_kernel(
        self,
        h: cute.Tensor,  # bf16 (max_rows * k, VEC, I / VEC)
        ids: cute.Tensor,  # int32 (b * k)
        w2: cute.Tensor,  # bf16 (E_local, P, VEC, I / VEC)
        rows: cute.Tensor,  # bf16 (b * k, VEC, P / VEC)
        b: Int32,
        first_expert: Int32,
    ):
        s, big = self.s, self.s.max_rows
        tidx, _, _ = cute.arch.thread_idx()
        warp, lane = self._warp_lane()
        hs, ids_s, distinct, counts, meta, red = self._smem(s.intermediate)
        rows_a_tile = const_expr(self.down_rows)
        tiles = const_expr(s.width // rows_a_tile)

        # The ids were complete before gate_up passed its wait, so before this
        # kernel started: find the work and prefetch its first W2 tile into L2.
        n = self._distinct(ids, b, first_expert, ids_s, distinct, counts)
        start, end = self._span(n * tiles)
        if start < end:
            d = start // tiles
            local = ids_s[distinct[d]] - first_expert
            per_warp = const_expr(rows_a_tile // WARPS)
            _prefetch_rows(w2, local, (start - d * tiles) * rows_a_tile + warp * per_warp, per_warp)
        cute.arch.griddepcontrol_wait()  # h comes from gate_up
        cute.arch.griddepcontrol_launch_dependents()

        # Routes to experts other ranks hold: zero rows, spread over the CTAs.
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        row_vecs = const_expr(s.width // VEC)
        for v in cutlass.range(cta * WARPS * LANES + tidx, b * s.top_k * row_vecs, ctas * WARPS * LANES, unroll=1):
            slot = v // row_vecs
            local = ids_s[slot] - first_expert
            if (local < 0) | (local >= s.num_local):
                rows[slot, None, v - slot * row_vecs].store(cute.zeros_like(rows[slot, None, 0].load()))

        current = Int32(-1)
        for item in cutlass.range(start, end, unroll=1):
            d = item // tiles
            slot = distinct[d]
            local = ids_s[slot] - first_expert
            if d != current:
                self._route(ids_s, b, ids_s[slot], meta)
                self._stage(h, cute.make_tensor(meta.iterator + 2 * big, cute.make_layout(big)), meta[3 * big], hs)
                current = d
            m = meta[3 * big]
            self._down_item(warp, lane, w2, local, item - d * tiles, hs, m, meta, rows, red)

    # ---- the host function ------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        x_stride: Int32,  # of x's rows, in 16-byte units
        ids_ptr: cute.Pointer,
        w13_ptr: cute.Pointer,
        w2_ptr: cute.Pointer,
        h_ptr: cute.Pointer,
        rows_ptr: cute.Pointer,
        b: Int32,
        first_expert: Int32,
        ctas: Int32,  # persistent CTAs a kernel (a few a multiprocessor)
        stream: cuda.CUstream,
    ):
        s = self.s
        p, i, k = s.width, s.intermediate, s.top_k
        x = cute.make_tensor(
            x_ptr, cute.make_layout((b, VEC, p // VEC), stride=(cute.assume(x_stride * VEC, divby=VEC), 1, VEC))
        )
        ids = cute.make_tensor(ids_ptr, cute.make_layout(b * k))
        w13 = cute.make_tensor(
            w13_ptr, cute.make_layout((s.num_local, 2 * i, VEC, p // VEC), stride=(2 * i * p, p, 1, VEC))
        )
        w2 = cute.make_tensor(w2_ptr, cute.make_layout((s.num_local, p, VEC, i // VEC), stride=(p * i, i, 1, VEC)))
        h_rows = cute.make_tensor(h_ptr, cute.make_layout((s.max_rows * k, i), stride=(i, 1)))
        h_vecs = cute.make_tensor(h_ptr, cute.make_layout((s.max_rows * k, VEC, i // VEC), stride=(i, 1, VEC)))
        rows = cute.make_tensor(rows_ptr, cute.make_layout((b * k, VEC, p // VEC), stride=(p, 1, VEC)))
        self.gate_up_kernel(x, ids, w13, h_rows, b, first_expert).launch(
            grid=(ctas, 1, 1),
            block=(WARPS * LANES, 1, 1),
            smem=self._smem_bytes(p),
            stream=stream,
            use_pdl=True,
        )
        self.down_kernel(h_vecs, ids, w2, rows, b, first_expert).launch(
            grid=(ctas, 1, 1),
            block=(WARPS * LANES, 1, 1),
            smem=self._smem_bytes(i),
            stream=stream,
            use_pdl=True,
        )


def compile_experts(shape: ExpertsShape, arch: str | None = None, options: str = "", kind: type = RoutedExperts):
    """The compiled host function of ``kind`` (``RoutedExperts`` or a subclass) for
    ``shape`` for ``arch`` (e.g. ``sm_90a``; by default ``CUTE_DSL_ARCH`` or the
    GPU's), with further ``options`` for ``cute.compile`` (e.g. ``remarks{ptx}``);
    call it with the real pointers."""
    bf16 = fake_pointer(BFloat16)
    return compile_for(
        kind(shape),
        bf16,
        Int32(shape.width // VEC),
        fake_pointer(Int32, 4),
        bf16,
        bf16,
        bf16,
        bf16,
        Int32(1),
        Int32(0),
        Int32(264),
        cute.runtime.make_fake_stream(),
        arch=arch,
        options=options,
    )
