// The routed experts of one layer for up to 8 rows (MUSE_SPARK.md, "MoE"): two
// kernels, the gate/up GEMM with SwiGLU (experts_up_kernel) and the down GEMM
// (experts_down_kernel), templated on the weight format (FMT 0: bf16, 1: NVFP4 in the
// checkpoint's layout, 2: NVFP4 in vLLM's SM90 Marlin layout, read in place).
//
// Every block finds the distinct selected experts this rank holds from the ids on
// the device (in route order of first occurrence, the same list in every block and
// both kernels), then loops over work items (distinct expert, tile of output rows):
// each expert's weights are read once, for all 8 rows of x at a time, by
// mma.sync m16n8k16 (bf16 in, fp32 accumulate): A = 16 weight rows, B = x^T (8 rows).
// A thread loads its own 16 bytes of a weight row (32 NVFP4 codes or 8 bf16 values,
// consecutive k) and feeds them to the MMA in k order permuted within the tensor
// core step; x is loaded with the same permutation, so the sum covers each k once.
// The warps of a block split K; their partial sums are added in warp order through
// shared memory (deterministic).
//
// NVFP4 dequantization (nvfp4.dequantize, as vLLM defines it): for a 16-value block
// with e4m3 scale sc and the expert's fp32 global g, s = fp32(float(sc) * g), each
// value bf16_rne(fp32(e2m1 * s)). The code's magnitude bits placed at fp32 bits 22..24
// make the fp32 number e2m1 * 2^-126 (a subnormal for the codes 0 and 1), and
// s * 2^126 is exact while s < 4 (checked at build), so one fp32 multiply gives
// exactly fp32(e2m1 * s), then one rounding to bf16: the reference's bits. FMT 1 does
// that for a block's 8 magnitudes only (make_lut) and looks its 32 codes up with prmt,
// the sign bits xor'ed in (lut_quad): about 2 integer ops a code instead of 6
// (tests/test_cuda_experts_nvfp4_lut.py emulates it against nvfp4.dequantize).
//
// Marlin's layout (FMT 2, nvfp4_marlin.py; per expert, a GEMM of N rows over K):
// codes int32 [K / 16, 2N], each row of 16 k cut into 64-row blocks of 128 words;
// lane l = 4g + t of a warp finds in words 4l + j (j = 0..3) of a block exactly its
// m16n8k16 A fragments of the 16-row tile j: nibbles 0, 4 row g, k 2t, 2t + 1 (a0);
// 2, 6 row g + 8, k 2t, 2t + 1 (a1); 1, 5 row g, k 2t + 8, 2t + 9 (a2); 3, 7 row
// g + 8, k 2t + 8, 2t + 9 (a3); so one 16-byte load gives a thread its A of the four
// tiles for one MMA step, and x is read in plain k order. Scales: one byte [K / 16, N]
// (the fp16 bits 14..7 of Marlin's scale, whose value is the byte << 7 as fp16 over
// 2^7), permuted per 64 rows so that lane g's 8 bytes at 8g of a block are its own:
// byte 4 (j >> 1) + (j & 1) + 2h for row 16j + g + 8h. The fp32 global is Marlin's
// times 2^-119 (nvfp4_marlin.dequantize); then as above, the same bits.
//
// EXPERTS_V2 (a define, 0 when absent): FMT 2 decodes a word's 8 codes as e4m3 bytes
// (marlin_word_v2) and a scale byte as fp32 bits (marlin_s64), and both NVFP4 formats
// prefetch into L2 the next batch of a warp's weights and the next item's first batch
// while computing (prefetch_gemm); with 0, the code above as it was.
//
// EXPERTS_V2 = 2 (EXPERTS_V3; NVFP4 only): V2's prefetch, and the weights no longer
// rounded to bf16 one by one: A holds e2m1 * block scale EXACTLY (a bf16 product of
// 2 by 4 significant bits), the MMA sums in fp32 over all of K, and each output sum is
// multiplied once by the expert's fp32 global (W13: the gate rows' and the up rows'
// own) before the gate/up and output roundings to bf16. That is the math of vLLM's
// own Marlin kernel on SM90 (csrc/quantization/marlin/dequant.h: the fp4 codes' bits
// placed as bf16 with the exponent unbiased, the e4m3-derived scale bytes placed as
// bf16 by dequant_fp8_scales, one __hmul2 by the block scale in marlin_template.h's
// scale(); marlin_template.h's write_result multiplies the fp32 sums by
// global_scale_f32 before the bf16 conversion; marlin_utils_fp4.py puts 2^119 / sf in
// that global and zeroes the scales below 2 so that each byte's top bit is set), up to
// the order of the fp32 sums. Marlin (marlin_word_v3): a code's sign at bf16 bit 15 and
// magnitude at bits 6..8 is the bf16 of e2m1 * 2^-126 (a subnormal for 0.5), two codes
// a register by one mask, one multiply by 2^6 + 2^12 (or 2^2 + 2^8) and one mask; a
// scale byte B (0, or 0x80..0xf7: fp16 bits 14..7 of a value F >= 2) sign-extended to
// 16 bits and shifted left by 4 is the bf16 of -F * 2^112 (B = 0: zero), so one
// mul.rn.bf16x2 gives -e2m1 * F * 2^-14 exactly (at most 6 significant bits, at least
// 2^-14, at most 21), and the global becomes Marlin's times -2^-112 (the sign and the
// powers of two exact). NVFP4 rows (FMT 1): the block's table holds e2m1 * scale
// (make_lut_v3, exact in bf16 for every finite e4m3 scale) and the globals move to the
// output. tests/test_cuda_experts_v3.py emulates both decodes for every code and byte.
// The V3 Marlin loop also keeps its load pointers, advanced a batch at a time.
//
// EXPERTS_UP_BLOCKS, EXPERTS_DOWN_BLOCKS (2 when absent): the blocks per SM each
// kernel's registers are bounded for (__launch_bounds__); the provider's grid matches.
//
// EXPERTS_RING (a define, 0 when absent; V3 Marlin only): the up kernel's loads staged in
// shared memory instead of registers, a ring of S = EXPERTS_RING stages a warp (fewer
// where a warp has fewer steps), a stage one step of 16 k: the thread's own 16 bytes of
// codes a block (its A fragments, at 16 l), the warp's 64 scale bytes a block (copied by
// lanes 0..4 NBLK - 1, 16 bytes each; read by lane group g at 8 g) and the thread's own x
// words b0, b1. Before step s computes, the copies of step s + S - 1 (cp.async, one
// commit group a step) go out into the stage step s - 1 left, so the loads of S - 1 steps
// stay in flight through every step's decode and MMAs, and no register holds a load in
// flight. cp.async.wait_group makes a thread's own copies visible to it, and __syncwarp
// the scale lanes' copies to the warp (and every lane's reads of a stage done before it
// is refilled). The rings take the kernel's dynamic shared memory (UP_SMEM_BYTES), which
// the K reduction's `red` overlays: reduce_k starts with a barrier after every warp's
// ring is drained, and one more barrier after its sums are read keeps the next item's
// copies out until then. The same MMAs in the same order as V3: the same bits.
// EXPERTS_HALF (a define, 0 when absent; V3 Marlin only, not with EXPERTS_RING):
// each warp of the up kernel takes either the gate rows or the up rows of its item (one
// 64-row block, not both), so it holds half the accumulators and half a batch's loads and
// the kernel fits 3 blocks an SM (EXPERTS_UP_BLOCKS = 3): half the warps along K per half
// (WK1 / 2), each over twice the K. The halves' K-slices are added in warp order as before
// (reduce_k, per half), then the up half's sums go through shared memory to the gate
// half's first warp, which does SwiGLU. The same products summed in other K-slices: not
// V3's bits (the fp32 order), as close to the exact weights.
//
// EXPERTS_LEAN (a define, 0 when absent; V3 Marlin only): the Marlin loop with fewer
// integer-pipe instructions (at most half rate on SM90, and as busy as the issue slots in
// V3's loop: 206 of its 411 instructions a batch of 128 codes). The L2 prefetch's lines
// are pointers set once a loop and advanced a batch at a time (MarlinLines;
// prefetch_marlin works out every lane's step and block every batch), a batch further
// ahead (see warp_gemm_marlin), and a word's shift by 8 is a multiply-high by 2^24 (the
// FMA pipe). The same lines prefetched and the same words decoded: the same bits.
//
// EXPERTS_EARLY (a define, 0 when absent; EXPERTS_HALF only): the up kernel takes
// `ids_final`; when set, the ids were complete before the kernel launched (the caller's
// routing ran behind a full dependency, as cuda.moe's side stream and its join make it),
// so the block finds its experts and prefetches its first item's first batch into L2
// before its PDL wait, while the kernel before it (the pre-expert norm) still runs; x is
// read only after the wait, as always. Unset: the order of before. The same bits.
//
// EXPERTS_ROUTE_MASK (a define, 0 when absent): the down kernel's epilogue finds, once an
// item, which routes of each of a thread's two rows go to the item's slot (and, on slot
// 0's items, which go to experts this rank does not hold) as bit masks over the top-k,
// and stores each output value to those routes only; without it every value scans the
// row's TOP_K routes in shared memory (about a fifth of the down kernel's instructions
// at 8 rows x top-8). The same values stored to the same places: the same bits.
//
// EXPERTS_DOWN_SCATTER (a define, 0 when absent): the down kernel's K reduction as a
// reduce-scatter. With the reduction of before (reduce_k), the warp wk == 0 of each wm
// adds the WK2 partial sums of all NT2 tiles and alone runs the item's epilogue (the
// route masks, the scaling, the stores) while the other warps wait for it at the next
// item's reduction: the item's tail runs on one warp of WK2. Here every warp adds and
// stores its share of the tiles (tile a goes to warp a % WK2; with more warps along K
// than tiles, warps NT2.. own none): the same partial sums added in the same warp
// order and the same values stored: the same bits.
//
// EXPERTS_UP_SCATTER (a define, 0 when absent; EXPERTS_HALF only): the same for the up
// kernel's item tail. Each side's K reduction is a reduce-scatter, the up side's warp
// that owns a tile passes its sums to the gate side's warp that owns it, which applies
// SwiGLU and stores it; before, the gate side's first warp did all TPB tiles (16 values
// a thread, each an expf and a division) while the rest of the block waited. The same
// sums in the same order: the same bits.
//
// EXPERTS_TRACE (a define, 0 when absent; for scripts/experts-trace): both kernels take one
// more argument, `trace` (u64, TRACE_STRIDE a block), where thread 0 of each block writes
// its SM (%smid) and item count, the %globaltimer when its items may start (after the PDL
// wait and find_experts), when it ends, and at the start of each of its first TRACE_ITEMS
// items. Without it the kernels are as before, instruction for instruction.
//
// EXPERTS_DOWN_QUEUE (a define, 0 when absent): the down kernel's items after each block's
// first (item blockIdx.x, as without it) claimed from a queue, a counter the kernel takes
// as `queue` (int [2], zeros at launch), instead of every gridDim.x-th item: thread 0
// claims the block's next item when an item starts (so its first batch can be warmed into
// L2), and the last block to finish zeroes the counter and its own count of finished
// blocks for the next launch. The down kernel's blocks start while the up kernel's last
// blocks run (PDL), on the SMs those leave first, so with every gridDim.x-th item one SM
// can get four blocks of the most items (bench/NOTES.md v25's trace: 16 items on an SM
// against a median of 12 at 55 experts); claimed, the items go to the blocks that are
// free first. An item's sums do not depend on the block that runs it: the same bits.
// EXPERTS_SLOT_MASKS (a define, 0 when absent; with EXPERTS_ROUTE_MASK): the down
// kernel's route masks made once a block, after find_experts: per slot and row, the
// routes of the row to the slot; per row, its routes to experts not held. An item's
// epilogue reads its two rows' masks (two shared loads a thread) instead of scanning the
// rows' TOP_K routes every item. The same masks: the same bits.
// EXPERTS_STREAM_LOADS (a define, 0 when absent; the V3 Marlin loop): the weights' code
// words loaded past L1 (ld.global.nc.L1::no_allocate), where each is read once and would
// only churn it, so that x's words, which every warp of an expert reads again, stay there.
// = 2: the same loads also hinted evict-first in L2 (CUTLASS's SM90 policy word, a
// constant the compiler keeps in a register), so that the weight stream leaves the step's
// activations there. The same values loaded: the same bits.
// EXPERTS_DOWN_SPARE (a define, 0 when absent; V3 Marlin with EXPERTS_LEAN): the down
// kernel without its L2 prefetches but a block's first item's, before its PDL wait: not
// each next item's first batch, nor the K loop's next batch. At expert TP a warp's item is
// 8 steps, two batches. On the H100, warming more of the next item (the whole of it) was
// slower; warming none was faster at 55 and 64 experts, slower at 33 (bench/NOTES.md v33,
// v34). Prefetches only: the same bits.
// EXPERTS_DOWN_CARRY (a define, 0 when absent; with EXPERTS_DOWN_SPARE and
// EXPERTS_DOWN_QUEUE): a down warp's next item's first batch (its code words and scales)
// loaded into registers as soon as its item's K loop ends, before the item's tail (the K
// reduction through shared memory, the route masks, the stores), and its first item's
// before the PDL wait. Without it the next item's first loads start only after the tail
// and the next claim's barrier: at expert TP a warp's item is two batches, so the tail
// sits between every two round trips of the block's loads (the tails are 16% of the down
// kernel on the H100, bench/NOTES.md v41). The same words decoded in the same order: the
// same bits. EXPERTS_DOWN_CARRY = 2: also one barrier an item fewer. The claim of the next
// item is shown to the block by a barrier after the K loop, which the K reduction's first
// barrier becomes, instead of by its own barrier at the item's start; the carried loads
// then go out after that barrier.
#include "common.cuh"
#include "experts_common.cuh"

