"""Fixtures of the vLLM integration's tests (imported by conftest.py only where
vLLM is installed): a tiny Muse Spark checkpoint and DSpark draft on disk, real
``VllmConfig`` objects, vLLM's distributed state over gloo, and the model built
and loaded by vLLM's own loader and ``load_weights`` on the CPU."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm.plugins
from safetensors.torch import load_file
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from sparkdecode.checkpoint import save_checkpoint
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import ExpertWeights, Nvfp4Scales, random_weights

MAX_CONTEXT = 512
SEED = 11
# DSpark's aux layers are its target layer ids + 1: layer 1's input stream and
# the final stream (num_layers), so both kinds of aux output are exercised.
DRAFT_TARGET_LAYERS = (0, 3)

_platform = type(current_platform)
_platform.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
_platform.support_static_graph_mode = classmethod(lambda cls: True)
# The CPU platform's own config rewrites (DBO off, CPU compilation settings) are not
# the GPU's: leave configs as given. The modules are still built by its backends.
_platform.check_and_update_config = classmethod(lambda cls, vllm_config: None)
_platform.is_sleep_mode_available = lambda self: True

# The CPU attention backend's kernel pages are multiples of 32 tokens; FlashAttention
# on Hopper takes multiples of 16, and vLLM sizes the sliding-window layers' KV
# blocks by that (16 where --block-size is 16). Give the CPU backend Hopper's.
CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(lambda kv_cache_spec=None: [MultipleOf(16)])

# As every vLLM process does at start, before any config resolves an architecture
# (vLLM caches the resolved model class per checkpoint path).
vllm.plugins.load_general_plugins()


def tiny_spec() -> ModelSpec:
    return ModelSpec.preset("tiny")


def write_multimodal_config(directory: Path, spec: ModelSpec, quantization: dict | None = None) -> None:
    """The config.json vLLM reads for ``MuseSparkForConditionalGeneration``: the
    text model of ``spec`` with the smallest vision and audio towers its config
    classes accept (their weights are absent: vLLM leaves them as allocated)."""
    text = spec.to_config()
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    config: dict[str, Any] = {
        "architectures": ["MuseSparkForConditionalGeneration"],
        "model_type": "muse_spark",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "hidden_act": "gelu",
            "layer_types": ["full_attention"],
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
            "patch_size": 14,
            "patch_temporal": 2,
            "merge_size": 2,
            "layer_norm_eps": 1e-5,
            "pos_emb_height": 4,
            "pos_emb_width": 4,
        },
        "audio_config": {
            "hidden_act": "gelu",
            "num_hidden_layers": 1,
            "patch_sizes": [4],
            "depths": [1],
            "hidden_sizes": [32],
            "out_hidden_size": spec.H,
            "conv_kernel_size": 3,
            "mlp_ratio": 2,
            "rms_norm_eps": 1e-5,
        },
        "projector_hidden_size": 64,
        "out_hidden_size": 32 * 2**2,
    }
    if quantization is not None:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Muse Spark checkpoint written by the core (HF names, HF Q/K order,
    the router unfolded), with the multimodal config vLLM serves."""
    directory = tmp_path_factory.mktemp("muse-spark-tiny")
    spec = tiny_spec()
    save_checkpoint(random_weights(spec, seed=SEED), directory)
    write_multimodal_config(directory, spec)
    return directory


