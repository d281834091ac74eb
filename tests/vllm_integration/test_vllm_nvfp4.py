"""NVFP4 checkpoints through vLLM 0.33 on the CPU: the core's checkpoint (its
``quantization_config``, the packed experts and their scales under the Hugging
Face names) as vLLM's config machinery, module builder and ``load_weights`` read
it; what vLLM's SM90 experts method hands to its Marlin repack; Marlin's layout
read back (``nvfp4_marlin``); the adapter's views of the repacked experts and
served steps on them.

The CPU platform has no NVFP4 MoE backend, so vLLM's backend choice is replaced
by the one it makes on Hopper (Marlin) for these tests. Marlin's repack
(``process_weights_after_loading``) runs with its one CUDA op, ``gptq_marlin_repack``,
replaced by vLLM's Python model of it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm_support import (
    MAX_CONTEXT,
    build_config,
    free_port,
    iter_checkpoint,
    load_model,
    marlin_definition,
    patch_marlin_backend,
    patch_marlin_repack,
    python_marlin_repack,
    tiny_spec,
    tp_rank_weights,
    write_multimodal_config,
)

from sparkdecode.checkpoint import MULTIMODAL_PREFIX, Nvfp4Config, load_checkpoint, save_checkpoint
from sparkdecode.layout import needed_kinds
from sparkdecode.vllm import gate
from sparkdecode.weights import ModelWeights, random_weights

SEED = 13


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with NVFP4 experts in every layer but the edge layers, saved by
    the core, under the multimodal config vLLM serves (same quantization_config)."""
    directory = tmp_path_factory.mktemp("muse-spark-tiny-nvfp4")
    spec = tiny_spec()
    save_checkpoint(random_weights(spec, seed=SEED, expert_format="nvfp4"), directory)
    quantization = json.loads((directory / "config.json").read_text())["quantization_config"]
    write_multimodal_config(directory, spec, quantization)
    return directory


@pytest.fixture(scope="module")
def marlin_as_on_hopper() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch_marlin_backend(patch)
        yield


@pytest.fixture(scope="module")
def loaded(nvfp4_checkpoint: Path, draft: Path, distributed: None, marlin_as_on_hopper: None) -> Any:
    """The stock model as vLLM builds it for this checkpoint (decode_backend=auto),
    after its own ``load_weights``, before ``process_weights_after_loading``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = build_config(nvfp4_checkpoint, draft, additional={"decode_backend": "auto"})
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            model = loader.create_model(vllm_config=config, model_config=config.model_config)
        model.load_weights(iter_checkpoint(nvfp4_checkpoint))
    return model.eval()


@pytest.fixture(scope="module")
def ours(nvfp4_checkpoint: Path) -> ModelWeights:
    return load_checkpoint(nvfp4_checkpoint)


def routed(layer: Any) -> Any:
    return layer.feed_forward.experts.routed_experts


def test_vllm_quantizes_exactly_the_layers_the_config_names(nvfp4_checkpoint: Path, loaded: Any) -> None:
    spec = tiny_spec()
    config = Nvfp4Config.from_config(
        json.loads((nvfp4_checkpoint / "config.json").read_text())["quantization_config"], ""
    )
    quantized = config.quantized_layers(spec, MULTIMODAL_PREFIX, "")
    assert quantized == set(range(1, spec.num_layers - 1))
    for layer in loaded.model.layers:
        method = routed(layer).quant_method
        if layer.layer_idx in quantized:
            assert type(method).__name__ == "MuseSparkModelOptNvFp4FusedMoE"
            assert method.nvfp4_backend.name == "MARLIN" and method.use_route_major  # SM90: Marlin, route-major
        else:
            assert type(method).__name__ == "MuseSparkUnquantizedFusedMoE"
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
            assert type(linear.quant_method).__name__ == "UnquantizedLinearMethod", layer.layer_idx
    assert type(loaded.lm_head.quant_method).__name__ == "UnquantizedLinearMethod"


def test_vllm_loads_the_nvfp4_experts_bit_for_bit(loaded: Any, ours: ModelWeights) -> None:
    """vLLM's loader puts the checkpoint's packed codes, e4m3 scales, the gate's and
    up's global scales and the input scales into its parameters unchanged."""
    for layer in loaded.model.layers[1:-1]:
        experts, mine = routed(layer), ours.layers[layer.layer_idx].experts
        s = mine.nvfp4
        assert s is not None
        pairs = {
            "w13_weight": mine.w13,
            "w13_weight_scale": s.w13_scale,
            "w13_weight_scale_2": s.w13_global,
            "w13_input_scale": s.w13_input_scale,
            "w2_weight": mine.w2,
            "w2_weight_scale": s.w2_scale,
            "w2_weight_scale_2": s.w2_global,
            "w2_input_scale": s.w2_input_scale,
        }
        for name, tensor in pairs.items():
            theirs = getattr(experts, name).data
            assert theirs.dtype == tensor.dtype and theirs.shape == tensor.shape, (layer.layer_idx, name)
            assert torch.equal(theirs.view(torch.uint8), tensor.view(torch.uint8)), (layer.layer_idx, name)


