// The MoE's small kernels (MUSE_SPARK.md, "MoE"): routing, the pre-expert norm and
// the tail. The GEMMs (router, pooler, experts, unpooler) run elsewhere.
// tail_all_reduce_kernel (TP > 1): the tail with its reduction fused, one Lamport
// call (lamport.cuh): under expert TP the route rows all-reduced before the norms,
// under EP the output all-reduced after the sum, each rounded to bf16 as the
// reference transport rounds.
#include "lamport.cuh"

#ifndef WIDTH
#define WIDTH 4096
#endif
#ifndef THREADS
#define THREADS 512
#endif
#define ITEMS (WIDTH / THREADS)

// Routing, one warp per row, EXPERTS <= 32 * EPL:
//   p = sigmoid(z); the top-k of p + bias, ties to the lowest expert index;
//   w = p[idx] * (scaling / (sum of p[idx] in selection order + eps)).
#ifndef EXPERTS
#define EXPERTS 256
#endif
#define EPL ((EXPERTS + 31) / 32)

// An unsigned key ordered as the float f (not NaN) compares: -0 and +0 equal.
__device__ __forceinline__ unsigned order_key(float f) {
  unsigned u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

extern "C" __global__ void __launch_bounds__(32) routing_kernel(
    const float* __restrict__ logits, int logits_stride,  // [b, E] fp32 (output multiplier folded)
    const float* __restrict__ bias,                       // [E]
    int* __restrict__ ids, float* __restrict__ weights,   // [b, k]
    int top_k, float scaling, float eps) {
  const int row = blockIdx.x, lane = threadIdx.x;
  float b_[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    b_[i] = e < EXPERTS ? bias[e] : 0.f;
  }
  pdl_launch_dependents();
  pdl_wait();
  float p[EPL], s[EPL];
  const float* z = logits + (long)row * logits_stride;
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < EXPERTS ? 1.0f / (1.0f + expf(-z[e])) : 0.f;
    s[i] = e < EXPERTS ? p[i] + b_[i] : -__int_as_float(0x7f800000);
  }
  float total = 0.f, chosen_p = 0.f;
  int chosen = 0;
  for (int j = 0; j < top_k; ++j) {
    // This lane's best (highest score, lowest index among equals), then the warp's by two
    // redux.sync reductions (the highest score's order key, then the lowest expert index
    // holding it) and one shuffle of its probability: scores compared as floats, ties to
    // the lowest index, a NaN never chosen.
    float best = -__int_as_float(0x7f800000), best_p = 0.f;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const int e = lane + 32 * i;
      if (e < EXPERTS && (s[i] > best || (s[i] == best && e < best_e))) {
        best = s[i];
        best_e = e;
        best_p = p[i];
      }
    }
    // A lane's best is never NaN (a NaN never compares above); with no candidate it is
    // (-inf, INT_MAX, 0).
    const unsigned key = order_key(best);
    const unsigned top = __reduce_max_sync(0xffffffffu, key);
    best_e = (int)__reduce_min_sync(0xffffffffu, key == top ? (unsigned)best_e : 0xffffffffu);
    best_p = __shfl_sync(0xffffffffu, best_p, best_e & 31);  // expert e lives in lane e % 32
    if (lane == j) {
      chosen = best_e;
      chosen_p = best_p;
    }
    total += best_p;
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      if (lane + 32 * i == best_e) s[i] = -__int_as_float(0x7f800000);
  }
  const float inv = scaling / (total + eps);
  if (lane < top_k) {
    ids[row * top_k + lane] = chosen;
    weights[row * top_k + lane] = chosen_p * inv;
  }
}

// The norm's weight (w + center) at a thread's 8 values: it does not depend on the kernel
// before, so it is read before the PDL wait.
__device__ __forceinline__ void norm_weight(const bf16_t* __restrict__ weight, int base, float center,
                                            float (&w)[ITEMS]) {
  load_bf16x8(weight + base, w);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) w[i] += center;
}

