"""ctypes bindings of libgpualloc.so (the C ABI in capi/include/gpualloc.h).

Finding the library, in order:

1. ``GPUALLOC_LIBRARY`` (a path), for a source-tree checkout:
   ``GPUALLOC_LIBRARY=target/release/libgpualloc.so``;
2. the copy ``pip install`` built into this package (``_gpualloc*.so``).

Nothing here imports torch.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import json
import operator
import os
import sys
import threading
from typing import Dict, Optional, Tuple

c_int, c_size_t, c_void_p, c_char_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
c_int64, c_uint64, c_uint32, c_double = ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_double

# Status codes (gpualloc.h).
OK = 0
ERR_OUT_OF_MEMORY = -1
ERR_INVALID_ARGUMENT = -2
ERR_INVALID_POINTER = -3
ERR_INVALID_DEVICE = -4
ERR_UNKNOWN_POOL = -5
ERR_BACKEND = -6
ERR_UNAVAILABLE = -7
ERR_CONFIG = -8
ERR_ALREADY_INITIALIZED = -9
ERR_BUFFER_TOO_SMALL = -10
ERR_IO = -11
ERR_PANIC = -12
ERR_NOT_FOUND = -13
ERR_INVARIANT = -14


class GpuallocError(RuntimeError):
    """A gpualloc call failed. ``code`` is the C status (``gpualloc.h``)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


class LibraryNotFound(GpuallocError):
    """libgpualloc.so could not be found or loaded."""


class Stat(ctypes.Structure):
    _fields_ = [("current", c_int64), ("peak", c_int64), ("allocated", c_int64), ("freed", c_int64)]


class StatArray(ctypes.Structure):
    _fields_ = [("all", Stat), ("small_pool", Stat), ("large_pool", Stat)]


STAT_ARRAYS = (
    "allocation",
    "allocated_bytes",
    "requested_bytes",
    "active",
    "active_bytes",
    "segment",
    "reserved_bytes",
    "inactive_split",
    "inactive_split_bytes",
)


STATS_VERSION = 2


class Stats(ctypes.Structure):
    """``GpuallocStats`` (version 2). Mirrors the stats table (docs/stats.md);
    tests/test_stats_table.py checks it against the header and the table."""

    _fields_ = (
        [("size", c_uint32), ("version", c_uint32)]
        + [(n, StatArray) for n in STAT_ARRAYS]
        + [("oversize_allocations", Stat), ("oversize_segments", Stat)]
        + [
            (n, c_int64)
            for n in (
                "num_alloc_retries",
                "num_ooms",
                "num_sync_all_streams",
                "num_device_alloc",
                "num_device_free",
                "num_cross_stream_reuse",
                "num_trace_dropped",
                "max_split_size",
            )
        ]
        + [("largest_free_block", c_uint64), ("cached_free_bytes", c_uint64)]
        + [("external_fragmentation", c_double), ("unallocated_fraction", c_double)]
        # version 2
        + [
            (n, c_int64)
            for n in (
                "num_oom_rejections",
                "num_defragment",
                "num_stitch",
                "num_driver_calls",
                "num_driver_memory_calls",
                "driver_time_ns",
            )
        ]
    )


class OomInfo(ctypes.Structure):
    """``GpuallocOomInfo`` (version 1)."""

    _fields_ = [
        ("size", c_uint32),
        ("version", c_uint32),
        ("kind", ctypes.c_int32),
        ("device", ctypes.c_int32),
    ] + [
        (n, c_uint64)
        for n in (
            "requested",
            "needed",
            "allocated",
            "reserved",
            "private_pools_allocated",
            "device_free",
            "device_total",
            "limit",
            "largest_free_block",
        )
    ] + [("external_fragmentation", c_double), ("unallocated_fraction", c_double)]


class TraceSummary(ctypes.Structure):
    _fields_ = [("events", c_uint64), ("dropped", c_uint64), ("bytes", c_uint64)]


class DriverCallRow(ctypes.Structure):
    """One kind of driver call (``GpuallocDriverCall``)."""

    _fields_ = [
        ("name", c_char_p),
        ("calls", c_uint64),
        ("handles", c_uint64),
        ("bytes", c_uint64),
        ("nanos", c_uint64),
    ]


