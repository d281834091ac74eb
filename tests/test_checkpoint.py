"""Hugging Face checkpoints: save and load round trips, the Q/K row order on disk,
shards, and the loader's errors."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Collection
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sparkdecode.checkpoint import (
    HF_QUANT_CONFIG_NAME,
    INDEX_NAME,
    CheckpointError,
    Nvfp4Config,
    iter_checkpoint_names,
    load_checkpoint,
    save_checkpoint,
)
from sparkdecode.reference.kvcache import PagedKVCache
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec, SpecError
from sparkdecode.weights import (
    LayerWeights,
    ModelWeights,
    Sharding,
    deinterleave_qk_rows,
    interleave_qk_rows,
    random_weights,
)

PREFIX = "model.language_model."
SHARD_BYTES = 4 << 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tensors this small gain nothing from intra-op threads, and lose much to them
    on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    return random_weights(ModelSpec.preset("tiny", 2), seed=3)


@pytest.fixture(scope="module")
def ckpt(weights, tmp_path_factory) -> Path:
    """One-shard checkpoint of ``weights``."""
    directory = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(weights, directory)
    return directory


@pytest.fixture(scope="module")
def sharded(weights, tmp_path_factory) -> Path:
    """The same weights in shards of about 4 MiB."""
    directory = tmp_path_factory.mktemp("sharded")
    save_checkpoint(weights, directory, shard_bytes=SHARD_BYTES)
    return directory


@pytest.fixture(scope="module")
def loaded(ckpt) -> ModelWeights:
    return load_checkpoint(ckpt)


def weight_map(directory: Path) -> dict[str, str]:
    return json.loads((directory / INDEX_NAME).read_text())["weight_map"]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy whose JSON files are real and whose shards link to ``src``'s."""
    dst.mkdir()
    for path in src.iterdir():
        if path.suffix == ".json":
            shutil.copyfile(path, dst / path.name)
        else:
            (dst / path.name).symlink_to(path)
    return dst


def rewrite_shard(directory: Path, file: str, edit) -> None:
    """Replace shard ``file`` of a copy by ``edit`` of its tensors."""
    path = directory / file
    tensors = {name: t.clone() for name, t in load_file(path).items()}
    edit(tensors)
    path.unlink()
    save_file(tensors, path, metadata={"format": "pt"})


def add_tensors(directory: Path, tensors: dict[str, torch.Tensor], file: str = "extra.safetensors") -> None:
    """Write ``tensors`` to a new shard of a copy and list them in its index."""
    save_file(tensors, directory / file, metadata={"format": "pt"})
    index = json.loads((directory / INDEX_NAME).read_text())
    index["weight_map"].update(dict.fromkeys(tensors, file))
    (directory / INDEX_NAME).write_text(json.dumps(index))


def assert_same_layer(a: LayerWeights, b: LayerWeights) -> None:
    for f in dataclasses.fields(LayerWeights):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif f.name == "experts":
            assert (x.format, x.first_expert, x.intermediate_slice) == (y.format, y.first_expert, y.intermediate_slice)
            assert x.w13.dtype == y.w13.dtype and torch.equal(x.w13, y.w13)
            assert x.w2.dtype == y.w2.dtype and torch.equal(x.w2, y.w2)
            assert (x.nvfp4 is None) == (y.nvfp4 is None)
            for name, t in (vars(x.nvfp4) if x.nvfp4 is not None else {}).items():
                u = getattr(y.nvfp4, name)
                if t is None or u is None:
                    assert t is u, name
                    continue
                # e4m3 has no torch.equal kernel on the CPU: compare the bytes.
                assert t.dtype == u.dtype and torch.equal(t.view(torch.uint8), u.view(torch.uint8)), name
        else:
            assert x == y, f.name