#ifndef EXPERTS_TRACE
#define EXPERTS_TRACE 0
#endif
#if EXPERTS_TRACE
// trace[block * TRACE_STRIDE + ...]: [0] smid | items << 32, [1] start, [2] end, [3 + n] item n's start
#define TRACE_ITEMS 61
#define TRACE_STRIDE (3 + TRACE_ITEMS)
#define TRACE_PARAM , unsigned long long* __restrict__ trace
__device__ __forceinline__ unsigned long long trace_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define TRACE_START \
  if (threadIdx.x == 0) trace[(long)blockIdx.x * TRACE_STRIDE + 1] = trace_now();
// the block's n-th item starts
#define TRACE_NTH(n) \
  if (threadIdx.x == 0 && (n) < TRACE_ITEMS) trace[(long)blockIdx.x * TRACE_STRIDE + 3 + (n)] = trace_now();
#define TRACE_ITEM(item) TRACE_NTH(((item) - (int)blockIdx.x) / (int)gridDim.x)
// the block ends after n items
#define TRACE_END_N(n)                                                      \
  if (threadIdx.x == 0) {                                                   \
    unsigned smid;                                                          \
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));                       \
    trace[(long)blockIdx.x * TRACE_STRIDE] = ((unsigned long long)(n) << 32) | smid; \
    trace[(long)blockIdx.x * TRACE_STRIDE + 2] = trace_now();               \
  }
