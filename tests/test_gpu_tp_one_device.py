"""Tensor parallelism on ONE GPU shared by 2, 4 and 8 processes (marker gpu): the
cuda pack's Lamport all-reduce and fused TP attention boundary over CUDA IPC between
processes of one device, the host side of the group over gloo (tp_gpu_worker.py).
The processes' kernels time-slice the GPU, so a rank spinning on a mailbox waits
for the others' turns: this checks correctness and liveness, not speed.

Asserted, per TP size:
- ``all_reduce`` variants (only the transport is the pack's): the executor equals
  the TP stock forward (the reference transport over gloo) bit for bit at every
  step, hidden and aux streams: the Lamport sum is the reference's fp32 rank-order
  sum with one rounding;
- ``moe_fused`` (cuda.moe's tail with the all-reduce fused in) equals
  ``moe_reference_transport`` (the same cuda.moe, its reductions over gloo) bit for
  bit: the Lamport sum is the reference transport's;
- ``fused`` variants (cuda.attention_boundary fused with the all-reduce, cuda.moe
  with its tail reductions on cuda.all_reduce) and ``fused_publish`` (also
  cuda.attention with cuda.linear, whose o_proj publishes the partial from its
  epilogue while the boundary only gathers): within 3e-2 relative per row of the
  stock forward at every step and greedy tokens agreeing where decided (the bound
  and the rule of test_gpu_cuda_pack.py: the kernels' row reductions sum in another
  order, one bf16 ulp here and there, over two layers, every expert routed);
  ``fused_publish`` 1,000 steps at TP 2, 100 at TP 4, 200 at TP 8, replaying one
  CUDA graph; ``fused_publish_cute`` (the same with cute.linear_tma's o_proj publishing,
  where the CuTe DSL is installed) 200 steps at TP 2, 50 at TP 8;
- ``device_gather`` (the transport ``cuda.all_reduce``: cuda.moe taking a column-sharded
  pooler's output over the Lamport mailbox inside the pre-expert norm's kernel,
  rmsnorm_columns_kernel, cuda.boundary and cuda.final a sharded unpooler's columns
  inside theirs, boundary_columns_kernel, whose row sums at the tiny H are
  boundary_kernel's; the GEMMs reference.linear's, which push nothing) equals
  ``gather_reference_transport`` (the same blocks gathering over gloo) bit for bit,
  eagerly at TP 2 with both sharded; replaying one CUDA graph at TP 2 (EP with both
  sharded, 20 steps; expert TP with the pooler alone, 6) and TP 8 (both, 6 steps)
  within the bound below; ``device_gather_publish`` (the same on cuda.linear, or
  cute.linear_tma where installed: the sharded pooler and unpooler pushing their
  columns from the GEMMs' epilogues, the pre-expert norm and every input and final
  boundary only taking them) replaying one graph at TP 2 (20 steps) and TP 8 (6 steps)
  within the bound below;
- every rank's hidden states (and first steps' aux streams) are the same bits;
- the TP output equals the TP-1 model within bf16 rounding (3e-2, test_tp.py's bound);
- no hang: each TP size runs under a watchdog that kills the ranks and fails.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]

pytest.importorskip("sparkdecode_cuda.lamport")

import tp_gpu_worker  # noqa: E402
from test_tp import relative_rows  # noqa: E402

WATCHDOG_S = 240  # per TP size; a hang fails the test instead of blocking CI


def variant(
    preset, experts, pins, steps, graph, shard_pooler=False, shard_unpooler=False, smooth=True, seed=1, same_as=None
):
    """``same_as``: the index of an earlier variant whose hidden states this one equals."""
    return dict(
        preset=preset,
        experts=experts,
        pins=pins,
        steps=steps,
        graph=graph,
        shard_pooler=shard_pooler,
        shard_unpooler=shard_unpooler,
        smooth=smooth,
        seed=seed,
        same_as=same_as,
    )


# cute.linear_tma's publishing o_proj runs where its pack and the CuTe DSL are installed.
CUTE = all(importlib.util.find_spec(m) is not None for m in ("sparkdecode_cute", "cutlass"))

# The column-sharded pooler/unpooler gather over the reference transport (gloo), which
# a CUDA graph cannot capture: those variants run eagerly.
CASES = {
    2: [
        variant("tiny", "ep", "all_reduce", 4, False, smooth=False),
        variant("tiny", "tp", "all_reduce", 4, False, shard_pooler=True, shard_unpooler=True),
        variant("tiny", "tp", "all_reduce", 6, True),
        variant("tiny", "ep", "moe_reference_transport", 4, False, smooth=False),
        variant("tiny", "ep", "moe_fused", 4, False, smooth=False, same_as=3),
        variant("tiny", "tp", "moe_reference_transport", 4, False, smooth=False),
        variant("tiny", "tp", "moe_fused", 4, False, smooth=False, same_as=5),
        variant("tiny", "ep", "fused", 6, False, shard_unpooler=True),
        variant("tiny", "tp", "fused", 6, True),
        variant("tiny", "tp", "fused_publish", 1000, True),
        *([variant("tiny", "tp", "fused_publish_cute", 200, True)] if CUTE else []),
        variant("tiny", "tp", "gather_reference_transport", 4, False, True, True, smooth=False),
        # the variant before (index 10, or 11 with the cute case)
        variant("tiny", "tp", "device_gather", 4, False, True, True, smooth=False, same_as=10 + int(CUTE)),
        variant("tiny", "ep", "device_gather", 20, True, True, True),
        variant("tiny", "tp", "device_gather", 6, True, shard_pooler=True),
        variant("tiny", "ep", "device_gather_publish", 20, True, True, True),
        *([variant("tiny", "tp", "device_gather_publish_cute", 20, True, True, True)] if CUTE else []),
    ],
    4: [
        variant("tiny-tp8", "ep", "all_reduce", 4, False, shard_pooler=True, shard_unpooler=True),
        variant("tiny-tp8", "tp", "fused_publish", 100, True),
    ],
    8: [
        variant("tiny-tp8", "tp", "all_reduce", 6, True),
        variant("tiny-tp8", "ep", "fused", 6, True),
        variant("tiny-tp8", "ep", "fused_publish", 200, True),
        *([variant("tiny-tp8", "ep", "fused_publish_cute", 50, True)] if CUTE else []),
        variant("tiny-tp8", "tp", "device_gather", 6, True, True, True),
        variant("tiny-tp8", "tp", "device_gather_publish", 6, True, True, True),
    ],
}


def watched(target, tp: int, tmp_path, *args) -> list[dict]:
    """``target(rank, tp, init, out_dir, *args)`` in ``tp`` processes under the watchdog;
    each rank's saved result."""
    init = f"file://{tmp_path / 'store'}"
    context = mp.start_processes(
        target, args=(tp, init, str(tmp_path), *args), nprocs=tp, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + WATCHDOG_S
    while not context.join(timeout=5):  # raises if a rank failed (and ends the others)
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"TP {tp}: no result after {WATCHDOG_S} s (a rank hung)")
    return [torch.load(os.path.join(tmp_path, f"rank{r}.pt"), weights_only=False) for r in range(tp)]


