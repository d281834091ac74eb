"""vLLM's own machinery finds the integration: its plug-in loader runs the entry
point, its model registry resolves the Muse Spark architecture to the subclass
(by import and by the subprocess inspection vLLM runs before a model is built),
and its V2 runner's ModelState resolution picks the subclass's state."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest
import vllm.plugins
from vllm import ModelRegistry
from vllm.model_executor.models.registry import _LazyRegisteredModel
from vllm.models.muse_spark import MuseSparkForConditionalGeneration
from vllm.v1.worker.gpu.model_states import resolve_model_state_cls
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm_support import load_model

from sparkdecode import vllm as integration
from sparkdecode.vllm import gate
from sparkdecode.vllm.model import SparkDecodeModelState, SparkDecodeMuseSpark

ARCH = "MuseSparkForConditionalGeneration"


def _fields(info) -> dict:
    """A model info's fields but the class name, collections as sorted lists (the
    inspected info comes back through JSON)."""
    out = dataclasses.asdict(info)
    out.pop("architecture")
    return {k: sorted(v) if isinstance(v, (set, frozenset, list, tuple)) else v for k, v in out.items()}


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded() -> None:
    """vLLM's loader, as every vLLM process runs it (once per process)."""
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()


def test_the_core_distribution_declares_the_entry_point() -> None:
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    (point,) = [p for p in points if p.name == "sparkdecode"]
    assert point.value == "sparkdecode.vllm:register"
    assert point.dist is not None and point.dist.name == "sparkdecode"


def test_vllms_plugin_loader_registers_the_subclass_lazily() -> None:
    registered = ModelRegistry.models[ARCH]
    assert isinstance(registered, _LazyRegisteredModel)
    assert f"{registered.module_name}:{registered.class_name}" == integration.MODEL_CLASS


def test_registering_again_is_harmless() -> None:
    integration.register()
    integration.register()
    assert ModelRegistry.models[ARCH].class_name == "SparkDecodeMuseSpark"


def test_the_registry_resolves_the_architecture_to_the_subclass(make_config) -> None:
    config = make_config()
    cls, arch = ModelRegistry.resolve_model_cls([ARCH], config.model_config)
    assert (cls, arch) == (SparkDecodeMuseSpark, ARCH)
    assert issubclass(cls, MuseSparkForConditionalGeneration)


def test_the_registry_inspects_the_subclass_as_the_stock_model(make_config) -> None:
    """vLLM inspects a lazily registered class in a subprocess before building it:
    the subclass reports what the stock class reports (multimodal, MoE, EAGLE-3
    aux states), so vLLM configures the deployment exactly as for stock."""
    config = make_config()
    info, arch = ModelRegistry.inspect_model_cls([ARCH], config.model_config)
    assert arch == ARCH
    stock = type(info).from_model_cls(MuseSparkForConditionalGeneration)
    assert _fields(info) == _fields(stock)
    assert info.supports_multimodal and info.is_text_generation_model and not info.is_hybrid


@pytest.mark.parametrize("backend", ["auto", "latency_specialized"])
def test_the_v2_runner_resolves_the_model_state(make_config, checkpoint, distributed, monkeypatch, backend) -> None:
    monkeypatch.setattr(gate, "platform_capability", lambda: (9, 0))
    config = make_config(additional={"decode_backend": backend})
    model = load_model(config, checkpoint)
    assert type(model) is SparkDecodeMuseSpark
    expected = DefaultModelState if backend == "auto" else SparkDecodeModelState
    assert resolve_model_state_cls(config, model) is expected
    assert model.sparkdecode is None  # built by the ModelState, after the weights load
    assert (model.sparkdecode_settings is None) == (backend == "auto")
    assert issubclass(SparkDecodeModelState, DefaultModelState)
