"""The routed experts' two kernels in the CuTe DSL (bf16 weights, Hopper).

Both kernels run over a grid (tile, route slot): ``b * k`` slots (one per route), each
slot's CTAs first find, from the ids on the device, the rows routed to the slot's
expert; only the expert's first slot (its *owner*) works, so each distinct expert's
weights are read once and applied to every row routed to it (at most ``max_rows``).

- ``gate_up``: a CTA streams a tile of gate rows and the matching up rows of W13
  (16-byte loads, a few in flight per lane), dots them with the routed x rows (staged
  in shared memory), reduces each dot across its warp (fixed butterfly order), rounds
  gate and up to bf16, then ``bf16(silu(gate) * up)`` in fp32: h of each routed row
  goes to the scratch ``h[r * k + j, I]`` (j: the row's first slot with the expert).
- ``down``: a CTA streams a tile of W2 rows, dots them with the routed h rows, and
  writes ``rows[r, j, p]`` rounded to bf16 for every slot j of row r with the expert;
  slots of experts other ranks hold (EP) get zeros. Its weight tile is prefetched
  into L2 before it waits on ``gate_up`` (PDL: both kernels are launched as
  programmatic dependents and trigger their dependents once the ids are read).

Shapes are compile-time (one compile serves every layer of a rank); the pointers,
``b``, the x row stride and the first expert held are run-time arguments.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from .experts_shape import CHUNK, LANES, VEC, WARPS, ExpertsShape, Plan, shape_unsupported
from .gemv import fake_pointer


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


class RoutedExperts:
    """The compiled pair of kernels for one ``ExpertsShape``; ``__call__`` is the
    ``cute.jit`` host function (compile it with ``cute.compile``)."""

    def __init__(self, shape: ExpertsShape):
        reason = shape_unsupported(shape)
        if reason:
            raise ValueError(reason)
        self.s = shape
        self.plan = Plan.of(shape)
        # Shared memory: the routed input rows (bf16) and the routing of the expert.
        self.meta_ints = 3 * shape.max_rows + 2

    def _smem_bytes(self, width: int) -> int:
        return self.s.max_rows * width * 2 + 16 + self.meta_ints * 4

    # ---- the routing of the slot's expert, from the ids (every CTA) ----------------

    @cute.jit
    def _route(self, ids: cute.Tensor, b: Int32, e: Int32, meta: cute.Tensor):
        """Warp 0 writes meta: [0, R) the routed rows, [R, 2R) each row's slot mask,
        [2R, 3R) each row's first slot, then the count and the expert's first slot."""
        s, big = self.s, self.s.max_rows
        lane = cute.arch.lane_idx()
        if cute.arch.warp_idx() == 0:
            m = Int32(0)
            first = Int32(-1)
            for r in cutlass.range(b, unroll=1):
                j = cutlass.min(lane, s.top_k - 1)
                hit = (ids[r * s.top_k + j] == e) & (lane < s.top_k)
                mask = cute.arch.vote_ballot_sync(hit)
                if mask != 0:
                    slot = r * s.top_k + cute.arch.popc((mask & (-mask)) - 1)
                    if first < 0:
                        first = slot
                    if lane == 0:
                        meta[m] = r
                        meta[big + m] = mask
                        meta[2 * big + m] = slot
                    m = m + 1
            if lane == 0:
                meta[3 * big] = m
                meta[3 * big + 1] = first
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

    # ---- kernel 1: W13 tile, SwiGLU, h -------------------------------------------

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
        s, plan, big = self.s, self.plan, self.s.max_rows
        tidx, _, _ = cute.arch.thread_idx()
        tile, slot, _ = cute.arch.block_idx()
        warp, lane = tidx // LANES, tidx % LANES
        smem = cutlass.memory.SmemAllocator()
        xs = smem.allocate_tensor(BFloat16, cute.make_layout((big, VEC, s.width // VEC), stride=(s.width, 1, VEC)), 16)
        meta = smem.allocate_tensor(Int32, cute.make_layout(self.meta_ints), 4)

        cute.arch.griddepcontrol_wait()  # x and ids come from the kernels before
        e = ids[slot]
        local = e - first_expert
        self._route(ids, b, e, meta)
        cute.arch.griddepcontrol_launch_dependents()
        m = meta[3 * big]
        if (local >= 0) & (local < s.num_local) & (meta[3 * big + 1] == slot):
            self._stage(x, meta, m, xs)
            pw, nc = const_expr(plan.gate_up_warp_pairs), const_expr(plan.gate_up_chunks)
            acc = cute.make_rmem_tensor(cute.make_layout((2 * pw, big)), Float32)
            acc.fill(0.0)
            n0 = tile * plan.gate_up_pairs + warp * pw
            for g in cutlass.range(s.width // (CHUNK * nc), unroll=1):
                wv = []
                for u in cutlass.range_constexpr(nc):
                    c = (g * nc + u) * LANES + lane
                    for q in cutlass.range_constexpr(pw):
                        wv.append(w13[local, n0 + q, None, c].load())
                        wv.append(w13[local, s.intermediate + n0 + q, None, c].load())
                for u in cutlass.range_constexpr(nc):
                    c = (g * nc + u) * LANES + lane
                    wf = _scalars([wv[u * 2 * pw + t] for t in range(2 * pw)])
                    for i in cutlass.range_constexpr(big):
                        if i < m:
                            _accumulate(acc, wf, xs[i, None, c], i)
            for i in cutlass.range_constexpr(big):
                if i < m:
                    for q in cutlass.range_constexpr(pw):
                        gate = _warp_sum(acc[2 * q, i]).to(BFloat16).to(Float32)
                        up = _warp_sum(acc[2 * q + 1, i]).to(BFloat16).to(Float32)
                        act = gate / (1.0 + cute.math.exp(-gate)) * up
                        if lane == i:
                            h[meta[2 * big + i], n0 + q] = act.to(BFloat16)

    # ---- kernel 2: W2 tile into the route rows --------------------------------------

    @cute.kernel
    def down_kernel(
        self,
        h: cute.Tensor,  # bf16 (max_rows * k, VEC, I / VEC)
        ids: cute.Tensor,  # int32 (b * k)
        w2: cute.Tensor,  # bf16 (E_local, P, VEC, I / VEC)
        rows: cute.Tensor,  # bf16 (b * k, P)
        b: Int32,
        first_expert: Int32,
    ):
        s, plan, big = self.s, self.plan, self.s.max_rows
        tidx, _, _ = cute.arch.thread_idx()
        tile, slot, _ = cute.arch.block_idx()
        warp, lane = tidx // LANES, tidx % LANES
        smem = cutlass.memory.SmemAllocator()
        vecs = s.intermediate // VEC
        hs = smem.allocate_tensor(BFloat16, cute.make_layout((big, VEC, vecs), stride=(s.intermediate, 1, VEC)), 16)
        meta = smem.allocate_tensor(Int32, cute.make_layout(self.meta_ints), 4)

        # The ids were written before gate_up waited, so they are complete here.
        e = ids[slot]
        local = e - first_expert
        held = (local >= 0) & (local < s.num_local)
        self._route(ids, b, e, meta)
        owner = held & (meta[3 * big + 1] == slot)
        rw, nc = const_expr(plan.down_warp_rows), const_expr(plan.down_chunks)
        p0 = tile * plan.down_rows + warp * rw
        if owner:  # bring this CTA's W2 tile towards L2 while gate_up finishes
            for q in cutlass.range_constexpr(rw):
                for c in cutlass.range(lane * (128 // 16), vecs, LANES * (128 // 16), unroll=1):
                    cute.arch.prefetch(w2[local, p0 + q, None, c].iterator.llvm_ptr, cache_level="L2")
        cute.arch.griddepcontrol_wait()  # h comes from gate_up
        cute.arch.griddepcontrol_launch_dependents()
        if not held:  # another rank's expert: a zero row
            for p in cutlass.range(tidx, plan.down_rows, WARPS * LANES, unroll=1):
                rows[slot, tile * plan.down_rows + p] = BFloat16(0.0)
        if owner:
            m = meta[3 * big]
            self._stage(h, cute.make_tensor(meta.iterator + 2 * big, cute.make_layout(big)), m, hs)
            acc = cute.make_rmem_tensor(cute.make_layout((rw, big)), Float32)
            acc.fill(0.0)
            for g in cutlass.range(vecs // (LANES * nc), unroll=1):
                wv = []
                for u in cutlass.range_constexpr(nc):
                    c = (g * nc + u) * LANES + lane
                    for q in cutlass.range_constexpr(rw):
                        wv.append(w2[local, p0 + q, None, c].load())
                for u in cutlass.range_constexpr(nc):
                    c = (g * nc + u) * LANES + lane
                    wf = _scalars([wv[u * rw + q] for q in range(rw)])
                    for i in cutlass.range_constexpr(big):
                        if i < m:
                            _accumulate(acc, wf, hs[i, None, c], i)
            for i in cutlass.range_constexpr(big):
                if i < m:
                    r = meta[i]
                    mask = meta[big + i]
                    for q in cutlass.range_constexpr(rw):
                        y = _warp_sum(acc[q, i]).to(BFloat16)
                        for j in cutlass.range_constexpr(s.top_k):
                            if (lane == j) & (((mask >> j) & 1) != 0):
                                rows[r * s.top_k + j, p0 + q] = y

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
        stream: cuda.CUstream,
    ):
        s, plan = self.s, self.plan
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
        rows = cute.make_tensor(rows_ptr, cute.make_layout((b * k, p), stride=(p, 1)))
        self.gate_up_kernel(x, ids, w13, h_rows, b, first_expert).launch(
            grid=(i // plan.gate_up_pairs, b * k, 1),
            block=(WARPS * LANES, 1, 1),
            smem=self._smem_bytes(p),
            stream=stream,
            use_pdl=True,
        )
        self.down_kernel(h_vecs, ids, w2, rows, b, first_expert).launch(
            grid=(p // plan.down_rows, b * k, 1),
            block=(WARPS * LANES, 1, 1),
            smem=self._smem_bytes(i),
            stream=stream,
            use_pdl=True,
        )


def compile_experts(shape: ExpertsShape, arch: str | None = None):
    """The compiled host function for ``shape`` for ``arch`` (e.g. ``sm_90a``; by
    default ``CUTE_DSL_ARCH`` or the GPU's); call it with the real pointers."""
    bf16 = fake_pointer(BFloat16)
    options = {} if arch is None else {"options": f"--gpu-arch {arch}"}
    return cute.compile(
        RoutedExperts(shape),
        bf16,
        Int32(shape.width // VEC),
        fake_pointer(Int32),
        bf16,
        bf16,
        bf16,
        bf16,
        Int32(1),
        Int32(0),
        cute.runtime.make_fake_stream(),
        **options,
    )