#define TRACE_END(items) \
  TRACE_END_N((int)blockIdx.x < (items) ? ((items) - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0)
#else
#define TRACE_PARAM
#define TRACE_START
#define TRACE_NTH(n)
#define TRACE_ITEM(item)
#define TRACE_END_N(n)
#define TRACE_END(items)
#endif

#ifndef EXPERTS_DOWN_QUEUE
#define EXPERTS_DOWN_QUEUE 0
#endif
#if EXPERTS_DOWN_QUEUE
#define QUEUE_PARAM , int* __restrict__ queue
#else
#define QUEUE_PARAM
#endif

#ifndef EXPERTS_DOWN_SCATTER
#define EXPERTS_DOWN_SCATTER 0
#endif
#ifndef EXPERTS_UP_SCATTER
#define EXPERTS_UP_SCATTER 0
#endif
#if EXPERTS_UP_SCATTER && !EXPERTS_HALF
#error "EXPERTS_UP_SCATTER is for the EXPERTS_HALF up kernel"
#endif
#ifndef EXPERTS_SLOT_MASKS
#define EXPERTS_SLOT_MASKS 0
#endif
#if EXPERTS_SLOT_MASKS && !EXPERTS_ROUTE_MASK
#error "EXPERTS_SLOT_MASKS is for the EXPERTS_ROUTE_MASK epilogue"
#endif
#ifndef EXPERTS_ROUTE_MASK
#define EXPERTS_ROUTE_MASK 0
#endif
#ifndef EXPERTS_LEAN
#define EXPERTS_LEAN 0
#endif
#ifndef EXPERTS_EARLY
#define EXPERTS_EARLY 0
#endif
#ifndef EXPERTS_STREAM_LOADS
#define EXPERTS_STREAM_LOADS 0
#endif
#ifndef EXPERTS_DOWN_SPARE
#define EXPERTS_DOWN_SPARE 0
#endif
#ifndef EXPERTS_DOWN_CARRY
#define EXPERTS_DOWN_CARRY 0
#endif
#if EXPERTS_DOWN_CARRY && !(EXPERTS_DOWN_SPARE && EXPERTS_DOWN_QUEUE)
#error "EXPERTS_DOWN_CARRY is for the down kernel with EXPERTS_DOWN_SPARE and EXPERTS_DOWN_QUEUE"
#endif
#if EXPERTS_ROUTE_MASK && TOP_K > 32
#error "EXPERTS_ROUTE_MASK: a row's routes in one 32-bit mask (TOP_K <= 32)"
#endif

#ifndef EXPERTS_V2
#define EXPERTS_V2 0
#endif
#define EXPERTS_V3 (EXPERTS_V2 >= 2)

#if !defined(P_DIM) || !defined(I_LOCAL) || !defined(FMT) || !defined(TOP_K)
#error "experts.cu needs P_DIM, I_LOCAL, FMT and TOP_K"
#endif
#if EXPERTS_V3 && FMT == 0
#error "EXPERTS_V2 = 2 (V3) is for the NVFP4 formats"
#endif
#ifndef EXPERTS_UP_BLOCKS
#define EXPERTS_UP_BLOCKS 2
#endif
#ifndef EXPERTS_DOWN_BLOCKS
#define EXPERTS_DOWN_BLOCKS 2
#endif
#ifndef EXPERTS_RING
#define EXPERTS_RING 0
#endif
#if EXPERTS_RING && !(EXPERTS_RING >= 2 && EXPERTS_V3 && FMT == 2)
#error "EXPERTS_RING (at least 2): the V3 Marlin up kernel (EXPERTS_V2 = 2, FMT 2)"
#endif
#ifndef EXPERTS_HALF
#define EXPERTS_HALF 0
#endif
#if EXPERTS_HALF && !(EXPERTS_V3 && FMT == 2 && !EXPERTS_RING)
#error "EXPERTS_HALF is for the V3 Marlin up kernel (EXPERTS_V2 = 2, FMT 2), not with EXPERTS_RING"
#endif
#if EXPERTS_LEAN && !(EXPERTS_V3 && FMT == 2)
#error "EXPERTS_LEAN is for the V3 Marlin loop (EXPERTS_V2 = 2, FMT 2)"
#endif
#if EXPERTS_EARLY && !EXPERTS_HALF
#error "EXPERTS_EARLY is for the EXPERTS_HALF up kernel"
#endif
#if EXPERTS_STREAM_LOADS && !(EXPERTS_V3 && FMT == 2)
#error "EXPERTS_STREAM_LOADS is for the V3 Marlin loop (EXPERTS_V2 = 2, FMT 2)"
#endif
#if EXPERTS_DOWN_SPARE && !(EXPERTS_V3 && FMT == 2 && EXPERTS_LEAN)
#error "EXPERTS_DOWN_SPARE is for the V3 Marlin kernels with EXPERTS_LEAN"
#endif

#define NB 8  // rows of x per MMA (the n of m16n8k16)
#define WARPS 8
#define NTHREADS (WARPS * 32)

// Elements a thread loads per weight row per 16-byte load, and per chunk of a warp.
// Marlin: a chunk is four MMA steps of 16 k.
constexpr int G = FMT == 1 ? 32 : 8;
constexpr int CHUNK_K = FMT == 2 ? 64 : 4 * G;
// A warp's rows: 16-row tiles in blocks of TPB consecutive tiles (Marlin: its 64-row
// blocks); up: UP_COLS intermediate columns (gate rows and up rows, NT1 tiles); down:
// DOWN_ROWS output rows (NT2 tiles).
constexpr int TPB = FMT == 2 ? 4 : 1;
constexpr int UP_COLS = 16 * TPB;
constexpr int DOWN_ROWS = FMT == 2 ? 64 : 32;
constexpr int NT1 = 2 * UP_COLS / 16, NT2 = DOWN_ROWS / 16;

// Warps along K: as many as keep at least two chunks per warp, at most 8.
__host__ __device__ constexpr int warps_k(int k) {
  return k >= 16 * CHUNK_K ? 8 : (k >= 8 * CHUNK_K ? 4 : (k >= 4 * CHUNK_K ? 2 : 1));
}
// A Marlin warp's steps of 16 k over K with WK_ warps along K, and how many of them it
// loads together (a batch).
__host__ __device__ constexpr int marlin_steps(int k, int wk) { return k / wk / 16; }
__host__ __device__ constexpr int marlin_batch_steps(int k, int wk) {
  return marlin_steps(k, wk) < 4 ? marlin_steps(k, wk) : 4;
}

// A warp's NT tiles of sums, zeroed.
template <int NT>
__device__ __forceinline__ void zero_sums(float c[NT][4]) {
#pragma unroll
  for (int a = 0; a < NT; ++a)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[a][e] = 0.f;
}
constexpr int WK1 = warps_k(P_DIM), WM1 = WARPS / WK1;
// EXPERTS_DOWN_WK (a define; warps_k when absent): the down kernel's warps along K, fewer
// for longer K-slices a warp and fewer cross-warp reductions (barriers) an item.
#ifdef EXPERTS_DOWN_WK
constexpr int WK2 = EXPERTS_DOWN_WK, WM2 = WARPS / WK2;
static_assert(WK2 == 1 || WK2 == 2 || WK2 == 4 || WK2 == 8, "EXPERTS_DOWN_WK: 1, 2, 4 or 8");
#else
constexpr int WK2 = warps_k(I_LOCAL), WM2 = WARPS / WK2;
#endif
// Up: an item is UP_COLS * WM1 intermediate columns (gate and up rows); down:
// DOWN_ROWS * WM2 output rows.
constexpr int TILES1 = I_LOCAL / (UP_COLS * WM1);
constexpr int TILES2 = P_DIM / (DOWN_ROWS * WM2);
static_assert(P_DIM % (CHUNK_K * WK1) == 0, "P_DIM: a multiple of the chunk times the warps along K");
static_assert(I_LOCAL % (CHUNK_K * WK2) == 0, "I_LOCAL: a multiple of the chunk times the warps along K");
static_assert(I_LOCAL % (UP_COLS * WM1) == 0 && P_DIM % (DOWN_ROWS * WM2) == 0, "tile widths");

// Marlin's one-byte scale: float(fp16 bits byte << 7) / 2^7, exact (5 exponent bits,
// bias 15, 3 mantissa bits, no sign; exponent 31 is inf / NaN as in fp16).
__device__ __forceinline__ float marlin_scale_to_float(u32 v) {
  const u32 exp = v >> 3, man = v & 7u;
  if (exp == 31u) return __uint_as_float(0x7f800000u | (man << 20));
  if (exp == 0) return (float)man * 0x1p-24f;  // man * 2^-17 / 2^7, exact
  return __uint_as_float(((exp + 105u) << 23) | (man << 20));
}

// NVFP4 (FMT 1) by table: a block's 16 values are its 8 magnitudes' bf16 (the fp32
// product above, so the same bits) with the sign flipped for the negative codes,
// since fp32(-m * s) = -fp32(m * s) and rounding to bf16 is symmetric. The table keeps
// the magnitudes' low bytes (lo0: codes 0..3, lo1: 4..7) and high bytes (hi0, hi1),
// so one prmt looks up a byte of four codes whose magnitudes are its selector's nibbles.
struct Lut {
  u32 lo0, lo1, hi0, hi1;
};

__device__ __forceinline__ Lut make_lut(float s126) {
  u32 p[4];  // bf16x2 of magnitudes 2c, 2c + 1
#pragma unroll
  for (u32 c = 0; c < 4; ++c)
    p[c] = pack_bf16x2(__uint_as_float((2 * c) << 22) * s126, __uint_as_float((2 * c + 1) << 22) * s126);
  return {prmt(p[0], p[1], 0x6420), prmt(p[2], p[3], 0x6420), prmt(p[0], p[1], 0x7531), prmt(p[2], p[3], 0x7531)};
}

// Codes 4q .. 4q + 3 of w (q = 0, 1) as two bf16x2 (codes 4q, 4q + 1 and 4q + 2, 4q + 3).
__device__ __forceinline__ void lut_quad(const Lut& t, u32 w, int q, u32& r0, u32& r1) {
  const u32 sel = (q ? w >> 16 : w) & 0x7777u;  // magnitudes: prmt's nibble bit 3 would replicate a sign
  // The codes' sign bits at their high bytes' bit 7: byte 0 of w << 4 holds code 0's sign, of w code 1's.
  const u32 sign = prmt(w << 4, w, q ? 0x7362 : 0x5140);
  const u32 lo = prmt(t.lo0, t.lo1, sel);
  const u32 hi = prmt(t.hi0, t.hi1, sel) ^ (sign & 0x80808080u);
  r0 = prmt(lo, hi, 0x5140);
  r1 = prmt(lo, hi, 0x7362);
}

// Codes lo and hi of w (nibble indices), dequantized with s126 = s * 2^126: bf16x2.
__device__ __forceinline__ u32 dequant_pair(u32 w, int lo, int hi, float s126) {
  const u32 c0 = w >> (4 * lo), c1 = w >> (4 * hi);
  const float f0 = __uint_as_float(((c0 & 7u) << 22) | ((c0 & 8u) << 28)) * s126;
  const float f1 = __uint_as_float(((c1 & 7u) << 22) | ((c1 & 8u) << 28)) * s126;
  return pack_bf16x2(f0, f1);
}

#if EXPERTS_V3
// NVFP4 (FMT 1), V3: the table of e2m1 * sc (fp32 exact, then exact in bf16: at most 6
// significant bits, from 2^-10 to 2688 for every finite e4m3 sc).
__device__ __forceinline__ Lut make_lut_v3(float sc) {
  constexpr float E2M1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  u32 p[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) p[c] = pack_bf16x2(E2M1[2 * c] * sc, E2M1[2 * c + 1] * sc);
  return {prmt(p[0], p[1], 0x6420), prmt(p[2], p[3], 0x6420), prmt(p[0], p[1], 0x7531), prmt(p[2], p[3], 0x7531)};
}

#endif

// The weights of one expert for one GEMM: rows of K values.
struct Weights {
  const unsigned char* w;      // bf16 [rows, K], NVFP4 codes [rows, K / 2] or Marlin's int32 [K / 16, 2 rows]
  const unsigned char* scale;  // NVFP4: e4m3 [rows, K / 16]; Marlin: its bytes [K / 16, rows]
  float global_lo, global_hi;  // NVFP4: the global scale of rows below / from `split`
  int split;
};

#if EXPERTS_V2
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Marlin (FMT 2): SB steps of 16 k from row kt0 of a warp's NBLK blocks of 64 rows into
// L2, a line a lane: the codes' 128-byte lines (512 bytes a step and block), then the
// scale bytes (64 a step and block).
template <int N, int NBLK, int SB>
__device__ __forceinline__ void prefetch_marlin(const Weights& W, const int blk0[NBLK], long kt0) {
  static_assert(NBLK <= 2 && SB * NBLK * 4 <= 32, "a line a lane");
  const int lane = threadIdx.x & 31;
  if (lane < SB * NBLK * 4) {
    const long kt = kt0 + lane / (4 * NBLK), blk = blk0[0] + ((lane / 4) % NBLK ? blk0[NBLK - 1] - blk0[0] : 0);
    prefetch_l2(W.w + (kt * 2 * N + 2 * blk) * 4 + 128 * (lane & 3));
  }
  if (lane < SB * NBLK) {
    const long kt = kt0 + lane / NBLK, blk = blk0[0] + (lane % NBLK ? blk0[NBLK - 1] - blk0[0] : 0);
    prefetch_l2(W.scale + kt * N + blk);
  }
}

#if EXPERTS_LEAN
// prefetch_marlin's lines for the batch at row kt0 of 16 k, then for each batch after
// it: a lane's code line and scale line set once, advanced SB steps at a time.
template <int N, int NBLK, int SB>
struct MarlinLines {
  static_assert(NBLK <= 2 && SB * NBLK * 4 <= 32, "a line a lane");
  const unsigned char* code;
  const unsigned char* scale;
  bool has_code, has_scale;
  __device__ __forceinline__ MarlinLines(const Weights& W, const int blk0[NBLK], long kt0) {
    const int lane = threadIdx.x & 31;
    has_code = lane < SB * NBLK * 4;
    has_scale = lane < SB * NBLK;
    const long cb = (lane / 4) % NBLK ? blk0[NBLK - 1] : blk0[0], sb = lane % NBLK ? blk0[NBLK - 1] : blk0[0];
    code = W.w + ((kt0 + lane / (4 * NBLK)) * 2 * N + 2 * cb) * 4 + 128 * (lane & 3);
    scale = W.scale + (kt0 + lane / NBLK) * N + sb;
  }
  // This batch's lines into L2 (when `issue`), then on to the next batch's.
  __device__ __forceinline__ void prefetch_and_advance(bool issue) {
    if (issue && has_code) prefetch_l2(code);
    if (issue && has_scale) prefetch_l2(scale);
    code += (long)SB * 8 * N;
    scale += (long)SB * N;
  }
};
#endif

// NVFP4 rows (FMT 1): CB chunks from k of a warp's 32 rows (lane: row row0[lane / 16] +
// lane % 16) into L2: the codes (64 bytes a chunk), then the scales (8 bytes a chunk).
template <int K, int CB>
__device__ __forceinline__ void prefetch_rows(const Weights& W, const int row0[2], int k) {
  const int lane = threadIdx.x & 31;
  const long row = (lane >> 4 ? row0[1] : row0[0]) + (lane & 15);
#pragma unroll
  for (int off = 0; off < CB * CHUNK_K / 2; off += 128) prefetch_l2(W.w + row * (K / 2) + k / 2 + off);
  prefetch_l2(W.scale + row * (K / 16) + k / 16);
}
#endif

#if EXPERTS_STREAM_LOADS
// A thread's 16 bytes of a weight (EXPERTS_STREAM_LOADS), read once: not kept in L1.
__device__ __forceinline__ uint4 ld_weight_16(const uint4* p) {
  uint4 v;
#if EXPERTS_STREAM_LOADS == 2
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(0x12F0000000000000ull));
#else
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
  return v;
}
#endif

