"""NVFP4 experts: the codec against independent formulations (vLLM's dequantization
and e2m1 rounding written out again here), the TP slicing of packed weights and
scales, and the reference model and executor over NVFP4 layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparkdecode import nvfp4
from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.harness import DecodeHarness
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import ExpertWeights, Sharding, quantize_experts, random_weights, shard_weights

TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def vllm_style_dequantize(packed, scale, global_scale, dtype=torch.bfloat16):
    """vLLM's dequantize_to_dtype (no swizzle), written out element by element."""
    rows, half = packed.shape
    out = torch.empty(rows, half * 2, dtype=torch.float32)
    sf = scale.float() * global_scale
    for r in range(rows):
        for i, byte in enumerate(packed[r].tolist()):
            for j, nibble in enumerate((byte & 0x0F, byte >> 4)):
                k = 2 * i + j
                value = TABLE[nibble & 7] * (-1.0 if nibble & 8 else 1.0)
                out[r, k] = value * sf[r, k // 16]
    return out.to(dtype)


def test_nibble_order_and_sign():
    # 0x2A: low nibble 0xA = -1.0 (element 0), high nibble 0x2 = 1.0 (element 1)
    assert nvfp4.unpack(torch.tensor([[0x2A, 0xF7]], dtype=torch.uint8)).tolist() == [[-1.0, 1.0, 6.0, -6.0]]
    values = torch.tensor([[0.0, -0.5, 1.5, -6.0, 4.0, 3.0, -2.0, 1.0]])
    assert torch.equal(nvfp4.unpack(nvfp4.pack(values)), values)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantization_is_bit_exact(seed):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (3, 32), generator=g, dtype=torch.uint8)
    scale = (torch.rand(3, 4, generator=g) * 400).to(torch.float8_e4m3fn)
    glob = torch.rand((), generator=g) * 1e-3
    for dtype in (torch.bfloat16, torch.float32):
        ours = nvfp4.dequantize(packed, scale, glob, dtype)
        assert torch.equal(ours, vllm_style_dequantize(packed, scale, glob, dtype))


def vllm_cast_to_fp4(x):
    """vLLM's cast_to_fp4 (the reference NVFP4 rounding), as written there."""
    sign, x = torch.sign(x), torch.abs(x).clone()
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def test_e2m1_rounding_matches_vllm_including_ties():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([ties, -ties, torch.linspace(-6, 6, 2001)])
    assert torch.equal(nvfp4.round_e2m1(x), vllm_cast_to_fp4(x))


def test_quantize_follows_modelopt_and_round_trips():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(4, 64, 128, generator=g) * 0.02).to(torch.bfloat16)
    codes, scale, glob = nvfp4.quantize(w)
    assert codes.shape == (4, 64, 64) and scale.shape == (4, 64, 8) and glob.shape == (4,)
    amax = w.float().abs().amax(dim=(1, 2))
    assert torch.equal(glob, amax / (6 * 448))  # ModelOpt's global decode scale
    dq = nvfp4.dequantize(codes, scale, glob, torch.float32)
    err = (dq - w.float()).norm() / w.float().norm()
    assert err < 0.12  # e2m1 keeps 1 mantissa bit: about 9% RMS error on Gaussian blocks
    # Each block's largest magnitude maps to 6 (or close, through the e4m3 scale).
    assert (nvfp4.unpack(codes).abs().amax(-1) >= 4).all()


def test_block_scale_divides_once_as_modelopt_does():
    """ModelOpt's block scale is ``block_amax / (6 * global)``, one fp32 division.
    Dividing by 6 and then by the global rounds twice; at an e4m3 tie (1.0625 lies
    halfway between 1 and 1.125) the extra ulp picks the other neighbour. The tensor
    here is built so that the two orders disagree."""
    g = torch.Generator().manual_seed(11)
    for _ in range(10_000):
        amax = float(torch.rand((), generator=g)) + 0.5
        glob = torch.tensor(amax, dtype=torch.float32) / (6 * 448)
        block_amax = torch.tensor(1.0625 * 6, dtype=torch.float32) * glob
        once = (block_amax / (6 * glob)).to(torch.float8_e4m3fn)
        twice = (block_amax / 6 / glob).to(torch.float8_e4m3fn)
        if once.float() != twice.float():
            break
    else:
        pytest.fail("no tensor where the two orders of division disagree")
    w = torch.zeros(1, 32)
    w[0, 0] = amax
    w[0, 16] = block_amax
    _, scale, global_scale = nvfp4.quantize(w)
    assert global_scale.item() == glob.item()
    assert scale[0, 1].float() == once.float()


