"""The specialized decode executor: one plan per step, then every layer's
providers in one loop.

    embeddings -> boundary(0) (the front) -> attention(0) -> attention_boundary(0)
    -> moe(0) -> boundary(1) -> ... -> moe(L-1) -> final -> hidden (+ aux streams)

``SpecializedDecode`` resolves the layout, builds every provider in one order
(the same on every rank: builds may be collective), owns every buffer (sized for
``DecodeConfig.max_rows`` at build; the weights are used in place, never copied),
and runs planned steps. It reads the backbone's weights and never modifies them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .comm import Collectives, ColumnMailbox, LocalMailbox
from .deployment import detect, on_every_rank, require
from .layout import Layout, resolve
from .plugins import Registry, discover
from .protocols import (
    SUB_OPS,
    BuildContext,
    Deployment,
    HostStep,
    KVGroupMetadata,
    LayerKV,
    Mailbox,
    Step,
    plans_on_host,
)
from .weights import ModelWeights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig:
    """What the deployment fixes before the executor is built."""

    q: int = 8  # tokens a verify step carries (1 + 7 drafted)
    max_rows: int = 8  # rows the buffers are sized for
    max_context: int = 4096  # the deployment's max_model_len
    aux_layers: tuple[int, ...] = ()  # layers whose input stream the drafter reads (num_layers: final)
    pins: Mapping[str, str] = field(default_factory=dict)  # kind -> provider name


def named_build(cls: Any, ctx: BuildContext, layer: int | None) -> Any:
    """``cls.build(ctx, layer)``; what it raises carries a note naming the provider and
    the layer (a compile, a missing library or a weight check deep in its build)."""
    try:
        return cls.build(ctx, layer)
    except Exception as e:
        where = "the final block" if layer is None else f"layer {layer}"
        if hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(f"sparkdecode: raised building {getattr(cls, 'name', cls.__name__)} for {where}")
        raise


class DecodeLayer(NamedTuple):
    """The providers of one decoder layer."""

    boundary: Any
    attention: Any
    attention_boundary: Any
    moe: Any
    aux: torch.Tensor | None  # fp32 [max_rows, H]: this layer's input stream for the drafter

    @property
    def blocks(self) -> tuple[Any, Any, Any, Any]:
        """The layer's providers in build and run order."""
        return self.boundary, self.attention, self.attention_boundary, self.moe

    def run(
        self,
        step: Step,
        stream: torch.Tensor,
        x: torch.Tensor,
        partial: torch.Tensor,
        xf: torch.Tensor,
        aux: torch.Tensor | None,
    ) -> None:
        """The layer's blocks in order on ``step``'s rows: the stream updated in place,
        ``aux`` (where given) its input stream; x, partial and xf its scratch."""
        self.boundary.run(step, stream, x, aux)
        self.attention.run(step, x, partial)
        self.attention_boundary.run(partial, stream, xf)
        self.moe.run(step, xf)


