"""Time the pack's collectives with several processes on ONE GPU:

    python -m sparkdecode_cuda.bench_collectives --tp 2 4 8

Per TP size: that many processes on cuda:0 (gloo for the host side), one Lamport
workspace, and per collective of a decode step (the shapes of ``--preset`` at
``--rows`` rows): ``cuda.all_reduce`` of the attention partial [b, H], of the MoE
tail under EP [b, P] and of the route rows under expert TP [b, k, P], and the fused
TP attention boundary ([b, H] all-reduce + norms + gated add) and the fused MoE
tails (under EP and under expert TP: the tail kernel with its reduction). Each is captured
``CALLS`` times back to back in one CUDA graph and the graph replayed; the time of
a call is a replay over ``CALLS``, median over replays, the slowest rank's. The
reference transport (gloo through the host) is timed eagerly beside them.

The processes' kernels time-slice the GPU: a rank spinning on a mailbox waits for
the others' turns, so these are ONE-GPU EMULATION figures, not multi-GPU ones; the
record says so. One JSON record per TP size goes to ``--out`` (bench/results/).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparkdecode.bench.report import write
from sparkdecode.bench.runner import provenance
from sparkdecode.comm import Collectives
from sparkdecode.protocols import BuildContext
from sparkdecode.reference import functional as fn
from sparkdecode.spec import ModelSpec

from .boundary import CudaAttentionBoundary
from .lamport import workspace
from .moe import MoEKernels

LABEL = "one-GPU emulation, not a multi-GPU figure"
CALLS = 20


def context(spec: ModelSpec, rows: int, tp: int, rank: int, device: torch.device) -> SimpleNamespace:
    """What the providers' builds read, for norms of random values (timing only)."""
    g = torch.Generator().manual_seed(0)
    alpha, beta = fn.gate_coefficients(torch.randn(spec.H, generator=g), 0.3)
    layer = SimpleNamespace(
        attn_alpha=alpha.to(device),
        attn_beta=beta.to(device),
        pre_ffn_norm=(torch.randn(spec.H, generator=g) * 0.1).to(torch.bfloat16).to(device),
    )
    ctx = SimpleNamespace(
        spec=spec,
        tp=tp,
        rank=rank,
        device=device,
        group=dist.group.WORLD,
        buffers={},
        max_rows=rows,
        layer=lambda index: layer,
    )
    ctx.shared = lambda name, make: BuildContext.shared(ctx, name, make)  # the Lamport workspace's keeper
    return ctx


def _time_graph(call, replays: int, device: torch.device) -> float:
    """Median seconds of one call: CALLS calls captured in one graph, replayed."""
    for _ in range(3):
        call()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS)
    return statistics.median(times)


