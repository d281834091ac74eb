"""providers_cuda's read-ahead on the CPU (read_ahead.py): the weights it refuses by name,
the kernel building spill-free for sm_90a at each depth, and the block not registered.
Its GPU test: tests/test_gpu_cuda_read_ahead.py."""

from __future__ import annotations

import pytest
import torch

read_ahead = pytest.importorskip("sparkdecode_cuda.read_ahead")


def test_weights_refused_by_name():
    w = torch.empty(64, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no weights"):
        read_ahead.ReadAhead(torch.device("cpu"), [])
    with pytest.raises(ValueError, match="not contiguous"):
        read_ahead.ReadAhead(torch.device("cpu"), [w[:, :512]])
    with pytest.raises(ValueError, match="not contiguous"):
        read_ahead.ReadAhead(torch.device("cpu"), [torch.empty(3, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="loads a thread"):
        read_ahead.ReadAhead(torch.device("cpu"), [w], depth=64)


def test_block_is_not_registered():
    from sparkdecode_cuda import attention, plugin

    cls = attention.CudaAttentionReadAhead
    assert cls not in plugin.PROVIDERS and issubclass(cls, attention.CudaAttention)


@pytest.mark.parametrize("depth", [8, 16])
def test_kernel_builds_spill_free(depth):
    nvrtc = pytest.importorskip("sparkdecode_cuda.nvrtc")
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    from ptxas_check import assert_spill_free

    assert set(assert_spill_free(read_ahead.SOURCE, {"DEPTH": depth}, ())) == {"read_ahead_kernel"}
