"""The routed experts (sub-op ``experts_nvfp4``) on NVFP4 weights in vLLM's SM90 Marlin
layout, streamed by Hopper bulk async copies: kernels/experts_bulk.cu.

    experts_bulk_up_kernel:   the distinct held experts found from the ids on the device;
                              each one's W13 copied into a shared-memory ring by a
                              producer warp, decoded and multiplied by 8 consumer warps,
                              SwiGLU -> act
    experts_bulk_down_kernel: each one's W2 the same way -> rows[b, k, P]

One block an SM, 12 stages of 9 KB in flight each (108 KB of weights a block); the work
items are (expert, 64 intermediate columns) for W13 and (expert, 128 output rows) for W2,
their K split per launch (choose_splits) so that few routed experts still fill the
grid, the splits added in a fixed order (deterministic). The weights are read in place
(views of vLLM's tensors, as cuda.experts_nvfp4_marlin).

Against the reference: the same as experts.py says (the dequantized values are
nvfp4_marlin.dequantize's bf16 bits, through experts.cu's EXPERTS_V2 decode; gate/up
and h rounded to bf16 where the reference rounds them; only the fp32 sums' order
differs: the MMA's 16-value steps, the warps' k rows added in warp order, the K splits
in split order).
"""

from __future__ import annotations

import torch

from sparkdecode.protocols import BuildContext, Deployment, ExpertsInput, RoutedTopk

from .boundary import cuda_unsupported
from .experts import (
    MAX_LOCAL,
    MAX_ROUTES,
    MAX_ROWS,
    CudaExpertsNvfp4Marlin,
    _intermediate,
    _MarlinV3,
    prefer_max_shared,
    rank_experts,
    routes_unsupported,
)
from .launch import Kernel, ptr

SOURCE = "experts_bulk.cu"
COMPILE_OPTIONS = ("--fmad=false",)
# experts_bulk.cu's layout: CWARPS consumer warps and a producer warp; a stage is a row
# of 16 k per consumer warp of NBLK Marlin blocks (512 bytes of codes and 64 of scales).
CONSUMER_WARPS = 8
THREADS = (CONSUMER_WARPS + 1) * 32
STAGES = 12
NBLK = 2
STAGE_BYTES = CONSUMER_WARPS * NBLK * (512 + 64)
K_STEP = 16 * CONSUMER_WARPS  # the K of a stage
TILE_FLOATS = NBLK * 4 * 4 * 32  # a consumer warp's accumulators
MAX_SPLITS = 16
PARTS_PER_CTA = 8  # split items at most this times the grid (the workspace)
UP_COLUMNS = 64  # intermediate columns an up item
DOWN_ROWS = 128  # output rows a down item


def smem_bytes(stages: int = STAGES) -> int:
    """The kernels' dynamic shared memory: the ring, the double-buffered reduction of the
    consumer warps' sums, the stages' full and empty barriers."""
    return stages * STAGE_BYTES + 2 * CONSUMER_WARPS * TILE_FLOATS * 4 + 2 * stages * 8


def defines(
    width: int, intermediate: int, top_k: int, stages: int = STAGES, v3: int = 0, blocks: int = 1
) -> dict[str, int]:
    """experts_bulk.cu's defines (BULK_V3, STAGES and BULK_BLOCKS only where not the default)."""
    d = {"P_DIM": width, "I_LOCAL": intermediate, "TOP_K": top_k, "SMEM": smem_bytes(stages)}
    if v3:
        d["BULK_V3"] = 1
    if stages != STAGES:
        d["STAGES"] = stages
    if blocks != 1:
        d["BULK_BLOCKS"] = blocks
    return d


