"""Drive the stock forward and the executor side by side over verify steps.

The stand-in for the serving loop: prefill a prompt through the stock forward,
give each side its own copy of the KV cache, then run verify steps of q tokens
(the last accepted token and q - 1 drafted ones) on both. Acceptance is drawn at
random (1..q tokens a step, a stand-in for the drafter), so the context grows
unevenly, steps cross page and window edges and rejected slots are overwritten
by the next step, as in serving.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .executor import SpecializedDecode
from .protocols import HostStep
from .reference.kvcache import PagedKVCache
from .reference.model import ReferenceModel


@dataclass
class StepResult:
    """One verify step on both sides."""

    first_position: int
    tokens: torch.Tensor  # int64 [q], the step's input tokens
    stock_hidden: torch.Tensor
    executor_hidden: torch.Tensor
    stock_aux: list[torch.Tensor]
    executor_aux: list[torch.Tensor]
    stock_logits: torch.Tensor
    executor_logits: torch.Tensor
    stock_seconds: float
    executor_seconds: float
    accepted: int  # tokens of this step kept in the context

    @property
    def hidden_diff(self) -> float:
        return (self.stock_hidden.float() - self.executor_hidden.float()).abs().max().item()

    @property
    def logits_diff(self) -> float:
        return (self.stock_logits - self.executor_logits).abs().max().item()

    @property
    def greedy_agree(self) -> bool:
        return torch.equal(self.stock_logits.argmax(-1), self.executor_logits.argmax(-1))


class DecodeHarness:
    """The stock forward (``ReferenceModel``) and an executor over the same weights,
    each with its own paged KV cache after a shared prefill."""

    def __init__(
        self,
        model: ReferenceModel,
        executor: SpecializedDecode,
        max_prompt: int,
        seed: int = 0,
        poison: bool = True,
        graph: bool = False,
    ):
        """``graph``: capture the executor's step in a CUDA graph at the first verify
        and replay that one graph for every later step (new buffer contents only)."""
        self.model, self.executor = model, executor
        spec, config = model.spec, executor.config
        self.q, self.aux_layers = config.q, config.aux_layers
        device = model.weights.device
        pages = math.ceil(config.max_context / 16) + 2
        self.stock_cache = PagedKVCache(
            spec,
            pages,
            config.max_context,
            max(max_prompt, config.max_rows),
            device,
            num_kv_heads=spec.num_key_value_heads // model.weights.tp,
            poison_released=poison,
        )
        if poison:
            self.stock_cache.poison_null_page()
        self.executor_cache: PagedKVCache | None = None
        self.rng = torch.Generator().manual_seed(seed)
        self.position = 0
        self.next_token: torch.Tensor | None = None
        self.use_graph = graph
        self.graph: torch.cuda.CUDAGraph | None = None
        # The step's inputs live in fixed buffers so a captured graph sees new values.
        self.positions = torch.zeros(self.q, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(self.q, dtype=torch.int64, device=device)
        self.outputs: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def prefill(self, prompt: torch.Tensor) -> None:
        """The prompt through the stock forward; the executor's cache is then a copy."""
        hidden, _ = self.model.step(self.stock_cache, prompt, 0)
        self.next_token = self.model.logits(hidden[-1:]).argmax(-1)
        self.position = prompt.shape[0]
        self.executor_cache = self.stock_cache.clone()
        self.executor.prepare_kv(self.executor_cache.kv())

    def draft(self) -> torch.Tensor:
        """q - 1 drafted tokens (random: a stand-in for the drafter)."""
        vocab = self.model.spec.vocab_size
        return torch.randint(0, vocab, (self.q - 1,), generator=self.rng).to(self.model.weights.device)

    def verify(self, accepted: int | None = None) -> StepResult:
        """One verify step on both sides; then ``accepted`` tokens (drawn in 1..q when
        None) stay in the context and the next step starts after them with the stock
        side's greedy token."""
        assert self.next_token is not None and self.executor_cache is not None, "prefill first"
        device = self.model.weights.device
        tokens = torch.cat([self.next_token, self.draft()])
        first = self.position
        start = time.perf_counter()
        stock_hidden, stock_aux = self.model.step(self.stock_cache, tokens, first, self.aux_layers)
        stock_logits = self.model.logits(stock_hidden)
        _sync(device)
        stock_seconds = time.perf_counter() - start

        host = self.executor_cache.begin_step(first, self.q)
        self.positions.copy_(torch.arange(first, first + self.q, device=device))
        self.tokens.copy_(tokens)
        start = time.perf_counter()
        hidden, aux = self._run_executor(host)
        _sync(device)
        executor_seconds = time.perf_counter() - start
        executor_hidden = hidden.clone()
        executor_logits = self.model.logits(executor_hidden)

        if accepted is None:
            accepted = int(torch.randint(1, self.q + 1, (1,), generator=self.rng))
        self.next_token = stock_logits[accepted - 1 : accepted].argmax(-1)
        self.position = first + accepted
        return StepResult(
            first,
            tokens,
            stock_hidden,
            executor_hidden,
            stock_aux,
            [a.clone() for a in aux],
            stock_logits,
            executor_logits,
            stock_seconds,
            executor_seconds,
            accepted,
        )

    def _run_executor(self, host: HostStep) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # The providers' host work for this step (a library's plan), before any replay.
        self.executor.prepare_step(host)
        if self.graph is not None:
            self.graph.replay()
            assert self.outputs is not None
            return self.outputs
        step = self.executor.plan(self.positions)
        if step is None:
            raise RuntimeError("the executor declined a verify step (see the log for why)")
        if not self.use_graph:
            return self.executor.run(step, input_ids=self.tokens)
        # Warm up outside the capture (library handles, lazy inits), then capture once.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.executor.run(step, input_ids=self.tokens)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.executor.run(step, input_ids=self.tokens)
        self.graph.replay()
        return self.outputs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
