"""providers_cute on a Hopper GPU against the reference (marker gpu), within
linear_check's bounds (cute.linear and reference.linear both accumulate the products
in fp32 and round once to the output dtype; only the order of the sum differs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from linear_check import HOPPER, SHAPES, equals_reference

from sparkdecode.bench.streams import linear_context
from sparkdecode.spec import ModelSpec

pytestmark = [pytest.mark.gpu, HOPPER]

linear = pytest.importorskip("sparkdecode_cute.linear")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_cute_linear_equals_reference(shape, rows):
    equals_reference(linear.CuteLinear, shape, rows)


def test_bad_input_is_an_error():
    ctx = linear_context(SHAPES["tp8-rank"], torch.device("cuda"))
    cute = linear.CuteLinear.build(ctx, 0)
    x = torch.zeros(9, 8192, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="9 rows"):
        cute.run("pooler", x, torch.empty(9, 4096, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="not bf16"):
        cute.run("pooler", x[:2].float(), torch.empty(2, 4096, dtype=torch.bfloat16, device="cuda"))


def test_executor_with_cute_linear():
    """The whole step (tiny spec, the cuda pack's attention and MoE, so the GEMMs go
    through the ``linear`` sub-op) with cute.linear pinned, in one captured graph
    replayed over steps, against the stock forward. With every expert routed
    (top-k = E: no discrete choice a one-ulp difference could flip) over two layers,
    one-ulp GEMM and norm differences carried through stay at a few bf16 ulps: 3e-2
    relative per row on the final hidden state (the bound the cuda pack's executor
    test holds with cuBLAS)."""
    from sparkdecode.executor import DecodeConfig, SpecializedDecode
    from sparkdecode.harness import DecodeHarness
    from sparkdecode.reference.model import ReferenceModel
    from sparkdecode.weights import random_weights

    pytest.importorskip("sparkdecode_cuda.moe")
    spec = dataclasses.replace(ModelSpec.preset("tiny", 2), num_experts_per_tok=16)
    weights = random_weights(spec, seed=2, device="cuda")
    pins = {"attention": "cuda.attention", "moe": "cuda.moe", "linear": "cute.linear"}
    executor = SpecializedDecode(weights, DecodeConfig(max_context=1024, pins=pins))
    assert executor.layout.choices["linear"].chosen.name == "cute.linear"
    harness = DecodeHarness(ReferenceModel(weights, 1024), executor, max_prompt=70, graph=True)
    harness.prefill(torch.randint(0, spec.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).cuda())
    for _ in range(12):
        r = harness.verify()
        err = (r.executor_hidden.float() - r.stock_hidden.float()).norm(dim=-1) / r.stock_hidden.float().norm(dim=-1)
        assert err.max() < 3e-2, err
