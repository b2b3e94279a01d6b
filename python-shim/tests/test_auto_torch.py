"""Automatic marks and phases under a real torch (CPU is enough).

The fake torch of the other tests cannot show what torch.compile, TorchScript
or torch's per-class optimizer wrapping do to the hooks. These tests run a
real torch when `GPUALLOC_TEST_TORCH_PYTHON` names a Python that has one (for
example a virtual environment with `pip install torch`), and are skipped
otherwise: gpualloc is installed without its bridge on the simulated device,
the allocator started by one allocation, and the trace's annotations read
back. Each program is written to a file (TorchScript reads source files).
"""

import json
import os
import subprocess
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.dirname(HERE)
PY = os.environ.get("GPUALLOC_TEST_TORCH_PYTHON", "")

PRELUDE = """
import json, sys
import torch, gpualloc
from gpualloc._lib import lib
from gpualloc.tracefile import annotations
assert not getattr(torch, "FAKE", False)
TRACE = sys.argv[1]
gpualloc.install(trace=TRACE, bridge=False)
BLOCK = lib().malloc(1 << 20, 0, 0)  # starts the allocator: phases and marks are recorded from here

def done():
    lib().free(BLOCK, 0)
    gpualloc.trace_stop()
    seq = [(a["kind"], a["name"]) for a in annotations(TRACE) if a["device"] == 0]
    print("ANNOTATIONS " + json.dumps(seq))
"""

STEP = ("mark", "step")


def push(name):
    return ("phase_push", name)


def pop(name):
    return ("phase_pop", name)


def open_at(seq, i):
    """The phases open just before annotation ``i``."""
    stack = []
    for kind, name in seq[:i]:
        if kind == "phase_push":
            stack.append(name)
        elif kind == "phase_pop" and name in stack:
            del stack[len(stack) - 1 - stack[::-1].index(name)]
    return stack


