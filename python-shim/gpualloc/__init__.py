"""gpualloc: a CUDA caching allocator for PyTorch, with a full allocation trace.

Use::

    import gpualloc
    gpualloc.install(config="max_split_size_mb:128", trace="run.gtrace")  # before CUDA starts
    ...                                   # train as usual; torch.cuda.memory_* keep working
    with gpualloc.phase("checkpoint"):
        torch.save(model.state_dict(), "ckpt.pt")

or, without touching the script: ``python -m gpualloc run train.py --args``.

How gpualloc is plugged into PyTorch (see ``_torch.py`` for the details)
-----------------------------------------------------------------------
PyTorch's only switch is ``CUDAPluggableAllocator``: two C functions,
``alloc`` and ``free``. Used alone it is not a drop-in replacement: it
cannot raise ``torch.cuda.OutOfMemoryError`` (a NULL becomes a tensor at
address 0), ``memory_stats``/``memory_allocated``/``reset_peak_memory_stats``,
``get_per_process_memory_fraction`` and cuDNN benchmark (``cacheInfo``) raise
"does not yet support", and the CUDA-graph pool hooks pass C++ objects.

So ``install()`` compiles (once, cached; g++ and the ``ninja`` package, a
dependency of this one) a C++ bridge against the installed
torch (``bridge.cpp`` and ``bridge/``): a direct subclass of torch's
``CUDAAllocator``, like PyTorch's own allocator, implementing every virtual
member (``docs/torch-compat.md`` lists them with their tests). Allocation
failures raise ``torch.cuda.OutOfMemoryError`` with gpualloc's diagnosis;
stats, ``cacheInfo`` and fractions read gpualloc; CUDA-graph pools, MemPool
and cudagraph trees' checkpoints reach gpualloc's private pools;
``_record_memory_history``/``_snapshot``/``memory_viz`` work natively
(the bridge keeps torch's history while gpualloc keeps its own trace);
NCCL's registration hooks see every segment event; tensors shared with
other processes use PyTorch's formats (CUDA IPC for plain segments, its
expandable format, or gpualloc's own for pages of several sizes, which a
receiver under gpualloc opens). The bridge loads libgpualloc.so with ``dlopen`` (same
handle as this package's ctypes copy) and installs itself with
``changeCurrentAllocator``. It needs g++ and the torch headers (they ship
with the wheel); the build directory is ``GPUALLOC_BUILD_DIR`` or
``~/.cache/gpualloc``.

Without a compiler (or with ``bridge=False``), ``install()`` falls back to a
plain ``CUDAPluggableAllocator`` with a warning: stats, summary, fractions,
``empty_cache`` and ``record_stream`` still work (``torch.cuda.memory_*`` are
patched in Python to read gpualloc, ``torch.cuda.memory_snapshot`` returns
gpualloc's segments), ``cudnn.benchmark`` convolutions do not (PyTorch's
wrapper refuses ``cacheInfo``), and out of memory cannot become
``torch.cuda.OutOfMemoryError``: the fallback registers
``gpualloc_malloc_or_raise``, which throws a C++ ``std::runtime_error`` with
the diagnosis (a ``RuntimeError`` opening with "CUDA out of memory." in
Python) rather than hand PyTorch a NULL it would silently turn into a
tensor (``GPUALLOC_FALLBACK_OOM=abort`` aborts the process instead).
PyTorch announces CUDA graph captures
only through hooks a C library cannot receive, so that entry point asks the
driver and gives a capture a pool of its own, kept until the process ends
(nothing says when the graph is destroyed).

``torch.accelerator.memory_*`` reach PyTorch's generic allocator registry;
the bridge registers itself there too, and ``install()`` also points them at
the ``torch.cuda`` functions (for the fallback).

This module imports without torch; torch is imported only by ``install()``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, List, Optional

from . import _phases
from ._lib import ERR_IO, ERR_UNAVAILABLE, GpuallocError, LibraryNotFound, _dev, lib, library_path, trace_path_problem

__all__ = [
    "GpuallocError",
    "LibraryNotFound",
    "install",
    "config",
    "installed",
    "auto_marks",
    "stats",
    "summary",
    "snapshot",
    "empty_cache",
    "reset_peak_stats",
    "reset_accumulated_stats",
    "set_memory_fraction",
    "set_memory_limit",
    "fragmentation",
    "driver_calls",
    "held",
    "last_oom",
    "phase",
    "mark",
    "trace_start",
    "trace_stop",
    "trace_flush",
    "is_tracing",
    "library_path",
    "backend",
    "version",
]


def install(
    config: Optional[str] = None,
    trace: Optional[str] = None,
    bridge: bool = True,
    verbose: bool = False,
    auto_marks: Optional[bool] = None,
) -> str:
    """Makes gpualloc PyTorch's CUDA allocator. Call before CUDA is initialized.

    ``config``: gpualloc's configuration (``GPUALLOC_CONF`` syntax; default:
    that variable). ``trace``: start recording a trace to this path
    (``{pid}``, ``{rank}``, ``{local_rank}`` and ``{restart}`` are filled in, as in
    ``GPUALLOC_TRACE``; a path that can never be written, in a folder that
    does not exist or a folder itself, is an error here). ``bridge``: compile the C++ bridge (see the module
    docs); False forces the fallback. ``auto_marks``: mark every optimizer
    step and open the phases ``backward``, ``optimizer``, ``eval`` and
    ``checkpoint`` through torch's hooks (see ``_auto.py``); default:
    ``GPUALLOC_AUTO_MARKS`` (on unless ``0``). Returns ``"bridge"`` or
    ``"fallback"``.

    Installing initializes nothing on the GPU: the allocator starts at
    PyTorch's own CUDA initialization (its first CUDA call) with this
    configuration and trace, so the program may still choose its GPUs
    (``CUDA_VISIBLE_DEVICES``) afterwards, and a process that never uses
    CUDA (a DataLoader worker importing the script again) never starts the
    driver. A bad configuration is an error here; one the allocator cannot
    start with (no driver, no device) is PyTorch's CUDA initialization error.
    """
    from . import _torch

    return _torch.install(config=config, trace=trace, bridge=bridge, verbose=verbose, auto_marks=auto_marks)


def auto_marks() -> List[str]:
    """The automatic hooks in place (``optimizer``, ``backward``,
    ``checkpoint``, ``eval``, ``inference``, ``compile``); empty when off."""
    from . import _auto

    return _auto.enabled()


def installed() -> Optional[str]:
    """``"bridge"``, ``"fallback"`` or None."""
    from . import _torch

    return _torch.MODE


def _device(device) -> int:
    """An int device index from an int, ``"cuda"``, ``"cuda:N"``, a torch
    device, or None (the current device, when torch is loaded). Anything
    else is a TypeError; a string or torch device that is not CUDA's, a
    ValueError (as torch says of them); an index beyond a C int, a
    GpuallocError for an invalid device (ctypes would keep its low bits)."""
    if device is None:
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, str):
        kind, colon, index = device.partition(":")
        if kind != "cuda" or (colon and not (index.isascii() and index.isdigit())):
            raise ValueError(f"not a CUDA device: {device!r:.60} (expected 'cuda' or 'cuda:N')")
        # "cuda" without an index: the current device, as torch reads it.
        return _dev(int(index)) if colon else _device(None)
    if not isinstance(device, int) and hasattr(device, "type") and hasattr(device, "index"):  # torch.device
        if device.type != "cuda":
            raise ValueError(f"not a CUDA device: {device!r:.60}")
        return _device(None) if device.index is None else _dev(device.index)
    return _dev(device)


def stats(device=None) -> Dict[str, int]:
    """Every stat, named and ordered as ``torch.cuda.memory_stats()`` names them."""
    return lib().stats(_device(device))


def fragmentation(device=None) -> Dict[str, float]:
    """gpualloc's figures beyond PyTorch's: largest cached block, cached bytes,
    external fragmentation (1 - largest/cached), unallocated fraction (1 - allocated/reserved)."""
    s = lib().stats_struct(_device(device))
    return {
        "largest_free_block": s.largest_free_block,
        "cached_free_bytes": s.cached_free_bytes,
        "external_fragmentation": s.external_fragmentation,
        "unallocated_fraction": s.unallocated_fraction,
    }


def driver_calls(device=None, helper=False) -> Dict[str, dict]:
    """The driver calls made since the device started (or its accumulated
    stats were reset), by kind: ``{"cuMemSetAccess": {"calls", "handles",
    "bytes", "ms"}, ...}``, the shape of ``gpualloc replay --json``'s
    ``driver_calls_by_kind``, with the milliseconds measured instead of
    predicted (0 on the simulated backend).

    The milliseconds are the allocating thread's: unmapping handed to the
    helper thread (``unmap_thread``) counts with the time spent waiting for
    it. ``helper=True`` gives the calls that thread made, with their time
    (on the simulated backend, the calls it would have made, 0 ms)."""
    return lib().driver_calls(_device(device), helper)


def held(device=None) -> Dict[str, int]:
    """Reserved memory now, by the unit it can be given back in: is it the
    tensors or the cache? Bytes:

    - ``used_units``: physical handles (or plain segments) that back at
      least one byte in use;
    - ``used_units_unallocated``: of those, what no allocation holds, free
      bytes beside live blocks that only freeing those blocks gives back
      (with blocks waiting for events and the rest of stitches in use);
    - ``free_units``: mapped units that back nothing in use, the cache
      ``empty_cache()`` gives back;
    - ``free_private_units``: the same in private pools still held (CUDA
      graphs, ``MemPool``), kept until the pool is released;
    - ``pooled``: physical handles unmapped and kept for reuse.

    ``used_units + free_units + free_private_units + pooled`` is
    ``reserved_bytes.all.current``. ``gpualloc replay`` gives the same
    split at a trace's peak of reserved memory."""
    return lib().held(_device(device))


