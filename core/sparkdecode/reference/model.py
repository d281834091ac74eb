"""The reference backbone: Muse Spark's text model in plain torch.

It reads like MUSE_SPARK.md: one function per block of the step, each built from
the formulas of ``functional``. ``ReferenceModel.forward`` is the stock forward
(the oracle of every test and the fallback); the reference providers
(``reference.providers``) call the same block functions, so the executor with
reference providers equals it bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..comm import Collectives
from ..protocols import LayerKV
from ..spec import ModelSpec
from ..weights import LayerWeights, ModelWeights
from . import functional as fn
from .kvcache import PagedKVCache


def front(
    spec: ModelSpec, embeddings: torch.Tensor, normed: bool, layer: LayerWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's input: the fp32 stream of the embedded rows (their RMS norm, or fp32
    of the bf16 normed rows of the multimodal path) and bf16 pre_qkv_proj_norm."""
    stream = embeddings.float() if normed else fn.embed_norm(embeddings, spec.rms_norm_eps)
    return stream, fn.pre_norm(stream, layer.pre_qkv_norm, spec.rms_norm_eps).to(fn.BF16)


def ffn_blend(spec: ModelSpec, stream: torch.Tensor, f: torch.Tensor, prev: LayerWeights) -> torch.Tensor:
    """The deferred end of layer ``prev``: s = alpha_f * s + beta_f * post_ffn_norm(f)."""
    branch = fn.input_scale_norm(f, prev.post_ffn_norm, spec.post_norm_eps)
    return fn.gated_add(stream, branch, prev.ffn_alpha, prev.ffn_beta)


