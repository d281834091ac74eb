"""``flashinfer.fa2`` (and the candidate ``flashinfer.fa3``): the verify step's
attention core on FlashInfer's paged prefill (``BatchPrefillWithPagedKVCacheWrapper``,
backend fa2, or fa3 on the Hopper kernels; CUDA-graph mode).

The wrapper splits host planning from the kernel: ``plan`` takes the step's
lengths on the host (query and page index pointers, the last page's fill) and
schedules the work (fa2: split-KV) into its int workspace; the kernel then reads every
length and page from device buffers, so a graph captured once replays after a
new plan. That plan is host work before every step: ``prepare_step`` (the
executor's hook, called outside the graph), by the lowest layer of each KV-cache
group for the whole group (one plan per group and step, as vLLM plans).

The page indices the kernel reads: a full group's block table row itself; a
sliding group's ``pages.VisiblePages`` (cut at the step's first visible page in
the graph, by the same lowest layer; the host plan counts the same pages with
``first_visible_page``). Causal, the window as ``window_left = window - 1``;
full layers run the same sliding-window module with a window past any context
(one JIT module rather than two, no key masked by it). Scores and softmax in
fp32, probabilities rounded to bf16 before the PV product, output bf16.
"""

from __future__ import annotations

import math

import torch

from sparkdecode.protocols import BuildContext, Deployment, HostStep, LayerKV, Step

from .pages import VisiblePages, first_visible_page, shared_groups
from .support import check_cache, contiguous_rows, flashinfer_unsupported

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-KV float workspace (shared by all layers)
HEAD_DIMS = (64, 128, 256)  # the prefill kernels' instantiated head dims (fa2 and fa3, QK = VO)


def jit_args(head_dim: int) -> tuple:
    """``get_batch_prefill_module``'s arguments after the backend, as ``plan`` derives
    them from its call: bf16 q, K/V and output, int32 indices, ``head_dim`` for QK and
    VO, no position encoding in the kernel, the sliding-window build (``window_left``
    >= 0 on every layer), no logits cap, no fp16 QK reduction."""
    bf16 = torch.bfloat16
    return (bf16, bf16, bf16, torch.int32, head_dim, head_dim, 0, True, False, False)


def module_name(backend: str, head_dim: int) -> str:
    """The JIT module (its folder and ``.so`` name) FlashInfer 0.7.2 builds for
    ``jit_args(head_dim)``: ``get_batch_prefill_uri``, fa2's primary module with its
    equal-K/V-stride suffix, fa3's with ``_sm90``."""
    suffix = {"fa2": "_kv_stride_equal", "fa3": "_sm90"}[backend]
    return (
        f"batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_"
        f"head_dim_qk_{head_dim}_head_dim_vo_{head_dim}_posenc_0_use_swa_True_use_logits_cap_False_f16qk_False{suffix}"
    )


class MissingPlanError(RuntimeError):
    """The wrapper ran without a plan for this step (``prepare_step`` not called)."""


class _PrefillGroup:
    """One KV-cache group's wrapper and its plan, shared by the group's layers."""

    def __init__(self, core: FlashInferPrefill, kv: LayerKV, workspace: torch.Tensor):
        import flashinfer

        self.window, self.page_size = kv.window, core.page_size
        table = kv.group.block_table
        self.max_pages = table.shape[1]
        self.pages = None if kv.window is None else VisiblePages(kv.group, kv.window, core.page_size)
        indices = table[0] if self.pages is None else self.pages.pages[0]
        i32 = dict(dtype=torch.int32, device=table.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(2, **i32),
            paged_kv_indptr_buf=torch.zeros(2, **i32),
            paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=torch.zeros(1, **i32),
            backend=core.backend,
        )
        self.no_indices = torch.zeros(0, **i32)  # the kernel reads ``indices`` in place
        self.heads, self.kv_heads, self.head_dim = core.heads, core.kv_heads, core.head_dim
        self.scale = core.scale
        self.planned: HostStep | None = None

    def plan(self, host: HostStep) -> None:
        first = (
            0 if self.window is None else first_visible_page(host.context_len, host.rows, self.window, self.page_size)
        )
        kv_len = host.context_len - first * self.page_size
        pages = math.ceil(kv_len / self.page_size)
        window_left = self.max_pages * self.page_size if self.window is None else self.window - 1
        self.wrapper.plan(
            torch.tensor([0, host.rows], dtype=torch.int32),
            torch.tensor([0, pages], dtype=torch.int32),
            self.no_indices,
            torch.tensor([kv_len - (pages - 1) * self.page_size], dtype=torch.int32),
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.page_size,
            causal=True,
            sm_scale=self.scale,
            window_left=window_left,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
            o_data_type=torch.bfloat16,
            uniform_q_len=host.rows,
        )
        self.planned = host


