// Device helpers of the routed-experts kernels (experts.cu, experts_bulk.cu): the
// distinct held experts found from the ids on the device, the bf16 MMA, and the Marlin
// NVFP4 decode of EXPERTS_V2 (experts.cu's header says why it gives the reference's bits).
#pragma once

#include "common.cuh"

#define MAX_ROUTES 64
#define MAX_LOCAL 256  // experts a rank may hold (the provider refuses more)

struct Routes {
  int owner[MAX_LOCAL];         // per local expert: its first route (MAX_ROUTES where none)
  int slot[MAX_ROUTES];         // the route's distinct-expert slot, -1 where not held
  int slot_expert[MAX_ROUTES];  // local expert of each slot
  unsigned firsts[MAX_ROUTES / 32];
  int n_slots;
};

// Slots in the order of the experts' first routes: the same in every block.
template <int THREADS>
__device__ void find_experts(const int* __restrict__ ids, int routes, int first_expert, int num_local, Routes& r) {
  const int i = threadIdx.x;
  for (int l = i; l < num_local; l += THREADS) r.owner[l] = MAX_ROUTES;
  __syncthreads();
  int l = -1;
  if (i < routes) {
    const int e = ids[i] - first_expert;
    if (e >= 0 && e < num_local) l = e;
  }
  if (l >= 0) atomicMin(&r.owner[l], i);
  __syncthreads();
  const bool first = l >= 0 && r.owner[l] == i;
  if (i < MAX_ROUTES) {
    const unsigned bits = __ballot_sync(0xffffffffu, first);
    if ((i & 31) == 0) r.firsts[i >> 5] = bits;
  }
  __syncthreads();
  if (i < MAX_ROUTES) {
    int slot = -1;
    if (l >= 0) {
      const int owner = r.owner[l];
      slot = __popc(r.firsts[0] & ((owner >= 32) ? 0xffffffffu : ((1u << owner) - 1u)));
      if (owner >= 32) slot += __popc(r.firsts[1] & ((1u << (owner - 32)) - 1u));
      if (first) r.slot_expert[slot] = l;
    }
    r.slot[i] = slot;
    if (i == 0) r.n_slots = __popc(r.firsts[0]) + __popc(r.firsts[1]);
  }
  __syncthreads();
}

// float(e4m3fn) of the two bytes of v (low byte first): exact through fp16 (e4m3's values
// are fp16 numbers); the NaN bytes 0x7f, 0xff give a NaN (the provider refuses them).
__device__ __forceinline__ float2 e4m3x2_to_float2(u32 v) {
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)v));
  float2 f;
  asm("{.reg .f16 l, u;\n mov.b32 {l, u}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, u;}"
      : "=f"(f.x), "=f"(f.y)
      : "r"(h));
  return f;
}

// Marlin (FMT 2), EXPERTS_V2: a code's 3 magnitude bits at bits 2..4 of a byte and its
// sign at bit 7 make the e4m3 byte of e2m1 * 2^-6 (e4m3's exponent bits 3..6, bias 7:
// subnormal for 0 and 0.5), exact through fp16 to fp32; times s * 2^6 (exact) one fp32
// multiply gives fp32(e2m1 * s), signed, then one rounding to bf16: the reference's bits.
// The even nibbles' bytes: magnitudes << 2, signs << 4; the odd ones': >> 2 and in place.
// a[0..3]: the A fragments of the word (nibbles 0, 4; 2, 6; 1, 5; 3, 7), rows g (s0),
// g + 8 (s1).
// Bits 16..31 of v (a register half, no shift).
__device__ __forceinline__ u32 high_half(u32 v) {
  unsigned short h;
  asm("{.reg .b16 l;\n mov.b32 {l, %0}, %1;}" : "=h"(h) : "r"(v));
  return h;
}

__device__ __forceinline__ void marlin_word_v2(u32 w, float s0, float s1, u32 a[4]) {
  const u32 ev = ((w << 2) & 0x1c1c1c1cu) | ((w << 4) & 0x80808080u);  // nibbles 0, 2, 4, 6
  const u32 od = ((w >> 2) & 0x1c1c1c1cu) | (w & 0x80808080u);         // nibbles 1, 3, 5, 7
  const float2 e0 = e4m3x2_to_float2(ev), e1 = e4m3x2_to_float2(high_half(ev));
  const float2 o0 = e4m3x2_to_float2(od), o1 = e4m3x2_to_float2(high_half(od));
  a[0] = pack_bf16x2(e0.x * s0, e1.x * s0);
  a[1] = pack_bf16x2(e0.y * s1, e1.y * s1);
  a[2] = pack_bf16x2(o0.x * s0, o1.x * s0);
  a[3] = pack_bf16x2(o0.y * s1, o1.y * s1);
}

// s * 2^6 of a Marlin scale byte at bits 20..27 of `bits` (the rest zero): those fp32
// bits are fp16(byte << 7) * 2^-112 exactly (subnormals too; the inf / NaN bytes give a
// finite number, but the provider refuses them), and g105 = global * 2^-119 * 2^105
// (exact), so one multiply gives fp32(scale * global) as nvfp4_marlin.dequantize.
__device__ __forceinline__ float marlin_s64(u32 bits, float g105) { return (__uint_as_float(bits) * g105) * 0x1p6f; }

__device__ __forceinline__ float round_bf16(float v) { return bf16_to_float(float_to_bf16(v)); }