class Held(ctypes.Structure):
    """Reserved memory by unit (``GpuallocHeld``)."""

    _fields_ = [
        ("used_units", c_uint64),
        ("used_units_unallocated", c_uint64),
        ("free_units", c_uint64),
        ("free_private_units", c_uint64),
        ("pooled", c_uint64),
    ]


class BlockState(ctypes.Structure):
    """One block of a private pool's checkpoint (``GpuallocBlockState``)."""

    _fields_ = [
        ("address", c_uint64),
        ("size", c_uint64),
        ("stream", c_uint64),
        ("segment_address", c_uint64),
        ("allocated", ctypes.c_uint8),
    ]


U64_MAX = (1 << 64) - 1


def _cstr(value, what: str) -> bytes:
    """``value`` as a C string: bytes as they are, a path through
    ``os.fsencode``, anything else as ``str(value)`` in UTF-8. A NUL byte
    would silently cut it short (ValueError)."""
    if isinstance(value, (bytes, bytearray)):
        b = bytes(value)
    elif isinstance(value, os.PathLike):
        b = os.fsencode(value)
    else:
        try:
            b = str(value).encode()
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} is not valid Unicode ({e.reason} at {e.start}): {str(value)[:64]!r}") from None
    if b"\0" in b:
        raise ValueError(f"{what} contains a NUL byte: {value!r:.64}")
    return b


def _count(value, what: str, low: int = 0) -> int:
    """``value`` as an int in ``[low, 2**64)``; ctypes would wrap a negative one."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    value = operator.index(value)
    if not low <= value <= U64_MAX:
        raise ValueError(f"{what} {value} is not in {low}..2**64-1")
    return value


def _handle(value, what: str) -> int:
    """A pointer or a stream: None (NULL, the default stream) or an int in
    ``[0, 2**64)``; ctypes would wrap others, or take a str's address."""
    return 0 if value is None else _count(value, what)


C_INT_MIN, C_INT_MAX = -(1 << 31), (1 << 31) - 1


def _dev(device) -> int:
    """A device index for the C ABI. ctypes would keep the low 32 bits of a
    larger int (device ``2**32`` would become device 0), so those are an
    invalid device here, as the library says of any other."""
    if isinstance(device, bool):
        raise TypeError("a device index must be an int, not bool")
    try:
        device = operator.index(device)
    except TypeError:
        raise TypeError(f"a device index must be an int, not {type(device).__name__}") from None
    if not C_INT_MIN <= device <= C_INT_MAX:
        raise GpuallocError(f"gpualloc: invalid device {device}", ERR_INVALID_DEVICE)
    return device


