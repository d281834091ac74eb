"""Plain weights of the DSpark draft: what every draft provider builds from.

``DraftWeights`` holds the draft's tensors in the layout vLLM keeps after loading
(the fused [q | k | v | o-gate] rows as the checkpoint stores them: the draft's Q/K
rows are already in the interleaved GPT-J order its RoPE reads, and vLLM does not
re-order them; the gate-up rows [gate | up]; the norms with their gain centres
resolved; the residual gates' alpha/beta precomputed in fp32), and the tensors it
shares with the target: the embedding table (vLLM drops the draft's own and aliases
the target's) and, where they are equal, the LM head (vLLM keeps the draft's own
``lm_head`` only when it differs from the target's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..reference import functional as fn
from ..spec import ModelSpec
from ..weights import ModelWeights
from .functional import Norm, Residual
from .spec import DRAFT_GATE_TEMPERATURE, DraftSpec


@dataclass
class DraftLayerWeights:
    """One dense draft layer (TP 1: every tensor whole)."""

    index: int  # the draft layer (0-based); vLLM's layer index is spec.layer_index(index)
    window: int | None  # keys a query sees (counting itself), None on full layers
    rope_theta: float  # 0 without RoPE
    pre_qkv_norm: Norm
    qkv: torch.Tensor  # bf16 [q + 2 kv (+ q o-gate rows), H]
    o_proj: torch.Tensor  # bf16 [H, q]
    post_attn_norm: Norm
    attn_residual: Residual
    pre_ffn_norm: Norm
    gate_up: torch.Tensor  # bf16 [2 I, H], gate rows first
    down: torch.Tensor  # bf16 [H, I]
    post_ffn_norm: Norm
    ffn_residual: Residual
    num_heads: int
    num_kv_heads: int

    @property
    def kv_rows(self) -> torch.Tensor:
        """The K and V rows of the fused projection (what the context path projects)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.qkv[q : q + 2 * kv]

    @property
    def head_dim(self) -> int:
        return self.o_proj.shape[1] // self.num_heads


