// The MoE's small kernels (MUSE_SPARK.md, "MoE"): routing, the pre-expert norm and
// the tail. The GEMMs (router, pooler, experts, unpooler) run elsewhere.
#include "common.cuh"

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
    // This lane's best (highest score, lowest index among equals), then the warp's.
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
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float o = __shfl_xor_sync(0xffffffffu, best, offset);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, offset);
      const float op = __shfl_xor_sync(0xffffffffu, best_p, offset);
      if (o > best || (o == best && oe < best_e)) {
        best = o;
        best_e = oe;
        best_p = op;
      }
    }
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

// bf16 out = bf16(rms(x, eps) * (w + center)), one block per row of WIDTH.
extern "C" __global__ void __launch_bounds__(THREADS) rmsnorm_kernel(
    const bf16_t* __restrict__ x, int x_stride, const bf16_t* __restrict__ weight, float eps, float center,
    bf16_t* __restrict__ out) {
  __shared__ float scratch[32];
  const int row = blockIdx.x, base = threadIdx.x * ITEMS;
  float w[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) w[i] = bf16_to_float(weight[base + i]) + center;
  pdl_launch_dependents();
  pdl_wait();
  const bf16_t* xr = x + (long)row * x_stride;
  float v[ITEMS], sq = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    v[i] = bf16_to_float(xr[base + i]);
    sq += v[i] * v[i];
  }
  const float inv = rsqrtf(block_sum<THREADS>(sq, scratch) / (float)WIDTH + eps);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) out[(long)row * WIDTH + base + i] = float_to_bf16(v[i] * inv * w[i]);
}

// The tail, one block per row: m = bf16(sum_j w[j] * rms(y_j * (1 + n), eps)), the
// per-route norms and the sum in fp32, slots summed in order 0..k-1.
extern "C" __global__ void __launch_bounds__(THREADS) tail_kernel(
    const bf16_t* __restrict__ rows,      // [b, k, WIDTH] route rows
    const float* __restrict__ weights,    // [b, k]
    const bf16_t* __restrict__ norm,      // [WIDTH] post_expert_norm (delta around 1)
    float eps, int top_k,
    bf16_t* __restrict__ out) {           // [b, WIDTH]
  __shared__ float scratch[32];
  const int row = blockIdx.x, base = threadIdx.x * ITEMS;
  float n[ITEMS], total[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) n[i] = bf16_to_float(norm[base + i]) + 1.0f;
  pdl_launch_dependents();
  pdl_wait();
  for (int j = 0; j < top_k; ++j) {
    const bf16_t* y = rows + ((long)row * top_k + j) * WIDTH;
    float v[ITEMS], sq = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      v[i] = bf16_to_float(y[base + i]) * n[i];
      sq += v[i] * v[i];
    }
    const float inv = rsqrtf(block_sum<THREADS>(sq, scratch) / (float)WIDTH + eps);
    const float wj = weights[row * top_k + j];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const float c = v[i] * inv * wj;
      total[i] = j == 0 ? c : total[i] + c;
    }
  }
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) out[(long)row * WIDTH + base + i] = float_to_bf16(total[i]);
}