@unittest.skipUnless(PY, "GPUALLOC_TEST_TORCH_PYTHON names no Python with torch")
class AutoMarksUnderTorch(unittest.TestCase):
    def traced(self, body, before=""):
        env = dict(os.environ, GPUALLOC_BACKEND="sim", GPUALLOC_SIM_CAPACITY="2GiB", PYTHONPATH=SHIM)
        for k in ("GPUALLOC_AUTO_MARKS", "GPUALLOC_TRACE", "GPUALLOC_CONF"):
            env.pop(k, None)
        with tempfile.TemporaryDirectory() as d:
            prog = os.path.join(d, "prog.py")
            with open(prog, "w") as f:
                f.write(before + "\n" + PRELUDE + textwrap.dedent(body) + "\ndone()\n")
            out = subprocess.run(
                [PY, prog, os.path.join(d, "t.gtrace")], capture_output=True, text=True, env=env, timeout=300
            )
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertNotIn("automatic marks", out.stderr)
        for line in out.stdout.splitlines():
            if line.startswith("ANNOTATIONS "):
                return [tuple(x) for x in json.loads(line[len("ANNOTATIONS ") :])]
        raise AssertionError(out.stderr[-3000:])

    def test_a_compiled_training_step_records_its_backward_passes(self):
        # The backward pass breaks the graph; torch.compile compiled the
        # wrappers' frames with the hooks folded away (no phase at all).
        seq = self.traced("""
            m = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            @torch.compile(backend="eager")
            def train_step(x):
                loss = m(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
            for i in range(3):
                train_step(torch.randn(2, 4))
        """)
        # The step after the break is traced into a graph: no mark, no phase
        # (Note [Hooks under torch.compile]).
        self.assertEqual(seq, [push("backward"), pop("backward")] * 3)

    def test_every_way_into_dynamo_keeps_the_backward_passes(self):
        # Only torch.compile called after install() used to ready the
        # package for dynamo: a compile imported before install(), or
        # torch._dynamo.optimize, lost every phase of a broken graph.
        # Asking whether dynamo is there (find_spec) imports nothing.
        for how in ("opt = torch._dynamo.optimize('eager')", "opt = lambda f: compile_(f, backend='eager')"):
            with self.subTest(how=how):
                seq = self.traced(
                    """
            import importlib.util
            assert importlib.util.find_spec("torch._dynamo") is not None
            assert "torch._dynamo" not in sys.modules
            HOW
            m = torch.nn.Linear(4, 4)
            def train_step(x):
                loss = m(x).sum(); loss.backward()
            train_step = opt(train_step)
            for i in range(3):
                train_step(torch.randn(2, 4))
        """.replace("HOW", how),
                    before="from torch import compile as compile_",
                )
                self.assertEqual(seq, [push("backward"), pop("backward")] * 3)

    def test_a_compiled_optimizer_step_compiles_once_and_trains(self):
        # PyTorch's recipe for compiling the optimizer: the step hooks are
        # traced into the graph, where they step aside (no mark), and add
        # no guard that recompiles the step.
        seq = self.traced("""
            m = torch.nn.Linear(4, 4)
            opt = torch.optim.Adam(m.parameters(), lr=0.1)
            @torch.compile(backend="eager")
            def step():
                opt.step()
            w = m.weight.detach().clone()
            import torch._dynamo.utils as u
            def grad_step():
                # autograd.grad: no hook of the package runs between steps
                loss = m(torch.randn(2, 4)).sum()
                for p, g in zip(m.parameters(), torch.autograd.grad(loss, list(m.parameters()))):
                    p.grad = g
                step(); opt.zero_grad()
            for i in range(3):
                grad_step()
            compiled = dict(u.counters["frames"])
            for i in range(9):
                grad_step()
            assert dict(u.counters["frames"]) == compiled, (compiled, dict(u.counters["frames"]))
            for i in range(3):
                m(torch.randn(2, 4)).sum().backward(); step(); opt.zero_grad()
            assert not torch.equal(w, m.weight)
        """)
        self.assertEqual(seq, [push("backward"), pop("backward")] * 3)

    def test_switching_modes_inside_a_fullgraph_compile_still_compiles(self):
        seq = self.traced("""
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
            @torch.compile(backend="eager", fullgraph=True)
            def f(x):
                m.eval()
                y = m(x)
                m.train()
                return y
            for i in range(2):
                f(torch.randn(8, 4))
            m.eval(); m(torch.randn(8, 4)); m.train()
        """)
        self.assertEqual(seq, [push("eval"), pop("eval")])

    def test_an_optimizer_subclass_calling_super_step_marks_once_per_step(self):
        # torch wraps the step of each class it makes an optimizer of: once an
        # SGD exists, MySGD.step -> super().step() runs the hooks twice.
        seq = self.traced("""
            class MySGD(torch.optim.SGD):
                def step(self, closure=None):
                    return super().step(closure)
            torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
            m = torch.nn.Linear(4, 4)
            opt = MySGD(m.parameters(), lr=0.1)
            for i in range(2):
                m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        """)
        one = [push("backward"), pop("backward"), push("optimizer"), pop("optimizer"), STEP]
        self.assertEqual(seq, one * 2)

    def test_a_new_optimizer_marks_its_first_step_once_the_last_is_freed(self):
        # A learning-rate finder, then the real run; sweeps of trials.
        seq = self.traced("""
            for trial in range(3):
                m = torch.nn.Linear(4, 4)
                opt = torch.optim.SGD(m.parameters(), lr=0.1)
                for i in range(2):
                    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
                del m, opt
        """)
        self.assertEqual(seq.count(STEP), 6, seq)

    def test_an_ema_copy_in_eval_mode_is_no_evaluation_of_the_training(self):
        # timm's and Ultralytics' EMA: deepcopy(model).eval(), in a loop that
        # never calls model.train().
        seq = self.traced("""
            import copy
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
            ema = copy.deepcopy(m).eval()
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for i in range(3):
                m(torch.randn(8, 4)).sum().backward(); opt.step(); opt.zero_grad()
        """)
        first_step = seq.index(push("optimizer"))
        self.assertNotIn("eval", open_at(seq, first_step + 1), seq)
        self.assertEqual(seq.count(push("eval")), 1, seq)

    def test_the_models_own_evaluation_stays_an_eval_phase(self):
        seq = self.traced("""
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m.eval()
            # frozen statistics, trained weights: the model's own optimizer steps
            m(torch.randn(8, 4)).sum().backward(); opt.step(); opt.zero_grad()
        """)
        self.assertIn("eval", open_at(seq, seq.index(STEP)), seq)

    def test_pickling_a_tensor_is_not_a_checkpoint(self):
        seq = self.traced("""
            import io, pickle
            pickle.dumps([torch.zeros(3) for _ in range(5)])
            torch.save({"w": torch.zeros(3)}, io.BytesIO())
        """)
        self.assertEqual(seq, [push("checkpoint"), pop("checkpoint")])

    def test_a_torchscript_function_calling_autograd_backward_compiles(self):
        seq = self.traced("""
            @torch.jit.script
            def f(x: torch.Tensor):
                torch.autograd.backward([x.sum()])
                return x
            x = torch.ones(3, requires_grad=True)
            f(x)
            assert x.grad is not None and x.grad.sum().item() == 3
        """)
        self.assertEqual(seq, [])

    def test_the_hooks_come_out_whole(self):
        seq = self.traced("""
            import torch.jit._builtins as b
            import gpualloc._auto as auto
            wrapped = torch.autograd.backward
            assert any(isinstance(f, auto._DynamoImport) for f in sys.meta_path)
            gpualloc.install(auto_marks=False)
            assert torch.autograd.backward is not wrapped
            assert b._find_builtin(wrapped) is None
            assert not any(isinstance(f, auto._DynamoImport) for f in sys.meta_path)
            @torch.jit.script
            def f(x: torch.Tensor):
                torch.autograd.backward([x.sum()])
                return x
        """)
        self.assertEqual(seq, [])


if __name__ == "__main__":
    unittest.main()
