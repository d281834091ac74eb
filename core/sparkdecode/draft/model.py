"""The reference DSpark draft step: vLLM 0.33's stock draft in plain torch.

One draft step follows each verify step of the target. With P the last accepted
position and a the anchor (the token the target sampled at P + 1):

```
context (the rows the target just accepted, positions <= P; the whole prompt after a prefill):
  c   = bf16(concat_l bf16(aux_l) @ W_fc^T)                 aux: the target's fp32 streams, ascending layers
  h   = hidden_norm(c)                                      bf16
  per draft layer j:
    x_j    = pre_qkv_norm_j(h)                              bf16
    [k | v] = x_j @ W_kv,j^T                                bf16 (the K and V rows of the fused projection)
    k      = bf16 RoPE(bf16(rms_per_head(k)), positions)    vLLM's rotary op on bf16, with layer 0's table
    write k, v into layer j's paged cache at the context slots
query block (N = 7 rows, tokens [a, m, ..., m], m = mask_token_id, positions P+1 .. P+N):
  s  = residual_dtype(embed[tokens])                        the target's embedding rows, no norm
  per draft layer j:
    x  = pre_qkv_norm(bf16(s))                              bf16
    [q | k | v | g] = x @ W_qkv^T                           bf16 (g only with the o-gate)
    q, k = bf16(rms_per_head(q)), bf16(rms_per_head(k))
    q = bf16(q * tau(positions))                            global layers with temperature tuning only
    q, k = RoPE(q, k, positions)                            fused kernel: fp32 from bf16, one rounding, the
                                                            layer's fp32 table (layer 0's: bf16-rounded);
                                                            tuned layers: the bf16 rotary op
    write k, v at the query slots
    o  = causal paged attention (window on sliding layers, scale head_dim^-0.5 * s)
    o  = o_norm_gate(o, g)
    a  = bf16(o @ W_o^T)
    s  = res(alpha_a * s + beta_a * bf16(post_attn_norm(a)))   or s + bf16(...) without the gate
    xf = pre_ffn_norm(bf16(s))
    f  = bf16(bf16(silu(xf @ W_g^T)) * bf16(xf @ W_u^T)) @ W_d^T   bf16 GEMM outputs
    s  = res(alpha_f * s + beta_f * bf16(post_ffn_norm(f)))
hidden = final_norm(bf16(s))                                bf16 [N, H]
base   = bf16(hidden @ W_lm^T)                              bf16 [N, V]
Markov loop, i = 0 .. N-1, prev_0 = a:
  bias_i = bf16(markov_w1[prev_i] @ W_2^T)                  bf16 [V]
  l_i    = bf16(output_transform(bf16(base_i + bias_i)))    fp32 transform, rounded for the logits cache
  x_i    = argmax(fp32(l_i) / T + G(seed ^ (i << 32), P + 1 + i + 2^30, token))   T = 0: argmax(l_i)
  prev_{i+1} = x_i
hand the rejection sampler: x (int64 [N]) and l (bf16 [N, V], pre-temperature); q(x_i) = softmax(l_i / T)[x_i]
```

Where vLLM rounds (and this model with it): every bf16 GEMM's output; each norm's
output (the post-norms' too: unlike the target's fused boundary, the draft layer
adds a bf16-rounded branch); the stream to bf16 before each pre-norm and the final
norm; the residual sum to the residual dtype; q and k after the QK norm; the
context keys after each of the rotary op's bf16 products and sums; silu before its
product; base + bias; the transformed logits to bf16 (vLLM scatters them into its
bf16 draft-logits buffer before sampling). The attention is fp32 softmax over bf16
operands, its output rounded (as the target's reference).

Choices where vLLM's Python source does not settle the numerics (its compiled
kernels do): the fused QK-norm + RoPE kernel rotates in fp32 and rounds once (as
the target's reference assumes for the same kernel), and reads whatever table its
layer's rotary module holds; the context path's ``forward_cuda`` replaces layer 0's
table with a bf16 copy before any graph is captured, so layer 0's queries rotate
with bf16-rounded cos/sin (``DraftSpec.query_rope_table_bf16``). The rotary op on
bf16 (``rope_gptj_bf16``) rounds every product and sum, as its scalar_t arithmetic
does. ``silu_and_mul`` rounds silu before the product, as its kernel does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..protocols import LayerKV
from ..reference import functional as fn
from . import functional as dfn
from .spec import DraftSpec
from .weights import DraftLayerWeights, DraftWeights


class DraftOutput(NamedTuple):
    """What the draft step hands the rejection sampler."""

    tokens: torch.Tensor  # int64 [N]: the drafted target-vocabulary ids
    logits: torch.Tensor  # bf16 [N, V]: pre-temperature draft logits (vLLM's draft_logits rows)
    probs: torch.Tensor  # fp32 [N]: q(tokens[i]) = softmax(logits[i] / T)[tokens[i]] (1 at T = 0)


def block_tokens(spec: DraftSpec, anchor: torch.Tensor, num_query: int) -> torch.Tensor:
    """int64 [N]: the anchor then N - 1 mask tokens (sample_from_anchor)."""
    masks = torch.full((num_query - 1,), spec.mask_token_id, dtype=torch.int64, device=anchor.device)
    return torch.cat([anchor.reshape(1).to(torch.int64), masks])


def context_rope_table(weights: DraftWeights, max_context: int) -> torch.Tensor | None:
    """The table the context keys rotate with: layer 0's (every layer's theta is the
    config's), bf16-rounded by the rotary op; None without RoPE."""
    if not weights.spec.use_rope:
        return None
    return weights.rope_table(weights.spec.rope_theta, max_context)


