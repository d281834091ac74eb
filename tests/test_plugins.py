"""Provider discovery through real installed distributions.

The packs under ``tests/plugin_fixtures`` are built and installed with pip into a
temporary directory that is put on ``sys.path`` for this module, so ``discover()``
finds them the way it finds any installed pack: through the entry points of
``importlib.metadata``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sparkdecode.draft.providers import DRAFT_PROVIDERS
from sparkdecode.executor import DecodeConfig, SpecializedDecode
from sparkdecode.layout import LayoutError, resolve
from sparkdecode.plugins import GROUP, Registry, discover
from sparkdecode.protocols import Deployment
from sparkdecode.reference.kvcache import PagedKVCache
from sparkdecode.reference.model import ReferenceModel
from sparkdecode.reference.providers import PROVIDERS, ReferenceAttentionBoundary
from sparkdecode.spec import ModelSpec
from sparkdecode.weights import random_weights

FIXTURES = Path(__file__).parent / "plugin_fixtures"
PACKS = {  # fixture folder -> distribution
    "extra_pack": "sparkdecode-test-extra",
    "broken_pack": "sparkdecode-test-broken",
    "badclass_pack": "sparkdecode-test-badclass",
}
MODULES = ("sparkdecode_test_extra", "sparkdecode_test_broken", "sparkdecode_test_badclass")
EXTRA = "extra.attention_boundary"
REFERENCE = "reference.attention_boundary"
SPEC = ModelSpec.preset("tiny")


def _pip_install(target: Path, sources: list[Path]) -> None:
    base = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    offline = [*base, "--no-build-isolation", "--no-index", "--target", str(target), *map(str, sources)]
    done = subprocess.run(offline, capture_output=True, text=True)
    if done.returncode == 0:
        return
    output = done.stdout + done.stderr
    if "setuptools" not in output:
        raise RuntimeError(f"pip could not install the fixture packs:\n{output}")
    # No setuptools in this environment: let pip build in an isolated one.
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([*base, "--target", str(target), *map(str, sources)], check=True)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The three fixture packs installed for real, importable for this module only."""
    root = tmp_path_factory.mktemp("packs")
    # Build from copies so the build leaves no egg-info or build folder in the repository.
    sources = []
    for folder in PACKS:
        copy = root / "src" / folder
        shutil.copytree(FIXTURES / folder, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        sources.append(copy)
    target = root / "site"
    _pip_install(target, sources)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(target))
        importlib.invalidate_caches()
        yield target
    for name in [m for m in sys.modules if m.split(".")[0] in MODULES]:
        del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture(scope="module")
def registry(installed: Path) -> Registry:
    """Everything installed: the reference, the fixture packs and any other pack."""
    return discover()


@pytest.fixture(scope="module")
def fixture_registry(installed: Path) -> Registry:
    """The reference and the fixture packs only (their entry points read from their
    installed metadata), so a provider pack installed beside them cannot change
    which provider the layout tests expect."""
    eps = [
        ep for dist in PACKS.values() for ep in importlib.metadata.distribution(dist).entry_points if ep.group == GROUP
    ]
    assert sorted(ep.name for ep in eps) == ["badclass", "broken", "extra"]
    return discover(entry_points=eps)


def _reasons(registry: Registry, pack: str) -> list[str]:
    return [reason for name, reason in registry.broken if name == pack]


def test_entry_points_are_installed(installed: Path) -> None:
    by_name = {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}
    assert by_name["extra"].value == "sparkdecode_test_extra.plugin"
    assert by_name["broken"].value == "sparkdecode_test_broken.plugin"
    assert by_name["badclass"].value == "sparkdecode_test_badclass.plugin"
    assert importlib.metadata.version("sparkdecode-test-extra") == "0.0.1"


