"""Every rank of a TP config at once: the step with its real collectives.

``sparkdecode bench tp8-L<N>-bf16`` (any config with ``all_ranks``) spawns tp
processes, one per rank, in a process group:

- one rank per GPU over NCCL (``cuda:rank``) when there are tp GPUs: a speed claim;
- with ``--one-gpu``, tp processes sharing ``cuda:0`` over gloo (the collectives
  through CUDA IPC between the processes; their kernels time-slice the GPU): a
  one-GPU emulation that shows the mode runs, never a speed claim;
- on the CPU over gloo, eagerly: a smoke run.

Each rank draws only its shard of the seeded weights (``steer.draw_weights``:
the replicated tensors the same on every rank), fills its KV cache, builds the
executor with the group, captures the step in a CUDA graph and, for each
routing, checks one replay (finite, the output stream the same bits on every
rank), reads the routing back and times the replays, every rank starting
together (a barrier before each timing). Then the same rank's executor built
detached (no group: its collectives left out) is timed the same way; the
difference is what the collectives cost the step. The step's time is the slowest
rank's median; its floor the largest of the ranks' bytes over their own copy
bandwidth. Rank 0 gathers every rank's figures and writes the record
(``report.py``). The torch baseline has no collectives of its own and is left
out of this mode (the record says so); per-block times are not taken (a block
alone would time its collectives out of step with the others').
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import sys
import tempfile
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..arguments import parse_pins
from ..executor import DecodeConfig, SpecializedDecode
from ..protocols import HostStep
from .configs import ROUTINGS, ROWS, BenchConfig, BenchConfigError, check_max_context
from .floor import block_bytes, copy_bandwidth
from .report import table, write
from .runner import RECORD_VERSION, Progress, _collectives, _layer_tensors, model_record, provenance
from .steer import Routing, draw_weights, executor_routing, filled_cache
from .timing import FLUSH_BYTES, Timer

ONE_GPU_LABEL = "one-GPU emulation: every rank on cuda:0, time-sliced; not a multi-GPU figure"


class Placement:
    """Where the ranks run and over which backend; refuses what cannot run."""

    def __init__(self, tp: int, device: str, one_gpu: bool, backend: str | None):
        self.tp = tp
        if device == "cpu":
            if one_gpu:
                raise BenchConfigError("--one-gpu shares one GPU between the ranks; on the CPU leave it out")
            if backend == "nccl":
                raise BenchConfigError("NCCL runs on GPUs only; on the CPU the ranks use gloo")
            self.kind, self.backend = "cpu", "gloo"
        elif one_gpu:
            if backend == "nccl":
                raise BenchConfigError("NCCL refuses two ranks on one GPU; --one-gpu runs over gloo")
            self.kind, self.backend = "one-gpu", "gloo"
        else:
            count = torch.cuda.device_count()
            if count < tp:
                raise BenchConfigError(
                    f"TP {tp} runs one rank per GPU and this machine has {count}; "
                    "--one-gpu runs every rank on cuda:0 (an emulation, not a speed claim)"
                )
            self.kind, self.backend = "per-gpu", backend or "nccl"

    @property
    def times_layouts(self) -> bool:
        """Whether the executor's resolver may time its candidates in place: not on one
        time-sliced GPU, where a rank's timings would be the other processes' context
        switches (a collective there takes milliseconds); its layout is then chosen by
        priority, the same on every rank, and the record says so (``(priority)``)."""
        return self.kind != "one-gpu"

    def device(self, rank: int) -> torch.device:
        return {"cpu": torch.device("cpu"), "one-gpu": torch.device("cuda", 0)}.get(
            self.kind, torch.device("cuda", rank)
        )

    def describe(self) -> str:
        return {
            "cpu": f"{self.tp} processes on the CPU over gloo, eagerly",
            "one-gpu": f"{self.tp} processes sharing cuda:0 (gloo host group, CUDA-IPC collectives), CUDA graphs",
            "per-gpu": f"{self.tp} processes, one per GPU (cuda:0..{self.tp - 1}) over {self.backend}, CUDA graphs",
        }[self.kind]

    def check_fits(self, cfg: BenchConfig) -> BenchConfig:
        """The config (``Lmax`` resolved) once each rank's shard fits beside the bench's
        reserve on its GPU (on one GPU: tp shards and reserves together)."""
        if self.kind == "cpu":
            if cfg.layers == 0:
                raise BenchConfigError(f"{cfg.name} sizes itself to a GPU's memory")
            return cfg
        gpus = [0] if self.kind == "one-gpu" else range(self.tp)
        free = min(torch.cuda.mem_get_info(i)[0] for i in gpus)
        if self.kind == "one-gpu":
            free //= self.tp
        if cfg.layers == 0:
            cfg = cfg.fitting(free)
        cfg.check_fits(free)
        return cfg


def spawn(cfg: BenchConfig, placement: Placement, job: dict[str, Any], progress_quiet: bool = False) -> None:
    """Run every rank (``rank_main``) and wait for them; rank 0 writes the record."""
    with tempfile.TemporaryDirectory(prefix="sparkdecode-bench-") as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.spawn(rank_main, args=(cfg, placement, init, job, progress_quiet), nprocs=cfg.tp, join=True)


def rank_main(rank: int, cfg: BenchConfig, placement: Placement, init: str, job: dict[str, Any], quiet: bool) -> None:
    """One rank: join the group, measure, and on rank 0 write the record."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.tp))
    device = placement.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(placement.backend, init_method=init, rank=rank, world_size=cfg.tp)
    try:
        progress = Progress(f"{cfg.name} rank {rank}", quiet=quiet or rank != 0)
        mine = measure(replace(cfg, rank=rank), device, placement, job, progress)
        every: list[Any] = [None] * cfg.tp
        dist.all_gather_object(every, mine)
        if rank == 0:
            record = assemble(cfg, placement, job, every)
            path = write(record, job["out"])
            print(table(record))
            print(f"record: {path}", flush=True)
        _barrier(device, placement.backend)  # the group lives until the record is written
    finally:
        dist.destroy_process_group()


