"""cuda.attention_core on a Hopper GPU against the reference core (marker gpu):
tests/attention_check.py's checks (one graph over contexts, a sliding and a full
layer at a TP8 rank's and TP1's KV heads; the whole step with the core pinned).

The bound is attention_check's 1e-2; this core keeps the probabilities to about
2^-17 through the PV product, so its rows should differ from the reference's by the
output's bf16 rounding alone (a few 1e-3 at most): the largest error is printed.
"""

from __future__ import annotations

import pytest
import torch
from attention_check import check_core_over_contexts, check_executor_with_core

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
    ),
]

from sparkdecode_cuda.attention_core import CudaAttentionCore  # noqa: E402


@pytest.mark.parametrize("kv_heads", [2, 16])  # a TP8 rank's and TP1's heads (GQA 8)
def test_core_in_one_graph_over_contexts(kv_heads):
    check_core_over_contexts(CudaAttentionCore, kv_heads)


def test_executor_with_cuda_core():
    check_executor_with_core(CudaAttentionCore)
