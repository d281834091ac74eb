"""The layout resolver over hand-built registries of fake provider classes."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import pytest

from sparkdecode import layout as layout_module
from sparkdecode.layout import CLOSE, MEASURE_ROUNDS, LayoutError, cache_key, measured_seconds, needed_kinds, resolve
from sparkdecode.plugins import Registered, Registry
from sparkdecode.protocols import KINDS, Deployment
from sparkdecode.spec import ModelSpec

DEPLOYMENT = Deployment(spec=ModelSpec.preset("tiny"))


def provider(name: str, block: str, priority: int = 0, reason: str | None = None) -> type:
    """A fake provider class: ``unsupported`` gives ``reason``; it never builds."""

    def unsupported(cls, deployment: Deployment) -> str | None:
        return reason

    def build(cls, ctx: object, layer: int | None) -> object:
        raise AssertionError("the resolver builds nothing")

    def run(self, *args: object) -> None:
        pass

    return type(
        name.replace(".", "_"),
        (),
        {
            "block": block,
            "name": name,
            "priority": priority,
            "unsupported": classmethod(unsupported),
            "build": classmethod(build),
            "run": run,
        },
    )


def registry(*extra: type, base: bool = True) -> Registry:
    """The fake pack ``base`` (one provider of every kind, priority 0) plus ``extra``
    classes, each in the pack named by its name's prefix (version 1.0)."""
    classes = [provider(f"base.{kind}", kind) for kind in KINDS] if base else []
    classes += extra
    return Registry(
        providers=[Registered(c, c.name.split(".")[0], f"dist-{c.name.split('.')[0]}", "1.0") for c in classes]
    )


class Timer:
    """A ``measure`` function with fixed seconds per provider name that records its calls."""

    def __init__(self, seconds: Mapping[str, float | None]):
        self.seconds = dict(seconds)
        self.calls: list[tuple[str, str]] = []

    def __call__(self, kind: str, cls: type, layout: Mapping[str, type]) -> float | None:
        self.calls.append((kind, cls.name))
        assert kind not in layout or layout[kind].block == kind
        return self.seconds[cls.name]


def clear_winner_calls(*candidates: int) -> int:
    """measure calls for kinds of that many candidates each with one clear winner:
    every candidate once, then the winner in every further round."""
    return sum(n + MEASURE_ROUNDS - 1 for n in candidates)


def fail_measure(kind: str, cls: type, layout: Mapping[str, type]) -> float:
    raise AssertionError(f"measured {cls.name} although the decision was cached")


def cache_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json"))


# Without measurement: the declared priority.


def test_needed_kinds_at_tp1_and_tp2() -> None:
    assert "all_reduce" not in needed_kinds(DEPLOYMENT)
    assert "all_reduce" in needed_kinds(Deployment(spec=DEPLOYMENT.spec, tp=2))
    assert set(needed_kinds(DEPLOYMENT)) == set(KINDS) - {"all_reduce", "experts_nvfp4"}
    nvfp4 = Deployment(spec=DEPLOYMENT.spec, expert_format="nvfp4")
    assert {"experts", "experts_nvfp4"} <= set(needed_kinds(nvfp4))  # edge layers stay bf16


def test_highest_priority_wins_without_measure() -> None:
    reg = registry(provider("fast.attention", "attention", 5), provider("mid.attention", "attention", 3))
    layout = resolve(reg, DEPLOYMENT)
    choice = layout.choices["attention"]
    assert (choice.chosen.name, choice.how) == ("fast.attention", "priority")
    assert [c.name for c in choice.candidates] == ["base.attention", "fast.attention", "mid.attention"]
    assert layout.choices["moe"].chosen.name == "base.moe"
    assert set(layout.classes()) == set(needed_kinds(DEPLOYMENT))


def test_priority_tie_broken_by_name() -> None:
    reg = registry(provider("zeta.moe", "moe", 2), provider("alpha.moe", "moe", 2))
    assert resolve(reg, DEPLOYMENT).choices["moe"].chosen.name == "alpha.moe"


