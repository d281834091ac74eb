"""providers_cuda: every kernel compiles with NVRTC (on the CPU too), the providers
say why they do not apply off Hopper, and on a GPU each equals the reference."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from sparkdecode.deployment import detect
from sparkdecode.spec import ModelSpec

nvrtc = pytest.importorskip("sparkdecode_cuda.nvrtc")
if nvrtc.nvrtc_unavailable() is not None:
    pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}", allow_module_level=True)

from ptxas_check import assert_spill_free  # noqa: E402

from sparkdecode_cuda import all_reduce, attention, boundary, lamport, moe  # noqa: E402
from sparkdecode_cuda.launch import i32, i64, ptr  # noqa: E402


class PublishingLinear:
    """A linear provider's ``publish`` as the blocks ask it: records each ask, answers
    ``answer``."""

    def __init__(self, answer: bool):
        self.answer, self.calls = answer, []

    def publish(self, name: str, mailbox: object) -> bool:
        self.calls.append((name, mailbox))
        return self.answer


@pytest.mark.parametrize("hidden", [1024, 2048, 4096, 8192])
def test_boundary_kernel_compiles_for_hopper(hidden, tmp_path, monkeypatch):
    """boundary_kernel as the provider builds it (a row over a cluster of up to 8 blocks of
    at least 128 threads), cached, spill-free."""
    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    defines = boundary.kernel_defines(hidden)
    cluster = {1024: 1, 2048: 2, 4096: 4, 8192: 8}[hidden]
    assert boundary.row_cluster(hidden) == cluster and defines.get("CLUSTER", 1) == cluster
    assert defines["THREADS"] * cluster * boundary.ITEMS == hidden
    cubin = nvrtc.compile_cubin(boundary.SOURCE, "sm_90a", defines, boundary.COMPILE_OPTIONS)
    assert cubin[:4] == b"\x7fELF"
    assert list(tmp_path.glob("cubin/boundary-*.cubin"))  # cached
    assert nvrtc.compile_cubin(boundary.SOURCE, "sm_90a", defines, boundary.COMPILE_OPTIONS) == cubin
    assert "boundary_kernel" in assert_spill_free(boundary.SOURCE, defines, boundary.COMPILE_OPTIONS)


@pytest.mark.parametrize("kernel", ["boundary_kernel", "attention_boundary_all_reduce_kernel"])
def test_late_trigger_launches_dependents_past_the_first_row_sum(kernel):
    """PDL_TRIGGER 1 (the unregistered ``cuda.attention_boundary_late_trigger``): each kernel lets its
    dependents launch only past the first row sum's barrier after its PDL wait (every
    thread's input has arrived; the fused kernel's after its gather), where the registered
    kernels do before the wait; the rest of the PTX is the same."""
    from ptxas_check import kernel_ptx, ptx_entry

    fused = kernel == "attention_boundary_all_reduce_kernel"
    cls = boundary.CudaAttentionBoundaryLateTrigger
    assert cls.pdl_trigger == 1 and cls.name.endswith("_late_trigger")
    assert cls.__mro__[1].pdl_trigger == 0
    assert boundary.kernel_defines(8192, 1) == {**boundary.kernel_defines(8192), "PDL_TRIGGER": 1}
    assert boundary.fused_defines(8192, 1) == {"H": 8192, "THREADS": 1024, "PDL_TRIGGER": 1}

    def ptx(trigger: int) -> str:
        defines = (boundary.fused_defines if fused else boundary.kernel_defines)(8192, trigger)
        return ptx_entry(kernel_ptx(boundary.SOURCE, defines, boundary.COMPILE_OPTIONS), kernel)

    early, late = ptx(0), ptx(1)
    for text in (early, late):
        assert text.count("griddepcontrol.launch_dependents;") == 1 and text.count("griddepcontrol.wait;") == 1
    assert early.index("griddepcontrol.launch_dependents") < early.index("griddepcontrol.wait")
    after = late.index("griddepcontrol.wait")
    if fused:  # the gather's polling loads, then the row sum
        after = late.index("ld.volatile.global.v4.u32", after)
    assert after < late.index("bar.sync", after) < late.index("griddepcontrol.launch_dependents")
    assert early.count("ld.global") == late.count("ld.global") and early.count("st.global") == late.count("st.global")
    with pytest.raises(nvrtc.CompileError, match="PDL_TRIGGER"):
        nvrtc.compile_cubin(boundary.SOURCE, "sm_90a", {**boundary.kernel_defines(8192), "PDL_TRIGGER": 2})


def test_boundary_rows_must_be_aligned():
    """The row kernels move 16 bytes at a time: a misaligned or strided tensor is refused
    with its name, before any launch."""
    torch = pytest.importorskip("torch")
    rows = torch.zeros(8, 1032, dtype=torch.bfloat16)
    boundary.check_aligned("x", rows[:, :1024], strided=True)
    with pytest.raises(ValueError, match="x has strides"):
        boundary.check_aligned("x", rows.view(-1)[4 : 4 + 8 * 1024].view(8, 1024), strided=True)
    with pytest.raises(ValueError, match="stream has strides"):
        boundary.check_aligned("stream", torch.zeros(8, 1032)[:, :1024])
    boundary.check_aligned("aux", None)


@pytest.mark.parametrize("width,experts,top_k", [(512, 16, 2), (2048, 16, 12), (4096, 256, 8)])
def test_moe_kernels_compile_for_hopper(width, experts, top_k, tmp_path, monkeypatch):
    """moe.cu as MoEKernels builds it: the tail's routes up to 8 at a time, spill-free."""
    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    spec = dataclasses.replace(
        ModelSpec.preset("tiny"), moe_hidden_size=width, num_local_experts=experts, num_experts_per_tok=top_k
    )
    defines = moe.kernel_defines(spec)
    assert defines["TOP_K"] == top_k and defines["TAIL_GROUP"] == min(8, top_k)
    assert nvrtc.compile_cubin(moe.SOURCE, "sm_90a", defines, moe.COMPILE_OPTIONS)[:4] == b"\x7fELF"
    assert "tail_kernel" in assert_spill_free(moe.SOURCE, defines, moe.COMPILE_OPTIONS)