def test_extra_pack_discovered(registry: Registry) -> None:
    reg = registry.find(EXTRA)
    assert reg is not None, registry.broken
    assert (reg.pack, reg.distribution, reg.version, reg.block) == (
        "extra",
        "sparkdecode-test-extra",
        "0.0.1",
        "attention_boundary",
    )
    assert reg.cls.__module__ == "sparkdecode_test_extra.plugin"
    assert issubclass(reg.cls, ReferenceAttentionBoundary)
    assert reg.cls.priority == 10
    assert registry.versions()["extra"] == "sparkdecode-test-extra==0.0.1"
    # The reference providers are still registered, from the core.
    for cls in PROVIDERS:
        ref = registry.find(cls.name)
        assert ref is not None and ref.cls is cls
        assert (ref.pack, ref.distribution) == ("reference", "sparkdecode")
    assert registry.of("attention_boundary")[0].name == REFERENCE


def test_broken_pack_reported_others_load(registry: Registry) -> None:
    [reason] = _reasons(registry, "broken")
    assert "sparkdecode_test_broken.plugin" in reason
    assert "ImportError" in reason
    assert "no_such_kernel_library" in reason
    assert not [r for r in registry.providers if r.pack == "broken"]
    assert registry.find(EXTRA) is not None
    assert registry.find(REFERENCE) is not None


def test_bad_class_reported(registry: Registry) -> None:
    [reason] = _reasons(registry, "badclass")
    assert "NonsenseProvider.block" in reason
    assert "'nonsense'" in reason
    assert registry.find("badclass.nonsense") is None
    assert not [r for r in registry.providers if r.pack == "badclass"]


def test_skipped_packs_are_logged(installed: Path, caplog: pytest.LogCaptureFixture) -> None:
    eps = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name in ("broken", "badclass")]
    with caplog.at_level(logging.WARNING, logger="sparkdecode.plugins"):
        registry = discover(entry_points=eps)
    assert [r.name for r in registry.providers] == [cls.name for cls in PROVIDERS + DRAFT_PROVIDERS]
    assert {name for name, _ in registry.broken} == {"broken", "badclass"}
    logged = caplog.text
    assert "skipped provider pack broken" in logged
    assert "skipped provider pack badclass" in logged


def test_fixture_registry(fixture_registry: Registry) -> None:
    assert {r.pack for r in fixture_registry.providers} == {"reference", "extra"}
    assert {name for name, _ in fixture_registry.broken} == {"broken", "badclass"}


def test_only_keeps_the_named_packs(fixture_registry: Registry) -> None:
    reference = fixture_registry.only("reference")
    assert {r.pack for r in reference.providers} == {"reference"}
    assert reference.broken == fixture_registry.broken
    assert len(fixture_registry.only("reference", "extra").providers) == len(fixture_registry.providers)
    layout = resolve(reference, Deployment(spec=SPEC, max_context=1024))
    assert layout.provider("attention_boundary") is ReferenceAttentionBoundary
    with pytest.raises(ValueError, match=r"no provider pack cuda; registered: extra, reference"):
        fixture_registry.only("reference", "cuda")


# The layout over the discovered providers.


def test_resolve_prefers_extra_by_priority(fixture_registry: Registry) -> None:
    layout = resolve(fixture_registry, Deployment(spec=SPEC, max_context=1024))
    choice = layout.choices["attention_boundary"]
    assert choice.chosen.name == EXTRA
    assert choice.how == "priority"
    assert layout.provider("attention_boundary") is fixture_registry.find(EXTRA).cls
    assert {c.name: c.reason for c in choice.candidates} == {REFERENCE: None, EXTRA: None}
    for kind, other in layout.choices.items():
        if kind != "attention_boundary":
            assert other.chosen.pack == "reference"


def test_resolve_pin_to_reference(fixture_registry: Registry) -> None:
    deployment = Deployment(spec=SPEC, max_context=1024)
    layout = resolve(fixture_registry, deployment, {"attention_boundary": REFERENCE})
    assert layout.choices["attention_boundary"].how == "pinned"
    assert layout.provider("attention_boundary") is ReferenceAttentionBoundary


