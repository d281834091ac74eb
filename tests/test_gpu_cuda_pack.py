"""providers_cuda on a Hopper GPU against the reference (marker gpu).

Bounds, and why: the kernels do the reference's fp32 elementwise operations in the
same order (no FMA contraction); only the two row reductions sum in another order.
So the fp32 stream agrees to 1e-5 relative (a few fp32 ulps through rsqrt), the aux
stream equals the stream exactly, and a bf16 output differs by at most one bf16 ulp
(2^-7 relative) where the fp32 value sits at a rounding boundary.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.harness import DecodeHarness
from sparkdecode.reference import functional as fn
from sparkdecode.reference import model
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs a Hopper GPU"
    ),
]

boundary = pytest.importorskip("sparkdecode_cuda.boundary")


def one_ulp_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out.float()).all()
    diff = (out.float() - ref.float()).abs()
    assert (diff <= ref.float().abs() * 2**-7 + 1e-30).all(), diff.max()


def random_norms(width: int, g: torch.Generator) -> SimpleNamespace:
    def vec(std: float) -> torch.Tensor:
        return (torch.randn(width, generator=g) * std).to(torch.bfloat16).cuda()

    alpha, beta = fn.gate_coefficients(torch.randn(width, generator=g).cuda(), 0.3)
    return SimpleNamespace(
        post_ffn_norm=vec(0.1),
        ffn_alpha=alpha,
        ffn_beta=beta,
        pre_qkv_norm=vec(0.1),
        pre_ffn_norm=vec(0.1),
        attn_alpha=alpha,
        attn_beta=beta,
    )


@pytest.mark.parametrize("width", [1024, 4096, 8192])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_boundary_kernel_equals_reference(width, rows, mode):
    spec = ModelSpec.preset("muse-spark-open")
    g = torch.Generator().manual_seed(width * 10 + rows + mode)
    w = random_norms(width, g)
    ctx = SimpleNamespace(spec=SimpleNamespace(H=width), device=torch.device("cuda"))
    kernel = boundary._BoundaryKernel(ctx)
    x = (torch.randn(rows, width, generator=g) * 3).to(torch.bfloat16).cuda()
    stream = torch.randn(rows, width, generator=g).cuda()
    out = torch.full((rows, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    aux = torch.full((rows, width), float("nan"), device="cuda")
    s0 = stream.clone()
    eps = spec.rms_norm_eps
    if mode == 0:
        ref_s = fn.embed_norm(x, eps)
        ref_out = fn.pre_norm(ref_s, w.pre_qkv_norm, eps).to(torch.bfloat16)
        args = (None, None, None, w.pre_qkv_norm, eps, eps, 1.0)
    elif mode == 1:
        ref_s = x.float()
        ref_out = fn.pre_norm(ref_s, w.pre_qkv_norm, eps).to(torch.bfloat16)
        args = (None, None, None, w.pre_qkv_norm, eps, eps, 1.0)
    elif mode == 2:
        ref_s, ref_out = model.input_boundary(spec, s0, x, w, w)
        args = (w.post_ffn_norm, w.ffn_alpha, w.ffn_beta, w.pre_qkv_norm, spec.post_norm_eps, eps, 1.0)
    else:
        ref_s, ref_out = model.attention_boundary(spec, w, s0, x)
        args = (None, w.attn_alpha, w.attn_beta, w.pre_ffn_norm, spec.post_norm_eps, eps, 1.0)
    kernel(mode, x, stream, out, aux, *args)
    torch.cuda.synchronize()
    torch.testing.assert_close(stream, ref_s, rtol=1e-5, atol=1e-6)
    assert torch.equal(aux, stream)
    one_ulp_close(out, ref_out)


def test_final_kernel_equals_reference():
    spec = ModelSpec.preset("tiny")
    g = torch.Generator().manual_seed(5)
    w = random_norms(spec.H, g)
    norm = (1 + torch.randn(spec.H, generator=g) * 0.1).to(torch.bfloat16).cuda()
    kernel = boundary._BoundaryKernel(SimpleNamespace(spec=spec, device=torch.device("cuda")))
    x = torch.randn(8, spec.H, generator=g).to(torch.bfloat16).cuda()
    stream = torch.randn(8, spec.H, generator=g).cuda()
    ref_s, ref_out = model.final_boundary(spec, stream.clone(), x, w, norm)
    out = torch.empty(8, spec.H, dtype=torch.bfloat16, device="cuda")
    kernel(
        2,
        x,
        stream,
        out,
        None,
        w.post_ffn_norm,
        w.ffn_alpha,
        w.ffn_beta,
        norm,
        spec.post_norm_eps,
        spec.rms_norm_eps,
        0.0,
    )
    torch.cuda.synchronize()
    torch.testing.assert_close(stream, ref_s, rtol=1e-5, atol=1e-6)
    one_ulp_close(out, ref_out)


@pytest.mark.parametrize("graph", [False, True])
def test_executor_with_cuda_boundaries(graph):
    """The whole step with the pack's boundaries pinned, eagerly and in one captured
    graph replayed over steps: close to the stock forward. One-ulp differences can
    flip a near-tied route of a random model and move a row far, so this runs with
    every expert routed (top-k = E: no discrete choice) over two layers, where the
    boundaries' roundings carried through stay at a few bf16 ulps; greedy tokens
    agree wherever the stock top-2 margin exceeds 4x the logit difference."""
    spec = dataclasses.replace(ModelSpec.preset("tiny", 2), num_experts_per_tok=16)
    weights = random_weights(spec, seed=2, device="cuda")
    pins = {"boundary": "cuda.boundary", "attention_boundary": "cuda.attention_boundary", "final": "cuda.final"}
    executor = SpecializedDecode(weights, DecodeConfig(max_context=1024, aux_layers=(0, 1, 2), pins=pins))
    assert executor.layout.choices["boundary"].chosen.name == "cuda.boundary"
    harness = DecodeHarness(ReferenceModel(weights, 1024), executor, max_prompt=70, graph=graph)
    harness.prefill(torch.randint(0, spec.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).cuda())
    for _ in range(12):
        r = harness.verify()
        err = (r.executor_hidden.float() - r.stock_hidden.float()).norm(dim=-1) / r.stock_hidden.float().norm(dim=-1)
        assert err.max() < 3e-2, err
        torch.testing.assert_close(r.executor_aux[0], r.stock_aux[0], rtol=1e-5, atol=1e-6)
        diff = (r.executor_logits - r.stock_logits).abs().max()
        top2 = r.stock_logits.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 4 * diff
        assert torch.equal(r.executor_logits.argmax(-1)[decided], r.stock_logits.argmax(-1)[decided])
