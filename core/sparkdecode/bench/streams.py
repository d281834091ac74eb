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
- the copy bandwidth: a ``COPY_BYTES`` device-to-device copy, (read + written
  bytes) / median time.

Each GEMM runs on ``ROWS`` rows (the verify step's 8).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import torch

from ..protocols import LINEAR_WEIGHTS, scratch_buffer
from .configs import ROWS
from .timing import Timer

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
COPY_BYTES = 1 << 30
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


def copy_bandwidth(timer: Timer, replays: int) -> float:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=timer.device)
    dst = torch.empty_like(src)
    graph = timer.capture(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / timer.time(graph, replays).median_s


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
    copy = copy_bandwidth(timer, replays)
    record = linear_streams(timer, providers, SHAPES[args.config], replays)
    print(report(args.config, copy, record))
    return 0
