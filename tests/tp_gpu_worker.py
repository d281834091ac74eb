"""One rank of the GPU tensor-parallel tests (spawned by test_gpu_tp_one_device.py and
test_gpu_tp_per_gpu.py): every rank on cuda:0 (the processes' kernels time-slice the
GPU), or with ``per_gpu`` rank r on cuda:r; the host side of the group over gloo (NCCL
refuses two ranks on one GPU), the collectives on the GPUs through the cuda pack's
Lamport mailboxes (CUDA IPC between the processes, peer memory across GPUs).

Each variant: this rank's shard of one seeded TP-1 model, the executor with the
variant's pins beside the TP stock forward (the reference transport over gloo),
``steps`` verify steps (eagerly or replaying one captured graph), one position a
step; per step on the GPU: whether the executor equals the stock forward bit for
bit, its largest relative row error, whether greedy tokens agree where decided.
Rank 0 also runs the TP-1 stock forward on the first steps' tokens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from test_tp import relative_rows

from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.harness import DecodeHarness
from sparkdecode.reference.kvcache import PagedKVCache
from sparkdecode.reference.model import ReferenceModel
from tp_worker import PROMPT, model_and_shard, to_cpu

TP1_STEPS = 4  # steps compared with the TP-1 model on rank 0
REFERENCE = {
    kind: f"reference.{kind}"
    for kind in ("boundary", "attention", "attention_boundary", "moe", "final", "experts", "attention_core", "linear")
}
PINS = {
    # Only the transport changes: the executor must equal the TP stock forward bit for bit.
    "all_reduce": {**REFERENCE, "all_reduce": "cuda.all_reduce"},
    # FlashInfer's one-shot all-reduce as the transport: bit for bit too (test_gpu_flashinfer_allreduce.py).
    "flashinfer_all_reduce": {**REFERENCE, "all_reduce": "flashinfer.trtllm_all_reduce"},
    # cuda.moe with its tail reductions over the reference transport, then fused into
    # its tail kernel with cuda.all_reduce: the same bits.
    "moe_reference_transport": {**REFERENCE, "moe": "cuda.moe", "all_reduce": "reference.all_reduce"},
    "moe_fused": {**REFERENCE, "moe": "cuda.moe", "all_reduce": "cuda.all_reduce"},
    # The fused TP attention boundary and cuda.moe's fused tail.
    "fused": {
        **REFERENCE,
        "all_reduce": "cuda.all_reduce",
        "attention_boundary": "cuda.attention_boundary",
        "moe": "cuda.moe",
    },
    # The same with cuda.attention and cuda.linear: the o_proj publishes its partial
    # from its epilogue and the fused boundary only gathers.
    "fused_publish": {
        **REFERENCE,
        "all_reduce": "cuda.all_reduce",
        "attention": "cuda.attention",
        "linear": "cuda.linear",
        "attention_boundary": "cuda.attention_boundary",
        "moe": "cuda.moe",
    },
    # The same with cute.linear_tma (the fastest dense GEMM) publishing the o_proj partial.
    "fused_publish_cute": {
        **REFERENCE,
        "all_reduce": "cuda.all_reduce",
        "attention": "cuda.attention",
        "linear": "cute.linear_tma",
        "attention_boundary": "cuda.attention_boundary",
        "moe": "cuda.moe",
    },
    # cuda.moe, cuda.boundary and cuda.final gathering a sharded pooler's and unpooler's
    # columns over the reference transport, then over the Lamport mailbox (the transport
    # cuda.all_reduce, the tail fused with it): the same bits.
    "gather_reference_transport": {
        **REFERENCE,
        "boundary": "cuda.boundary",
        "moe": "cuda.moe",
        "final": "cuda.final",
        "all_reduce": "reference.all_reduce",
    },
    "device_gather": {
        **REFERENCE,
        "boundary": "cuda.boundary",
        "moe": "cuda.moe",
        "final": "cuda.final",
        "all_reduce": "cuda.all_reduce",
    },
    # The same on cuda.linear (then cute.linear_tma): a sharded pooler's and unpooler's
    # epilogues push their columns, and the norm and the boundary after them only take.
    "device_gather_publish": {
        **REFERENCE,
        "boundary": "cuda.boundary",
        "moe": "cuda.moe",
        "final": "cuda.final",
        "all_reduce": "cuda.all_reduce",
        "linear": "cuda.linear",
    },
    "device_gather_publish_cute": {
        **REFERENCE,
        "boundary": "cuda.boundary",
        "moe": "cuda.moe",
        "final": "cuda.final",
        "all_reduce": "cuda.all_reduce",
        "linear": "cute.linear_tma",
    },
}


def run_variant(rank: int, tp: int, variant: dict, device: torch.device) -> dict:
    spec, full, shard = model_and_shard(rank, tp, variant, device)
    group = dist.group.WORLD
    steps = variant["steps"]
    max_context = -(-(PROMPT + steps + 16) // 64) * 64
    pins = PINS[variant["pins"]]
    config = DecodeConfig(max_context=max_context, aux_layers=(0, 1, spec.num_layers), pins=pins)
    executor = SpecializedDecode(shard, config, group=group)
    chosen = {kind: executor.layout.choices[kind].chosen.name for kind in pins}
    assert chosen == pins, chosen
    # The input and final boundaries take a sharded unpooler's columns in their own kernel
    # where the transport gathers on the device (cuda.all_reduce), else the mailbox's gather.
    readers = [layer.boundary for layer in executor.layers[1:]] + [executor.final]
    fused = [getattr(reader, "fused", None) is not None for reader in readers]
    sharded = variant.get("shard_unpooler", False) and pins.get("boundary") == "cuda.boundary"
    assert fused == [sharded and pins["all_reduce"] == "cuda.all_reduce"] * len(readers), fused
    # The pack's publishing GEMMs push a sharded result's columns from their epilogues.
    publishing = pins["linear"] in ("cuda.linear", "cute.linear_tma")
    taken = [getattr(getattr(reader, "fused", None), "published", False) for reader in readers]
    assert taken == [sharded and publishing] * len(readers), taken
    # cuda.moe on the device transport: a sharded pooler's columns exchanged in the norm,
    # pushed from the pooler's epilogue where the linear provider publishes.
    exchanged = variant["shard_pooler"] and pins["moe"] == "cuda.moe" and pins["all_reduce"] == "cuda.all_reduce"
    pooled = [
        (getattr(layer.moe, "pooled_exchange", None) is not None, getattr(layer.moe, "pooled_published", False))
        for layer in executor.layers
    ]
    assert pooled == [(exchanged, exchanged and publishing)] * len(executor.layers), pooled
    published = [getattr(layer.attention_boundary, "published", False) for layer in executor.layers]
    assert all(published) if variant["pins"].startswith("fused_publish") else not any(published), published
    harness = DecodeHarness(
        ReferenceModel(shard, max_context, group), executor, PROMPT, seed=variant["seed"], graph=variant["graph"]
    )
    prompt = torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(7)).to(device)
    harness.prefill(prompt)
    exact, error, agree, hidden, aux, tokens, first = [], [], [], [], [], [], []
    start = time.perf_counter()
    for i in range(steps):
        r = harness.verify(accepted=1)
        exact.append(
            torch.equal(r.executor_hidden, r.stock_hidden)
            and all(torch.equal(a, b) for a, b in zip(r.executor_aux, r.stock_aux))
        )
        error.append(relative_rows(r.executor_hidden, r.stock_hidden).max())
        diff = (r.executor_logits - r.stock_logits).abs().max()
        top2 = r.stock_logits.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 4 * diff
        agree.append(torch.equal(r.executor_logits.argmax(-1)[decided], r.stock_logits.argmax(-1)[decided]))
        hidden.append(r.executor_hidden)
        if i < TP1_STEPS:
            aux.append(r.executor_aux)
            tokens.append(r.tokens)
            first.append(r.first_position)
    torch.cuda.synchronize(device)
    out = {
        "seconds": time.perf_counter() - start,
        "exact": exact,
        "error": torch.stack(error),
        "agree": agree,
        "hidden": torch.stack(hidden),
        "aux": aux,
    }
    if rank == 0:
        model = ReferenceModel(full, max_context)
        cache = PagedKVCache(spec, max_context // 16 + 2, max_context, PROMPT, device)
        model.step(cache, prompt, 0)
        out["tp1_hidden"] = [model.step(cache, t, f)[0] for t, f in zip(tokens, first)]
    return out


def rank_device(rank: int, per_gpu: bool) -> torch.device:
    """This rank's GPU, made current: cuda:0 for every rank, or cuda:rank with ``per_gpu``."""
    device = torch.device("cuda", rank if per_gpu else 0)
    torch.cuda.set_device(device)
    return device


