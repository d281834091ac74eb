"""The layout resolver: which provider serves each block and sub-op.

For every kind (protocols.KINDS) that the deployment needs:

1. candidates: every registered provider of that kind; those whose
   ``unsupported(deployment)`` gives a reason are dropped (and kept, with the
   reason, for the report);
2. a pin (``additional_config["decode_providers"]`` or the CLI) wins; a pin to an
   unknown or unsupported provider is an error naming why;
3. otherwise, where a ``measure`` function is given (on a GPU: the candidate timed
   in place, in a graph of the model's first ``executor.MEASURE_LAYERS`` layers, its
   step at a context of at most ``executor.MEASURE_CONTEXT``),
   the fastest, its time combined over ranks so every rank picks the same; without
   one, the highest declared priority (then the name, so the order is total). The
   candidates of a kind are timed in ``MEASURE_ROUNDS`` interleaved rounds and
   each keeps its least time: a layer's time only grows under interference
   (another process, a clock dip), and a round-robin order spreads any drift over
   all of them alike, so a block that is a few percent of its layer is still told
   apart. After the first round only the candidates within ``CLOSE`` of the
   fastest are timed again (a clear loser costs one timing). Kinds are timed in
   turn, each with the kinds after it still at their priority choice; blocks
   interact (a GEMM's prologue runs beside the attention core before it), so a
   further pass times each kind's close candidates, and its priority choice if within
   ``PRIORITY_CLOSE`` (one slow timing must not rule out the pack's declared best),
   again in the layout the first pass chose (``MEASURE_PASSES``); a candidate
   replaces the priority choice only if it times more than ``PRIORITY_MARGIN``
   faster (beneath the measure's repeatability a timing is no evidence);
4. measured decisions are cached on disk, keyed by GPU, TP, spec, pack versions,
   pins and ``MEASURE_VERSION``; a corrupt or stale cache is ignored with a warning
   and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .plugins import Registered, Registry
from .protocols import ALL_KINDS, BLOCKS, KINDS, Deployment
from .weights import NVFP4_FORMATS

logger = logging.getLogger(__name__)

# measure(kind, candidate, layout) -> seconds a layer with ``candidate`` serving
# ``kind`` and ``layout`` (kind -> class) serving the others, or None where that layer
# cannot be timed here (a CUDA graph cannot capture its transport, or the candidate
# could not be built or run on some rank): not chosen by time. A failed capture raises
# (executor.CaptureFailedError): the process cannot go on from it.
Measure = Callable[[str, type, Mapping[str, type]], float | None]

MEASURE_ROUNDS = 3
CLOSE = 0.05  # candidates this close to the fastest's time get the further rounds
# In the cache key: raised whenever the way candidates are timed changes, so decisions
# timed the old way are measured again (2: the executor times the first four layers in
# one graph, where 1 timed layer 1 alone; 3: the refinement pass; 4: replays before
# timing, executor.WARM_SECONDS; 5: the refinement times the priority choice too; 6:
# the first sixteen layers, executor.MEASURE_LAYERS; 7: PRIORITY_MARGIN; 8: the step
# timed at a context of at most executor.MEASURE_CONTEXT, not the max context).
MEASURE_VERSION = 8
# Passes over the contested kinds: the first times every candidate; each further one
# times again, in the layout chosen so far, the candidates within CLOSE of a kind's
# fastest and its priority choice within PRIORITY_CLOSE, and stops early once no choice
# changes.
MEASURE_PASSES = 2
# How far behind a kind's fastest its priority choice may have timed in the first pass
# and still be timed again in the refinement: one timing disturbed by a clock dip or
# another process must not rule out the pack's declared best (the H200's four-layer
# measure once put the same graph 12% apart), but a clear loser is not timed again.
PRIORITY_CLOSE = 0.25
# How much faster than a kind's priority choice another candidate must time to be chosen
# in its place: beneath the measure's repeatability a timing is no evidence, and the
# pack's declared best stands (on the H200, two timings of one sixteen-layer graph
# differed by up to 0.5%, and a candidate 0.1% ahead in the resolve was 0.7% behind
# in the 62-layer step).
PRIORITY_MARGIN = 0.01


class LayoutError(ValueError):
    """No provider can serve a kind, or a pin cannot be honoured."""


@dataclass
class Candidate:
    name: str
    pack: str
    version: str
    reason: str | None = None  # why it is unsupported here, None if supported
    seconds: float | None = None  # its measured layer time, where measured


@dataclass
class Choice:
    kind: str
    chosen: Registered
    how: str  # "pinned", "measured", "cached", "priority"
    candidates: list[Candidate] = field(default_factory=list)


@dataclass
class Layout:
    choices: dict[str, Choice]

    def provider(self, kind: str) -> type:
        return self.choices[kind].chosen.cls

    def classes(self) -> dict[str, type]:
        return {kind: c.chosen.cls for kind, c in self.choices.items()}

    def table(self) -> str:
        """The decision report: kind, chosen (and how), every candidate with its time or reason."""
        lines = [f"{'block':<20} {'chosen':<46} candidates"]
        for kind, choice in self.choices.items():
            notes = []
            for c in choice.candidates:
                if c.reason is not None:
                    notes.append(f"{c.name}: {c.reason}")
                elif c.seconds is not None:
                    notes.append(f"{c.name}: {c.seconds * 1e6:.1f} us")
                else:
                    notes.append(c.name)
            chosen = f"{choice.chosen.name} ({choice.how})"
            lines.append(f"{kind:<20} {chosen:<46} {'; '.join(notes)}")
        return "\n".join(lines)


def needed_kinds(deployment: Deployment) -> tuple[str, ...]:
    """The kinds a deployment needs: every block, the routed experts (bf16, and NVFP4
    where the checkpoint has NVFP4 layers), the attention core, and the all-reduce
    transport where there is more than one rank."""
    skip = {"all_reduce"} if deployment.tp == 1 else set()
    if deployment.expert_format not in NVFP4_FORMATS:
        skip.add("experts_nvfp4")
    return tuple(k for k in KINDS if k not in skip)


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPARKDECODE_CACHE", Path.home() / ".cache" / "sparkdecode")) / "layouts"


def cache_key(deployment: Deployment, registry: Registry, pins: Mapping[str, str]) -> str:
    text = json.dumps(
        {
            "gpu": deployment.gpu_name,
            "capability": deployment.capability,
            "tp": deployment.tp,
            "spec": deployment.spec.key(),
            "expert_format": deployment.expert_format,
            "expert_parallel": deployment.expert_parallel,
            "kv": [str(deployment.kv_dtype), deployment.kv_block_size],
            "max_rows": deployment.max_rows,
            "max_context": deployment.max_context,
            "host_lengths_exact": deployment.host_lengths_exact,
            "packs": sorted(registry.versions().items()),
            "pins": sorted(pins.items()),
            "measure": MEASURE_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _same_on_every_rank(
    every_rank: Callable[[str], list[str]], registry: Registry, table: Mapping[str, list[tuple[Registered, Candidate]]]
) -> None:
    """``LayoutError`` on every rank unless every rank has the same packs and the same
    supported candidates of each kind (a pack broken on one rank, a library or GPU
    another rank lacks)."""
    mine = {
        "packs": sorted(registry.versions().items()),
        "supported": {kind: sorted(c.name for _, c in rows if c.reason is None) for kind, rows in table.items()},
    }
    texts = every_rank(json.dumps(mine, sort_keys=True))
    first = json.loads(texts[0])
    for rank, text in enumerate(texts):
        theirs = json.loads(text)
        if theirs == first:
            continue
        if theirs["packs"] != first["packs"]:
            what = f"packs {dict(theirs['packs'])} where rank 0 has {dict(first['packs'])}"
        else:
            kind = next(k for k in first["supported"] if theirs["supported"][k] != first["supported"][k])
            what = f"{kind} served by {theirs['supported'][kind]} where rank 0 has {first['supported'][kind]}"
        raise LayoutError(f"the ranks see different providers: rank {rank} has {what}")


def _pinned(kind: str, name: str, registry: Registry) -> Registered:
    """The provider a pin names, or ``LayoutError``: none installed (with the packs
    discovery skipped, where any), or one of another kind."""
    reg = registry.find(name)
    if reg is None:
        known = ", ".join(r.name for r in registry.of(kind)) or "none"
        skipped = "; ".join(f"{pack}: {reason}" for pack, reason in registry.broken)
        raise LayoutError(
            f"{kind} is pinned to {name!r}, which no installed pack provides (known: {known})"
            + (f"; skipped packs: {skipped}" if skipped else "")
        )
    if reg.block != kind:
        raise LayoutError(f"{kind} is pinned to {name!r}, a provider of {reg.block}")
    return reg


def unsupported_reason(reg: Registered, deployment: Deployment) -> str | None:
    """A provider's ``unsupported(deployment)``, kept from taking its caller down: a
    check that raises, or answers other than None or a reason, is its own reason."""
    try:
        reason = reg.cls.unsupported(deployment)
    except Exception as e:
        return f"unsupported() raised {type(e).__name__}: {e}"
    if reason is not None and not (isinstance(reason, str) and reason):
        return f"unsupported() returned {reason!r}, not None or a reason"
    return reason


def _candidates(kind: str, registry: Registry, deployment: Deployment) -> list[tuple[Registered, Candidate]]:
    return [
        (reg, Candidate(reg.name, reg.pack, reg.version, unsupported_reason(reg, deployment)))
        for reg in registry.of(kind)
    ]


def _by_priority(supported: list[tuple[Registered, Candidate]]) -> list[tuple[Registered, Candidate]]:
    return sorted(supported, key=lambda rc: (-rc[0].cls.priority, rc[0].name))


def _load_cache(path: Path) -> dict[str, str] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        chosen = data["chosen"]
        if not isinstance(chosen, dict) or not all(isinstance(v, str) for v in chosen.values()):
            raise ValueError("'chosen' is not a map of kind to provider name")
        return chosen
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("sparkdecode: ignoring the corrupt layout cache %s (%s); measuring again", path, e)
        return None


def resolve(
    registry: Registry,
    deployment: Deployment,
    pins: Mapping[str, str] | None = None,
    measure: Measure | None = None,
    cache_dir: Path | None = None,
    kinds: Sequence[str] | None = None,
    rank: int = 0,
    agree: Callable[[bool], bool] | None = None,
    rounds: int = MEASURE_ROUNDS,
    every_rank: Callable[[str], list[str]] | None = None,
) -> Layout:
    """The provider of every kind the deployment needs (see the module docstring);
    ``kinds`` resolves those instead (the draft executor: ``DRAFT_KINDS``). Pins of
    kinds outside them are left for the other layout.

    Over several ranks, ``measure`` is collective (its times are combined over the
    ranks), so every rank must measure or none: each rank keeps its own cache file
    (``rank``), and ``agree`` (True only if every rank says True) decides whether
    the caches are used. ``every_rank`` (every rank's copy of a text, a collective)
    makes sure first that every rank sees the same packs and the same supported
    candidates (else ``LayoutError`` on every rank: they would choose apart and
    their collectives would not meet), and then that every rank's cache holds the
    same choices (else every rank measures again)."""
    pins = dict(pins or {})
    kinds = needed_kinds(deployment) if kinds is None else tuple(kinds)
    table = {kind: _candidates(kind, registry, deployment) for kind in kinds}
    if every_rank is not None:
        _same_on_every_rank(every_rank, registry, table)
    for kind, name in pins.items():
        if kind not in ALL_KINDS:
            raise LayoutError(f"pin for unknown block {kind!r}; blocks: {', '.join(ALL_KINDS)}")
        # A pin of a kind this layout does not resolve is still named right (a typo
        # or a missing pack is found now, not where the other layout reads it).
        if kind not in kinds:
            _pinned(kind, name, registry)
    choices: dict[str, Choice] = {}
    for kind in kinds:
        candidates = table[kind]
        report = [c for _, c in candidates]
        supported = _by_priority([rc for rc in candidates if rc[1].reason is None])
        if kind in pins:
            name = pins[kind]
            reg = _pinned(kind, name, registry)
            reason = next(c.reason for r, c in candidates if r.name == name)
            if reason is not None:
                raise LayoutError(f"{kind} is pinned to {name!r}, which does not support this deployment: {reason}")
            choices[kind] = Choice(kind, reg, "pinned", report)
            continue
        if not supported:
            reasons = "; ".join(f"{c.name}: {c.reason}" for c in report) or "no provider is registered"
            raise LayoutError(f"no provider supports {kind} here ({reasons})")
        choices[kind] = Choice(kind, supported[0][0], "priority", report)

    contested = [k for k in kinds if k not in pins and sum(c.reason is None for _, c in table[k]) > 1]
    first = {k: choices[k].chosen for k in contested}  # the priority choices
    if measure is None or not contested:
        return Layout(choices)

    path = (cache_dir or default_cache_dir()) / f"{cache_key(deployment, registry, pins)}-rank{rank}.json"
    cached = _load_cache(path)
    stale = (
        [] if cached is None else [k for k in contested if k not in cached or not _is_supported(table[k], cached[k])]
    )
    if cached is not None and stale:
        logger.warning("sparkdecode: the layout cache %s is stale (%s); measuring again", path, ", ".join(stale))
    usable = cached is not None and not stale
    if every_rank is not None:
        assert cached is not None or not usable
        texts = every_rank(json.dumps({k: cached[k] for k in contested}, sort_keys=True) if usable else "")
        if texts[0] and any(t != texts[0] for t in texts):
            logger.warning("sparkdecode: the ranks' layout caches hold different choices; measuring again")
        usable = bool(texts[0]) and all(t == texts[0] for t in texts)
    elif agree is not None:
        usable = agree(usable)
    if usable:
        assert cached is not None
        for kind in contested:
            reg = next(r for r, _ in table[kind] if r.name == cached[kind])
            choices[kind] = Choice(kind, reg, "cached", choices[kind].candidates)
        return Layout(choices)

    for kind in contested:
        timed = [(reg, cand) for reg, cand in table[kind] if cand.reason is None]
        _time_kind(kind, timed, choices, measure, rounds, first[kind])
    # Refinement: a kind was timed with the kinds after it still at their priority
    # choice, and blocks interact (a GEMM's PDL prologue runs beside the attention
    # core before it), so each kind's close candidates and its priority choice are
    # timed again in the layout the first pass chose, until no choice changes or
    # MEASURE_PASSES is reached.
    for _ in range(1, MEASURE_PASSES):
        changed = False
        for kind in contested:
            times = [c.seconds for _, c in table[kind] if c.seconds is not None]
            if not times:
                continue
            fastest = min(times)
            close = [
                (reg, cand)
                for reg, cand in table[kind]
                if cand.seconds is not None
                and cand.seconds <= fastest * (1 + (PRIORITY_CLOSE if reg is first[kind] else CLOSE))
            ]
            if len(close) < 2:
                continue
            before = choices[kind].chosen
            for _, cand in close:
                cand.seconds = None
            _time_kind(kind, close, choices, measure, rounds, first[kind])
            changed |= choices[kind].chosen is not before
        if not changed:
            break
    record = {
        "chosen": {k: choices[k].chosen.name for k in contested},
        "seconds": {k: {c.name: c.seconds for _, c in table[k] if c.seconds is not None} for k in contested},
    }
    _write_cache(path, record)
    return Layout(choices)


def _write_cache(path: Path, record: dict) -> None:
    """Writes the decision atomically (a temporary file of this process, then a rename,
    so servers sharing the cache never read half a file). A cache that cannot be written
    (a read-only home, a bad ``SPARKDECODE_CACHE``) costs the next start a measurement,
    not this one its layout: a warning, and the measured layout stands."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
    except OSError as e:
        logger.warning("sparkdecode: could not write the layout cache %s (%s); the next start measures again", path, e)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _time_kind(
    kind: str,
    timed: list[tuple[Registered, Candidate]],
    choices: dict[str, Choice],
    measure: Measure,
    rounds: int,
    priority: Registered,
) -> None:
    """Times ``timed`` (candidates of ``kind``) in place of the current choice, the
    other kinds at theirs, in ``rounds`` interleaved rounds (after the first, only
    those within CLOSE of the fastest), and makes the fastest the choice, unless
    ``priority`` (the kind's priority choice) was timed within PRIORITY_MARGIN of it.
    Where none could be timed (each needs a transport a CUDA graph cannot capture),
    the choice stands."""
    layout = {k: c.chosen.cls for k, c in choices.items()}
    untimed: set[str] = set()
    for round_ in range(rounds):
        times = [c.seconds for _, c in timed if c.seconds is not None]
        bar = min(times) * (1 + CLOSE) if round_ and times else None
        for reg, cand in timed:
            again = round_ == 0 or (bar is not None and cand.seconds is not None and cand.seconds <= bar)
            if reg.name in untimed or not again:
                continue
            seconds = measure(kind, reg.cls, layout)
            if seconds is None:
                untimed.add(reg.name)
            elif cand.seconds is None or seconds < cand.seconds:
                cand.seconds = seconds
    best: tuple[float, Registered] | None = None
    for reg, cand in timed:
        if cand.seconds is not None and (best is None or cand.seconds < best[0]):
            best = (cand.seconds, reg)
    if best is not None:
        held = next((cand.seconds for reg, cand in timed if reg is priority), None)
        if held is not None and held <= best[0] * (1 + PRIORITY_MARGIN):
            best = (held, priority)
        choices[kind] = Choice(kind, best[1], "measured", choices[kind].candidates)


def measured_seconds(layout: Layout) -> dict[str, dict[str, float]]:
    """Per kind the resolver measured: each timed candidate's layer time (seconds)."""
    return {
        kind: {c.name: c.seconds for c in choice.candidates if c.seconds is not None}
        for kind, choice in layout.choices.items()
        if choice.how == "measured"
    }


def _is_supported(candidates: list[tuple[Registered, Candidate]], name: str) -> bool:
    return any(r.name == name and c.reason is None for r, c in candidates)


__all__ = ["BLOCKS", "Layout", "LayoutError", "measured_seconds", "resolve"]
