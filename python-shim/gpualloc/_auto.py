"""Steps and phases without code changes: hooks ``install()`` puts into torch.

- Every optimizer step ends with the mark ``step`` (torch's global
  optimizer-step hooks), the iteration boundary that ``gpualloc leaks`` and
  the per-step figures read. With several optimizers (a GAN), only one of
  them marks: the first to step, or, once it stops stepping, the next that
  steps twice in a row without it (at once when it was freed: a
  learning-rate finder's optimizer, a finished trial's). The step itself is
  the phase ``optimizer``; a step inside another step (a subclass calling
  ``super().step()``, an optimizer that steps another) is the outer one's.
- ``torch.autograd.backward`` (which ``Tensor.backward`` calls) runs in the
  phase ``backward``; ``torch.save`` in the phase ``checkpoint`` (not when a
  tensor's storage pickles itself through it). An ``optimizer`` phase a
  raising step left open closes at the next backward.
- Under ``torch.compile`` the hooks add no graph break; an optimizer step
  compiled into a graph has no mark and no phase (Note [Hooks under
  torch.compile]).
- ``eval`` opens when a module in training mode is switched to evaluation
  (``model.eval()``, ``model.train(False)``) and closes at the next
  ``model.train()``, or at the next backward pass or optimizer step once
  that module trains again however its flag was set (Lightning restores
  modes by assigning ``module.training``). Not when the module is a part
  of the model last switched to training and something beside it still
  trains (``model.train(); model.bn.eval()`` freezes a part); a wrapper
  whose whole content is switched (``DDP(model).train()``, then
  ``model.eval()``) is an evaluation; so is not a module that an optimizer
  steps beside without updating it (an EMA or teacher copy made with
  ``copy.deepcopy(model).eval()``): its phase closes at that step. An
  outermost ``torch.inference_mode`` region is an ``eval`` phase too when
  none is open. ``torch.no_grad`` is not: optimizers, gradient clipping and
  EMA updates use it inside training steps.
- Phases come from one thread: the first to open one (the training loop),
  until it ends. The library keeps one stack of phases; the regions of a
  server's request threads or a checkpoint thread would interleave with it
  and never unwind. Step marks come from any thread.

Each hook is guarded: a failure inside one is reported once as a warning and
never reaches the training code (not even with warnings turned into
errors). ``GPUALLOC_AUTO_MARKS=0`` or ``install(auto_marks=False)`` turns
all of them off. Outside a trace, the hooks cost one call into the library
each, which returns at once.
"""

from __future__ import annotations

import functools
import importlib
import io
import sys
import threading
import warnings
import weakref
from typing import Callable, List, Optional

from . import _phases
from ._lib import ForkSafeLock, lib

ENV = "GPUALLOC_AUTO_MARKS"
STEP_MARK = "step"

_LOCK = ForkSafeLock(threading.RLock)

_TL = threading.local()
_UNDO: List[Callable[[], None]] = []  # restores torch, newest last
_ENABLED: List[str] = []  # names of the hooks in place
_WARNED: set = set()  # the hooks whose failure was reported
_IS_COMPILING: Optional[Callable[[], bool]] = None  # torch.compiler.is_compiling, once enabled


def wanted(auto_marks: Optional[bool]) -> bool:
    """``auto_marks`` when given, else ``GPUALLOC_AUTO_MARKS`` (default on)."""
    if auto_marks is not None:
        return bool(auto_marks)
    from ._torch import _env_switch

    return _env_switch(ENV, True, stacklevel=4)  # an unknown value warns, as GPUALLOC_BRIDGE's


def enabled() -> List[str]:
    """The hooks in place: ``optimizer``, ``backward``, ``checkpoint``, ``eval``, ``inference``, ``compile``."""
    return list(_ENABLED)


