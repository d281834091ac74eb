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
