// The boundaries of the step, one kernel each, one block per row, the fp32 stream
// updated in place (MUSE_SPARK.md, "Norms", "Residual gate", "One decode step"):
//
//   branch = post_norm(x)                  (by MODE)
//   s      = alpha * s + beta * branch     (fp32; the branch is not rounded)
//   out    = bf16(next_norm(s))            (pre-norm (1 + w), or model.norm (w as stored))
//   aux    = s                             (when the drafter reads this layer's stream)
//
// MODE 0: the front from embedding rows (s = rms(x, eps_post), no gated add);
// MODE 1: the front from bf16 normed embeddings (s = fp32(x));
// MODE 2: input boundary / final boundary: branch = rms(x * (1 + w_post), eps_post);
// MODE 3: attention boundary: branch = rms(x, eps_post) (weightless post_attn_norm).
// Compile-time: H (width), THREADS (block size); each thread holds H / THREADS
// consecutive values in registers.
//
// attention_boundary_all_reduce_kernel (TP > 1): MODE 3 on the one-shot all-reduce
// of every rank's bf16 o_proj partial (lamport.cuh), rounded to bf16 once as the
// reference transport rounds, then the same code as boundary_kernel. `published`: the
// o_proj GEMM has pushed this rank's partial to the peers from its epilogue
// (linear.cu's PUBLISH), so this kernel only gathers; else it pushes first.
#include "lamport.cuh"

#ifndef H
#error "define H"
#endif
#ifndef THREADS
#define THREADS 256
#endif
#define ITEMS (H / THREADS)

// From the post-norm's input (v: x * post weight, sq: its sum of squares) to the
// stream, aux and the next pre-norm of one row.
__device__ __forceinline__ void boundary_row(float (&v)[ITEMS], float sq, int mode, int row, int base,
                                             float* __restrict__ stream, bf16_t* __restrict__ out,
                                             float* __restrict__ aux, const float (&a)[ITEMS],
                                             const float (&bt)[ITEMS], const float (&wn)[ITEMS],
                                             float eps_post, float eps_next, float* scratch) {
  float* sr = stream + (long)row * H;
  if (mode != 1) {
    const float inv = rsqrtf(block_sum<THREADS>(sq, scratch) / (float)H + eps_post);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) v[i] *= inv;
  }
  if (mode >= 2) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) v[i] = a[i] * sr[base + i] + bt[i] * v[i];
  }
  sq = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    sr[base + i] = v[i];
    sq += v[i] * v[i];
  }
  if (aux != nullptr) {
    float* ar = aux + (long)row * H;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) ar[base + i] = v[i];
  }
  const float inv = rsqrtf(block_sum<THREADS>(sq, scratch) / (float)H + eps_next);
  bf16_t* orow = out + (long)row * H;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) orow[base + i] = float_to_bf16(v[i] * inv * wn[i]);
}

extern "C" __global__ void __launch_bounds__(THREADS) boundary_kernel(
    const bf16_t* __restrict__ x, int x_stride,        // [b, H] branch (or embeddings)
    float* __restrict__ stream,                        // [b, H] fp32, in place
    bf16_t* __restrict__ out,                          // [b, H]
    float* __restrict__ aux,                           // [b, H] or null
    const bf16_t* __restrict__ post_weight,            // [H] (MODE 2) or null
    const float* __restrict__ alpha,                   // [H] (MODE 2, 3)
    const float* __restrict__ beta,                    // [H]
    const bf16_t* __restrict__ next_weight,            // [H]
    float eps_post, float eps_next, float next_center, int mode) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  const int base = threadIdx.x * ITEMS;
  // Weights do not depend on the previous kernel: read them before the PDL wait.
  float wn[ITEMS], wp[ITEMS], a[ITEMS], bt[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    wn[i] = bf16_to_float(next_weight[base + i]) + next_center;
    wp[i] = (mode == 2) ? bf16_to_float(post_weight[base + i]) + 1.0f : 1.0f;
    a[i] = (mode >= 2) ? alpha[base + i] : 0.f;
    bt[i] = (mode >= 2) ? beta[base + i] : 0.f;
  }
  pdl_launch_dependents();
  pdl_wait();

  float v[ITEMS];
  const bf16_t* xr = x + (long)row * x_stride;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    v[i] = bf16_to_float(xr[base + i]) * wp[i];
    sq += v[i] * v[i];
  }
  boundary_row(v, sq, mode, row, base, stream, out, aux, a, bt, wn, eps_post, eps_next, scratch);
}

#if ITEMS == 8
extern "C" __global__ void __launch_bounds__(THREADS) attention_boundary_all_reduce_kernel(
    const bf16_t* __restrict__ partial, int partial_stride,  // [b, H] this rank's o_proj partial
    float* __restrict__ stream,                               // [b, H] fp32, in place
    bf16_t* __restrict__ out,                                 // [b, H]
    const float* __restrict__ alpha, const float* __restrict__ beta,
    const bf16_t* __restrict__ next_weight, float eps_post, float eps_next,
    int published, const u64* __restrict__ peers, int* __restrict__ control, int rank, int tp, long long cap) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  const int base = threadIdx.x * ITEMS;
  float wn[ITEMS], a[ITEMS], bt[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    wn[i] = bf16_to_float(next_weight[base + i]) + 1.0f;
    a[i] = alpha[base + i];
    bt[i] = beta[base + i];
  }
  pdl_launch_dependents();
  pdl_wait();
  const Lamport l = lamport_begin(peers, control, rank, tp, cap);
  const long long offset = (long long)row * H + base;
  const uint4 local = *(const uint4*)(partial + (long)row * partial_stride + base);
  if (!published) lamport_push(l, offset, local);
  float acc[8];
  lamport_sum(l, offset, local, acc);
  float v[ITEMS];
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    v[i] = bf16_to_float(float_to_bf16(acc[i]));  // the reduced partial, rounded once to bf16
    sq += v[i] * v[i];
  }
  boundary_row(v, sq, 3, row, base, stream, out, nullptr, a, bt, wn, eps_post, eps_next, scratch);
  lamport_end(l);
}
#endif
