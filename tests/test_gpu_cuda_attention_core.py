"""cuda.attention_core on a Hopper GPU against the reference core (marker gpu):
tests/attention_check.py's checks (one graph over contexts, a sliding and a full
layer at a TP8 rank's and TP1's KV heads; the whole step with the core pinned, and
with cuda.attention pinned beside it, which runs the core's gated combine); the gated
combine against the core's output with the o-norm and gate applied after it; and a core
built for a long max context against one built for the context (the same bits).

The bound is attention_check's 1e-2; this core keeps the probabilities to about
2^-17 through the PV product, so its rows should differ from the reference's by the
output's bf16 rounding alone (a few 1e-3 at most): the largest error is printed.
"""

from __future__ import annotations

import pytest
import torch
from attention_check import (
    BLOCK_SIZE,
    MAX_CONTEXT,
    ROWS,
    PagedKVCache,
    check_core_over_contexts,
    check_executor_with_core,
    core_context,
    write_positions,
)

from sparkdecode.protocols import Step
from sparkdecode.spec import ModelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
    ),
]

from sparkdecode_cuda.attention_core import CudaAttentionCore, splits_for  # noqa: E402


@pytest.mark.parametrize("kv_heads", [2, 16])  # a TP8 rank's and TP1's heads (GQA 8)
def test_core_in_one_graph_over_contexts(kv_heads):
    check_core_over_contexts(CudaAttentionCore, kv_heads)


def _outputs_alike(pairs, spec, heads: int, kv_heads: int, rows: int, context: int) -> None:
    """Each pair of cores (one pair a layer) on the same cache, q and gate: run's and
    run_gated's outputs equal to the bit."""
    cache = PagedKVCache(spec, MAX_CONTEXT // BLOCK_SIZE + 2, MAX_CONTEXT, ROWS, "cuda", num_kv_heads=kv_heads)
    for pair in pairs:
        for c in pair:
            c.prepare_kv(cache.kv())
    g = torch.Generator(device="cuda").manual_seed(rows * 100003 + context)
    cache.begin_step(context - rows, rows)
    write_positions(cache, 0, context, g)
    positions = torch.arange(context - rows, context, device="cuda")
    step = Step(rows, rows, positions, cache.kv(), False)
    for first, second in pairs:
        q = torch.randn(rows, heads, 64, generator=g, device="cuda").to(torch.bfloat16)
        gate = torch.randn(rows, heads * 64, generator=g, device="cuda").to(torch.bfloat16)
        outs = []
        for c in (first, second):
            o = torch.full_like(q, float("nan"))
            gated = torch.full((rows, heads * 64), float("nan"), dtype=torch.bfloat16, device="cuda")
            c.run(step, q, o)
            c.run_gated(step, q, gate, spec.rms_norm_eps, gated)
            outs.append((o, gated))
        torch.cuda.synchronize()
        assert torch.isfinite(outs[0][0]).all() and torch.isfinite(outs[0][1]).all()
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("context", [9, 700, 2100, 4096, 9000])
@pytest.mark.parametrize("rows", [1, 8])
def test_a_long_build_runs_a_short_context_as_its_own_build(rows, context):
    """Built for a served max_model_len (a full layer's grid of 128 splits) and built for
    the context itself (the bench's build): the step's length sets the splits that take
    part, so the same bits from both, on a sliding and a full layer."""
    spec = ModelSpec.preset("muse-spark-open", 2)
    served, own = core_context(spec, 16, 2, MAX_CONTEXT), core_context(spec, 16, 2, context)
    pairs = [(CudaAttentionCore.build(served, layer), CudaAttentionCore.build(own, layer)) for layer in (0, 1)]
    assert pairs[1][0].splits == 128 and pairs[1][1].splits == splits_for(context)
    _outputs_alike(pairs, spec, 16, 2, rows, context)


def test_executor_with_cuda_core():
    check_executor_with_core(CudaAttentionCore)


def test_executor_with_cuda_attention_and_core():
    """cuda.attention with this core: the o-norm and gate in the core's combine."""
    check_executor_with_core(CudaAttentionCore, pins={"attention": "cuda.attention"})


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_gated_combine_is_the_core_then_the_gate(rows):
    """run_gated against run's bf16 output with the o-norm and gate applied in fp32 as the
    gate kernel applies them: a head's 64 squares summed in another order, so a value may
    move by one bf16 rounding; the gate read through a view of wider rows (as qkvg's)."""
    spec = ModelSpec.preset("muse-spark-open", 2)
    kv_heads, heads, context = 2, 16, 3000
    ctx = core_context(spec, heads, kv_heads, MAX_CONTEXT)
    cores = [CudaAttentionCore.build(ctx, layer) for layer in (0, 1)]
    cache = PagedKVCache(spec, MAX_CONTEXT // BLOCK_SIZE + 2, MAX_CONTEXT, ROWS, "cuda", num_kv_heads=kv_heads)
    for c in cores:
        c.prepare_kv(cache.kv())
    g = torch.Generator(device="cuda").manual_seed(rows)
    cache.begin_step(context - rows, rows)
    write_positions(cache, 0, context, g)
    positions = torch.arange(context - rows, context, device="cuda")
    step = Step(rows, rows, positions, cache.kv(), False)
    eps = spec.rms_norm_eps
    for c in cores:
        q = torch.randn(rows, heads, 64, generator=g, device="cuda").to(torch.bfloat16)
        wide = torch.randn(rows, 3 * heads * 64, generator=g, device="cuda").to(torch.bfloat16)
        gate = wide[:, heads * 64 : 2 * heads * 64]
        o = torch.full_like(q, float("nan"))
        out = torch.full((rows, heads * 64), float("nan"), dtype=torch.bfloat16, device="cuda")
        c.run(step, q, o)
        c.run_gated(step, q, gate, eps, out)
        torch.cuda.synchronize()
        of = o.float()
        inv = torch.rsqrt((of * of).sum(-1, keepdim=True) / 64 + eps)
        want = (of * inv * torch.sigmoid(gate.float().view(rows, heads, 64))).to(torch.bfloat16).view(rows, -1)
        assert torch.isfinite(out).all()
        diff = (out.float() - want.float()).abs()
        assert (diff <= want.float().abs() * 2**-7).all(), diff.max()
        assert (diff == 0).float().mean() > 0.99
