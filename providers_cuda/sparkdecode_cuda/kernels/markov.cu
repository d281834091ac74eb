// One dependent sampling step of the DSpark draft's Markov loop (draft step i), one
// kernel. The Markov bias GEMV before it is cuBLAS's (the reference's own call), so
// `bias` is the reference's to the bit; this kernel does the rest of the step:
//
//   l     = bf16(transform(bf16(base + bias)))               -> logits (the row of slot i)
//   key_v = T == 0 ? l_v : l_v / T + G(seed ^ (i << 32), position + 2^30, v)
//   x     = argmax_v key_v (ties: the lowest id)             -> token
//   q     = T == 0 ? 1 : exp(l_x / T - M - log(sum_v exp(l_v / T - M)))   -> prob
//   next  = w1[x]                                            (the next step's GEMV input)
//
// with transform(y) = cap * tanh(y * m * (1 / cap)) (no cap: y * m) and G vLLM's
// hashed Gumbel noise (draft/functional.py). Every fp32 operation is the one torch's
// kernels do, in their order and rounding (explicit _rn intrinsics: nothing is
// contracted into an FMA where torch rounds twice; the division by the cap is
// torch's multiplication by the fp32 reciprocal of a CPU scalar); logf, tanhf and
// expf are the CUDA math library's, as torch calls them. Only the softmax sum runs
// in another order (per block, then over blocks rescaled by exp(m_b - M)).
//
// Each block takes ITEMS * THREADS consecutive ids (thread t: ids t, t + THREADS,
// ...), writes its argmax and (max, sum) partials; the last block to finish (a
// ticket on `counter`, which it resets to 0 for the next launch and graph replay)
// combines them. The noise depends only on the step's seed and position (written
// before the step runs), so it is computed before the PDL wait, overlapping the GEMV.
#include "common.cuh"

#ifndef THREADS
#define THREADS 256
#endif
#ifndef ITEMS
#define ITEMS 4
#endif
#define PER_BLOCK (THREADS * ITEMS)
#define WARPS (THREADS / 32)
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 rotl32(u32 v, int s) { return (v << s) | (v >> (32 - s)); }

__device__ __forceinline__ u32 murmur_mix(u32 h, u32 key) {
  key *= 0xCC9E2D51u;
  key = rotl32(key, 15);
  key *= 0x1B873593u;
  h ^= key;
  h = rotl32(h, 13);
  return h * 5u + 0xE6546B64u;
}