#if EXPERTS_V3
// One step of 16 k of a warp's NBLK Marlin blocks, V3: the thread's words q[b] and scale
// bytes sc[b] of block b, x's words b0 at xs and b1 at xs + 4 (rows >= nx: zeros).
template <int NBLK>
__device__ __forceinline__ void marlin_step_v3(const uint4 q[NBLK], const uint2 sc[NBLK], const u32* xs, bool xrow,
                                               float c[4 * NBLK][4]) {
  u32 b0 = 0u, b1 = 0u;
  if (xrow) {
    b0 = __ldg(xs);
    b1 = __ldg(xs + 4);
  }
#pragma unroll
  for (int b = 0; b < NBLK; ++b) marlin_block_v3<EXPERTS_LEAN>(q[b], sc[b], b0, b1, c + 4 * b);
}

// The thread's first words and scales of a warp's NBLK Marlin blocks at blk0 (N rows), from
// the row of 16 k kt0.
template <int N, int NBLK>
__device__ __forceinline__ void marlin_pointers(const Weights& W, const int blk0[NBLK], int kt0, const uint4* wp[NBLK],
                                                const uint2* sp[NBLK]) {
  const int lane = threadIdx.x & 31, g = lane >> 2;
#pragma unroll
  for (int b = 0; b < NBLK; ++b) {
    wp[b] = reinterpret_cast<const uint4*>(W.w) + ((long)kt0 * 2 * N + 2 * blk0[b]) / 4 + lane;
    sp[b] = reinterpret_cast<const uint2*>(W.scale + (long)kt0 * N + blk0[b]) + g;
  }
}

// A batch's loads of a warp's NBLK blocks: SB steps from wp, sp, a step N / 2 uint4 and
// N / 8 uint2 further.
template <int N, int NBLK, int SB>
__device__ __forceinline__ void marlin_batch_load(uint4 q[SB][NBLK], uint2 sc[SB][NBLK], const uint4* const wp[NBLK],
                                                  const uint2* const sp[NBLK]) {
#pragma unroll
  for (int sb = 0; sb < SB; ++sb)
#pragma unroll
    for (int b = 0; b < NBLK; ++b) {
#if EXPERTS_STREAM_LOADS
      q[sb][b] = ld_weight_16(wp[b] + sb * (N / 2));
#else
      q[sb][b] = __ldg(wp[b] + sb * (N / 2));
#endif
      sc[sb][b] = __ldg(sp[b] + sb * (N / 8));
    }
}

// The load pointers on to the next batch.
template <int N, int NBLK, int SB>
__device__ __forceinline__ void marlin_batch_advance(const uint4* wp[NBLK], const uint2* sp[NBLK]) {
#pragma unroll
  for (int b = 0; b < NBLK; ++b) {
    wp[b] += SB * (N / 2);
    sp[b] += SB * (N / 8);
  }
}

// A batch's MMAs, x's words from xp (8 a step).
template <int NBLK, int SB>
__device__ __forceinline__ void marlin_batch_mma(const uint4 q[SB][NBLK], const uint2 sc[SB][NBLK], const u32* xp,
                                                 bool xrow, float c[4 * NBLK][4]) {
#pragma unroll
  for (int sb = 0; sb < SB; ++sb) marlin_step_v3<NBLK>(q[sb], sc[sb], xp + 8 * sb, xrow, c);
}

// A batch of the V3 Marlin loop in q, sc: its loads, its MMAs, and the pointers on to the
// next batch.
template <int N, int NBLK, int SB>
__device__ __forceinline__ void marlin_batch(uint4 q[SB][NBLK], uint2 sc[SB][NBLK], const uint4* wp[NBLK],
                                             const uint2* sp[NBLK], const u32*& xp, bool xrow, float c[4 * NBLK][4]) {
  marlin_batch_load<N, NBLK, SB>(q, sc, wp, sp);
  marlin_batch_mma<NBLK, SB>(q, sc, xp, xrow, c);
  marlin_batch_advance<N, NBLK, SB>(wp, sp);
  xp += SB * 8;
}
#endif


// A warp's 32 rows (two tiles of 16: rows row0[0] + 0..15, row0[1] + 0..15) over its
// K-slice [k0, k0 + K / WK_) against B = x rows (8, row stride xs, rows >= nx read as 0).
template <int K, int WK_>
__device__ __forceinline__ void warp_gemm(const Weights& W, const int row0[2], int k0, const bf16_t* __restrict__ x,
                                          int xs, int nx, float c[2][4]) {
  constexpr int KS = K / WK_;
  constexpr int NC = KS / CHUNK_K;
  constexpr int CB = NC < 4 ? NC : 4;  // chunks loaded together
  static_assert(NC % CB == 0, "chunks per batch");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  constexpr int ROW_BYTES = FMT == 1 ? K / 2 : K * 2;
  zero_sums<2>(c);
  const bf16_t* xr = x + (long)g * xs;
  const bool xrow = g < nx;
#pragma unroll 1
  for (int batch = 0; batch < NC; batch += CB) {
    uint4 q[2][2][CB];
    unsigned short sc[2][2][CB];
    // Every load of the batch first: 16 bytes per row and chunk in flight per thread.
#pragma unroll
    for (int cb = 0; cb < CB; ++cb) {
      const int kb = k0 + (batch + cb) * CHUNK_K + G * t;  // this thread's first k of the chunk
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const long row = row0[a] + g + 8 * h;
          const long byte = FMT == 1 ? kb / 2 : kb * 2;
          q[a][h][cb] = __ldg(reinterpret_cast<const uint4*>(W.w + row * ROW_BYTES + byte));
          if (FMT == 1)
            sc[a][h][cb] = __ldg(reinterpret_cast<const unsigned short*>(W.scale + row * (K / 16) + kb / 16));
        }
    }
#if EXPERTS_V2
    if (FMT == 1 && batch + CB < NC) prefetch_rows<K, CB>(W, row0, k0 + (batch + CB) * CHUNK_K);
#endif
#pragma unroll
    for (int cb = 0; cb < CB; ++cb) {
      const int kb = k0 + (batch + cb) * CHUNK_K + G * t;
      Lut lut[2][2];  // NVFP4: each row's table of the 16-value block of elements 4j.., made at its first j
#pragma unroll
      for (int j = 0; j < G / 4; ++j) {
        const int k = kb + 4 * j;
        uint2 bx = make_uint2(0u, 0u);
        if (xrow) bx = __ldg(reinterpret_cast<const uint2*>(xr + k));
        if (FMT == 1 && j % 4 == 0) {
#pragma unroll
          for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#if EXPERTS_V3
              const float2 scale = e4m3x2_to_float2(sc[a][h][cb]);
              lut[a][h] = make_lut_v3(j == 0 ? scale.x : scale.y);
#else
              const float glob = row0[a] + g + 8 * h < W.split ? W.global_lo : W.global_hi;
              const float2 scale = e4m3x2_to_float2(sc[a][h][cb]);
              lut[a][h] = make_lut(((j == 0 ? scale.x : scale.y) * glob) * 0x1p126f);
#endif
            }
        }
#pragma unroll
        for (int a = 0; a < 2; ++a) {
          u32 r[2][2];  // [h][pair]: elements 4j, 4j + 1 and 4j + 2, 4j + 3 of row g + 8h
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 v = q[a][h][cb];
            const u32 words[4] = {v.x, v.y, v.z, v.w};
            if (FMT == 1) {
              lut_quad(lut[a][h], words[j >> 1], j & 1, r[h][0], r[h][1]);
            } else {
              r[h][0] = words[2 * j];
              r[h][1] = words[2 * j + 1];
            }
          }
          mma_bf16(c[a], r[0][0], r[1][0], r[0][1], r[1][1], bx.x, bx.y);
        }
      }
    }
  }
}

