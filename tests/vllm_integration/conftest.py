"""The vLLM integration's tests: they run in .venv-vllm (scripts/setup-vllm), with
the real vllm==0.33.0 installed, on the CPU. The core suite (.venv, no vLLM)
collects nothing here.

vLLM on a machine without a GPU: the CUDA wheel imports, and with
``VLLM_TARGET_DEVICE=cpu`` its CPU platform builds the stock Muse Spark modules
(attention on its CPU backend). Two class methods of that platform are replaced
for the session, so configs and modules take the decisions they take on an H200:

- ``get_device_capability`` answers SM90: the Muse Spark MoE takes the SM90 bf16
  path (Triton experts, checkpoint layout kept, route-major finalize) and leaves
  its pooler/unpooler replicated, as on Hopper;
- ``support_static_graph_mode`` answers True: ``VllmConfig`` keeps the CUDA graph
  mode it is given (on the plain CPU platform it resets it to NONE).

``VLLM_USE_V2_MODEL_RUNNER=1`` stands in for the GPU default (vLLM picks the V1
runner where Triton cannot run).
"""

from __future__ import annotations

import importlib.util
import os

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:  # not installed (a bare directory named vllm is no vLLM)
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm_support import *  # noqa: E402, F403
