"""providers_cuda's L2 prefetch on the CPU (prefetch.py): the kernel's table (runs cut
into chunks, each region's first chunk), the regions it refuses by name, and the kernel
compiling spill-free for sm_90a. Its GPU test: tests/test_gpu_cuda_prefetch.py."""

from __future__ import annotations

import pytest
import torch

prefetch = pytest.importorskip("sparkdecode_cuda.prefetch")


def test_table_cuts_runs_into_chunks():
    w = torch.empty(4096, 8192, dtype=torch.bfloat16)
    r = torch.empty(256, 8192)
    regions = [
        prefetch.whole(r),  # 8 MB: 512 chunks of 16 KB
        prefetch.Region(w, 2048, rows=4096, stride=16384),  # a run a row under a chunk
        prefetch.Region(w, 20000, rows=3, stride=16384, offset=8192),  # a run past a chunk: 2 a row
    ]
    rows, chunks = prefetch.table(regions)
    assert [row[4] for row in rows] == [512, 1, 2]
    assert [row[5] for row in rows] == [0, 512, 512 + 4096]
    assert chunks == 512 + 4096 + 6
    assert rows[2][0] == w.data_ptr() + 8192 and rows[2][1:4] == [16384, 20000, 3]
    assert rows[0][2] == 256 * 8192 * 4 and rows[0][3] == 1


def test_regions_refused_by_name():
    w = torch.empty(64, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 16"):
        prefetch.table([prefetch.Region(w, 100)])
    with pytest.raises(ValueError, match="past the tensor"):
        prefetch.table([prefetch.Region(w, 2048, rows=65, stride=2048)])
    with pytest.raises(ValueError, match="contiguous rows"):
        prefetch.whole(w.t())
    view = prefetch.whole(w[:, 256:768])  # rows of a wider weight: a run a row
    assert (view.nbytes, view.rows, view.stride) == (1024, 64, 2048) and view.reason() is None
    assert prefetch.Region(w, 2048, rows=64, stride=2048).reason() is None


def test_prefetching_blocks_are_not_registered():
    from sparkdecode_cuda import attention, moe, plugin

    for cls in (attention.CudaAttentionPrefetch, attention.CudaAttentionPrefetchPooler):
        assert cls not in plugin.PROVIDERS and issubclass(cls, attention.CudaAttention)
    for cls in (moe.CudaMoEPrefetch, moe.CudaMoEPrefetchNormal):
        assert cls not in plugin.PROVIDERS and issubclass(cls, moe.CudaMoE)


@pytest.mark.parametrize("evict_last", [0, 1])
def test_kernel_compiles_with_either_policy(evict_last):
    nvrtc = pytest.importorskip("sparkdecode_cuda.nvrtc")
    if nvrtc.nvrtc_unavailable() is not None:
        pytest.skip(f"NVRTC: {nvrtc.nvrtc_unavailable()}")
    from ptxas_check import assert_spill_free

    usage = assert_spill_free(prefetch.SOURCE, {"CHUNK": prefetch.CHUNK, "EVICT_LAST": evict_last}, ())
    assert set(usage) == {"l2_prefetch_kernel"}