def _barrier(device: torch.device, backend: str) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if backend == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    cfg: BenchConfig, device: torch.device, placement: Placement, job: dict[str, Any], progress: Progress
) -> dict[str, Any]:
    """This rank's figures: per (context, routing) the step with its collectives and
    the same step detached, its bytes, its output stream."""
    graphs = device.type == "cuda"
    replays = job["replays"] or (100 if graphs else 3)
    barrier = functools.partial(_barrier, device, placement.backend)
    # One rank at a time, so ranks sharing a GPU do not measure each other's copies.
    bandwidth = None
    for turn in range(cfg.tp):
        if turn == cfg.rank:
            progress("measuring the copy bandwidth")
            bandwidth = copy_bandwidth(device)
        barrier()
    assert bandwidth is not None
    spec = cfg.spec()
    progress(f"drawing this rank's shard ({spec.num_layers} layers, TP {cfg.tp})")
    weights = draw_weights(cfg, device, job["seed"])
    routing = Routing(weights, job["seed"])
    tokens = torch.randint(0, spec.vocab_size, (ROWS,), generator=torch.Generator().manual_seed(job["seed"]))
    tokens = tokens.to(device)
    timer = Timer(device, barrier=barrier)
    runs: list[dict[str, Any]] = []
    layouts: dict[str, dict[str, str]] = {}
    for context in job["contexts"]:
        progress(f"context {context}: filling the KV cache")
        cache = filled_cache(weights, context, ROWS, job["seed"])
        first = context - ROWS
        positions = torch.arange(first, context, dtype=torch.int64, device=device)
        host = HostStep(first_position=first, rows=ROWS, context_len=context)
        here: dict[str, dict[str, Any]] = {}
        for side, group in (("executor", dist.group.WORLD), ("detached", None)):
            progress(f"context {context}: building the executor ({side})")
            max_context = job["max_context"] or context
            config = DecodeConfig(q=ROWS, max_rows=ROWS, max_context=max_context, pins=dict(job["pins"]))
            executor = SpecializedDecode(weights, config, group=group, measure=placement.times_layouts)
            layouts[side] = {kind: f"{c.chosen.name} ({c.how})" for kind, c in executor.layout.choices.items()}
            reduce = executor.layout.choices.get("all_reduce")
            if graphs and group is not None and placement.backend == "gloo" and reduce is not None:
                if reduce.chosen.name == "reference.all_reduce":
                    raise RuntimeError(
                        "the all_reduce resolved to reference.all_reduce, whose gloo collectives a CUDA graph "
                        "cannot capture: install the cuda pack (cuda.all_reduce) or pin all_reduce to a pack's"
                    )
            executor.prepare_kv(cache.kv())
            step = executor.plan(positions)
            if step is None:
                raise RuntimeError(f"rank {cfg.rank}: the executor declined the verify step (--log INFO says why)")
            executor.prepare_step(host)
            progress(f"context {context}: capturing the step ({side})")
            work = timer.capture(functools.partial(executor.run, step, input_ids=tokens))
            for kind in job["routings"]:
                routing.set(kind)
                progress(f"context {context}, {kind} routing: timing {replays} replays ({side})")
                entry = here.setdefault(kind, {"context": context, "routing": kind})
                if side == "executor":
                    timer.run(work)
                    entry["output"] = executor.output[:ROWS].float().cpu().clone()
                    ids = executor_routing(executor, step, tokens)
                    if ids is None:  # a MoE provider without an observable experts sub-op: the upper bound
                        entry["distinct_experts"] = [min(spec.E, ROWS * spec.top_k)] * spec.num_layers
                        entry["routing_read_from"] = "upper bound (rows x top-k)"
                    else:
                        entry["distinct_experts"] = [int(torch.unique(t).numel()) for t in ids]
                        entry["routing_read_from"] = "executor"
                    entry["bytes"] = sum(
                        b.bytes for b in block_bytes(weights, context, ROWS, entry["distinct_experts"])
                    )
                entry[side] = timer.time(work, replays).as_dict()
            routing.set("random")
            del work, executor
            if graphs:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
        runs += list(here.values())
        del cache
    progress("done")
    progress.done()
    return {
        "rank": cfg.rank,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if graphs else None,
        "copy_bandwidth": bandwidth._asdict(),
        "weights_bytes": sum(t.numel() * t.element_size() for layer in weights.layers for t in _layer_tensors(layer)),
        "layouts": layouts,
        "routing_method": routing.describe(),
        "runs": runs,
    }


