"""``cuda.attention_core``: the verify step's attention core on this pack's split-KV
kernels (kernels/attention_core.cu): attention_split_kernel over the splits of a KV head
that the step's length asks for (``active_splits``, read from the device), then
attention_combine_kernel over those splits; nothing on the host per step, so it replays in
a FULL graph. ``run_gated``: the same with the attention block's o-norm and gate in the
combine (attention_gated_combine_kernel), which cuda.attention calls in place of its
own gate kernel.

Against the reference (``reference.functional.paged_attention``): the same bf16 q, K and
V, scores and the softmax in fp32 (exp2 of the scores in log2 units), the probabilities
kept to about 2^-17 (two bf16 terms) through the PV product, the output rounded to bf16
once; the splits' partial sums are added in a fixed order (the same bits every run).
"""

from __future__ import annotations

import math

import torch

from sparkdecode.protocols import BuildContext, Deployment, LayerKV, Step, check_kv_form

from .boundary import _Cuda
from .launch import Kernel, f32, i32, i64, ptr

SOURCE = "attention_core.cu"
COMPILE_OPTIONS = ("--fmad=false",)
HEAD_DIM = 64
MROWS = 64  # query rows a KV head: rows x query heads a KV head, at most
TILE = 64  # keys a tile
MIN_SPLITS = 16
MAX_SPLITS = 128
PARTS = 8  # runs of splits a row's combine takes at once (kernels/attention_core.cu)


