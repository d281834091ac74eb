"""sparkdecode inside vLLM 0.33, without changing vLLM.

The entry point ``vllm.general_plugins: sparkdecode = sparkdecode.vllm:register``
runs in every vLLM process (front end, engine core, workers). It registers
``model.SparkDecodeMuseSpark`` (a subclass of the stock
``MuseSparkForConditionalGeneration``) under the same architecture name, as a
lazy ``"module:Class"`` string so nothing is imported before vLLM needs the model.

| module | holds |
| --- | --- |
| ``gate`` | ``decode_backend`` and every requirement, read from the ``VllmConfig`` |
| ``adapter`` | vLLM's loaded modules and bound KV caches as ``LayerWeights`` / ``LayerKV`` |
| ``model`` | the model subclass, its ``ModelState`` and the per-step plan |

Without ``additional_config={"decode_backend": "latency_specialized"}`` the
subclass is the stock model: same modules, same forward, same ModelState.
"""

from __future__ import annotations

import logging

ARCHITECTURE = "MuseSparkForConditionalGeneration"
MODEL_CLASS = "sparkdecode.vllm.model:SparkDecodeMuseSpark"
# A child of vLLM's logger, so these lines go where vLLM's go, in its format.
LOGGER = "vllm.sparkdecode"


def register() -> None:
    """The ``vllm.general_plugins`` hook: idempotent, imports no model code."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    route_core_logs()


def route_core_logs() -> None:
    """Send the core's own log lines (``sparkdecode.*``: the layout table, the
    build) to vLLM's handlers, once."""
    core, host = logging.getLogger("sparkdecode"), logging.getLogger("vllm")
    if core.handlers or not host.handlers:
        return
    for handler in host.handlers:
        core.addHandler(handler)
    core.setLevel(logging.INFO)
    core.propagate = False
