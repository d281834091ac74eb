"""The DSpark draft's spec: every number of the Muse Spark draft the draft step depends on.

Read from the draft checkpoint's ``config.json`` (vLLM 0.33's ``MuseSparkDSparkConfig``,
``model_type`` ``muse_spark_dspark``) against the target's ``ModelSpec``, or from a
preset. Every field is validated: a missing or wrong field raises ``DraftSpecError``
naming it.

What vLLM derives from the config, and this spec derives the same way:

- vLLM builds the draft's layers under the prefix ``layers.{i + target layers}``
  (``MuseSparkDSparkForCausalLM`` passes the target's layer count as
  ``start_layer_id``), so draft layer i has the layer index ``L = layer_offset + i``
  everywhere a layer index enters the math: the sliding window (``global_attn_cfg``
  indexed by ``count_backward_layer_id``), the NoPE cycle (``every_n_layers_nope``),
  the post-norm gain centres (residual ids ``2L + 1`` and ``2L + 2``) and whether a
  layer is dense (``moe``);
- the softmax scale ``head_dim^-0.5 * s`` with ``s = 3.87`` (``use_sqrt_attn_scaling``)
  or ``43.7840518911 / sqrt(head_dim)`` (QK norm on; required, below);
- the output multiplier of the logits from ``metap`` (``(hidden_size / base_width)^-1``
  under muP, ``^-0.5`` under SP, 1 without metap) and the soft cap
  ``output_soft_cap_temp``;
- the residual gates' temperature: 0.3 for every draft (vLLM hard-codes it; the
  config's ``residual_gate_temperature`` is not read);
- the intermediate width ``int(ffn_dim_multiplier * hidden_size)``;
- the aux layers the draft reads: ``target_layer_ids`` + 1 (vLLM's dense-DSpark
  convention: the stream entering that target layer; 0 is the embedding stream, the
  target's layer count the final stream), concatenated in ascending layer order.

Configs vLLM would refuse or misread are refused here: MoE draft layers, positional
modes that differ between layers, drafts without QK norm (vLLM's context K/V path
reads the QK norm's epsilon), a hidden size or vocabulary other than the target's
(the draft embeds with the target's embedding table).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..spec import ModelSpec, SpecError, read_json

MODEL_TYPE = "muse_spark_dspark"
ARCHITECTURE = "MuseSparkDSparkModel"
RESIDUAL_DTYPES = ("bf16", "fp32")
GAIN_CENTER_TYPES = (
    "one",
    "zero",
    "inverse_residual_index",
    "inverse_residual_index_v2",
    "inverse_residual_index_p1",
    "inverse_sqrt_residual_index",
)
# vLLM's residual gate temperature for every draft layer (MuseSpark1xDecoderLayer).
DRAFT_GATE_TEMPERATURE = 0.3
# Head widths vLLM's fused QK-norm + RoPE + KV-insert kernel takes.
FUSED_QK_HEAD_DIMS = (64, 128, 256)


class DraftSpecError(SpecError):
    """A DSpark draft config that is missing a field or holds a wrong value."""


def gain_center(kind: str, residual_id: int) -> float:
    """vLLM's ``calculate_gain_center`` (1-based residual ids)."""
    if kind == "one":
        return 1.0
    if kind == "zero":
        return 0.0
    if kind == "inverse_residual_index":
        return 1.0 / (2 * math.ceil(residual_id / 2))
    if kind in ("inverse_residual_index_v2", "inverse_residual_index_p1"):
        return 1.0 / (residual_id + 1)
    if kind == "inverse_sqrt_residual_index":
        return 1.0 / math.sqrt(2 * math.ceil(residual_id / 2))
    raise DraftSpecError(f"post_norm_gain_center_type {kind!r} is not one of {', '.join(GAIN_CENTER_TYPES)}")


