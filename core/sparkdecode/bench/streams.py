"""Weight streams: the bandwidth at which each registered provider of a sub-op
reads its weights, against the copy bandwidth measured in the same run.

``sparkdecode bench streams-tp8-rank`` (or ``streams-tp1``) on a GPU prints, for
every provider of ``linear`` that supports the GPU (``reference.linear`` is
cuBLAS through ``torch.mm``):

- isolated: each of Muse Spark's dense weights (qkvg, o_proj, router, pooler,
  unpooler at the config's shard) alone in a CUDA graph, L2 flushed before every
  replay; weight bytes / median time;
- chained: the five GEMMs of ``CHAIN_LAYERS`` layers of distinct weights (far
  larger than L2) back to back in one graph, as they run in the step (with PDL
  where the provider launches with it); total weight bytes / median time;
- the copy bandwidth: the step bench's (``floor.copy_bandwidth``, a 1 GiB eager
  device-to-device copy), (read + written bytes) / median time.

Each GEMM runs on ``ROWS`` rows (the verify step's 8).

``streams-tp8-rank`` also measures the routed experts (``expert_streams``): kinds
``experts`` (bf16) and ``experts_nvfp4``, each under expert TP (every expert's
I / 8 slice) and EP (32 whole experts), 8 rows x top-8 routes, routing ``random``
(each row's top-8 of all experts) and ``correlated`` (among ``CORRELATED_EXPERTS``
per layer); every registered provider of the kind that supports the TP-8 rank and
the torch path of the step bench's baseline (baseline.stock_expert_rows):
isolated (one layer) and chained (``EXPERT_LAYERS`` distinct layers, far larger
than L2, in one graph), L2 flushed before every replay. Bytes read = the distinct
experts the rank holds x one expert's bytes (floor.expert_bytes, NVFP4 with its
scales); each provider's rows are checked against the torch path's. The run's
figures go to a JSON record in ``--out`` (command, commit, GPU, date).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..protocols import LINEAR_WEIGHTS, BuildContext, Deployment, ExpertsInput, RoutedTopk, scratch_buffer
from ..spec import ModelSpec
from ..weights import ExpertWeights, ModelWeights, Sharding, quantize_experts, random_weights
from .baseline import stock_expert_rows
from .configs import ROWS
from .floor import copy_bandwidth, expert_bytes
from .steer import CORRELATED_EXPERTS
from .timing import FLUSH_BYTES, Timer

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
    buffers: dict[str, torch.Tensor] = {}
    return SimpleNamespace(
        layer=lambda i: layer,
        max_rows=max_rows,
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
    """Isolated and chained figures of every provider: {provider: {weight or
    "chain": (seconds, bytes / s)}}."""
    device = timer.device
    io = _io(shapes, device)
    contexts = [linear_context(shapes, device, seed=i) for i in range(CHAIN_LAYERS)]
    record: dict[str, Any] = {}
    for cls in providers:
        ops = [cls.build(ctx, 0) for ctx in contexts]
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

        seconds = timer.time(timer.capture(chain), replays).median_s
        total = CHAIN_LAYERS * sum(weight_bytes(shapes, name) for name in LINEAR_WEIGHTS)
        row["chain"] = (seconds, total / seconds)
        record[cls.name] = row
    return record


EXPERT_LAYERS = 8
TP = 8
EXPERT_ROUTINGS = ("random", "correlated")
TORCH = "torch"  # baseline.stock_expert_rows


@dataclass(frozen=True)
class ExpertStream:
    name: str
    kind: str  # "experts" or "experts_nvfp4"
    expert_parallel: str  # "tp" or "ep"
    expert_format: str  # "bf16" or "nvfp4"


EXPERT_STREAMS = (
    ExpertStream("experts bf16 expert-TP", "experts", "tp", "bf16"),
    ExpertStream("experts bf16 EP", "experts", "ep", "bf16"),
    ExpertStream("experts nvfp4 expert-TP", "experts_nvfp4", "tp", "nvfp4"),
    ExpertStream("experts nvfp4 EP", "experts_nvfp4", "ep", "nvfp4"),
)


def draw_experts(spec: ModelSpec, stream: ExpertStream, g: torch.Generator, device: torch.device) -> ExpertWeights:
    """Rank 0's routed experts of one layer in the stream's shard form, drawn an
    expert at a time (no full-size fp32 temporary), NVFP4 by ModelOpt's formula."""
    P, I, E = spec.P, spec.I, spec.E  # noqa: E741, N806
    ep = stream.expert_parallel == "ep"
    num, inter = (E // TP, I) if ep else (E, I // TP)
    w13 = torch.empty(num, 2 * inter, P, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(num, P, inter, dtype=torch.bfloat16, device=device)
    for i in range(num):
        w13[i].copy_(torch.randn(w13.shape[1:], generator=g, device=device) * P**-0.5)
        w2[i].copy_(torch.randn(w2.shape[1:], generator=g, device=device) * I**-0.5)
    experts = ExpertWeights("bf16", w13, w2, 0, None if ep else (0, inter))
    return quantize_experts(experts) if stream.expert_format == "nvfp4" else experts


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


def held_distinct(ids: torch.Tensor, experts: ExpertWeights) -> int:
    """Distinct experts of ``ids`` this rank holds."""
    local = ids.flatten().long() - experts.first_expert
    return int(torch.unique(local[(local >= 0) & (local < experts.num_local)]).numel())


def experts_context(weights: ModelWeights, deployment: Deployment, device: torch.device) -> BuildContext:
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


def _timed(timer: Timer, works: list, replays: int) -> float:
    graph = timer.capture(lambda: [w() for w in works])
    return timer.time(graph, replays).median_s


def _entry(bytes_read: int, seconds: float, copy: float) -> dict[str, Any]:
    return {
        "bytes": bytes_read,
        "median_s": seconds,
        "bytes_per_s": bytes_read / seconds,
        "fraction_of_copy": bytes_read / seconds / copy,
    }


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
    log: Any = print,
) -> list[dict[str, Any]]:
    """Per (stream, routing): every supported provider's and the torch path's
    isolated and chained figures, and their rows' error against the torch path."""
    from ..deployment import detect

    device = timer.device
    spec = ModelSpec.preset(preset, layers)
    sharding = Sharding(tp=TP, expert_parallel="tp")
    weights = random_weights(spec, seed=seed, device=device, keep_unfolded_router=False, sharding=sharding)
    g = torch.Generator(device=device).manual_seed(seed)
    host = torch.Generator().manual_seed(seed)
    xs = [torch.randn(ROWS, spec.P, generator=g, device=device).to(torch.bfloat16) for _ in range(layers)]
    out: list[dict[str, Any]] = []
    for stream in EXPERT_STREAMS:
        for layer in weights.layers:
            layer.experts = None  # the previous stream's, freed before the next draw
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"{stream.name}: drawing {layers} layers")
        for layer in weights.layers:
            layer.experts = draw_experts(spec, stream, g, device)
        deployment = detect(
            spec, tp=TP, device=device, expert_format=stream.expert_format, expert_parallel=stream.expert_parallel
        )
        classes, skipped = [], {}
        for reg in registry.of(stream.kind):
            reason = reg.cls.unsupported(deployment)
            if reason is None:
                classes.append(reg.cls)
            else:
                skipped[reg.name] = reason
        experts = [layer.experts for layer in weights.layers]
        one = expert_bytes(SimpleNamespace(experts=experts[0]))
        for routing in routings:
            ids = [route_ids(spec, routing, host).to(device) for _ in range(layers)]
            topk = [RoutedTopk(i, torch.ones(ROWS, spec.top_k, device=device)) for i in ids]
            distinct = [held_distinct(i, e) for i, e in zip(ids, experts)]
            reference = [stock_expert_rows(x, i, e) for x, i, e in zip(xs, ids, experts)]
            outs = [torch.empty_like(r) for r in reference]
            sides = [
                (
                    TORCH,
                    [
                        lambda x=x, i=i, e=e, o=o: o.copy_(stock_expert_rows(x, i, e))
                        for x, i, e, o in zip(xs, ids, experts, outs)
                    ],
                    outs,
                )
            ]
            for cls in classes:
                ctx = experts_context(weights, deployment, device)
                ops = [cls.build(ctx, i) for i in range(layers)]
                rows = [torch.empty_like(r) for r in reference]
                works = [
                    lambda op=op, x=x, t=t, r=r: op.run(ExpertsInput(x), t, r)
                    for op, x, t, r in zip(ops, xs, topk, rows)
                ]
                sides.append((cls.name, works, rows))
            results = {}
            for name, works, rows in sides:
                log(f"{stream.name}, {routing} routing: {name}")
                isolated = _timed(timer, works[:1], replays)
                chained = _timed(timer, works, replays)
                errors = [
                    ((r.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
                    for r, ref in zip(rows, reference)
                ]
                results[name] = {
                    "isolated": _entry(distinct[0] * one, isolated, copy),
                    "chained": _entry(sum(distinct) * one, chained, copy),
                    "relative_error_vs_torch": max(errors),
                }
            out.append(
                {
                    "stream": stream.name,
                    "kind": stream.kind,
                    "routing": routing,
                    "expert_bytes": one,
                    "distinct_experts": distinct,
                    "providers": results,
                    "unsupported": skipped,
                }
            )
            del sides
    for layer in weights.layers:
        layer.experts = None
    return out


def experts_report(streams: list[dict[str, Any]], copy: float, layers: int = EXPERT_LAYERS) -> str:
    lines = [
        f"routed experts: {ROWS} rows x top-8; isolated = one layer, chained = {layers} distinct layers in one "
        "graph; TB/s = distinct held experts' bytes / median; % of the copy bandwidth; err vs the torch path"
    ]
    head = (
        f"{'stream':<24} {'routing':<10} {'provider':<24} {'iso MB':>7} {'iso us':>8} {'TB/s':>6} {'%':>5} "
        f"{'chain MB':>9} {'chain us':>9} {'TB/s':>6} {'%':>5} {'err':>8}"
    )
    lines += [head, "-" * len(head)]
    for s in streams:
        for provider, r in s["providers"].items():
            iso, ch = r["isolated"], r["chained"]
            lines.append(
                f"{s['stream']:<24} {s['routing']:<10} {provider[:24]:<24} {iso['bytes'] / 1e6:>7.1f} "
                f"{iso['median_s'] * 1e6:>8.1f} {iso['bytes_per_s'] / 1e12:>6.3f} {100 * iso['fraction_of_copy']:>4.0f}% "
                f"{ch['bytes'] / 1e6:>9.1f} {ch['median_s'] * 1e6:>9.1f} {ch['bytes_per_s'] / 1e12:>6.3f} "
                f"{100 * ch['fraction_of_copy']:>4.0f}% {r['relative_error_vs_torch']:>8.1e}"
            )
        for provider, why in s["unsupported"].items():
            lines.append(f"{s['stream']:<24} {s['routing']:<10} {provider[:24]:<24} unsupported: {why}")
    return "\n".join(lines)


def report(config: str, copy: float, record: dict[str, Any]) -> str:
    shapes = SHAPES[config]
    names = list(record)
    lines = [f"{config}: {ROWS} rows; copy bandwidth {copy / 1e12:.2f} TB/s (read + written)"]
    lines.append(f"{'weight':<10} {'N x K':>12} {'MB':>8}  " + "  ".join(f"{n:>30}" for n in names))
    for name in (*LINEAR_WEIGHTS, "chain"):
        if name == "chain":
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
    import sys

    from ..deployment import detect
    from ..plugins import discover
    from ..spec import ModelSpec

    if args.config not in SHAPES:
        print(f"sparkdecode bench: unknown streams config {args.config!r} ({', '.join(SHAPES)})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("sparkdecode bench: the weight streams are measured on a GPU only", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    deployment = detect(ModelSpec.preset("muse-spark-open", 1), device=device, max_rows=ROWS)
    providers = []
    for reg in discover().of("linear"):
        reason = reg.cls.unsupported(deployment)
        if reason is None:
            providers.append(reg.cls)
        else:
            print(f"{reg.name}: not measured ({reason})")
    replays = args.replays or REPLAYS
    timer = Timer(device)
    # The step bench's measure (floor.copy_bandwidth, an eager copy on the SMs): a
    # memcpy captured in a graph runs on a copy engine, about two thirds as fast.
    copy = copy_bandwidth(timer.device).bytes_per_s
    record = linear_streams(timer, providers, SHAPES[args.config], replays)
    print(report(args.config, copy, record))
    experts: list[dict[str, Any]] = []
    if args.config == "streams-tp8-rank":
        registry = discover()
        experts = expert_streams(timer, registry, copy, replays, seed=args.seed, log=lambda m: None)
        print(experts_report(experts, copy))
    path = write_record(args, copy, replays, record, experts)
    print(f"record: {path}")
    return 0


def write_record(
    args: argparse.Namespace, copy: float, replays: int, linear: dict[str, Any], experts: list[dict[str, Any]]
) -> Any:
    """The run's figures as JSON in ``args.out`` (named like the step bench's records)."""
    import datetime
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
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": gpu,
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rows": ROWS,
        "replays": replays,
        "l2_flush_bytes": FLUSH_BYTES,
        "copy_bandwidth_bytes_per_s": copy,
        "linear": {
            provider: {name: {"median_s": t, "bytes_per_s": bw} for name, (t, bw) in row.items()}
            for provider, row in linear.items()
        },
        "expert_layers": EXPERT_LAYERS,
        "experts": experts,
    }
    return write(record, args.out)
