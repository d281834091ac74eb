// The verify step's attention core (sub-op attention_core, MUSE_SPARK.md "Attention"):
// the b <= 8 rows of one request at consecutive positions ending at seq_lens[0] - 1,
// over one layer's paged bf16 cache, causal within the step, the layer's window on
// sliding layers (a query sees itself and the window - 1 keys before it), split over
// the keys (flash decoding) on mma.sync m16n8k16.
//
// A KV head's queries are one tile of MROWS = 64 rows, row r = i * GROUP + j for token
// i and the head's query head j (rows of tokens past b are zeros, never stored). The
// keys that some row sees, lo .. seq_len - 1, are cut into tiles of TILE = 64 positions
// aligned to 64. SPLITS (the grid: SPLITS x KV heads) is set at build for the longest
// context; the step's own length sets how many of them take part (active_splits: about
// TILES_A_SPLIT tiles each, at least 16 where there are as many tiles, at most SPLITS),
// and those take equal runs of tiles (attention_split_kernel); the others leave at once
// and the combine reads none of their partials. So a build for a long max_model_len runs
// a short context as a build for that context does, with the same bits. A block stages
// each tile's K and V in shared memory
// (16-byte loads through the block table; keys outside lo .. seq_len - 1 are zeros, so a
// released page is never read) and its 4 warps each take 16 query rows:
//   S = Q K^T (A = Q, B = K rows; fp32 sums), times the softmax scale in log2 units,
//   keys outside the row's range at -inf; the online softmax per row in fp32 (running
//   max m and sum l of exp2(S - m) over the block's tiles); P (fp32) split exactly enough
//   into two bf16 terms hi + lo (P - hi rounded: about 2^-17 of P left out), both
//   multiplied into V (A = P straight from S's accumulator layout, B = V read from shared
//   memory a key pair at a time), the output accumulated in fp32.
// Each block writes its rows' m, l and unnormalized output (fp32) to a workspace;
// attention_combine_kernel (grid: 64 rows x KV heads) adds the active splits' partials of
// each row, scaled by exp2(m_s - max m) in two levels (8 runs of splits, then a butterfly
// over the runs), divides by the summed l and rounds to bf16 once: the same bits every run.
//
// PDL: both kernels let their dependents launch at their start and wait (griddepcontrol)
// before any read of what the kernels before wrote (q, the cache and its metadata, the
// workspace) and before any write.
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef GROUP
#define GROUP 8  // query heads a KV head
#endif
#ifndef SPLITS
#define SPLITS 32  // blocks a KV head
#endif
#define MROWS 64
#define TILE 64
#define WARPS 4
#define THREADS (WARPS * 32)
#define KPAD 8  // bf16 of padding a shared-memory row: a 144-byte stride, conflict-free reads
#ifndef TILES_A_SPLIT
#define TILES_A_SPLIT 1  // key tiles a split takes, about, where the grid has splits enough
#endif
#define NEG_INF __int_as_float(0xff800000u)
static_assert(HEAD_DIM == 64, "one tile of 64 dims: 4 MMA steps of 16 (QK) and 8 of 8 (PV)");
static_assert(MROWS == WARPS * 16 && MROWS % GROUP == 0, "16 query rows a warp, whole tokens");
static_assert(TILE * HEAD_DIM / 8 == 4 * THREADS, "4 16-byte chunks of K and of V a thread a tile");

__device__ __forceinline__ u32 pack2(bf16_t lo, bf16_t hi) { return (u32)lo | ((u32)hi << 16); }

// The step's key tiles: the first tile's position base0 (lo rounded down to TILE), and
// how many tiles reach seq - 1. lo: the first key some row sees (0 on a full layer).
struct Tiles {
  int lo, base0, count;
};
__device__ __forceinline__ Tiles step_tiles(int seq, int rows, int window) {
  const int first = seq - rows, lo = window > 0 ? max(first - window + 1, 0) : 0;
  const int base0 = lo & ~(TILE - 1);
  return {lo, base0, (seq - 1 - base0) / TILE + 1};
}

