"""The gate's answer on a matrix of real ``VllmConfig`` objects, built without a
GPU: every refused line comes back as its own sentence, the accepted deployments
give settings, and the ranks agree before any proceeds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from vllm.config import WeightTransferConfig
from vllm_support import MakeConfig, free_port, gate_rank, tiny_spec, write_multimodal_config

from sparkdecode.checkpoint import Nvfp4Config
from sparkdecode.deployment import DeploymentError
from sparkdecode.layout import needed_kinds
from sparkdecode.vllm import gate

HOPPER = (9, 0)


def reasons(config, capability=HOPPER) -> list[str]:
    return gate.unsupported(config, capability, "NVIDIA H200")


def test_the_reference_deployment_is_accepted(make_config: MakeConfig) -> None:
    config = make_config()
    assert reasons(config) == []
    settings = gate.check(config, capability=HOPPER, gpu_name="NVIDIA H200")
    assert settings is not None
    d = settings.deployment
    assert (d.tp, d.capability, d.expert_parallel, d.kv_dtype, d.kv_block_size) == (1, HOPPER, "ep", torch.bfloat16, 16)
    assert (d.max_rows, d.max_context, settings.q) == (8, 512, 8)
    assert (d.shard_pooler, d.shard_unpooler) == (False, False)  # vLLM replicates them on Hopper
    assert d.spec == tiny_spec()


@pytest.mark.parametrize(
    "overrides",
    [
        {"compilation": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
        {"parallel": {"tensor_parallel_size": 2, "enable_expert_parallel": True}},
        {"parallel": {"tensor_parallel_size": 2}},
        {"cache": {"cache_dtype": "bfloat16"}},
        {"additional": {"decode_providers": {"moe": "reference.moe", "experts": "reference.experts"}}},
    ],
    ids=["full-decode-only", "tp2-ep", "tp2-expert-tp", "kv-bf16-explicit", "pins"],
)
def test_other_accepted_deployments(make_config: MakeConfig, overrides: dict) -> None:
    config = make_config(**overrides)
    assert reasons(config) == []
    settings = gate.check(config, capability=HOPPER)
    assert settings is not None
    par = config.parallel_config
    assert settings.deployment.tp == par.tensor_parallel_size
    ep = par.enable_expert_parallel or par.tensor_parallel_size == 1
    assert settings.deployment.expert_parallel == ("ep" if ep else "tp")


@pytest.mark.parametrize("ep", [True, False], ids=["ep", "expert-tp"])
def test_the_recommended_override_shards_the_pooler_and_unpooler(make_config: MakeConfig, ep: bool) -> None:
    """The README's `--hf-overrides` for TP 8 on Hopper: vLLM 0.33 merges the nested
    text_config override into the checkpoint's text config, so its MoE column-shards the
    pooler and the unpooler on SM90, and the deployment follows that cut."""
    shard = {"text_config": {"muse_spark_tep_shard_pooler": True, "muse_spark_tep_shard_unpooler": True}}
    parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": ep}
    config = make_config(model={"hf_overrides": shard}, parallel=parallel)
    assert config.model_config.hf_text_config.muse_spark_tep_shard_pooler is True
    assert reasons(config) == []
    settings = gate.check(config, capability=HOPPER)
    assert settings is not None
    assert (settings.deployment.shard_pooler, settings.deployment.shard_unpooler) == (True, True)
    plain = gate.check(make_config(parallel=parallel), capability=HOPPER)
    assert plain is not None and (plain.deployment.shard_pooler, plain.deployment.shard_unpooler) == (False, False)


def test_auto_is_the_stock_decode(make_config: MakeConfig) -> None:
    for extra in ({"decode_backend": "auto"}, {}):
        config = make_config()
        config.additional_config = dict(extra)
        assert gate.check(config, capability=None) is None  # nothing else is read


def test_an_unknown_backend_raises(make_config: MakeConfig) -> None:
    with pytest.raises(DeploymentError, match="decode_backend must be one of auto, latency_specialized"):
        gate.check(make_config(additional={"decode_backend": "fast"}), capability=HOPPER)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"decode-backend": "latency_specialized"}, "key 'decode-backend' is not one sparkdecode reads"),
        ({"decode_backed": "latency_specialized"}, "key 'decode_backed' is not one sparkdecode reads"),
        ({"decode_provider": {"attention": "reference.attention"}}, "key 'decode_provider' is not one"),
        ('{"decode_backend": "latency_specialized"}', "additional_config is a str, not a dict"),
    ],
    ids=["dash", "typo", "singular", "a-string"],
)
def test_a_near_miss_of_our_keys_is_warned_about(make_config: MakeConfig, caplog, extra, words: str) -> None:
    """The stock decode stays on (nothing of ours was asked for by name), with a
    warning naming the key."""
    config = make_config()
    config.additional_config = extra
    with caplog.at_level("WARNING", logger="vllm.sparkdecode"):
        assert gate.check(config, capability=None) is None
    assert words in caplog.text


# (id, make_config overrides, words of the one refused line). Each row changes one
# thing of the accepted deployment.
REFUSED = [
    ("tp16", {"parallel": {"tensor_parallel_size": 16}}, "Tensor parallel size 16"),
    ("pp2", {"parallel": {"pipeline_parallel_size": 2}}, "Pipeline parallelism is on"),
    ("dp2", {"parallel": {"data_parallel_size": 2}}, "Data parallelism is on"),
    (
        "ep-round-robin",
        {
            "parallel": {
                "tensor_parallel_size": 2,
                "enable_expert_parallel": True,
                "expert_placement_strategy": "round_robin",
            }
        },
        "Expert placement is 'round_robin'",
    ),
    (
        "dcp2",
        {"parallel": {"tensor_parallel_size": 4, "decode_context_parallel_size": 2}},
        "Decode context parallelism",
    ),
    ("sleep", {"model": {"enable_sleep_mode": True}}, "Sleep mode is on"),
    ("weight-transfer", {"weight_transfer_config": WeightTransferConfig()}, "Weight transfer is configured"),
    ("graphs-none", {"compilation": {"cudagraph_mode": "NONE"}}, "CUDA graph mode is NONE"),
    ("graphs-piecewise", {"compilation": {"cudagraph_mode": "PIECEWISE"}}, "CUDA graph mode is PIECEWISE"),
    ("graphs-full-mixed", {"compilation": {"cudagraph_mode": "FULL"}}, "CUDA graph mode is FULL"),
    ("enforce-eager", {"model": {"enforce_eager": True}}, "CUDA graph mode is NONE"),
    ("capture-sizes", {"compilation": {"cudagraph_capture_sizes": [16, 32]}}, "capture sizes [16, 32] leave out 8"),
    ("no-spec", {"speculative": None}, "Speculative decoding is off"),
    ("spec-3-tokens", {"speculative": {"num_speculative_tokens": 3}}, "num_speculative_tokens is 3"),
    ("adaptive", {"speculative": {"enable_adaptive_verification": True}}, "Adaptive verification is on"),
    ("kv-fp8", {"cache": {"cache_dtype": "fp8"}}, "The KV cache dtype is fp8"),
    ("block-32", {"cache": {"block_size": 32}}, "The KV cache block size is 32"),
]


@pytest.mark.parametrize("overrides, words", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_each_refused_line(make_config: MakeConfig, overrides: dict, words: str) -> None:
    config = make_config(**overrides)
    found = reasons(config)
    assert len(found) == 1 and words in found[0], found
    assert found[0].endswith(".")
    with pytest.raises(DeploymentError) as raised:
        gate.check(config, capability=HOPPER)
    message = str(raised.value)
    assert message.startswith("decode_backend=latency_specialized cannot serve this deployment: ")
    assert words in message and "decode_backend=auto serves it with vLLM's stock decode" in message


def test_fp16(make_config: MakeConfig) -> None:
    """The KV cache follows the model dtype under cache_dtype auto: two lines."""
    assert reasons(make_config(model={"dtype": "float16"})) == [
        "The model dtype is torch.float16: the executor's weights and activations are bf16.",
        "The KV cache dtype is torch.float16: the executor reads a bf16 KV cache.",
    ]


def test_dbo(make_config: MakeConfig) -> None:
    """vLLM 0.33's V2 runner refuses DBO with speculative decoding and with
    multimodal models, so no config of this model reaches the gate with it; the
    line stands for the day one does."""
    with pytest.raises(ValueError, match="dual batch overlap"):
        make_config(parallel={"enable_dbo": True})
    config = make_config()
    config.parallel_config.enable_dbo = True
    (found,) = reasons(config)
    assert found.startswith("Dual-batch overlap (DBO, micro-batching) is on")


def test_lora(make_config: MakeConfig) -> None:
    from vllm.config import LoRAConfig

    (found,) = reasons(make_config(lora_config=LoRAConfig()))
    assert found.startswith("LoRA is on")


def test_torch_compile(make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM serves Muse Spark under breakable CUDA graphs by default, which forces
    compilation mode NONE; opting out lets a compiled mode through, and the gate
    refuses it."""
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    config = make_config(compilation={"mode": 3})
    (found,) = reasons(config)
    assert found.startswith("torch.compile is on (compilation mode VLLM_COMPILE)")