// Marlin's layout (FMT 2): a warp's NBLK blocks of 64 rows (block b: rows blk0[b] + 0..63,
// tiles c[4b + j]) of a GEMM of N rows over its K-slice [k0, k0 + K / WK_), against
// B = x rows as warp_gemm. Per MMA step (16 k) a thread loads one 16-byte word run per
// block and 8 scale bytes per block: the layout's own fragments (see the top).
// `steps`: the steps of 16 k from k0, a multiple of the batch SB (the whole slice, STEPS,
// by default).
template <int K, int N, int WK_, int NBLK, bool LOOP_PREFETCH = true>
__device__ __forceinline__ void warp_gemm_marlin(const Weights& W, const int blk0[NBLK], int k0,
                                                 const bf16_t* __restrict__ x, int xs, int nx, float c[4 * NBLK][4],
                                                 int steps) {
  constexpr int STEPS = marlin_steps(K, WK_);
  constexpr int SB = marlin_batch_steps(K, WK_);  // steps loaded together
  static_assert(STEPS % SB == 0, "steps per batch");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  zero_sums<4 * NBLK>(c);
  const bf16_t* xr = x + (long)g * xs;
  const bool xrow = g < nx;
#if EXPERTS_V3
  // The thread's words, scales and x at the warp's first step, advanced a batch at a
  // time: a batch's loads at constant offsets (a step: N / 2 uint4, N / 8 uint2, 8 u32).
  const uint4* wp[NBLK];
  const uint2* sp[NBLK];
  marlin_pointers<N, NBLK>(W, blk0, k0 / 16, wp, sp);
  const u32* xp = reinterpret_cast<const u32*>(xr + k0 + 2 * t);
#endif
#if EXPERTS_LEAN
  // Batch 1's lines now, then in each batch those of the batch two ahead: ptxas places
  // the predicated prefetch anywhere in its batch (at its end, past the MMAs, in the
  // SASS), so one batch ahead could leave no lead at all.
  MarlinLines<N, NBLK, SB> lines(W, blk0, k0 / 16 + SB);
  lines.prefetch_and_advance(LOOP_PREFETCH && SB < steps);
#endif
#pragma unroll 1
  for (int batch = 0; batch < steps; batch += SB) {
#if EXPERTS_LEAN
    lines.prefetch_and_advance(LOOP_PREFETCH && batch + 2 * SB < steps);
#elif EXPERTS_V2
    if (batch + SB < steps) prefetch_marlin<N, NBLK, SB>(W, blk0, k0 / 16 + batch + SB);
#endif
#if EXPERTS_V3
    uint4 q[SB][NBLK];
    uint2 sc[SB][NBLK];
    marlin_batch<N, NBLK, SB>(q, sc, wp, sp, xp, xrow, c);
#else
    uint4 q[NBLK][SB];
    uint2 sc[NBLK][SB];
#pragma unroll
    for (int sb = 0; sb < SB; ++sb) {
      const long kt = k0 / 16 + batch + sb;  // the row of 16 k
#pragma unroll
      for (int b = 0; b < NBLK; ++b) {
        q[b][sb] = __ldg(reinterpret_cast<const uint4*>(W.w) + (kt * 2 * N + 2 * blk0[b]) / 4 + lane);
        sc[b][sb] = __ldg(reinterpret_cast<const uint2*>(W.scale + kt * N + blk0[b]) + g);
      }
    }
#pragma unroll
    for (int sb = 0; sb < SB; ++sb) {
      u32 b0 = 0u, b1 = 0u;
      const int k = k0 + (batch + sb) * 16 + 2 * t;
      if (xrow) {
        b0 = __ldg(reinterpret_cast<const u32*>(xr + k));
        b1 = __ldg(reinterpret_cast<const u32*>(xr + k + 8));
      }
#pragma unroll
      for (int b = 0; b < NBLK; ++b) {
        const float glob = blk0[b] < W.split ? W.global_lo : W.global_hi;
        const uint4 v = q[b][sb];
        const u32 words[4] = {v.x, v.y, v.z, v.w};
        const u32 scales[2] = {sc[b][sb].x, sc[b][sb].y};
#if EXPERTS_V2
        const float g105 = glob * 0x1p105f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const u32 sw = scales[j >> 1] >> (8 * (j & 1));  // row g's byte at bits 0..7, row g + 8's at 16..23
          u32 a[4];
          marlin_word_v2(words[j], marlin_s64((sw << 20) & 0x0ff00000u, g105),
                         marlin_s64((sw << 4) & 0x0ff00000u, g105), a);
          mma_bf16(c[4 * b + j], a[0], a[1], a[2], a[3], b0, b1);
        }
#else
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const u32 sw = scales[j >> 1] >> (8 * (j & 1));
          const float s0 = (marlin_scale_to_float(sw & 0xffu) * glob) * 0x1p126f;          // row g
          const float s1 = (marlin_scale_to_float((sw >> 16) & 0xffu) * glob) * 0x1p126f;  // row g + 8
          const u32 w = words[j];
          mma_bf16(c[4 * b + j], dequant_pair(w, 0, 4, s0), dequant_pair(w, 2, 6, s1), dequant_pair(w, 1, 5, s0),
                   dequant_pair(w, 3, 7, s1), b0, b1);
        }
#endif
      }
    }
#endif
  }
}

#if EXPERTS_RING
// A stage of the up kernel's ring (EXPERTS_RING, see the top): one step of 16 k of a
// warp's NBLK blocks of 64 rows.
template <int NBLK>
struct RingStage {
  static constexpr int CODES = 0;                // block b's codes: lane l's 16 bytes (its A fragments) at 512 b + 16 l
  static constexpr int SCALES = NBLK * 512;      // block b's 64 scale bytes at 64 b: lane group g's 8 at 8 g
  static constexpr int X = SCALES + NBLK * 64;   // lane l's b0, b1 at 8 l
  static constexpr int BYTES = X + 32 * 8;
};
constexpr int UP_NBLK = NT1 / TPB;
constexpr int RING_STEPS = P_DIM / WK1 / 16;  // a warp's steps in an item
constexpr int RING_S = EXPERTS_RING < RING_STEPS ? EXPERTS_RING : RING_STEPS;
static_assert(RING_S >= 2 && RING_STEPS % RING_S == 0, "EXPERTS_RING: at least 2, dividing a warp's steps");
constexpr int RING_BYTES = WARPS * RING_S * RingStage<UP_NBLK>::BYTES;
constexpr int RED1_BYTES = WARPS * NT1 * 4 * 32 * (int)sizeof(float);
// The up kernel's dynamic shared memory: the rings, `red` over them.
constexpr int UP_SMEM_BYTES = RING_BYTES > RED1_BYTES ? RING_BYTES : RED1_BYTES;

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes from global memory to shared address dst, past L1 (the weights are read once).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// 4 bytes (x, read by every block: through L1).
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

// Shared-memory loads at a shared address (ordered after the waits, as the copies are).
__device__ __forceinline__ uint4 ld_shared_16(u32 a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a)
               : "memory");
  return v;
}

__device__ __forceinline__ uint2 ld_shared_8(u32 a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a) : "memory");
  return v;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Until at most PENDING of this thread's newest commit groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// warp_gemm_marlin's V3 loop (its MMAs in its order) with the loads staged in the warp's
// ring of S stages (see the top): step s computes from stage s % S after the copies of
// step s + S - 1 are issued into stage (s - 1) % S. The whole slice (K / WK_ / 16 steps).
template <int K, int N, int WK_, int NBLK, int S>
__device__ __forceinline__ void warp_gemm_marlin_ring(const Weights& W, const int blk0[NBLK], int k0,
                                                      const bf16_t* __restrict__ x, int xs, int nx,
                                                      float c[4 * NBLK][4], u32 ring) {
  constexpr int STEPS = K / WK_ / 16;
  static_assert(STEPS % S == 0 && S >= 2 && 4 * NBLK <= 32, "ring steps, a scale lane per 16 bytes");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  zero_sums<4 * NBLK>(c);
  const bool xrow = g < nx;
  // The sources at the group of S steps being computed (as warp_gemm_marlin's V3 pointers):
  // the thread's words, its 16 scale bytes (lanes 0..4 NBLK - 1: block lane / 4, bytes
  // 16 (lane % 4)..) and its x words.
  const uint4* wp[NBLK];
#pragma unroll
  for (int b = 0; b < NBLK; ++b)
    wp[b] = reinterpret_cast<const uint4*>(W.w) + ((long)(k0 / 16) * 2 * N + 2 * blk0[b]) / 4 + lane;
  const bool scale_lane = lane < 4 * NBLK;
  const int sblk = scale_lane ? lane / 4 : 0;
  int srow = blk0[0];  // blk0[sblk], selected (a runtime index would put blk0 on the stack)
#pragma unroll
  for (int b = 1; b < NBLK; ++b) srow = sblk == b ? blk0[b] : srow;
  const uint4* sp = reinterpret_cast<const uint4*>(W.scale + (long)(k0 / 16) * N + srow) + t;
  const u32* xp = reinterpret_cast<const u32*>(x + (long)g * xs + k0 + 2 * t);
  // The thread's shared addresses in stage 0: its codes (block b at + 512 b) and, for the
  // scale lanes, its 16 scale bytes (block lane / 4, bytes 16 (lane % 4)..) at 16 lane; its
  // x words at 8 lane; its lane group's scale bytes (block b at + 64 b) at 8 g.
  using Stage = RingStage<NBLK>;
  const u32 lane16 = ring + 16 * lane, lane8 = ring + 8 * lane, group8 = ring + 8 * g;
  // Step `at` from the group's first into stage st, as one commit group (empty past the slice).
  auto issue = [&](int st, int at, bool load) {
    if (load) {
      const u32 stage = st * Stage::BYTES;
#pragma unroll
      for (int b = 0; b < NBLK; ++b) cp_async_16(lane16 + stage + Stage::CODES + 512 * b, wp[b] + at * (N / 2));
      if (scale_lane) cp_async_16(lane16 + stage + Stage::SCALES, sp + at * (N / 16));
      if (xrow) {
        cp_async_4(lane8 + stage + Stage::X, xp + 8 * at);
        cp_async_4(lane8 + stage + Stage::X + 4, xp + 8 * at + 4);
      }
    }
    cp_async_commit();
  };
  __syncwarp();  // the warp's reads of its ring from the item before are done
#pragma unroll
  for (int r = 0; r < S - 1; ++r) issue(r, r, true);
#pragma unroll 1
  for (int step0 = 0; step0 < STEPS; step0 += S) {
#pragma unroll
    for (int r = 0; r < S; ++r) {
      cp_async_wait<S - 2>();  // this thread's copies of step step0 + r
      __syncwarp();            // and the scale lanes'; every lane's reads of stage r - 1 done
      issue((r + S - 1) % S, r + S - 1, step0 + r + S - 1 < STEPS);
      const u32 stage = r * Stage::BYTES;
      u32 b0 = 0u, b1 = 0u;
      if (xrow) {
        const uint2 xv = ld_shared_8(lane8 + stage + Stage::X);
        b0 = xv.x;
        b1 = xv.y;
      }
#pragma unroll
      for (int b = 0; b < NBLK; ++b)
        marlin_block_v3<EXPERTS_LEAN>(ld_shared_16(lane16 + stage + Stage::CODES + 512 * b),
                        ld_shared_8(group8 + stage + Stage::SCALES + 64 * b), b0, b1, c + 4 * b);
    }
#pragma unroll
    for (int b = 0; b < NBLK; ++b) wp[b] += S * (N / 2);
    sp += S * (N / 16);
    xp += S * 8;
  }
  cp_async_wait<0>();  // nothing left in flight into the ring (red overlays it)
}
#endif