def test_a_block_whose_scale_underflows_codes_as_modelopt_does():
    """A block far below the tensor's largest value gets an e4m3 scale of 0; ModelOpt
    divides by it (x / 0: +-inf, 0 / 0: NaN) and its rounding takes both to 6 with
    the value's sign (NaN: +6, code 7). The block dequantizes to zeros."""
    w = torch.zeros(1, 32)
    w[0, 0] = 1.0
    w[0, 16:19] = torch.tensor([1e-7, -1e-7, 0.0])
    codes, scale, glob = nvfp4.quantize(w)
    assert scale[0, 1].float() == 0
    assert nvfp4.unpack(codes)[0, 16:].tolist() == [6.0, -6.0] + [6.0] * 14
    assert (nvfp4.dequantize(codes, scale, glob, torch.float32)[0, 16:] == 0).all()


def test_expert_tp_and_ep_slices_of_packed_experts():
    spec = ModelSpec.preset("tiny", 3)
    full = random_weights(spec, seed=4, expert_format="nvfp4")
    assert [w.experts.format for w in full.layers] == ["bf16", "nvfp4", "bf16"]  # edge layers stay bf16
    w13, w2 = full.layers[1].experts.dequantized()
    for experts_mode in ("tp", "ep"):
        for rank in range(2):
            part = shard_weights(full, Sharding(2, rank, experts_mode)).layers[1].experts
            assert part.format == "nvfp4"
            s13, s2 = part.dequantized()
            if experts_mode == "tp":
                lo, hi = part.intermediate_slice
                gate, up = w13.chunk(2, dim=1)
                assert torch.equal(s13, torch.cat([gate[:, lo:hi], up[:, lo:hi]], dim=1))
                assert torch.equal(s2, w2[:, :, lo:hi])
            else:
                experts = slice(part.first_expert, part.first_expert + part.num_local)
                assert torch.equal(s13, w13[experts]) and torch.equal(s2, w2[experts])


def test_quantized_experts_keep_their_layout():
    e = random_weights(ModelSpec.preset("tiny", 1), seed=5).layers[0].experts
    q = quantize_experts(e, chunk=5)
    assert q.w13.dtype == torch.uint8 and q.w13.shape == (16, 1024, 256)
    assert q.nvfp4.w13_global.shape == (16, 2) and q.nvfp4.w2_global.shape == (16,)
    w13, w2 = q.dequantized()
    assert (w13.float() - e.w13.float()).norm() / e.w13.float().norm() < 0.12
    with pytest.raises(ValueError, match="scales"):
        ExpertWeights("nvfp4", q.w13, q.w2)


def test_executor_over_nvfp4_layers_equals_stock():
    spec = ModelSpec.preset("tiny")
    weights = random_weights(spec, seed=6, expert_format="nvfp4")
    executor = SpecializedDecode(weights, DecodeConfig(max_context=512, aux_layers=(0, 4)))
    assert executor.deployment.expert_format == "nvfp4"
    assert executor.layout.choices["experts_nvfp4"].chosen.name == "reference.experts_nvfp4"
    harness = DecodeHarness(ReferenceModel(weights, 512), executor, max_prompt=70, seed=1)
    harness.prefill(torch.randint(0, spec.vocab_size, (70,), generator=torch.Generator().manual_seed(0)))
    for _ in range(4):
        r = harness.verify()
        assert torch.equal(r.stock_hidden, r.executor_hidden)


def test_nvfp4_changes_the_experts_math_only():
    """The NVFP4 model differs from its bf16 source only through its experts' weights."""
    spec = ModelSpec.preset("tiny", 3)
    bf16 = random_weights(spec, seed=7)
    q = random_weights(spec, seed=7, expert_format="nvfp4")
    for a, b in zip(bf16.layers, q.layers):
        assert torch.equal(a.qkvg, b.qkvg) and torch.equal(a.router, b.router)
    deq = dataclasses.replace(q.layers[1].experts)
    w13, _ = deq.dequantized()
    assert (w13.float() - bf16.layers[1].experts.w13.float()).norm() / bf16.layers[1].experts.w13.float().norm() < 0.12


def test_expert_tp_needs_whole_scale_blocks_per_rank():
    spec = dataclasses.replace(ModelSpec.preset("tiny", 1), moe_intermediate_size=48)
    experts = quantize_experts(random_weights(spec, seed=9).layers[0].experts)
    full = random_weights(spec, seed=9)
    full.layers[0].experts = experts
    with pytest.raises(ValueError, match="each rank's 24 rows of I = 48 must be whole NVFP4 scale blocks of 16"):
        shard_weights(full, Sharding(2, 0, "tp"))
    assert shard_weights(full, Sharding(2, 1, "ep")).layers[0].experts.first_expert == 8  # EP cuts no block
