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
// Compile-time: H (width), THREADS (block size), CLUSTER (blocks a row, 1 when absent):
// a row is CLUSTER blocks of one thread-block cluster, each thread holding 8 consecutive
// values of the row in registers (16-byte loads and stores), so a row's bytes stream
// through CLUSTER SMs. A row's sums of squares: each block's (block_sum) written to its
// shared memory, then read by every block of the cluster in rank order (distributed
// shared memory), so all of them hold the same total. Every read of the previous
// kernel's output (x, the stream) is issued right after the PDL wait, before either
// reduction.
//
// PDL_TRIGGER: where a kernel lets its dependents launch (griddepcontrol.launch_dependents).
// 0 (default): at its start, after the weights' loads, so the next GEMM's CTAs take the SMs
// as they free and issue their first weight loads (before their own PDL wait) while this
// kernel still waits or reads; 1: once the previous kernel's output has arrived (after the
// first row sum's barrier; in the fused kernel after the gather), so this kernel's reads
// are not queued behind the next GEMM's first weight loads.
//
// attention_boundary_all_reduce_kernel (TP > 1): MODE 3 on the one-shot all-reduce
// of every rank's bf16 o_proj partial (lamport.cuh), rounded to bf16 once as the
// reference transport rounds, then the same code as boundary_kernel. `published`: the
// o_proj GEMM has pushed this rank's partial to the peers from its epilogue
// (linear.cu's PUBLISH), so this kernel only gathers; else it pushes first.
//
// boundary_columns_kernel (TP > 1, a column-sharded unpooler): MODE 2 on the row laid
// out from every rank's bf16 [b, H / tp] column block over the Lamport mailbox (every
// NaN the canonical one), then the same code as boundary_kernel, the gathered row kept in
// registers (lamport.cuh's lamport_column_vector: a thread's 8 columns from this rank's
// block, pushed unless `published`, or from the owner's slot).
#include "lamport.cuh"

#ifndef H
#error "define H"
#endif
#ifndef THREADS
#define THREADS 256
#endif
#ifndef CLUSTER
#define CLUSTER 1
#endif
#ifndef PDL_TRIGGER
#define PDL_TRIGGER 0
#endif
static_assert(PDL_TRIGGER == 0 || PDL_TRIGGER == 1, "PDL_TRIGGER: 0 (at the start) or 1 (once the inputs arrived)");
#define ITEMS (H / (THREADS * CLUSTER))
static_assert(ITEMS == 8 && H % (8 * THREADS * CLUSTER) == 0, "8 values a thread");
static_assert(CLUSTER >= 1 && CLUSTER <= 8, "a portable cluster: at most 8 blocks");

// The sum over the row of every thread's v (`slot`: this call's float of `red`, each call
// its own, so no block overwrites a slot another block may still read).
__device__ __forceinline__ float row_sum(float v, float* scratch, float* red, int slot) {
  const float part = block_sum<THREADS>(v, scratch);
#if CLUSTER > 1
  if (threadIdx.x == 0) red[slot] = part;
  cluster_barrier();
  float total = 0.f;
#pragma unroll
  for (int r = 0; r < CLUSTER; ++r) total += cluster_load_f32(red + slot, r);
  return total;
#else
  return part;
#endif
}

// From the post-norm's input (v: x * post weight, sq: its sum of squares) and the row's
// stream values s to the stream, aux and the next pre-norm of one row.
__device__ __forceinline__ void boundary_row(float (&v)[ITEMS], float sq, const float (&s)[ITEMS], int mode,
                                             int row, int base, float* __restrict__ stream,
                                             bf16_t* __restrict__ out, float* __restrict__ aux,
                                             const float (&a)[ITEMS], const float (&bt)[ITEMS],
                                             const float (&wn)[ITEMS], float eps_post, float eps_next,
                                             float* scratch, float* red) {
  const long long at = (long long)row * H + base;
  if (mode != 1) {
    const float inv = rsqrtf(row_sum(sq, scratch, red, 0) / (float)H + eps_post);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) v[i] *= inv;
  }
#if PDL_TRIGGER == 1
  pdl_launch_dependents();  // past the row sum's barrier: every thread's x has arrived
#endif
  if (mode >= 2) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) v[i] = a[i] * s[i] + bt[i] * v[i];
  }
  sq = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) sq += v[i] * v[i];
  store_f32x8(stream + at, v);
  if (aux != nullptr) store_f32x8(aux + at, v);
  const float inv = rsqrtf(row_sum(sq, scratch, red, 1) / (float)H + eps_next);
  float o[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) o[i] = v[i] * inv * wn[i];
  store_bf16x8(out + at, o);
#if CLUSTER > 1
  cluster_barrier();  // no block leaves while another still reads its partial sums
#endif
}

// The weights of a thread's 8 values (they do not depend on the kernel before).
__device__ __forceinline__ void boundary_weights(int base, int mode, const bf16_t* __restrict__ post_weight,
                                                 const float* __restrict__ alpha, const float* __restrict__ beta,
                                                 const bf16_t* __restrict__ next_weight, float next_center,
                                                 float (&wn)[ITEMS], float (&wp)[ITEMS], float (&a)[ITEMS],
                                                 float (&bt)[ITEMS]) {
  load_bf16x8(next_weight + base, wn);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) wn[i] += next_center;
  if (mode == 2) {
    load_bf16x8(post_weight + base, wp);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) wp[i] += 1.0f;
  } else {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) wp[i] = 1.0f;
  }
  if (mode >= 2) {
    load_f32x8(alpha + base, a);
    load_f32x8(beta + base, bt);
  } else {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) a[i] = bt[i] = 0.f;
  }
}