@dataclass(frozen=True)
class DraftSpec:
    """Muse Spark DSpark draft hyper-parameters (names as in the draft's config.json)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_dim_multiplier: float
    vocab_size: int
    draft_vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rms_post_norm_eps: float | None
    norm_affine: bool
    post_norm_affine: bool
    norm_zero_centered_gamma: bool
    post_norm_gain_center_type: str
    use_ffn_learnable_scales: bool
    use_qk_norm: bool
    use_attn_o_gate: bool
    use_attn_o_norm: bool
    use_sqrt_attn_scaling: bool
    use_residual_gate: bool
    residual_dtype: str
    use_rope: bool
    rope_theta: float
    rope_use_fp32_in_outer_product: bool
    every_n_layers_nope: int | None
    global_attn_cfg: tuple[int | str, ...] | None
    attn_temperature_tuning_floor_scale: float | None
    attn_temperature_tuning_q_scale_constant: float | None
    attn_temperature_tuning_layers: str | None
    use_metap: bool
    metap_mode: str
    metap_base_width: float
    metap_router_has_one_inf_dim: bool
    output_soft_cap_temp: float | None
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    sample_from_anchor: bool
    dspark_draft_topk: int | None
    # vLLM's layer index of draft layer 0: the target's num_hidden_layers.
    layer_offset: int
    target_num_layers: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        _validate(self)

    # Derived shapes.
    @property
    def H(self) -> int:  # noqa: N802 - the formula's name
        return self.hidden_size

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def intermediate_size(self) -> int:
        """vLLM's ``intermediate_size_mlp``: ``int(ffn_dim_multiplier * hidden_size)``."""
        return int(self.ffn_dim_multiplier * self.hidden_size)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused projection: [q | k | v] and the o-gate's q rows when on."""
        return 2 * self.q_size + 2 * self.kv_size if self.use_attn_o_gate else self.q_size + 2 * self.kv_size

    @property
    def post_norm_eps(self) -> float:
        return self.rms_post_norm_eps or self.rms_norm_eps

    @property
    def residual_torch_dtype(self) -> Any:
        import torch

        return torch.bfloat16 if self.residual_dtype == "bf16" else torch.float32

    @property
    def softmax_scale(self) -> float:
        """``head_dim^-0.5 * scale_query_by``, multiplied as vLLM multiplies it."""
        scaling = self.head_dim**-0.5
        scaling *= 3.87 if self.use_sqrt_attn_scaling else 43.7840518911 / math.sqrt(self.head_dim)
        return scaling

    @property
    def output_multiplier(self) -> float:
        """The logit multiplier of ``MuseSparkDSparkForCausalLM`` (from ``metap``)."""
        if not (self.use_metap and self.metap_router_has_one_inf_dim):
            return 1.0
        width_mult = self.hidden_size / self.metap_base_width
        return width_mult**-1 if self.metap_mode == "mup" else width_mult**-0.5

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose entering stream the draft reads, ascending (the
        order vLLM concatenates them in before ``fc``)."""
        return tuple(sorted(i + 1 for i in self.target_layer_ids))

    @property
    def fc_input_size(self) -> int:
        return self.target_hidden_size * len(self.target_layer_ids)

    def layer_index(self, layer: int) -> int:
        """vLLM's index of draft layer ``layer`` (after the target's layers)."""
        return self.layer_offset + layer

    def _count_backward(self, layer: int) -> int:
        index = self.layer_index(layer)
        n = self.every_n_layers_nope
        return index if n is None else index + (n - self.num_hidden_layers % n)

    def window(self, layer: int) -> int | None:
        """Keys a query sees on this layer, counting itself; None on full layers."""
        cfg = self.global_attn_cfg
        if not cfg:
            return None
        entry = cfg[self._count_backward(layer) % len(cfg)]
        return entry if isinstance(entry, int) and not isinstance(entry, bool) and entry > 0 else None

    def uses_rope_at(self, layer: int) -> bool:
        """vLLM's per-layer RoPE decision (validated equal to ``use_rope`` for every layer)."""
        n = self.every_n_layers_nope
        if n is None:
            return self.use_rope
        return self.use_rope and (self.num_hidden_layers - self.layer_index(layer) - 1) % n != 0

    def temperature_tuning(self, layer: int) -> bool:
        """Whether this layer scales its queries by position (global layers only)."""
        return (
            self.attn_temperature_tuning_floor_scale is not None
            and self.attn_temperature_tuning_q_scale_constant is not None
            and self.attn_temperature_tuning_layers == "global"
            and self.window(layer) is None
        )

    def fused_qk_rope(self, layer: int) -> bool:
        """Whether vLLM runs this layer's QK norm, RoPE and K/V insert as its fused
        kernel (fp32 rotation, one rounding): no temperature tuning and a head width
        the kernel takes. Otherwise the rotation is vLLM's bf16 rotary op."""
        return not self.temperature_tuning(layer) and self.head_dim in FUSED_QK_HEAD_DIMS

    def query_rope_table_bf16(self, layer: int) -> bool:
        """Whether this layer's queries rotate with a bf16-rounded cos/sin table.

        vLLM builds every layer's table in fp32 (``rope_use_fp32_in_outer_product``,
        else rounded to bf16). Its context K/V path rotates every layer's keys through
        layer 0's rotary module, whose ``forward_cuda`` replaces that module's table
        with a bf16 copy at the first call, before any graph is captured; the fused
        kernel of layer 0 then reads the bf16 table."""
        return layer == 0 or not self.rope_use_fp32_in_outer_product

    def pre_norm_center(self) -> float | None:
        """Gain centre of the pre-norms, hidden norm and final norm (None: the weight
        is used as stored)."""
        return 1.0 if self.norm_zero_centered_gamma else None

    def post_norm_center(self, layer: int, which: str) -> float | None:
        """Gain centre of ``post_attn_norm`` (``which="attn"``, residual id 2L + 1) or
        ``post_ffn_norm`` (``"ffn"``, 2L + 2)."""
        if not self.norm_zero_centered_gamma:
            return None
        residual_id = 2 * self.layer_index(layer) + (1 if which == "attn" else 2)
        return gain_center(self.post_norm_gain_center_type, residual_id)

    @property
    def post_attn_norm_has_weight(self) -> bool:
        return self.post_norm_affine

    @property
    def post_ffn_norm_has_weight(self) -> bool:
        return True if self.use_ffn_learnable_scales else self.post_norm_affine

    def with_layers(self, num_layers: int) -> DraftSpec:
        """The same draft cut to its first ``num_layers`` layers (the layer indices,
        and so the windows and gain centres, are kept)."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise DraftSpecError(f"num_hidden_layers override {num_layers} is outside 1..{self.num_hidden_layers}")
        return replace(self, num_hidden_layers=num_layers)

    def key(self) -> str:
        """A stable text key of every field (for caches)."""
        out = asdict(self)
        out.pop("extra")
        return json.dumps(out, sort_keys=True)

    def to_config(self) -> dict[str, Any]:
        """The draft's ``config.json`` (what ``from_config`` reads and vLLM's
        ``MuseSparkDSparkConfig`` takes)."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        out.update(self.extra)
        for name in _FIELDS:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        out["metap"] = {
            "use_metap": self.use_metap,
            "metap_mode": self.metap_mode,
            "base_width": self.metap_base_width,
            "router_has_one_inf_dim": self.metap_router_has_one_inf_dim,
        }
        out["moe"] = {"is_enabled": False}
        out["non_linearity"] = "swiglu"
        out["tie_word_embeddings"] = False
        return out

    @classmethod
    def from_config(cls, config: dict[str, Any] | str | Path, target: ModelSpec) -> DraftSpec:
        """A draft spec from a config dict, a config.json path or a checkpoint
        directory, checked against the target it drafts for."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            config = read_json(path, DraftSpecError, "no DSpark draft config at")
        if not isinstance(config, dict):
            raise DraftSpecError(f"a DSpark draft config must be a dict, got {type(config).__name__}")
        return cls(**_read(config, target))

    @classmethod
    def preset(cls, name: str, target: ModelSpec | None = None, num_layers: int | None = None) -> DraftSpec:
        """``tiny`` (for ``ModelSpec.preset("tiny")``) or ``muse-spark-open`` (for the
        released target), optionally cut to ``num_layers``; ``target`` defaults to the
        preset's own target."""
        try:
            make = PRESETS[name]
        except KeyError:
            raise DraftSpecError(f"unknown draft preset {name!r}; presets: {', '.join(PRESETS)}") from None
        spec = make(target)
        return spec if num_layers is None else spec.with_layers(num_layers)


