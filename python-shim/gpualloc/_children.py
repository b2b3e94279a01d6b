"""gpualloc in the Python processes started by a program under ``run``.

Note [Installing in child processes]
Rationale: ``python -m gpualloc run`` installs gpualloc in its own process.
Training often runs in others the program starts: ranks of
``torch.multiprocessing.spawn``, of Lightning's DDP launcher (which runs
the script again), of ``torchrun`` or ``accelerate launch``, DataLoader
workers under ``spawn``. Those start a fresh interpreter and used
PyTorch's allocator, silently.
Approach: ``run`` passes on, in the environment its children inherit, its
choices (``GPUALLOC_CONF``, ``GPUALLOC_TRACE``, ``GPUALLOC_BRIDGE``,
``GPUALLOC_AUTO_MARKS``), ``GPUALLOC_RUN_CHILDREN=1``, and ``PYTHONPATH``
led by ``gpualloc/_child``, whose ``sitecustomize`` every Python process
imports when it starts. There, gpualloc is installed right after the
process has imported torch, before its program can touch CUDA. A process
that never imports torch is left alone; one that does pays for loading
the bridge (built once, cached), and for nothing on the GPU until it uses
CUDA, since installing starts nothing (Note [Starting on first use] in
``capi/src/pending.rs``). A trace path without ``{pid}`` or ``{rank}`` is
shared: the first process that allocates writes it, later ones write
``<name>-pid<N>.gtrace`` (Note [One writer per trace file]), whether
they run at once or one after another (the path is emptied as ``run``
starts); the process running ``run`` (a launcher) usually never
allocates, so never writes it.
"""

from __future__ import annotations

import fcntl
import os
import stat
import urllib.parse
from typing import List, Optional, Sequence

ENV = "GPUALLOC_RUN_CHILDREN"
SAID_ENV = "GPUALLOC_RUN_SAID"  # _torch.SAID_ENV
HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_DIR = os.path.join(HERE, "_child")


def said_value(said: Sequence[str]) -> str:
    """``SAID_ENV``'s value for the settings ``said`` ("NAME=value" each):
    each percent-encoded, joined by commas. A launcher that hands the
    environment on through a shell (``colossalai run`` writes
    ``export NAME="value"`` and drops any value holding a newline) keeps
    it as it is: no quote, dollar, backslash or newline is left in it."""
    return ",".join(urllib.parse.quote(s, safe="") for s in said)


def said_settings(value: str) -> List[str]:
    """The settings a ``SAID_ENV`` value names (``said_value``'s inverse);
    one per line, as earlier versions wrote it, is read too."""
    if not value:
        return []
    if "\n" in value:
        return value.split("\n")
    return [urllib.parse.unquote(s) for s in value.split(",")]


def leave_alone() -> None:
    """Takes out of this process the hook that an enclosing ``run`` put in
    (``_child/sitecustomize.py``), so that a nested ``python -m gpualloc
    run`` installs gpualloc with its own options, not the enclosing one's."""
    import sys

    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_TorchFinder"]


def pass_on(config: Optional[str], trace: Optional[str], bridge: bool, said: Sequence[str] = ()) -> None:
    """Sets the environment the program's child processes inherit (see
    the Note). Called by ``run`` once it has installed gpualloc here."""
    os.environ[ENV] = "1"
    # What run said of PyTorch's allocator settings, not said again there.
    os.environ[SAID_ENV] = said_value(said)
    # Paths as this process reads them: a child may start in another folder.
    for name in ("GPUALLOC_LIBRARY", "GPUALLOC_BUILD_DIR"):
        path = os.environ.get(name, "")
        if path and not os.path.isabs(path):
            os.environ[name] = os.path.abspath(path)
    if config is not None:
        os.environ["GPUALLOC_CONF"] = config
    if trace and not os.environ.get("GPUALLOC_TRACE", "").strip():
        # (With GPUALLOC_TRACE set, install() ignored --trace: so do they.)
        os.environ["GPUALLOC_TRACE"] = trace
    if not bridge:
        os.environ["GPUALLOC_BRIDGE"] = "0"
    _empty_unwritten(os.environ.get("GPUALLOC_TRACE", "").strip())
    # An empty entry is the current directory: kept (none when unset).
    given = os.environ.get("PYTHONPATH", "")
    paths = [p for p in given.split(os.pathsep) if p != CHILD_DIR] if given else []
    os.environ["PYTHONPATH"] = os.pathsep.join([CHILD_DIR] + paths)


def _empty_unwritten(path: str) -> None:
    """Empties the trace path this run's processes share when it is a
    regular file that no process writes (an earlier run's trace): the
    library sends a process of a run that finds a finished trace there
    beside it, to keep the trace of an earlier process of the same run
    (Note [One writer per trace file] in ``allocator/src/trace/trace_file.rs``),
    and the run's first writer is to take the path itself. A path with a
    placeholder (``{pid}``) names no one file; one being written is left
    to its writer."""
    if not path or "{" in path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # never created here; a pipe without reader fails
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
    except OSError:
        pass  # being written (locked), or not ours to empty
    finally:
        os.close(fd)
