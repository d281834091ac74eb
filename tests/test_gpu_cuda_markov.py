"""cuda.markov (the draft's Markov loop: cuBLAS GEMVs and the sampling kernel) on a
Hopper GPU against reference.markov, and the draft executor with it pinned against
the reference draft step (marker gpu).

What must agree, and why:

- tokens: identical. The bias GEMV is the reference's own cuBLAS call and every
  other fp32 operation of a step (base + bias, the transform, the noise, the
  division by T, the noisy key) is the reference's in the same order and rounding,
  so the keys are the same bits and the argmax (ties: the lowest id) the same id.
- logits: equal to the bit (same reasoning).
- probabilities: q = exp(x_t - M - log S) with S = sum_v exp(x_v - M), x = l / T. The
  kernel sums S in another order (per block, then over blocks rescaled by
  exp(m_b - M)). A sum of positive terms through at most d additions has a relative
  error of at most d * u (u = 2^-24); torch's log_softmax adds each term through at
  most ceil(V / 128) + 16 additions (a block of at least 128 threads, each summing
  its share in sequence, then its trees), the kernel through at most
  ``KERNEL_DEPTH``. Each term's exponent is rounded at most twice more in the kernel
  (x - m_b, m_b - M) and its exp and the rescaling product add 3 ulps: at most
  2 * R * u + 3u relative per term, R the range of x. Then log S, the two
  subtractions and exp move q by at most (|log S| + R + 4) * u more. With
  |log S| <= log V + R: ``prob_bound`` = (ceil(V / 128) + 16 + KERNEL_DEPTH + 5 R +
  log V + 16) * u, about 1e-4 at V = 202048, T = 1. At T = 0 both are exactly 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparkdecode.draft import functional as dfn
from sparkdecode.draft.executor import DraftConfig, DraftDecode, draft_deployment
from sparkdecode.draft.harness import DraftHarness
from sparkdecode.draft.model import ReferenceDraft
from sparkdecode.draft.protocols import DraftBuildContext, DraftStep
from sparkdecode.draft.providers import ReferenceMarkov
from sparkdecode.draft.spec import DraftSpec
from sparkdecode.draft.weights import random_draft_weights
from sparkdecode.plugins import discover
from sparkdecode.spec import ModelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]

markov = pytest.importorskip("sparkdecode_cuda.markov")
from test_draft_gpu import target_stub  # noqa: E402

N = 7
U = 2.0**-24
# Additions a term of the kernel's sum passes: ITEMS in a thread, the warp tree (5),
# the warps in sequence, and the same again over the blocks' partials, plus the rescale.
KERNEL_DEPTH = markov.ITEMS + 2 * (5 + markov.THREADS // 32) + 2


def prob_bound(vocab: int, x_range: float, blocks: int) -> float:
    depth_ref = math.ceil(vocab / 128) + 16
    depth = KERNEL_DEPTH + math.ceil(blocks / markov.THREADS)
    return (depth_ref + depth + 5 * x_range + math.log(vocab) + 16) * U


@pytest.fixture(scope="module", params=["tiny", "real"])
def weights(request):
    if request.param == "tiny":
        target_spec = ModelSpec.preset("tiny")
        spec = DraftSpec.preset("tiny", target=target_spec)
    else:
        target_spec = ModelSpec.preset("muse-spark-open")
        spec = DraftSpec.preset("muse-spark-open", target=target_spec, num_layers=1)
    w = random_draft_weights(spec, target_stub(target_spec), seed=5)
    yield w
    del w
    torch.cuda.empty_cache()


def build_pair(weights):
    spec = weights.spec
    deployment = draft_deployment(spec, weights.target_spec, "cuda", DraftConfig())

    def ctx() -> DraftBuildContext:
        return DraftBuildContext(spec, weights, torch.device("cuda"), deployment, {}, 8, N, 4096)

    assert markov.CudaMarkov.unsupported(deployment) is None
    return ReferenceMarkov.build(ctx(), None), markov.CudaMarkov.build(ctx(), None)


class Inputs:
    """A step's device buffers (what a graph replays over) and its outputs."""

    def __init__(self, weights):
        spec, dev = weights.spec, "cuda"
        self.hidden = torch.zeros(N, spec.hidden_size, dtype=torch.bfloat16, device=dev)
        self.anchor = torch.zeros(1, dtype=torch.int64, device=dev)
        self.seed = torch.zeros(1, dtype=torch.int64, device=dev)
        self.temperature = torch.ones(1, dtype=torch.float32, device=dev)
        self.positions = torch.zeros(N, dtype=torch.int64, device=dev)
        self.step = DraftStep(
            8, N, torch.zeros(8, dtype=torch.int64, device=dev), self.positions, (), self.anchor, self.seed,
            self.temperature,
        )  # fmt: skip

    def set(self, g: torch.Generator, vocab: int, temperature: float, seed: int | None = None) -> None:
        self.hidden.copy_(torch.randn(self.hidden.shape, generator=g))
        self.anchor.fill_(int(torch.randint(0, vocab, (1,), generator=g)))
        self.seed.fill_(seed if seed is not None else int(torch.randint(-(2**62), 2**62, (1,), generator=g)))
        self.temperature.fill_(temperature)
        first = int(torch.randint(1, 30000, (1,), generator=g))
        self.positions.copy_(torch.arange(first, first + N))