# Config fields read into the spec, written back by ``to_config`` (metap and moe apart).
_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "ffn_dim_multiplier",
    "vocab_size",
    "draft_vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rms_post_norm_eps",
    "norm_affine",
    "post_norm_affine",
    "norm_zero_centered_gamma",
    "post_norm_gain_center_type",
    "use_ffn_learnable_scales",
    "use_qk_norm",
    "use_attn_o_gate",
    "use_attn_o_norm",
    "use_sqrt_attn_scaling",
    "use_residual_gate",
    "residual_dtype",
    "use_rope",
    "rope_theta",
    "rope_use_fp32_in_outer_product",
    "every_n_layers_nope",
    "global_attn_cfg",
    "attn_temperature_tuning_floor_scale",
    "attn_temperature_tuning_q_scale_constant",
    "attn_temperature_tuning_layers",
    "output_soft_cap_temp",
    "target_hidden_size",
    "target_layer_ids",
    "mask_token_id",
    "markov_rank",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "sample_from_anchor",
    "dspark_draft_topk",
)

# MuseSpark1xTextConfig's defaults for the fields a draft config may leave out.
_DEFAULTS: dict[str, Any] = {
    "ffn_dim_multiplier": 1.0,
    "rms_norm_eps": 1e-5,
    "rms_post_norm_eps": None,
    "norm_affine": True,
    "post_norm_affine": True,
    "norm_zero_centered_gamma": False,
    "post_norm_gain_center_type": "one",
    "use_ffn_learnable_scales": False,
    "use_qk_norm": True,
    "use_attn_o_gate": False,
    "use_attn_o_norm": False,
    "use_sqrt_attn_scaling": False,
    "use_residual_gate": False,
    "residual_dtype": "bf16",
    "use_rope": True,
    "rope_theta": 500000.0,
    "rope_use_fp32_in_outer_product": True,
    "every_n_layers_nope": None,
    "global_attn_cfg": None,
    "attn_temperature_tuning_floor_scale": None,
    "attn_temperature_tuning_q_scale_constant": None,
    "attn_temperature_tuning_layers": None,
    "output_soft_cap_temp": None,
    "enable_confidence_head": False,
    "confidence_head_with_markov": False,
    "sample_from_anchor": True,
    "dspark_draft_topk": None,
    "max_position_embeddings": 4096 * 32,
}
DEFAULT_KV_HEADS = 8
_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "vocab_size",
    "target_layer_ids",
    "markov_rank",
)
_INTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "draft_vocab_size",
    "max_position_embeddings",
    "target_hidden_size",
    "mask_token_id",
    "markov_rank",
)
_OPTIONAL_INTS = ("every_n_layers_nope", "dspark_draft_topk")
_FLOATS = ("ffn_dim_multiplier", "rms_norm_eps", "rope_theta")
_OPTIONAL_FLOATS = (
    "rms_post_norm_eps",
    "attn_temperature_tuning_floor_scale",
    "attn_temperature_tuning_q_scale_constant",
    "output_soft_cap_temp",
)
_BOOLS = (
    "norm_affine",
    "post_norm_affine",
    "norm_zero_centered_gamma",
    "use_ffn_learnable_scales",
    "use_qk_norm",
    "use_attn_o_gate",
    "use_attn_o_norm",
    "use_sqrt_attn_scaling",
    "use_residual_gate",
    "use_rope",
    "rope_use_fp32_in_outer_product",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "sample_from_anchor",
)
# Fields that would move the draft's aux layers away from target_layer_ids in vLLM.
_AUX_OVERRIDES = ("eagle_aux_hidden_state_layer_ids", "dspark_target_layer_ids")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_global_attn_cfg(value: Any) -> tuple[int | str, ...] | None:
    """vLLM's parsing: "all" or None (every layer global), a list, or its string form
    "[2048, 0, gdn2]"."""
    if value is None or value == "all":
        return None
    if isinstance(value, str):
        if not (value.startswith("[") and value.endswith("]")):
            raise DraftSpecError(f"global_attn_cfg must be 'all', a list or '[...]', got {value!r}")
        items: list[int | str] = []
        for item in value[1:-1].split(","):
            item = item.strip()
            try:
                items.append(int(item))
            except ValueError:
                items.append(item)
        return tuple(items)
    if not isinstance(value, (list, tuple)) or not value:
        raise DraftSpecError(f"global_attn_cfg must be 'all' or a non-empty list, got {value!r}")
    if any(not (_is_int(v) or isinstance(v, str)) for v in value):
        raise DraftSpecError(f"global_attn_cfg entries must be window sizes (integers) or names, got {value!r}")
    return tuple(value)