def test_attention_kernels_compile_for_hopper(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    cubin = nvrtc.compile_cubin(attention.SOURCE, "sm_90a", {"HEAD_DIM": 64}, attention.COMPILE_OPTIONS)
    assert cubin[:4] == b"\x7fELF"


def test_lamport_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """The one-shot all-reduce, the fused TP attention boundary and MoE tail at every width."""
    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    assert nvrtc.compile_cubin(lamport.SOURCE, "sm_90a", None, lamport.COMPILE_OPTIONS)[:4] == b"\x7fELF"
    for hidden in (1024, 8192):
        defines = boundary.fused_defines(hidden)
        assert defines == {"H": hidden, "THREADS": hidden // boundary.ITEMS}
        cubin = nvrtc.compile_cubin(boundary.SOURCE, "sm_90a", defines, boundary.COMPILE_OPTIONS)
        assert b"attention_boundary_all_reduce_kernel" in cubin and b"boundary_columns_kernel" in cubin
        assert "boundary_columns_kernel" in assert_spill_free(boundary.SOURCE, defines, boundary.COMPILE_OPTIONS)
    for width in (512, 4096):
        defines = {"WIDTH": width, "THREADS": width // boundary.ITEMS, "EXPERTS": 256, "TOP_K": 8}
        assert b"tail_all_reduce_kernel" in nvrtc.compile_cubin(moe.SOURCE, "sm_90a", defines, moe.COMPILE_OPTIONS)


def test_columns_boundary_is_the_lamport_exchange_then_the_input_boundary():
    """boundary_columns_kernel (a sharded unpooler's mailbox, gathered on the device): the
    all-reduce kernel's exchange without the sum (one PDL trigger and wait, the push's
    release fence and one 16-byte store a peer, the spinning take with the sentinel
    stored back, the acquire fence), no whole written to memory, then boundary_kernel's
    mode 2 at one block a row (the stream and out stores; its reductions over the block,
    not a cluster)."""
    from ptxas_check import kernel_ptx, ptx_entry

    defines = boundary.fused_defines(8192)
    ptx = kernel_ptx(boundary.SOURCE, defines, boundary.COMPILE_OPTIONS)
    fused = ptx_entry(ptx, "boundary_columns_kernel")
    exchange = ptx_entry(kernel_ptx(lamport.SOURCE, {}, lamport.COMPILE_OPTIONS), "all_reduce_kernel")
    plain = ptx_entry(ptx, "boundary_kernel")
    assert fused.count("griddepcontrol.launch_dependents;") == 1 and fused.count("griddepcontrol.wait;") == 1
    assert fused.index("griddepcontrol.launch_dependents") < fused.index("griddepcontrol.wait")
    assert fused.count("fence.acq_rel.sys;") == exchange.count("fence.acq_rel.sys;") == 2
    for op in ("ld.volatile.global.v4.u32", "st.volatile.global.v4.u32"):
        assert fused.count(op) == exchange.count(op), op
    assert "mapa" not in fused and "barrier.cluster" not in fused  # one block a row
    # The stream (fp32, 32 bytes), the aux and out stores of the plain kernel's mode 2;
    # the gathered row stays in registers.
    assert fused.count("st.global.v4") == plain.count("st.global.v4")


def test_columns_norm_is_the_lamport_exchange_then_the_pre_expert_norm():
    """rmsnorm_columns_kernel (cuda.moe's sharded pooler): the all-reduce kernel's
    exchange without the sum, then rmsnorm_kernel's code (its one output store), the
    gathered row kept in registers; spill-free at the real and the tiny widths."""
    from ptxas_check import kernel_ptx, ptx_entry

    spec = ModelSpec.preset("muse-spark-open")
    defines = moe.kernel_defines(spec)
    ptx = kernel_ptx(moe.SOURCE, defines, moe.COMPILE_OPTIONS)
    fused, plain = ptx_entry(ptx, "rmsnorm_columns_kernel"), ptx_entry(ptx, "rmsnorm_kernel")
    exchange = ptx_entry(kernel_ptx(lamport.SOURCE, {}, lamport.COMPILE_OPTIONS), "all_reduce_kernel")
    assert fused.count("griddepcontrol.launch_dependents;") == 1 and fused.count("griddepcontrol.wait;") == 1
    assert fused.count("fence.acq_rel.sys;") == exchange.count("fence.acq_rel.sys;") == 2
    for op in ("ld.volatile.global.v4.u32", "st.volatile.global.v4.u32"):
        assert fused.count(op) == exchange.count(op), op
    assert fused.count("st.global.v4") == plain.count("st.global.v4") == 1
    for s in (spec, ModelSpec.preset("tiny")):
        d = moe.kernel_defines(s)
        assert "rmsnorm_columns_kernel" in assert_spill_free(moe.SOURCE, d, moe.COMPILE_OPTIONS)


def launch_types(args: list) -> list[str]:
    """The PTX parameter types a launch's arguments pass (pointers and 64-bit integers
    u64, ints u32, floats f32)."""
    import ctypes

    ptx_types = {ctypes.c_void_p: "u64", ctypes.c_int: "u32", ctypes.c_float: "f32", ctypes.c_longlong: "u64"}
    return [ptx_types[a.ctype] for a in args]


def entry_params(source: str, defines: dict, options: tuple, kernel: str) -> list[str]:
    """The PTX types of a compiled entry's parameters, signed as unsigned."""
    import re

    from ptxas_check import kernel_ptx, ptx_entry

    text = ptx_entry(kernel_ptx(source, defines, options), kernel)
    head = text[: text.index(")")]
    return [t.replace("s32", "u32").replace("s64", "u64") for t in re.findall(r"\.param \.([a-z]\d+)", head)]


def test_boundary_launches_match_their_kernels_parameters():
    """boundary_kernel's and boundary_columns_kernel's launches pass one argument per
    parameter of the compiled entry, each of its PTX type (pointers and the Lamport
    capacity 64-bit, the strides, mode and flags 32-bit integers, the epsilons and
    center fp32), the row arguments in the same order."""
    from types import SimpleNamespace

    def params(kernel: str) -> list[str]:
        return entry_params(boundary.SOURCE, boundary.fused_defines(1024), boundary.COMPILE_OPTIONS, kernel)

    launched: list[list] = []
    fake = SimpleNamespace(launch=lambda grid, block, args: launched.append(args))
    rows = torch.zeros(3, 1024, dtype=torch.bfloat16)
    stream, out = torch.zeros(3, 1024), torch.zeros(3, 1024, dtype=torch.bfloat16)
    weight, gate = torch.zeros(1024, dtype=torch.bfloat16), torch.zeros(1024)
    plain = boundary._BoundaryKernel.__new__(boundary._BoundaryKernel)
    plain.kernel, plain.cluster, plain.block = fake, 1, 128
    plain(2, rows, stream, out, None, weight, gate, gate, weight, 1e-6, 2e-6, 1.0)
    fused = boundary._ColumnsKernel.__new__(boundary._ColumnsKernel)
    fused.kernel, fused.width, fused.published = fake, 1024, True
    fused.workspace = SimpleNamespace(args=lambda: [ptr(rows), ptr(rows), i32(1), i32(2), i64(4096)])
    fused(rows[:, :512], stream, out, stream, weight, gate, gate, weight, 1e-6, 2e-6, 1.0)
    for args, kernel in zip(launched, ("boundary_kernel", "boundary_columns_kernel")):
        assert launch_types(args) == params(kernel), kernel
    p = [t.data_ptr() for t in (rows, stream, out, weight, gate)]
    rows_args = [p[0], 1024, p[1], p[2], None, p[3], p[4], p[4], p[3], 1e-6, 2e-6, 1.0]
    assert [a.value for a in launched[0]] == [*rows_args[:4], 0, *rows_args[5:], 2]
    assert [a.value for a in launched[1][:13]] == [*rows_args[:4], p[1], *rows_args[5:], 1]


def test_norm_launches_match_their_kernels_parameters():
    """cuda.moe's pre-expert norm launches, rmsnorm_kernel's and (a sharded pooler)
    rmsnorm_columns_kernel's, pass one argument per parameter of the compiled entry, each
    of its PTX type, the norm's arguments in the same order in both."""
    from types import SimpleNamespace

    spec = ModelSpec.preset("tiny")
    defines = moe.kernel_defines(spec)
    launched: list[list] = []
    kernels = moe.MoEKernels.__new__(moe.MoEKernels)
    kernels.threads = defines["THREADS"]
    kernels.norm = kernels.norm_columns = SimpleNamespace(launch=lambda grid, block, args: launched.append(args))
    rows, weight = torch.zeros(3, spec.P, dtype=torch.bfloat16), torch.zeros(spec.P, dtype=torch.bfloat16)
    out = torch.zeros(3, spec.P, dtype=torch.bfloat16)
    kernels.pre_norm(rows, weight, 1e-6, out)
    workspace = SimpleNamespace(args=lambda: [ptr(rows), ptr(rows), i32(1), i32(2), i64(4096)])
    kernels.pre_norm_columns(rows[:, : spec.P // 2], weight, 1e-6, out, workspace, True)
    for args, kernel in zip(launched, ("rmsnorm_kernel", "rmsnorm_columns_kernel")):
        assert launch_types(args) == entry_params(moe.SOURCE, defines, moe.COMPILE_OPTIONS, kernel), kernel
    norm = [rows.data_ptr(), spec.P, weight.data_ptr(), 1e-6, 1.0, out.data_ptr()]
    assert [a.value for a in launched[0]] == pytest.approx(norm)
    assert [a.value for a in launched[1][:7]] == pytest.approx([*norm, 1])


def test_input_and_final_boundaries_fuse_the_gather_only_where_both_apply(monkeypatch):
    """cuda.boundary and cuda.final run boundary_columns_kernel only on a column-sharded
    mailbox with a transport that gathers on the device; a replicated mailbox, or no
    device gather (the reference transport, a detached rank), keeps the mailbox's gather."""
    from sparkdecode.comm import Collectives, ColumnMailbox, LocalMailbox

    spec = ModelSpec.preset("tiny")
    ctx = type("Ctx", (), {"spec": spec})()
    cpu = torch.device("cpu")
    column = ColumnMailbox(8, spec.H, Collectives(4, 1, None), cpu)
    local = LocalMailbox(8, spec.H, cpu)

    workspace = object()  # the Lamport workspace the device transport exchanges over

    for transport, box, wanted in [
        (workspace, column, True),
        (workspace, local, False),
        (None, column, False),
        (None, local, False),
    ]:
        monkeypatch.setattr(boundary, "device_gather", lambda ctx, t=transport: t)
        assert boundary._ColumnsKernel.wanted(ctx, box) is wanted


def test_sharded_unpooler_publishes_into_the_fused_boundary():
    """The fused input or final boundary asks the MoE before it to push this rank's
    unpooler block from the GEMM's epilogue, and takes only the peers' blocks where the
    MoE agreed; cuda.moe agrees only for a column-sharded unpooler whose linear provider
    publishes (asked for the unpooler, into the boundary's workspace); a MoE provider
    without ``publish_columns`` is left alone; a boundary without the fused kernel asks
    nothing."""
    from sparkdecode.comm import Collectives, ColumnMailbox, LocalMailbox
    from sparkdecode_cuda.boundary import CudaBoundary, CudaFinal, _ColumnsKernel
    from sparkdecode_cuda.moe import CudaMoE

    spec = ModelSpec.preset("tiny")
    cpu = torch.device("cpu")
    moe_block = CudaMoE.__new__(CudaMoE)
    moe_block.spec = spec
    moe_block.mailbox = ColumnMailbox(8, spec.H, Collectives(4, 1, None), cpu)
    for answer in (True, False):
        moe_block.linear = PublishingLinear(answer)
        assert moe_block.publish_columns("ws") is answer and moe_block.linear.calls == [("unpooler", "ws")]
    moe_block.linear = object()  # a linear provider that cannot publish (reference.linear)
    assert moe_block.publish_columns("ws") is False
    moe_block.mailbox, moe_block.linear = LocalMailbox(8, spec.H, cpu), PublishingLinear(True)
    assert moe_block.publish_columns("ws") is False and moe_block.linear.calls == []

    class Agreeing:
        def __init__(self):
            self.asked: list[object] = []

        def publish_columns(self, mailbox: object) -> bool:
            self.asked.append(mailbox)
            return True

    for cls in (CudaBoundary, CudaFinal):
        reader = cls.__new__(cls)
        reader.fused = None
        producer = Agreeing()
        reader.pair_producer(producer)
        assert producer.asked == []
        reader.fused = _ColumnsKernel.__new__(_ColumnsKernel)
        reader.fused.workspace, reader.fused.published = "ws", False
        reader.pair_producer(object())  # reference.moe: no publish_columns
        assert reader.fused.published is False
        reader.pair_producer(producer)
        assert reader.fused.published is True and producer.asked == ["ws"]


def test_compile_errors_name_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    with pytest.raises(nvrtc.CompileError, match="boundary.cu"):
        nvrtc.compile_cubin(boundary.SOURCE, "sm_90a", {})  # no H: the source's #error


def test_compiles_leave_the_shared_one_byte_bytes_alone(tmp_path, monkeypatch):
    """NVRTC writes its log and outputs into the buffer it is given; a log of one byte (an
    empty one, with its NUL) written into ``b" " * 1`` overwrote CPython's cached b" ",
    which then broke unrelated code in the same process (torch.load). The compile helpers
    give NVRTC buffers of their own."""
    from ptxas_check import kernel_ptx

    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    nvrtc.compile_cubin(attention.SOURCE, "sm_90a", {"HEAD_DIM": 64}, attention.COMPILE_OPTIONS)
    assert ".entry" in kernel_ptx(attention.SOURCE, {"HEAD_DIM": 64}, attention.COMPILE_OPTIONS)
    assert bytes([0x20])[0] == 0x20  # the cached one-byte object for 0x20


def test_unsupported_off_hopper(monkeypatch):
    spec = ModelSpec.preset("tiny")
    cpu = detect(spec, device="cpu")
    for cls in (
        boundary.CudaBoundary,
        attention.CudaAttention,
        boundary.CudaAttentionBoundary,
        boundary.CudaFinal,
        moe.CudaMoE,
        all_reduce.CudaAllReduce,
    ):
        assert cls.unsupported(cpu) == "needs a CUDA GPU"
        ampere = dataclasses.replace(cpu, device="cuda", capability=(8, 0))
        assert "SM90" in cls.unsupported(ampere)
        no_bindings = dataclasses.replace(
            cpu, device="cuda", capability=(9, 0), libraries={**cpu.libraries, "cuda.bindings": None}
        )
        assert "cuda-bindings" in cls.unsupported(no_bindings)
    hopper = dataclasses.replace(cpu, device="cuda", capability=(9, 0))
    assert boundary.CudaBoundary.unsupported(hopper) is None
    for cls in (boundary.CudaAttentionBoundary, all_reduce.CudaAllReduce):  # TP > 1: the Lamport all-reduce
        assert cls.unsupported(dataclasses.replace(hopper, tp=8)) is None
        assert "at most 8 ranks" in cls.unsupported(dataclasses.replace(hopper, tp=16))
    monkeypatch.setattr(sys, "platform", "win32")
    assert "CUDA IPC" in all_reduce.CudaAllReduce.unsupported(dataclasses.replace(hopper, tp=2))
    odd = dataclasses.replace(
        hopper, spec=dataclasses.replace(spec, hidden_size=1088, num_attention_heads=17, num_key_value_heads=1)
    )
    assert "hidden size 1088" in boundary.CudaBoundary.unsupported(odd)


@pytest.mark.parametrize(
    "fmt,variant",
    [
        ("bf16", 0),
        ("nvfp4", 0),
        ("nvfp4_marlin", 0),
        ("nvfp4", 1),
        ("nvfp4_marlin", 1),
        ("nvfp4", 2),
        ("nvfp4_marlin", 2),
    ],
)
@pytest.mark.parametrize("width,intermediate,top_k", [(4096, 512, 8), (4096, 4096, 8), (512, 512, 4), (512, 256, 4)])
def test_experts_kernels_compile_for_hopper(fmt, variant, width, intermediate, top_k, tmp_path, monkeypatch):
    """The routed experts at the TP8 rank's expert-TP slice (I 512) and EP (whole
    experts), and the tiny spec's shapes; the NVFP4 ones under EXPERTS_V2 too (the
    V2 providers' define) and EXPERTS_V2 = 2 (the V3 providers')."""
    from sparkdecode_cuda import experts

    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    assert experts.shape_unsupported(width, intermediate, fmt, top_k, 8) is None
    defines = {"P_DIM": width, "I_LOCAL": intermediate, "FMT": experts.FMT[fmt], "TOP_K": top_k}
    if variant:
        defines["EXPERTS_V2"] = variant
    cubin = nvrtc.compile_cubin(experts.SOURCE, "sm_90a", defines, experts.COMPILE_OPTIONS)
    assert b"experts_up_kernel" in cubin and b"experts_down_kernel" in cubin


def test_experts_unsupported_shapes():
    from sparkdecode_cuda import experts, plugin

    assert "at most 8 rows" in experts.shape_unsupported(4096, 512, "nvfp4", 8, 16)
    assert "multiples of 128" in experts.shape_unsupported(4096, 96, "nvfp4", 8, 8)
    assert "multiples of 32" in experts.shape_unsupported(4096, 80, "bf16", 8, 8)
    spec = ModelSpec.preset("muse-spark-open")
    cpu = detect(spec, device="cpu")
    for cls in (experts.CudaExperts, experts.CudaExpertsNvfp4):
        assert cls.unsupported(cpu) == "needs a CUDA GPU"
        hopper = dataclasses.replace(cpu, device="cuda", capability=(9, 0), tp=8, expert_parallel="tp")
        assert cls.unsupported(hopper) is None
        assert "rows" in cls.unsupported(dataclasses.replace(hopper, max_rows=16))
    marlin = dataclasses.replace(hopper, expert_format="nvfp4_marlin")
    assert experts.CudaExperts.unsupported(marlin) is None  # the bf16 edge layers
    assert "not nvfp4_marlin" in experts.CudaExpertsNvfp4.unsupported(marlin)
    # Marlin's layout: its own provider
    assert experts.CudaExpertsNvfp4Marlin.unsupported(marlin) is None
    assert "SM90 Marlin layout, not" in experts.CudaExpertsNvfp4Marlin.unsupported(hopper)
    assert "multiples of 64" in experts.shape_unsupported(4096, 96, "nvfp4_marlin", 8, 8)
    assert experts.CudaExpertsNvfp4Marlin in plugin.PROVIDERS
    for cls in (experts.CudaExpertsNvfp4V2, experts.CudaExpertsNvfp4MarlinV2):
        assert cls in plugin.PROVIDERS and cls.variant == 1 and cls.__base__.variant == 0
    for cls in (experts.CudaExpertsNvfp4V3, experts.CudaExpertsNvfp4MarlinV3):
        assert cls.variant == 2
    # Marlin's V3 is registered (faster than v2 on the H200); the checkpoint layout's V3 is not (no faster than v1)
    assert experts.CudaExpertsNvfp4MarlinV3 in plugin.PROVIDERS and experts.CudaExpertsNvfp4V3 not in plugin.PROVIDERS


def test_markov_kernel_compiles_and_says_what_it_takes(tmp_path, monkeypatch):
    """The draft's Markov sampling kernel compiles for Hopper; cuda.markov takes only a
    Hopper draft deployment."""
    import torch

    from sparkdecode.draft.executor import DraftConfig, draft_deployment
    from sparkdecode.draft.spec import DraftSpec
    from sparkdecode_cuda import markov

    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    assert nvrtc.compile_cubin(markov.SOURCE, "sm_90a", markov.defines(), markov.COMPILE_OPTIONS)[:4] == b"\x7fELF"
    target = ModelSpec.preset("tiny")
    draft = draft_deployment(DraftSpec.preset("tiny", target=target), target, "cpu", DraftConfig())
    assert markov.CudaMarkov.unsupported(draft) == "needs a CUDA GPU"
    hopper = dataclasses.replace(draft, device="cuda", capability=(9, 0))
    assert markov.CudaMarkov.unsupported(hopper) is None
    assert "SM90" in markov.CudaMarkov.unsupported(dataclasses.replace(hopper, capability=(8, 0)))
    plain = detect(target, device="cpu")
    assert "draft" in markov.CudaMarkov.unsupported(dataclasses.replace(plain, device="cuda", capability=(9, 0)))
    assert markov.grid_blocks(202048) == 198 and markov.grid_blocks(1024) == 1
    assert markov.fp32_reciprocal(20.0) == float(torch.tensor(0.05, dtype=torch.float32))


# The dense weights (N, K) at TP1, on one TP8 rank, with the pooler and unpooler
# column-sharded over 8 ranks, and the tiny spec's (the router is fp32).
LINEAR_SHAPES = {
    "qkvg": [(18432, 8192), (2304, 8192), (2304, 1024)],
    "o_proj": [(8192, 8192), (8192, 1024), (1024, 1024)],
    "router": [(256, 8192), (16, 1024)],
    "pooler": [(4096, 8192), (512, 8192), (512, 1024)],
    "unpooler": [(8192, 4096), (1024, 4096), (1024, 512)],
}


@pytest.mark.parametrize("name,n,k", [(name, n, k) for name, shapes in LINEAR_SHAPES.items() for n, k in shapes])
def test_linear_kernel_compiles_for_hopper(name, n, k, tmp_path, monkeypatch):
    """linear_kernel under the plan cuda.linear picks on an H200 (132 SMs) for every
    dense weight shape, and under the plan of the most rows and loads a thread."""
    from sparkdecode_cuda import linear

    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    fp32 = name == "router"
    chosen = linear.plan(n, k, fp32, 132)
    widest = max(linear.plans(n, k, fp32), key=lambda p: (p.rows, p.tm * p.depth))
    for p in {chosen, widest}:
        assert p.ctas * p.rows // p.splits == n and p.splits <= linear.MAX_SPLITS
        cubin = nvrtc.compile_cubin(linear.SOURCE, "sm_90a", p.defines(), linear.COMPILE_OPTIONS)
        assert b"linear_kernel" in cubin


def test_linear_plans_and_unsupported_shapes():
    from sparkdecode_cuda import linear, plugin

    # o_proj at TP8: wide and short; qkvg at TP8: narrow and long, split over a cluster
    assert linear.plan(8192, 1024, False, 132).splits == 1
    qkvg = linear.plan(2304, 8192, False, 132)
    assert qkvg.splits > 1 and qkvg.ctas >= 132 and 8192 // qkvg.splits <= linear.MAX_SLICE
    assert "qkvg 2300 x 8192" in linear.shape_unsupported("qkvg", 2300, 8192, False)
    assert "multiple of 256" in linear.shape_unsupported("o_proj", 8192, 1000, False)
    assert "up to 16384" in linear.shape_unsupported("pooler", 4096, 32768, False)
    assert linear.shape_unsupported("router", 256, 8192, True) is None
    with pytest.raises(ValueError, match="N a multiple of 16"):
        linear.plan(100, 1024, False, 132)
    spec = ModelSpec.preset("muse-spark-open")
    cpu = detect(spec, device="cpu")
    assert linear.CudaLinear.unsupported(cpu) == "needs a CUDA GPU"
    assert "SM90" in linear.CudaLinear.unsupported(dataclasses.replace(cpu, device="cuda", capability=(8, 0)))
    hopper = dataclasses.replace(cpu, device="cuda", capability=(9, 0))
    for tp, shard in ((1, False), (8, False), (8, True)):
        d = dataclasses.replace(hopper, tp=tp, shard_pooler=shard, shard_unpooler=shard)
        assert linear.CudaLinear.unsupported(d) is None
    assert linear.deployment_shapes(dataclasses.replace(hopper, tp=8)) == {
        "qkvg": (2304, 8192),
        "o_proj": (8192, 1024),
        "router": (256, 8192),
        "pooler": (4096, 8192),
        "unpooler": (8192, 4096),
    }
    assert "rows a step" in linear.CudaLinear.unsupported(dataclasses.replace(hopper, max_rows=16))
    tiny = detect(ModelSpec.preset("tiny"), device="cpu")
    assert linear.CudaLinear.unsupported(dataclasses.replace(tiny, device="cuda", capability=(9, 0))) is None
    assert linear.CudaLinear in plugin.PROVIDERS


@pytest.mark.parametrize("n,k", [(8192, 1024), (8192, 2048), (8192, 4096), (1024, 512), (4096, 512), (4096, 1024)])
def test_publishing_o_proj_compiles_for_hopper(n, k, tmp_path, monkeypatch):
    """o_proj with its epilogue publishing into the Lamport mailbox (linear.cu's PUBLISH)
    at the TP 8, 4 and 2 ranks' widths (real and tiny): a tiling with 16-byte shares of
    rows (the model's own choice there); the fp32 router refused at compile time."""
    from sparkdecode_cuda import linear

    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    chosen = linear.publishing_plan(n, k, 132)
    assert chosen is not None and (chosen.rows // chosen.splits) % 8 == 0
    assert chosen == linear.plan(n, k, False, 132)
    published = nvrtc.compile_cubin(linear.SOURCE, "sm_90a", {**chosen.defines(), "PUBLISH": 1}, linear.COMPILE_OPTIONS)
    plain = nvrtc.compile_cubin(linear.SOURCE, "sm_90a", chosen.defines(), linear.COMPILE_OPTIONS)
    assert b"linear_kernel" in published and published != plain
    with pytest.raises(nvrtc.CompileError, match="published"):  # the fp32 router cannot publish
        nvrtc.compile_cubin(
            linear.SOURCE,
            "sm_90a",
            {**linear.plan(256, 8192, True, 132).defines(), "PUBLISH": 1},
            linear.COMPILE_OPTIONS,
        )


def test_publish_pairs_o_proj_with_the_fused_boundary():
    """CudaAttentionBoundary.pair_attention asks the attention block to publish only at
    TP > 1 (with a mailbox), and runs its fused kernel gather-only only where the
    attention agreed; an attention provider without publish_partial is left alone."""
    from sparkdecode_cuda.attention import CudaAttention
    from sparkdecode_cuda.boundary import CudaAttentionBoundary

    asked: list[object] = []

    class Publishing:
        def publish_partial(self, mailbox: object) -> bool:
            asked.append(mailbox)
            return True

    class Refusing:
        def publish_partial(self, mailbox: object) -> bool:
            return False

    boundary = CudaAttentionBoundary.__new__(CudaAttentionBoundary)
    for workspace, block, published in (
        (None, Publishing(), False),  # TP 1 or detached: nothing to publish into
        ("ws", object(), False),  # reference.attention: no publish_partial
        ("ws", Refusing(), False),
        ("ws", Publishing(), True),
    ):
        boundary.workspace, boundary.published = workspace, False
        boundary.pair_attention(block)
        assert boundary.published is published
    assert asked == ["ws"]

    front = CudaAttention.__new__(CudaAttention)
    for answer in (True, False):
        front.linear = PublishingLinear(answer)
        assert front.publish_partial("ws") is answer and front.linear.calls == [("o_proj", "ws")]
    front.linear = object()  # a linear provider that cannot publish (reference.linear)
    assert front.publish_partial("ws") is False


@pytest.mark.parametrize("width,intermediate,top_k", [(4096, 512, 8), (4096, 4096, 8), (512, 512, 4), (512, 256, 4)])
def test_experts_bulk_kernels_compile_for_hopper(width, intermediate, top_k, tmp_path, monkeypatch):
    """The bulk-copy Marlin experts at the TP8 rank's expert-TP slice (I 512), EP (whole
    experts) and the tiny spec's shapes; the SMEM define is the layout's own (a static_assert)."""
    from sparkdecode_cuda import experts_bulk

    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    assert experts_bulk.shape_unsupported(width, intermediate, top_k, 8) is None
    defines = experts_bulk.defines(width, intermediate, top_k)
    cubin = nvrtc.compile_cubin(experts_bulk.SOURCE, "sm_90a", defines, experts_bulk.COMPILE_OPTIONS)
    assert b"experts_bulk_up_kernel" in cubin and b"experts_bulk_down_kernel" in cubin
    with pytest.raises(nvrtc.CompileError, match="SMEM"):
        nvrtc.compile_cubin(experts_bulk.SOURCE, "sm_90a", {**defines, "SMEM": defines["SMEM"] + 16})


@pytest.mark.parametrize("width,intermediate", [(4096, 512), (4096, 4096), (512, 512)])
def test_experts_bulk_v3_variants_compile_spill_free_and_fit(width, intermediate, tmp_path, monkeypatch):
    """The V3 bulk classes: the registered bulk kernels' defines plus BULK_V3 (and STAGES,
    BULK_BLOCKS for two blocks an SM), spill-free, their rings and reductions within an
    SM90 SM's shared memory at their blocks an SM; the registered class sets none of them."""
    from ptxas_check import assert_spill_free

    from sparkdecode_cuda import experts_bulk

    monkeypatch.setenv("SPARKDECODE_CACHE", str(tmp_path))
    base = experts_bulk.CudaExpertsNvfp4MarlinBulk
    assert (base.v3, base.stages, base.blocks_per_sm) == (0, experts_bulk.STAGES, 1)
    assert experts_bulk.defines(width, intermediate, 8) == {
        "P_DIM": width,
        "I_LOCAL": intermediate,
        "TOP_K": 8,
        "SMEM": experts_bulk.smem_bytes(),
    }
    for cls, extra in (
        (experts_bulk.CudaExpertsNvfp4MarlinBulkV3, {"BULK_V3": 1}),
        (experts_bulk.CudaExpertsNvfp4MarlinBulkV3x2, {"BULK_V3": 1, "STAGES": 5, "BULK_BLOCKS": 2}),
    ):
        d = experts_bulk.defines(width, intermediate, 8, cls.stages, cls.v3, cls.blocks_per_sm)
        assert d == {
            **experts_bulk.defines(width, intermediate, 8),
            "SMEM": experts_bulk.smem_bytes(cls.stages),
            **extra,
        }
        usage = assert_spill_free(experts_bulk.SOURCE, d, experts_bulk.COMPILE_OPTIONS)
        threads = experts_bulk.THREADS * cls.blocks_per_sm
        for kernel in ("experts_bulk_up_kernel", "experts_bulk_down_kernel"):
            assert usage[kernel].registers * threads <= 65536, (cls.name, kernel)
            assert cls.blocks_per_sm * (d["SMEM"] + usage[kernel].smem + 1024) <= 228 * 1024, (cls.name, kernel)


def test_experts_bulk_work_and_unsupported():
    from sparkdecode_cuda import experts, experts_bulk, plugin

    # one block an SM of an H200 (132): the TP8 rank's expert-TP slice (I 512) and EP (I 4096)
    assert experts_bulk.smem_bytes() + 2048 <= 227 * 1024
    assert experts_bulk.work_items(57, 4096, 512, 132) == {"up": (912, 2), "down": (1824, 1)}  # random routing
    assert experts_bulk.work_items(5, 4096, 512, 132) == {"up": (320, 8), "down": (320, 2)}  # correlated
    assert experts_bulk.work_items(8, 4096, 4096, 132) == {"up": (512, 1), "down": (256, 1)}  # EP, random
    assert experts_bulk.work_items(2, 4096, 4096, 132) == {"up": (128, 1), "down": (128, 2)}  # EP, few
    for units in range(1, 2000):  # the workspace and the counters hold every split launch
        s = experts_bulk.choose_splits(units, 132, 32)
        assert s == 1 or units * s <= experts_bulk.PARTS_PER_CTA * 132
        assert 32 % s == 0 and s <= experts_bulk.MAX_SPLITS
    assert "multiples of 128" in experts_bulk.shape_unsupported(4096, 192, 8, 8)
    assert "at most 8 rows" in experts_bulk.shape_unsupported(4096, 512, 8, 16)
    cls = experts_bulk.CudaExpertsNvfp4MarlinBulk
    spec = ModelSpec.preset("muse-spark-open")
    cpu = detect(spec, device="cpu")
    assert cls.unsupported(cpu) == "needs a CUDA GPU"
    hopper = dataclasses.replace(cpu, device="cuda", capability=(9, 0), tp=8, expert_parallel="tp")
    marlin = dataclasses.replace(hopper, expert_format="nvfp4_marlin")
    assert cls.unsupported(marlin) is None
    assert cls.unsupported(dataclasses.replace(marlin, expert_parallel="ep")) is None
    assert "SM90 Marlin layout, not" in cls.unsupported(hopper)
    assert "SM80" in cls.unsupported(dataclasses.replace(marlin, capability=(8, 0)))
    assert "SM90 (Hopper)" in cls.unsupported(dataclasses.replace(marlin, capability=(10, 0)))
    assert "rows" in cls.unsupported(dataclasses.replace(marlin, max_rows=16))
    assert (cls.block, cls.name, cls.format) == ("experts_nvfp4", "cuda.experts_nvfp4_marlin_bulk", "nvfp4_marlin")
    assert cls in plugin.PROVIDERS and experts.CudaExpertsNvfp4Marlin in plugin.PROVIDERS


@pytest.mark.parametrize(("current", "wanted", "fails"), [(0, 0, False), (1, 1, False), (0, 1, True)])
def test_driver_calls_go_to_the_device_built_for(monkeypatch, current, wanted, fails):
    """The cuda pack's driver calls (module loads, the Lamport buffer) go to the
    current context's GPU: building for another device than the thread's current one
    is refused by name rather than loading or allocating on the wrong GPU."""
    import contextlib

    import torch
    from cuda.bindings import driver

    from sparkdecode_cuda import launch

    ok = driver.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(driver, "cuCtxGetCurrent", lambda: (ok, driver.CUcontext(1)))
    monkeypatch.setattr(driver, "cuCtxGetDevice", lambda: (ok, driver.CUdevice(current)))
    if fails:
        with pytest.raises(
            RuntimeError, match=rf"builds for cuda:{wanted}, but .* current CUDA device is cuda:{current}"
        ):
            launch._ensure_context(torch.device("cuda", wanted))
    else:
        launch._ensure_context(torch.device("cuda", wanted))
    launch._ensure_context(torch.device("cuda"))  # the current device: always its own


def test_the_collectives_bench_context_keeps_shared_objects():
    """The collectives bench's stand-in context keeps what the providers share
    (the Lamport workspace) as a BuildContext does."""
    import torch

    from sparkdecode_cuda.bench_collectives import context

    ctx = context(ModelSpec.preset("tiny"), 8, 2, 0, torch.device("cpu"))
    made = ctx.shared("lamport_workspace", list)
    assert ctx.shared("lamport_workspace", lambda: pytest.fail("made twice")) is made


def test_moe_capture_order(monkeypatch):
    """cuda.moe's launches as a CUDA graph captures them: the fork's event recorded on the
    current stream first, the router and the routing on the side stream after it, the
    pooler on the current stream, the join before the experts."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from sparkdecode_cuda import plugin

    calls: list[str] = []

    class Event:
        def __init__(self, name: str):
            self.name = name

        def record(self, stream):
            calls.append(f"record {self.name} on {stream.name}")

    class Stream:
        def __init__(self, name: str):
            self.name = name

        def wait_event(self, event):
            calls.append(f"{self.name} waits {event.name}")

    side, current = Stream("side"), Stream("current")
    on = [current]

    @contextlib.contextmanager
    def on_stream(stream):
        on.append(stream)
        yield
        on.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)

    def launch(name):
        return lambda *args, **kwargs: calls.append(f"{name} on {on[-1].name}")

    assert moe.CudaMoE in plugin.PROVIDERS
    block = moe.CudaMoE.__new__(moe.CudaMoE)
    spec = ModelSpec.preset("tiny")
    rows = torch.zeros(8, spec.P)
    block.spec, block.side, block.fork, block.join = spec, side, Event("fork"), Event("join")
    block.layer = SimpleNamespace(pre_expert_norm=None, post_expert_norm=None, expert_bias=None)
    block.ids, block.weights = torch.zeros(8, spec.top_k), torch.zeros(8, spec.top_k)
    block.logits, block.pooled, block.h, block.m = torch.zeros(8, spec.E), rows, rows, rows
    block.rows = torch.zeros(8, spec.top_k, spec.P)
    block.router_linear = SimpleNamespace(run=lambda name, *a: calls.append(f"{name} on {on[-1].name}"))
    block.linear = block.router_linear
    block.kernels = SimpleNamespace(
        route=launch("routing"),
        pre_norm=launch("pre_norm"),
        pre_norm_columns=launch("pre_norm_columns"),
        finish=launch("tail"),
    )
    block.experts = SimpleNamespace(run=launch("experts"))
    block.workspace, block.reduce_rows, block.reduce_out = None, False, False
    block.pooled_exchange, block.pooled_published = None, False
    block.mailbox = SimpleNamespace(publish=lambda b: None)
    block.run(None, torch.zeros(3, spec.H))
    branch = ["side waits fork", "router on side", "routing on side", "record join on side"]
    pooler = ["pooler on current"]
    head = ["record fork on current"] + branch + pooler
    tail = ["current waits join", "experts on current", "tail on current", "unpooler on current"]
    assert calls == head + ["pre_norm on current"] + tail
    # A sharded pooler over the device transport: its columns exchanged in the norm, right
    # after the pooler on the same stream (the Lamport consumer its epilogue pushes to).
    calls.clear()
    block.pooled_exchange = "ws"
    block.run(None, torch.zeros(3, spec.H))
    assert calls == head + ["pre_norm_columns on current"] + tail


@pytest.mark.parametrize("preset", ["tiny", "muse-spark-open"])
def test_routing_rounds_by_redux(preset):
    """routing_kernel's top-k rounds: each by a redux.sync max and min and one indexed
    shuffle, with no butterfly of shuffles."""
    from ptxas_check import kernel_ptx, ptx_entry

    defines = moe.kernel_defines(ModelSpec.preset(preset))
    routing = ptx_entry(kernel_ptx(moe.SOURCE, defines, moe.COMPILE_OPTIONS), "routing_kernel")
    rounds = routing.count("redux.sync.max.u32")
    assert rounds >= 1 and routing.count("redux.sync.min.u32") == routing.count("shfl.sync.idx") == rounds
    assert "shfl.sync.bfly" not in routing
