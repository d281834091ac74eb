// The routed experts of one layer for up to 8 rows on NVFP4 weights in vLLM's SM90
// Marlin layout (experts.cu's FMT 2, nvfp4_marlin.py), streamed at memory speed: two
// kernels, the gate/up GEMM with SwiGLU (experts_bulk_up_kernel, into act) and the down
// GEMM (experts_bulk_down_kernel, into the route rows), as experts.cu's pair.
//
// A block is one producer warp and CWARPS consumer warps, one block an SM. The producer
// copies each work item's Marlin tiles with Hopper bulk async copies (cp.async.bulk,
// 1-D contiguous bytes, completion counted on an mbarrier) into a ring of STAGES
// shared-memory stages, running ahead over the block's items; the consumers wait on a
// stage's full barrier, read their fragments, release the stage on its empty barrier
// and decode and multiply from registers. A stage is KR = CWARPS rows of 16 k (consumer
// warp w takes row w) of the item's NBLK = 2 blocks of 64 output rows: per row and
// block Marlin's 512 contiguous bytes of codes (lane l's 16 bytes at 16 l are its
// m16n8k16 A fragments of the block's four 16-row tiles, experts.cu's header) and its
// 64 bytes of scales (lane group g's 8 at 8 g); 32 copies a stage, one a producer lane.
// The decode is experts.cu's EXPERTS_V2 one (experts_common.cuh: codes as e4m3 bytes,
// scale bytes as fp32 bits; the reference's bf16 bits), mma.sync m16n8k16 against
// B = x^T (8 rows) in fp32.
//
// Work: a unit is (distinct expert, NBLK blocks): up, gate block u and up block
// I / 64 + u (64 intermediate columns, so SwiGLU stays in the block); down, blocks 2u,
// 2u + 1 (128 output rows). Each unit's K is split into `splits` equal parts (an item
// each, chosen per launch from the count of distinct experts so that the largest share
// of a block is smallest: choose_splits), so few routed experts still fill the SMs.
// Within an item the consumer warps' sums over their k rows are added in warp order
// through shared memory, each warp finishing one slice (a 16-row tile pair's half);
// with splits > 1 the slice goes to a workspace and the last of the item's splits to
// arrive (a counter per unit and slice, reset by that last one) adds the splits' slices
// in split order: deterministic, whichever block comes last. Then up: gate and up
// rounded to bf16, act = bf16(silu(gate) * up); down: bf16 into the rows of the routes
// to the slot's expert, zeros for routes to experts not held.
//
// BULK_V3 (a define, 0 when absent): experts.cu's EXPERTS_V3 decode (marlin_block_v3 with
// its LEAN shift: e2m1 * block scale exact in bf16, the expert's global applied once to
// each output's fp32 sum, as vLLM's Marlin kernel computes) in place of EXPERTS_V2's;
// the scale bytes vLLM's repack keeps (0, or 0x80..0xf7) and globals of at least 2^-14
// (the provider checks). The sums in this file's order (the warps' k rows, the splits):
// not experts.cu's bits, as close to the exact weights. STAGES (12 when absent) and
// BULK_BLOCKS (the blocks an SM the kernels are built and launched for, 1 when absent)
// size the ring: at 2 an SM, two producers and 16 consumer warps share an SM.
//
// PDL: the up kernel waits first (the ids come from the kernel before); the down kernel
// finds the experts from the ids (final before the up kernel passed its wait) and its
// producer fills the ring with the first items' weights before waiting; the consumers
// wait before reading act.
#include "common.cuh"
#include "experts_common.cuh"

#if !defined(P_DIM) || !defined(I_LOCAL) || !defined(TOP_K) || !defined(SMEM)
#error "experts_bulk.cu needs P_DIM, I_LOCAL, TOP_K and SMEM (the dynamic shared memory the launch gives)"
#endif

#ifndef BULK_V3
#define BULK_V3 0
#endif
#ifndef STAGES
#define STAGES 12
#endif
#ifndef BULK_BLOCKS
#define BULK_BLOCKS 1
#endif