def _read(config: dict[str, Any], target: ModelSpec) -> dict[str, Any]:
    """The spec's fields from a draft config (defaults as vLLM's config class has them)."""
    model_type = config.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise DraftSpecError(f"model_type must be {MODEL_TYPE!r} for a Muse Spark DSpark draft, got {model_type!r}")
    if config.get("non_linearity", "swiglu") != "swiglu":
        raise DraftSpecError(f"non_linearity must be 'swiglu', got {config['non_linearity']!r}")
    if config.get("tie_word_embeddings", False) is not False:
        raise DraftSpecError(f"tie_word_embeddings must be False, got {config['tie_word_embeddings']!r}")
    for name in _AUX_OVERRIDES:
        if config.get(name):
            raise DraftSpecError(f"{name} is not supported: the draft's aux layers come from target_layer_ids")
    dflash = config.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise DraftSpecError(f"dflash_config must be a dict, got {dflash!r}")
    if dflash.get("target_layer_ids"):
        raise DraftSpecError(
            "dflash_config.target_layer_ids is not supported: the draft's aux layers come from target_layer_ids"
        )
    for name in _REQUIRED:
        if name not in config:
            raise DraftSpecError(f"draft config is missing {name}")
    values: dict[str, Any] = {name: config.get(name, _DEFAULTS.get(name)) for name in _FIELDS}
    # vLLM's MuseSpark1xTextConfig: 8 when absent, the query heads when null.
    values["num_key_value_heads"] = config.get("num_key_value_heads", DEFAULT_KV_HEADS)
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = config["num_attention_heads"]
    values["draft_vocab_size"] = config.get("draft_vocab_size") or config["vocab_size"]
    values["target_hidden_size"] = config.get("target_hidden_size") or config["hidden_size"]
    # vLLM's mask (parallel drafting) token: dflash_config's first, then the top level.
    mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        raise DraftSpecError("draft config is missing mask_token_id")
    values["mask_token_id"] = mask
    position_mode = config.get("draft_position_mode")
    if position_mode is not None:
        if position_mode not in ("rope", "nope"):
            raise DraftSpecError(f"draft_position_mode must be 'rope' or 'nope', got {position_mode!r}")
        values["use_rope"] = position_mode == "rope"
    values["global_attn_cfg"] = _parse_global_attn_cfg(values["global_attn_cfg"])
    if config.get("every_n_layers_global") is not None and values["global_attn_cfg"] is not None:
        raise DraftSpecError("every_n_layers_global and global_attn_cfg cannot be set together")

    metap = config.get("metap") or {}
    if not isinstance(metap, dict):
        raise DraftSpecError(f"metap must be a dict, got {metap!r}")
    values["use_metap"] = metap.get("use_metap", False)
    values["metap_mode"] = metap.get("metap_mode", "mup")
    values["metap_base_width"] = metap.get("base_width", 256)
    values["metap_router_has_one_inf_dim"] = metap.get("router_has_one_inf_dim", True)

    moe = config.get("moe") or {}
    if not isinstance(moe, dict):
        raise DraftSpecError(f"moe must be a dict, got {moe!r}")
    for name, value in values.items():
        if name in _INTS and not _is_int(value):
            raise DraftSpecError(f"{name} must be an integer, got {value!r}")
        if name in _OPTIONAL_INTS and value is not None and not _is_int(value):
            raise DraftSpecError(f"{name} must be an integer or null, got {value!r}")
        if name in _FLOATS:
            if not _is_number(value):
                raise DraftSpecError(f"{name} must be a number, got {value!r}")
            values[name] = float(value)
        if name in _OPTIONAL_FLOATS and value is not None:
            if not _is_number(value):
                raise DraftSpecError(f"{name} must be a number or null, got {value!r}")
            values[name] = float(value)
        if name in _BOOLS and not isinstance(value, bool):
            raise DraftSpecError(f"{name} must be true or false, got {value!r}")
    if not isinstance(values["use_metap"], bool) or not isinstance(values["metap_router_has_one_inf_dim"], bool):
        raise DraftSpecError("metap.use_metap and metap.router_has_one_inf_dim must be true or false")
    if not _is_number(values["metap_base_width"]):
        raise DraftSpecError(f"metap.base_width must be a number, got {values['metap_base_width']!r}")
    values["metap_base_width"] = float(values["metap_base_width"])
    ids = values["target_layer_ids"]
    if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) for i in ids):
        raise DraftSpecError(f"target_layer_ids must be a non-empty list of integers, got {ids!r}")
    values["target_layer_ids"] = tuple(ids)
    values["layer_offset"] = target.num_layers
    values["target_num_layers"] = target.num_layers
    values["extra"] = {k: v for k, v in config.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}

    _check_dense(moe, values)
    _check_target(values, target)
    return values


