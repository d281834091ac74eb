"""The model spec: every number of Muse Spark's text model the step depends on.

Read from a checkpoint's ``config.json`` (the multimodal form nests the text
model under ``text_config``) or from a preset. Every field is validated: a
missing or wrong field raises ``SpecError`` naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


class SpecError(ValueError):
    """A Muse Spark config that is missing a field or holds a wrong value."""


FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class ModelSpec:
    """Muse Spark text-model hyper-parameters (names as in ``text_config``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    layer_rope_theta: tuple[float, ...]
    num_local_experts: int
    num_experts_per_tok: int
    moe_hidden_size: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    qk_scale_factor: float
    output_multiplier: float
    final_logit_softcapping: float
    rms_norm_eps: float
    post_norm_eps: float
    residual_gate_temperature: float
    vocab_size: int
    max_position_embeddings: int

    def __post_init__(self) -> None:
        _validate(self)

    # Derived shapes, named as MUSE_SPARK.md names them.
    @property
    def H(self) -> int:  # noqa: N802 - the formula's name
        return self.hidden_size

    @property
    def P(self) -> int:  # noqa: N802
        return self.moe_hidden_size

    @property
    def I(self) -> int:  # noqa: E743, N802
        return self.moe_intermediate_size

    @property
    def E(self) -> int:  # noqa: N802
        return self.num_local_experts

    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_scale_factor / sqrt(head_dim), as vLLM folds it."""
        return self.head_dim**-0.5 * self.qk_scale_factor

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def window(self, layer: int) -> int | None:
        """Keys a query sees on this layer, counting itself; None on full layers."""
        return self.sliding_window if self.is_sliding(layer) else None

    def uses_rope(self, layer: int) -> bool:
        return self.layer_rope_theta[layer] > 0

    def with_layers(self, num_layers: int) -> ModelSpec:
        """The same model cut to its first ``num_layers`` layers."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise SpecError(f"num_hidden_layers override {num_layers} is outside 1..{self.num_hidden_layers}")
        return replace(
            self,
            num_hidden_layers=num_layers,
            layer_types=self.layer_types[:num_layers],
            layer_rope_theta=self.layer_rope_theta[:num_layers],
        )

    def to_config(self) -> dict[str, Any]:
        """The ``text_config`` dict of this spec (what ``from_config`` reads)."""
        out = asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["layer_rope_theta"] = list(self.layer_rope_theta)
        out.update(_FIXED)
        out["mlp_layer_types"] = ["sparse"] * self.num_hidden_layers
        return out

    def key(self) -> str:
        """A stable text key of every field (for caches)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_config(cls, config: dict[str, Any] | str | Path) -> ModelSpec:
        """A spec from a config dict, a config.json path, or a checkpoint directory."""
        if isinstance(config, (str, Path)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            config = read_json(path, SpecError, "no Muse Spark config at")
        if not isinstance(config, dict):
            raise SpecError(f"a Muse Spark config must be a dict, got {type(config).__name__}")
        text = config.get("text_config", config)
        if not isinstance(text, dict):
            raise SpecError("text_config must be a dict")
        if config.get("tie_word_embeddings", False) is not False:
            raise SpecError(f"tie_word_embeddings must be False for Muse Spark, got {config['tie_word_embeddings']!r}")
        for name, value in _FIXED.items():
            if name in text and text[name] != value:
                raise SpecError(f"{name} must be {value!r} for Muse Spark, got {text[name]!r}")
        for key in ("rope_parameters", "rope_scaling"):
            _check_rope(key, text.get(key))
        if "mlp_layer_types" in text:
            kinds = text["mlp_layer_types"]
            if not isinstance(kinds, list) or any(k not in ("sparse", "dense") for k in kinds):
                raise SpecError(f"mlp_layer_types must be a list of 'sparse'/'dense', got {kinds!r}")
            if any(k != "sparse" for k in kinds):
                raise SpecError("mlp_layer_types: dense MLP layers are not supported (every layer must be 'sparse')")
        values: dict[str, Any] = {}
        for name, kind in _FIELDS.items():
            if name not in text:
                raise SpecError(f"config is missing {name}")
            values[name] = _coerce(name, text[name], kind)
        spec = cls(**values)
        kinds = text.get("mlp_layer_types")
        if kinds is not None and len(kinds) != spec.num_hidden_layers:
            raise SpecError(f"mlp_layer_types has {len(kinds)} entries for {spec.num_hidden_layers} layers")
        return spec

    @classmethod
    def preset(cls, name: str, num_layers: int | None = None) -> ModelSpec:
        """``tiny`` or ``muse-spark-open``, optionally cut to ``num_layers``."""
        try:
            make = PRESETS[name]
        except KeyError:
            raise SpecError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None
        return make(num_layers)


# Fields fixed for Muse Spark: present-and-different is an error.
_FIXED: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "num_shared_experts": 0,
    "tie_word_embeddings": False,
}

_FIELDS: dict[str, type] = {
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "layer_types": tuple,
    "sliding_window": int,
    "layer_rope_theta": tuple,
    "num_local_experts": int,
    "num_experts_per_tok": int,
    "moe_hidden_size": int,
    "moe_intermediate_size": int,
    "routed_scaling_factor": float,
    "qk_scale_factor": float,
    "output_multiplier": float,
    "final_logit_softcapping": float,
    "rms_norm_eps": float,
    "post_norm_eps": float,
    "residual_gate_temperature": float,
    "vocab_size": int,
    "max_position_embeddings": int,
}


def _coerce(name: str, value: Any, kind: type) -> Any:
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{name} must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{name} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, (list, tuple)):
        raise SpecError(f"{name} must be a list, got {value!r}")
    if name == "layer_rope_theta":  # numbers as floats, so equal specs have equal keys
        return tuple(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value)
    return tuple(value)


def _validate(s: ModelSpec) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise SpecError(message)

    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "sliding_window",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_hidden_size",
        "moe_intermediate_size",
        "vocab_size",
        "max_position_embeddings",
    ):
        value = getattr(s, name)
        need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
    for name in (
        "routed_scaling_factor",
        "qk_scale_factor",
        "output_multiplier",
        "final_logit_softcapping",
        "rms_norm_eps",
        "post_norm_eps",
        "residual_gate_temperature",
    ):
        value = getattr(s, name)
        need(math.isfinite(value) and value > 0, f"{name} must be a positive finite number, got {value!r}")
    need(s.head_dim % 2 == 0, f"head_dim must be even (RoPE pairs), got {s.head_dim}")
    need(
        s.num_attention_heads * s.head_dim == s.hidden_size,
        f"num_attention_heads x head_dim ({s.num_attention_heads} x {s.head_dim}) must equal hidden_size {s.hidden_size}",
    )
    need(
        s.num_attention_heads % s.num_key_value_heads == 0,
        f"num_attention_heads {s.num_attention_heads} must be a multiple of num_key_value_heads {s.num_key_value_heads}",
    )
    need(
        s.num_experts_per_tok <= s.num_local_experts,
        f"num_experts_per_tok {s.num_experts_per_tok} exceeds num_local_experts {s.num_local_experts}",
    )
    need(
        len(s.layer_types) == s.num_hidden_layers,
        f"layer_types has {len(s.layer_types)} entries for {s.num_hidden_layers} layers",
    )
    bad = [t for t in s.layer_types if t not in (FULL, SLIDING)]
    need(not bad, f"layer_types must be {FULL!r} or {SLIDING!r}, got {bad[:1]}")
    need(
        len(s.layer_rope_theta) == s.num_hidden_layers,
        f"layer_rope_theta has {len(s.layer_rope_theta)} entries for {s.num_hidden_layers} layers",
    )
    for layer, (kind, theta) in enumerate(zip(s.layer_types, s.layer_rope_theta)):
        need(
            isinstance(theta, (int, float)) and not isinstance(theta, bool) and theta >= 0,
            f"layer_rope_theta[{layer}] must be a number >= 0, got {theta!r}",
        )
        # Muse Spark: RoPE on sliding layers only, NoPE (theta 0) on full layers.
        need(
            (theta > 0) == (kind == SLIDING),
            f"layer_rope_theta[{layer}] = {theta} does not match layer_types[{layer}] = {kind!r} "
            "(RoPE on sliding layers only)",
        )
    need(
        s.sliding_window < s.max_position_embeddings,
        f"sliding_window {s.sliding_window} must be below max_position_embeddings {s.max_position_embeddings}",
    )


def read_json(path: Path, error: type[Exception], missing: str = "no such file:") -> Any:
    """A JSON file's value, or ``error`` naming the file: missing, unreadable (a
    folder, no permission), not UTF-8 text, or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise error(f"{missing} {path}") from e
    except OSError as e:
        raise error(f"cannot read {path}: {e}") from e
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError
        raise error(f"{path} is not valid JSON: {e}") from e


