"""The executor with the reference providers against the stock forward, bit for bit.

One definition of each formula serves both sides (reference.functional and the
block functions of reference.model), so any difference is the executor's: its
buffers, mailboxes, metadata, aux streams or the order it runs the blocks in.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from sparkdecode import executor as executor_module
from sparkdecode.deployment import DeploymentError
from sparkdecode.executor import DecodeConfig, SpecializedDecode, _measurement_kv, measured_layers
from sparkdecode.harness import DecodeHarness
from sparkdecode.reference import functional as fn
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import random_weights

MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return ModelSpec.preset("tiny")


@pytest.fixture(scope="module")
def weights(spec: ModelSpec):
    return random_weights(spec, seed=11)


def make_harness(weights, aux_layers=(0, 2, 4), prompt_len=40, seed=0) -> DecodeHarness:
    config = DecodeConfig(max_context=MAX_CONTEXT, aux_layers=aux_layers)
    executor = SpecializedDecode(weights, config)
    harness = DecodeHarness(ReferenceModel(weights, MAX_CONTEXT), executor, max_prompt=prompt_len, seed=seed)
    prompt = torch.randint(0, weights.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    harness.prefill(prompt)
    return harness


def assert_same(result) -> None:
    assert torch.equal(result.stock_hidden, result.executor_hidden)
    assert torch.equal(result.stock_logits, result.executor_logits)
    assert len(result.stock_aux) == len(result.executor_aux)
    for a, b in zip(result.stock_aux, result.executor_aux):
        assert torch.equal(a, b)
    assert torch.isfinite(result.stock_hidden.float()).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prompt_len", [5, 40, 70, 130])
def test_bitwise_equal_to_stock(spec, seed, prompt_len):
    """Contexts below and above the window (64), steps crossing page (16) and window
    edges with random acceptance, released pages and the null page poisoned."""
    weights = random_weights(spec, seed=100 + seed)
    harness = make_harness(weights, prompt_len=prompt_len, seed=seed)
    crossed_page = False
    for _ in range(6):
        before = harness.position
        assert_same(harness.verify())
        crossed_page |= before // 16 != (before + 7) // 16
    assert crossed_page


def test_greedy_tokens_agree_over_32_steps(weights):
    harness = make_harness(weights, prompt_len=60, seed=5)
    for _ in range(32):
        result = harness.verify()
        assert result.greedy_agree
        assert torch.equal(result.stock_logits, result.executor_logits)
    assert harness.position > 60 + 32  # contexts grew past the window and across pages


def test_aux_streams_are_the_stream_entering_each_aux_layer(weights, spec):
    """Aux layer 0 is the embedding stream, L the final stream (vLLM's convention)."""
    harness = make_harness(weights, aux_layers=(0, 1, 3, spec.num_layers), prompt_len=20)
    result = harness.verify()
    assert len(result.executor_aux) == 4
    embedded = weights.embed.index_select(0, result.tokens)
    assert torch.equal(result.executor_aux[0], fn.embed_norm(embedded, spec.rms_norm_eps))
    assert_same(result)


def test_normed_embeddings_path(weights, spec):
    """The multimodal path passes bf16 normed embeddings: the stream starts as fp32 of them."""
    harness = make_harness(weights, aux_layers=(0,), prompt_len=24)
    tokens = torch.randint(0, spec.vocab_size, (8,), generator=torch.Generator().manual_seed(3))
    embeds = fn.embed_norm(weights.embed.index_select(0, tokens), spec.rms_norm_eps).to(torch.bfloat16)
    first = harness.position
    stock_cache, exec_cache = harness.stock_cache, harness.executor_cache
    stock_cache.begin_step(first, 8)
    positions = torch.arange(first, first + 8)
    stock_hidden, stock_aux = harness.model.forward(embeds, positions, stock_cache.kv(), (0,), normed=True)
    exec_cache.begin_step(first, 8)
    step = harness.executor.plan(positions, normed_embeddings=True)
    hidden, aux = harness.executor.run(step, inputs_embeds=embeds)
    assert torch.equal(stock_hidden, hidden)
    assert torch.equal(stock_aux[0], aux[0])
    assert torch.equal(aux[0], embeds.float())


def test_plan_gates_log_each_outcome_once(weights, caplog):
    executor = SpecializedDecode(weights, DecodeConfig(max_context=MAX_CONTEXT))
    caplog.set_level(logging.INFO, logger="sparkdecode.executor")
    assert executor.plan(torch.arange(8)) is None  # nothing bound yet
    harness = DecodeHarness(ReferenceModel(weights, MAX_CONTEXT), executor, max_prompt=16)
    harness.prefill(torch.arange(16))
    assert executor.plan(torch.arange(16, 20)) is None  # 4 rows: not one request of 8
    assert executor.plan(torch.arange(16, 24, dtype=torch.int32)) is None
    other = harness.stock_cache.kv()
    assert executor.plan(torch.arange(16, 24), other) is None  # another cache
    assert executor.plan(torch.arange(16, 24)) is not None
    assert executor.plan(torch.arange(16, 24)) is not None
    messages = [r.getMessage() for r in caplog.records]
    for text in (
        "no KV cache bound",
        "not one request verifying 8 tokens",
        "positions not int64",
        "other than the bound one",
        "specialized decode",
    ):
        assert sum(text in m for m in messages) == 1, text


def test_bad_config_and_unsupported_deployment(weights):
    with pytest.raises(ValueError, match="aux layers"):
        SpecializedDecode(weights, DecodeConfig(aux_layers=(99,)))
    with pytest.raises(ValueError, match="q = 9"):
        SpecializedDecode(weights, DecodeConfig(q=9, max_rows=8))
    with pytest.raises(DeploymentError, match="max context"):
        SpecializedDecode(weights, DecodeConfig(max_context=10**6))
    with pytest.raises(DeploymentError, match="no installed pack provides"):
        SpecializedDecode(weights, DecodeConfig(max_context=MAX_CONTEXT, pins={"moe": "nosuch.moe"}))


def test_executor_uses_the_weights_in_place(weights):
    executor = SpecializedDecode(weights, DecodeConfig(max_context=MAX_CONTEXT))
    layer = executor.layers[1].attention.layer
    assert layer.qkvg.data_ptr() == weights.layers[1].qkvg.data_ptr()
    assert executor.layers[2].moe.experts.experts.w13.data_ptr() == weights.layers[2].experts.w13.data_ptr()


def test_each_attention_boundary_meets_its_layers_attention(weights):
    """An attention boundary with ``pair_attention`` is handed its own layer's attention
    block once both are built (every layer, in layer order); one without the hook is
    left alone (the reference's)."""
    from sparkdecode.plugins import Registered, Registry
    from sparkdecode.reference.providers import PROVIDERS, ReferenceAttentionBoundary

    class PairingBoundary(ReferenceAttentionBoundary):
        name = "test.pairing_boundary"
        priority = 5
        met: list[tuple[int, object]] = []

        @classmethod
        def build(cls, ctx, layer):
            built = super().build(ctx, layer)
            built.index = layer
            return built

        def pair_attention(self, attention: object) -> None:
            PairingBoundary.met.append((self.index, attention))

    registry = Registry(
        [Registered(c, "reference", "sparkdecode", "0") for c in PROVIDERS]
        + [Registered(PairingBoundary, "test", "dist-test", "1.0")]
    )
    executor = SpecializedDecode(weights, DecodeConfig(max_context=MAX_CONTEXT), registry=registry)
    assert executor.layout.choices["attention_boundary"].chosen.name == "test.pairing_boundary"
    assert PairingBoundary.met == [(i, layer.attention) for i, layer in enumerate(executor.layers)]


def test_each_boundary_meets_the_moe_that_publishes_into_its_mailbox(weights):
    """A boundary (input or final) with ``pair_producer`` is handed the MoE block that
    publishes into its mailbox and runs right before it: layer l's boundary layer
    l - 1's MoE, the final boundary the last layer's; layer 0's front none."""
    from sparkdecode.plugins import Registered, Registry
    from sparkdecode.reference.providers import PROVIDERS, ReferenceBoundary, ReferenceFinal

    met: list[tuple[object, object]] = []

    class PairingBoundary(ReferenceBoundary):
        name = "test.pairing_input_boundary"
        priority = 5

        @classmethod
        def build(cls, ctx, layer):
            built = super().build(ctx, layer)
            built.index = layer
            return built

        def pair_producer(self, moe: object) -> None:
            met.append((self.index, moe))

    class PairingFinal(ReferenceFinal):
        name = "test.pairing_final"
        priority = 5

        def pair_producer(self, moe: object) -> None:
            met.append(("final", moe))

    registry = Registry(
        [Registered(c, "reference", "sparkdecode", "0") for c in PROVIDERS]
        + [Registered(c, "test", "dist-test", "1.0") for c in (PairingBoundary, PairingFinal)]
    )
    executor = SpecializedDecode(weights, DecodeConfig(max_context=MAX_CONTEXT), registry=registry)
    assert executor.layout.choices["boundary"].chosen.name == "test.pairing_input_boundary"
    assert executor.layout.choices["final"].chosen.name == "test.pairing_final"
    layers = executor.layers
    expected = [(i, layers[i - 1].moe) for i in range(1, len(layers))] + [("final", layers[-1].moe)]
    assert met == expected


def test_measured_layers_are_four_periods_of_the_pattern() -> None:
    """The resolver times candidates over the first sixteen layers: four periods of
    one full-attention layer (l % 4 == 1) and three sliding ones, as the model has
    them; fewer where the model has fewer."""
    assert measured_layers(62) == tuple(range(16))
    assert measured_layers(2) == (0, 1)
    assert measured_layers(1) == (0,)
    spec = ModelSpec.preset("tiny")
    full = [i for i in measured_layers(spec.num_layers) if spec.window(i) is None]
    assert full == [1]
    assert [i for i in measured_layers(62) if i % 4 == 1] == [1, 5, 9, 13]


def test_measurement_kv_gives_each_timed_layer_its_own_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measurement cache: each timed layer its own entry at its window (the
    longest context, every page mapped), the untimed layers aliasing the first."""
    monkeypatch.setattr(executor_module, "MEASURE_LAYERS", 2)  # tiny has 4 layers: leave two untimed
    spec = ModelSpec.preset("tiny")
    weights = random_weights(spec)
    indices = measured_layers(spec.num_layers)
    kv = _measurement_kv(weights, indices, 256, 8, torch.device("cpu"))
    assert len(kv) == spec.num_layers
    for i in indices:
        assert kv[i].window == spec.window(i)
        assert kv[i].k.shape == (256 // 16 + 1, 16, weights.layers[i].num_kv_heads, spec.head_dim)
    assert kv[0].group is not kv[1].group  # a sliding and a full layer: two groups, as vLLM keeps them
    for i in indices:
        lens, table = kv[i].group.seq_lens, kv[i].group.block_table
        assert lens.tolist() == [256] and table.shape == (1, 256 // 16)
        # every slot the verify rows write lies in a page the table maps
        assert set((kv[i].group.slot_mapping // 16).tolist()) <= set(table[0].tolist())
    assert indices == (0, 1)
    assert kv[2] is kv[0] and kv[3] is kv[0]


def test_measurement_times_a_step_at_most_measure_context_long(weights, monkeypatch: pytest.MonkeyPatch):
    """Built for a max context above MEASURE_CONTEXT (a served max_model_len), the
    resolver's chain times a step of MEASURE_CONTEXT keys; at or below it, the max
    context's. Either way it computes the executor's step on its cache, bit for bit."""
    monkeypatch.setattr(executor_module, "MEASURE_CONTEXT", 128)
    for max_context, timed in ((MAX_CONTEXT, 128), (96, 96)):
        executor = SpecializedDecode(weights, DecodeConfig(max_context=max_context))
        chain = executor.measurement_chain(executor.layout.classes(), final=True)
        assert chain.step.kv[0].group.seq_lens.tolist() == [timed]
        assert chain.step.positions.tolist() == list(range(timed - 8, timed))
        chain.run()
        executor.prepare_kv(chain.step.kv)
        step = executor.plan(chain.step.positions)
        assert step is not None
        hidden, _ = executor.run(step, inputs_embeds=chain.embeddings)
        assert torch.equal(hidden, chain.out)


def test_measurement_chain_is_the_step_over_its_layers(weights, spec):
    """What the resolver times computes what the executor's step computes over the same
    layers, cache and embeddings (tiny has four layers: the whole step), bit for bit;
    and twice the same, as its graph replays must."""
    executor = SpecializedDecode(weights, DecodeConfig(max_context=MAX_CONTEXT))
    chain = executor.measurement_chain(executor.layout.classes(), final=True)
    assert chain.indices == tuple(range(spec.num_layers))
    chain.run()
    first = chain.out.clone()
    chain.run()
    assert torch.equal(chain.out, first)
    executor.prepare_kv(chain.step.kv)
    step = executor.plan(chain.step.positions)
    assert step is not None
    hidden, _ = executor.run(step, inputs_embeds=chain.embeddings)
    assert torch.equal(hidden, first)


@pytest.mark.parametrize(
    ("pooler", "unpooler", "all_reduce", "expected"),
    [
        (False, False, "cuda", False),
        (False, False, "reference", True),
        (True, False, "cuda", True),
        (False, True, "cuda", True),
    ],
)
def test_chains_with_torch_collectives_are_known(spec, pooler, unpooler, all_reduce, expected) -> None:
    """What a timing over a group a CUDA graph cannot capture (gloo) leaves untimed:
    a chain whose all-reduce runs torch.distributed collectives, or whose sharded
    pooler or unpooler gathers its columns through the reference transport."""
    from sparkdecode.reference.providers import ReferenceAllReduce
    from sparkdecode.weights import Sharding

    sharding = Sharding(tp=2, rank=0, expert_parallel="tp", shard_pooler=pooler, shard_unpooler=unpooler)
    executor = SpecializedDecode(random_weights(spec, seed=3, sharding=sharding), DecodeConfig(max_context=64))

    class DeviceAllReduce:  # an all-reduce that moves the rows itself, as the cuda pack's does
        block = "all_reduce"

    cls = ReferenceAllReduce if all_reduce == "reference" else DeviceAllReduce
    assert executor._host_collectives({"all_reduce": cls}) is expected


class _FakeCuda:
    """torch.cuda's stream and graph calls that graph_seconds makes before its first
    replay, on the CPU: the run happens eagerly, and the capture fails where asked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capture_fails: bool) -> None:
        import contextlib

        class Stream:
            def __init__(self, device=None) -> None:
                pass

            def wait_stream(self, other) -> None:
                pass

        @contextlib.contextmanager
        def graph(g):
            if capture_fails:
                raise RuntimeError("operation not permitted when stream is capturing")
            yield

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
        monkeypatch.setattr(torch.cuda, "graph", graph)