def _check_dense(moe: dict[str, Any], values: dict[str, Any]) -> None:
    """Every draft layer dense, by vLLM's rule at the draft's layer indices."""
    enabled = moe.get("is_enabled", True)
    step = moe.get("interleave_moe_layer_step", 1)
    first = moe.get("n_dense_layers_before_moe", 0)
    if not isinstance(enabled, bool) or not _is_int(step) or not _is_int(first):
        raise DraftSpecError(
            f"moe.is_enabled, interleave_moe_layer_step, n_dense_layers_before_moe are malformed: {moe!r}"
        )
    for layer in range(values["num_hidden_layers"]):
        index = values["layer_offset"] + layer
        if enabled and step > 0 and (index + 1) % step == 0 and index >= first:
            raise DraftSpecError(
                f"moe: draft layer {layer} (vLLM layer index {index}) would be an MoE layer; "
                "the DSpark draft's layers are dense (set moe.is_enabled false)"
            )


def _check_target(values: dict[str, Any], target: ModelSpec) -> None:
    """What the draft must share with its target."""
    if values["hidden_size"] != target.hidden_size:
        raise DraftSpecError(
            f"hidden_size {values['hidden_size']} must equal the target's {target.hidden_size} "
            "(the draft embeds its tokens with the target's embedding table)"
        )
    if values["target_hidden_size"] != target.hidden_size:
        raise DraftSpecError(
            f"target_hidden_size {values['target_hidden_size']} must equal the target's hidden_size {target.hidden_size}"
        )
    if values["vocab_size"] != target.vocab_size:
        raise DraftSpecError(
            f"vocab_size {values['vocab_size']} must equal the target's {target.vocab_size} "
            "(the draft's embedding and Markov rows are target token ids)"
        )
    bad = [i for i in values["target_layer_ids"] if not -1 <= i < target.num_layers]
    if bad:
        raise DraftSpecError(f"target_layer_ids {bad} are outside -1..{target.num_layers - 1} (the target's layers)")


