// The attention's front and back around the attention core (MUSE_SPARK.md, "One
// decode step"): after the QKV+gate GEMM, the per-head QK norm (weightless, rounded
// to bf16), GPT-J RoPE on sliding layers (fp32 from the bf16 values and the fp32
// [cos | sin] table, rounded once), K and V into the paged cache at the slot
// mapping (rows with a negative slot write none), q into its buffer; after the core, the o-norm with the sigmoid gate.
// One warp per (row, head), each lane one RoPE pair: HEAD_DIM = 64.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#define PAIRS (HEAD_DIM / 2)

__device__ __forceinline__ float lane_sum(float v) { return warp_sum(v); }

// grid (b, heads + 2 * kv_heads), block 32. Heads in [q | k | v] order of the
// qkvg row ([q | k | v | gate] with q/k rows in GPT-J pairs).
extern "C" __global__ void __launch_bounds__(32) qkv_front_kernel(
    const bf16_t* __restrict__ qkvg, int qkvg_stride,   // [b, (2 * heads + 2 * kv_heads) * d]
    const long long* __restrict__ positions,             // [b]
    const long long* __restrict__ slot_mapping,          // [b]
    const float* __restrict__ rope,                      // [max_pos, d] = [cos | sin], or null (NoPE)
    bf16_t* __restrict__ q_out,                          // [b, heads, d]
    bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
    long long page_stride, long long slot_stride, long long head_stride,  // cache strides (elements)
    int heads, int kv_heads, int block_size, float eps) {
  pdl_launch_dependents();
  pdl_wait();
  const int row = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
  const bf16_t* x = qkvg + (long)row * qkvg_stride + (long)head * HEAD_DIM;
  const bool is_v = head >= heads + kv_heads;
  float even = bf16_to_float(x[2 * lane]), odd = bf16_to_float(x[2 * lane + 1]);
  bf16_t e16, o16;
  if (is_v) {
    e16 = x[2 * lane];
    o16 = x[2 * lane + 1];
  } else {
    const float inv = rsqrtf(lane_sum(even * even + odd * odd) / (float)HEAD_DIM + eps);
    e16 = float_to_bf16(even * inv);
    o16 = float_to_bf16(odd * inv);
    if (rope != nullptr) {
      const float* cs = rope + positions[row] * HEAD_DIM;
      const float c = cs[lane], s = cs[PAIRS + lane];
      even = bf16_to_float(e16);
      odd = bf16_to_float(o16);
      e16 = float_to_bf16(even * c - odd * s);
      o16 = float_to_bf16(odd * c + even * s);
    }
  }
  if (head < heads) {
    bf16_t* q = q_out + ((long)row * heads + head) * HEAD_DIM;
    q[2 * lane] = e16;
    q[2 * lane + 1] = o16;
    return;
  }
  const long long slot = slot_mapping[row];
  if (slot < 0) return;  // a padding row (vLLM's PAD_SLOT_ID): no cache slot, as vLLM's own insert skips it
  const long long page = slot / block_size, offset = slot % block_size;
  const int kv_head = is_v ? head - heads - kv_heads : head - heads;
  bf16_t* dst = (is_v ? v_cache : k_cache) + page * page_stride + offset * slot_stride + kv_head * head_stride;
  dst[2 * lane] = e16;
  dst[2 * lane + 1] = o16;
}

// grid (b, heads), block 32: out = bf16(rms(o) * sigmoid(gate)), both in fp32.
extern "C" __global__ void __launch_bounds__(32) o_norm_gate_kernel(
    const bf16_t* __restrict__ o,                       // [b, heads, d]
    const bf16_t* __restrict__ qkvg, int qkvg_stride, int gate_offset,  // the gate columns of the qkvg rows
    bf16_t* __restrict__ out,                           // [b, heads * d]
    int heads, float eps) {
  pdl_launch_dependents();
  pdl_wait();
  const int row = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
  const bf16_t* src = o + ((long)row * heads + head) * HEAD_DIM;
  const bf16_t* g = qkvg + (long)row * qkvg_stride + gate_offset + head * HEAD_DIM;
  const float a = bf16_to_float(src[2 * lane]), b = bf16_to_float(src[2 * lane + 1]);
  const float inv = rsqrtf(lane_sum(a * a + b * b) / (float)HEAD_DIM + eps);
  const float ga = 1.0f / (1.0f + expf(-bf16_to_float(g[2 * lane])));
  const float gb = 1.0f / (1.0f + expf(-bf16_to_float(g[2 * lane + 1])));
  bf16_t* dst = out + (long)row * heads * HEAD_DIM + head * HEAD_DIM;
  dst[2 * lane] = float_to_bf16(a * inv * ga);
  dst[2 * lane + 1] = float_to_bf16(b * inv * gb);
}