def _check_rope(key: str, rope: Any) -> None:
    """Muse Spark's RoPE is the default one (vLLM refuses any other type): a config
    asking for scaling (``rope_scaling``, or ``rope_parameters`` whole or per layer
    type, as transformers writes it) is refused rather than run unscaled."""
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise SpecError(f"{key} must be a dict, got {rope!r}")
    per_type = [(f"{key}.{name}", v) for name, v in rope.items() if isinstance(v, dict)]
    for where, params in per_type or [(key, rope)]:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise SpecError(f"{where}: rope type {kind!r}: Muse Spark's RoPE is 'default' (no scaling)")


def _layer_types(num_layers: int) -> tuple[str, ...]:
    return tuple(FULL if layer % 4 == 1 else SLIDING for layer in range(num_layers))


def _muse_spark_open(num_layers: int | None = None) -> ModelSpec:
    types = _layer_types(62)
    spec = ModelSpec(
        hidden_size=8192,
        num_hidden_layers=62,
        num_attention_heads=128,
        num_key_value_heads=16,
        head_dim=64,
        layer_types=types,
        sliding_window=2048,
        layer_rope_theta=tuple(0.0 if t == FULL else 500000.0 for t in types),
        num_local_experts=256,
        num_experts_per_tok=8,
        moe_hidden_size=4096,
        moe_intermediate_size=4096,
        routed_scaling_factor=1.0,
        qk_scale_factor=5.4730064863875,
        output_multiplier=2.0**-2.5,
        final_logit_softcapping=20.0,
        rms_norm_eps=1e-5,
        post_norm_eps=1e-8,
        residual_gate_temperature=0.3,
        vocab_size=202048,
        max_position_embeddings=1048576,
    )
    return spec if num_layers is None else spec.with_layers(num_layers)


