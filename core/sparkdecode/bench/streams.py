"""Weight streams: the bandwidth at which each registered provider of a sub-op
reads its weights, against the copy bandwidth measured in the same run.

``sparkdecode bench streams-tp8-rank`` (or ``streams-tp1``, or ``streams-tp8-rank-sharded``
with the pooler and the unpooler column-sharded) on a GPU prints, for
every provider of ``linear`` that supports the GPU (``reference.linear`` is
cuBLAS through ``torch.mm``; ``--linear-provider module:Class`` adds one that is
not registered, ``--experts-provider module:Class`` an experts one):

- isolated: each of Muse Spark's dense weights (qkvg, o_proj, router, pooler,
  unpooler at the config's shard) alone in a CUDA graph, L2 flushed before every
  replay; weight bytes / median time;
- chained: the five GEMMs of ``CHAIN_LAYERS`` layers of distinct weights (far
  larger than L2) back to back in one graph (with PDL where the provider launches
  with it); total weight bytes / median time;
- chained as in the step (``chain_step``): the same, with the router on a side stream
  beside the pooler as cuda.moe runs it (forked after the o_proj, joined before the
  unpooler; on a CPU, in line), through its own op built with its own scratch;
- the copy bandwidth: the step bench's (``floor.copy_bandwidth``, a 1 GiB eager
  device-to-device copy), (read + written bytes) / median time.

Each GEMM runs on ``ROWS`` rows (the verify step's 8).

``streams-tp8-rank`` also measures the routed experts (``expert_streams``): kind
``experts`` (bf16) and kind ``experts_nvfp4`` in two layouts, the checkpoint's
(format ``nvfp4``) and the one vLLM serves on SM90 after its Marlin repack
(``nvfp4_marlin``, nvfp4_marlin.py), each under expert TP (every expert's I / 8
slice) and EP (32 whole experts), 8 rows x top-8 routes, routing ``random`` (each
row's top-8 of all experts) and ``correlated`` (among ``CORRELATED_EXPERTS`` per
layer); every registered provider of the kind that supports the TP-8 rank in that
format and the torch path of the step bench's baseline (baseline.stock_expert_rows):
isolated (one layer) and chained (as many distinct layers as read ``CHAIN_BYTES``,
three times the L2, at most ``EXPERT_LAYERS``, in one graph), L2 flushed before
every replay. Each shard form's bf16 layers are drawn once and quantized once for
its NVFP4 stream, whose layers are then packed once into Marlin's layout
(nvfp4_marlin.marlin_form, a torch model of vLLM's repack) for its Marlin stream;
each provider is built once per stream. The torch path reads the checkpoint's
layout: it is timed in the bf16 and NVFP4 streams, and its rows on the NVFP4
layers are the Marlin stream's baseline too (the Marlin layout holds the same
weights, with W13's up half on the gate's global scale and W2's global times
up / gate, as vLLM folds them: equal up to bf16 rounding, so the Marlin rows' error
against it is that rounding's, a few 1e-3, where the NVFP4 reference's is 0). The
dequantizing paths (slower than ``SLOW_S`` a layer) are timed isolated only. Bytes
read = the distinct experts the rank holds x one expert's bytes
(floor.expert_bytes, NVFP4 in either layout with its block and global scales);
each provider's rows are checked against the torch path's.

``--part linear`` or ``--part experts`` runs one part (default both). The run's
figures go to a JSON record in ``--out`` (command, commit, GPU, date), written
after each part (``parts`` lists those finished), so a later timeout keeps what
finished; without ``--quiet`` a progress line with the seconds elapsed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..nvfp4_marlin import marlin_form
from ..protocols import LINEAR_WEIGHTS, BuildContext, Deployment, ExpertsInput, RoutedTopk, scratch_buffer
from ..spec import ModelSpec
from ..weights import ExpertWeights, quantize_experts
from .baseline import stock_expert_rows
from .configs import ROWS
from .floor import copy_bandwidth, expert_bytes
from .steer import CORRELATED_EXPERTS
from .timing import FLUSH_BYTES, Timer, Times

# name -> (N, K) of Muse Spark's dense weights (H 8192, 128 q / 16 kv heads of 64,
# E 256, P 4096); the router is fp32, the others bf16.
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "streams-tp1": {
        "qkvg": (2 * 8192 + 2 * 1024, 8192),
        "o_proj": (8192, 8192),
        "router": (256, 8192),
        "pooler": (4096, 8192),
        "unpooler": (8192, 4096),
    },
    "streams-tp8-rank": {
        "qkvg": (2 * 1024 + 2 * 128, 8192),
        "o_proj": (8192, 1024),
        "router": (256, 8192),
        "pooler": (4096, 8192),
        "unpooler": (8192, 4096),
    },
}
# The pooler and the unpooler column-sharded (vLLM's muse_spark_tep_shard_pooler /
# _unpooler): each rank's eighth of their output columns.
SHAPES["streams-tp8-rank-sharded"] = {
    **SHAPES["streams-tp8-rank"],
    **{name: (n // 8, k) for name, (n, k) in SHAPES["streams-tp8-rank"].items() if name in ("pooler", "unpooler")},
}
CHAIN_LAYERS = 2
REPLAYS = 50


def linear_context(
    shapes: dict[str, tuple[int, int]], device: torch.device, max_rows: int = ROWS, seed: int = 0
) -> SimpleNamespace:
    """What a ``linear`` provider's build reads: one layer's five weights (random,
    of the real ones' scale; the router fp32), ``max_rows`` and the scratch."""
    g = torch.Generator(device=device).manual_seed(seed)
    layer = SimpleNamespace()
    for name, (n, k) in shapes.items():
        dtype = torch.float32 if name == "router" else torch.bfloat16
        setattr(layer, name, (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype))
    return own_scratch(SimpleNamespace(layer=lambda i: layer, max_rows=max_rows), device)


def own_scratch(ctx: SimpleNamespace, device: torch.device) -> SimpleNamespace:
    """``ctx``'s layer and rows with scratch of its own (also the side stream's op: cuda.moe
    builds the router's from such a context, so no workspace is shared across the streams)."""
    buffers: dict[str, torch.Tensor] = {}
    return SimpleNamespace(
        layer=ctx.layer,
        max_rows=ctx.max_rows,
        scratch=lambda name, shape, dtype: scratch_buffer(buffers, device, name, shape, dtype),
    )


def _io(shapes: dict[str, tuple[int, int]], device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per weight: an x of ROWS bf16 rows and its output."""
    out = {}
    for name, (n, k) in shapes.items():
        dtype = torch.float32 if name == "router" else torch.bfloat16
        x = torch.randn(ROWS, k, device=device).to(torch.bfloat16)
        out[name] = (x, torch.empty(ROWS, n, dtype=dtype, device=device))
    return out


def weight_bytes(shapes: dict[str, tuple[int, int]], name: str) -> int:
    n, k = shapes[name]
    return n * k * (4 if name == "router" else 2)


def linear_streams(
    timer: Timer, providers: list[type], shapes: dict[str, tuple[int, int]], replays: int
) -> dict[str, Any]:
    """Isolated and chained figures of every provider: {provider: {weight, "chain" or
    "chain_step": (seconds, bytes / s)}}."""
    device = timer.device
    io = _io(shapes, device)
    contexts = [linear_context(shapes, device, seed=i) for i in range(CHAIN_LAYERS)]
    side = torch.cuda.Stream(device) if timer.graph else None
    record: dict[str, Any] = {}
    for cls in providers:
        ops = [cls.build(ctx, 0) for ctx in contexts]
        router_ops = [cls.build(own_scratch(ctx, device), 0) for ctx in contexts]
        row: dict[str, tuple[float, float]] = {}
        for name in LINEAR_WEIGHTS:
            x, out = io[name]
            graph = timer.capture(lambda op=ops[0], name=name, x=x, out=out: op.run(name, x, out))
            seconds = timer.time(graph, replays).median_s
            row[name] = (seconds, weight_bytes(shapes, name) / seconds)

        def chain(ops=ops) -> None:
            for op in ops:
                for name in LINEAR_WEIGHTS:
                    op.run(name, *io[name])

        def step_chain(ops=ops, router_ops=router_ops) -> None:
            for op, router in zip(ops, router_ops, strict=True):
                op.run("qkvg", *io["qkvg"])
                op.run("o_proj", *io["o_proj"])
                if side is None:
                    router.run("router", *io["router"])
                else:
                    current = torch.cuda.current_stream(device)
                    side.wait_stream(current)
                    with torch.cuda.stream(side):
                        router.run("router", *io["router"])
                op.run("pooler", *io["pooler"])
                if side is not None:
                    current.wait_stream(side)
                op.run("unpooler", *io["unpooler"])

        total = CHAIN_LAYERS * sum(weight_bytes(shapes, name) for name in LINEAR_WEIGHTS)
        for key, fn in (("chain", chain), ("chain_step", step_chain)):
            seconds = timer.time(timer.capture(fn), replays).median_s
            row[key] = (seconds, total / seconds)
        record[cls.name] = row
    return record


EXPERT_LAYERS = 8  # the most layers a chain draws
TP = 8
EXPERT_ROUTINGS = ("random", "correlated")
TORCH = "torch"  # baseline.stock_expert_rows
# A chain reads at least three times the H200's 50 MB L2 (no layer's experts are
# found in L2 by the next replay), with as few layers as that takes (at least 2).
CHAIN_BYTES = 3 * 50_000_000
# A path slower than this per layer is not streaming its weights (a TP-8 rank's
# whole layer of experts is 3.2 GB, 0.8 ms at the copy bandwidth): the dequantizing
# paths (the NVFP4 torch path dequantizes every route's expert per call,
# reference.experts_nvfp4 every held expert). They are timed isolated only, with
# SLOW_REPLAYS replays, and their rows checked on that one layer.
SLOW_S = 5e-3
SLOW_REPLAYS = 5


@dataclass(frozen=True)
class ExpertStream:
    name: str
    kind: str  # "experts" or "experts_nvfp4"
    expert_parallel: str  # "tp" or "ep"
    expert_format: str  # "bf16", "nvfp4" or "nvfp4_marlin"


# In the order they are measured: each shard form's bf16 layers are drawn once,
# quantized for its NVFP4 stream, and those packed into Marlin's layout.
EXPERT_STREAMS = (
    ExpertStream("experts bf16 expert-TP", "experts", "tp", "bf16"),
    ExpertStream("experts nvfp4 expert-TP", "experts_nvfp4", "tp", "nvfp4"),
    ExpertStream("experts nvfp4-marlin expert-TP", "experts_nvfp4", "tp", "nvfp4_marlin"),
    ExpertStream("experts bf16 EP", "experts", "ep", "bf16"),
    ExpertStream("experts nvfp4 EP", "experts_nvfp4", "ep", "nvfp4"),
    ExpertStream("experts nvfp4-marlin EP", "experts_nvfp4", "ep", "nvfp4_marlin"),
)


def draw_experts(spec: ModelSpec, stream: ExpertStream, g: torch.Generator, device: torch.device) -> ExpertWeights:
    """Rank 0's routed experts of one layer in the stream's shard form and format,
    drawn an expert at a time (no full-size fp32 temporary), NVFP4 by ModelOpt's
    formula, Marlin's layout packed from that."""
    P, I, E = spec.P, spec.I, spec.E  # noqa: E741, N806
    ep = stream.expert_parallel == "ep"
    num, inter = (E // TP, I) if ep else (E, I // TP)
    w13 = torch.empty(num, 2 * inter, P, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(num, P, inter, dtype=torch.bfloat16, device=device)
    for i in range(num):
        w13[i].copy_(torch.randn(w13.shape[1:], generator=g, device=device) * P**-0.5)
        w2[i].copy_(torch.randn(w2.shape[1:], generator=g, device=device) * I**-0.5)
    experts = ExpertWeights("bf16", w13, w2, 0, None if ep else (0, inter))
    if stream.expert_format == "bf16":
        return experts
    nvfp4 = quantize_experts(experts)
    return marlin_form(nvfp4) if stream.expert_format == "nvfp4_marlin" else nvfp4


def route_ids(spec: ModelSpec, kind: str, g: torch.Generator) -> torch.Tensor:
    """int32 [ROWS, k] global expert ids: each row's top-k of all experts (random) or
    of ``CORRELATED_EXPERTS`` favoured ones (correlated)."""
    if kind == "random":
        pool = torch.arange(spec.E)
    elif kind == "correlated":
        pool = torch.randperm(spec.E, generator=g)[:CORRELATED_EXPERTS]
    else:
        raise ValueError(f"routing {kind!r} (random or correlated)")
    rows = [pool[torch.randperm(len(pool), generator=g)[: spec.top_k]] for _ in range(ROWS)]
    return torch.stack(rows).to(torch.int32)


def spread_ids(spec: ModelSpec, distinct: int, g: torch.Generator) -> torch.Tensor:
    """int32 [ROWS, k] ids over exactly ``distinct`` experts (k <= distinct <= ROWS * k):
    route r of the ROWS * k takes expert r mod distinct of a random draw, so each row's k
    are distinct. ValueError outside that range."""
    routes = ROWS * spec.top_k
    if not spec.top_k <= distinct <= min(routes, spec.E):
        raise ValueError(f"distinct experts {distinct}: from top-k {spec.top_k} to {min(routes, spec.E)}")
    pool = torch.randperm(spec.E, generator=g)[:distinct]
    return pool[torch.arange(routes) % distinct].view(ROWS, spec.top_k).to(torch.int32)


def copied(value: Any) -> Any:
    """A deep copy of a layer's experts on the device: every tensor cloned, so no two
    layers share a byte in L2."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: copied(getattr(value, f.name)) for f in dataclasses.fields(value)})
    return value


def script_ids(spec: ModelSpec, distinct: int | None, routing: str, g: torch.Generator) -> tuple[torch.Tensor, str]:
    """The expert scripts' ids and how they were drawn: ``spread_ids`` over ``distinct``
    experts where given (``--distinct``), else ``route_ids`` of ``routing``."""
    if distinct is not None:
        return spread_ids(spec, distinct, g), f"--distinct {distinct}"
    return route_ids(spec, routing, g), f"{routing} routing"


def held_distinct(ids: torch.Tensor, experts: ExpertWeights) -> int:
    """Distinct experts of ``ids`` this rank holds."""
    local = ids.flatten().long() - experts.first_expert
    return int(torch.unique(local[(local >= 0) & (local < experts.num_local)]).numel())


def chain_length(distinct: list[int], one: int, chain_bytes: int = CHAIN_BYTES) -> int:
    """The fewest leading layers (at least 2) whose held experts (``distinct[i]``
    experts of ``one`` bytes on layer i) read ``chain_bytes``; all of them if they
    read less."""
    total = 0
    for n, d in enumerate(distinct, start=1):
        total += d * one
        if n >= 2 and total >= chain_bytes:
            return n
    return len(distinct)


def _release(device: torch.device) -> None:
    """Hand the freed layers and graph pools back to the device."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def experts_context(weights: Any, deployment: Deployment, device: torch.device) -> BuildContext:
    """What an experts provider's build reads: ``weights.layers[i].experts``, the
    spec, ``max_rows`` and the scratch."""
    return BuildContext(
        spec=weights.spec,
        weights=weights,
        tp=TP,
        rank=0,
        device=device,
        group=None,
        deployment=deployment,
        buffers={},
        aux_layers=(),
        max_rows=ROWS,
        max_context=deployment.max_context,
        mailboxes=[],
        ops={},
    )


def _timed(timer: Timer, works: list, replays: int, slow_s: float) -> tuple[Times, Times | None]:
    """(isolated, chained) times of ``works`` (one per layer): the first alone, then
    all back to back, each in one graph; a path slower than ``slow_s`` per layer is
    timed isolated only, with ``SLOW_REPLAYS`` replays (chained None)."""
    graph = timer.capture(works[0])
    probe = timer.time(graph, min(SLOW_REPLAYS, replays))
    if probe.median_s > slow_s:
        return probe, None
    isolated = probe if replays <= SLOW_REPLAYS else timer.time(graph, replays)
    del graph
    return isolated, timer.time(timer.capture(lambda: [w() for w in works]), replays)


def _entry(bytes_read: int, times: Times, copy: float) -> dict[str, Any]:
    return {
        "bytes": bytes_read,
        "median_s": times.median_s,
        "replays": times.count,
        "bytes_per_s": bytes_read / times.median_s,
        "fraction_of_copy": bytes_read / times.median_s / copy,
    }


@dataclass
class ShardRouting:
    """One shard form's routing, shared by its bf16, NVFP4 and Marlin streams: per
    routing each layer's ids and the distinct experts of them rank 0 holds."""

    ids: dict[str, list[torch.Tensor]]
    distinct: dict[str, list[int]]


def _chains(routing: ShardRouting, layer: ExpertWeights, chain_bytes: int, drawn: int | None = None) -> dict[str, int]:
    """Per routing, the chain of layers like ``layer`` (chain_length), among the first
    ``drawn`` layers (all the routing's when None)."""
    one = expert_bytes(SimpleNamespace(experts=layer))
    return {r: chain_length(d[:drawn], one, chain_bytes) for r, d in routing.distinct.items()}


def measure_stream(
    timer: Timer,
    registry: Any,
    spec: ModelSpec,
    stream: ExpertStream,
    experts: list[ExpertWeights],
    xs: list[torch.Tensor],
    routing: ShardRouting,
    chains: dict[str, int],
    copy: float,
    replays: int,
    slow_s: float,
    progress: Any,
    torch_layers: list[ExpertWeights] | None = None,
    extra: tuple[type, ...] = (),
) -> list[dict[str, Any]]:
    """Per routing: every supported provider's and the torch path's isolated figure
    (layer 0) and chained figure (the routing's ``chains`` layers), and their rows'
    error against the torch path. Each provider is built once for all layers.
    ``torch_layers``: the layers the torch path runs on where it does not read the
    stream's layout (the NVFP4 layers Marlin's were packed from): its rows there are
    the baseline, not timed (the NVFP4 stream times them). ``extra``: provider classes
    not registered, measured where their block is the stream's kind."""
    from ..deployment import detect

    device = timer.device
    deployment = detect(
        spec, tp=TP, device=device, expert_format=stream.expert_format, expert_parallel=stream.expert_parallel
    )
    classes, skipped = [], {}
    for cls in [reg.cls for reg in registry.of(stream.kind)] + [c for c in extra if c.block == stream.kind]:
        reason = cls.unsupported(deployment)
        if reason is None:
            classes.append(cls)
        else:
            skipped[cls.name] = reason
    layers = max(chains.values())
    weights = SimpleNamespace(spec=spec, layers=[SimpleNamespace(experts=e) for e in experts[:layers]])
    built = {}
    for cls in classes:
        progress(f"{stream.name}: building {cls.name}")
        ctx = experts_context(weights, deployment, device)
        built[cls.name] = [cls.build(ctx, i) for i in range(layers)]
    one = expert_bytes(SimpleNamespace(experts=experts[0]))
    out = []
    for name, n in chains.items():
        ids, distinct = routing.ids[name][:n], routing.distinct[name][:n]
        topk = [RoutedTopk(i, torch.ones(ROWS, spec.top_k, device=device)) for i in ids]
        reference = [stock_expert_rows(x, i, e) for x, i, e in zip(xs, ids, torch_layers or experts)]
        sides: list[tuple[str, list, list[torch.Tensor]]] = []
        if torch_layers is None:
            outs = [torch.empty_like(r) for r in reference]
            works = [
                lambda x=x, i=i, e=e, o=o: o.copy_(stock_expert_rows(x, i, e))
                for x, i, e, o in zip(xs, ids, experts, outs)
            ]
            sides.append((TORCH, works, outs))
        for provider, ops in built.items():
            rows = [torch.empty_like(r) for r in reference]
            works = [
                lambda op=op, x=x, t=t, r=r: op.run(ExpertsInput(x), t, r) for op, x, t, r in zip(ops, xs, topk, rows)
            ]
            sides.append((provider, works, rows))
        results = {}
        for provider, works, rows in sides:
            progress(f"{stream.name}, {name} routing, {n} layers: {provider}")
            isolated, chained = _timed(timer, works, replays, slow_s)
            checked = 1 if chained is None else n
            errors = [
                ((r.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
                for r, ref in zip(rows[:checked], reference)
            ]
            results[provider] = {
                "isolated": _entry(distinct[0] * one, isolated, copy),
                "chained": None if chained is None else _entry(sum(distinct) * one, chained, copy),
                "relative_error_vs_torch": max(errors),
                "checked_layers": checked,
            }
        out.append(
            {
                "stream": stream.name,
                "kind": stream.kind,
                "expert_format": stream.expert_format,
                "routing": name,
                "expert_bytes": one,
                "chain_layers": n,
                "distinct_experts": distinct,
                "providers": results,
                "unsupported": skipped,
            }
        )
        del sides
    return out


def expert_streams(
    timer: Timer,
    registry: Any,
    copy: float,
    replays: int,
    *,
    preset: str = "muse-spark-open",
    layers: int = EXPERT_LAYERS,
    routings: tuple[str, ...] = EXPERT_ROUTINGS,
    seed: int = 0,
    chain_bytes: int = CHAIN_BYTES,
    slow_s: float = SLOW_S,
    log: Any = print,
    extra: tuple[type, ...] = (),
) -> list[dict[str, Any]]:
    """Per (stream, routing), in ``EXPERT_STREAMS`` order: every supported provider's
    and the torch path's isolated and chained figures, and their rows' error against
    the torch path. Per shard form (expert TP, EP): one routing per routing kind for
    its three streams, the bf16 layers drawn once (as many as the longest chain
    needs, at most ``layers``), quantized once for the NVFP4 stream, and those
    packed once into Marlin's layout (chained over at most the NVFP4 layers; the
    torch path's rows on the NVFP4 layers are its baseline). ``log`` gets a
    progress line with the seconds elapsed; ``extra``: unregistered provider classes
    measured beside the registered ones (measure_stream)."""
    device = timer.device
    spec = ModelSpec.preset(preset, layers)
    g = torch.Generator(device=device).manual_seed(seed)
    host = torch.Generator().manual_seed(seed)
    xs = [torch.randn(ROWS, spec.P, generator=g, device=device).to(torch.bfloat16) for _ in range(layers)]
    start = time.perf_counter()

    def progress(message: str) -> None:
        log(f"[{time.perf_counter() - start:6.1f} s] {message}")

    out: list[dict[str, Any]] = []
    for parallel in ("tp", "ep"):
        bf16_stream, nvfp4_stream, marlin_stream = (s for s in EXPERT_STREAMS if s.expert_parallel == parallel)
        bf16 = [draw_experts(spec, bf16_stream, g, device)]
        nvfp4 = [quantize_experts(bf16[0])]
        ids = {r: [route_ids(spec, r, host).to(device) for _ in range(layers)] for r in routings}
        routing = ShardRouting(ids, {r: [held_distinct(i, bf16[0]) for i in ids[r]] for r in routings})
        chains = {
            bf16_stream: _chains(routing, bf16[0], chain_bytes),
            nvfp4_stream: _chains(routing, nvfp4[0], chain_bytes),
        }
        while len(bf16) < max(max(c.values()) for c in chains.values()):
            bf16.append(draw_experts(spec, bf16_stream, g, device))
        progress(f"{bf16_stream.name}: drew {len(bf16)} layers")
        args = (xs, routing)
        kw = {"extra": extra}
        out += measure_stream(
            timer, registry, spec, bf16_stream, bf16, *args, chains[bf16_stream], copy, replays, slow_s, progress, **kw
        )
        nvfp4 += [quantize_experts(e) for e in bf16[1 : max(chains[nvfp4_stream].values())]]
        del bf16
        _release(device)  # the bf16 layers and the bf16 stream's graph pools
        progress(f"{nvfp4_stream.name}: quantized {len(nvfp4)} layers")
        out += measure_stream(
            timer,
            registry,
            spec,
            nvfp4_stream,
            nvfp4,
            *args,
            chains[nvfp4_stream],
            copy,
            replays,
            slow_s,
            progress,
            **kw,
        )
        _release(device)  # the NVFP4 stream's graph pools
        # Marlin's form of the NVFP4 layers (an expert's bytes but 4 of its global
        # scales), packed a layer at a time; the NVFP4 layers stay for the torch path.
        marlin = [marlin_form(nvfp4[0])]
        chains[marlin_stream] = _chains(routing, marlin[0], chain_bytes, len(nvfp4))
        marlin += [marlin_form(e) for e in nvfp4[1 : max(chains[marlin_stream].values())]]
        progress(f"{marlin_stream.name}: packed {len(marlin)} layers")
        out += measure_stream(
            timer,
            registry,
            spec,
            marlin_stream,
            marlin,
            *args,
            chains[marlin_stream],
            copy,
            replays,
            slow_s,
            progress,
            torch_layers=nvfp4,
            **kw,
        )
        del nvfp4, marlin
        _release(device)
    progress("routed experts done")
    return out


STREAM_WIDTH = max(len(s.name) for s in EXPERT_STREAMS)


def experts_report(streams: list[dict[str, Any]], copy: float) -> str:
    lines = [
        f"routed experts: {ROWS} rows x top-8; isolated = one layer, chained = the distinct layers in one graph "
        f"(at least {CHAIN_BYTES / 1e6:.0f} MB); TB/s = distinct held experts' bytes / median; % of the copy "
        f"bandwidth; err vs the torch path (on the nvfp4 layers for the nvfp4-marlin streams, timed there); "
        f"a path slower than {SLOW_S * 1e3:.0f} ms a layer: isolated only"
    ]
    head = (
        f"{'stream':<{STREAM_WIDTH}} {'routing':<10} {'provider':<26} {'iso MB':>7} {'iso us':>8} {'TB/s':>6} {'%':>5} "
        f"{'layers':>6} {'chain MB':>9} {'chain us':>9} {'TB/s':>6} {'%':>5} {'err':>8}"
    )
    lines += [head, "-" * len(head)]
    for s in streams:
        for provider, r in s["providers"].items():
            iso, ch = r["isolated"], r["chained"]
            chain = (
                f"{'':>6} {'isolated only (slow)':>32}"
                if ch is None
                else f"{s['chain_layers']:>6} {ch['bytes'] / 1e6:>9.1f} {ch['median_s'] * 1e6:>9.1f} "
                f"{ch['bytes_per_s'] / 1e12:>6.3f} {100 * ch['fraction_of_copy']:>4.0f}%"
            )
            lines.append(
                f"{s['stream']:<{STREAM_WIDTH}} {s['routing']:<10} {provider[:26]:<26} {iso['bytes'] / 1e6:>7.1f} "
                f"{iso['median_s'] * 1e6:>8.1f} {iso['bytes_per_s'] / 1e12:>6.3f} {100 * iso['fraction_of_copy']:>4.0f}% "
                f"{chain} {r['relative_error_vs_torch']:>8.1e}"
            )
        for provider, why in s["unsupported"].items():
            lines.append(f"{s['stream']:<{STREAM_WIDTH}} {s['routing']:<10} {provider[:26]:<26} unsupported: {why}")
    return "\n".join(lines)


def report(config: str, copy: float, record: dict[str, Any]) -> str:
    shapes = SHAPES[config]
    names = list(record)
    lines = [f"{config}: {ROWS} rows; copy bandwidth {copy / 1e12:.2f} TB/s (read + written)"]
    lines.append(f"{'weight':<10} {'N x K':>12} {'MB':>8}  " + "  ".join(f"{n:>30}" for n in names))
    chained = [c for c in ("chain", "chain_step") if all(c in record[p] for p in names)]
    for name in (*LINEAR_WEIGHTS, *chained):
        if name in chained:
            label, mb = f"{CHAIN_LAYERS} layers", CHAIN_LAYERS * sum(weight_bytes(shapes, w) for w in LINEAR_WEIGHTS)
        else:
            n, k = shapes[name]
            label, mb = f"{n}x{k}", weight_bytes(shapes, name)
        cells = []
        for provider in names:
            seconds, bw = record[provider][name]
            cells.append(f"{seconds * 1e6:8.1f} us {bw / 1e12:5.2f} TB/s {100 * bw / copy:4.0f}%")
        lines.append(f"{name:<10} {label:>12} {mb / 1e6:8.1f}  " + "  ".join(f"{c:>30}" for c in cells))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """``sparkdecode bench streams-...``: needs a GPU."""
    import datetime
    import sys

    from ..deployment import detect
    from ..plugins import discover, provider_class
    from ..spec import ModelSpec

    if args.config not in SHAPES:
        print(f"sparkdecode bench: unknown streams config {args.config!r} ({', '.join(SHAPES)})", file=sys.stderr)
        return 2
    if args.part == "experts" and args.config != "streams-tp8-rank":
        print("sparkdecode bench: the routed experts are measured by streams-tp8-rank only", file=sys.stderr)
        return 2
    if getattr(args, "max_context", None) is not None:
        print("sparkdecode bench: --max-context is for the step configs (streams read no KV cache)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sparkdecode bench: the weight streams are measured on a GPU only", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    deployment = detect(ModelSpec.preset("muse-spark-open", 1), device=device, max_rows=ROWS)
    try:
        classes = [reg.cls for reg in discover().of("linear")] + [provider_class(p) for p in args.linear_provider]
    except (ValueError, ImportError, AttributeError) as e:
        print(f"sparkdecode bench: --linear-provider: {e}", file=sys.stderr)
        return 2
    try:
        extra = tuple(provider_class(p) for p in args.experts_provider)
    except (ValueError, ImportError, AttributeError) as e:
        print(f"sparkdecode bench: --experts-provider: {e}", file=sys.stderr)
        return 2
    if extra and args.config != "streams-tp8-rank":
        print(
            "sparkdecode bench: --experts-provider: the routed experts are measured by streams-tp8-rank only",
            file=sys.stderr,
        )
        return 2
    providers = []
    for cls in classes:
        reason = cls.unsupported(deployment)
        if reason is None:
            providers.append(cls)
        else:
            print(f"{cls.name}: not measured ({reason})")
    replays = args.replays or REPLAYS
    timer = Timer(device)
    # The step bench's measure (floor.copy_bandwidth, an eager copy on the SMs): a
    # memcpy captured in a graph runs on a copy engine, about two thirds as fast.
    copy = copy_bandwidth(timer.device).bytes_per_s
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = None
    if args.part != "experts":
        record = linear_streams(timer, providers, SHAPES[args.config], replays)
        print(report(args.config, copy, record))
        print(f"record: {write_record(args, date, copy, replays, record, None)}", flush=True)
    if args.part != "linear" and args.config == "streams-tp8-rank":
        log = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))
        experts = expert_streams(timer, discover(), copy, replays, seed=args.seed, log=log, extra=extra)
        print(experts_report(experts, copy))
        print(f"record: {write_record(args, date, copy, replays, record, experts)}")
    return 0


def write_record(
    args: argparse.Namespace,
    date: str,
    copy: float,
    replays: int,
    linear: dict[str, Any] | None,
    experts: list[dict[str, Any]] | None,
) -> Any:
    """The run's figures as JSON in ``args.out`` (named like the step bench's records
    by the run's start ``date``: each part's write replaces the previous one); a part
    not run (yet) is null and left out of ``parts``."""
    import shlex
    import sys

    from .report import write
    from .runner import RECORD_VERSION, provenance

    argv = sys.argv[sys.argv.index("bench") + 1 :] if "bench" in sys.argv else [args.config]
    gpu = torch.cuda.get_device_name()
    record = {
        "version": RECORD_VERSION,
        "config": args.config,
        "command": "sparkdecode bench " + shlex.join(argv),
        **provenance(),
        "date": date,
        "parts": [part for part, done in (("linear", linear), ("experts", experts)) if done is not None],
        "device": gpu,
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rows": ROWS,
        "replays": replays,
        "l2_flush_bytes": FLUSH_BYTES,
        "copy_bandwidth_bytes_per_s": copy,
        "linear": None
        if linear is None
        else {
            provider: {name: {"median_s": t, "bytes_per_s": bw} for name, (t, bw) in row.items()}
            for provider, row in linear.items()
        },
        "expert_layers": EXPERT_LAYERS,
        "expert_chain_bytes": CHAIN_BYTES,
        "expert_slow_s": SLOW_S,
        "experts": experts,
    }
    return write(record, args.out)
