// The routed experts of one layer for up to 8 rows (MUSE_SPARK.md, "MoE"): two
// kernels, the gate/up GEMM with SwiGLU (experts_up_kernel) and the down GEMM
// (experts_down_kernel), templated on the weight format (FMT 0: bf16, 1: NVFP4).
//
// Every block finds the distinct selected experts this rank holds from the ids on
// the device (in route order of first occurrence, the same list in every block and
// both kernels), then loops over work items (distinct expert, tile of output rows):
// each expert's weights are read once, for all 8 rows of x at a time, by
// mma.sync m16n8k16 (bf16 in, fp32 accumulate): A = 16 weight rows, B = x^T (8 rows).
// A thread loads its own 16 bytes of a weight row (32 NVFP4 codes or 8 bf16 values,
// consecutive k) and feeds them to the MMA in k order permuted within the tensor
// core step; x is loaded with the same permutation, so the sum covers each k once.
// The warps of a block split K; their partial sums are added in warp order through
// shared memory (deterministic).
//
// NVFP4 dequantization (nvfp4.dequantize, as vLLM defines it): for a 16-value block
// with e4m3 scale sc and the expert's fp32 global g, s = fp32(float(sc) * g), each
// value bf16_rne(fp32(e2m1 * s)). The code's magnitude bits placed at fp32 bits 22..24
// make the fp32 number e2m1 * 2^-126 (a subnormal for the codes 0 and 1), and
// s * 2^126 is exact while s < 4 (checked at build), so one fp32 multiply gives
// exactly fp32(e2m1 * s), then one rounding to bf16: the reference's bits.
#include "common.cuh"

#if !defined(P_DIM) || !defined(I_LOCAL) || !defined(FMT) || !defined(TOP_K)
#error "experts.cu needs P_DIM, I_LOCAL, FMT and TOP_K"
#endif

#define MAX_ROUTES 64
#define NB 8  // rows of x per MMA (the n of m16n8k16)
#define WARPS 8
#define NTHREADS (WARPS * 32)

// Elements a thread loads per weight row per 16-byte load, and per chunk of a warp.
constexpr int G = FMT == 1 ? 32 : 8;
constexpr int CHUNK_K = 4 * G;

// Warps along K: as many as keep at least two chunks per warp, at most 8.
__host__ __device__ constexpr int warps_k(int k) {
  return k >= 16 * CHUNK_K ? 8 : (k >= 8 * CHUNK_K ? 4 : (k >= 4 * CHUNK_K ? 2 : 1));
}
constexpr int WK1 = warps_k(P_DIM), WM1 = WARPS / WK1;
constexpr int WK2 = warps_k(I_LOCAL), WM2 = WARPS / WK2;
// Up: an item is 16 * WM1 intermediate columns (gate and up rows); down: 32 * WM2 output rows.
constexpr int TILES1 = I_LOCAL / (16 * WM1);
constexpr int TILES2 = P_DIM / (32 * WM2);
static_assert(P_DIM % (CHUNK_K * WK1) == 0, "P_DIM: a multiple of the chunk times the warps along K");
static_assert(I_LOCAL % (CHUNK_K * WK2) == 0, "I_LOCAL: a multiple of the chunk times the warps along K");
static_assert(I_LOCAL % (16 * WM1) == 0 && P_DIM % (32 * WM2) == 0, "tile widths");

#define MAX_LOCAL 256  // experts a rank may hold (the provider refuses more)

struct Routes {
  int owner[MAX_LOCAL];         // per local expert: its first route (MAX_ROUTES where none)
  int slot[MAX_ROUTES];         // the route's distinct-expert slot, -1 where not held
  int slot_expert[MAX_ROUTES];  // local expert of each slot
  unsigned firsts[MAX_ROUTES / 32];
  int n_slots;
};

