"""One rank of the CPU tensor-parallel tests (spawned by test_tp.py over gloo).

Each variant: a TP-1 model drawn from one seed on every rank, this rank's shard of
it, the stock forward and the executor over the TP group side by side (each with
its own cache after the prefill), and, on rank 0, the TP-1 stock forward on the
same tokens. Everything the test asserts on is saved for the parent process.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from sparkdecode.deployment import DeploymentError
from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.harness import DecodeHarness
from sparkdecode.plugins import discover
from sparkdecode.reference import functional as fn
from sparkdecode.reference.kvcache import PagedKVCache
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.reference.providers import ReferenceAttentionBoundary
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import ModelWeights, Sharding, random_weights, shard_weights

MAX_CONTEXT = 256
PROMPT = 70  # past the window (64): sliding pages are released during the steps
STEPS = 4


def make_spec(preset: str, smooth: bool) -> ModelSpec:
    """``smooth``: every expert routed (top-k = E), so the MoE has no discrete choice
    and TP rounding cannot flip a route: the TP-vs-TP-1 comparison then measures
    rounding alone."""
    spec = ModelSpec.preset(preset, 2)
    return dataclasses.replace(spec, num_experts_per_tok=spec.num_local_experts) if smooth else spec


def model_and_shard(
    rank: int, tp: int, variant: dict, device: torch.device
) -> tuple[ModelSpec, ModelWeights, ModelWeights]:
    """The variant's spec, its seeded TP-1 weights and this rank's shard of them."""
    spec = make_spec(variant["preset"], variant["smooth"])
    full = random_weights(spec, seed=variant["seed"], device=device)
    sharding = Sharding(tp, rank, variant["experts"], variant["shard_pooler"], variant["shard_unpooler"])
    return spec, full, shard_weights(full, sharding)


def run_variant(rank: int, tp: int, variant: dict, device: torch.device) -> dict:
    spec, full, shard = model_and_shard(rank, tp, variant, device)
    group = dist.group.WORLD
    routes: list[torch.Tensor] = []
    route = fn.route

    def recording_route(logits, bias, top_k, scaling, eps=1e-15):
        ids, weights = route(logits, bias, top_k, scaling, eps)
        routes.extend([logits.clone(), ids.clone(), weights.clone()])
        return ids, weights

    fn.route = recording_route
    try:
        pins = variant.get("pins", {})
        config = DecodeConfig(max_context=MAX_CONTEXT, aux_layers=(0, 1, spec.num_layers), pins=pins)
        executor = SpecializedDecode(shard, config, group=group)
        harness = DecodeHarness(ReferenceModel(shard, MAX_CONTEXT, group), executor, PROMPT, seed=variant["seed"])
        prompt = torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7))
        prompt = prompt.to(device)
        harness.prefill(prompt)
        steps = [harness.verify() for _ in range(STEPS)]
    finally:
        fn.route = route
    out = {
        "tokens": [s.tokens for s in steps],
        "first": [s.first_position for s in steps],
        "stock_hidden": [s.stock_hidden for s in steps],
        "exec_hidden": [s.executor_hidden for s in steps],
        "stock_aux": [s.stock_aux for s in steps],
        "exec_aux": [s.executor_aux for s in steps],
        "exec_logits": [s.executor_logits for s in steps],
        "routes": routes,
    }
    if rank == 0 and variant["compare_tp1"]:
        model = ReferenceModel(full, MAX_CONTEXT)
        cache = PagedKVCache(spec, MAX_CONTEXT // 16 + 2, MAX_CONTEXT, PROMPT, device)
        model.step(cache, prompt, 0)
        hidden, logits = [], []
        for s in steps:
            h, _ = model.step(cache, s.tokens, s.first_position)
            hidden.append(h)
            logits.append(model.logits(h))
        out["tp1_hidden"], out["tp1_logits"] = hidden, logits
    return out


def gate_disagreement(rank: int, tp: int, device: torch.device) -> str:
    """Rank 1 alone cannot serve the deployment; every rank must raise its reason."""
    spec = ModelSpec.preset("tiny", 2)
    shard = shard_weights(random_weights(spec, seed=0, device=device), Sharding(tp, rank))
    max_context = 10**6 if rank == 1 else MAX_CONTEXT
    try:
        SpecializedDecode(shard, DecodeConfig(max_context=max_context), group=dist.group.WORLD)
    except DeploymentError as e:
        return str(e)
    return "built"


class RankOneFails(ReferenceAttentionBoundary):
    """The reference attention boundary, except that its build fails on rank 1 (a
    compile error, a weight check, an allocation on that rank alone)."""

    name = "failing.attention_boundary"

    @classmethod
    def build(cls, ctx, layer):
        if ctx.rank == 1:
            raise ValueError("rank 1's build failed")
        return super().build(ctx, layer)


class OnlyOnRankOne(ReferenceAttentionBoundary):
    """A provider only rank 1 has installed (a pack that failed to import on rank 0)."""

    name = "lonely.attention_boundary"
    priority = 50


def rank_failures(rank: int, tp: int, device: torch.device) -> dict[str, str]:
    """What each rank raises when one rank's build fails, and when the ranks see
    different providers: every rank must raise (none may be left waiting in a
    collective), the failed rank its own error, the others naming it."""
    spec = ModelSpec.preset("tiny", 2)
    shard = shard_weights(random_weights(spec, seed=0, device=device), Sharding(tp, rank))
    out = {}
    for case, extra, pins in (
        ("build", [RankOneFails], {"attention_boundary": RankOneFails.name}),
        ("providers", [OnlyOnRankOne] if rank == 1 else [], {}),
    ):
        registry = discover().adding(extra)
        try:
            SpecializedDecode(
                shard, DecodeConfig(max_context=MAX_CONTEXT, pins=pins), registry=registry, group=dist.group.WORLD
            )
            out[case] = "built"
        except Exception as e:
            out[case] = f"{type(e).__name__}: {e}"
    # A candidate built for its timing (the resolver's measurement chain) failing on
    # rank 1 alone: every rank raises, none goes on to replay the chain.
    executor = SpecializedDecode(shard, DecodeConfig(max_context=MAX_CONTEXT), group=dist.group.WORLD)
    classes = {**executor.layout.classes(), "attention_boundary": RankOneFails}
    try:
        executor.measurement_chain(classes)
        out["chain"] = "built"
    except Exception as e:
        out["chain"] = f"{type(e).__name__}: {e}"
    return out


def to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def main(rank: int, tp: int, init: str, out_dir: str, variants: list[dict], gate: bool, backend: str = "gloo") -> None:
    """One rank: gloo on the CPU, or NCCL with this rank on GPU ``rank``."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=tp)
    try:
        results = {"variants": [run_variant(rank, tp, v, device) for v in variants]}
        if gate:
            results["gate"] = gate_disagreement(rank, tp, device)
            results["failures"] = rank_failures(rank, tp, device)
        torch.save(to_cpu(results), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