def snapshot(device=None) -> List[dict]:
    """Segments with their blocks, shaped like ``torch.cuda.memory_snapshot()``
    (every device when ``device`` is None)."""
    return lib().snapshot(-1 if device is None else _device(device))["segments"]


def empty_cache() -> None:
    """Returns every cached, entirely free segment to the device."""
    lib().empty_cache()


def reset_peak_stats(device=None) -> None:
    lib().reset_peak_stats(_device(device))


def reset_accumulated_stats(device=None) -> None:
    lib().reset_accumulated_stats(_device(device))


def set_memory_fraction(fraction: float, device=None) -> None:
    lib().set_memory_fraction(fraction, _device(device))


def set_memory_limit(nbytes: Optional[int], device=None) -> None:
    """Caps reserved memory at ``nbytes``; None removes the cap. 0 and
    negative values are a ValueError (0 would be ambiguous, as in
    ``memory_limit:0``)."""
    lib().set_memory_limit(nbytes, _device(device))


def last_oom() -> Optional[dict]:
    """The figures of this thread's last out-of-memory error, or None."""
    return lib().last_oom()


def backend() -> str:
    """``"cuda"`` or ``"sim"`` (``GPUALLOC_BACKEND=sim``: the simulated device),
    or ``"unavailable"`` when there is no usable CUDA driver or device
    (``python -m gpualloc info`` says why). A bad configuration raises
    :class:`GpuallocError`."""
    try:
        return lib().backend()
    except GpuallocError as e:
        if e.code == ERR_UNAVAILABLE:
            return "unavailable"
        raise