@dataclass
class DraftWeights:
    """The draft's weights and the target tensors it reads."""

    spec: DraftSpec
    fc: torch.Tensor  # bf16 [H, n_aux * H_target]
    hidden_norm: Norm
    layers: list[DraftLayerWeights]
    final_norm: Norm
    markov_w1: torch.Tensor  # bf16 [vocab_size, r]: the previous token's Markov embedding
    markov_w2: torch.Tensor  # bf16 [draft_vocab_size, r]: the embedding's vocabulary bias
    lm_head: torch.Tensor  # bf16 [draft_vocab_size, H]: the target's where equal
    embed: torch.Tensor  # bf16 [vocab_size, H]: the target's embedding table
    d2t: torch.Tensor  # int64 [draft_vocab_size]: draft -> target id offsets (zeros: full vocabulary)
    # Not run (adaptive verification is refused); kept so a checkpoint saves again.
    confidence_weight: torch.Tensor | None = None  # fp32 [1, H (+ r)]
    confidence_bias: torch.Tensor | None = None  # fp32 [1]
    lm_head_is_target: bool = False  # the LM head is the target's tensor (vLLM shares equal heads)
    target_spec: ModelSpec | None = None  # the target's spec (the deployment the draft serves)
    rope_tables: dict[tuple[float, bool], torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.fc.device

    def rope_table(self, theta: float, max_positions: int, bf16: bool = False) -> torch.Tensor:
        """The [cos | sin] table of ``theta`` (fp32, or its bf16 rounding held in fp32
        when ``bf16``), built once and shared by every layer."""
        if self.rope_tables is None:
            self.rope_tables = {}
        key = (theta, bf16)
        table = self.rope_tables.get(key)
        if table is None or table.shape[0] < max_positions:
            table = fn.rope_table(theta, self.spec.head_dim, max_positions, self.device)
            if bf16:
                table = table.to(fn.BF16).float()
            self.rope_tables[key] = table
        return table


def norm_of(weight: torch.Tensor | None, center: float | None, eps: float, input_scale: bool = False) -> Norm:
    return Norm(weight, center, eps, input_scale)


def residual_of(gate: torch.Tensor | None) -> Residual:
    """vLLM's gated residual (alpha/beta of gate / 0.3, materialized in fp32), or a plain sum."""
    if gate is None:
        return Residual(None, None, None)
    alpha, beta = fn.gate_coefficients(gate, DRAFT_GATE_TEMPERATURE)
    return Residual(gate, alpha, beta)


def make_draft_layer(spec: DraftSpec, index: int, tensors: dict[str, Any]) -> DraftLayerWeights:
    """A layer from checkpoint-form tensors (keys as ``draft_layer_tensor_table``'s):
    fuses the projections as vLLM stacks them, resolves the norms' gain centres and
    precomputes the residual coefficients."""
    qkv = [tensors["q_proj"], tensors["k_proj"], tensors["v_proj"]]
    if spec.use_attn_o_gate:
        qkv.append(tensors["o_gate_proj"])
    eps, post_eps = spec.rms_norm_eps, spec.post_norm_eps
    return DraftLayerWeights(
        index=index,
        window=spec.window(index),
        rope_theta=spec.rope_theta if spec.use_rope else 0.0,
        pre_qkv_norm=norm_of(tensors.get("pre_qkv_norm"), spec.pre_norm_center(), eps),
        qkv=torch.cat(qkv, dim=0).contiguous(),
        o_proj=tensors["o_proj"],
        post_attn_norm=norm_of(tensors.get("post_attn_norm"), spec.post_norm_center(index, "attn"), post_eps),
        attn_residual=residual_of(tensors.get("attn_gate")),
        pre_ffn_norm=norm_of(tensors.get("pre_ffn_norm"), spec.pre_norm_center(), eps),
        gate_up=torch.cat([tensors["gate_proj"], tensors["up_proj"]], dim=0).contiguous(),
        down=tensors["down_proj"],
        post_ffn_norm=norm_of(
            tensors.get("post_ffn_norm"),
            spec.post_norm_center(index, "ffn"),
            post_eps,
            input_scale=spec.use_ffn_learnable_scales,
        ),
        ffn_residual=residual_of(tensors.get("ffn_gate")),
        num_heads=spec.num_attention_heads,
        num_kv_heads=spec.num_key_value_heads,
    )


def make_draft_weights(
    spec: DraftSpec,
    target: ModelWeights,
    *,
    fc: torch.Tensor,
    hidden_norm: torch.Tensor | None,
    layers: list[DraftLayerWeights],
    final_norm: torch.Tensor | None,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    lm_head: torch.Tensor,
    d2t: torch.Tensor,
    confidence_weight: torch.Tensor | None = None,
    confidence_bias: torch.Tensor | None = None,
) -> DraftWeights:
    """The draft's weights over ``target``: its embedding table, and its LM head in
    place of the draft's own where the two are equal (vLLM's ``load_dspark_model``)."""
    if target.spec.hidden_size != spec.hidden_size or target.spec.vocab_size != spec.vocab_size:
        raise ValueError(
            f"the draft (H {spec.hidden_size}, vocabulary {spec.vocab_size}) does not fit the target "
            f"(H {target.spec.hidden_size}, vocabulary {target.spec.vocab_size})"
        )
    shared = (
        spec.draft_vocab_size == target.spec.vocab_size
        and lm_head.shape == target.lm_head.shape
        and lm_head.dtype == target.lm_head.dtype
        and (lm_head is target.lm_head or torch.equal(lm_head.to(target.lm_head.device), target.lm_head))
    )
    return DraftWeights(
        spec=spec,
        fc=fc,
        hidden_norm=norm_of(hidden_norm, spec.pre_norm_center(), spec.rms_norm_eps),
        layers=layers,
        final_norm=norm_of(final_norm, spec.pre_norm_center(), spec.rms_norm_eps),
        markov_w1=markov_w1,
        markov_w2=markov_w2,
        lm_head=target.lm_head if shared else lm_head,
        embed=target.embed,
        d2t=d2t,
        confidence_weight=confidence_weight,
        confidence_bias=confidence_bias,
        lm_head_is_target=shared,
        target_spec=target.spec,
    )


def random_draft_weights(
    spec: DraftSpec,
    target: ModelWeights,
    seed: int = 0,
    *,
    own_lm_head: bool = False,
) -> DraftWeights:
    """Seeded random draft weights on the target's device, scaled so the activations
    stay O(1): projections N(0, 1/fan_in) (their inputs are RMS-normed or O(1)), norm
    weights small around their centres (zero-centred deltas, or 1 + delta used as
    stored), residual gates N(0, 0.5), Markov embeddings N(0, 1). The Markov
    projection is drawn so the bias has a standard deviation of 2 after the output
    multiplier: transformed logits that vary by O(1), a draft distribution far from
    uniform (as a trained draft's is), so sampling tests can tell tokens apart. The LM
    head is the target's unless ``own_lm_head`` (then a draw of the target's scale)."""
    dev = target.device
    g = torch.Generator(device=dev).manual_seed(seed)
    H, I, r = spec.hidden_size, spec.intermediate_size, spec.markov_rank  # noqa: E741

    def normal(*shape: int, std: float, dtype: torch.dtype = fn.BF16) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=dev) * std).to(dtype)

    def norm_weight(width: int, present: bool) -> torch.Tensor | None:
        if not present:
            return None
        delta = normal(width, std=0.1, dtype=fn.FP32)
        return (delta if spec.norm_zero_centered_gamma else 1.0 + delta).to(fn.BF16)

    layers = []
    for index in range(spec.num_layers):
        tensors: dict[str, Any] = {
            "pre_qkv_norm": norm_weight(H, spec.norm_affine),
            "q_proj": normal(spec.q_size, H, std=H**-0.5),
            "k_proj": normal(spec.kv_size, H, std=H**-0.5),
            "v_proj": normal(spec.kv_size, H, std=H**-0.5),
            "o_gate_proj": normal(spec.q_size, H, std=H**-0.5) if spec.use_attn_o_gate else None,
            "o_proj": normal(H, spec.q_size, std=spec.q_size**-0.5),
            "post_attn_norm": norm_weight(H, spec.post_attn_norm_has_weight),
            "attn_gate": normal(H, std=0.5) if spec.use_residual_gate else None,
            "pre_ffn_norm": norm_weight(H, spec.norm_affine),
            "gate_proj": normal(I, H, std=H**-0.5),
            "up_proj": normal(I, H, std=H**-0.5),
            "down_proj": normal(H, I, std=I**-0.5),
            "post_ffn_norm": norm_weight(H, spec.post_ffn_norm_has_weight),
            "ffn_gate": normal(H, std=0.5) if spec.use_residual_gate else None,
        }
        layers.append(make_draft_layer(spec, index, tensors))
    confidence = None
    if spec.enable_confidence_head:
        width = H + (r if spec.confidence_head_with_markov else 0)
        confidence = (normal(1, width, std=width**-0.5, dtype=fn.FP32), normal(1, std=0.1, dtype=fn.FP32))
    return make_draft_weights(
        spec,
        target,
        fc=normal(H, spec.fc_input_size, std=spec.fc_input_size**-0.5),
        hidden_norm=norm_weight(H, spec.norm_affine),
        layers=layers,
        final_norm=norm_weight(H, spec.norm_affine),
        markov_w1=normal(spec.vocab_size, r, std=1.0),
        markov_w2=normal(spec.draft_vocab_size, r, std=2.0 * r**-0.5 / spec.output_multiplier),
        lm_head=normal(spec.draft_vocab_size, H, std=H**-0.5) if own_lm_head else target.lm_head,
        d2t=torch.zeros(spec.draft_vocab_size, dtype=torch.int64, device=dev),
        confidence_weight=None if confidence is None else confidence[0],
        confidence_bias=None if confidence is None else confidence[1],
    )
