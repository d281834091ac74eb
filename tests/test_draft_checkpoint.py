"""Draft checkpoints: vLLM's tensor names, the round trip bit for bit, the LM head
shared back where it equals the target's, and every refusal naming its tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparkdecode.checkpoint import CheckpointError
from sparkdecode.draft.checkpoint import draft_checkpoint_names, load_draft_checkpoint, save_draft_checkpoint
from sparkdecode.draft.model import ReferenceDraft, markov_loop
from sparkdecode.draft.spec import DraftSpec
from sparkdecode.draft.weights import random_draft_weights
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import ModelWeights

TARGET = ModelSpec.preset("tiny")


def target_stub(seed: int = 0) -> ModelWeights:
    g = torch.Generator().manual_seed(seed)
    return ModelWeights(
        spec=TARGET,
        embed=torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g).to(torch.bfloat16),
        layers=[],
        final_norm=torch.ones(TARGET.hidden_size, dtype=torch.bfloat16),
        lm_head=(torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g) * 0.03).to(torch.bfloat16),
    )


@pytest.fixture(scope="module")
def target() -> ModelWeights:
    return target_stub()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, target):
    directory = tmp_path_factory.mktemp("draft")
    save_draft_checkpoint(random_draft_weights(DraftSpec.preset("tiny"), target, seed=4), directory)
    return directory


def confidence_spec() -> DraftSpec:
    config = DraftSpec.preset("tiny").to_config()
    config.update(enable_confidence_head=True, confidence_head_with_markov=True)
    return DraftSpec.from_config(config, TARGET)


def all_tensors(w) -> dict[str, torch.Tensor]:
    out = {"fc": w.fc, "w1": w.markov_w1, "w2": w.markov_w2, "lm": w.lm_head, "d2t": w.d2t}
    out.update(hidden=w.hidden_norm.weight, norm=w.final_norm.weight)
    for layer in w.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            out[f"{layer.index}.{name}"] = getattr(layer, name)
        for name in ("pre_qkv_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm"):
            out[f"{layer.index}.{name}"] = getattr(layer, name).weight
        for name in ("attn_residual", "ffn_residual"):
            r = getattr(layer, name)
            out[f"{layer.index}.{name}.gate"], out[f"{layer.index}.{name}.alpha"] = r.gate, r.alpha
    return out


def test_names_are_vllms(tmp_path, target):
    weights = random_draft_weights(DraftSpec.preset("tiny"), target, seed=1)
    save_draft_checkpoint(weights, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert names == set(draft_checkpoint_names(weights.spec))
    for name in (
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.o_gate_proj.weight",
        "layers.0.self_attn.pre_qkv_proj_norm.weight",
        "layers.1.feed_forward.gate_proj.weight",
        "layers.1.post_ffn_norm.weight",
        "layers.1.add_ffn.gate",
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "lm_head.weight",
        "d2t",
    ):
        assert name in names
    # No weight where this config has none (post_norm_affine false: a weightless post-attention norm).
    assert "layers.0.post_attn_norm.weight" not in names
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["MuseSparkDSparkModel"] and config["model_type"] == "muse_spark_dspark"


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_round_trip_bit_for_bit(tmp_path, target, own_lm_head):
    weights = random_draft_weights(confidence_spec(), target, seed=2, own_lm_head=own_lm_head)
    assert weights.lm_head_is_target is not own_lm_head
    save_draft_checkpoint(weights, tmp_path)
    loaded = load_draft_checkpoint(tmp_path, target)
    assert loaded.spec == weights.spec
    for (name, a), b in zip(all_tensors(weights).items(), all_tensors(loaded).values()):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(loaded.confidence_weight, weights.confidence_weight)
    # vLLM shares an LM head equal to the target's; a different one stays the draft's own.
    assert (loaded.lm_head is target.lm_head) is not own_lm_head
    assert loaded.embed is target.embed
    # A saved-and-loaded draft drafts the same tokens.
    hidden = torch.randn(7, TARGET.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    args = (torch.tensor([5]), torch.arange(40, 47), torch.tensor([3]), torch.tensor([1.0]))
    assert torch.equal(markov_loop(weights, hidden, *args).tokens, markov_loop(loaded, hidden, *args).tokens)
    ReferenceDraft(loaded, 256)


def test_checkpoint_dtypes_converted_and_extras_ignored(tmp_path, target):
    weights = random_draft_weights(DraftSpec.preset("tiny"), target, seed=3)
    save_draft_checkpoint(weights, tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["fc.weight"] = tensors["fc.weight"].float()  # vLLM's loader copies into its bf16 parameter
    tensors["d2t"] = tensors["d2t"].int()
    tensors["t2d"] = torch.zeros(4, dtype=torch.bool)
    tensors["embed_tokens.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(path))
    loaded = load_draft_checkpoint(tmp_path, target)
    assert loaded.fc.dtype == torch.bfloat16 and torch.equal(loaded.fc, weights.fc)
    assert loaded.d2t.dtype == torch.int64


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("lm_head.weight"), "lm_head.weight is missing.*requires it"),
        (lambda t: t.pop("d2t"), "d2t is missing.*requires it"),
        (lambda t: t.pop("layers.1.self_attn.o_proj.weight"), "layers.1.self_attn.o_proj.weight is missing"),
        (lambda t: t.update({"layers.0.post_attn_norm.weight": torch.ones(1024)}), "unexpected tensor"),
        (lambda t: t.update({"markov_head.markov_w2.weight": torch.zeros(1024, 16)}), "markov_w2.weight has shape"),
        (lambda t: t.update({"d2t": torch.zeros(1024)}), "d2t has dtype"),
    ],
)
def test_refusals_name_the_tensor(tmp_path, target, saved, edit, message):
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    tensors = load_file(str(saved / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_draft_checkpoint(tmp_path, target)


def test_config_is_checked_against_the_target(saved, target):
    other = ModelWeights(
        spec=ModelSpec.preset("tiny-tp8"),
        embed=target.embed,
        layers=[],
        final_norm=target.final_norm,
        lm_head=target.lm_head,
    )
    with pytest.raises(ValueError, match="hidden_size"):
        load_draft_checkpoint(saved, other)
