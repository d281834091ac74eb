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

Kernels that do not round each dequantized weight to bf16 (experts.cu's EXPERTS_V3:
e2m1 * block scale exact in bf16, the global scale on the fp32 sums, as vLLM's Marlin
kernel computes) are closer to the exact quantized model than the reference, which
rounds every weight; ``assert_experts_close_exact`` measures both against
``truth_rows`` of the exact weights (``exact_weights``: e2m1 * block scale * global in
fp64) and holds the kernel to at most the reference's L2 error (EXACT_L2_FACTOR) and
MAX_FACTOR times its largest one: the kernel's error is its fp32 sums' (about 2^-24
relative) and the same bf16 rounding points', the reference's adds every weight's
rounding (up to 2^-9 relative each), so the kernel's is the smaller; a wrong weight,
scale, global or sign still gives errors hundreds of times the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparkdecode import nvfp4, nvfp4_marlin
from sparkdecode.weights import ExpertWeights

L2_FACTOR = 1.5
MAX_FACTOR = 2.0
EXACT_L2_FACTOR = 1.0


def _exact(codes: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """fp64 [E, rows, K]: e2m1 * block scale (fp32 [E, rows, K / 16], exact) * glob (fp64 [E])."""
    values = nvfp4.unpack(codes).double().unflatten(-1, (-1, nvfp4.BLOCK))
    return (values * scale.double()[..., None] * glob[:, None, None, None]).flatten(-2)


def exact_weights(experts: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 (w13, w2) of NVFP4 experts (checkpoint or Marlin layout) without any rounding:
    each weight e2m1 * block scale * global, the product of the quantized model."""
    m, q = experts.marlin, experts.nvfp4
    if m is not None:
        hidden, inter = m.w13_scale.shape[1] * nvfp4.BLOCK, m.w2_scale.shape[1] * nvfp4.BLOCK
        w13 = _exact(
            nvfp4_marlin.unpack_weight(experts.w13, hidden, 2 * inter, m.perms),
            nvfp4_marlin.unpack_scales(m.w13_scale, hidden, 2 * inter, m.perms),
            m.w13_global.double() / nvfp4_marlin.GLOBAL_SHIFT,
        )
        w2 = _exact(
            nvfp4_marlin.unpack_weight(experts.w2, inter, hidden, m.perms),
            nvfp4_marlin.unpack_scales(m.w2_scale, inter, hidden, m.perms),
            m.w2_global.double() / nvfp4_marlin.GLOBAL_SHIFT,
        )
        return w13, w2
    if q is None:
        raise ValueError(f"{experts.format} experts are not NVFP4")
    gate, up = experts.w13.chunk(2, dim=1)
    gate_scale, up_scale = q.w13_scale.float().chunk(2, dim=1)
    w13 = torch.cat(
        [_exact(gate, gate_scale, q.w13_global[:, 0].double()), _exact(up, up_scale, q.w13_global[:, 1].double())],
        dim=1,
    )
    return w13, _exact(experts.w2, q.w2_scale.float(), q.w2_global.double())


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
    l2_factor: float = L2_FACTOR,
) -> None:
    """``got`` (the kernel's bf16 [b, k, P]) against ``ref`` (the reference's), both
    measured against ``truth_rows`` of w13, w2; see the module docstring for the bounds."""
    assert torch.isfinite(got.float()).all()
    local = ids.long() - first
    held = (local >= 0) & (local < w13.shape[0])
    assert torch.equal(got[~held], torch.zeros_like(got[~held])), "a route to another rank's expert is not zero"
    if not held.any():
        return
    t = truth_rows(x, ids, w13, w2, first)[held]
    g, r = got[held].double() - t, ref[held].double() - t
    assert g.norm() <= l2_factor * r.norm(), (g.norm().item(), r.norm().item())
    assert g.abs().max() <= MAX_FACTOR * r.abs().max(), (g.abs().max().item(), r.abs().max().item())


def assert_experts_close_exact(
    got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights
) -> None:
    """``got`` (a kernel that keeps e2m1 * scale * global unrounded) against ``ref`` (the
    reference on the bf16-rounded weights), both measured against ``truth_rows`` of
    ``exact_weights``; see the module docstring for the bounds."""
    w13, w2 = exact_weights(experts)
    assert_experts_close(got, ref, x, ids, w13, w2, experts.first_expert, EXACT_L2_FACTOR)
