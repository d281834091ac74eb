"""Drive the reference draft step and the draft executor side by side.

The stand-in for vLLM's speculator loop: a prompt's context is stored into the
draft's cache (the aux streams of a target prefill), then every round runs one
draft step on both sides (each with its own copy of the draft's KV cache, the same
anchor, seed and temperature) and one verify step of the target over the anchor
and the reference's 7 draft tokens; a random number of them is accepted (1..8 rows
a step, so contexts grow unevenly and cross page and window edges), and the
accepted rows' aux streams are the next draft step's context rows.

The target is the stock forward (``ReferenceModel``, which returns the aux streams
the draft reads), or, where only the draft is under test, a stand-in that draws
O(1) fp32 aux rows and anchors at random (the target's stream is RMS-normalized).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..reference.kvcache import PagedKVCache
from ..reference.model import ReferenceModel
from .executor import DraftDecode
from .kvcache import CONTEXT_ROWS, NUM_QUERY, DraftCache, DraftHostStep
from .model import DraftOutput, ReferenceDraft


@dataclass
class DraftResult:
    """One draft step on both sides."""

    host: DraftHostStep
    anchor: int
    reference: DraftOutput
    executor: DraftOutput | None

    @property
    def tokens_agree(self) -> bool:
        return self.executor is not None and torch.equal(self.reference.tokens, self.executor.tokens)

    @property
    def logits_diff(self) -> float:
        assert self.executor is not None
        return (self.reference.logits.float() - self.executor.logits.float()).abs().max().item()

    @property
    def probs_rel_diff(self) -> float:
        assert self.executor is not None
        ref, ex = self.reference.probs, self.executor.probs
        return ((ref - ex).abs() / ref.abs().clamp_min(1e-30)).max().item()


class DraftHarness:
    """The reference draft and (optionally) the draft executor over the same
    weights, each with its own draft cache after a shared prompt context."""

    def __init__(
        self,
        draft: ReferenceDraft,
        executor: DraftDecode | None,
        max_prompt: int,
        target: ReferenceModel | None = None,
        seed: int = 0,
        temperature: float = 1.0,
        request_seed: int = 1234,
        poison: bool = True,
        graph: bool = False,
    ):
        self.draft, self.executor, self.target = draft, executor, target
        spec = draft.spec
        self.spec, self.max_context = spec, draft.max_context
        device = draft.weights.device
        self.device = device
        pages = math.ceil(self.max_context / 16) + 2
        self.reference_cache = DraftCache(spec, pages, self.max_context, max_prompt, device, poison_released=poison)
        if poison:
            self.reference_cache.poison_null_page()
        self.executor_cache: DraftCache | None = None
        self.target_cache = (
            PagedKVCache(target.spec, pages, self.max_context, max(max_prompt, CONTEXT_ROWS), device)
            if target is not None
            else None
        )
        self.rng = torch.Generator().manual_seed(seed)
        self.poison = poison
        # The executor's inputs live in fixed buffers so a captured graph sees new values.
        self.anchor = torch.zeros(1, dtype=torch.int64, device=device)
        self.seed = torch.tensor([request_seed], dtype=torch.int64, device=device)
        self.temperature = torch.tensor([temperature], dtype=torch.float32, device=device)
        self.aux = [torch.zeros(CONTEXT_ROWS, spec.target_hidden_size, device=device) for _ in spec.aux_layers]
        self.use_graph = graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: DraftOutput | None = None
        self.context_first = 0
        self.context: list[torch.Tensor] = []  # the next step's context rows, per aux layer

    # -- the target (or its stand-in) --------------------------------------------------------

    def _target_rows(self, tokens: torch.Tensor, first: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(aux rows per aux layer, each row's next token) of ``tokens`` at ``first``.."""
        rows = tokens.shape[0]
        if self.target is None:
            aux = [
                torch.randn(rows, self.spec.target_hidden_size, generator=self.rng).to(self.device) for _ in self.aux
            ]
            nxt = torch.randint(0, self.spec.vocab_size, (rows,), generator=self.rng).to(self.device)
            return aux, nxt
        assert self.target_cache is not None
        hidden, aux = self.target.step(self.target_cache, tokens, first, self.spec.aux_layers)
        return aux, self.target.logits(hidden).argmax(-1)

    # -- the loop -----------------------------------------------------------------------------

    def prefill(self, prompt: torch.Tensor) -> None:
        """The prompt through the target; its rows' K/V into the reference's draft
        cache; the executor's cache is then a copy (and its first step stores no
        context rows)."""
        n = prompt.shape[0]
        aux, nxt = self._target_rows(prompt.to(self.device), 0)
        cache = self.reference_cache
        cache.begin_step(0, n, n)
        self.draft.context(aux, cache.context_positions[:n], cache.kv(), cache.context_slots(n))
        self.anchor.copy_(nxt[-1:])
        self.context_first, self.context = n, [a[:0] for a in aux]
        if self.executor is not None:
            self.executor_cache = cache.clone()
            self.executor.prepare_kv(self.executor_cache.kv())

    def step(self) -> DraftResult:
        """One draft step on both sides."""
        count = self.context[0].shape[0]
        cache = self.reference_cache
        host = cache.begin_step(self.context_first, count)
        rows = host.context_rows
        for buffer, accepted in zip(self.aux, self.context):
            # Rows past the accepted ones store nothing: poisoned, they must not leak.
            buffer.fill_(float("nan") if self.poison else 0.0)
            buffer[:count].copy_(accepted)
        # Both sides store the context over the step's layout of ``rows`` rows (the
        # rest into the null page), as vLLM's padded graph batch does: the row count
        # picks cuBLAS's GEMM kernel and torch's reduction split, so the same row can
        # round differently in a batch of another size.
        reference = self.draft.step(
            [a[:rows] for a in self.aux],
            cache.context_positions[:rows],
            self.anchor,
            cache.positions,
            cache.kv(),
            cache.context_slots(rows),
            cache.query_slots(rows),
            self.seed,
            self.temperature,
        )
        executor = None
        if self.executor is not None:
            assert self.executor_cache is not None
            self.executor_cache.begin_step(self.context_first, count)
            executor = self._run_executor()
            executor = DraftOutput(*(t.clone() for t in executor))
        return DraftResult(host, int(self.anchor.item()), reference, executor)

    def verify(self, result: DraftResult, accepted: int | None = None) -> None:
        """The target over the anchor and the reference's draft tokens; ``accepted``
        rows (1..8, drawn when None) stay in the context; the next anchor is the
        target's token after the last of them."""
        first = result.host.anchor_position
        tokens = torch.cat([self.anchor, result.reference.tokens])
        aux, nxt = self._target_rows(tokens, first)
        if accepted is None:
            accepted = int(torch.randint(1, NUM_QUERY + 2, (1,), generator=self.rng))
        self.context_first, self.context = first, [a[:accepted] for a in aux]
        self.anchor.copy_(nxt[accepted - 1 : accepted])

    def _run_executor(self) -> DraftOutput:
        assert self.executor is not None and self.executor_cache is not None
        if self.graph is not None:
            self.graph.replay()
            assert self.outputs is not None
            return self.outputs
        cache = self.executor_cache
        step = self.executor.plan(
            cache.context_positions[: cache.context_rows], cache.positions, self.anchor, self.seed, self.temperature
        )
        if step is None:
            raise RuntimeError("the draft executor declined a step (see the log for why)")
        if not self.use_graph:
            return self.executor.run(step, self.aux)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.executor.run(step, self.aux)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.executor.run(step, self.aux)
        self.graph.replay()
        return self.outputs