def test_unsupported_provider_skipped_with_its_reason() -> None:
    reg = registry(provider("gpu.attention", "attention", 9, reason="needs a CUDA device"))
    layout = resolve(reg, DEPLOYMENT)
    assert layout.choices["attention"].chosen.name == "base.attention"
    assert "gpu.attention: needs a CUDA device" in layout.table()


def test_unsupported_that_raises_is_a_reason() -> None:
    def unsupported(cls, deployment: Deployment) -> str | None:
        raise RuntimeError("probe failed")

    bad = provider("flaky.final", "final", 9)
    bad.unsupported = classmethod(unsupported)
    layout = resolve(registry(bad), DEPLOYMENT)
    assert layout.choices["final"].chosen.name == "base.final"
    assert "flaky.final: unsupported() raised RuntimeError: probe failed" in layout.table()


def test_no_supported_provider_lists_reasons() -> None:
    classes = [provider(f"base.{kind}", kind) for kind in KINDS if kind != "experts"]
    classes += [
        provider("fp4.experts", "experts", reason="expert format bf16 (nvfp4 only)"),
        provider("sm100.experts", "experts", reason="needs compute capability 10.0"),
    ]
    reg = registry(*classes, base=False)
    with pytest.raises(LayoutError) as err:
        resolve(reg, DEPLOYMENT)
    message = str(err.value)
    assert "no provider supports experts" in message
    assert "fp4.experts: expert format bf16 (nvfp4 only)" in message
    assert "sm100.experts: needs compute capability 10.0" in message


def test_kind_with_no_provider_at_all() -> None:
    reg = registry(*(provider(f"base.{kind}", kind) for kind in KINDS if kind != "final"), base=False)
    with pytest.raises(LayoutError, match="no provider supports final here \\(no provider is registered\\)"):
        resolve(reg, DEPLOYMENT)


def test_pins() -> None:
    reg = registry(provider("fast.attention", "attention", 5))
    layout = resolve(reg, DEPLOYMENT, {"attention": "base.attention"}, measure=fail_measure)
    assert layout.choices["attention"].how == "pinned"
    assert layout.choices["attention"].chosen.name == "base.attention"
    with pytest.raises(LayoutError, match="'nope.attention'"):
        resolve(reg, DEPLOYMENT, {"attention": "nope.attention"})
    with pytest.raises(LayoutError, match="unknown block 'attn'"):
        resolve(reg, DEPLOYMENT, {"attn": "base.attention"})


# With measurement: the fastest, cached on disk.


def test_measure_picks_fastest_and_reports_times(tmp_path: Path) -> None:
    reg = registry(provider("slow.attention", "attention", 9), provider("quick.attention", "attention", 1))
    timer = Timer({"base.attention": 30e-6, "slow.attention": 50e-6, "quick.attention": 10e-6})
    layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    choice = layout.choices["attention"]
    assert (choice.chosen.name, choice.how) == ("quick.attention", "measured")
    # Only the contested kind is measured: each supported candidate once, then the
    # only one within CLOSE of the fastest (the fastest) in the further rounds.
    assert sorted(timer.calls) == sorted(
        [("attention", "base.attention"), ("attention", "slow.attention")]
        + [("attention", "quick.attention")] * MEASURE_ROUNDS
    )
    assert layout.choices["moe"].how == "priority"
    table = layout.table()
    assert "quick.attention (measured)" in table
    for text in ("quick.attention: 10.0 us", "slow.attention: 50.0 us", "base.attention: 30.0 us"):
        assert text in table
    [path] = cache_files(tmp_path)
    assert path.name == f"{cache_key(DEPLOYMENT, reg, {})}-rank0.json"
    record = json.loads(path.read_text())
    assert record["chosen"] == {"attention": "quick.attention"}
    assert record["seconds"]["attention"]["slow.attention"] == pytest.approx(50e-6)
    # What the bench records: the measured kinds' candidate times only.
    assert measured_seconds(layout) == {
        "attention": {"base.attention": 30e-6, "slow.attention": 50e-6, "quick.attention": 10e-6}
    }


