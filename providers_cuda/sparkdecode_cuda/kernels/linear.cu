// The dense GEMMs of the step (sub-op `linear`): out[b, N] = x[b, K] @ W^T for up to
// 8 rows of x, W bf16 [N, K] (out bf16) or the fp32 router (out fp32), streamed once
// by tensor-core MMA: mma.sync m16n8k16 with A = 16 weight rows, B = x^T (its 8 rows
// the n of the MMA, rows >= b zeros), fp32 accumulators.
//
// Work: a CTA (8 warps) owns R = 16 * TM * WM output rows and a K-slice of K / SPLITS.
// Its warps are WM along the rows (TM tiles of 16 each) times WK = 8 / WM along the
// slice. The SPLITS CTAs of one row block are a thread-block cluster: their partial
// sums meet in distributed shared memory, so no global workspace and no counters.
//
// Loads: a thread loads 16 bytes of a weight row a time (8 bf16 or 4 fp32 values of
// consecutive k; lane l = 4g + t takes row g (and g + 8) at k 8t (4t) of a chunk of
// 32 (16) k), DEPTH chunks of its 2 * TM rows in flight before any is used; weights
// bypass L1. The first batch is issued before griddepcontrol.wait: the weights are
// constant, only x comes from the kernel before. x's slice is staged once per CTA in
// shared memory (rows padded so a warp's B fragments load without bank conflicts);
// its values follow the same k permutation inside the tensor core step as the
// weights, so every k is summed once.
//
// The fp32 router: each weight w = hi + mid + lo exactly (three bf16, each the
// round-to-nearest of what is left; exact for |w| >= 2^-109, where no part is below
// bf16's subnormals), so bf16 MMAs with fp32 accumulation multiply the fp32 weights
// exactly; mid and lo accumulate apart from hi and are added to it once at the end.
//
// Sums, in a fixed order: within a warp the MMA's fp32 accumulation over its k;
// then per output value the (rank, warp-along-K) partials in rank order, then warp
// order; one rounding to bf16 (fp32 out for the router). The same bits every run.
//
// PUBLISH (bf16 only; 0 when absent): the epilogue also publishes its output into the
// Lamport mailbox (lamport.cuh) for the next kernel to gather: each thread rounds 8
// consecutive output columns of one row of x (the same sums and roundings), stores
// them as 16 bytes and pushes them to slot (g, rank) of every peer at element
// row * N_DIM + column, g being the generation the consumer reads next (this kernel
// does not advance it; the consumer does). The o_proj partial's producer for
// cuda.attention_boundary at TP > 1 (lamport.py, "Publishing from a producer").
#ifndef PUBLISH
#define PUBLISH 0
#endif
#if PUBLISH
#include "lamport.cuh"
#else
#include "common.cuh"
#endif

#if !defined(N_DIM) || !defined(K_DIM) || !defined(TM) || !defined(WM) || !defined(SPLITS) || !defined(DEPTH) || \
    !defined(W_FP32)
#error "linear.cu needs N_DIM, K_DIM, TM, WM, SPLITS, DEPTH and W_FP32"
#endif

#define NTHREADS 256
#define WARPS 8
#define NB 8  // rows of x: the n of m16n8k16

constexpr int WK = WARPS / WM;              // warps along K
constexpr int R = 16 * TM * WM;             // output rows of a CTA
constexpr int VK = W_FP32 ? 4 : 8;          // k per 16-byte weight load
constexpr int CK = 4 * VK;                  // k of a chunk (the 4 lanes of a row)
constexpr int KS = K_DIM / SPLITS;          // a CTA's K-slice
constexpr int KW = KS / WK;                 // a warp's K-slice
constexpr int NC = KW / CK;                 // chunks a warp
constexpr int XPAD = W_FP32 ? 16 : 32;      // bf16 elements between x rows in shared memory past KS
constexpr int XROW = KS + XPAD;             // x's row pitch in shared memory (elements)
static_assert(WM * WK == WARPS, "warps");
static_assert(N_DIM % R == 0, "N: a multiple of the CTA's rows");
static_assert(K_DIM % (SPLITS * WK * CK * DEPTH) == 0 && NC % DEPTH == 0, "K: whole batches of chunks");
static_assert(R % SPLITS == 0, "rows shared out over the cluster");
static_assert(KS % 8 == 0, "x staged in 16-byte vectors");
static_assert(!PUBLISH || (!W_FP32 && (R / SPLITS) % 8 == 0), "published: bf16, 16-byte vectors of a CTA's rows");