def _validate(s: DraftSpec) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise DraftSpecError(message)

    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "draft_vocab_size",
        "max_position_embeddings",
        "target_hidden_size",
        "markov_rank",
        "target_num_layers",
    ):
        value = getattr(s, name)
        need(_is_int(value) and value > 0, f"{name} must be a positive integer, got {value!r}")
    need(_is_int(s.layer_offset) and s.layer_offset >= 0, f"layer_offset must be >= 0, got {s.layer_offset!r}")
    for name in ("ffn_dim_multiplier", "rms_norm_eps", "rope_theta", "metap_base_width"):
        value = getattr(s, name)
        need(math.isfinite(value) and value > 0, f"{name} must be a positive finite number, got {value!r}")
    for name in ("rms_post_norm_eps", "output_soft_cap_temp", "attn_temperature_tuning_floor_scale"):
        value = getattr(s, name)
        need(value is None or (math.isfinite(value) and value > 0), f"{name} must be positive or null, got {value!r}")
    need(s.intermediate_size > 0, f"ffn_dim_multiplier {s.ffn_dim_multiplier} gives no intermediate width")
    need(s.head_dim % 2 == 0, f"head_dim must be even (RoPE pairs), got {s.head_dim}")
    need(
        s.num_attention_heads % s.num_key_value_heads == 0,
        f"num_attention_heads {s.num_attention_heads} must be a multiple of num_key_value_heads {s.num_key_value_heads}",
    )
    need(s.residual_dtype in RESIDUAL_DTYPES, f"residual_dtype must be 'bf16' or 'fp32', got {s.residual_dtype!r}")
    need(
        s.post_norm_gain_center_type in GAIN_CENTER_TYPES,
        f"post_norm_gain_center_type {s.post_norm_gain_center_type!r} is not one of {', '.join(GAIN_CENTER_TYPES)}",
    )
    need(s.metap_mode in ("mup", "sp"), f"metap.metap_mode must be 'mup' or 'sp', got {s.metap_mode!r}")
    need(
        s.use_qk_norm,
        "use_qk_norm must be true: vLLM's context K/V path normalizes the keys with the layers' QK norm",
    )
    need(
        s.every_n_layers_nope is None or s.every_n_layers_nope > 0,
        f"every_n_layers_nope must be positive or null, got {s.every_n_layers_nope!r}",
    )
    if s.every_n_layers_nope is not None:
        need(
            s.global_attn_cfg is not None and len(s.global_attn_cfg) == s.every_n_layers_nope,
            f"global_attn_cfg {s.global_attn_cfg!r} must have every_n_layers_nope ({s.every_n_layers_nope}) entries",
        )
    for layer in range(s.num_hidden_layers):
        need(
            s.uses_rope_at(layer) == s.use_rope,
            f"every_n_layers_nope {s.every_n_layers_nope} makes draft layer {layer} "
            f"{'NoPE' if s.use_rope else 'RoPE'} while use_rope is {s.use_rope}: "
            "vLLM requires every DSpark layer to share the positional mode",
        )
        window = s.window(layer)
        need(
            window is None or window < s.max_position_embeddings,
            f"global_attn_cfg window {window} must be below max_position_embeddings {s.max_position_embeddings}",
        )
    if s.attn_temperature_tuning_floor_scale is not None or s.attn_temperature_tuning_q_scale_constant is not None:
        q = s.attn_temperature_tuning_q_scale_constant
        need(
            q is None or math.isfinite(q),
            f"attn_temperature_tuning_q_scale_constant must be a finite number, got {q!r}",
        )
    need(
        0 <= s.mask_token_id < s.vocab_size,
        f"mask_token_id {s.mask_token_id} is outside the vocabulary (0..{s.vocab_size - 1})",
    )
    need(
        s.draft_vocab_size <= s.vocab_size,
        f"draft_vocab_size {s.draft_vocab_size} exceeds vocab_size {s.vocab_size}",
    )
    need(
        s.dspark_draft_topk is None or 1 <= s.dspark_draft_topk <= s.draft_vocab_size,
        f"dspark_draft_topk must be within 1..{s.draft_vocab_size} or null, got {s.dspark_draft_topk!r}",
    )
    ids = s.target_layer_ids
    need(len(set(ids)) == len(ids), f"target_layer_ids {list(ids)} repeat a layer")
    need(
        all(-1 <= i < s.target_num_layers for i in ids),
        f"target_layer_ids {list(ids)} are outside -1..{s.target_num_layers - 1} (the target's layers)",
    )


