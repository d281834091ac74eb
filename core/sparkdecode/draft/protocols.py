"""The contracts between the draft executor and the providers of its blocks.

One draft step (one request; N = 7 query rows, C = 8 context rows):

    draft_context (every layer's context K/V) -> embeddings of [anchor, mask x 6]
    -> for each draft layer j: draft_boundary(j) -> draft_attention(j)
       -> draft_attention_boundary(j) -> draft_mlp(j)
    -> draft_final -> markov (LM head, 7 dependent sampling steps)

The kinds are ``protocols.DRAFT_KINDS``: registered through the same hook as the
target's blocks, resolved by the same resolver into the draft's own layout. The
lifecycle is the target's (``protocols``): ``unsupported(deployment)`` reads only
the deployment (a ``DraftDeployment``: the target's deployment and the draft spec;
a plain ``Deployment`` when the CLI lists providers), ``build(ctx, layer)`` once
after the weights load, ``prepare_kv`` for every bound draft cache, ``run``
graph-capturable (no allocation that escapes, no host sync, no per-step constant).

Shapes: H the draft's hidden size (the target's), V the vocabulary, r the Markov
rank, S the residual stream's dtype (``DraftSpec.residual_dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import torch

from ..protocols import Deployment, LayerKV, scratch_buffer

if TYPE_CHECKING:
    from .spec import DraftSpec
    from .weights import DraftLayerWeights, DraftWeights


class DraftStep(NamedTuple):
    """A planned draft step: host-decided shapes, device buffers whose contents
    change between replays."""

    context_rows: int  # C: the context rows of the layout (rows past the accepted ones store nothing)
    num_query: int  # N
    context_positions: torch.Tensor  # int64 [C]
    positions: torch.Tensor  # int64 [N]: the query positions P + 1 .. P + N
    # Per draft layer; group.slot_mapping int64 [>= C + N]: [context slots | query slots].
    kv: tuple[LayerKV, ...]
    anchor: torch.Tensor  # int64 [1]: the token at P + 1 (the target's last sample)
    seed: torch.Tensor  # int64 [1]: the request's sampling seed
    temperature: torch.Tensor  # fp32 [1]: the request's temperature (0: greedy)


@dataclass(frozen=True)
class DraftDeployment(Deployment):
    """The target's deployment and the draft it serves: what a draft provider's
    ``unsupported`` may read."""

    draft: DraftSpec | None = None


@dataclass
class DraftBuildContext:
    """What a draft provider's ``build`` receives, once, after the weights load."""

    spec: DraftSpec
    weights: DraftWeights
    device: torch.device
    deployment: DraftDeployment
    # Executor-owned buffers by name ("draft_embeddings" bf16 [N, H], ...); providers
    # add scratch through ``scratch`` so layers share it.
    buffers: dict[str, torch.Tensor]
    context_rows: int
    num_query: int
    max_context: int
    extra: dict[str, Any] = field(default_factory=dict)

    def layer(self, index: int) -> DraftLayerWeights:
        return self.weights.layers[index]

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An executor-owned buffer shared by every layer, allocated at the first ask."""
        return scratch_buffer(self.buffers, self.device, name, shape, dtype)


class DraftProvider(Protocol):
    """The surface every draft provider class shares (``protocols.Provider``'s)."""

    block: ClassVar[str]
    name: ClassVar[str]
    priority: ClassVar[int]

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None: ...

    @classmethod
    def build(cls, ctx: DraftBuildContext, layer: int | None) -> DraftProvider: ...

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None: ...


class DraftContextProvider(DraftProvider, Protocol):
    """``draft_context`` (``build(ctx, None)``): the context rows of every layer.
    ``aux``: the target's fp32 aux streams [>= C, H_target] (ascending aux layers; the
    first C rows are read); fc, hidden norm, each layer's pre_qkv_proj_norm and K/V
    rows, the K norm, the bf16 RoPE at ``step.context_positions``, the insert at each
    layer's context slots (slot 0, the null page: a row that stores nothing)."""

    def run(self, step: DraftStep, aux: Sequence[torch.Tensor]) -> None: ...


class DraftBoundaryProvider(DraftProvider, Protocol):
    """``draft_boundary`` of layer j. Layer 0: the embeddings buffer
    (``ctx.buffers["draft_embeddings"]``, bf16 [N, H]) into ``stream`` (S [N, H]);
    layer j > 0: layer j - 1's post_ffn_norm of ``f`` (bf16 [N, H]) added into
    ``stream`` in place. Then layer j's pre_qkv_proj_norm of bf16(stream) into
    ``out`` (bf16 [N, H])."""

    def run(self, step: DraftStep, stream: torch.Tensor, f: torch.Tensor, out: torch.Tensor) -> None: ...


class DraftAttentionProvider(DraftProvider, Protocol):
    """``draft_attention`` of layer j: QKV(+o-gate) GEMM, QK norm, temperature
    tuning, RoPE, K/V insert at the query slots, the causal paged attention, o-norm
    and gate, o_proj: bf16 ``x`` [N, H] -> ``out`` bf16 [N, H]."""

    def run(self, step: DraftStep, x: torch.Tensor, out: torch.Tensor) -> None: ...


class DraftAttentionBoundaryProvider(DraftProvider, Protocol):
    """``draft_attention_boundary`` of layer j: post_attn_norm of ``a`` (bf16),
    the residual add into ``stream`` in place, pre_ffn_norm of bf16(stream) into
    ``out`` (bf16 [N, H])."""

    def run(self, a: torch.Tensor, stream: torch.Tensor, out: torch.Tensor) -> None: ...


class DraftMLPProvider(DraftProvider, Protocol):
    """``draft_mlp`` of layer j: the dense SwiGLU MLP, bf16 [N, H] -> ``out`` bf16 [N, H]."""

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None: ...


class DraftFinalProvider(DraftProvider, Protocol):
    """``draft_final`` (``build(ctx, None)``): the last layer's FFN branch into
    ``stream``, the final norm of bf16(stream) into ``out`` (bf16 [N, H])."""

    def run(self, step: DraftStep, stream: torch.Tensor, f: torch.Tensor, out: torch.Tensor) -> None: ...


class MarkovProvider(DraftProvider, Protocol):
    """``markov`` (``build(ctx, None)``): the LM head of ``hidden`` (bf16 [N, H]) and
    the N dependent sampling steps from ``step.anchor``: step i adds the Markov bias
    of the previous token, applies the output transform, rounds to bf16 into
    ``logits[i]`` and draws ``tokens[i]`` by Gumbel-max with vLLM's noise of
    (``step.seed``, i, ``step.positions[i]``) at ``step.temperature``; ``probs[i]`` the
    token's probability. tokens int64 [N], logits bf16 [N, V], probs fp32 [N]."""

    def run(
        self, step: DraftStep, hidden: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor
    ) -> None: ...


def draft_of(deployment: Deployment) -> DraftSpec | None:
    """The draft spec of a deployment (None for a target-only deployment)."""
    return getattr(deployment, "draft", None)
