"""The phases opened from Python, mirrored so that loose ones cannot break nesting.

The library keeps one stack of phases and ``phase_pop`` closes the innermost.
Phases of ``with gpualloc.phase(...)`` and of the automatic hooks for the
backward pass and ``torch.save`` are well nested. Two automatic phases are
not: ``eval`` opens at ``model.eval()`` and closes at ``model.train()``, and
``optimizer`` opens in a pre-step hook whose post-step hook an exception may
skip. They are *loose*: when a phase opened before one of them closes first,
the loose phase is closed with it, so the user's phase still closes itself
and not the loose one.
"""

from __future__ import annotations

import threading
from typing import List

from ._lib import ForkSafeLock, lib


class Entry:
    """One open phase; ``closed`` once popped (or closed early, when loose)."""

    __slots__ = ("name", "loose", "closed")

    def __init__(self, name: str, loose: bool):
        self.name = name
        self.loose = loose
        self.closed = False


_STACK: List[Entry] = []
_LOCK = ForkSafeLock(threading.RLock)


def started() -> bool:
    """Whether the allocator has started (phases are recorded from then on)."""
    return lib().is_initialized()


def push(name: str, loose: bool = False) -> Entry:
    """Opens a phase in the library and mirrors it."""
    e = Entry(str(name), loose)
    with _LOCK:
        lib().phase_push(e.name)
        _STACK.append(e)
    return e


def pop(e: Entry) -> None:
    """Closes ``e``, and first the loose phases still open inside it. When a
    well-nested phase opened inside ``e`` (on another thread) is still open,
    ``e`` closes as soon as that one does."""
    with _LOCK:
        if e.closed:
            return
        e.closed = True
        if not any(x is e for x in _STACK):
            return
        while _STACK[-1] is not e and (_STACK[-1].loose or _STACK[-1].closed):
            _pop_top()
        while _STACK and _STACK[-1].closed:
            _pop_top()


def _pop_top() -> None:
    top = _STACK.pop()
    top.closed = True
    lib().phase_pop()


def open_names() -> List[str]:
    """The phases open from Python, outermost first."""
    with _LOCK:
        return [e.name for e in _STACK if not e.closed]
