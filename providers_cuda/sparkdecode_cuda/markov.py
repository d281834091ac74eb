"""The DSpark draft's Markov loop (``markov``): the LM head, then the 7 dependent
sampling steps, each one cuBLAS GEMV and one kernel (kernels/markov.cu).

Per draft step: the LM head of the 7 hidden rows (cuBLAS, the reference's own call),
the gather of the anchor's Markov embedding, then for each slot i the Markov bias
GEMV of the previous token's embedding (cuBLAS, again the reference's call on the
same shapes, so the bias is the reference's to the bit) and ``markov_sample_kernel``:
base + bias, the output transform and its bf16 rounding into the logits row, vLLM's
hashed Gumbel noise, the argmax (a last-block reduction over the grid), the
softmax statistics for the token's probability, and the next token's embedding row
for the next GEMV. 16 launches, no host work, capturable.

Against ``reference.markov``: the logits and tokens are equal to the bit (the same
fp32 operations in the same order and rounding, the same math library); the
probability's softmax sum runs in another order, so the probabilities agree within
the fp32 error of two sums of V terms (tests/test_gpu_cuda_markov.py states the
bound). At temperature 0 both are the greedy argmax and probability 1.
"""

from __future__ import annotations

import math

import torch

from sparkdecode.draft.protocols import DraftBuildContext, DraftStep, draft_of
from sparkdecode.protocols import Deployment, LayerKV

from .boundary import cuda_unsupported
from .launch import Kernel, f32, i32, ptr

SOURCE = "markov.cu"
THREADS = 256  # one block of 256 threads per ITEMS * 256 vocabulary ids
ITEMS = 4  # ids per thread: 198 blocks at V = 202048, more than the H200's 132 SMs
PER_BLOCK = THREADS * ITEMS
COMPILE_OPTIONS: tuple[str, ...] = ()  # FMA contraction stays on (as torch's math library is built); the
# kernel's own arithmetic is explicit _rn intrinsics, which are never contracted


def grid_blocks(vocab: int) -> int:
    return math.ceil(vocab / PER_BLOCK)


def defines() -> dict[str, int | str]:
    return {"THREADS": THREADS, "ITEMS": ITEMS}


def fp32_reciprocal(x: float) -> float:
    """``1 / x`` as torch computes it for a CPU-scalar divisor: fp32 division."""
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(x, dtype=torch.float32))


class CudaMarkov:
    block = "markov"
    name = "cuda.markov"
    priority = 10

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        reason = cuda_unsupported(deployment)
        if reason:
            return reason
        draft = draft_of(deployment)
        if draft is None:
            return "needs the draft's spec (a draft deployment)"
        if draft.draft_vocab_size >= 2**31 - PER_BLOCK:
            return f"draft vocabulary {draft.draft_vocab_size}: the kernel indexes ids in int32"
        return None

    def __init__(self, ctx: DraftBuildContext):
        spec, w = ctx.spec, ctx.weights
        self.vocab, self.rank, self.num_query = spec.draft_vocab_size, spec.markov_rank, ctx.num_query
        for name, t, rows in (
            ("lm_head", w.lm_head, self.vocab),
            ("markov_w1", w.markov_w1, spec.vocab_size),
            ("markov_w2", w.markov_w2, self.vocab),
        ):
            width = spec.hidden_size if name == "lm_head" else self.rank
            if t.dtype != torch.bfloat16 or not t.is_contiguous() or tuple(t.shape) != (rows, width):
                raise ValueError(
                    f"cuda.markov: {name} must be contiguous bf16 [{rows}, {width}], got {t.dtype} "
                    f"{tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}"
                )
        self.lm_head, self.w1, self.w2 = w.lm_head, w.markov_w1, w.markov_w2
        self.multiplier = spec.output_multiplier
        cap = spec.output_soft_cap_temp
        self.cap, self.inv_cap = (0.0, 0.0) if cap is None else (cap, fp32_reciprocal(cap))
        self.blocks = grid_blocks(self.vocab)
        n, v = self.num_query, self.vocab
        self.base = ctx.scratch("markov_base", (n, v), torch.bfloat16)
        self.bias = ctx.scratch("markov_bias", (1, v), torch.bfloat16)
        self.row = ctx.scratch("markov_row", (1, self.rank), torch.bfloat16)
        self.partials = ctx.scratch("markov_partials", (3, self.blocks), torch.float32)
        self.partial_ids = ctx.scratch("markov_partial_ids", (self.blocks,), torch.int32)
        # One ticket counter per slot, 0 between launches (each last block resets its own).
        self.counters = ctx.scratch("markov_counters", (n,), torch.int32)
        self.counters.zero_()
        self.kernel = Kernel(SOURCE, "markov_sample_kernel", ctx.device, defines(), COMPILE_OPTIONS)

    @classmethod
    def build(cls, ctx: DraftBuildContext, layer: int | None) -> CudaMarkov:
        return cls(ctx)

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        pass

    def run(
        self, step: DraftStep, hidden: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor
    ) -> None:
        n = step.num_query
        if n > self.num_query:
            raise ValueError(f"cuda.markov: {n} query rows, built for {self.num_query}")
        # The reference's calls: F.linear of 2-D bf16 operands is this mm.
        torch.mm(hidden[:n], self.lm_head.t(), out=self.base[:n])
        torch.index_select(self.w1, 0, step.anchor.reshape(1), out=self.row)
        key, mx, total = self.partials
        for i in range(n):
            torch.mm(self.row, self.w2.t(), out=self.bias)
            self.kernel.launch(
                (self.blocks, 1, 1),
                (THREADS, 1, 1),
                [
                    ptr(self.base[i]),
                    ptr(self.bias),
                    ptr(logits[i]),
                    ptr(step.seed),
                    ptr(step.positions[i]),
                    ptr(step.temperature),
                    i32(i),
                    i32(self.vocab),
                    f32(self.multiplier),
                    f32(self.inv_cap),
                    f32(self.cap),
                    ptr(tokens[i]),
                    ptr(probs[i]),
                    ptr(self.w1),
                    i32(self.rank),
                    ptr(self.row if i + 1 < n else None),
                    ptr(key),
                    ptr(self.partial_ids),
                    ptr(mx),
                    ptr(total),
                    ptr(self.counters[i]),
                ],
            )