def test_muse_spark_runs_uncompiled_by_default(make_config: MakeConfig) -> None:
    config = make_config(compilation={"mode": 3})
    assert config.compilation_config.mode == 0 and reasons(config) == []


def test_the_v1_runner(make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM builds no DSpark config for the V1 runner; the runner is chosen again by
    the environment of each process, so a worker can still come up on V1."""
    config = make_config()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not config.use_v2_model_runner
    (found,) = reasons(config)
    assert found.startswith("vLLM runs the V1 model runner")


def test_batch_invariant_mode(make_config: MakeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert any("Batch-invariant mode" in r for r in reasons(config))


def test_kv_transfer(make_config: MakeConfig) -> None:
    from vllm.config import KVTransferConfig

    config = make_config(kv_transfer_config=KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"))
    assert any(r.startswith("KV transfer") for r in reasons(config))


@pytest.mark.parametrize(
    "capability, words",
    [(None, "No CUDA GPU is visible"), ((8, 0), "This GPU is SM80"), ((10, 0), "This GPU is SM100")],
)
def test_the_gpu(make_config: MakeConfig, capability, words: str) -> None:
    (found,) = reasons(make_config(), capability)
    assert found.startswith(words) and "Hopper" in found


def test_a_quantized_checkpoint_is_refused(make_config: MakeConfig) -> None:
    config = make_config()
    config.quant_config = None
    config.model_config.quantization = "fp8"
    (found,) = reasons(config)
    assert found.startswith(
        "The checkpoint is quantized (fp8): the executor reads bf16 weights and ModelOpt NVFP4 routed experts only"
    )


def test_a_text_config_the_executor_does_not_take(make_config: MakeConfig, checkpoint: Path, tmp_path: Path) -> None:
    directory = tmp_path / "dense"
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["mlp_layer_types"][1] = "dense"
    (directory / "config.json").write_text(json.dumps(config))
    (found,) = reasons(make_config(directory=directory))
    assert found.startswith("The text config is not one the executor takes") and "dense MLP layers" in found


def test_the_executor_and_provider_requirements(make_config: MakeConfig) -> None:
    """TP 8 passes every serving line, but the tiny model's 2 KV heads do not split
    over 8 ranks: the core gate's sentence comes through."""
    (found,) = reasons(make_config(parallel={"tensor_parallel_size": 8}))
    assert "tensor parallel size 8" in found.lower() and "do not split evenly" in found


def test_pins(make_config: MakeConfig) -> None:
    (found,) = reasons(make_config(additional={"decode_providers": {"moe": "nopack.moe"}}))
    assert "nopack.moe" in found
    (found,) = reasons(make_config(additional={"decode_providers": {"lm_head": "reference.lm_head"}}))
    assert found.startswith("The additional config:") and "lm_head" in found and "not blocks or sub-ops" in found
    (found,) = reasons(make_config(additional={"decode_providers": ["reference.moe"]}))
    assert "must map a block to a provider name" in found


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync-scheduling"])
@pytest.mark.parametrize("setting", [None, "device", "sync"])
def test_decode_lengths(make_config: MakeConfig, asynchronous: bool, setting: str | None) -> None:
    """Under asynchronous scheduling the host's lengths are an upper bound unless
    ``decode_lengths`` is ``sync`` (then the ModelState reads them off the device before
    a host-planned step, and the deployment says they are exact); under synchronous
    scheduling they are exact and nothing is read."""
    config = make_config(additional={} if setting is None else {"decode_lengths": setting})
    config.scheduler_config.async_scheduling = asynchronous
    assert reasons(config) == []
    settings = gate.check(config, capability=HOPPER)
    assert settings.host_lengths_upper_bound is asynchronous
    assert settings.deployment.host_lengths_exact is (not asynchronous or setting == "sync")


@pytest.mark.parametrize("value", ["exact", True, None])
def test_decode_lengths_refuses_other_values(make_config: MakeConfig, value) -> None:
    (found,) = reasons(make_config(additional={"decode_lengths": value}))
    assert found.startswith("The additional config:") and "decode_lengths" in found and "device, sync" in found
    with pytest.raises(DeploymentError, match="decode_lengths"):
        gate.check(make_config(additional={"decode_lengths": value}), capability=HOPPER)


def test_draft_pins_are_left_to_the_draft(make_config: MakeConfig) -> None:
    from sparkdecode.protocols import DRAFT_KINDS

    draft_kind = DRAFT_KINDS[0]
    config = make_config(additional={"decode_providers": {draft_kind: "somepack.draft", "moe": "reference.moe"}})
    assert reasons(config) == []
    assert dict(gate.check(config, capability=HOPPER).pins) == {"moe": "reference.moe"}


def test_every_kind_can_be_pinned_to_the_reference(make_config: MakeConfig) -> None:
    config = make_config()
    deployment = gate.check(config, capability=HOPPER).deployment
    pins = {kind: f"reference.{kind}" for kind in needed_kinds(deployment)}
    settings = gate.check(make_config(additional={"decode_providers": pins}), capability=HOPPER)
    assert dict(settings.pins) == pins


def test_every_unmet_line_is_reported(make_config: MakeConfig) -> None:
    config = make_config(parallel={"pipeline_parallel_size": 2}, cache={"block_size": 32}, speculative=None)
    found = reasons(config, (8, 9))
    assert [r.split()[0] for r in found] == ["This", "Pipeline", "Speculative", "The"]
    with pytest.raises(DeploymentError) as raised:
        gate.check(config, capability=(8, 9))
    for sentence in found:
        assert sentence in str(raised.value)


def nvfp4_config(make_config: MakeConfig, checkpoint: Path, directory: Path, quantization: dict, **kwargs):
    """A config of the tiny checkpoint under a ModelOpt quantization config (vLLM
    resolves it to its ModelOpt NVFP4 config; the weights are not read here)."""
    shutil.copytree(checkpoint, directory)
    write_multimodal_config(directory, tiny_spec(), quantization=quantization)
    config = make_config(directory=directory, **kwargs)
    assert type(config.quant_config).__name__ == "ModelOptNvFp4Config"
    return config


def test_nvfp4_experts_are_served_in_marlins_layout(make_config: MakeConfig, checkpoint: Path, tmp_path: Path) -> None:
    """ModelOpt NVFP4 routed experts: the deployment's experts are vLLM's Marlin
    repack (``nvfp4_marlin``), which the reference experts read; the CUDA pack's
    NVFP4 kernels read the checkpoint's layout only, and pinning them is refused
    with their reason."""
    quantization = Nvfp4Config.for_layers(tiny_spec(), range(1, tiny_spec().num_layers - 1)).to_config()
    config = nvfp4_config(make_config, checkpoint, tmp_path / "nvfp4", quantization)
    assert reasons(config) == []
    settings = gate.check(config, capability=HOPPER)
    assert settings is not None and settings.deployment.expert_format == "nvfp4_marlin"
    assert "experts_nvfp4" in needed_kinds(settings.deployment)
    pinned = nvfp4_config(
        make_config,
        checkpoint,
        tmp_path / "pinned",
        quantization,
        additional={"decode_providers": {"experts_nvfp4": "cuda.experts_nvfp4"}},
    )
    (found,) = reasons(pinned)
    assert "cuda.experts_nvfp4" in found and "not nvfp4_marlin" in found and "Marlin" in found


def test_nvfp4_beyond_the_experts_is_refused(make_config: MakeConfig, checkpoint: Path, tmp_path: Path) -> None:
    """A ModelOpt NVFP4 config that quantizes more than the routed experts (here
    everything: no excluded modules) gets one sentence naming a module."""
    config = nvfp4_config(
        make_config,
        checkpoint,
        tmp_path / "nvfp4",
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []},
    )
    (found,) = reasons(config)
    assert found.startswith("The checkpoint's ModelOpt NVFP4 config is not one the executor serves")
    assert "quantizes lm_head" in found
    with pytest.raises(DeploymentError, match="ModelOpt NVFP4 config is not one the executor serves"):
        gate.check(config, capability=HOPPER)