def test_graph_seconds_tells_a_failed_capture_from_a_failed_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed capture raises CaptureFailedError (fatal: the allocator may be left in
    its capture state); a failed warm-up run, its own error; over ranks, the worst
    rank's outcome is every rank's, agreed before any replay."""
    from sparkdecode.executor import CaptureFailedError, graph_seconds

    def broken() -> None:
        raise ValueError("rows of 7")

    device = torch.device("cpu")
    _FakeCuda(monkeypatch, capture_fails=True)
    with pytest.raises(CaptureFailedError, match=r"could not be captured \(RuntimeError: operation not permitted"):
        graph_seconds(lambda: None, device)
    with pytest.raises(ValueError, match="rows of 7"):
        graph_seconds(broken, device)
    seen: list[float] = []
    with pytest.raises(ValueError, match="rows of 7"):  # another rank ran: the run's failure stands
        graph_seconds(broken, device, combine=lambda x: seen.append(x) or x)
    assert seen == [1.0]
    _FakeCuda(monkeypatch, capture_fails=False)
    with pytest.raises(CaptureFailedError, match="could not be captured on another rank"):
        graph_seconds(lambda: None, device, combine=lambda x: 2.0)
    with pytest.raises(RuntimeError, match="failed to run on another rank"):
        graph_seconds(lambda: None, device, combine=lambda x: max(x, 1.0))


def test_a_failed_capture_stops_the_layout_a_failed_run_leaves_the_candidate_untimed(
    spec, weights, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sparkdecode.executor import CaptureFailedError
    from sparkdecode.reference.providers import ReferenceMoE

    executor = SpecializedDecode(weights, DecodeConfig(max_context=64))
    chain = SimpleNamespace(run=lambda: None, indices=(0,))
    monkeypatch.setattr(
        executor_module.SpecializedDecode, "measurement_chain", lambda self, classes, final=False: chain
    )

    def capture_fails(run, device, combine=None):
        raise CaptureFailedError("the graph could not be captured (RuntimeError: sync while capturing)")

    monkeypatch.setattr(executor_module, "graph_seconds", capture_fails)
    with pytest.raises(CaptureFailedError, match=r"reference\.moe serving moe, timed for the layout: the graph could"):
        executor._measure("moe", ReferenceMoE, {})

    def run_fails(run, device, combine=None):
        raise ValueError("rows of 7")

    monkeypatch.setattr(executor_module, "graph_seconds", run_fails)
    with caplog.at_level(logging.WARNING):
        assert executor._measure("moe", ReferenceMoE, {}) is None
    assert "reference.moe could not be timed for moe (ValueError: rows of 7)" in caplog.text


def test_timing_chains_share_what_their_collective_setups_make(spec) -> None:
    """A collective setup's workspace (``BuildContext.shared``) is made by the first
    timing chain that needs it and shared by the later ones, not made per timing; once
    the executor drops the timings' markers (its layout resolved), a new one is made."""
    from sparkdecode.reference.providers import ReferenceAllReduce
    from sparkdecode.weights import Sharding

    made: list[object] = []
    seen: list[object] = []

    class SharedAllReduce(ReferenceAllReduce):
        name = "test.shared_all_reduce"

        @classmethod
        def collective_setup(cls, ctx) -> None:
            ctx.shared("test_workspace", lambda: made.append(object()) or made[-1])

        @classmethod
        def build(cls, ctx, layer):
            seen.append(ctx.shared("test_workspace", lambda: pytest.fail("made at a build")))
            return super().build(ctx, layer)

    # A TP-2 rank (detached: no group) builds the MoE's all-reduce.
    weights = random_weights(spec, seed=3, sharding=Sharding(tp=2, rank=0, expert_parallel="tp"))
    executor = SpecializedDecode(weights, DecodeConfig(max_context=MAX_CONTEXT))
    classes = {**executor.layout.classes(), "all_reduce": SharedAllReduce}
    for _ in range(3):
        executor.measurement_chain(classes)
    assert len(made) == 1 and seen and all(w is made[0] for w in seen)
    executor._timing_collectives.clear()  # as after the layout's resolution
    executor.measurement_chain(classes)
    assert len(made) == 2
