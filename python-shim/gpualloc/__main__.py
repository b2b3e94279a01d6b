"""``python -m gpualloc run [options] (script.py | -m module | console-script | -) args...``

Installs gpualloc into PyTorch, then runs the program as ``__main__`` with its
own arguments, so training code needs no change. The program is a script
path, a module (``-m pkg``, as ``python -m`` runs it) or an installed console
script (``yolo train ...``: a ``console_scripts`` entry point, else a Python
program found on PATH), or ``-``: a program read from standard input. Every optimizer step is marked and the backward pass,
evaluation and ``torch.save`` are phases (``--no-auto-marks`` or
``GPUALLOC_AUTO_MARKS=0`` turns that off). Without PyTorch (a program that
uses gpualloc through its C ABI or ctypes) the library is started with the
configuration and trace, and a warning says torch was not found.

``python -m gpualloc info`` prints the library, its version and backend.
"""

from __future__ import annotations

import argparse
import atexit
import os
import runpy
import shutil
import sys
from typing import Optional


class _NotFound(Exception):
    pass


def _target(args):
    """``(argv0, start)``: what sys.argv[0] becomes and a function running
    the program; _NotFound names what was looked for."""
    if args.module is not None:
        if not args.module:
            raise _NotFound("-m needs a module name")
        name = args.module[0]
        args.args = args.module[1:]
        if os.getcwd() not in sys.path[:1]:
            sys.path.insert(0, os.getcwd())  # as `python -m` does (this run's own -m put it there)
        if not _module_exists(name):
            raise _NotFound(f"No module named {name}")
        # As `python -m` runs it (which sets sys.argv[0] to the module's file).
        return name, lambda: _run_as_main(lambda: runpy._run_module_as_main(name, alter_argv=True))
    script = args.script
    if script is None:
        raise _NotFound("nothing to run: give a script, -m module or a console script")
    if script == "-":
        # `python -`: the program is read from standard input, whole, before
        # it runs; sys.argv[0] is "-" and the working folder stays first on
        # sys.path (this run's own -m put it there).
        source = sys.stdin.read()
        return "-", lambda: _run_source(source)
    archive = _is_zip(script)
    bundle = archive or os.path.isdir(script)  # `python app/`, `python app.pyz`
    if os.path.isfile(script) and not archive:
        path = os.path.abspath(script)  # __file__ is absolute, as under `python script.py`
        _path_first(os.path.dirname(os.path.realpath(script)))
        return script, lambda: _run_file(path)
    if os.sep not in script:
        # A bare name is a command first (`run mypy` in a checkout with a
        # mypy/ folder means the installed mypy); `./mypy` is the folder.
        ep = _console_script(script)
        found = shutil.which(script)
        if ep is not None:
            if found:
                _path_first(os.path.dirname(os.path.realpath(found)))
            return found or script, lambda: _call_entry_point(ep)
        if found and _is_python(found):
            path = os.path.abspath(found)
            _path_first(os.path.dirname(os.path.realpath(found)))
            return found, lambda: _run_file(path)
        if found and not bundle:
            raise _NotFound(f"{script}: {found} is not a Python program (no python in its #! line)")
    if bundle:
        # `python app/` or `python app.pyz`: its __main__.py, with the folder
        # or archive itself first on sys.path.
        if _has_main(script) is False:
            raise _NotFound(f"{script}: no __main__.py in it")
        _path_first(os.path.abspath(script))
        # As `python app/` runs it: the __main__ module found on sys.path.
        return script, lambda: _run_as_main(lambda: runpy._run_module_as_main("__main__", alter_argv=False))
    raise _NotFound(f"{script}: no such file, console script entry point or Python program on PATH")


# Note [The program's __main__ stays]
# Rationale: runpy.run_path and run_module run a program in a temporary
# __main__ and put the caller's back when its body returns, but a program's
# exit handlers, the threads it leaves running (a ThreadPoolExecutor left to
# drain, the feeder thread of a multiprocessing Queue after a last put) and
# the workers they spawn still pickle the classes it defined, by name, in
# __main__: that failed under `run` ("attribute lookup Cfg on __main__
# failed"), and a checkpoint saved at exit was never written.
# Approach: as `python` does, the program runs in a fresh module that
# becomes sys.modules["__main__"] for good: a script's code is executed in
# it; a module (-m) or a folder or archive is run by
# runpy._run_module_as_main, the function `python -m` itself calls, which
# runs the code in whatever module is __main__ then. This module (the
# launcher) stays referenced by its own functions, such as the exit handler
# that completes the trace.


