// A fragment, not a header: the body of one EXPERTS_HALF up item (experts.cu), included
// in the item loops of experts_up_kernel and experts_fused_kernel, so that both compile
// the same code and the up kernel's instructions stay as they were. It reads the
// enclosing scope: item (the item), items and UP_STRIDE (a macro: the block's step to its
// next item, warmed into L2 when below items), the warp's side, hm, hk, lane, g, t, WKH
// and HALF_FLOATS, the routes, the kernel's arguments (x, x_stride, b, w13, w13_scale,
// w13_global, act) and the shared red and xch.
    const int slot = item / TILES1, tile = item % TILES1;
    const int e = routes.slot_expert[slot];
    const int i0 = (tile * WM1 + hm) * UP_COLS;
    const Weights W = up_weights(w13, w13_scale, w13_global, e);
    const int row0[1] = {side ? I_LOCAL + i0 : i0};
    if (item + (int)UP_STRIDE < items) {  // the next item's first batch
      const int next = item + UP_STRIDE, n0 = (next % TILES1 * WM1 + hm) * UP_COLS;
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
