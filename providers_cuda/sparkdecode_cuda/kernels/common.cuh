// Shared device helpers: bf16 <-> fp32 by bit manipulation (no CUDA headers, so
// NVRTC needs no include path), programmatic dependent launch, block reductions.
#pragma once

typedef unsigned short bf16_t;
typedef unsigned int u32;

__device__ __forceinline__ float bf16_to_float(bf16_t h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even, as torch rounds fp32 to bf16; NaN stays NaN.
__device__ __forceinline__ bf16_t float_to_bf16(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16_t)(u >> 16);
}

// Wait for the kernels this one depends on (PDL); a no-op without the launch attribute.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Let the next kernel in the stream start its prologue (it still waits for us in pdl_wait).
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block; every thread gets the total. `scratch`: 32 floats of shared memory.
template <int NTHREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  constexpr int WARPS = NTHREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from an earlier call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) total += scratch[w];
  return total;
}

// D += A * B on the tensor cores: m16n8k16, bf16 A (row) and B (col), fp32 C/D.
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
