"""The routed experts (sub-ops ``experts`` and ``experts_nvfp4``) as two kernels of
kernels/experts.cu, one source templated on the weight format:

    experts_up_kernel:   the distinct held experts found from the ids on the device;
                         each one's W13 read once for the 8 rows, SwiGLU -> act
    experts_down_kernel: each one's W2 read once -> rows[b, k, P]

The kernels read the weights as the checkpoint stores them (bf16 rows; NVFP4 codes
row-major two a byte, e4m3 scales row-major per 16 values, fp32 globals per expert),
or as vLLM keeps NVFP4 experts on SM90 (``nvfp4_marlin``: Marlin's 16 x 64 tiles,
its permuted one-byte scales and scaled globals, nvfp4_marlin.py): there is nothing
to repack, so the provider keeps views of the layer's tensors and no second copy. Under EP the routes to other ranks' experts get zero rows; under
expert TP the rows are this rank's partial over its I-slice.

Against the reference (``reference.experts`` / ``reference.experts_nvfp4``): the
NVFP4 values are dequantized to the reference's bf16 bits (nvfp4.dequantize,
nvfp4_marlin.dequantize), both
GEMM outputs are rounded to bf16 where the reference rounds them, SwiGLU is the same
fp32 operations; the GEMMs' fp32 sums run in another order (tensor-core MMA over
16 values, the K-slices of the warps added in a fixed order), so an output differs
by fp32 rounding of the sums, a bf16 ulp where that crosses a rounding boundary.
The V3 providers (EXPERTS_V2 = 2; the Marlin ones registered) follow vLLM's Marlin math
instead, which is what vLLM's stock forward computes on SM90: the weights e2m1 * block
scale exact in bf16, the global scale on the fp32 sums; their outputs are closer to the
exact quantized model than the reference's (which rounds every weight to bf16).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from sparkdecode.nvfp4_marlin import GLOBAL_SHIFT, SCALE_SHIFT
from sparkdecode.protocols import BuildContext, Deployment, ExpertsInput, RoutedTopk
from sparkdecode.weights import CHECKPOINT_FORMATS, ExpertWeights

from .boundary import _Cuda, cuda_unsupported
from .launch import Arg, Kernel, i32, ptr

SOURCE = "experts.cu"
COMPILE_OPTIONS = ("--fmad=false",)
MAX_ROWS = 8  # the MMA's n
MAX_ROUTES = 64
MAX_LOCAL = 256  # experts one rank holds (the kernels' first-route table)
# The K a warp covers per batch of loads (experts.cu's CHUNK_K): 16-byte loads of 32
# NVFP4 or 8 bf16 values times the 4 threads of a row; Marlin: four MMA steps of 16.
CHUNK = {"bf16": 32, "nvfp4": 128, "nvfp4_marlin": 64}
FMT = {"bf16": 0, "nvfp4": 1, "nvfp4_marlin": 2}
# A warp's intermediate columns in the up GEMM and output rows in the down GEMM
# (experts.cu's UP_COLS, DOWN_ROWS: Marlin's 64-row blocks).
UP_COLS = {"bf16": 16, "nvfp4": 16, "nvfp4_marlin": 64}
DOWN_ROWS = {"bf16": 32, "nvfp4": 32, "nvfp4_marlin": 64}
BLOCKS_PER_SM = 2  # the kernels' 256 threads fit twice on an SM
# dequantization is exact while scale * global * 2^126 stays finite (experts.cu)
MAX_BLOCK_SCALE = 4.0


def _warps_k(k: int, chunk: int) -> int:
    """Warps along K (as experts.cu's warps_k)."""
    return 8 if k >= 16 * chunk else 4 if k >= 8 * chunk else 2 if k >= 4 * chunk else 1


def routes_unsupported(top_k: int, max_rows: int, num_local: int) -> str | None:
    """Why the experts kernels' route tables (experts_common.cuh) cannot hold this
    many experts on a rank, rows or routes, or None."""
    if num_local > MAX_LOCAL:
        return f"{num_local} experts on a rank: the experts kernels take at most {MAX_LOCAL}"
    if max_rows > MAX_ROWS:
        return f"max_rows {max_rows}: the experts kernels take at most {MAX_ROWS} rows"
    if max_rows * top_k > MAX_ROUTES:
        return f"{max_rows} rows x top-{top_k}: the experts kernels take at most {MAX_ROUTES} routes"
    return None


def shape_unsupported(
    width: int,
    intermediate: int,
    fmt: str,
    top_k: int,
    max_rows: int,
    num_local: int = MAX_LOCAL,
    down_wk: int | None = None,
) -> str | None:
    """Why the kernels cannot take this pooled width P, this rank's I-slice and its
    count of experts, or None; ``down_wk``: the down kernel's warps along K where not
    _warps_k's (experts.cu's EXPERTS_DOWN_WK)."""
    chunk = CHUNK[fmt]
    reason = routes_unsupported(top_k, max_rows, num_local)
    if reason:
        return reason
    for what, k in (("moe_hidden_size", width), ("this rank's moe_intermediate_size", intermediate)):
        if k % chunk:
            return f"{what} {k}: the {fmt} experts kernels take multiples of {chunk}"
    wk2 = down_wk or _warps_k(intermediate, chunk)
    if intermediate % (chunk * wk2):
        return f"this rank's moe_intermediate_size {intermediate}: not a multiple of {chunk * wk2}"
    up = UP_COLS[fmt] * (8 // _warps_k(width, chunk))
    down = DOWN_ROWS[fmt] * (8 // wk2)
    if intermediate % up:
        return f"this rank's moe_intermediate_size {intermediate}: not a multiple of {up}"
    if width % down:
        return f"moe_hidden_size {width}: not a multiple of {down}"
    return None


def rank_experts(deployment: Deployment) -> tuple[int, int]:
    """This rank's I-slice and its count of experts under ``deployment``: I / TP of every
    expert under expert TP, whole experts, E / TP of them, under EP."""
    d, s = deployment, deployment.spec
    return (s.I // d.tp, s.E) if d.expert_parallel == "tp" else (s.I, s.E // d.tp)


def _intermediate(w2: torch.Tensor, fmt: str) -> int:
    """This rank's I from W2 (bf16 [E, P, I], NVFP4 [E, P, I / 2], Marlin int32 [E, I / 16, 2P])."""
    return {"bf16": w2.shape[2], "nvfp4": 2 * w2.shape[2], "nvfp4_marlin": 16 * w2.shape[1]}[fmt]


def prefer_max_shared(kernel: Kernel, who: str) -> None:
    """Hint the driver to the largest shared-memory carveout for ``kernel`` (blocks an SM
    that need most of an SM's shared memory are not cut by a smaller carveout)."""
    from cuda.bindings import driver

    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    max_shared = int(driver.CUshared_carveout.CU_SHAREDMEM_CARVEOUT_MAX_SHARED)
    (err,) = driver.cuFuncSetAttribute(kernel.function, attribute, max_shared)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{who}: the shared-memory carveout: {err}")


# experts.cu's switch defines, each by the CudaExperts class attribute that sets it (its
# value; absent where 0)
SWITCHES = (
    ("route_mask", "EXPERTS_ROUTE_MASK"),
    ("lean", "EXPERTS_LEAN"),
    ("early", "EXPERTS_EARLY"),
    ("down_scatter", "EXPERTS_DOWN_SCATTER"),
    ("slot_masks", "EXPERTS_SLOT_MASKS"),
    ("up_scatter", "EXPERTS_UP_SCATTER"),
    ("down_queue", "EXPERTS_DOWN_QUEUE"),
    ("stream_loads", "EXPERTS_STREAM_LOADS"),
    ("down_spare", "EXPERTS_DOWN_SPARE"),
    ("down_carry", "EXPERTS_DOWN_CARRY"),
)


class CudaExperts(_Cuda):
    """Sub-op ``experts``: bf16 routed experts on this pack's kernels."""

    block = "experts"
    name = "cuda.experts"
    format = "bf16"
    # experts.cu's EXPERTS_V2 (0: the kernels as registered); a define, so in the compile key
    variant: ClassVar[int] = 0
    # the blocks per SM the up and down kernels are built and launched for
    # (EXPERTS_UP_BLOCKS, EXPERTS_DOWN_BLOCKS; defined where not the default)
    up_blocks: ClassVar[int] = BLOCKS_PER_SM
    down_blocks: ClassVar[int] = BLOCKS_PER_SM
    # the up kernel's dynamic shared memory a launch (EXPERTS_RING's rings; none otherwise)
    up_shared: int = 0
    # experts.cu's EXPERTS_ROUTE_MASK: the down kernel's epilogue over per-row route masks
    route_mask: ClassVar[int] = 0
    # experts.cu's EXPERTS_LEAN: the V3 Marlin loop's prefetch pointers and shift on the FMA pipe
    lean: ClassVar[int] = 0
    # experts.cu's EXPERTS_EARLY: the up kernel finds its experts before its PDL wait when
    # the routing is final at launch (RoutedTopk.final)
    early: ClassVar[int] = 0
    # experts.cu's EXPERTS_DOWN_SCATTER: the down kernel's K reduction as a reduce-scatter,
    # every warp along K finishing its share of the item's tiles
    down_scatter: ClassVar[int] = 0
    # experts.cu's EXPERTS_SLOT_MASKS: the down kernel's route masks made once a block
    slot_masks: ClassVar[int] = 0
    # experts.cu's EXPERTS_UP_SCATTER: the EXPERTS_HALF up kernel's item tail shared the same way
    up_scatter: ClassVar[int] = 0
    # experts.cu's EXPERTS_DOWN_QUEUE: the down kernel's items after each block's first
    # claimed from a counter (``queue``, an argument after ``rows``)
    down_queue: ClassVar[int] = 0
    # experts.cu's EXPERTS_STREAM_LOADS: the V3 Marlin loop's code words loaded past L1
    stream_loads: ClassVar[int] = 0
    # experts.cu's EXPERTS_DOWN_SPARE: the down kernel's only L2 prefetch a block's first item
    down_spare: ClassVar[int] = 0
    # experts.cu's EXPERTS_DOWN_CARRY: a down warp's next item's first batch loaded into
    # registers before its item's tail
    down_carry: ClassVar[int] = 0

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        d, s = deployment, deployment.spec
        intermediate, num_local = rank_experts(d)
        wk2 = cls.down_warps_k(s.P, intermediate)
        return cuda_unsupported(d) or shape_unsupported(
            s.P, intermediate, cls.format, s.top_k, d.max_rows, num_local, wk2
        )

    def __init__(self, ctx: BuildContext, layer: int):
        spec = ctx.spec
        e = self.experts = ctx.layer(layer).experts
        if e.format != self.format:
            raise ValueError(f"layer {layer}: {self.name} serves {self.format} experts, not {e.format}")
        self.intermediate = _intermediate(e.w2, e.format)
        wk2 = self.down_warps_k(spec.P, self.intermediate)
        why = shape_unsupported(spec.P, self.intermediate, self.format, spec.top_k, ctx.max_rows, e.num_local, wk2)
        if why:
            raise ValueError(f"layer {layer}: {self.name}: {why}")
        self._check_layout(layer)
        self.top_k, self.width = spec.top_k, spec.P
        defines = self.kernel_defines(spec.P, self.intermediate, spec.top_k)
        self.up = Kernel(SOURCE, "experts_up_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.down = Kernel(SOURCE, "experts_down_kernel", ctx.device, defines, COMPILE_OPTIONS)
        slots = min(MAX_ROUTES, ctx.max_rows * spec.top_k, e.num_local)
        self.act = ctx.scratch(
            f"cuda_experts_act_{self.intermediate}", (max(slots, 1), MAX_ROWS, self.intermediate), torch.bfloat16
        )
        sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
        tiles_up = self.up_tiles(spec.P, self.intermediate)
        tiles_down = spec.P // (DOWN_ROWS[self.format] * (8 // self.down_warps_k(spec.P, self.intermediate)))
        self.grid_up = max(1, min(slots * tiles_up, self.up_blocks * sms))
        self.grid_down = max(1, min(max(slots, 1) * tiles_down, self.down_blocks * sms))
        self.scales = self._scale_views()
        # EXPERTS_DOWN_QUEUE's counter and finished blocks, zero at every launch (its last block resets them)
        self.queue = torch.zeros(2, dtype=torch.int32, device=ctx.device) if self.down_queue else None

    @classmethod
    def kernel_defines(cls, width: int, intermediate: int, top_k: int) -> dict[str, int]:
        """experts.cu's defines for pooled width P, this rank's I-slice and top-k."""
        defines = {"P_DIM": width, "I_LOCAL": intermediate, "FMT": FMT[cls.format], "TOP_K": top_k}
        if cls.variant:
            defines["EXPERTS_V2"] = cls.variant
        if cls.up_blocks != BLOCKS_PER_SM:
            defines["EXPERTS_UP_BLOCKS"] = cls.up_blocks
        if cls.down_blocks != BLOCKS_PER_SM:
            defines["EXPERTS_DOWN_BLOCKS"] = cls.down_blocks
        wk = cls.down_warps_k(width, intermediate)
        if wk != _warps_k(intermediate, CHUNK[cls.format]):
            defines["EXPERTS_DOWN_WK"] = wk
        defines.update({define: int(getattr(cls, attr)) for attr, define in SWITCHES if getattr(cls, attr)})
        return defines

    @classmethod
    def up_tiles(cls, width: int, intermediate: int) -> int:
        """The up kernel's items an expert for pooled width P and this rank's I-slice
        (experts.cu's TILES1)."""
        return intermediate // (UP_COLS[cls.format] * (8 // _warps_k(width, CHUNK[cls.format])))

    @classmethod
    def down_warps_k(cls, width: int, intermediate: int) -> int:
        """The down kernel's warps along K for pooled width P and this rank's I-slice
        (experts.cu's WK2)."""
        return _warps_k(intermediate, CHUNK[cls.format])

    def _check_layout(self, layer: int) -> None:
        e = self.experts
        for name, t in (("w13", e.w13), ("w2", e.w2)):
            if not t.is_contiguous():
                raise ValueError(f"layer {layer}: {self.name} takes contiguous expert weights ({name} is strided)")

    def _scale_views(self) -> tuple[torch.Tensor | None, ...]:
        return (None, None, None, None)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CudaExperts:
        assert layer is not None
        return cls(ctx, layer)

    def _check_run(self, x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """What the kernels take of a step's x, ids and rows."""
        b = x.shape[0]
        if ids.dtype != torch.int32 or not ids.is_contiguous() or tuple(ids.shape) != (b, self.top_k):
            raise ValueError(f"{self.name}: ids must be contiguous int32 [{b}, {self.top_k}]")
        if not rows.is_contiguous() or tuple(rows.shape) != (b, self.top_k, self.width):
            raise ValueError(f"{self.name}: rows must be contiguous bf16 [{b}, {self.top_k}, {self.width}]")
        if x.stride(1) != 1 or x.stride(0) % 4 or x.data_ptr() % 8:
            raise ValueError(f"{self.name}: x rows must be contiguous, 8-byte aligned, row stride a multiple of 4")

    def _routing_args(self, topk: RoutedTopk) -> list[Arg]:
        """What the up kernel takes of the routing beyond its ids (EXPERTS_EARLY: whether
        they are final at launch)."""
        return [i32(int(topk.final))] if self.early else []

    def _up_args(self, x: torch.Tensor, ids: torch.Tensor) -> list[Arg]:
        """The up kernel's arguments (those of every experts kernel's up, first):
        x, its row stride and rows, the routes, w13 and its scales, the activations."""
        e = self.experts
        w13_scale, w13_global, _, _ = self.scales
        return [
            ptr(x),
            i32(x.stride(0)),
            i32(x.shape[0]),
            ptr(ids),
            i32(e.first_expert),
            i32(e.num_local),
            ptr(e.w13),
            ptr(w13_scale),
            ptr(w13_global),
            ptr(self.act),
        ]

    def _down_args(self, b: int, ids: torch.Tensor, rows: torch.Tensor) -> list[Arg]:
        """The down kernel's arguments (those of every experts kernel's down, first):
        the activations of b rows, the routes, w2 and its scales, the routed rows."""
        e = self.experts
        _, _, w2_scale, w2_global = self.scales
        return [
            ptr(self.act),
            i32(b),
            ptr(ids),
            i32(e.first_expert),
            i32(e.num_local),
            ptr(e.w2),
            ptr(w2_scale),
            ptr(w2_global),
            ptr(rows),
            *([ptr(self.queue)] if self.down_queue else []),
        ]

    def launch_up(self, x: torch.Tensor, topk: RoutedTopk) -> None:
        """The up kernel alone (x -> act), as ``run`` launches it."""
        up = [*self._up_args(x, topk.ids), *self._routing_args(topk)]
        self.up.launch((self.grid_up, 1, 1), (256, 1, 1), up, shared=self.up_shared)

    def launch_down(self, b: int, topk: RoutedTopk, rows: torch.Tensor) -> None:
        """The down kernel alone (act -> rows, b rows of x), as ``run`` launches it."""
        self.down.launch((self.grid_down, 1, 1), (256, 1, 1), self._down_args(b, topk.ids, rows))

    def run(self, inputs: ExpertsInput, topk: RoutedTopk, rows: torch.Tensor) -> None:
        x, ids = inputs.x, topk.ids
        self._check_run(x, ids, rows)
        self.launch_up(x, topk)
        self.launch_down(x.shape[0], topk, rows)


class CudaExpertsNvfp4(CudaExperts):
    """Sub-op ``experts_nvfp4``: NVFP4 routed experts, dequantized in registers."""

    block = "experts_nvfp4"
    name = "cuda.experts_nvfp4"
    format = "nvfp4"
    layouts: ClassVar[tuple[str, ...]] = CHECKPOINT_FORMATS
    refusal = (
        "reads NVFP4 experts in the checkpoint's layout, not {} (vLLM's SM90 Marlin repack is read by "
        "cuda.experts_nvfp4_marlin)"
    )

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        reason = super().unsupported(deployment)
        if reason is None and deployment.expert_format not in cls.layouts:
            reason = cls.refusal.format(deployment.expert_format)
        return reason

    def _check_layout(self, layer: int) -> None:
        super()._check_layout(layer)
        q = self.experts.nvfp4
        assert q is not None
        for name, t in (("w13_scale", q.w13_scale), ("w2_scale", q.w2_scale)):
            if t.dtype != torch.float8_e4m3fn or not t.is_contiguous():
                raise ValueError(f"layer {layer}: {self.name} takes contiguous e4m3 scales ({name})")
        for name, t in (("w13_global", q.w13_global), ("w2_global", q.w2_global)):
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"layer {layer}: {self.name} takes contiguous fp32 global scales ({name})")
        largest = max(
            (q.w13_scale.float().amax(dim=(1, 2))[:, None] * q.w13_global.abs()).max().item(),
            (q.w2_scale.float().amax(dim=(1, 2)) * q.w2_global.abs()).max().item(),
        )
        self._check_bound(layer, largest)

    def _check_bound(self, layer: int, largest: float) -> None:
        if not largest < MAX_BLOCK_SCALE:
            raise ValueError(
                f"layer {layer}: a block scale times its global scale is {largest:g}; {self.name} "
                f"dequantizes exactly below {MAX_BLOCK_SCALE:g} (weights of magnitude up to 24)"
            )

    def _scale_views(self) -> tuple[torch.Tensor | None, ...]:
        q = self.experts.nvfp4
        assert q is not None
        return (q.w13_scale.view(torch.uint8), q.w13_global, q.w2_scale.view(torch.uint8), q.w2_global)


def _marlin_scale_max(scale: torch.Tensor) -> torch.Tensor:
    """fp32 [E]: each expert's largest Marlin block scale (byte << 7 as fp16, over 2^7)."""
    half = (scale.view(torch.uint8).to(torch.int16) << 7).view(torch.float16)
    return half.float().amax(dim=(1, 2)) / SCALE_SHIFT


class CudaExpertsNvfp4Marlin(CudaExpertsNvfp4):
    """Sub-op ``experts_nvfp4`` on vLLM's SM90 Marlin layout (``nvfp4_marlin``):
    Marlin's tiles and scales read in place by the same kernels (FMT 2), dequantized
    in registers to nvfp4_marlin.dequantize's bits (tests/test_gpu_cuda_experts.py,
    the marlin cases)."""

    name = "cuda.experts_nvfp4_marlin"
    format = "nvfp4_marlin"
    layouts = ("nvfp4_marlin",)
    refusal = "reads NVFP4 experts in vLLM's SM90 Marlin layout, not {}"

    def _check_layout(self, layer: int) -> None:
        CudaExperts._check_layout(self, layer)
        m = self.experts.marlin
        assert m is not None
        for name, t in (("w13_scale", m.w13_scale), ("w2_scale", m.w2_scale)):
            if t.element_size() != 1 or not t.is_contiguous():
                raise ValueError(f"layer {layer}: {self.name} takes Marlin's contiguous one-byte scales ({name})")
        for name, t in (("w13_global", m.w13_global), ("w2_global", m.w2_global)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 1:
                raise ValueError(f"layer {layer}: {self.name} takes Marlin's fp32 [E] global scales ({name})")
        largest = max(
            (_marlin_scale_max(m.w13_scale) * (m.w13_global / GLOBAL_SHIFT).abs()).max().item(),
            (_marlin_scale_max(m.w2_scale) * (m.w2_global / GLOBAL_SHIFT).abs()).max().item(),
        )
        self._check_bound(layer, largest)

    def _scale_views(self) -> tuple[torch.Tensor | None, ...]:
        m = self.experts.marlin
        assert m is not None
        return (m.w13_scale.view(torch.uint8), m.w13_global, m.w2_scale.view(torch.uint8), m.w2_global)


class CudaExpertsNvfp4V2(CudaExpertsNvfp4):
    """``cuda.experts_nvfp4`` with experts.cu's EXPERTS_V2: the next batch's and the next
    item's weights prefetched into L2 while computing."""

    name = "cuda.experts_nvfp4_v2"
    variant = 1


class CudaExpertsNvfp4MarlinV2(CudaExpertsNvfp4Marlin):
    """``cuda.experts_nvfp4_marlin`` with experts.cu's EXPERTS_V2: the codes decoded as
    e4m3 bytes and the scale bytes as fp32 bits (tests/test_cuda_experts_marlin.py
    emulates both against nvfp4_marlin.dequantize), plus the L2 prefetch."""

    name = "cuda.experts_nvfp4_marlin_v2"
    variant = 1


class _ExactScales:
    """EXPERTS_V3's bound: e2m1 * block scale is exact in bf16 for every finite scale and
    the globals apply to fp32 sums, so only non-finite scales are refused."""

    name: str

    def _check_bound(self, layer: int, largest: float) -> None:
        if not math.isfinite(largest):
            raise ValueError(f"layer {layer}: {self.name} takes finite block and global scales (got {largest:g})")


class CudaExpertsNvfp4V3(_ExactScales, CudaExpertsNvfp4V2):
    """``cuda.experts_nvfp4_v2`` with experts.cu's EXPERTS_V3 (EXPERTS_V2 = 2): each block's
    table holds e2m1 * scale, exact in bf16, and the globals (gate's, up's, W2's) multiply
    the GEMMs' fp32 sums once, before their bf16 roundings (vLLM's Marlin math, experts.cu's
    header): the weights are not rounded to bf16 one by one, so the outputs are closer to
    the exact quantized model than the reference's (tests/expert_check.py,
    assert_experts_close_exact). Not registered: on the H200 it is no faster than
    ``cuda.experts_nvfp4`` (bench/NOTES.md v7), and the V1 kernel keeps the reference's roundings."""

    name = "cuda.experts_nvfp4_v3"
    variant = 2


# Marlin's scale bytes V3 decodes by bit placement: 0, or the fp16 exponent's top bit set
# (values >= 2, all vLLM's repack keeps) below the inf / NaN bytes 0xf8..0xff.
MARLIN_BYTE_FLOOR, MARLIN_BYTE_END = 0x80, 0xF8
# Marlin's global times 2^-112 must stay a normal fp32 (experts.cu: exact, V3)
MARLIN_GLOBAL_MIN = 2.0**-14


def marlin_v3_unsupported(scale: torch.Tensor, global_scale: torch.Tensor) -> str | None:
    """Why EXPERTS_V3 cannot decode these Marlin scale bytes and globals exactly, or None."""
    b = scale.view(torch.uint8)
    bad = ((b > 0) & (b < MARLIN_BYTE_FLOOR)) | (b >= MARLIN_BYTE_END)
    if bad.any():
        byte = int(b[bad][0])
        return (
            f"a Marlin scale byte 0x{byte:02x}: V3 decodes 0 and 0x{MARLIN_BYTE_FLOOR:02x}..0x{MARLIN_BYTE_END - 1:02x} "
            "(block scales of at least 2, as vLLM's repack keeps them; finite)"
        )
    g = global_scale.abs()
    if ((g > 0) & (g < MARLIN_GLOBAL_MIN)).any() or not torch.isfinite(g).all():
        return f"a Marlin global scale below {MARLIN_GLOBAL_MIN:g} or not finite"
    return None


class _MarlinV3(_ExactScales):
    """The V3 decode on Marlin's layout (experts.cu's EXPERTS_V3, experts_bulk.cu's
    BULK_V3): the exact bound, and the layer's scale bytes and globals refused where the
    decode would not give them exactly (``marlin_v3_unsupported``)."""

    experts: ExpertWeights

    def _check_layout(self, layer: int) -> None:
        super()._check_layout(layer)  # type: ignore[misc]
        m = self.experts.marlin
        assert m is not None
        for which, scale, glob in (("w13", m.w13_scale, m.w13_global), ("w2", m.w2_scale, m.w2_global)):
            why = marlin_v3_unsupported(scale, glob)
            if why:
                raise ValueError(f"layer {layer}: {self.name}: {which}: {why}")


class CudaExpertsNvfp4MarlinV3(_MarlinV3, CudaExpertsNvfp4MarlinV2):
    """``cuda.experts_nvfp4_marlin_v2`` with experts.cu's EXPERTS_V3 (EXPERTS_V2 = 2):
    codes and scale bytes placed as bf16 bits, one exact bf16x2 multiply per two codes,
    Marlin's global on the GEMMs' fp32 sums, as vLLM's Marlin kernel computes
    (experts.cu's header; tests/test_cuda_experts_v3.py emulates the decode for every
    code and scale byte). Takes the scale bytes vLLM's repack makes (0 or at least 2);
    refuses others. The fastest Marlin kernel measured (bench/NOTES.md v7)."""

    name = "cuda.experts_nvfp4_marlin_v3"
    variant = 2


class CudaExpertsNvfp4MarlinV3Occ(CudaExpertsNvfp4MarlinV3):
    """``cuda.experts_nvfp4_marlin_v3`` with the down kernel built for 4 blocks an SM
    (EXPERTS_DOWN_BLOCKS = 4: 64 registers, no spills, a batch's loads still issued
    before its MMAs) and launched on 4 an SM: twice the warps, so twice the down GEMM's
    weight loads in flight an SM. The up kernel stays at 2 (at 3, ptxas fits 80
    registers by issuing a batch's loads a few at a time). The same kernels' math: the
    same bits. The fastest Marlin kernel measured (bench/NOTES.md v7)."""

    name = "cuda.experts_nvfp4_marlin_v3_occ"
    down_blocks = 4


# experts.cu's EXPERTS_RING stage (RingStage): per Marlin block of 64 rows a warp's 512 bytes
# of codes and 64 of scales for one step of 16 k, and the warp's x words (8 bytes a lane)
RING_BLOCK_BYTES, RING_X_BYTES = 512 + 64, 32 * 8


def ring_smem_bytes(width: int, stages: int) -> int:
    """experts.cu's UP_SMEM_BYTES for pooled width P: the up kernel's dynamic shared memory
    under EXPERTS_RING = stages, the 8 warps' rings (min(stages, a warp's steps) stages of
    its two blocks, gate and up) or the K reduction's sums laid over them, the larger."""
    fmt = "nvfp4_marlin"
    steps = width // _warps_k(width, CHUNK[fmt]) // 16
    tiles = 2 * UP_COLS[fmt] // 16  # a warp's gate and up tiles (NT1)
    ring = 8 * min(stages, steps) * (tiles // 4 * RING_BLOCK_BYTES + RING_X_BYTES)
    red = 8 * tiles * 4 * 32 * 4
    return max(ring, red)


class CudaExpertsNvfp4MarlinV3Ring(CudaExpertsNvfp4MarlinV3Occ):
    """``cuda.experts_nvfp4_marlin_v3_occ`` with experts.cu's EXPERTS_RING: the up kernel's
    weight, scale and x loads staged through a per-warp ring of 4 shared-memory stages of one
    step of 16 k each (cp.async, a thread's own 16 bytes of codes: its A fragments), issued
    3 steps ahead of the step being decoded, so loads stay in flight through every step's
    decode and MMAs instead of a register batch's being waited for whole; with the loads
    out of registers the up kernel fits 80 registers and runs 3 blocks an SM (its rings
    ring_smem_bytes of dynamic shared memory a block, the K reduction's sums laid over
    them). The same MMAs in the same order as V3: the same bits. Registered: on the H200 the
    fastest Marlin kernel on the EP stream (49% of the copy chained against _occ's 46%),
    slower than _occ under expert TP (48% against 52%; bench/NOTES.md v8); the resolver's
    in-place timing picks between them."""

    name = "cuda.experts_nvfp4_marlin_v3_ring"
    # experts.cu's EXPERTS_RING: a warp's stages
    ring: ClassVar[int] = 4
    up_blocks = 3

    @classmethod
    def kernel_defines(cls, width: int, intermediate: int, top_k: int) -> dict[str, int]:
        return {**super().kernel_defines(width, intermediate, top_k), "EXPERTS_RING": cls.ring}

    def __init__(self, ctx: BuildContext, layer: int):
        super().__init__(ctx, layer)
        for name, t in (("w13", self.experts.w13), ("w13_scale", self.scales[0])):
            assert t is not None
            if t.data_ptr() % 16:
                raise ValueError(f"layer {layer}: {self.name} copies 16-byte aligned tensors ({name} is not)")
        self.up_shared = ring_smem_bytes(ctx.spec.P, self.ring)
        self.up.allow_shared(self.up_shared)
        # the largest carveout, so that 3 blocks an SM (3 x 47 KB with the rings) are not cut
        prefer_max_shared(self.up, f"{self.name}: the up kernel")


# The largest I-slice the Slice variant's down kernel takes on one warp along K (expert TP at
# TP 8: I / 8 = 512; whole experts under EP keep the default, where one warp along K leaves
# most blocks without an item).
SLICE_WK1 = 512


class _SliceDown:
    """The down kernel on ``slice_wk`` warps along K where this rank's I-slice is at most
    ``SLICE_WK1`` and the width tiles (expert TP's slice), the class's own choice elsewhere."""

    format: str
    slice_wk: ClassVar[int] = 1

    @classmethod
    def down_warps_k(cls, width: int, intermediate: int) -> int:
        fits = shape_unsupported(width, intermediate, cls.format, 1, 1, down_wk=cls.slice_wk) is None
        if intermediate <= SLICE_WK1 and fits:
            return cls.slice_wk
        return super().down_warps_k(width, intermediate)  # type: ignore[misc]


class CudaExpertsNvfp4MarlinV3Slice(_SliceDown, CudaExpertsNvfp4MarlinV3Occ):
    """``cuda.experts_nvfp4_marlin_v3_occ`` whose down kernel takes one warp along K
    (EXPERTS_DOWN_WK = 1: no cross-warp reduction, no barrier an item; 512 output rows an
    item) where this rank's I-slice is at most ``SLICE_WK1`` and the width tiles, and
    ``_occ``'s elsewhere (tests/test_cuda_experts_v3.py). Registered: 54% of the copy chained at expert
    TP (bench/NOTES.md v9)."""

    name = "cuda.experts_nvfp4_marlin_v3_slice"


class CudaExpertsNvfp4MarlinV3Half(CudaExpertsNvfp4MarlinV3Occ):
    """``cuda.experts_nvfp4_marlin_v3_occ`` with experts.cu's EXPERTS_HALF: each up warp takes
    the gate rows or the up rows of its item, not both (half the accumulators and loads a
    thread), so the up kernel runs 3 blocks an SM with its loads still in registers (the
    measured stall is memory latency at 4 warps a scheduler, bench/NOTES.md v8); the halves
    meet in shared memory for SwiGLU. Not V3's bits (other K-slices), as close to the exact
    weights. Registered: the fastest under EP (52% of the copy chained) and in the 62-layer
    step's in-place timing (bench/NOTES.md v9)."""

    name = "cuda.experts_nvfp4_marlin_v3_half"
    up_blocks = 3

    @classmethod
    def kernel_defines(cls, width: int, intermediate: int, top_k: int) -> dict[str, int]:
        return {**super().kernel_defines(width, intermediate, top_k), "EXPERTS_HALF": 1}

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        width = deployment.spec.P
        if _warps_k(width, CHUNK[cls.format]) < 2:
            return f"moe_hidden_size {width}: {cls.name} splits K over at least 2 warps a half (P >= 256)"
        return super().unsupported(deployment)


class CudaExpertsNvfp4MarlinV3Half4(CudaExpertsNvfp4MarlinV3Half):
    """``cuda.experts_nvfp4_marlin_v3_half`` with the up kernel on 4 blocks an SM (64
    registers, no spills): at expert TP's 440-odd items one round of the 528 blocks, where 3
    an SM leave a second round of 44. Registered: the fastest at expert TP (55% of the copy
    chained, bench/NOTES.md v9)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4"
    up_blocks = 4


class CudaExpertsNvfp4MarlinV3Half4Mask(CudaExpertsNvfp4MarlinV3Half4):
    """``cuda.experts_nvfp4_marlin_v3_half4`` with experts.cu's EXPERTS_ROUTE_MASK: the down
    kernel's epilogue stores each value to the routes of its row that a mask made once an
    item names, instead of scanning the row's top-k routes for every value (about a fifth
    of the down kernel's instructions, from its SASS). The same bits as ``_half4``. Not registered: ``_half4_lean`` (this with EXPERTS_LEAN) is
    faster (86.4 against 85.0 us a layer chained at expert TP on the H200)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_mask"
    route_mask = 1


class CudaExpertsNvfp4MarlinV3Half4Lean(CudaExpertsNvfp4MarlinV3Half4Mask):
    """``cuda.experts_nvfp4_marlin_v3_half4_mask`` with experts.cu's EXPERTS_LEAN: the Marlin
    loop of both kernels with fewer integer-pipe instructions (the L2 prefetch's lines as
    pointers advanced a batch at a time, a word's shift by 8 as a multiply-high). The same
    bits as ``_half4``. Registered: the fastest Marlin kernel at expert TP on the H200
    (85.0 us a layer chained, 55% of the copy; ``_half4`` 87.6 us), and with
    ``cuda.experts_slice2`` the fastest 62-layer step (bench/NOTES.md v10)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_lean"
    lean = 1


class CudaExpertsNvfp4MarlinV3Half4Early(CudaExpertsNvfp4MarlinV3Half4Lean):
    """``cuda.experts_nvfp4_marlin_v3_half4_lean`` with experts.cu's EXPERTS_EARLY: when the
    routing is final at launch (``RoutedTopk.final``: cuda.moe's side stream behind its
    join), the up kernel finds its experts and prefetches its first item's first batch
    into L2 before its PDL wait, beside the pre-expert norm, instead of after it. The same
    bits as ``_half4`` (on the H200, through a side stream's join in a graph; memcheck and
    racecheck clean). Registered: in the 62-layer step 10.35 ms against ``_half4_lean``'s
    10.42 ms with the same pins, and the resolver's choice unpinned (bench/NOTES.md v11)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_early"
    # Above the pack's other NVFP4 kernels (10): the fastest in the H200's step.
    priority = 20
    early = 1


class CudaExpertsNvfp4MarlinV3Half4Scatter(CudaExpertsNvfp4MarlinV3Half4Early):
    """``cuda.experts_nvfp4_marlin_v3_half4_early`` with experts.cu's EXPERTS_DOWN_SCATTER:
    the down kernel's K reduction as a reduce-scatter, so an item's sums and stores are
    shared by its warps along K (one tile each at expert TP's slice) instead of run by one
    warp while the others wait for it at the next item. The same bits. Not registered: on
    the H200 its down kernel is 0.9 us a layer faster chained, up + down no faster
    (bench/NOTES.md v16)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter"
    down_scatter = 1


class CudaExpertsNvfp4MarlinV3Half4ScatterMasks(CudaExpertsNvfp4MarlinV3Half4Scatter):
    """``cuda.experts_nvfp4_marlin_v3_half4_scatter`` with experts.cu's EXPERTS_SLOT_MASKS:
    the down kernel's route masks made once a block instead of in every item's epilogue.
    The same bits. Not registered: on the H200 1.3 us a layer faster chained than
    ``_half4_early``, the up kernel's shared tail (``_half4_scatter_up``) 0.5 us more
    (bench/NOTES.md v16)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_masks"
    slot_masks = 1


class CudaExpertsNvfp4MarlinV3Half4ScatterUp(CudaExpertsNvfp4MarlinV3Half4ScatterMasks):
    """``cuda.experts_nvfp4_marlin_v3_half4_scatter_masks`` with experts.cu's
    EXPERTS_UP_SCATTER: the up kernel's item tail (its K reductions, the up side's sums
    passed to the gate side, SwiGLU and the stores) shared by each side's warps along K, a
    tile each, instead of run by the gate side's first warp alone. The same bits (on the
    H200; memcheck and racecheck clean). Registered: chained at expert TP 78.4 us a layer
    against ``_half4_early``'s 79.8, and the 62-layer step 10.12 ms against 10.21 with the
    same pins (bench/NOTES.md v16)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_up"
    # Above _half4_early (20): the fastest NVFP4 kernel in the H200's step.
    priority = 25
    up_scatter = 1


class CudaExpertsNvfp4MarlinV3Half4ScatterUpK2(_SliceDown, CudaExpertsNvfp4MarlinV3Half4ScatterUp):
    """``cuda.experts_nvfp4_marlin_v3_half4_scatter_up`` whose down kernel takes 2 warps along K
    at expert TP's slice (EXPERTS_DOWN_WK = 2, ``_SliceDown``), ``_half4_scatter_up``'s
    elsewhere: a warp's item 16 k-steps of its 4 tiles instead of 8, so the item's own
    instructions (the K reduction's stores, the route masks, the stores) are spread over
    twice the MMAs, 2 tiles a warp in the scattered epilogue. At expert TP 38% of the down
    kernel's instructions are outside its loop (bench/NOTES.md v19). The same products
    summed in other K-slices: not ``_half4_scatter_up``'s bits (the fp32 order). Not
    registered: on the H200 75.8 us a layer chained against 78.7, but the 62-layer step
    10.12 ms, level with ``_half4_scatter_up`` (bench/NOTES.md v20)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_up_k2"
    slice_wk = 2


class CudaExpertsNvfp4MarlinV3Half4ScatterUpK1(CudaExpertsNvfp4MarlinV3Half4ScatterUpK2):
    """``_half4_scatter_up_k2`` with one warp along K at expert TP's slice (EXPERTS_DOWN_WK =
    1): a warp's item the whole K-slice, no K reduction, its 4 tiles' epilogue its own.
    Not registered: on the H200 75.1 us a layer chained against 78.7; not yet in the step."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_up_k1"
    slice_wk = 1


class CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue(CudaExpertsNvfp4MarlinV3Half4ScatterUp):
    """``cuda.experts_nvfp4_marlin_v3_half4_scatter_up`` with experts.cu's EXPERTS_DOWN_QUEUE:
    the down kernel's items after each block's first claimed from a counter instead of
    every gridDim.x-th one, so that the blocks the dispatcher puts together on one SM
    (under PDL, on the SMs the up kernel leaves first) do not all get the most items. The
    same bits as ``_half4_scatter_up`` (on the H200; memcheck and racecheck clean).
    Registered: chained at expert TP 74.1-74.5 us a layer against 78.1-79.1 at 55 experts
    (level at 64, 1 us slower at 33), and the 62-layer step 10.05 ms against 10.10 with the
    same pins (bench/NOTES.md v25)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue"
    # Above _half4_scatter_up (25): the fastest NVFP4 kernel in the H200's step.
    priority = 30
    down_queue = 1


class CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNa(CudaExpertsNvfp4MarlinV3Half4ScatterUpQueue):
    """``cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue`` with experts.cu's
    EXPERTS_STREAM_LOADS: both kernels' code words loaded past L1
    (``ld.global.nc.L1::no_allocate``). Each is read once and would only evict x's words,
    which every warp of an expert reads again. The same instructions but for the loads'
    cache operator, the same bits (GPU-tested at every shape; memcheck and racecheck
    clean). Registered: on an H100, chained at expert TP 82.9 us a layer against 85.7 at 55
    experts (60.8 against 65.0 at 33, 92.5 against 97.0 at 64), and the 6-layer step
    1503-1507 us against 1510-1517 with the same pins (bench/NOTES.md v31). With the scales
    past L1 too, or the codes with 256-byte L2 fetches, it was slower; with the codes also
    evict-first in L2, or x's words evict-last in L1, no faster."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na"
    # Above _queue (30): faster chained and in the step on the H100.
    priority = 35
    stream_loads = 1


class CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpare(CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNa):
    """``cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na`` whose down kernel warms into
    L2 only a block's first item, before its PDL wait (experts.cu's EXPERTS_DOWN_SPARE): not
    each next item's first batch, nor the K loop's next batch. Prefetches only: the same bits
    (GPU-tested at every shape; memcheck and racecheck clean). Registered: on an H100,
    chained at expert TP 83.7-84.0 us a layer against 84.5-84.6 at 55 experts and 92.5
    against 95.0-95.1 at 64 (62.7-62.9 against 60.9-61.0 at 33), and the 6-layer step
    1528.5-1530.0 us against 1533.4-1539.9 with the same pins (bench/NOTES.md v34; measured
    as ``_queue_na_spare2``). Dropping only the next item's warm-up was no faster. On the
    H200, 70.9 us a layer chained against 73.5-73.6 at 55 experts (52.0-52.2 against 54.2
    at 33, level at 64), and the 62-layer step 9.86 ms against ``_queue``'s 10.03
    (bench/NOTES.md v35)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na_spare"
    # Above _queue_na (35): faster chained and in the step on the H100 and the H200.
    priority = 40
    down_spare = 1


class CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry(CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpare):
    """``cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na_spare`` whose down warps load
    their next item's first batch (code words and scales) into registers as soon as their
    item's K loop ends, so that it is in flight through the item's tail (the K reduction,
    the route masks, the stores) and the next claim's barrier, and their first item's before
    the PDL wait (experts.cu's EXPERTS_DOWN_CARRY). The same words decoded in the same
    order: the same bits (GPU-tested at every shape and over replays; memcheck and racecheck
    clean). Registered: on an H100, the 6-layer step 1519.8-1522.4 us against
    1524.9-1532.1 with the same pins, three runs each; chained at expert TP 82.1-82.6 us a
    layer against 83.9-84.4 at 55 experts and 58.1-58.4 against 62.7-63.6 at 33, but
    75.5-76.1 against 75.0-75.7 at 48 and 93.6-93.8 against 92.2-92.4 at 64 (bench/NOTES.md
    v41). Where it times
    slower the resolver's measurement keeps ``_queue_na_spare``."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na_spare_carry"
    # Above _queue_na_spare (40): faster in the step on the H100.
    priority = 45
    down_carry = 1


class CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2(CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry):
    """``cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na_spare_carry`` with two barriers
    an item in the down kernel, not three (experts.cu's EXPERTS_DOWN_CARRY = 2): the next
    item's claim is shown to the block by a barrier after the K loop, which the K
    reduction's first barrier becomes, not by its own barrier at the item's start, so the
    claim's atomic no longer holds the block; the carried loads go out after that barrier.
    The same bits (GPU-tested at every shape and over replays; memcheck and racecheck
    clean). Registered: on an H100, the 40-layer step 7447.9-7467.6 us against ``_carry``'s
    7469.1-7497.4 and ``_queue_na_spare``'s 7483.7-7516.1 with the same pins, three runs
    each; chained at expert TP 0.1-0.5 us a layer under ``_carry`` at 33, 48, 55 and 64
    experts (80.8 us a layer at 55, 80% of the copy) (bench/NOTES.md v42)."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na_spare_carry2"
    # Above _carry (45): faster in the 40-layer step and chained on the H100.
    priority = 47
    down_carry = 2


class CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2Evict(
    CudaExpertsNvfp4MarlinV3Half4ScatterUpQueueNaSpareCarry2
):
    """``cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na_spare_carry2`` with its code
    words' loads also hinted evict-first in L2 (experts.cu's EXPERTS_STREAM_LOADS = 2:
    CUTLASS's SM90 policy word on ``ld.global.nc.L1::no_allocate.L2::cache_hint``), so that
    the expert stream leaves the step's activations in L2, as cute.linear_tma_evict_first
    does for the dense streams (bench/NOTES.md v50). The same loads' values: the same bits.
    Not registered."""

    name = "cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na_spare_carry2_evict"
    stream_loads = 2


class CudaExpertsSlice2(_SliceDown, CudaExperts):
    """``cuda.experts`` (bf16) whose down kernel takes 2 warps along K at expert TP's slice
    (EXPERTS_DOWN_WK = 2: 32 k a chunk, so a warp's 64 k at the default 8 become 256, four
    times the loads in flight a warp and a quarter of the cross-warp reductions; 128 output
    rows an item), the default elsewhere. At expert TP the bf16 stream is at 75% of the copy
    chained against 86% under EP, whose whole experts give each warp 512 k. The same products
    summed in other K-slices. Registered: 87% of the copy chained at expert TP on the H200
    (193.2 us a layer; ``cuda.experts`` 229.5 us, 73%), EP unchanged (bench/NOTES.md v10)."""

    name = "cuda.experts_slice2"
    # Above cuda.experts (10): the faster bf16 stream at expert TP, level under EP.
    priority = 20
    slice_wk = 2