def _slowest(times: list[dict[str, Any]]) -> dict[str, Any]:
    """The step over the ranks: the slowest rank's median (its min and max beside it)."""
    rank = max(range(len(times)), key=lambda r: times[r]["median_s"])
    return {**times[rank], "slowest_rank": rank, "by_rank": times}


def assemble(
    cfg: BenchConfig, placement: Placement, job: dict[str, Any], every: list[dict[str, Any]]
) -> dict[str, Any]:
    """The record, from every rank's ``measure``."""
    first = every[0]
    graphs = placement.kind != "cpu"
    runs = []
    for i, run in enumerate(first["runs"]):
        mine = [m["runs"][i] for m in every]
        floors = [r["bytes"] / m["copy_bandwidth"]["bytes_per_s"] for r, m in zip(mine, every, strict=True)]
        step, detached = _slowest([r["executor"] for r in mine]), _slowest([r["detached"] for r in mine])
        floor_s = max(floors)
        runs.append(
            {
                "context": run["context"],
                "routing": run["routing"],
                "distinct_experts": run["distinct_experts"],
                "routing_read_from": run["routing_read_from"],
                "check": {
                    "finite": all(bool(torch.isfinite(r["output"]).all()) for r in mine),
                    # The collectives leave every rank the same bits of the stream.
                    "replicated_output_identical": all(torch.equal(r["output"], run["output"]) for r in mine),
                    "routing_identical": all(r["distinct_experts"] == run["distinct_experts"] for r in mine),
                },
                "bytes_by_rank": [r["bytes"] for r in mine],
                "floor_s_by_rank": floors,
                "floor_s": floor_s,
                "executor": {**step, "fraction_of_floor": floor_s / step["median_s"]},
                "detached": detached,
                "collectives_s": step["median_s"] - detached["median_s"],
            }
        )
    gpus = [m["gpu"] for m in every]
    one_gpu = placement.kind == "one-gpu"
    return {
        "version": RECORD_VERSION,
        "config": cfg.name + ("-one-gpu" if one_gpu else ""),
        "command": job["command"],
        **provenance(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": (gpus[0] + (" shared by " if one_gpu else " x ") + str(cfg.tp))
        if graphs
        else platform.processor() or "cpu",
        "gpu": gpus[0],
        "mode": ("CUDA graphs" if graphs else "eager on the CPU") + (f" ({ONE_GPU_LABEL})" if one_gpu else ""),
        "label": ONE_GPU_LABEL if one_gpu else None,
        "speed_claim": cfg.speed_claim and placement.kind == "per-gpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "ranks": {
            "tp": cfg.tp,
            "backend": placement.backend,
            "placement": placement.describe(),
            "devices": [m["device"] for m in every],
            "gpus": gpus,
        },
        "model": model_record(cfg),
        "shard": {
            "tp": cfg.tp,
            "rank": "all",
            "expert_parallel": cfg.expert_parallel,
            "expert_format": cfg.expert_format,
            "pooler_unpooler": "column-sharded" if cfg.shard_projections else "replicated",
            "weights_bytes": first["weights_bytes"],
            "weights_bytes_by_rank": [m["weights_bytes"] for m in every],
        },
        "rows": ROWS,
        "max_context": job["max_context"],
        "replays": job["replays"] or (100 if graphs else 3),
        "l2_flush_bytes": FLUSH_BYTES if graphs else 0,
        "seed": job["seed"],
        "copy_bandwidth": first["copy_bandwidth"],
        "copy_bandwidth_by_rank": [m["copy_bandwidth"] for m in every],
        "routing_method": first["routing_method"],
        "kv_cache": "as the one-rank bench: random K/V, the sliding pages below every window released",
        "timing": (
            "every rank captures the step and times its replays alone (L2 flushed before each on a GPU), "
            "the ranks starting together after a barrier; a rank's median; the step's is the slowest rank's"
        ),
        "baseline": {
            "name": "none",
            "what": "left out of the multi-rank mode: the torch baseline has no TP collectives of its own "
            "(the one-rank configs compare it with a detached rank)",
        },
        "executor": {
            "layout": first["layouts"]["executor"],
            "detached_layout": first["layouts"]["detached"],
            "layout_identical_across_ranks": all(m["layouts"] == first["layouts"] for m in every),
            "notes": [
                "detached: the same rank's executor built without the group, its collectives left out; "
                "collectives_s = the step's median minus the detached step's (slowest ranks); where the "
                "layouts differ (a provider fused with its all-reduce) that difference includes the fusion"
            ],
        },
        "collectives_timed": _collectives(cfg),
        "collectives_left_out": [],
        "runs": runs,
        "candidates": [],
    }