def enable(torch) -> List[str]:
    """Puts the hooks into ``torch`` (once); returns those in place. A hook
    whose torch entry point is missing is left out."""
    global _IS_COMPILING
    with _LOCK:
        if _ENABLED:
            return list(_ENABLED)
        _IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)
        for name, fn in (
            ("optimizer", _hook_optimizer),
            ("backward", _hook_backward),
            ("checkpoint", _hook_save),
            ("eval", _hook_train_switch),
            ("inference", _hook_inference_mode),
            ("compile", _hook_compile),
        ):
            try:
                if fn(torch):
                    _ENABLED.append(name)
            except Exception as e:  # noqa: BLE001 - a torch without this entry point
                _warn(f"cannot hook {name} ({type(e).__name__}: {e})")
        return list(_ENABLED)


def disable() -> None:
    """Takes every hook out of torch and closes the automatic phases."""
    with _LOCK:
        while _UNDO:
            _guard(_UNDO.pop())
        _ENABLED.clear()
        _State.reset()


def _warn(what: str, key: str = "") -> None:
    """One warning for each hook (``key``) that fails, however often."""
    if key not in _WARNED:
        _WARNED.add(key)
        try:
            warnings.warn(f"gpualloc: automatic marks: {what}; the program goes on", RuntimeWarning, stacklevel=3)
        except Exception:  # noqa: BLE001 - warnings turned into errors (-W error) must not reach the program
            pass


def _guard(fn, *args):
    """Runs a hook's body; a failure becomes a warning (one for each hook),
    never an exception."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the user's program must not break
        name = getattr(fn, "__name__", "a hook")
        _warn(f"{name} failed ({type(e).__name__}: {e})", name)
        return None


def _compiling() -> bool:
    """Whether torch.compile is tracing the caller: the hooks then step
    aside, so that they add no graph break (their locks and library calls
    cannot be traced) and ``fullgraph=True`` still compiles."""
    f = _IS_COMPILING
    try:
        return bool(f is not None and f())
    except Exception:  # noqa: BLE001 - a torch whose check fails: not compiling
        return False


def _patch(owner, attr: str, make: Callable, also=()) -> bool:
    """Replaces ``owner.attr`` with ``make(original)``, once, and the same
    attribute of each of ``also`` with the same wrapper (so that names of one
    function stay one object: pickle finds ``torch.save`` by its qualified
    name, ``torch.serialization.save``); undone by disable()."""
    orig = getattr(owner, attr)
    if getattr(orig, "_gpualloc_auto", False):
        # Ours, or another library's wrapper of ours that copied its
        # attributes (functools.wraps): one left in place by disable() lives again.
        live = getattr(orig, "_gpualloc_live", None)
        if live is not None and not live[0]:
            live[0] = True
            _UNDO.append(functools.partial(live.__setitem__, 0, False))
        return True
    inner = make(orig)
    live = [True]

    @functools.wraps(orig)
    def new(*args, **kwargs):
        if live[0]:
            return inner(*args, **kwargs)
        return orig(*args, **kwargs)

    new._gpualloc_auto = True
    new._gpualloc_live = live
    for o in (owner, *also):
        setattr(o, attr, new)
        _UNDO.append(functools.partial(_unpatch, o, attr, orig, new, live))
    return True


def _unpatch(owner, attr: str, orig, new, live: list) -> None:
    """Puts ``orig`` back where ``new`` still stands. Where another library
    patched over it since (its wrapper calls ``new``), the attribute stays
    theirs, and ``new`` only calls ``orig`` from now on: putting ``orig``
    back would take their patch out too."""
    live[0] = False
    if getattr(owner, attr, None) is new:
        setattr(owner, attr, orig)


class _State:
    """Which automatic phases are open, and the optimizer that marks steps."""

    optimizer: Optional[_phases.Entry] = None
    eval_switch: Optional[_phases.Entry] = None
    eval_module: Optional[object] = None  # the module whose switch opened eval_switch, as _weak keeps it
    training: Optional["weakref.ref"] = None  # the module last switched to training
    inside: Optional[dict] = None  # the modules inside it and their parents by id (weakly), found when first asked
    leader: Optional[object] = None  # the optimizer that marks steps, as _weak keeps it
    eval_asked: Optional[tuple] = None  # (eval phase, {optimizer id: updates its module}): _updates_part_of
    others: set = set()

    @classmethod
    def reset(cls) -> None:
        for e in (cls.optimizer, cls.eval_switch):
            if e is not None:
                _guard(_phases.pop, e)
        cls.optimizer = cls.eval_switch = cls.eval_module = cls.leader = cls.training = cls.inside = None
        cls.eval_asked = None
        cls.others = set()


_OWNER: Optional[threading.Thread] = None


def _owns() -> bool:
    """Whether this thread may open automatic phases: the first thread that
    opens one owns them (the training loop), until it ends. The library has
    one stack of phases per device; regions of other threads (a server's
    `inference_mode` requests, a checkpoint thread) would interleave with
    the owner's and never unwind."""
    global _OWNER
    t = threading.current_thread()
    with _LOCK:
        if _OWNER is None or not _OWNER.is_alive():
            _OWNER = t
        return _OWNER is t