def assert_same_weights(a: ModelWeights, b: ModelWeights, layers: int | None = None) -> None:
    for name in ("embed", "final_norm", "lm_head"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    count = len(a.layers) if layers is None else layers
    assert len(b.layers) == count
    for x, y in zip(a.layers[:count], b.layers):
        assert_same_layer(x, y)


def test_save_load_round_trip_is_bit_identical(weights, ckpt, loaded):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["MuseSparkForConditionalGeneration"]
    assert config["model_type"] == "muse_spark"
    assert config["text_config"] == weights.spec.to_config()
    assert sorted(weight_map(ckpt)) == sorted(iter_checkpoint_names(weights.spec))
    assert [p.name for p in ckpt.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    assert loaded.spec == weights.spec and loaded.tp == 1
    assert_same_weights(weights, loaded)
    with safe_open(str(ckpt / "model-00001-of-00001.safetensors"), framework="pt") as f:
        router = f.get_tensor(f"{PREFIX}layers.1.mlp.gate.weight")
        assert router.dtype == torch.float32
        assert torch.equal(router, weights.layers[1].router_unfolded)
        assert f.get_tensor(f"{PREFIX}layers.1.mlp.experts.gate_up_proj").shape == weights.layers[1].experts.w13.shape


def assert_same_reference_outputs(a: ModelWeights, b: ModelWeights, prompt_len: int = 40, seed: int = 11) -> None:
    """A prefill then an 8-token verify step of the reference model over ``a`` and
    over ``b``: the same hidden states and logits, bit for bit."""
    spec = a.spec
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,), generator=g)
    verify = torch.randint(0, spec.vocab_size, (8,), generator=g)
    outputs = []
    for w in (a, b):
        model = ReferenceModel(w, max_context=512)
        cache = PagedKVCache(spec, num_pages=64, max_context=512, max_rows=64)
        h1, _ = model.step(cache, prompt, 0)
        h2, _ = model.step(cache, verify, prompt_len)
        outputs.append((h1, model.logits(h1), h2, model.logits(h2)))
    for x, y in zip(*outputs):
        assert torch.isfinite(x.float()).all()
        assert torch.equal(x, y)


def test_save_load_round_trip_gives_the_same_reference_outputs(weights, loaded):
    assert_same_reference_outputs(weights, loaded)