// The splits that take part at this many tiles: about TILES_A_SPLIT tiles each, at least
// MIN_SPLITS (but never more splits than tiles), at most the grid's SPLITS. The split
// kernel and the combine both compute it from seq_lens, so they agree.
#define MIN_SPLITS 16
__device__ __forceinline__ int active_splits(int tiles) {
  return min(SPLITS, min(tiles, max(MIN_SPLITS, (tiles + TILES_A_SPLIT - 1) / TILES_A_SPLIT)));
}

// The 4 chunks of a tile this thread loads (chunk c: key (tid + c * THREADS) / 8, dims
// 8 * ((tid + c * THREADS) % 8) ..), zeros outside the visible keys lo .. hi.
__device__ __forceinline__ void load_tile(uint4 (&kr)[4], uint4 (&vr)[4], const bf16_t* __restrict__ k,
                                          const bf16_t* __restrict__ v, const int* __restrict__ table,
                                          int page_size, long long kv_page, long long kv_token,
                                          long long head_off, int kbase, int lo, int hi) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int idx = threadIdx.x + c * THREADS, key = idx >> 3, chunk = idx & 7;
    const int kp = kbase + key;
    kr[c] = make_uint4(0u, 0u, 0u, 0u);
    vr[c] = make_uint4(0u, 0u, 0u, 0u);
    if (kp >= lo && kp <= hi) {
      const long long at =
          (long long)table[kp / page_size] * kv_page + (long long)(kp % page_size) * kv_token + head_off + chunk * 8;
      kr[c] = *(const uint4*)(k + at);
      vr[c] = *(const uint4*)(v + at);
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS) attention_split_kernel(
    const bf16_t* __restrict__ q, long long q_row, long long q_head,  // [b, Hq, d] (d contiguous)
    const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,        // [pages, page_size, Hkv, d]
    long long kv_page, long long kv_token, long long kv_head,         // their strides (K and V alike)
    const int* __restrict__ table, const int* __restrict__ seq_lens,  // [max_pages], [1]
    int page_size, int rows, int window, float scale_log2,            // window 0: a full layer
    float* __restrict__ part_o,                                       // [Hkv, SPLITS, MROWS, d]
    float* __restrict__ part_ml) {                                    // [Hkv, SPLITS, 2, MROWS]
  __shared__ __align__(16) bf16_t ks[TILE][HEAD_DIM + KPAD];
  __shared__ __align__(16) bf16_t vs[TILE][HEAD_DIM + KPAD];
  const int h = blockIdx.y, split = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  pdl_launch_dependents();
  pdl_wait();

  const int seq = seq_lens[0], first = seq - rows, hi = seq - 1;
  const Tiles span = step_tiles(seq, rows, window);
  const int lo = span.lo, base0 = span.base0, tiles = span.count, active = active_splits(tiles);
  if (split >= active) return;  // no tiles at this length; the combine reads none of this split
  const int t0 = split * tiles / active, t1 = (split + 1) * tiles / active;

  // This lane's two query rows (g and g + 8 of the warp's 16), their tokens and ranges.
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  const int i0 = r0 / GROUP, i1 = r1 / GROUP;
  const bool ok0 = i0 < rows, ok1 = i1 < rows;
  const int p0 = first + i0, p1 = first + i1;
  const int lo0 = window > 0 ? p0 - window + 1 : 0, lo1 = window > 0 ? p1 - window + 1 : 0;

  // Q's A fragments, 4 steps of 16 dims.
  u32 qa[4][4];
  {
    const bf16_t* q0 = q + (long long)i0 * q_row + (long long)(h * GROUP + r0 % GROUP) * q_head;
    const bf16_t* q1 = q + (long long)i1 * q_row + (long long)(h * GROUP + r1 % GROUP) * q_head;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int d = 16 * kk + 2 * t;
      qa[kk][0] = ok0 ? *(const u32*)(q0 + d) : 0u;
      qa[kk][1] = ok1 ? *(const u32*)(q1 + d) : 0u;
      qa[kk][2] = ok0 ? *(const u32*)(q0 + d + 8) : 0u;
      qa[kk][3] = ok1 ? *(const u32*)(q1 + d + 8) : 0u;
    }
  }

  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
  float o[8][4];