@pytest.fixture(scope="session")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DSpark draft config (no weights: only its config is read here)."""
    directory = tmp_path_factory.mktemp("dspark-draft")
    spec = tiny_spec()
    config = {
        "model_type": "muse_spark_dspark",
        "architectures": ["MuseSparkDSparkModel"],
        "hidden_size": spec.H,
        "num_hidden_layers": 1,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "dspark_target_layer_ids": list(DRAFT_TARGET_LAYERS),
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config) + "\n")
    return directory


def iter_checkpoint(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in sorted(directory.glob("*.safetensors")):
        yield from load_file(str(path)).items()


MakeConfig = Callable[..., Any]


def build_config(
    checkpoint: Path,
    draft: Path,
    *,
    model: dict | None = None,
    parallel: dict | None = None,
    compilation: dict | None = None,
    cache: dict | None = None,
    speculative: dict | None | bool = True,
    additional: dict | None = None,
    directory: Path | None = None,
    **kwargs: Any,
) -> Any:
    """A real ``VllmConfig`` of the tiny checkpoint. The defaults are a deployment
    the gate accepts (TP 1, DSpark 7, FULL_AND_PIECEWISE graphs, compilation mode
    NONE, bf16 KV cache of 16-token blocks, latency_specialized); each keyword
    group overrides one sub-config."""
    from vllm.config import (
        CacheConfig,
        CompilationConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        **{
            "model": str(directory or checkpoint),
            "skip_tokenizer_init": True,
            "dtype": "bfloat16",
            "max_model_len": MAX_CONTEXT,
            **(model or {}),
        }
    )
    parallel_config = ParallelConfig(**(parallel or {}))
    spec_config = None
    if speculative is not None and speculative is not False:
        settings = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 7}
        settings.update(speculative if isinstance(speculative, dict) else {})
        spec_config = SpeculativeConfig(
            **settings, target_model_config=model_config, target_parallel_config=parallel_config
        )
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device="cpu"),
        parallel_config=parallel_config,
        compilation_config=CompilationConfig(
            **{"mode": 0, "cudagraph_mode": "FULL_AND_PIECEWISE", **(compilation or {})}
        ),
        cache_config=CacheConfig(**{"block_size": 16, **(cache or {})}),
        speculative_config=spec_config,
        additional_config={"decode_backend": "latency_specialized", **(additional or {})},
        **kwargs,
    )


@pytest.fixture(scope="session")
def make_config(checkpoint: Path, draft: Path) -> MakeConfig:
    """``build_config`` of the session's checkpoint and draft."""
    return functools.partial(build_config, checkpoint, draft)


def gate_rank(rank: int, world: int, port: int, checkpoint: Path, draft: Path, capabilities: list, out: Path) -> None:
    """One rank of a TP group that runs ``gate.check`` over gloo with its own GPU
    capability; writes what it got (the settings' TP, or the error) to ``out``."""
    import torch.distributed as dist

    from sparkdecode.deployment import DeploymentError
    from sparkdecode.vllm import gate

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = build_config(checkpoint, draft)
    try:
        settings = gate.check(config, group=dist.group.WORLD, capability=tuple(capabilities[rank]))
        result = f"ok TP{settings.deployment.tp}"
    except DeploymentError as e:
        result = f"error {e}"
    (out / f"rank{rank}").write_text(result)
    dist.destroy_process_group()


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def distributed(make_config: MakeConfig) -> None:
    """vLLM's distributed state for one process over gloo (TP 1)."""
    init_tp_rank(make_config(), 0, 1, free_port())


