// A fragment, not a header: the body of one down item (experts.cu), included in the item
// loops of experts_down_kernel and experts_fused_kernel, so that both compile the same
// code and the down kernel's instructions stay as they were. It reads the enclosing
// scope: item (the item), items and DOWN_STRIDE (a macro: the block's step to its next
// item, warmed into L2 when below items; EXPERTS_DOWN_QUEUE: claimed[nth & 1] is the
// next), DOWN_X_L2 (a macro: act read from L2, see marlin_step_v3), the warp's wm, wk, g,
// t, n_slots, the routes (and EXPERTS_SLOT_MASKS' slot_masks and unheld_masks), the
// kernel's arguments (b, w2, w2_scale, w2_global, act, rows) and the shared red. Its
// `continue`s end the item.
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
      if (item + (int)DOWN_STRIDE < items) {  // the next item's first batch
        const int next = item + DOWN_STRIDE;
#endif
        int nrow0[NT2 / TPB];
#pragma unroll
        for (int r = 0; r < NT2 / TPB; ++r) nrow0[r] = (next % TILES2 * WM2 + wm) * DOWN_ROWS + 16 * TPB * r;
        prefetch_gemm<I_LOCAL, P_DIM, WK2, NT2>(down_weights(w2, w2_scale, w2_global, routes.slot_expert[next / TILES2]),
                                                nrow0, wk * (I_LOCAL / WK2));
      }
#endif
      expert_gemm<I_LOCAL, P_DIM, WK2, NT2, EXPERTS_DOWN_SPARE < 2, DOWN_X_L2>(
          W, row0, wk * (I_LOCAL / WK2), act + (long)slot * NB * I_LOCAL, I_LOCAL, NB, c);
      reduce_k<WK2, NT2, EXPERTS_DOWN_SCATTER != 0>(c, red, wm, wk);
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