def version() -> str:
    return lib().version()


def config() -> Optional[str]:
    """The configuration string the allocator runs with (``""`` for the
    defaults), or None before it starts. (``torch.cuda.memory._snapshot()``
    reports PyTorch's own settings string, which programs set back.)"""
    return lib().config()


def trace_start(path: str) -> None:
    """Records every allocator call to ``path`` (``{pid}`` and ``{rank}``
    filled in). Before the allocator's first use, recording is kept for
    its start, as ``install(trace=...)`` keeps it, so that no GPU is touched
    now (a spawned DataLoader worker that runs the script's first lines
    again never starts CUDA); a folder that does not exist, an existing
    folder as the path or an empty path is still an error at once."""
    L = lib()
    if not L.is_initialized():
        problem = trace_path_problem(path)
        if problem is not None:
            raise GpuallocError(f"gpualloc.trace_start({path!r}): {problem}", ERR_IO)
    L.configure(None, path)  # now if the allocator runs, else from its start


def trace_stop() -> Dict[str, int]:
    """Stops tracing; returns ``{"events", "dropped", "bytes"}``."""
    return lib().trace_stop()


def trace_flush() -> None:
    lib().trace_flush()


def is_tracing() -> bool:
    return lib().is_tracing()


def mark(name: str) -> None:
    """Records a named point in time in the trace (``gpualloc.mark("epoch 3")``)."""
    lib().mark(name)


