"""providers_cute on the CPU: the providers say why they do not apply without a
Hopper GPU or the CuTe DSL (and resolve to the reference), and every GEMV kernel
of the step compiles for sm_90a at TP1 and TP8-rank shapes of Muse Spark."""

from __future__ import annotations

import dataclasses
import importlib
import math
import re

import pytest
import torch

from sparkdecode.deployment import detect
from sparkdecode.layout import resolve
from sparkdecode.plugins import discover
from sparkdecode.spec import ModelSpec
from sparkdecode_cute import common, plugin
from sparkdecode_cute.linear import CuteLinear

# Muse Spark's dense weights (H 8192, 128 q / 16 kv heads of 64, E 256, P 4096):
# name -> (N, K, fp32) at TP1 and on one rank of TP8.
TP1 = {
    "qkvg": (2 * 8192 + 2 * 1024, 8192, False),
    "o_proj": (8192, 8192, False),
    "router": (256, 8192, True),
    "pooler": (4096, 8192, False),
    "unpooler": (8192, 4096, False),
}
TP8 = {
    "qkvg": (2 * 1024 + 2 * 128, 8192, False),
    "o_proj": (8192, 1024, False),
    "router": (256, 8192, True),
    "pooler": (4096, 8192, False),
    "unpooler": (8192, 4096, False),
    "pooler_tp8_columns": (512, 8192, False),
    "unpooler_tp8_columns": (1024, 4096, False),
}


def _hopper(spec: ModelSpec, **changes):
    cpu = detect(spec, device="cpu")
    libraries = {**cpu.libraries, "cutlass": common.CUTLASS_DSL_VERSION}
    return dataclasses.replace(cpu, device="cuda", capability=(9, 0), libraries=libraries, **changes)


def test_registered():
    assert CuteLinear in plugin.PROVIDERS


def test_unsupported_reasons():
    spec = ModelSpec.preset("tiny")
    hopper = _hopper(spec)
    assert CuteLinear.unsupported(hopper) is None
    cpu = dataclasses.replace(hopper, device="cpu", capability=None)
    assert CuteLinear.unsupported(cpu) == "needs a CUDA GPU"
    ampere = dataclasses.replace(hopper, capability=(8, 0))
    assert "SM80" in CuteLinear.unsupported(ampere)
    blackwell = dataclasses.replace(hopper, capability=(10, 0))
    assert "sm_90a" in CuteLinear.unsupported(blackwell)
    missing = dataclasses.replace(hopper, libraries={**hopper.libraries, "cutlass": None})
    assert "nvidia-cutlass-dsl==4.8.1" in CuteLinear.unsupported(missing)
    other = dataclasses.replace(hopper, libraries={**hopper.libraries, "cutlass": "4.7.0"})
    assert "4.7.0" in CuteLinear.unsupported(other)
    assert "16 rows" in CuteLinear.unsupported(dataclasses.replace(hopper, max_rows=16))
    odd = dataclasses.replace(
        hopper, spec=dataclasses.replace(spec, hidden_size=1088, num_attention_heads=17, num_key_value_heads=1)
    )
    assert "hidden size 1088" in CuteLinear.unsupported(odd)


def test_resolves_to_the_reference_without_a_gpu():
    spec = ModelSpec.preset("tiny")
    registry = discover()
    layout = resolve(registry, detect(spec, device="cpu"))
    assert layout.provider("linear").name == "reference.linear"
    reasons = {c.name: c.reason for c in layout.choices["linear"].candidates}
    assert reasons["cute.linear"] == "needs a CUDA GPU"