def main(rank: int, tp: int, init: str, out_dir: str, variants: list[dict], per_gpu: bool = False) -> None:
    torch.set_num_threads(1)
    device = rank_device(rank, per_gpu)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    try:
        results = {"variants": [run_variant(rank, tp, v, device) for v in variants]}
        torch.save(to_cpu(results), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def specials(x: torch.Tensor, rank: int) -> torch.Tensor:
    """Edge values in the first elements: -0.0 on every rank (a -0.0 sum), +inf on one
    rank and -inf on another (NaN), NaN on rank 0, the largest bf16 on every rank
    (overflow to inf), bf16's smallest subnormal."""
    flat = x.view(-1)
    if flat.numel() >= 8:
        flat[0] = -0.0
        flat[1] = float("inf") if rank == 0 else float("-inf") if rank == 1 else 1.0
        flat[2] = float("nan") if rank == 0 else 1.0
        flat[3] = torch.finfo(torch.bfloat16).max
        flat[4] = 2.0**-133
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal where not NaN, NaN where the other is (a NaN's payload may differ)."""
    nan = a.isnan() & b.isnan()
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | nan).all() and (a.isnan() == b.isnan()).all())


def eager_then_replayed(
    draw: Callable[[], None], calls: Callable[[], None], check: Callable[[], list[bool]], late: bool, replays: int
) -> list[bool]:
    """``calls`` on new inputs (``draw``) eagerly twice (every generation's slots reused
    once), then captured in one graph and replayed ``replays`` times, this rank late to
    every other replay where ``late`` (the others spin on its slots, then go on); every
    round's ``check``."""
    checks = []
    for _ in range(2):
        draw()
        calls()
        checks += check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for i in range(replays):
        draw()
        if late and i % 2 == 0:
            time.sleep(0.5)
        graph.replay()
        checks += check()
    return checks