# The sharded gathers alone, a few steps each, so that a sanitizer run stays short.
GATHER_CASES = [
    variant("tiny", "tp", "gather_reference_transport", 2, False, True, True, smooth=False),
    variant("tiny", "tp", "device_gather", 2, False, True, True, smooth=False, same_as=0),
    variant("tiny", "ep", "device_gather", 3, True, True, True),
    variant("tiny", "ep", "device_gather_publish", 3, True, True, True),
]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_on_one_gpu(tp, tmp_path):
    check_variants(tp, CASES[tp], watched(tp_gpu_worker.main, tp, tmp_path, CASES[tp]))


def test_sharded_gathers_on_one_gpu(tmp_path):
    """The ``device_gather`` assertions on GATHER_CASES at TP 2 (what memcheck and
    racecheck run on rmsnorm_columns_kernel and boundary_columns_kernel, taking and
    pushing, and on the publishing epilogues)."""
    check_variants(2, GATHER_CASES, watched(tp_gpu_worker.main, 2, tmp_path, GATHER_CASES))


def check_variants(tp: int, cases: list[dict], ranks: list[dict]) -> None:
    """The assertions of the module docstring on each rank's runs of ``cases``."""
    for index, case in enumerate(cases):
        runs = [r["variants"][index] for r in ranks]
        print(f"TP {tp} {case['pins']} {case['experts']}: {case['steps']} steps in {runs[0]['seconds']:.1f} s")
        for run in runs:
            assert len(run["exact"]) == case["steps"]
            if case["pins"] == "all_reduce":
                assert all(run["exact"]), (case, run["exact"].index(False))
            else:
                assert run["error"].max() < 3e-2, (case, run["error"].max())
            if case["same_as"] is not None:
                twin = [r["variants"][case["same_as"]] for r in ranks][runs.index(run)]
                assert torch.equal(run["hidden"], twin["hidden"]), case
            assert all(run["agree"]), case
        first = runs[0]
        for other in runs[1:]:  # replicated values: the same bits on every rank
            assert torch.equal(first["hidden"], other["hidden"]), case
            for x, y in zip(first["aux"], other["aux"]):
                assert all(torch.equal(a, b) for a, b in zip(x, y)), case
        if case["smooth"]:
            for hidden, tp1 in zip(first["hidden"], first["tp1_hidden"]):
                assert relative_rows(hidden, tp1).max() < 3e-2, case