// bf16(rms(v, eps) * w) of a row, stored at out's row.
__device__ __forceinline__ void norm_row(const float (&v)[ITEMS], const float (&w)[ITEMS], float eps,
                                         float* scratch, bf16_t* __restrict__ out, int row, int base) {
  float sq = 0.f, o[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) sq += v[i] * v[i];
  const float inv = rsqrtf(block_sum<THREADS>(sq, scratch) / (float)WIDTH + eps);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) o[i] = v[i] * inv * w[i];
  store_bf16x8(out + (long)row * WIDTH + base, o);
}

// bf16 out = bf16(rms(x, eps) * (w + center)), one block per row of WIDTH (16-byte
// loads and stores of a thread's 8 values).
extern "C" __global__ void __launch_bounds__(THREADS) rmsnorm_kernel(
    const bf16_t* __restrict__ x, int x_stride, const bf16_t* __restrict__ weight, float eps, float center,
    bf16_t* __restrict__ out) {
  static_assert(ITEMS == 8, "8 values a thread");
  __shared__ float scratch[32];
  const int row = blockIdx.x, base = threadIdx.x * ITEMS;
  float w[ITEMS];
  norm_weight(weight, base, center, w);
  pdl_launch_dependents();
  pdl_wait();
  float v[ITEMS];
  load_bf16x8(x + (long)row * x_stride + base, v);
  norm_row(v, w, eps, scratch, out, row, base);
}

#if ITEMS == 8
// rmsnorm_columns_kernel (TP > 1, a column-sharded pooler): rmsnorm_kernel on the row
// exchanged from every rank's [b, WIDTH / tp] column block over the Lamport mailbox
// (lamport_column_vector; pushed unless `published`), one kernel where the column gather
// and the norm were two: the same bits.
extern "C" __global__ void __launch_bounds__(THREADS) rmsnorm_columns_kernel(
    const bf16_t* __restrict__ block, int block_stride, const bf16_t* __restrict__ weight, float eps, float center,
    bf16_t* __restrict__ out, int published, const u64* __restrict__ peers, int* __restrict__ control, int rank,
    int tp, long long cap) {
  __shared__ float scratch[32];
  const int row = blockIdx.x, base = threadIdx.x * ITEMS;
  float w[ITEMS];
  norm_weight(weight, base, center, w);
  pdl_launch_dependents();
  pdl_wait();
  const Lamport l = lamport_begin(peers, control, rank, tp, cap);
  float v[ITEMS];
  unpack_bf16x8(lamport_column_vector(l, block, block_stride, row, base, WIDTH, published), v);
  norm_row(v, w, eps, scratch, out, row, base);
  lamport_end(l);
}
#endif

