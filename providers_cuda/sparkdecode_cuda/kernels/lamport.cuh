// Lamport mailboxes over unicast peer memory (lamport.py holds the argument for
// the memory ordering). Each rank owns one buffer of GENERATIONS x tp slots of
// `cap` bf16; slot (g, src) of rank r is written only by rank src, at a call of
// generation g, and read (then cleared) only by rank r. A value equal to SENTINEL
// means "not written yet"; producers never write it (they canonicalize NaN).
#pragma once
#include "common.cuh"

#define LAMPORT_GENERATIONS 3
#define LAMPORT_MAX_TP 8
// bf16 0xffff: a negative NaN with every payload bit set. GPU arithmetic produces
// the canonical NaN (0x7fff) and float_to_bf16 keeps a NaN's sign and sets the
// quiet bit, so data can only carry this pattern by copying it; the push maps every
// NaN to 0x7fff, so a published value is never the sentinel (a NaN stays a NaN).
#define LAMPORT_SENTINEL 0xffffu
#define LAMPORT_SENTINEL2 0xffffffffu
#ifndef LAMPORT_SPIN_LIMIT_NS
// A rank waiting this long for a peer traps with a message instead of hanging:
// ten minutes, far past any pause of a healthy group (compiles, captures, another
// process's turns on a shared GPU).
#define LAMPORT_SPIN_LIMIT_NS 600000000000ull
#endif

typedef unsigned long long u64;

// control[0]: generation of the next call (0..GENERATIONS-1); control[1]: blocks of
// the current call done; control[2]: set once a spin has trapped (one message).
struct Lamport {
  const u64* peers;  // [tp] base address of every rank's buffer (this rank's own included)
  int* control;
  int rank, tp;
  long long cap;  // elements per slot
  int gen;
};

__device__ __forceinline__ u64 global_timer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ uint4 ld_volatile_v4(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile_v4(void* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ bool has_sentinel(u32 w) {
  return (w & 0xffffu) == LAMPORT_SENTINEL || (w >> 16) == LAMPORT_SENTINEL;
}

__device__ __forceinline__ u32 canonical_nan2(u32 w) {
  if ((w & 0x7fffu) > 0x7f80u) w = (w & 0xffff0000u) | 0x7fffu;
  if (((w >> 16) & 0x7fffu) > 0x7f80u) w = (w & 0xffffu) | 0x7fff0000u;
  return w;
}

// Call after pdl_wait by every thread of the block: the generation of this call.
__device__ __forceinline__ Lamport lamport_begin(const u64* peers, int* control, int rank, int tp, long long cap) {
  __shared__ int gen;
  if (threadIdx.x == 0) gen = *(volatile int*)control;
  __syncthreads();
  return Lamport{peers, control, rank, tp, cap, gen};
}

// The last block of the grid to finish advances the generation (every block read it
// in lamport_begin before counting itself done). Call by every thread of the block.
__device__ __forceinline__ void lamport_end(const Lamport& l) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
    if (atomicAdd((unsigned*)&l.control[1], 1u) == blocks - 1) {
      l.control[1] = 0;
      l.control[0] = (l.gen + 1) % LAMPORT_GENERATIONS;
      __threadfence();
    }
  }
}

__device__ __forceinline__ bf16_t* lamport_slot(const Lamport& l, int owner, int src, long long offset) {
  return (bf16_t*)l.peers[owner] + ((long long)l.gen * l.tp + src) * l.cap + offset;
}

// Publish 8 bf16 (16 bytes at element `offset` of this call's block) into every
// peer's slot for this rank. Release: every write this rank made before (the
// clears of earlier calls included) is ordered before the data a peer observes.
__device__ __forceinline__ void lamport_push(const Lamport& l, long long offset, uint4 v) {
  v.x = canonical_nan2(v.x);
  v.y = canonical_nan2(v.y);
  v.z = canonical_nan2(v.z);
  v.w = canonical_nan2(v.w);
  fence_acq_rel_sys();
  for (int r = 0; r < l.tp; ++r)
    if (r != l.rank) st_volatile_v4(lamport_slot(l, r, l.rank, offset), v);
}

