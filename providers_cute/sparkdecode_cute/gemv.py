"""The weight-streaming GEMM for a few rows: ``out[b, N] = x[b, K] @ W[N, K]^T``,
b <= ``max_rows`` (a handful), in the CuTe DSL. Imports no torch: the kernels
compile (``compile_gemv``) from fake pointers on a machine without a GPU.

With b this small the GEMM reads its weight once and does little else, so the
kernel is a stream of W at the copy bandwidth:

- a CTA owns ``rows`` output columns (weight rows) over the whole K; its
  ``threads`` threads split K (an in-CTA split-K), thread t reading the 16-byte
  vectors t, t + threads, ... of each of its weight rows, every weight vector of
  the CTA issued up front (``rows * loads`` 16-byte loads in flight per thread);
- those loads are issued before ``griddepcontrol.wait``: launched with programmatic
  stream serialization (PDL), a kernel streams its weight while the kernel before
  it finishes, and reads x (which that kernel may write) only after the wait;
- x is read after the wait through L1 (a few KB per row, shared by the CTAs of an
  SM), converted to fp32; every product accumulates in fp32 in registers;
- the split over K is summed in a fixed order (butterfly shuffles in each warp,
  then the warps in index order through shared memory), so results are identical
  from run to run; the sum is rounded once into the output dtype.

bf16 weights take bf16 x and write bf16; the fp32 router takes bf16 x (exact in
fp32) and writes fp32. b is a runtime argument: rows past b read row b - 1 (valid
memory) and are never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

VECTOR_BYTES = 16  # one 128-bit load
MAX_THREADS = 256
LOADS_PER_THREAD = 16  # 16-byte weight vectors a thread keeps in flight
MIN_CTAS = 264  # two per SM of an H200 (132 SMs) before fewer rows per CTA are taken


@dataclass(frozen=True)
class GemvPlan:
    """The compile-time shape of one kernel: W [n, k] (row stride ``w_stride``) of
    ``weight_fp32`` (else bf16), up to ``max_rows`` rows of x, and the tiling
    chosen for it."""

    n: int
    k: int
    w_stride: int
    weight_fp32: bool
    max_rows: int
    threads: int  # per CTA, all along K
    loads: int  # 16-byte vectors of one weight row per thread
    rows: int  # weight rows per CTA

    @property
    def vector(self) -> int:
        """Elements per 16-byte weight vector (8 bf16, 4 fp32)."""
        return VECTOR_BYTES // (4 if self.weight_fp32 else 2)

    @property
    def ctas(self) -> int:
        return self.n // self.rows

    @property
    def warps(self) -> int:
        return self.threads // 32


def operands_reason(k: int, vector: int, max_rows: int, w_stride: int) -> str | None:
    """Why a weight of rows ``w_stride`` elements apart (K ``k``, ``vector``
    elements a 16-byte load) or ``max_rows`` rows of x are not taken, if so."""
    if w_stride % vector or w_stride < k:
        return f"weight rows {w_stride} elements apart (K {k}): not whole 16-byte vectors"
    if not 1 <= max_rows <= 8:
        return f"{max_rows} rows (the GEMV takes 1..8)"
    return None


def plan_gemv(n: int, k: int, weight_fp32: bool, max_rows: int, w_stride: int | None = None) -> GemvPlan | str:
    """The tiling for W [n, k] (rows ``w_stride`` apart, default k), or why the
    kernel does not take the shape."""
    vector = VECTOR_BYTES // (4 if weight_fp32 else 2)
    w_stride = k if w_stride is None else w_stride
    reason = operands_reason(k, vector, max_rows, w_stride)
    if reason:
        return reason
    if k % (vector * 32):
        return f"K {k} is not a multiple of {vector * 32}"
    vectors = k // vector
    threads = next(t for t in (MAX_THREADS, 128, 64, 32) if vectors % t == 0)
    loads = vectors // threads
    if loads > LOADS_PER_THREAD:
        return f"K {k}: {loads} loads per thread, more than {LOADS_PER_THREAD}"
    rows = 1
    for r in (8, 4, 2):
        if n % r == 0 and r * loads <= LOADS_PER_THREAD and n // r >= MIN_CTAS:
            rows = r
            break
    return GemvPlan(n, k, w_stride, weight_fp32, max_rows, threads, loads, rows)


class Gemv:
    """One compiled shape: ``__call__(w, x, out, b, x_stride, out_stride, stream)``
    on pointers (W [n, k] with contiguous rows; x and out rows contiguous, row strides in
    elements; x's a multiple of the vector, pointers 16-byte aligned)."""

    def __init__(self, plan: GemvPlan):
        self.plan = plan
        self.weight_dtype = Float32 if plan.weight_fp32 else BFloat16
        self.out_dtype = self.weight_dtype

    @cute.jit
    def __call__(
        self,
        w: cute.Pointer,
        x: cute.Pointer,
        out: cute.Pointer,
        b: Int32,
        x_stride: Int32,
        out_stride: Int32,
        stream: cuda.CUstream,
    ):
        p = self.plan
        self.kernel(w, x, out, b, x_stride, out_stride).launch(
            grid=[p.ctas, 1, 1], block=[p.threads, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(
        self,
        w: cute.Pointer,
        x: cute.Pointer,
        out: cute.Pointer,
        b: Int32,
        x_stride: Int32,
        out_stride: Int32,
    ):
        p = self.plan
        V, T, J, R, B = p.vector, p.threads, p.loads, p.rows, p.max_rows
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        n0 = bidx * R

        # The weight first: constant for the step, so read before the wait.
        mW = cute.make_tensor(w, cute.make_layout((p.n, p.k), stride=(p.w_stride, 1)))
        weights = []
        for r in cutlass.range_constexpr(R):
            for j in cutlass.range_constexpr(J):
                weights.append(cute.local_tile(mW, (1, V), (n0 + r, tidx + j * T)).load())
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()

        xs = cute.assume(x_stride, divby=V)
        mX = cute.make_tensor(x, cute.make_layout((B, p.k), stride=(xs, 1)))
        acc = [Float32(0.0)] * (R * B)
        for j in cutlass.range_constexpr(J):
            for i in cutlass.range_constexpr(B):
                row = cutlass.min(Int32(i), b - 1)
                xv = cute.local_tile(mX, (1, V), (row, tidx + j * T)).load().to(Float32)
                for r in cutlass.range_constexpr(R):
                    prod = weights[r * J + j].to(Float32) * xv
                    acc[r * B + i] = acc[r * B + i] + prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

        smem = cutlass.memory.SmemAllocator()
        partial = smem.allocate_tensor(Float32, cute.make_layout((p.warps, R * B), stride=(R * B, 1)), 16)
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        for q in cutlass.range_constexpr(R * B):
            total = cute.arch.warp_reduction_sum(acc[q])
            if lane == 0:
                partial[warp, q] = total
        cute.arch.sync_threads()

        mO = cute.make_tensor(out, cute.make_layout((B, p.n), stride=(out_stride, 1)))
        if tidx < R * B:
            r = tidx // B
            i = tidx - r * B
            if i < b:
                total = Float32(0.0)
                for v in cutlass.range_constexpr(p.warps):
                    total = total + partial[v, tidx]
                mO[i, n0 + r] = total.to(self.out_dtype)


def fake_pointer(dtype, align: int = VECTOR_BYTES):
    """A device pointer for ``cute.compile`` without a GPU."""
    return cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def compile_for(kernel, *args, arch: str | None = None, options: str = ""):
    """``cute.compile(kernel, *args)`` for ``arch`` (e.g. ``sm_90a``; by default
    ``CUTE_DSL_ARCH`` or the GPU's), with further ``options`` (e.g. ``remarks{ptx}``)."""
    flags = " ".join(f for f in (options, "" if arch is None else f"--gpu-arch {arch}") if f)
    return cute.compile(kernel, *args, **({"options": flags} if flags else {}))


def compile_fake(gemv, *scratch, arch: str | None = None, options: str = ""):
    """``gemv`` (a GEMV of ``__call__(w, x, out, *scratch, b, x_stride, out_stride,
    stream)``, its ``plan`` and ``weight_dtype`` set) compiled on fake pointers (the
    ``scratch`` ones after out) for ``arch`` (e.g. ``sm_90a``; by default
    ``CUTE_DSL_ARCH`` or the GPU's), with further ``options`` for ``cute.compile``
    (e.g. ``remarks{ptx}``)."""
    dtype, plan = gemv.weight_dtype, gemv.plan
    return compile_for(
        gemv,
        fake_pointer(dtype),
        fake_pointer(BFloat16),
        fake_pointer(dtype, dtype.width // 8),
        *scratch,
        Int32(1),
        Int32(plan.k),
        Int32(plan.n),
        cute.runtime.make_fake_stream(),
        arch=arch,
        options=options,
    )


def compile_gemv(plan: GemvPlan, arch: str | None = None):
    """The compiled kernel of ``plan`` for ``arch`` (e.g. ``sm_90a``; by default
    ``CUTE_DSL_ARCH`` or the GPU's)."""
    return compile_fake(Gemv(plan), arch=arch)