def _target_conventions(target: ModelSpec) -> dict[str, object]:
    """The draft config keys both presets share with the target: its hidden width,
    vocabulary and length, head_dim 64, dense SwiGLU at the default width, and its
    conventions (zero-centred pre-norms, weightless post-attention norm, input-scale
    post-FFN norm, QK norm, o-norm and o-gate, gated fp32 residual, RoPE, soft cap 20)."""
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": target.hidden_size,
        "head_dim": 64,
        "ffn_dim_multiplier": 1.0,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rms_post_norm_eps": 1e-8,
        "norm_affine": True,
        "post_norm_affine": False,
        "norm_zero_centered_gamma": True,
        "post_norm_gain_center_type": "one",
        "use_ffn_learnable_scales": True,
        "use_qk_norm": True,
        "use_attn_o_gate": True,
        "use_attn_o_norm": True,
        "use_residual_gate": True,
        "residual_dtype": "fp32",
        "use_rope": True,
        "output_soft_cap_temp": 20.0,
        "moe": {"is_enabled": False},
        "target_hidden_size": target.hidden_size,
    }


def _tiny(target: ModelSpec | None = None) -> DraftSpec:
    """A draft for ``ModelSpec.preset("tiny")``: its widths (H 1024, 16 / 2 heads of
    64, vocabulary 1024), two dense layers, the first sliding (window 64), the second
    full; the target's conventions (zero-centred pre-norms, weightless post-attention
    norm, input-scale post-FFN norm, gated fp32 residual, o-norm and o-gate) and its
    logit transform (2^-2.5 from metap SP at base width 32, soft cap 20)."""
    target = target or ModelSpec.preset("tiny")
    config = {
        **_target_conventions(target),
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        # Indexed by vLLM's layer index (4 and 5 after the tiny target's 4 layers).
        "global_attn_cfg": [64, 0],
        "metap": {"use_metap": True, "metap_mode": "sp", "base_width": target.hidden_size / 32},
        "target_layer_ids": sorted({0, target.num_layers // 2, target.num_layers - 1}),
        "mask_token_id": target.vocab_size - 1,
        "markov_rank": 32,
    }
    return DraftSpec.from_config(config, target)


def _muse_spark_open(target: ModelSpec | None = None) -> DraftSpec:
    """The draft for the released target, at the widths vLLM's code implies; the
    released draft config is not public, so what the code does not fix is assumed
    (marked below).

    Fixed by vLLM's code: hidden_size = the target's 8192 (the draft embeds with the
    target's table and may share its LM head), head_dim 64 (the QK-norm scale constant
    43.784 / sqrt(64) = 5.473 is the target's qk_scale_factor), the target's logit
    transform (metap SP at base width 256: 2^-2.5; soft cap 20), dense layers.
    Assumed: 5 layers (MUSE_SPARK.md), the target's 128 / 16 heads, intermediate
    width 8192 (vLLM's default ffn_dim_multiplier 1.0), markov_rank 256, every layer
    sliding with the target's window 2048, the target's norm conventions, five aux
    layers spread over the target, mask token id 200099."""
    target = target or ModelSpec.preset("muse-spark-open")
    config = {
        **_target_conventions(target),
        "num_hidden_layers": 5,
        "num_attention_heads": 128,
        "num_key_value_heads": 16,
        "rope_theta": 500000.0,
        "global_attn_cfg": [target.sliding_window],
        "metap": {"use_metap": True, "metap_mode": "sp", "base_width": 256},
        "target_layer_ids": [1, 15, 30, 44, 59] if target.num_layers == 62 else [0, target.num_layers - 1],
        "mask_token_id": 200099 if target.vocab_size > 200099 else target.vocab_size - 1,
        "markov_rank": 256,
    }
    return DraftSpec.from_config(config, target)


PRESETS = {"tiny": _tiny, "muse-spark-open": _muse_spark_open}