#if EXPERTS_DOWN_CARRY
// A warp's first batch of its NBLK Marlin blocks at blk0 (N rows) over its K-slice from
// k0 (SB steps of 16 k): the thread's words and scales, for warp_gemm_marlin_carried.
template <int N, int NBLK, int SB>
__device__ __forceinline__ void marlin_first_batch(const Weights& W, const int blk0[NBLK], int k0, uint4 q[SB][NBLK],
                                                   uint2 sc[SB][NBLK]) {
  const uint4* wp[NBLK];
  const uint2* sp[NBLK];
  marlin_pointers<N, NBLK>(W, blk0, k0 / 16, wp, sp);
  marlin_batch_load<N, NBLK, SB>(q, sc, wp, sp);
}

// warp_gemm_marlin (V3, no L2 prefetch, the whole K-slice) whose first batch was loaded
// into q, sc before (marlin_first_batch); its later batches go through q, sc as well.
template <int K, int N, int WK_, int NBLK>
__device__ __forceinline__ void warp_gemm_marlin_carried(const Weights& W, const int blk0[NBLK], int k0,
                                                         const bf16_t* __restrict__ x, int xs, int nx,
                                                         float c[4 * NBLK][4], uint4 q[][NBLK], uint2 sc[][NBLK]) {
  constexpr int STEPS = marlin_steps(K, WK_), SB = marlin_batch_steps(K, WK_);
  static_assert(STEPS % SB == 0, "steps per batch");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  zero_sums<4 * NBLK>(c);
  const bool xrow = g < nx;
  const u32* xp = reinterpret_cast<const u32*>(x + (long)g * xs + k0 + 2 * t);
  const uint4* wp[NBLK];
  const uint2* sp[NBLK];
  marlin_pointers<N, NBLK>(W, blk0, k0 / 16 + SB, wp, sp);
  marlin_batch_mma<NBLK, SB>(q, sc, xp, xrow, c);
  xp += 8 * SB;
#pragma unroll 1
  for (int batch = SB; batch < STEPS; batch += SB) marlin_batch<N, NBLK, SB>(q, sc, wp, sp, xp, xrow, c);
}
#endif

// A warp's NT tiles of an expert's GEMM of N rows over K: its blocks of TPB tiles at
// rows row0[b], K-slice from k0 (Marlin: `steps` steps of 16 k, the whole slice by default;
// LOOP_PREFETCH: the lean loop's L2 prefetch of each next batch).
template <int K, int N, int WK_, int NT, bool LOOP_PREFETCH = true>
__device__ __forceinline__ void expert_gemm(const Weights& W, const int row0[NT / TPB], int k0,
                                            const bf16_t* __restrict__ x, int xs, int nx, float c[NT][4],
                                            int steps = K / WK_ / 16) {
#if FMT == 2
  warp_gemm_marlin<K, N, WK_, NT / TPB, LOOP_PREFETCH>(W, row0, k0, x, xs, nx, c, steps);
#else
  static_assert(NT == 2, "two tiles a warp");
  warp_gemm<K, WK_>(W, row0, k0, x, xs, nx, c);
#endif
}

#if EXPERTS_V2
// The first batch expert_gemm loads of these tiles into L2 (NVFP4; nothing for bf16).
template <int K, int N, int WK_, int NT>
__device__ __forceinline__ void prefetch_gemm(const Weights& W, const int row0[NT / TPB], int k0) {
#if FMT == 2
  prefetch_marlin<N, NT / TPB, marlin_batch_steps(K, WK_)>(W, row0, k0 / 16);
#elif FMT == 1
  constexpr int NC = K / WK_ / CHUNK_K;
  prefetch_rows<K, NC < 4 ? NC : 4>(W, row0, k0);
#endif
}
#endif

// Tile a of a warp's NT tiles is owned, under a reduce-scatter over WK_ warps along K,
// by warp a % WK_ (by warp a where there are more warps than tiles).
template <int WK_, int NT>
__device__ __forceinline__ bool owns_tile(int a, int wk) {
  return WK_ <= NT ? a % WK_ == wk : a == wk;
}

// Adds the warps' partial sums over K in warp order; the warp wk == 0 of each wm
// ends with the total in c (SCATTER: each tile's total in the warp that owns it,
// owns_tile, the other tiles of c left as they were). `red`: WARPS * NT * 4 * 32 floats.
// SYNCED: the caller's barrier came after every warp's last reads of red, so the first
// one here is left out.
template <int WK_, int NT, bool SCATTER = false, bool SYNCED = false>
__device__ __forceinline__ void reduce_k(float c[NT][4], float* red, int wm, int wk) {
  const int lane = threadIdx.x & 31;
  constexpr int WARP_FLOATS = NT * 4 * 32;
  if (WK_ > 1) {
    if (!SYNCED) __syncthreads();  // red may still be read from the previous item
    float* mine = red + (wm * WK_ + wk) * WARP_FLOATS;
#pragma unroll
    for (int a = 0; a < NT; ++a)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[(a * 4 + e) * 32 + lane] = c[a][e];
    __syncthreads();
    if (SCATTER || wk == 0) {
#pragma unroll
      for (int a = 0; a < NT; ++a) {
        if (SCATTER && !owns_tile<WK_, NT>(a, wk)) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float s = red[(wm * WK_) * WARP_FLOATS + (a * 4 + e) * 32 + lane];
          for (int w = 1; w < WK_; ++w) s += red[(wm * WK_ + w) * WARP_FLOATS + (a * 4 + e) * 32 + lane];
          c[a][e] = s;
        }
      }
    }
  }
}

// Expert e's W13 (gate rows, then up rows).
__device__ __forceinline__ Weights up_weights(const unsigned char* w13, const unsigned char* w13_scale,
                                              const float* w13_global, int e) {
  constexpr long EXPERT_BYTES = (long)2 * I_LOCAL * (FMT >= 1 ? P_DIM / 2 : P_DIM * 2);
  Weights W;
  W.w = w13 + e * EXPERT_BYTES;
  W.scale = FMT >= 1 ? w13_scale + (long)e * 2 * I_LOCAL * (P_DIM / 16) : nullptr;
#if EXPERTS_V3
  // the factors of the GEMM's fp32 sums (Marlin's: marlin_word_v3's -2^-112, exact)
  W.global_lo = FMT == 1 ? w13_global[2 * e] : w13_global[e] * -0x1p-112f;
  W.global_hi = FMT == 1 ? w13_global[2 * e + 1] : w13_global[e] * -0x1p-112f;
#else
  W.global_lo = FMT == 1 ? w13_global[2 * e] : FMT == 2 ? w13_global[e] * 0x1p-119f : 1.f;
  W.global_hi = FMT == 1 ? w13_global[2 * e + 1] : FMT == 2 ? w13_global[e] * 0x1p-119f : 1.f;
#endif
  W.split = I_LOCAL;
  return W;
}

// Expert e's W2.
__device__ __forceinline__ Weights down_weights(const unsigned char* w2, const unsigned char* w2_scale,
                                                const float* w2_global, int e) {
  constexpr long EXPERT_BYTES = (long)P_DIM * (FMT >= 1 ? I_LOCAL / 2 : I_LOCAL * 2);
  Weights W;
  W.w = w2 + e * EXPERT_BYTES;
  W.scale = FMT >= 1 ? w2_scale + (long)e * P_DIM * (I_LOCAL / 16) : nullptr;
#if EXPERTS_V3
  W.global_lo = W.global_hi = FMT == 1 ? w2_global[e] : w2_global[e] * -0x1p-112f;
#else
  W.global_lo = W.global_hi = FMT == 1 ? w2_global[e] : FMT == 2 ? w2_global[e] * 0x1p-119f : 1.f;
#endif
  W.split = P_DIM;
  return W;
}

// act[slot][n][i] for the warp's columns (warp wk == 0) of an item's total sums c: a
// macro over the kernel's W, slot, i0, g, t and act, so that each of the kernel's loops
// compiles as if written out.
#if EXPERTS_V3
#define UP_GATE_UP_OF(gv, uv) const float gate = round_bf16((gv) * W.global_lo), up = round_bf16((uv) * W.global_hi);
#else
#define UP_GATE_UP_OF(gv, uv) const float gate = round_bf16(gv), up = round_bf16(uv);
#endif
// act at column i, row n from the gate and up rows' sums gv, uv
#define UP_STORE_ONE(i, n, gv, uv)                                       \
  {                                                                      \
    UP_GATE_UP_OF(gv, uv)                                                \
    const float silu = gate / (1.0f + expf(-gate));                      \
    act[((long)slot * NB + (n)) * I_LOCAL + (i)] = float_to_bf16(silu * up); \
  }
#define UP_STORE(c)                                                        \
  _Pragma("unroll") for (int a = 0; a < TPB; ++a)                          \
  _Pragma("unroll") for (int e4 = 0; e4 < 4; ++e4) {                       \
    const int i = i0 + 16 * a + g + 8 * (e4 >> 1), n = 2 * t + (e4 & 1);   \
    UP_STORE_ONE(i, n, c[a][e4], c[TPB + a][e4])                           \
  }