def outputs(weights):
    v = weights.spec.draft_vocab_size
    return (
        torch.full((N,), -1, dtype=torch.int64, device="cuda"),
        torch.full((N, v), float("nan"), dtype=torch.bfloat16, device="cuda"),
        torch.full((N,), float("nan"), dtype=torch.float32, device="cuda"),
    )


def run(provider, inputs: Inputs, out) -> tuple[torch.Tensor, ...]:
    provider.run(inputs.step, inputs.hidden, *out)
    torch.cuda.synchronize()
    return tuple(t.clone() for t in out)


def compare(ref, got, temperature: float, blocks: int) -> None:
    tokens, logits, probs = got
    assert torch.equal(ref[0], tokens), (ref[0], tokens)
    assert torch.equal(ref[1], logits), (ref[1].float() - logits.float()).abs().max()
    if temperature == 0:
        assert torch.equal(probs, torch.ones_like(probs)) and torch.equal(ref[2], probs)
        return
    x = ref[1].float() / temperature
    x_range = (x.amax(-1) - x.amin(-1)).max().item()
    rel = ((probs - ref[2]).abs() / ref[2]).max().item()
    assert rel <= prob_bound(logits.shape[-1], x_range, blocks), (rel, ref[2], probs)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_markov_equals_reference(weights, temperature, seed):
    reference, cuda = build_pair(weights)
    inputs = Inputs(weights)
    inputs.set(torch.Generator().manual_seed(seed), weights.spec.vocab_size, temperature)
    ref = run(reference, inputs, outputs(weights))
    compare(ref, run(cuda, inputs, outputs(weights)), temperature, cuda.blocks)
    # Deterministic: the same bits again.
    again = run(cuda, inputs, outputs(weights))
    assert all(torch.equal(a, b) for a, b in zip(again, run(cuda, inputs, outputs(weights))))


