"""The deployment gate on vLLM's ``VllmConfig``.

``decode_backend`` (``additional_config``) is ``auto`` (the stock decode, the
default) or ``latency_specialized``; anything else raises. When the specialized
decode is requested, ``check`` raises ``DeploymentError`` at start-up with one
sentence per unmet requirement, after the TP ranks agree
(``sparkdecode.deployment.agree``), so no rank proceeds alone. What it refuses:

- serving lines (``serving_reasons``): a GPU that is not Hopper; a TP size the
  executor does not build; pipeline parallelism; data parallelism, expert
  parallelism other than EP = TP (or none: expert TP), round-robin expert
  placement, EPLB; DBO; decode and prefill context parallelism; LoRA; sleep
  mode; the V1 model runner (only the V2 runner asks the model for its
  ModelState); torch.compile (a compiled forward would trace the executor);
  deployments without separate FULL decode CUDA graphs, or whose capture sizes
  leave out the verify step's 8 tokens; speculative decoding
  other than DSpark with 7 tokens and no adaptive verification, no dynamic
  token counts; a model dtype or KV cache dtype other than bf16; KV blocks other
  than 16 tokens; KV transfer; batch-invariant mode; the MegaMoE backend;
  quantized checkpoints other than ModelOpt NVFP4 (``quantization_reason``);
- the text config (``ModelSpec`` validation);
- once those hold, the core gate on the ``Deployment`` this config makes: the
  executor's own requirements, every block's providers (each provider's
  ``unsupported`` sees the GPU, TP size, expert layout and format, KV dtype and
  block size) and the pins of ``additional_config["decode_providers"]``. ModelOpt
  NVFP4 experts, which vLLM repacks on SM90 into Marlin's layout and keeps using
  there, make the format ``nvfp4_marlin``: served where an ``experts_nvfp4``
  provider reads that layout in place.

``additional_config["decode_lengths"]`` (``device``, the default, or ``sync``) says
what asynchronous scheduling (vLLM's default with DSpark), whose host count of
computed tokens assumes every draft accepted, does to the providers that plan a step
on the host from its lengths: left out (``device``; the cores that read the lengths
from device buffers serve), or served with the exact lengths read off the device
before each such step (``sync``: a wait on the step before, as vLLM's own FlashInfer
backend makes with drafts).

The KV cache's physical layout is resolved by vLLM's engine core after the model
is built (``resolve_kv_cache_layout``), so it cannot be read here: the adapter
checks each bound cache, and every provider's ``prepare_kv`` the views, in the
ModelState's ``initialize_kv_cache``, before any step runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import deployment as core
from ..checkpoint import MULTIMODAL_PREFIX, CheckpointError, Nvfp4Config
from ..deployment import DeploymentError
from ..plugins import Registry
from ..protocols import ALL_KINDS, KINDS, Deployment
from ..spec import ModelSpec, SpecError
from . import LOGGER

logger = logging.getLogger(LOGGER)

# Hopper (H100, H200): the GPUs the project's kernels target and vLLM's SM90
# Muse Spark path (bf16 experts kept in the checkpoint layout, NVFP4 experts in
# Marlin's) serves.
CAPABILITIES = ((9, 0),)
DRAFT_TOKENS = 7  # DSpark drafts; a verify step carries 1 + 7 tokens
KV_BLOCK_SIZE = 16
SEPARATE_DECODE_GRAPHS = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")


@dataclass(frozen=True)
class Settings:
    """What the gate fixed for a deployment it accepts."""

    deployment: Deployment
    pins: Mapping[str, str] = field(default_factory=dict)
    q: int = 1 + DRAFT_TOKENS
    max_context: int = 4096
    # Asynchronous scheduling: the runner's host lengths are an upper bound, so before a
    # step that a provider plans on the host the ModelState reads the exact ones off the
    # device (such providers serve only with ``decode_lengths: sync``, or from a pack
    # whose provider does not refuse the inexact deployment)
    host_lengths_upper_bound: bool = False


OUR_KEYS = ("decode_backend", "decode_providers", "decode_lengths")
# ``additional_config["decode_lengths"]``: under asynchronous scheduling the host knows
# a step's lengths only as an upper bound; ``device`` leaves out the providers that plan
# on the host from them, ``sync`` makes them exact by a read off the device before such
# a step (a wait on the step before, as vLLM's own FlashInfer backend makes with drafts).
LENGTHS = ("device", "sync")


def requested(vllm_config: Any) -> bool:
    """Whether ``latency_specialized`` is asked for (``auto``: False; else raises).
    A key that looks like one of ours but is not (``decode-backend``,
    ``decode_provider``), or an additional config that is not a dict, is warned
    about: it would otherwise leave the stock decode on without a word."""
    extra = vllm_config.additional_config
    if extra is not None and not isinstance(extra, Mapping):
        logger.warning(
            "sparkdecode: additional_config is a %s, not a dict: decode_backend is not read from it "
            '(pass --additional-config \'{"decode_backend": "latency_specialized"}\')',
            type(extra).__name__,
        )
        extra = {}
    for key in extra or {}:
        plain = str(key).lower().replace("-", "_")
        if key not in OUR_KEYS and plain.startswith("decode"):
            logger.warning(
                "sparkdecode: additional_config key %r is not one sparkdecode reads (it reads %s)",
                key,
                ", ".join(OUR_KEYS),
            )
    return core.decode_backend(extra or {}) == "latency_specialized"


def pins(vllm_config: Any) -> dict[str, str]:
    """``additional_config["decode_providers"]``: block or sub-op -> provider name
    (the target's kinds; the DSpark draft's kinds are accepted and left to its own
    executor)."""
    extra = vllm_config.additional_config
    value = extra.get("decode_providers", {}) if isinstance(extra, Mapping) else {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise DeploymentError(
            f'additional_config["decode_providers"] must map a block to a provider name, got {value!r}'
        )
    unknown = sorted(set(value) - set(ALL_KINDS))
    if unknown:
        raise DeploymentError(
            f'additional_config["decode_providers"] names {", ".join(unknown)}, which are not blocks or sub-ops '
            f"(those are {', '.join(ALL_KINDS)})"
        )
    return dict(value)


def lengths(vllm_config: Any) -> str:
    """``additional_config["decode_lengths"]`` (``device`` when unset; see LENGTHS)."""
    extra = vllm_config.additional_config
    value = extra.get("decode_lengths", "device") if isinstance(extra, Mapping) else "device"
    if value not in LENGTHS:
        raise DeploymentError(f'additional_config["decode_lengths"] must be one of {", ".join(LENGTHS)}, got {value!r}')
    return value


def host_lengths_upper_bound(vllm_config: Any) -> bool:
    """Whether the runner's host lengths are only an upper bound: asynchronous
    scheduling (vLLM resolved ``async_scheduling`` when it built the config; None: off)."""
    return bool(vllm_config.scheduler_config.async_scheduling)


def target_pins(chosen: Mapping[str, str]) -> dict[str, str]:
    """The pins of the target backbone's kinds (what its executor resolves)."""
    return {kind: name for kind, name in chosen.items() if kind in KINDS}


