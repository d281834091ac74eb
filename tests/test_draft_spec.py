"""The draft spec: presets, the config round trip, what vLLM derives from the config
(windows, positional mode, gain centres, scales, aux layers), and every refusal
naming its field."""

from __future__ import annotations

import json
import math

import pytest

from sparkdecode.draft.spec import DraftSpec, DraftSpecError, gain_center
from sparkdecode.spec import ModelSpec

TARGET = ModelSpec.preset("tiny")


def tiny_config(**changes) -> dict:
    config = DraftSpec.preset("tiny").to_config()
    config.update(changes)
    return config


def test_tiny_preset_matches_the_tiny_target():
    spec = DraftSpec.preset("tiny")
    assert spec.hidden_size == TARGET.hidden_size and spec.vocab_size == TARGET.vocab_size
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (16, 2, 64)
    assert spec.layer_offset == TARGET.num_layers  # vLLM's draft layer indices follow the target's
    assert [spec.window(i) for i in range(spec.num_layers)] == [64, None]
    assert spec.aux_layers == (1, 3, 4)  # target_layer_ids + 1; 4 is the target's final stream
    assert spec.fc_input_size == 3 * TARGET.hidden_size
    assert spec.output_multiplier == pytest.approx(2.0**-2.5)  # the target's, from metap SP
    assert spec.softmax_scale == pytest.approx(TARGET.softmax_scale)  # 43.784 / 8 = qk_scale_factor
    assert spec.intermediate_size == 1024
    assert spec.residual_torch_dtype.is_floating_point


def test_real_preset_widths():
    target = ModelSpec.preset("muse-spark-open")
    spec = DraftSpec.preset("muse-spark-open")
    assert spec.hidden_size == 8192 and spec.layer_offset == 62 and spec.num_layers == 5
    assert spec.output_multiplier == pytest.approx(target.output_multiplier)
    assert spec.softmax_scale == pytest.approx(target.softmax_scale)
    assert all(spec.window(i) == 2048 for i in range(5))
    assert spec.with_layers(2).num_layers == 2
    cut = DraftSpec.preset("muse-spark-open", target=ModelSpec.preset("muse-spark-open", num_layers=2), num_layers=1)
    assert cut.layer_offset == 2 and cut.aux_layers == (1, 2)


def test_config_round_trip(tmp_path):
    spec = DraftSpec.preset("tiny")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(spec.to_config()))
    again = DraftSpec.from_config(tmp_path, TARGET)
    assert again == spec and again.key() == spec.key()
    assert json.loads(path.read_text())["model_type"] == "muse_spark_dspark"


def test_vllm_defaults_fill_what_a_config_leaves_out():
    config = {
        "hidden_size": 1024,
        "num_hidden_layers": 1,
        "num_attention_heads": 16,
        "head_dim": 64,
        "vocab_size": 1024,
        "target_layer_ids": [1],
        "markov_rank": 8,
        "mask_token_id": 5,
        "moe": {"is_enabled": False},
    }
    spec = DraftSpec.from_config(config, TARGET)
    # vLLM's MuseSpark1xTextConfig: 8 KV heads when absent, the query heads when null.
    assert spec.num_key_value_heads == 8 and spec.draft_vocab_size == 1024
    assert DraftSpec.from_config({**config, "num_key_value_heads": None}, TARGET).num_key_value_heads == 16
    assert spec.residual_dtype == "bf16" and not spec.use_residual_gate and spec.use_rope
    assert spec.window(0) is None and spec.output_multiplier == 1.0 and spec.output_soft_cap_temp is None
    assert spec.intermediate_size == 1024 and spec.post_norm_eps == spec.rms_norm_eps
    assert spec.sample_from_anchor and spec.target_hidden_size == 1024


def test_windows_follow_vllms_layer_index_and_nope_cycle():
    # Without every_n_layers_nope: global_attn_cfg[L % len], L = 4 + i.
    spec = DraftSpec.from_config(tiny_config(global_attn_cfg="[0, 32, 0]", num_hidden_layers=3), TARGET)
    assert [spec.window(i) for i in range(3)] == [32, None, None]  # L = 4, 5, 6 -> entries 1, 2, 0
    # With every_n_layers_nope n: count back from the draft's end (num_layers % n shifts it).
    spec = DraftSpec.from_config(
        tiny_config(
            num_hidden_layers=3,
            every_n_layers_nope=4,
            global_attn_cfg=[16, 32, 48, 64],
            use_rope=False,
        ),
        TARGET,
    )
    # count_backward = L + (4 - 3 % 4) = L + 1 -> 5, 6, 7 -> entries 1, 2, 3
    assert [spec.window(i) for i in range(3)] == [32, 48, 64]
    assert not any(spec.uses_rope_at(i) for i in range(3))
    # Names (e.g. "gdn2") and 0 are global attention for a draft layer.
    spec = DraftSpec.from_config(tiny_config(global_attn_cfg=["gdn2", 0]), TARGET)
    assert [spec.window(i) for i in range(2)] == [None, None]