def _time_reference(collectives: Collectives, x: torch.Tensor, replays: int, device: torch.device) -> float:
    times = []
    for _ in range(replays + 2):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        collectives.all_reduce(x)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _rank(rank: int, tp: int, init: str, preset: str, rows: int, replays: int, out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    try:
        spec = ModelSpec.preset(preset)
        ctx = context(spec, rows, tp, rank, device)
        ws = workspace(ctx)  # collective
        assert ws is not None
        boundary = CudaAttentionBoundary(ctx, 0)
        g = torch.Generator(device=device).manual_seed(rank)
        shapes = {
            "all_reduce attention partial [b, H]": (rows, spec.H),
            "all_reduce MoE tail under EP [b, P]": (rows, spec.P),
            "all_reduce MoE route rows under expert TP [b, k, P]": (rows, spec.top_k, spec.P),
        }
        seconds: dict[str, float] = {}
        for name, shape in shapes.items():
            x = torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
            dist.barrier()
            seconds[name] = _time_graph(lambda x=x: ws.all_reduce(x), replays, device)
        partial = torch.randn(rows, spec.H, generator=g, device=device).to(torch.bfloat16)
        stream = torch.randn(rows, spec.H, generator=g, device=device)
        xf = torch.empty_like(partial)
        dist.barrier()
        name = "fused attention boundary (all_reduce [b, H] + post_attn_norm + gated add + pre_ffn_norm)"
        seconds[name] = _time_graph(lambda: boundary.run(partial, stream, xf), replays, device)
        tail = MoEKernels(ctx)
        rows_in = torch.randn(rows, spec.top_k, spec.P, generator=g, device=device).to(torch.bfloat16)
        weights = torch.rand(rows, spec.top_k, generator=g, device=device)
        norm = (torch.randn(spec.P, generator=g, device=device) * 0.1).to(torch.bfloat16)
        m = torch.empty(rows, spec.P, dtype=torch.bfloat16, device=device)
        for label, reduce_rows in (("EP: output [b, P]", False), ("expert TP: route rows [b, k, P]", True)):
            dist.barrier()
            seconds[f"fused MoE tail, {label} all-reduced"] = _time_graph(
                lambda r=reduce_rows: tail.finish_all_reduce(rows_in, weights, norm, 1e-5, m, r, ws), replays, device
            )
        dist.barrier()
        seconds["reference transport all_reduce [b, H] (gloo via the host, eager)"] = _time_reference(
            Collectives(tp, rank, dist.group.WORLD), partial, replays, device
        )
        gathered: list[dict[str, float] | None] = [None] * tp
        dist.all_gather_object(gathered, seconds, group=dist.group.WORLD)
        if rank == 0:
            torch.save(gathered, os.path.join(out, "seconds.pt"))
    finally:
        dist.destroy_process_group()


def record(tp: int, preset: str, rows: int, replays: int, per_rank: list[dict[str, float]], command: str) -> dict:
    spec = ModelSpec.preset(preset)
    collectives = {
        name: {
            "per_call_us_slowest_rank": max(r[name] for r in per_rank) * 1e6,
            "per_call_us_by_rank": [r[name] * 1e6 for r in per_rank],
        }
        for name in per_rank[0]
    }
    gpu = torch.cuda.get_device_name(0)
    return {
        "config": f"collectives-one-gpu-tp{tp}",
        "label": LABEL,
        "command": command,
        **provenance(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{gpu} shared by {tp} processes",
        "gpu": gpu,
        "speed_claim": False,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "method": (
            f"{tp} processes on cuda:0 (time-sliced), gloo host group, CUDA IPC Lamport mailbox; "
            f"{CALLS} calls captured in one CUDA graph, {replays} replays, median per call, slowest rank"
        ),
        "model": {"preset": preset, "hidden_size": spec.H, "moe_hidden_size": spec.P, "top_k": spec.top_k},
        "rows": rows,
        "collectives": collectives,
    }


def run(tp: int, preset: str, rows: int, replays: int, out_dir: Path, command: str) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp) / 'store'}"
        mp.spawn(_rank, args=(tp, init, preset, rows, replays, tmp), nprocs=tp, join=True)
        per_rank = torch.load(os.path.join(tmp, "seconds.pt"), weights_only=False)
    rec = record(tp, preset, rows, replays, per_rank, command)
    path = write(rec, out_dir)
    print(f"{rec['config']} ({LABEL}): {rec['device']}, {preset}, {rows} rows")
    for name, entry in rec["collectives"].items():
        print(f"  {entry['per_call_us_slowest_rank']:10.1f} us  {name}")
    print(f"  record: {path}")
    return path


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--preset", default="muse-spark-open", help="the spec whose shapes are reduced")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the collectives run on it)")
    for tp in args.tp:
        if not 2 <= tp <= 8:
            parser.error(f"--tp {tp}: the Lamport mailbox serves 2..8 ranks")
    command = shlex.join(
        ["python", "-m", "sparkdecode_cuda.bench_collectives", *(sys.argv[1:] if argv is None else argv)]
    )
    return [run(tp, args.preset, args.rows, args.replays, args.out, command) for tp in args.tp]


if __name__ == "__main__":
    main()
