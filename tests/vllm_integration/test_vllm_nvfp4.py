"""NVFP4 checkpoints through vLLM 0.33 on the CPU: the core's checkpoint (its
``quantization_config``, the packed experts and their scales under the Hugging
Face names) as vLLM's config machinery, module builder and ``load_weights`` read
it; what vLLM's SM90 experts method hands to its Marlin repack; Marlin's layout
read back (``nvfp4_marlin``); the adapter's refusal of the repacked experts.

The CPU platform has no NVFP4 MoE backend, so vLLM's backend choice is replaced
by the one it makes on Hopper (Marlin) for these tests. Marlin's repack itself
(``process_weights_after_loading``) runs CUDA ops and is not run here: the test of
what it receives stops it before them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_support import build_config, iter_checkpoint, tiny_spec, write_multimodal_config

from sparkdecode.checkpoint import MULTIMODAL_PREFIX, Nvfp4Config, load_checkpoint, save_checkpoint
from sparkdecode.vllm import adapter
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
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend, backend_to_kernel_cls
    from vllm.model_executor.layers.quantization import modelopt

    marlin = NvFp4MoeBackend.MARLIN
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modelopt, "select_nvfp4_moe_backend", lambda **_: (marlin, backend_to_kernel_cls(marlin)[0]))
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


def test_the_adapter_refuses_the_nvfp4_experts(loaded: Any) -> None:
    sharding = adapter.sharding_of(loaded.model, 1, 0, False)
    with pytest.raises(adapter.AdapterError, match=r"layer 1: feed_forward\.experts: NVFP4 experts .*Marlin's layout"):
        adapter.model_weights(tiny_spec(), loaded.model, loaded.lm_head, sharding)


def python_marlin_repack(weight: torch.Tensor, size_n: int, size_k: int, is_a_8bit: bool) -> torch.Tensor:
    """vLLM's ``_repack_marlin_experts`` with its CUDA op (``gptq_marlin_repack`` of
    the GPTQ words) replaced by vLLM's own Python model of it (``marlin_weights``
    of the unpacked codes, which vLLM's kernel tests check the op against)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights

    assert not is_a_8bit
    codes = nvfp4_codes(weight)  # [E, N, K]
    perm = get_weight_perm(4)
    return torch.stack([marlin_weights(c.T.contiguous(), size_k, size_n, 4, perm) for c in codes])


def nvfp4_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).to(torch.int32)


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
    back = nvfp4_marlin.from_marlin(*marlin, hidden=spec.P, intermediate=spec.I)
    assert torch.equal(back.w13, e.w13) and torch.equal(back.w2, e.w2)
    w13, w2 = back.dequantized()
    assert torch.equal(w13, nvfp4.dequantize(e.w13, s.w13_scale, gate))
    assert torch.equal(w2, nvfp4.dequantize(e.w2, s.w2_scale, w2_global))
    # Marlin's weights are not the checkpoint's: its up half carries the gate's scale.
    assert not torch.equal(w13, e.dequantized()[0])