def test_gain_centres_and_rope_tables():
    assert gain_center("one", 9) == 1.0 and gain_center("zero", 9) == 0.0
    assert gain_center("inverse_residual_index", 9) == 1.0 / 10
    assert gain_center("inverse_residual_index_v2", 9) == 1.0 / 10
    assert gain_center("inverse_sqrt_residual_index", 9) == pytest.approx(1.0 / math.sqrt(10))
    spec = DraftSpec.from_config(tiny_config(post_norm_gain_center_type="inverse_residual_index_p1"), TARGET)
    # post_attn_norm of draft layer 1 (L = 5): residual id 11; post_ffn_norm: 12.
    assert spec.post_norm_center(1, "attn") == 1.0 / 12 and spec.post_norm_center(1, "ffn") == 1.0 / 13
    assert spec.pre_norm_center() == 1.0
    plain = DraftSpec.from_config(tiny_config(norm_zero_centered_gamma=False), TARGET)
    assert plain.pre_norm_center() is None and plain.post_norm_center(0, "attn") is None
    # Layer 0's queries rotate with the table the context path rounded to bf16.
    assert spec.query_rope_table_bf16(0) and not spec.query_rope_table_bf16(1)
    assert DraftSpec.from_config(tiny_config(rope_use_fp32_in_outer_product=False), TARGET).query_rope_table_bf16(1)


def test_temperature_tuning_and_fused_rope_per_layer():
    spec = DraftSpec.from_config(
        tiny_config(
            attn_temperature_tuning_floor_scale=8.0,
            attn_temperature_tuning_q_scale_constant=0.1,
            attn_temperature_tuning_layers="global",
        ),
        TARGET,
    )
    assert not spec.temperature_tuning(0) and spec.temperature_tuning(1)  # sliding, full
    assert spec.fused_qk_rope(0) and not spec.fused_qk_rope(1)
    assert DraftSpec.from_config(tiny_config(use_sqrt_attn_scaling=True), TARGET).softmax_scale == pytest.approx(
        64**-0.5 * 3.87
    )


def test_mup_output_multiplier_and_mask_token_from_dflash_config():
    spec = DraftSpec.from_config(
        tiny_config(
            metap={"use_metap": True, "metap_mode": "mup", "base_width": 256}, dflash_config={"mask_token_id": 7}
        ),
        TARGET,
    )
    assert spec.output_multiplier == 256 / 1024 and spec.mask_token_id == 7
    assert DraftSpec.from_config(tiny_config(draft_position_mode="nope"), TARGET).use_rope is False


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_size": 2048}, "hidden_size"),
        ({"target_hidden_size": 2048}, "target_hidden_size"),
        ({"vocab_size": 2048}, "vocab_size"),
        ({"target_layer_ids": [0, 9]}, "target_layer_ids"),
        ({"target_layer_ids": [1, 1]}, "target_layer_ids"),
        ({"target_layer_ids": []}, "target_layer_ids"),
        ({"num_attention_heads": "16"}, "num_attention_heads"),
        ({"num_attention_heads": 15}, "num_attention_heads"),
        ({"head_dim": 63}, "head_dim"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"residual_dtype": "fp16"}, "residual_dtype"),
        ({"use_qk_norm": False}, "use_qk_norm"),
        ({"use_rope": "yes"}, "use_rope"),
        ({"moe": {"is_enabled": True}}, "moe"),
        ({"global_attn_cfg": [5000]}, "global_attn_cfg"),
        ({"global_attn_cfg": "64, 0"}, "global_attn_cfg"),
        ({"every_n_layers_nope": 2, "global_attn_cfg": [0, 64]}, "every_n_layers_nope"),
        ({"every_n_layers_nope": 3}, "global_attn_cfg"),
        ({"mask_token_id": 4096}, "mask_token_id"),
        ({"post_norm_gain_center_type": "inverse_sqrt_layers"}, "post_norm_gain_center_type"),
        ({"metap": {"use_metap": True, "metap_mode": "xl"}}, "metap_mode"),
        ({"dspark_target_layer_ids": [1]}, "dspark_target_layer_ids"),
        ({"non_linearity": "gelu"}, "non_linearity"),
        ({"draft_position_mode": "alibi"}, "draft_position_mode"),
        ({"ffn_dim_multiplier": 0.0}, "ffn_dim_multiplier"),
        ({"dspark_draft_topk": 0}, "dspark_draft_topk"),
    ],
)
def test_refusals_name_the_field(changes, field):
    with pytest.raises(DraftSpecError, match=field):
        DraftSpec.from_config(tiny_config(**changes), TARGET)


def test_missing_fields_and_files(tmp_path):
    config = tiny_config()
    del config["markov_rank"]
    with pytest.raises(DraftSpecError, match="missing markov_rank"):
        DraftSpec.from_config(config, TARGET)
    config = tiny_config()
    del config["mask_token_id"]
    with pytest.raises(DraftSpecError, match="mask_token_id"):
        DraftSpec.from_config(config, TARGET)
    with pytest.raises(DraftSpecError, match="no DSpark draft config"):
        DraftSpec.from_config(tmp_path, TARGET)
    with pytest.raises(DraftSpecError, match="unknown draft preset"):
        DraftSpec.preset("huge")
    with pytest.raises(DraftSpecError, match="outside"):
        DraftSpec.preset("tiny").with_layers(3)
