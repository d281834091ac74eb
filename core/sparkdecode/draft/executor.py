"""The specialized DSpark draft step: one plan per step, then every draft block's
provider in one loop.

    draft_context -> embed [anchor, mask x 6] -> draft_boundary(0) -> draft_attention(0)
    -> draft_attention_boundary(0) -> draft_mlp(0) -> draft_boundary(1) -> ...
    -> draft_mlp(L-1) -> draft_final -> markov -> tokens, logits, probabilities

``DraftDecode`` resolves the draft's own layout over the same registry as the
target's (the kinds of ``protocols.DRAFT_KINDS``), builds every provider once, owns
every buffer, and runs planned steps. It reads the draft's weights (and the target
tensors they hold: the embedding table, the LM head) and never modifies them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..deployment import DeploymentError, detect
from ..executor import graph_seconds, metadata_ok
from ..layout import Layout, default_cache_dir, resolve
from ..plugins import Registry, discover
from ..protocols import DRAFT_KINDS, KVGroupMetadata, LayerKV
from . import model
from .kvcache import CONTEXT_ROWS, NUM_QUERY
from .model import DraftOutput
from .protocols import DraftBuildContext, DraftDeployment, DraftStep
from .spec import DraftSpec
from .weights import DraftWeights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftConfig:
    """What the deployment fixes before the draft executor is built."""

    num_query: int = NUM_QUERY  # tokens drafted a step (num_speculative_tokens)
    context_rows: int = CONTEXT_ROWS  # context rows a step stores: one verify step's
    max_context: int = 4096  # the deployment's max_model_len
    pins: Mapping[str, str] = field(default_factory=dict)  # draft kind -> provider name


class DraftLayer(NamedTuple):
    """The providers of one draft layer."""

    boundary: Any
    attention: Any
    attention_boundary: Any
    mlp: Any


def draft_deployment(
    spec: DraftSpec, target_spec: Any, device: torch.device | str | None, config: DraftConfig
) -> DraftDeployment:
    """This process's deployment (``deployment.detect``) with the draft it serves."""
    base = detect(target_spec, 1, device, max_rows=config.num_query, max_context=config.max_context)
    return DraftDeployment(**{f.name: getattr(base, f.name) for f in fields(base)}, draft=spec)


def draft_requirements(weights: DraftWeights, config: DraftConfig) -> list[str]:
    """Every unmet requirement of the draft executor itself (providers add their own)."""
    spec, out = weights.spec, []
    unmet = model.supported_draft(spec)
    if unmet:
        out.append(unmet)
    if config.num_query != NUM_QUERY:
        out.append(f"{config.num_query} drafted tokens a step (the draft step drafts {NUM_QUERY})")
    if config.context_rows < 1:
        out.append(f"{config.context_rows} context rows a step (at least 1)")
    if config.max_context > spec.max_position_embeddings:
        out.append(f"max context {config.max_context} above the draft's {spec.max_position_embeddings} positions")
    if weights.d2t.ne(0).any():
        out.append("a draft-to-target vocabulary map (d2t) other than the identity")
    if weights.lm_head.shape[0] != spec.draft_vocab_size:
        out.append(f"an LM head of {weights.lm_head.shape[0]} rows for a vocabulary of {spec.draft_vocab_size}")
    return out