def test_resolve_long_context_skips_extra(fixture_registry: Registry) -> None:
    layout = resolve(fixture_registry, Deployment(spec=SPEC, max_context=4096))
    assert layout.provider("attention_boundary") is ReferenceAttentionBoundary
    [extra] = [c for c in layout.choices["attention_boundary"].candidates if c.name == EXTRA]
    assert extra.reason == "needs max_context <= 2048, got 4096"
    assert f"{EXTRA}: needs max_context <= 2048, got 4096" in layout.table()


def test_resolve_pin_to_unsupported_names_reason(fixture_registry: Registry) -> None:
    with pytest.raises(LayoutError, match=r"extra\.attention_boundary.*needs max_context <= 2048"):
        resolve(fixture_registry, Deployment(spec=SPEC, max_context=4096), {"attention_boundary": EXTRA})


def test_resolve_pin_to_unknown_provider(fixture_registry: Registry) -> None:
    with pytest.raises(LayoutError, match=r"'extra\.no_such_provider'"):
        resolve(
            fixture_registry, Deployment(spec=SPEC, max_context=1024), {"attention_boundary": "extra.no_such_provider"}
        )


def test_resolve_pin_to_provider_of_another_block(fixture_registry: Registry) -> None:
    with pytest.raises(LayoutError, match="a provider of attention_boundary"):
        resolve(fixture_registry, Deployment(spec=SPEC, max_context=1024), {"attention": EXTRA})


def test_resolve_pin_for_unknown_block(fixture_registry: Registry) -> None:
    with pytest.raises(LayoutError, match="unknown block 'attention_sink'"):
        resolve(fixture_registry, Deployment(spec=SPEC, max_context=1024), {"attention_sink": REFERENCE})


# End to end: the executor with the extra pack equals the stock forward.