def query_rope_table(weights: DraftWeights, layer: int, max_context: int) -> torch.Tensor | None:
    """The table layer ``layer``'s queries rotate with (``DraftSpec.query_rope_table_bf16``)."""
    spec = weights.spec
    if not spec.use_rope:
        return None
    return weights.rope_table(spec.rope_theta, max_context, bf16=spec.query_rope_table_bf16(layer))


def context_kv(
    weights: DraftWeights,
    aux: Sequence[torch.Tensor],
    positions: torch.Tensor,
    kv: Sequence[LayerKV],
    slots: Sequence[torch.Tensor],
    rope_table: torch.Tensor | None,
) -> None:
    """Store the K/V of n context rows in every draft layer's cache.

    ``aux``: the target's fp32 streams [n, H_t], ascending aux layers; ``positions``
    int64 [n]; ``slots[j]``: int64 [n] cache slots of layer j (its KV group's; the null
    page's slot 0 for a row that stores nothing)."""
    spec = weights.spec
    n, d = positions.shape[0], spec.head_dim
    c = fn.linear(torch.cat([a.to(fn.BF16) for a in aux], dim=-1), weights.fc)
    h = dfn.norm(weights.hidden_norm, c)
    for j, layer in enumerate(weights.layers):
        x = dfn.norm(layer.pre_qkv_norm, h)
        k, v = fn.linear(x, layer.kv_rows).split([spec.kv_size, spec.kv_size], dim=-1)
        k = fn.qk_norm(k, d, spec.rms_norm_eps)
        if rope_table is not None:
            k = dfn.rope_gptj_bf16(k, positions, rope_table)
        fn.kv_insert(kv[j].k, kv[j].v, slots[j], k, v.reshape(n, -1, d))


def front(spec: DraftSpec, embeddings: torch.Tensor) -> torch.Tensor:
    """The stream of the query block: the embedding rows in the residual dtype."""
    return embeddings.to(spec.residual_torch_dtype)