# The shapes a step reduces (tiny and real: [b, H], [b, P], [b, k, P]), a partial
# step and a short row, in turn so consecutive calls differ in size.
OP_SHAPES = [(8, 1024), (1, 8), (8, 16, 512), (3, 4096), (8, 8192), (5, 24), (8, 8, 4096), (8, 512)]


@pytest.mark.parametrize("tp", [2, 8])
def test_all_reduce_op_is_the_reference_transport(tp, tmp_path):
    """Bit for bit (NaN as NaN) on random bf16 with -0.0, infinities, NaN, overflow
    and subnormals, eagerly and replaying one graph of every shape 10 times. Then the
    fused kernels at the tiny and the real widths (tp_gpu_worker.fused_ops): the
    boundary within its kernel bounds, the MoE tail bit for bit, the o_proj publishing
    from its epilogue with the boundary only gathering bit for bit the same as the
    boundary pushing (tp_gpu_worker.published_partial), the same bits on every rank."""
    check_all_reduce_op(watched(tp_gpu_worker.all_reduce_op, tp, tmp_path, OP_SHAPES, 10))


def check_all_reduce_op(ranks: list[dict]) -> None:
    for r in ranks:
        assert len(r["checks"]) == 12 * len(OP_SHAPES) and all(r["checks"]), r["checks"]
        assert r["boundary_ok"] == [True, True] and r["tail_ok"] == [True] * 4, (r["boundary_ok"], r["tail_ok"])
        assert r["published_ok"] == [True, True], r["published_ok"]
    for r in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["replicated"], r["replicated"]))


def test_collectives_bench_writes_a_labelled_record(tmp_path):
    import json

    from sparkdecode_cuda import bench_collectives

    (path,) = bench_collectives.main(["--tp", "2", "--preset", "tiny", "--replays", "3", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    assert record["label"] == "one-GPU emulation, not a multi-GPU figure" and not record["speed_claim"]
    assert record["config"] == "collectives-one-gpu-tp2" and record["commit"] and record["gpu"]
    assert len(record["collectives"]) == 7
    for entry in record["collectives"].values():
        assert len(entry["per_call_us_by_rank"]) == 2 and entry["per_call_us_slowest_rank"] > 0