def _open(name: str, loose: bool = False) -> Optional[_phases.Entry]:
    # Not before the allocator starts: a phase would start it, and with it
    # the CUDA driver, before the program's first CUDA call (Note [Starting
    # on first use] in capi/src/pending.rs); there is no memory to name yet.
    if not _guard(_started) or not _owns():
        return None
    return _guard(_phases.push, name, loose)


def _started() -> bool:
    return _phases.started()


def _close(e: Optional[_phases.Entry]) -> None:
    if e is not None:
        _guard(_phases.pop, e)


# -- optimizer steps ---------------------------------------------------------


def _optimizer_module(torch):
    """``torch.optim.optimizer``, imported: ``import torch`` does not always
    make it an attribute of ``torch.optim`` (torch 2.11 does not)."""
    try:
        return importlib.import_module("torch.optim.optimizer")
    except ImportError:
        return torch.optim.optimizer


def _hook_optimizer(torch) -> bool:
    opt = _optimizer_module(torch)
    pre = opt.register_optimizer_step_pre_hook(_step_pre_hook)
    post = opt.register_optimizer_step_post_hook(_step_post_hook)
    _UNDO.append(pre.remove)
    _UNDO.append(post.remove)
    return True


def _step_pre_hook(optimizer, args, kwargs):
    """Opens the phase ``optimizer``. A step given a closure (Lightning's
    automatic optimization, LBFGS) runs the forward and backward passes
    inside ``step``: the closure is wrapped so that the phase is closed
    while it runs (returned as the step's new arguments, which torch's
    pre-hooks may do)."""
    if _compiling() or _nested_step(sys._getframe(1)):
        return None
    # torch passes the step's own arguments, the optimizer first.
    at = 1 if args and args[0] is optimizer else 0
    if "closure" in kwargs and callable(kwargs["closure"]):
        new = args, {**kwargs, "closure": _outside_the_step(kwargs["closure"], optimizer)}
    elif len(args) > at and callable(args[at]):
        new = tuple(args[:at]) + (_outside_the_step(args[at], optimizer),) + tuple(args[at + 1 :]), kwargs
    else:
        _guard(_step_begins, optimizer)
        return None
    _guard(_step_pauses)  # a step that raised may have left it open
    return new


def _step_post_hook(optimizer, args, kwargs):
    """Closes the phase ``optimizer`` and marks the step."""
    if _compiling() or _nested_step(sys._getframe(1)):
        return
    _guard(_step_ends, optimizer)


