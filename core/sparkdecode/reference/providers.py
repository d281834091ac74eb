"""The reference provider of every block and sub-op: the stock math of
``reference.model`` behind the provider contracts, on any device.

They are the fallback (priority 0: any pack that supports the deployment is
preferred where nothing is measured) and the oracle the packs are tested
against. Their torch temporaries come from the caching allocator (the graph's
pool under capture); every result lands in an executor-owned buffer.
"""

from __future__ import annotations

import torch

from ..plugins import hookimpl
from ..protocols import (
    LINEAR_WEIGHTS,
    BuildContext,
    Deployment,
    ExpertsInput,
    LayerKV,
    RoutedTopk,
    Step,
    check_kv_form,
    host_work,
)
from ..weights import NVFP4_FORMATS, LayerWeights
from . import functional as fn
from . import model


class _Reference:
    priority = 0

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        return None

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        pass


class ReferenceBoundary(_Reference):
    """Layer 0: the front; later layers: the input boundary (reference.model)."""

    block = "boundary"
    name = "reference.boundary"

    def __init__(self, ctx: BuildContext, layer: int):
        self.spec, self.index = ctx.spec, layer
        self.layer = ctx.layer(layer)
        self.prev = ctx.layer(layer - 1) if layer > 0 else None
        self.embeddings = ctx.buffers["embeddings"]
        self.mailbox = ctx.mailboxes[layer - 1] if layer > 0 else None

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> ReferenceBoundary:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, step: Step, stream: torch.Tensor, out: torch.Tensor, aux: torch.Tensor | None) -> None:
        b = step.rows
        if self.prev is None:
            s, x = model.front(self.spec, self.embeddings[:b], step.normed_embeddings, self.layer)
        else:
            assert self.mailbox is not None
            s, x = model.input_boundary(self.spec, stream, self.mailbox.gather(b), self.prev, self.layer)
        stream.copy_(s)
        out.copy_(x)
        if aux is not None:
            aux.copy_(s)


class ReferenceAttention(_Reference):
    block = "attention"
    name = "reference.attention"

    def __init__(self, ctx: BuildContext, layer: int):
        self.spec, self.index, self.max_context = ctx.spec, layer, ctx.max_context
        self.layer = ctx.layer(layer)
        theta = self.layer.rope_theta
        self.rope_table = ctx.weights.rope_table(theta, ctx.max_context) if theta > 0 else None
        self.core = ctx.ops["attention_core"].build(ctx, layer)
        host_work(self, self.core)
        shape = (ctx.max_rows, self.layer.num_heads, ctx.spec.head_dim)
        self.o = ctx.scratch(f"attention_o_{self.layer.num_heads}", shape, torch.bfloat16)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> ReferenceAttention:
        assert layer is not None
        return cls(ctx, layer)

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        check_kv_form(f"layer {self.index}", kv[self.index], self.layer.num_kv_heads, self.spec.head_dim)
        self.core.prepare_kv(kv)

    def run(self, step: Step, x: torch.Tensor, partial: torch.Tensor) -> None:
        q, gate = model.qkv_front(self.spec, self.layer, x, step.positions, step.kv[self.index], self.rope_table)
        o = self.o[: x.shape[0]]
        self.core.run(step, q, o)
        partial.copy_(model.attention_out(self.spec, self.layer, o, gate))


class ReferenceAttentionCore(_Reference):
    """Sub-op ``attention_core``: the paged attention in torch over a fixed-size
    gather of the cache (reference.functional.paged_attention)."""

    block = "attention_core"
    name = "reference.attention_core"

    def __init__(self, ctx: BuildContext, layer: int):
        self.spec, self.index, self.max_context = ctx.spec, layer, ctx.max_context
        self.layer = ctx.layer(layer)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> ReferenceAttentionCore:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, step: Step, q: torch.Tensor, out: torch.Tensor) -> None:
        kv = step.kv[self.index]
        out.copy_(model.attention_core(self.spec, self.layer, q, step.positions, kv, self.max_context))


class ReferenceAttentionBoundary(_Reference):
    block = "attention_boundary"
    name = "reference.attention_boundary"

    def __init__(self, ctx: BuildContext, layer: int):
        self.spec, self.layer = ctx.spec, ctx.layer(layer)
        self.all_reduce = ctx.ops["all_reduce"].build(ctx, None) if ctx.tp > 1 else None

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> ReferenceAttentionBoundary:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, partial: torch.Tensor, stream: torch.Tensor, out: torch.Tensor) -> None:
        if self.all_reduce is not None:
            self.all_reduce.run(partial)
        s, xf = model.attention_boundary(self.spec, self.layer, stream, partial)
        stream.copy_(s)
        out.copy_(xf)