@pytest.fixture(scope="module")
def gemv():
    return pytest.importorskip("sparkdecode_cute.gemv", reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.parametrize(
    "deployment,name", [("tp1", name) for name in TP1] + [("tp8", name) for name in TP8], ids=lambda v: str(v)
)
def test_gemv_compiles_for_hopper(gemv, deployment, name):
    n, k, fp32 = (TP1 if deployment == "tp1" else TP8)[name]
    plan = gemv.plan_gemv(n, k, fp32, 8)
    assert isinstance(plan, gemv.GemvPlan), plan
    assert plan.ctas * plan.rows == n and plan.threads * plan.loads * plan.vector == k
    assert gemv.compile_gemv(plan, "sm_90a") is not None


def test_plan_reasons(gemv):
    assert "K 1000" in gemv.plan_gemv(64, 1000, False, 8)
    assert "9 rows" in gemv.plan_gemv(64, 1024, False, 9)
    assert "16-byte" in gemv.plan_gemv(64, 1024, False, 8, w_stride=1030)
    assert "loads per thread" in gemv.plan_gemv(64, 65536, False, 8)


def test_splitk_is_registered():
    """cute.linear_splitk passed its GPU test (tests/test_gpu_cute_linear_v2.py)."""
    from sparkdecode_cute.linear_splitk import CuteLinearSplitK

    assert CuteLinearSplitK in plugin.PROVIDERS
    hopper = _hopper(ModelSpec.preset("tiny"))
    assert CuteLinearSplitK.unsupported(hopper) is None
    assert (
        CuteLinearSplitK.unsupported(dataclasses.replace(hopper, device="cpu", capability=None)) == "needs a CUDA GPU"
    )


@pytest.fixture(scope="module")
def splitk():
    return pytest.importorskip("sparkdecode_cute.gemv_splitk", reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.parametrize(
    "deployment,name", [("tp1", name) for name in TP1] + [("tp8", name) for name in TP8], ids=lambda v: str(v)
)
def test_splitk_compiles_for_hopper(splitk, deployment, name):
    """Every shape tiles exactly; a TP-8 rank's weights each run in one wave of an H200."""
    n, k, fp32 = (TP1 if deployment == "tp1" else TP8)[name]
    plan = splitk.plan_splitk(n, k, fp32, 8)
    assert isinstance(plan, splitk.SplitKPlan), plan
    assert plan.tiles * plan.tile_rows == n and plan.splits * plan.chunk == k
    assert plan.batches * plan.depth * plan.vector * splitk.K_LANES * splitk.WARPS == plan.chunk
    if deployment == "tp8":
        assert plan.ctas <= splitk.H200_SMS
    assert splitk.compile_splitk(plan, "sm_90a") is not None


@pytest.mark.parametrize("max_rows", [1, 3])
def test_splitk_compiles_for_fewer_rows(splitk, max_rows):
    for n, k, fp32 in (TP8["router"], TP8["qkvg"]):
        assert splitk.compile_splitk(splitk.plan_splitk(n, k, fp32, max_rows), "sm_90a") is not None


def test_splitk_plan_reasons(splitk):
    assert "K 1000" in splitk.plan_splitk(64, 1000, False, 8)
    assert "9 rows" in splitk.plan_splitk(64, 1024, False, 9)
    assert "16-byte" in splitk.plan_splitk(64, 1024, False, 8, w_stride=1030)
    assert "N 60" in splitk.plan_splitk(60, 1024, False, 8)


@pytest.mark.parametrize(
    "module,cls",
    [("linear_mma", "CuteLinearMma"), ("linear_tma", "CuteLinearTma"), ("linear_tma", "CuteLinearTmaEvictFirst")],
)
def test_tensor_core_linear_reasons(module, cls):
    """cute.linear_mma, cute.linear_tma and cute.linear_tma_evict_first are registered
    (their GPU tests and compute-sanitizer passed); their reasons are cute.linear's."""
    provider = getattr(importlib.import_module(f"sparkdecode_cute.{module}"), cls)
    assert provider in plugin.PROVIDERS
    hopper = _hopper(ModelSpec.preset("tiny"))
    assert provider.unsupported(hopper) is None
    assert provider.unsupported(dataclasses.replace(hopper, device="cpu", capability=None)) == "needs a CUDA GPU"
    assert "SM80" in provider.unsupported(dataclasses.replace(hopper, capability=(8, 0)))
    missing = dataclasses.replace(hopper, libraries={**hopper.libraries, "cutlass": None})
    assert "nvidia-cutlass-dsl==4.8.1" in provider.unsupported(missing)
    assert "16 rows" in provider.unsupported(dataclasses.replace(hopper, max_rows=16))


@pytest.fixture(scope="module")
def mma():
    return pytest.importorskip("sparkdecode_cute.gemv_mma", reason="nvidia-cutlass-dsl is not installed")


def _spill_free(capfd) -> None:
    """ptxas's report (``remarks{ptx}``) of the kernel just compiled: no local memory."""
    report = "".join(capfd.readouterr())
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report


BF16_SHAPES = [("tp1", name) for name, s in TP1.items() if not s[2]] + [
    ("tp8", name) for name, s in TP8.items() if not s[2]
]


@pytest.mark.parametrize("deployment,name", BF16_SHAPES, ids=lambda v: str(v))
def test_mma_compiles_for_hopper(mma, splitk, capfd, deployment, name):
    """Every bf16 shape tiles exactly, balanced over an H200's SMs, and compiles
    for sm_90a with no register spills (the fp32 router runs on gemv_splitk)."""
    n, k, _ = (TP1 if deployment == "tp1" else TP8)[name]
    plan = mma.plan_mma(n, k, 8)
    assert isinstance(plan, mma.MmaPlan), plan
    assert plan.tiles * plan.tile_rows == n and plan.splits * plan.chunk == k
    assert plan.batches * plan.depth * mma.STEP == plan.chunk
    assert 2 * plan.groups * plan.depth <= mma.MAX_BATCH_LOADS
    ctas_per_sm = plan.ctas / mma.H200_SMS
    assert ctas_per_sm / -(-plan.ctas // mma.H200_SMS) >= splitk.MIN_BALANCE
    capfd.readouterr()
    assert mma.compile_mma(plan, "sm_90a", "remarks{ptx}") is not None
    _spill_free(capfd)


@pytest.mark.parametrize("kernel", ["mma", "tma"])
@pytest.mark.parametrize("max_rows", [1, 3])
def test_tensor_core_gemvs_compile_for_fewer_rows(request, capfd, kernel, max_rows):
    """The MMA and TMA GEMVs compile spill-free for 1 and 3 rows too."""
    module = request.getfixturevalue(kernel)
    plan, compile_ = getattr(module, f"plan_{kernel}"), getattr(module, f"compile_{kernel}")
    for n, k, _ in (TP8["qkvg"], TP8["pooler_tp8_columns"]):
        capfd.readouterr()
        assert compile_(plan(n, k, max_rows), "sm_90a", "remarks{ptx}") is not None
        _spill_free(capfd)


def test_mma_plans(mma):
    """The planner's reasons, and its ranking: a TP-8 rank's o_proj, pooler and
    unpooler in one wave of 128 CTAs of 64 rows; tilings past the register batch or
    x's shared-memory chunk are never offered."""
    assert "K 1000" in mma.plan_mma(64, 1000, 8)
    assert "9 rows" in mma.plan_mma(64, 1024, 9)
    assert "16-byte" in mma.plan_mma(64, 1024, 8, w_stride=1030)
    assert "N 72" in mma.plan_mma(72, 1024, 8)
    for name in ("o_proj", "pooler", "unpooler"):
        plan = mma.plan_mma(*TP8[name][:2], 8)
        assert (plan.ctas, plan.tile_rows) == (128, 64), plan
    plans = mma.mma_plans(2304, 8192, 8)
    assert len(plans) > 4
    for plan in plans:
        assert 8 * plan.chunk * 2 <= mma.MAX_CHUNK_BYTES
        assert 2 * plan.groups * plan.depth <= mma.MAX_BATCH_LOADS


@pytest.fixture(scope="module")
def tma():
    return pytest.importorskip("sparkdecode_cute.gemv_tma", reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.parametrize("coresident", [False, True], ids=["plan", "coresident"])
@pytest.mark.parametrize("deployment,name", BF16_SHAPES, ids=lambda v: str(v))
def test_tma_compiles_for_hopper(tma, capfd, deployment, name, coresident):
    """Every bf16 shape tiles exactly, its shared memory fits a CTA (coresident: half an
    SM's, cute.linear_tma_coresident's plans, two CTAs an SM at least), and it compiles
    for sm_90a (TMA into the ring, wgmma.m64n8k16) with no register spills."""
    n, k, _ = (TP1 if deployment == "tp1" else TP8)[name]
    limit = tma.CORESIDENT_SMEM_BYTES if coresident else tma.CTA_SMEM_BYTES
    plan = tma.plan_tma(n, k, 8, max_smem=limit)
    assert isinstance(plan, tma.TmaPlan), plan
    assert plan.tiles * plan.tile_rows == n and plan.splits * plan.chunk == k
    assert plan.k_tiles * plan.stage_k == plan.chunk and 2 <= plan.stages <= plan.k_tiles
    assert plan.smem_bytes <= limit and plan.resident >= (2 if coresident else 1)
    capfd.readouterr()
    assert tma.compile_tma(plan, "sm_90a", "remarks{ptx}") is not None
    _spill_free(capfd)


def test_tma_plans(tma, splitk):
    """The planner's reasons, and its ranking: a TP-8 rank's o_proj, pooler and
    unpooler balanced over an H200's SMs with the weight of every SM's CTAs in
    flight in shared memory; no tiling past a CTA's shared memory or below
    ``MIN_CTA_BYTES`` a split CTA is offered."""
    assert "K 1000" in tma.plan_tma(64, 1000, 8)
    assert "9 rows" in tma.plan_tma(64, 1024, 9)
    assert "16-byte" in tma.plan_tma(64, 1024, 8, w_stride=1030)
    assert "N 72" in tma.plan_tma(72, 1024, 8)
    for name in ("o_proj", "pooler", "unpooler"):
        plan = tma.plan_tma(*TP8[name][:2], 8)
        per_sm = -(-plan.ctas // tma.H200_SMS)
        assert plan.ctas / tma.H200_SMS / per_sm >= splitk.MIN_BALANCE, plan
        assert per_sm <= plan.resident, plan
        assert plan.stages * plan.stage_bytes >= 64 * 1024, plan
    plans = tma.tma_plans(2304, 8192, 8)
    assert len(plans) > 4
    for plan in plans:
        assert plan.smem_bytes <= tma.CTA_SMEM_BYTES
        assert plan.stages * plan.stage_bytes <= tma.RING_BYTES
        assert plan.splits == 1 or plan.tile_rows * plan.chunk * 2 >= tma.MIN_CTA_BYTES


@pytest.mark.parametrize("max_rows", [1, 4, 8])
def test_router_fits_beside_the_pooler(tma, splitk, max_rows):
    """cute.linear_tma's router plan: every CTA on its own SM beside one of the pooler's
    (1 an SM at Muse Spark's shapes), within the SM's shared memory; the planner's first
    plan at 8 rows (a 64 KB chunk of x) does not fit there. The plan compiles for sm_90a."""
    from sparkdecode_cute.linear_tma import CuteLinearTma, TmaWeight

    n, k, _ = TP8["pooler"]
    pooler = TmaWeight.__new__(TmaWeight)
    pooler.plan = tma.plan_tma(n, k, max_rows)
    router = torch.empty(256, 8192)
    plan = CuteLinearTma.router_plan("router", router, {"pooler": pooler}, max_rows, tma.H200_SMS)
    assert isinstance(plan, splitk.SplitKPlan) and plan.weight_fp32 and (plan.n, plan.k) == (256, 8192)
    assert pooler.plan.resident == 1 and plan.ctas <= tma.H200_SMS
    beside = pooler.plan.smem_bytes + plan.smem_bytes + 2 * splitk.CTA_RESERVED_BYTES
    assert beside <= tma.SM_SMEM_BYTES, (pooler.plan, plan)
    assert plan in splitk.splitk_plans(256, 8192, True, max_rows)
    if max_rows == 8:
        default = splitk.plan_splitk(256, 8192, True, 8)
        assert pooler.plan.smem_bytes + default.smem_bytes + 2 * splitk.CTA_RESERVED_BYTES > tma.SM_SMEM_BYTES
    assert splitk.compile_splitk(plan, "sm_90a") is not None
    assert CuteLinearTma.router_plan("router", router, {}, max_rows, tma.H200_SMS) is None


# The o_proj of one rank of preset muse-spark-open at TP 8, 4, 2 (N 8192) and of the
# tiny presets (tiny at TP 2; tiny-tp8 at TP 8 and 4): the shapes cute.linear_tma publishes
# from its epilogue.
PUBLISHED_SHAPES = [(8192, 1024), (8192, 2048), (8192, 4096), (1024, 512), (4096, 512), (4096, 1024)]


def _keep_ptx(directory) -> str:
    """``cute.compile`` options keeping the PTX (in ``directory``, written there)."""
    return f"--keep-ptx --dump-dir {directory}"


@pytest.mark.parametrize("n,k", PUBLISHED_SHAPES, ids=lambda v: str(v))
def test_publishing_tma_compiles_for_hopper(tma, capfd, tmp_path, n, k):
    """The published epilogue (gemv_tma.PublishingTmaGemv) takes the planner's own
    tiling of every o_proj shape (the same sums as cute.linear_tma's) and compiles for
    sm_90a with no register spills: the output in 16-byte stores, one fence.acq_rel.sys
    and the pushes as st.volatile.global.v4.u32 (one per possible peer), the generation
    read by ld.volatile."""
    plan = tma.plan_tma(n, k, 8)
    assert all(tma.publish_reason(p) is None for p in tma.tma_plans(n, k, 8))
    capfd.readouterr()
    ptx = tma.compile_tma_publishing(plan, "sm_90a", f"remarks{{ptx}} {_keep_ptx(tmp_path)}").artifacts.PTX
    _spill_free(capfd)
    assert ptx.count("st.volatile.global.v4.u32") == tma.MAX_TP
    assert ptx.count("fence.acq_rel.sys") == 1 and ptx.count("ld.volatile.global.u32") == 1
    assert "st.global.v4.b32" in ptx and "griddepcontrol.wait" in ptx


@pytest.mark.parametrize("max_rows", [1, 3])
def test_publishing_tma_compiles_for_fewer_rows(tma, capfd, max_rows):
    for n, k in PUBLISHED_SHAPES[:2]:
        capfd.readouterr()
        assert tma.compile_tma_publishing(tma.plan_tma(n, k, max_rows), "sm_90a", "remarks{ptx}") is not None
        _spill_free(capfd)


def test_registered_tma_does_not_publish(tma, tmp_path):
    """cute.linear_tma's kernel (the flag off) has no push, fence.acq_rel.sys or
    volatile access."""
    for n, k in PUBLISHED_SHAPES[:2]:
        ptx = tma.compile_tma(tma.plan_tma(n, k, 8), "sm_90a", _keep_ptx(tmp_path)).artifacts.PTX
        assert "volatile" not in ptx and "fence.acq_rel.sys" not in ptx


def carveouts(compiled) -> list:
    """The launch attributes a compiled kernel sets on its functions (name, value)."""
    return [(a.name, v) for kernel in compiled.kernel_info.values() for a, v in kernel.items()]


def _pooler_and_router(tma) -> tuple:
    """A TP-8 rank's pooler (a TmaWeight holding only its 8-row plan) and the router's
    split-K plan that cute.linear_tma takes beside it on an H200."""
    from sparkdecode_cute.linear_tma import CuteLinearTma, TmaWeight

    n, k, _ = TP8["pooler"]
    pooler = TmaWeight.__new__(TmaWeight)
    pooler.plan = tma.plan_tma(n, k, 8)
    return pooler, CuteLinearTma.router_plan("router", torch.empty(256, 8192), {"pooler": pooler}, 8, tma.H200_SMS)


def test_traced_kernels_record_each_cta(tma, splitk, tmp_path):
    """scripts/beside-trace's kernels (``trace``): the pooler's TMA GEMV and the router's
    split-K plan beside it compile for sm_90a with %smid and %globaltimer read (at the
    start, the release and the end; the router also once x is staged and once thread 0
    has its products); the registered kernels read neither and set no launch attribute (the carveout is the
    driver's). The records sit past the tile counters, 32-byte
    aligned, a record of TRACE_WORDS words a CTA."""
    pooler, router = _pooler_and_router(tma)
    kernels = [
        (tma.TracedTmaGemv(pooler.plan), tma.TmaGemv(pooler.plan)),
        (splitk.TracedSplitKGemv(router), splitk.SplitKGemv(router)),
    ]
    for d in ("t", "r"):
        (tmp_path / d).mkdir()

    for (traced, registered), times in zip(kernels, (3, 5), strict=True):
        ptx = splitk.compile_split(traced, "sm_90a", _keep_ptx(tmp_path / "t")).artifacts.PTX
        assert "%smid" in ptx and ptx.count("%globaltimer") == times
        compiled = splitk.compile_split(registered, "sm_90a", _keep_ptx(tmp_path / "r"))
        assert "%smid" not in compiled.artifacts.PTX and "%globaltimer" not in compiled.artifacts.PTX
        assert carveouts(compiled) == []  # the driver's choice
    for plan in (pooler.plan, router):
        assert splitk.trace_offset(plan.tiles) % 8 == 0 and splitk.trace_offset(plan.tiles) >= plan.tiles
        assert splitk.trace_counters(plan) == splitk.trace_offset(plan.tiles) + splitk.TRACE_WORDS * plan.ctas


def test_beside_trace_forms_compile(tma, splitk):
    """scripts/beside-trace's ``nopdl`` and ``small`` forms: a kernel whose ``pdl`` is off
    launches without PDL (every registered kernel with it) and compiles for sm_90a; the
    pooler's plan a ring buffer shorter takes 32 KB less shared memory and compiles too."""
    from dataclasses import replace

    pooler, router = _pooler_and_router(tma)
    assert splitk.SplitKGemv(router).launch_options() == {"use_pdl": True}
    assert tma.TmaGemv(pooler.plan).launch_options() == {"use_pdl": True}
    assert splitk.formed(splitk.SplitKGemv) is splitk.SplitKGemv  # nothing to change
    nopdl = splitk.formed(splitk.TracedSplitKGemv, pdl=False)(router)
    assert nopdl.launch_options() == {"use_pdl": False}
    assert splitk.compile_split(nopdl, "sm_90a") is not None
    small = replace(pooler.plan, stages=pooler.plan.stages - 1)
    assert pooler.plan.smem_bytes - small.smem_bytes == 32 * 1024
    assert splitk.compile_split(tma.TracedTmaGemv(small), "sm_90a") is not None


def test_registered_linear_tma_publishes():
    """The registered cute.linear_tma and cute.linear_tma_evict_first offer ``publish``
    (checked on one GPU by tests/test_gpu_cute_publish.py), so the cuda pack's attention
    can ask them for the o_proj; the evict-first weight publishes from its own hinted kernel."""
    from sparkdecode_cute import gemv_tma
    from sparkdecode_cute.linear_tma import CuteLinearTma, CuteLinearTmaEvictFirst, EvictFirstTmaWeight, TmaWeight

    for provider in (CuteLinearTma, CuteLinearTmaEvictFirst):
        assert provider in plugin.PROVIDERS and callable(getattr(provider, "publish", None))
    assert CuteLinearTmaEvictFirst.priority > CuteLinearTma.priority
    assert CuteLinearTmaEvictFirst.bf16_weight is EvictFirstTmaWeight
    assert EvictFirstTmaWeight.compile_publishing is not TmaWeight.compile_publishing
    assert gemv_tma.EvictFirstPublishingTmaGemv.weight_cache_hint == gemv_tma.EVICT_FIRST


def _mailbox(tp: int = 2, rank: int = 1, capacity: int = 8 * 1024, **changes):
    """A stand-in for the cuda pack's LamportWorkspace (the attributes publish reads)."""
    from types import SimpleNamespace

    fields = dict(
        peers=torch.arange(tp, dtype=torch.int64) * 2**20 + 2**30,
        control=torch.zeros(4, dtype=torch.int32),
        rank=rank,
        tp=tp,
        capacity=capacity,
    )
    return SimpleNamespace(**{**fields, **changes})


@pytest.fixture
def publishing_linear(tma, monkeypatch):
    """cute.linear_tma built on the CPU for tiny's layer shapes at TP 2 (o_proj
    1024 x 512), the kernels compiled for sm_90a."""
    from types import SimpleNamespace

    from sparkdecode_cute import gemv_splitk
    from sparkdecode_cute.linear_splitk import SplitKWeight
    from sparkdecode_cute.linear_tma import CuteLinearTma, TmaWeight

    # Each weight's compile for sm_90a (by default the DSL's arch, read once a process).
    hooks = (
        (SplitKWeight, "compile", lambda plan: gemv_splitk.compile_splitk(plan, "sm_90a")),
        (TmaWeight, "compile", lambda plan: tma.compile_tma(plan, "sm_90a")),
        (TmaWeight, "compile_publishing", lambda plan: tma.compile_tma_publishing(plan, "sm_90a")),
    )
    for cls, name, compile_ in hooks:
        monkeypatch.setattr(cls, name, staticmethod(compile_))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    g = torch.Generator().manual_seed(0)
    shapes = {"qkvg": (1280, 1024), "o_proj": (1024, 512), "router": (64, 1024), "pooler": (512, 1024)}
    layer = {
        name: torch.randn(n, k, generator=g).to(torch.float32 if name == "router" else torch.bfloat16)
        for name, (n, k) in {**shapes, "unpooler": (1024, 512)}.items()
    }
    buffers: dict = {}
    ctx = SimpleNamespace(
        max_rows=8,
        layer=lambda index: SimpleNamespace(**layer),
        scratch=lambda name, shape, dtype: buffers.setdefault(name, torch.zeros(shape, dtype=dtype)),
    )
    return CuteLinearTma(ctx, 0)


def test_publish_refuses_what_it_cannot_publish(publishing_linear):
    """``publish`` refuses the fp32 router, a slot smaller than max_rows x N, and what
    is not a mailbox; then switches o_proj to the published kernel, its pointers after
    the workspace and counters the mailbox's (kept if the scratch is shared again)."""
    from sparkdecode_cute.linear_tma import TmaWeight

    linear = publishing_linear
    o_proj = linear.weights["o_proj"]
    assert isinstance(o_proj, TmaWeight) and not isinstance(linear.weights["router"], TmaWeight)
    plain = o_proj.kernel
    assert not linear.publish("router", _mailbox())
    assert not linear.publish("o_proj", _mailbox(capacity=8 * 1024 - 8))
    assert not linear.publish("o_proj", _mailbox(peers=torch.zeros(2, dtype=torch.int32)))
    assert not linear.publish("o_proj", _mailbox(tp=9, peers=torch.zeros(9, dtype=torch.int64)))
    assert not linear.publish("o_proj", object())
    assert o_proj.mailbox is None and o_proj.kernel is plain and len(o_proj.buffers) == 2
    mailbox = _mailbox()
    assert linear.publish("o_proj", mailbox)
    assert o_proj.mailbox is mailbox and o_proj.kernel is not plain and len(o_proj.buffers) == 7
    o_proj.share(*o_proj.shared)
    assert len(o_proj.buffers) == 7
    assert not linear.weights["qkvg"].mailbox  # only the weight asked for


def test_coresident_linear_plans_within_half_an_sm(tma):
    """cute.linear_tma_coresident (unregistered) plans each TP8-rank weight within half an
    SM's shared memory, where the registered planner takes 1 CTA an SM for the o_proj,
    pooler and unpooler; a shape whose smallest ring does not fit there is refused by name."""
    from sparkdecode_cute.linear_tma import CoresidentTmaWeight, CuteLinearTmaCoresident

    assert (
        CuteLinearTmaCoresident not in plugin.PROVIDERS and CuteLinearTmaCoresident.bf16_weight is CoresidentTmaWeight
    )
    for name in ("o_proj", "pooler", "unpooler"):
        n, k, _ = TP8[name]
        assert tma.plan_tma(n, k, 8).resident == 1
        w = torch.empty(n, k, dtype=torch.bfloat16)
        plan = CoresidentTmaWeight.make_plan(w, False, 8, 132)
        assert plan.smem_bytes <= tma.CORESIDENT_SMEM_BYTES and plan.resident >= 2, (name, plan)
    assert "do not fit 4096 bytes" in tma.plan_tma(8192, 1024, 8, max_smem=4096)


def test_set_carveout_needs_a_loaded_kernel():
    """``set_carveout`` (scripts/beside-trace's carve forms) refuses a kernel the DSL has
    not loaded yet (no library to set the attribute on), and ``loaded_kernels`` finds none
    there."""
    from types import SimpleNamespace

    pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    unloaded = SimpleNamespace(jit_module=SimpleNamespace(cuda_library=[]))
    assert common.loaded_kernels(unloaded) == [] and common.loaded_kernels(object()) == []
    with pytest.raises(RuntimeError, match="not loaded"):
        common.set_carveout(unloaded, 100, 0)


def _tma_load_policies(ptx: str) -> set[int]:
    """The policy words a PTX's TMA loads take (their last operand, moved in as a constant)."""
    moved = dict(re.findall(r"mov\.b64\s+(%rd\d+), (-?\d+);", ptx))
    loads = re.findall(r"cp\.async\.bulk\.tensor\.[^;]*L2::cache_hint[^;]*, (%rd\d+);", ptx)
    assert loads and all(r in moved for r in loads)
    return {int(moved[r]) for r in loads}


def test_evict_first_tma_hints_only_the_weight_loads(tma, tmp_path):
    """cute.linear_tma_evict_first's kernel: the weight's TMA loads carry CUTLASS's
    evict-first L2 policy word, where cute.linear_tma's carry the DSL's default word 0;
    the MMAs are the same."""
    plan = tma.plan_tma(4096, 8192, 8)
    for d in ("r", "e"):
        (tmp_path / d).mkdir()
    registered = tma.compile_tma(plan, "sm_90a", _keep_ptx(tmp_path / "r")).artifacts.PTX
    hinted = tma.compile_tma(plan, "sm_90a", _keep_ptx(tmp_path / "e"), cls=tma.EvictFirstTmaGemv).artifacts.PTX
    assert _tma_load_policies(registered) == {0}
    assert _tma_load_policies(hinted) == {tma.EVICT_FIRST}
    assert hinted.count("wgmma.mma_async") == registered.count("wgmma.mma_async") > 0


def test_shallow_tma_loads_one_buffer_before_the_wait(tma, tmp_path, monkeypatch):
    """cute.linear_tma_evict_first_shallow (not registered): the qkvg's and the pooler's
    kernels issue one TMA load of the weight before griddepcontrol.wait, where the
    registered kernels fill the ring; the other weights take the registered evict-first
    kernel; the loads' policy words and the MMAs are the same."""
    from sparkdecode_cute import linear_tma
    from sparkdecode_cute.linear_tma import (
        SHALLOW_WEIGHTS,
        CuteLinearTmaEvictFirstShallow,
        EvictFirstTmaWeight,
        ShallowEvictFirstTmaWeight,
    )

    assert CuteLinearTmaEvictFirstShallow not in plugin.PROVIDERS
    assert CuteLinearTmaEvictFirstShallow.bf16_weight is ShallowEvictFirstTmaWeight
    assert SHALLOW_WEIGHTS == {"qkvg", "pooler"}
    plan = tma.plan_tma(4096, 8192, 8)
    assert plan.stages > 1 and plan.k_tiles > plan.stages, plan
    for d in ("r", "s"):
        (tmp_path / d).mkdir()
    full = tma.compile_tma(plan, "sm_90a", _keep_ptx(tmp_path / "r"), cls=tma.EvictFirstTmaGemv).artifacts.PTX
    shallow = tma.compile_tma(plan, "sm_90a", _keep_ptx(tmp_path / "s"), cls=tma.ShallowEvictFirstTmaGemv)
    shallow = shallow.artifacts.PTX

    def before_wait(ptx: str) -> int:
        return ptx[: ptx.index("griddepcontrol.wait")].count("cp.async.bulk.tensor")

    boxes = plan.stage_k // tma.SWIZZLE_K  # a buffer's TMA loads: one a 128-byte swizzled box of K
    assert (before_wait(full), before_wait(shallow)) == (plan.stages * boxes, boxes)
    assert _tma_load_policies(shallow) == _tma_load_policies(full) == {tma.EVICT_FIRST}
    assert shallow.count("wgmma.mma_async") == full.count("wgmma.mma_async") > 0

    # Which compiled kernel each weight takes (the cache's key, nothing compiled).
    monkeypatch.setattr(linear_tma, "compiled", lambda key, make: key[0])
    weight = ShallowEvictFirstTmaWeight.__new__(ShallowEvictFirstTmaWeight)
    for name in ("qkvg", "o_proj", "pooler", "unpooler"):
        weight.name = name
        shallow_kernel = name in SHALLOW_WEIGHTS
        assert weight.compile(plan) == ("gemv_tma_evict_first_shallow" if shallow_kernel else "gemv_tma_evict_first")
    assert EvictFirstTmaWeight.compile(plan) == "gemv_tma_evict_first"


def test_evict_first_publishing_tma_hints_the_weight_loads(tma, tmp_path):
    """cute.linear_tma_evict_first's published epilogue: the weight's TMA loads hinted as
    its plain kernel's, the pushes and MMAs those of cute.linear_tma's published kernel."""
    plan = tma.plan_tma(*PUBLISHED_SHAPES[0], 8)
    for d in ("r", "e"):
        (tmp_path / d).mkdir()
    registered = tma.compile_tma_publishing(plan, "sm_90a", _keep_ptx(tmp_path / "r")).artifacts.PTX
    hinted = tma.compile_tma_publishing(
        plan, "sm_90a", _keep_ptx(tmp_path / "e"), cls=tma.EvictFirstPublishingTmaGemv
    ).artifacts.PTX
    assert _tma_load_policies(registered) == {0}
    assert _tma_load_policies(hinted) == {tma.EVICT_FIRST}
    for op in ("wgmma.mma_async", "st.volatile.global.v4.u32", "fence.acq_rel.sys"):
        assert hinted.count(op) == registered.count(op) > 0, op


@pytest.mark.parametrize("rows,splits", [(1, 4), (4, 16), (8, 64)])
def test_x_first_router_issues_its_x_loads_at_once(splitk, capfd, tmp_path, rows, splits):
    """gemv_splitk's XFirstSplitKGemv (cute.linear_tma_evict_first_x_first's router): after
    the PDL wait every load of the thread's x vectors comes before a barrier and its first
    shared store, with no spills, at the planner's router plan (the column-sharded cut's),
    the one beside the replicated pooler and the most split; SplitKGemv stores the first
    vector before its second load. Neither registered linear takes it."""
    from sparkdecode_cute import linear_splitk, linear_tma, plugin

    plan = next(p for p in splitk.splitk_plans(256, 8192, True, 8) if (p.rows, p.splits) == (rows, splits))
    rounds = math.ceil(plan.max_rows * (plan.chunk // 8) / plan.threads)  # x vectors a thread

    def after_wait(cls: type, directory: str) -> str:
        (tmp_path / directory).mkdir()
        ptx = splitk.compile_split(cls(plan), "sm_90a", f"remarks{{ptx}} {_keep_ptx(tmp_path / directory)}")
        return ptx.artifacts.PTX.split("griddepcontrol.wait;", 1)[1]

    capfd.readouterr()
    staged = after_wait(splitk.XFirstSplitKGemv, "x").split("st.shared", 1)[0]
    _spill_free(capfd)
    assert staged.count("ld.global") == rounds and "bar.sync" in staged
    registered = after_wait(splitk.SplitKGemv, "r").split("st.shared", 1)[0]
    assert registered.count("ld.global") == 1 and "bar.sync" not in registered
    assert linear_tma.CuteLinearTmaEvictFirstXFirst.router_weight is linear_splitk.XFirstSplitKWeight
    assert linear_tma.CuteLinearTmaEvictFirstXFirst.bf16_weight is linear_tma.XFirstEvictFirstTmaWeight
    assert linear_tma.CuteLinearTmaEvictFirst.router_weight is linear_splitk.SplitKWeight
    assert linear_tma.CuteLinearTmaEvictFirstXFirst not in plugin.PROVIDERS
    if rows == 1:  # beside-trace's --router-x-first: the same staging, traced
        (tmp_path / "t").mkdir()
        traced = splitk.compile_split(splitk.TracedXFirstSplitKGemv(plan), "sm_90a", _keep_ptx(tmp_path / "t"))
        assert traced.artifacts.PTX.count("%globaltimer") == 5


@pytest.mark.parametrize("n,k", [(4096, 8192), (8192, 4096), (1024, 4096)], ids=lambda v: str(v))
def test_x_first_tma_issues_its_x_loads_at_once(tma, capfd, tmp_path, n, k):
    """gemv_tma's XFirstEvictFirstTmaGemv (cute.linear_tma_evict_first_x_first's bf16
    weights) and its published form: after the PDL wait every load of the thread's x
    vectors comes before a barrier and its first shared store, with no spills, for the
    replicated pooler and unpooler (16 loads a thread) and the sharded unpooler (2);
    EvictFirstTmaGemv stores before its last load where a thread has 16."""
    plan = tma.plan_tma(n, k, 8)
    rounds = math.ceil(tma.MMA_N * (plan.k // plan.splits // 8) / plan.threads)  # x vectors a thread

    def after_wait(ptx: str) -> str:
        return ptx.split("griddepcontrol.wait;", 1)[1].split("st.shared", 1)[0]

    capfd.readouterr()
    (tmp_path / "x").mkdir()
    ptx = tma.compile_tma(
        plan, "sm_90a", f"remarks{{ptx}} {_keep_ptx(tmp_path / 'x')}", cls=tma.XFirstEvictFirstTmaGemv
    )
    _spill_free(capfd)
    staged = after_wait(ptx.artifacts.PTX)
    assert staged.count("ld.global") == rounds and "bar.sync" in staged
    if tma.publish_reason(plan) is None:
        (tmp_path / "p").mkdir()
        opts = f"remarks{{ptx}} {_keep_ptx(tmp_path / 'p')}"
        published = tma.compile_tma_publishing(plan, "sm_90a", opts, cls=tma.XFirstEvictFirstPublishingTmaGemv)
        _spill_free(capfd)
        assert after_wait(published.artifacts.PTX).count("ld.global") == rounds
    if rounds == 16:
        (tmp_path / "r").mkdir()
        registered = tma.compile_tma(plan, "sm_90a", _keep_ptx(tmp_path / "r"), cls=tma.EvictFirstTmaGemv)
        assert after_wait(registered.artifacts.PTX).count("ld.global") < rounds