// act[slot][n][i] = bf16(silu(gate) * up), gate and up the GEMM's rows rounded to bf16,
// for the 8 rows n of x (rows >= b of x are zeros). One slot per distinct expert.
#if EXPERTS_EARLY
// The first batch of the block's first item (EXPERTS_HALF's warps: the gate or the up rows,
// hk's K-slice) into L2, as the item loop prefetches each next item's.
__device__ __forceinline__ void half_first_prefetch(const Routes& routes, const unsigned char* w13,
                                                    const unsigned char* w13_scale, const float* w13_global) {
  constexpr int WKH = WK1 / 2;
  const int warp = threadIdx.x >> 5, side = warp / (WARPS / 2), hw = warp % (WARPS / 2), hm = hw / WKH, hk = hw % WKH;
  const int item = blockIdx.x;
  if (item >= routes.n_slots * TILES1) return;
  const int n0 = (item % TILES1 * WM1 + hm) * UP_COLS;
  const int row0[1] = {side ? I_LOCAL + n0 : n0};
  prefetch_gemm<P_DIM, 2 * I_LOCAL, WKH, TPB>(up_weights(w13, w13_scale, w13_global, routes.slot_expert[item / TILES1]),
                                             row0, hk * (P_DIM / WKH));
}
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS, EXPERTS_UP_BLOCKS) experts_up_kernel(
    const bf16_t* __restrict__ x, int x_stride, int b,           // [b, P]
    const int* __restrict__ ids, int first_expert, int num_local,  // [b, TOP_K] global ids
    const unsigned char* __restrict__ w13,                         // [E_local, 2I, P] bf16 or [E_local, 2I, P/2]
    const unsigned char* __restrict__ w13_scale,                   // NVFP4: [E_local, 2I, P/16]
    const float* __restrict__ w13_global,                          // NVFP4: [E_local, 2]; Marlin: [E_local]
#if EXPERTS_EARLY
    bf16_t* __restrict__ act,                                      // [slots, 8, I_LOCAL]
    int ids_final TRACE_PARAM) {                                   // the ids complete at launch (see the top)
#else
    bf16_t* __restrict__ act TRACE_PARAM) {                        // [slots, 8, I_LOCAL]
#endif
  __shared__ Routes routes;
#if EXPERTS_RING
  extern __shared__ uint4 up_smem[];  // UP_SMEM_BYTES: the warps' rings, red over them (see the top)
  float* const red = reinterpret_cast<float*>(up_smem);
  u32 smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  if (smem_bytes < UP_SMEM_BYTES) __trap();  // launched without the rings' shared memory
#else
  __shared__ float red[WARPS * NT1 * 4 * 32];
#endif
#if EXPERTS_EARLY
  if (ids_final) {
    find_experts<NTHREADS>(ids, b * TOP_K, first_expert, num_local, routes);
    half_first_prefetch(routes, w13, w13_scale, w13_global);
    pdl_wait();  // x comes from the kernel before
    pdl_launch_dependents();
  } else
#endif
  {
    pdl_wait();  // x and ids come from the kernels before
    pdl_launch_dependents();
    find_experts<NTHREADS>(ids, b * TOP_K, first_expert, num_local, routes);
  }
  TRACE_START
  const int warp = threadIdx.x >> 5, wm = warp / WK1, wk = warp % WK1;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if EXPERTS_RING
  const u32 ring = smem_u32(up_smem) + warp * RING_S * RingStage<UP_NBLK>::BYTES;  // the warp's, a shared address
#endif
#if EXPERTS_HALF
  // warp = (side, hm, hk): side 0 the gate rows, 1 the up rows of the item (see the top)
  constexpr int WKH = WK1 / 2, HALF_FLOATS = TPB * 4 * 32;
  static_assert(WK1 >= 2, "EXPERTS_HALF: at least two warps along K");
  const int side = warp / (WARPS / 2), hw = warp % (WARPS / 2), hm = hw / WKH, hk = hw % WKH;
  __shared__ float xch[WM1 * HALF_FLOATS];  // the up side's sums, for the gate side
  const int items = routes.n_slots * TILES1;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    TRACE_ITEM(item)
    const int slot = item / TILES1, tile = item % TILES1;
    const int e = routes.slot_expert[slot];
    const int i0 = (tile * WM1 + hm) * UP_COLS;
    const Weights W = up_weights(w13, w13_scale, w13_global, e);
    const int row0[1] = {side ? I_LOCAL + i0 : i0};
    if (item + (int)gridDim.x < items) {  // the next item's first batch
      const int next = item + gridDim.x, n0 = (next % TILES1 * WM1 + hm) * UP_COLS;
      const int nrow0[1] = {side ? I_LOCAL + n0 : n0};
      prefetch_gemm<P_DIM, 2 * I_LOCAL, WKH, TPB>(
          up_weights(w13, w13_scale, w13_global, routes.slot_expert[next / TILES1]), nrow0, hk * (P_DIM / WKH));
    }
    float h[TPB][4];  // this side's tiles
    expert_gemm<P_DIM, 2 * I_LOCAL, WKH, TPB>(W, row0, hk * (P_DIM / WKH), x, x_stride, b, h);
#if EXPERTS_UP_SCATTER
    // Each warp of a side adds the tiles it owns (a % WKH == hk: OWN of them, or where
    // there are more warps than tiles, tile hk alone), the up side passes them over, and
    // the gate side's owner finishes them. The owned tiles picked by selects on hk, so h
    // stays in registers.
    reduce_k<WKH, TPB, true>(h, red, side * WM1 + hm, hk);
    constexpr int OWN = WKH <= TPB ? TPB / WKH : 1, OWNERS = WKH <= TPB ? WKH : TPB;
    float mine[OWN][4];
#pragma unroll
    for (int j = 0; j < OWN; ++j)
#pragma unroll
      for (int e4 = 0; e4 < 4; ++e4) {
        mine[j][e4] = h[j * WKH][e4];
#pragma unroll
        for (int r = 1; r < OWNERS; ++r)
          if (hk == r) mine[j][e4] = h[j * WKH + r][e4];
      }
    __syncthreads();  // xch read for the item before
    if (side == 1 && hk < OWNERS) {
#pragma unroll
      for (int j = 0; j < OWN; ++j)
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4) xch[hm * HALF_FLOATS + ((j * WKH + hk) * 4 + e4) * 32 + lane] = mine[j][e4];
    }
    __syncthreads();
    if (side == 0 && hk < OWNERS) {
#pragma unroll
      for (int j = 0; j < OWN; ++j)
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4) {
          const int a = j * WKH + hk, i = i0 + 16 * a + g + 8 * (e4 >> 1), n = 2 * t + (e4 & 1);
          UP_STORE_ONE(i, n, mine[j][e4], xch[hm * HALF_FLOATS + (a * 4 + e4) * 32 + lane])
        }
    }
#else
    reduce_k<WKH, TPB>(h, red, side * WM1 + hm, hk);
    __syncthreads();  // xch read for the item before
    if (hk == 0 && side == 1) {
#pragma unroll
      for (int a = 0; a < TPB; ++a)
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4) xch[hm * HALF_FLOATS + (a * 4 + e4) * 32 + lane] = h[a][e4];
    }
    __syncthreads();
    if (hk == 0 && side == 0) {
      float c[NT1][4];  // gate tiles, then up tiles
#pragma unroll
      for (int a = 0; a < TPB; ++a)
#pragma unroll
        for (int e4 = 0; e4 < 4; ++e4) {
          c[a][e4] = h[a][e4];
          c[TPB + a][e4] = xch[hm * HALF_FLOATS + (a * 4 + e4) * 32 + lane];
        }
      UP_STORE(c)
    }
#endif
  }
#else
  const int items = routes.n_slots * TILES1;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    TRACE_ITEM(item)
    const int slot = item / TILES1, tile = item % TILES1;
    const int e = routes.slot_expert[slot];
    const int i0 = (tile * WM1 + wm) * UP_COLS;
    const Weights W = up_weights(w13, w13_scale, w13_global, e);
    const int row0[2] = {i0, I_LOCAL + i0};  // gate rows, up rows
#if EXPERTS_V2
    if (item + (int)gridDim.x < items) {  // the next item's first batch
      const int next = item + gridDim.x, n0 = (next % TILES1 * WM1 + wm) * UP_COLS;
      const int nrow0[2] = {n0, I_LOCAL + n0};
      prefetch_gemm<P_DIM, 2 * I_LOCAL, WK1, NT1>(
          up_weights(w13, w13_scale, w13_global, routes.slot_expert[next / TILES1]), nrow0, wk * (P_DIM / WK1));
    }
#endif
    float c[NT1][4];                         // gate tiles, then up tiles
#if EXPERTS_RING
    warp_gemm_marlin_ring<P_DIM, 2 * I_LOCAL, WK1, UP_NBLK, RING_S>(W, row0, wk * (P_DIM / WK1), x, x_stride, b, c,
                                                                    ring);
#else
    expert_gemm<P_DIM, 2 * I_LOCAL, WK1, NT1>(W, row0, wk * (P_DIM / WK1), x, x_stride, b, c);
#endif
    reduce_k<WK1, NT1>(c, red, wm, wk);
#if EXPERTS_RING
    if (WK1 > 1) __syncthreads();  // red read before the next item's copies go over it
#endif
    if (wk == 0) {
      UP_STORE(c)
    }
  }
#endif
  TRACE_END(items)
}

#if EXPERTS_DOWN_CARRY
// Warp (wm, wk)'s first batch of down item `item` (its expert's W2, the warp's 64-row
// block, its K-slice), into q, sc.
template <int SB>
__device__ __forceinline__ void down_first_batch(const unsigned char* w2, const unsigned char* w2_scale,
                                                 const float* w2_global, const Routes& routes, int item, int wm, int wk,
                                                 uint4 q[SB][NT2 / TPB], uint2 sc[SB][NT2 / TPB]) {
  int row0[NT2 / TPB];
#pragma unroll
  for (int r = 0; r < NT2 / TPB; ++r) row0[r] = (item % TILES2 * WM2 + wm) * DOWN_ROWS + 16 * TPB * r;
  marlin_first_batch<P_DIM, NT2 / TPB, SB>(down_weights(w2, w2_scale, w2_global, routes.slot_expert[item / TILES2]),
                                           row0, wk * (I_LOCAL / WK2), q, sc);
}
#endif

