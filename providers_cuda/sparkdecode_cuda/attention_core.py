"""``cuda.attention_core``: the verify step's attention core on this pack's split-KV
kernels (kernels/attention_core.cu): attention_split_kernel over SPLITS blocks a KV head,
then attention_combine_kernel; nothing on the host per step, so it replays in a FULL
graph.

Against the reference (``reference.functional.paged_attention``): the same bf16 q, K and
V, scores and the softmax in fp32 (exp2 of the scores in log2 units), the probabilities
kept to about 2^-17 (two bf16 terms) through the PV product, the output rounded to bf16
once; the partial sums of the splits are added in split order (the same bits every run).
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
COMBINE_ROWS = 8
MAX_SPLITS = 128


def splits_for(max_context: int) -> int:
    """Blocks a KV head: about two tiles each at the longest context, 16 to MAX_SPLITS."""
    tiles = max_context // TILE + 1
    return max(16, min(MAX_SPLITS, -(-tiles // 2)))


def kernel_defines(group: int, max_context: int) -> dict[str, int]:
    return {"HEAD_DIM": HEAD_DIM, "GROUP": group, "SPLITS": splits_for(max_context)}


class CudaAttentionCore(_Cuda):
    """Sub-op ``attention_core``: split-KV flash decoding on mma.sync for up to
    ``MROWS`` query rows a KV head (rows x GQA group), head_dim 64, any page size."""

    block = "attention_core"
    name = "cuda.attention_core"

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        reason = super().unsupported(deployment)
        if reason is not None:
            return reason
        spec = deployment.spec
        if spec.head_dim != HEAD_DIM:
            return f"head_dim {spec.head_dim}: {cls.name} takes {HEAD_DIM}"
        group = spec.num_attention_heads // spec.num_key_value_heads
        if deployment.max_rows * group > MROWS:
            return f"{deployment.max_rows} rows x {group} query heads a KV head: {cls.name} takes at most {MROWS}"
        return None

    def __init__(self, ctx: BuildContext, layer: int):
        lw = ctx.layer(layer)
        self.index, self.window = layer, lw.window
        self.heads, self.kv_heads = lw.num_heads, lw.num_kv_heads
        if self.heads % self.kv_heads or ctx.max_rows * (self.heads // self.kv_heads) > MROWS:
            raise ValueError(
                f"layer {layer}: {self.name} takes at most {MROWS} query rows a KV head "
                f"({ctx.max_rows} rows, {self.heads} query heads over {self.kv_heads} KV heads)"
            )
        self.group = self.heads // self.kv_heads
        defines = kernel_defines(self.group, ctx.max_context)
        self.splits = defines["SPLITS"]
        self.scale_log2 = ctx.spec.softmax_scale * math.log2(math.e)
        self.split = Kernel(SOURCE, "attention_split_kernel", ctx.device, defines, COMPILE_OPTIONS)
        self.combine = Kernel(SOURCE, "attention_combine_kernel", ctx.device, defines, COMPILE_OPTIONS)
        # One workspace for every layer: a layer's kernels write it only after their PDL
        # wait, when every kernel before them (the previous layer's combine among them) is done.
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
        kv = step.kv[self.index]
        b = q.shape[0]
        if q.stride(2) != 1 or q.stride(0) % 2 or q.stride(1) % 2 or q.data_ptr() % 4:
            raise ValueError(f"{self.name}: q takes rows of contiguous bf16 pairs, strides {q.stride()}")
        if out.stride(2) != 1 or out.stride(0) % 4 or out.stride(1) % 4 or out.data_ptr() % 8:
            raise ValueError(f"{self.name}: out takes rows of 8-byte groups, strides {out.stride()}")
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
        self.combine.launch(
            (MROWS // COMBINE_ROWS, self.kv_heads, 1),
            (COMBINE_ROWS * HEAD_DIM // 4, 1, 1),
            [ptr(self.part_o), ptr(self.part_ml), i32(b), ptr(out), i64(out.stride(0)), i64(out.stride(1))],
        )