#define NB 8      // rows of x per MMA (the n of m16n8k16)
#define CWARPS 8  // consumer warps
#define NTHREADS ((CWARPS + 1) * 32)

constexpr int KR = CWARPS;  // rows of 16 k a stage
constexpr int NBLK = 2;     // Marlin blocks of 64 rows an item
constexpr int BLOCK_CODES = 512, BLOCK_SCALES = 64;
constexpr int STAGE_CODES = KR * NBLK * BLOCK_CODES;
constexpr int STAGE_BYTES = STAGE_CODES + KR * NBLK * BLOCK_SCALES;
constexpr int TILE_FLOATS = NBLK * 4 * 4 * 32;  // a warp's accumulators
constexpr int MAX_SPLITS = 16;
constexpr int PARTS_PER_CTA = 8;  // workspace: items with splits > 1 at most this times the grid
static_assert(KR * NBLK * 2 == 32, "a copy a producer lane");
static_assert(P_DIM % (16 * KR) == 0 && I_LOCAL % (16 * KR) == 0, "K: a multiple of a stage's 128");
static_assert(I_LOCAL % 64 == 0 && P_DIM % 128 == 0, "up: 64 columns an item; down: 128 rows");

// Shared memory (dynamic): the ring, the double-buffered reduction, the barriers.
constexpr int RING_BYTES = STAGES * STAGE_BYTES;
constexpr int RED_BYTES = 2 * CWARPS * TILE_FLOATS * 4;
constexpr int SMEM_BYTES = RING_BYTES + RED_BYTES + 2 * STAGES * 8;
static_assert(SMEM == SMEM_BYTES, "SMEM: experts_bulk.py's smem_bytes() differs from the layout here");
static_assert(SMEM_BYTES + 2048 <= 227 * 1024, "an SM90 block's shared memory, the Routes (static) included");
static_assert(BULK_BLOCKS * (SMEM_BYTES + 2048 + 1024) <= 228 * 1024, "BULK_BLOCKS blocks' shared memory an SM90 SM");

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 a;
  asm("{.reg .u64 t;\n cvta.to.shared.u64 t, %1;\n cvt.u32.u64 %0, t;}" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{.reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared,
// counted on `bar` when they land.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CWARPS * 32) : "memory"); }

// The split of each unit's K that makes a block's largest share of stages (items of
// nst / s stages and one of overhead, round robin over the grid) smallest, among the
// powers of two dividing nst, at most MAX_SPLITS and PARTS_PER_CTA items a block.
// experts_bulk.py's choose_splits is the same.
__device__ __forceinline__ int choose_splits(int units, int grid, int nst) {
  int best = 1, best_cost = ((units + grid - 1) / grid) * (nst + 1);
  for (int s = 2; s <= MAX_SPLITS && nst % s == 0 && units * s <= PARTS_PER_CTA * grid; s *= 2) {
    const int cost = ((units * s + grid - 1) / grid) * (nst / s + 1);
    if (cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// One of the two GEMMs: up (W13, N = 2I rows over K = P) or down (W2, P rows over I).
template <bool UP>
struct Gemm {
  static constexpr int K = UP ? P_DIM : I_LOCAL;
  static constexpr int N = UP ? 2 * I_LOCAL : P_DIM;
  static constexpr int UNITS = UP ? I_LOCAL / 64 : P_DIM / 128;  // units an expert
  static constexpr int NST = K / 16 / KR;                        // stages of a whole K
  static constexpr long CODE_BYTES = (long)K * N / 2;            // an expert's
  static constexpr long SCALE_BYTES = (long)K / 16 * N;
  // The Marlin block (of 64 rows) b of unit u.
  __device__ static int block(int u, int b) { return UP ? (b ? I_LOCAL / 64 + u : u) : 2 * u + b; }
};

struct Item {
  int slot, u, unit, split, kt0;  // kt0: the first row of 16 k
};

template <bool UP>
__device__ __forceinline__ Item item_of(int item, int splits) {
  using G = Gemm<UP>;
  Item m;
  m.unit = item / splits;
  m.split = item % splits;
  m.slot = m.unit / G::UNITS;
  m.u = m.unit % G::UNITS;
  m.kt0 = m.split * (G::NST / splits) * KR;
  return m;
}

// The producer warp: every stage of the block's items, in order, into the ring. With
// `late_wait`, the PDL wait comes when the ring is first full (the weights before it).
template <bool UP>
__device__ void produce(const Routes& r, const unsigned char* __restrict__ codes,
                        const unsigned char* __restrict__ scales, int items, int splits, u32 ring, u32 full,
                        u32 empty, bool late_wait) {
  using G = Gemm<UP>;
  const int lane = threadIdx.x & 31;
  const int b = lane & 1, row = lane >> 2;
  const bool is_scale = lane & 2;
  const int nst = G::NST / splits;
  const u32 offset = is_scale ? STAGE_CODES + (row * NBLK + b) * BLOCK_SCALES : (row * NBLK + b) * BLOCK_CODES;
  bool waited = !late_wait;
  int it = 0;  // the block's stage sequence
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const Item m = item_of<UP>(item, splits);
    const long e = r.slot_expert[m.slot];
    const int blk = G::block(m.u, b);
    const unsigned char* src = is_scale ? scales + e * G::SCALE_BYTES + (long)(m.kt0 + row) * G::N + 64 * blk
                                        : codes + e * G::CODE_BYTES + (long)(m.kt0 + row) * 8 * G::N + 512 * blk;
    const long step = is_scale ? (long)KR * G::N : (long)KR * 8 * G::N;  // a stage's rows further
    for (int st = 0; st < nst; ++st, ++it) {
      const int s = it % STAGES;
      if (it >= STAGES) {
        if (!waited) {
          pdl_wait();
          pdl_launch_dependents();
          waited = true;
        }
        mbar_wait(empty + 8 * s, ((it / STAGES) - 1) & 1);
      }
      if (lane == 0) mbar_expect_tx(full + 8 * s, STAGE_BYTES);
      __syncwarp();
      bulk_copy(ring + s * STAGE_BYTES + offset, src + st * step, is_scale ? BLOCK_SCALES : BLOCK_CODES, full + 8 * s);
    }
  }
  if (!waited) {
    pdl_wait();
    pdl_launch_dependents();
  }
}

// A consumer warp's item: its k rows (row w of each stage) of the item's two blocks,
// c[4 b + j] the tile j of block b, against B = x rows (row stride xs, rows >= nx as 0).
template <bool UP>
__device__ __forceinline__ void consume_item(const Item& m, int nst, int& it, const unsigned char* ring, u32 full,
                                             u32 empty, float g105, const bf16_t* __restrict__ x, int xs, int nx,
                                             float c[4 * NBLK][4]) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int a = 0; a < 4 * NBLK; ++a)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[a][e] = 0.f;
  const bf16_t* xr = x + (long)g * xs;
  const bool xrow = g < nx;
#if BULK_V3
  // The stage, its parity and the x words as running values (no division a stage), the
  // same stages in the same order as below.
  int s = it % STAGES;
  u32 parity = (it / STAGES) & 1;
  const u32* xp = reinterpret_cast<const u32*>(xr + (m.kt0 + w) * 16 + 2 * t);
  const unsigned char* mine = ring + (w * NBLK) * BLOCK_CODES + 16 * lane;
  const unsigned char* mine_scales = ring + STAGE_CODES + (w * NBLK) * BLOCK_SCALES + 8 * g;
#pragma unroll 1
  for (int st = 0; st < nst; ++st) {
    u32 b0 = 0u, b1 = 0u;
    if (xrow) {
      b0 = __ldg(xp);
      b1 = __ldg(xp + 4);
    }
    xp += KR * 8;  // KR rows of 16 k further
    mbar_wait(full + 8 * s, parity);
    uint4 q[NBLK];
    uint2 sc[NBLK];
#pragma unroll
    for (int b = 0; b < NBLK; ++b) {
      q[b] = *reinterpret_cast<const uint4*>(mine + s * STAGE_BYTES + b * BLOCK_CODES);
      sc[b] = *reinterpret_cast<const uint2*>(mine_scales + s * STAGE_BYTES + b * BLOCK_SCALES);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * s);  // release: the reads above come first
#pragma unroll
    for (int b = 0; b < NBLK; ++b) marlin_block_v3<true>(q[b], sc[b], b0, b1, c + 4 * b);
    if (++s == STAGES) {
      s = 0;
      parity ^= 1u;
    }
  }
  it += nst;
#else
#pragma unroll 1
  for (int st = 0; st < nst; ++st, ++it) {
    const int s = it % STAGES;
    const int k = (m.kt0 + st * KR + w) * 16 + 2 * t;
    u32 b0 = 0u, b1 = 0u;
    if (xrow) {
      b0 = __ldg(reinterpret_cast<const u32*>(xr + k));
      b1 = __ldg(reinterpret_cast<const u32*>(xr + k + 8));
    }
    mbar_wait(full + 8 * s, (it / STAGES) & 1);
    const unsigned char* stage = ring + s * STAGE_BYTES;
    uint4 q[NBLK];
    uint2 sc[NBLK];
#pragma unroll
    for (int b = 0; b < NBLK; ++b) {
      q[b] = *reinterpret_cast<const uint4*>(stage + (w * NBLK + b) * BLOCK_CODES + 16 * lane);
      sc[b] = *reinterpret_cast<const uint2*>(stage + STAGE_CODES + (w * NBLK + b) * BLOCK_SCALES + 8 * g);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * s);  // release: the reads above come first
#pragma unroll
    for (int b = 0; b < NBLK; ++b) {
      const u32 words[4] = {q[b].x, q[b].y, q[b].z, q[b].w};
      const u32 scl[2] = {sc[b].x, sc[b].y};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 sw = scl[j >> 1] >> (8 * (j & 1));  // row g's byte at bits 0..7, row g + 8's at 16..23
        u32 a[4];
        marlin_word_v2(words[j], marlin_s64((sw << 20) & 0x0ff00000u, g105), marlin_s64((sw << 4) & 0x0ff00000u, g105),
                       a);
        mma_bf16(c[4 * b + j], a[0], a[1], a[2], a[3], b0, b1);
      }
    }
  }
#endif
}

// The item's total of this warp's slice: tiles jj = w % 4 of both blocks, elements
// 2 hh, 2 hh + 1 (hh = w / 4: rows g + 8 hh), v[b][n & 1]: the warps' sums added in warp
// order, then (splits > 1) the splits' in split order by the last to arrive. False:
// this warp's slice is not final here.
__device__ __forceinline__ bool finish_slice(const Item& m, int splits, float c[4 * NBLK][4], float* red,
                                             float4* __restrict__ ws, int* __restrict__ counters, float v[NBLK][2]) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, jj = w & 3, hh = w >> 2;
#pragma unroll
  for (int a = 0; a < 4 * NBLK; ++a)
#pragma unroll
    for (int e = 0; e < 4; ++e) red[(w * 4 * NBLK + a) * 4 * 32 + e * 32 + lane] = c[a][e];
  consumer_sync();
#pragma unroll
  for (int b = 0; b < NBLK; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int at = ((4 * b + jj) * 4 + 2 * hh + h) * 32 + lane;
      float s = red[at];
#pragma unroll
      for (int src = 1; src < CWARPS; ++src) s += red[src * TILE_FLOATS + at];
      v[b][h] = s;
    }
  if (splits == 1) return true;
  static_assert(NBLK == 2, "a slice: one float4 a lane");
  float4* mine = ws + ((long)(m.unit * splits + m.split) * CWARPS + w) * 32 + lane;
  __stcg(mine, make_float4(v[0][0], v[0][1], v[1][0], v[1][1]));
  __threadfence();
  __syncwarp();
  int old = 0;
  if (lane == 0) old = atomicAdd(counters + m.unit * CWARPS + w, 1);
  if (__shfl_sync(0xffffffffu, old, 0) != splits - 1) return false;
  __threadfence();
  float4 sum = __ldcg(ws + ((long)m.unit * splits * CWARPS + w) * 32 + lane);
  for (int sp = 1; sp < splits; ++sp) {
    const float4 p = __ldcg(ws + ((long)(m.unit * splits + sp) * CWARPS + w) * 32 + lane);
    sum.x += p.x, sum.y += p.y, sum.z += p.z, sum.w += p.w;
  }
  if (lane == 0) counters[m.unit * CWARPS + w] = 0;  // every split has arrived: ready for the next launch
  v[0][0] = sum.x, v[0][1] = sum.y, v[1][0] = sum.z, v[1][1] = sum.w;
  return true;
}