class ReferenceMoE(_Reference):
    """Router, routing, pooler, the resolved ``experts`` sub-op, tail, unpooler."""

    block = "moe"
    name = "reference.moe"

    def __init__(self, ctx: BuildContext, layer: int):
        spec = self.spec = ctx.spec
        self.layer = ctx.layer(layer)
        self.collectives = ctx.collectives
        self.experts = ctx.ops[experts_kind(self.layer)].build(ctx, layer)
        self.all_reduce = ctx.ops["all_reduce"].build(ctx, None) if ctx.tp > 1 else None
        self.rows = ctx.scratch("moe_rows", (ctx.max_rows, spec.top_k, spec.P), torch.bfloat16)
        self.mailbox = ctx.mailboxes[layer]

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            self.all_reduce.run(x)
        return x

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> ReferenceMoE:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, step: Step, x: torch.Tensor) -> None:
        spec, layer, b = self.spec, self.layer, x.shape[0]
        ids, weights = fn.route(
            model.router_logits(layer, x), layer.expert_bias, spec.top_k, spec.routed_scaling_factor
        )
        h = model.pool(spec, layer, x, self.collectives)
        rows = self.rows[:b]
        self.experts.run(ExpertsInput(h), RoutedTopk(ids, weights), rows)
        m = model.moe_tail(spec, layer, rows, weights, self._all_reduce)
        self.mailbox.publish(b).copy_(fn.linear(m, layer.unpooler))


def experts_kind(layer: LayerWeights) -> str:
    """The sub-op that serves this layer's routed experts: ``experts`` for bf16,
    ``experts_nvfp4`` for NVFP4 (the released checkpoint's layers 1..60), in the
    checkpoint's layout or in vLLM's Marlin repack."""
    return "experts_nvfp4" if layer.experts.format in NVFP4_FORMATS else "experts"


class ReferenceExperts(_Reference):
    """Sub-op ``experts``: each route's SwiGLU expert in torch (two grouped GEMMs),
    bf16 weights."""

    block = "experts"
    name = "reference.experts"
    formats: tuple[str, ...] = ("bf16",)

    def __init__(self, ctx: BuildContext, layer: int):
        self.experts = ctx.layer(layer).experts
        if self.experts.format not in self.formats:
            raise ValueError(
                f"layer {layer}: {self.name} serves {' or '.join(self.formats)} experts, not {self.experts.format}"
            )

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> ReferenceExperts:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, inputs: ExpertsInput, topk: RoutedTopk, rows: torch.Tensor) -> None:
        e = self.experts
        w13, w2 = e.dequantized()
        rows.copy_(fn.expert_rows(inputs.x, topk.ids, w13, w2, e.first_expert))


class ReferenceExpertsNvfp4(ReferenceExperts):
    """Sub-op ``experts_nvfp4``: the NVFP4 experts dequantized to bf16 (nvfp4.py, as
    vLLM defines it; from Marlin's layout the weights Marlin computes with,
    nvfp4_marlin.py), then as ``reference.experts``."""

    block = "experts_nvfp4"
    name = "reference.experts_nvfp4"
    formats = NVFP4_FORMATS


class ReferenceAllReduce(_Reference):
    """Sub-op ``all_reduce``: the reference transport's fixed-order sum (comm.Collectives)
    over the TP group, in place; detached ranks leave it out."""

    block = "all_reduce"
    name = "reference.all_reduce"
    # torch.distributed collectives: capturable in a CUDA graph over NCCL only.
    host_collectives = True

    def __init__(self, ctx: BuildContext):
        self.collectives = ctx.collectives

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> ReferenceAllReduce:
        return cls(ctx)

    def run(self, x: torch.Tensor) -> None:
        x.copy_(self.collectives.all_reduce(x))


class ReferenceLinear(_Reference):
    """Sub-op ``linear``: cuBLAS through ``torch.mm`` on the layer's weights, as the
    blocks compute them (bf16 GEMMs with fp32 accumulation rounded to bf16; the
    router's fp32 GEMM on the fp32 copy of ``x`` in an executor-owned buffer)."""

    block = "linear"
    name = "reference.linear"

    def __init__(self, ctx: BuildContext, layer: int):
        lw = ctx.layer(layer)
        self.weights_t = {name: getattr(lw, name).t() for name in LINEAR_WEIGHTS}
        router = lw.router
        self.x_fp32 = ctx.scratch(f"linear_x_fp32_{router.shape[1]}", (ctx.max_rows, router.shape[1]), torch.float32)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> ReferenceLinear:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        w_t = self.weights_t[name]
        if w_t.dtype == torch.float32:
            xf = self.x_fp32[: x.shape[0]]
            xf.copy_(x)
            x = xf
        torch.mm(x, w_t, out=out)


class ReferenceFinal(_Reference):
    block = "final"
    name = "reference.final"

    def __init__(self, ctx: BuildContext):
        self.spec, self.prev = ctx.spec, ctx.layer(ctx.spec.num_layers - 1)
        self.norm = ctx.weights.final_norm
        self.mailbox = ctx.mailboxes[-1]

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> ReferenceFinal:
        return cls(ctx)

    def run(self, step: Step, stream: torch.Tensor, out: torch.Tensor, aux: torch.Tensor | None) -> None:
        s, hidden = model.final_boundary(self.spec, stream, self.mailbox.gather(step.rows), self.prev, self.norm)
        stream.copy_(s)
        out.copy_(hidden)
        if aux is not None:
            aux.copy_(s)


PROVIDERS = (
    ReferenceBoundary,
    ReferenceAttention,
    ReferenceAttentionBoundary,
    ReferenceMoE,
    ReferenceExperts,
    ReferenceExpertsNvfp4,
    ReferenceAttentionCore,
    ReferenceAllReduce,
    ReferenceLinear,
    ReferenceFinal,
)


@hookimpl
def sparkdecode_providers() -> tuple[type, ...]:
    return PROVIDERS