def test_rounds_keep_each_candidates_least_time(tmp_path: Path) -> None:
    """The candidates are timed round-robin; one disturbed time (here the quicker
    candidate's first) does not decide: each keeps its least. A candidate further
    than CLOSE from the fastest after a round (slow) is not timed again."""
    reg = registry(provider("quick.attention", "attention", 1), provider("slow.attention", "attention", 2))
    times = {
        "base.attention": [20e-6, 21e-6],
        "quick.attention": [20.5e-6, 15e-6, 16e-6],
        "slow.attention": [40e-6],
    }
    order: list[str] = []

    def measure(kind: str, cls: type, layout: Mapping[str, type]) -> float:
        order.append(cls.name)
        return times[cls.name].pop(0)

    layout = resolve(reg, DEPLOYMENT, measure=measure, cache_dir=tmp_path, rounds=3)
    assert 40e-6 > 20e-6 * (1 + CLOSE) > 20.5e-6
    # Round 2 re-times base and quick (within CLOSE of 20 us); round 3 only quick (15 us).
    assert order == ["base.attention", "quick.attention", "slow.attention", "base.attention"] + ["quick.attention"] * 2
    assert layout.choices["attention"].chosen.name == "quick.attention"
    assert measured_seconds(layout) == {
        "attention": {"base.attention": 20e-6, "quick.attention": 15e-6, "slow.attention": 40e-6}
    }
    one = resolve(
        reg,
        DEPLOYMENT,
        measure=Timer({"base.attention": 1.0, "quick.attention": 2.0, "slow.attention": 3.0}),
        cache_dir=tmp_path / "one",
        rounds=1,
    )
    assert one.choices["attention"].chosen.name == "base.attention"


def test_measure_skips_unsupported_and_uncontested(tmp_path: Path) -> None:
    reg = registry(provider("gpu.attention", "attention", 9, reason="needs a GPU"), provider("alt.moe", "moe", 1))
    timer = Timer({"base.moe": 2.0, "alt.moe": 1.0})
    layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert sorted(timer.calls) == sorted([("moe", "base.moe")] + [("moe", "alt.moe")] * MEASURE_ROUNDS)
    assert layout.choices["attention"].how == "priority"
    assert layout.choices["moe"].chosen.name == "alt.moe"


def test_a_candidate_that_cannot_be_timed_is_not_chosen_by_time(tmp_path: Path) -> None:
    """measure returns None for a layer it cannot time (a transport a CUDA graph
    cannot capture): the others are compared; with none timed, priority stands."""
    reg = registry(provider("host.attention", "attention", 9), provider("quick.attention", "attention", 1))
    timer = Timer({"base.attention": 30e-6, "host.attention": None, "quick.attention": 40e-6})
    layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert (layout.choices["attention"].chosen.name, layout.choices["attention"].how) == ("base.attention", "measured")
    assert "host.attention: " not in layout.table()
    untimed = Timer({"base.attention": None, "host.attention": None, "quick.attention": None})
    layout = resolve(reg, DEPLOYMENT, measure=untimed, cache_dir=tmp_path / "none")
    assert (layout.choices["attention"].chosen.name, layout.choices["attention"].how) == ("host.attention", "priority")


def test_nothing_contested_writes_no_cache(tmp_path: Path) -> None:
    layout = resolve(registry(), DEPLOYMENT, measure=fail_measure, cache_dir=tmp_path)
    assert {c.how for c in layout.choices.values()} == {"priority"}
    assert cache_files(tmp_path) == []


def test_second_resolve_uses_cache(tmp_path: Path) -> None:
    reg = registry(provider("quick.attention", "attention"), provider("quick.moe", "moe"))
    timer = Timer({"base.attention": 2.0, "quick.attention": 1.0, "base.moe": 1.0, "quick.moe": 3.0})
    first = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert len(timer.calls) == clear_winner_calls(2, 2)
    second = resolve(reg, DEPLOYMENT, measure=fail_measure, cache_dir=tmp_path)
    for kind in ("attention", "moe"):
        assert second.choices[kind].how == "cached"
        assert second.choices[kind].chosen.name == first.choices[kind].chosen.name
    assert second.choices["attention"].chosen.name == "quick.attention"
    assert second.choices["moe"].chosen.name == "base.moe"
    assert "quick.attention (cached)" in second.table()