def platform_capability() -> tuple[int, int] | None:
    """This process's GPU (major, minor), None without one."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    return None if cap is None else (cap.major, cap.minor)


def platform_gpu_name() -> str | None:
    from vllm.platforms import current_platform

    return current_platform.get_device_name() if current_platform.is_cuda() else None


def kv_dtype(vllm_config: Any) -> torch.dtype | str:
    """The KV cache's element type: the model dtype under ``auto``."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto":
        return vllm_config.model_config.dtype
    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16}.get(str(cache_dtype), str(cache_dtype))


def serving_reasons(vllm_config: Any, capability: tuple[int, int] | None) -> list[str]:
    """Every line of the serving configuration the specialized decode cannot take,
    each a sentence; empty when all hold. Reads the config only."""
    from vllm import envs
    from vllm.config import CompilationMode

    par, model, cache = vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config
    comp, spec = vllm_config.compilation_config, vllm_config.speculative_config
    tp = par.tensor_parallel_size
    out: list[str] = []

    def need(ok: bool, sentence: str) -> None:
        if not ok:
            out.append(sentence)

    names = ", ".join(f"SM{a}{b}" for a, b in CAPABILITIES)
    if capability is None:
        out.append(f"No CUDA GPU is visible: the specialized decode runs on Hopper GPUs ({names}).")
    else:
        need(
            tuple(capability) in CAPABILITIES,
            f"This GPU is SM{capability[0]}{capability[1]}: the specialized decode runs on Hopper GPUs ({names}).",
        )
    need(
        tp in core.TP_SIZES,
        f"Tensor parallel size {tp} is not one the executor builds ({', '.join(map(str, core.TP_SIZES))}).",
    )
    need(
        par.pipeline_parallel_size == 1,
        f"Pipeline parallelism is on (pipeline_parallel_size={par.pipeline_parallel_size}): "
        "the executor runs every layer of the backbone in one stage.",
    )
    need(
        par.data_parallel_size == 1,
        f"Data parallelism is on (data_parallel_size={par.data_parallel_size}): its experts would be shared "
        "over DP x TP ranks, and the executor serves expert parallelism equal to TP or none.",
    )
    if par.enable_expert_parallel:
        need(
            par.expert_placement_strategy == "linear",
            f"Expert placement is {par.expert_placement_strategy!r}: under EP each rank must hold one "
            "contiguous range of experts (expert_placement_strategy='linear').",
        )
    need(not par.enable_eplb, "EPLB is on: the executor reads a fixed expert placement.")
    need(
        not par.use_ubatching,
        "Dual-batch overlap (DBO, micro-batching) is on: the executor runs one batch of one request.",
    )
    need(
        par.decode_context_parallel_size == 1,
        f"Decode context parallelism is on (decode_context_parallel_size={par.decode_context_parallel_size}): "
        "each rank must hold the whole KV cache of its heads.",
    )
    need(
        par.prefill_context_parallel_size == 1,
        f"Prefill context parallelism is on (prefill_context_parallel_size={par.prefill_context_parallel_size}): "
        "each rank must hold the whole KV cache of its heads.",
    )
    need(vllm_config.lora_config is None, "LoRA is on: the executor reads the base weights only.")
    need(not model.enable_sleep_mode, "Sleep mode is on: the executor holds views of weights that sleep would move.")
    need(
        getattr(vllm_config, "weight_transfer_config", None) is None,
        "Weight transfer is configured: the executor keeps values it derived from the weights at build, which an "
        "update of the weights would leave stale.",
    )
    need(
        vllm_config.use_v2_model_runner,
        "vLLM runs the V1 model runner: only the V2 runner asks the model for its ModelState, which builds the "
        "executor and binds the KV cache (set VLLM_USE_V2_MODEL_RUNNER=1, or drop what makes vLLM fall back).",
    )
    need(
        comp.mode == CompilationMode.NONE,
        f"torch.compile is on (compilation mode {getattr(comp.mode, 'name', comp.mode)}): a compiled forward "
        "would trace the executor's loop; use compilation mode NONE (-cc.mode=0).",
    )
    graphs = graph_mode_reason(comp.cudagraph_mode)
    need(graphs is None, graphs or "")
    sizes = list(comp.cudagraph_capture_sizes or ())
    need(
        not sizes or 1 + DRAFT_TOKENS in sizes,
        f"The CUDA graph capture sizes {sizes} leave out {1 + DRAFT_TOKENS} tokens: one request's verify step "
        "would replay a larger graph, captured for several requests, which runs the stock forward.",
    )
    if spec is None:
        out.append(
            f"Speculative decoding is off: the specialized decode serves DSpark verify steps of 1 + "
            f"{DRAFT_TOKENS} tokens (speculative method 'dspark', num_speculative_tokens {DRAFT_TOKENS})."
        )
    else:
        need(spec.method == "dspark", f"The speculative method is {spec.method!r}: only 'dspark' is served.")
        need(
            spec.num_speculative_tokens == DRAFT_TOKENS,
            f"num_speculative_tokens is {spec.num_speculative_tokens}: a verify step must carry 1 + "
            f"{DRAFT_TOKENS} tokens.",
        )
        need(
            not spec.enable_adaptive_verification,
            "Adaptive verification is on: it verifies a varying number of tokens per request.",
        )
        need(
            not spec.uses_dynamic_speculative_decoding(),
            "Dynamic speculative decoding is on: the number of drafted tokens varies with the batch.",
        )
    need(
        model.dtype == torch.bfloat16,
        f"The model dtype is {model.dtype}: the executor's weights and activations are bf16.",
    )
    dtype = kv_dtype(vllm_config)
    need(dtype == torch.bfloat16, f"The KV cache dtype is {dtype}: the executor reads a bf16 KV cache.")
    need(
        cache.block_size == KV_BLOCK_SIZE,
        f"The KV cache block size is {cache.block_size}: the executor reads pages of {KV_BLOCK_SIZE} tokens.",
    )
    need(
        vllm_config.kv_transfer_config is None,
        "KV transfer (disaggregated serving) is on: its connector hooks run outside the executor.",
    )
    need(not envs.VLLM_BATCH_INVARIANT, "Batch-invariant mode is on (VLLM_BATCH_INVARIANT=1).")
    need(
        vllm_config.kernel_config.moe_backend != "deep_gemm_mega_moe",
        "The MegaMoE backend (moe_backend='deep_gemm_mega_moe') repacks the experts and shards the stream.",
    )
    reason = quantization_reason(vllm_config)
    if reason is not None:
        out.append(reason)
    return out