class DraftDecode:
    """Built once the draft's weights are loaded; owns every draft provider and buffer."""

    def __init__(
        self,
        weights: DraftWeights,
        config: DraftConfig,
        *,
        target_spec: Any = None,
        deployment: DraftDeployment | None = None,
        registry: Registry | None = None,
        measure: bool = True,
        cache_dir: Path | None = None,
    ):
        self.weights, self.spec, self.config = weights, weights.spec, config
        self.device = weights.device
        reasons = draft_requirements(weights, config)
        if reasons:
            raise DeploymentError(f"the specialized draft step does not support this draft: {reasons[0]}")
        target_spec = target_spec if target_spec is not None else weights.target_spec
        if deployment is None:
            if target_spec is None:
                raise ValueError("a draft deployment needs the target's spec (target_spec)")
            deployment = draft_deployment(self.spec, target_spec, self.device, config)
        self.deployment = deployment
        self.registry = registry if registry is not None else discover()
        pins = {k: v for k, v in config.pins.items() if k in DRAFT_KINDS}
        measure_fn = self._measure if measure and self.device.type == "cuda" else None
        cache = (cache_dir or default_cache_dir()) / "draft" / _spec_digest(self.spec)
        self.layout: Layout = resolve(self.registry, self.deployment, pins, measure_fn, cache, kinds=DRAFT_KINDS)
        self.kv: tuple[LayerKV, ...] | None = None
        self.logged: set[str] = set()
        self.build()
        logger.info("sparkdecode: built the draft step, %d layers\n%s", self.spec.num_layers, self.layout.table())

    def build(self) -> None:
        """Every provider of the resolved layout, with its buffers."""
        self.program = DraftProgram(self._context({}), self.layout.classes())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _context(self, buffers: dict[str, torch.Tensor]) -> DraftBuildContext:
        return DraftBuildContext(
            spec=self.spec,
            weights=self.weights,
            device=self.device,
            deployment=self.deployment,
            buffers=buffers,
            context_rows=self.config.context_rows,
            num_query=self.config.num_query,
            max_context=self.config.max_context,
        )

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return self.program.buffers

    def providers(self) -> list[Any]:
        """Every built provider, in build order."""
        return self.program.providers()

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        """Bind the draft's KV cache (per draft layer); every provider checks the form it takes."""
        if len(kv) != self.spec.num_layers:
            raise ValueError(f"{len(kv)} KV layers bound for {self.spec.num_layers} draft layers")
        for provider in self.providers():
            provider.prepare_kv(kv)
        self.kv = kv

    def plan(
        self,
        context_positions: torch.Tensor,
        positions: torch.Tensor,
        anchor: torch.Tensor,
        seed: torch.Tensor,
        temperature: torch.Tensor,
        kv: tuple[LayerKV, ...] | None = None,
    ) -> DraftStep | None:
        """This step's plan, or None to run the stock draft instead.

        Every gate reads host state only. Steps that run stock:
        - no KV cache bound yet, or metadata over another cache;
        - layouts other than ``context_rows`` context rows and ``num_query`` query rows
          (``context_positions`` int64 [C], ``positions`` int64 [N] on the device);
        - sampling inputs not in device buffers of the expected form (anchor int64 [1],
          seed int64 [1], temperature fp32 [1]);
        - metadata in a form the providers do not take (block tables int32 [1, n],
          sequence lengths int32 [1], slot mappings int64 of at least C + N rows).
        Each outcome is logged once."""
        kv = self.kv if kv is None else kv
        c, n = self.config.context_rows, self.config.num_query
        if self.kv is None or kv is None:
            return self._outcome("no KV cache bound")
        if (
            tuple(context_positions.shape) != (c,)
            or tuple(positions.shape) != (n,)
            or context_positions.dtype != torch.int64
            or positions.dtype != torch.int64
            or positions.device != self.device
            or context_positions.device != self.device
        ):
            return self._outcome(f"not a layout of {c} context and {n} query rows (int64 on the executor's device)")
        inputs = ((anchor, torch.int64), (seed, torch.int64), (temperature, torch.float32))
        if any(tuple(t.shape) != (1,) or t.dtype != dtype or t.device != self.device for t, dtype in inputs):
            return self._outcome("sampling inputs not in device buffers (anchor, seed, temperature [1])")
        if len(kv) != len(self.kv) or any(
            a.k.data_ptr() != b.k.data_ptr() or a.v.data_ptr() != b.v.data_ptr() for a, b in zip(kv, self.kv)
        ):
            return self._outcome("metadata over a KV cache other than the bound one")
        if not all(metadata_ok(layer.group, c + n) for layer in kv):
            return self._outcome("draft metadata in a form the providers do not take")
        step = DraftStep(c, n, context_positions, positions, kv, anchor, seed, temperature)
        return self._outcome(None, step)

    def _outcome(self, fallback: str | None, step: DraftStep | None = None) -> DraftStep | None:
        outcome = f"stock draft ({fallback})" if fallback else "specialized draft step"
        message = f"sparkdecode: draft step: {outcome}"
        if message not in self.logged:
            self.logged.add(message)
            logger.info(message)
        return step

    def store_context(
        self, aux: Sequence[torch.Tensor], positions: torch.Tensor, kv: Sequence[LayerKV], slots: Sequence[torch.Tensor]
    ) -> None:
        """The K/V of a context longer than a step's rows (a prompt), eagerly through
        the reference math, as vLLM stores the rows past its graph's outside it."""
        if positions.shape[0]:
            table = model.context_rope_table(self.weights, self.config.max_context)
            model.context_kv(self.weights, aux, positions, kv, slots, table)

    def run(self, step: DraftStep, aux: Sequence[torch.Tensor]) -> DraftOutput:
        """The draft tokens, their bf16 logits and probabilities (views of the
        executor's buffers) of a planned step; ``aux``: the target's fp32 aux streams
        of the context rows ([>= C, H_target] each, ascending aux layers)."""
        return self.program.run(step, aux)

    def _measure(self, kind: str, cls: type, layout: Mapping[str, type]) -> float:
        """Seconds per replay of a whole draft step in a CUDA graph with ``cls``
        serving ``kind`` (the draft is a few layers: the whole step is what decides),
        over a random, fully used cache at the longest context."""
        classes = dict(layout)
        classes[kind] = cls
        spec, device, c, n = self.spec, self.device, self.config.context_rows, self.config.num_query
        program = DraftProgram(self._context({}), classes)
        kv = _measurement_kv(spec, self.config.max_context, c + n, device)
        for provider in program.providers():
            provider.prepare_kv(kv)
        last = self.config.max_context - n
        context_positions = torch.arange(last - c, last, device=device)
        positions = torch.arange(last, last + n, device=device)
        anchor = torch.zeros(1, dtype=torch.int64, device=device)
        seed = torch.ones(1, dtype=torch.int64, device=device)
        temperature = torch.ones(1, dtype=torch.float32, device=device)
        step = DraftStep(c, n, context_positions, positions, kv, anchor, seed, temperature)
        aux = [torch.randn(c, spec.target_hidden_size, device=device) for _ in spec.aux_layers]
        return graph_seconds(lambda: program.run(step, aux), device)