def choose_splits(units: int, grid: int, stages: int) -> int:
    """experts_bulk.cu's choose_splits: the power-of-two split of each unit's ``stages``
    (of K_STEP) that makes a block's largest share (round robin, an item costing its
    stages plus one) smallest, at most MAX_SPLITS and PARTS_PER_CTA items a block."""
    best, best_cost = 1, -(-units // grid) * (stages + 1)
    s = 2
    while s <= MAX_SPLITS and stages % s == 0 and units * s <= PARTS_PER_CTA * grid:
        cost = -(-units * s // grid) * (stages // s + 1)
        if cost < best_cost:
            best, best_cost = s, cost
        s *= 2
    return best


def work_items(distinct: int, width: int, intermediate: int, grid: int) -> dict[str, tuple[int, int]]:
    """Per kernel ("up", "down"): (items, splits) of a launch on ``grid`` blocks with
    ``distinct`` held experts routed."""
    up_units = distinct * (intermediate // UP_COLUMNS)
    down_units = distinct * (width // DOWN_ROWS)
    up = choose_splits(up_units, grid, width // K_STEP)
    down = choose_splits(down_units, grid, intermediate // K_STEP)
    return {"up": (up_units * up, up), "down": (down_units * down, down)}


def shape_unsupported(
    width: int, intermediate: int, top_k: int, max_rows: int, num_local: int = MAX_LOCAL
) -> str | None:
    """Why the kernels cannot take this pooled width P, this rank's I-slice and its
    count of experts, or None."""
    reason = routes_unsupported(top_k, max_rows, num_local)
    if reason:
        return reason
    for what, k in (("moe_hidden_size", width), ("this rank's moe_intermediate_size", intermediate)):
        if k % K_STEP:
            return f"{what} {k}: the bulk-copy experts kernels take multiples of {K_STEP} (a stage's K)"
    return None


class CudaExpertsNvfp4MarlinBulk(CudaExpertsNvfp4Marlin):
    """Sub-op ``experts_nvfp4`` on vLLM's SM90 Marlin layout (``nvfp4_marlin``), the
    weights streamed into shared memory by bulk async copies (experts_bulk.cu)."""

    name = "cuda.experts_nvfp4_marlin_bulk"
    # experts_bulk.cu's BULK_V3, STAGES and BULK_BLOCKS (blocks an SM, as built and launched)
    v3: int = 0
    stages: int = STAGES
    blocks_per_sm: int = 1

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        d, s = deployment, deployment.spec
        why = cuda_unsupported(d)
        if why is None and d.capability is not None and d.capability[0] != 9:
            major, minor = d.capability
            why = (
                f"needs SM90 (Hopper): its {smem_bytes(cls.stages) // 1024} KB shared-memory ring is sized for SM90; "
                f"this GPU is SM{major}{minor}"
            )
        if why is None and d.expert_format not in cls.layouts:
            why = cls.refusal.format(d.expert_format)
        if why is None:
            intermediate, num_local = rank_experts(d)
            why = shape_unsupported(s.P, intermediate, s.top_k, d.max_rows, num_local)
        return why

    def __init__(self, ctx: BuildContext, layer: int):
        spec = ctx.spec
        e = self.experts = ctx.layer(layer).experts
        if e.format != self.format:
            raise ValueError(f"layer {layer}: {self.name} serves {self.format} experts, not {e.format}")
        self.intermediate = _intermediate(e.w2, e.format)
        why = shape_unsupported(spec.P, self.intermediate, spec.top_k, ctx.max_rows, e.num_local)
        if why:
            raise ValueError(f"layer {layer}: {why}")
        self._check_layout(layer)
        self.scales = self._scale_views()
        for name, t in (("w13", e.w13), ("w2", e.w2), ("w13_scale", self.scales[0]), ("w2_scale", self.scales[2])):
            if t.data_ptr() % 16:
                raise ValueError(f"layer {layer}: {self.name} copies 16-byte aligned tensors ({name} is not)")
        self.top_k, self.width = spec.top_k, spec.P
        self.smem = smem_bytes(self.stages)
        d = defines(spec.P, self.intermediate, spec.top_k, self.stages, self.v3, self.blocks_per_sm)
        self.up = Kernel(SOURCE, "experts_bulk_up_kernel", ctx.device, d, COMPILE_OPTIONS)
        self.down = Kernel(SOURCE, "experts_bulk_down_kernel", ctx.device, d, COMPILE_OPTIONS)
        for kernel in (self.up, self.down):
            kernel.allow_shared(self.smem)
            if self.blocks_per_sm > 1:  # two blocks' rings take nearly all of an SM's shared memory
                prefer_max_shared(kernel, self.name)
        slots = min(MAX_ROUTES, ctx.max_rows * spec.top_k, e.num_local)
        self.act = ctx.scratch(
            f"cuda_experts_act_{self.intermediate}", (max(slots, 1), MAX_ROWS, self.intermediate), torch.bfloat16
        )
        # blocks_per_sm blocks an SM; the split-K workspace (a float4 a lane, warp and item)
        # and the per-unit counters (zero between launches: the last split resets its own).
        sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
        self.grid = self.blocks_per_sm * sms
        parts = PARTS_PER_CTA * self.grid * CONSUMER_WARPS * 32
        counters = PARTS_PER_CTA // 2 * self.grid * CONSUMER_WARPS
        self.workspace: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for kernel in ("up", "down"):
            ws = ctx.scratch(f"cuda_experts_bulk_{kernel}_ws_{self.grid}", (parts, 4), torch.float32)
            count = ctx.scratch(f"cuda_experts_bulk_{kernel}_counters_{self.grid}", (counters,), torch.int32)
            count.zero_()
            self.workspace[kernel] = (ws, count)

    def launch_up(self, x: torch.Tensor, topk: RoutedTopk) -> None:
        ws, count = self.workspace["up"]
        up = [*self._up_args(x, topk.ids), ptr(ws), ptr(count)]
        self.up.launch((self.grid, 1, 1), (THREADS, 1, 1), up, shared=self.smem)

    def launch_down(self, b: int, topk: RoutedTopk, rows: torch.Tensor) -> None:
        ws, count = self.workspace["down"]
        down = [*self._down_args(b, topk.ids, rows), ptr(ws), ptr(count)]
        self.down.launch((self.grid, 1, 1), (THREADS, 1, 1), down, shared=self.smem)

    def run(self, inputs: ExpertsInput, topk: RoutedTopk, rows: torch.Tensor) -> None:
        x, ids = inputs.x, topk.ids
        self._check_run(x, ids, rows)
        self.launch_up(x, topk)
        self.launch_down(x.shape[0], topk, rows)


class CudaExpertsNvfp4MarlinBulkV3(_MarlinV3, CudaExpertsNvfp4MarlinBulk):
    """``cuda.experts_nvfp4_marlin_bulk`` with experts.cu's V3 decode (BULK_V3): about 3
    instead of 6 instructions a code, so the consumer warps, fed from the bulk-copy ring
    instead of waiting on their own loads, can keep up with the copy. The scale bytes and
    globals V3 decodes exactly (``cuda.experts_nvfp4_marlin_v3``'s check); not V3's bits
    (this file's order of the fp32 sums), as close to the exact weights. Not registered (the
    two-block form measured 155.5 us a layer chained at expert TP on the H200, 30% of the
    copy, against the register loads' 85.0 us: bench/NOTES.md v10)."""

    name = "cuda.experts_nvfp4_marlin_v3_bulk"
    v3 = 1


class CudaExpertsNvfp4MarlinBulkV3x2(CudaExpertsNvfp4MarlinBulkV3):
    """``cuda.experts_nvfp4_marlin_v3_bulk`` on two blocks an SM (BULK_BLOCKS = 2) of 5
    stages each: 16 consumer warps an SM (4 a scheduler) instead of 8, with about as many
    bytes in flight (90 KB an SM instead of 108). Not registered."""

    name = "cuda.experts_nvfp4_marlin_v3_bulk2"
    stages = 5
    blocks_per_sm = 2
