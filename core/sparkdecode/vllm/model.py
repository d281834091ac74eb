"""The Muse Spark model vLLM builds when sparkdecode is installed.

``SparkDecodeMuseSpark`` is the stock ``MuseSparkForConditionalGeneration`` with
three additions, all inert under ``decode_backend=auto``:

- ``__init__`` reads the gate (``gate.check``) before the stock modules are
  built: ``latency_specialized`` on a deployment it cannot serve stops every
  rank with the reasons;
- ``get_model_state_cls`` returns ``SparkDecodeModelState`` (the stock
  ``DefaultModelState`` under ``auto``). The V2 model runner builds it after the
  weights are loaded: it builds the executor over the adapter's views of the
  loaded modules, binds every KV cache in ``initialize_kv_cache`` (the profiling
  cache, then the real one) and, in ``prepare_attn``, refills the project's plain
  metadata from vLLM's before every step, outside the graph;
- ``forward`` runs the executor where ``VllmDecode.plan`` gives a step, else the
  stock forward. Where a step is planned, the executor returns what the stock
  forward returns: bf16 normed hidden states, and with DSpark's aux layers set,
  ``(hidden, aux)`` with the fp32 stream entering each aux layer, ascending.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from vllm.models.muse_spark import MuseSparkForConditionalGeneration
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from ..deployment import on_every_rank
from ..executor import DecodeConfig, SpecializedDecode
from ..protocols import HostStep, Step
from . import LOGGER, adapter, gate

logger = logging.getLogger(LOGGER)


class HostBatch(NamedTuple):
    """What ``prepare_attn`` saw of the step about to run (host values only)."""

    num_reqs: int
    num_tokens: int
    first_position: int  # request 0's first new position
    for_capture: bool


class VllmDecode:
    """The executor inside vLLM: built once after the weights load; binds each KV
    cache; plans every forward from host state only (the same on every rank)."""

    def __init__(self, model: Any, settings: gate.Settings, device: torch.device, group: Any = None):
        from vllm.distributed import get_tensor_model_parallel_rank

        self.model, self.settings, self.device = model, settings, device
        self.backbone = model.model
        d = settings.deployment
        self.spec = d.spec
        rank = get_tensor_model_parallel_rank() if d.tp > 1 else 0
        # What the adapter finds wrong on one rank stops every rank here, before the
        # executor's collective build.
        self.weights = on_every_rank(lambda: self._weights(model, d, rank), _tp_groups()[0], "reading vLLM's weights")
        self.config = DecodeConfig(
            q=settings.q,
            max_rows=settings.q,
            max_context=settings.max_context,
            aux_layers=tuple(self.backbone.aux_hidden_state_layers),
            pins=dict(settings.pins),
        )
        self.executor = SpecializedDecode(
            self.weights,
            self.config,
            deployment=d,
            group=group,
            measure=torch.device(device).type == "cuda",
        )
        self.binding: adapter.KVBinding | None = None
        self.host: HostBatch | None = None
        self.specialized_sizes: set[int] = set()  # token counts whose FULL graph runs the executor
        self.logged: set[str] = set()

    def _weights(self, model: Any, d: Any, rank: int) -> Any:
        """This rank's plain weights: views of vLLM's loaded modules."""
        sharding = adapter.sharding_of(self.backbone, d.tp, rank, d.expert_parallel == "ep")
        if (sharding.shard_pooler, sharding.shard_unpooler) != (d.shard_pooler, d.shard_unpooler):
            raise adapter.AdapterError(
                f"vLLM shards pooler/unpooler {sharding.shard_pooler}/{sharding.shard_unpooler}, "
                f"the gate expected {d.shard_pooler}/{d.shard_unpooler}"
            )
        return adapter.model_weights(self.spec, self.backbone, model.lm_head, sharding)

    # ----------------------------------------------------------- runner hooks

    def bind_kv(self, kv_cache_config: Any, block_tables: Any) -> None:
        """Bind the KV caches vLLM just allocated (``initialize_kv_cache``)."""
        widths = [int(t.shape[1]) for t in block_tables.input_block_tables]
        self.binding = adapter.bind_kv(
            self.spec, self.backbone, kv_cache_config, widths, self.config.max_rows, self.device
        )
        self.executor.prepare_kv(self.binding.kv)
        logger.info(
            "sparkdecode: KV caches bound: %d layers in %d KV-cache groups (layout %s)",
            len(self.binding.kv),
            sum(g is not None for g in self.binding.groups),
            _layout_name(self.model),
        )

    def prepare_step(
        self, input_batch: Any, cudagraph_mode: Any, block_tables: Any, slot_mappings: Any, for_capture: bool
    ) -> None:
        """Host view of the step and, for one request of q tokens, the project's
        metadata refilled from vLLM's (``prepare_attn``; outside any graph)."""
        num_reqs = int(input_batch.num_reqs_after_padding if for_capture else input_batch.num_reqs)
        num_tokens = int(input_batch.num_tokens_after_padding)
        # The runner's host mirror of the computed tokens is an upper bound under
        # asynchronous scheduling with drafts (it counts every draft as accepted);
        # the device's sequence lengths are exact.
        first = int(input_batch.num_computed_tokens_np[0]) if input_batch.num_computed_tokens_np.size else 0
        self.host = HostBatch(num_reqs, num_tokens, first, for_capture)
        one = self.one_request(self.host)
        if one and not for_capture and self.settings.host_lengths_upper_bound and self.executor.plans_on_host:
            # A provider plans the step on the host from its lengths, though the host
            # knows them only as an upper bound (asynchronous scheduling): with
            # ``decode_lengths: sync`` (or a pack's provider that does not refuse such a
            # deployment) it gets the exact length, read off the device, as vLLM's own
            # FlashInfer backend does with drafts. Cores that read the device buffers
            # need no such wait.
            first = exact_context_len(input_batch) - num_tokens
            self.host = self.host._replace(first_position=first)
        if (
            not for_capture
            and getattr(cudagraph_mode, "name", "") == "FULL"
            and num_tokens in self.specialized_sizes
            and not one
        ):
            # A graph captured with the executor replays only for its own batch form.
            raise RuntimeError(
                f"sparkdecode: the FULL graph of {num_tokens} tokens runs the executor, but this batch is "
                f"{num_reqs} requests of {input_batch.num_tokens} tokens"
            )
        if one and self.binding is not None and block_tables is not None and slot_mappings is not None:
            adapter.refresh(self.binding, block_tables, slot_mappings, input_batch.seq_lens)
            self.executor.prepare_step(HostStep(first_position=first, rows=num_tokens, context_len=first + num_tokens))

    def one_request(self, host: HostBatch | None) -> bool:
        q = self.config.q
        return host is not None and host.num_reqs == 1 and host.num_tokens == q

    # ---------------------------------------------------------------- forward

    def plan(
        self,
        positions: torch.Tensor,
        intermediate_tensors: Any,
        normed_embeddings: bool,
        capturing: bool | None = None,
        runtime_mode: str | None = None,
    ) -> Step | None:
        """This forward's step, or None for the stock forward. Every predicate reads
        host state (the same on every rank). Stock runs:
        - pipeline-stage inputs;
        - forwards outside a CUDA graph capture (profiling, warm-up, eager steps)
          and PIECEWISE captures: the executor runs only inside FULL decode graphs,
          so every stock kernel has run once before any capture;
        - batches other than one request of q tokens (prefills, several requests);
        - no KV cache bound, or metadata in a form the providers do not take
          (``SpecializedDecode.plan``).
        ``capturing`` and ``runtime_mode`` default to the current CUDA stream and
        vLLM's forward context; tests pass them."""
        b = positions.shape[0]
        if intermediate_tensors is not None:
            return self.outcome(b, "a pipeline stage's input")
        if capturing is None:
            capturing = stream_capturing()
        if not capturing:
            return self.outcome(b, "outside a FULL CUDA graph capture")
        if runtime_mode is None:
            runtime_mode = _runtime_mode()
        if runtime_mode == "PIECEWISE":
            return self.outcome(b, "a PIECEWISE graph")
        if not self.one_request(self.host) or b != self.config.q:
            return self.outcome(b, f"not one request verifying {self.config.q} tokens")
        step = self.executor.plan(positions, normed_embeddings=normed_embeddings)
        if step is None:
            return self.outcome(b, "metadata in a form the providers do not take")
        self.specialized_sizes.add(b)
        return self.outcome(b, None, step)

    def outcome(self, b: int, fallback: str | None, step: Step | None = None) -> Step | None:
        """Log each outcome once (the capture-time decisions are the ones that stay)."""
        what = f"stock forward ({fallback})" if fallback else "specialized decode"
        message = f"sparkdecode: forward of {b} tokens: {what}"
        if message not in self.logged:
            self.logged.add(message)
            logger.info(message)
        return step

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        capturing: bool | None = None,
        runtime_mode: str | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The executor's output in the stock forward's form, or None to run stock.

        The multimodal architecture's runner passes ``inputs_embeds`` (bf16 rows
        already through ``tok_embeddings_norm``): the stream starts as their fp32.
        With token ids the rows come from the stock ``embed_tokens`` (vocabulary-
        parallel at TP > 1) and the executor's front normalizes them in fp32, as
        the stock text path does."""
        normed = inputs_embeds is not None
        step = self.plan(positions, intermediate_tensors, normed, capturing, runtime_mode)
        if step is None:
            return None
        rows = inputs_embeds if normed else self.backbone.embed_tokens(input_ids)
        hidden, aux = self.executor.run(step, inputs_embeds=rows)
        return (hidden, aux) if aux else hidden


def exact_context_len(input_batch: Any) -> int:
    """Request 0's context length after this step from the device's sequence lengths
    (a synchronization, allowed by vLLM's sync check)."""
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    with gpu_sync_allowed():
        return int(input_batch.seq_lens[0].item())


def stream_capturing() -> bool:
    """Whether this forward is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _runtime_mode() -> str | None:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    mode = get_forward_context().cudagraph_runtime_mode
    return getattr(mode, "name", None)


def _layout_name(model: Any) -> str:
    try:
        return model.sparkdecode_vllm_config.cache_config.get_resolved_kv_cache_layout().name
    except (AttributeError, ValueError):
        return "unresolved"


def _tp_groups() -> tuple[Any, Any]:
    """(cpu group, device group) of the TP group, or (None, None) before vLLM's
    distributed state exists or at TP 1."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, None
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return None, None
    return group.cpu_group, group.device_group


class SparkDecodeMuseSpark(MuseSparkForConditionalGeneration):
    """The stock multimodal Muse Spark, plus the specialized decode when
    ``additional_config["decode_backend"] == "latency_specialized"``."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        # The gate first: an unsupported deployment stops before any weight is allocated.
        cpu_group, _ = _tp_groups()
        settings = gate.check(vllm_config, group=cpu_group)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.sparkdecode_settings = settings
        self.sparkdecode_vllm_config = vllm_config
        self.sparkdecode: VllmDecode | None = None  # set by SparkDecodeModelState

    def get_model_state_cls(self) -> type:
        """Only the V2 model runner calls this (the gate requires it)."""
        return DefaultModelState if self.sparkdecode_settings is None else SparkDecodeModelState

    def build_sparkdecode(self, device: torch.device) -> VllmDecode:
        """The executor over this model's loaded weights (once, after load)."""
        if self.sparkdecode is None:
            assert self.sparkdecode_settings is not None
            _, device_group = _tp_groups()
            self.sparkdecode = VllmDecode(self, self.sparkdecode_settings, device, device_group)
        return self.sparkdecode

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if self.sparkdecode is not None:
            out = self.sparkdecode.forward(input_ids, positions, intermediate_tensors, inputs_embeds)
            if out is not None:
                return out
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)