#pragma unroll
  for (int dt = 0; dt < 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;

  const long long head_off = (long long)h * kv_head;
  uint4 kr[4], vr[4];
  if (t0 < t1) load_tile(kr, vr, k, v, table, page_size, kv_page, kv_token, head_off, base0 + t0 * TILE, lo, hi);
  for (int tile = t0; tile < t1; ++tile) {
    const int kbase = base0 + tile * TILE;
    __syncthreads();  // the previous tile's reads are done
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int idx = threadIdx.x + c * THREADS, key = idx >> 3, chunk = idx & 7;
      *(uint4*)&ks[key][chunk * 8] = kr[c];
      *(uint4*)&vs[key][chunk * 8] = vr[c];
    }
    __syncthreads();
    if (tile + 1 < t1) load_tile(kr, vr, k, v, table, page_size, kv_page, kv_token, head_off, kbase + TILE, lo, hi);

    // S = Q K^T: 8 tiles of 8 keys.
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const u32 b0 = *(const u32*)&ks[nt * 8 + g][16 * kk + 2 * t];
        const u32 b1 = *(const u32*)&ks[nt * 8 + g][16 * kk + 2 * t + 8];
        mma_bf16(s[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
      }
    }
    // Scale, mask, the tile's row maxima (over the 4 lanes of a row).
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kp = kbase + nt * 8 + 2 * t + e;
        s[nt][e] = ok0 && kp <= p0 && kp >= lo0 ? s[nt][e] * scale_log2 : NEG_INF;
        s[nt][2 + e] = ok1 && kp <= p1 && kp >= lo1 ? s[nt][2 + e] * scale_log2 : NEG_INF;
        mx0 = fmaxf(mx0, s[nt][e]);
        mx1 = fmaxf(mx1, s[nt][2 + e]);
      }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    // A row with no visible key yet keeps m = -inf: nothing to rescale, every p is 0.
    const float a0 = n0 == NEG_INF ? 1.f : exp2f(m0 - n0), a1 = n1 == NEG_INF ? 1.f : exp2f(m1 - n1);
    m0 = n0;
    m1 = n1;
    l0 *= a0;
    l1 *= a1;
#pragma unroll
    for (int dt = 0; dt < 8; ++dt) {
      o[dt][0] *= a0;
      o[dt][1] *= a0;
      o[dt][2] *= a1;
      o[dt][3] *= a1;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[nt][e] = n0 == NEG_INF ? 0.f : exp2f(s[nt][e] - n0);
        s[nt][2 + e] = n1 == NEG_INF ? 0.f : exp2f(s[nt][2 + e] - n1);
        l0 += s[nt][e];
        l1 += s[nt][2 + e];
      }
    }
    // O += P V: 4 steps of 16 keys, P's A fragments from S's layout, as hi + lo bf16.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      u32 ph[4], pl[4];
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        // a0: row g, keys 2t, 2t+1 of tile 2kk; a1: row g + 8; a2, a3: the same of tile 2kk + 1
        const float* src = &s[2 * kk + (f >> 1)][(f & 1) * 2];
        ph[f] = pack_bf16x2(src[0], src[1]);
        pl[f] = pack_bf16x2(src[0] - __uint_as_float(ph[f] << 16), src[1] - __uint_as_float(ph[f] & 0xffff0000u));
      }
      const int key = 16 * kk + 2 * t;