struct Shared {
  unsigned char* ring;
  float* red;
  u32 ring_addr, full, empty;
};

__device__ __forceinline__ Shared setup(unsigned char* smem) {
  Shared s;
  s.ring = smem;
  s.red = reinterpret_cast<float*>(smem + RING_BYTES);
  s.ring_addr = smem_u32(smem);
  s.full = smem_u32(smem + RING_BYTES + RED_BYTES);
  s.empty = s.full + 8 * STAGES;
  if (threadIdx.x == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(s.full + 8 * i, 1);
      mbar_init(s.empty + 8 * i, CWARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  return s;  // the caller's __syncthreads (find_experts) publishes the barriers
}

// act[slot][n][i] = bf16(silu(gate) * up), gate and up the GEMM's rows rounded to bf16,
// for the 8 rows n of x (rows >= b of x are zeros). One slot per distinct expert.
extern "C" __global__ void __launch_bounds__(NTHREADS, BULK_BLOCKS) experts_bulk_up_kernel(
    const bf16_t* __restrict__ x, int x_stride, int b,           // [b, P]
    const int* __restrict__ ids, int first_expert, int num_local,  // [b, TOP_K] global ids
    const unsigned char* __restrict__ w13,                         // Marlin int32 [E_local, P / 16, 4I]
    const unsigned char* __restrict__ w13_scale,                   // Marlin bytes [E_local, P / 16, 2I]
    const float* __restrict__ w13_global,                          // Marlin [E_local]
    bf16_t* __restrict__ act,                                      // [slots, 8, I_LOCAL]
    float4* __restrict__ ws, int* __restrict__ counters) {         // split-K workspace, zeroed counters
  using G = Gemm<true>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ Routes routes;
  const Shared sh = setup(smem);
  pdl_wait();  // x and ids come from the kernels before
  pdl_launch_dependents();
  find_experts<NTHREADS>(ids, b * TOP_K, first_expert, num_local, routes);
  const int units = routes.n_slots * G::UNITS;
  const int splits = choose_splits(units, gridDim.x, G::NST);
  const int items = units * splits;
  const int warp = threadIdx.x >> 5;
  if (warp == CWARPS) {
    produce<true>(routes, w13, w13_scale, items, splits, sh.ring_addr, sh.full, sh.empty, false);
    return;
  }
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, jj = warp & 3, hh = warp >> 2;
  int it = 0, buf = 0;
  for (int item = blockIdx.x; item < items; item += gridDim.x, buf ^= 1) {
    const Item m = item_of<true>(item, splits);
    const int e = routes.slot_expert[m.slot];
    const float g105 = (w13_global[e] * 0x1p-119f) * 0x1p105f;
    float c[4 * NBLK][4];
    consume_item<true>(m, G::NST / splits, it, sh.ring, sh.full, sh.empty, g105, x, x_stride, b, c);
    float v[NBLK][2];
    if (!finish_slice(m, splits, c, sh.red + buf * CWARPS * TILE_FLOATS, ws, counters, v)) continue;
    const int i = 64 * m.u + 16 * jj + g + 8 * hh;
#if BULK_V3
    const float out_scale = w13_global[e] * -0x1p-112f;  // marlin_word_v3's -2^-112, exact
#else
    const float out_scale = 1.f;
#endif
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float gate = round_bf16(v[0][h] * out_scale), up = round_bf16(v[1][h] * out_scale);
      const float silu = gate / (1.0f + expf(-gate));
      act[((long)m.slot * NB + 2 * t + h) * I_LOCAL + i] = float_to_bf16(silu * up);
    }
  }
}

// rows[r, j, :] = bf16(act[slot(r, j)][r] @ W2[e]^T) for the held routes; zeros for
// routes to experts this rank does not hold.
extern "C" __global__ void __launch_bounds__(NTHREADS, BULK_BLOCKS) experts_bulk_down_kernel(
    const bf16_t* __restrict__ act, int b,                         // [slots, 8, I_LOCAL]
    const int* __restrict__ ids, int first_expert, int num_local,  // [b, TOP_K]
    const unsigned char* __restrict__ w2,                          // Marlin int32 [E_local, I / 16, 2P]
    const unsigned char* __restrict__ w2_scale,                    // Marlin bytes [E_local, I / 16, P]
    const float* __restrict__ w2_global,                           // Marlin [E_local]
    bf16_t* __restrict__ rows,                                     // [b, TOP_K, P]
    float4* __restrict__ ws, int* __restrict__ counters) {
  using G = Gemm<false>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ Routes routes;
  const Shared sh = setup(smem);
  // The ids were final before the up kernel passed its wait (and let this one start).
  find_experts<NTHREADS>(ids, b * TOP_K, first_expert, num_local, routes);
  const int n_slots = routes.n_slots;
  const int units = n_slots * G::UNITS;
  const int splits = choose_splits(units, gridDim.x, G::NST);
  const int items = units * splits;
  const int warp = threadIdx.x >> 5;
  if (warp == CWARPS) {  // the first stages' weights before the wait
    produce<false>(routes, w2, w2_scale, items, splits, sh.ring_addr, sh.full, sh.empty, true);
    return;
  }
  pdl_wait();
  pdl_launch_dependents();
  if (n_slots == 0) {  // no route to a held expert: every row is zero
    for (long i = (long)blockIdx.x * CWARPS * 32 + threadIdx.x; i < (long)b * TOP_K * P_DIM;
         i += (long)gridDim.x * CWARPS * 32)
      rows[i] = 0;
    return;
  }
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, jj = warp & 3, hh = warp >> 2;
  int it = 0, buf = 0;
  for (int item = blockIdx.x; item < items; item += gridDim.x, buf ^= 1) {
    const Item m = item_of<false>(item, splits);
    const int e = routes.slot_expert[m.slot];
    const float g105 = (w2_global[e] * 0x1p-119f) * 0x1p105f;
    float c[4 * NBLK][4];
    consume_item<false>(m, G::NST / splits, it, sh.ring, sh.full, sh.empty, g105, act + (long)m.slot * NB * I_LOCAL,
                        I_LOCAL, NB, c);
    float v[NBLK][2];
    if (!finish_slice(m, splits, c, sh.red + buf * CWARPS * TILE_FLOATS, ws, counters, v)) continue;
#if BULK_V3
    const float out_scale = w2_global[e] * -0x1p-112f;
#else
    const float out_scale = 1.f;
#endif
#pragma unroll
    for (int bl = 0; bl < NBLK; ++bl)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = 128 * m.u + 64 * bl + 16 * jj + g + 8 * hh, n = 2 * t + h;
        if (n >= b) continue;
        const bf16_t val = float_to_bf16(v[bl][h] * out_scale);
        for (int j = 0; j < TOP_K; ++j) {
          const int route = n * TOP_K + j;
          const int rs = routes.slot[route];
          if (rs == m.slot)
            rows[(long)route * P_DIM + p] = val;
          else if (rs < 0 && m.slot == 0)
            rows[(long)route * P_DIM + p] = 0;
        }
      }
  }
}
