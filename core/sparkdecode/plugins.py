"""Provider discovery: pluggy hooks over the ``sparkdecode.providers`` entry points.

A pack is a distribution whose entry point in the group ``sparkdecode.providers``
names a plain module with ``@hookimpl`` functions. The core walks the group itself
and registers each module inside its own error handling (pluggy's own loader stops
at the first broken pack): a pack that fails to import, or returns something that
is not a provider class, is reported by name and skipped; the others still load.
The core registers its reference providers the same way, so a deployment with no
pack installed still runs.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

try:
    import pluggy
except ImportError as e:  # a core installed without its dependencies
    raise ImportError(f"sparkdecode needs pluggy (pip install 'pluggy>=1.5'): {e}") from e

from .protocols import ALL_KINDS

PROJECT = "sparkdecode"
GROUP = "sparkdecode.providers"
COMMAND_LINE = "command-line"  # the pack name of providers added by Registry.adding

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

logger = logging.getLogger(__name__)


class HookSpecs:
    """Every hook a pack may implement."""

    @hookspec
    def sparkdecode_providers(self) -> Sequence[type]:
        """The provider classes this pack registers: each declares ``block`` (one of
        ``protocols.ALL_KINDS``: the target's kinds and the draft's), ``name``
        (``pack.provider``), ``priority`` (int) and the class methods
        ``unsupported(deployment)`` and ``build(ctx, layer)``. Register only
        providers that work: one not done is not returned."""


@dataclass(frozen=True)
class Registered:
    """A discovered provider class and the pack it came from."""

    cls: type
    pack: str  # the entry point's name
    distribution: str
    version: str

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def block(self) -> str:
        return self.cls.block


@dataclass
class Registry:
    """Every provider discovered, and every pack or class that could not be used."""

    providers: list[Registered] = field(default_factory=list)
    broken: list[tuple[str, str]] = field(default_factory=list)  # (pack or class, reason)

    def of(self, kind: str) -> list[Registered]:
        return [p for p in self.providers if p.block == kind]

    def find(self, name: str) -> Registered | None:
        return next((p for p in self.providers if p.name == name), None)

    def versions(self) -> dict[str, str]:
        """Pack -> distribution version, for cache keys."""
        return {p.pack: f"{p.distribution}=={p.version}" for p in self.providers}

    def adding(self, classes: Sequence[type]) -> Registry:
        """This registry with ``classes`` (providers no pack registers, named on a
        command line: ``--provider``) added under the pack name ``COMMAND_LINE``; a class
        that is no provider, or whose name is taken, raises ValueError naming it."""
        added = Registry(list(self.providers), list(self.broken))
        for cls in classes:
            reason = invalid_provider(cls)
            if reason is None and added.find(cls.name) is not None:
                reason = f"{cls.name} is already registered"
            if reason is not None:
                raise ValueError(reason)
            added.providers.append(Registered(cls, COMMAND_LINE, getattr(cls, "__module__", "?"), "unregistered"))
        return added

    def only(self, *packs: str) -> Registry:
        """This registry with the providers of ``packs`` alone (``"reference"``: the
        core's stock math, whatever packs are installed); an unknown pack name raises
        ValueError naming the packs there are."""
        known = {p.pack for p in self.providers}
        unknown = [p for p in packs if p not in known]
        if unknown:
            raise ValueError(f"no provider pack {', '.join(unknown)}; registered: {', '.join(sorted(known))}")
        return Registry([p for p in self.providers if p.pack in packs], list(self.broken))

    def unregistered(self) -> dict[str, str]:
        """The providers ``adding`` took: name -> ``module:Class``."""
        return {p.name: f"{p.cls.__module__}:{p.cls.__qualname__}" for p in self.providers if p.pack == COMMAND_LINE}


def provider_class(path: str) -> type:
    """The class at ``module:Class`` (a provider not registered yet, named on a command
    line); ValueError, ImportError or AttributeError where there is none."""
    module, sep, name = path.partition(":")
    if not (sep and module and name):
        raise ValueError(f"{path!r} is not module:Class")
    return getattr(importlib.import_module(module), name)


def invalid_provider(cls: object) -> str | None:
    """Why ``cls`` is not a provider class, or None."""
    if not isinstance(cls, type):
        return f"{cls!r} is not a class"
    block = getattr(cls, "block", None)
    if block not in ALL_KINDS:
        return f"{cls.__qualname__}.block is {block!r}, not one of {', '.join(ALL_KINDS)}"
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or "." not in name:
        return f"{cls.__qualname__}.name must be 'pack.provider', got {name!r}"
    priority = getattr(cls, "priority", None)
    if not isinstance(priority, int) or isinstance(priority, bool):
        return f"{name}: priority must be an int"
    for method in ("unsupported", "build"):
        if not callable(getattr(cls, method, None)):
            return f"{name}: no {method}() class method"
    if not callable(getattr(cls, "run", None)):
        return f"{name}: no run() method"
    return None


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=GROUP)


class _CoreReference:
    """The core's reference providers as one plug-in: the target's blocks
    (``reference.providers``) and the DSpark draft's (``draft.providers``)."""

    @hookimpl
    def sparkdecode_providers(self) -> Sequence[type]:
        from .draft.providers import DRAFT_PROVIDERS
        from .reference import providers as reference

        return tuple(reference.sparkdecode_providers()) + DRAFT_PROVIDERS


def discover(entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> Registry:
    """Register the core's reference providers and every installed pack."""
    from . import __version__

    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(HookSpecs)
    registry = Registry()
    sources: list[tuple[str, ModuleType | object, str, str]] = [("reference", _CoreReference(), PROJECT, __version__)]
    for ep in _entry_points() if entry_points is None else entry_points:
        dist = ep.dist
        try:
            module = ep.load()
        except (Exception, SystemExit) as e:  # a broken pack (even one that exits) must not take the others down
            registry.broken.append((ep.name, f"import of {ep.value} failed: {type(e).__name__}: {e}"))
            continue
        sources.append((ep.name, module, dist.name if dist else ep.name, dist.version if dist else "unknown"))
    # An entry-point name two distributions register is ambiguous: neither pack is
    # taken (whichever came first would otherwise win by the order of the disk). The
    # core's own "reference" always stands.
    owners: dict[str, list[str]] = {}
    for pack, _, distribution, _ in sources:
        owners.setdefault(pack, []).append(distribution)
    for pack, dists in owners.items():
        if len(dists) > 1:
            registry.broken.append((pack, f"registered by several distributions: {', '.join(sorted(dists))}"))
    for index, (pack, module, distribution, version) in enumerate(sources):
        if len(owners[pack]) > 1 and not (pack == "reference" and index == 0):
            continue
        try:
            manager.register(module, name=pack)
        except Exception as e:
            registry.broken.append((pack, f"not a valid plug-in module: {type(e).__name__}: {e}"))
            continue
        impl = next((i for i in manager.hook.sparkdecode_providers.get_hookimpls() if i.plugin_name == pack), None)
        if impl is None:
            registry.broken.append((pack, "implements no sparkdecode_providers hook"))
            continue
        try:
            classes = list(impl.function())
        except (Exception, SystemExit) as e:
            registry.broken.append((pack, f"sparkdecode_providers() raised {type(e).__name__}: {e}"))
            continue
        for cls in classes:
            reason = invalid_provider(cls)
            if reason is None and registry.find(cls.name) is not None:
                reason = f"{cls.name} is registered twice"
            if reason is not None:
                registry.broken.append((pack, reason))
                continue
            registry.providers.append(Registered(cls, pack, distribution, version))
    for pack, reason in registry.broken:
        logger.warning("sparkdecode: skipped provider pack %s: %s", pack, reason)
    return registry