#pragma unroll
      for (int dt = 0; dt < 8; ++dt) {
        const int d = dt * 8 + g;
        const u32 b0 = pack2(vs[key][d], vs[key + 1][d]);
        const u32 b1 = pack2(vs[key + 8][d], vs[key + 9][d]);
        mma_bf16(o[dt], ph[0], ph[1], ph[2], ph[3], b0, b1);
        mma_bf16(o[dt], pl[0], pl[1], pl[2], pl[3], b0, b1);
      }
    }
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }

  const long long part = (long long)h * SPLITS + split;
  float* ml = part_ml + part * 2 * MROWS;
  if (t == 0) {
    ml[r0] = m0;
    ml[r1] = m1;
    ml[MROWS + r0] = l0;
    ml[MROWS + r1] = l1;
  }
  float* po = part_o + part * MROWS * HEAD_DIM;
#pragma unroll
  for (int dt = 0; dt < 8; ++dt) {
    *(float2*)(po + r0 * HEAD_DIM + dt * 8 + 2 * t) = make_float2(o[dt][0], o[dt][1]);
    *(float2*)(po + r1 * HEAD_DIM + dt * 8 + 2 * t) = make_float2(o[dt][2], o[dt][3]);
  }
}

__device__ __forceinline__ void store_bf16x4(bf16_t* dst, const float v[4]) {
  uint2 w;
  w.x = pack2(float_to_bf16(v[0]), float_to_bf16(v[1]));
  w.y = pack2(float_to_bf16(v[2]), float_to_bf16(v[3]));
  *(uint2*)dst = w;
}

// The combine: a block a row (grid: MROWS x KV heads, 128 threads), each thread 4 dims of
// it (16 dim groups) over one of PARTS = 8 contiguous runs of the active splits. Lane = part
// p (bits 0-2) + dim group within the warp (bits 3-4); warp w takes dim groups 4w .. 4w + 3.
// A thread loads its run's m, l and output at once (one round trip after seq_lens), keeps
// the run's max, sums its splits scaled to it, then the 8 parts of a dim group meet by a
// butterfly over lanes (xor 1, 2, 4): each step rescales both sides to the larger max and
// adds them, the same operations on both lanes of a pair (IEEE sums and products commute),
// so every part ends with the same value, and the same bits every run.
#define PARTS 8
#define PART_BATCH ((SPLITS + PARTS - 1) / PARTS)
static_assert(PARTS == 8 && HEAD_DIM / 4 * PARTS == 128, "a row's 16 dim groups x 8 parts: 128 threads");

__device__ __forceinline__ void combine_row_parts(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                  int h, int active, int r, int d, int p, float o[4]) {
  const float* ml = part_ml + (long long)h * SPLITS * 2 * MROWS;
  const float* po = part_o + ((long long)h * SPLITS * MROWS + r) * HEAD_DIM + d;
  const int s0 = p * active / PARTS, s1 = (p + 1) * active / PARTS;
  float m[PART_BATCH], ls[PART_BATCH];
  float4 v[PART_BATCH];
#pragma unroll
  for (int u = 0; u < PART_BATCH; ++u) {
    const int s = s0 + u < s1 ? s0 + u : 0;  // past the run: split 0's (always there), left out below
    m[u] = ml[s * 2 * MROWS + r];
    ls[u] = ml[s * 2 * MROWS + MROWS + r];
    v[u] = *(const float4*)(po + (long long)s * MROWS * HEAD_DIM);
  }
  float mloc = NEG_INF;
#pragma unroll
  for (int u = 0; u < PART_BATCH; ++u) {
    if (s0 + u < s1) mloc = fmaxf(mloc, m[u]);
  }
  float l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int u = 0; u < PART_BATCH; ++u) {
    if (s0 + u >= s1 || m[u] == NEG_INF) continue;  // past the run, or a split with no key this row sees
    const float w = exp2f(m[u] - mloc);
    l += w * ls[u];
    acc[0] += w * v[u].x;
    acc[1] += w * v[u].y;
    acc[2] += w * v[u].z;
    acc[3] += w * v[u].w;
  }