// rows[r, j, :] = bf16(act[slot(r, j)][r] @ W2[e]^T) for the held routes; zeros for
// routes to experts this rank does not hold.
extern "C" __global__ void __launch_bounds__(NTHREADS, EXPERTS_DOWN_BLOCKS) experts_down_kernel(
    const bf16_t* __restrict__ act, int b,                         // [slots, 8, I_LOCAL]
    const int* __restrict__ ids, int first_expert, int num_local,  // [b, TOP_K]
    const unsigned char* __restrict__ w2,                          // [E_local, P, I] bf16 or [E_local, P, I/2]
    const unsigned char* __restrict__ w2_scale,                    // NVFP4: [E_local, P, I/16]
    const float* __restrict__ w2_global,                           // NVFP4: [E_local]
    bf16_t* __restrict__ rows QUEUE_PARAM TRACE_PARAM) {           // [b, TOP_K, P]; EXPERTS_DOWN_QUEUE's counter
  __shared__ Routes routes;
  __shared__ float red[WARPS * NT2 * 4 * 32];
  // The ids were final before the up kernel passed its wait (and let this one start),
  // so the experts are found, and their weights loaded, before this kernel's wait.
  find_experts<NTHREADS>(ids, b * TOP_K, first_expert, num_local, routes);
#if EXPERTS_SLOT_MASKS
  __shared__ unsigned slot_masks[MAX_ROUTES * NB];  // [slot][row]: bit j where route (row, j) goes to the slot
  __shared__ unsigned unheld_masks[NB];             // [row]: bit j where route (row, j) goes to an expert not held
  for (int i = threadIdx.x; i < MAX_ROUTES * NB; i += NTHREADS) slot_masks[i] = 0u;
  if (threadIdx.x < NB) unheld_masks[threadIdx.x] = 0u;
  __syncthreads();
  if ((int)threadIdx.x < b * TOP_K) {
    const int n = threadIdx.x / TOP_K, j = threadIdx.x % TOP_K, rs = routes.slot[threadIdx.x];
    atomicOr(rs >= 0 ? &slot_masks[rs * NB + n] : &unheld_masks[n], 1u << j);
  }
  __syncthreads();
#endif
  const int warp = threadIdx.x >> 5, wm = warp / WK2, wk = warp % WK2;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n_slots = routes.n_slots;
  const int items = (n_slots > 0 ? n_slots : 1) * TILES2;
  constexpr long EXPERT_BYTES = (long)P_DIM * (FMT >= 1 ? I_LOCAL / 2 : I_LOCAL * 2);
  // Warm the first item's weights into L2 before waiting for act.
  if (n_slots > 0 && (int)blockIdx.x < items) {
    const int e = routes.slot_expert[blockIdx.x / TILES2];
    const int p0 = (blockIdx.x % TILES2) * WM2 * DOWN_ROWS;
#if FMT == 2
    // Marlin: the item's rows are a run of 8 bytes a row in each of the I / 16 rows of tiles.
    constexpr int RUN = 8 * WM2 * DOWN_ROWS;
    const unsigned char* base = w2 + e * EXPERT_BYTES + (long)p0 * 8;
    for (int off = threadIdx.x * 128; off < (I_LOCAL / 16) * RUN; off += NTHREADS * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(base + (long)(off / RUN) * 8 * P_DIM + off % RUN));
#else
    constexpr int ROW_BYTES = FMT == 1 ? I_LOCAL / 2 : I_LOCAL * 2;
    const unsigned char* base = w2 + e * EXPERT_BYTES + (long)p0 * ROW_BYTES;
    for (int off = threadIdx.x * 128; off < WM2 * 32 * ROW_BYTES; off += NTHREADS * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off));
#endif
  }
#if EXPERTS_DOWN_CARRY
  // The warp's next item's first batch (here its first item's), carried in registers.
  constexpr int SB2 = marlin_batch_steps(I_LOCAL, WK2);
  uint4 carry_q[SB2][NT2 / TPB];
  uint2 carry_sc[SB2][NT2 / TPB];
  if (n_slots > 0 && (int)blockIdx.x < items) down_first_batch<SB2>(w2, w2_scale, w2_global, routes, blockIdx.x, wm, wk,
                                                                     carry_q, carry_sc);
#endif
  pdl_wait();
  pdl_launch_dependents();
  TRACE_START
#if EXPERTS_DOWN_QUEUE
  // The block's next item, double-buffered by its count of items (so the next claim
  // cannot overwrite it before every thread has read it), read where it is used.
  __shared__ int claimed[2];
  int nth = 0;
  for (int item = blockIdx.x; item < items; item = claimed[nth & 1], ++nth) {
    TRACE_NTH(nth)
    if (threadIdx.x == 0) claimed[nth & 1] = (int)gridDim.x + atomicAdd(queue, 1);
#if EXPERTS_DOWN_CARRY == 2
    if (n_slots == 0) __syncthreads();  // else the barrier after the K loop shows the claim
#else
    __syncthreads();
#endif
#else
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    TRACE_ITEM(item)
#endif
    const int slot = item / TILES2, tile = item % TILES2;
    const int p0 = (tile * WM2 + wm) * DOWN_ROWS;
    float c[NT2][4];
#if EXPERTS_V3
    float out_scale = 0.f;  // the global of the item's expert
#endif
    if (n_slots > 0) {
      const Weights W = down_weights(w2, w2_scale, w2_global, routes.slot_expert[slot]);
#if EXPERTS_V3
      out_scale = W.global_lo;
#endif
      int row0[NT2 / TPB];  // blocks of TPB tiles
#pragma unroll
      for (int r = 0; r < NT2 / TPB; ++r) row0[r] = p0 + 16 * TPB * r;
#if EXPERTS_V2 && !EXPERTS_DOWN_SPARE
#if EXPERTS_DOWN_QUEUE
      const int next = claimed[nth & 1];
      if (next < items) {  // the next item's first batch
#else
      if (item + (int)gridDim.x < items) {  // the next item's first batch
        const int next = item + gridDim.x;
#endif
        int nrow0[NT2 / TPB];
#pragma unroll
        for (int r = 0; r < NT2 / TPB; ++r) nrow0[r] = (next % TILES2 * WM2 + wm) * DOWN_ROWS + 16 * TPB * r;
        prefetch_gemm<I_LOCAL, P_DIM, WK2, NT2>(down_weights(w2, w2_scale, w2_global, routes.slot_expert[next / TILES2]),
                                                nrow0, wk * (I_LOCAL / WK2));
      }
#endif
#if EXPERTS_DOWN_CARRY
      warp_gemm_marlin_carried<I_LOCAL, P_DIM, WK2, NT2 / TPB>(W, row0, wk * (I_LOCAL / WK2),
                                                              act + (long)slot * NB * I_LOCAL, I_LOCAL, NB, c, carry_q,
                                                              carry_sc);
#if EXPERTS_DOWN_CARRY == 2
      // The claim shown to every warp, red's reads of the item before done. The barrier's
      // operand (its result unused) is a sum of the K loop, so that ptxas keeps the barrier
      // after the loop's last loads: a plain one it issues before the second batch's loads
      // (read-only loads, which it may move past a barrier).
      (void)__syncthreads_or(c[0][0] != 0.f);
#endif
      const int next = claimed[nth & 1];
      if (next < items) down_first_batch<SB2>(w2, w2_scale, w2_global, routes, next, wm, wk, carry_q, carry_sc);
#else
      expert_gemm<I_LOCAL, P_DIM, WK2, NT2, !EXPERTS_DOWN_SPARE>(W, row0, wk * (I_LOCAL / WK2),
                                                                 act + (long)slot * NB * I_LOCAL, I_LOCAL, NB, c);
#endif
      reduce_k<WK2, NT2, EXPERTS_DOWN_SCATTER != 0, EXPERTS_DOWN_CARRY == 2>(c, red, wm, wk);
    }
#if EXPERTS_DOWN_SCATTER
    if (wk >= NT2) continue;  // owns no tile
#else
    if (wk != 0) continue;
#endif
#if EXPERTS_ROUTE_MASK
    // This thread's rows n = 2t, 2t + 1: the routes to the item's slot, and (slot 0's
    // items) the routes to experts not held, which get zeros.
    unsigned to_slot[2] = {0u, 0u}, unheld[2] = {0u, 0u};
#if EXPERTS_SLOT_MASKS
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = 2 * t + e;
      if (n >= b) continue;
      if (n_slots > 0) to_slot[e] = slot_masks[slot * NB + n];
      if (slot == 0) unheld[e] = unheld_masks[n];
    }
#else
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = 2 * t + e;
      if (n >= b) continue;
#pragma unroll
      for (int j = 0; j < TOP_K; ++j) {
        const int rs = routes.slot[n * TOP_K + j];
        if (n_slots > 0 && rs == slot) to_slot[e] |= 1u << j;
        else if (rs < 0 && slot == 0) unheld[e] |= 1u << j;
      }
    }
#endif  // EXPERTS_SLOT_MASKS
#endif
#pragma unroll
    for (int a = 0; a < NT2; ++a)
#pragma unroll
      for (int e4 = 0; e4 < 4; ++e4) {
#if EXPERTS_DOWN_SCATTER
        if (!owns_tile<WK2, NT2>(a, wk)) continue;
#endif
        const int p = p0 + 16 * a + g + 8 * (e4 >> 1), n = 2 * t + (e4 & 1);
        if (n >= b) continue;
#if EXPERTS_V3
        const bf16_t v = n_slots > 0 ? float_to_bf16(c[a][e4] * out_scale) : (bf16_t)0;
#else
        const bf16_t v = n_slots > 0 ? float_to_bf16(c[a][e4]) : (bf16_t)0;
#endif
#if EXPERTS_ROUTE_MASK
        for (unsigned m = to_slot[e4 & 1]; m != 0u; m &= m - 1u)
          rows[(long)(n * TOP_K + __ffs(m) - 1) * P_DIM + p] = v;
        for (unsigned m = unheld[e4 & 1]; m != 0u; m &= m - 1u)
          rows[(long)(n * TOP_K + __ffs(m) - 1) * P_DIM + p] = 0;
#else
        for (int j = 0; j < TOP_K; ++j) {
          const int route = n * TOP_K + j;
          const int rs = routes.slot[route];
          if (n_slots > 0 && rs == slot)
            rows[(long)route * P_DIM + p] = v;
          else if (rs < 0 && slot == 0)
            rows[(long)route * P_DIM + p] = 0;
        }
#endif
      }
  }
#if EXPERTS_DOWN_QUEUE
  if (threadIdx.x == 0 && atomicAdd(queue + 1, 1) == (int)gridDim.x - 1) {  // every claim made: reset
    atomicExch(queue, 0);
    atomicExch(queue + 1, 0);
  }
  TRACE_END_N(nth)
#else
  TRACE_END(items)
#endif
}
