"""Releasing what a provider held (device memory, IPC mappings) safely around CUDA
graph capture.

A provider's resources usually go in a ``weakref.finalize`` when its last holder
goes, and a garbage collection can run that anywhere, including while a graph is
being captured on this thread, where freeing device memory would invalidate the
capture. Such releases wait in one list until ``release_deferred``, which a pack
calls before it allocates again (its next workspace); a release therefore runs in
the thread that frees the resource, or in the next build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Releases asked for while this thread was capturing a CUDA graph, in order.
_DEFERRED: list[tuple[Callable[..., None], tuple[Any, ...]]] = []


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (never without
    an initialized CUDA context)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def release_outside_capture(release: Callable[..., None], *args: Any) -> None:
    """``release(*args)`` now, or at the next ``release_deferred`` while this thread
    captures a CUDA graph."""
    if capturing():
        _DEFERRED.append((release, args))
        return
    release(*args)


def release_deferred() -> None:
    """Every release deferred past a capture, oldest first (none while capturing)."""
    if capturing():
        return
    while _DEFERRED:
        release, args = _DEFERRED.pop(0)
        release(*args)