def _fraction(value) -> float:
    """A memory fraction as a C double (the library checks its range)."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"a memory fraction must be a number, not {type(value).__name__}")
    try:
        return float(value)
    except TypeError:
        raise TypeError(f"a memory fraction must be a number, not {type(value).__name__}") from None
    except OverflowError:
        raise ValueError(f"memory fraction {value!r:.40} is not in [0, 1]") from None


def _pool(pool) -> Tuple[int, int]:
    """A private pool id: a pair of ints in ``[0, 2**64)`` (PyTorch's ``MempoolId_t``)."""
    try:
        a, b = pool
    except (TypeError, ValueError):
        raise TypeError(f"a pool id is a pair of ints, not {pool!r:.60}") from None
    return _count(a, "pool id"), _count(b, "pool id")


_SIGNATURES = {
    "gpualloc_init": (c_int, [c_char_p]),
    "gpualloc_is_initialized": (c_int, []),
    "gpualloc_configure": (c_int, [c_char_p, c_char_p]),
    "gpualloc_forget_config": (c_int, [c_char_p]),
    "gpualloc_backend_name": (c_char_p, []),
    "gpualloc_version": (c_char_p, []),
    "gpualloc_config_string": (c_char_p, []),
    "gpualloc_maps_memory": (c_int, []),
    "gpualloc_device_count": (c_int, []),
    "gpualloc_last_error": (c_char_p, []),
    "gpualloc_last_error_code": (c_int, []),
    "gpualloc_clear_error": (None, []),
    "gpualloc_malloc": (c_void_p, [c_size_t, c_int, c_void_p]),
    "gpualloc_malloc_or_abort": (c_void_p, [c_size_t, c_int, c_void_p]),
    "gpualloc_malloc_or_raise": (c_void_p, [c_size_t, c_int, c_void_p]),
    "gpualloc_free": (None, [c_void_p, c_size_t, c_int, c_void_p]),
    "gpualloc_record_stream": (None, [c_void_p, c_void_p]),
    "gpualloc_record_stream_on": (None, [c_void_p, c_void_p, c_int]),
    "gpualloc_add_peer_access": (c_int, [c_int, c_int]),
    "gpualloc_empty_cache": (None, []),
    "gpualloc_set_memory_fraction": (None, [c_double, c_int]),
    "gpualloc_set_torch_settings": (c_int, [c_char_p]),
    "gpualloc_get_memory_fraction": (c_int, [c_int, ctypes.POINTER(c_double)]),
    "gpualloc_set_memory_limit": (c_int, [c_int, c_uint64]),
    "gpualloc_mem_info": (c_int, [c_int, ctypes.POINTER(c_uint64), ctypes.POINTER(c_uint64)]),
    "gpualloc_check_invariants": (c_int, [c_int]),
    "gpualloc_last_oom": (c_int, [ctypes.POINTER(OomInfo)]),
    "gpualloc_get_stats": (c_int, [c_int, ctypes.POINTER(Stats)]),
    "gpualloc_stat_count": (c_size_t, []),
    "gpualloc_stat_name": (c_char_p, [c_size_t]),
    "gpualloc_stat_values": (c_int, [c_int, ctypes.POINTER(c_int64), c_size_t]),
    "gpualloc_driver_calls": (
        c_int,
        [c_int, ctypes.POINTER(DriverCallRow), c_size_t, ctypes.POINTER(c_size_t)],
    ),
    "gpualloc_helper_driver_calls": (
        c_int,
        [c_int, ctypes.POINTER(DriverCallRow), c_size_t, ctypes.POINTER(c_size_t)],
    ),
    "gpualloc_held": (c_int, [c_int, ctypes.POINTER(Held)]),
    "gpualloc_reset_peak_stats": (c_int, [c_int]),
    "gpualloc_reset_accumulated_stats": (c_int, [c_int]),
    "gpualloc_cache_info": (c_int, [c_int, ctypes.POINTER(c_size_t)]),
    "gpualloc_snapshot_json": (c_int, [c_int, c_char_p, c_size_t, ctypes.POINTER(c_size_t)]),
    "gpualloc_begin_allocate_to_pool": (c_int, [c_int, c_uint64, c_uint64, c_void_p, c_void_p]),
    "gpualloc_end_allocate_to_pool": (c_int, [c_int, c_uint64, c_uint64]),
    "gpualloc_release_pool": (c_int, [c_int, c_uint64, c_uint64]),
    "gpualloc_create_or_incref_pool": (c_int, [c_int, c_uint64, c_uint64]),
    "gpualloc_set_plain_requests": (c_int, [c_int]),
    "gpualloc_pool_use_count": (c_int, [c_int, c_uint64, c_uint64, ctypes.POINTER(ctypes.c_uint32)]),
    "gpualloc_empty_pool_cache": (c_int, [c_int, c_uint64, c_uint64]),
    "gpualloc_pool_live_allocations": (
        c_int,
        [c_int, c_uint64, c_uint64, ctypes.POINTER(c_uint64), c_size_t, ctypes.POINTER(c_size_t)],
    ),
    "gpualloc_pool_checkpoint": (
        c_int,
        [c_int, c_uint64, c_uint64, ctypes.POINTER(BlockState), c_size_t, ctypes.POINTER(c_size_t)],
    ),
    "gpualloc_pool_restore": (
        c_int,
        [
            c_int,
            c_uint64,
            c_uint64,
            ctypes.POINTER(BlockState),
            c_size_t,
            ctypes.POINTER(c_uint64),
            c_size_t,
            ctypes.POINTER(c_size_t),
            ctypes.POINTER(c_uint64),
            c_size_t,
            ctypes.POINTER(c_size_t),
        ],
    ),
    "gpualloc_trace_start": (c_int, [c_char_p]),
    "gpualloc_trace_stop": (c_int, [ctypes.POINTER(TraceSummary)]),
    "gpualloc_trace_stop_at_end": (c_int, [ctypes.POINTER(TraceSummary)]),
    "gpualloc_trace_flush": (c_int, []),
    "gpualloc_is_tracing": (c_int, []),
    "gpualloc_phase_push": (c_int, [c_char_p]),
    "gpualloc_phase_pop": (c_int, []),
    "gpualloc_mark": (c_int, [c_char_p]),
}


def missing_trace_folder(path) -> Optional[str]:
    """The folder of trace path ``path`` when it does not exist (a trace
    could never be written there); None when it does, or when it holds a
    placeholder (``{pid}``, ``{rank}``) filled in only at the start."""
    folder = os.path.dirname(os.fsdecode(path)) or os.curdir
    return None if "{" in folder or os.path.isdir(folder) else folder


def trace_path_problem(path) -> Optional[str]:
    """Why a trace could never be written at ``path`` (an empty path, one
    whose folder does not exist, an existing folder), or None. Before the
    allocator starts, a trace is kept for its start, where a failure is only
    a line on stderr: callers that keep one check this first."""
    text = os.fsdecode(path)
    if not text.strip():
        return "the path is empty"
    folder = missing_trace_folder(path)
    if folder is not None:
        return f"the folder {folder!r} does not exist"
    if "{" not in text and os.path.isdir(text):
        return f"{text!r} is a folder: give the path of a file in it"
    return None


def library_path() -> str:
    """The path of libgpualloc.so this process uses (see the module docs)."""
    env = os.environ.get("GPUALLOC_LIBRARY")
    if env:
        if os.path.isdir(env):
            raise LibraryNotFound(
                f"GPUALLOC_LIBRARY={env!r} is a folder: give the path of the library file "
                "(GPUALLOC_LIBRARY=target/release/libgpualloc.so)"
            )
        if not os.path.isfile(env):
            raise LibraryNotFound(f"GPUALLOC_LIBRARY={env!r}: no such file (build it with `cargo build --release -p gpualloc-capi`)")
        return os.path.realpath(env)
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_gpualloc*.so")))
    if not found:
        raise LibraryNotFound(
            "libgpualloc.so not found: install the package with `pip install ./python-shim` (builds it), "
            "or set GPUALLOC_LIBRARY to a built library (cargo build --release -p gpualloc-capi; "
            "GPUALLOC_LIBRARY=target/release/libgpualloc.so)"
        )
    return os.path.realpath(found[0])


class Library:
    """The loaded library with typed wrappers. One per process (see :func:`lib`)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.dll = ctypes.CDLL(path)
        except OSError as e:
            raise LibraryNotFound(f"could not load {path}: {e}") from None
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                fn = getattr(self.dll, name)
            except AttributeError:
                raise LibraryNotFound(f"{path} lacks {name}: an older or foreign library") from None
            fn.restype = restype
            fn.argtypes = argtypes
        n = self.dll.gpualloc_stat_count()
        self.stat_names = tuple(self.dll.gpualloc_stat_name(i).decode() for i in range(n))
        # A trace started by install(trace=...) or GPUALLOC_TRACE ends with
        # the process: write its last buffers and its end block then.
        atexit.register(self._stop_trace_at_exit)

    def stop_started_trace(self) -> Optional[Dict[str, int]]:
        """Completes the trace when the allocator started and records one;
        its summary, or None. Only a trace of an allocator that started was
        written (one kept for a start that never came, or in GPUALLOC_TRACE,
        was not). For the ends of a process: a failure is said on stderr,
        the last place to say that the file is incomplete, never raised.
        The trace gets a few seconds (``gpualloc_trace_stop_at_end``): a
        thread stuck in the driver while it holds the allocator cannot keep
        the process from ending."""
        try:
            if self.dll.gpualloc_is_initialized() and self.dll.gpualloc_is_tracing() > 0:
                return self.trace_stop(at_end=True)
        except Exception as e:  # noqa: BLE001 - never fail the process's end
            print(f"gpualloc: the trace could not be completed: {e}", file=sys.stderr)
        return None

    def _stop_trace_at_exit(self) -> None:
        self.stop_started_trace()

    # ---- errors ----

    def last_error(self) -> Optional[str]:
        e = self.dll.gpualloc_last_error()
        return e.decode(errors="replace") if e else None

    def check(self, rc: int) -> int:
        if rc < 0:
            raise GpuallocError(self.last_error() or f"gpualloc error {rc}", rc)
        return rc

    def check_void(self) -> None:
        e = self.last_error()
        if e:
            raise GpuallocError(e, self.dll.gpualloc_last_error_code())

    # ---- lifecycle ----

    def init(self, config: Optional[str]) -> None:
        self.check(self.dll.gpualloc_init(None if config is None else _cstr(config, "config")))

    def configure(self, config: Optional[str], trace: Optional[str] = None) -> None:
        """Checks ``config`` and keeps it, with a trace path, for the
        allocator's start, which it leaves to the first call that needs the
        allocator (the CUDA driver is not initialized here); once the
        allocator runs, as init() then trace_start()."""
        self.check(
            self.dll.gpualloc_configure(
                None if config is None else _cstr(config, "config"),
                None if trace is None else _cstr(os.fsencode(trace), "trace path"),
            )
        )

    def maps_memory(self) -> bool:
        """Whether the configuration (in force, kept for the start, or
        GPUALLOC_CONF's) maps memory through the driver's virtual memory
        management (expandable segments, the default). Starts nothing."""
        return bool(self.check(self.dll.gpualloc_maps_memory()))

    def forget_config(self, config: str) -> bool:
        """Before the start, forgets the configuration ``configure`` kept
        when it is ``config``; whether it did."""
        return bool(self.check(self.dll.gpualloc_forget_config(_cstr(config, "config"))))

    def is_initialized(self) -> bool:
        return bool(self.dll.gpualloc_is_initialized())

    def backend(self) -> str:
        name = self.dll.gpualloc_backend_name()
        if not name:
            raise GpuallocError(self.last_error() or "gpualloc could not start", self.dll.gpualloc_last_error_code() or ERR_UNAVAILABLE)
        return name.decode()

    def config(self) -> Optional[str]:
        """The configuration string the allocator runs with, None before it starts."""
        c = self.dll.gpualloc_config_string()
        return None if c is None else c.decode()

    def version(self) -> str:
        return self.dll.gpualloc_version().decode()

    def device_count(self) -> int:
        return self.check(self.dll.gpualloc_device_count())

    # ---- memory ----

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        """Allocates; returns the address (0 for size 0). Raises on failure
        (ValueError for a negative size)."""
        size, device, stream = _count(size, "size"), _dev(device), _handle(stream, "stream")
        p = self.dll.gpualloc_malloc(size, device, stream)
        if not p and size > 0:
            raise GpuallocError(self.last_error() or "allocation failed", self.dll.gpualloc_last_error_code() or ERR_OUT_OF_MEMORY)
        return p or 0

    def free(self, ptr: int, device: int = 0) -> None:
        ptr, device = _handle(ptr, "pointer"), _dev(device)
        self.dll.gpualloc_clear_error()
        self.dll.gpualloc_free(ptr, 0, device, None)
        self.check_void()

    def record_stream(self, ptr: int, stream: int, device: int | None = None) -> None:
        """Marks ``ptr`` as used on ``stream`` too; ``device`` is the
        stream's device (default: the pointer's own), which tells another
        GPU's default stream (handle 0) from this one's."""
        ptr, stream = _handle(ptr, "pointer"), _handle(stream, "stream")
        if device is None:
            self.dll.gpualloc_record_stream(ptr, stream)
        else:
            self.dll.gpualloc_record_stream_on(ptr, stream, _dev(device))
        self.check_void()

    def empty_cache(self) -> None:
        self.dll.gpualloc_empty_cache()
        self.check_void()

    def set_memory_fraction(self, fraction: float, device: int = 0) -> None:
        fraction, device = _fraction(fraction), _dev(device)
        self.dll.gpualloc_set_memory_fraction(fraction, device)
        self.check_void()

    def memory_fraction(self, device: int = 0) -> float:
        out = c_double()
        self.check(self.dll.gpualloc_get_memory_fraction(_dev(device), ctypes.byref(out)))
        return out.value

    def set_torch_settings(self, settings: str) -> bool:
        """PyTorch's settings string as torch took it at run time: before the
        allocator starts, its ``per_process_memory_fraction`` caps each
        device from its start, as PyTorch's allocator applies it when CUDA
        starts. Whether it will (False: no such key, the allocator runs
        already, or gpualloc's own fraction wins). Starts nothing."""
        return bool(self.check(self.dll.gpualloc_set_torch_settings(_cstr(settings, "settings"))))

    def set_memory_limit(self, nbytes: Optional[int], device: int = 0) -> None:
        """Caps reserved memory at ``nbytes`` (at least 1); None removes the cap."""
        if nbytes is not None:
            nbytes = _count(nbytes, "memory limit", low=1)
        self.check(self.dll.gpualloc_set_memory_limit(_dev(device), nbytes or 0))

    def mem_info(self, device: int = 0) -> Tuple[int, int]:
        free, total = c_uint64(), c_uint64()
        self.check(self.dll.gpualloc_mem_info(_dev(device), ctypes.byref(free), ctypes.byref(total)))
        return free.value, total.value

    def check_invariants(self, device: int = 0) -> None:
        self.check(self.dll.gpualloc_check_invariants(_dev(device)))

    def last_oom(self) -> Optional[Dict[str, float]]:
        info = OomInfo()
        info.size = ctypes.sizeof(OomInfo)
        rc = self.dll.gpualloc_last_oom(ctypes.byref(info))
        if rc == ERR_NOT_FOUND:
            return None
        self.check(rc)
        return {name: getattr(info, name) for name, _ in OomInfo._fields_ if name not in ("size", "version")}

    # ---- stats ----

    def stats(self, device: int = 0) -> Dict[str, int]:
        """Every stat under ``torch.cuda.memory_stats()``'s key, sorted."""
        values = (c_int64 * len(self.stat_names))()
        self.check(self.dll.gpualloc_stat_values(_dev(device), values, len(self.stat_names)))
        return dict(zip(self.stat_names, values))

    def stats_struct(self, device: int = 0) -> Stats:
        s = Stats()
        s.size = ctypes.sizeof(Stats)
        self.check(self.dll.gpualloc_get_stats(_dev(device), ctypes.byref(s)))
        return s

    def driver_calls(self, device: int = 0, helper: bool = False) -> Dict[str, dict]:
        """The kinds of driver call made, as ``gpualloc replay --json`` lists
        them (``driver_calls_by_kind``), with the time measured in them; with
        ``helper``, those the unmapping thread made, with its time."""
        fn = self.dll.gpualloc_helper_driver_calls if helper else self.dll.gpualloc_driver_calls
        n = c_size_t(0)
        rc = fn(_dev(device), None, 0, ctypes.byref(n))
        if rc != ERR_BUFFER_TOO_SMALL:
            self.check(rc)
        rows = (DriverCallRow * n.value)()
        self.check(fn(_dev(device), rows, n.value, None))
        return {
            r.name.decode(): {"calls": r.calls, "handles": r.handles, "bytes": r.bytes, "ms": r.nanos / 1e6}
            for r in rows
            if r.calls
        }

    def held(self, device: int = 0) -> Dict[str, int]:
        """Reserved memory by the unit it can be given back in (``GpuallocHeld``)."""
        h = Held()
        self.check(self.dll.gpualloc_held(_dev(device), ctypes.byref(h)))
        return {name: getattr(h, name) for name, _ in Held._fields_}

    def reset_peak_stats(self, device: int = 0) -> None:
        self.check(self.dll.gpualloc_reset_peak_stats(_dev(device)))

    def reset_accumulated_stats(self, device: int = 0) -> None:
        self.check(self.dll.gpualloc_reset_accumulated_stats(_dev(device)))

    def snapshot(self, device: int = -1) -> dict:
        """Segments and blocks (``torch.cuda.memory_snapshot()``'s shape)."""
        device = _dev(device)
        needed = c_size_t(0)
        for _ in range(8):
            cap = needed.value
            buf = ctypes.create_string_buffer(cap) if cap else None
            rc = self.dll.gpualloc_snapshot_json(device, buf, cap, ctypes.byref(needed))
            if rc == ERR_BUFFER_TOO_SMALL:
                needed.value += 4096  # the state may grow between the two calls
                continue
            self.check(rc)
            return json.loads(buf.value.decode())
        raise GpuallocError("snapshot kept growing", ERR_BUFFER_TOO_SMALL)

    def set_plain_requests(self, plain: bool) -> None:
        """PyTorch's ``expandable_segments`` says off (``True``) or on again:
        requests outside private pools take plain segments meanwhile (the
        torch bridge tells it; Note [PyTorch's expandable_segments switch])."""
        self.check(self.dll.gpualloc_set_plain_requests(1 if plain else 0))

    # ---- private pools ----

    def create_or_incref_pool(self, pool: Tuple[int, int], device: int = 0) -> None:
        """Creates private pool ``pool`` if absent and takes one hold on it."""
        self.check(self.dll.gpualloc_create_or_incref_pool(_dev(device), *_pool(pool)))

    def pool_use_count(self, pool: Tuple[int, int], device: int = 0) -> int:
        """Holds on private pool ``pool``; 0 for an unknown pool."""
        n = ctypes.c_uint32(0)
        self.check(self.dll.gpualloc_pool_use_count(_dev(device), *_pool(pool), ctypes.byref(n)))
        return n.value

    def empty_pool_cache(self, pool: Tuple[int, int], device: int = 0) -> None:
        """``emptyCache(mempool_id)``: frees a released pool's cached memory."""
        self.check(self.dll.gpualloc_empty_pool_cache(_dev(device), *_pool(pool)))

    def pool_live_allocations(self, pool: Tuple[int, int], device: int = 0) -> list:
        """Addresses of the blocks allocated in private pool ``pool``."""
        device, pool = _dev(device), _pool(pool)
        n = c_size_t(0)
        for _ in range(8):
            cap = n.value
            out = (c_uint64 * cap)()
            rc = self.dll.gpualloc_pool_live_allocations(
                device, pool[0], pool[1], out, cap, ctypes.byref(n)
            )
            if rc != ERR_BUFFER_TOO_SMALL:
                self.check(rc)
                return list(out[: n.value])
        raise GpuallocError("live allocations kept growing", ERR_BUFFER_TOO_SMALL)

    # ---- tracing ----

    def trace_start(self, path: str) -> None:
        self.check(self.dll.gpualloc_trace_start(_cstr(os.fsencode(path), "trace path")))

    def trace_stop(self, at_end: bool = False) -> Dict[str, int]:
        s = TraceSummary()
        stop = self.dll.gpualloc_trace_stop_at_end if at_end else self.dll.gpualloc_trace_stop
        self.check(stop(ctypes.byref(s)))
        return {"events": s.events, "dropped": s.dropped, "bytes": s.bytes}

    def trace_flush(self) -> None:
        self.check(self.dll.gpualloc_trace_flush())

    def is_tracing(self) -> bool:
        return bool(self.check(self.dll.gpualloc_is_tracing()))

    def phase_push(self, name: str) -> None:
        self.check(self.dll.gpualloc_phase_push(_cstr(name, "phase name")))

    def phase_pop(self) -> None:
        self.check(self.dll.gpualloc_phase_pop())

    def mark(self, name: str) -> None:
        self.check(self.dll.gpualloc_mark(_cstr(name, "mark name")))


class ForkSafeLock:
    """A module's lock that a forked child gets anew: the child has only the
    thread that forked, so a lock another thread held at that moment would
    stay held for good (Note [Trace control across fork] in
    ``allocator/src/trace/control_lock.rs``). For locks that live as long
    as the process (the fork handler keeps it)."""

    def __init__(self, factory=threading.Lock):
        self._factory = factory
        self._lock = factory()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._lock = self._factory()

    def __enter__(self):
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


_LIB: Optional[Library] = None
_LOCK = ForkSafeLock()


def lib() -> Library:
    """The process's library, loaded on first use."""
    global _LIB
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                _LIB = Library(library_path())
    return _LIB