def all_reduce_op(
    rank: int, tp: int, init: str, out_dir: str, shapes: list[tuple[int, ...]], replays: int, per_gpu: bool = False
) -> None:
    """cuda.all_reduce's workspace against the reference transport (comm.Collectives
    over gloo) on random bf16 of every shape in turn, eagerly, then the same sequence
    captured in one graph and replayed on new inputs each time, the last rank late to
    every other replay."""
    from sparkdecode.comm import Collectives
    from sparkdecode_cuda.lamport import LamportWorkspace

    torch.set_num_threads(1)
    device = rank_device(rank, per_gpu)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    try:
        capacity = max(torch.Size(s).numel() for s in shapes)
        ws = LamportWorkspace(device, dist.group.WORLD, tp, rank, capacity)
        reference = Collectives(tp, rank, dist.group.WORLD)
        g = torch.Generator(device=device).manual_seed(rank)
        inputs = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
        outputs = [torch.empty_like(x) for x in inputs]

        def draw() -> None:
            for x in inputs:
                specials(x.copy_(torch.randn(x.shape, generator=g, device=device) * 4), rank)

        def calls() -> None:
            for x, y in zip(inputs, outputs):
                y.copy_(x)
                ws.all_reduce(y)

        def check() -> list[bool]:
            return [same_bits(y, reference.all_reduce(x)) for x, y in zip(inputs, outputs)]

        checks = eager_then_replayed(draw, calls, check, rank == tp - 1, replays)
        results = {"checks": checks, **fused_ops(rank, tp, reference, device)}
        torch.save(to_cpu(results), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def one_ulp_close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Finite and within one bf16 ulp (test_gpu_cuda_pack.py's bound for the kernels'
    other row-reduction order)."""
    diff = (out.float() - ref.float()).abs()
    return bool(torch.isfinite(out.float()).all() and (diff <= ref.float().abs() * 2**-7 + 1e-30).all())


def fused_ops(rank: int, tp: int, reference, device: torch.device) -> dict:
    """The fused kernels at the tiny and the real widths: the TP attention boundary
    against the reference transport's sum then reference.model.attention_boundary
    (the stream to 1e-5, the output to one ulp: the row reductions' order), and the
    fused MoE tail bit for bit against tail_kernel with the reference transport
    before (expert TP) or after (EP) it."""
    from sparkdecode.reference import model
    from sparkdecode.spec import ModelSpec
    from sparkdecode_cuda.bench_collectives import context
    from sparkdecode_cuda.boundary import CudaAttentionBoundary
    from sparkdecode_cuda.moe import MoEKernels

    out: dict = {"boundary_ok": [], "tail_ok": [], "published_ok": [], "replicated": []}
    for preset in ("tiny", "muse-spark-open"):
        spec = ModelSpec.preset(preset)
        ctx = context(spec, 8, tp, rank, device)
        boundary, w = CudaAttentionBoundary(ctx, 0), ctx.layer(0)
        out["published_ok"].append(published_partial(ctx, boundary, rank, device))
        mine = torch.Generator(device=device).manual_seed(100 + rank)  # this rank's partials
        shared = torch.Generator(device=device).manual_seed(100)  # replicated values
        partial = (torch.randn(8, spec.H, generator=mine, device=device) * 2).to(torch.bfloat16)
        stream0 = torch.randn(8, spec.H, generator=shared, device=device)
        stream, xf = stream0.clone(), torch.empty_like(partial)
        boundary.run(partial, stream, xf)
        ref_s, ref_xf = model.attention_boundary(spec, w, stream0.clone(), reference.all_reduce(partial))
        out["boundary_ok"].append(
            bool(torch.allclose(stream, ref_s, rtol=1e-5, atol=1e-6)) and one_ulp_close(xf, ref_xf)
        )
        out["replicated"] += [stream, xf]
        kernels = MoEKernels(ctx)
        rows = (torch.randn(8, spec.top_k, spec.P, generator=mine, device=device) * 2).to(torch.bfloat16)
        weights = torch.rand(8, spec.top_k, generator=shared, device=device)
        norm = (torch.randn(spec.P, generator=shared, device=device) * 0.1).to(torch.bfloat16)
        eps = spec.post_norm_eps
        for reduce_rows in (False, True):
            fused_rows, fused = rows.clone(), torch.empty(8, spec.P, dtype=torch.bfloat16, device=device)
            kernels.finish_all_reduce(fused_rows, weights, norm, eps, fused, reduce_rows, boundary.workspace)
            ref_rows, ref = rows.clone(), torch.empty_like(fused)
            if reduce_rows:
                ref_rows.copy_(reference.all_reduce(ref_rows))
            kernels.finish(ref_rows, weights, norm, eps, ref)
            if not reduce_rows:
                ref.copy_(reference.all_reduce(ref))
            out["tail_ok"].append(same_bits(fused, ref))
            out["replicated"].append(fused)
    return out


def published_partial(ctx, boundary, rank: int, device: torch.device) -> bool:
    """cuda.linear's o_proj publishing its partial from the epilogue, then the fused
    boundary gathering only, against the same o_proj not publishing and the boundary
    pushing then gathering (``publishing_matches``)."""
    from sparkdecode_cuda.linear import _Weight

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    k = ctx.spec.q_size // ctx.tp
    weight = o_proj_weight(ctx.spec.H, k, rank, device)
    plain, publishing = _Weight("o_proj", weight, 8, sms), _Weight("o_proj", weight, 8, sms)
    return publishing_matches(ctx, plain, publishing, boundary, rank, device, seed=200) is True


def o_proj_weight(n: int, k: int, rank: int, device: torch.device) -> torch.Tensor:
    """This rank's random bf16 o_proj shard [n, k]."""
    g = torch.Generator(device=device).manual_seed(250 + rank)
    return (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(torch.bfloat16)


def publishing_matches(
    ctx, plain, publishing, pushing, rank: int, device: torch.device, seed: int, edges: bool = False
) -> bool | None:
    """The o_proj weight ``publishing`` (a GEMM callable ``(x, out)`` with ``publish``)
    paired with a new fused boundary that then only gathers, against ``plain`` (the same
    weight and plan, not publishing) with ``pushing`` (a boundary that pushes then
    gathers): the partial, the stream and the output the same bits, at 8, 3 and 1 rows,
    each path twice in turn (every generation's slots reused), then both in one graph
    replayed on new inputs. ``edges``: the 8-row draws carry an infinity or a NaN in x's
    last row (a NaN partial row, pushed canonicalized). None when the pairing did not
    take (the weight refused to publish, or ``pushing`` publishes)."""
    from types import SimpleNamespace

    from sparkdecode_cuda.boundary import CudaAttentionBoundary

    spec, k = ctx.spec, plain.w.shape[1]
    gathering = CudaAttentionBoundary(ctx, 0)
    gathering.pair_attention(SimpleNamespace(publish_partial=lambda mailbox: publishing.publish(mailbox)))
    if not gathering.published or pushing.published:
        return None
    mine = torch.Generator(device=device).manual_seed(seed + rank)
    shared = torch.Generator(device=device).manual_seed(seed)
    x = torch.empty(8, k, dtype=torch.bfloat16, device=device)
    stream0 = torch.empty(8, spec.H, device=device)

    def side(o_proj, boundary) -> tuple:
        partial, xf = (torch.empty(8, spec.H, dtype=torch.bfloat16, device=device) for _ in range(2))
        return o_proj, boundary, partial, torch.empty_like(stream0), xf

    sides = [side(plain, pushing), side(publishing, gathering)]

    def draw(rows: int) -> None:
        x.copy_(torch.randn(x.shape, generator=mine, device=device))
        if edges and rows == 8:
            x[7, rank % 4] = float("inf") if rank % 2 == 0 else float("nan")
        stream0.copy_(torch.randn(stream0.shape, generator=shared, device=device))

    def calls(rows: int) -> None:
        for o_proj, b, partial, stream, xf in sides:
            o_proj(x[:rows], partial[:rows])
            stream[:rows].copy_(stream0[:rows])
            b.run(partial[:rows], stream[:rows], xf[:rows])

    def same(rows: int) -> bool:
        (_, _, pa, sa, xa), (_, _, pb, sb, xb) = sides
        stream_same = torch.equal(sa[:rows].view(torch.int32), sb[:rows].view(torch.int32))
        return stream_same and same_bits(pa[:rows], pb[:rows]) and same_bits(xa[:rows], xb[:rows])

    ok = []
    for rows in (8, 3, 1):
        for _ in range(2):
            draw(rows)
            calls(rows)
            ok.append(same(rows))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls(8)
    for _ in range(3):
        draw(8)
        graph.replay()
        ok.append(same(8))
    return all(ok)


def cute_published_partial(
    rank: int, tp: int, init: str, out_dir: str, per_gpu: bool = False, weight: str = "TmaWeight"
) -> None:
    """cute.linear_tma's o_proj (``weight``: linear_tma's TmaWeight, or EvictFirstTmaWeight
    for cute.linear_tma_evict_first's) publishing its partial from the epilogue, then the cuda
    pack's fused boundary gathering only, against the same o_proj (the same plan) not
    publishing and the boundary pushing then gathering, as
    ``published_partial`` checks cuda.linear's: the partial, the stream and the output
    the same bits, at 8, 3 and 1 rows, each path twice in turn (every generation's
    slots reused), then both in one graph replayed on new inputs; at a tiny width
    (tiny up to TP 2, tiny-tp8 past it) and the real one (muse-spark-open). The 8-row
    draws carry an infinity or a NaN in x's last row (a NaN partial row, pushed
    canonicalized). Saves per width whether the o_proj published and whether all held."""
    from sparkdecode.spec import ModelSpec
    from sparkdecode_cuda.bench_collectives import context
    from sparkdecode_cuda.boundary import CudaAttentionBoundary
    from sparkdecode_cute import linear_tma

    weight_class = getattr(linear_tma, weight)

    def width(preset: str, sms: int, device: torch.device) -> tuple[bool, bool, tuple[int, int, int]]:
        spec = ModelSpec.preset(preset)
        ctx = context(spec, 8, tp, rank, device)
        k = spec.q_size // tp
        w = o_proj_weight(spec.H, k, rank, device)
        plain, publishing = weight_class("o_proj", w, 8, sms), weight_class("o_proj", w, 8, sms)
        assert plain.plan == publishing.plan, (plain.plan, publishing.plan)
        for o_proj in (plain, publishing):
            workspace = torch.zeros(max(1, o_proj.plan.workspace), device=device)
            o_proj.share(workspace, torch.zeros(o_proj.plan.tiles, dtype=torch.int32, device=device))
        matched = publishing_matches(ctx, plain, publishing, CudaAttentionBoundary(ctx, 0), rank, device, 300, True)
        return matched is not None, matched is True, (spec.H, k, plain.plan.splits)

    torch.set_num_threads(1)
    device = rank_device(rank, per_gpu)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=tp)
    try:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        widths = [width(preset, sms, device) for preset in ("tiny" if tp <= 2 else "tiny-tp8", "muse-spark-open")]
        published, published_ok, shapes = (list(column) for column in zip(*widths))
        results = {"published": published, "published_ok": published_ok, "shapes": shapes}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