NVFP4_QUANTIZATION = "modelopt_fp4"


def graph_mode_reason(graphs: Any) -> str | None:
    """Why a CUDA graph mode cannot run the executor, or None."""
    if graphs is not None and graphs.decode_mode().name == "FULL" and graphs.separate_routine():
        return None
    return (
        f"CUDA graph mode is {getattr(graphs, 'name', str(graphs))}: the executor runs only inside FULL decode "
        f"graphs captured apart from mixed batches ({' or '.join(SEPARATE_DECODE_GRAPHS)}); eager "
        "(enforce-eager), PIECEWISE and mixed-batch FULL graphs would run the stock forward or replay a verify "
        "graph for another batch."
    )


def check_resolved_graphs(vllm_config: Any) -> None:
    """The graph mode again once the runner has resolved it (vLLM may lower the mode
    the gate saw, at KV-cache setup, to what the attention backends support): raises
    where the executor would never run, rather than serving the stock decode."""
    reason = graph_mode_reason(vllm_config.compilation_config.cudagraph_mode)
    if reason is not None:
        raise DeploymentError(
            "decode_backend=latency_specialized cannot serve this deployment: vLLM resolved the CUDA graphs "
            f"after the gate: {reason} (decode_backend=auto serves it with vLLM's stock decode)"
        )


