"""The attention block around the resolved attention core (kernels/attention.cu):

    QKV+gate GEMM (the ``linear`` sub-op) -> qkv_front_kernel (QK norm, RoPE on sliding layers,
    K/V into the paged cache, q into its buffer) -> attention core (the ``attention_core``
    sub-op: the reference's, FlashInfer's or this pack's) -> o_norm_gate_kernel -> o_proj (the
    ``linear`` sub-op)

With this pack's core (cuda.attention_core, its ``run_gated``) the o-norm and gate run in
the core's combine kernel instead of o_norm_gate_kernel (the same operations; the 64
squares of a head summed in another order).

Against the reference: the same fp32 operations per element; the per-head norms
sum their 64 squares in another order, so a bf16 q, k or gated output may differ
by one ulp.
"""

from __future__ import annotations

import torch

from sparkdecode.protocols import BuildContext, Deployment, LayerKV, Step, check_kv_form, host_work

from .boundary import _Cuda
from .launch import Kernel, f32, i32, i64, ptr

SOURCE = "attention.cu"
COMPILE_OPTIONS = ("--fmad=false",)
HEAD_DIM = 64  # one warp per head, one lane per RoPE pair


class CudaAttention(_Cuda):
    block = "attention"
    name = "cuda.attention"

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        reason = super().unsupported(deployment)
        if reason is None and deployment.spec.head_dim != HEAD_DIM:
            reason = f"head_dim {deployment.spec.head_dim} (the front kernels take {HEAD_DIM})"
        return reason

    def __init__(self, ctx: BuildContext, layer: int):
        spec = self.spec = ctx.spec
        self.index, self.layer = layer, ctx.layer(layer)
        lw = self.layer
        self.heads, self.kv_heads = lw.num_heads, lw.num_kv_heads
        self.gate_offset = (lw.num_heads + 2 * lw.num_kv_heads) * spec.head_dim
        self.rope = ctx.weights.rope_table(lw.rope_theta, ctx.max_context) if lw.rope_theta > 0 else None
        self.core = ctx.ops["attention_core"].build(ctx, layer)
        host_work(self, self.core)
        self.linear = ctx.ops["linear"].build(ctx, layer)
        rows = ctx.max_rows
        self.qkvg = ctx.scratch(f"cuda_qkvg_{lw.qkvg.shape[0]}", (rows, lw.qkvg.shape[0]), torch.bfloat16)
        shape = (rows, lw.num_heads, spec.head_dim)
        self.q = ctx.scratch(f"cuda_q_{lw.num_heads}", shape, torch.bfloat16)
        self.o = ctx.scratch(f"attention_o_{lw.num_heads}", shape, torch.bfloat16)
        self.gated = ctx.scratch(f"cuda_gated_{lw.num_heads}", (rows, lw.num_heads * spec.head_dim), torch.bfloat16)
        self.front = Kernel(SOURCE, "qkv_front_kernel", ctx.device, {"HEAD_DIM": HEAD_DIM}, COMPILE_OPTIONS)
        self.gate = Kernel(SOURCE, "o_norm_gate_kernel", ctx.device, {"HEAD_DIM": HEAD_DIM}, COMPILE_OPTIONS)
        # A core that takes the o-norm and gate into its own last kernel (run_gated: this
        # pack's) runs them there, one launch fewer; any other core, then the gate kernel.
        self.gated_core = getattr(self.core, "run_gated", None)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CudaAttention:
        assert layer is not None
        return cls(ctx, layer)

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        layer = kv[self.index]
        check_kv_form(f"layer {self.index}", layer, self.kv_heads, HEAD_DIM)
        for name, t in (("K", layer.k), ("V", layer.v)):
            if t.stride(3) != 1:
                raise ValueError(f"layer {self.index}: {name} cache rows are not contiguous (strides {t.stride()})")
        if layer.k.stride() != layer.v.stride():
            raise ValueError(f"layer {self.index}: K and V caches have different strides")
        self.core.prepare_kv(kv)

    def publish_partial(self, mailbox: object) -> bool:
        """The o_proj's output is this block's partial as it stands (nothing after it),
        so its GEMM may publish it into the attention boundary's Lamport mailbox from
        its epilogue, where the ``linear`` provider can (``publish``); whether it will."""
        publish = getattr(self.linear, "publish", None)
        return bool(publish is not None and publish("o_proj", mailbox))

    def run(self, step: Step, x: torch.Tensor, partial: torch.Tensor) -> None:
        b, kv = x.shape[0], step.kv[self.index]
        qkvg, q, o, gated = self.qkvg[:b], self.q[:b], self.o[:b], self.gated[:b]
        self.linear.run("qkvg", x, qkvg)
        s0, s1, s2, _ = kv.k.stride()
        self.front.launch(
            (b, self.heads + 2 * self.kv_heads, 1),
            (32, 1, 1),
            [
                ptr(qkvg),
                i32(qkvg.stride(0)),
                ptr(step.positions),
                ptr(kv.group.slot_mapping),
                ptr(self.rope),
                ptr(q),
                ptr(kv.k),
                ptr(kv.v),
                i64(s0),
                i64(s1),
                i64(s2),
                i32(self.heads),
                i32(self.kv_heads),
                i32(kv.k.shape[1]),
                f32(self.spec.rms_norm_eps),
            ],
        )
        if self.gated_core is not None:
            self.gated_core(step, q, qkvg[:, self.gate_offset :], self.spec.rms_norm_eps, gated)
            self.linear.run("o_proj", gated, partial)
            return
        self.core.run(step, q, o)
        self.gate.launch(
            (b, self.heads, 1),
            (32, 1, 1),
            [
                ptr(o),
                ptr(qkvg),
                i32(qkvg.stride(0)),
                i32(self.gate_offset),
                ptr(gated),
                i32(self.heads),
                f32(self.spec.rms_norm_eps),
            ],
        )
        self.linear.run("o_proj", gated, partial)