def splits_for(max_context: int, per: int = 1) -> int:
    """The grid's blocks a KV head: about ``per`` tiles each at the longest context,
    MIN_SPLITS to MAX_SPLITS. A step uses ``active_splits`` of them."""
    tiles = max_context // TILE + 1
    return max(MIN_SPLITS, min(MAX_SPLITS, -(-tiles // per)))


def active_splits(tiles: int, splits: int, per: int = 1) -> int:
    """The blocks of a grid of ``splits`` that take part in a step over ``tiles`` key
    tiles (kernels/attention_core.cu's active_splits, which both kernels compute from the
    device's length): about ``per`` tiles each (TILES_A_SPLIT), at least MIN_SPLITS where
    there are as many tiles, at most the grid. A build for a long max_model_len thus runs
    a short context as a build for that context does, with the same bits."""
    return min(splits, tiles, max(MIN_SPLITS, -(-tiles // per)))


def keys_seen(max_context: int, window: int | None, max_rows: int) -> int:
    """The most keys one step of a layer reads: the context, or on a sliding layer the
    window of the first row plus the rows after it."""
    return min(max_context, window + max_rows) if window else max_context


def kernel_defines(group: int, keys: int, per: int = 1) -> dict[str, int]:
    """attention_core.cu's defines for a GQA group, the most keys a step reads and about
    ``per`` key tiles a split."""
    return {"HEAD_DIM": HEAD_DIM, "GROUP": group, "SPLITS": splits_for(keys, per), "TILES_A_SPLIT": per}


def _group_unsupported(heads: int, kv_heads: int, rows: int) -> str | None:
    if heads % kv_heads:
        return f"{heads} query heads over {kv_heads} KV heads: {CudaAttentionCore.name} takes whole GQA groups"
    group = heads // kv_heads
    if 16 % group:
        return f"GQA groups of {group}: {CudaAttentionCore.name} takes groups that divide 16 (a warp's rows)"
    if rows * group > MROWS:
        return (
            f"{rows} rows x {group} query heads a KV head: {CudaAttentionCore.name} takes at most {MROWS} "
            f"({heads} query heads over {kv_heads} KV heads)"
        )
    return None


class CudaAttentionCore(_Cuda):
    """Sub-op ``attention_core``: split-KV flash decoding on mma.sync for up to
    ``MROWS`` query rows a KV head (rows x GQA group), head_dim 64, any page size; about
    one key tile a split; the combine a block a row, each group of 4 dims over PARTS runs
    of splits that load their partials at once and meet by a butterfly. It reads the
    step's length from the device, so it serves vLLM's asynchronous scheduling, where
    FlashInfer's host-planned fa2 cannot. Correct against the reference core on an H100
    (and in its earlier forms on the H200), compute-sanitizer clean. In the 6-layer TP-8
    rank step on an H100 it is level with XQA and about 11% behind fa2 (bench/NOTES.md
    v30); the resolver times it beside them."""

    block = "attention_core"
    name = "cuda.attention_core"
    tiles_a_split = 1  # TILES_A_SPLIT

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        reason = super().unsupported(deployment)
        if reason is not None:
            return reason
        spec = deployment.spec
        if spec.head_dim != HEAD_DIM:
            return f"head_dim {spec.head_dim}: {cls.name} takes {HEAD_DIM}"
        return _group_unsupported(spec.num_attention_heads, spec.num_key_value_heads, deployment.max_rows)

    def __init__(self, ctx: BuildContext, layer: int):
        lw = ctx.layer(layer)
        self.index, self.window = layer, lw.window
        self.heads, self.kv_heads = lw.num_heads, lw.num_kv_heads
        why = _group_unsupported(self.heads, self.kv_heads, ctx.max_rows)
        if why:
            raise ValueError(f"layer {layer}: {why}")
        self.group, self.max_rows = self.heads // self.kv_heads, ctx.max_rows
        # A sliding layer's grid covers its window and the step's rows, not the whole
        # context (its steps never have more tiles than that).
        keys = keys_seen(ctx.max_context, lw.window, ctx.max_rows)
        defines = kernel_defines(self.group, keys, self.tiles_a_split)
        # the combine: a block a row, its 16 groups of 4 dims x PARTS runs of splits
        self.combine_shape = ((MROWS, self.kv_heads, 1), (HEAD_DIM // 4 * PARTS, 1, 1))
        self.splits = defines["SPLITS"]
        self.scale_log2 = ctx.spec.softmax_scale * math.log2(math.e)
        self.split = Kernel(SOURCE, "attention_split_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.combine = Kernel(SOURCE, "attention_combine_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.gated_combine = Kernel(SOURCE, "attention_gated_combine_kernel", ctx.device, defines, COMPILE_OPTIONS)
        # One workspace for the layers of a split count (the full layers', the sliding
        # ones'): a layer's kernels write it only after their PDL wait, when every kernel
        # before them (the previous layer's combine among them) is done.
        parts = self.kv_heads * self.splits * MROWS
        self.part_o = ctx.scratch(f"cuda_attention_core_o_{parts}", (parts * HEAD_DIM,), torch.float32)
        self.part_ml = ctx.scratch(f"cuda_attention_core_ml_{parts}", (parts * 2,), torch.float32)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CudaAttentionCore:
        assert layer is not None
        return cls(ctx, layer)

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        layer = kv[self.index]
        where = f"{self.name}, layer {self.index}"
        check_kv_form(where, layer, self.kv_heads, HEAD_DIM)
        if layer.window != self.window:
            raise ValueError(f"{where}: cache window {layer.window}, layer {self.window}")
        for label, t in (("K", layer.k), ("V", layer.v)):
            if t.stride(3) != 1 or any(s % 8 for s in t.stride()[:3]) or t.data_ptr() % 16:
                raise ValueError(f"{where}: {label} cache strides {t.stride()} are not 16-byte rows")
        if layer.k.stride() != layer.v.stride():
            raise ValueError(f"{where}: K and V caches have different strides")

    def run(self, step: Step, q: torch.Tensor, out: torch.Tensor) -> None:
        if out.dtype != torch.bfloat16 or out.dim() != 3 or out.shape != q.shape:
            raise ValueError(
                f"{self.name}: out takes q's shape {tuple(q.shape)} in bf16, not {tuple(out.shape)} {out.dtype}"
            )
        if out.stride(2) != 1 or out.stride(0) % 4 or out.stride(1) % 4 or out.data_ptr() % 8:
            raise ValueError(f"{self.name}: out takes rows of 8-byte groups, strides {out.stride()}")
        self._split(step, q)
        self.combine.launch(
            *self.combine_shape,
            [
                ptr(self.part_o),
                ptr(self.part_ml),
                ptr(step.kv[self.index].group.seq_lens),
                i32(q.shape[0]),
                i32(self.window or 0),
                ptr(out),
                i64(out.stride(0)),
                i64(out.stride(1)),
            ],
        )

    def run_gated(self, step: Step, q: torch.Tensor, gate: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        """The core with the attention block's o-norm and gate fused into its combine:
        out[i, h * 64 + d] = bf16(rms_per_head(o)[i, h, d] * sigmoid(gate[i, h * 64 + d])),
        o the core's bf16 output (``run``'s), eps the norm's. ``gate``: the [rows, heads * 64]
        gate columns (a view of the qkvg rows); ``out``: the o_proj's [rows, heads * 64] input."""
        b, width = q.shape[0], self.heads * HEAD_DIM
        for name, t in (("gate", gate), ("out", out)):
            if t.dtype != torch.bfloat16 or t.dim() != 2 or tuple(t.shape) != (b, width) or t.stride(1) != 1:
                raise ValueError(f"{self.name}: {name} takes [{b}, {width}] bf16 rows, not {tuple(t.shape)} {t.dtype}")
            if t.stride(0) % 4 or t.data_ptr() % 8:
                raise ValueError(f"{self.name}: {name} takes rows of 8-byte groups, strides {t.stride()}")
        self._split(step, q)
        self.gated_combine.launch(
            *self.combine_shape,
            [
                ptr(self.part_o),
                ptr(self.part_ml),
                ptr(step.kv[self.index].group.seq_lens),
                i32(b),
                i32(self.window or 0),
                ptr(gate),
                i64(gate.stride(0)),
                f32(eps),
                ptr(out),
                i64(out.stride(0)),
            ],
        )

    def _split(self, step: Step, q: torch.Tensor) -> None:
        """attention_split_kernel for q's rows into the workspace."""
        kv = step.kv[self.index]
        b = q.shape[0]
        if q.dtype != torch.bfloat16 or q.dim() != 3 or tuple(q.shape[1:]) != (self.heads, HEAD_DIM):
            raise ValueError(
                f"{self.name}: q takes [rows, {self.heads}, {HEAD_DIM}] bf16, not {tuple(q.shape)} {q.dtype}"
            )
        if b > self.max_rows:
            raise ValueError(f"{self.name}: {b} rows, built for at most {self.max_rows}")
        if q.stride(2) != 1 or q.stride(0) % 2 or q.stride(1) % 2 or q.data_ptr() % 4:
            raise ValueError(f"{self.name}: q takes rows of contiguous bf16 pairs, strides {q.stride()}")
        s0, s1, s2, _ = kv.k.stride()
        self.split.launch(
            (self.splits, self.kv_heads, 1),
            (128, 1, 1),
            [
                ptr(q),
                i64(q.stride(0)),
                i64(q.stride(1)),
                ptr(kv.k),
                ptr(kv.v),
                i64(s0),
                i64(s1),
                i64(s2),
                ptr(kv.group.block_table),
                ptr(kv.group.seq_lens),
                i32(kv.k.shape[1]),
                i32(b),
                i32(self.window or 0),
                f32(self.scale_log2),
                ptr(self.part_o),
                ptr(self.part_ml),
            ],
        )