def load_model(vllm_config: Any, directory: Path) -> Any:
    """The served model as vLLM builds it: the class resolved by vLLM's registry
    (the plug-in's subclass), built by the default loader's ``create_model``,
    loaded by the model's own ``load_weights`` from the checkpoint, then every
    MoE experts method's ``process_weights_after_loading`` (the SM90 path). The
    loader's remaining post-processing is left out: on the CPU platform it repacks
    bf16 linear weights for CPU GEMMs, which the CUDA platform does not."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config):
        loader = get_model_loader(vllm_config.load_config)
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            model = loader.create_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        model.load_weights(iter_checkpoint(directory))
        for module in model.modules():
            if type(module).__name__ == "MuseSparkRoutedExperts":
                module.quant_method.process_weights_after_loading(module)
    return model.eval()


class HostBlockTables:
    """What the ModelState reads of the V2 runner's ``BlockTables`` (its per-group
    input block tables, [max_reqs, max_blocks] int32), without the pinned host
    buffers the real one allocates, which need a CUDA driver."""

    def __init__(self, num_groups: int, max_reqs: int, max_blocks: int):
        self.input_block_tables = [torch.zeros(max_reqs, max_blocks, dtype=torch.int32) for _ in range(num_groups)]


def kv_cache_setup(vllm_config: Any, layout: str, memory: int = 64 * 2**20) -> Any:
    """vLLM's KV-cache config of the served model (its own specs, grouping and
    sizing) and the caches allocated and bound to the attention layers in the
    physical ``layout`` (a ``KVCacheLayout`` name), as the engine core and the
    worker do. Returns the ``KVCacheConfig`` and the attention groups."""
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.gpu.attn_utils import init_attn_backend, init_kv_cache

    vllm_config.cache_config.kv_cache_layout = layout
    with set_current_vllm_config(vllm_config):
        layers = get_layers_from_vllm_config(vllm_config, Attention)
        specs = {name: layer.get_kv_cache_spec(vllm_config) for name, layer in layers.items()}
        groups = get_global_kv_cache_groups(vllm_config, [specs])
        kv_cache_config = get_kv_cache_configs(vllm_config, [specs], [memory], groups)[0]
        attn_groups, _, kernel_block_sizes = init_attn_backend(kv_cache_config, vllm_config, torch.device("cpu"))
        init_kv_cache(
            vllm_config.compilation_config.static_forward_context,
            kv_cache_config,
            torch.device("cpu"),
            kernel_block_sizes,
            vllm_config,
        )
    return kv_cache_config, attn_groups


def init_tp_rank(config: Any, rank: int, world: int, port: int) -> None:
    """vLLM's distributed state of one rank of a TP group over gloo."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=world,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        ensure_model_parallel_initialized(world, 1)


# The layer tensors the TP-2 workers compare with the core's cut (besides the experts).
LAYER_TENSORS = ("qkvg", "o_proj", "router", "expert_bias", "pooler", "unpooler", "attn_alpha", "ffn_beta")


def rank_weights(config: Any, checkpoint: Path, rank: int, world: int, ep: bool) -> tuple[Any, Any]:
    """This rank's model built and loaded by vLLM, as the adapter reads it, and the
    core's own cut of the checkpoint for the rank (``shard_weights``)."""
    from sparkdecode.checkpoint import load_checkpoint
    from sparkdecode.vllm import adapter
    from sparkdecode.weights import Sharding, shard_weights

    model = load_model(config, checkpoint)
    sharding = adapter.sharding_of(model.model, world, rank, ep)
    ours = adapter.model_weights(tiny_spec(), model.model, model.lm_head, sharding)
    theirs = shard_weights(
        load_checkpoint(checkpoint), Sharding(tp=world, rank=rank, expert_parallel="ep" if ep else "tp")
    )
    return ours, theirs