class DraftProgram:
    """The built providers of one draft layout and the buffers they run over."""

    def __init__(self, ctx: DraftBuildContext, classes: Mapping[str, type]):
        spec, n, H, device = ctx.spec, ctx.num_query, ctx.spec.hidden_size, ctx.device
        self.weights, self.buffers = ctx.weights, ctx.buffers

        def buffer(name: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            t = torch.zeros(*shape, dtype=dtype, device=device)
            self.buffers[name] = t
            return t

        self.block_ids = buffer("draft_block_ids", torch.int64, n)
        self.block_ids[1:].fill_(spec.mask_token_id)
        self.embeddings = buffer("draft_embeddings", torch.bfloat16, n, H)
        self.stream = buffer("draft_stream", spec.residual_torch_dtype, n, H)
        self.x = buffer("draft_x", torch.bfloat16, n, H)
        self.a = buffer("draft_a", torch.bfloat16, n, H)
        self.xf = buffer("draft_xf", torch.bfloat16, n, H)
        self.f = buffer("draft_f", torch.bfloat16, n, H)
        self.hidden = buffer("draft_hidden", torch.bfloat16, n, H)
        self.tokens = buffer("draft_tokens", torch.int64, n)
        self.logits = buffer("draft_logits", torch.bfloat16, n, spec.draft_vocab_size)
        self.probs = buffer("draft_probs", torch.float32, n)
        self.context = classes["draft_context"].build(ctx, None)
        self.layers = tuple(
            DraftLayer(
                classes["draft_boundary"].build(ctx, j),
                classes["draft_attention"].build(ctx, j),
                classes["draft_attention_boundary"].build(ctx, j),
                classes["draft_mlp"].build(ctx, j),
            )
            for j in range(spec.num_layers)
        )
        self.final = classes["draft_final"].build(ctx, None)
        self.markov = classes["markov"].build(ctx, None)

    def providers(self) -> list[Any]:
        """Every built provider, in build order: the context, each layer's four
        blocks, the final boundary, the Markov loop."""
        out: list[Any] = [self.context]
        for layer in self.layers:
            out.extend(layer)
        out.extend((self.final, self.markov))
        return out

    def run(self, step: DraftStep, aux: Sequence[torch.Tensor]) -> DraftOutput:
        self.context.run(step, aux)
        self.block_ids[:1].copy_(step.anchor)
        torch.index_select(self.weights.embed, 0, self.block_ids, out=self.embeddings)
        for layer in self.layers:
            layer.boundary.run(step, self.stream, self.f, self.x)
            layer.attention.run(step, self.x, self.a)
            layer.attention_boundary.run(self.a, self.stream, self.xf)
            layer.mlp.run(self.xf, self.f)
        self.final.run(step, self.stream, self.f, self.hidden)
        self.markov.run(step, self.hidden, self.tokens, self.logits, self.probs)
        return DraftOutput(self.tokens, self.logits, self.probs)


def _spec_digest(spec: DraftSpec) -> str:
    import hashlib

    return hashlib.sha256(spec.key().encode()).hexdigest()[:16]


def _measurement_kv(spec: DraftSpec, max_context: int, rows: int, device: torch.device) -> tuple[LayerKV, ...]:
    """A random, fully used paged cache at the longest context, one per draft layer
    (the worst case a candidate serves)."""
    pages = math.ceil(max_context / 16)
    table = torch.arange(1, pages + 1, dtype=torch.int32, device=device)[None]
    lens = torch.tensor([max_context], dtype=torch.int32, device=device)
    slots = torch.zeros(rows, dtype=torch.int64, device=device)
    out = []
    for j in range(spec.num_layers):
        kvt = torch.randn(2, pages + 1, 16, spec.num_key_value_heads, spec.head_dim, device=device).to(torch.bfloat16)
        out.append(LayerKV(kvt[0], kvt[1], KVGroupMetadata(table, lens, slots), spec.window(j)))
    return tuple(out)