def test_interleave_matches_vllm_on_a_known_tensor():
    head_dim, heads, cols = 8, 3, 2
    rows = heads * head_dim
    weight = torch.arange(rows * cols).reshape(rows, cols)
    vllm = weight.reshape(-1, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)
    # HF rows per head: [x_0 .. x_{d/2-1} | y_0 .. y_{d/2-1}]; interleaved: x_0, y_0, x_1, y_1, ...
    order = [h * head_dim + j + half for h in range(heads) for j in range(head_dim // 2) for half in (0, head_dim // 2)]
    assert order[:8] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(vllm, weight[order])
    assert torch.equal(interleave_qk_rows(weight, head_dim), vllm)
    assert torch.equal(deinterleave_qk_rows(vllm, head_dim), weight)


def test_q_and_k_rows_are_in_the_hf_order_on_disk(weights, ckpt):
    spec = weights.spec
    d, q, kv = spec.head_dim, spec.q_size, spec.kv_size
    with safe_open(str(ckpt / "model-00001-of-00001.safetensors"), framework="pt") as f:
        for layer in weights.layers:
            name = f"{PREFIX}layers.{layer.index}.self_attn."
            q_proj, k_proj = f.get_tensor(name + "q_proj.weight"), f.get_tensor(name + "k_proj.weight")
            v_proj, gate_proj = f.get_tensor(name + "v_proj.weight"), f.get_tensor(name + "gate_proj.weight")
            q_rows, k_rows = layer.qkvg[:q], layer.qkvg[q : q + kv]
            assert torch.equal(q_proj, deinterleave_qk_rows(q_rows, d))
            assert torch.equal(k_proj, deinterleave_qk_rows(k_rows, d))
            assert not torch.equal(q_proj, q_rows)
            for stored, rows in ((q_proj, q_rows), (k_proj, k_rows)):
                vllm = stored.reshape(-1, 2, d // 2, spec.H).transpose(1, 2).reshape(rows.shape)
                assert torch.equal(vllm, rows)
            assert torch.equal(v_proj, layer.qkvg[q + kv : q + 2 * kv])
            assert torch.equal(gate_proj, layer.qkvg[q + 2 * kv :])


def test_shards_and_index(weights, sharded):
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    n = len(files)
    assert n > 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    mapping = weight_map(sharded)
    assert sorted(mapping) == sorted(iter_checkpoint_names(weights.spec))
    total = 0
    for file in files:
        with safe_open(str(sharded / file), framework="pt") as f:
            names = set(f.keys())
            size = sum(f.get_tensor(name).numel() * f.get_tensor(name).element_size() for name in names)
        assert names == {name for name, where in mapping.items() if where == file}
        assert size <= SHARD_BYTES or len(names) == 1
        total += size
    assert json.loads((sharded / INDEX_NAME).read_text())["metadata"]["total_size"] == total
    assert_same_weights(weights, load_checkpoint(sharded))


def test_load_without_an_index_reads_every_file(weights, sharded, tmp_path):
    directory = copy_checkpoint(sharded, tmp_path / "c")
    (directory / INDEX_NAME).unlink()
    assert_same_weights(weights, load_checkpoint(directory))


def test_layer_count_override_loads_the_first_layers_only(weights, sharded, tmp_path):
    directory = copy_checkpoint(sharded, tmp_path / "c")
    name = f"{PREFIX}layers.1.mlp.pre_expert_norm.weight"
    rewrite_shard(directory, weight_map(directory)[name], lambda t: t.pop(name))
    first = load_checkpoint(directory, num_layers=1)
    assert first.spec == weights.spec.with_layers(1)
    assert_same_weights(weights, first, layers=1)
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_checkpoint(directory)
    with pytest.raises(SpecError, match="override 3"):
        load_checkpoint(directory, num_layers=3)


def test_missing_tensor_is_named(sharded, tmp_path):
    name = f"{PREFIX}layers.0.self_attn.o_proj.weight"
    directory = copy_checkpoint(sharded, tmp_path / "c")
    rewrite_shard(directory, weight_map(directory)[name], lambda t: t.pop(name))
    # Still listed in the index, absent from its file.
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} is missing .*{re.escape(str(directory))}"):
        load_checkpoint(directory)
    index = json.loads((directory / INDEX_NAME).read_text())
    del index["weight_map"][name]
    (directory / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} is missing .*{re.escape(str(directory))}"):
        load_checkpoint(directory)
    (directory / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_checkpoint(directory)


def test_missing_shard_file_is_named(sharded, tmp_path):
    directory = copy_checkpoint(sharded, tmp_path / "c")
    file = weight_map(directory)["lm_head.weight"]
    (directory / file).unlink()
    with pytest.raises(CheckpointError, match=rf"tensor \S+ is in {re.escape(file)}, which does not exist"):
        load_checkpoint(directory)


def test_wrong_shape_is_named(sharded, tmp_path, weights):
    name = f"{PREFIX}layers.1.mlp.pre_expert_norm.weight"
    P = weights.spec.P
    directory = copy_checkpoint(sharded, tmp_path / "c")
    rewrite_shard(directory, weight_map(directory)[name], lambda t: t.update({name: torch.zeros(P + 1).bfloat16()}))
    with pytest.raises(CheckpointError, match=re.escape(f"{name} has shape [{P + 1}], expected [{P}]")):
        load_checkpoint(directory)


def test_wrong_dtype_is_named(sharded, tmp_path):
    name = f"{PREFIX}layers.0.mlp.gate.weight"
    directory = copy_checkpoint(sharded, tmp_path / "c")
    rewrite_shard(directory, weight_map(directory)[name], lambda t: t.update({name: t[name].bfloat16()}))
    with pytest.raises(CheckpointError, match=re.escape(f"{name} has dtype torch.bfloat16, expected torch.float32")):
        load_checkpoint(directory)


def test_missing_config_field_is_named(sharded, tmp_path):
    directory = copy_checkpoint(sharded, tmp_path / "c")
    config = json.loads((directory / "config.json").read_text())
    del config["text_config"]["num_key_value_heads"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match="missing num_key_value_heads"):
        load_checkpoint(directory)


def test_flat_config_and_text_only_prefix(weights, tmp_path):
    spec = weights.spec.with_layers(1)
    one = dataclasses.replace(weights, spec=spec, layers=weights.layers[:1], rope_tables={})
    directory = tmp_path / "c"
    save_checkpoint(one, directory)
    (directory / "config.json").write_text(json.dumps(spec.to_config()))
    for path in directory.glob("*.safetensors"):
        tensors = {name.replace(PREFIX, "model."): t.clone() for name, t in load_file(path).items()}
        path.unlink()
        save_file(tensors, path)
    (directory / INDEX_NAME).unlink()
    flat = load_checkpoint(directory)
    assert_same_weights(one, flat)
    # The loaded weights own their memory: scribbling over the files changes nothing.
    for path in directory.glob("*.safetensors"):
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 2)
            f.write(b"\xff" * 65536)
    assert_same_weights(one, flat)
    save_checkpoint(flat, directory)
    assert_same_weights(one, load_checkpoint(directory))


def test_tower_tensors_are_ignored(weights, sharded, tmp_path):
    directory = copy_checkpoint(sharded, tmp_path / "c")
    towers = {
        "model.vision_tower.blocks.0.attn.qkv.weight": torch.ones(3, 5, dtype=torch.float16),
        "model.audio_tower.conv.weight": torch.ones(7, dtype=torch.float32),
        "model.vision_projection.weight": torch.ones(2, 2, dtype=torch.bfloat16),
        "model.vision_adapter.norm.weight": torch.ones(4, dtype=torch.bfloat16),
    }
    add_tensors(directory, towers)
    assert_same_weights(weights, load_checkpoint(directory))


@pytest.mark.parametrize(
    "name",
    [
        f"{PREFIX}layers.0.mlp.shared_expert.down_proj.weight",
        f"{PREFIX}layers.2.input_layernorm.weight",
        f"{PREFIX}rotary_emb.inv_freq",
        "model.layers.0.input_layernorm.weight",
    ],
)
def test_unknown_language_model_tensor_is_named(sharded, tmp_path, name):
    directory = copy_checkpoint(sharded, tmp_path / "c")
    add_tensors(directory, {name: torch.zeros(4, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {re.escape(name)}"):
        load_checkpoint(directory)


def test_save_refuses_weights_it_cannot_write(weights, tmp_path):
    folded_only = dataclasses.replace(weights, layers=[dataclasses.replace(x) for x in weights.layers])
    folded_only.layers[1].router_unfolded = None
    with pytest.raises(ValueError, match="unfolded router was not kept"):
        save_checkpoint(folded_only, tmp_path / "a")
    with pytest.raises(ValueError, match="TP-1"):
        save_checkpoint(dataclasses.replace(weights, sharding=Sharding(tp=2, rank=1)), tmp_path / "b")
    wrong = dataclasses.replace(weights, lm_head=weights.lm_head.float())
    with pytest.raises(ValueError, match=r"lm_head\.weight: dtype torch\.float32"):
        save_checkpoint(wrong, tmp_path / "c")
    assert not any(tmp_path.iterdir())


def test_other_quantized_tensors_are_refused(sharded, tmp_path):
    name = f"{PREFIX}layers.0.self_attn.q_proj.weight_scale"
    directory = copy_checkpoint(sharded, tmp_path / "c")
    add_tensors(directory, {name: torch.ones(1, dtype=torch.float32)})
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} .*quantized weights are not supported"):
        load_checkpoint(directory)


# ------------------------------------------------------------------- NVFP4 experts


@pytest.fixture(scope="module")
def q_weights() -> ModelWeights:
    """Three layers: the middle one's experts NVFP4, the edge layers' bf16."""
    return random_weights(ModelSpec.preset("tiny", 3), seed=8, expert_format="nvfp4")


@pytest.fixture(scope="module")
def q_ckpt(q_weights, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("q_ckpt")
    save_checkpoint(q_weights, directory, shard_bytes=SHARD_BYTES)
    return directory


def edit_config(directory: Path, edit) -> None:
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


def test_nvfp4_round_trip_is_bit_identical(q_weights, q_ckpt):
    spec = q_weights.spec
    assert [x.experts.format for x in q_weights.layers] == ["bf16", "nvfp4", "bf16"]
    config = json.loads((q_ckpt / "config.json").read_text())["quantization_config"]
    assert config == {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "ignore": [
            "lm_head",
            f"{PREFIX}layers.*.self_attn*",
            f"{PREFIX}layers.0.mlp.experts*",
            f"{PREFIX}layers.2.mlp.experts*",
        ],
    }
    assert sorted(weight_map(q_ckpt)) == sorted(iter_checkpoint_names(spec, nvfp4_layers=[1]))
    E, P, I = spec.E, spec.P, spec.I  # noqa: E741, N806
    expected = {
        "gate_up_proj": (torch.uint8, [E, 2 * I, P // 2]),
        "gate_up_proj_weight_scale": (torch.float8_e4m3fn, [E, 2 * I, P // 16]),
        "gate_up_proj_weight_scale_2": (torch.float32, [E, 2]),
        "gate_up_proj_input_scale": (torch.float32, [E, 2]),
        "down_proj": (torch.uint8, [E, P, I // 2]),
        "down_proj_weight_scale": (torch.float8_e4m3fn, [E, P, I // 16]),
        "down_proj_weight_scale_2": (torch.float32, [E]),
        "down_proj_input_scale": (torch.float32, [E]),
    }
    for suffix, (dtype, shape) in expected.items():
        name = f"{PREFIX}layers.1.mlp.experts.{suffix}"
        with safe_open(str(q_ckpt / weight_map(q_ckpt)[name]), framework="pt") as f:
            t = f.get_tensor(name)
        assert (t.dtype, list(t.shape)) == (dtype, shape), name
    assert f"{PREFIX}layers.0.mlp.experts.gate_up_proj_weight_scale" not in weight_map(q_ckpt)
    loaded = load_checkpoint(q_ckpt)
    assert_same_weights(q_weights, loaded)
    # The global scales stay apart: gate's and up's differ on random weights.
    s = loaded.layers[1].experts.nvfp4
    assert not torch.equal(s.w13_global[:, 0], s.w13_global[:, 1])


def test_nvfp4_round_trip_gives_the_same_reference_outputs(q_weights, q_ckpt):
    assert_same_reference_outputs(q_weights, load_checkpoint(q_ckpt), prompt_len=24, seed=12)


def test_nvfp4_legacy_hf_quant_config(q_weights, q_ckpt, tmp_path):
    directory = copy_checkpoint(q_ckpt, tmp_path / "c")
    config = json.loads((directory / "config.json").read_text())
    ignore = config.pop("quantization_config")["ignore"]
    (directory / "config.json").write_text(json.dumps(config))
    legacy = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "exclude_modules": ignore}}
    (directory / HF_QUANT_CONFIG_NAME).write_text(json.dumps(legacy))
    assert_same_weights(q_weights, load_checkpoint(directory))


def test_nvfp4_missing_scale_is_named(q_ckpt, tmp_path):
    name = f"{PREFIX}layers.1.mlp.experts.down_proj_weight_scale_2"
    directory = copy_checkpoint(q_ckpt, tmp_path / "c")
    rewrite_shard(directory, weight_map(directory)[name], lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} is missing"):
        load_checkpoint(directory)


@pytest.mark.parametrize(
    ("suffix", "bad", "message"),
    [
        ("gate_up_proj_weight_scale", lambda t: t.float(), "dtype torch.float32, expected torch.float8_e4m3fn"),
        ("gate_up_proj", lambda t: t.view(torch.int8), "dtype torch.int8, expected torch.uint8"),
        ("gate_up_proj_weight_scale_2", lambda t: t[:, :1].contiguous(), "shape [16, 1], expected [16, 2]"),
        ("down_proj", lambda t: torch.cat([t, t], -1), "shape [16, 512, 512], expected [16, 512, 256]"),
    ],
)
def test_nvfp4_wrong_dtype_or_shape_is_named(q_ckpt, tmp_path, suffix, bad, message):
    name = f"{PREFIX}layers.1.mlp.experts.{suffix}"
    directory = copy_checkpoint(q_ckpt, tmp_path / "c")
    rewrite_shard(directory, weight_map(directory)[name], lambda t: t.update({name: bad(t[name])}))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} .*{re.escape(message)}"):
        load_checkpoint(directory)


def test_nvfp4_tensors_of_an_excluded_layer_are_refused(q_ckpt, tmp_path):
    directory = copy_checkpoint(q_ckpt, tmp_path / "c")
    edit_config(directory, lambda c: c["quantization_config"]["ignore"].append(f"{PREFIX}layers.1.mlp.experts*"))
    name = re.escape(f"{PREFIX}layers.1.mlp.experts.")
    with pytest.raises(
        CheckpointError, match=rf"{name}\S+ .*NVFP4 expert tensor, but the quantization config excludes layer 1"
    ):
        load_checkpoint(directory)


def test_nvfp4_tensors_without_a_quantization_config_are_refused(q_ckpt, tmp_path):
    directory = copy_checkpoint(q_ckpt, tmp_path / "c")
    edit_config(directory, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="NVFP4 expert tensor, but the checkpoint has no quantization config"):
        load_checkpoint(directory)


def test_nvfp4_layer_the_config_quantizes_but_stored_bf16_is_refused(sharded, tmp_path):
    """A bf16 checkpoint whose config quantizes layer 1's experts: the scales are missing."""
    directory = copy_checkpoint(sharded, tmp_path / "c")
    spec = ModelSpec.from_config(directory)
    edit_config(directory, lambda c: c.update(quantization_config=Nvfp4Config.for_layers(spec, [1]).to_config()))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.gate_up_proj_weight_scale is missing"):
        load_checkpoint(directory)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda q: q["ignore"].remove(f"{PREFIX}layers.*.self_attn*"),
            "quantizes model.language_model.layers.0.self_attn.q_proj",
        ),
        (lambda q: q["ignore"].remove("lm_head"), "quantizes lm_head"),
        (lambda q: q.update(quant_algo="FP8"), "quant_algo is 'FP8'"),
        (lambda q: q.update(group_size=32), "group_size is 32"),
        (lambda q: q.update(quant_method="compressed-tensors"), "quant_method is 'compressed-tensors'"),
        (lambda q: q.update(ignore="lm_head"), "must be a list of names"),
    ],
)
def test_nvfp4_config_errors_are_named(q_ckpt, tmp_path, edit, message):
    directory = copy_checkpoint(q_ckpt, tmp_path / "c")
    edit_config(directory, lambda c: edit(c["quantization_config"]))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_checkpoint(directory)


def test_nvfp4_exclusion_follows_vllm_matching():
    config = Nvfp4Config(("lm_head", "model.language_model.layers.1.mlp.experts*", "*.self_attn.o_proj", "vision"))
    assert config.excludes("model.language_model.layers.1.mlp.experts")  # path* names the path itself
    assert not config.excludes("model.language_model.layers.12.mlp.experts")  # but not a longer number
    assert config.excludes("model.language_model.layers.7.self_attn.o_proj")
    assert config.excludes("model.vision_tower.x") and config.excludes("lm_head")  # contained in the name
    assert not config.excludes("model.language_model.layers.7.self_attn.q_proj")


def without_input_scales(weights: ModelWeights, layers: Collection[int] | None = None) -> ModelWeights:
    """``weights`` with the input scales of the NVFP4 experts (of ``layers``, or all) taken out."""
    out = []
    for layer in weights.layers:
        e = layer.experts
        if e.nvfp4 is not None and (layers is None or layer.index in layers):
            scales = dataclasses.replace(e.nvfp4, w13_input_scale=None, w2_input_scale=None)
            layer = dataclasses.replace(layer, experts=dataclasses.replace(e, nvfp4=scales))
        out.append(layer)
    return dataclasses.replace(weights, layers=out)


def test_nvfp4_save_needs_both_input_scales_or_neither(q_weights, tmp_path):
    layers = [dataclasses.replace(x) for x in q_weights.layers]
    e = layers[1].experts
    layers[1].experts = dataclasses.replace(e, nvfp4=dataclasses.replace(e.nvfp4, w2_input_scale=None))
    with pytest.raises(ValueError, match=r"input scales in some places and not in others .*\{1: \(True, False\)\}"):
        save_checkpoint(dataclasses.replace(q_weights, layers=layers), tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_nvfp4_save_refuses_input_scales_in_some_layers_only(tmp_path):
    weights = random_weights(ModelSpec.preset("tiny", 4), seed=8, expert_format="nvfp4")
    with pytest.raises(ValueError, match=r"\{1: \(False, False\), 2: \(True, True\)\}"):
        save_checkpoint(without_input_scales(weights, [1]), tmp_path / "a")


@pytest.fixture(scope="module")
def w4a16_ckpt(q_weights, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("w4a16_ckpt")
    save_checkpoint(without_input_scales(q_weights), directory, shard_bytes=SHARD_BYTES)
    return directory


def test_weight_only_nvfp4_round_trip(q_weights, w4a16_ckpt):
    """Experts without input scales are saved as ModelOpt's weight-only form
    (W4A16_NVFP4, no input scale tensors) and load back bit for bit, with the same
    outputs as the NVFP4 checkpoint they came from (the input scales are unused)."""
    config = json.loads((w4a16_ckpt / "config.json").read_text())["quantization_config"]
    assert config["quant_algo"] == "W4A16_NVFP4"
    assert not [n for n in weight_map(w4a16_ckpt) if n.endswith("input_scale")]
    loaded = load_checkpoint(w4a16_ckpt)
    assert_same_weights(without_input_scales(q_weights), loaded)
    s = loaded.layers[1].experts.nvfp4
    assert s.w13_input_scale is None and s.w2_input_scale is None
    assert_same_reference_outputs(q_weights, loaded, prompt_len=24, seed=12)


def test_weight_only_config_reads_input_scales_it_finds(q_weights, q_ckpt, tmp_path):
    """A weight-only config over a checkpoint that kept its input scales (as vLLM
    loads such checkpoints): they are read."""
    directory = copy_checkpoint(q_ckpt, tmp_path / "c")
    edit_config(directory, lambda c: c["quantization_config"].update(quant_algo="W4A16_NVFP4"))
    assert_same_weights(q_weights, load_checkpoint(directory))


def test_nvfp4_groups_without_input_activations_are_weight_only(w4a16_ckpt, tmp_path):
    """quant_algo NVFP4 whose every config group quantizes weights only is weight-only,
    as vLLM 0.33 reads it (it routes such checkpoints to W4A16)."""
    directory = copy_checkpoint(w4a16_ckpt, tmp_path / "c")
    groups = {"group_0": {"weights": {"num_bits": 4, "group_size": 16}, "input_activations": None}}
    edit_config(directory, lambda c: c["quantization_config"].update(quant_algo="NVFP4", config_groups=groups))
    assert load_checkpoint(directory).layers[1].experts.nvfp4.w2_input_scale is None
    groups["group_0"]["input_activations"] = {"num_bits": 4}
    edit_config(directory, lambda c: c["quantization_config"].update(config_groups=groups))
    name = re.escape(f"{PREFIX}layers.1.mlp.experts.gate_up_proj_input_scale")
    with pytest.raises(CheckpointError, match=rf"{name} is missing .*NVFP4 with activation scales"):
        load_checkpoint(directory)


def test_legacy_config_groups_are_read_where_vllm_reads_them(w4a16_ckpt, tmp_path):
    """hf_quant_config.json: vLLM reads ``config_groups`` at the file's top level (the
    ``original_config``), not inside ``quantization``; so does the loader."""
    directory = copy_checkpoint(w4a16_ckpt, tmp_path / "c")
    config = json.loads((directory / "config.json").read_text())
    ignore = config.pop("quantization_config")["ignore"]
    (directory / "config.json").write_text(json.dumps(config))
    groups = {"group_0": {"weights": {"num_bits": 4}, "input_activations": None}}
    legacy = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ignore}, "config_groups": groups}
    (directory / HF_QUANT_CONFIG_NAME).write_text(json.dumps(legacy))
    assert load_checkpoint(directory).layers[1].experts.nvfp4.w13_input_scale is None
    legacy = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ignore, "config_groups": groups}}
    (directory / HF_QUANT_CONFIG_NAME).write_text(json.dumps(legacy))
    with pytest.raises(CheckpointError, match="gate_up_proj_input_scale is missing"):
        load_checkpoint(directory)


def test_weight_only_checkpoint_with_one_input_scale_is_refused(w4a16_ckpt, tmp_path, q_weights):
    directory = copy_checkpoint(w4a16_ckpt, tmp_path / "c")
    name = f"{PREFIX}layers.1.mlp.experts.down_proj_input_scale"
    add_tensors(directory, {name: q_weights.layers[1].experts.nvfp4.w2_input_scale})
    with pytest.raises(CheckpointError, match="carry one of their two input scales"):
        load_checkpoint(directory)