// Slots in the order of the experts' first routes: the same in every block.
__device__ void find_experts(const int* __restrict__ ids, int routes, int first_expert, int num_local, Routes& r) {
  const int i = threadIdx.x;
  for (int l = i; l < num_local; l += NTHREADS) r.owner[l] = MAX_ROUTES;
  __syncthreads();
  int l = -1;
  if (i < routes) {
    const int e = ids[i] - first_expert;
    if (e >= 0 && e < num_local) l = e;
  }
  if (l >= 0) atomicMin(&r.owner[l], i);
  __syncthreads();
  const bool first = l >= 0 && r.owner[l] == i;
  if (i < MAX_ROUTES) {
    const unsigned bits = __ballot_sync(0xffffffffu, first);
    if ((i & 31) == 0) r.firsts[i >> 5] = bits;
  }
  __syncthreads();
  if (i < MAX_ROUTES) {
    int slot = -1;
    if (l >= 0) {
      const int owner = r.owner[l];
      slot = __popc(r.firsts[0] & ((owner >= 32) ? 0xffffffffu : ((1u << owner) - 1u)));
      if (owner >= 32) slot += __popc(r.firsts[1] & ((1u << (owner - 32)) - 1u));
      if (first) r.slot_expert[slot] = l;
    }
    r.slot[i] = slot;
    if (i == 0) r.n_slots = __popc(r.firsts[0]) + __popc(r.firsts[1]);
  }
  __syncthreads();
}

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two fp32 -> bf16x2, round to nearest even (lo in the low half).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// float(e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f / 0xff are NaN.
__device__ __forceinline__ float e4m3_to_float(u32 v) {
  const u32 sign = (v & 0x80u) << 24, exp = (v >> 3) & 0xfu, man = v & 7u;
  float mag;
  if ((v & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u | sign);
  if (exp == 0)
    mag = (float)man * 0.001953125f;  // man * 2^-9, exact
  else
    mag = __uint_as_float(((exp + 120u) << 23) | (man << 20));
  return __uint_as_float(__float_as_uint(mag) | sign);
}

// Codes nib and nib + 1 of w, dequantized with s126 = s * 2^126: bf16x2.
__device__ __forceinline__ u32 dequant2(u32 w, int nib, float s126) {
  const u32 c0 = w >> (4 * nib), c1 = w >> (4 * nib + 4);
  const float f0 = __uint_as_float(((c0 & 7u) << 22) | ((c0 & 8u) << 28)) * s126;
  const float f1 = __uint_as_float(((c1 & 7u) << 22) | ((c1 & 8u) << 28)) * s126;
  return pack_bf16x2(f0, f1);
}

// The weights of one expert for one GEMM: rows of K values.
struct Weights {
  const unsigned char* w;      // bf16 [rows, K] or NVFP4 codes [rows, K / 2]
  const unsigned char* scale;  // NVFP4: e4m3 [rows, K / 16]
  float global_lo, global_hi;  // NVFP4: the global scale of rows below / from `split`
  int split;
};

// A warp's 32 rows (two tiles of 16: rows row0[0] + 0..15, row0[1] + 0..15) over its
// K-slice [k0, k0 + K / WK_) against B = x rows (8, row stride xs, rows >= nx read as 0).
template <int K, int WK_>
__device__ __forceinline__ void warp_gemm(const Weights& W, const int row0[2], int k0, const bf16_t* __restrict__ x,
                                          int xs, int nx, float c[2][4]) {
  constexpr int KS = K / WK_;
  constexpr int NC = KS / CHUNK_K;
  constexpr int CB = NC < 4 ? NC : 4;  // chunks loaded together
  static_assert(NC % CB == 0, "chunks per batch");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  constexpr int ROW_BYTES = FMT == 1 ? K / 2 : K * 2;
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[a][e] = 0.f;
  const bf16_t* xr = x + (long)g * xs;
  const bool xrow = g < nx;
#pragma unroll 1
  for (int batch = 0; batch < NC; batch += CB) {
    uint4 q[2][2][CB];
    unsigned short sc[2][2][CB];
    // Every load of the batch first: 16 bytes per row and chunk in flight per thread.
#pragma unroll
    for (int cb = 0; cb < CB; ++cb) {
      const int kb = k0 + (batch + cb) * CHUNK_K + G * t;  // this thread's first k of the chunk
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long row = row0[a] + g + 8 * h;
          const long byte = FMT == 1 ? kb / 2 : kb * 2;
          q[a][h][cb] = __ldg(reinterpret_cast<const uint4*>(W.w + row * ROW_BYTES + byte));
          if (FMT == 1)
            sc[a][h][cb] = __ldg(reinterpret_cast<const unsigned short*>(W.scale + row * (K / 16) + kb / 16));
        }
    }
#pragma unroll
    for (int cb = 0; cb < CB; ++cb) {
      const int kb = k0 + (batch + cb) * CHUNK_K + G * t;
      float s126[2][2][2];
      if (FMT == 1) {
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float glob = row0[a] + g + 8 * h < W.split ? W.global_lo : W.global_hi;
            s126[a][h][0] = (e4m3_to_float(sc[a][h][cb] & 0xffu) * glob) * 0x1p126f;
            s126[a][h][1] = (e4m3_to_float(sc[a][h][cb] >> 8) * glob) * 0x1p126f;
          }
      }
#pragma unroll
      for (int j = 0; j < G / 4; ++j) {
        const int k = kb + 4 * j;
        uint2 bx = make_uint2(0u, 0u);
        if (xrow) bx = __ldg(reinterpret_cast<const uint2*>(xr + k));
#pragma unroll
        for (int a = 0; a < 2; ++a) {
          u32 r[2][2];  // [h][pair]: elements 4j, 4j + 1 and 4j + 2, 4j + 3 of row g + 8h
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 v = q[a][h][cb];
            const u32 words[4] = {v.x, v.y, v.z, v.w};
            if (FMT == 1) {
              const u32 w = words[j >> 1];
              const float s = s126[a][h][j >> 2];
              r[h][0] = dequant2(w, 4 * (j & 1), s);
              r[h][1] = dequant2(w, 4 * (j & 1) + 2, s);
            } else {
              r[h][0] = words[2 * j];
              r[h][1] = words[2 * j + 1];
            }
          }
          mma_bf16(c[a], r[0][0], r[1][0], r[0][1], r[1][1], bx.x, bx.y);
        }
      }
    }
  }
}