def _run_as_main(body) -> None:
    """Runs ``body`` with a fresh, empty module as ``__main__``, which stays
    (Note [The program's __main__ stays])."""
    import builtins
    import types

    module = types.ModuleType("__main__")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    body()


def _run_file(path: str) -> None:
    """Runs the script (or compiled script) at ``path`` as ``python path``
    does, in a ``__main__`` that stays, with the globals python gives it."""
    import importlib.machinery
    import importlib.util
    import io
    import marshal

    with io.open_code(path) as f:
        data = f.read()
    if data[:4] == importlib.util.MAGIC_NUMBER:
        code = marshal.loads(data[16:])  # a .pyc: its 16-byte header, then the code
        loader = importlib.machinery.SourcelessFileLoader("__main__", path)
    else:
        # dont_inherit: not this module's `from __future__ import annotations`
        # (the program's annotations would become strings).
        code = compile(data, path, "exec", dont_inherit=True)
        loader = importlib.machinery.SourceFileLoader("__main__", path)
    _run_globals(code, __file__=path, __loader__=loader)


def _run_source(source: str) -> None:
    """Runs ``source`` as ``__main__``, named ``<stdin>`` in tracebacks as
    under ``python -``."""
    import importlib.machinery

    _run_globals(compile(source, "<stdin>", "exec", dont_inherit=True), __file__="<stdin>",
                 __loader__=importlib.machinery.BuiltinImporter)


def _run_globals(code, **extra) -> None:
    def body():
        g = sys.modules["__main__"].__dict__
        g.update(__name__="__main__", __doc__=None, __cached__=None, __loader__=None, __package__=None, __spec__=None)
        g.update(extra)
        exec(code, g)

    _run_as_main(body)


def _is_zip(path: str) -> bool:
    import zipfile

    return os.path.isfile(path) and zipfile.is_zipfile(path)


def _has_main(path: str) -> Optional[bool]:
    """Whether the folder or zip archive ``path`` holds a ``__main__.py``
    (or its compiled form), as ``python path`` needs; ``None`` for an
    archive that cannot be read (run as ``python`` would, to fail there)."""
    names = ("__main__.py", "__main__.pyc")
    if os.path.isdir(path):
        return any(os.path.isfile(os.path.join(path, n)) for n in names)
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return any(n in z.namelist() for n in names)
    except (zipfile.BadZipFile, OSError):
        return None


