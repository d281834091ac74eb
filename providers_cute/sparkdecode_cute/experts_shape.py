"""The tiling of the routed experts' kernels (experts_kernels.py) and the shapes
they take; imports neither torch nor the CuTe DSL, so ``unsupported`` can answer
without either."""

from __future__ import annotations

from dataclasses import dataclass

LANES = 32
VEC = 8  # bf16 per 16-byte load
CHUNK = LANES * VEC  # elements of a row one warp-wide load covers
WARPS = 8
LOADS_IN_FLIGHT = 8  # 16-byte weight loads a lane issues before it computes


@dataclass(frozen=True)
class ExpertsShape:
    """What one compile serves: P (x width, W2 rows), I (this rank's I-slice),
    experts held, top-k and the most rows a step has."""

    width: int
    intermediate: int
    num_local: int
    top_k: int
    max_rows: int


def shape_unsupported(s: ExpertsShape) -> str | None:
    """Why the kernels cannot take ``s``, or None."""
    if s.max_rows > 8:
        return f"max_rows {s.max_rows}: the experts kernels take at most 8 rows"
    if s.top_k > LANES:
        return f"top-{s.top_k}: the experts kernels take at most {LANES}"
    for name, k in (("moe_hidden_size", s.width), ("the I-slice", s.intermediate)):
        if k % CHUNK:
            return f"{name} {k}: the experts kernels take multiples of {CHUNK}"
    plan = Plan.of(s)
    if s.intermediate % plan.gate_up_pairs:
        return f"the I-slice {s.intermediate} is not a multiple of {plan.gate_up_pairs} gate/up rows a CTA"
    if s.width % plan.down_rows:
        return f"moe_hidden_size {s.width} is not a multiple of {plan.down_rows} W2 rows a CTA"
    return None


@dataclass(frozen=True)
class Plan:
    """Tiling: a warp's rows and the chunks of 256 columns loaded per step."""

    gate_up_chunks: int  # chunks of one W13 row loaded at once
    gate_up_warp_pairs: int  # gate/up row pairs a warp computes
    down_chunks: int
    down_warp_rows: int

    @classmethod
    def of(cls, s: ExpertsShape) -> Plan:
        c1 = min(LOADS_IN_FLIGHT // 2, s.width // CHUNK)
        c2 = min(LOADS_IN_FLIGHT, s.intermediate // CHUNK)
        return cls(c1, max(1, LOADS_IN_FLIGHT // (2 * c1)), c2, max(1, LOADS_IN_FLIGHT // c2))

    @property
    def gate_up_pairs(self) -> int:
        return WARPS * self.gate_up_warp_pairs

    @property
    def down_rows(self) -> int:
        return WARPS * self.down_warp_rows