def input_boundary(
    spec: ModelSpec, stream: torch.Tensor, f: torch.Tensor, prev: LayerWeights, layer: LayerWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """Post_ffn_norm of the previous MoE output, gated add, this layer's
    pre_qkv_proj_norm: (new fp32 stream, bf16 attention input)."""
    stream = ffn_blend(spec, stream, f, prev)
    return stream, fn.pre_norm(stream, layer.pre_qkv_norm, spec.rms_norm_eps).to(fn.BF16)


def final_boundary(
    spec: ModelSpec, stream: torch.Tensor, f: torch.Tensor, prev: LayerWeights, norm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last boundary with model.norm: (final fp32 stream, bf16 normed hidden)."""
    stream = ffn_blend(spec, stream, f, prev)
    return stream, fn.final_norm(stream, norm, spec.rms_norm_eps).to(fn.BF16)


def qkv_front(
    spec: ModelSpec,
    layer: LayerWeights,
    x: torch.Tensor,
    positions: torch.Tensor,
    kv: LayerKV,
    rope_table: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QKV+gate GEMM, QK norm (rounded), RoPE on sliding layers, K/V insert.
    Returns (bf16 q [b, heads, d], bf16 o-gate [b, heads * d])."""
    b, d = x.shape[0], spec.head_dim
    q_size, kv_size = layer.num_heads * d, layer.num_kv_heads * d
    qkvg = fn.linear(x, layer.qkvg)
    q, k, v, gate = qkvg.split([q_size, kv_size, kv_size, q_size], dim=-1)
    q = fn.qk_norm(q, d, spec.rms_norm_eps)
    k = fn.qk_norm(k, d, spec.rms_norm_eps)
    if rope_table is not None:
        q = fn.rope_gptj(q, positions, rope_table)
        k = fn.rope_gptj(k, positions, rope_table)
    fn.kv_insert(kv.k, kv.v, kv.group.slot_mapping[:b], k, v.reshape(b, -1, d))
    return q, gate


def attention_core(
    spec: ModelSpec, layer: LayerWeights, q: torch.Tensor, positions: torch.Tensor, kv: LayerKV, max_context: int
) -> torch.Tensor:
    """The paged attention of the step's rows: bf16 q [b, heads, d] -> bf16 [b, heads, d]."""
    return fn.paged_attention(
        q, positions, kv.k, kv.v, kv.group.block_table[0], layer.window, spec.softmax_scale, max_context
    )


def attention_out(spec: ModelSpec, layer: LayerWeights, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The o-norm with the sigmoid gate, then o_proj: this rank's bf16 partial [b, H]."""
    o = fn.o_norm_gate(o, gate, spec.rms_norm_eps)
    return fn.linear(o.reshape(o.shape[0], -1), layer.o_proj)


def attention(
    spec: ModelSpec,
    layer: LayerWeights,
    x: torch.Tensor,
    positions: torch.Tensor,
    kv: LayerKV,
    rope_table: torch.Tensor | None,
    max_context: int,
) -> torch.Tensor:
    """The attention block: bf16 x [b, H] -> this rank's bf16 o_proj partial [b, H]."""
    q, gate = qkv_front(spec, layer, x, positions, kv, rope_table)
    return attention_out(spec, layer, attention_core(spec, layer, q, positions, kv, max_context), gate)


def attention_boundary(
    spec: ModelSpec, layer: LayerWeights, stream: torch.Tensor, a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """post_attn_norm (weightless), gated add, pre_ffn_norm: (new stream, bf16 MoE input)."""
    stream = fn.gated_add(stream, fn.weightless_norm(a, spec.post_norm_eps), layer.attn_alpha, layer.attn_beta)
    return stream, fn.pre_norm(stream, layer.pre_ffn_norm, spec.rms_norm_eps).to(fn.BF16)


def router_logits(layer: LayerWeights, xf: torch.Tensor) -> torch.Tensor:
    """fp32 [b, E] = fp32(xf) @ (W_router * output_multiplier)^T."""
    return fn.linear(xf.float(), layer.router)


def pool(spec: ModelSpec, layer: LayerWeights, xf: torch.Tensor, collectives: Collectives) -> torch.Tensor:
    """bf16 [b, P] = pre_expert_norm(bf16(xf @ W_pooler^T)), rounded. A column-sharded
    pooler computes this rank's P / tp columns and gathers the rest."""
    pooled = fn.linear(xf, layer.pooler)
    if layer.pooler.shape[0] != spec.P:
        pooled = collectives.gather_columns(pooled, spec.P)
    return fn.pre_norm(pooled, layer.pre_expert_norm, spec.rms_norm_eps).to(fn.BF16)


def moe_tail(
    spec: ModelSpec,
    layer: LayerWeights,
    rows: torch.Tensor,
    weights: torch.Tensor,
    all_reduce: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """bf16 m [b, P] from this rank's route rows. Expert TP (the TP tail): the rows
    are partial sums over this rank's I-slice, all-reduced (bf16) before the
    per-route post_expert_norm. EP over several ranks (the EP tail): the norm and the
    weighted sum of this rank's experts' routes (zero rows for the others), then the
    [b, P] partials all-reduced."""
    if layer.experts.intermediate_slice is not None:
        rows = all_reduce(rows)
    m = fn.moe_tail(rows, weights, layer.post_expert_norm, spec.post_norm_eps)
    if layer.experts.num_local != spec.E:
        m = all_reduce(m)
    return m


def moe(spec: ModelSpec, layer: LayerWeights, xf: torch.Tensor, collectives: Collectives) -> torch.Tensor:
    """The MoE block: bf16 xf [b, H] -> bf16 f, [b, H] (or this rank's [b, H / tp]
    columns when the unpooler is column-sharded)."""
    ids, weights = fn.route(router_logits(layer, xf), layer.expert_bias, spec.top_k, spec.routed_scaling_factor)
    h = pool(spec, layer, xf, collectives)
    w13, w2 = layer.experts.dequantized()
    rows = fn.expert_rows(h, ids, w13, w2, layer.experts.first_expert)
    m = moe_tail(spec, layer, rows, weights, collectives.all_reduce)
    return fn.linear(m, layer.unpooler)


class ReferenceModel:
    """The stock forward over one rank's ``ModelWeights`` with a paged KV cache; over
    ``group`` (the TP group's process group) at TP > 1."""

    def __init__(self, weights: ModelWeights, max_context: int, group: Any = None):
        self.weights, self.spec, self.max_context = weights, weights.spec, max_context
        self.collectives = Collectives(weights.tp, weights.rank, group)

    def rope_table(self, layer: LayerWeights) -> torch.Tensor | None:
        if layer.rope_theta <= 0:
            return None
        return self.weights.rope_table(layer.rope_theta, self.max_context)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """bf16 rows of the embedding table."""
        return self.weights.embed.index_select(0, input_ids)

    def forward(
        self,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[LayerKV, ...],
        aux_layers: tuple[int, ...] = (),
        normed: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """bf16 normed hidden states [b, H] and the fp32 aux streams (the stream
        entering each layer in ``aux_layers``, ascending; ``num_layers`` is the final
        stream) of b rows whose K/V go to the cache slots of ``kv``."""
        spec, layers = self.spec, self.weights.layers
        aux: list[torch.Tensor] = []
        stream, x = front(spec, embeddings, normed, layers[0])
        f = None
        for i, layer in enumerate(layers):
            if i > 0:
                assert f is not None
                stream, x = input_boundary(spec, stream, f, layers[i - 1], layer)
            if i in aux_layers:
                aux.append(stream)
            partial = attention(spec, layer, x, positions, kv[i], self.rope_table(layer), self.max_context)
            stream, xf = attention_boundary(spec, layer, stream, self.collectives.all_reduce(partial))
            f = moe(spec, layer, xf, self.collectives)
            if f.shape[-1] != spec.H:  # a column-sharded unpooler: gather every rank's block
                f = self.collectives.gather_columns(f, spec.H)
        assert f is not None
        stream, hidden = final_boundary(spec, stream, f, layers[-1], self.weights.final_norm)
        if spec.num_layers in aux_layers:
            aux.append(stream)
        return hidden, aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 [b, V]: softcap(output_multiplier * (hidden @ W_lm^T)), the LM head in bf16."""
        return fn.softcap_logits(
            fn.linear(hidden, self.weights.lm_head), self.spec.output_multiplier, self.spec.final_logit_softcapping
        )

    def step(
        self, cache: PagedKVCache, tokens: torch.Tensor, first_position: int, aux_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run ``tokens`` (int64 [n]) at positions first_position.. through the stock
        forward on ``cache`` (prefill of a prompt, or a verify step): (hidden, aux)."""
        n = tokens.shape[0]
        cache.begin_step(first_position, n)
        positions = torch.arange(first_position, first_position + n, device=tokens.device)
        return self.forward(self.embed(tokens), positions, cache.kv(), aux_layers)