def tp_rank_weights(
    rank: int, world: int, port: int, checkpoint: Path, draft: Path, out: Path, nvfp4: bool = False
) -> None:
    """One rank of a TP-2 deployment built and loaded by vLLM (over gloo), under EP
    and under expert TP: the adapter's ``ModelWeights`` of this rank against the
    core's own cut of the checkpoint (``shard_weights``), tensor by tensor. With
    ``nvfp4`` the checkpoint's experts are NVFP4, which vLLM repacks for Marlin as on
    Hopper: the experts the adapter holds (Marlin's tensors in place) then dequantize,
    bit for bit, to the core's cut under the global scales vLLM's SM90 method hands to
    Marlin. Writes ``ok`` or the first difference to ``out/rank{rank}-{mode}``."""
    from sparkdecode.vllm import adapter

    with pytest.MonkeyPatch.context() as patch:
        if nvfp4:
            patch_marlin_backend(patch)
            patch_marlin_repack(patch)
        for ep in (True, False):
            mode = "ep" if ep else "expert-tp"
            parallel = {"tensor_parallel_size": world, "enable_expert_parallel": ep}
            config = build_config(checkpoint, draft, parallel=parallel, additional={"decode_backend": "auto"})
            if ep:
                init_tp_rank(config, rank, world, port)
            try:
                ours, theirs = rank_weights(config, checkpoint, rank, world, ep)
                result = "ok"
                assert ours.expert_format == ("nvfp4_marlin" if nvfp4 else "bf16"), ours.expert_format
                assert ours.sharding == theirs.sharding, (ours.sharding, theirs.sharding)
                assert torch.equal(ours.final_norm, theirs.final_norm), "final_norm"
                for mine, ref in zip(ours.layers, theirs.layers, strict=True):
                    for name in LAYER_TENSORS:
                        assert torch.equal(getattr(mine, name), getattr(ref, name)), (mine.index, name)
                    assert (mine.num_heads, mine.num_kv_heads) == (ref.num_heads, ref.num_kv_heads)
                    a, b = mine.experts, ref.experts
                    assert (a.first_expert, a.intermediate_slice) == (b.first_expert, b.intermediate_slice), (a, b)
                    if b.format == "nvfp4":
                        assert a.format == "nvfp4_marlin", (mine.index, a.format)
                        b = marlin_definition(b)
                    else:
                        assert a.format == "bf16", (mine.index, a.format)
                    for x, y, name in zip(a.dequantized(), b.dequantized(), ("w13", "w2"), strict=True):
                        assert x.shape == y.shape and torch.equal(x, y), (mine.index, name)
            except AssertionError as e:
                result = f"differs: {e}"
            (out / f"rank{rank}-{mode}").write_text(result)
    # An adapter problem on rank 1 alone stops both ranks: rank 1 with its own error,
    # rank 0 naming rank 1's.
    from vllm.distributed import parallel_state

    from sparkdecode.deployment import RankFailedError, on_every_rank

    def read() -> str:
        if rank == 1:
            raise adapter.AdapterError("layer 3: not loaded")
        return "weights"

    try:
        on_every_rank(read, parallel_state.get_tp_group().cpu_group, "reading vLLM's weights")
        stopped = "not stopped"
    except (adapter.AdapterError, RankFailedError) as e:
        stopped = f"{type(e).__name__}: {e}"
    (out / f"rank{rank}-one-rank-fails").write_text(stopped)


# ---------------------------------------------------------------- NVFP4 on Marlin


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


def marlin_definition(experts: ExpertWeights) -> ExpertWeights:
    """The checkpoint's NVFP4 experts with the global scales vLLM's SM90 method
    hands to Marlin (the gate's for both halves of W13, W2's times up/gate): the
    weights Marlin computes with, in the core's NVFP4 form."""
    s = experts.nvfp4
    assert s is not None
    gate, up = s.w13_global[:, 0], s.w13_global[:, 1]
    scales = Nvfp4Scales(s.w13_scale, torch.stack([gate, gate], dim=1), s.w2_scale, s.w2_global * (up / gate))
    return dataclasses.replace(experts, nvfp4=scales)


def patch_marlin_backend(patch: pytest.MonkeyPatch) -> None:
    """vLLM's NVFP4 MoE backend as it chooses it on Hopper (Marlin): the CPU platform
    has none."""
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend, backend_to_kernel_cls
    from vllm.model_executor.layers.quantization import modelopt

    marlin = NvFp4MoeBackend.MARLIN
    patch.setattr(modelopt, "select_nvfp4_moe_backend", lambda **_: (marlin, backend_to_kernel_cls(marlin)[0]))


def patch_marlin_repack(patch: pytest.MonkeyPatch) -> None:
    """vLLM's Marlin repack with its CUDA op replaced by vLLM's Python model of it."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4

    patch.setattr(marlin_utils_fp4, "_repack_marlin_experts", python_marlin_repack)
