"""The draft step on a CUDA GPU: the executor (whatever providers the resolver
picks: the reference, or a pack's where installed and faster) against the
reference draft step, eagerly and in one CUDA graph replayed over steps whose
buffers change; at the tiny widths and at the real ones. Skipped without a GPU.

Bounds. With the same random numbers (vLLM's hash of seed, step and position) the
tokens must be identical. The reference providers run the reference's own torch
ops over the same row counts (the harness stores the reference's context rows over
the executor's padded layout of 8 rows too: a row's bf16 K/V can round differently
in a GEMM or a row reduction over another number of rows, as cuBLAS and torch pick
their kernels and splits by the row count), so they must match it bit for bit.
cuda.markov alone keeps the logits bit-equal and the probabilities within 2e-4
(tests/test_gpu_cuda_markov.py). A pack's layer kernels compute the same bf16 GEMMs
and norms in another accumulation order, so the bf16 hidden states and logits may
land one rounding apart: logits within two bf16 ulps plus 1/32, the probabilities
(softmax of logits / T, T = 1) within 10% relative, which is what a logit error of
that size moves them by at most.
"""

from __future__ import annotations

import pytest
import torch

from sparkdecode.draft.executor import DraftConfig, DraftDecode
from sparkdecode.draft.floor import draft_step_bytes
from sparkdecode.draft.harness import DraftHarness
from sparkdecode.draft.model import ReferenceDraft
from sparkdecode.draft.spec import DraftSpec
from sparkdecode.draft.weights import random_draft_weights
from sparkdecode.plugins import discover
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import ModelWeights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def target_stub(spec: ModelSpec, seed: int = 0) -> ModelWeights:
    """The target tensors a draft reads (embedding, LM head) on the GPU, no layers."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    embed = torch.empty(spec.vocab_size, spec.hidden_size, dtype=torch.bfloat16, device="cuda")
    lm_head = torch.empty_like(embed)
    for rows in range(0, spec.vocab_size, 16384):  # no full-size fp32 temporary
        part = slice(rows, rows + 16384)
        embed[part] = torch.randn(embed[part].shape, generator=g, device="cuda")
        lm_head[part] = torch.randn(lm_head[part].shape, generator=g, device="cuda") * spec.hidden_size**-0.5
    return ModelWeights(
        spec=spec,
        embed=embed,
        layers=[],
        final_norm=torch.ones(spec.hidden_size, dtype=torch.bfloat16, device="cuda"),
        lm_head=lm_head,
    )


def run_rounds(weights, max_context: int, prompt_len: int, rounds: int, graph: bool, seed: int = 0):
    executor = DraftDecode(weights, DraftConfig(max_context=max_context), registry=discover())
    harness = DraftHarness(
        ReferenceDraft(weights, max_context), executor, max_prompt=prompt_len, seed=seed, graph=graph
    )
    prompt = torch.randint(0, weights.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    harness.prefill(prompt.cuda())
    # "all": every block the reference's; "layers": all but the Markov loop; "": a pack's layers.
    packs = {kind: c.chosen.pack for kind, c in executor.layout.choices.items()}
    layers = all(p == "reference" for kind, p in packs.items() if kind != "markov")
    reference_only = ("all" if packs["markov"] == "reference" else "layers") if layers else ""
    results = []
    for _ in range(rounds):
        result = harness.step()
        results.append(result)
        harness.verify(result)
    return executor, harness, results, reference_only


def check(result, reference_only: str) -> None:
    assert result.tokens_agree, (result.reference.tokens, result.executor.tokens)
    assert torch.isfinite(result.executor.logits.float()).all()
    if reference_only:
        assert torch.equal(result.reference.logits, result.executor.logits)
        if reference_only == "all":
            assert torch.equal(result.reference.probs, result.executor.probs)
        else:
            assert result.probs_rel_diff <= 2e-4  # test_gpu_cuda_markov.prob_bound: 1.1e-4 at V = 202048
        return
    ref, ex = result.reference.logits.float(), result.executor.logits.float()
    ulp = ref.abs().clamp_min(2.0**-126) * 2.0**-7
    assert ((ref - ex).abs() <= 2 * ulp + 1 / 32).all(), result.logits_diff
    assert result.probs_rel_diff <= 0.1


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("prompt_len", [5, 70])
def test_tiny_draft_step_on_gpu(graph, prompt_len):
    """One graph captured at the first step and replayed over 16 steps that grow the
    context by 1..8 rows, cross pages and the sliding layer's window."""
    target = target_stub(ModelSpec.preset("tiny"))
    weights = random_draft_weights(DraftSpec.preset("tiny"), target, seed=1)
    executor, harness, results, reference_only = run_rounds(weights, 1024, prompt_len, 16, graph)
    for result in results:
        check(result, reference_only)
    assert harness.reference_cache.positions[0].item() >= prompt_len + 15
    if graph:
        assert harness.graph is not None


@pytest.mark.parametrize("layers", [1, 2])
def test_real_width_draft_step_on_gpu(layers):
    """The draft at the widths vLLM's code implies (H 8192, 128 / 16 heads of 64,
    MLP 8192, Markov rank 256, vocabulary 202048, sliding window 2048) with one or
    two layers, a 3000-token prompt (the window is full), in a CUDA graph."""
    target_spec = ModelSpec.preset("muse-spark-open")
    target = target_stub(target_spec)
    spec = DraftSpec.preset("muse-spark-open", target=target_spec, num_layers=layers)
    weights = random_draft_weights(spec, target, seed=2)
    assert weights.lm_head is target.lm_head
    executor, harness, results, reference_only = run_rounds(weights, 8192, 3000, 6, graph=True)
    for result in results:
        check(result, reference_only)
    # The floor of this step, for the record: the LM head alone is 3.3 GB.
    assert draft_step_bytes(weights, 3008) > target.lm_head.numel() * 2
    print(executor.layout.table())


@pytest.mark.parametrize("context", [4096, 32768])
def test_real_width_draft_step_time_and_floor(context):
    """The whole real-width draft (5 layers) timed in a CUDA graph against its floor;
    with SPARKDECODE_DRAFT_RECORD set to a directory (bench/results), the record is
    written there."""
    import os
    from pathlib import Path

    from sparkdecode.bench.report import write
    from sparkdecode.draft.bench import bench_draft_step

    target_spec = ModelSpec.preset("muse-spark-open")
    weights = random_draft_weights(DraftSpec.preset("muse-spark-open"), target_stub(target_spec), seed=3)
    out = os.environ.get("SPARKDECODE_DRAFT_RECORD")
    command = f"SPARKDECODE_DRAFT_RECORD={out} python -m pytest -m gpu tests/test_draft_gpu.py -k 'time_and_floor and {context}'"
    record = bench_draft_step(
        weights, context, name=f"draft-real-L5-ctx{context}", registry=discover(), command=command
    )
    assert record["graph"] and 0 < record["floor"]["fraction"] <= 1.0
    print(record["step"], record["floor"]["seconds"], record["floor"]["fraction"], record["layout"])
    if out:
        print(write(record, Path(out)))