def _nested_step(caller) -> bool:
    """Whether the step whose hook ``caller`` (torch's step wrapper) runs
    is inside another step's wrapper, whose hooks alone count: torch wraps
    the ``step`` of each optimizer class it makes, so a subclass whose
    ``step`` calls ``super().step()`` runs the hooks twice, and so does an
    optimizer that steps another (ZeroRedundancyOptimizer). Found on the
    stack, so that a step that raised between its hooks leaves nothing
    behind."""
    code = caller.f_code
    f = caller.f_back
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _outside_the_step(closure, optimizer):
    @functools.wraps(closure)
    def run(*a, **k):
        _guard(_step_pauses)
        try:
            return closure(*a, **k)
        finally:
            _guard(_step_begins, optimizer)

    return run


def _another_owns() -> bool:
    """Whether another thread, still running, owns the automatic phases
    (``_owns``): its open phases are not this thread's to close."""
    o = _OWNER
    return o is not None and o is not threading.current_thread() and o.is_alive()


def _step_begins(optimizer) -> None:
    with _LOCK:
        if _another_owns():
            return
        _close(_State.optimizer)  # a step that raised left it open
        _eval_over_if_training(optimizer)
        _State.optimizer = _open("optimizer", loose=True)


def _step_pauses() -> None:
    with _LOCK:
        if _another_owns():
            return
        _close(_State.optimizer)
        _State.optimizer = None


def _step_ends(optimizer) -> None:
    with _LOCK:
        if not _another_owns():
            _close(_State.optimizer)
            _State.optimizer = None
        me = id(optimizer)
        # A leader that was freed (a learning-rate finder's optimizer, a
        # finished trial's) gives way at once.
        leader = _deref(_State.leader)
        if leader is not None and leader is not optimizer:
            if me not in _State.others:
                _State.others.add(me)
                return
        _State.leader = _weak(optimizer)  # the leader, or one that stepped twice without it
        _State.others = set()
    if _started():  # as in _open
        lib().mark(STEP_MARK)


# -- backward, torch.save ----------------------------------------------------


def _in_phase(name: str):
    """A wrapper factory: the original runs inside the phase ``name``."""

    def make(orig):
        def wrapper(*args, **kwargs):
            if _compiling():
                return orig(*args, **kwargs)
            e = _open(name)
            try:
                return orig(*args, **kwargs)
            finally:
                _close(e)

        return wrapper

    return make


def _training_resumed() -> None:
    """Before a backward pass on the owner's thread: an ``optimizer`` phase
    still open is one whose step raised (a closure's backward runs with it
    paused), and an ``eval`` phase whose module is back in training mode set
    without ``train()`` (Lightning's ``_ModuleMode.restore`` assigns
    ``module.training``) is over."""
    if _OWNER is not threading.current_thread():
        return
    with _LOCK:
        if _State.optimizer is not None:
            _close(_State.optimizer)
            _State.optimizer = None
        _eval_over_if_training()


def _eval_over_if_training(optimizer=None) -> None:
    """Closes an ``eval`` phase whose module trains again; at an optimizer
    step, also one whose module the stepping optimizer does not update."""
    e = _State.eval_switch
    if e is None or e.closed:
        return
    m = _deref(_State.eval_module)
    if (
        m is None
        or getattr(m, "training", False) is True
        or (optimizer is not None and not _updates_part_of(optimizer, m, e))
    ):
        _close(e)
        _State.eval_switch = _State.eval_module = None


def _updates_part_of(optimizer, module, entry) -> bool:
    """Whether ``optimizer`` updates a parameter of ``module``. An
    optimizer stepping while only another module is in evaluation trains:
    an EMA, teacher or reference copy made with ``copy.deepcopy(model).eval()``
    is no evaluation of the model. Asked once per optimizer while ``entry``
    (the eval phase) is open; one that cannot be asked counts as updating."""
    asked = _State.eval_asked
    if asked is None or asked[0] is not entry:
        asked = _State.eval_asked = (entry, {})
    key = id(optimizer)
    if key not in asked[1]:
        try:
            mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
            asked[1][key] = any(id(p) in mine for p in module.parameters())
        except Exception:  # noqa: BLE001 - not a torch optimizer or module after all
            asked[1][key] = True
    return asked[1][key]