#pragma unroll
  for (int off = 1; off < PARTS; off <<= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, mloc, off), lo = __shfl_xor_sync(0xffffffffu, l, off);
    float ao[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) ao[e] = __shfl_xor_sync(0xffffffffu, acc[e], off);
    const float mn = fmaxf(mloc, mo);
    // a part with no key the row sees (m = -inf) weighs 0; a row always sees its own key
    const float a = mloc == NEG_INF ? 0.f : exp2f(mloc - mn), b = mo == NEG_INF ? 0.f : exp2f(mo - mn);
    l = a * l + b * lo;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] = a * acc[e] + b * ao[e];
    mloc = mn;
  }
  const float inv = 1.f / l;
#pragma unroll
  for (int e = 0; e < 4; ++e) o[e] = bf16_to_float(float_to_bf16(acc[e] * inv));
}

extern "C" __global__ void __launch_bounds__(128) attention_combine_kernel(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, const int* __restrict__ seq_lens, int rows,
    int window, bf16_t* __restrict__ out, long long o_row, long long o_head) {
  const int h = blockIdx.y, r = blockIdx.x, lane = threadIdx.x & 31, p = lane & (PARTS - 1);
  const int d = ((threadIdx.x >> 5) * 4 + (lane >> 3)) * 4;
  const int i = r / GROUP, j = r % GROUP;
  pdl_launch_dependents();
  pdl_wait();
  if (i >= rows) return;  // the whole block: one row
  const int active = active_splits(step_tiles(seq_lens[0], rows, window).count);
  float o[4];
  combine_row_parts(part_o, part_ml, h, active, r, d, p, o);
  if (p == 0) store_bf16x4(out + (long long)i * o_row + (long long)(h * GROUP + j) * o_head + d, o);
}

// The gated form: the row's 64 squares summed over its dim groups (lanes xor 8, 16, then
// the 4 warps through shared memory, in warp order), the gate columns loaded as the kernel
// starts (they do not wait on the split kernel's partials, only on the PDL wait).
extern "C" __global__ void __launch_bounds__(128) attention_gated_combine_kernel(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, const int* __restrict__ seq_lens, int rows,
    int window, const bf16_t* __restrict__ gate, long long gate_row, float eps, bf16_t* __restrict__ out,
    long long out_row) {
  __shared__ float warp_sq[4];
  const int h = blockIdx.y, r = blockIdx.x, lane = threadIdx.x & 31, p = lane & (PARTS - 1);
  const int d = ((threadIdx.x >> 5) * 4 + (lane >> 3)) * 4;
  const int i = r / GROUP, j = r % GROUP;
  pdl_launch_dependents();
  pdl_wait();
  if (i >= rows) return;  // the whole block: one row
  const long long col = (long long)(h * GROUP + j) * HEAD_DIM + d;
  const uint2 gw = *(const uint2*)(gate + (long long)i * gate_row + col);
  const int active = active_splits(step_tiles(seq_lens[0], rows, window).count);
  float o[4];
  combine_row_parts(part_o, part_ml, h, active, r, d, p, o);
  float sq = o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3];
  sq += __shfl_xor_sync(0xffffffffu, sq, 8);
  sq += __shfl_xor_sync(0xffffffffu, sq, 16);
  if (lane == 0) warp_sq[threadIdx.x >> 5] = sq;
  __syncthreads();
  sq = warp_sq[0] + warp_sq[1] + warp_sq[2] + warp_sq[3];
  if (p != 0) return;
  const float inv = rsqrtf(sq / (float)HEAD_DIM + eps);
  const float g[4] = {bf16_to_float((bf16_t)(gw.x & 0xffffu)), bf16_to_float((bf16_t)(gw.x >> 16)),
                      bf16_to_float((bf16_t)(gw.y & 0xffffu)), bf16_to_float((bf16_t)(gw.y >> 16))};
#pragma unroll
  for (int e = 0; e < 4; ++e) o[e] = o[e] * inv * (1.0f / (1.0f + expf(-g[e])));
  store_bf16x4(out + (long long)i * out_row + col, o);
}
