"""Releases deferred past a CUDA graph capture (release.py): what a finalizer frees
while this thread captures waits for the next ``release_deferred``."""

from __future__ import annotations

import pytest

from sparkdecode import release


@pytest.fixture
def capture(monkeypatch):
    """Whether the thread captures, as the test sets it; no release left behind."""
    state = {"on": False}
    monkeypatch.setattr(release, "capturing", lambda: state["on"])
    monkeypatch.setattr(release, "_DEFERRED", [])
    return state


def test_release_runs_now_outside_a_capture(capture):
    done = []
    release.release_outside_capture(done.append, "a")
    assert done == ["a"] and not release._DEFERRED


def test_release_waits_for_the_capture_to_end(capture):
    done = []
    capture["on"] = True
    release.release_outside_capture(done.append, "a")
    release.release_outside_capture(lambda x, y: done.append(x + y), "b", "c")
    release.release_deferred()  # still capturing: nothing freed
    assert done == [] and len(release._DEFERRED) == 2
    capture["on"] = False
    release.release_deferred()
    assert done == ["a", "bc"] and not release._DEFERRED


def test_a_failing_release_leaves_the_later_ones_waiting(capture):
    capture["on"] = True

    def fail() -> None:
        raise RuntimeError("gone")

    done = []
    release.release_outside_capture(fail)
    release.release_outside_capture(done.append, "b")
    capture["on"] = False
    with pytest.raises(RuntimeError, match="gone"):
        release.release_deferred()
    release.release_deferred()
    assert done == ["b"] and not release._DEFERRED


def test_no_capture_without_cuda():
    """Without an initialized CUDA context nothing can be capturing (a CPU machine)."""
    assert release.capturing() is False
