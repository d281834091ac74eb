"""cute.experts on the CPU: why it does not apply without a Hopper GPU, the CuTe DSL
or bf16 experts (and the layout falls back to the reference), and its two kernels
compile for sm_90a at the tiny, TP8-rank EP and TP8-rank expert-TP shapes; its
tensor-core variant cute.experts_mma compiles at those and at
TP 1 with no local memory."""

from __future__ import annotations

import dataclasses

import pytest
from test_cute_pack import _hopper

from sparkdecode.deployment import detect
from sparkdecode.layout import resolve
from sparkdecode.plugins import discover
from sparkdecode.spec import ModelSpec
from sparkdecode_cute import plugin
from sparkdecode_cute.experts import CuteExperts
from sparkdecode_cute.experts_mma import CuteExpertsMma
from sparkdecode_cute.experts_shape import ExpertsShape, shape_unsupported


def test_registered():
    assert CuteExperts in plugin.PROVIDERS
    assert CuteExpertsMma in plugin.PROVIDERS


def test_mma_variant_reasons():
    """cute.experts_mma takes what cute.experts takes, under its own name."""
    assert (CuteExpertsMma.block, CuteExpertsMma.name) == ("experts", "cute.experts_mma")
    hopper = _hopper(ModelSpec.preset("tiny"))
    assert CuteExpertsMma.unsupported(hopper) is None
    assert "not nvfp4" in CuteExpertsMma.unsupported(dataclasses.replace(hopper, expert_format="nvfp4"))
    assert "at most 8" in CuteExpertsMma.unsupported(dataclasses.replace(hopper, max_rows=16))
    spark = ModelSpec.preset("muse-spark-open", 1)
    for mode in ("ep", "tp"):
        assert CuteExpertsMma.unsupported(_hopper(spark, tp=8, expert_parallel=mode)) is None
    assert CuteExpertsMma.unsupported(_hopper(spark)) is None


def test_unsupported_reasons():
    tiny = ModelSpec.preset("tiny")
    hopper = _hopper(tiny)
    assert CuteExperts.unsupported(hopper) is None
    assert CuteExperts.unsupported(dataclasses.replace(hopper, device="cpu", capability=None)) == "needs a CUDA GPU"
    assert "SM80" in CuteExperts.unsupported(dataclasses.replace(hopper, capability=(8, 0)))
    missing = dataclasses.replace(hopper, libraries={**hopper.libraries, "cutlass": None})
    assert "nvidia-cutlass-dsl==4.8.1" in CuteExperts.unsupported(missing)
    assert "not nvfp4" in CuteExperts.unsupported(dataclasses.replace(hopper, expert_format="nvfp4"))
    assert "at most 8" in CuteExperts.unsupported(dataclasses.replace(hopper, max_rows=16))
    # tiny's I 512 over 8 ranks leaves a 64-wide slice.
    assert "I-slice 64" in CuteExperts.unsupported(dataclasses.replace(hopper, tp=8, expert_parallel="tp"))
    spark = ModelSpec.preset("muse-spark-open", 1)
    for mode in ("ep", "tp"):
        assert CuteExperts.unsupported(_hopper(spark, tp=8, expert_parallel=mode)) is None


def test_resolves_to_the_reference_without_a_gpu():
    spec = ModelSpec.preset("tiny")
    layout = resolve(discover(), detect(spec, device="cpu"))
    assert layout.provider("experts").name == "reference.experts"
    reasons = {c.name: c.reason for c in layout.choices["experts"].candidates}
    assert reasons["cute.experts"] == "needs a CUDA GPU"


@pytest.fixture(scope="module")
def kernels():
    return pytest.importorskip("sparkdecode_cute.experts_kernels", reason="nvidia-cutlass-dsl is not installed")


# (P, I-slice, experts held, top-k, max rows)
SHAPES = {
    "tiny": (512, 512, 16, 4, 8),
    "tiny-every-expert": (512, 512, 16, 16, 8),
    "tp8-rank-ep": (4096, 4096, 32, 8, 8),
    "tp8-rank-expert-tp": (4096, 512, 256, 8, 8),
    "one-row": (4096, 512, 256, 8, 1),
}


@pytest.mark.parametrize("name", SHAPES)
def test_compiles_for_sm90a(kernels, name):
    shape = ExpertsShape(*SHAPES[name])
    assert shape_unsupported(shape) is None
    assert kernels.compile_experts(shape, "sm_90a") is not None


MMA_SHAPES = {**SHAPES, "tp1": (4096, 4096, 256, 8, 8)}


@pytest.fixture(scope="module")
def mma_kernels():
    return pytest.importorskip("sparkdecode_cute.experts_mma_kernels", reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.parametrize("name", MMA_SHAPES)
def test_mma_compiles_for_sm90a(mma_kernels, capfd, name):
    """Both tensor-core kernels compile with no register spills (TP 1: experts
    indexed in 64 bits, as the CUDA-core kernels)."""
    shape = ExpertsShape(*MMA_SHAPES[name])
    assert shape_unsupported(shape) is None
    capfd.readouterr()
    assert mma_kernels.compile_experts_mma(shape, "sm_90a", "remarks{ptx}") is not None
    report = "".join(capfd.readouterr())
    # ptxas's report (remarks{ptx}) of gate_up and of down: no local memory.
    assert report.count("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") == 2, report


def test_shape_reasons():
    s = ExpertsShape(4096, 512, 256, 8, 8)
    assert shape_unsupported(s) is None
    assert shape_unsupported(dataclasses.replace(s, intermediate=384)) == (
        "the I-slice 384: the experts kernels take multiples of 256"
    )
    assert "moe_hidden_size 4000" in shape_unsupported(dataclasses.replace(s, width=4000))
    assert "top-33" in shape_unsupported(dataclasses.replace(s, top_k=33))
    assert "at most 8 rows" in shape_unsupported(dataclasses.replace(s, max_rows=9))