def expert_format(vllm_config: Any) -> str:
    """How the executor finds the routed experts: ``nvfp4_marlin`` for a ModelOpt
    NVFP4 checkpoint (on SM90 vLLM's Muse Spark experts method repacks them at load,
    ``process_weights_after_loading``, into Marlin's tiles, with e4m3 scales
    re-encoded for Marlin, the gate's global scale applied to both halves of W13
    and the up/gate ratio folded into W2's global scale; its stock forward keeps
    running Marlin on those tensors, so the executor reads them where they are);
    else ``bf16``."""
    quant = _quant(vllm_config)
    return "nvfp4_marlin" if quant is not None and _quant_name(quant) == NVFP4_QUANTIZATION else "bf16"


def quantization_reason(vllm_config: Any) -> str | None:
    """Why the checkpoint's quantization is not served (None for bf16 and ModelOpt
    NVFP4, whose experts the providers' gate decides on: ``expert_format``)."""
    quant = _quant(vllm_config)
    if quant is None:
        return None
    if _quant_name(quant) == NVFP4_QUANTIZATION:
        return _nvfp4_reason(vllm_config)
    return (
        f"The checkpoint is quantized ({_quant_name(quant)}): the executor reads bf16 weights and ModelOpt NVFP4 "
        "routed experts only; serve a bf16 or ModelOpt NVFP4 checkpoint."
    )


