// L2 prefetch of weights a later kernel of the step reads, issued where the step leaves
// the memory idle (the attention core's phase: bench/NOTES.md v11). Semantically nothing:
// no thread writes anything, so every result is the same with or without it.
//
// The table (int64 [regions, 6], made at build): a region's base address, its row stride
// and run length in bytes, its rows, its chunks a row and its first chunk's index over the
// table. A region is `rows` runs of `bytes` bytes, `stride` apart (a whole contiguous
// weight is one run); every run is cut into chunks of at most CHUNK bytes, and a chunk is
// one cp.async.bulk.prefetch.L2 (the TMA unit fills L2 asynchronously: the kernel ends as
// soon as its threads have issued theirs). Addresses and lengths are multiples of 16.
#include "common.cuh"

#ifndef CHUNK
#define CHUNK 16384
#endif
#ifndef EVICT_LAST
#define EVICT_LAST 0  // 1: the lines under an evict-last L2 policy, kept before lines streamed past them
#endif
static_assert(CHUNK % 16 == 0, "bulk prefetches take multiples of 16 bytes");

extern "C" __global__ void l2_prefetch_kernel(const long long* __restrict__ table, int regions, long long chunks) {
  const long long threads = (long long)gridDim.x * blockDim.x;
#if EVICT_LAST && __CUDA_ARCH__ >= 900
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
#endif
  int r = 0;
  for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += threads) {
    while (r + 1 < regions && c >= table[(r + 1) * 6 + 5]) ++r;  // chunks ascend, so r only grows
    const long long* t = table + r * 6;
    const long long local = c - t[5], per_row = t[4];
    const long long row = local / per_row, at = (local - row * per_row) * CHUNK;
    const long long left = t[2] - at;
    const unsigned size = (unsigned)(left < CHUNK ? left : CHUNK);
    const char* address = (const char*)t[0] + row * t[1] + at;
#if EVICT_LAST && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(address), "r"(size), "l"(policy)
                 : "memory");
#elif __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(address), "r"(size) : "memory");
#endif
  }
}