// Adds the warps' partial sums over K in warp order; the warp wk == 0 of each wm
// ends with the total in c. `red`: WARPS * 8 * 32 floats.
template <int WK_>
__device__ __forceinline__ void reduce_k(float c[2][4], float* red, int wm, int wk) {
  const int lane = threadIdx.x & 31;
  if (WK_ > 1) {
    __syncthreads();  // red may still be read from the previous item
    float* mine = red + (wm * WK_ + wk) * 8 * 32;
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[(a * 4 + e) * 32 + lane] = c[a][e];
    __syncthreads();
    if (wk == 0) {
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float s = red[(wm * WK_) * 8 * 32 + (a * 4 + e) * 32 + lane];
          for (int w = 1; w < WK_; ++w) s += red[(wm * WK_ + w) * 8 * 32 + (a * 4 + e) * 32 + lane];
          c[a][e] = s;
        }
    }
  }
}

__device__ __forceinline__ float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }

// act[slot][n][i] = bf16(silu(gate) * up), gate and up the GEMM's rows rounded to bf16,
// for the 8 rows n of x (rows >= b of x are zeros). One slot per distinct expert.
extern "C" __global__ void __launch_bounds__(NTHREADS, 2) experts_up_kernel(
    const bf16_t* __restrict__ x, int x_stride, int b,           // [b, P]
    const int* __restrict__ ids, int first_expert, int num_local,  // [b, TOP_K] global ids
    const unsigned char* __restrict__ w13,                         // [E_local, 2I, P] bf16 or [E_local, 2I, P/2]
    const unsigned char* __restrict__ w13_scale,                   // NVFP4: [E_local, 2I, P/16]
    const float* __restrict__ w13_global,                          // NVFP4: [E_local, 2]
    bf16_t* __restrict__ act) {                                    // [slots, 8, I_LOCAL]
  __shared__ Routes routes;
  __shared__ float red[WARPS * 8 * 32];
  pdl_wait();  // x and ids come from the kernels before
  pdl_launch_dependents();
  find_experts(ids, b * TOP_K, first_expert, num_local, routes);
  const int warp = threadIdx.x >> 5, wm = warp / WK1, wk = warp % WK1;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int items = routes.n_slots * TILES1;
  constexpr long EXPERT_BYTES = (long)2 * I_LOCAL * (FMT == 1 ? P_DIM / 2 : P_DIM * 2);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int slot = item / TILES1, tile = item % TILES1;
    const int e = routes.slot_expert[slot];
    const int i0 = (tile * WM1 + wm) * 16;
    Weights W;
    W.w = w13 + e * EXPERT_BYTES;
    W.scale = FMT == 1 ? w13_scale + (long)e * 2 * I_LOCAL * (P_DIM / 16) : nullptr;
    W.global_lo = FMT == 1 ? w13_global[2 * e] : 1.f;
    W.global_hi = FMT == 1 ? w13_global[2 * e + 1] : 1.f;
    W.split = I_LOCAL;
    const int row0[2] = {i0, I_LOCAL + i0};  // gate rows, up rows
    float c[2][4];
    warp_gemm<P_DIM, WK1>(W, row0, wk * (P_DIM / WK1), x, x_stride, b, c);
    reduce_k<WK1>(c, red, wm, wk);
    if (wk == 0) {
#pragma unroll
      for (int e4 = 0; e4 < 4; ++e4) {
        const int i = i0 + g + 8 * (e4 >> 1), n = 2 * t + (e4 & 1);
        const float gate = round_bf16(c[0][e4]), up = round_bf16(c[1][e4]);
        const float silu = gate / (1.0f + expf(-gate));
        act[((long)slot * NB + n) * I_LOCAL + i] = float_to_bf16(silu * up);
      }
    }
  }
}

