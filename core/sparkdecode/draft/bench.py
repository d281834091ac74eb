"""The draft step's time against its floor: a record for ``bench/results/``.

One draft step (8 context rows, 7 query rows, the Markov loop) at a given
context, over a draft cache filled with random K/V, captured once in a CUDA graph
and replayed with L2 flushed before each replay (``bench.timing.Timer``); the
floor is the step's bytes (``draft.floor``) over the copy bandwidth measured in
the same run. On the CPU the step runs eagerly: a smoke figure, never a speed
claim.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..bench.floor import copy_bandwidth
from ..bench.runner import provenance
from ..bench.timing import Timer
from ..plugins import Registry
from .executor import DraftConfig, DraftDecode
from .floor import draft_block_bytes
from .kvcache import CONTEXT_ROWS, NUM_QUERY, DraftCache
from .weights import DraftWeights


def bench_draft_step(
    weights: DraftWeights,
    context: int,
    name: str,
    replays: int = 50,
    registry: Registry | None = None,
    pins: Mapping[str, str] | None = None,
    seed: int = 0,
    command: str = "",
) -> dict[str, Any]:
    """Time one draft step whose last query sits at ``context - 1``; returns the
    record (``bench.report.write`` stores it under ``name``), with ``command``, the
    command line that ran it."""
    spec, device = weights.spec, weights.device
    g = torch.Generator(device=device).manual_seed(seed)
    max_context = max(context, CONTEXT_ROWS + NUM_QUERY)
    executor = DraftDecode(weights, DraftConfig(max_context=max_context, pins=dict(pins or {})), registry=registry)
    cache = DraftCache(spec, math.ceil(max_context / 16) + 2, max_context, device=device)
    for kv in cache.paged.tensors:
        kv.copy_(torch.randn(kv.shape, generator=g, device=device))
    # Pages up to the last query are allocated at once; the context rows are the last verify's.
    cache.begin_step(max_context - NUM_QUERY - CONTEXT_ROWS, CONTEXT_ROWS)
    executor.prepare_kv(cache.kv())
    aux = [torch.randn(CONTEXT_ROWS, spec.target_hidden_size, generator=g, device=device) for _ in spec.aux_layers]
    anchor = torch.zeros(1, dtype=torch.int64, device=device)
    request_seed = torch.tensor([seed], dtype=torch.int64, device=device)
    temperature = torch.ones(1, dtype=torch.float32, device=device)
    step = executor.plan(cache.context_positions[:CONTEXT_ROWS], cache.positions, anchor, request_seed, temperature)
    if step is None:
        raise RuntimeError("the draft executor declined the benchmark's step (see the log for why)")
    timer = Timer(device)
    work = timer.capture(lambda: executor.run(step, aux))
    times = timer.time(work, replays)
    bandwidth = copy_bandwidth(device)
    blocks = draft_block_bytes(weights, max_context)
    floor_bytes = sum(b.bytes for b in blocks)
    floor_s = floor_bytes / bandwidth.bytes_per_s
    return {
        "config": name,
        "kind": "draft_step",
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **provenance(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "graph": timer.graph,
        "context": max_context,
        "draft": {"layers": spec.num_layers, "hidden_size": spec.hidden_size, "markov_rank": spec.markov_rank},
        "layout": {kind: choice.chosen.name for kind, choice in executor.layout.choices.items()},
        "step": times.as_dict(),
        "floor": {
            "bytes": floor_bytes,
            "seconds": floor_s,
            "copy_bytes_per_s": bandwidth.bytes_per_s,
            "fraction": floor_s / times.median_s,
            "blocks": {b.name: b.bytes for b in blocks},
        },
    }