def _module_exists(name: str) -> bool:
    """Whether the top-level package or module of ``name`` can be found.
    Only that: looking inside a package imports it, which must come after
    gpualloc is installed (runpy says what else is missing, then)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _path_first(folder: str) -> None:
    """``sys.path[0]`` as ``python script.py`` sets it: the script's folder
    (links resolved) in place of the working folder this run's own ``-m``
    put there, which a script run directly does not have."""
    # Under -P (safe_path, Python 3.11 on) sys.path[0] is the user's first
    # PYTHONPATH entry.
    safe_path = getattr(sys.flags, "safe_path", False)
    if sys.path and sys.path[0] in ("", os.getcwd()) and not safe_path:
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)


def _console_script(name: str):
    """The ``console_scripts`` entry point called ``name``, or None."""
    try:
        from importlib.metadata import entry_points
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    eps = entry_points()
    group = eps.select(group="console_scripts") if hasattr(eps, "select") else eps.get("console_scripts", [])
    for ep in group:
        if ep.name == name:
            return ep
    return None


def _call_entry_point(ep) -> None:
    """As the generated wrapper does: ``sys.exit(main())``; with ``__main__``
    looking like that wrapper, a script (no ``__spec__``): libraries that
    start their own worker processes (Lightning's DDP launcher) re-run
    ``python -m <__main__.__spec__.name>``, which would be this module, not
    the program."""
    main = sys.modules.get("__main__")
    if main is not None:
        main.__spec__ = None
    sys.exit(ep.load()())


def _is_python(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def _start(args) -> int:
    """Installs gpualloc (or only starts the library, without torch); 0 or 1."""
    import gpualloc
    from gpualloc import _children
    from gpualloc._lib import lib

    _children.leave_alone()  # a run inside a run: its own options
    trace = args.trace
    if trace and os.environ.get(_children.ENV) == "1":
        # The enclosing run passed its trace on in GPUALLOC_TRACE, which
        # would win over --trace as a user's own does: this run's --trace
        # takes its place, for this process (the library reads it when it
        # starts) and for the processes it starts.
        os.environ["GPUALLOC_TRACE"] = trace
        trace = None
    try:
        import torch  # noqa: F401
    except ImportError:
        torch = None
    if args.no_auto_marks:
        # Also for the script's own install() calls and its child processes.
        os.environ["GPUALLOC_AUTO_MARKS"] = "0"
    try:
        if torch is not None:
            from gpualloc import _torch

            _torch.BY_RUN = True  # the script's own install(config=...) warns instead of failing
            auto = False if args.no_auto_marks else None
            gpualloc.install(config=args.config, trace=trace, bridge=not args.no_bridge, auto_marks=auto)
            # And in the Python processes the program starts (Note
            # [Installing in child processes] in _children.py).
            _children.pass_on(args.config, args.trace, bridge=not args.no_bridge, said=_torch.SAID)
        else:
            lib()  # a library that cannot be loaded is the error to report, not a note that it was
            print("gpualloc: PyTorch not found: the allocator is loaded but not installed into torch", file=sys.stderr)
            lib().init(args.config)
            lib().backend()  # starts the backend: a missing driver is reported now
            if trace and lib().is_tracing():
                # GPUALLOC_TRACE started one: it wins, as under install().
                print(f"gpualloc: --trace {trace} ignored: a trace is already being recorded (GPUALLOC_TRACE)", file=sys.stderr)
            elif trace:
                lib().trace_start(trace)
    except (gpualloc.GpuallocError, ValueError) as e:
        print(f"gpualloc: cannot start: {_unprefixed(e)}", file=sys.stderr)
        return 1
    return 0


def _unprefixed(e) -> str:
    """An error's text without the ``gpualloc:`` this module puts first itself."""
    text = str(e)
    for prefix in ("gpualloc: ", "gpualloc "):
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


# Launchers that start the training processes themselves (gpualloc reaches
# them through the environment, on this machine only).
LAUNCHERS = {"torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate", "deepspeed"}


# deepspeed's own options that take no value (every other option of its
# takes one, unless given as --opt=value), and the hostfile it reads when
# none is given.
DEEPSPEED_FLAGS = {
    "--force_multi", "--no_ssh", "--no_ssh_check", "--no_python", "--no_local_rank", "--module",
    "--elastic_training", "--bind_cores_to_rank", "--save_pid", "--enable_each_rank_log", "-h", "--help",
}
DEEPSPEED_HOSTFILE = "/job/hostfile"


def _deepspeed_options(launcher_args) -> dict:
    """deepspeed's own options, up to the training script (its first
    argument that is no option nor an option's value): name -> value
    (True for a flag)."""
    options, i = {}, 0
    while i < len(launcher_args):
        a = launcher_args[i]
        if not a.startswith("-"):
            break
        name, eq, value = a.partition("=")
        if eq or name in DEEPSPEED_FLAGS:
            options[name] = value if eq else True
        else:
            options[name] = launcher_args[i + 1] if i + 1 < len(launcher_args) else ""
            i += 1
        i += 1
    return options


def _hosts_in(path: str) -> int:
    """The hosts a deepspeed hostfile lists (``host slots=N`` lines); 0 when
    it cannot be read."""
    try:
        with open(path) as f:
            lines = [ln.split("#", 1)[0].split() for ln in f]
    except OSError:
        return 0
    return len({ln[0] for ln in lines if ln})


def _deepspeed_over_ssh(launcher_args) -> bool:
    """Whether deepspeed starts its ranks, this machine's too, through its
    multi-node runners (pdsh, mpirun, ...), which forward only some
    variables: as its runner decides (``--force_multi``, or more than one
    host left of the hostfile, unless ``--no_ssh``)."""
    o = _deepspeed_options(launcher_args)
    if o.get("--no_ssh"):
        return False
    if o.get("--force_multi"):
        return True
    if o.get("--num_nodes") == "1":
        return False
    include = o.get("--include", o.get("-i"))
    if isinstance(include, str) and include:
        return len({h.split(":", 1)[0] for h in include.split("@") if h}) > 1
    hostfile = o.get("--hostfile", o.get("-H", DEEPSPEED_HOSTFILE))
    return isinstance(hostfile, str) and _hosts_in(hostfile) > 1


def _launcher_note(args):
    """What to know when the program is a launcher; None otherwise."""
    name = args.module[0] if args.module else os.path.basename(args.script or "")
    if name not in LAUNCHERS:
        return None
    note = (
        f"gpualloc: {name} starts the training processes itself: gpualloc is installed in those it starts on this "
        "machine, when they import torch (Note [Installing in child processes]); on other machines (ssh, pdsh), put "
        "`import gpualloc; gpualloc.install()` at the top of the training script. A trace path with {rank} or "
        "{pid} (--trace 'trace-{rank}.gtrace') gives each process its own file"
    )
    launcher_args = args.module[1:] if args.module else args.args
    if name == "deepspeed" and _deepspeed_over_ssh(launcher_args):
        note += (
            ". With more than one host, deepspeed starts every rank, this machine's too, through its multi-node runner "
            "(pdsh, mpirun, ...), which passes on only the variables it forwards (PYTHON*, NCCL*, ...) and those "
            "listed in .deepspeed_env: add GPUALLOC_RUN_CHILDREN=1 there (and GPUALLOC_CONF, GPUALLOC_TRACE if "
            "set), or call install() in the script, else no rank runs under gpualloc"
        )
    return note


def _run(args) -> int:
    from gpualloc._lib import lib

    note = _launcher_note(args)
    if note:
        print(note, file=sys.stderr)
    try:
        argv0, start = _target(args)
    except _NotFound as e:
        print(f"gpualloc: cannot run: {e}", file=sys.stderr)
        return 2
    if _start(args):
        return 1
    sys.argv = [argv0] + args.args
    # The trace is completed at exit, after the program's other threads
    # ended and its own exit handlers (registered later, run earlier) ran,
    # so that what they allocate is recorded too.
    atexit.register(_stop_trace, lib())
    code = 0
    try:
        start()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    return code


def _stop_trace(L) -> None:
    # A launcher that never used CUDA wrote nothing, and says nothing.
    s = L.stop_started_trace()
    if s is not None:
        print(f"gpualloc: trace written: {s['events']} events, {s['bytes']} bytes, {s['dropped']} dropped", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpualloc", description="gpualloc: a CUDA caching allocator for PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a Python script, module or console script with gpualloc as PyTorch's allocator")
    r.add_argument("--config", default=None, help="gpualloc configuration (default: GPUALLOC_CONF)")
    r.add_argument("--trace", default=None, help="record an allocation trace to this file ({pid}, {rank}, {local_rank}, {restart} are filled in)")
    r.add_argument("--no-bridge", action="store_true", help="use the plain CUDAPluggableAllocator fallback")
    r.add_argument("--no-auto-marks", action="store_true", help="no automatic step marks and phases (as GPUALLOC_AUTO_MARKS=0)")
    r.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE", help="run a module with its arguments, as python -m does")
    r.add_argument("script", nargs="?", help="a script path, a folder or zip archive with a __main__.py, an installed console script (e.g. yolo), or - for a program read from standard input")
    r.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("info", help="print the library path, version and backend")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.cmd == "info":
        return _info()
    if args.module is not None:
        args.module = _module_args(raw, args.module)
    elif args.script is not None:
        args.args = _script_args(raw, args.script, args.args)
    if args.trace is not None and not args.trace.strip():
        # As a blank GPUALLOC_TRACE, it would record nothing: a mistake
        # (an unset shell variable), not a choice.
        p.error("--trace: the path is empty")
    if args.trace:
        # Where run was started, not wherever each process is when it
        # starts recording (a program that changes folder, a child started
        # in another).
        from gpualloc._lib import trace_path_problem

        args.trace = os.path.abspath(args.trace)
        problem = trace_path_problem(args.trace)
        if problem is not None:
            p.error(f"--trace {args.trace}: {problem}")
    return _run(args)


def _module_args(raw, parsed):
    """``-m``'s module and its arguments verbatim: argparse ends the ``-m``
    list at a ``--`` and hands the rest to ``script``, which the module must
    see as ``python -m`` passes it on."""
    if not parsed:
        return parsed
    for i in range(len(raw) - 1):
        if raw[i] == "-m" and raw[i + 1] == parsed[0]:
            return raw[i + 1 :]
    return parsed


def _script_args(raw, script, parsed):
    """The script's arguments verbatim: argparse drops a ``--`` right after
    the script, which the script must see (``python train.py -- --x``
    passes it on)."""
    k = len(raw) - len(parsed)
    if k >= 2 and raw[k - 1] == "--" and raw[k - 2] == script:
        return ["--"] + parsed
    return parsed


def _info() -> int:
    """Library, version and backend; a clear line (exit 1), not a traceback,
    when one of them is missing."""
    import gpualloc
    from gpualloc._lib import lib

    try:
        print(f"library: {gpualloc.library_path()}")
        print(f"version: {gpualloc.version()}")
        print(f"backend: {lib().backend()}")
    except gpualloc.GpuallocError as e:
        from gpualloc._lib import ERR_CONFIG

        print(f"gpualloc: {_unprefixed(e)}", file=sys.stderr)
        if e.code == ERR_CONFIG:
            print("backend: not started (the configuration is invalid)")
        elif not isinstance(e, gpualloc.LibraryNotFound):
            print("backend: unavailable")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
