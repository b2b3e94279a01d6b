"""PyTorch's allocator settings changed at run time, followed by the bridge.

Programs switch PyTorch's ``expandable_segments`` off for what they share
with other processes (``torch.cuda.memory._set_allocator_settings(
"expandable_segments:False")``), and gpualloc honours it (Note [PyTorch's
expandable_segments switch] in ``allocator/src/plain_requests.rs``). Torch
parses the string without calling its allocator, so the torch bridge cannot
see the change by itself: ``follow`` wraps torch's setters so that the
bridge reads the setting again each time one returns. Code that kept a
reference to a setter from before ``install()`` is caught later, where a
CUDA graph or MemPool creates a pool (the bridge reads it there too).

Its ``per_process_memory_fraction`` (torch 2.10 and later) caps each
device from its start when the string comes before CUDA's initialization,
as under PyTorch's allocator (Note [PyTorch's fraction set at run time] in
``capi/src/global.rs``); ``follow`` hands each string torch took to the
library for that. Later, it changes nothing under either allocator.

The other keys of such a string configure PyTorch's own CUDA allocator
(``garbage_collection_threshold``, ``max_split_size_mb``, ...) and do
nothing under gpualloc, or its host allocator (``pinned_*``), which stays
PyTorch's: the wrapper says each of the first kind once, as ``install()``
says them of ``PYTORCH_CUDA_ALLOC_CONF``, instead of leaving a program to
believe its setting took.
"""

from __future__ import annotations

import sys
import warnings
from typing import Callable, Iterable, List, Optional, Tuple

# torch's C setters of the settings string: the first up to torch 2.9's
# ``torch.cuda.memory._set_allocator_settings``, the second since (and
# ``torch.accelerator``'s).
SETTERS = ("_cuda_cudaCachingAllocator_set_allocator_settings", "_accelerator_setAllocatorSettings")

_MARK = "_gpualloc_follows"


# Keys of PyTorch's settings string that hold under gpualloc when set at
# run time: the switch and the capture setting, which the bridge reads from
# PyTorch, and the pinned host allocator's, which stays PyTorch's. Every
# other key configures PyTorch's CUDA allocator alone.
BRIDGE_HONOURS = frozenset(("expandable_segments", "graph_capture_record_stream_reuse"))
HOST_KEYS_PREFIX = "pinned_"
FRACTION_KEY = "per_process_memory_fraction"

_SAID: set = set()


def entries_in(settings: str) -> List[Tuple[str, str]]:
    """The ``(key, value)`` entries of PyTorch's settings string, in order:
    its comma-separated ``key:value`` entries, a bracketed value
    (``roundup_power2_divisions:[256:1,512:2]``) counted as one; whitespace
    dropped, as torch drops it."""
    entries, depth, entry = [], 0, []
    for ch in settings + ",":
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            key, _, value = "".join(entry).partition(":")
            if key:
                entries.append((key, value))
            entry = []
        elif not ch.isspace():
            entry.append(ch)
    return entries


def keys_in(settings: str) -> List[str]:
    """The keys of PyTorch's settings string, in order (``entries_in``)."""
    return [key for key, _ in entries_in(settings)]


def holds_as_written(settings: str, maps_memory: bool = True) -> bool:
    """Whether every entry of PyTorch's settings string holds under gpualloc
    as it does under PyTorch, leaving nothing to say: ``expandable_segments:
    True`` (gpualloc's default, when it ``maps_memory``; scripts and
    libraries such as torchtune set it; torch 2.11 reads only ``True`` and
    ``False``), and the pinned host allocator's keys, which stay PyTorch's.
    (``per_process_memory_fraction`` is said: gpualloc's own key wins.)"""
    for key, value in entries_in(settings):
        if key == "expandable_segments" and value == "True" and maps_memory:
            continue
        if key.startswith(HOST_KEYS_PREFIX):
            continue
        return False
    return True


# Modules whose frames a warning passes over to name the program's line:
# gpualloc's wrappers, torch's setters and the deprecation wrapper torch
# 2.10 puts around ``torch.cuda.memory._set_allocator_settings``.
_PASSED_OVER = ("gpualloc", "torch", "typing_extensions")


def _program_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by this function's
    caller name the first frame outside ``_PASSED_OVER``: the program's call
    of a setter, however many wrappers lie between."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".", 1)[0] not in _PASSED_OVER:
            return level
        frame, level = frame.f_back, level + 1
    return level


def say_ignored(settings: str, honoured: Iterable[str], stacklevel: Optional[int] = None) -> List[str]:
    """Warns once per process for each key of ``settings`` that gpualloc
    does not follow (not in ``honoured``, nor the pinned host allocator's);
    returns the keys warned of now. The warning names the first frame
    outside gpualloc and torch unless ``stacklevel`` says otherwise."""
    honoured = frozenset(honoured)
    if stacklevel is None:
        stacklevel = _program_stacklevel() - 1  # counted from here, not from warnings.warn's caller
    said = []
    for key in keys_in(settings):
        if key in honoured or key.startswith(HOST_KEYS_PREFIX) or key in _SAID:
            continue
        _SAID.add(key)
        said.append(key)
        if key == FRACTION_KEY:
            hint = (
                "it caps each device only when set before CUDA starts, as under PyTorch's allocator, and gpualloc's "
                "own per_process_memory_fraction wins over it; torch.cuda.set_per_process_memory_fraction(), "
                "which gpualloc honours, caps a device at run time"
            )
        else:
            hint = "gpualloc takes its configuration from install(config=...) or GPUALLOC_CONF (docs/configuration.md)"
        warnings.warn(
            f"gpualloc: PyTorch allocator setting {key!r} set at run time configures PyTorch's own CUDA allocator "
            f"and has no effect on gpualloc; {hint}",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )
    return said


def follow(
    torch_c,
    sync: Callable[[], None],
    honoured: Iterable[str] = BRIDGE_HONOURS,
    start_fraction: Optional[Callable[[str], bool]] = None,
) -> int:
    """Wraps each of torch's setters found on ``torch_c`` (``torch._C``) so
    that ``sync()`` runs after it returns, a string torch took goes to
    ``start_fraction`` when it names ``per_process_memory_fraction``
    (whether that caps the devices from their start: the library's
    ``set_torch_settings``), and keys of the string that gpualloc does not
    follow (not in ``honoured``, nor a fraction taken) are said once each
    (``say_ignored``); a setter wrapped already is left alone. Returns the
    number of setters wrapped now."""
    honoured = frozenset(honoured)
    wrapped = 0
    for name in SETTERS:
        setter = getattr(torch_c, name, None)
        if setter is None or getattr(setter, _MARK, False):
            continue

        def following(env, _setter=setter):
            try:
                result = _setter(env)
            finally:
                # Keys before a refused one took effect in torch.
                sync()
            if isinstance(env, str):
                taken = honoured
                if start_fraction is not None and FRACTION_KEY in keys_in(env) and start_fraction(env):
                    taken = honoured | {FRACTION_KEY}
                # Said of a string torch took, at the program's call.
                say_ignored(env, taken)
            return result

        following.__name__ = name
        following.__doc__ = getattr(setter, "__doc__", None)
        setattr(following, _MARK, True)
        setattr(torch_c, name, following)
        wrapped += 1
    return wrapped
