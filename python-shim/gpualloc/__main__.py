"""``python -m gpualloc run [--config C] [--trace PATH] [--no-bridge] script.py args...``

Installs gpualloc into PyTorch, then runs the script as ``__main__`` with its
own arguments, so training code needs no change. Without PyTorch (a program
that uses gpualloc through its C ABI or ctypes) the library is started with
the configuration and trace, and a warning says torch was not found.

``python -m gpualloc info`` prints the library, its version and backend.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def _run(args) -> int:
    import gpualloc
    from gpualloc._lib import lib

    try:
        import torch  # noqa: F401
    except ImportError:
        torch = None
    try:
        if torch is not None:
            gpualloc.install(config=args.config, trace=args.trace, bridge=not args.no_bridge)
        else:
            print("gpualloc: PyTorch not found: the allocator is loaded but not installed into torch", file=sys.stderr)
            lib().init(args.config)
            lib().backend()  # starts the backend: a missing driver is reported now
            if args.trace:
                lib().trace_start(args.trace)
    except (gpualloc.GpuallocError, ValueError) as e:
        print(f"gpualloc: cannot start: {e}", file=sys.stderr)
        return 1
    sys.argv = [args.script] + args.args
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    code = 0
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    finally:
        if lib().is_tracing():
            s = lib().trace_stop()
            print(f"gpualloc: trace written: {s['events']} events, {s['bytes']} bytes, {s['dropped']} dropped", file=sys.stderr)
    return code


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpualloc", description="gpualloc: a CUDA caching allocator for PyTorch")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a Python script with gpualloc as PyTorch's allocator")
    r.add_argument("--config", default=None, help="gpualloc configuration (default: GPUALLOC_CONF)")
    r.add_argument("--trace", default=None, help="record an allocation trace to this file")
    r.add_argument("--no-bridge", action="store_true", help="use the plain CUDAPluggableAllocator fallback")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("info", help="print the library path, version and backend")
    args = p.parse_args(argv)
    if args.cmd == "info":
        return _info()
    return _run(args)


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
        print(f"gpualloc: {e}", file=sys.stderr)
        if not isinstance(e, gpualloc.LibraryNotFound):
            print("backend: unavailable")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