def test_cache_is_keyed_by_deployment(tmp_path: Path) -> None:
    reg = registry(provider("quick.attention", "attention"))
    timer = Timer({"base.attention": 2.0, "quick.attention": 1.0})
    resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    other = Deployment(spec=DEPLOYMENT.spec, max_context=1024)
    layout = resolve(reg, other, measure=timer, cache_dir=tmp_path)
    assert layout.choices["attention"].how == "measured"
    assert len(timer.calls) == clear_winner_calls(2, 2)
    assert len(cache_files(tmp_path)) == 2


@pytest.mark.parametrize("where", ["parent-is-a-file", "path-is-a-folder"])
def test_a_cache_that_cannot_be_written_keeps_the_measured_layout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """A read-only or broken cache location (here: a file where the folder should be,
    or a folder where the file should be) is a warning; the measured layout stands and
    no temporary file is left behind."""
    reg = registry(provider("quick.attention", "attention"))
    timer = Timer({"base.attention": 2.0, "quick.attention": 1.0})
    if where == "parent-is-a-file":
        cache_dir = tmp_path / "cache"
        cache_dir.write_text("not a folder")
    else:
        cache_dir = tmp_path
        (tmp_path / f"{cache_key(DEPLOYMENT, reg, {})}-rank0.json").mkdir()
    with caplog.at_level(logging.WARNING, logger="sparkdecode.layout"):
        layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=cache_dir)
    assert (layout.choices["attention"].chosen.name, layout.choices["attention"].how) == ("quick.attention", "measured")
    assert "could not write the layout cache" in caplog.text
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize(
    "garbage",
    [b"{not json", b"", b"[1, 2]", b"null", b'{"seconds": {}}', b'{"chosen": {"attention": 3}}', b"\xff\xfe{"],
    ids=["syntax", "empty", "list", "null", "no-chosen", "non-str", "not-utf8"],
)
def test_corrupt_cache_ignored_and_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture, garbage: bytes) -> None:
    reg = registry(provider("quick.attention", "attention"))
    timer = Timer({"base.attention": 2.0, "quick.attention": 1.0})
    path = tmp_path / f"{cache_key(DEPLOYMENT, reg, {})}-rank0.json"
    path.write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="sparkdecode.layout"):
        layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert layout.choices["attention"].how == "measured"
    assert layout.choices["attention"].chosen.name == "quick.attention"
    assert len(timer.calls) == clear_winner_calls(2)
    assert "corrupt layout cache" in caplog.text and str(path) in caplog.text
    assert json.loads(path.read_text())["chosen"] == {"attention": "quick.attention"}
    # Rebuilt: the next resolve reads it.
    assert resolve(reg, DEPLOYMENT, measure=fail_measure, cache_dir=tmp_path).choices["attention"].how == "cached"