def _hook_backward(torch) -> bool:
    inner = _in_phase("backward")

    def make(orig):
        wrapped = inner(orig)

        def backward(*args, **kwargs):
            if not _compiling():
                _guard(_training_resumed)
            return wrapped(*args, **kwargs)

        return backward

    if not _patch(torch.autograd, "backward", make):
        return False
    _guard(_script_as_backward, torch, torch.autograd.backward)
    return True


def _script_as_backward(torch, new) -> None:
    """TorchScript compiles a call of ``torch.autograd.backward`` as the
    operator ``aten::backward``, which it finds by the function object it
    listed when torch was imported: the wrapper is listed too, or
    ``torch.jit.script`` would try to compile the wrapper itself, and fail."""
    b = getattr(getattr(torch, "jit", None), "_builtins", None)
    if b is None or not hasattr(b, "_builtin_ops"):
        return
    entry = (new, "aten::backward")
    if getattr(b, "_builtin_table", None) is None:  # built on first use, from the list
        b._builtin_ops.append(entry)
    else:
        b._register_builtin(new, "aten::backward")
    _UNDO.append(functools.partial(_unlist, b, entry))


def _unlist(b, entry) -> None:
    """Takes the wrapper out of TorchScript's builtins again (its id may
    be another object's once it is freed)."""
    if entry in b._builtin_ops:
        b._builtin_ops.remove(entry)
    table = getattr(b, "_builtin_table", None)
    if table is not None and table.get(id(entry[0])) == entry[1]:
        del table[id(entry[0])]


def _hook_save(torch) -> bool:
    ser = getattr(torch, "serialization", None)
    same = ser is not None and getattr(ser, "save", None) is torch.save
    inner = _in_phase("checkpoint")

    def make(orig):
        wrapped = inner(orig)

        def save(obj, f, *args, **kwargs):
            # A storage pickling itself (``TypedStorage.__reduce__``, for
            # ``pickle.dumps``, multiprocessing queues, broadcast_object_list)
            # saves into a BytesIO in the legacy format: no checkpoint.
            if kwargs.get("_use_new_zipfile_serialization") is False and isinstance(f, io.BytesIO):
                return orig(obj, f, *args, **kwargs)
            return wrapped(obj, f, *args, **kwargs)

        return save

    return _patch(torch, "save", make, also=(ser,) if same else ())


# -- evaluation --------------------------------------------------------------


def _hook_train_switch(torch) -> bool:
    def make(orig):
        def train(self, mode=True):
            if _compiling() or getattr(_TL, "in_train", False):  # a child module: the outermost call decides
                return orig(self, mode)
            was = getattr(self, "training", None)
            _TL.in_train = True
            try:
                return orig(self, mode)
            finally:
                _TL.in_train = False
                _guard(_switched, self, was, mode)

        return train

    return _patch(torch.nn.Module, "train", make)


def _switched(module, was, mode) -> None:
    if not isinstance(mode, bool):
        return
    with _LOCK:
        e = _State.eval_switch
        if mode:
            try:
                _State.training = weakref.ref(module)
            except TypeError:  # a module without weak references
                _State.training = None
            _State.inside = None
            if e is not None:
                _close(e)
                _State.eval_switch = None
        elif was is True and (e is None or e.closed) and not _frozen_inside_training(module):
            _State.eval_switch = _open("eval", loose=True)
            _State.eval_module = _weak(module)