class SpecializedDecode:
    """Built once the weights are loaded; owns every provider and buffer."""

    def __init__(
        self,
        weights: ModelWeights,
        config: DecodeConfig,
        *,
        deployment: Deployment | None = None,
        registry: Registry | None = None,
        group: Any = None,
        measure: bool = True,
        cache_dir: Path | None = None,
    ):
        self.weights, self.spec, self.config = weights, weights.spec, config
        self.device, self.tp, self.rank, self.group = weights.device, weights.tp, weights.rank, group
        bad = [i for i in config.aux_layers if not 0 <= i <= self.spec.num_layers]
        if bad:
            raise ValueError(f"aux layers {bad} outside 0..{self.spec.num_layers}")
        if not 1 <= config.q <= config.max_rows:
            raise ValueError(f"q = {config.q} must be within 1..max_rows ({config.max_rows})")
        sharding = weights.sharding
        self.collectives = Collectives(self.tp, self.rank, group)
        if self.collectives.detached:
            logger.warning(
                "sparkdecode: rank %d of TP %d runs detached (no process group): its collectives are left out",
                self.rank,
                self.tp,
            )
        self.deployment = deployment or detect(
            self.spec,
            self.tp,
            self.device,
            max_rows=config.max_rows,
            max_context=config.max_context,
            expert_format=weights.expert_format,
            expert_parallel=sharding.expert_parallel,
            shard_pooler=sharding.shard_pooler,
            shard_unpooler=sharding.shard_unpooler,
        )
        self.registry = registry if registry is not None else discover()
        require(self.deployment, self.registry, config.pins, group)
        measure_fn = self._measure if measure and self.device.type == "cuda" else None
        # What the timings' collective setups made (their workspaces' markers), kept
        # for every later timing while the layout is resolved (measurement_chain).
        self._timing_collectives: dict[str, torch.Tensor] = {}
        self.layout: Layout = resolve(
            self.registry,
            self.deployment,
            config.pins,
            measure_fn,
            cache_dir,
            rank=self.rank,
            agree=self._all_ranks if group is not None else None,
            every_rank=self._every_rank if group is not None else None,
        )
        self._timing_collectives.clear()  # their workspaces go with the last timing's providers
        self.buffers: dict[str, torch.Tensor] = {}
        self.kv: tuple[LayerKV, ...] | None = None
        self.logged: set[str] = set()
        self.build()
        logger.info(
            "sparkdecode: built TP%d, %d layers, aux layers %s\n%s",
            self.tp,
            self.spec.num_layers,
            config.aux_layers,
            self.layout.table(),
        )

    def _buffer(self, name: str, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
        t = torch.zeros(self.config.max_rows, width or self.spec.H, dtype=dtype, device=self.device)
        self.buffers[name] = t
        return t

    def _context(self, classes: Mapping[str, type], buffers: dict[str, torch.Tensor], mailboxes: list) -> BuildContext:
        return BuildContext(
            spec=self.spec,
            weights=self.weights,
            tp=self.tp,
            rank=self.rank,
            device=self.device,
            group=self.group,
            deployment=self.deployment,
            buffers=buffers,
            aux_layers=self.config.aux_layers,
            max_rows=self.config.max_rows,
            max_context=self.config.max_context,
            mailboxes=mailboxes,
            ops={k: classes[k] for k in SUB_OPS if k in classes},
            collectives=self.collectives,
        )

    def _mailboxes(self) -> list[Mailbox]:
        """One per layer: what its MoE publishes, for the boundary after it."""
        rows, width = self.config.max_rows, self.spec.H
        if self.tp > 1 and self.weights.sharding.shard_unpooler:
            return [ColumnMailbox(rows, width, self.collectives, self.device) for _ in range(self.spec.num_layers)]
        return [LocalMailbox(rows, width, self.device) for _ in range(self.spec.num_layers)]

    def build(self) -> None:
        """Every provider, in one order on every rank (the builds may be collective)."""
        self.embeddings = self._buffer("embeddings", torch.bfloat16)
        self.stream = self._buffer("stream", torch.float32)
        self.attention_input = self._buffer("attention_input", torch.bfloat16)
        self.partial = self._buffer("partial", torch.bfloat16)
        self.moe_input = self._buffer("moe_input", torch.bfloat16)
        self.output = self._buffer("output", torch.bfloat16)
        self.mailboxes = self._mailboxes()
        classes = self.layout.classes()
        ctx = self._context(classes, self.buffers, self.mailboxes)
        self._build_collective_first(classes, ctx)
        on_every_rank(lambda: self._build_layers(classes, ctx), self.group, "building the providers")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _build_collective_first(self, classes: Mapping[str, type], ctx: BuildContext) -> None:
        """The build's collective steps (``collective_setup``: a workspace's rendezvous
        of every rank's buffers, its warm all-reduce), before any provider's build and
        in one order on every rank: the builds after them are each rank's own, so a
        failure in one is agreed over the ranks (``on_every_rank``) instead of leaving
        the others in a rendezvous. Not itself inside an agreed step: the setups agree
        their own local steps around their exchanges."""
        for kind in sorted(classes):
            setup = getattr(classes[kind], "collective_setup", None)
            if setup is not None:
                setup(ctx)

    def _build_layers(self, classes: Mapping[str, type], ctx: BuildContext) -> None:
        aux = self.config.aux_layers
        layers = []
        for i in range(self.spec.num_layers):
            boundary, attention = named_build(classes["boundary"], ctx, i), named_build(classes["attention"], ctx, i)
            if layers:
                pair_producer(boundary, layers[-1].moe)
            attention_boundary = named_build(classes["attention_boundary"], ctx, i)
            pair(attention_boundary, attention)
            moe = named_build(classes["moe"], ctx, i)
            aux_buffer = self._buffer(f"aux{i}", torch.float32) if i in aux else None
            layers.append(DecodeLayer(boundary, attention, attention_boundary, moe, aux_buffer))
        self.layers = tuple(layers)
        self.final = named_build(classes["final"], ctx, None)
        pair_producer(self.final, layers[-1].moe)
        end = self.spec.num_layers
        self.final_aux = self._buffer(f"aux{end}", torch.float32) if end in aux else None

    def providers(self) -> list[Any]:
        """Every built provider, in build order."""
        out: list[Any] = []
        for layer in self.layers:
            out.extend(layer.blocks)
        out.append(self.final)
        return out

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        """Bind a KV cache (per layer: K/V views and its group's metadata buffers);
        every provider checks the form it takes. Called for every bound cache."""
        if len(kv) != self.spec.num_layers:
            raise ValueError(f"{len(kv)} KV layers bound for {self.spec.num_layers} layers")
        for provider in self.providers():
            provider.prepare_kv(kv)
        self.kv = kv

    @property
    def plans_on_host(self) -> bool:
        """Whether a provider plans each step from host values (``prepare_step``): its
        caller must then pass the step's exact context length, not an estimate."""
        return plans_on_host(self.providers())

    def prepare_step(self, host: Any) -> None:
        """Host work of the providers that need it before each step (outside the graph)."""
        for provider in self.providers():
            hook = getattr(provider, "prepare_step", None)
            if hook is not None:
                hook(host)

    def plan(
        self, positions: torch.Tensor, kv: tuple[LayerKV, ...] | None = None, normed_embeddings: bool = False
    ) -> Step | None:
        """This step's plan, or None to run the stock forward instead.

        Every gate reads host state only (shapes, dtypes, devices, which tensors),
        the same on every rank. Steps that run stock:
        - no KV cache bound yet (``prepare_kv``), or metadata over another cache;
        - row counts other than one request verifying ``q`` tokens;
        - positions that are not int64 [b] on the executor's device;
        - metadata in a form the providers do not take (block tables int32 [1, n],
          sequence lengths int32 [1], slot mappings int64 with at least b rows).
        Each outcome is logged once.
        """
        kv = self.kv if kv is None else kv
        b = positions.shape[0] if positions.dim() == 1 else -1
        if self.kv is None or kv is None:
            return self._outcome(b, "no KV cache bound")
        if b != self.config.q:
            return self._outcome(b, f"not one request verifying {self.config.q} tokens")
        if positions.dtype != torch.int64 or positions.device != self.device:
            return self._outcome(b, "positions not int64 on the executor's device")
        if len(kv) != len(self.kv) or any(
            a.k.data_ptr() != c.k.data_ptr() or a.v.data_ptr() != c.v.data_ptr() for a, c in zip(kv, self.kv)
        ):
            return self._outcome(b, "metadata over a KV cache other than the bound one")
        if not all(metadata_ok(layer.group, b) for layer in kv):
            return self._outcome(b, "attention metadata in a form the providers do not take")
        return self._outcome(b, None, Step(self.config.q, b, positions, kv, normed_embeddings))

    def _outcome(self, b: int, fallback: str | None, step: Step | None = None) -> Step | None:
        outcome = f"stock forward ({fallback})" if fallback else "specialized decode"
        message = f"sparkdecode: step of {b} rows: {outcome}"
        if message not in self.logged:
            self.logged.add(message)
            logger.info(message)
        return step

    def run(
        self,
        step: Step,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Normed hidden states (bf16 [b, H], a view of the executor's output buffer)
        and the fp32 aux streams (ascending layer order) of a planned step. Takes
        token ids (rows of the embedding table) or the embeddings themselves (bf16
        [b, H]: normed when the step was planned with ``normed_embeddings``)."""
        b = step.rows
        embeddings = self.embeddings[:b]
        if inputs_embeds is not None:
            embeddings.copy_(inputs_embeds)
        else:
            assert input_ids is not None, "run needs input_ids or inputs_embeds"
            torch.index_select(self.weights.embed, 0, input_ids, out=embeddings)
        stream, x, xf = self.stream[:b], self.attention_input[:b], self.moe_input[:b]
        partial = self.partial[:b]
        aux_out: list[torch.Tensor] = []
        for layer in self.layers:
            aux = None if layer.aux is None else layer.aux[:b]
            layer.run(step, stream, x, partial, xf, aux)
            if aux is not None:
                aux_out.append(aux)
        output = self.output[:b]
        final_aux = None if self.final_aux is None else self.final_aux[:b]
        self.final.run(step, stream, output, final_aux)
        if final_aux is not None:
            aux_out.append(final_aux)
        return output, aux_out

    def _every_rank(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order (collective)."""
        import torch.distributed as dist

        out: list[str] = [""] * dist.get_world_size(self.group)
        dist.all_gather_object(out, text, group=self.group)
        return out

    def _all_ranks(self, ok: bool) -> bool:
        """True only if ``ok`` on every rank of the group (a MIN all-reduce)."""
        import torch.distributed as dist

        device = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _measure(self, kind: str, cls: type, layout: Mapping[str, type]) -> float | None:
        """Seconds per layer, in a CUDA graph, of ``measurement_chain``'s layers with
        ``cls`` serving ``kind``: the candidate in place, launch gaps and overlaps
        included, the overlap of one layer's start with the end of the layer before
        as well. The slowest rank's time, so every rank decides alike. None (not timed)
        when the chain runs torch.distributed collectives over a group a CUDA graph
        cannot capture (gloo), or when the candidate could not be built or run on some
        rank (a warning names why). A capture that fails raises ``CaptureFailedError``
        on every rank."""
        classes = dict(layout)
        classes[kind] = cls
        if self.group is not None and self._host_collectives(classes):
            import torch.distributed as dist

            if dist.get_backend(self.group) != "nccl":
                return None
        try:
            # Built and captured on every rank or on none (every step agreed): a rank
            # failing alone would leave the others replaying collectives it never joins.
            chain = self.measurement_chain(classes, final=kind == "final")
            combine = self._slowest if self.group is not None else None
            seconds = graph_seconds(chain.run, self.device, combine=combine) / len(chain.indices)
        except CaptureFailedError as e:  # on every rank alike (graph_seconds agrees it)
            raise CaptureFailedError(f"{getattr(cls, 'name', cls)} serving {kind}, timed for the layout: {e}") from e
        except Exception as e:  # the candidate cannot run here: untimed on every rank
            failure = f"{type(e).__name__}: {e}"
            seconds = math.inf
        else:
            failure = None
        if self.group is not None:
            seconds = self._slowest(seconds)  # inf where any rank failed
        if failure is not None or math.isinf(seconds):
            logger.warning(
                "sparkdecode: %s could not be timed for %s (%s); it is not chosen by time",
                getattr(cls, "name", cls),
                kind,
                failure or "it failed on another rank",
            )
            return None
        return seconds

    def _host_collectives(self, classes: Mapping[str, type]) -> bool:
        """Whether a chain of ``classes`` runs torch.distributed collectives: an
        all-reduce that says so (``host_collectives``), or the column gathers of a
        sharded unpooler (the mailboxes) or pooler (the MoE's pooled rows), which go
        through the reference transport (``comm.Collectives.gather_columns``)."""
        if getattr(classes.get("all_reduce"), "host_collectives", False):
            return True
        sharding = self.weights.sharding
        return self.tp > 1 and (sharding.shard_unpooler or sharding.shard_pooler)

    def _slowest(self, seconds: float) -> float:
        """The largest of every rank's ``seconds`` (a MAX all-reduce)."""
        import torch.distributed as dist

        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def measurement_chain(self, classes: Mapping[str, type], final: bool = False) -> MeasurementChain:
        """What the resolver times: the first ``MEASURE_LAYERS`` layers built from ``classes``
        (each with its own weights and attention kind), a random paged cache at
        ``measured_context`` (the max context up to MEASURE_CONTEXT), and random embeddings;
        the final boundary after them with ``final``. Its own buffers and mailboxes, so the
        executor's are left alone. Made in three steps, each agreed over the ranks and none
        inside another: this rank's inputs, the collective setups, the builds. What a
        collective setup makes (a workspace, ``BuildContext.shared``) is made once and
        shared by this executor's later chains (those of its layout's resolution drop theirs
        once it is resolved): every candidate's timing would otherwise make and free a
        workspace of its own, a rendezvous of every rank each time."""
        ctx, kv = on_every_rank(lambda: self._chain_inputs(classes), self.group, "the timing's inputs")
        ctx.buffers.update(self._timing_collectives)
        before = set(ctx.buffers)
        self._build_collective_first(classes, ctx)
        self._timing_collectives.update({k: v for k, v in ctx.buffers.items() if k not in before})
        return on_every_rank(lambda: self._chain_builds(classes, ctx, kv, final), self.group, "the timing's builds")

    def _chain_inputs(self, classes: Mapping[str, type]) -> tuple[BuildContext, tuple[LayerKV, ...]]:
        spec, device = self.spec, self.device
        buffers: dict[str, torch.Tensor] = {
            "embeddings": torch.randn(self.config.max_rows, spec.H, device=device).to(torch.bfloat16)
        }
        mailboxes = self._mailboxes()
        for box in mailboxes:
            box.publish(self.config.max_rows).normal_()
        ctx = self._context(classes, buffers, mailboxes)
        indices = measured_layers(spec.num_layers)
        kv = _measurement_kv(
            self.weights, indices, measured_context(self.config.max_context), self.config.max_rows, device
        )
        return ctx, kv

    def _chain_builds(
        self, classes: Mapping[str, type], ctx: BuildContext, kv: tuple[LayerKV, ...], final: bool
    ) -> MeasurementChain:
        rows, device = self.config.q, self.device
        indices = measured_layers(self.spec.num_layers)
        built: list[DecodeLayer] = []
        for n, index in enumerate(indices):
            boundary = named_build(classes["boundary"], ctx, index)
            if n and indices[n - 1] == index - 1:  # the MoE publishing into its mailbox runs right before it
                pair_producer(boundary, built[-1].moe)
            attention = named_build(classes["attention"], ctx, index)
            attention_boundary = named_build(classes["attention_boundary"], ctx, index)
            pair(attention_boundary, attention)
            moe = named_build(classes["moe"], ctx, index)
            built.append(DecodeLayer(boundary, attention, attention_boundary, moe, None))
        last = named_build(classes["final"], ctx, None) if final else None
        if last is not None and indices[-1] == self.spec.num_layers - 1:
            pair_producer(last, built[-1].moe)
        providers = [p for layer in built for p in layer.blocks] + ([last] if last else [])
        for provider in providers:
            provider.prepare_kv(kv)
        context = measured_context(self.config.max_context)
        first = context - rows
        positions = torch.arange(first, first + rows, device=device)
        host = HostStep(first_position=first, rows=rows, context_len=context)
        for provider in providers:
            hook = getattr(provider, "prepare_step", None)
            if hook is not None:
                hook(host)
        step = Step(self.config.q, rows, positions, kv, False)
        return MeasurementChain(indices, built, last, step, ctx.buffers["embeddings"])


class MeasurementChain:
    """Built layers run back to back on one step (``SpecializedDecode.measurement_chain``)
    from layer 0's front, which sets the stream from the embeddings, so every run
    (every graph replay) computes and routes alike."""

    def __init__(
        self, indices: tuple[int, ...], built: list[DecodeLayer], final: Any, step: Step, embeddings: torch.Tensor
    ):
        assert indices[0] == 0, "the chain starts at the front"
        self.indices, self.built, self.final, self.step = indices, built, final, step
        self.embeddings = embeddings[: step.rows]
        self.stream = torch.zeros(step.rows, embeddings.shape[1], device=embeddings.device)
        self.x = torch.empty_like(self.embeddings)
        self.partial, self.xf, self.out = (torch.empty_like(self.x) for _ in range(3))

    def run(self) -> None:
        step, stream = self.step, self.stream
        for layer in self.built:
            layer.run(step, stream, self.x, self.partial, self.xf, None)
        if self.final is not None:
            self.final.run(step, stream, self.out, None)


class CaptureFailedError(RuntimeError):
    """A CUDA graph capture failed. Not a candidate to pass over: what the executor
    runs must capture (it serves inside a FULL CUDA graph), and a failed capture can
    leave torch's allocator in its capture state and the thread on the capture
    stream, so this process cannot go on measuring or serving."""


# What graph_seconds' ranks agree on before any replay (the largest is every rank's).
_RAN, _RUN_FAILED, _CAPTURE_FAILED = 0.0, 1.0, 2.0

# Seconds of replays before a candidate is timed: the GPU's clocks leave their idle
# state only under load, and the host work of building a candidate between timings
# lets them fall back, so without it each candidate is timed from wherever the clocks
# were: on the H200 (SM clock 345 MHz at idle) the three all-reduce candidates of a
# detached rank, whose graphs differ by a small copy at most, timed 8% apart.
WARM_SECONDS = 0.1


def graph_seconds(
    run: Callable[[], None],
    device: torch.device,
    batches: int = 4,
    replays: int = 5,
    warm_seconds: float = WARM_SECONDS,
    combine: Callable[[float], float] | None = None,
) -> float:
    """Seconds per replay of ``run`` captured in a CUDA graph (after two warm-up runs
    on a side stream, then replays for ``warm_seconds``): the least mean of
    ``batches`` batches of back-to-back replays, since interference (another
    process, a clock dip) only adds time. ``combine`` makes the first replay's time,
    which sets the count of warm replays, the same on every rank (a graph holding
    collectives must be replayed as often on each), and before it whether the
    warm-up runs and the capture succeeded. A failed capture raises
    ``CaptureFailedError``; a failed warm-up run, the run's own error."""
    failure: Exception | None = None
    stage = _RAN
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
    except Exception as e:
        failure, stage = e, _RUN_FAILED
    if failure is None:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
        except Exception as e:
            failure, stage = e, _CAPTURE_FAILED
    local = stage
    if combine is not None:
        # Captured on every rank or replayed on none; the worst rank's outcome is
        # every rank's, so all raise the same kind of error.
        stage = combine(stage)
    if stage == _CAPTURE_FAILED:
        why = f" ({type(failure).__name__}: {failure})" if local == _CAPTURE_FAILED else " on another rank"
        raise CaptureFailedError(f"the graph could not be captured{why}") from failure
    if stage == _RUN_FAILED:
        raise failure or RuntimeError("the chain failed to run on another rank")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(batches)]
    begin, end = events[0]
    try:
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        once = max(begin.elapsed_time(end) / 1e3, 1e-6)
    except Exception as e:
        if combine is None:
            raise
        failure, once = e, math.inf
    if combine is not None:
        once = combine(once)
        if math.isinf(once):  # a replay failed on some rank: no rank replays on
            raise failure or RuntimeError("the graph's first replay failed on another rank")
    for _ in range(min(math.ceil(warm_seconds / once), 10_000)):
        graph.replay()
    for begin, end in events:
        begin.record()
        for _ in range(replays):
            graph.replay()
        end.record()
    events[-1][1].synchronize()
    return min(begin.elapsed_time(end) for begin, end in events) / 1e3 / replays


# Layers a candidate is timed over: the first sixteen, four periods of Muse Spark's
# layer pattern (full attention at l % 4 == 1, sliding elsewhere; layer 0 the bf16 edge
# of an NVFP4 checkpoint), so each attention kind and expert format weighs in about as
# the model has it, and each layer's kernels start beside the end of the layer before
# as in the step. Shorter chains understate what a block costs in the step: on the H200
# (TP-8 rank, 62 layers, scripts/measure-chain) cute.linear_tma's lead over cuda.linear
# was 11 us a layer in the step, and 3.4-6.8 us over 4 layers, 5-6 over 8, 8-9 over 16,
# 10-10.6 over 32, while two timings of one graph differed by up to 1.5% over 4 layers
# and 0.5% over 16; over 4 layers (and 1 before) the resolver took blocks that were
# slower in the step than the ones it passed over.
MEASURE_LAYERS = 16

# The context a candidate is timed at: the deployment's max context (vLLM's
# max_model_len) up to this. Served, max_model_len defaults to the model's positions
# (1,048,576 for Muse Spark): timed there, a full layer at a TP-8 rank would read 512 MB
# of keys and values, a typical step far less, and the chain's time would be mostly the
# attention's, its noise larger than the differences of the other kinds' candidates. The
# candidates are still built for the deployment's max context (their split counts and
# workspaces as served); only the timed step is this long.
MEASURE_CONTEXT = 16384


def measured_layers(num_layers: int) -> tuple[int, ...]:
    """The layer indices the resolver's measure runs: the first ``MEASURE_LAYERS``."""
    return tuple(range(min(MEASURE_LAYERS, num_layers)))


def measured_context(max_context: int) -> int:
    """The context the resolver's measure times: ``max_context`` up to ``MEASURE_CONTEXT``."""
    return min(max_context, MEASURE_CONTEXT)


def pair(attention_boundary: Any, attention: Any) -> None:
    """A layer's attention boundary meets its attention block once both are built
    (``AttentionBoundaryProvider.pair_attention``, optional): where the boundary can
    gather a partial the attention publishes, they agree on it here."""
    hook = getattr(attention_boundary, "pair_attention", None)
    if hook is not None:
        hook(attention)


def pair_producer(reader: Any, moe: Any) -> None:
    """A boundary meets the MoE block that publishes into its mailbox and runs right
    before it, once both are built (``BoundaryProvider.pair_producer``, optional):
    where the boundary exchanges the mailbox's column blocks itself and the MoE can
    push its block from the unpooler's epilogue, they agree on it here."""
    hook = getattr(reader, "pair_producer", None)
    if hook is not None:
        hook(moe)


def metadata_ok(group: KVGroupMetadata, b: int) -> bool:
    """Whether a KV group's metadata has the form the providers take for b rows:
    int32 [1, n] block table, int32 [1] sequence length, int64 slots for b rows."""
    table, lens, slots = group.block_table, group.seq_lens, group.slot_mapping
    return (
        table.dtype == torch.int32
        and table.dim() == 2
        and table.shape[0] == 1
        and lens.dtype == torch.int32
        and tuple(lens.shape) == (1,)
        and slots.dtype == torch.int64
        and slots.dim() == 1
        and slots.shape[0] >= b
    )


def _measurement_kv(
    weights: ModelWeights, indices: tuple[int, ...], max_context: int, max_rows: int, device: torch.device
) -> tuple[LayerKV, ...]:
    """A random, fully used paged cache at ``max_context`` (the measured context): an
    entry of each layer in ``indices`` with its own window, one cache tensor per KV width
    and one metadata group (block table, lengths, slots) per window among them, as vLLM
    keeps full and sliding layers in separate groups; the other layers alias the first's
    entry."""
    spec = weights.spec
    pages = math.ceil(max_context / 16)
    positions = torch.arange(max_context - max_rows, max_context, device=device)
    caches: dict[int, torch.Tensor] = {}
    groups: dict[int | None, KVGroupMetadata] = {}
    entries: dict[int, LayerKV] = {}
    for index in indices:
        layer = weights.layers[index]
        if layer.num_kv_heads not in caches:
            shape = (2, pages + 1, 16, layer.num_kv_heads, spec.head_dim)
            caches[layer.num_kv_heads] = torch.randn(shape, device=device).to(torch.bfloat16)
        if layer.window not in groups:
            table = torch.arange(1, pages + 1, dtype=torch.int32, device=device)[None]
            lens = torch.tensor([max_context], dtype=torch.int32, device=device)
            slots = (table[0, positions // 16].long() * 16 + positions % 16).to(torch.int64)
            groups[layer.window] = KVGroupMetadata(table, lens, slots)
        kvt = caches[layer.num_kv_heads]
        entries[index] = LayerKV(kvt[0], kvt[1], groups[layer.window], layer.window)
    return tuple(entries.get(i, entries[indices[0]]) for i in range(spec.num_layers))
