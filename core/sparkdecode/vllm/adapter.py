"""The vLLM backbone adapter: vLLM 0.33's loaded Muse Spark modules and bound KV
caches, per rank, as the core's plain ``ModelWeights`` and ``LayerKV``.

Every tensor is a view of what vLLM keeps (nothing is copied, the experts
included), taken after vLLM's ``load_weights`` has re-ordered the Q/K rows,
folded the router's output multiplier and materialized the residual gates'
alpha/beta. Each module's conventions are checked against what ``LayerWeights``
means, so a vLLM change that moves a +1 or a rounding point fails here, by name,
instead of in the numbers:

| vLLM module (per decoder layer) | LayerWeights field | convention checked |
| --- | --- | --- |
| ``self_attn.pre_qkv_proj_norm.weight`` | ``pre_qkv_norm`` | ``rms(x) * (w + 1)``, eps ``rms_norm_eps`` |
| ``self_attn.qkv_proj.weight`` | ``qkvg`` | rows ``[q, k, v, o_gate]`` of this rank's heads, bf16 |
| ``self_attn.o_proj.weight`` | ``o_proj`` | this rank's input columns (row-parallel) |
| ``add_attn.gate / alpha / beta`` | ``attn_gate / attn_alpha / attn_beta`` | fp32 buffers materialized at load |
| ``post_attn_norm`` | (none) | weightless, eps ``post_norm_eps`` |
| ``pre_ffn_norm.weight`` | ``pre_ffn_norm`` | ``rms(x) * (w + 1)`` |
| ``feed_forward.router.weight`` | ``router`` | fp32, output multiplier folded in |
| ``feed_forward.expert_bias`` | ``expert_bias`` | fp32 selection bias |
| ``feed_forward.pooler.weight`` | ``pooler`` | bf16 [P, H] (this rank's rows when vLLM shards it) |
| ``feed_forward.pre_expert_norm.weight`` | ``pre_expert_norm`` | ``rms(x) * (w + 1)`` |
| ``feed_forward.experts.routed_experts.w13_weight / w2_weight`` | ``experts`` | bf16, checkpoint layout (SM90 Triton path) |
| ``...routed_experts.w13_* / w2_*`` (NVFP4) | ``experts`` (``nvfp4_marlin``) | Marlin's tiles and scales (SM90 Marlin path) |
| ``feed_forward.post_expert_norm.weight`` | ``post_expert_norm`` | ``rms(x * (w + 1))``, eps ``post_norm_eps`` |
| ``feed_forward.unpooler.weight`` | ``unpooler`` | bf16 [H, P] (this rank's rows when vLLM shards it) |
| ``post_ffn_norm.weight``, ``add_ffn.*`` | ``post_ffn_norm``, ``ffn_*`` | ``rms(x * (w + 1))`` |
| ``model.norm.weight`` | ``ModelWeights.final_norm`` | ``rms(x) * w`` (no +1) |
| ``self_attn.rotary_emb.cos_sin_cache`` | ``ModelWeights.rope_tables`` | fp32 ``[cos | sin]`` |

The KV side: each attention layer's bound cache (vLLM's per-layer logical view
``[pages, kv_heads, 16, 2 * head_dim]``, K then V along the last axis, in
whatever physical layout vLLM resolved) becomes strided K and V views
``[pages, 16, kv_heads, head_dim]``; each KV-cache group gets the project's own
metadata buffers (``KVGroupMetadata``), refilled from vLLM's block tables, slot
mappings and sequence lengths before every step (``refresh``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import nvfp4_marlin
from ..protocols import KVGroupMetadata, LayerKV
from ..spec import ModelSpec
from ..weights import ExpertWeights, LayerWeights, ModelWeights, Sharding

BF16, FP32 = torch.bfloat16, torch.float32
KV_BLOCK_SIZE = 16


class AdapterError(ValueError):
    """vLLM's modules or KV cache are not in a form the adapter maps (the message
    names the module and what differs)."""


def _data(t: torch.Tensor) -> torch.Tensor:
    return t.data if isinstance(t, torch.nn.Parameter) else t


def _tensor(where: str, t: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise AdapterError(f"{where}: expected a tensor, vLLM holds {type(t).__name__}")
    t = _data(t)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise AdapterError(f"{where}: expected {dtype} {tuple(shape)}, vLLM holds {t.dtype} {tuple(t.shape)}")
    return t


def _norm(
    where: str, norm: Any, *, width: int, eps: float, weight: bool, center: float = 1.0, first: bool = False
) -> torch.Tensor | None:
    """The weight of one of vLLM's ``MuseSpark1xRMSNorm`` after checking it computes
    ``rms(x) * (w + center)`` (``first``: ``rms(x * (w + center))``) with ``eps``."""
    if norm.variance_epsilon != eps or norm.variance_size_override is not None:
        raise AdapterError(f"{where}: eps {norm.variance_epsilon} over the whole row expected {eps}")
    if bool(norm.has_weight) != weight:
        raise AdapterError(f"{where}: expected {'a' if weight else 'no'} weight")
    if not weight:
        return None
    if norm.fused_gain_center != center or bool(norm.applies_weight_before_norm) != first:
        gain = f"(w + {center:g})"
        expected = f"rms(x * {gain})" if first else f"rms(x) * {gain}"
        raise AdapterError(
            f"{where}: expected {expected}, vLLM's norm has gain centre {norm.fused_gain_center} "
            f"{'before' if norm.applies_weight_before_norm else 'after'} normalizing"
        )
    return _tensor(f"{where}.weight", norm.weight, (width,), BF16)


def _gate(where: str, conn: Any, width: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not getattr(conn, "_coefficients_ready", False):
        raise AdapterError(f"{where}: alpha/beta are not materialized (vLLM's load_weights has not run)")
    if conn.temperature != temperature or not conn.use_stream_gate or conn.activation_type != "sigmoid":
        raise AdapterError(f"{where}: expected a sigmoid stream gate of temperature {temperature}")
    return (
        _tensor(f"{where}.gate", conn.gate, (width,), BF16),
        _tensor(f"{where}.alpha", conn.alpha, (width,), FP32),
        _tensor(f"{where}.beta", conn.beta, (width,), FP32),
    )


def _rows(t: torch.Tensor, sharded: bool, sharding: Sharding) -> torch.Tensor:
    """This rank's block of output rows where vLLM shards the projection at decode
    batches (it keeps the whole weight and narrows it per call: so do we)."""
    return t.narrow(0, sharding.part(t.shape[0]).start, t.shape[0] // sharding.tp) if sharded else t


def _first_expert(where: str, experts: Any, e_local: int, sharding: Sharding, spec: ModelSpec) -> int:
    """The first expert this rank holds (vLLM's expert map under EP), checked to be
    one contiguous range in expert order at the linear placement."""
    first = 0
    expert_map = getattr(experts, "expert_map", None)
    if expert_map is not None:
        local = torch.nonzero(expert_map.cpu() >= 0).flatten()
        if local.numel() != e_local or not torch.equal(local, torch.arange(int(local[0]), int(local[0]) + e_local)):
            raise AdapterError(f"{where}: this rank's experts {local.tolist()} are not one contiguous range")
        if not torch.equal(expert_map.cpu()[local], torch.arange(e_local, dtype=expert_map.dtype)):
            raise AdapterError(f"{where}: this rank's experts are not stored in expert order")
        first = int(local[0])
    if sharding.expert_parallel == "ep" and first != sharding.part(spec.E).start:
        raise AdapterError(f"{where}: rank {sharding.rank} holds experts from {first}, expected the linear placement")
    return first


def expert_weights(spec: ModelSpec, index: int, runner: Any, sharding: Sharding) -> ExpertWeights:
    """The routed experts vLLM keeps. bf16 (vLLM's SM90 path, the Triton experts
    behind the route-major finalize) as the checkpoint lays them out: w13 bf16
    [E_local, 2 I_local, P] (gate rows, then up rows, of this rank's I-slice) and
    w2 bf16 [E_local, P, I_local]. ModelOpt NVFP4 (SM90: Marlin behind the same
    finalize) as vLLM repacked them at load, Marlin's tiles and scales held in
    place (``nvfp4_marlin.marlin_experts``). Other paths repack otherwise and are
    refused."""
    where = f"layer {index}: feed_forward.experts"
    experts = getattr(runner, "routed_experts", runner)
    method = getattr(experts, "quant_method", None)
    name = type(method).__name__
    nvfp4 = name == "MuseSparkModelOptNvFp4FusedMoE"
    route_major = getattr(method, "use_route_major", False)
    if nvfp4 and not (route_major and getattr(getattr(method, "nvfp4_backend", None), "name", None) == "MARLIN"):
        raise AdapterError(
            f"{where}: NVFP4 experts on backend {getattr(method, 'nvfp4_backend', None)} (route-major: "
            f"{route_major}); only vLLM's SM90 Marlin path, whose repacked layout the executor reads, is served"
        )
    if not nvfp4 and (name != "MuseSparkUnquantizedFusedMoE" or not route_major):
        raise AdapterError(
            f"{where}: vLLM's experts method {name} (route-major: {route_major}) keeps its own weight layout; only "
            "the SM90 paths (MuseSparkUnquantizedFusedMoE on the Triton experts, bf16 in the checkpoint's layout; "
            "MuseSparkModelOptNvFp4FusedMoE on Marlin) are read"
        )
    ep = sharding.expert_parallel == "ep"
    e_local = spec.E // sharding.tp if ep else spec.E
    i_local = spec.I if ep else spec.I // sharding.tp
    first = _first_expert(where, experts, e_local, sharding, spec)
    part = sharding.part(spec.I)
    i_slice = None if ep or sharding.tp == 1 else (part.start, part.stop)
    if nvfp4:
        tensors = [
            _data(getattr(experts, f"{w}_weight{suffix}"))
            for w in ("w13", "w2")
            for suffix in ("", "_scale", "_scale_2")
        ]
        try:
            return nvfp4_marlin.marlin_experts(*tensors, spec.P, i_local, first, i_slice)
        except ValueError as e:
            raise AdapterError(f"{where}: {e}") from None
    w13 = _tensor(f"{where}.w13_weight", experts.w13_weight, (e_local, 2 * i_local, spec.P), BF16)
    w2 = _tensor(f"{where}.w2_weight", experts.w2_weight, (e_local, spec.P, i_local), BF16)
    return ExpertWeights("bf16", w13, w2, first, i_slice)


def layer_weights(spec: ModelSpec, layer: Any, sharding: Sharding) -> LayerWeights:
    """One of vLLM's ``MuseSpark1xDecoderLayer`` as this rank's ``LayerWeights``."""
    i = layer.layer_idx
    at = f"layer {i}"
    attn, moe = layer.self_attn, layer.feed_forward
    H, P, E, d = spec.H, spec.P, spec.E, spec.head_dim  # noqa: N806
    eps, post_eps = spec.rms_norm_eps, spec.post_norm_eps
    if type(moe).__name__ != "MuseSpark1xMoE" or moe.use_mega_moe or moe.pooler is None or moe.unpooler is None:
        raise AdapterError(f"{at}: feed_forward is not the pooled MoE the executor runs")
    if moe.router_output_multiplier is not None:
        raise AdapterError(f"{at}: the router's output multiplier is not folded (vLLM's load_weights has not run)")
    if not attn.use_qk_norm or not attn.fuse_o_norm_gate or attn.use_attn_temperature_tuning:
        raise AdapterError(f"{at}: attention without QK norm and the o-norm sigmoid gate")
    if attn.head_dim != d or attn.num_heads * sharding.tp != spec.num_attention_heads:
        raise AdapterError(f"{at}: {attn.num_heads} heads of {attn.head_dim} on this rank do not match the spec")
    if attn.num_kv_heads * sharding.tp != spec.num_key_value_heads:
        raise AdapterError(f"{at}: {attn.num_kv_heads} KV heads on this rank (vLLM replicates KV heads at this TP)")
    window = attn.attn.sliding_window
    if window != spec.window(i) or attn.use_rope != spec.uses_rope(i):
        raise AdapterError(f"{at}: sliding window {window} / RoPE {attn.use_rope} differ from the spec")
    for name in ("qk_norm", "o_norm"):
        _norm(f"{at}: self_attn.{name}", getattr(attn, name), width=d, eps=eps, weight=False)
    _norm(f"{at}: post_attn_norm", layer.post_attn_norm, width=H, eps=post_eps, weight=False)
    q, kv = attn.num_heads * d, attn.num_kv_heads * d
    attn_gate, attn_alpha, attn_beta = _gate(f"{at}: add_attn", layer.add_attn, H, spec.residual_gate_temperature)
    ffn_gate, ffn_alpha, ffn_beta = _gate(f"{at}: add_ffn", layer.add_ffn, H, spec.residual_gate_temperature)
    pooler = _tensor(f"{at}: feed_forward.pooler.weight", moe.pooler.weight, (P, H), BF16)
    unpooler = _tensor(f"{at}: feed_forward.unpooler.weight", moe.unpooler.weight, (H, P), BF16)
    return LayerWeights(
        index=i,
        window=spec.window(i),
        rope_theta=spec.layer_rope_theta[i],
        pre_qkv_norm=_norm(f"{at}: self_attn.pre_qkv_proj_norm", attn.pre_qkv_proj_norm, width=H, eps=eps, weight=True),
        qkvg=_tensor(f"{at}: self_attn.qkv_proj.weight", attn.qkv_proj.weight, (2 * q + 2 * kv, H), BF16),
        o_proj=_tensor(f"{at}: self_attn.o_proj.weight", attn.o_proj.weight, (H, q), BF16),
        attn_gate=attn_gate,
        attn_alpha=attn_alpha,
        attn_beta=attn_beta,
        pre_ffn_norm=_norm(f"{at}: pre_ffn_norm", layer.pre_ffn_norm, width=H, eps=eps, weight=True),
        router=_tensor(f"{at}: feed_forward.router.weight", moe.router.weight, (E, H), FP32),
        expert_bias=_tensor(f"{at}: feed_forward.expert_bias", moe.expert_bias, (E,), FP32),
        pooler=_rows(pooler, bool(moe.shard_pooler), sharding),
        pre_expert_norm=_norm(
            f"{at}: feed_forward.pre_expert_norm", moe.pre_expert_norm, width=P, eps=eps, weight=True
        ),
        experts=expert_weights(spec, i, moe.experts, sharding),
        post_expert_norm=_norm(
            f"{at}: feed_forward.post_expert_norm", moe.post_expert_norm, width=P, eps=post_eps, weight=True, first=True
        ),
        unpooler=_rows(unpooler, bool(moe.shard_unpooler), sharding),
        post_ffn_norm=_norm(
            f"{at}: post_ffn_norm", layer.post_ffn_norm, width=H, eps=post_eps, weight=True, first=True
        ),
        ffn_gate=ffn_gate,
        ffn_alpha=ffn_alpha,
        ffn_beta=ffn_beta,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
    )


def sharding_of(backbone: Any, tp: int, rank: int, expert_parallel: bool) -> Sharding:
    """How vLLM cut this rank's weights: EP (whole experts) or expert TP (an
    I-slice of every expert), and whether the MoE shards its pooler / unpooler."""
    layers = [layer for layer in backbone.layers[backbone.start_layer : backbone.end_layer]]
    flags = {(bool(x.feed_forward.shard_pooler), bool(x.feed_forward.shard_unpooler)) for x in layers}
    if len(flags) != 1:
        raise AdapterError(f"vLLM shards the pooler/unpooler of some layers only: {sorted(flags)}")
    shard_pooler, shard_unpooler = flags.pop()
    return Sharding(
        tp=tp,
        rank=rank,
        expert_parallel="ep" if expert_parallel or tp == 1 else "tp",
        shard_pooler=shard_pooler,
        shard_unpooler=shard_unpooler,
    )


def model_weights(
    spec: ModelSpec, backbone: Any, lm_head: Any, sharding: Sharding, vocab_size: int | None = None
) -> ModelWeights:
    """vLLM's ``MuseSpark1xModel`` (with the LM head) as this rank's ``ModelWeights``.

    At TP > 1 vLLM keeps only this rank's rows of the vocabulary in the embedding
    and the LM head; the vLLM model then always hands the executor embedded rows
    (the stock ``embed_tokens``), so the table is never indexed here."""
    if backbone.start_layer != 0 or backbone.end_layer != spec.num_layers:
        raise AdapterError(f"this rank holds layers {backbone.start_layer}..{backbone.end_layer - 1}, not all")
    sharding.check(spec)
    layers = [layer_weights(spec, layer, sharding) for layer in backbone.layers]
    _norm("model.tok_embeddings_norm", backbone.tok_embeddings_norm, width=spec.H, eps=spec.rms_norm_eps, weight=False)
    final = _norm("model.norm", backbone.norm, width=spec.H, eps=spec.rms_norm_eps, weight=True, center=0.0)
    vocab = spec.vocab_size if vocab_size is None else vocab_size
    embed, head = _data(backbone.embed_tokens.weight), _data(lm_head.weight)
    if sharding.tp == 1:
        embed, head = embed[:vocab], head[:vocab]
    weights = ModelWeights(
        spec=spec,
        embed=embed,
        layers=layers,
        final_norm=final,
        lm_head=head,
        sharding=sharding,
    )
    for layer in backbone.layers:
        attn = layer.self_attn
        theta = spec.layer_rope_theta[layer.layer_idx]
        if attn.use_rope and theta not in weights.rope_tables:
            table = attn.rotary_emb.cos_sin_cache
            if table.dtype != FP32 or tuple(table.shape[1:]) != (spec.head_dim,) or attn.rotary_emb.is_neox_style:
                raise AdapterError(f"layer {layer.layer_idx}: RoPE is not the GPT-J fp32 [cos | sin] table")
            weights.rope_tables[theta] = table
    return weights


# ------------------------------------------------------------------------------ KV


def kv_views(where: str, cache: Any, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[pages, 16, kv_heads, head_dim]`` of one layer's bound cache, as
    vLLM's attention backends split it (``cache.transpose(1, 2).split(head_dim)``):
    views whatever the physical layout."""
    if not isinstance(cache, torch.Tensor) or cache.numel() == 0:
        raise AdapterError(f"{where}: no KV cache is bound")
    expected = (num_kv_heads, KV_BLOCK_SIZE, 2 * head_dim)
    if cache.dim() != 4 or tuple(cache.shape[1:]) != expected or cache.dtype != BF16:
        raise AdapterError(
            f"{where}: the KV cache is {cache.dtype} {tuple(cache.shape)}; the executor reads bf16 "
            f"[pages, {num_kv_heads}, {KV_BLOCK_SIZE}, {2 * head_dim}] (K then V, pages of {KV_BLOCK_SIZE} tokens: "
            "vLLM split the pages into smaller kernel blocks, or keeps another dtype)"
        )
    kv = cache.transpose(1, 2)
    return kv[..., :head_dim], kv[..., head_dim:]


@dataclass
class KVBinding:
    """The executor's view of vLLM's bound KV caches: per layer K/V and its group's
    metadata; per vLLM KV-cache group the metadata buffers (None for a group that
    holds none of this model's layers, such as the draft's)."""

    kv: tuple[LayerKV, ...]
    groups: list[KVGroupMetadata | None]
    max_rows: int


def bind_kv(
    spec: ModelSpec,
    backbone: Any,
    kv_cache_config: Any,
    block_table_widths: Sequence[int],
    max_rows: int,
    device: torch.device,
) -> KVBinding:
    """The K/V views of every layer's bound cache and fresh metadata buffers per
    KV-cache group (filled by ``refresh`` before every step)."""
    group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
    groups: list[KVGroupMetadata | None] = [None] * len(kv_cache_config.kv_cache_groups)
    kv = []
    for layer in backbone.layers:
        attn = layer.self_attn.attn
        name = attn.layer_name
        if name not in group_of:
            raise AdapterError(f"{name}: in no KV-cache group")
        g = group_of[name]
        block_size = kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size
        if block_size != KV_BLOCK_SIZE:
            # vLLM sizes sliding-window groups by what the attention backend runs,
            # not by --block-size: the executor's block tables count 16-token pages.
            raise AdapterError(
                f"{name}: its KV-cache group {g} has blocks of {block_size} tokens; the executor reads pages "
                f"of {KV_BLOCK_SIZE} (the attention backend chose the block size)"
            )
        if groups[g] is None:
            groups[g] = KVGroupMetadata(
                block_table=torch.zeros(1, block_table_widths[g], dtype=torch.int32, device=device),
                seq_lens=torch.zeros(1, dtype=torch.int32, device=device),
                slot_mapping=torch.zeros(max_rows, dtype=torch.int64, device=device),
            )
        k, v = kv_views(name, attn.kv_cache, layer.self_attn.num_kv_heads, spec.head_dim)
        metadata = groups[g]
        assert metadata is not None
        kv.append(LayerKV(k, v, metadata, spec.window(layer.layer_idx)))
    return KVBinding(tuple(kv), groups, max_rows)


def refresh(
    binding: KVBinding, block_tables: Sequence[torch.Tensor], slot_mappings: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """Refill the project's metadata from vLLM's for a step of one request:
    request 0's block-table row per group, its sequence length (context after the
    step), and the first ``max_rows`` slots of each group's slot mapping. Device
    copies on the current stream, outside any graph."""
    rows = min(binding.max_rows, slot_mappings.shape[-1])
    for g, metadata in enumerate(binding.groups):
        if metadata is None:
            continue
        metadata.block_table.copy_(block_tables[g][:1])
        metadata.seq_lens.copy_(seq_lens[:1])
        metadata.slot_mapping[:rows].copy_(slot_mappings[g, :rows])