__device__ __forceinline__ void add_bf16x2(float* acc, u32 w, bool first) {
  const float lo = bf16_to_float((bf16_t)(w & 0xffffu)), hi = bf16_to_float((bf16_t)(w >> 16));
  if (first) {
    acc[0] = lo;
    acc[1] = hi;
  } else {
    acc[0] += lo;
    acc[1] += hi;
  }
}

// Wait for a peer's 16 bytes in this rank's slot, then clear the slot.
__device__ __forceinline__ uint4 lamport_take(const Lamport& l, int src, long long offset) {
  bf16_t* p = lamport_slot(l, l.rank, src, offset);
  uint4 v = ld_volatile_v4(p);
  if (has_sentinel(v.x) || has_sentinel(v.y) || has_sentinel(v.z) || has_sentinel(v.w)) {
    const u64 start = global_timer();
    do {
      if (global_timer() - start > LAMPORT_SPIN_LIMIT_NS) {
        if (atomicExch(&l.control[2], 1) == 0)
          printf("sparkdecode lamport: rank %d waited %llu s for rank %d; that rank is gone or hung: trapping\n",
                 l.rank, LAMPORT_SPIN_LIMIT_NS / 1000000000ull, src);
        __trap();
      }
      v = ld_volatile_v4(p);
    } while (has_sentinel(v.x) || has_sentinel(v.y) || has_sentinel(v.z) || has_sentinel(v.w));
  }
  st_volatile_v4(p, make_uint4(LAMPORT_SENTINEL2, LAMPORT_SENTINEL2, LAMPORT_SENTINEL2, LAMPORT_SENTINEL2));
  return v;
}

// The one-shot all-reduce of 8 bf16: fp32 sum in rank order 0..tp-1 starting from
// rank 0's value (as comm.Collectives sums), gathering each peer's block as it
// arrives; `local` is this rank's own block. Acquire after the reads: what this
// rank does next is ordered after the peers' writes it observed.
__device__ __forceinline__ void lamport_sum(const Lamport& l, long long offset, uint4 local, float (&acc)[8]) {
  for (int r = 0; r < l.tp; ++r) {
    const uint4 v = r == l.rank ? local : lamport_take(l, r, offset);
    add_bf16x2(acc + 0, v.x, r == 0);
    add_bf16x2(acc + 2, v.y, r == 0);
    add_bf16x2(acc + 4, v.z, r == 0);
    add_bf16x2(acc + 6, v.w, r == 0);
  }
  fence_acq_rel_sys();
}

// The 16 bytes at columns [base, base + 8) of row `row` of a [rows, width] whole that is
// column-sharded over the ranks (each rank's [rows, width / tp] block, width / tp a
// multiple of 8, so the 8 columns lie in one rank's block), exchanged over the mailbox
// at slot offset row * width / tp + column: from this rank's `block` (pushed to the
// peers first unless `published`, the producer's epilogue having pushed them) or taken
// from the owner's slot; every NaN the canonical one, so every rank holds the same bits.
// Acquire after: what this thread does next is ordered after the peer's write it
// observed.
__device__ __forceinline__ uint4 lamport_column_vector(const Lamport& l, const bf16_t* block, int block_stride,
                                                       int row, int base, int width, int published) {
  const int cols = width / l.tp;
  const int owner = base / cols, col = base - owner * cols;
  const long long offset = (long long)row * cols + col;
  uint4 w;
  if (owner == l.rank) {
    w = *(const uint4*)(block + (long)row * block_stride + col);
    if (!published) lamport_push(l, offset, w);
    w.x = canonical_nan2(w.x);
    w.y = canonical_nan2(w.y);
    w.z = canonical_nan2(w.z);
    w.w = canonical_nan2(w.w);
  } else {
    w = lamport_take(l, owner, offset);
  }
  fence_acq_rel_sys();
  return w;
}