// A 16-byte weight load that leaves L1 alone (each weight byte is read once).
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// fp32 pair (v0, v1) -> three bf16x2 parts hi, mid, lo with v = hi + mid + lo exactly.
__device__ __forceinline__ void split3(float v0, float v1, u32& hi, u32& mid, u32& lo) {
  hi = pack_bf16x2(v0, v1);
  v0 = v0 - __uint_as_float(hi << 16);
  v1 = v1 - __uint_as_float(hi & 0xffff0000u);
  mid = pack_bf16x2(v0, v1);
  v0 = v0 - __uint_as_float(mid << 16);
  v1 = v1 - __uint_as_float(mid & 0xffff0000u);
  lo = pack_bf16x2(v0, v1);
}

__device__ __forceinline__ void cluster_sync() {
#if SPLITS > 1
  cluster_barrier();
#else
  __syncthreads();
#endif
}

// red[i] of the cluster's CTA `rank` (this CTA's own when SPLITS == 1).
__device__ __forceinline__ float load_partial(const float* red, int i, int rank) {
#if SPLITS > 1
  return cluster_load_f32(red + i, rank);
#else
  return red[i];
#endif
}

__device__ __forceinline__ int cluster_rank() {
#if SPLITS > 1
  return cluster_ctarank();
#else
  return 0;
#endif
}

// The weight loads of one batch (DEPTH chunks from chunk c0) of a warp: its TM tiles'
// rows g and g + 8.
__device__ __forceinline__ void load_batch(uint4 (&q)[DEPTH][TM][2], const unsigned char* w, int c0) {
  constexpr long ROW_BYTES = (long)K_DIM * (W_FP32 ? 4 : 2);
#pragma unroll
  for (int d = 0; d < DEPTH; ++d)
#pragma unroll
    for (int a = 0; a < TM; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        q[d][a][h] = load_stream(w + (long)(16 * a + 8 * h) * ROW_BYTES + (long)(c0 + d) * CK * (W_FP32 ? 4 : 2));
}

// Output value (n, row) of the CTA's block: the cluster's partials in rank order, then
// warp order.
__device__ __forceinline__ float output_sum(const float* red, int n, int row) {
  float p[SPLITS * WK];
#pragma unroll
  for (int src = 0; src < SPLITS; ++src)
#pragma unroll
    for (int v = 0; v < WK; ++v) p[src * WK + v] = load_partial(red, (v * NB + n) * R + row, src);
  float s = p[0];
#pragma unroll
  for (int j = 1; j < SPLITS * WK; ++j) s += p[j];
  return s;
}

#if W_FP32
#define OUT_T float
#else
#define OUT_T bf16_t
#endif

// One CTA: rows [R * (blockIdx.x / SPLITS), + R), K-slice of its cluster rank.
extern "C" __global__ void __launch_bounds__(NTHREADS, 2)
#if SPLITS > 1
    __cluster_dims__(SPLITS, 1, 1)
#endif
        linear_kernel(const unsigned char* __restrict__ w,  // [N, K] bf16 or fp32, rows contiguous
                      const bf16_t* __restrict__ x, int x_stride, int b,  // [b, K]
                      OUT_T* __restrict__ out, int out_stride             // [b, N]
#if PUBLISH
                      ,
                      const u64* __restrict__ peers, int* __restrict__ control, int tp_rank, int tp, long long cap
#endif
        ) {
  __shared__ __align__(16) bf16_t xs[NB * XROW];
  __shared__ float red[WK * NB * R];  // [wk][n][row]: the warps' partials
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wm = warp / WK, wk = warp % WK;
  const int rank = cluster_rank();
  const int row0 = (blockIdx.x / SPLITS) * R + wm * 16 * TM;
  const int kx = wk * KW;  // the warp's first k within the CTA's slice
  const int k0 = rank * KS + kx;
  const unsigned char* wt = w + ((long)(row0 + g) * K_DIM + k0 + VK * t) * (W_FP32 ? 4 : 2);

  uint4 q[DEPTH][TM][2];
  load_batch(q, wt, 0);  // before the wait: the weights do not depend on the kernel before
  pdl_wait();
  pdl_launch_dependents();

  // x's slice into shared memory, rows >= b zeros.
  {
    const bf16_t* xk = x + rank * KS;
    const bool vec = ((reinterpret_cast<unsigned long long>(xk) | (unsigned long long)x_stride * 2) & 15) == 0;
    constexpr int VECS = NB * KS / 8;
#pragma unroll 4
    for (int i = threadIdx.x; i < VECS; i += NTHREADS) {
      const int n = i / (KS / 8), k = (i % (KS / 8)) * 8;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (n < b) {
        const bf16_t* src = xk + (long)n * x_stride + k;
        if (vec) {
          v = __ldg(reinterpret_cast<const uint4*>(src));
        } else {
          u32 e[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) e[j] = __ldg(reinterpret_cast<const unsigned short*>(src) + j);
          v = make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
        }
      }
      *reinterpret_cast<uint4*>(xs + n * XROW + k) = v;
    }
  }
  __syncthreads();

  float c[TM][4], cl[TM][4];  // cl: the router's mid and lo parts
#pragma unroll
  for (int a = 0; a < TM; ++a)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[a][e] = cl[a][e] = 0.f;
  const bf16_t* xrow = xs + g * XROW + kx + VK * t;

#pragma unroll 1
  for (int batch = 0; batch < NC; batch += DEPTH) {
    if (batch > 0) load_batch(q, wt, batch);
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int kc = (batch + d) * CK;
#if W_FP32
      // One MMA step: k 4t, 4t + 1 in the A/B slots of k 2t, 2t + 1; 4t + 2, 4t + 3 in 2t + 8, 2t + 9.
      const uint2 bx = *reinterpret_cast<const uint2*>(xrow + kc);
#pragma unroll
      for (int a = 0; a < TM; ++a) {
        const uint4 r0 = q[d][a][0], r1 = q[d][a][1];
        u32 h0, m0, l0, h1, m1, l1, h2, m2, l2, h3, m3, l3;
        split3(__uint_as_float(r0.x), __uint_as_float(r0.y), h0, m0, l0);  // row g, k 4t, 4t + 1
        split3(__uint_as_float(r1.x), __uint_as_float(r1.y), h1, m1, l1);  // row g + 8
        split3(__uint_as_float(r0.z), __uint_as_float(r0.w), h2, m2, l2);  // row g, k 4t + 2, 4t + 3
        split3(__uint_as_float(r1.z), __uint_as_float(r1.w), h3, m3, l3);  // row g + 8
        mma_bf16(cl[a], l0, l1, l2, l3, bx.x, bx.y);
        mma_bf16(cl[a], m0, m1, m2, m3, bx.x, bx.y);
        mma_bf16(c[a], h0, h1, h2, h3, bx.x, bx.y);
      }
#else
      // Two MMA steps: k 8t + 4j .. 4j + 3 (j = 0, 1) as in experts.cu.
      const uint4 bx = *reinterpret_cast<const uint4*>(xrow + kc);
#pragma unroll
      for (int a = 0; a < TM; ++a) {
        const uint4 r0 = q[d][a][0], r1 = q[d][a][1];
        mma_bf16(c[a], r0.x, r1.x, r0.y, r1.y, bx.x, bx.y);
        mma_bf16(c[a], r0.z, r1.z, r0.w, r1.w, bx.z, bx.w);
      }
#endif
    }
  }

  // The warp's partials: element e of tile a is row 16a + g + 8 (e >> 1), n = 2t + (e & 1).
#pragma unroll
  for (int a = 0; a < TM; ++a)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = wm * 16 * TM + 16 * a + g + 8 * (e >> 1), n = 2 * t + (e & 1);
      red[(wk * NB + n) * R + row] = W_FP32 ? c[a][e] + cl[a][e] : c[a][e];
    }
  cluster_sync();  // every partial of the cluster written
  // This rank's share of the block's rows: R / SPLITS rows x the b rows of x.
  constexpr int ROWS = R / SPLITS;
