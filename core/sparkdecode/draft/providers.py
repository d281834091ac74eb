"""The reference provider of every draft block: the stock draft math of
``draft.model`` behind the draft contracts (``draft.protocols``), on any device.

They are the draft's fallback (priority 0) and the oracle a pack's draft providers
are tested against; the core registers them with the target's reference providers.
Their torch temporaries come from the caching allocator (the graph's pool under
capture); every result lands in an executor-owned buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..protocols import Deployment, LayerKV, check_kv_form
from . import model
from .protocols import DraftBuildContext, DraftStep


class _Reference:
    priority = 0

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        return None

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        pass


def _layer_slots(step: DraftStep, query: bool) -> list[torch.Tensor]:
    c, n = step.context_rows, step.num_query
    return [layer.group.slot_mapping[c : c + n] if query else layer.group.slot_mapping[:c] for layer in step.kv]


class ReferenceDraftContext(_Reference):
    """fc, hidden norm and every layer's context K/V (``model.context_kv``)."""

    block = "draft_context"
    name = "reference.draft_context"

    def __init__(self, ctx: DraftBuildContext):
        self.weights = ctx.weights
        self.rope_table = model.context_rope_table(ctx.weights, ctx.max_context)

    @classmethod
    def build(cls, ctx: DraftBuildContext, layer: int | None) -> ReferenceDraftContext:
        return cls(ctx)

    def run(self, step: DraftStep, aux: Sequence[torch.Tensor]) -> None:
        c = step.context_rows
        rows = [a[:c] for a in aux]
        model.context_kv(
            self.weights, rows, step.context_positions[:c], step.kv, _layer_slots(step, False), self.rope_table
        )


class ReferenceDraftBoundary(_Reference):
    """Layer 0: the embedded block into the stream; later layers: the previous FFN
    branch into the stream; then this layer's pre_qkv_proj_norm."""

    block = "draft_boundary"
    name = "reference.draft_boundary"

    def __init__(self, ctx: DraftBuildContext, layer: int):
        self.spec = ctx.spec
        self.layer = ctx.layer(layer)
        self.prev = ctx.layer(layer - 1) if layer > 0 else None
        self.embeddings = ctx.buffers["draft_embeddings"]

    @classmethod
    def build(cls, ctx: DraftBuildContext, layer: int | None) -> ReferenceDraftBoundary:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, step: DraftStep, stream: torch.Tensor, f: torch.Tensor, out: torch.Tensor) -> None:
        s = model.front(self.spec, self.embeddings[: step.num_query]) if self.prev is None else stream
        s, x = model.input_boundary(self.spec, s, f, self.prev, self.layer)
        stream.copy_(s)
        out.copy_(x)


class ReferenceDraftAttention(_Reference):
    block = "draft_attention"
    name = "reference.draft_attention"

    def __init__(self, ctx: DraftBuildContext, layer: int):
        self.spec, self.index, self.max_context = ctx.spec, layer, ctx.max_context
        self.layer = ctx.layer(layer)
        self.rope_table = model.query_rope_table(ctx.weights, layer, ctx.max_context)

    @classmethod
    def build(cls, ctx: DraftBuildContext, layer: int | None) -> ReferenceDraftAttention:
        assert layer is not None
        return cls(ctx, layer)

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        check_kv_form(f"draft layer {self.index}", kv[self.index], self.layer.num_kv_heads, self.spec.head_dim)
        if kv[self.index].window != self.layer.window:
            raise ValueError(
                f"draft layer {self.index}: bound to a cache group of window {kv[self.index].window}, "
                f"the layer's is {self.layer.window}"
            )

    def run(self, step: DraftStep, x: torch.Tensor, out: torch.Tensor) -> None:
        c, n = step.context_rows, step.num_query
        kv = step.kv[self.index]
        slots = kv.group.slot_mapping[c : c + n]
        out.copy_(
            model.attention(self.spec, self.layer, x, step.positions, kv, slots, self.rope_table, self.max_context)
        )


class ReferenceDraftAttentionBoundary(_Reference):
    block = "draft_attention_boundary"
    name = "reference.draft_attention_boundary"

    def __init__(self, ctx: DraftBuildContext, layer: int):
        self.spec, self.layer = ctx.spec, ctx.layer(layer)

    @classmethod
    def build(cls, ctx: DraftBuildContext, layer: int | None) -> ReferenceDraftAttentionBoundary:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, a: torch.Tensor, stream: torch.Tensor, out: torch.Tensor) -> None:
        s, xf = model.attention_boundary(self.spec, self.layer, stream, a)
        stream.copy_(s)
        out.copy_(xf)


class ReferenceDraftMLP(_Reference):
    block = "draft_mlp"
    name = "reference.draft_mlp"

    def __init__(self, ctx: DraftBuildContext, layer: int):
        self.spec, self.layer = ctx.spec, ctx.layer(layer)

    @classmethod
    def build(cls, ctx: DraftBuildContext, layer: int | None) -> ReferenceDraftMLP:
        assert layer is not None
        return cls(ctx, layer)

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(model.mlp(self.spec, self.layer, x))


class ReferenceDraftFinal(_Reference):
    block = "draft_final"
    name = "reference.draft_final"

    def __init__(self, ctx: DraftBuildContext):
        self.spec, self.weights = ctx.spec, ctx.weights

    @classmethod
    def build(cls, ctx: DraftBuildContext, layer: int | None) -> ReferenceDraftFinal:
        return cls(ctx)

    def run(self, step: DraftStep, stream: torch.Tensor, f: torch.Tensor, out: torch.Tensor) -> None:
        s, hidden = model.final(self.spec, self.weights, stream, f)
        stream.copy_(s)
        out.copy_(hidden)


class ReferenceMarkov(_Reference):
    """The LM head, then the 7 dependent steps in torch (each: the Markov bias GEMV,
    the transform, the noise, the argmax), all on the device."""

    block = "markov"
    name = "reference.markov"

    def __init__(self, ctx: DraftBuildContext):
        self.weights = ctx.weights
        vocab = ctx.spec.draft_vocab_size
        self.offsets = torch.arange(vocab, dtype=torch.int64, device=ctx.device)
        self.prev = ctx.scratch("markov_prev", (1,), torch.int64)

    @classmethod
    def build(cls, ctx: DraftBuildContext, layer: int | None) -> ReferenceMarkov:
        return cls(ctx)

    def run(
        self, step: DraftStep, hidden: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor
    ) -> None:
        base = model.base_logits(self.weights, hidden)
        self.prev.copy_(step.anchor.reshape(1))
        for i in range(step.num_query):
            token, l_i, q_i = model.markov_step(
                self.weights,
                base[i : i + 1],
                self.prev,
                i,
                step.positions[i : i + 1],
                step.seed,
                step.temperature,
                self.offsets,
            )
            tokens[i : i + 1].copy_(token)
            logits[i : i + 1].copy_(l_i)
            probs[i : i + 1].copy_(q_i)
            self.prev.copy_(token)


DRAFT_PROVIDERS = (
    ReferenceDraftContext,
    ReferenceDraftBoundary,
    ReferenceDraftAttention,
    ReferenceDraftAttentionBoundary,
    ReferenceDraftMLP,
    ReferenceDraftFinal,
    ReferenceMarkov,
)
