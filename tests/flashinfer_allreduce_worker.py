"""One rank of test_gpu_flashinfer_allreduce.py: ``flashinfer.trtllm_all_reduce``
built from a BuildContext over this rank's TP group, run eagerly and in one
replayed CUDA graph on the shapes the blocks all-reduce, each result checked
against the rank-order fp32 sum of every rank's input (each rank draws every
rank's input from the same seeds). What the test asserts on is saved for the parent."""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from sparkdecode.deployment import detect
from sparkdecode.protocols import BuildContext
from sparkdecode.spec import ModelSpec
from sparkdecode_flashinfer import allreduce
from sparkdecode_flashinfer.allreduce import FlashInferAllReduce

ROWS = 8
REPLAYS = 3


def shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    """Attention partials [b, H], the MoE tail's route rows [b, k, P] (expert TP) and
    partials [b, P] (EP), at several row counts."""
    return [(1, spec.H), (3, spec.H), (ROWS, spec.H), (2, spec.top_k, spec.P), (ROWS, spec.top_k, spec.P), (5, spec.P)]


def draw(shape: tuple[int, ...], seed: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input: random rows, and in the first row the cases a sum can get
    wrong: -0.0 on every rank (the kernel's sentinel), -0.0 on some ranks, exact
    cancellation between ranks, large values next to small ones, and a sum whose
    result depends on the order of its terms."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(shape, generator=g) * 4
    row = x.view(-1, shape[-1])[0]
    row[0:64] = -0.0
    row[64:128] = -0.0 if rank % 2 else 0.0
    row[128:192] = 3.0 if rank % 2 else -3.0
    row[192:256] = 1e4 if rank == 0 else 1e-3
    # Order-sensitive from three ranks on: 2^24 + 1 - 2^24 is 0 in fp32 in rank order
    # (2^24 + 1 rounds to 2^24), 1 summed from the last rank down.
    row[256:320] = (2.0**24, 1.0, -(2.0**24))[rank] if rank < 3 else 0.25
    return x.to(torch.bfloat16)


def expected(shape: tuple[int, ...], seed: int, tp: int) -> torch.Tensor:
    """The reference transport's sum (comm.Collectives.all_reduce): fp32 in rank order,
    rounded to bf16 once."""
    total = draw(shape, seed, 0).float()
    for r in range(1, tp):
        total = total + draw(shape, seed, r).float()
    return total.to(torch.bfloat16)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Bits that differ, apart from a -0.0 sum the kernel gives as +0.0 (its -0.0 is
    the not-arrived mark: it sends -0.0 inputs as +0.0)."""
    o, r = out.cpu().view(torch.int16), ref.view(torch.int16)
    negative_zero = r == torch.tensor(-0.0, dtype=torch.bfloat16).view(torch.int16)
    return {
        "differ": int(((o != r) & ~negative_zero).sum()),
        "negative_zero_sums": int(negative_zero.sum()),
        "zero_where_negative_zero": bool((out.cpu()[negative_zero] == 0).all()),
        "out": out.cpu().clone(),
    }


def run_checks(rank: int, tp: int, device: torch.device) -> dict:
    spec = ModelSpec.preset("muse-spark-open", 2)
    ctx = BuildContext(
        spec=spec,
        weights=SimpleNamespace(layers=[]),
        tp=tp,
        rank=rank,
        device=device,
        group=dist.group.WORLD,
        deployment=detect(spec, tp, device, max_rows=ROWS),
        buffers={},
        aux_layers=(),
        max_rows=ROWS,
        max_context=4096,
        mailboxes=[],
        ops={},
    )
    # As the executor builds: the collective setup first, then each layer's build
    # finds its workspace (made once).
    made = []
    create = allreduce.create_workspace
    allreduce.create_workspace = lambda c: made.append(c) or create(c)
    try:
        FlashInferAllReduce.collective_setup(ctx)
        op = FlashInferAllReduce.build(ctx, None)
        shared = FlashInferAllReduce.build(ctx, None).workspace is op.workspace and len(made) == 1
    finally:
        allreduce.create_workspace = create
    made.clear()
    cases = shapes(spec)
    eager = []
    for seed, shape in enumerate(cases):
        x = draw(shape, seed, rank).to(device)
        op.run(x)
        torch.cuda.synchronize(device)
        eager.append(compare(x, expected(shape, seed, tp)))

    # One graph of the sequence two layers run (H, route rows, P, twice), replayed
    # with new inputs: the Lamport buffers rotate over the replays.
    order = [(ROWS, spec.H), (ROWS, spec.top_k, spec.P), (ROWS, spec.P)] * 2
    buffers = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for shape in order]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b in buffers:
            op.run(b)
    replayed = []
    for replay in range(REPLAYS):
        seeds = [100 + replay * len(order) + i for i in range(len(order))]
        for b, shape, seed in zip(buffers, order, seeds, strict=True):
            b.copy_(draw(shape, seed, rank))
        graph.replay()
        torch.cuda.synchronize(device)
        replayed += [compare(b, expected(s, seed, tp)) for b, s, seed in zip(buffers, order, seeds, strict=True)]
    # The workspace's memory goes back to FlashInfer once nothing holds it.
    from flashinfer.comm import trtllm_ar

    handles = id(op.workspace.ipc_handles)
    held = handles in trtllm_ar._symm_workspace_refs
    del op, graph, ctx
    gc.collect()
    released = held and handles not in trtllm_ar._symm_workspace_refs
    return {"shared_workspace": shared, "released": released, "eager": eager, "graph": replayed}


def main(rank: int, tp: int, init: str, out_dir: str, one_gpu: bool) -> None:
    """One rank: every rank on GPU 0 over a gloo group (``one_gpu``), or rank r on GPU r
    over NCCL."""
    device = torch.device("cuda", 0 if one_gpu else rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo" if one_gpu else "nccl", init_method=init, rank=rank, world_size=tp)
    try:
        torch.save(run_checks(rank, tp, device), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