def test_executor_with_extra_pack_matches_reference(
    fixture_registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = fixture_registry.find(EXTRA).cls
    calls = []
    run = extra.run

    def counting_run(self, partial, stream, out):
        calls.append(type(self))
        run(self, partial, stream, out)

    monkeypatch.setattr(extra, "run", counting_run)

    max_context, q, aux_layers = 1024, 8, (1, SPEC.num_layers)
    weights = random_weights(SPEC, seed=0)
    executor = SpecializedDecode(
        weights, DecodeConfig(q=q, max_context=max_context, aux_layers=aux_layers), registry=fixture_registry
    )
    assert executor.layout.choices["attention_boundary"].chosen.name == EXTRA
    assert all(type(layer.attention_boundary) is extra for layer in executor.layers)

    reference = ReferenceModel(weights, max_context)
    cache = PagedKVCache(SPEC, num_pages=64, max_context=max_context, max_rows=64)
    gen = torch.Generator().manual_seed(1)
    # A prompt well past the sliding window: the step releases the sliding group's
    # first pages, so its block table points at the null page there.
    pos = SPEC.sliding_window + 41
    prompt = torch.randint(0, SPEC.vocab_size, (pos,), generator=gen)
    ids = torch.randint(0, SPEC.vocab_size, (q,), generator=gen)
    for first in range(0, pos, 64):  # prefill in chunks of the cache's row limit
        reference.step(cache, prompt[first : first + 64], first)

    clone = cache.clone()
    executor.prepare_kv(clone.kv())
    clone.begin_step(pos, q)
    step = executor.plan(torch.arange(pos, pos + q))
    assert step is not None
    hidden, aux = executor.run(step, input_ids=ids)

    expected, expected_aux = reference.step(cache, ids, pos, aux_layers)
    assert torch.equal(hidden, expected)
    assert len(aux) == len(expected_aux) == 2
    for got, want in zip(aux, expected_aux):
        assert torch.equal(got, want)
    assert calls == [extra] * SPEC.num_layers
    # The K/V the step wrote are the same too.
    for mine, theirs in zip(clone.tensors, cache.tensors):
        assert torch.equal(mine, theirs)


class FakeEntryPoint:
    """An entry point of the providers group as ``discover`` reads one: a name, a
    value, a distribution and ``load()``."""

    def __init__(self, name: str, dist: str, load) -> None:
        self.name, self.value, self._load = name, f"{dist.replace('-', '_')}:plugin", load
        self.dist = type("Dist", (), {"name": dist, "version": "1.0"})()

    def load(self):
        return self._load()


def _plugin(*classes: type) -> object:
    from sparkdecode.plugins import hookimpl

    class Plugin:
        @hookimpl
        def sparkdecode_providers(self):
            return classes

    return Plugin()


def _extra_boundary(name: str, priority: object = 5) -> type:
    return type(name, (ReferenceAttentionBoundary,), {"name": name, "priority": priority})


def test_an_entry_point_name_two_distributions_register_takes_neither() -> None:
    one = FakeEntryPoint("dup", "dist-one", lambda: _plugin(_extra_boundary("dup.one")))
    two = FakeEntryPoint("dup", "dist-two", lambda: _plugin(_extra_boundary("dup.two")))
    registry = discover([one, two])
    assert registry.find("dup.one") is None and registry.find("dup.two") is None
    assert ("dup", "registered by several distributions: dist-one, dist-two") in registry.broken


def test_a_pack_named_reference_never_displaces_the_core() -> None:
    rogue = FakeEntryPoint("reference", "rogue-dist", lambda: _plugin(_extra_boundary("rogue.boundary")))
    registry = discover([rogue])
    assert registry.find(REFERENCE) is not None and registry.find("rogue.boundary") is None
    assert any(pack == "reference" and "rogue-dist" in reason for pack, reason in registry.broken)


def test_a_pack_that_exits_at_import_is_reported() -> None:
    def exits():
        raise SystemExit("no CUDA here")

    registry = discover([FakeEntryPoint("exiting", "exiting-dist", exits)])
    assert registry.find(REFERENCE) is not None
    assert any(pack == "exiting" and "SystemExit: no CUDA here" in reason for pack, reason in registry.broken)


def test_a_bool_priority_is_not_a_priority() -> None:
    registry = discover([FakeEntryPoint("odd", "odd-dist", lambda: _plugin(_extra_boundary("odd.boundary", True)))])
    assert registry.find("odd.boundary") is None
    assert ("odd", "odd.boundary: priority must be an int") in registry.broken


def test_a_pin_to_a_provider_of_a_skipped_pack_names_the_pack() -> None:
    def fails():
        raise ImportError("No module named 'numpy'")

    registry = discover([FakeEntryPoint("fast", "fast-dist", fails)])
    deployment = Deployment(spec=SPEC, max_context=1024)
    with pytest.raises(LayoutError, match="which no installed pack provides .*; skipped packs: fast: import of"):
        resolve(registry, deployment, {"attention_boundary": "fast.attention_boundary"})


def test_installed_libraries_need_the_module_too(monkeypatch) -> None:
    """A distribution whose module is absent (``pip install --no-deps
    nvidia-cutlass-dsl`` leaves such a placeholder) counts as missing."""
    from sparkdecode import deployment

    monkeypatch.setattr(deployment, "LIBRARIES", {"pluggy": "pluggy", "no_such_module_here": "pluggy"})
    found = deployment.installed_libraries()
    assert found["pluggy"] == importlib.metadata.version("pluggy") and found["no_such_module_here"] is None


def test_import_problem_names_the_failure() -> None:
    from sparkdecode.deployment import import_problem

    assert import_problem("json") is None
    assert import_problem("no_such_module_here") == (
        "no_such_module_here is installed but cannot be imported "
        "(ModuleNotFoundError: No module named 'no_such_module_here')"
    )


def test_a_failed_build_names_the_provider() -> None:
    class Failing(ReferenceAttentionBoundary):
        name = "failing.attention_boundary"
        priority = 9

        @classmethod
        def build(cls, ctx, layer):
            raise ValueError("the weights are not in the form this kernel reads")

    registry = discover([FakeEntryPoint("failing", "failing-dist", lambda: _plugin(Failing))])
    weights = random_weights(SPEC, seed=0)
    with pytest.raises(ValueError, match="not in the form") as e:
        SpecializedDecode(weights, DecodeConfig(max_context=256), registry=registry)
    assert "sparkdecode: raised building failing.attention_boundary for layer 0" in e.value.__notes__