def _frozen_inside_training(module) -> bool:
    """Whether ``module`` lies inside (and is not) the module last switched
    to training mode, which is still training: a part frozen for training
    (``model.train(); model.backbone.bn.eval()``), not an evaluation."""
    ref = _State.training
    top = ref() if ref is not None else None
    if top is None or top is module or getattr(top, "training", False) is not True:
        return False
    # The modules inside are found once per switch to training, not at each
    # call: models that freeze their BatchNorms after every model.train()
    # call eval() on each of them, and a walk each time made that quadratic.
    # Found again when the module is not among them (one added since).
    # A module found there by its id is checked to be that module: an id is
    # reused once a module removed from the model is freed.
    entry = _State.inside.get(id(module)) if _State.inside is not None else None
    if entry is None or not _is(entry[0], module):
        _State.inside = _inside(top)
        entry = _State.inside.get(id(module))
    if entry is None or not _is(entry[0], module):
        return False
    # A part is frozen while something beside it still trains; a wrapper
    # (DDP, a compiled module) whose only content is switched to eval is
    # an evaluation, though the wrapper's own flag stays True.
    child = module
    while child is not top:
        entry = _State.inside.get(id(child))
        parent = _deref(entry[1]) if entry is not None else None
        if parent is None:
            return True
        if any(c is not child and getattr(c, "training", False) is True for c in _children(parent)):
            return True
        child = parent
    return False


def _is(ref, module) -> bool:
    return ref is not None and _deref(ref) is module


def _weak(obj):
    """A weak reference to ``obj``, or ``obj`` itself when it takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return obj


def _deref(ref):
    return ref() if isinstance(ref, weakref.ref) else ref


def _inside(top) -> dict:
    """The modules inside ``top``, by id: (the module, its parent), each as
    ``_weak`` keeps it."""
    found = {}
    todo = [(c, top) for c in _children(top)]
    while todo:
        m, parent = todo.pop()
        if id(m) not in found:
            found[id(m)] = (_weak(m), _weak(parent))
            todo.extend((c, m) for c in _children(m))
    return found


def _children(m):
    try:
        return list(m.children())
    except Exception:  # noqa: BLE001 - not a torch module after all
        return []


# -- torch.compile -------------------------------------------------------------

# Note [Hooks under torch.compile]
# Rationale: while torch.compile traces a function, the hooks step aside
# (``_compiling``), so that they add no graph break and ``fullgraph=True``
# still compiles; what they would do is folded away with them. A graph
# break (``loss.backward()`` inside a compiled training step) runs the
# unsupported call eagerly, but torch.compile still compiles each new
# Python frame that call enters, this package's wrappers included, with
# ``_compiling()`` fixed to true in the result: such a training step lost
# every phase and mark.
# Approach: once dynamo is imported (by ``torch.compile``,
# ``torch._dynamo.optimize`` or anything else, before ``install()`` or
# after: an import finder hears of it), every code object of this package
# is marked for dynamo to run as Python runs it when entered as a frame
# (``skip_code``, which leaves inlining into a traced function as it was).
# Nothing is imported for it: dynamo's import takes most of a second.
# Not covered: an optimizer step traced into a graph (the step after the
# break, or ``torch.compile(opt.step)``) has no mark and no phase. The
# hooks are inlined there, where they cannot call the library. Tried and
# dropped: a traced append to a list, which dynamo replays after the graph,
# made dynamo guard on the list's length, so a loop where nothing emptied
# it in between recompiled at every step until it ran the step uncompiled;
# and ``reorderable_logging_functions`` (a call made after the graph) fails
# in torch 2.5 when the call comes from an inlined function.

_DYNAMO = "torch._dynamo"
_DYNAMO_READY = False


def _hook_compile(torch) -> bool:
    if not callable(getattr(torch, "compile", None)):
        return False
    if _DYNAMO in sys.modules:
        _guard(_ready_for_dynamo)
    elif not any(getattr(f, "_gpualloc_dynamo_import", False) for f in sys.meta_path):
        finder = _DynamoImport()
        sys.meta_path.insert(0, finder)
        _UNDO.append(finder.leave)
    return True


def _ready_for_dynamo() -> None:
    """Note [Hooks under torch.compile], once dynamo is imported. The
    finder stays where it is, finding nothing from then on: another
    thread may be walking ``sys.meta_path`` (``disable()`` takes it out)."""
    global _DYNAMO_READY
    if _DYNAMO_READY or _DYNAMO not in sys.modules:
        return
    _DYNAMO_READY = True
    skip = getattr(importlib.import_module(_DYNAMO + ".eval_frame"), "skip_code", None)
    if skip is not None:
        for code in _own_code():
            skip(code)


class _DynamoImport:
    """An import finder that finds nothing itself: it hands dynamo's import
    to the finders after it, and has the package readied for dynamo once
    the import has run (Note [Hooks under torch.compile]). Asked again
    while it asks the others (another finder that asks the rest of
    ``sys.meta_path``), it finds nothing."""

    _gpualloc_dynamo_import = True  # known by this, whichever copy of the module made it
    _asking = threading.local()

    def find_spec(self, name, path=None, target=None):
        if name != _DYNAMO or _DYNAMO_READY or getattr(self._asking, "on", False):
            return None
        self._asking.on = True
        try:
            for finder in list(sys.meta_path):
                if getattr(finder, "_gpualloc_dynamo_import", False):
                    continue
                find = getattr(finder, "find_spec", None)
                spec = find(name, path, target) if find is not None else None
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._asking.on = False
        if getattr(spec.loader, "exec_module", None) is not None:
            spec.loader = _ReadyAfter(spec.loader)
        return spec

    def leave(self) -> None:
        # A new list: an import walking the old one in another thread
        # still sees every finder it had.
        sys.meta_path = [f for f in sys.meta_path if f is not self]


class _ReadyAfter:
    """A module loader that runs ``loader``, puts it back in the module's
    place, then readies the package for dynamo; anything else it asks of
    ``loader``."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        if name == "_loader" or name.startswith("__"):  # copy, pickle: not set up yet
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            spec = getattr(module, "__spec__", None)
            if spec is not None and spec.loader is self:
                spec.loader = self._loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
        _guard(_ready_for_dynamo)