__device__ __forceinline__ u32 murmur_fmix(u32 h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// fp32 a * b + c as the reference's _fma32 rounds it: the product exact in double,
// the sum rounded to double, then to fp32.
__device__ __forceinline__ float fma_via_double(float a, float b, float c) {
  return __double2float_rn(__dadd_rn(__dmul_rn((double)a, (double)b), (double)c));
}

// -log(-log(1 - u)) of the token's hash (functional.gumbel_noise); `prefix`: the hash
// state after the seed's two halves and the salted position.
__device__ __forceinline__ float gumbel(u32 prefix, u32 token) {
  const u32 r = murmur_fmix(murmur_mix(prefix, token) ^ 16u);
  const float hi = __fmul_rn((float)(r >> 16), 1.52587890625e-05f);
  const float lo = __fmul_rn(__fadd_rn((float)(r & 0xFFFFu), 0.5f), 2.3283064365386963e-10f);
  const float u = __fadd_rn(hi, lo);
  // log1p_neg_stable: Horner over fp32 1/7 .. 1/1 (exact hex values of the reference's).
  float p = 0.125f;
  p = fma_via_double(u, p, 0x1.24924ap-3f);
  p = fma_via_double(u, p, 0x1.555556p-3f);
  p = fma_via_double(u, p, 0x1.99999ap-3f);
  p = fma_via_double(u, p, 0x1p-2f);
  p = fma_via_double(u, p, 0x1.555556p-2f);
  p = fma_via_double(u, p, 0x1p-1f);
  p = fma_via_double(u, p, 1.0f);
  const float series = __fmul_rn(-u, p);
  const float direct = logf(fmaxf(__fsub_rn(1.0f, u), 5.960464477539063e-08f));
  return -logf(-(u < 0.25f ? series : direct));
}

// torch.argmax's order: NaN above everything, then the larger key, then the lower id.
__device__ __forceinline__ bool beats(float k, int i, float best_k, int best_i) {
  const bool kn = k != k, bn = best_k != best_k;
  if (kn != bn) return kn;
  if (!kn && k != best_k) return k > best_k;
  return i < best_i;
}

__device__ __forceinline__ void warp_argmax(float& k, int& i) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ok = __shfl_xor_sync(0xffffffffu, k, offset);
    const int oi = __shfl_xor_sync(0xffffffffu, i, offset);
    if (beats(ok, oi, k, i)) k = ok, i = oi;
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block argmax and max; every thread gets them.
__device__ __forceinline__ void block_argmax_max(float& k, int& i, float& m, float* sk, int* si, float* sm) {
  warp_argmax(k, i);
  m = warp_max(m);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sk[warp] = k, si[warp] = i, sm[warp] = m;
  __syncthreads();
  k = sk[0], i = si[0], m = sm[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) {
    if (beats(sk[w], si[w], k, i)) k = sk[w], i = si[w];
    m = fmaxf(m, sm[w]);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) markov_sample_kernel(
    const bf16_t* __restrict__ base,         // [V] this slot's LM-head logits
    const bf16_t* __restrict__ bias,         // [V] the Markov bias of the previous token
    bf16_t* __restrict__ logits,             // [V] out: this slot's transformed logits
    const long long* __restrict__ seed,      // [1] the request's seed
    const long long* __restrict__ position,  // [1] the query position of this slot
    const float* __restrict__ temperature,   // [1]
    int step, int vocab, float multiplier, float inv_cap, float cap,  // cap 0: no soft cap
    long long* __restrict__ token_out,       // [1]
    float* __restrict__ prob_out,            // [1]
    const bf16_t* __restrict__ w1, int rank,  // [vocab_size, rank] Markov embeddings
    bf16_t* __restrict__ next_row,           // [rank] out: w1[token]; null on the last step
    float* __restrict__ part_key, int* __restrict__ part_id, float* __restrict__ part_max,
    float* __restrict__ part_sum,            // [gridDim.x] each
    unsigned int* __restrict__ counter) {    // [1], 0 between launches
  __shared__ float sk[WARPS], sm[WARPS], scratch[32];
  __shared__ int si[WARPS];
  __shared__ bool last;
  const int first = blockIdx.x * PER_BLOCK + threadIdx.x;

  const long long s = *seed ^ ((long long)step << 32);
  const u32 prefix = murmur_mix(murmur_mix(murmur_mix(0u, (u32)s), (u32)((unsigned long long)s >> 32)),
                                (u32)(*position + (1ll << 30)));
  const float t = *temperature;
  float noise[ITEMS];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int v = first + k * THREADS;
    noise[k] = (v < vocab && t != 0.f) ? gumbel(prefix, (u32)v) : 0.f;
  }
  pdl_wait();
  pdl_launch_dependents();

  float best_k = NEG_INF, m = NEG_INF;
  int best_i = 0x7fffffff;
  float x[ITEMS];
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    const int v = first + k * THREADS;
    x[k] = NEG_INF;
    if (v >= vocab) continue;
    const float b = bf16_to_float(float_to_bf16(__fadd_rn(bf16_to_float(base[v]), bf16_to_float(bias[v]))));
    float y = __fmul_rn(b, multiplier);
    if (cap != 0.f) y = __fmul_rn(tanhf(__fmul_rn(y, inv_cap)), cap);
    const bf16_t lb = float_to_bf16(y);
    logits[v] = lb;
    const float l = bf16_to_float(lb);
    x[k] = t != 0.f ? __fdiv_rn(l, t) : l;
    const float key = t != 0.f ? __fadd_rn(x[k], noise[k]) : l;
    if (beats(key, v, best_k, best_i)) best_k = key, best_i = v;
    m = fmaxf(m, x[k]);
  }
  __threadfence();  // this thread's logits, before the ticket the last block reads them after
  block_argmax_max(best_k, best_i, m, sk, si, sm);
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) sum = __fadd_rn(sum, expf(__fsub_rn(x[k], m)));
  sum = block_sum<THREADS>(sum, scratch);
  if (threadIdx.x == 0) {
    part_key[blockIdx.x] = best_k, part_id[blockIdx.x] = best_i;
    part_max[blockIdx.x] = m, part_sum[blockIdx.x] = sum;
    __threadfence();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;

  // The last block: every block's partials (read past L1: other SMs wrote them).
  __threadfence();
  best_k = NEG_INF, best_i = 0x7fffffff, m = NEG_INF;
  for (int b = threadIdx.x; b < gridDim.x; b += THREADS) {
    const float k = __ldcg(part_key + b);
    const int i = __ldcg(part_id + b);
    if (beats(k, i, best_k, best_i)) best_k = k, best_i = i;
    m = fmaxf(m, __ldcg(part_max + b));
  }
  block_argmax_max(best_k, best_i, m, sk, si, sm);
  sum = 0.f;
  for (int b = threadIdx.x; b < gridDim.x; b += THREADS)
    sum = __fadd_rn(sum, __fmul_rn(__ldcg(part_sum + b), expf(__fsub_rn(__ldcg(part_max + b), m))));
  sum = block_sum<THREADS>(sum, scratch);
  if (next_row != nullptr) {
    const bf16_t* row = w1 + (long long)best_i * rank;
    for (int j = threadIdx.x; j < rank; j += THREADS) next_row[j] = row[j];
  }
  if (threadIdx.x == 0) {
    *token_out = best_i;
    float q = 1.f;
    if (t != 0.f) {
      const float xt = __fdiv_rn(bf16_to_float(__ldcg(logits + best_i)), t);
      q = expf(__fsub_rn(__fsub_rn(xt, m), logf(sum)));
    }
    *prob_out = q;
    *counter = 0u;
  }
}
