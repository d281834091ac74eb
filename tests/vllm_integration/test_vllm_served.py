"""The served path on the CPU, over real vLLM objects: the model vLLM's registry
resolves and its loader builds and loads from a checkpoint, DSpark's aux layers
set by vLLM's runner helper, the ModelState vLLM's resolution picks, KV caches
sized, grouped, allocated and bound by vLLM in several physical layouts.

- the adapter's weights are views of vLLM's parameters (the experts are not
  copied) and equal, bit for bit, what the core's own checkpoint loader reads;
- the K/V views address vLLM's caches the way its attention backends split them;
- steps of one request of 8 tokens through the subclass's ``forward`` (the
  executor with the reference providers, plain metadata refilled by the
  ModelState's ``prepare_attn`` from vLLM's block tables and slot mappings)
  equal the core's reference model on its own paged cache, hidden states and aux
  streams, bit for bit, on both input paths (embeddings and token ids);
- the plan runs stock everywhere but inside a FULL capture of one request.

The stock vLLM forward itself does not run here: its Triton and CUDA kernels
(fused RMS norms, QK-norm/RoPE/KV insert, the experts) need a GPU; nor do vLLM's
attention-metadata builders, whose CPU backend needs vLLM's CPU kernels, absent
from the CUDA wheel (the stock ``prepare_attn`` is stubbed where it would run).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.models.muse_spark import MuseSparkForConditionalGeneration
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.model_states import init_model_state
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers
from vllm_support import (
    DRAFT_TARGET_LAYERS,
    MAX_CONTEXT,
    HostBlockTables,
    build_config,
    free_port,
    init_tp_rank,
    kv_cache_setup,
    load_model,
    tp_rank_weights,
)

from sparkdecode.checkpoint import load_checkpoint
from sparkdecode.deployment import DeploymentError
from sparkdecode.layout import needed_kinds
from sparkdecode.protocols import HostStep
from sparkdecode.reference import functional as fn
from sparkdecode.reference.kvcache import PagedKVCache
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.vllm import adapter, gate
from sparkdecode.vllm import model as served_model
from sparkdecode.vllm.model import SparkDecodeModelState, SparkDecodeMuseSpark

Q = 8
MAX_REQS = 4
MAX_BLOCKS = 64  # block-table width: 1024 tokens
LAYOUTS = ("LBNHC", "LBHNC", "BLNHC")


@dataclasses.dataclass
class Served:
    config: Any
    model: SparkDecodeMuseSpark
    state: SparkDecodeModelState
    checkpoint: Path


@pytest.fixture(scope="module")
def served(make_config, checkpoint: Path, distributed) -> Served:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate, "platform_capability", lambda: (9, 0))  # this CPU stands in for an H200
        probe = gate.check(make_config(), capability=(9, 0))
        # The reference providers serve every block: installed packs may claim a
        # "GPU" this CPU only pretends to be.
        pins = {kind: f"reference.{kind}" for kind in needed_kinds(probe.deployment)}
        config = make_config(additional={"decode_providers": pins})
        model = load_model(config, checkpoint)
    set_eagle3_aux_hidden_state_layers(model, config.speculative_config)
    with set_current_vllm_config(config):
        state = init_model_state(config, model, None, torch.device("cpu"))
    assert type(state) is SparkDecodeModelState and model.sparkdecode is state.decode
    return Served(config, model, state, checkpoint)


def test_aux_layers_come_from_dspark(served: Served) -> None:
    assert served.model.model.aux_hidden_state_layers == tuple(i + 1 for i in DRAFT_TARGET_LAYERS)
    assert served.state.decode.config.aux_layers == (1, 4)


def test_the_adapter_reads_vllms_modules_bit_for_bit(served: Served) -> None:
    ours = served.state.decode.weights
    theirs = load_checkpoint(served.checkpoint)
    assert ours.spec == theirs.spec and ours.sharding == theirs.sharding
    for name in ("embed", "final_norm", "lm_head"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    for mine, ref in zip(ours.layers, theirs.layers, strict=True):
        for field in dataclasses.fields(mine):
            a, b = getattr(mine, field.name), getattr(ref, field.name)
            if field.name == "router_unfolded":
                continue  # only the checkpoint loader keeps the unfolded router
            if field.name == "experts":
                assert (a.format, a.first_expert, a.intermediate_slice) == (
                    b.format,
                    b.first_expert,
                    b.intermediate_slice,
                )
                assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
            elif isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), (mine.index, field.name)
            else:
                assert a == b, (mine.index, field.name)
    spec = ours.spec
    for theta, table in ours.rope_tables.items():
        assert torch.equal(table[:MAX_CONTEXT], fn.rope_table(theta, spec.head_dim, MAX_CONTEXT, "cpu"))


def test_the_weights_are_views_of_vllms_parameters(served: Served) -> None:
    """Nothing is copied: the experts least of all."""
    backbone, weights = served.model.model, served.state.decode.weights
    for layer, mine in zip(backbone.layers, weights.layers, strict=True):
        experts = layer.feed_forward.experts.routed_experts
        assert mine.experts.w13.data_ptr() == experts.w13_weight.data_ptr()
        assert mine.experts.w2.data_ptr() == experts.w2_weight.data_ptr()
        assert mine.qkvg.data_ptr() == layer.self_attn.qkv_proj.weight.data_ptr()
        assert mine.router.data_ptr() == layer.feed_forward.router.weight.data_ptr()
        assert mine.attn_alpha.data_ptr() == layer.add_attn.alpha.data_ptr()
    assert weights.embed.data_ptr() == backbone.embed_tokens.weight.data_ptr()


def test_an_unfinished_load_is_named(served: Served) -> None:
    layer = served.model.model.layers[0]
    moe = layer.feed_forward
    moe.router_output_multiplier, saved = 0.5, moe.router_output_multiplier
    try:
        with pytest.raises(adapter.AdapterError, match="layer 0: the router's output multiplier is not folded"):
            adapter.layer_weights(served.state.decode.spec, layer, served.state.decode.weights.sharding)
    finally:
        moe.router_output_multiplier = saved


def bind(served: Served, layout: str) -> tuple[Any, Any, HostBlockTables]:
    kv_cache_config, attn_groups = kv_cache_setup(served.config, layout)
    tables = HostBlockTables(len(kv_cache_config.kv_cache_groups), MAX_REQS, MAX_BLOCKS)
    with set_current_vllm_config(served.config):
        served.state.initialize_kv_cache(kv_cache_config, tables)
    return kv_cache_config, attn_groups, tables


@pytest.mark.parametrize("lowered", ["NONE", "PIECEWISE", "FULL"])
def test_graphs_lowered_after_the_gate_stop_the_kv_setup(served: Served, monkeypatch, lowered: str) -> None:
    """The runner resolves the graph mode at KV-cache setup and may lower the one the
    gate accepted (an attention backend without uniform-batch FULL graphs): the
    ModelState's KV setup then raises, naming the resolved mode, instead of serving the
    stock decode under latency_specialized."""
    monkeypatch.setattr(served.config.compilation_config, "cudagraph_mode", CUDAGraphMode[lowered])
    with pytest.raises(
        DeploymentError, match=f"vLLM resolved the CUDA graphs after the gate: CUDA graph mode is {lowered}:"
    ):
        bind(served, "LBNHC")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_views_address_vllms_caches(served: Served, layout: str) -> None:
    """Each layer's K and V are the halves vLLM's backends split from its cache
    (``cache.transpose(1, 2).split(head_dim)``), in every layout; each group's
    metadata is shared by that group's layers."""
    kv_cache_config, _, _ = bind(served, layout)
    binding = served.state.decode.binding
    assert binding is not None
    spec = served.state.decode.spec
    group_of = {n: g for g, grp in enumerate(kv_cache_config.kv_cache_groups) for n in grp.layer_names}
    for layer, kv in zip(served.model.model.layers, binding.kv, strict=True):
        attn = layer.self_attn.attn
        cache = attn.kv_cache
        assert cache.shape[1:] == (layer.self_attn.num_kv_heads, 16, 2 * spec.head_dim)
        k, v = cache.transpose(1, 2).split(spec.head_dim, dim=-1)
        assert kv.k.shape == k.shape and kv.k.stride() == k.stride() and kv.k.data_ptr() == k.data_ptr()
        assert kv.v.shape == v.shape and kv.v.stride() == v.stride() and kv.v.data_ptr() == v.data_ptr()
        kv.k[3, 5, 1].fill_(7.0)
        assert torch.all(cache[3, 1, 5, : spec.head_dim] == 7.0)
        assert kv.group is binding.groups[group_of[attn.layer_name]]
        assert kv.window == spec.window(layer.layer_idx)


