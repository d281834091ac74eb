"""Muse Spark checkpoints on disk: Hugging Face safetensors, written and read.

``save_checkpoint`` writes TP-1 ``ModelWeights`` in the checkpoint's form (Q/K rows
in the HF order, the router weight unfolded, the raw residual gates) under the
Hugging Face tensor names of the multimodal model, with a ``config.json`` that nests
the text model under ``text_config``. ``load_checkpoint`` reads such a directory
back into ``ModelWeights`` through ``weights.make_layer``, which re-orders, folds
and precomputes as vLLM does at load, so a save and a load give the same tensors
bit for bit.

NVFP4 experts (ModelOpt, nvfp4.py) are written and read as the released
checkpoint stores them: per quantized layer the packed ``mlp.experts.gate_up_proj``
and ``down_proj`` (uint8) with their ``_weight_scale`` (e4m3), ``_weight_scale_2``
(fp32 global decode scales: [E, 2] gate's and up's for gate_up, [E] for down) and
``_input_scale`` tensors. Which layers' experts are quantized comes from the
quantization config (``Nvfp4Config``): ``config.json``'s ``quantization_config``
(ModelOpt >= 0.31) or, without one, ``hf_quant_config.json`` (older ModelOpt).
A weight-only config (W4A16_NVFP4) may leave out the input scales; experts saved
without them are written in that form.

The loader is strict: a missing tensor, a tensor of the wrong shape or dtype, an
unknown text-model tensor name, a quantized tensor the quantization config does
not call for (or a config that quantizes what this loader reads as bf16) raises
``CheckpointError`` naming it; a missing or wrong config field raises
``SpecError``. Tensors of the vision and audio towers are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import nvfp4
from .spec import ModelSpec, read_json
from .weights import LayerWeights, ModelWeights, Nvfp4Scales, deinterleave_qk_rows, make_layer

BF16 = torch.bfloat16
FP32 = torch.float32
E4M3 = torch.float8_e4m3fn
U8 = torch.uint8

CONFIG_NAME = "config.json"
HF_QUANT_CONFIG_NAME = "hf_quant_config.json"
INDEX_NAME = "model.safetensors.index.json"
ARCHITECTURE = "MuseSparkForConditionalGeneration"
MODEL_TYPE = "muse_spark"

MULTIMODAL_PREFIX = "model.language_model."
TEXT_ONLY_PREFIX = "model."
LM_HEAD = "lm_head.weight"
EMBED = "embed_tokens.weight"
FINAL_NORM = "norm.weight"

# Tensors of the multimodal checkpoint that the text model does not use.
IGNORED_PREFIXES = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.vision_projection.",
    "model.vision_adapter.",
    "model.audio_projection.",
    "model.audio_adapter.",
    "model.multi_modal_projector.",
)

# Name endings of the tensors a quantized (NVFP4 / ModelOpt / compressed) checkpoint adds.
QUANTIZED_SUFFIXES = (
    "weight_scale",
    "weight_scale_2",
    "input_scale",
    "weight_global_scale",
    "input_global_scale",
    "weight_packed",
)

_QK = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")
_LAYER_NAME = re.compile(r"layers\.(0|[1-9][0-9]*)\.(.+)")

EXPERTS_MODULE = "mlp.experts"
# The linear modules vLLM would quantize under a ModelOpt config unless it excludes
# them (the router, pooler and unpooler are built unquantized): the config must
# exclude them, for this loader reads them as bf16.
_LAYER_LINEARS = tuple(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj"))
NVFP4_ALGO = "NVFP4"
# ModelOpt's weight-only form: the same packed experts and scales, no activation
# scales (vLLM runs both through Marlin's W4A16 kernels on SM90).
W4A16_NVFP4_ALGO = "W4A16_NVFP4"
# The NVFP4 expert tensors a weight-only checkpoint may leave out (vLLM never reads them
# there).
INPUT_SCALE_SUFFIXES = ("mlp.experts.gate_up_proj_input_scale", "mlp.experts.down_proj_input_scale")


class CheckpointError(ValueError):
    """A checkpoint directory that does not hold Muse Spark text-model weights as
    this module reads them (the message names the tensor or file at fault)."""


@dataclass(frozen=True)
class Nvfp4Config:
    """A ModelOpt NVFP4 quantization config: ``quant_algo`` NVFP4 or W4A16_NVFP4,
    blocks of 16, and the modules it leaves unquantized (``ignore``, ModelOpt's
    ``exclude_modules``), matched as vLLM's ``ModelOptQuantConfigBase.is_layer_excluded``
    matches them: a module is excluded by an entry equal to its name, contained in
    its name, or a wildcard matching it (``path*`` meaning ``path`` and everything
    under it). Module names are the checkpoint's (``model.language_model.layers.1.mlp.experts``).

    ``weights_only``: the config quantizes weights only, as vLLM 0.33 decides it:
    ``quant_algo`` W4A16_NVFP4, or NVFP4 with ``config_groups`` whose every group has
    no ``input_activations``. Such a checkpoint may leave out the experts'
    ``_input_scale`` tensors; the weights are the same either way (the executor's
    NVFP4 kernels, like Marlin's, never quantize activations)."""

    ignore: tuple[str, ...] = ()
    weights_only: bool = False

    @classmethod
    def from_config(cls, config: Any, where: str) -> Nvfp4Config:
        """From ``quantization_config`` (``{"quant_method": "modelopt", "quant_algo":
        ..., "ignore" or "exclude_modules": [...]}``) or an ``hf_quant_config.json``
        (``{"quantization": {"quant_algo": ..., "exclude_modules": [...]}}``)."""
        if not isinstance(config, dict):
            raise CheckpointError(f"{where}: the quantization config must be a dict, got {config!r}")
        if "quantization" in config:
            body = config["quantization"]
            if not isinstance(body, dict):
                raise CheckpointError(f"{where}: 'quantization' must be a dict, got {body!r}")
            ignore = body.get("exclude_modules", [])
        else:
            method = config.get("quant_method")
            if not (isinstance(method, str) and method.lower().startswith("modelopt")):
                raise CheckpointError(
                    f"{where}: quant_method is {method!r}; this loader reads ModelOpt NVFP4 checkpoints only"
                )
            body = config
            ignore = config.get("ignore", config.get("exclude_modules", []))
        algo = body.get("quant_algo")
        if not isinstance(algo, str) or algo.upper() not in (NVFP4_ALGO, W4A16_NVFP4_ALGO):
            raise CheckpointError(
                f"{where}: quant_algo is {algo!r}; this loader reads {NVFP4_ALGO} and {W4A16_NVFP4_ALGO} only"
            )
        group = body.get("group_size", nvfp4.BLOCK)
        if group != nvfp4.BLOCK:
            raise CheckpointError(f"{where}: group_size is {group!r}; NVFP4 scales blocks of {nvfp4.BLOCK}")
        if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
            raise CheckpointError(f"{where}: the excluded modules must be a list of names, got {ignore!r}")
        # Read where vLLM reads it: the top level of either form.
        groups = config.get("config_groups")
        weights_only = algo.upper() == W4A16_NVFP4_ALGO or (
            isinstance(groups, dict)
            and bool(groups)
            and all(isinstance(g, dict) and g.get("input_activations") is None for g in groups.values())
        )
        return cls(tuple(ignore), weights_only)

    def to_config(self) -> dict[str, Any]:
        """The ``quantization_config`` of ``config.json`` (ModelOpt >= 0.31's form)."""
        return {
            "quant_method": "modelopt",
            "quant_algo": W4A16_NVFP4_ALGO if self.weights_only else NVFP4_ALGO,
            "group_size": nvfp4.BLOCK,
            "ignore": list(self.ignore),
        }

    @classmethod
    def for_layers(
        cls, spec: ModelSpec, quantized: Collection[int], prefix: str = MULTIMODAL_PREFIX, weights_only: bool = False
    ) -> Nvfp4Config:
        """The config of a checkpoint whose routed experts are NVFP4 in the
        ``quantized`` layers only (everything else bf16)."""
        ignore = [LM_HEAD.removesuffix(".weight"), f"{prefix}layers.*.self_attn*"]
        ignore += [f"{prefix}layers.{i}.{EXPERTS_MODULE}*" for i in range(spec.num_layers) if i not in quantized]
        return cls(tuple(ignore), weights_only)

    def excludes(self, module: str) -> bool:
        for entry in self.ignore:
            if entry == module or entry in module:
                return True
            if entry.endswith("*") and not entry.endswith(".*"):
                patterns: tuple[str, ...] = (entry[:-1], entry[:-1] + ".*")
            else:
                patterns = (entry,)
            if any(fnmatchcase(module, p) for p in patterns):
                return True
        return False

    def quantized_layers(self, spec: ModelSpec, prefix: str, where: str) -> frozenset[int]:
        """The layers whose routed experts are NVFP4; raises where the config would
        quantize a module this loader reads as bf16 (the attention projections,
        the LM head)."""
        for module in [LM_HEAD.removesuffix(".weight")] + [
            f"{prefix}layers.{i}.{name}" for i in range(spec.num_layers) for name in _LAYER_LINEARS
        ]:
            if not self.excludes(module):
                raise CheckpointError(
                    f"{where}: the quantization config quantizes {module} (it is not among the excluded modules); "
                    "this loader reads NVFP4 routed experts only, every other weight bf16"
                )
        return frozenset(i for i in range(spec.num_layers) if not self.excludes(f"{prefix}layers.{i}.{EXPERTS_MODULE}"))


def read_quant_config(directory: Path, config: dict[str, Any]) -> Nvfp4Config | None:
    """The checkpoint's NVFP4 config: ``config.json``'s ``quantization_config`` (top
    level, or in ``text_config``), else ``hf_quant_config.json``; None for bf16."""
    text = config.get("text_config")
    for where, value in (
        (f"{directory / CONFIG_NAME} quantization_config", config.get("quantization_config")),
        (
            f"{directory / CONFIG_NAME} text_config.quantization_config",
            text.get("quantization_config") if isinstance(text, dict) else None,
        ),
    ):
        if value is not None:
            return Nvfp4Config.from_config(value, where)
    legacy = directory / HF_QUANT_CONFIG_NAME
    if legacy.is_file():
        value = read_json(legacy, CheckpointError)
        return Nvfp4Config.from_config(value, str(legacy))
    return None


def nvfp4_expert_table(spec: ModelSpec) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """The routed experts of an NVFP4 layer: checkpoint name suffix -> (key, shape,
    dtype), the keys naming ``Nvfp4Scales`` fields (w13 and w2: the packed codes)."""
    P, I, E, B = spec.P, spec.I, spec.E, nvfp4.BLOCK  # noqa: N806
    return {
        "mlp.experts.gate_up_proj": ("w13", (E, 2 * I, P // 2), U8),
        "mlp.experts.gate_up_proj_weight_scale": ("w13_scale", (E, 2 * I, P // B), E4M3),
        "mlp.experts.gate_up_proj_weight_scale_2": ("w13_global", (E, 2), FP32),
        "mlp.experts.gate_up_proj_input_scale": ("w13_input_scale", (E, 2), FP32),
        "mlp.experts.down_proj": ("w2", (E, P, I // 2), U8),
        "mlp.experts.down_proj_weight_scale": ("w2_scale", (E, P, I // B), E4M3),
        "mlp.experts.down_proj_weight_scale_2": ("w2_global", (E,), FP32),
        "mlp.experts.down_proj_input_scale": ("w2_input_scale", (E,), FP32),
    }


def layer_tensor_table(
    spec: ModelSpec, nvfp4_experts: bool = False
) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """Per decoder layer: checkpoint name suffix (after ``layers.{l}.``) ->
    (``make_layer`` key, shape, dtype), in the checkpoint's form; with
    ``nvfp4_experts`` the routed experts as ``nvfp4_expert_table``."""
    H, P, I, E = spec.H, spec.P, spec.I, spec.E
    q, kv = spec.q_size, spec.kv_size
    table = {
        "input_layernorm.weight": ("pre_qkv_norm", (H,), BF16),
        "self_attn.q_proj.weight": ("q_proj", (q, H), BF16),
        "self_attn.k_proj.weight": ("k_proj", (kv, H), BF16),
        "self_attn.v_proj.weight": ("v_proj", (kv, H), BF16),
        "self_attn.gate_proj.weight": ("gate_proj", (q, H), BF16),
        "self_attn.o_proj.weight": ("o_proj", (H, q), BF16),
        "post_attention_residual_gate.gate": ("attn_gate", (H,), BF16),
        "pre_feedforward_layernorm.weight": ("pre_ffn_norm", (H,), BF16),
        "mlp.gate.weight": ("router", (E, H), FP32),
        "mlp.gate.e_score_correction_bias": ("expert_bias", (E,), FP32),
        "mlp.pre_expert_proj.weight": ("pooler", (P, H), BF16),
        "mlp.pre_expert_norm.weight": ("pre_expert_norm", (P,), BF16),
        "mlp.experts.gate_up_proj": ("w13", (E, 2 * I, P), BF16),
        "mlp.experts.down_proj": ("w2", (E, P, I), BF16),
        "mlp.experts.post_expert_norm.weight": ("post_expert_norm", (P,), BF16),
        "mlp.post_expert_proj.weight": ("unpooler", (H, P), BF16),
        "post_feedforward_layernorm.weight": ("post_ffn_norm", (H,), BF16),
        "post_feedforward_residual_gate.gate": ("ffn_gate", (H,), BF16),
    }
    if not nvfp4_experts:
        return table
    out = {}
    for suffix, entry in table.items():
        if suffix == "mlp.experts.gate_up_proj":
            out.update(nvfp4_expert_table(spec))
        elif suffix != "mlp.experts.down_proj":
            out[suffix] = entry
    return out


def global_tensor_table(
    spec: ModelSpec, prefix: str = MULTIMODAL_PREFIX
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors outside the layers: full name -> (shape, dtype)."""
    V, H = spec.vocab_size, spec.H
    return {
        prefix + EMBED: ((V, H), BF16),
        prefix + FINAL_NORM: ((H,), BF16),
        LM_HEAD: ((V, H), BF16),
    }


def iter_checkpoint_names(
    spec: ModelSpec, prefix: str = MULTIMODAL_PREFIX, nvfp4_layers: Collection[int] = ()
) -> Iterator[str]:
    """Every tensor name of a checkpoint of ``spec`` (with NVFP4 experts in
    ``nvfp4_layers``), in the order ``save_checkpoint`` writes them."""
    yield prefix + EMBED
    for index in range(spec.num_layers):
        for suffix in layer_tensor_table(spec, index in nvfp4_layers):
            yield f"{prefix}layers.{index}.{suffix}"
    yield prefix + FINAL_NORM
    yield LM_HEAD


# ---------------------------------------------------------------------------- save


def save_checkpoint(weights: ModelWeights, directory: str | Path, shard_bytes: int = 2**30) -> None:
    """Write ``weights`` (TP 1, unfolded router kept; routed experts bf16 or NVFP4
    with their scales) to ``directory`` as a Hugging Face checkpoint:
    ``config.json`` (with the ``quantization_config`` of the NVFP4 layers when there
    are any), safetensors shards
    ``model-0000i-of-0000N.safetensors`` of about ``shard_bytes`` each (a tensor
    larger than that gets a shard of its own) and ``model.safetensors.index.json``.
    Everything is checked before anything is written; a tensor is copied to the
    host only while its shard is written."""
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    weights_only = _weights_only(weights)
    entries = _save_entries(weights)
    shards: list[list[tuple[str, torch.Tensor, bool]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = entry[1].numel() * entry[1].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "text_config": weights.spec.to_config(),
    }
    quantized = [layer.index for layer in weights.layers if layer.experts.format == "nvfp4"]
    if quantized:
        config["quantization_config"] = Nvfp4Config.for_layers(
            weights.spec, quantized, weights_only=weights_only
        ).to_config()
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    head_dim = weights.spec.head_dim
    weight_map: dict[str, str] = {}
    total = 0
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, tensor, qk in shard:
            host = tensor.detach().to("cpu", copy=True).contiguous()
            tensors[name] = deinterleave_qk_rows(host, head_dim).contiguous() if qk else host
            weight_map[name] = file
            total += host.numel() * host.element_size()
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _weights_only(weights: ModelWeights) -> bool:
    """Whether the NVFP4 experts are saved as a weight-only checkpoint (W4A16_NVFP4):
    no layer's experts carry input scales. Either every NVFP4 layer carries both or
    none carries any."""
    carried = {}
    for layer in weights.layers:
        scales = layer.experts.nvfp4
        if scales is not None:
            carried[layer.index] = (scales.w13_input_scale is not None, scales.w2_input_scale is not None)
    kinds = set(carried.values())
    if len(kinds) > 1 or (True, False) in kinds or (False, True) in kinds:
        raise ValueError(
            "cannot save NVFP4 experts with input scales in some places and not in others (layer: gate_up's, "
            f"down's): {carried}; a checkpoint is NVFP4 with every input scale or W4A16_NVFP4 with none"
        )
    return kinds == {(False, False)}


def _save_entries(weights: ModelWeights) -> list[tuple[str, torch.Tensor, bool]]:
    """(checkpoint name, source tensor, whether its rows go back to the HF Q/K order)
    of every tensor, each source checked against the checkpoint's shape and dtype."""
    spec = weights.spec
    if weights.tp != 1:
        raise ValueError(f"only TP-1 weights can be saved, these are rank {weights.rank} of TP {weights.tp}")
    if len(weights.layers) != spec.num_layers:
        raise ValueError(f"the weights hold {len(weights.layers)} layers, their spec {spec.num_layers}")
    prefix = MULTIMODAL_PREFIX
    top = global_tensor_table(spec, prefix)
    for name, tensor in zip(top, (weights.embed, weights.final_norm, weights.lm_head)):
        _check_source(name, tensor, *top[name])
    entries = [(prefix + EMBED, weights.embed, False)]
    for position, layer in enumerate(weights.layers):
        if layer.index != position:
            raise ValueError(f"layer {position} of the weights has index {layer.index}")
        table = layer_tensor_table(spec, layer.experts.format == "nvfp4")
        for suffix, tensor in _layer_sources(spec, layer).items():
            name = f"{prefix}layers.{position}.{suffix}"
            _, shape, dtype = table[suffix]
            _check_source(name, tensor, shape, dtype)
            entries.append((name, tensor, suffix in _QK))
    entries.append((prefix + FINAL_NORM, weights.final_norm, False))
    entries.append((LM_HEAD, weights.lm_head, False))
    return entries


def _layer_sources(spec: ModelSpec, layer: LayerWeights) -> dict[str, torch.Tensor]:
    """Checkpoint name suffix -> the layer's tensor it is written from (Q and K rows
    still in vLLM's interleaved order)."""
    where = f"layer {layer.index}"
    if layer.router_unfolded is None:
        raise ValueError(
            f"{where}: the weights cannot be saved because the unfolded router was not kept "
            "(router_unfolded is None; the folded router cannot be un-multiplied exactly)"
        )
    e = layer.experts
    if e.first_expert != 0 or e.intermediate_slice is not None or e.num_local != spec.E:
        raise ValueError(
            f"{where}: only the full set of experts can be saved (TP 1), these are {e.num_local} experts "
            f"from {e.first_expert} with intermediate slice {e.intermediate_slice}"
        )
    if layer.num_heads != spec.num_attention_heads or layer.num_kv_heads != spec.num_key_value_heads:
        raise ValueError(
            f"{where}: holds {layer.num_heads} query / {layer.num_kv_heads} KV heads, the spec "
            f"{spec.num_attention_heads} / {spec.num_key_value_heads} (only TP-1 weights can be saved)"
        )
    q, kv = spec.q_size, spec.kv_size
    _check_source(f"{where} qkvg", layer.qkvg, (2 * q + 2 * kv, spec.H), BF16)
    qkvg = layer.qkvg
    experts: dict[str, torch.Tensor] = {"mlp.experts.gate_up_proj": e.w13, "mlp.experts.down_proj": e.w2}
    if e.nvfp4 is not None:
        tensors = {**vars(e.nvfp4), "w13": e.w13, "w2": e.w2}
        experts = {}
        for suffix, (key, _, _) in nvfp4_expert_table(spec).items():
            if tensors[key] is None and suffix in INPUT_SCALE_SUFFIXES:
                continue  # a weight-only checkpoint (_weights_only)
            if tensors[key] is None:
                raise ValueError(f"{where}: the NVFP4 experts have no {key}, which the checkpoint stores ({suffix})")
            experts[suffix] = tensors[key]
    return {
        "input_layernorm.weight": layer.pre_qkv_norm,
        "self_attn.q_proj.weight": qkvg[:q],
        "self_attn.k_proj.weight": qkvg[q : q + kv],
        "self_attn.v_proj.weight": qkvg[q + kv : q + 2 * kv],
        "self_attn.gate_proj.weight": qkvg[q + 2 * kv :],
        "self_attn.o_proj.weight": layer.o_proj,
        "post_attention_residual_gate.gate": layer.attn_gate,
        "pre_feedforward_layernorm.weight": layer.pre_ffn_norm,
        "mlp.gate.weight": layer.router_unfolded,
        "mlp.gate.e_score_correction_bias": layer.expert_bias,
        "mlp.pre_expert_proj.weight": layer.pooler,
        "mlp.pre_expert_norm.weight": layer.pre_expert_norm,
        **experts,
        "mlp.experts.post_expert_norm.weight": layer.post_expert_norm,
        "mlp.post_expert_proj.weight": layer.unpooler,
        "post_feedforward_layernorm.weight": layer.post_ffn_norm,
        "post_feedforward_residual_gate.gate": layer.ffn_gate,
    }


def _check_source(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"cannot save {name}: shape {list(tensor.shape)}, the checkpoint needs {list(shape)}")
    if tensor.dtype != dtype:
        raise ValueError(f"cannot save {name}: dtype {tensor.dtype}, the checkpoint needs {dtype}")


# ---------------------------------------------------------------------------- load


def load_checkpoint(
    directory: str | Path, device: torch.device | str = "cpu", num_layers: int | None = None
) -> ModelWeights:
    """TP-1 ``ModelWeights`` on ``device`` from a Hugging Face checkpoint directory.

    The spec comes from ``config.json`` (``text_config`` nested or flat), cut to its
    first ``num_layers`` layers when given (only those layers' tensors are read).
    Tensors are found through the index's ``weight_map`` when there is one, else in
    every ``*.safetensors`` file, under ``model.language_model.`` or the text-only
    ``model.`` prefix; each is read alone, checked and copied to ``device`` (the
    weights never map the files). The unfolded router is kept, so the weights can
    be saved again, into the same directory too. The routed experts of the layers
    the quantization config quantizes are NVFP4 (packed codes and scales as stored,
    the gate's and up's global scales apart), the others bf16."""
    directory = Path(directory)
    full_spec = ModelSpec.from_config(directory)
    spec = full_spec if num_layers is None else full_spec.with_layers(num_layers)
    locations = _tensor_locations(directory)
    prefix = _text_prefix(locations)
    quant = read_quant_config(directory, json.loads((directory / CONFIG_NAME).read_text()))
    quantized = frozenset() if quant is None else quant.quantized_layers(full_spec, prefix, str(directory))
    _check_names(locations, prefix, full_spec, directory, quantized, quant is not None)
    # A weight-only config's experts may leave out their input scales.
    optional = INPUT_SCALE_SUFFIXES if quant is not None and quant.weights_only else ()

    top = global_tensor_table(spec, prefix)
    for name in iter_checkpoint_names(spec, prefix, quantized):
        if name not in locations and not name.endswith(optional):
            why = (
                " (the quantization config is NVFP4 with activation scales; a weight-only one is W4A16_NVFP4)"
                if name.endswith(INPUT_SCALE_SUFFIXES)
                else ""
            )
            raise CheckpointError(f"tensor {name} is missing from the checkpoint at {directory}{why}")

    dev = torch.device(device)
    with _Reader(directory, locations, dev) as read:
        embed = read(prefix + EMBED, *top[prefix + EMBED])
        layers = []
        for index in range(spec.num_layers):
            tensors: dict[str, Any] = {
                key: read(f"{prefix}layers.{index}.{suffix}", shape, dtype)
                for suffix, (key, shape, dtype) in layer_tensor_table(spec, index in quantized).items()
                if f"{prefix}layers.{index}.{suffix}" in locations or suffix not in optional
            }
            if index in quantized:
                scales = {f: tensors.pop(f, None) for f in Nvfp4Scales.__dataclass_fields__}
                if (scales["w13_input_scale"] is None) != (scales["w2_input_scale"] is None):
                    raise CheckpointError(
                        f"layer {index}'s experts in {directory} carry one of their two input scales "
                        "(gate_up_proj_input_scale, down_proj_input_scale): either both or neither"
                    )
                tensors["nvfp4"] = Nvfp4Scales(**scales)
            layers.append(
                make_layer(
                    spec,
                    index,
                    q_proj=tensors.pop("q_proj"),
                    k_proj=tensors.pop("k_proj"),
                    v_proj=tensors.pop("v_proj"),
                    gate_proj=tensors.pop("gate_proj"),
                    tensors=tensors,
                )
            )
        final_norm = read(prefix + FINAL_NORM, *top[prefix + FINAL_NORM])
        lm_head = read(LM_HEAD, *top[LM_HEAD])
    return ModelWeights(spec=spec, embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def _tensor_locations(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: the index's weight_map, or
    the headers of every ``*.safetensors`` file of the directory."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        index: Any = read_json(index_path, CheckpointError)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no weight_map dict")
        locations = {}
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise CheckpointError(f"{index_path}: weight_map[{name!r}] must be a file name, got {file!r}")
            locations[name] = directory / file
        return locations
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no {INDEX_NAME} and no *.safetensors files in {directory}")
    locations = {}
    for path in files:
        for name in _file_keys(path):
            if name in locations:
                raise CheckpointError(f"tensor {name} is in both {locations[name].name} and {path.name} in {directory}")
            locations[name] = path
    return locations


def _file_keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"cannot read the safetensors file {path}: {e}") from e


def _text_prefix(locations: dict[str, Path]) -> str:
    """``model.language_model.`` (the multimodal checkpoint) when any tensor has it,
    else ``model.`` (a text-only checkpoint)."""
    return MULTIMODAL_PREFIX if any(n.startswith(MULTIMODAL_PREFIX) for n in locations) else TEXT_ONLY_PREFIX


def _check_names(
    locations: dict[str, Path],
    prefix: str,
    spec: ModelSpec,
    directory: Path,
    quantized: frozenset[int],
    configured: bool,
) -> None:
    """Every tensor name is a text-model tensor of ``spec`` (the NVFP4 expert
    tensors in the ``quantized`` layers only), ``lm_head.weight`` or a tensor of
    the towers (ignored); other quantized tensors are refused by name."""
    tables = {q: layer_tensor_table(spec, q) for q in (False, True)}
    for name in locations:
        if name.startswith(IGNORED_PREFIXES) or name == LM_HEAD:
            continue
        rest = name[len(prefix) :] if name.startswith(prefix) else None
        match = None if rest is None else _LAYER_NAME.fullmatch(rest)
        layer = int(match[1]) if match else None
        if match and layer is not None and layer < spec.num_layers and match[2] in tables[layer in quantized]:
            continue
        last = name.rsplit(".", 1)[-1]
        if match and layer is not None and layer < spec.num_layers and match[2] in tables[True]:
            why = (
                f"the checkpoint has no quantization config (config.json quantization_config or {HF_QUANT_CONFIG_NAME})"
                if not configured
                else f"the quantization config excludes layer {layer}'s experts"
            )
            raise CheckpointError(f"tensor {name} in {directory} is an NVFP4 expert tensor, but {why}")
        if last.endswith(QUANTIZED_SUFFIXES):
            raise CheckpointError(
                f"tensor {name} in {directory} belongs to a quantized weight: quantized weights are not "
                "supported by this loader outside the NVFP4 routed experts (it reads bf16 weights with an fp32 "
                "router)"
            )
        if rest is not None:
            if rest in (EMBED, FINAL_NORM):
                continue
        raise CheckpointError(
            f"unexpected tensor {name} in the checkpoint at {directory}: not a tensor of the Muse Spark text model "
            f"with {spec.num_layers} layers (text tensors are under {prefix!r})"
        )


class _Reader:
    """Reads single tensors by name, each file opened once, and checks them."""

    def __init__(self, directory: Path, locations: dict[str, Path], device: torch.device):
        self.directory, self.locations, self.device = directory, locations, device
        self.files: dict[Path, tuple[Any, set[str]]] = {}
        self.stack = ExitStack()

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def _open(self, path: Path, name: str) -> tuple[Any, set[str]]:
        entry = self.files.get(path)
        if entry is None:
            if not path.is_file():
                raise CheckpointError(
                    f"tensor {name} is in {path.name}, which does not exist in the checkpoint at {self.directory}"
                )
            try:
                handle = self.stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read the safetensors file {path}: {e}") from e
            entry = self.files[path] = (handle, set(handle.keys()))
        return entry

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        path = self.locations[name]
        handle, keys = self._open(path, name)
        if name not in keys:
            raise CheckpointError(
                f"tensor {name} is missing from the checkpoint at {self.directory} "
                f"(the index places it in {path.name}, which does not hold it)"
            )
        tensor = handle.get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor {name} has shape {list(tensor.shape)}, expected {list(shape)} (checkpoint at {self.directory})"
            )
        if tensor.dtype != dtype:
            raise CheckpointError(
                f"tensor {name} has dtype {tensor.dtype}, expected {dtype} (checkpoint at {self.directory})"
            )
        # A copy: the tensors safetensors returns on the host map the file, so they
        # would change with it (a save into the same directory, a re-download).
        return tensor.to(self.device, copy=True)
