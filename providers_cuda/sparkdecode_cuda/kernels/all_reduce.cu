// The one-shot all-reduce of a bf16 tensor in place over a Lamport mailbox
// (lamport.cuh): each thread pushes its 16 bytes to every peer, gathers the peers'
// blocks in rank order as they arrive, sums in fp32 and rounds once to bf16.
#include "lamport.cuh"

#define AR_THREADS 256

extern "C" __global__ void __launch_bounds__(AR_THREADS) all_reduce_kernel(
    bf16_t* __restrict__ x, long long chunks,  // [chunks * 8] bf16, 16-byte aligned, in place
    const u64* __restrict__ peers, int* __restrict__ control, int rank, int tp, long long cap) {
  pdl_launch_dependents();
  pdl_wait();
  const Lamport l = lamport_begin(peers, control, rank, tp, cap);
  const long long c = (long long)blockIdx.x * AR_THREADS + threadIdx.x;
  if (c < chunks) {
    uint4* xc = (uint4*)x + c;
    const uint4 local = *xc;
    lamport_push(l, c * 8, local);
    float acc[8];
    lamport_sum(l, c * 8, local, acc);
    *xc = pack_bf16x8(acc);
  }
  lamport_end(l);
}

// The column gather over a Lamport mailbox: each rank holds a [rows, cols] block of
// a [rows, cols * tp] whole (cols a multiple of 8); each thread pushes 16 bytes of
// its block to every peer, then lays every rank's 16 bytes at that place out in rank
// order as they arrive. Its own block goes out as the peers receive it (every NaN
// the canonical one), so every rank holds the same bits.
extern "C" __global__ void __launch_bounds__(AR_THREADS) gather_columns_kernel(
    const bf16_t* __restrict__ block, bf16_t* __restrict__ whole, long long chunks, int row_chunks,
    const u64* __restrict__ peers, int* __restrict__ control, int rank, int tp, long long cap) {
  pdl_launch_dependents();
  pdl_wait();
  const Lamport l = lamport_begin(peers, control, rank, tp, cap);
  const long long c = (long long)blockIdx.x * AR_THREADS + threadIdx.x;
  if (c < chunks) {
    uint4 local = ((const uint4*)block)[c];
    lamport_push(l, c * 8, local);
    local.x = canonical_nan2(local.x);
    local.y = canonical_nan2(local.y);
    local.z = canonical_nan2(local.z);
    local.w = canonical_nan2(local.w);
    const long long row = c / row_chunks, col = c % row_chunks;
    uint4* out = (uint4*)whole + row * row_chunks * tp + col;
    for (int r = 0; r < tp; ++r) out[r * row_chunks] = r == rank ? local : lamport_take(l, r, c * 8);
    fence_acq_rel_sys();
  }
  lamport_end(l);
}