class _StopBeforeRepackError(Exception):
    pass


def test_sm90_marlin_takes_the_gate_scale_for_both_halves(
    loaded: Any, ours: ModelWeights, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What vLLM's SM90 method hands to the Marlin conversion: W13's global scale is
    the gate's for both halves, W2's is multiplied by up/gate (so Marlin's tensors
    no longer hold the up half's own scale)."""
    from vllm.models.muse_spark.nvidia import muse_moe_runner

    seen: dict[str, Any] = {}

    def capture(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise _StopBeforeRepackError

    monkeypatch.setattr(muse_moe_runner, "convert_to_nvfp4_moe_kernel_format", capture)
    layer = loaded.model.layers[1]
    with pytest.raises(_StopBeforeRepackError):
        routed(layer).quant_method.process_weights_after_loading(routed(layer))
    s = ours.layers[1].experts.nvfp4
    assert s is not None and seen["nvfp4_backend"].name == "MARLIN"
    gate, up = s.w13_global[:, 0], s.w13_global[:, 1]
    assert not torch.equal(gate, up)
    assert torch.equal(seen["w13_scale_2"], gate)
    assert torch.equal(seen["w2_scale_2"], s.w2_global * (up / gate))
    assert torch.equal(seen["w13"], ours.layers[1].experts.w13)


def test_marlin_layout_reads_back_to_the_weights_marlin_computes_with(
    ours: ModelWeights, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's SM90 conversion (gate's global for both halves, W2's times up/gate,
    then ``prepare_nvfp4_moe_layer_for_marlin``) on the checkpoint's experts, read
    back by ``nvfp4_marlin.from_marlin``: the same codes, and block times global
    scales that dequantize to what that conversion defines, bit for bit."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4

    from sparkdecode import nvfp4, nvfp4_marlin

    monkeypatch.setattr(marlin_utils_fp4, "_repack_marlin_experts", python_marlin_repack)
    spec = tiny_spec()
    e = ours.layers[1].experts
    s = e.nvfp4
    assert s is not None
    gate, up = s.w13_global[:, 0].contiguous(), s.w13_global[:, 1]
    w2_global = (s.w2_global * (up / gate)).contiguous()
    layer = SimpleNamespace(
        num_experts=spec.E, hidden_size=spec.P, intermediate_size_per_partition=spec.I, params_dtype=torch.bfloat16
    )
    marlin = marlin_utils_fp4.prepare_nvfp4_moe_layer_for_marlin(
        layer, e.w13, s.w13_scale, gate, e.w2, s.w2_scale, w2_global, is_act_and_mul=True
    )
    back = nvfp4_marlin.from_marlin(nvfp4_marlin.marlin_experts(*marlin, spec.P, spec.I))
    assert torch.equal(back.w13, e.w13) and torch.equal(back.w2, e.w2)
    w13, w2 = back.dequantized()
    assert torch.equal(w13, nvfp4.dequantize(e.w13, s.w13_scale, gate))
    assert torch.equal(w2, nvfp4.dequantize(e.w2, s.w2_scale, w2_global))
    # Marlin's weights are not the checkpoint's: its up half carries the gate's scale.
    assert not torch.equal(w13, e.dequantized()[0])


@pytest.fixture(scope="module")
def marlin_repack_on_the_cpu() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch_marlin_repack(patch)
        yield


@pytest.fixture(scope="module")
def served(
    nvfp4_checkpoint: Path, draft: Path, distributed: None, marlin_as_on_hopper: None, marlin_repack_on_the_cpu: None
) -> Any:
    """The NVFP4 checkpoint served with decode_backend=latency_specialized as vLLM
    builds it on an H200 (the gate, the load, the SM90 Marlin repack, the
    ModelState and its executor on the reference providers)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.model_states import init_model_state
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate, "platform_capability", lambda: (9, 0))  # this CPU stands in for an H200
        probe = gate.check(build_config(nvfp4_checkpoint, draft), capability=(9, 0))
        assert probe is not None and probe.deployment.expert_format == "nvfp4_marlin"
        pins = {kind: f"reference.{kind}" for kind in needed_kinds(probe.deployment)}
        config = build_config(nvfp4_checkpoint, draft, additional={"decode_providers": pins})
        model = load_model(config, nvfp4_checkpoint)
    set_eagle3_aux_hidden_state_layers(model, config.speculative_config)
    with set_current_vllm_config(config):
        state = init_model_state(config, model, None, torch.device("cpu"))
    return SimpleNamespace(config=config, model=model, state=state)


def test_the_adapter_views_marlins_tensors(served: Any, ours: ModelWeights) -> None:
    """The executor's NVFP4 experts are vLLM's Marlin tensors themselves (no copy),
    and dequantize, bit for bit, to what ``from_marlin`` reads back and to the
    checkpoint's experts under vLLM's SM90 global scales."""
    from sparkdecode import nvfp4_marlin

    spec = tiny_spec()
    weights = served.state.decode.weights
    assert weights.expert_format == "nvfp4_marlin"
    for layer, mine in zip(served.model.model.layers, weights.layers, strict=True):
        e, experts = mine.experts, routed(layer)
        if not 0 < layer.layer_idx < spec.num_layers - 1:
            assert e.format == "bf16"
            continue
        m = e.marlin
        assert e.format == "nvfp4_marlin" and m is not None
        for mine_t, name in (
            (e.w13, "w13_weight"),
            (m.w13_scale, "w13_weight_scale"),
            (m.w13_global, "w13_weight_scale_2"),
            (e.w2, "w2_weight"),
            (m.w2_scale, "w2_weight_scale"),
            (m.w2_global, "w2_weight_scale_2"),
        ):
            assert mine_t.data_ptr() == getattr(experts, name).data_ptr(), (layer.layer_idx, name)
        w13, w2 = e.dequantized()
        back = nvfp4_marlin.from_marlin(e)
        b13, b2 = back.dequantized()
        assert torch.equal(w13, b13) and torch.equal(w2, b2), layer.layer_idx
        d13, d2 = marlin_definition(ours.layers[layer.layer_idx].experts).dequantized()
        assert torch.equal(w13, d13) and torch.equal(w2, d2), layer.layer_idx


def test_the_cuda_experts_refuse_marlins_layout(served: Any) -> None:
    from sparkdecode_cuda.experts import CudaExpertsNvfp4

    deployment = dataclasses.replace(served.state.decode.settings.deployment, device="cuda", capability=(9, 0))
    assert "not nvfp4_marlin" in CudaExpertsNvfp4.unsupported(deployment)


def test_served_steps_equal_the_reference(served: Any, ours: ModelWeights, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of one request of 8 tokens through the served model's ``forward``
    (inside a pretended FULL capture, the executor reading Marlin's layout with
    ``reference.experts_nvfp4``) equal the reference model on the checkpoint's
    weights, its NVFP4 experts taken with vLLM's SM90 global scales, bit for bit;
    the checkpoint's own scales give other bits (the up half rounds otherwise)."""
    from test_vllm_served import MAX_REQS, Q, Request, bind
    from vllm.config import set_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.input_batch import InputBuffers
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    from sparkdecode.reference.kvcache import PagedKVCache
    from sparkdecode.reference.model import ReferenceModel
    from sparkdecode.vllm import model as served_model

    kv_cache_config, attn_groups, _ = bind(served, "LBNHC")
    monkeypatch.setattr(served_model, "stream_capturing", lambda: True)
    monkeypatch.setattr(DefaultModelState, "prepare_attn", lambda self, *args, **kw: {"stock": True})
    model, state, spec = served.model, served.state, tiny_spec()
    marlin_weights = dataclasses.replace(
        ours,
        layers=[
            dataclasses.replace(layer, experts=marlin_definition(layer.experts))
            if layer.experts.format == "nvfp4"
            else layer
            for layer in ours.layers
        ],
    )
    references = [ReferenceModel(w, MAX_CONTEXT) for w in (marlin_weights, ours)]
    caches = [PagedKVCache(spec, num_pages=64, max_context=MAX_CONTEXT, max_rows=Q) for _ in references]
    aux_layers = model.model.aux_hidden_state_layers
    buffers = InputBuffers(MAX_REQS, 64, torch.device("cpu"))
    request = Request(len(kv_cache_config.kv_cache_groups))
    gen = torch.Generator().manual_seed(5)
    differs = False
    for first in range(0, 3 * Q, Q):
        tokens = torch.randint(0, spec.vocab_size, (Q,), generator=gen)
        batch, tables, slots = request.step(first, Q, buffers)
        with set_current_vllm_config(served.config):
            state.prepare_attn(batch, CUDAGraphMode.FULL, tables, slots, attn_groups, kv_cache_config)
        positions = buffers.positions[:Q]
        hidden, aux = model(tokens, positions)
        rows = model.model.embed_tokens(tokens)
        outs = []
        for reference, cache in zip(references, caches, strict=True):
            cache.begin_step(first, Q)
            outs.append(reference.forward(rows, positions, cache.kv(), aux_layers))
        (hidden_ref, aux_ref), (hidden_ckpt, _) = outs
        assert torch.equal(hidden, hidden_ref), first
        for a, b in zip(aux, aux_ref, strict=True):
            assert torch.equal(a, b), first
        differs |= not torch.equal(hidden, hidden_ckpt)
    assert differs


@pytest.fixture(scope="module")
def weight_only_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The NVFP4 checkpoint's weights saved without input scales: ModelOpt's
    weight-only form (quant_algo W4A16_NVFP4)."""
    directory = tmp_path_factory.mktemp("muse-spark-tiny-w4a16-nvfp4")
    spec = tiny_spec()
    weights = random_weights(spec, seed=SEED, expert_format="nvfp4")
    layers = []
    for layer in weights.layers:
        e = layer.experts
        if e.nvfp4 is not None:
            scales = dataclasses.replace(e.nvfp4, w13_input_scale=None, w2_input_scale=None)
            layer = dataclasses.replace(layer, experts=dataclasses.replace(e, nvfp4=scales))
        layers.append(layer)
    save_checkpoint(dataclasses.replace(weights, layers=layers), directory)
    quantization = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert quantization["quant_algo"] == "W4A16_NVFP4"
    write_multimodal_config(directory, spec, quantization)
    return directory


def test_weight_only_nvfp4_serves_the_same_marlin_experts(
    weight_only_checkpoint: Path,
    served: Any,
    draft: Path,
    distributed: None,
    marlin_as_on_hopper: None,
    marlin_repack_on_the_cpu: None,
) -> None:
    """A W4A16_NVFP4 checkpoint (no input scales): vLLM 0.33 takes it as its
    weight-only NVFP4 config, the gate serves it, and Marlin's tensors after vLLM's
    repack (what the executor reads in place) equal, byte for byte, those of the
    NVFP4 checkpoint of the same weights (the activation scales never enter Marlin's
    W4A16 kernels)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate, "platform_capability", lambda: (9, 0))
        probe = gate.check(build_config(weight_only_checkpoint, draft), capability=(9, 0))
        assert probe is not None and probe.deployment.expert_format == "nvfp4_marlin"
        config = build_config(weight_only_checkpoint, draft, additional={"decode_backend": "auto"})
        assert config.quant_config.quant_method == "W4A16_NVFP4"
        model = load_model(config, weight_only_checkpoint)
    spec = tiny_spec()
    names = (
        "w13_weight",
        "w13_weight_scale",
        "w13_weight_scale_2",
        "w2_weight",
        "w2_weight_scale",
        "w2_weight_scale_2",
    )
    for layer, theirs in zip(model.model.layers[1:-1], served.model.model.layers[1:-1], strict=True):
        method = routed(layer).quant_method
        assert method.use_a16 and method.use_route_major, layer.layer_idx
        for name in names:
            a, b = getattr(routed(layer), name).data, getattr(routed(theirs), name).data
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (layer.layer_idx, name)
    assert len(model.model.layers) == spec.num_layers


def test_the_adapter_reads_marlins_experts_at_tp2(nvfp4_checkpoint: Path, draft: Path, tmp_path: Path) -> None:
    """Two ranks over gloo, each building, loading and repacking the NVFP4 checkpoint
    with vLLM at TP 2 as on Hopper (EP, then expert TP): each rank's experts, read in
    place from Marlin's tensors, are the checkpoint's cut for that rank (whole experts
    under EP, I-slices of codes and scales under expert TP), bit for bit."""
    import torch.multiprocessing as mp

    args = (2, free_port(), nvfp4_checkpoint, draft, tmp_path, True)
    mp.spawn(tp_rank_weights, args=args, nprocs=2, join=True)
    for rank in range(2):
        for mode in ("ep", "expert-tp"):
            assert (tmp_path / f"rank{rank}-{mode}").read_text() == "ok", (rank, mode)


def test_served_steps_at_tp2(nvfp4_checkpoint: Path, draft: Path, tmp_path: Path) -> None:
    """The NVFP4 checkpoint served at TP 2 (two gloo ranks, EP and expert TP; vLLM's
    Marlin repack as on Hopper): each rank's steps through vLLM's model, the executor
    reading its experts from Marlin's tensors in place, equal the reference model of
    its cut under Marlin's global scales, bit for bit."""
    import torch.multiprocessing as mp
    from test_vllm_served import tp_rank_served_steps

    args = (2, free_port(), nvfp4_checkpoint, draft, tmp_path, True)
    mp.spawn(tp_rank_served_steps, args=args, nprocs=2, join=True)
    for rank in range(2):
        for mode in ("ep", "expert-tp"):
            assert (tmp_path / f"rank{rank}-{mode}").read_text() == "ok", (rank, mode)