def test_stale_cache_ignored_and_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    quick, alt = provider("quick.attention", "attention"), provider("quick.attention_alt", "attention")
    timer = Timer({"base.attention": 2.0, "quick.attention": 1.5, "quick.attention_alt": 1.0})
    first = resolve(registry(quick, alt), DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert first.choices["attention"].chosen.name == "quick.attention_alt"
    # The same packs at the same versions (the same cache key), but the cached
    # provider is no longer registered.
    reg = registry(quick)
    assert cache_key(DEPLOYMENT, reg, {}) == cache_key(DEPLOYMENT, registry(quick, alt), {})
    timer.calls.clear()
    with caplog.at_level(logging.WARNING, logger="sparkdecode.layout"):
        layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert "stale" in caplog.text and "attention" in caplog.text
    assert layout.choices["attention"].how == "measured"
    assert layout.choices["attention"].chosen.name == "quick.attention"
    assert sorted(timer.calls) == sorted(
        [("attention", "base.attention")] + [("attention", "quick.attention")] * MEASURE_ROUNDS
    )
    [path] = cache_files(tmp_path)
    assert json.loads(path.read_text())["chosen"] == {"attention": "quick.attention"}


def test_cache_missing_a_contested_kind_is_stale(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    timer = Timer({"base.attention": 2.0, "quick.attention": 1.0})
    resolve(registry(provider("quick.attention", "attention")), DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    # Another contested kind appears: the cache lacks it, so it is stale.
    reg = registry(provider("quick.attention", "attention"), provider("quick.final", "final"))
    [path] = cache_files(tmp_path)
    path.rename(tmp_path / f"{cache_key(DEPLOYMENT, reg, {})}-rank0.json")
    timer.seconds.update({"base.final": 1.0, "quick.final": 2.0})
    with caplog.at_level(logging.WARNING, logger="sparkdecode.layout"):
        layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert "stale" in caplog.text and "final" in caplog.text
    assert layout.choices["final"].chosen.name == "base.final"
    assert layout.choices["final"].how == "measured"


def test_cached_provider_now_unsupported_is_stale(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing: list[str] = []

    def unsupported(cls, deployment: Deployment) -> str | None:
        return missing[0] if missing else None

    quick = provider("quick.attention", "attention")
    quick.unsupported = classmethod(unsupported)
    reg = registry(quick, provider("other.attention", "attention"))
    timer = Timer({"base.attention": 2.0, "quick.attention": 1.0, "other.attention": 1.5})
    assert resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path).choices["attention"].chosen is reg.find(
        "quick.attention"
    )
    # Its library went away: the same cache key, but the cached choice is unsupported now.
    missing.append("needs libquick")
    timer.calls.clear()
    with caplog.at_level(logging.WARNING, logger="sparkdecode.layout"):
        layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert "stale" in caplog.text
    assert (layout.choices["attention"].chosen.name, layout.choices["attention"].how) == ("other.attention", "measured")
    assert sorted(timer.calls) == sorted(
        [("attention", "base.attention")] + [("attention", "other.attention")] * MEASURE_ROUNDS
    )
    assert "quick.attention: needs libquick" in layout.table()


def test_ranks_measure_together_or_not_at_all(tmp_path: Path) -> None:
    """Measurement is collective over the ranks: each rank keeps its own cache file,
    and a cache is used only when every rank's is (``agree``); one rank without a
    usable cache makes every rank measure again."""
    reg = registry(
        provider("quick.attention", "attention", 1),
        provider("slow.attention", "attention", 2),
    )
    times = {"base.attention": 30.0, "quick.attention": 10.0, "slow.attention": 50.0}
    for rank in (0, 1):
        resolve(reg, DEPLOYMENT, measure=Timer(times), cache_dir=tmp_path, rank=rank)
    assert sorted(p.name for p in cache_files(tmp_path)) == [
        f"{cache_key(DEPLOYMENT, reg, {})}-rank0.json",
        f"{cache_key(DEPLOYMENT, reg, {})}-rank1.json",
    ]
    seen: list[bool] = []

    def others_have_none(ok: bool) -> bool:
        seen.append(ok)
        return False

    timer = Timer(times)
    layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path, rank=0, agree=others_have_none)
    assert seen == [True]  # this rank's cache was usable, another rank's was not
    assert layout.choices["attention"].how == "measured" and timer.calls
    layout = resolve(reg, DEPLOYMENT, measure=Timer(times), cache_dir=tmp_path, rank=1, agree=lambda ok: ok)
    assert layout.choices["attention"].how == "cached"


def test_decisions_timed_another_way_are_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MEASURE_VERSION is in the cache key: a decision cached by an earlier way of timing
    the candidates is not reused once that way changes."""
    quick = provider("quick.attention", "attention")
    timer = Timer({"base.attention": 2.0, "quick.attention": 1.5})
    resolve(registry(quick), DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert (
        resolve(registry(quick), DEPLOYMENT, measure=fail_measure, cache_dir=tmp_path).choices["attention"].how
        == "cached"
    )
    before = cache_key(DEPLOYMENT, registry(quick), {})
    monkeypatch.setattr(layout_module, "MEASURE_VERSION", layout_module.MEASURE_VERSION + 1)
    assert cache_key(DEPLOYMENT, registry(quick), {}) != before
    timer.calls.clear()
    again = resolve(registry(quick), DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    assert again.choices["attention"].how == "measured" and timer.calls


def test_refinement_pass_times_close_candidates_in_the_chosen_layout(tmp_path: Path) -> None:
    """Blocks interact: here x.attention is only faster beside base.moe, which the
    first pass chooses after attention was timed beside y.moe (moe's priority
    choice). The refinement pass times each kind's close candidates again in the
    layout the first pass chose and finds the faster pair; a kind whose first-pass
    winner was clear is not timed again."""
    reg = registry(
        provider("x.attention", "attention"),
        provider("y.moe", "moe", priority=1),
        provider("slow.final", "final"),
    )
    pair_seconds = {
        ("base.attention", "y.moe"): 10.0,
        ("x.attention", "y.moe"): 10.2,
        ("base.attention", "base.moe"): 9.9,
        ("x.attention", "base.moe"): 9.0,
    }
    calls: list[tuple[str, str, str, str]] = []

    def measure(kind: str, cls: type, layout: Mapping[str, type]) -> float:
        chosen = {**{k: c.name for k, c in layout.items()}, kind: cls.name}
        calls.append((kind, cls.name, chosen["attention"], chosen["moe"]))
        if kind == "final":
            return {"base.final": 1.0, "slow.final": 2.0}[cls.name]
        return pair_seconds[(chosen["attention"], chosen["moe"])]

    layout = resolve(reg, DEPLOYMENT, measure=measure, cache_dir=tmp_path, rounds=1)
    assert layout_module.MEASURE_PASSES == 2
    assert {k: layout.choices[k].chosen.name for k in ("attention", "moe", "final")} == {
        "attention": "x.attention",
        "moe": "base.moe",
        "final": "base.final",
    }
    first = [
        ("attention", "base.attention", "base.attention", "y.moe"),
        ("attention", "x.attention", "x.attention", "y.moe"),
        ("moe", "base.moe", "base.attention", "base.moe"),
        ("moe", "y.moe", "base.attention", "y.moe"),
        ("final", "base.final", "base.attention", "base.moe"),
        ("final", "slow.final", "base.attention", "base.moe"),
    ]
    second = [
        ("attention", "base.attention", "base.attention", "base.moe"),
        ("attention", "x.attention", "x.attention", "base.moe"),
        ("moe", "base.moe", "x.attention", "base.moe"),
        ("moe", "y.moe", "x.attention", "y.moe"),
    ]
    assert calls == first + second
    # The times reported are those of the last pass that timed each candidate.
    assert measured_seconds(layout)["attention"] == {"base.attention": 9.9, "x.attention": 9.0}
    assert json.loads(cache_files(tmp_path)[0].read_text())["chosen"]["attention"] == "x.attention"


def test_refinement_times_the_priority_choice_again(tmp_path: Path) -> None:
    """One slow first timing (here the pack's declared best, fav.attention, more than
    CLOSE behind but within PRIORITY_CLOSE) does not rule a candidate out: the
    refinement pass times the kind's priority choice again beside its close
    candidates, and a candidate neither close nor the priority choice (base.attention)
    is not timed again; a priority choice further behind is not timed again either."""
    reg = registry(provider("fav.attention", "attention", 5), provider("quick.attention", "attention", 1))
    times = {
        "base.attention": [15.0],
        "fav.attention": [12.0, 9.5],
        "quick.attention": [10.0, 10.0],
    }
    order: list[str] = []

    def measure(kind: str, cls: type, layout: Mapping[str, type]) -> float:
        order.append(cls.name)
        return times[cls.name].pop(0)

    assert 10.0 * (1 + layout_module.PRIORITY_CLOSE) >= 12.0 > 10.0 * (1 + CLOSE)
    layout = resolve(reg, DEPLOYMENT, measure=measure, cache_dir=tmp_path, rounds=1)
    assert order == ["base.attention", "fav.attention", "quick.attention", "fav.attention", "quick.attention"]
    assert layout.choices["attention"].chosen.name == "fav.attention"
    assert measured_seconds(layout)["attention"] == {
        "base.attention": 15.0,
        "fav.attention": 9.5,
        "quick.attention": 10.0,
    }
    timer = Timer({"base.attention": 15.0, "fav.attention": 13.0, "quick.attention": 10.0})
    assert 13.0 > 10.0 * (1 + layout_module.PRIORITY_CLOSE)
    far = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path / "far", rounds=1)
    assert far.choices["attention"].chosen.name == "quick.attention" and len(timer.calls) == 3


def test_priority_choice_stands_within_the_margin(tmp_path: Path) -> None:
    """A candidate replaces the kind's priority choice only if it times more than
    PRIORITY_MARGIN faster: a lead beneath the measure's repeatability is no evidence."""
    reg = registry(provider("fav.attention", "attention", 5), provider("quick.attention", "attention", 1))
    margin = layout_module.PRIORITY_MARGIN
    near = Timer({"base.attention": 15.0, "fav.attention": 10.0 * (1 + margin / 2), "quick.attention": 10.0})
    layout = resolve(reg, DEPLOYMENT, measure=near, cache_dir=tmp_path / "near", rounds=1)
    assert (layout.choices["attention"].chosen.name, layout.choices["attention"].how) == ("fav.attention", "measured")
    far = Timer({"base.attention": 15.0, "fav.attention": 10.0 * (1 + 2 * margin), "quick.attention": 10.0})
    layout = resolve(reg, DEPLOYMENT, measure=far, cache_dir=tmp_path / "far", rounds=1)
    assert layout.choices["attention"].chosen.name == "quick.attention"


class OtherRank:
    """``every_rank`` for two ranks, rank 1's text changed by ``change`` on its calls
    numbered in ``when`` (0: the providers' check, 1: the caches' choices)."""

    def __init__(self, change, when: tuple[int, ...]):
        self.change, self.when, self.calls = change, when, 0

    def __call__(self, text: str) -> list[str]:
        call, self.calls = self.calls, self.calls + 1
        return [text, self.change(text) if call in self.when else text]


def test_ranks_that_see_different_providers_raise_before_choosing(tmp_path: Path) -> None:
    reg = registry(provider("quick.attention", "attention"))

    def lose_quick(text: str) -> str:
        data = json.loads(text)
        data["supported"]["attention"].remove("quick.attention")
        return json.dumps(data, sort_keys=True)

    with pytest.raises(LayoutError, match=r"rank 1 has attention served by \['base.attention'\] where rank 0 has"):
        resolve(reg, DEPLOYMENT, measure=fail_measure, cache_dir=tmp_path, every_rank=OtherRank(lose_quick, (0,)))


def test_ranks_whose_caches_differ_measure_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reg = registry(provider("quick.attention", "attention"))
    timer = Timer({"base.attention": 2.0, "quick.attention": 1.0})
    resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path)
    calls = len(timer.calls)
    same = resolve(reg, DEPLOYMENT, measure=fail_measure, cache_dir=tmp_path, every_rank=OtherRank(str, ()))
    assert same.choices["attention"].how == "cached"

    def other_choice(text: str) -> str:
        return text.replace("quick.attention", "base.attention")

    with caplog.at_level(logging.WARNING, logger="sparkdecode.layout"):
        layout = resolve(reg, DEPLOYMENT, measure=timer, cache_dir=tmp_path, every_rank=OtherRank(other_choice, (1,)))
    assert layout.choices["attention"].how == "measured" and len(timer.calls) > calls
    assert "layout caches hold different choices" in caplog.text