@pytest.mark.parametrize("quantizes", ["experts", "everything"])
def test_a_legacy_hf_quant_config_is_read_too(
    make_config: MakeConfig, checkpoint: Path, tmp_path: Path, quantizes: str
) -> None:
    """The NVFP4 config in a legacy hf_quant_config.json (no quantization_config in
    config.json), which vLLM's config loader puts in the HF config: judged as the
    config.json form is."""
    spec = tiny_spec()
    ignore = list(Nvfp4Config.for_layers(spec, range(1, spec.num_layers - 1)).ignore) if quantizes == "experts" else []
    directory = tmp_path / "legacy"
    shutil.copytree(checkpoint, directory)
    write_multimodal_config(directory, spec)
    legacy = {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ignore,
        },
    }
    (directory / "hf_quant_config.json").write_text(json.dumps(legacy))
    config = make_config(directory=directory)
    assert type(config.quant_config).__name__ == "ModelOptNvFp4Config"
    if quantizes == "experts":
        assert reasons(config) == []
    else:
        (found,) = reasons(config)
        assert found.startswith("The checkpoint's ModelOpt NVFP4 config is not one the executor serves")
        assert "quantizes lm_head" in found


def test_the_ranks_agree_before_anyone_proceeds(checkpoint: Path, draft: Path, tmp_path: Path) -> None:
    """Two ranks over gloo, rank 1 on an Ampere GPU: rank 0, which could serve,
    stops too, and both name rank 1's reason."""
    import torch.multiprocessing as mp

    capabilities = [(9, 0), (8, 0)]
    mp.spawn(gate_rank, args=(2, free_port(), checkpoint, draft, capabilities, tmp_path), nprocs=2, join=True)
    for rank in range(2):
        result = (tmp_path / f"rank{rank}").read_text()
        assert result.startswith("error decode_backend=latency_specialized cannot serve this deployment: ")
        assert "rank 1: This GPU is SM80" in result