class FlashInferPrefill:
    """Sub-op ``attention_core`` on FlashInfer's fa2 paged prefill, planned on the
    host before every step (``prepare_step``)."""

    block = "attention_core"
    name = "flashinfer.fa2"
    # Above xqa (20) and fa3: the pack's fastest core in the H200's 62-layer step.
    priority = 30
    backend = "fa2"

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        reason = flashinfer_unsupported(deployment)
        if reason is None and deployment.spec.head_dim not in HEAD_DIMS:
            reason = f"head_dim {deployment.spec.head_dim}: the prefill kernels take {HEAD_DIMS}"
        if reason is None and not deployment.host_lengths_exact:
            reason = (
                "plans each step on the host from its context length, which the host knows only as an upper "
                "bound here (vLLM's asynchronous scheduling); to use it, serve with --no-async-scheduling or "
                'have the lengths read off the device before each step (additional_config "decode_lengths": "sync")'
            )
        return reason

    def __init__(self, ctx: BuildContext, layer: int):
        from flashinfer.prefill import get_batch_prefill_module

        spec = ctx.spec
        lw = ctx.layer(layer)
        self.index, self.window = layer, lw.window
        self.heads, self.kv_heads, self.head_dim = lw.num_heads, lw.num_kv_heads, spec.head_dim
        self.page_size = ctx.deployment.kv_block_size
        self.scale = spec.softmax_scale
        self.workspace = ctx.scratch("flashinfer_prefill_workspace", (WORKSPACE_BYTES,), torch.uint8)
        self.q_rows = contiguous_rows(ctx, f"flashinfer_q_{self.heads}", self.heads)
        self.out_rows = contiguous_rows(ctx, f"flashinfer_out_{self.heads}", self.heads)
        # JIT-compile (or load) the module now, not at the first plan.
        get_batch_prefill_module(self.backend, *jit_args(self.head_dim))
        self.shared = shared_groups(ctx, self.name)
        self.shared.layers.add(layer)
        self.group: _PrefillGroup | None = None
        self.owner = False

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> FlashInferPrefill:
        assert layer is not None
        return cls(ctx, layer)

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        layer = kv[self.index]
        check_cache(self.name, self.index, layer, self.kv_heads, self.head_dim, self.page_size, self.window)
        self.group = self.shared.group(layer, lambda: _PrefillGroup(self, layer, self.workspace))
        self.owner = self.shared.owner(kv, self.index) == self.index

    def prepare_step(self, host: HostStep) -> None:
        """Plan the group's wrapper for this step (its lowest layer does, for all)."""
        if self.owner and self.group is not None:
            self.group.plan(host)

    def run(self, step: Step, q: torch.Tensor, out: torch.Tensor) -> None:
        group = self.group
        assert group is not None, "prepare_kv first"
        b = q.shape[0]
        if group.planned is None or group.planned.rows != b:
            raise MissingPlanError(
                f"{self.name} runs a step of {b} rows planned for none: call prepare_step(host) first"
            )
        if group.pages is not None and self.owner:
            group.pages.update(b)
        kv = step.kv[self.index]
        if not q.is_contiguous():
            q = self.q_rows[:b].copy_(q)
        result = out if out.is_contiguous() else self.out_rows[:b]
        group.wrapper.run(q, (kv.k, kv.v), out=result)
        if result is not out:
            out.copy_(result)


class FlashInferFa3(FlashInferPrefill):
    """``flashinfer.fa3``: the same paged prefill on the Hopper (SM90) kernels, backend
    fa3. Its plan schedules whole query tiles (192 rows at head_dim 64) per query
    head with no split-KV, each CTA walking the step's whole visible context; the
    kernel reads the page indices in place, as fa2's does."""

    name = "flashinfer.fa3"
    priority = 10
    backend = "fa3"
