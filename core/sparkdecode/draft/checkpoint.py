"""DSpark draft checkpoints on disk: ``config.json`` and safetensors, written and read.

The tensor names are the ones vLLM 0.33's ``MuseSparkDSparkForCausalLM.load_weights``
takes: bare module names (it prefixes ``model.`` to all but ``lm_head``), the Q/K/V
and o-gate rows as ``self_attn.{q,k,v,o_gate}_proj`` (stacked into ``qkv_proj``),
the MLP's ``feed_forward.{gate,up,down}_proj``, ``lm_head.weight`` and the ``d2t``
vocabulary map, both required; ``t2d``, ``embed_tokens.weight`` and
``mask_embedding`` are ignored (vLLM drops them: the draft embeds with the
target's table). A tensor whose module is absent from this config (a norm weight
without ``norm_affine``, a gate without ``use_residual_gate``) is not written, and is
refused on load, as vLLM's loader would.

Floating tensors are converted to the dtype vLLM's parameter holds (bf16; fp32 for
the confidence head), as its weight loaders copy them; shapes are checked strictly:
a missing, misshapen or unknown tensor raises ``CheckpointError`` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..checkpoint import CheckpointError
from ..weights import ModelWeights
from .spec import DraftSpec
from .weights import DraftWeights, make_draft_layer, make_draft_weights

BF16, FP32 = torch.bfloat16, torch.float32
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
IGNORED = ("t2d", "embed_tokens.weight", "mask_embedding")


def draft_layer_tensor_table(spec: DraftSpec) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """Per draft layer: name suffix (after ``layers.{i}.``) -> (``make_draft_layer``
    key, shape, dtype), for the tensors this config has."""
    H, I, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size  # noqa: E741
    table: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {
        "self_attn.q_proj.weight": ("q_proj", (q, H), BF16),
        "self_attn.k_proj.weight": ("k_proj", (kv, H), BF16),
        "self_attn.v_proj.weight": ("v_proj", (kv, H), BF16),
    }
    if spec.use_attn_o_gate:
        table["self_attn.o_gate_proj.weight"] = ("o_gate_proj", (q, H), BF16)
    table["self_attn.o_proj.weight"] = ("o_proj", (H, q), BF16)
    if spec.norm_affine:
        table["self_attn.pre_qkv_proj_norm.weight"] = ("pre_qkv_norm", (H,), BF16)
    if spec.post_attn_norm_has_weight:
        table["post_attn_norm.weight"] = ("post_attn_norm", (H,), BF16)
    if spec.use_residual_gate:
        table["add_attn.gate"] = ("attn_gate", (H,), BF16)
    if spec.norm_affine:
        table["pre_ffn_norm.weight"] = ("pre_ffn_norm", (H,), BF16)
    table["feed_forward.gate_proj.weight"] = ("gate_proj", (I, H), BF16)
    table["feed_forward.up_proj.weight"] = ("up_proj", (I, H), BF16)
    table["feed_forward.down_proj.weight"] = ("down_proj", (H, I), BF16)
    if spec.post_ffn_norm_has_weight:
        table["post_ffn_norm.weight"] = ("post_ffn_norm", (H,), BF16)
    if spec.use_residual_gate:
        table["add_ffn.gate"] = ("ffn_gate", (H,), BF16)
    return table


def draft_global_tensor_table(spec: DraftSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors outside the layers: name -> (shape, dtype)."""
    H, r = spec.hidden_size, spec.markov_rank
    table: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"fc.weight": ((H, spec.fc_input_size), BF16)}
    if spec.norm_affine:
        table["hidden_norm.weight"] = ((H,), BF16)
        table["norm.weight"] = ((H,), BF16)
    table["markov_head.markov_w1.weight"] = ((spec.vocab_size, r), BF16)
    table["markov_head.markov_w2.weight"] = ((spec.draft_vocab_size, r), BF16)
    table["lm_head.weight"] = ((spec.draft_vocab_size, H), BF16)
    table["d2t"] = ((spec.draft_vocab_size,), torch.int64)
    return table


