"""Installing gpualloc into PyTorch: the C++ bridge, the fallback, the patches.

See the package docstring for why a bridge is needed. Everything here
imports torch, so only ``install()`` loads this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import os
import platform
import sys
import tempfile
import threading
import time
import warnings
from typing import Optional

from ._lib import ERR_IO, GpuallocError, lib, trace_path_problem

MODE: Optional[str] = None  # "bridge" or "fallback" once installed
# Set by `python -m gpualloc run` before it installs: the script's own
# install(config=...) then warns instead of failing (run's choice holds).
BY_RUN = False
# Set by the hook that installs gpualloc in a child process of ``run``
# (_child/sitecustomize.py). What the environment's PyTorch allocator
# settings do is said by the run process, once: its children (every rank,
# every spawned DataLoader worker) say it again only of a setting the run
# process did not say (one the program set for its children itself).
IN_RUN_CHILD = False
# The settings this process said of ("NAME=value"), which run passes on to
# its children in SAID_ENV.
SAID: list = []
SAID_ENV = "GPUALLOC_RUN_SAID"
# Libraries known to start CUDA when imported, named by install()'s error
# when CUDA runs already.
CUDA_AT_IMPORT = ("unsloth", "unsloth_zoo")


def _say_setting(name: str) -> bool:
    """Whether to say what ``name``'s value in the environment does: not in
    a child of run that said that very setting. Records it as said."""
    from ._children import said_settings, said_value

    setting = f"{name}={os.environ.get(name, '')}"
    said = said_settings(os.environ.get(SAID_ENV, ""))
    if IN_RUN_CHILD and setting in said:
        return False
    SAID.append(setting)
    if IN_RUN_CHILD:
        # This process's own children (a rank's workers) inherit it said.
        os.environ[SAID_ENV] = said_value(said + [setting])
    return True
_LOCK = threading.Lock()
_KEEP = []  # objects that must live as long as the process (allocator, libraries)

HERE = os.path.dirname(os.path.abspath(__file__))

# PyTorch's variables for its own allocator's settings (PYTORCH_ALLOC_CONF is
# the newer name of the first): set under gpualloc, they do nothing but for
# two keys (Note [PyTorch's settings under gpualloc] in the core), which
# install() says.
TORCH_ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# PyTorch's switches that send every allocation to cudaMalloc, on when set to
# "1" (torch >= 2.7 reads them with c10::utils::check_env: "0" keeps caching,
# another value is ignored; the HIP name counts on CUDA too): the bridge
# honours them as PyTorch does (Note [The caching allocator switched off] in
# bridge/uncached.h), the fallback cannot; install() says which.
NO_CACHING_VARIABLES = ("PYTORCH_NO_CUDA_MEMORY_CACHING", "PYTORCH_NO_HIP_MEMORY_CACHING")


def _import_torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise GpuallocError(f"gpualloc.install() needs PyTorch, which could not be imported: {e}") from None
    return torch


def install(config: Optional[str], trace: Optional[str], bridge: bool, verbose: bool, auto_marks: Optional[bool] = None) -> str:
    global MODE
    # Imported before the lock: under `run`, importing torch in a child
    # process installs gpualloc itself (Note [Installing in child
    # processes]), on this thread, and finds the lock free; this call then
    # finds gpualloc installed.
    torch = _import_torch()
    if trace and not lib().is_initialized() and not lib().is_tracing():
        # Kept for the allocator's start, where a failure is only a line on
        # stderr: a path that can never be written is refused now.
        problem = trace_path_problem(trace)
        if problem is not None:
            raise GpuallocError(f"gpualloc.install(trace={trace!r}): {problem}", ERR_IO)
    with _LOCK:
        if MODE is not None:
            if config is not None:
                try:
                    lib().configure(config)  # same configuration: fine; another: a clear error
                except GpuallocError as e:
                    if not BY_RUN:
                        raise
                    warnings.warn(
                        f"gpualloc: install(config={config!r}) ignored: `python -m gpualloc run` installed gpualloc "
                        f"first ({e}); give the configuration to it: `python -m gpualloc run --config '{config}' ...`",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            if trace and lib().is_tracing():
                warnings.warn(
                    f"gpualloc: install(trace={trace!r}) ignored: a trace is already being recorded; "
                    "gpualloc.trace_stop() first to record another",
                    RuntimeWarning,
                    stacklevel=3,
                )
            elif trace:
                lib().configure(None, trace)  # now if the allocator runs, else from its start
            if auto_marks is not None:  # None leaves the first install's choice, as config=None does
                _set_auto_marks(torch, auto_marks)
            return MODE
        if torch.cuda.is_initialized():
            starters = [m for m in CUDA_AT_IMPORT if m in sys.modules]
            which = f" ({', '.join(starters)} does so when imported)" if starters else ""
            raise GpuallocError(
                "gpualloc.install() must run before CUDA is initialized, but torch has already initialized CUDA "
                f"(a torch.cuda call or a CUDA tensor came first, possibly inside an imported library{which}). "
                "Call gpualloc.install() at the very top of the program, before importing such libraries, "
                "or use `python -m gpualloc run script.py`, which installs gpualloc as torch is imported."
            )
        if getattr(getattr(torch, "version", None), "cuda", None) is None:
            raise GpuallocError(f"gpualloc.install(): this torch ({torch.__version__}) was built without CUDA")
        # Nothing here initializes the CUDA driver: the allocator starts at
        # PyTorch's own CUDA initialization, so that a program may still
        # choose its GPUs (CUDA_VISIBLE_DEVICES) after install(), and
        # processes that never use the GPU never start the driver (Note
        # [Starting on first use] in capi/src/pending.rs).
        _say_preloaded_hooks()
        replacing = _allocator_backend(torch)
        L = lib()  # raises LibraryNotFound with instructions
        # A bad configuration raises here, before torch is touched. None is
        # GPUALLOC_CONF's, kept as such: a later install(config=...) with
        # another is refused, as once the allocator runs.
        kept = config if config is not None else os.environ.get("GPUALLOC_CONF", "")
        L.configure(kept)
        _say_torch_variables(L)
        started = bool(trace) and not L.is_tracing()
        if started:
            L.configure(None, trace)
        elif trace:
            warnings.warn(
                f"gpualloc: install(trace={trace!r}) ignored: a trace is already being recorded (GPUALLOC_TRACE?)",
                RuntimeWarning,
                stacklevel=3,
            )
        try:
            mode = _install_into(torch, L, bridge, verbose)
        except BaseException:
            # Nothing was installed: a retry may start the trace again, and
            # take another configuration.
            try:
                if started:
                    L.trace_stop()
                if not L.is_initialized():
                    L.forget_config(kept)
            except GpuallocError:
                pass  # the install's own error is the one to report
            raise
        MODE = mode
        _say_replaced_allocator(replacing)
        _nccl_graph_register(L)
        _say_no_caching(mode)
        _set_auto_marks(torch, auto_marks)
        _complete_trace_in_workers(L)
        return mode


def _say_torch_variables(L) -> None:
    """Says, once, that PyTorch's allocator variables configure PyTorch's
    own allocator, unless each of their keys holds as written under gpualloc
    (``_settings.holds_as_written``)."""
    from . import _settings

    try:
        maps = L.maps_memory()
    except GpuallocError:
        maps = False
    for name in TORCH_ALLOCATOR_VARIABLES:
        value = os.environ.get(name, "")
        # expandable_segments:True alone (torchtune sets it as it is
        # imported) is what gpualloc does anyway: nothing to say.
        if value.strip() and not _settings.holds_as_written(value, maps) and _say_setting(name):
            warnings.warn(
                f"gpualloc: {name}={os.environ[name]!r} configures PyTorch's own "
                "allocator and has no effect on gpualloc (but for per_process_memory_fraction, which caps each "
                "device as under PyTorch, and, which the bridge honours, graph_capture_record_stream_reuse and "
                "expandable_segments:False: requests then take plain segments, as PyTorch's, for CUDA IPC, and "
                "reserved memory is no longer kept close to live memory); "
                "gpualloc takes its configuration from install(config=...) or "
                "GPUALLOC_CONF (same syntax for the keys both have: docs/configuration.md)",
                RuntimeWarning,
                stacklevel=4,
            )


# Libraries that see and release PyTorch's memory by interposing on
# cudaMalloc through LD_PRELOAD (torch_memory_saver's default "preload"
# mode, which SGLang forces for its pauseable CUDA graphs).
PRELOAD_HOOKS = ("torch_memory_saver",)


def _say_preloaded_hooks() -> None:
    """Warns of a preloaded cudaMalloc hook: gpualloc never calls cudaMalloc
    (it maps memory through the driver), so such a hook sees none of its
    memory and releases none of it."""
    for path in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if any(h in os.path.basename(path) for h in PRELOAD_HOOKS):
            warnings.warn(
                f"gpualloc: LD_PRELOAD has {path!r}, which hooks cudaMalloc to see and release PyTorch's memory; "
                "gpualloc never calls cudaMalloc (it maps memory through the CUDA driver), so that library sees "
                "none of it and releases none (torch_memory_saver's pause() would free nothing): use its "
                "hook_mode='torch', whose MemPool gpualloc serves from that library's own allocator",
                RuntimeWarning,
                stacklevel=4,  # the caller of gpualloc.install
            )
            return


# NCCL's registration of the buffers of collectives captured in CUDA graphs
# (on unless NCCL_GRAPH_REGISTER=0).
NCCL_GRAPH_REGISTER = "NCCL_GRAPH_REGISTER"


def _nccl_graph_register(L) -> None:
    """Turns NCCL's registration of buffers captured in CUDA graphs off
    (NCCL_GRAPH_REGISTER=0, for this process and those it starts) when
    gpualloc maps memory and the variable is unset; warns when it is set on.

    Note [NCCL's graph registration]
    Rationale: a collective captured in a CUDA graph registers its buffers
    with NCCL when they are memory mapped through the driver (NCCL's
    "qualified allocator"), taking the buffer to lie in one allocation, and
    keeps the registration, by address, as long as the graph lives. Under
    PyTorch's own expandable segments that is known to end in illegal memory
    accesses or hangs (pytorch/pytorch#158029; Megatron-LM refuses CUDA
    graphs on GPUs before Blackwell unless NCCL_GRAPH_REGISTER=0, and
    torchtitan and Megatron-Bridge set it). gpualloc's memory is mapped the
    same way, in handles of at most 16 MiB, and its defragmentation maps
    other pages at a free address that a registration may still name.
    Megatron's guard reads PYTORCH_CUDA_ALLOC_CONF only, so it never fires
    under gpualloc.
    Approach: install() sets NCCL_GRAPH_REGISTER=0 when gpualloc maps memory
    (its default) and the variable is unset; NCCL reads it when its first
    communicator starts, after install(), and processes started later
    inherit it. Captured collectives then copy through NCCL's own buffers,
    as with plain memory not from ncclMemAlloc. A value the program set is
    left alone; one that turns registration on is warned of once. Nothing
    is set where PyTorch's variable says expandable_segments:False, which
    keeps gpualloc's memory plain (but for a later switch back on)."""
    try:
        maps = L.maps_memory()
    except Exception:  # noqa: BLE001 - install() has reported a bad configuration already
        return
    if not maps or _torch_says_plain():
        return
    value = os.environ.get(NCCL_GRAPH_REGISTER)
    if value is None or not value.strip():
        os.environ[NCCL_GRAPH_REGISTER] = "0"
    elif value.strip() != "0" and _say_setting(NCCL_GRAPH_REGISTER):
        warnings.warn(
            f"gpualloc: {NCCL_GRAPH_REGISTER}={value!r} has NCCL register the buffers of collectives captured in CUDA "
            "graphs, which is known to end in illegal memory accesses or hangs on memory mapped through the driver, as "
            "gpualloc's expandable memory is (pytorch/pytorch#158029); gpualloc sets it to 0 when it is unset",
            RuntimeWarning,
            stacklevel=4,  # the caller of gpualloc.install
        )


def _torch_says_plain() -> bool:
    """Whether PyTorch's variable (the first of TORCH_ALLOCATOR_VARIABLES
    set, as torch reads them) says ``expandable_segments:False``, which the
    bridge honours from the start: requests and pools take plain memory
    (Note [PyTorch's expandable_segments switch])."""
    from . import _settings

    for name in TORCH_ALLOCATOR_VARIABLES:
        if name in os.environ:
            said = [v for k, v in _settings.entries_in(os.environ[name]) if k == "expandable_segments"]
            return bool(said) and said[-1] == "False"
    return False


def _allocator_backend(torch) -> str:
    """The allocator torch would use now (before install(): PyTorch's own,
    "native", unless the program chose another); "native" when this torch
    cannot say. Starts nothing."""
    get = getattr(torch.cuda, "get_allocator_backend", None)
    try:
        return get() if get is not None else "native"
    except Exception:  # noqa: BLE001 - a torch whose query fails has nothing to say
        return "native"


def _say_replaced_allocator(name: str) -> None:
    """Warns, once install() succeeded, when the allocator it replaced
    (``name``, read before) is not PyTorch's own: one the program swapped in
    before (RMM's, through change_current_allocator) or chose with
    PYTORCH_CUDA_ALLOC_CONF's ``backend:cudaMallocAsync``. PyTorch lets a
    later swap replace it as silently, but a program that set it up means it
    to serve torch (RMM's managed memory, a preallocated pool), and
    gpualloc's torch bridge opens the CUDA IPC handles of other processes'
    plain memory through it, which such allocators refuse."""
    if name == "native":
        return
    warnings.warn(
        f"gpualloc: install() replaces the {name!r} allocator this process had chosen for torch "
        "(change_current_allocator() before install(), or PYTORCH_CUDA_ALLOC_CONF's backend): gpualloc now serves "
        "every CUDA allocation and that allocator none (its memory resource, pool and statistics go unused), and a "
        "CUDA tensor another process shares from plain (not expandable) memory cannot be opened here; install "
        "gpualloc first, or leave that allocator in place",
        RuntimeWarning,
        stacklevel=4,  # the caller of gpualloc.install
    )


def _say_no_caching(mode: str) -> None:
    """Warns, under PYTORCH_NO_CUDA_MEMORY_CACHING=1, what it does to this
    install: scripts set it to debug a crash or "to save memory" and would
    otherwise wonder why gpualloc's stats and trace stay empty, or, on the
    fallback, why memory stays cached."""
    names = [name for name in NO_CACHING_VARIABLES if os.environ.get(name) == "1"]
    if not names or not _say_setting(names[0]):
        return
    if mode == "bridge":
        what = ("as under PyTorch's own allocator, every CUDA allocation goes to cudaMalloc and back to cudaFree: "
                "gpualloc caches nothing, and its stats, memory history and trace see none of those allocations "
                "(unset it to use gpualloc)")
    else:
        what = ("gpualloc honours it only through its C++ bridge; without the bridge (a plain CUDAPluggableAllocator) "
                "allocations stay cached by gpualloc")
    warnings.warn(f"gpualloc: {names[0]}='1' is set: {what}", RuntimeWarning, stacklevel=4)


def _complete_trace_in_workers(L) -> None:
    """A multiprocessing worker (a ``Pool``'s, under ``spawn`` or
    ``forkserver``) leaves through ``os._exit``, past the exit handlers that
    complete a trace, which then lacks its end; multiprocessing runs its
    finalizers first, so the trace is completed there. Only in such a
    worker: a main process completes it at exit, after what its other
    threads and exit handlers allocate."""
    import multiprocessing
    import multiprocessing.util

    def finalize_in_worker(L) -> None:
        multiprocessing.util.Finalize(None, L.stop_started_trace, exitpriority=0)

    if multiprocessing.parent_process() is None:
        # A worker forked from here (the fork start method: Lightning's
        # ddp_fork, mp.Process) runs none of this again, and its bootstrap
        # clears the finalizers it inherits: register it there anew.
        multiprocessing.util.register_after_fork(L, finalize_in_worker)
        return
    finalize_in_worker(L)


def _install_into(torch, L, bridge: bool, verbose: bool) -> str:
    """The bridge, or the fallback; then the Python patches. Returns the mode."""
    mode = None
    if bridge and _env_switch("GPUALLOC_BRIDGE", True, stacklevel=4):  # the caller of gpualloc.install
        try:
            _install_bridge(torch, L.path, verbose)
            mode = "bridge"
        except _BridgeUnavailable as e:
            warnings.warn(
                f"gpualloc: the C++ bridge could not be built ({e}); falling back to a plain CUDAPluggableAllocator: "
                "stats keep working through Python patches, but an out-of-memory error raises RuntimeError "
                "('CUDA out of memory. ...') instead of torch.cuda.OutOfMemoryError, cudnn.benchmark convolutions "
                "fail, and a captured CUDA graph keeps its memory until the process ends.",
                RuntimeWarning,
                stacklevel=4,
            )
    if mode is None:
        _install_fallback(torch, L.path)
        mode = "fallback"
    _patch_python(torch, fallback=(mode == "fallback"))
    return mode


def _set_auto_marks(torch, auto_marks: Optional[bool]) -> None:
    from . import _auto

    if _auto.wanted(auto_marks):
        _auto.enable(torch)
    elif auto_marks is False:
        _auto.disable()


class _BridgeUnavailable(Exception):
    pass


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _env_switch(name: str, default: bool, stacklevel: int = 2) -> bool:
    """An on/off variable: 1/true/yes/on or 0/false/no/off, any case; unset
    or empty is ``default``, and so is anything else, with a warning that
    names the value (``stacklevel`` counted from the caller, as in
    ``warnings.warn``)."""
    v = os.environ.get(name, "").strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    if v:
        warnings.warn(f"gpualloc: {name}={os.environ[name]!r} is not one of {'/'.join(_ON)} or "
                      f"{'/'.join(_OFF)}; using the default ({'on' if default else 'off'})", RuntimeWarning, stacklevel=stacklevel + 1)
    return default


# Where the file system has no locks (see _build_turn), cpp_extension's
# build lock older than this is taken for the leftover of a build killed
# midway. Compiling the bridge takes well under a minute.
STALE_LOCK_S = 600


@contextlib.contextmanager
def _build_turn(build_dir: str):
    """One gpualloc build at a time in ``build_dir``, by a lock the kernel
    lets go of when its holder dies (``fcntl.flock``). cpp_extension's own
    lock is a file that a build killed midway leaves behind (torchrun stops
    every rank when one fails), and it would wait for that file forever;
    while this turn is held, no live gpualloc build owns such a file. Yields
    whether the turn is held (False where the file system has no locks)."""
    try:
        import fcntl

        fd = os.open(os.path.join(build_dir, "gpualloc-build.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except (ImportError, OSError):
        yield False
        return
    try:
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # Say why this process pauses (a notebook would seem to hang).
                print(f"gpualloc: waiting for another process building the C++ bridge in {build_dir}",
                      file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        except OSError:
            held = False
        yield held
    finally:
        os.close(fd)  # lets go of the turn


def _clear_leftover_lock(build_dir: str, sole: bool) -> None:
    """Removes cpp_extension's build lock left by a build that did not
    finish, with a warning: any such file while this process holds the
    build turn (``sole``), else one older than STALE_LOCK_S."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock
    if sole or age > STALE_LOCK_S:
        warnings.warn(f"gpualloc: removing the bridge's build lock {lock}, left {age:.0f} s ago by a build that "
                      "did not finish", RuntimeWarning, stacklevel=7)  # the caller of gpualloc.install
        with contextlib.suppress(OSError):
            os.remove(lock)


def _build_failure(text: str) -> str:
    """The lines of a failed build's output that say why: the first that
    reports an error (a compiler's, the bridge's own #error, a missing
    header), and the last (ninja's summary)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "no output"
    said = [ln for ln in lines if "error" in ln.lower() and not ln.startswith(("ninja: build stopped", "Error building extension"))]
    first = next((ln for ln in said if "error:" in ln.lower()), said[0] if said else None)
    return lines[-1] if first is None or first == lines[-1] else f"{first} ... {lines[-1]}"


def _cuda_include_dirs(torch):
    """Directories holding cuda_runtime_api.h: a toolkit, or NVIDIA's pip wheels."""
    dirs = []
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime_api.h")):
            dirs.append(os.path.join(root, "include"))
    for sp in {os.path.dirname(os.path.dirname(torch.__file__))} | set(sys.path):
        if not sp or not os.path.isdir(os.path.join(sp, "nvidia")):
            continue
        for hdr in glob.glob(os.path.join(sp, "nvidia", "**", "include", "cuda_runtime_api.h"), recursive=True):
            dirs.append(os.path.dirname(hdr))
    # cuda_runtime_api.h includes crt/host_defines.h etc. from the same tree; keep order, drop repeats.
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def _build_dir(torch, key: str) -> str:
    base = os.environ.get("GPUALLOC_BUILD_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpualloc")
    path = os.path.join(base, f"bridge-torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}-{key}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise _BridgeUnavailable(f"cannot create the build directory {path} ({e.strerror or e}); "
                                 "set GPUALLOC_BUILD_DIR to a writable folder") from None
    return path


@contextlib.contextmanager
def _cuda_left_alone():
    """While torch's extension tools run: ``torch.utils.cpp_extension``
    calls ``torch.cuda.is_available()`` when it is imported, which counts
    devices through the CUDA driver, starting it and fixing the devices the
    process sees before the program could choose them (Note [Starting on
    first use] in capi/src/pending.rs). torch counts them through NVML
    instead, which starts no driver, when PYTORCH_NVML_BASED_CUDA_CHECK=1:
    set for the build, restored after."""
    key = "PYTORCH_NVML_BASED_CUDA_CHECK"
    old = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _build_bridge(torch, verbose: bool) -> str:
    """Compiles bridge.cpp against the installed torch; returns the .so path (cached)."""
    with _cuda_left_alone():
        return _build_bridge_now(torch, verbose)


def _build_bridge_now(torch, verbose: bool) -> str:
    src = os.path.join(HERE, "bridge.cpp")
    header_dir = os.path.join(HERE, "include")
    h = hashlib.sha256()
    parts = sorted(glob.glob(os.path.join(HERE, "bridge", "*.h")))
    for p in [src, os.path.join(header_dir, "gpualloc.h")] + parts:
        with open(p, "rb") as f:
            h.update(f.read())
    # And the build's platform: one cache directory may be shared by
    # machines of other architectures or by other builds of the same torch
    # version (a home directory mounted on x86-64 and aarch64 nodes, pip and
    # conda torch), whose bridges cannot load here.
    version = getattr(torch, "version", None)
    for part in (platform.machine(), sys.implementation.cache_tag, getattr(version, "cuda", None),
                 getattr(version, "git_version", None),
                 getattr(getattr(torch, "_C", None), "_GLIBCXX_USE_CXX11_ABI", None)):
        h.update(repr(part).encode())
    key = h.hexdigest()[:12]
    name = f"gpualloc_bridge_{key}"
    build_dir = _build_dir(torch, key)
    so = os.path.join(build_dir, f"{name}.so")
    # Several processes may install at once (torchrun's ranks on a fresh
    # machine). They build one at a time (_build_turn, and cpp_extension's
    # own lock within), but the linker writes the .so in place: one seen
    # before its build finished may be partial, and loading it can fail or
    # fault. So the cached .so is trusted only beside the marker written
    # once a build completed; without it a process waits for its turn and
    # then finds the marker, or builds (ninja finds it up to date).
    complete = so + ".complete"
    rebuild = _env_switch("GPUALLOC_REBUILD_BRIDGE", False, stacklevel=6)  # the caller of gpualloc.install
    if os.path.isfile(complete) and os.path.isfile(so) and not rebuild:
        return so
    if rebuild:  # the library may be relinked in place: not to be trusted meanwhile
        with contextlib.suppress(OSError):
            os.remove(complete)
    # Imported only for a build: importing it costs every process that
    # installs (spawned workers, each rank) a second or so.
    try:
        from torch.utils import cpp_extension
    except Exception as e:  # pragma: no cover
        raise _BridgeUnavailable(f"torch.utils.cpp_extension unavailable: {e}") from None
    cuda_inc = _cuda_include_dirs(torch)
    if not cuda_inc:
        raise _BridgeUnavailable("cuda_runtime_api.h not found (set CUDA_HOME, or install the nvidia-cuda-runtime wheel)")
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    with _build_turn(build_dir) as sole:
        if sole and not rebuild and os.path.isfile(complete) and os.path.isfile(so):
            return so  # built by the process this one waited for
        _clear_leftover_lock(build_dir, sole)
        print(f"gpualloc: compiling the C++ bridge for torch {torch.__version__} (once; cached in {build_dir})",
              file=sys.stderr, flush=True)
        so = _load_bridge(cpp_extension, name, src, header_dir, cuda_inc, torch_lib, build_dir, so, verbose)
        _write_marker(complete)
    return so


def _load_bridge(cpp_extension, name, src, header_dir, cuda_inc, torch_lib, build_dir, so, verbose) -> str:
    """cpp_extension's build of the bridge; the library's path."""
    try:
        built = cpp_extension.load(
            name=name,
            sources=[src],
            extra_include_paths=[header_dir] + cuda_inc,
            extra_cflags=["-O2"],
            extra_ldflags=[f"-L{torch_lib}", "-lc10_cuda", "-ltorch_cuda", "-ldl", f"-Wl,-rpath,{torch_lib}"],
            build_directory=build_dir,
            with_cuda=False,
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as e:
        raise _BridgeUnavailable(f"compiling {src} failed: {_build_failure(str(e)) if str(e).strip() else repr(e)}") from None
    if isinstance(built, str) and os.path.isfile(built):
        so = built
    if not os.path.isfile(so):
        raise _BridgeUnavailable(f"the build did not produce {so}")
    return so


def _write_marker(path: str) -> None:
    """Creates `path` atomically (a file of a unique name written beside it,
    then renamed), so that another process sees it whole or not at all. A
    failure only costs later processes a wait on the build lock, so it is
    reported and otherwise ignored."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".complete-")
        with os.fdopen(fd, "w") as f:
            f.write("built\n")
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        warnings.warn(f"gpualloc: could not mark the bridge build complete ({e}); later installs will check it again",
                      RuntimeWarning, stacklevel=2)


def _install_bridge(torch, libpath: str, verbose: bool) -> None:
    so = _build_bridge(torch, verbose)
    try:
        bridge = ctypes.CDLL(so)
    except OSError as e:
        raise _BridgeUnavailable(f"loading {so} failed: {e}") from None
    bridge.gpualloc_bridge_install.restype = ctypes.c_int
    bridge.gpualloc_bridge_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    err = ctypes.create_string_buffer(4096)
    rc = bridge.gpualloc_bridge_install(os.fsencode(libpath), err, len(err))
    if rc == 2:
        # PyTorch refuses its own settings (a key or value it does not know
        # in PYTORCH_CUDA_ALLOC_CONF): the user's to mend, as it would be
        # without gpualloc, not a reason to fall back.
        msg = err.value.decode(errors="replace")
        raise GpuallocError(f"gpualloc.install(): PyTorch refuses its allocator settings "
                            f"(PYTORCH_CUDA_ALLOC_CONF): {msg}")
    if rc != 0:
        msg = err.value.decode(errors="replace")
        if "already initialized" in msg or "Can't swap" in msg:
            raise GpuallocError(f"gpualloc.install(): {msg} (torch initialized CUDA before gpualloc.install())")
        raise _BridgeUnavailable(msg)
    _KEEP.append(bridge)
    bridge.gpualloc_bridge_sync_settings.restype = ctypes.c_int
    bridge.gpualloc_bridge_sync_settings.argtypes = [ctypes.c_char_p, ctypes.c_size_t]

    def sync() -> None:
        buf = ctypes.create_string_buffer(4096)
        rc = bridge.gpualloc_bridge_sync_settings(buf, len(buf))
        if rc < 0:
            raise GpuallocError(f"gpualloc: {buf.value.decode(errors='replace')}")
        if rc == 1:
            warnings.warn(buf.value.decode(errors="replace"), RuntimeWarning, stacklevel=4)

    from . import _settings

    sync()  # PyTorch's variable, kept for the allocator's start
    start_fraction = _start_fraction(torch)
    _settings.follow(torch._C, sync, start_fraction=start_fraction)
    _fraction_set_before(torch, start_fraction)


def _start_fraction(torch):
    """For ``_settings.follow``: a string torch took before CUDA started
    caps each device with its ``per_process_memory_fraction`` from the
    device's start, as PyTorch's allocator does (Note [PyTorch's fraction
    set at run time] in ``capi/src/global.rs``); whether it will."""

    def start_fraction(settings: str) -> bool:
        if torch.cuda.is_initialized():
            return False
        try:
            return lib().set_torch_settings(settings)
        except GpuallocError:  # torch took the string: said as not followed instead
            return False

    return start_fraction


def _fraction_set_before(torch, start_fraction) -> None:
    """A ``per_process_memory_fraction`` set at run time before install()
    wrapped torch's setters: torch keeps the last string it took
    (``_accelerator_getAllocatorSettings``, torch >= 2.10), which
    ``start_fraction`` reads as the wrapper would have (the variable's own
    string gives the variable's fraction again)."""
    from . import _settings

    get = getattr(getattr(torch, "_C", None), "_accelerator_getAllocatorSettings", None)
    if get is None:
        return
    try:
        settings = get()
    except Exception:  # noqa: BLE001 - torch refuses its variable: it says so at CUDA's start
        return
    if isinstance(settings, str) and _settings.FRACTION_KEY in _settings.keys_in(settings):
        start_fraction(settings)


def _install_fallback(torch, libpath: str) -> None:
    """A plain CUDAPluggableAllocator with every hook PyTorch lets C set."""
    oom = os.environ.get("GPUALLOC_FALLBACK_OOM", "raise").strip().lower() or "raise"
    if oom not in ("raise", "abort", "null"):
        warnings.warn(f"gpualloc: GPUALLOC_FALLBACK_OOM={oom!r} is not 'raise', 'abort' or 'null'; using 'raise'",
                      RuntimeWarning, stacklevel=5)  # the caller of gpualloc.install
        oom = "raise"
    alloc_fn = {"raise": "gpualloc_malloc_or_raise", "abort": "gpualloc_malloc_or_abort", "null": "gpualloc_malloc"}[oom]
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(libpath, alloc_fn, "gpualloc_free")
    raw = pluggable.allocator()
    dll = lib().dll

    def addr(fn):
        return ctypes.cast(fn, ctypes.c_void_p).value

    raw.set_reset_fn(addr(dll.gpualloc_empty_cache))
    raw.set_memory_fraction_fn(addr(dll.gpualloc_set_memory_fraction))
    raw.set_record_stream_fn(addr(dll.gpualloc_record_stream))
    # The graph-pool hooks pass C++ objects (MempoolId_t, std::function): a C
    # function cannot take them, so they stay unset: gpualloc_malloc_or_raise
    # (and _or_abort) follow captures through the driver instead (Note
    # [Capture without a pool]).
    torch.cuda.memory.change_current_allocator(pluggable)
    _KEEP.append(pluggable)
    torch_c = getattr(torch, "_C", None)
    if torch_c is not None:
        from . import _settings

        # Nothing reaches gpualloc on this route but the fraction before
        # the start: every other key is said.
        start_fraction = _start_fraction(torch)
        _settings.follow(torch_c, lambda: None, honoured=(), start_fraction=start_fraction)
        _fraction_set_before(torch, start_fraction)


def _device_index(torch, device) -> int:
    from torch.cuda._utils import _get_device_index

    return _get_device_index(device, optional=True)


def _patch_python(torch, fallback: bool) -> None:
    """Python-level patches (see the package docs)."""
    import collections

    mem = torch.cuda.memory

    def memory_snapshot(mempool_id=None, include_traces=True):
        """gpualloc's segments and blocks (``torch.cuda.memory_snapshot`` shape;
        no stack frames); only those of private pool ``mempool_id`` when given."""
        segs = lib().snapshot(-1)["segments"]
        if mempool_id is not None and tuple(int(x) for x in mempool_id) != (0, 0):
            # (0, 0) means every pool, as in PyTorch's snapshot.
            want = tuple(int(x) for x in mempool_id)
            segs = [s for s in segs if tuple(s["segment_pool_id"]) == want]
        for s in segs:
            for b in s["blocks"]:
                b.setdefault("frames", [])
            s.setdefault("frames", [])
        return segs

    def _snapshot(device=None, *args, **kwargs):
        # No history on this route, but one (empty) trace per device, as
        # PyTorch gives: MemoryViz indexes device_traces by device.
        traces = [[] for _ in range(max(1, torch.cuda.device_count()))]
        segments = memory_snapshot(kwargs.get("mempool_id"))
        return {"segments": segments, "device_traces": traces, "allocator_settings": {}, "external_annotations": []}

    # With the bridge, torch's own snapshot path reads gpualloc (segments,
    # blocks, and the history torch records through it): nothing to patch.
    patches = {}

    def change_current_allocator(allocator):
        """gpualloc is PyTorch's CUDA allocator and stays so: another one
        asked for (RMM's, a CUDAPluggableAllocator) is refused with a
        warning, as libraries that find an allocator plugged in already
        skip the swap themselves. Under the bridge torch would raise
        "Can't swap an already initialized allocator", which names neither
        gpualloc nor a way out; on the fallback route it would silently
        put the other allocator in gpualloc's place before CUDA starts."""
        if any(allocator is kept for kept in _KEEP):
            return  # gpualloc's own plain CUDAPluggableAllocator
        warnings.warn(
            f"gpualloc: torch.cuda.memory.change_current_allocator({type(allocator).__name__}) ignored: gpualloc "
            "is installed as PyTorch's CUDA allocator and stays. To have that allocator serve some tensors, "
            "create them under torch.cuda.use_mem_pool(torch.cuda.MemPool(<it>.allocator())): gpualloc takes such "
            "a pool's segments from it; to use it for everything, do not install gpualloc",
            RuntimeWarning,
            stacklevel=2,
        )

    patches["change_current_allocator"] = change_current_allocator

    if fallback:
        patches.update(memory_snapshot=memory_snapshot, _snapshot=_snapshot)
        # Without the bridge torch's C++ stats calls raise "does not yet support":
        # answer from gpualloc instead.
        def memory_stats(device=None):
            if not torch.cuda.is_initialized():
                return collections.OrderedDict()
            return collections.OrderedDict(sorted(lib().stats(_device_index(torch, device)).items()))

        def memory_stats_as_nested_dict(device=None):
            nested = {}
            for k, v in memory_stats(device).items():
                cur = nested
                parts = k.split(".")
                for p in parts[:-1]:
                    cur = cur.setdefault(p, {})
                cur[parts[-1]] = v
            return nested

        def reset_peak_memory_stats(device=None):
            lib().reset_peak_stats(_device_index(torch, device))

        def reset_accumulated_memory_stats(device=None):
            lib().reset_accumulated_stats(_device_index(torch, device))

        def get_per_process_memory_fraction(device=None):
            return lib().memory_fraction(_device_index(torch, device))

        patches.update(
            memory_stats=memory_stats,
            memory_stats_as_nested_dict=memory_stats_as_nested_dict,
            reset_peak_memory_stats=reset_peak_memory_stats,
            reset_accumulated_memory_stats=reset_accumulated_memory_stats,
            get_per_process_memory_fraction=get_per_process_memory_fraction,
        )
    for name, fn in patches.items():
        # memory_allocated, max_memory_reserved, memory_summary, ... call the
        # module-level memory_stats, so patching the module covers them.
        if hasattr(mem, name) or name in ("memory_snapshot",):
            setattr(mem, name, fn)
        if hasattr(torch.cuda, name):
            setattr(torch.cuda, name, fn)

    # torch.accelerator.memory_* go through c10::getDeviceAllocator(kCUDA),
    # the native object the swap leaves in place: they would read zeros.
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        for name in (
            "memory_stats",
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
            "reset_peak_memory_stats",
            "reset_accumulated_memory_stats",
            "empty_cache",
        ):
            target = getattr(torch.cuda, name, None)
            if target is not None and hasattr(acc, name):

                def forward(*args, _t=target, **kwargs):
                    return _t(*args, **kwargs)

                forward.__name__ = name
                forward.__doc__ = f"gpualloc: forwards to torch.cuda.{name} (the generic path would read the native allocator)."
                setattr(acc, name, forward)