def main(cfg: BenchConfig, args: Any, command: str) -> int:
    """``sparkdecode bench`` for a config of every rank (see the module docstring)."""
    for flag, given in (("--candidates", args.candidates), ("--plot", args.plot)):
        if given:
            print(f"sparkdecode bench: {flag} is not measured for a config of every rank ({cfg.name})", file=sys.stderr)
            return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if device not in ("cpu", "cuda"):
            raise BenchConfigError(f"--device {device!r}: cpu or cuda (the ranks place themselves on the GPUs)")
        if device == "cuda" and not torch.cuda.is_available():
            raise BenchConfigError("no CUDA GPU here; --device cpu runs the ranks on the CPU (a smoke run)")
        placement = Placement(cfg.tp, device, args.one_gpu, args.backend)
        cfg = placement.check_fits(cfg)
    except BenchConfigError as e:
        print(f"sparkdecode bench: {e}", file=sys.stderr)
        return 2
    contexts = tuple(args.context) if args.context else cfg.contexts
    spec = cfg.spec()
    for context in contexts:
        if not ROWS < context <= spec.max_position_embeddings:
            print(f"sparkdecode bench: context {context} is outside {ROWS + 1}..{spec.max_position_embeddings}")
            return 2
    try:
        check_max_context(args.max_context, contexts, spec.max_position_embeddings)
    except BenchConfigError as e:
        print(f"sparkdecode bench: {e}", file=sys.stderr)
        return 2
    job = {
        "command": command,
        "contexts": contexts,
        "routings": tuple(dict.fromkeys(args.routing)) if args.routing else ROUTINGS,
        "replays": args.replays,
        "seed": args.seed,
        "max_context": args.max_context,
        "pins": parse_pins(args.pin),
        "out": args.out,
    }
    try:
        spawn(cfg, placement, job, progress_quiet=args.quiet)
    except mp.ProcessRaisedException as e:
        print(f"sparkdecode bench: a rank of {cfg.name} failed:\n{e}", file=sys.stderr)
        return 1
    return 0