#if PUBLISH
  const Lamport l = lamport_begin(peers, control, tp_rank, tp, cap);
  for (int i = threadIdx.x; i < ROWS / 8 * NB; i += NTHREADS) {
    const int n = i / (ROWS / 8), row = rank * ROWS + i % (ROWS / 8) * 8;
    if (n >= b) continue;
    u32 h[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      h[j] = (u32)float_to_bf16(output_sum(red, n, row + 2 * j)) |
             (u32)float_to_bf16(output_sum(red, n, row + 2 * j + 1)) << 16;
    const uint4 v = make_uint4(h[0], h[1], h[2], h[3]);
    const long col = (long)(blockIdx.x / SPLITS) * R + row;
    *reinterpret_cast<uint4*>(out + (long)n * out_stride + col) = v;
    lamport_push(l, (long long)n * N_DIM + col, v);
  }
#else
  for (int i = threadIdx.x; i < ROWS * NB; i += NTHREADS) {
    const int n = i / ROWS, row = rank * ROWS + i % ROWS;
    if (n >= b) continue;
    const float s = output_sum(red, n, row);
    const long o = (long)n * out_stride + (blockIdx.x / SPLITS) * R + row;
#if W_FP32
    out[o] = s;
#else
    out[o] = float_to_bf16(s);
#endif
  }
#endif
#if SPLITS > 1
  cluster_sync();  // no CTA leaves while another still reads its partials
#endif
}