def _tiny(num_layers: int | None = None) -> ModelSpec:
    """Small widths with every shape relation of the real model: GQA 8, head_dim 64,
    P = I = H / 2, top-k of E, window below the context, full layers at l % 4 == 1.
    Any layer count keeps the layer pattern."""
    if num_layers is not None and num_layers < 1:
        raise SpecError(f"num_hidden_layers override {num_layers} must be at least 1")
    types = _layer_types(4 if num_layers is None else num_layers)
    return replace(
        _muse_spark_open(),
        hidden_size=1024,
        num_hidden_layers=len(types),
        num_attention_heads=16,
        num_key_value_heads=2,
        layer_types=types,
        sliding_window=64,
        layer_rope_theta=tuple(0.0 if t == FULL else 10000.0 for t in types),
        num_local_experts=16,
        num_experts_per_tok=4,
        moe_hidden_size=512,
        moe_intermediate_size=512,
        vocab_size=1024,
        max_position_embeddings=4096,
    )


def _tiny_tp8(num_layers: int | None = None) -> ModelSpec:
    """The narrowest spec that shards over 8 ranks with GQA 8 and head_dim 64 (vLLM
    does not replicate Muse Spark's KV heads, so TP 8 needs 8 of them): H 4096,
    64 / 8 heads; small experts (E 16 of I 256, top-4) keep it cheap on a CPU."""
    return replace(
        _tiny(2 if num_layers is None else num_layers),
        hidden_size=4096,
        num_attention_heads=64,
        num_key_value_heads=8,
        moe_hidden_size=2048,
        moe_intermediate_size=256,
    )


PRESETS = {"tiny": _tiny, "tiny-tp8": _tiny_tp8, "muse-spark-open": _muse_spark_open}