class SparkDecodeModelState(DefaultModelState):
    """The stock ModelState of this model, plus the executor's build (after the
    weights load), KV binding (every ``initialize_kv_cache``) and per-step metadata
    (every ``prepare_attn``)."""

    def __init__(self, vllm_config: Any, model: Any, encoder_cache: Any, device: torch.device) -> None:
        super().__init__(vllm_config, model, encoder_cache, device)
        self.decode = model.build_sparkdecode(device)

    def initialize_kv_cache(self, kv_cache_config: Any, block_tables: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, block_tables)
        gate.check_resolved_graphs(self.vllm_config)
        self.decode.bind_kv(kv_cache_config, block_tables)

    def prepare_attn(
        self,
        input_batch: Any,
        cudagraph_mode: Any,
        block_tables: Any,
        slot_mappings: Any,
        attn_groups: Any,
        kv_cache_config: Any,
        for_capture: bool = False,
        ubatch_idx: int = 0,
        **kwargs: Any,
    ) -> dict[str, Any]:
        metadata = super().prepare_attn(
            input_batch,
            cudagraph_mode,
            block_tables,
            slot_mappings,
            attn_groups,
            kv_cache_config,
            for_capture=for_capture,
            ubatch_idx=ubatch_idx,
            **kwargs,
        )
        self.decode.prepare_step(input_batch, cudagraph_mode, block_tables, slot_mappings, for_capture)
        return metadata
