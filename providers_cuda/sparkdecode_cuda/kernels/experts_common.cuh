// Device helpers of the routed-experts kernels (experts.cu, experts_bulk.cu): the
// distinct held experts found from the ids on the device, the bf16 MMA, and the Marlin
// NVFP4 decodes of EXPERTS_V2 and EXPERTS_V3 (experts.cu's header says why they give
// the reference's bits, and V3 the exact weights).
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

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Marlin (FMT 2), V3: bytes k (row g) and k + 2 (row g + 8) of a thread's scale word as
// bf16x2 {-F_g * 2^112, -F_g8 * 2^112}: each byte and its sign byte (prmt's sign
// replication) as 16 bits, shifted into bf16 bits 4..15.
__device__ __forceinline__ u32 marlin_scales_v3(u32 v, int k) {
  return (prmt(v, 0u, k ? 0xb391 : 0xa280) << 4) & 0xfff0fff0u;
}

// a * {s.lo, s.lo} (HI = 0) or a * {s.hi, s.hi} (HI = 1), bf16x2, rounded once (exact here).
template <int HI>
__device__ __forceinline__ u32 mul_bf16x2_bcast(u32 a, u32 s) {
  u32 d;
  if (HI)
    asm("{.reg .b16 l, h;\n .reg .b32 t;\n mov.b32 {l, h}, %2;\n mov.b32 t, {h, h};\n mul.rn.bf16x2 %0, %1, t;}"
        : "=r"(d)
        : "r"(a), "r"(s));
  else
    asm("{.reg .b16 l, h;\n .reg .b32 t;\n mov.b32 {l, h}, %2;\n mov.b32 t, {l, l};\n mul.rn.bf16x2 %0, %1, t;}"
        : "=r"(d)
        : "r"(a), "r"(s));
  return d;
}

// The A fragments of a Marlin word (nibbles 0, 4; 2, 6; 1, 5; 3, 7) as
// -e2m1 * F * 2^-14, s2 from marlin_scales_v3 (row g low, row g + 8 high). A code
// nibble masked alone in each 16-bit half and multiplied by 2^6 + 2^12 (nibble 0; 2^2 +
// 2^8 for nibble 1) lands twice, at bits 6..9 and 12..15, without carries; the mask
// keeps the magnitude at 6..8 and the sign at 15: the bf16 of e2m1 * 2^-126.
// LEAN (experts.cu's EXPERTS_LEAN): the shift by 8 as a multiply-high by 2^24, on the FMA
// pipe instead of the integer pipe (the same word).
template <bool LEAN>
__device__ __forceinline__ void marlin_word_v3(u32 w, u32 s2, u32 a[4]) {
  constexpr u32 M = 0x81c081c0u;
  const u32 h = LEAN ? __umulhi(w, 1u << 24) : w >> 8;  // nibbles 2, 3 (6, 7) where 0, 1 (4, 5) were
  a[0] = mul_bf16x2_bcast<0>(((w & 0x000f000fu) * 0x1040u) & M, s2);
  a[1] = mul_bf16x2_bcast<1>(((h & 0x000f000fu) * 0x1040u) & M, s2);
  a[2] = mul_bf16x2_bcast<0>(((w & 0x00f000f0u) * 0x104u) & M, s2);
  a[3] = mul_bf16x2_bcast<1>(((h & 0x00f000f0u) * 0x104u) & M, s2);
}

// One MMA step of a 64-row Marlin block, V3: the thread's 16 bytes of words v and 8
// scale bytes s, x's b0, b1; tiles c[0..3].
template <bool LEAN>
__device__ __forceinline__ void marlin_block_v3(uint4 v, uint2 s, u32 b0, u32 b1, float c[4][4]) {
  const u32 words[4] = {v.x, v.y, v.z, v.w};
  const u32 scales[2] = {s.x, s.y};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 a[4];
    marlin_word_v3<LEAN>(words[j], marlin_scales_v3(scales[j >> 1], j & 1), a);
    mma_bf16(c[j], a[0], a[1], a[2], a[3], b0, b1);
  }
}
