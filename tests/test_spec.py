"""The model spec: presets, config parsing and validation."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkdecode.spec import _FIELDS, _FIXED, FULL, PRESETS, SLIDING, ModelSpec, SpecError


def tiny_config(**changes: Any) -> dict[str, Any]:
    config = ModelSpec.preset("tiny").to_config()
    config.update(changes)
    return config


def raises_naming(*parts: str):
    return pytest.raises(SpecError, match=".*".join(re.escape(p) for p in parts))


# Presets.


def test_muse_spark_open_preset() -> None:
    s = ModelSpec.preset("muse-spark-open")
    assert (s.hidden_size, s.H, s.num_hidden_layers, s.num_layers) == (8192, 8192, 62, 62)
    assert (s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (128, 16, 64)
    assert (s.q_size, s.kv_size) == (8192, 1024)
    assert s.sliding_window == 2048
    assert (s.num_local_experts, s.E, s.num_experts_per_tok, s.top_k) == (256, 256, 8, 8)
    assert (s.moe_hidden_size, s.P, s.moe_intermediate_size, s.I) == (4096, 4096, 4096, 4096)
    assert (s.rms_norm_eps, s.post_norm_eps) == (1e-5, 1e-8)
    assert s.final_logit_softcapping == 20.0
    assert s.output_multiplier == 2**-2.5
    assert s.residual_gate_temperature == 0.3
    assert s.vocab_size == 202048
    assert s.softmax_scale == pytest.approx(s.qk_scale_factor / 8)
    assert len(s.layer_types) == len(s.layer_rope_theta) == 62
    for layer in range(62):
        full = layer % 4 == 1
        assert s.layer_types[layer] == (FULL if full else SLIDING)
        assert s.layer_rope_theta[layer] == (0.0 if full else 500000.0)
        assert s.is_sliding(layer) is not full
        assert s.uses_rope(layer) is not full
        assert s.window(layer) == (None if full else 2048)


def test_tiny_preset_keeps_the_relations() -> None:
    s = ModelSpec.preset("tiny")
    assert s.num_layers == 4
    assert s.head_dim == 64
    assert s.num_attention_heads * s.head_dim == s.H
    assert s.num_attention_heads // s.num_key_value_heads == 8
    assert s.P == s.I == s.H // 2
    assert s.top_k < s.E
    assert s.sliding_window < s.max_position_embeddings
    assert s.layer_types == (SLIDING, FULL, SLIDING, SLIDING)
    assert [t > 0 for t in s.layer_rope_theta] == [True, False, True, True]
    # The numbers that do not set a shape are the real model's.
    real = ModelSpec.preset("muse-spark-open")
    for name in ("rms_norm_eps", "post_norm_eps", "output_multiplier", "final_logit_softcapping", "qk_scale_factor"):
        assert getattr(s, name) == getattr(real, name)


def test_layer_override() -> None:
    six = ModelSpec.preset("tiny", 6)
    assert six.num_layers == 6
    assert six.layer_types == (SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL)
    assert ModelSpec.preset("tiny", 1).layer_types == (SLIDING,)
    cut = ModelSpec.preset("muse-spark-open", 5)
    real = ModelSpec.preset("muse-spark-open")
    assert cut == real.with_layers(5)
    assert cut.num_layers == 5
    assert cut.layer_types == real.layer_types[:5]
    assert cut.layer_rope_theta == real.layer_rope_theta[:5]
    assert cut.H == real.H
    assert real.with_layers(62) == real


@pytest.mark.parametrize(
    ("name", "layers"), [("tiny", 0), ("tiny", -1), ("muse-spark-open", 0), ("muse-spark-open", 63)]
)
def test_layer_override_out_of_range(name: str, layers: int) -> None:
    with raises_naming("num_hidden_layers override", str(layers)):
        ModelSpec.preset(name, layers)


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(SpecError) as err:
        ModelSpec.preset("muse-spark-huge")
    message = str(err.value)
    assert "'muse-spark-huge'" in message
    for name in PRESETS:
        assert name in message


# Reading configs.


def test_from_config_dict() -> None:
    spec = ModelSpec.preset("tiny")
    assert ModelSpec.from_config(spec.to_config()) == spec
    assert ModelSpec.from_config(json.loads(json.dumps(spec.to_config()))) == spec


def test_from_config_nested_text_config() -> None:
    spec = ModelSpec.preset("muse-spark-open")
    config = {"architectures": ["MuseSparkForConditionalGeneration"], "vision_config": {"hidden_size": 3}}
    config["text_config"] = spec.to_config()
    assert ModelSpec.from_config(config) == spec


def test_from_config_ignores_unknown_keys_and_takes_default_rope() -> None:
    config = tiny_config(rope_parameters={"rope_type": "default"}, model_type="muse_spark_text", bos_token_id=1)
    assert ModelSpec.from_config(config) == ModelSpec.preset("tiny")


def test_from_config_file_and_directory(tmp_path: Path) -> None:
    spec = ModelSpec.preset("tiny", 5)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": spec.to_config()}))
    assert ModelSpec.from_config(path) == spec
    assert ModelSpec.from_config(str(path)) == spec
    assert ModelSpec.from_config(tmp_path) == spec
    assert ModelSpec.from_config(str(tmp_path)) == spec


def test_from_config_missing_or_invalid_file(tmp_path: Path) -> None:
    with raises_naming("no Muse Spark config at", str(tmp_path / "config.json")):
        ModelSpec.from_config(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with raises_naming(str(bad), "is not valid JSON"):
        ModelSpec.from_config(bad)


@pytest.mark.parametrize("config", [[1, 2], 3, None])
def test_from_config_not_a_dict(config: Any) -> None:
    with raises_naming("must be a dict"):
        ModelSpec.from_config(config)


def test_text_config_not_a_dict() -> None:
    with raises_naming("text_config must be a dict"):
        ModelSpec.from_config({"text_config": [1]})


# Every field: missing, or of the wrong type.


@pytest.mark.parametrize("name", list(_FIELDS))
def test_missing_field_is_named(name: str) -> None:
    config = tiny_config()
    del config[name]
    with raises_naming(f"config is missing {name}"):
        ModelSpec.from_config(config)
    with raises_naming(f"config is missing {name}"):
        ModelSpec.from_config({"text_config": config})


WRONG = {
    int: ["8", 8.0, True, None, [8]],
    float: ["0.3", True, None, [0.3]],
    tuple: [5, "sliding_attention", None, {"a": 1}],
}


@pytest.mark.parametrize(("name", "value"), [(name, value) for name, kind in _FIELDS.items() for value in WRONG[kind]])
def test_wrong_type_is_named(name: str, value: Any) -> None:
    with raises_naming(name, repr(value)):
        ModelSpec.from_config(tiny_config(**{name: value}))


NUMBERS = [name for name, kind in _FIELDS.items() if kind in (int, float)]


@pytest.mark.parametrize(("name", "value"), [(n, v) for n in NUMBERS for v in (0, -1)])
def test_non_positive_number_is_named(name: str, value: int) -> None:
    with raises_naming(name, "must be a positive"):
        ModelSpec.from_config(tiny_config(**{name: value}))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", [n for n, kind in _FIELDS.items() if kind is float])
def test_non_finite_number_is_named(name: str, value: float) -> None:
    with raises_naming(name, "positive finite"):
        ModelSpec.from_config(tiny_config(**{name: value}))


def test_integral_float_fields_take_ints() -> None:
    spec = ModelSpec.from_config(tiny_config(final_logit_softcapping=20, routed_scaling_factor=1))
    assert spec.final_logit_softcapping == 20.0 and isinstance(spec.final_logit_softcapping, float)


# Relations between fields.


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default"},
                "full_attention": {"rope_type": "default"},
            }
        },
        {"rope_scaling": None},
    ],
    ids=["whole", "per-layer-type", "none"],
)
def test_default_rope_in_every_form_is_taken(rope: dict[str, Any]) -> None:
    assert ModelSpec.from_config(tiny_config(**rope)) == ModelSpec.from_config(tiny_config())


@pytest.mark.parametrize(
    ("changes", "parts"),
    [
        ({"num_attention_heads": 8}, ["num_attention_heads x head_dim", "8 x 64", "hidden_size 1024"]),
        ({"hidden_size": 2048}, ["num_attention_heads x head_dim", "hidden_size 2048"]),
        (
            {"num_key_value_heads": 3},
            ["num_attention_heads 16 must be a multiple of num_key_value_heads 3"],
        ),
        ({"num_key_value_heads": 32}, ["num_key_value_heads 32"]),
        ({"num_experts_per_tok": 17}, ["num_experts_per_tok 17 exceeds num_local_experts 16"]),
        ({"head_dim": 63, "hidden_size": 16 * 63}, ["head_dim must be even", "63"]),
        ({"sliding_window": 4096}, ["sliding_window 4096", "max_position_embeddings 4096"]),
        ({"layer_types": [SLIDING, FULL, SLIDING]}, ["layer_types has 3 entries for 4 layers"]),
        (
            {"layer_types": [SLIDING, FULL, SLIDING, SLIDING, FULL]},
            ["layer_types has 5 entries for 4 layers"],
        ),
        (
            {"layer_types": [SLIDING, FULL, "chunked_attention", SLIDING]},
            ["layer_types must be", "chunked_attention"],
        ),
        ({"layer_rope_theta": [10000.0, 0.0, 10000.0]}, ["layer_rope_theta has 3 entries for 4 layers"]),
        (
            {"layer_rope_theta": [10000.0, 10000.0, 10000.0, 10000.0]},
            ["layer_rope_theta[1] = 10000.0", f"layer_types[1] = {FULL!r}"],
        ),
        (
            {"layer_rope_theta": [10000.0, 0.0, 0.0, 10000.0]},
            ["layer_rope_theta[2] = 0.0", f"layer_types[2] = {SLIDING!r}"],
        ),
        ({"layer_rope_theta": [10000.0, -1.0, 10000.0, 10000.0]}, ["layer_rope_theta[1] must be a number >= 0"]),
        ({"layer_rope_theta": [10000.0, 0.0, "x", 10000.0]}, ["layer_rope_theta[2] must be a number", "'x'"]),
        ({"layer_rope_theta": [True, 0.0, 10000.0, 10000.0]}, ["layer_rope_theta[0] must be a number"]),
        (
            {"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]},
            ["mlp_layer_types", "dense MLP layers are not supported"],
        ),
        ({"mlp_layer_types": ["sparse", "moe", "sparse", "sparse"]}, ["mlp_layer_types must be a list", "'moe'"]),
        ({"mlp_layer_types": "sparse"}, ["mlp_layer_types must be a list"]),
        ({"hidden_act": "gelu"}, ["hidden_act must be 'silu'", "'gelu'"]),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ["rope_parameters: rope type 'yarn'"]),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope_scaling: rope type 'yarn'"]),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_scaling: rope type 'linear'"]),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "yarn", "factor": 4.0},
                }
            },
            ["rope_parameters.full_attention: rope type 'yarn'"],
        ),
        ({"rope_parameters": "yarn"}, ["rope_parameters must be a dict", "'yarn'"]),
    ],
)
def test_wrong_relation_names_the_problem(changes: dict[str, Any], parts: list[str]) -> None:
    with raises_naming(*parts):
        ModelSpec.from_config(tiny_config(**changes))


@pytest.mark.parametrize("name", list(_FIXED))
def test_fixed_fields(name: str) -> None:
    wrong = {"hidden_act": "relu", "attention_bias": True, "num_shared_experts": 1, "tie_word_embeddings": True}
    with raises_naming(f"{name} must be {_FIXED[name]!r}", repr(wrong[name])):
        ModelSpec.from_config(tiny_config(**{name: wrong[name]}))
    # Absent is fine: it defaults to the fixed value.
    config = tiny_config()
    del config[name]
    assert ModelSpec.from_config(config) == ModelSpec.preset("tiny")


def test_constructor_validates() -> None:
    spec = ModelSpec.preset("tiny")
    values = {name: getattr(spec, name) for name in _FIELDS}
    with raises_naming("num_experts_per_tok 17 exceeds num_local_experts 16"):
        ModelSpec(**{**values, "num_experts_per_tok": 17})
    with raises_naming("layer_types has 3 entries for 4 layers"):
        ModelSpec(**{**values, "layer_types": spec.layer_types[:3]})


def test_key_is_stable_and_distinguishes() -> None:
    a, b = ModelSpec.preset("tiny"), ModelSpec.preset("tiny")
    assert a.key() == b.key()
    assert a.key() != ModelSpec.preset("tiny", 5).key()
    assert json.loads(a.key())["hidden_size"] == 1024


# The round trip, for any layer count.


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(min_value=1, max_value=96), nested=st.booleans())
def test_config_round_trip(layers: int, nested: bool) -> None:
    spec = ModelSpec.preset("tiny", layers)
    assert spec.num_layers == len(spec.layer_types) == layers
    config = json.loads(json.dumps(spec.to_config()))
    assert config["mlp_layer_types"] == ["sparse"] * layers
    again = ModelSpec.from_config({"text_config": config} if nested else config)
    assert again == spec
    assert again.key() == spec.key()
    assert again.to_config() == spec.to_config()
