"""How a routed-experts kernel is compared with the reference on a GPU.

Both the kernel and the reference (``fn.expert_rows``: cuBLAS grouped GEMMs) round
gate/up and h = silu(gate) * up to bf16 after fp32 sums taken in some order. Where a
sum lies within its fp32 accumulation error of a bf16 rounding point, the two may
round it to neighbouring values; the one-ulp change of such an h element then moves
every output through W2. Neither result is the better one, so the kernel is held to
the reference's own accuracy: both are measured against ``truth``, the same rounding
points with exact (fp64) sums and the output left unrounded, and the kernel's error
may be at most ``L2_FACTOR`` times the reference's in the L2 norm over all held
routes and ``MAX_FACTOR`` times in the largest element. A wrong weight, row, slot,
scale or sign gives errors of the size of the values themselves (hundreds of times
the reference's), so these bounds fail on any such bug. Routes to experts another
rank holds (EP) must be exact zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_FACTOR = 1.5
MAX_FACTOR = 2.0


def truth_rows(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, first: int) -> torch.Tensor:
    """fp64 [b, k, P]: gate/up and h rounded to bf16 as the reference rounds them,
    every sum exact, the output unrounded; zero rows for experts not held."""
    b, k = ids.shape
    intermediate = w2.shape[2]
    out = torch.zeros(b, k, w2.shape[1], dtype=torch.float64, device=x.device)
    for r in range(b):
        for j in range(k):
            e = int(ids[r, j]) - first
            if not 0 <= e < w13.shape[0]:
                continue
            gate_up = (w13[e].double() @ x[r].double()).to(torch.bfloat16).float()
            gate, up = gate_up[:intermediate], gate_up[intermediate:]
            h = (F.silu(gate) * up).to(torch.bfloat16)
            out[r, j] = w2[e].double() @ h.double()
    return out


def assert_experts_close(
    got: torch.Tensor,
    ref: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first: int = 0,
) -> None:
    """``got`` (the kernel's bf16 [b, k, P]) against ``ref`` (the reference's), both
    measured against ``truth_rows``; see the module docstring for the bounds."""
    assert torch.isfinite(got.float()).all()
    local = ids.long() - first
    held = (local >= 0) & (local < w13.shape[0])
    assert torch.equal(got[~held], torch.zeros_like(got[~held])), "a route to another rank's expert is not zero"
    if not held.any():
        return
    t = truth_rows(x, ids, w13, w2, first)[held]
    g, r = got[held].double() - t, ref[held].double() - t
    assert g.norm() <= L2_FACTOR * r.norm(), (g.norm().item(), r.norm().item())
    assert g.abs().max() <= MAX_FACTOR * r.abs().max(), (g.abs().max().item(), r.abs().max().item())
