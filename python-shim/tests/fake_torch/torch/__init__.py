"""A stand-in for torch with only what gpualloc.install() and its automatic
marks touch: CUDA availability, CUDAPluggableAllocator, the optimizer-step
hooks, autograd.backward, Tensor.backward, torch.save, nn.Module.train and
inference_mode. Tests put its directory first on sys.path (never installed).
"""

import functools
import pickle
import sys
import types
from collections import OrderedDict

__version__ = "0.0-fake"
FAKE = True
version = types.SimpleNamespace(cuda="0.0-fake")


# -- cuda ---------------------------------------------------------------------
class _Raw:
    def __getattr__(self, name):  # set_reset_fn, set_memory_fraction_fn, ...
        return lambda *a: None


class CUDAPluggableAllocator:
    def __init__(self, path, alloc_fn, free_fn):
        self.path, self.alloc_fn, self.free_fn = path, alloc_fn, free_fn

    def allocator(self):
        return _Raw()


cuda = types.ModuleType("torch.cuda")
cuda.is_initialized = lambda: False
cuda.is_available = lambda: True
cuda.memory = types.ModuleType("torch.cuda.memory")
cuda.memory.CUDAPluggableAllocator = CUDAPluggableAllocator
cuda.memory.installed = []  # what change_current_allocator was given
cuda.memory.change_current_allocator = cuda.memory.installed.append
cuda.change_current_allocator = cuda.memory.change_current_allocator  # torch.cuda's `from .memory import *`
cuda.memory.memory_stats = lambda device=None: {}
cuda.memory._snapshot = lambda device=None: {}  # replaced by gpualloc's fallback
cuda.device_count = lambda: 2
# The allocator torch would use: PyTorch's own unless a test says which.
cuda.get_allocator_backend = lambda: __import__("os").environ.get("FAKE_TORCH_ALLOCATOR_BACKEND", "native")

# -- _C: the allocator settings string's setter and getter (torch >= 2.10) ------
_C = types.ModuleType("torch._C")
_C.allocator_settings = [__import__("os").environ.get("FAKE_TORCH_ALLOCATOR_SETTINGS", "")]
_C._accelerator_setAllocatorSettings = lambda env: _C.allocator_settings.append(env)
_C._accelerator_getAllocatorSettings = lambda: _C.allocator_settings[-1]

# -- compiler -----------------------------------------------------------------
COMPILING = [False]  # tests set it to act as torch.compile tracing the caller
compiler = types.ModuleType("torch.compiler")
compiler.is_compiling = lambda: COMPILING[0]


def compile(model=None, **kwargs):  # noqa: A001 - torch's name; imports dynamo, as torch.compile does
    import torch._dynamo  # noqa: F401

    return model

# -- optim --------------------------------------------------------------------
_pre_hooks, _post_hooks = OrderedDict(), OrderedDict()


class _Handle:
    def __init__(self, table, key):
        self.table, self.key = table, key

    def remove(self):
        self.table.pop(self.key, None)


def _register(table, hook):
    key = object()
    table[key] = hook
    return _Handle(table, key)


def _profile_hook_step(func):
    # As torch's Optimizer.profile_hook_step: the hooks get the optimizer and
    # the step's arguments, the optimizer first among them; a pre-hook may
    # return new (args, kwargs).
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        self = args[0]
        for h in list(_pre_hooks.values()):
            r = h(self, args, kwargs)
            if r is not None:
                args, kwargs = r
        out = func(*args, **kwargs)
        for h in list(_post_hooks.values()):
            h(self, args, kwargs)
        return out

    return wrapper


class Optimizer:
    def __init__(self, params=()):
        self.params = list(params)
        self.param_groups = [{"params": self.params}]
        self.steps = 0
        # As torch's Optimizer.__init__ (_patch_step_function): the step of
        # each class an optimizer is made of is wrapped once, so a subclass
        # whose step calls super().step() runs the hooks twice.
        cls = type(self)
        if not getattr(cls.step, "hooked", False):
            cls.step = _profile_hook_step(cls.step)
            cls.step.hooked = True

    def step(self, closure=None):
        return Optimizer._step(self, closure)

    def _step(self, closure=None):  # tests replace it to make a step raise
        if closure is not None:
            closure()
        self.steps += 1


optim = types.ModuleType("torch.optim")
optim.optimizer = types.ModuleType("torch.optim.optimizer")
optim.optimizer.Optimizer = Optimizer
optim.optimizer.register_optimizer_step_pre_hook = lambda h: _register(_pre_hooks, h)
optim.optimizer.register_optimizer_step_post_hook = lambda h: _register(_post_hooks, h)
optim.SGD = Optimizer

# -- autograd, Tensor ---------------------------------------------------------
autograd = types.ModuleType("torch.autograd")
BACKWARD_CALLS = []


def _backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    BACKWARD_CALLS.append(tensors)


autograd.backward = _backward


class Tensor:
    def backward(self, gradient=None):
        # As torch/_tensor.py does: through the module attribute.
        sys.modules["torch"].autograd.backward(self, gradient)


class inference_mode:
    def __init__(self, mode=True):
        self.mode = mode

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


# -- nn -----------------------------------------------------------------------
class Module:
    def __init__(self, *children):
        self.training = True
        self._children = list(children)
        self._weight = object()  # its one parameter

    def children(self):
        return iter(self._children)

    def parameters(self):
        yield self._weight
        for m in self._children:
            yield from m.parameters()

    def train(self, mode=True):
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        for m in self.children():
            m.train(mode)
        return self

    def eval(self):
        return self.train(False)


nn = types.ModuleType("torch.nn")
nn.Module = Module


# -- save ---------------------------------------------------------------------
def save(obj, f, pickle_module=pickle, pickle_protocol=2, _use_new_zipfile_serialization=True):
    if hasattr(f, "write"):  # a storage pickling itself saves into a BytesIO, the legacy format
        pickle.dump(obj, f)
        return
    with open(f, "wb") as fh:
        pickle.dump(obj, fh)


class UntypedStorage:
    # As torch's: a storage pickles itself through torch.save.
    def __reduce__(self):
        import io

        b = io.BytesIO()
        save(b"its bytes", b, _use_new_zipfile_serialization=False)
        return (UntypedStorage, ())


serialization = types.ModuleType("torch.serialization")
serialization.save = save

for _name, _mod in (("cuda", cuda), ("cuda.memory", cuda.memory), ("optim", optim), ("optim.optimizer", optim.optimizer),
                    ("autograd", autograd), ("nn", nn), ("serialization", serialization)):
    sys.modules[f"torch.{_name}"] = _mod

# As in torch 2.11, `import torch` leaves `torch.optim.optimizer` reachable by
# import only, not as an attribute of `torch.optim`.
del optim.optimizer
