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
"""

from __future__ import annotations

from typing import Callable

# torch's C setters of the settings string: the first up to torch 2.9's
# ``torch.cuda.memory._set_allocator_settings``, the second since (and
# ``torch.accelerator``'s).
SETTERS = ("_cuda_cudaCachingAllocator_set_allocator_settings", "_accelerator_setAllocatorSettings")

_MARK = "_gpualloc_follows"


def follow(torch_c, sync: Callable[[], None]) -> int:
    """Wraps each of torch's setters found on ``torch_c`` (``torch._C``) so
    that ``sync()`` runs after it returns; a setter wrapped already is
    left alone. Returns the number of setters wrapped now."""
    wrapped = 0
    for name in SETTERS:
        setter = getattr(torch_c, name, None)
        if setter is None or getattr(setter, _MARK, False):
            continue

        def following(env, _setter=setter):
            try:
                return _setter(env)
            finally:
                # Keys before a refused one took effect in torch.
                sync()

        following.__name__ = name
        following.__doc__ = getattr(setter, "__doc__", None)
        setattr(following, _MARK, True)
        setattr(torch_c, name, following)
        wrapped += 1
    return wrapped