def _nvfp4_reason(vllm_config: Any) -> str | None:
    """Why a ModelOpt NVFP4 config is not served: it quantizes more than the routed
    experts (its ``ignore`` / ``exclude_modules`` matched as vLLM matches them,
    checkpoint.Nvfp4Config). None when it quantizes routed experts only."""
    model = vllm_config.model_config
    configs = (getattr(hf, "quantization_config", None) for hf in (model.hf_config, model.hf_text_config))
    value = next((c for c in configs if c is not None), None)
    if value is None:
        # vLLM's config loader puts a legacy hf_quant_config.json there too; a config
        # from elsewhere (an hf_overrides file) is one the gate cannot read.
        return (
            "The checkpoint's ModelOpt NVFP4 config is not in its HF config (config.json or hf_quant_config.json): "
            "the executor cannot tell which modules it quantizes."
        )
    try:
        config = Nvfp4Config.from_config(dict(value), "quantization_config")
        config.quantized_layers(model_spec(vllm_config), MULTIMODAL_PREFIX, "quantization_config")
    except (CheckpointError, SpecError) as e:
        return f"The checkpoint's ModelOpt NVFP4 config is not one the executor serves: {e}."
    return None


def _quant(vllm_config: Any) -> Any:
    model = vllm_config.model_config
    return vllm_config.quant_config if vllm_config.quant_config is not None else model.quantization


def _quant_name(quant: Any) -> str:
    get_name = getattr(quant, "get_name", None)
    return str(get_name()) if callable(get_name) else str(quant)


def model_spec(vllm_config: Any) -> ModelSpec:
    """The text model's spec from the served checkpoint's config (validated)."""
    hf = vllm_config.model_config.hf_config
    return ModelSpec.from_config(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))


def shards_projections(vllm_config: Any, capability: tuple[int, int] | None) -> tuple[bool, bool]:
    """Whether vLLM's Muse Spark MoE column-shards the pooler and the unpooler over
    TP at decode batches (its ``shard_pooler`` / ``shard_unpooler``): only with
    replicated tokens over TP > 1, by default on SM100 and newer, or as the text
    config's ``muse_spark_tep_shard_pooler`` / ``_unpooler`` says."""
    from vllm import envs

    par = vllm_config.parallel_config
    text = vllm_config.model_config.hf_text_config
    replicated = (
        par.tensor_parallel_size > 1
        and vllm_config.kernel_config.moe_backend != "deep_gemm_mega_moe"
        and not par.use_sequence_parallel_moe
        and par.data_parallel_size == 1
        and not envs.VLLM_BATCH_INVARIANT
    )
    default = replicated and capability is not None and tuple(capability) >= (10, 0)
    return (
        bool(replicated and getattr(text, "muse_spark_tep_shard_pooler", default)),
        bool(replicated and getattr(text, "muse_spark_tep_shard_unpooler", default)),
    )


