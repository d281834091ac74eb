// A weight read into L2 ahead of the kernel that streams it, where the step leaves the
// memory idle (bench/NOTES.md v18: a weight read by ordinary loads streams from L2 at
// 5.4 TB/s afterwards, where cp.async.bulk.prefetch.L2 left most of it in the DRAM).
// Every thread reads 16-byte vectors, DEPTH in flight a batch; the values are folded into
// one word that is stored only if it equals a constant no weight of the step gives, so
// the loads stay and the kernel writes nothing in practice.
#include "common.cuh"

#ifndef DEPTH
#define DEPTH 16
#endif

extern "C" __global__ void __launch_bounds__(256) read_ahead_kernel(const uint4* __restrict__ w, long long vectors,
                                                                    unsigned* __restrict__ sink) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + (DEPTH - 1) * stride < vectors; i += DEPTH * stride) {
    uint4 x[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) x[d] = __ldg(w + i + d * stride);
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) acc ^= x[d].x ^ x[d].y ^ x[d].z ^ x[d].w;
  }
  for (; i < vectors; i += stride) {
    const uint4 x = __ldg(w + i);
    acc ^= x.x ^ x.y ^ x.z ^ x.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