class phase(contextlib.ContextDecorator):
    """A named phase in the trace, as a context manager or a decorator::

    with gpualloc.phase("checkpoint"): ...

    @gpualloc.phase("optimizer")
    def step(): ...

    Closing it also closes the automatic ``eval`` or ``optimizer`` phase
    opened inside it and still open (see ``_phases.py``).
    """

    def __init__(self, name: str):
        if isinstance(name, (bytes, bytearray)):  # str() would make b"x" the name "b'x'"
            try:
                name = bytes(name).decode()
            except UnicodeDecodeError:
                raise ValueError(f"phase name is not valid UTF-8: {bytes(name)[:64]!r}") from None
        self.name = str(name)
        self._open: Dict[int, list] = {}  # thread -> entries, innermost last (a decorator can recurse)

    def __enter__(self):
        e = _phases.push(self.name)
        self._open.setdefault(threading.get_ident(), []).append(e)
        return self

    def __exit__(self, *exc):
        entries = self._open.get(threading.get_ident())
        if entries:
            _phases.pop(entries.pop())
        return False


def _fmt_bytes(n: int) -> str:
    for unit in ("B  ", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:7d} {unit}" if unit == "B  " else f"{n:7.2f} {unit}"
        n /= 1024
    return str(n)


def summary(device=None, abbreviated: bool = False) -> str:
    """A table like ``torch.cuda.memory_summary()``, from gpualloc's stats."""
    d = _device(device)
    s = stats(d)
    f = fragmentation(d)
    h = held(d)
    # backend() would start the allocator (and the CUDA driver), which
    # stats() and fragmentation() leave to the first use.
    where = f"{backend()} backend" if lib().is_initialized() else "not started"
    width = 77
    lines = [
        "=" * width,
        f" gpualloc memory summary, device {d:<3d} ({where})".ljust(width),
        "-" * width,
        f"{'Metric':<32}|{'Cur Usage':>11}|{'Peak Usage':>11}|{'Tot Alloc':>10}|{'Tot Freed':>10}",
        "-" * width,
    ]
    rows = [
        ("Allocated memory", "allocated_bytes", True),
        ("Active memory", "active_bytes", True),
        ("Requested memory", "requested_bytes", True),
        ("GPU reserved memory", "reserved_bytes", True),
        ("Non-releasable memory", "inactive_split_bytes", True),
        ("Allocations", "allocation", False),
        ("Active allocs", "active", False),
        ("GPU reserved segments", "segment", False),
        ("Non-releasable allocs", "inactive_split", False),
    ]
    pools = [("all", "")] if abbreviated else [("all", ""), ("large_pool", "  from large pool"), ("small_pool", "  from small pool")]
    for title, key, is_bytes in rows:
        for pool, label in pools:
            vals = [s[f"{key}.{pool}.{field}"] for field in ("current", "peak", "allocated", "freed")]
            cells = [_fmt_bytes(v) if is_bytes else str(v) for v in vals]
            lines.append(f"{(title if not label else label):<32}|{cells[0]:>11}|{cells[1]:>11}|{cells[2]:>10}|{cells[3]:>10}")
        lines.append("-" * width)
    for title, key in (("Oversize allocations", "oversize_allocations"), ("Oversize GPU segments", "oversize_segments")):
        vals = [s[f"{key}.{field}"] for field in ("current", "peak", "allocated", "freed")]
        lines.append(f"{title:<32}|{vals[0]:>11}|{vals[1]:>11}|{vals[2]:>10}|{vals[3]:>10}")
    lines.append("-" * width)
    counters = ", ".join(
        f"{k}: {s[k]}" for k in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free", "num_cross_stream_reuse")
    )
    lines.append(f" {counters}")
    lines.append(
        f" largest cached block: {_fmt_bytes(f['largest_free_block']).strip()}, cached free: {_fmt_bytes(f['cached_free_bytes']).strip()}, "
        f"external fragmentation: {f['external_fragmentation'] * 100:.1f}%, unallocated: {f['unallocated_fraction'] * 100:.1f}%"
    )
    b = {k: _fmt_bytes(v).strip() for k, v in h.items()}
    lines.append(
        f" reserved by unit: used {b['used_units']} ({b['used_units_unallocated']} of it beside live blocks), "
        f"cache {b['free_units']}, private pools {b['free_private_units']}, pooled {b['pooled']}"
    )
    lines.append("=" * width)
    return "\n".join(lines) + "\n"