def make_deployment(
    vllm_config: Any,
    spec: ModelSpec,
    capability: tuple[int, int] | None,
    gpu_name: str | None = None,
    q: int = 1 + DRAFT_TOKENS,
) -> Deployment:
    """The core's ``Deployment`` of this serving configuration (what providers read)."""
    par = vllm_config.parallel_config
    shard_pooler, shard_unpooler = shards_projections(vllm_config, capability)
    dtype = kv_dtype(vllm_config)
    return Deployment(
        spec=spec,
        tp=par.tensor_parallel_size,
        device="cuda" if capability is not None else "cpu",
        capability=None if capability is None else tuple(capability),
        gpu_name=gpu_name,
        expert_format=expert_format(vllm_config),
        kv_dtype=dtype if isinstance(dtype, torch.dtype) else torch.bfloat16,
        kv_block_size=vllm_config.cache_config.block_size,
        max_rows=q,
        max_context=vllm_config.model_config.max_model_len,
        # Whole experts per rank under EP (and at TP 1), an I-slice of each otherwise.
        expert_parallel="ep" if par.enable_expert_parallel or par.tensor_parallel_size == 1 else "tp",
        shard_pooler=shard_pooler,
        shard_unpooler=shard_unpooler,
        libraries=core.installed_libraries(),
        # Exact under synchronous scheduling, or made exact by a read off the device.
        host_lengths_exact=not host_lengths_upper_bound(vllm_config) or lengths(vllm_config) == "sync",
    )


def unsupported(
    vllm_config: Any,
    capability: tuple[int, int] | None = None,
    gpu_name: str | None = None,
    registry: Registry | None = None,
) -> list[str]:
    """Every reason this rank cannot run the specialized decode (empty: none):
    the serving lines, then the text config, then the core gate (the executor,
    the providers, the pins). Reads the config and this process's GPU only."""
    reasons = serving_reasons(vllm_config, capability)
    try:
        spec = model_spec(vllm_config)
        chosen = pins(vllm_config)
        lengths(vllm_config)
    except SpecError as e:
        return [*reasons, f"The text config is not one the executor takes: {e}."]
    except DeploymentError as e:
        return [*reasons, f"The additional config: {e}."]
    if reasons:  # the core gate repeats some serving lines (TP size, KV dtype and block size)
        return reasons
    deployment = make_deployment(vllm_config, spec, capability, gpu_name)
    reason = core.unsupported(deployment, registry, target_pins(chosen))
    return [] if reason is None else [f"{reason[0].upper()}{reason[1:]}."]


def check(
    vllm_config: Any,
    group: Any = None,
    capability: tuple[int, int] | None | str = "detect",
    gpu_name: str | None = None,
    registry: Registry | None = None,
) -> Settings | None:
    """None for the stock decode; the settings when the specialized decode is
    requested and every rank of ``group`` can run it; else ``DeploymentError`` on
    every rank, naming each unmet requirement (this rank's, or the first failing
    rank's). Collective over ``group`` when requested."""
    if not requested(vllm_config):
        logger.info("sparkdecode: decode_backend=auto: Muse Spark runs vLLM's stock decode")
        return None
    if capability == "detect":
        capability, gpu_name = platform_capability(), platform_gpu_name()
    reasons = unsupported(vllm_config, capability, gpu_name, registry)
    reason = core.agree(" ".join(reasons) if reasons else None, group)
    if reason is not None:
        raise DeploymentError(
            "decode_backend=latency_specialized cannot serve this deployment: "
            f"{reason} (decode_backend=auto serves it with vLLM's stock decode)"
        )
    spec = model_spec(vllm_config)
    settings = Settings(
        deployment=make_deployment(vllm_config, spec, capability, gpu_name),
        pins=target_pins(pins(vllm_config)),
        max_context=vllm_config.model_config.max_model_len,
        host_lengths_upper_bound=host_lengths_upper_bound(vllm_config),
    )
    logger.info(
        "sparkdecode: decode_backend=latency_specialized: the specialized decode is on "
        "(TP%d, %s experts, DSpark verify steps of %d tokens, pins %s, %s)",
        settings.deployment.tp,
        "EP" if settings.deployment.expert_parallel == "ep" else "expert-TP",
        settings.q,
        dict(settings.pins) or "none",
        "the host's lengths exact"
        if not settings.host_lengths_upper_bound
        else "the lengths read off the device before a host-planned step"
        if settings.deployment.host_lengths_exact
        else "the host's lengths an upper bound: the providers that plan on the host left out",
    )
    return settings