// rows[r, j, :] = bf16(act[slot(r, j)][r] @ W2[e]^T) for the held routes; zeros for
// routes to experts this rank does not hold.
extern "C" __global__ void __launch_bounds__(NTHREADS, 2) experts_down_kernel(
    const bf16_t* __restrict__ act, int b,                         // [slots, 8, I_LOCAL]
    const int* __restrict__ ids, int first_expert, int num_local,  // [b, TOP_K]
    const unsigned char* __restrict__ w2,                          // [E_local, P, I] bf16 or [E_local, P, I/2]
    const unsigned char* __restrict__ w2_scale,                    // NVFP4: [E_local, P, I/16]
    const float* __restrict__ w2_global,                           // NVFP4: [E_local]
    bf16_t* __restrict__ rows) {                                   // [b, TOP_K, P]
  __shared__ Routes routes;
  __shared__ float red[WARPS * 8 * 32];
  // The ids were final before the up kernel passed its wait (and let this one start),
  // so the experts are found, and their weights loaded, before this kernel's wait.
  find_experts(ids, b * TOP_K, first_expert, num_local, routes);
  const int warp = threadIdx.x >> 5, wm = warp / WK2, wk = warp % WK2;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n_slots = routes.n_slots;
  const int items = (n_slots > 0 ? n_slots : 1) * TILES2;
  constexpr long EXPERT_BYTES = (long)P_DIM * (FMT == 1 ? I_LOCAL / 2 : I_LOCAL * 2);
  // Warm the first item's weights into L2 before waiting for act.
  if (n_slots > 0 && (int)blockIdx.x < items) {
    const int e = routes.slot_expert[blockIdx.x / TILES2];
    const int p0 = (blockIdx.x % TILES2) * WM2 * 32;
    constexpr int ROW_BYTES = FMT == 1 ? I_LOCAL / 2 : I_LOCAL * 2;
    const unsigned char* base = w2 + e * EXPERT_BYTES + (long)p0 * ROW_BYTES;
    for (int off = threadIdx.x * 128; off < WM2 * 32 * ROW_BYTES; off += NTHREADS * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off));
  }
  pdl_wait();
  pdl_launch_dependents();
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int slot = item / TILES2, tile = item % TILES2;
    const int p0 = (tile * WM2 + wm) * 32;
    float c[2][4];
    if (n_slots > 0) {
      const int e = routes.slot_expert[slot];
      Weights W;
      W.w = w2 + e * EXPERT_BYTES;
      W.scale = FMT == 1 ? w2_scale + (long)e * P_DIM * (I_LOCAL / 16) : nullptr;
      W.global_lo = W.global_hi = FMT == 1 ? w2_global[e] : 1.f;
      W.split = P_DIM;
      const int row0[2] = {p0, p0 + 16};
      warp_gemm<I_LOCAL, WK2>(W, row0, wk * (I_LOCAL / WK2), act + (long)slot * NB * I_LOCAL, I_LOCAL, NB, c);
      reduce_k<WK2>(c, red, wm, wk);
    }
    if (wk != 0) continue;
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int e4 = 0; e4 < 4; ++e4) {
        const int p = p0 + 16 * a + g + 8 * (e4 >> 1), n = 2 * t + (e4 & 1);
        if (n >= b) continue;
        const bf16_t v = n_slots > 0 ? float_to_bf16(c[a][e4]) : (bf16_t)0;
        for (int j = 0; j < TOP_K; ++j) {
          const int route = n * TOP_K + j;
          const int rs = routes.slot[route];
          if (n_slots > 0 && rs == slot)
            rows[(long)route * P_DIM + p] = v;
          else if (rs < 0 && slot == 0)
            rows[(long)route * P_DIM + p] = 0;
        }
      }
  }
}
