"""One bench config, end to end: build, check, time, account, record.

For each context: a filled KV cache (one copy per side), the executor built for
that context and its step planned, the torch baseline planned; each side's
whole step captured once in a CUDA graph. For each routing (switched in place):
one replay of each side compared (relative error of the hidden states, finite),
the routing read back (distinct experts per layer), many timed replays of each
step, then each block alone in its own graph (orientation only), and the floor.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import subprocess
import sys
import time
from typing import Any

import torch

from ..executor import DecodeConfig, SpecializedDecode
from ..layout import measured_seconds
from ..plugins import Registry, discover
from ..protocols import HostStep
from .baseline import TorchBaseline, flashinfer_version
from .clockwatch import ClockWatch, clocks_record
from .configs import ROUTINGS, ROWS, BenchConfig
from .floor import block_bytes, copy_bandwidth, expert_tensors
from .steer import Routing, candidate_blocks, draw_weights, executor_blocks, executor_routing, filled_cache
from .timing import FLUSH_BYTES, Timer

RECORD_VERSION = 1
# A torch baseline step slower than this (the NVFP4 paths dequantize every route's
# expert, about 2.7 s a step at 62 layers) is timed SLOW_BASELINE_REPLAYS times: the
# comparison does not need 30 of them, and the GPU time goes to the executor.
SLOW_BASELINE_S = 0.25
SLOW_BASELINE_REPLAYS = 5
# How the config's routed experts were made, for the record (shard.expert_form).
EXPERT_FORMS = {
    "bf16": "bf16 experts, random",
    "nvfp4": "NVFP4 in the checkpoint's layout (ModelOpt's quantization of random bf16 experts) in all layers "
    "but the first and last, whose experts are bf16",
    "nvfp4_marlin": "NVFP4 drawn as the nvfp4 config draws them, then each layer's experts repacked into vLLM "
    "0.33's SM90 Marlin layout by nvfp4_marlin.marlin_form (a torch model of vLLM's repack: the gate's global "
    "scale for both W13 halves, W2's global times up / gate), as vLLM serves them on Hopper. The baseline and "
    "the executor both read that layout: W13's up rows and W2 hold the checkpoint's values scaled by gate / up "
    "and up / gate (the same SwiGLU product, rounded to bf16 at other values), on both sides alike",
}
MARLIN_BASELINE = {
    "nvfp4_marlin": " (in Marlin's layout: decoded by torch from Marlin's tiles and scales, "
    "nvfp4_marlin.dequantize, to the weights Marlin computes with)"
}


class Progress:
    """One line on stderr while it builds and captures (rewritten in place on a terminal)."""

    def __init__(self, name: str, quiet: bool = False):
        self.name, self.quiet, self.start = name, quiet, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.width = 0

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        line = f"[bench {self.name} {time.perf_counter() - self.start:6.1f} s] {message}"
        if self.tty:
            sys.stderr.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and not self.quiet and self.width:
            sys.stderr.write("\n")
            sys.stderr.flush()


def provenance() -> dict[str, Any]:
    """The git commit of the sources and the files that differ from it (from git, or
    from SPARKDECODE_COMMIT / SPARKDECODE_DIRTY where the tree was copied without git)."""
    root = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit:
        status = git("status", "--porcelain", "--untracked-files=no") or ""
        dirty = [line[3:] for line in status.splitlines() if line.strip()]
    else:
        commit = os.environ.get("SPARKDECODE_COMMIT", "unknown")
        dirty = [f for f in os.environ.get("SPARKDECODE_DIRTY", "").split(",") if f]
    return {"commit": commit, "modified_files": dirty}


def _collectives(cfg: BenchConfig) -> list[str]:
    if cfg.tp == 1:
        return []
    per_layer = ["the attention o_proj partial all-reduce (bf16 [rows, H])"]
    if cfg.expert_parallel == "tp":
        per_layer.append("the expert-TP route-row all-reduce (bf16 [rows, k, P])")
    else:
        per_layer.append("the EP partial-sum all-reduce of the MoE tail (bf16 [rows, P])")
    if cfg.shard_projections:
        per_layer.append("the column gathers of the sharded pooler (bf16 [rows, P]) and unpooler (bf16 [rows, H])")
    return [f"{c}, every layer" for c in per_layer]


def model_record(cfg: BenchConfig) -> dict[str, Any]:
    """The record's model: the preset cut to the config's layers, its widths."""
    spec = cfg.spec()
    return {
        "preset": cfg.preset,
        "layers": spec.num_layers,
        "layer_types": list(spec.layer_types),
        "hidden_size": spec.H,
        "heads": spec.num_attention_heads,
        "kv_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "experts": spec.E,
        "top_k": spec.top_k,
        "moe_hidden_size": spec.P,
        "moe_intermediate_size": spec.I,
        "sliding_window": spec.sliding_window,
    }


def _block_kind(name: str, weights) -> str:
    kind, _, index = name.partition(".")
    if kind == "attention":
        return "attention (sliding)" if weights.layers[int(index)].window is not None else "attention (full)"
    return kind


def run(
    cfg: BenchConfig,
    *,
    device: torch.device,
    contexts: tuple[int, ...] | None = None,
    routings: tuple[str, ...] = ROUTINGS,
    replays: int | None = None,
    block_replays: int | None = None,
    blocks: bool = True,
    seed: int = 0,
    max_context: int | None = None,
    pins: dict[str, str] | None = None,
    candidates: tuple[str, ...] = (),
    registry: Registry | None = None,
    command: str = "",
    progress: Progress | None = None,
    watch: ClockWatch | None = None,
) -> dict[str, Any]:
    """The record of one config (see ``report.py`` for its form). ``candidates``: kinds
    (``attention``, ``attention_core``) whose every supported provider is timed per
    layer, each alone in a graph (steer.candidate_blocks). ``registry``: the providers
    offered to the resolver (default: the discovered ones; ``--provider`` adds to them).
    ``max_context``: the executor's (a served max_model_len); default each context's own.
    ``watch``: samples the GPU's clocks through each run's timed executor replays, which the
    run's record then holds (``clocks``)."""
    progress = progress or Progress(cfg.name, quiet=True)
    registry = registry if registry is not None else discover()
    graphs = device.type == "cuda"
    replays = replays or (100 if graphs else 3)
    block_replays = block_replays or (30 if graphs else 1)
    contexts = contexts or cfg.contexts
    use_flashinfer = graphs and flashinfer_version() is not None
    spec = cfg.spec()
    for context in contexts:
        if not ROWS < context <= spec.max_position_embeddings:
            raise ValueError(f"context {context} is outside {ROWS + 1}..{spec.max_position_embeddings}")

    if graphs:
        cfg.check_fits(torch.cuda.mem_get_info(device)[0])
    progress("measuring the copy bandwidth")
    bandwidth = copy_bandwidth(device)
    if graphs:
        torch.cuda.empty_cache()
    progress(f"drawing random weights ({spec.num_layers} layers, TP {cfg.tp} rank {cfg.rank})")
    weights = draw_weights(cfg, device, seed)
    routing = Routing(weights, seed)
    tokens = torch.randint(0, spec.vocab_size, (ROWS,), generator=torch.Generator().manual_seed(seed)).to(device)
    timer = Timer(device)
    runs: list[dict[str, Any]] = []
    candidate_runs: list[dict[str, Any]] = []
    layout: dict[str, str] = {}
    measured: dict[str, dict[str, dict[str, float]]] = {}
    executor_notes: list[str] = []
    baseline_attention = ""
    for context in contexts:
        progress(f"context {context}: filling the KV cache")
        cache = filled_cache(weights, context, ROWS, seed)
        baseline_cache = cache.clone()
        first = context - ROWS
        positions = torch.arange(first, context, dtype=torch.int64, device=device)

        progress(f"context {context}: building the executor")
        executor = SpecializedDecode(
            weights,
            DecodeConfig(q=ROWS, max_rows=ROWS, max_context=max_context or context, pins=dict(pins or {})),
            registry=registry,
        )
        layout = {kind: f"{c.chosen.name} ({c.how})" for kind, c in executor.layout.choices.items()}
        measured[str(context)] = measured_seconds(executor.layout)
        executor_notes = []
        if executor.collectives.detached:
            executor_notes.append(f"rank {cfg.rank} of TP {cfg.tp} runs detached: its collectives are left out")
        executor.prepare_kv(cache.kv())
        step = executor.plan(positions)
        if step is None:
            raise RuntimeError("the executor declined the verify step (run with --log INFO for why)")
        # The providers' host work (a library's plan) for the one step every replay repeats.
        host = HostStep(first_position=first, rows=ROWS, context_len=context)
        executor.prepare_step(host)

        progress(f"context {context}: planning the torch baseline")
        baseline = TorchBaseline(weights, baseline_cache, tokens, positions, context, use_flashinfer)
        baseline_attention = baseline.attention_impl

        attention_error = baseline.attention_error()
        progress(f"context {context}: capturing the executor's step")
        executor_step = timer.capture(functools.partial(executor.run, step, input_ids=tokens))
        progress(f"context {context}: capturing the baseline's step")
        baseline_step = timer.capture(baseline.step)

        for kind in routings:
            routing.set(kind)
            label = f"context {context}, {kind} routing"
            progress(f"{label}: checking")
            timer.run(executor_step)
            executor_out = executor.output[:ROWS].float().clone()
            once = time.perf_counter()
            timer.run(baseline_step)
            once = time.perf_counter() - once
            baseline_out = baseline.out.float().clone()
            finite = bool(torch.isfinite(executor_out).all() and torch.isfinite(baseline_out).all())
            rel = ((baseline_out - executor_out).norm() / executor_out.norm()).item()

            ids = executor_routing(executor, step, tokens)
            baseline_ids = baseline.record_routing()
            source = "executor"
            if ids is None:
                ids, source = baseline_ids, "torch baseline"
            distinct = [int(torch.unique(t).numel()) for t in ids]
            baseline_distinct = [int(torch.unique(t).numel()) for t in baseline_ids]
            alike = sum(
                torch.equal(a.sort(-1).values, c.sort(-1).values) for a, c in zip(ids, baseline_ids, strict=True)
            )

            base_replays = replays if once < SLOW_BASELINE_S else min(replays, SLOW_BASELINE_REPLAYS)
            progress(f"{label}: timing {base_replays} replays of the baseline, {replays} of the executor")
            t_base = timer.time(baseline_step, base_replays)
            if watch is None:
                t_exec = timer.time(executor_step, replays)
            else:
                with watch.phase(label):
                    t_exec = timer.time(executor_step, replays)

            bytes_by_block = block_bytes(weights, context, ROWS, distinct)
            total = sum(b.bytes for b in bytes_by_block)
            floor_s = total / bandwidth.bytes_per_s
            per_block: dict[str, dict[str, Any]] = {
                b.name: {"kind": b.kind, "layer": b.layer, "bytes": b.bytes, "floor_s": b.bytes / bandwidth.bytes_per_s}
                for b in bytes_by_block
            }
            if blocks:
                sides = (
                    ("baseline", [(n, (lambda f=f: f)) for n, f in baseline.blocks()]),
                    ("executor", executor_blocks(executor, step, tokens)),
                )
                for side, entries in sides:
                    for name, prepare in entries:
                        progress(f"{label}: {side} block {name} alone")
                        work = timer.capture(prepare(), shared_pool=True)
                        per_block[name][side] = timer.time(work, block_replays).as_dict()
                        del work
            runs.append(
                {
                    "context": context,
                    "routing": kind,
                    "distinct_experts": distinct,
                    "routing_read_from": source,
                    "baseline_distinct_experts": baseline_distinct,
                    "check": {
                        # The attention block (o_proj partial) of the baseline against the
                        # reference on identical inputs, the largest over the layers.
                        "attention_relative_error": attention_error,
                        # The step's hidden states, baseline against executor: the attention
                        # differences are amplified wherever they flip an expert choice. Both
                        # sides read the same experts (in Marlin's layout: both compute with
                        # Marlin's folded scales, none with the checkpoint's).
                        "relative_error_baseline_vs_executor": rel,
                        "layers_routed_alike": alike,
                        "finite": finite,
                    },
                    "bytes": total,
                    "floor_s": floor_s,
                    "baseline": {**t_base.as_dict(), "fraction_of_floor": floor_s / t_base.median_s},
                    "executor": {**t_exec.as_dict(), "fraction_of_floor": floor_s / t_exec.median_s},
                    "speedup_baseline_over_executor": t_base.median_s / t_exec.median_s,
                    # the GPU's clocks through the executor's timed replays (--watch)
                    "clocks": None if watch is None else clocks_record(watch, label),
                    "blocks": per_block,
                }
            )
        if candidates:
            timed: dict[str, dict[str, Any]] = {}
            for kind in candidates:
                for block, provider, fn in candidate_blocks(executor, step, host, kind):
                    progress(f"context {context}: {provider} on {block} alone")
                    work = timer.capture(fn, shared_pool=True)
                    timed.setdefault(block, {})[provider] = timer.time(work, block_replays).as_dict()
                    del work
            candidate_runs.append({"context": context, "blocks": timed})
        routing.set("random")
        del executor_step, baseline_step, executor, baseline, cache, baseline_cache
        if graphs:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    progress("done")
    progress.done()

    gpu = torch.cuda.get_device_name(device) if graphs else None
    mode = "CUDA graphs" if graphs else "eager on the CPU"
    return {
        "version": RECORD_VERSION,
        "config": cfg.name,
        "command": command,
        **provenance(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": gpu or platform.processor() or "cpu",
        "gpu": gpu,
        "mode": mode,
        "speed_claim": cfg.speed_claim and graphs,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": flashinfer_version(),
        "model": model_record(cfg),
        "shard": {
            "tp": cfg.tp,
            "rank": cfg.rank,
            "expert_parallel": cfg.expert_parallel,
            "expert_format": cfg.expert_format,
            "expert_form": EXPERT_FORMS[cfg.expert_format],
            "pooler_unpooler": "column-sharded" if cfg.shard_projections else "replicated",
            "weights_bytes": sum(
                t.numel() * t.element_size() for layer in weights.layers for t in _layer_tensors(layer)
            ),
        },
        "rows": ROWS,
        # the executor's max context: null where each context's own (built for that length)
        "max_context": max_context,
        "replays": replays,
        "block_replays": block_replays,
        "l2_flush_bytes": FLUSH_BYTES if graphs else 0,
        "seed": seed,
        "copy_bandwidth": bandwidth._asdict(),
        "routing_method": routing.describe(),
        "kv_cache": (
            "random K/V written into the pages; begin_step twice at context - rows, so the sliding "
            "group's pages below every window are released to the (NaN-poisoned) null page"
        ),
        "baseline": {
            "name": "torch baseline",
            "what": "reference math: cuBLAS GEMMs, grouped expert GEMMs (torch._grouped_mm, each selected "
            "expert read once; NVFP4 experts: each route's expert dequantized to bf16, then batched GEMVs"
            + MARLIN_BASELINE.get(cfg.expert_format, "")
            + "), torch norms/RoPE/routing; paged attention: "
            + baseline_attention,
        },
        # The resolver's in-place layer times of each measured kind's candidates, per context.
        "executor": {
            "layout": layout,
            "measured_seconds": measured,
            "notes": executor_notes,
            # classes no pack registers, offered with --provider: name -> module:Class
            "unregistered_providers": registry.unregistered(),
        },
        "collectives_left_out": _collectives(cfg),
        "runs": runs,
        # Per context: every supported provider of the asked kinds, per layer, alone
        # in a graph on random inputs of the step's shapes (orientation only).
        "candidates": candidate_runs,
    }


def _layer_tensors(layer) -> list[torch.Tensor]:
    return [
        v
        for k, v in vars(layer).items()
        if isinstance(v, torch.Tensor) and k not in ("router_unfolded", "attn_gate", "ffn_gate")
    ] + expert_tensors(layer.experts)