@pytest.mark.parametrize("temperature", [0.0, 0.25])
def test_markov_exact_and_near_ties(weights, temperature):
    """Per slot i, two ids a < b get the same logit, far above the rest (hidden row i
    one-hot at column i, the LM head's column i set, their Markov projection rows
    zeroed), chosen as the pair whose Gumbel noise is nearest (equal at the real
    vocabulary, where such pairs exist): at T = 0 an exact tie of the logits, at
    T = 0.25 keys 64 + g that tie exactly or within an ulp. Both must pick the same,
    at T = 0 (and on an exact key tie) the lower id."""
    spec = weights.spec
    v, m = spec.draft_vocab_size, spec.output_multiplier
    lm_head, w2 = weights.lm_head, weights.markov_w2
    saved = lm_head[:, :N].clone(), w2.clone()
    try:
        inputs = Inputs(weights)
        inputs.set(torch.Generator().manual_seed(7), spec.vocab_size, temperature)
        inputs.hidden.zero_()
        inputs.hidden[:, :N] = torch.eye(N, dtype=torch.bfloat16, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(3)
        lm_head[:, :N] = (torch.randn(v, N, generator=g, device="cuda") / m).to(torch.bfloat16)
        offsets = torch.arange(v, device="cuda")
        pairs, tied = [], []
        for i in range(N):
            noise = dfn.gumbel_noise(inputs.seed, i, inputs.positions[i : i + 1], offsets)
            order = noise.argsort()
            gaps = noise[order[1:]] - noise[order[:-1]]
            j = int(gaps.argmin())
            a, b = sorted((int(order[j]), int(order[j + 1])))
            tied.append(bool(noise[a] == noise[b]))
            pairs.append((a, b))
            # 20 * tanh(atanh(0.8)) = 16: l = 16 (T = 0.25: l / T = 64), the rest below 11.
            lm_head[[a, b], i] = torch.tensor(20.0 * math.atanh(0.8) / m, dtype=torch.bfloat16, device="cuda")
            w2[[a, b]] = 0
        reference, cuda = build_pair(weights)
        ref = run(reference, inputs, outputs(weights))
        got = run(cuda, inputs, outputs(weights))
        compare(ref, got, temperature, cuda.blocks)
        for i in range(N):
            expected = pairs[i][:1] if temperature == 0 or tied[i] else pairs[i]  # an exact tie: the lower id
            assert int(got[0][i]) in expected, (i, got[0], pairs)
        print(f"V {v}: {sum(tied)} of {N} slots with an exact noise tie; tokens {got[0].tolist()}, pairs {pairs}")
    finally:
        lm_head[:, :N] = saved[0]
        w2.copy_(saved[1])


def test_markov_in_a_replayed_graph(weights):
    """One graph captured once, replayed over new hidden rows, anchors, seeds,
    positions and temperatures: each replay equals the reference on the same inputs."""
    reference, cuda = build_pair(weights)
    inputs, out = Inputs(weights), outputs(weights)
    g = torch.Generator().manual_seed(11)
    inputs.set(g, weights.spec.vocab_size, 1.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuda.run(inputs.step, inputs.hidden, *out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda.run(inputs.step, inputs.hidden, *out)
    for r, temperature in enumerate([1.0, 0.5, 0.0, 1.3, 1.0, 0.0, 0.8]):
        inputs.set(g, weights.spec.vocab_size, temperature, seed=r if r % 2 else None)
        graph.replay()
        torch.cuda.synchronize()
        got = tuple(t.clone() for t in out)
        compare(run(reference, inputs, outputs(weights)), got, temperature, cuda.blocks)


@pytest.mark.parametrize("graph", [False, True])
def test_draft_executor_with_cuda_markov(weights, graph):
    """The draft executor with cuda.markov pinned (every other block the reference's)
    over draft / verify rounds against the reference draft step."""
    real = weights.spec.draft_vocab_size > 100000
    max_context, prompt_len, rounds = (8192, 3000, 6) if real else (1024, 70, 12)
    executor = DraftDecode(
        weights, DraftConfig(max_context=max_context, pins={"markov": "cuda.markov"}), registry=discover()
    )
    assert executor.layout.choices["markov"].chosen.name == "cuda.markov"
    harness = DraftHarness(ReferenceDraft(weights, max_context), executor, max_prompt=prompt_len, graph=graph)
    prompt = torch.randint(0, weights.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    harness.prefill(prompt.cuda())
    blocks = markov.grid_blocks(weights.spec.draft_vocab_size)
    for _ in range(rounds):
        result = harness.step()
        assert result.executor is not None
        compare(tuple(result.reference), tuple(result.executor), 1.0, blocks)
        harness.verify(result)
