"""Installs gpualloc in the Python processes a program under
``python -m gpualloc run`` starts (Note [Installing in child processes] in
``gpualloc/_children.py``). ``run`` puts this directory first on the
children's ``PYTHONPATH``; Python imports this module when it starts.

With ``GPUALLOC_RUN_CHILDREN=1``, gpualloc is installed right after the
process imports torch (a process that never imports torch is left alone).
Without the variable, which a launcher between ``run`` and this process
dropped while keeping ``PYTHONPATH``, a process that imports torch is told
on stderr that gpualloc is not installed there; another value does
nothing. Another ``sitecustomize`` further on the path
(a virtual environment's, a cluster's) still runs, after this one.
"""

import os
import sys


def _chain():
    """Runs the next ``sitecustomize`` on sys.path, which this one shadows."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_DONE = []


def _install():
    """gpualloc.install(), once, configured by what run passed on."""
    if _DONE:
        return
    _DONE.append(True)
    try:
        # The package beside this file, found without leaving its directory
        # on sys.path (it may be another interpreter's site-packages).
        package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        added = package_parent not in sys.path
        if added:
            sys.path.append(package_parent)
        try:
            import gpualloc
            from gpualloc import _torch
        finally:
            if added:
                sys.path.remove(package_parent)

        _torch.BY_RUN = True  # the program's own install(config=...) warns, as under run
        _torch.IN_RUN_CHILD = True  # run said what PYTORCH_CUDA_ALLOC_CONF & co. do, once (GPUALLOC_RUN_SAID)
        gpualloc.install()
    except Exception as e:  # noqa: BLE001 - never stop the child's own program
        print(f"gpualloc: not installed in process {os.getpid()} ({type(e).__name__}: {e})", file=sys.stderr)


class _TorchFinder:
    """Finds ``torch`` as the rest of sys.meta_path would, and calls ``act``
    (installs gpualloc) once the module has run (before the program can use
    CUDA). It stays in place until then: a probe
    (``importlib.util.find_spec("torch")``, as transformers and datasets do
    when imported) finds a spec that is never run."""

    def __init__(self, act):
        self.act = act

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or _DONE:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        finder = self

        def exec_module(module):
            run(module)
            try:
                sys.meta_path.remove(finder)
            except ValueError:
                pass
            finder.act()

        spec.loader.exec_module = exec_module
        return spec


def _say_dropped():
    """Said once a process that lost ``GPUALLOC_RUN_CHILDREN`` on its way
    here (a launcher that passes on only some variables, as deepspeed's
    multi-node runners do, while ``PYTHONPATH`` still leads here) imports
    torch: without it gpualloc is not installed, and the run would
    otherwise look like one under gpualloc."""
    if _DONE:
        return
    _DONE.append(True)
    print(
        f"gpualloc: not installed in process {os.getpid()}, which imports torch: its environment has this "
        "directory on PYTHONPATH but lacks GPUALLOC_RUN_CHILDREN=1, which `python -m gpualloc run` set for the "
        "processes it starts; the launcher between them dropped it (deepspeed's multi-node runners pass on only "
        "what .deepspeed_env lists): pass it on, or call gpualloc.install() in the script",
        file=sys.stderr,
    )


def _start():
    value = os.environ.get("GPUALLOC_RUN_CHILDREN")
    if value is None:
        act = _say_dropped
    elif value == "1":
        act = _install
    else:
        return
    if "torch" in sys.modules:
        act()
    else:
        sys.meta_path.insert(0, _TorchFinder(act))


_start()
try:
    _chain()
except Exception as e:  # noqa: BLE001 - as Python itself reports a failing sitecustomize
    print(f"gpualloc: the sitecustomize after gpualloc's failed: {type(e).__name__}: {e}", file=sys.stderr)