def confidence_tensor_table(spec: DraftSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The confidence head's tensors (optional in a checkpoint; vLLM drops the head
    when they are absent)."""
    width = spec.hidden_size + (spec.markov_rank if spec.confidence_head_with_markov else 0)
    return {"confidence_head.proj.weight": ((1, width), FP32), "confidence_head.proj.bias": ((1,), FP32)}


def draft_checkpoint_names(spec: DraftSpec) -> list[str]:
    """Every required tensor name of a draft checkpoint of ``spec``."""
    names = list(draft_global_tensor_table(spec))
    for i in range(spec.num_layers):
        names.extend(f"layers.{i}.{suffix}" for suffix in draft_layer_tensor_table(spec))
    return names


# ---------------------------------------------------------------------------- save


def save_draft_checkpoint(weights: DraftWeights, directory: str | Path) -> None:
    """Write ``weights`` to ``directory``: ``config.json`` (the draft's) and
    ``model.safetensors`` with every tensor vLLM's loader needs, the LM head
    included even where it is the target's (vLLM requires it and shares it back)."""
    spec = weights.spec
    tensors: dict[str, torch.Tensor] = {
        "fc.weight": weights.fc,
        "markov_head.markov_w1.weight": weights.markov_w1,
        "markov_head.markov_w2.weight": weights.markov_w2,
        "lm_head.weight": weights.lm_head,
        "d2t": weights.d2t,
    }
    if spec.norm_affine:
        tensors["hidden_norm.weight"] = _weight(weights.hidden_norm.weight, "hidden_norm")
        tensors["norm.weight"] = _weight(weights.final_norm.weight, "norm")
    for layer in weights.layers:
        q, kv = spec.q_size, spec.kv_size
        sources: dict[str, torch.Tensor | None] = {
            "q_proj": layer.qkv[:q],
            "k_proj": layer.qkv[q : q + kv],
            "v_proj": layer.qkv[q + kv : q + 2 * kv],
            "o_gate_proj": layer.qkv[q + 2 * kv :] if spec.use_attn_o_gate else None,
            "o_proj": layer.o_proj,
            "pre_qkv_norm": layer.pre_qkv_norm.weight,
            "post_attn_norm": layer.post_attn_norm.weight,
            "attn_gate": layer.attn_residual.gate,
            "pre_ffn_norm": layer.pre_ffn_norm.weight,
            "gate_proj": layer.gate_up[: spec.intermediate_size],
            "up_proj": layer.gate_up[spec.intermediate_size :],
            "down_proj": layer.down,
            "post_ffn_norm": layer.post_ffn_norm.weight,
            "ffn_gate": layer.ffn_residual.gate,
        }
        for suffix, (key, _, _) in draft_layer_tensor_table(spec).items():
            tensors[f"layers.{layer.index}.{suffix}"] = _weight(sources[key], f"layer {layer.index} {key}")
    if weights.confidence_weight is not None and weights.confidence_bias is not None:
        tensors["confidence_head.proj.weight"] = weights.confidence_weight
        tensors["confidence_head.proj.bias"] = weights.confidence_bias
    expected = {**draft_global_tensor_table(spec), **confidence_tensor_table(spec)}
    for i in range(spec.num_layers):
        expected.update({f"layers.{i}.{k}": (s, d) for k, (_, s, d) in draft_layer_tensor_table(spec).items()})
    for name, tensor in tensors.items():
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"cannot save {name}: {list(tensor.shape)} {tensor.dtype}, the checkpoint needs {list(shape)} {dtype}"
            )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(spec.to_config(), indent=2) + "\n")
    host = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
    save_file(host, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})


def _weight(tensor: torch.Tensor | None, what: str) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"cannot save the draft: {what} has no weight but its config needs one")
    return tensor


# ---------------------------------------------------------------------------- load


def load_draft_checkpoint(
    directory: str | Path, target: ModelWeights, device: torch.device | str | None = None
) -> DraftWeights:
    """``DraftWeights`` over ``target`` from a draft checkpoint directory: the spec
    from its ``config.json`` (checked against the target's), every tensor checked and
    copied to ``device`` (the target's by default), the LM head replaced by the
    target's where the two are equal (vLLM's sharing)."""
    directory = Path(directory)
    spec = DraftSpec.from_config(directory, target.spec)
    dev = torch.device(device) if device is not None else target.device
    files = _tensor_files(directory)
    required = {**draft_global_tensor_table(spec)}
    for i in range(spec.num_layers):
        required.update({f"layers.{i}.{k}": (s, d) for k, (_, s, d) in draft_layer_tensor_table(spec).items()})
    optional = confidence_tensor_table(spec) if spec.enable_confidence_head else {}
    for name in files:
        if name in required or name in optional or name in IGNORED:
            continue
        raise CheckpointError(
            f"unexpected tensor {name} in the draft checkpoint at {directory} (not in this draft's config)"
        )
    for name in required:
        if name not in files:
            hint = " (vLLM's Muse Spark DSpark loader requires it)" if name in ("lm_head.weight", "d2t") else ""
            raise CheckpointError(f"tensor {name} is missing from the draft checkpoint at {directory}{hint}")
    present_optional = [name for name in optional if name in files]
    if present_optional and len(present_optional) != len(optional):
        raise CheckpointError(f"the draft checkpoint at {directory} holds only part of the confidence head")

    def read(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with safe_open(str(files[name]), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"tensor {name} has shape {list(tensor.shape)}, expected {list(shape)} (draft checkpoint at {directory})"
            )
        if dtype == torch.int64:
            if tensor.dtype not in (torch.int32, torch.int64):
                raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}, expected an integer map")
        elif not tensor.dtype.is_floating_point:
            raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}, expected a floating tensor")
        return tensor.to(dev, dtype=dtype, copy=True)

    g = {name: read(name, *required[name]) for name in draft_global_tensor_table(spec)}
    layers = []
    for i in range(spec.num_layers):
        tensors: dict[str, Any] = {
            key: read(f"layers.{i}.{suffix}", shape, dtype)
            for suffix, (key, shape, dtype) in draft_layer_tensor_table(spec).items()
        }
        layers.append(make_draft_layer(spec, i, tensors))
    confidence = {name: read(name, *optional[name]) for name in present_optional}
    return make_draft_weights(
        spec,
        target,
        fc=g["fc.weight"],
        hidden_norm=g.get("hidden_norm.weight"),
        layers=layers,
        final_norm=g.get("norm.weight"),
        markov_w1=g["markov_head.markov_w1.weight"],
        markov_w2=g["markov_head.markov_w2.weight"],
        lm_head=g["lm_head.weight"],
        d2t=g["d2t"],
        confidence_weight=confidence.get("confidence_head.proj.weight"),
        confidence_bias=confidence.get("confidence_head.proj.bias"),
    )


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (the index's weight_map, or
    every ``*.safetensors`` file's header)."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} has no readable weight_map: {e}") from e
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no {INDEX_NAME} and no *.safetensors files in {directory}")
    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if name in out:
                    raise CheckpointError(f"tensor {name} is in both {out[name].name} and {path.name} in {directory}")
                out[name] = path
    return out
