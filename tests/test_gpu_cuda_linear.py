"""cuda.linear (kernels/linear.cu) on a Hopper GPU (marker gpu): against the
reference within linear_check's bounds (fp32 sums of the bf16 products in
another order, rounded once; the router's fp32 weights split exactly into three bf16
parts, so only fp32 accumulation), eager, on a second run and in a replayed graph
with the same bits, rows past b untouched, at TP1, TP8-rank and sharded-pooler
shapes; x with an odd row stride and offset (the kernel's 2-byte staging path); and
the weight streams of torch.mm and cuda.linear side by side, with the model's best
tilings of each TP8-rank weight (run with -s; nothing asserted about speed).

Split-K runs in thread-block clusters whose partials meet in distributed shared
memory: there is no workspace or counter to return to zero.
"""

from __future__ import annotations

import pytest
import torch
from linear_check import HOPPER, SHAPES, Tiling, check_close, equals_reference, print_streams, tilings_equal_reference

pytestmark = [pytest.mark.gpu, HOPPER]

pytest.importorskip("sparkdecode_cuda.linear")

from sparkdecode.bench import streams  # noqa: E402
from sparkdecode.protocols import LINEAR_WEIGHTS  # noqa: E402
from sparkdecode.reference.providers import ReferenceLinear  # noqa: E402
from sparkdecode_cuda.linear import CudaLinear, _Weight, plans  # noqa: E402


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_cuda_linear_equals_reference(shape, rows):
    equals_reference(CudaLinear, shape, rows)


def test_odd_x_stride_and_offset():
    """x rows 2-byte aligned with an odd row stride: staged element by element, the
    same bounds."""
    ctx = streams.linear_context(SHAPES["tp8-rank"], torch.device("cuda"))
    op, ref = CudaLinear.build(ctx, 0), ReferenceLinear.build(ctx, 0)
    for name in LINEAR_WEIGHTS:
        w = getattr(ctx.layer(0), name)
        n, k = w.shape
        wide = torch.randn(5, k + 3, device="cuda").to(torch.bfloat16)
        x = wide[:, 1 : 1 + k]
        assert x.stride(0) % 2 and x.data_ptr() % 16
        out = torch.empty(5, n, dtype=w.dtype, device="cuda")
        expected = torch.empty_like(out)
        op.run(name, x, out)
        ref.run(name, x, expected)
        torch.cuda.synchronize()
        check_close(name, x, w, out, expected)


def test_bad_input_is_an_error():
    ctx = streams.linear_context(SHAPES["tp8-rank"], torch.device("cuda"))
    op = CudaLinear.build(ctx, 0)
    x = torch.zeros(9, 8192, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="9 rows"):
        op.run("pooler", x, torch.empty(9, 4096, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="not bf16"):
        op.run("pooler", x[:2].float(), torch.empty(2, 4096, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="is not torch.float32"):
        op.run("router", x[:2], torch.empty(2, 256, dtype=torch.bfloat16, device="cuda"))


def test_print_streams():
    print_streams([CudaLinear])


def test_tilings_equal_reference_and_print_their_streams():
    """Each TP8-rank weight under the model's five best tilings, its bandwidth
    printed beside the model's (for tuning the model)."""

    def tilings(name, w, sms):
        chosen = _Weight(name, w, 8, sms).plan
        ranked = sorted(plans(*w.shape, w.dtype == torch.float32), key=lambda p: p.seconds(sms))
        for p in [chosen, *[p for p in ranked if p != chosen][:4]]:
            head = f"tm {p.tm} wm {p.wm} splits {p.splits} depth {p.depth} CTAs {p.ctas:>4}"
            yield Tiling(p, _Weight(name, w, 8, sms, p), head, f" (model {p.seconds(sms) * 1e6:6.1f} us)")

    tilings_equal_reference(tilings)
