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

// Sums over the block of N values at once (one reduction's barriers for all of them);
// each is added in the order block_sum adds it, so each total has block_sum's bits.
// `scratch`: N * 32 floats of shared memory.
template <int NTHREADS, int N>
__device__ __forceinline__ void block_sums(float (&v)[N], float* scratch) {
  constexpr int WARPS = NTHREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = warp_sum(v[j]);
  __syncthreads();  // scratch may still be read from an earlier call
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) scratch[j * 32 + warp] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += scratch[j * 32 + w];
    v[j] = total;
  }
}

// Eight consecutive values: bf16 or fp32 in memory (16-byte aligned), fp32 in registers.
__device__ __forceinline__ void unpack_bf16x8(const uint4 w, float (&v)[8]) {
  const u32 u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(u[i] << 16);
    v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void load_bf16x8(const bf16_t* p, float (&v)[8]) { unpack_bf16x8(*(const uint4*)p, v); }

__device__ __forceinline__ void load_f32x8(const float* p, float (&v)[8]) {
  const float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void store_f32x8(float* p, const float (&v)[8]) {
  ((float4*)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  ((float4*)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Eight values rounded as float_to_bf16 rounds (NaN kept), packed in order.
__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  uint4 w;
  w.x = (u32)float_to_bf16(f[0]) | ((u32)float_to_bf16(f[1]) << 16);
  w.y = (u32)float_to_bf16(f[2]) | ((u32)float_to_bf16(f[3]) << 16);
  w.z = (u32)float_to_bf16(f[4]) | ((u32)float_to_bf16(f[5]) << 16);
  w.w = (u32)float_to_bf16(f[6]) | ((u32)float_to_bf16(f[7]) << 16);
  return w;
}

__device__ __forceinline__ void store_bf16x8(bf16_t* p, const float (&v)[8]) { *(uint4*)p = pack_bf16x8(v); }

// Thread-block clusters (sm_90): a barrier of every thread of the cluster (release /
// acquire: shared-memory writes before it are visible to the cluster's CTAs after it),
// the CTA's rank in its cluster, and a float of CTA `rank`'s shared memory at the
// address `p` has in this CTA's.
__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ int cluster_ctarank() {
  u32 r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return (int)r;
}

__device__ __forceinline__ float cluster_load_f32(const float* p, int rank) {
  u32 local = (u32)__cvta_generic_to_shared(p), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
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