def _own_code():
    """Every code object of this package's modules, nested ones included."""
    seen = set()
    todo = []
    for name, mod in list(sys.modules.items()):
        if name != __package__ and not name.startswith(__package__ + "."):
            continue
        for v in list(vars(mod).values()):
            members = list(vars(v).values()) if isinstance(v, type) else [v]
            for m in members:
                f = getattr(m, "__func__", m)  # classmethod, staticmethod
                code = getattr(f, "__code__", None)
                if code is not None and getattr(f, "__module__", None) == name:
                    todo.append(code)
    while todo:
        code = todo.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        yield code
        todo.extend(c for c in code.co_consts if hasattr(c, "co_consts"))


def _hook_inference_mode(torch) -> bool:
    cls = torch.inference_mode
    if not isinstance(cls, type):
        return False

    def make_enter(orig):
        def __enter__(self):
            r = orig(self)
            if not _compiling():
                _guard(_inference_enters, self)
            return r

        return __enter__

    def make_exit(orig):
        def __exit__(self, *exc):
            try:
                return orig(self, *exc)
            finally:
                if not _compiling():
                    _guard(_inference_exits, self)

        return __exit__

    _patch(cls, "__enter__", make_enter)
    _patch(cls, "__exit__", make_exit)
    return True


def _inference_enters(ctx) -> None:
    depth = getattr(_TL, "inference_depth", 0)
    _TL.inference_depth = depth + 1
    if depth == 0 and getattr(ctx, "mode", True) is not False:
        e = _State.eval_switch
        _TL.inference_entry = _open("eval") if (e is None or e.closed) else None


def _inference_exits(ctx) -> None:
    depth = getattr(_TL, "inference_depth", 0)
    _TL.inference_depth = max(0, depth - 1)
    if depth == 1:
        _close(getattr(_TL, "inference_entry", None))
        _TL.inference_entry = None
