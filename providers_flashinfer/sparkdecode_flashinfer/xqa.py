"""``flashinfer.xqa``: the verify step's attention core on FlashInfer's XQA kernel.

FlashInfer 0.7.2's ``flashinfer.xqa.xqa`` (csrc/xqa/mha.cu, ``kernel_mha``; JIT by
``flashinfer.jit.xqa.gen_xqa_module``) runs on SM90 for bf16 Q and K/V (the generic
mma kernel; the Hopper GMMA kernel mha_sm90.cu serves fp8 K/V only), and in its
speculative mode (``q_seq_len > 1``) takes the step's q rows of one request with:

- a draft mask read from a device buffer (bit j of row i: row i sees draft token
  j); here the causal one, fixed at build;
- a sliding window applied per row (``IS_SPEC_DEC_TREE=0``): row r sits at
  ``seq_len - q_seq_len + r`` and sees keys from ``seq_len - q_seq_len + r -
  window + 1``, Muse Spark's window counting the query itself;
- the context length and the block table read from device buffers (``seq_lens``
  [1, 1], ``page_table`` [1, max_pages]), the grid fixed by their shapes, and a
  multi-block split whose semaphores reset themselves: nothing on the host per
  step, so it replays in a FULL graph;
- softmax scale ``q_scale / sqrt(d)``: ``q_scale = softmax_scale * sqrt(d)``.

Its numerics: scores and the online softmax in fp32, the probabilities rounded
to bf16 before the PV product (their row sum taken from the rounded values), the
output rounded to bf16 once.

One JIT module serves every layer: the sliding-window build, with a window past
any context on full layers (``seq_len > window`` never holds, so no key is
masked by it). Sliding layers read ``pages.VisiblePages`` (the block table cut at
the step's first visible page) so no released page is read.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sparkdecode.protocols import BuildContext, Deployment, LayerKV, Step

from .pages import VisiblePages, shared_groups
from .support import check_cache, contiguous_rows, flashinfer_unsupported

PAGE_SIZES = (16, 32, 64, 128)  # gen_xqa_module's TOKENS_PER_PAGE values
MAX_ROWS = 32  # one 32-bit mask word per row
# Multi-block scratch per partial result: a 32-row fp32 max and sum and a 32 x 64
# bf16 tile (4.25 KiB); launchMHAFlashInfer splits each KV head over at most
# SMs / KV heads CTAs, so a step has at most max(SMs, KV heads) x (32-row blocks)
# partials. Twice that, for the segments' alignment.
SCRATCH_PER_PARTIAL = 8 << 10
SEMAPHORES = 4096  # one per (KV head, 32-row block); they return to 0 after each launch


def causal_mask(rows: int) -> torch.Tensor:
    """XQA's packed draft mask, row i = bits 0..i (little-endian: the two uint16
    words of each row are one uint32)."""
    words = np.array([(1 << (i + 1)) - 1 for i in range(rows)], dtype=np.uint32)
    return torch.from_numpy(words.view(np.int32).copy())


class FlashInferXqa:
    """Sub-op ``attention_core`` on FlashInfer's XQA (speculative mode): q bf16
    [b, Hq, d] of one request's b consecutive positions ending at ``seq_lens - 1``."""

    block = "attention_core"
    name = "flashinfer.xqa"
    priority = 20

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        reason = flashinfer_unsupported(deployment)
        if reason is not None:
            return reason
        spec = deployment.spec
        if deployment.kv_block_size not in PAGE_SIZES:
            return f"KV block size {deployment.kv_block_size}: XQA takes pages of {PAGE_SIZES} tokens"
        if spec.head_dim % 16 or not 16 <= spec.head_dim <= 256:
            return f"head_dim {spec.head_dim}: XQA's speculative mode takes multiples of 16 up to 256"
        if deployment.max_rows > MAX_ROWS:
            return f"{deployment.max_rows} rows a step: the causal mask here holds {MAX_ROWS}"
        return None

    def __init__(self, ctx: BuildContext, layer: int):
        # ``flashinfer.xqa`` is also the name of the function the package exports.
        from flashinfer.xqa import get_xqa_module, xqa

        self.xqa = xqa
        spec = ctx.spec
        lw = ctx.layer(layer)
        self.index, self.window = layer, lw.window
        self.heads, self.kv_heads, self.head_dim = lw.num_heads, lw.num_kv_heads, spec.head_dim
        self.page_size = ctx.deployment.kv_block_size
        self.q_scale = spec.softmax_scale * math.sqrt(spec.head_dim)
        self.sm_count = torch.cuda.get_device_properties(ctx.device).multi_processor_count
        blocks = -(-ctx.max_rows * (self.heads // self.kv_heads) // 32)  # 32-row blocks per KV head
        partials = max(self.sm_count, self.kv_heads) * blocks
        self.scratch = ctx.scratch("flashinfer_xqa_scratch", (partials * SCRATCH_PER_PARTIAL,), torch.uint8)
        fresh = "flashinfer_xqa_semaphores" not in ctx.buffers
        self.semaphores = ctx.scratch("flashinfer_xqa_semaphores", (SEMAPHORES,), torch.int32)
        if fresh:
            self.semaphores.zero_()
        fresh = "flashinfer_xqa_mask" not in ctx.buffers
        self.mask = ctx.scratch("flashinfer_xqa_mask", (ctx.max_rows,), torch.int32)
        if fresh:
            self.mask.copy_(causal_mask(ctx.max_rows))
        self.q_rows = contiguous_rows(ctx, f"flashinfer_q_{self.heads}", self.heads)
        self.out_rows = contiguous_rows(ctx, f"flashinfer_out_{self.heads}", self.heads)
        # JIT-compile (or load) the module of this step shape now, not at the first run.
        get_xqa_module(
            torch.bfloat16,
            torch.bfloat16,
            self.page_size,
            self.head_dim,
            self.heads // self.kv_heads,
            True,
            torch.bfloat16,
            ctx.max_rows,
        )
        self.shared = shared_groups(ctx, self.name)
        self.shared.layers.add(layer)
        self.pages: VisiblePages | None = None
        self.owner = False

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> FlashInferXqa:
        assert layer is not None
        return cls(ctx, layer)

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        layer = kv[self.index]
        check_cache(self.name, self.index, layer, self.kv_heads, self.head_dim, self.page_size, self.window)
        self.pages, self.owner = None, False
        if self.window is not None:
            window = self.window
            self.pages = self.shared.group(layer, lambda: VisiblePages(layer.group, window, self.page_size))
            self.owner = self.shared.owner(kv, self.index) == self.index

    def run(self, step: Step, q: torch.Tensor, out: torch.Tensor) -> None:
        kv = step.kv[self.index]
        b = q.shape[0]
        if self.pages is not None:
            if self.owner:
                self.pages.update(b)
            table, seq_lens, window = self.pages.pages, self.pages.seq_lens, self.pages.window
        else:
            table, seq_lens = kv.group.block_table, kv.group.seq_lens.view(1, 1)
            window = table.shape[1] * self.page_size  # past any context: masks nothing
        if not q.is_contiguous():
            q = self.q_rows[:b].copy_(q)
        result = out if out.is_contiguous() else self.out_rows[:b]
        shape = (1, 1, b, self.heads, self.head_dim)  # [batch, beam, q_seq_len, Hq, d]
        self.xqa(
            q.view(shape),
            kv.k,
            kv.v,
            table,
            seq_lens,
            result.view(shape),
            self.scratch,
            self.semaphores,
            self.kv_heads,
            self.page_size,
            q_scale=self.q_scale,
            sliding_win_size=window,
            sm_count=self.sm_count,
            q_seq_len=b,
            mask=self.mask[:b],
        )
        if result is not out:
            out.copy_(result)