def test_a_cache_in_pages_the_executor_does_not_read_is_named(served: Served) -> None:
    layer = served.model.model.layers[0].self_attn
    cache = torch.zeros(4, layer.num_kv_heads, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(adapter.AdapterError, match="pages of 16 tokens"):
        adapter.kv_views("layer0", cache, layer.num_kv_heads, 64)


class Request:
    """One request's pages per KV-cache group, handed out from one pool as vLLM's
    block pool does (the groups overlay the same memory, so a block id belongs to
    one group at a time; 0 is the null block), and the runner's tensors for a step."""

    def __init__(self, num_groups: int):
        self.pages: list[list[int]] = [[] for _ in range(num_groups)]
        self.next = 1

    def step(self, first: int, rows: int, buffers: InputBuffers) -> tuple[InputBatch, tuple, torch.Tensor]:
        last = first + rows - 1
        tables, slots = [], []
        for pages in self.pages:
            while len(pages) <= last // 16:
                pages.append(self.next)
                self.next += 1
            table = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.int32)
            table[0, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            tables.append(table[:1])
            positions = torch.arange(first, last + 1)
            slots.append(table[0, positions // 16].long() * 16 + positions % 16)
        batch = InputBatch.make_dummy(1, rows, buffers, max_query_len=rows)
        batch.num_computed_tokens_np[0] = first
        buffers.seq_lens[0] = last + 1
        batch.seq_lens_cpu_upper_bound[0] = last + 1
        buffers.positions[:rows] = torch.arange(first, last + 1)
        return batch, tuple(tables), torch.stack(slots)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inputs", ["embeddings", "token-ids"])
def test_served_steps_equal_the_reference(served: Served, layout: str, inputs: str, monkeypatch) -> None:
    """Thirteen steps of one request of 8 tokens (a 104-token context: past the
    64-token sliding window, over several pages per group) through the model's
    ``forward`` inside a (pretended) FULL capture, each after the ModelState's
    ``prepare_attn`` over vLLM's metadata, against the reference model."""
    kv_cache_config, attn_groups, _ = bind(served, layout)
    monkeypatch.setattr(served_model, "stream_capturing", lambda: True)
    # The stock prepare_attn builds the attention backend's metadata, here the CPU
    # backend's, whose kernels the CUDA wheel lacks: record the call instead.
    stock_calls: list[tuple] = []
    monkeypatch.setattr(
        DefaultModelState, "prepare_attn", lambda self, *args, **kw: stock_calls.append(args) or {"stock": True}
    )
    model, state = served.model, served.state
    spec = state.decode.spec
    reference = ReferenceModel(load_checkpoint(served.checkpoint), MAX_CONTEXT)
    cache = PagedKVCache(spec, num_pages=64, max_context=MAX_CONTEXT, max_rows=Q)
    aux_layers = model.model.aux_hidden_state_layers
    buffers = InputBuffers(MAX_REQS, 64, torch.device("cpu"))
    request = Request(len(kv_cache_config.kv_cache_groups))
    gen = torch.Generator().manual_seed(5)
    for first in range(0, 13 * Q, Q):
        tokens = torch.randint(0, spec.vocab_size, (Q,), generator=gen)
        batch, tables, slots = request.step(first, Q, buffers)
        with set_current_vllm_config(served.config):
            metadata = state.prepare_attn(batch, CUDAGraphMode.FULL, tables, slots, attn_groups, kv_cache_config)
        assert metadata == {"stock": True} and stock_calls[-1][0] is batch  # the stock metadata still comes back
        positions = buffers.positions[:Q]
        rows = model.model.embed_tokens(tokens)
        if inputs == "embeddings":
            normed = model.model.tok_embeddings_norm.forward_native(rows)  # what the multimodal runner passes
            out = model(None, positions, None, inputs_embeds=normed)
            cache.begin_step(first, Q)
            hidden_ref, aux_ref = reference.forward(normed, positions, cache.kv(), aux_layers, normed=True)
        else:
            out = model(tokens, positions)
            cache.begin_step(first, Q)
            hidden_ref, aux_ref = reference.forward(rows, positions, cache.kv(), aux_layers)
        hidden, aux = out  # the stock form with aux layers: (hidden, [aux...])
        assert hidden.dtype == torch.bfloat16 and hidden.shape == (Q, spec.H)
        assert torch.equal(hidden, hidden_ref), first
        assert len(aux) == len(aux_ref) == 2
        for a, b in zip(aux, aux_ref, strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, b), first


def test_the_plan(served: Served, caplog) -> None:
    """Stock everywhere but inside a FULL capture of one request of 8 tokens; each
    outcome is logged once."""
    kv_cache_config, attn_groups, _ = bind(served, "LBNHC")
    decode = served.state.decode
    buffers = InputBuffers(MAX_REQS, 64, torch.device("cpu"))
    request = Request(len(kv_cache_config.kv_cache_groups))
    batch, tables, slots = request.step(0, Q, buffers)
    decode.prepare_step(batch, CUDAGraphMode.NONE, tables, slots, for_capture=True)
    positions = buffers.positions[:Q]
    caplog.set_level(logging.INFO, logger="vllm.sparkdecode")
    decode.logged.clear()  # earlier tests logged some outcomes already
    assert decode.plan(positions, None, True, capturing=False) is None
    assert decode.plan(positions, None, True, capturing=True, runtime_mode="PIECEWISE") is None
    assert decode.plan(positions, {"hidden_states": None}, True, capturing=True) is None
    assert decode.plan(positions[:4], None, True, capturing=True) is None
    step = decode.plan(positions, None, True, capturing=True, runtime_mode="NONE")
    assert step is not None and step.rows == Q and step.normed_embeddings
    assert decode.plan(positions, None, False, capturing=True).normed_embeddings is False
    two = InputBatch.make_dummy(2, Q, buffers, max_query_len=4)
    decode.prepare_step(two, CUDAGraphMode.NONE, tables, slots, for_capture=True)
    assert decode.plan(positions, None, True, capturing=True) is None
    messages = [r.getMessage() for r in caplog.records]
    for tokens, outcome in (
        (8, "stock forward (outside a FULL CUDA graph capture)"),
        (8, "stock forward (a PIECEWISE graph)"),
        (8, "stock forward (a pipeline stage's input)"),
        (4, "stock forward (not one request verifying 8 tokens)"),
        (8, "stock forward (not one request verifying 8 tokens)"),
        (8, "specialized decode"),
    ):
        assert messages.count(f"sparkdecode: forward of {tokens} tokens: {outcome}") == 1, outcome


@pytest.mark.parametrize("host_planned", [True, False], ids=["host-planned-core", "device-read-core"])
@pytest.mark.parametrize(
    "scheduling", ["async", "async-sync-lengths", "sync"], ids=["async", "async-sync-lengths", "sync"]
)
def test_a_host_planned_step_gets_the_exact_context(
    served: Served, monkeypatch, host_planned: bool, scheduling: str
) -> None:
    """Under asynchronous scheduling (the served config's, vLLM's default) the
    runner's host mirror of the computed tokens counts every draft as accepted: after
    5 rejected drafts it is 5 ahead of the device's sequence lengths. A provider that
    plans on the host (served with ``decode_lengths: sync``, whose deployment then
    says the lengths are exact; or another pack's that does not refuse the inexact
    deployment) then gets the device's exact length; without one, or with exact host
    lengths (synchronous scheduling), nothing waits on the device."""
    kv_cache_config, _, _ = bind(served, "LBNHC")
    decode = served.state.decode
    assert served.config.scheduler_config.async_scheduling
    assert decode.settings.deployment.host_lengths_exact is False and decode.settings.host_lengths_upper_bound
    if scheduling != "async":
        exact = dataclasses.replace(decode.settings.deployment, host_lengths_exact=True)
        settings = dataclasses.replace(
            decode.settings, deployment=exact, host_lengths_upper_bound=scheduling == "async-sync-lengths"
        )
        monkeypatch.setattr(decode, "settings", settings)
    asynchronous = scheduling != "sync"
    buffers = InputBuffers(MAX_REQS, 64, torch.device("cpu"))
    request = Request(len(kv_cache_config.kv_cache_groups))
    first = 3 * Q
    batch, tables, slots = request.step(first, Q, buffers)
    batch.num_computed_tokens_np[0] = first + 5  # optimistic
    planned: list = []
    synced: list = []
    attention = decode.executor.layers[0].attention
    if host_planned:
        monkeypatch.setattr(attention, "prepare_step", planned.append, raising=False)
    assert decode.executor.plans_on_host is host_planned
    exact = served_model.exact_context_len
    monkeypatch.setattr(served_model, "exact_context_len", lambda b: synced.append(b) or exact(b))
    decode.prepare_step(batch, CUDAGraphMode.FULL, tables, slots, for_capture=False)
    if host_planned and asynchronous:
        assert synced == [batch]
        assert planned == [HostStep(first_position=first, rows=Q, context_len=first + Q)]
        assert decode.host.first_position == first
    else:
        assert synced == [] and decode.host.first_position == first + 5


def test_a_verify_graph_never_replays_for_another_batch(served: Served) -> None:
    decode = served.state.decode
    kv_cache_config, _, _ = bind(served, "LBNHC")
    buffers = InputBuffers(MAX_REQS, 64, torch.device("cpu"))
    decode.specialized_sizes.add(Q)
    two = InputBatch.make_dummy(2, Q, buffers, max_query_len=4)
    request = Request(len(kv_cache_config.kv_cache_groups))
    _, tables, slots = request.step(0, Q, buffers)
    with pytest.raises(
        RuntimeError, match="the FULL graph of 8 tokens runs the executor, but this batch is 2 requests"
    ):
        decode.prepare_step(two, CUDAGraphMode.FULL, tables, slots, for_capture=False)


def test_forward_falls_through_to_stock(served: Served, monkeypatch) -> None:
    """Where the plan gives no step, the subclass's forward is the stock forward,
    called with the same arguments."""
    bind(served, "LBNHC")
    calls = []

    def stock(self, *args, **kwargs):
        calls.append((args, kwargs))
        return "stock"

    monkeypatch.setattr(MuseSparkForConditionalGeneration, "forward", stock)
    positions = torch.arange(Q)
    embeds = torch.zeros(Q, served.state.decode.spec.H, dtype=torch.bfloat16)
    assert served.model(None, positions, None, inputs_embeds=embeds) == "stock"  # not inside a capture
    ((args, kwargs),) = calls
    assert args[0] is None and args[1] is positions and args[3] is embeds and kwargs == {}


def test_the_adapter_at_tp2(checkpoint: Path, draft: Path, tmp_path: Path) -> None:
    """Two ranks over gloo, each building and loading the model with vLLM at TP 2
    (EP, then expert TP): each rank's adapter weights equal the core's cut of the
    checkpoint for that rank (attention heads, o_proj columns, the experts: whole
    experts from vLLM's expert map under EP, I-slices under expert TP); an adapter
    problem on one rank stops both."""
    import torch.multiprocessing as mp

    mp.spawn(tp_rank_weights, args=(2, free_port(), checkpoint, draft, tmp_path), nprocs=2, join=True)
    for rank in range(2):
        for mode in ("ep", "expert-tp"):
            assert (tmp_path / f"rank{rank}-{mode}").read_text() == "ok", (rank, mode)
    assert (tmp_path / "rank1-one-rank-fails").read_text() == "AdapterError: layer 3: not loaded"
    assert (tmp_path / "rank0-one-rank-fails").read_text() == (
        "RankFailedError: reading vLLM's weights failed on rank 1: AdapterError: layer 3: not loaded"
    )


def tp_rank_served_steps(
    rank: int,
    world: int,
    port: int,
    checkpoint: Path,
    draft: Path,
    out: Path,
    nvfp4: bool = False,
    sharded: bool = False,
) -> None:
    """One rank of a TP-2 deployment served with latency_specialized over gloo (the
    reference providers pinned), under EP, then expert TP: vLLM builds, loads and
    shards the model, the ModelState builds the executor on the TP group vLLM hands it
    and binds this rank's KV caches; steps through the model's ``forward`` (inside a
    pretended FULL capture, each after ``prepare_attn``) against the reference model
    of this rank's cut of the checkpoint over the same group, hidden states and aux
    streams bit for bit. With ``nvfp4`` the checkpoint's experts are NVFP4, which vLLM
    repacks for Marlin as on Hopper and the executor reads in place; the reference
    then takes them with the global scales vLLM hands to Marlin. Writes ``ok`` or
    the first difference to ``out/rank{rank}-{mode}``. With ``sharded`` the text config
    asks vLLM to column-shard the pooler and the unpooler (the README's override for
    TP 8 on Hopper), and the reference takes the same cut."""
    from vllm.distributed import parallel_state
    from vllm_support import marlin_definition, patch_marlin_backend, patch_marlin_repack

    from sparkdecode.weights import Sharding, shard_weights

    for ep in (True, False):
        mode = "ep" if ep else "expert-tp"
        parallel = {"tensor_parallel_size": world, "enable_expert_parallel": ep}
        shard_text = {"muse_spark_tep_shard_pooler": True, "muse_spark_tep_shard_unpooler": True}
        model_args = {"hf_overrides": {"text_config": shard_text}} if sharded else None
        probe_config = build_config(checkpoint, draft, model=model_args, parallel=parallel)
        if ep:
            init_tp_rank(probe_config, rank, world, port)
        with pytest.MonkeyPatch.context() as mp:
            if nvfp4:
                patch_marlin_backend(mp)
                patch_marlin_repack(mp)
            mp.setattr(gate, "platform_capability", lambda: (9, 0))  # this CPU stands in for an H200
            mp.setattr(served_model, "stream_capturing", lambda: True)
            mp.setattr(DefaultModelState, "prepare_attn", lambda self, *args, **kw: {"stock": True})
            probe = gate.check(probe_config, capability=(9, 0))
            assert probe is not None and probe.deployment.tp == world
            assert (probe.deployment.shard_pooler, probe.deployment.shard_unpooler) == (sharded, sharded)
            pins = {kind: f"reference.{kind}" for kind in needed_kinds(probe.deployment)}
            config = build_config(
                checkpoint, draft, model=model_args, parallel=parallel, additional={"decode_providers": pins}
            )
            model = load_model(config, checkpoint)
            set_eagle3_aux_hidden_state_layers(model, config.speculative_config)
            with set_current_vllm_config(config):
                state = init_model_state(config, model, None, torch.device("cpu"))
            kv_cache_config, attn_groups = kv_cache_setup(config, "LBNHC")
            tables = HostBlockTables(len(kv_cache_config.kv_cache_groups), MAX_REQS, MAX_BLOCKS)
            with set_current_vllm_config(config):
                state.initialize_kv_cache(kv_cache_config, tables)
            group = parallel_state.get_tp_group().device_group
            cut = Sharding(world, rank, "ep" if ep else "tp", shard_pooler=sharded, shard_unpooler=sharded)
            shard = shard_weights(load_checkpoint(checkpoint), cut)
            if nvfp4:
                layers = [
                    dataclasses.replace(x, experts=marlin_definition(x.experts)) if x.experts.nvfp4 else x
                    for x in shard.layers
                ]
                shard = dataclasses.replace(shard, layers=layers)
            assert state.decode.weights.expert_format == ("nvfp4_marlin" if nvfp4 else "bf16")
            assert state.decode.weights.sharding == cut  # vLLM's cut, read off its modules
            reference = ReferenceModel(shard, MAX_CONTEXT, group)
            spec = shard.spec
            cache = PagedKVCache(spec, 64, MAX_CONTEXT, Q, num_kv_heads=spec.num_key_value_heads // world)
            aux_layers = model.model.aux_hidden_state_layers
            buffers = InputBuffers(MAX_REQS, 64, torch.device("cpu"))
            request = Request(len(kv_cache_config.kv_cache_groups))
            gen = torch.Generator().manual_seed(5)  # the same tokens on every rank
            result = "ok"
            try:
                assert state.decode.executor.tp == world and state.decode.executor.group is group
                for first in range(0, 10 * Q, Q):
                    tokens = torch.randint(0, spec.vocab_size, (Q,), generator=gen)
                    batch, block_tables, slots = request.step(first, Q, buffers)
                    with set_current_vllm_config(config):
                        state.prepare_attn(batch, CUDAGraphMode.FULL, block_tables, slots, attn_groups, kv_cache_config)
                    positions = buffers.positions[:Q]
                    hidden, aux = model(tokens, positions)
                    cache.begin_step(first, Q)
                    rows = model.model.embed_tokens(tokens)
                    hidden_ref, aux_ref = reference.forward(rows, positions, cache.kv(), aux_layers)
                    assert torch.equal(hidden, hidden_ref), ("hidden", first)
                    for i, (a, b) in enumerate(zip(aux, aux_ref, strict=True)):
                        assert torch.equal(a, b), ("aux", i, first)
            except AssertionError as e:
                result = f"differs: {e}"
            (out / f"rank{rank}-{mode}").write_text(result)


def test_served_steps_at_tp2(checkpoint: Path, draft: Path, tmp_path: Path) -> None:
    """The served path at TP 2 (two gloo ranks, EP and expert TP): each rank's steps
    through vLLM's model equal the reference model of its cut, bit for bit."""
    import torch.multiprocessing as mp

    mp.spawn(tp_rank_served_steps, args=(2, free_port(), checkpoint, draft, tmp_path), nprocs=2, join=True)
    for rank in range(2):
        for mode in ("ep", "expert-tp"):
            assert (tmp_path / f"rank{rank}-{mode}").read_text() == "ok", (rank, mode)


def test_served_steps_at_tp2_sharded(checkpoint: Path, draft: Path, tmp_path: Path) -> None:
    """The same with the pooler and the unpooler column-sharded by the README's override:
    vLLM's sharded MoE and the executor's mailbox gathers, bit for bit."""
    import torch.multiprocessing as mp

    args = (2, free_port(), checkpoint, draft, tmp_path, False, True)
    mp.spawn(tp_rank_served_steps, args=args, nprocs=2, join=True)
    for rank in range(2):
        for mode in ("ep", "expert-tp"):
            assert (tmp_path / f"rank{rank}-{mode}").read_text() == "ok", (rank, mode)