// A kernel's start: its weights read, its dependents let launch (PDL_TRIGGER 0), then the
// wait for the previous kernel's output.
__device__ __forceinline__ void boundary_start(int base, int mode, const bf16_t* __restrict__ post_weight,
                                               const float* __restrict__ alpha, const float* __restrict__ beta,
                                               const bf16_t* __restrict__ next_weight, float next_center,
                                               float (&wn)[ITEMS], float (&wp)[ITEMS], float (&a)[ITEMS],
                                               float (&bt)[ITEMS]) {
  boundary_weights(base, mode, post_weight, alpha, beta, next_weight, next_center, wn, wp, a, bt);
#if PDL_TRIGGER == 0
  pdl_launch_dependents();
#endif
  pdl_wait();
}

// v *= the post weight; returns the sum of squares of the result (the post-norm's input).
__device__ __forceinline__ float post_input(float (&v)[ITEMS], const float (&wp)[ITEMS]) {
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    v[i] *= wp[i];
    sq += v[i] * v[i];
  }
  return sq;
}

extern "C" __global__ void __launch_bounds__(THREADS)
#if CLUSTER > 1
    __cluster_dims__(CLUSTER, 1, 1)
#endif
    boundary_kernel(const bf16_t* __restrict__ x, int x_stride,  // [b, H] branch (or embeddings)
                    float* __restrict__ stream,                  // [b, H] fp32, in place
                    bf16_t* __restrict__ out,                    // [b, H]
                    float* __restrict__ aux,                     // [b, H] or null
                    const bf16_t* __restrict__ post_weight,      // [H] (MODE 2) or null
                    const float* __restrict__ alpha,             // [H] (MODE 2, 3)
                    const float* __restrict__ beta,              // [H]
                    const bf16_t* __restrict__ next_weight,      // [H]
                    float eps_post, float eps_next, float next_center, int mode) {
  __shared__ float scratch[32];
  __shared__ float red[2];
  const int row = blockIdx.x / CLUSTER;
  const int base = (blockIdx.x % CLUSTER) * (H / CLUSTER) + threadIdx.x * ITEMS;
  // Weights do not depend on the previous kernel: read them before the PDL wait.
  float wn[ITEMS], wp[ITEMS], a[ITEMS], bt[ITEMS];
  boundary_start(base, mode, post_weight, alpha, beta, next_weight, next_center, wn, wp, a, bt);

  float v[ITEMS], s[ITEMS];
  load_bf16x8(x + (long)row * x_stride + base, v);
  if (mode >= 2) {
    load_f32x8(stream + (long long)row * H + base, s);
  } else {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) s[i] = 0.f;
  }
  const float sq = post_input(v, wp);
  boundary_row(v, sq, s, mode, row, base, stream, out, aux, a, bt, wn, eps_post, eps_next, scratch, red);
}

#if CLUSTER == 1
extern "C" __global__ void __launch_bounds__(THREADS) attention_boundary_all_reduce_kernel(
    const bf16_t* __restrict__ partial, int partial_stride,  // [b, H] this rank's o_proj partial
    float* __restrict__ stream,                               // [b, H] fp32, in place
    bf16_t* __restrict__ out,                                 // [b, H]
    const float* __restrict__ alpha, const float* __restrict__ beta,
    const bf16_t* __restrict__ next_weight, float eps_post, float eps_next,
    int published, const u64* __restrict__ peers, int* __restrict__ control, int rank, int tp, long long cap) {
  __shared__ float scratch[32];
  __shared__ float red[2];
  const int row = blockIdx.x;
  const int base = threadIdx.x * ITEMS;
  float wn[ITEMS], wp[ITEMS], a[ITEMS], bt[ITEMS];
  boundary_start(base, 3, nullptr, alpha, beta, next_weight, 1.0f, wn, wp, a, bt);
  float s[ITEMS];
  load_f32x8(stream + (long long)row * H + base, s);
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
  boundary_row(v, sq, s, 3, row, base, stream, out, nullptr, a, bt, wn, eps_post, eps_next, scratch, red);
  lamport_end(l);
}

extern "C" __global__ void __launch_bounds__(THREADS) boundary_columns_kernel(
    const bf16_t* __restrict__ block, int block_stride,  // [b, H / tp] this rank's columns
    float* __restrict__ stream,                           // [b, H] fp32, in place
    bf16_t* __restrict__ out,                             // [b, H]
    float* __restrict__ aux,                              // [b, H] or null
    const bf16_t* __restrict__ post_weight, const float* __restrict__ alpha, const float* __restrict__ beta,
    const bf16_t* __restrict__ next_weight, float eps_post, float eps_next, float next_center, int published,
    const u64* __restrict__ peers, int* __restrict__ control, int rank, int tp, long long cap) {
  __shared__ float scratch[32];
  __shared__ float red[2];
  const int row = blockIdx.x;
  const int base = threadIdx.x * ITEMS;
  float wn[ITEMS], wp[ITEMS], a[ITEMS], bt[ITEMS];
  boundary_start(base, 2, post_weight, alpha, beta, next_weight, next_center, wn, wp, a, bt);
  float s[ITEMS];
  load_f32x8(stream + (long long)row * H + base, s);
  const Lamport l = lamport_begin(peers, control, rank, tp, cap);
  float v[ITEMS];
  unpack_bf16x8(lamport_column_vector(l, block, block_stride, row, base, H, published), v);
  const float sq = post_input(v, wp);
  boundary_row(v, sq, s, 2, row, base, stream, out, aux, a, bt, wn, eps_post, eps_next, scratch, red);
  lamport_end(l);
}
#endif
