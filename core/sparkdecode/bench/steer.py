"""Steering one step without an engine: weights of a rank's shard, a paged KV
cache filled to the context, routing forced where asked, the executor's blocks
one at a time.

- The KV cache is filled with random K/V directly (no prefill through the model),
  and ``begin_step`` is called twice at the step's first position: the first
  call allocates the pages, the second releases (and poisons with NaN) the
  sliding pages that left every query's window, as serving would have.
- Routing ``random`` is the model's own routing of random tokens through random
  weights; ``correlated`` raises the selection bias of ``CORRELATED_EXPERTS``
  seeded experts per layer by ``CORRELATED_BIAS`` (far above any unbiased score
  p + bias, p in (0, 1)), so every token's top-k falls among those experts and
  the rows share most of their experts, as the tokens of a real verify step do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..executor import SpecializedDecode
from ..nvfp4_marlin import marlin_form
from ..protocols import HostStep, RoutedTopk, Step
from ..reference.kvcache import PagedKVCache
from ..weights import ModelWeights, Sharding, random_weights
from .configs import BenchConfig

CORRELATED_EXPERTS = 10
CORRELATED_BIAS = 1.0


def draw_weights(cfg: BenchConfig, device: torch.device, seed: int) -> ModelWeights:
    """Random weights of the config's model: this rank's shard only (NVFP4 experts
    in every layer but the first and last for an ``nvfp4`` config). ``nvfp4_marlin``:
    the same NVFP4 experts, each layer's then repacked as vLLM serves them on SM90
    (``marlin_form``), one layer at a time, its checkpoint-layout tensors freed
    before the next: the peak holds one layer's experts twice, not the model's."""
    marlin = cfg.expert_format == "nvfp4_marlin"
    sharding = Sharding(
        tp=cfg.tp,
        rank=cfg.rank,
        expert_parallel=cfg.expert_parallel,
        shard_pooler=cfg.shard_projections,
        shard_unpooler=cfg.shard_projections,
    )
    weights = random_weights(
        cfg.spec(),
        seed=seed,
        device=device,
        keep_unfolded_router=False,
        sharding=sharding,
        expert_format="nvfp4" if marlin else cfg.expert_format,
    )
    if marlin:
        for layer in weights.layers:
            if layer.experts.format == "nvfp4":
                layer.experts = marlin_form(layer.experts)
    return weights


def filled_cache(weights: ModelWeights, context: int, rows: int, seed: int) -> PagedKVCache:
    """A paged cache holding random K/V for positions 0 .. context - rows - 1 (and
    anything at the step's own slots, which the step overwrites), its metadata set
    for the step at ``context - rows``."""
    spec, device = weights.spec, weights.device
    cache = PagedKVCache(
        spec,
        math.ceil(context / 16) + 2,
        context,
        rows,
        device,
        num_kv_heads=weights.layers[0].num_kv_heads,
        poison_released=True,
    )
    g = torch.Generator(device=device).manual_seed(seed)
    for kv in cache.tensors:
        kv.copy_(torch.randn(kv.shape, generator=g, device=device))
    cache.poison_null_page()
    first = context - rows
    cache.begin_step(first, rows)
    cache.begin_step(first, rows)  # releases the sliding pages below every window
    return cache


def bound_step(executor: SpecializedDecode, cache: PagedKVCache, context: int, rows: int) -> Step | None:
    """``executor`` bound to ``cache`` (``filled_cache``'s, at the same context and rows)
    and planned for one request verifying ``rows`` tokens ending at position
    ``context - 1``: its step, or None where the executor declines it."""
    executor.prepare_kv(cache.kv())
    first = context - rows
    step = executor.plan(torch.arange(first, context, dtype=torch.int64, device=executor.device))
    if step is not None:
        executor.prepare_step(HostStep(first_position=first, rows=rows, context_len=context))
    return step


class Routing:
    """Switches the weights' selection biases in place between the routings (the
    captured graphs read them by address, so no capture is redone)."""

    def __init__(self, weights: ModelWeights, seed: int):
        self.weights = weights
        self.original = [layer.expert_bias.clone() for layer in weights.layers]
        g = torch.Generator().manual_seed(seed)
        E = weights.spec.E
        self.favoured = [torch.randperm(E, generator=g)[:CORRELATED_EXPERTS].sort().values for _ in weights.layers]

    def set(self, kind: str) -> None:
        for layer, bias, favoured in zip(self.weights.layers, self.original, self.favoured):
            layer.expert_bias.copy_(bias)
            if kind == "correlated":
                layer.expert_bias[favoured.to(bias.device)] += CORRELATED_BIAS
            elif kind != "random":
                raise ValueError(f"routing {kind!r} (random or correlated)")

    def describe(self) -> dict[str, Any]:
        return {
            "random": "the model's own routing of 8 random tokens through random weights",
            "correlated": (
                f"selection bias raised by {CORRELATED_BIAS} on {CORRELATED_EXPERTS} seeded experts per layer "
                f"(so every token's top-{self.weights.spec.top_k} falls among them)"
            ),
            "favoured_experts": [f.tolist() for f in self.favoured],
        }


class _RecordingExperts:
    """An ``experts`` sub-op that keeps the step's expert ids, then runs the real one."""

    def __init__(self, inner: Any, sink: list[torch.Tensor]):
        self.inner, self.sink = inner, sink

    def run(self, inputs: Any, topk: RoutedTopk, rows: torch.Tensor) -> None:
        self.sink.append(topk.ids.clone())
        self.inner.run(inputs, topk, rows)


def executor_routing(executor: SpecializedDecode, step: Step, tokens: torch.Tensor) -> list[torch.Tensor] | None:
    """Each layer's expert ids as the executor routes the step (one eager run), or
    None where a MoE provider does not run its experts through an ``experts``
    sub-op this can observe."""
    moes = [layer.moe for layer in executor.layers]
    if not all(hasattr(m, "experts") and hasattr(m.experts, "run") for m in moes):
        return None
    sink: list[torch.Tensor] = []
    inner = [m.experts for m in moes]
    try:
        for m in moes:
            m.experts = _RecordingExperts(m.experts, sink)
        executor.run(step, input_ids=tokens)
    finally:
        for m, e in zip(moes, inner):
            m.experts = e
    return sink if len(sink) == len(moes) else None


def executor_blocks(
    executor: SpecializedDecode, step: Step, tokens: torch.Tensor
) -> list[tuple[str, Callable[[], Any]]]:
    """The executor's blocks in step order, each a closure that runs it alone on the
    inputs it had in one eager step (the shared buffers restored before it runs)."""
    b = step.rows
    names = ("stream", "attention_input", "partial", "moe_input")
    buffers = {name: executor.buffers[name] for name in names}
    stream, x, xf, partial = (buffers[n][:b] for n in ("stream", "attention_input", "moe_input", "partial"))
    snapshots: dict[str, dict[str, torch.Tensor]] = {}

    def snap(name: str) -> None:
        snapshots[name] = {n: t.clone() for n, t in buffers.items()}

    torch.index_select(executor.weights.embed, 0, tokens, out=executor.embeddings[:b])
    for i, layer in enumerate(executor.layers):
        snap(f"boundary.{i}")
        layer.boundary.run(step, stream, x, None)
        snap(f"attention.{i}")
        layer.attention.run(step, x, partial)
        snap(f"attention_boundary.{i}")
        layer.attention_boundary.run(partial, stream, xf)
        snap(f"moe.{i}")
        layer.moe.run(step, xf)
    snap("final")
    output = executor.output[:b]

    def restored(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def prepare() -> Callable[[], Any]:
            for n, t in snapshots[name].items():
                buffers[n].copy_(t)
            return fn

        return prepare

    out: list[tuple[str, Callable[[], Any]]] = [
        ("embed", lambda: lambda: torch.index_select(executor.weights.embed, 0, tokens, out=executor.embeddings[:b]))
    ]
    for i, layer in enumerate(executor.layers):
        out += [
            (f"boundary.{i}", restored(f"boundary.{i}", lambda layer=layer: layer.boundary.run(step, stream, x, None))),
            (f"attention.{i}", restored(f"attention.{i}", lambda layer=layer: layer.attention.run(step, x, partial))),
            (
                f"attention_boundary.{i}",
                restored(
                    f"attention_boundary.{i}", lambda layer=layer: layer.attention_boundary.run(partial, stream, xf)
                ),
            ),
            (f"moe.{i}", restored(f"moe.{i}", lambda layer=layer: layer.moe.run(step, xf))),
        ]
    out.append(("final", restored("final", lambda: executor.final.run(step, stream, output, None))))
    return out


CANDIDATE_KINDS = ("attention", "attention_core")


def candidate_blocks(
    executor: SpecializedDecode, step: Step, host: HostStep, kind: str
) -> list[tuple[str, str, Callable[[], Any]]]:
    """(block, provider, work) for every provider that supports ``kind`` here
    (``attention`` or ``attention_core``), on every layer: each candidate built into
    the executor's layout (the other kinds as resolved) from its own BuildContext,
    all layers in order, bound to the executor's cache, its host work done for
    ``host``, and one eager pass over the layers (so a state a group's lowest layer
    owns is filled), then ``work`` runs one layer's block alone on random inputs of
    the step's shapes (times only: the block's K/V insert writes the step's own
    slots, which the executor's step rewrites before it reads them)."""
    if kind not in CANDIDATE_KINDS:
        raise ValueError(f"candidates of {kind!r}: only {', '.join(CANDIDATE_KINDS)}")
    spec, b, device = executor.spec, step.rows, executor.device
    g = torch.Generator(device=device).manual_seed(0)
    out: list[tuple[str, str, Callable[[], Any]]] = []
    for candidate in executor.layout.choices[kind].candidates:
        if candidate.reason is not None:
            continue
        registered = executor.registry.find(candidate.name)
        assert registered is not None
        classes = {**executor.layout.classes(), kind: registered.cls}
        ctx = executor._context(classes, {}, executor._mailboxes())
        built = [registered.cls.build(ctx, i) for i in range(spec.num_layers)]
        works = []
        for i, provider in enumerate(built):
            provider.prepare_kv(step.kv)
            hook = getattr(provider, "prepare_step", None)
            if hook is not None:
                hook(host)
            if kind == "attention":
                x = torch.randn(b, spec.H, generator=g, device=device).to(torch.bfloat16)
                partial = torch.empty_like(x)
                works.append(lambda p=provider, x=x, partial=partial: p.run(step, x, partial))
            else:
                shape = (b, executor.weights.layers[i].num_heads, spec.head_dim)
                q = torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
                o = torch.empty_like(q)
                works.append(lambda p=provider, q=q, o=o: p.run(step, q, o))
        for work in works:
            work()
        out += [(f"{kind}.{i}", candidate.name, work) for i, work in enumerate(works)]
    return out
