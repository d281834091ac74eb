"""providers_flashinfer on a Hopper GPU against the reference core (marker gpu).

Each attention core runs attention_check's checks: one CUDA graph replayed over
contexts for a sliding and a full layer against the reference core (the bounds and
why are in tests/attention_check.py), and the whole step with the core pinned.
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

pytest.importorskip("flashinfer")
from sparkdecode_flashinfer.prefill import FlashInferFa3, FlashInferPrefill, jit_args, module_name  # noqa: E402
from sparkdecode_flashinfer.xqa import FlashInferXqa  # noqa: E402

CORES = {"xqa": FlashInferXqa, "fa2": FlashInferPrefill, "fa3": FlashInferFa3}


@pytest.mark.parametrize("kv_heads", [2, 16])  # a TP8 rank's and TP1's heads (GQA 8)
@pytest.mark.parametrize("core", list(CORES))
def test_core_in_one_graph_over_contexts(core, kv_heads):
    check_core_over_contexts(CORES[core], kv_heads)


@pytest.mark.parametrize("core", list(CORES))
def test_executor_with_flashinfer_core(core):
    """The whole step with the core pinned (attention_check.check_executor_with_core)."""
    check_executor_with_core(CORES[core])


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_prefill_module_names(backend):
    """The module the prefill cores build is the one FlashInfer names (the key of a
    prebuilt module in the JIT archive): fa2's primary, equal-K/V-stride module,
    fa3's SM90 module."""
    from flashinfer.jit.attention import modules

    gen = modules._gen_batch_prefill_primary_module if backend == "fa2" else modules.gen_batch_prefill_module
    assert gen(backend, *jit_args(64)).name == module_name(backend, 64)