// The tail, one block per row: m = bf16(sum_j w[j] * rms(y_j * (1 + n), eps)), the
// per-route norms and the sum in fp32, slots summed in order 0..k-1. The routes go
// TAIL_GROUP at a time: their rows loaded together (16 bytes a thread each) and their
// sums of squares reduced together (block_sums: each one block_sum's bits).
#ifndef TAIL_GROUP
#define TAIL_GROUP 8
#endif
#ifndef TOP_K
#define TOP_K 8
#endif
__device__ __forceinline__ void tail_row(const bf16_t* __restrict__ rows, const float* __restrict__ weights,
                                         const float (&n)[ITEMS], float eps, int row, int base,
                                         float* scratch, float (&total)[ITEMS]) {
  static_assert(ITEMS == 8, "8 values a thread");
#pragma unroll
  for (int j0 = 0; j0 < TOP_K; j0 += TAIL_GROUP) {
    // The group's rows stay packed (4 registers a route) between the two passes.
    uint4 y[TAIL_GROUP];
    float sq[TAIL_GROUP], wj[TAIL_GROUP];
#pragma unroll
    for (int g = 0; g < TAIL_GROUP; ++g) {
      sq[g] = 0.f;
      wj[g] = 0.f;
      y[g] = make_uint4(0u, 0u, 0u, 0u);
      if (j0 + g < TOP_K) {
        y[g] = *(const uint4*)(rows + ((long)row * TOP_K + j0 + g) * WIDTH + base);
        wj[g] = weights[row * TOP_K + j0 + g];
      }
    }
#pragma unroll
    for (int g = 0; g < TAIL_GROUP; ++g) {
      float v[ITEMS];
      unpack_bf16x8(y[g], v);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        v[i] *= n[i];
        sq[g] += v[i] * v[i];
      }
    }
    block_sums<THREADS, TAIL_GROUP>(sq, scratch);
#pragma unroll
    for (int g = 0; g < TAIL_GROUP; ++g) {
      if (j0 + g < TOP_K) {
        const float inv = rsqrtf(sq[g] / (float)WIDTH + eps);
        float v[ITEMS];
        unpack_bf16x8(y[g], v);
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          const float c = v[i] * n[i] * inv * wj[g];
          total[i] = j0 + g == 0 ? c : total[i] + c;
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) tail_kernel(
    const bf16_t* __restrict__ rows,      // [b, k, WIDTH] route rows
    const float* __restrict__ weights,    // [b, k]
    const bf16_t* __restrict__ norm,      // [WIDTH] post_expert_norm (delta around 1)
    float eps,
    bf16_t* __restrict__ out) {           // [b, WIDTH]
  __shared__ float scratch[TAIL_GROUP * 32];
  const int row = blockIdx.x, base = threadIdx.x * ITEMS;
  float n[ITEMS], total[ITEMS];
  load_bf16x8(norm + base, n);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) n[i] += 1.0f;
  pdl_launch_dependents();
  pdl_wait();
  tail_row(rows, weights, n, eps, row, base, scratch, total);
  store_bf16x8(out + (long)row * WIDTH + base, total);
}

#if ITEMS == 8
// reduce_rows (expert TP): each route row of this block all-reduced in place first
// (each thread its own 16 bytes of every route, which only it reads after), then the
// tail; otherwise (EP) the tail, then its bf16 output all-reduced.
extern "C" __global__ void __launch_bounds__(THREADS) tail_all_reduce_kernel(
    bf16_t* __restrict__ rows, const float* __restrict__ weights, const bf16_t* __restrict__ norm, float eps,
    bf16_t* __restrict__ out, int reduce_rows, const u64* __restrict__ peers, int* __restrict__ control,
    int rank, int tp, long long cap) {
  __shared__ float scratch[TAIL_GROUP * 32];
  const int row = blockIdx.x, base = threadIdx.x * ITEMS;
  float n[ITEMS], total[ITEMS];
  load_bf16x8(norm + base, n);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) n[i] += 1.0f;
  pdl_launch_dependents();
  pdl_wait();
  const Lamport l = lamport_begin(peers, control, rank, tp, cap);
  if (reduce_rows) {
    // Push every route first, then gather: a rank never waits holding a block unsent.
    for (int j = 0; j < TOP_K; ++j) {
      const long long offset = ((long long)row * TOP_K + j) * WIDTH + base;
      lamport_push(l, offset, *(const uint4*)(rows + offset));
    }
    for (int j = 0; j < TOP_K; ++j) {
      const long long offset = ((long long)row * TOP_K + j) * WIDTH + base;
      float acc[8];
      lamport_sum(l, offset, *(const uint4*)(rows + offset), acc);
      *(uint4*)(rows + offset) = pack_bf16x8(acc);
    }
  }
  tail_row(rows, weights, n, eps, row, base, scratch, total);
  bf16_t* orow = out + (long)row * WIDTH + base;
  if (reduce_rows) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) orow[i] = float_to_bf16(total[i]);
  } else {
    const long long offset = (long long)row * WIDTH + base;
    const uint4 local = pack_bf16x8(total);
    lamport_push(l, offset, local);
    float acc[8];
    lamport_sum(l, offset, local, acc);
    *(uint4*)orow = pack_bf16x8(acc);
  }
  lamport_end(l);
}
#endif