def input_boundary(
    spec: DraftSpec,
    stream: torch.Tensor,
    f: torch.Tensor | None,
    prev: DraftLayerWeights | None,
    layer: DraftLayerWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous layer's FFN branch into the stream (none before layer 0), then
    this layer's pre_qkv_proj_norm of the bf16 stream: (stream, bf16 attention input)."""
    if prev is not None:
        assert f is not None
        stream = dfn.residual_add(stream, dfn.norm(prev.post_ffn_norm, f), prev.ffn_residual)
    return stream, dfn.norm(layer.pre_qkv_norm, stream.to(fn.BF16))


def attention(
    spec: DraftSpec,
    layer: DraftLayerWeights,
    x: torch.Tensor,
    positions: torch.Tensor,
    kv: LayerKV,
    slots: torch.Tensor,
    rope_table: torch.Tensor | None,
    max_context: int,
) -> torch.Tensor:
    """The attention of the query block: bf16 x [N, H] -> bf16 o_proj output [N, H];
    writes the block's K/V at ``slots`` (int64 [N])."""
    n, d = x.shape[0], spec.head_dim
    q_size, kv_size = layer.num_heads * d, layer.num_kv_heads * d
    sizes = [q_size, kv_size, kv_size] + ([q_size] if spec.use_attn_o_gate else [])
    parts = fn.linear(x, layer.qkv).split(sizes, dim=-1)
    q, k, v = parts[0], parts[1], parts[2]
    gate = parts[3] if spec.use_attn_o_gate else None
    q = fn.qk_norm(q, d, spec.rms_norm_eps)
    k = fn.qk_norm(k, d, spec.rms_norm_eps)
    if spec.temperature_tuning(layer.index):
        assert spec.attn_temperature_tuning_floor_scale is not None
        assert spec.attn_temperature_tuning_q_scale_constant is not None
        tau = dfn.temperature_scale(
            positions, spec.attn_temperature_tuning_floor_scale, spec.attn_temperature_tuning_q_scale_constant
        )
        q = (q * tau[:, :, None]).to(fn.BF16)
    if rope_table is not None:
        if spec.fused_qk_rope(layer.index):
            q, k = fn.rope_gptj(q, positions, rope_table), fn.rope_gptj(k, positions, rope_table)
        else:
            q, k = dfn.rope_gptj_bf16(q, positions, rope_table), dfn.rope_gptj_bf16(k, positions, rope_table)
    fn.kv_insert(kv.k, kv.v, slots, k, v.reshape(n, -1, d))
    o = fn.paged_attention(
        q, positions, kv.k, kv.v, kv.group.block_table[0], layer.window, spec.softmax_scale, max_context
    )
    o = dfn.o_norm_gate(o, gate, spec.rms_norm_eps, spec.use_attn_o_norm)
    return fn.linear(o.reshape(n, -1), layer.o_proj)


def attention_boundary(
    spec: DraftSpec, layer: DraftLayerWeights, stream: torch.Tensor, a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """post_attn_norm (rounded), the residual add, pre_ffn_norm of the bf16 stream:
    (stream, bf16 MLP input)."""
    stream = dfn.residual_add(stream, dfn.norm(layer.post_attn_norm, a), layer.attn_residual)
    return stream, dfn.norm(layer.pre_ffn_norm, stream.to(fn.BF16))


def mlp(spec: DraftSpec, layer: DraftLayerWeights, xf: torch.Tensor) -> torch.Tensor:
    """The dense SwiGLU MLP: bf16 [N, H] -> bf16 [N, H]."""
    return fn.linear(dfn.silu_and_mul(fn.linear(xf, layer.gate_up), spec.intermediate_size), layer.down)


def final(
    spec: DraftSpec, weights: DraftWeights, stream: torch.Tensor, f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's FFN branch into the stream, the final norm of the bf16 stream:
    (stream, bf16 hidden [N, H])."""
    last = weights.layers[-1]
    stream = dfn.residual_add(stream, dfn.norm(last.post_ffn_norm, f), last.ffn_residual)
    return stream, dfn.norm(weights.final_norm, stream.to(fn.BF16))


def base_logits(weights: DraftWeights, hidden: torch.Tensor) -> torch.Tensor:
    """bf16 [N, V]: the LM head of the normed hidden states (no transform yet)."""
    return fn.linear(hidden, weights.lm_head)


def markov_step(
    weights: DraftWeights,
    base: torch.Tensor,
    prev: torch.Tensor,
    step: int,
    position: torch.Tensor,
    seed: torch.Tensor,
    temperature: torch.Tensor,
    offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One dependent sampling step: bf16 base logits [1, V] of slot ``step`` and the
    previous token int64 [1] -> (token int64 [1], bf16 logits [1, V], fp32 prob [1])."""
    spec = weights.spec
    bias = fn.linear(weights.markov_w1.index_select(0, prev), weights.markov_w2)
    logits = dfn.output_transform(base + bias, spec.output_multiplier, spec.output_soft_cap_temp).to(fn.BF16)
    noise = dfn.gumbel_noise(seed, step, position, offsets)
    token = dfn.gumbel_argmax(logits, noise, temperature)
    return token, logits, dfn.token_probability(logits, token, temperature)


def markov_loop(
    weights: DraftWeights,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    positions: torch.Tensor,
    seed: torch.Tensor,
    temperature: torch.Tensor,
) -> DraftOutput:
    """The LM head and the N dependent sampling steps, left to right from the anchor.
    ``positions`` int64 [N]: the query positions (step i samples the token after
    position i); ``seed`` int64 [1], ``temperature`` fp32 [1]: the request's."""
    base = base_logits(weights, hidden)
    offsets = torch.arange(base.shape[-1], dtype=torch.int64, device=base.device)
    prev = anchor.reshape(1).to(torch.int64)
    tokens, logits, probs = [], [], []
    for i in range(base.shape[0]):
        prev, l_i, q_i = markov_step(
            weights, base[i : i + 1], prev, i, positions[i : i + 1], seed, temperature, offsets
        )
        tokens.append(prev)
        logits.append(l_i)
        probs.append(q_i)
    return DraftOutput(torch.cat(tokens), torch.cat(logits), torch.cat(probs))


class ReferenceDraft:
    """The stock draft step over ``DraftWeights`` and the draft's paged KV cache."""

    def __init__(self, weights: DraftWeights, max_context: int):
        spec = weights.spec
        unmet = supported_draft(spec)
        if unmet:
            raise ValueError(f"the DSpark draft step does not support this draft: {unmet}")
        if weights.d2t.ne(0).any():
            # vLLM scatters the draft's logits to the target ids arange + d2t; this step
            # keeps the draft's ids (full-vocabulary drafts ship zeros).
            raise ValueError("the DSpark draft step takes the identity draft-to-target map (d2t all zeros)")
        self.weights, self.spec, self.max_context = weights, spec, max_context

    def context(
        self, aux: Sequence[torch.Tensor], positions: torch.Tensor, kv: Sequence[LayerKV], slots: Sequence[torch.Tensor]
    ) -> None:
        """Store the K/V of the context rows (see ``context_kv``)."""
        if positions.shape[0] == 0:
            return
        context_kv(self.weights, aux, positions, kv, slots, context_rope_table(self.weights, self.max_context))

    def query(
        self, anchor: torch.Tensor, positions: torch.Tensor, kv: Sequence[LayerKV], slots: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """The query block through every layer: bf16 normed hidden [N, H]."""
        spec, weights = self.spec, self.weights
        stream = front(spec, weights.embed.index_select(0, block_tokens(spec, anchor, positions.shape[0])))
        f: torch.Tensor | None = None
        prev: DraftLayerWeights | None = None
        for j, layer in enumerate(weights.layers):
            stream, x = input_boundary(spec, stream, f, prev, layer)
            table = query_rope_table(weights, j, self.max_context)
            a = attention(spec, layer, x, positions, kv[j], slots[j], table, self.max_context)
            stream, xf = attention_boundary(spec, layer, stream, a)
            f = mlp(spec, layer, xf)
            prev = layer
        assert f is not None
        return final(spec, weights, stream, f)[1]

    def step(
        self,
        aux: Sequence[torch.Tensor],
        context_positions: torch.Tensor,
        anchor: torch.Tensor,
        positions: torch.Tensor,
        kv: Sequence[LayerKV],
        context_slots: Sequence[torch.Tensor],
        query_slots: Sequence[torch.Tensor],
        seed: torch.Tensor,
        temperature: torch.Tensor,
    ) -> DraftOutput:
        """One draft step: the context rows' K/V, the query block, the Markov loop."""
        self.context(aux, context_positions, kv, context_slots)
        hidden = self.query(anchor, positions, kv, query_slots)
        return markov_loop(self.weights, hidden, anchor, positions, seed, temperature)


def supported_draft(spec: DraftSpec) -> str | None:
    """Why the draft step cannot run this draft, or None (the gate's draft sentences)."""
    from .gate import draft_unsupported

    return draft_unsupported(
        method="dspark",
        draft_sample_method="probabilistic",
        sample_from_anchor=spec.sample_from_anchor,
        draft_vocab_size=spec.draft_vocab_size,
        vocab_size=spec.vocab_size,
        dspark_draft_topk=spec.dspark_draft_topk,
    )
