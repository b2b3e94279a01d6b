"""Automatic step marks and phases, and `python -m gpualloc run` targets.

torch is not installed here: tests/fake_torch/torch stands in for it with just
the entry points gpualloc hooks. Each test runs a fresh process (install() is
once per process) on the simulated backend and reads the trace back with
gpualloc.tracefile.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

from . import __name__ as _env  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.dirname(HERE)
FAKE_TORCH = os.path.join(HERE, "fake_torch")

# Runs in the child: installs, then prints the device-0 annotations as JSON.
PRELUDE = """
import json, sys
import torch, gpualloc
from gpualloc._lib import lib
from gpualloc.tracefile import annotations
assert getattr(torch, "FAKE", False), "the fake torch must come first on sys.path"
TRACE = sys.argv[1]
MODE = gpualloc.install(trace=TRACE, bridge=False)
BLOCK = lib().malloc(1 << 20, 0, 0)  # creates device 0, which then records phases and marks

def done():
    lib().free(BLOCK, 0)
    gpualloc.trace_stop()
    seq = [(a["kind"], a["name"]) for a in annotations(TRACE) if a["device"] == 0]
    print("ANNOTATIONS " + json.dumps(seq))
"""


def run(args, env_extra=None, cwd=None, torch=True, stdin=None):
    env = os.environ.copy()
    paths = ([FAKE_TORCH] if torch else []) + [SHIM, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.pop("GPUALLOC_AUTO_MARKS", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable] + args, capture_output=True, text=True, env=env, cwd=cwd, timeout=120, input=stdin
    )


def annotations_of(out):
    for line in out.stdout.splitlines():
        if line.startswith("ANNOTATIONS "):
            return [tuple(x) for x in json.loads(line[len("ANNOTATIONS ") :])]
    raise AssertionError(f"no annotations printed; stdout:\n{out.stdout}\nstderr:\n{out.stderr}")


def push(name):
    return ("phase_push", name)


def pop(name):
    return ("phase_pop", name)


STEP = ("mark", "step")


class AutoMarksTest(unittest.TestCase):
    def traced(self, body, env_extra=None):
        with tempfile.TemporaryDirectory() as d:
            out = run(["-c", PRELUDE + textwrap.dedent(body) + "\ndone()\n", os.path.join(d, "t.gtrace")], env_extra)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out, annotations_of(out)

    def test_steps_backward_eval_and_checkpoint(self):
        out, seq = self.traced(
            """
            model = torch.nn.Module(torch.nn.Module(), torch.nn.Module())
            opt = torch.optim.SGD()
            for _ in range(3):
                torch.Tensor().backward()
                opt.step()
            model.eval()
            with torch.inference_mode():  # inside eval: no second eval phase
                pass
            model.train()
            with torch.inference_mode():
                with torch.inference_mode():
                    pass
            torch.save({"w": 1}, TRACE + ".ckpt")
            torch.serialization.save({"w": 2}, TRACE + ".ckpt")
            print("hooks", gpualloc.auto_marks(), torch.BACKWARD_CALLS.__len__())
            """
        )
        step = [push("backward"), pop("backward"), push("optimizer"), pop("optimizer"), STEP]
        expected = step * 3 + [push("eval"), pop("eval"), push("eval"), pop("eval")] + [push("checkpoint"), pop("checkpoint")] * 2
        self.assertEqual(seq, expected)
        self.assertIn("hooks ['optimizer', 'backward', 'checkpoint', 'eval', 'inference', 'compile'] 3", out.stdout)

    def test_a_user_phase_closing_first_closes_the_eval_opened_inside_it(self):
        _, seq = self.traced(
            """
            model = torch.nn.Module(torch.nn.Module())
            with gpualloc.phase("epoch"):
                model.train()
                model.eval()
            with gpualloc.phase("next"):
                model.train()  # eval was closed with "epoch": nothing to close
            model.eval()
            model.eval()  # already in eval: no second phase
            model.train()
            """
        )
        self.assertEqual(
            seq, [push("epoch"), push("eval"), pop("eval"), pop("epoch"), push("next"), pop("next"), push("eval"), pop("eval")]
        )

    def test_one_mark_per_iteration_with_two_optimizers(self):
        _, seq = self.traced(
            """
            g, d = torch.optim.SGD(), torch.optim.SGD()
            for _ in range(3):
                d.step()
                g.step()
            c = torch.optim.SGD()  # d is replaced: c leads from its second step on
            for _ in range(3):
                c.step()
            """
        )
        self.assertEqual([x for x in seq if x[0] == "mark"], [STEP] * 5)

    def test_a_part_frozen_for_training_opens_no_eval_phase(self):
        _, seq = self.traced(
            """
            bn = torch.nn.Module()
            model = torch.nn.Module(torch.nn.Module(bn), torch.nn.Module())
            opt = torch.optim.SGD()
            model.train()
            bn.eval()  # frozen BatchNorm: training goes on
            torch.Tensor().backward()
            opt.step()
            model.eval()  # the model itself: an evaluation
            model.train()
            bn.eval()
            """
        )
        self.assertEqual(
            seq, [push("backward"), pop("backward"), push("optimizer"), pop("optimizer"), STEP, push("eval"), pop("eval")]
        )

    def test_freezing_every_part_after_each_switch_walks_the_model_once(self):
        # Models that call eval() on each BatchNorm after every
        # model.train(): the modules inside are found once per switch.
        out, seq = self.traced(
            """
            walks = [0]
            class Counted(torch.nn.Module):
                def children(self):
                    walks[0] += 1
                    return super().children()
            bns = [Counted() for _ in range(50)]
            model = Counted(*[Counted(b) for b in bns])
            for step in range(3):
                model.train()
                before = walks[0]
                for b in bns:
                    b.eval()
                print("walk", walks[0] - before)
            """
        )
        self.assertEqual(seq, [])
        # A step: one walk of the model (101 modules), eval()'s own visit of
        # each part (50), and for each part the children of its parent and
        # grandparent, looked at for one still training beside it (100); not
        # a walk for each of the 50 parts (5,100).
        self.assertEqual(out.stdout.count("walk 251"), 3, out.stdout)

    def test_a_module_taken_out_of_the_model_is_not_inside_it_any_more(self):
        # The modules inside are cached by id; a new module may get a freed
        # one's id, and must not pass for a frozen part.
        _, seq = self.traced(
            """
            import weakref
            import gpualloc._auto as auto
            part = torch.nn.Module()
            model = torch.nn.Module(part)
            model.train()
            part.eval()  # frozen inside: no phase
            model._children.remove(part)
            other = torch.nn.Module()
            # As if `other` had been given the id of a part freed since:
            auto._State.inside[id(other)] = (weakref.ref(part), weakref.ref(model))
            other.eval()  # a module of its own, switched to evaluation
            """
        )
        self.assertEqual(seq, [push("eval")])

    def test_other_threads_open_no_phases(self):
        _, seq = self.traced(
            """
            import threading
            model = torch.nn.Module()
            torch.Tensor().backward()  # the main thread opens the first phase: it owns them

            def serve():
                for _ in range(50):
                    with torch.inference_mode():
                        torch.save({}, TRACE + ".t.ckpt")

            ts = [threading.Thread(target=serve) for _ in range(2)]
            for t in ts:
                t.start()
            for _ in range(20):
                torch.Tensor().backward()
            for t in ts:
                t.join()
            import gpualloc._phases as ph
            print("open", len(ph._STACK))
            """
        )
        self.assertEqual(seq, [push("backward"), pop("backward")] * 21)

    def test_torch_save_stays_one_picklable_function(self):
        with tempfile.TemporaryDirectory() as d:
            body = textwrap.dedent(
                """
                import pickle, torch, gpualloc
                torch.save.__module__ = "torch.serialization"  # as in torch
                gpualloc.install(bridge=False)
                assert torch.save is torch.serialization.save
                assert pickle.loads(pickle.dumps(torch.save)) is torch.save
                gpualloc._auto.disable()
                assert not getattr(torch.save, "_gpualloc_auto", False)
                assert torch.save is torch.serialization.save
                print("ok")
                """
            )
            out = run(["-c", body], cwd=d)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("ok", out.stdout)

    def test_switched_off_by_the_environment(self):
        out, seq = self.traced(
            """
            opt = torch.optim.SGD()
            torch.Tensor().backward()
            opt.step()
            with gpualloc.phase("mine"):
                torch.save({}, TRACE + ".ckpt")
            print("hooks", gpualloc.auto_marks())
            """,
            {"GPUALLOC_AUTO_MARKS": "0"},
        )
        self.assertEqual(seq, [push("mine"), pop("mine")])
        self.assertIn("hooks []", out.stdout)

    def test_run_no_auto_marks_holds_for_the_scripts_own_install(self):
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "train.py")
            with open(script, "w") as f:
                f.write("import gpualloc, torch\ngpualloc.install()\nprint('hooks', gpualloc.auto_marks())\n")
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--no-auto-marks", script])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("hooks []", out.stdout)
            out = run(["-m", "gpualloc", "run", "--no-bridge", script])
            self.assertIn("hooks ['optimizer', 'backward', 'checkpoint', 'eval', 'inference', 'compile']", out.stdout)

    def test_install_auto_marks_false_takes_the_hooks_out(self):
        _, seq = self.traced(
            """
            gpualloc.install(auto_marks=False)
            torch.optim.SGD().step()
            torch.Tensor().backward()
            assert not getattr(torch.autograd.backward, "_gpualloc_auto", False)
            """
        )
        self.assertEqual(seq, [])

    def test_another_threads_step_leaves_the_owners_optimizer_phase_open(self):
        # The training loop's step is under way when another thread's
        # optimizer steps (an EMA or a second learner): the owner's phase
        # stays open until its own step ends.
        _, seq = self.traced(
            """
            import threading
            started, go = threading.Event(), threading.Event()
            class Slow(torch.optim.SGD):
                def step(self, closure=None):
                    started.set()
                    go.wait(10)
                    return super().step(closure)
            a, b = Slow(), torch.optim.SGD()
            def other():
                started.wait(10)
                b.step()
                go.set()
            t = threading.Thread(target=other)
            t.start()
            torch.Tensor().backward()
            a.step()
            t.join()
            """
        )
        self.assertEqual(seq, [push("backward"), pop("backward"), push("optimizer"), STEP, pop("optimizer")])

    def test_switching_off_keeps_a_later_patch_of_another_library(self):
        # A library that wraps torch.autograd.backward after install(), one
        # with functools.wraps and one without: switching the marks off
        # leaves its wrapper in place, and ours inside it marks nothing;
        # switched on again, each backward pass is one phase, not two.
        for wraps in (True, False):
            with self.subTest(wraps=wraps):
                _, seq = self.traced(
                    f"""
                    import functools
                    ours = torch.autograd.backward
                    calls = []
                    def theirs(*a, **k):
                        calls.append(1)
                        return ours(*a, **k)
                    if {wraps}:
                        theirs = functools.wraps(ours)(theirs)
                    torch.autograd.backward = theirs
                    gpualloc.install(auto_marks=False)
                    assert torch.autograd.backward is theirs
                    torch.Tensor().backward()
                    gpualloc.mark("off")
                    gpualloc.install(auto_marks=True)
                    torch.Tensor().backward()
                    assert len(calls) == 2, calls
                    """
                )
                marks = [e for e in seq if e[0] == "mark"]
                self.assertEqual(len(marks), 1, seq)
                after = seq[seq.index(marks[0]) + 1 :]
                self.assertEqual(seq[: seq.index(marks[0])], [])
                self.assertEqual(after, [push("backward"), pop("backward")])

    def test_a_later_install_keeps_the_hooks_switched_off(self):
        _, seq = self.traced(
            """
            gpualloc.install(auto_marks=False)
            gpualloc.install()  # a library's own call: the program's choice holds
            print("hooks", gpualloc.auto_marks())
            torch.optim.SGD().step()
            """
        )
        self.assertEqual(seq, [])

    def test_a_closure_given_to_the_step_runs_outside_its_phase(self):
        # Lightning's automatic optimization: forward and backward run in
        # the closure, inside optimizer.step.
        _, seq = self.traced(
            """
            opt = torch.optim.SGD()
            def closure():
                torch.Tensor().backward()
                return 1.0
            opt.step(closure=closure)
            opt.step(closure)
            """
        )
        step = [push("backward"), pop("backward"), push("optimizer"), pop("optimizer"), ("mark", "step")]
        self.assertEqual(seq, step * 2)

    def test_dynamo_imported_after_install_runs_the_package_uncompiled(self):
        # However dynamo comes to be imported (here neither through
        # torch.compile nor before install()), the package's code is
        # skipped by it (Note [Hooks under torch.compile]); asking whether
        # dynamo is there imports nothing.
        out, _ = self.traced(
            """
            import copy, importlib.util
            import gpualloc._auto as auto
            assert importlib.util.find_spec("torch._dynamo") is not None
            assert "torch._dynamo" not in sys.modules

            class AskTheOthers:  # another library's finder that asks the rest
                def find_spec(self, name, path=None, target=None):
                    for f in list(sys.meta_path):
                        spec = f.find_spec(name, path, target) if f is not self and hasattr(f, "find_spec") else None
                        if spec is not None:
                            return spec

            sys.meta_path.insert(0, AskTheOthers())
            auto._hook_compile(torch)  # again (a reloaded module): no second finder
            import torch._dynamo.eval_frame as ef
            skipped = set(ef.SKIPPED)
            codes = (auto._step_pre_hook.__code__, auto._DynamoImport.find_spec.__code__)
            finders = sum(isinstance(f, auto._DynamoImport) for f in sys.meta_path)
            copy.deepcopy(torch._dynamo.__spec__)
            loader = type(torch._dynamo.__loader__).__name__
            print("skipped", all(c in skipped for c in codes), "finders", finders, "loader", loader)
            """
        )
        self.assertIn("skipped True finders 1 loader SourceFileLoader", out.stdout)

    def test_hooks_step_aside_while_torch_compile_traces(self):
        _, seq = self.traced(
            """
            opt = torch.optim.SGD()
            model = torch.nn.Module()
            torch.COMPILING[0] = True
            torch.Tensor().backward()
            opt.step()
            model.eval()
            with torch.inference_mode():
                pass
            torch.COMPILING[0] = False
            torch.Tensor().backward()
            """
        )
        self.assertEqual(seq, [push("backward"), pop("backward")])

    def test_a_failing_hook_warns_once_and_the_program_goes_on(self):
        out, seq = self.traced(
            """
            import gpualloc._auto as auto
            def broken():
                raise RuntimeError("library gone")
            auto.lib = broken
            opt = torch.optim.SGD()
            for _ in range(2):
                torch.Tensor().backward()
                opt.step()
            print("steps", opt.steps)
            """
        )
        self.assertIn("steps 2", out.stdout)
        self.assertEqual(out.stderr.count("gpualloc: automatic marks:"), 1, out.stderr)
        self.assertIn("library gone", out.stderr)
        self.assertEqual(seq, [push("backward"), pop("backward"), push("optimizer"), pop("optimizer")] * 2)


class AutoMarksWithLibrariesTest(unittest.TestCase):
    """How training libraries and loops switch modes and recover."""

    traced = AutoMarksTest.traced

    def test_modes_restored_by_attribute_close_eval(self):
        # Lightning >= 2.2: on_validation_model_eval calls trainer.model.eval(),
        # then _ModuleMode.restore sets `mod.training` on every submodule
        # directly (no train() call), and the fit loop never calls train()
        # again. The training steps after it are not inside "eval".
        _, seq = self.traced(
            """
            model = torch.nn.Module(torch.nn.Module())
            opt = torch.optim.SGD()
            def named(m):
                yield m
                for c in m.children():
                    yield from named(c)
            modes = {id(m): m.training for m in named(model)}  # the sanity check's validation
            model.eval()
            with torch.inference_mode():
                pass
            for m in named(model):
                m.training = modes[id(m)]  # _ModuleMode.restore
            for _ in range(2):  # a training epoch
                torch.Tensor().backward()
                opt.step()
            """
        )
        step = [push("backward"), pop("backward"), push("optimizer"), pop("optimizer"), STEP]
        self.assertEqual(seq, [push("eval"), pop("eval")] + step * 2)

    def test_evaluating_the_model_inside_a_wrapper_is_an_eval_phase(self):
        # ddp = DDP(model); ddp.train() each epoch, and the evaluation on the
        # inner model (the Hugging Face Trainer evaluates self.model, not
        # model_wrapped): the wrapper's own flag stays True.
        _, seq = self.traced(
            """
            model = torch.nn.Module(torch.nn.Module(), torch.nn.Module())
            ddp = torch.nn.Module(model)
            ddp.train()
            model.eval()
            model.train()
            """
        )
        self.assertEqual(seq, [push("eval"), pop("eval")])

    def test_a_frozen_part_beside_a_training_one_is_still_no_eval(self):
        _, seq = self.traced(
            """
            backbone, head = torch.nn.Module(torch.nn.Module()), torch.nn.Module()
            ddp = torch.nn.Module(torch.nn.Module(backbone, head))
            ddp.train()
            backbone.eval()  # frozen for fine-tuning: the head trains beside it
            list(backbone.children())[0].eval()
            torch.Tensor().backward()
            """
        )
        self.assertEqual(seq, [push("backward"), pop("backward")])

    def test_a_step_that_raised_leaves_no_optimizer_phase_over_the_next_iteration(self):
        # A loop that skips a batch whose step ran out of memory (or whose
        # closure raised) goes on; its next backward is not part of a step.
        _, seq = self.traced(
            """
            import torch.optim.optimizer as oo
            real = oo.Optimizer._step
            def failing(self, closure=None):
                raise RuntimeError("CUDA out of memory")
            opt = torch.optim.SGD()
            oo.Optimizer._step = failing
            try:
                opt.step()
            except RuntimeError:
                pass
            oo.Optimizer._step = real
            torch.Tensor().backward()
            opt.step()
            """
        )
        self.assertEqual(
            seq,
            [push("optimizer"), pop("optimizer"), push("backward"), pop("backward"), push("optimizer"),
             pop("optimizer"), STEP],
        )

    def test_a_failing_hook_under_warnings_as_errors_does_not_raise_into_training(self):
        body = """
            import gpualloc._auto as auto
            def broken():
                raise RuntimeError("library gone")
            auto.lib = broken
            opt = torch.optim.SGD()
            try:
                opt.step()
                print("went on")
            except BaseException as e:
                print("RAISED", type(e).__name__, e)
            """
        with tempfile.TemporaryDirectory() as d:
            out = run(["-W", "error::RuntimeWarning", "-c", PRELUDE + textwrap.dedent(body) + "\ndone()\n",
                       os.path.join(d, "t.gtrace")])
        self.assertIn("went on", out.stdout, out.stdout + out.stderr)


class AutoMarksOptimizersTest(unittest.TestCase):
    """Optimizers that wrap or follow one another, copies in evaluation, and
    storages pickled through torch.save (the same cases under a real torch:
    test_auto_torch.py)."""

    traced = AutoMarksTest.traced

    def test_a_subclass_whose_step_calls_super_marks_once_per_step(self):
        _, seq = self.traced(
            """
            class Mine(torch.optim.SGD):
                def step(self, closure=None):
                    return super().step(closure)
            torch.optim.SGD()  # its class's step is wrapped too
            opt = Mine()
            for _ in range(2):
                opt.step()
            """
        )
        self.assertEqual(seq, [push("optimizer"), pop("optimizer"), STEP] * 2)

    def test_a_step_that_raised_inside_another_leaves_no_nesting_behind(self):
        _, seq = self.traced(
            """
            class Mine(torch.optim.SGD):
                def step(self, closure=None):
                    return super().step(closure)
            torch.optim.SGD()
            opt = Mine()
            real = torch.optim.SGD._step
            def failing(self, closure=None):
                raise RuntimeError("out of memory")
            torch.optim.SGD._step = failing
            try:
                opt.step()
            except RuntimeError:
                pass
            torch.optim.SGD._step = real
            opt.step()
            """
        )
        self.assertEqual(seq, [push("optimizer"), pop("optimizer"), push("optimizer"), pop("optimizer"), STEP])

    def test_a_new_optimizer_leads_at_once_when_the_last_was_freed(self):
        _, seq = self.traced(
            """
            last = torch.optim.SGD()
            last.step()
            last.step()
            for trial in range(2):
                opt = torch.optim.SGD()  # made while the last one lives: another id
                del last
                opt.step()
                opt.step()
                last = opt
            """
        )
        self.assertEqual([x for x in seq if x[0] == "mark"], [STEP] * 6)

    def test_a_copy_in_evaluation_is_over_at_the_models_step(self):
        _, seq = self.traced(
            """
            import copy
            model = torch.nn.Module(torch.nn.Module())
            ema = copy.deepcopy(model).eval()
            opt = torch.optim.SGD(model.parameters())
            for _ in range(2):
                torch.Tensor().backward()
                opt.step()
            model.eval()  # the model's own evaluation, then a step of its optimizer
            opt.step()
            """
        )
        self.assertEqual(
            seq,
            [push("eval"), push("backward"), pop("backward"), pop("eval"), push("optimizer"), pop("optimizer"), STEP,
             push("backward"), pop("backward"), push("optimizer"), pop("optimizer"), STEP,
             push("eval"), push("optimizer"), pop("optimizer"), STEP],
        )

    def test_a_storage_pickling_itself_is_no_checkpoint(self):
        _, seq = self.traced(
            """
            import io, pickle
            pickle.dumps([torch.UntypedStorage() for _ in range(3)])
            torch.save({}, io.BytesIO())
            """
        )
        self.assertEqual(seq, [push("checkpoint"), pop("checkpoint")])


class InstallTest(unittest.TestCase):
    """install() called again, after `python -m gpualloc run`, or failing."""

    def script(self, d, body):
        path = os.path.join(d, "train.py")
        with open(path, "w") as f:
            f.write(textwrap.dedent(body))
        return path

    def test_installing_after_cuda_started_names_an_imported_library_known_to_start_it(self):
        body = (
            "import sys, types, torch, gpualloc\n"
            "torch.cuda.is_initialized = lambda: True\n"
            "{extra}"
            "try:\n    gpualloc.install(bridge=False)\nexcept gpualloc.GpuallocError as e:\n    print('ERROR', e)\n"
        )
        for extra, named in (("", False), ("sys.modules['unsloth'] = types.ModuleType('unsloth')\n", True)):
            with tempfile.TemporaryDirectory() as d:
                out = run([self.script(d, body.format(extra=extra))])
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertIn("ERROR gpualloc.install() must run before CUDA is initialized", out.stdout)
                self.assertIn("python -m gpualloc run", out.stdout)
                self.assertEqual("unsloth does so when imported" in out.stdout, named, out.stdout)

    def test_the_scripts_own_config_under_run_warns_and_goes_on(self):
        with tempfile.TemporaryDirectory() as d:
            s = self.script(d, "import gpualloc, torch\ngpualloc.install(config='max_split_size_mb:128')\nprint('went on')\n")
            out = run(["-m", "gpualloc", "run", "--no-bridge", s])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("went on", out.stdout)
            self.assertIn("--config 'max_split_size_mb:128'", out.stderr)
            # Without run, another configuration is still an error.
            s = self.script(
                d,
                """
                import gpualloc, torch
                gpualloc.install(bridge=False)
                try:
                    gpualloc.install(config="max_split_size_mb:128")
                except gpualloc.GpuallocError as e:
                    print("refused", "already initialized" in str(e))
                """,
            )
            out = run([s])
            self.assertIn("refused True", out.stdout, out.stderr)

    def test_an_install_that_failed_keeps_no_configuration(self):
        # Interrupted while it set up (Ctrl-C during the bridge build, torch
        # refusing the allocator): a retry, with another configuration or
        # none, installs; the failed call's trace was called off too.
        with tempfile.TemporaryDirectory() as d:
            a = os.path.join(d, "a.gtrace")
            s = self.script(
                d,
                f"""
                import gpualloc, torch
                from gpualloc._lib import lib
                swap = torch.cuda.memory.change_current_allocator
                def refuse(a):
                    raise RuntimeError("refused once")
                torch.cuda.memory.change_current_allocator = refuse
                try:
                    gpualloc.install(config="max_split_size_mb:128", trace={a!r}, bridge=False)
                except RuntimeError as e:
                    print("failed", e)
                torch.cuda.memory.change_current_allocator = swap
                print("installed", gpualloc.install(config="max_split_size_mb:256", bridge=False))
                print("tracing", lib().is_tracing())
                p = lib().malloc(1 << 20, 0, 0)
                import ctypes
                config_string = lib().dll.gpualloc_config_string
                config_string.restype = ctypes.c_char_p
                print("config", config_string().decode())
                lib().free(p, 0)
                """,
            )
            out = run([s])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("failed refused once", out.stdout)
            self.assertIn("installed fallback", out.stdout)
            self.assertIn("tracing False", out.stdout)
            self.assertIn("config max_split_size_mb:256", out.stdout)

    def test_install_starts_nothing_until_the_first_use(self):
        # Note [Starting on first use]: install() initializes no driver, so
        # the program may still choose its GPUs; the hooks do not start the
        # allocator either; the first allocation does, with the
        # configuration and trace install() was given.
        with tempfile.TemporaryDirectory() as d:
            a = os.path.join(d, "a.gtrace")
            s = self.script(
                d,
                f"""
                import gpualloc, torch
                from gpualloc._lib import lib
                from gpualloc.tracefile import annotations
                gpualloc.install(config="max_split_size_mb:128", trace={a!r}, bridge=False)
                print("started", lib().is_initialized(), "tracing", lib().is_tracing())
                torch.Tensor().backward()
                torch.optim.SGD().step()
                model = torch.nn.Module()
                model.eval()
                print("after hooks", lib().is_initialized())
                p = lib().malloc(1 << 20, 0, 0)
                print("after malloc", lib().is_initialized())
                torch.Tensor().backward()
                lib().free(p, 0)
                try:
                    gpualloc.install(config="max_split_size_mb:256")
                except gpualloc.GpuallocError as e:
                    print("refused", "max_split_size_mb:128" in str(e))
                gpualloc.trace_stop()
                print("seq", [(x["kind"], x["name"]) for x in annotations({a!r}) if x["device"] == 0])
                """,
            )
            out = run([s])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("started False tracing True", out.stdout)
            self.assertIn("after hooks False", out.stdout)
            self.assertIn("after malloc True", out.stdout)
            self.assertIn("refused True", out.stdout)
            self.assertIn("seq [('phase_push', 'backward'), ('phase_pop', 'backward')]", out.stdout)

    def test_a_trace_started_before_the_first_use_starts_nothing(self):
        # gpualloc.trace_start() at a script's top runs again in every
        # spawned worker: it keeps the trace for the start, as install(trace=)
        # does, rather than start CUDA there.
        with tempfile.TemporaryDirectory() as d:
            a = os.path.join(d, "a.gtrace")
            s = self.script(
                d,
                f"""
                import gpualloc, torch
                from gpualloc._lib import lib
                from gpualloc.tracefile import records
                gpualloc.install(bridge=False)
                try:
                    gpualloc.trace_start({os.path.join(d, "missing", "x.gtrace")!r})
                except gpualloc.GpuallocError as e:
                    print("refused", "missing" in str(e))
                gpualloc.trace_start({a!r})
                print("started", lib().is_initialized(), "tracing", gpualloc.is_tracing())
                lib().free(lib().malloc(1 << 20, 0, 0), 0)
                print("started", lib().is_initialized(), "tracing", gpualloc.is_tracing())
                gpualloc.trace_stop()
                print("sizes", [r["requested"] for r in records({a!r}) if r["kind"] == "alloc"])
                """,
            )
            out = run([s])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("refused True", out.stdout)
            self.assertIn("started False tracing True", out.stdout)
            self.assertIn("started True tracing True", out.stdout)
            self.assertIn(f"sizes [{1 << 20}]", out.stdout)

    def test_a_trace_path_that_can_never_be_written_is_refused_at_once(self):
        # Before the allocator starts, a trace is kept for its start, where a
        # failure is only a line on stderr: a missing folder, a folder given
        # as the path or an empty path is refused when asked for instead, by
        # trace_start(), install(trace=...) and `run --trace` alike.
        with tempfile.TemporaryDirectory() as d:
            missing = os.path.join(d, "missing", "x.gtrace")
            s = self.script(
                d,
                f"""
                import sys, gpualloc, torch
                from gpualloc._lib import lib
                for path in ({missing!r}, {d!r}, ""):
                    try:
                        gpualloc.trace_start(path)
                        print("trace_start accepted", repr(path))
                    except gpualloc.GpuallocError as e:
                        print("trace_start refused", repr(path), e)
                    try:
                        gpualloc.install(trace=path or {d!r} + "/", bridge=False)
                        print("install accepted", repr(path))
                    except gpualloc.GpuallocError as e:
                        print("install refused", repr(path), e)
                print("started", lib().is_initialized(), "tracing", gpualloc.is_tracing())
                """,
            )
            out = run([s])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertNotIn("accepted", out.stdout)
            self.assertIn(f"trace_start refused {missing!r} gpualloc.trace_start({missing!r}): the folder", out.stdout)
            self.assertIn(f"trace_start refused {d!r} gpualloc.trace_start({d!r}): {d!r} is a folder", out.stdout)
            self.assertIn("trace_start refused '' gpualloc.trace_start(''): the path is empty", out.stdout)
            self.assertIn(f"install refused {missing!r} gpualloc.install(trace={missing!r}): the folder", out.stdout)
            self.assertIn(f"install refused {d!r} gpualloc.install(trace={d!r}): {d!r} is a folder", out.stdout)
            self.assertIn("started False tracing False", out.stdout)
            # `run --trace FOLDER` with torch: an error, not a run whose trace is lost.
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", d, s])
            self.assertEqual(out.returncode, 2, out.stderr)
            self.assertIn(f"--trace {d}: {d!r} is a folder", out.stderr)

    def test_pytorchs_own_configuration_is_named_not_ignored_silently(self):
        with tempfile.TemporaryDirectory() as d:
            s = self.script(d, "import gpualloc, torch\ngpualloc.install(bridge=False)\nprint('went on')\n")
            out = run([s], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128"})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("went on", out.stdout)
            self.assertIn("PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True,max_split_size_mb:128'", out.stderr)
            self.assertIn("no effect on gpualloc", out.stderr)
            out = run([s], {"PYTORCH_CUDA_ALLOC_CONF": ""})
            self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", out.stderr)
            # What gpualloc does anyway (torchtune sets it on import): unsaid.
            out = run([s], {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
            self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", out.stderr)
            out = run([s], {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("PYTORCH_ALLOC_CONF='garbage_collection_threshold:0.6'", out.stderr)
            self.assertIn("PYTORCH_NO_CUDA_MEMORY_CACHING='1' is set: gpualloc honours it only through its C++ bridge",
                          out.stderr)
            # PyTorch (since 2.7) turns caching off for "1" only: "0", which
            # launch scripts set to keep caching, and other values leave it on.
            for value in ("0", "", "true"):
                out = run([s], {"PYTORCH_NO_CUDA_MEMORY_CACHING": value})
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertNotIn("PYTORCH_NO_CUDA_MEMORY_CACHING", out.stderr)
            # A preloaded cudaMalloc hook sees none of gpualloc's memory: said.
            out = run([s], {"LD_PRELOAD": "/nowhere/torch_memory_saver_hook_mode_preload.abi3.so"})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("went on", out.stdout)
            self.assertIn("torch_memory_saver_hook_mode_preload.abi3.so', which hooks cudaMalloc", out.stderr)
            self.assertIn("hook_mode='torch'", out.stderr)
            out = run([s], {"LD_PRELOAD": ""})
            self.assertNotIn("hooks cudaMalloc", out.stderr)
            # An allocator swapped in before install() is replaced: said.
            out = run([s], {"FAKE_TORCH_ALLOCATOR_BACKEND": "pluggable"})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("went on", out.stdout)
            self.assertIn("install() replaces the 'pluggable' allocator", out.stderr)
            self.assertNotIn("replaces the", run([s]).stderr)
            # Its HIP name counts on CUDA builds too.
            out = run([s], {"PYTORCH_NO_HIP_MEMORY_CACHING": "1"})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("PYTORCH_NO_HIP_MEMORY_CACHING='1' is set", out.stderr)
            self.assertNotIn("no effect on gpualloc", out.stderr)

    def test_nccls_graph_registration_is_turned_off_over_mapped_memory(self):
        # Note [NCCL's graph registration]: unset, it becomes 0 for this
        # process and those it starts; a value the program set stays, and
        # one that turns registration on is said; plain memory leaves it.
        with tempfile.TemporaryDirectory() as d:
            s = self.script(
                d,
                "import os, sys, gpualloc, torch\n"
                "gpualloc.install(bridge=False, config=sys.argv[1])\n"
                "print('nccl', os.environ.get('NCCL_GRAPH_REGISTER'))\n",
            )
            out = run([s, ""], {"NCCL_GRAPH_REGISTER": " "})  # blank: unset
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("nccl 0", out.stdout)
            self.assertNotIn("NCCL_GRAPH_REGISTER", out.stderr)
            out = run([s, ""], {"NCCL_GRAPH_REGISTER": "1"})
            self.assertIn("nccl 1", out.stdout)
            self.assertIn("NCCL_GRAPH_REGISTER='1' has NCCL register", out.stderr)
            out = run([s, ""], {"NCCL_GRAPH_REGISTER": "0"})
            self.assertIn("nccl 0", out.stdout)
            self.assertNotIn("NCCL_GRAPH_REGISTER", out.stderr)
            out = run([s, "expandable_segments:false"], {"NCCL_GRAPH_REGISTER": " "})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout.splitlines()[-1], "nccl  ")
            # PyTorch's own switch off from the start keeps memory plain too.
            plain = {"NCCL_GRAPH_REGISTER": " ", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,expandable_segments:False"}
            self.assertEqual(run([s, ""], plain).stdout.splitlines()[-1], "nccl  ")
            plain["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            self.assertEqual(run([s, ""], plain).stdout.splitlines()[-1], "nccl 0")

    def test_a_misspelled_gpualloc_variable_is_named_with_what_was_meant(self):
        with tempfile.TemporaryDirectory() as d:
            s = self.script(
                d,
                "import gpualloc, torch\ngpualloc.install(bridge=False)\n"
                "from gpualloc._lib import lib\nL = lib()\nL.free(L.malloc(4096))\nprint('went on')\n",
            )
            out = run([s], {"GPUALLOC_CONFIG": "policy:pytorch", "GPUALLOC_TRACE": os.path.join(d, "run-{RANK}.gtrace")})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("went on", out.stdout)
            self.assertIn("GPUALLOC_CONFIG is not one gpualloc reads (did you mean GPUALLOC_CONF?)", out.stderr)
            self.assertIn("{RANK} in the trace path", out.stderr)
            self.assertIn("did you mean {rank}?", out.stderr)

    def test_no_configuration_given_is_the_environments_and_holds(self):
        with tempfile.TemporaryDirectory() as d:
            s = self.script(
                d,
                """
                import gpualloc, torch
                gpualloc.install(bridge=False)
                for conf in ("max_split_size_mb:64", "max_split_size_mb:128"):
                    try:
                        gpualloc.install(config=conf)
                        print("took", conf)
                    except gpualloc.GpuallocError as e:
                        print("refused", conf)
                """,
            )
            out = run([s], {"GPUALLOC_CONF": "max_split_size_mb:64", "GPUALLOC_BACKEND": "sim"})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("took max_split_size_mb:64", out.stdout)
            self.assertIn("refused max_split_size_mb:128", out.stdout)

    def test_pytorchs_memory_fraction_is_checked_at_install_and_named_as_taking_effect(self):
        # Note [PyTorch's settings under gpualloc]: a fraction PyTorch
        # refuses fails install() itself, naming the variable; a good one
        # is said to take effect.
        with tempfile.TemporaryDirectory() as d:
            s = self.script(
                d,
                """
                import gpualloc, torch
                try:
                    gpualloc.install(bridge=False)
                    print("installed")
                except gpualloc.GpuallocError as e:
                    print("refused:", e)
                """,
            )
            bad = "expandable_segments:True,per_process_memory_fraction:1.5"
            out = run([s], {"PYTORCH_CUDA_ALLOC_CONF": bad, "GPUALLOC_BACKEND": "sim"})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("refused:", out.stdout)
            self.assertIn("PYTORCH_CUDA_ALLOC_CONF: per_process_memory_fraction", out.stdout)
            self.assertIn("`1.5` is not a number in [0, 1]", out.stdout)
            good = "per_process_memory_fraction:0.5,max_split_size_mb:64"
            out = run([s], {"PYTORCH_CUDA_ALLOC_CONF": good, "GPUALLOC_BACKEND": "sim"})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("installed", out.stdout)
            self.assertIn("but for per_process_memory_fraction", out.stderr)
            # Alone it is said too: gpualloc's own fraction would win over it.
            out = run([s], {"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.5", "GPUALLOC_BACKEND": "sim"})
            self.assertIn("installed", out.stdout)
            self.assertIn("but for per_process_memory_fraction", out.stderr)

    def test_a_fraction_set_at_run_time_before_install_caps_from_the_start(self):
        # Note [PyTorch's fraction set at run time]: torch keeps the last
        # string it took; install() reads it, and later strings reach the
        # library through the wrapped setter.
        with tempfile.TemporaryDirectory() as d:
            s = self.script(
                d,
                """
                import gpualloc, torch
                from gpualloc._lib import lib
                gpualloc.install(bridge=False)
                print("before", lib().memory_fraction(0))
                torch._C._accelerator_setAllocatorSettings("per_process_memory_fraction:0.125")
                print("after", lib().memory_fraction(0))
                """,
            )
            env = {"GPUALLOC_BACKEND": "sim", "FAKE_TORCH_ALLOCATOR_SETTINGS": "per_process_memory_fraction:0.25"}
            out = run([s], env)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("before 0.25", out.stdout)
            self.assertIn("after 0.125", out.stdout)
            self.assertNotIn("per_process_memory_fraction", out.stderr)

    def test_run_installs_in_the_python_processes_the_program_starts(self):
        # Note [Installing in child processes]: a child that imports torch
        # gets gpualloc (here the fallback: --no-bridge, passed on), with
        # run's configuration and trace; one that does not is left alone,
        # and a sitecustomize of its own still runs.
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "run.gtrace")
            own = os.path.join(d, "own")
            os.makedirs(own)
            with open(os.path.join(own, "sitecustomize.py"), "w") as f:
                f.write("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n")
            child = textwrap.dedent(
                """
                import importlib.util, os, sys
                print("own", os.environ.get("OWN_SITECUSTOMIZE"))
                print("before torch", "gpualloc" in sys.modules)
                assert importlib.util.find_spec("torch") is not None  # a probe, as transformers makes
                import torch, gpualloc
                from gpualloc._lib import lib
                print("installed", gpualloc.installed(), "started", lib().is_initialized())
                p = lib().malloc(1 << 20, 0, 0)
                lib().free(p, 0)
                print("config", os.environ.get("GPUALLOC_CONF"))
                """
            )
            s = self.script(
                d,
                f"""
                import multiprocessing, os, subprocess, sys
                import torch

                def rank():
                    import gpualloc
                    print("spawned", gpualloc.installed(), flush=True)

                if __name__ == "__main__":
                    env = dict(os.environ, PYTHONPATH=os.environ["PYTHONPATH"] + os.pathsep + {own!r})
                    subprocess.run([sys.executable, "-c", {child!r}], check=True, env=env)
                    subprocess.run([sys.executable, "-c", "import sys; print('plain child', 'gpualloc' in sys.modules)"], check=True)
                    p = multiprocessing.get_context("spawn").Process(target=rank)
                    p.start()
                    p.join()
                """,
            )
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--config", "max_split_size_mb:64", "--trace", trace, s])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("own ran", out.stdout)
            self.assertIn("before torch False", out.stdout)
            self.assertIn("installed fallback started False", out.stdout)
            self.assertIn("config max_split_size_mb:64", out.stdout)
            self.assertIn("plain child False", out.stdout)
            self.assertIn("spawned fallback", out.stdout)  # as torch.multiprocessing.spawn's ranks
            # The child allocated and wrote the trace; run's own process
            # (which allocated nothing) did not.
            from gpualloc.tracefile import records

            sizes = [r["requested"] for r in records(trace) if r["kind"] == "alloc"]
            self.assertIn(1 << 20, sizes)

    def test_the_environments_pytorch_settings_are_said_once_not_in_every_child(self):
        # PYTORCH_CUDA_ALLOC_CONF does nothing under gpualloc: run says so
        # once, not again in each rank or worker it installs gpualloc in.
        # The children's relative GPUALLOC_BUILD_DIR is made absolute, as
        # the library's path is, so a child started elsewhere finds the
        # bridge run built.
        with tempfile.TemporaryDirectory() as d:
            child = (
                "import os, subprocess, sys, torch, gpualloc; "
                "print('child', gpualloc.installed(), os.environ['GPUALLOC_BUILD_DIR'], flush=True); "
                "os.environ.get('GRANDCHILD') and subprocess.run([sys.executable, '-c', 'import torch'], check=True, "
                "env=dict(os.environ, GRANDCHILD=''))"
            )
            s = self.script(
                d,
                f"""
                import subprocess, sys
                import os
                if __name__ == "__main__":
                    for _ in range(2):
                        subprocess.run([sys.executable, "-c", {child!r}], check=True, cwd="/")
                    # A setting the program gives its child itself is said there.
                    # ... and not again in that child's own children (a rank's workers).
                    own = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="garbage_collection_threshold:0.6,max_split_size_mb:64", GRANDCHILD="1")
                    subprocess.run([sys.executable, "-c", {child!r}], check=True, cwd="/", env=own)
                """,
            )
            env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128", "GPUALLOC_BUILD_DIR": "bridge-cache"}
            out = run(["-m", "gpualloc", "run", "--no-bridge", s], env, cwd=d)
            self.assertEqual(out.returncode, 0, out.stderr)
            dirs = [ln.split()[2] for ln in out.stdout.splitlines() if ln.startswith("child fallback ")]
            self.assertEqual(len(dirs), 3, out.stdout)
            for built in dirs:
                self.assertEqual(os.path.realpath(built), os.path.join(os.path.realpath(d), "bridge-cache"))
            self.assertEqual(out.stderr.count("PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:128'"), 1, out.stderr)
            self.assertEqual(
                out.stderr.count("PYTORCH_CUDA_ALLOC_CONF='garbage_collection_threshold:0.6,max_split_size_mb:64'"),
                1,
                out.stderr,
            )

    def test_a_child_that_installs_before_importing_torch_does_not_hang(self):
        # The README's first lines in a rank or a spawned worker: install()
        # imports torch, whose import installs gpualloc through run's
        # sitecustomize (the same thread, inside the first install()). An
        # empty PYTHONPATH entry (the current directory) is kept for them.
        with tempfile.TemporaryDirectory() as d:
            local = os.path.join(d, "work")
            os.makedirs(local)
            with open(os.path.join(local, "localmod.py"), "w") as f:
                f.write("VALUE = 'local'\n")
            child = os.path.join(d, "rank.py")  # a script elsewhere: sys.path[0] is its directory
            with open(child, "w") as f:
                f.write("import gpualloc\nprint('mode', gpualloc.install())\nimport localmod\nprint('found', localmod.VALUE)\n")
            s = self.script(d, f"import subprocess, sys\nsubprocess.run([sys.executable, {child!r}], check=True)\n")
            env = {"PYTHONPATH": os.pathsep.join(["", FAKE_TORCH, SHIM])}
            out = run(["-m", "gpualloc", "run", "--no-bridge", s], env, cwd=local)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("mode fallback", out.stdout)
            self.assertIn("found local", out.stdout)

    def test_a_pool_worker_completes_its_trace(self):
        # Pool workers under forkserver (and fork) leave through os._exit,
        # past the exit handlers: the trace is completed by multiprocessing's
        # finalizers.
        with tempfile.TemporaryDirectory() as d:
            s = self.script(
                d,
                """
                import multiprocessing

                def work(n):
                    import torch
                    from gpualloc._lib import lib
                    lib().free(lib().malloc(n << 20, 0, 0), 0)
                    return n

                if __name__ == "__main__":
                    pool = multiprocessing.get_context("forkserver").Pool(1)
                    print("results", pool.map(work, [1, 2]))
                    pool.close()  # the workers end as they do (a `with` would terminate them)
                    pool.join()
                """,
            )
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", os.path.join(d, "t-{pid}.gtrace"), s])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("results [1, 2]", out.stdout)
            from gpualloc.tracefile import records

            traces = [n for n in os.listdir(d) if n.endswith(".gtrace")]
            self.assertEqual(len(traces), 1, traces)  # the worker's; run's own allocated nothing
            sizes = sorted(r["requested"] for r in records(os.path.join(d, traces[0])) if r["kind"] == "alloc")
            self.assertEqual(sizes, [1 << 20, 2 << 20])

    def test_processes_of_a_run_one_after_another_keep_each_others_traces(self):
        # A sweep that runs its trials one after another, each tracing to
        # the run's one path: the first writes it (an earlier run's trace
        # there is emptied as run starts), later ones beside it, instead of
        # each emptying the one before.
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "t.gtrace")
            with open(trace, "wb") as f:
                f.write(b"an earlier run's trace")
            child = "import sys, torch; from gpualloc._lib import lib; lib().free(lib().malloc(int(sys.argv[1]) << 20, 0, 0), 0)"
            s = self.script(
                d,
                f"""
                import subprocess, sys
                for n in (1, 2, 3):
                    subprocess.run([sys.executable, "-c", {child!r}, str(n)], check=True)
                """,
            )
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", trace, s])
            self.assertEqual(out.returncode, 0, out.stderr)
            from gpualloc.tracefile import records

            traces = sorted(n for n in os.listdir(d) if n.endswith(".gtrace"))
            self.assertEqual(len(traces), 3, traces)
            sizes = sorted(
                r["requested"] >> 20 for n in traces for r in records(os.path.join(d, n)) if r["kind"] == "alloc"
            )
            self.assertEqual(sizes, [1, 2, 3])
            first = [r["requested"] >> 20 for r in records(trace) if r["kind"] == "alloc"]
            self.assertEqual(first, [1], "the first trial took the path")

    def test_the_environments_trace_holds_for_run_and_its_children(self):
        # With GPUALLOC_TRACE set, install() ignores --trace (and says so):
        # the children are not told otherwise.
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "a.gtrace"), os.path.join(d, "b.gtrace")
            child = "import torch; from gpualloc._lib import lib; lib().free(lib().malloc(1 << 20, 0, 0), 0)"
            s = self.script(d, f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}], check=True)\n")
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", b, s], {"GPUALLOC_TRACE": a})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("ignored", out.stderr)
            self.assertTrue(os.path.exists(a), out.stderr)
            self.assertFalse(os.path.exists(b), out.stderr)

    def test_a_run_inside_a_run_keeps_its_own_options(self):
        with tempfile.TemporaryDirectory() as d:
            inner = self.script(
                d,
                """
                import ctypes, torch, gpualloc
                from gpualloc._lib import lib
                lib().free(lib().malloc(1 << 20, 0, 0), 0)
                f = lib().dll.gpualloc_config_string
                f.restype = ctypes.c_char_p
                print("inner config", f().decode())
                """,
            )
            outer = os.path.join(d, "outer.py")
            with open(outer, "w") as f:
                f.write(
                    "import subprocess, sys\n"
                    f"subprocess.run([sys.executable, '-m', 'gpualloc', 'run', '--no-bridge', '--config', "
                    f"'max_split_size_mb:128', {inner!r}], check=True)\n"
                )
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--config", "max_split_size_mb:64", outer])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("inner config max_split_size_mb:128", out.stdout)
            self.assertNotIn("ignored", out.stderr)

    def test_a_run_inside_a_run_records_its_own_trace(self):
        # The enclosing run's trace comes in GPUALLOC_TRACE; the nested
        # run's --trace takes its place, for it and for its children.
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "outer.gtrace"), os.path.join(d, "inner.gtrace")
            child = "import torch; from gpualloc._lib import lib; lib().free(lib().malloc(3 << 20, 0, 0), 0)"
            inner = self.script(
                d,
                f"""
                import subprocess, sys, torch
                from gpualloc._lib import lib
                lib().free(lib().malloc(1 << 20, 0, 0), 0)
                subprocess.run([sys.executable, '-c', {child!r}], check=True)
                """,
            )
            outer = os.path.join(d, "outer.py")
            with open(outer, "w") as f:
                f.write(
                    "import subprocess, sys, torch\n"
                    "from gpualloc._lib import lib\n"
                    "lib().free(lib().malloc(2 << 20, 0, 0), 0)\n"
                    f"subprocess.run([sys.executable, '-m', 'gpualloc', 'run', '--no-bridge', '--trace', {b!r}, {inner!r}], check=True)\n"
                )
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", a, outer])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertNotIn("ignored", out.stderr)
            from gpualloc.tracefile import records

            def sizes(path):
                return sorted(r["requested"] for r in records(path) if r["kind"] == "alloc")

            self.assertEqual(sizes(a), [2 << 20])
            # The inner run's process and its child: one file each (Note
            # [One writer per trace file]), both named after --trace's.
            inner_files = sorted(n for n in os.listdir(d) if n.startswith("inner") and n.endswith(".gtrace"))
            self.assertEqual(len(inner_files), 2, inner_files)
            got = sorted(s for n in inner_files for s in sizes(os.path.join(d, n)))
            self.assertEqual(got, [1 << 20, 3 << 20])

    def test_an_empty_trace_path_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            s = self.script(d, "print('ran')\n")
            for blank in ("", "  "):
                out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", blank, s])
                self.assertEqual(out.returncode, 2, out.stderr)
                self.assertIn("--trace: the path is empty", out.stderr)
                self.assertNotIn("ran", out.stdout)

    def test_a_launcher_is_named_with_what_to_do(self):
        with tempfile.TemporaryDirectory() as d:
            out = run(["-m", "gpualloc", "run", "--no-bridge", "-m", "torch.distributed.run", "--help"], cwd=d)
            self.assertIn("installed in those it starts on this machine", out.stderr)
            self.assertIn("gpualloc.install()", out.stderr)
            s = self.script(d, "print('plain')\n")
            out = run(["-m", "gpualloc", "run", "--no-bridge", s])
            self.assertNotIn("launcher", out.stderr)
            # deepspeed with a hostfile starts even this machine's ranks
            # through ssh, which drops what .deepspeed_env does not list.
            with open(os.path.join(d, "hf"), "w") as f:
                f.write("# two hosts\nworker-1 slots=8\nworker-2 slots=8 # the second\n")
            with open(os.path.join(d, "one"), "w") as f:
                f.write("localhost slots=2\n")
            over_ssh = [
                ["--hostfile=hf", "train.py"],
                ["-H", "hf", "--num_gpus", "8", "train.py"],
                ["--force_multi", "train.py"],
                ["--include", "worker-1:0,1@worker-2:0", "train.py"],
            ]
            local = [
                ["--num_gpus", "2", "train.py"],
                ["--hostfile", "one", "train.py"],
                ["--hostfile", "hf", "--no_ssh", "train.py"],
                ["--hostfile", "hf", "--include", "localhost:0,1", "train.py"],
                ["train.py", "--force_multi", "-H", "hf"],  # the script's own arguments
            ]
            for args in over_ssh + local:
                out = run(["-m", "gpualloc", "run", "--no-bridge", "deepspeed", *args], cwd=d)
                self.assertIn("installed in those it starts on this machine", out.stderr)
                self.assertEqual("add GPUALLOC_RUN_CHILDREN=1 there" in out.stderr, args in over_ssh, args)

    def test_a_child_whose_launcher_dropped_the_switch_says_it_runs_without_gpualloc(self):
        # PYTHONPATH still leads to run's sitecustomize, but the launcher
        # between dropped GPUALLOC_RUN_CHILDREN: said once torch is imported.
        with tempfile.TemporaryDirectory() as d:
            child = os.path.join(d, "rank.py")
            with open(child, "w") as f:
                f.write("import os\nprint('child imports')\nimport torch\nprint('child has torch')\n")
            s = self.script(
                d,
                "import os, subprocess, sys\n"
                "env = {k: v for k, v in os.environ.items() if k != 'GPUALLOC_RUN_CHILDREN'}\n"
                f"subprocess.run([sys.executable, {child!r}], env=env, check=True)\n"
                f"subprocess.run([sys.executable, '-c', 'print(1)'], env=env, check=True)\n",
            )
            out = run(["-m", "gpualloc", "run", "--no-bridge", s])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("child has torch", out.stdout)
            # Once, from the process that imported torch only.
            self.assertEqual(out.stderr.count("lacks GPUALLOC_RUN_CHILDREN=1"), 1, out.stderr)

    def test_a_second_trace_path_is_named_not_dropped_silently(self):
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "a.gtrace"), os.path.join(d, "b.gtrace")
            s = self.script(d, f"import gpualloc, torch\ngpualloc.install(trace={a!r}, bridge=False)\ngpualloc.install(trace={b!r})\n")
            out = run([s])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("ignored: a trace is already being recorded", out.stderr)
            self.assertFalse(os.path.exists(b))

    def test_a_failed_install_leaves_no_trace_running(self):
        with tempfile.TemporaryDirectory() as d:
            a = os.path.join(d, "a.gtrace")
            s = self.script(
                d,
                f"""
                import gpualloc, torch
                from gpualloc._lib import lib

                def refuse(allocator):
                    raise RuntimeError("Can't swap an already initialized allocator")

                torch.cuda.memory.change_current_allocator = refuse
                try:
                    gpualloc.install(trace={a!r}, bridge=False)
                except Exception as e:
                    print("failed", type(e).__name__)
                print("tracing", lib().is_tracing())
                """,
            )
            out = run([s])
            self.assertIn("failed", out.stdout, out.stderr)
            self.assertIn("tracing False", out.stdout, out.stderr)


def cli():
    """The `gpualloc` command: GPUALLOC_CLI, else a cargo build of this tree
    (tools/test.sh builds it before these tests run); None when absent."""
    if os.environ.get("GPUALLOC_CLI"):
        return os.environ["GPUALLOC_CLI"]
    root = os.path.dirname(SHIM)
    for target in (os.environ.get("CARGO_TARGET_DIR"), os.path.join(root, "target")):
        for profile in ("debug", "release"):
            path = os.path.join(target or "", profile, "gpualloc")
            if target and os.path.isfile(path):
                return path
    return None


class CliReadsAutoMarksTest(unittest.TestCase):
    """The marks are the iteration boundaries `gpualloc leaks` counts; the
    phases appear in `gpualloc summary`."""

    def test_leaks_counts_the_steps_and_finds_the_per_step_leak(self):
        exe = cli()
        if exe is None:
            self.skipTest("no gpualloc command built (cargo build -p gpualloc-cli)")
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "t.gtrace")
            body = textwrap.dedent(
                """
                kept = []
                model, opt = torch.nn.Module(), torch.optim.SGD()
                for _ in range(5):
                    kept.append(lib().malloc(4096, 0, 0))  # one block leaked per step
                    torch.Tensor().backward()  # two micro-batches per step (gradient accumulation)
                    torch.Tensor().backward()
                    opt.step()
                model.eval()
                model.train()
                torch.save({}, TRACE + ".ckpt")
                done()
                """
            )
            out = run(["-c", PRELUDE + body, trace])
            self.assertEqual(out.returncode, 0, out.stderr)
            leaks = subprocess.run([exe, "leaks", "--json", trace], capture_output=True, text=True, timeout=60)
            self.assertEqual(leaks.returncode, 0, leaks.stderr)
            dev = json.loads(leaks.stdout)["devices"][0]
            # Without the marks, leaks would count the 10 backward phases instead.
            self.assertEqual(dev["iterations"], 6, "5 step marks: 6 iterations")
            self.assertTrue(any(g["candidate"] and g["size"] == 4096 for g in dev["groups"]), leaks.stdout)
            summary = subprocess.run([exe, "summary", "--json", trace], capture_output=True, text=True, timeout=60)
            self.assertEqual(summary.returncode, 0, summary.stderr)
            phases = {p["name"]: p["count"] for p in json.loads(summary.stdout)["devices"][0]["phases"]}
            self.assertEqual(phases, {"backward": 10, "optimizer": 5, "eval": 1, "checkpoint": 1})


class SaidSettingsTest(unittest.TestCase):
    def test_what_run_said_survives_a_launcher_that_passes_the_environment_through_a_shell(self):
        # colossalai run writes `export NAME="value"` for each variable and
        # drops values that hold a newline: the list of settings run said
        # must come through both, whatever the settings hold.
        from gpualloc._children import said_settings, said_value

        said = [
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:128",
            'PYTORCH_ALLOC_CONF=a "quoted" $HOME `x` \\ value',
            "PYTORCH_NO_CUDA_MEMORY_CACHING=",
            "CUDA_MODULE_LOADING=line\nbreak, comma%2C",
        ]
        value = said_value(said)
        self.assertNotIn("\n", value)
        out = subprocess.run(
            ["bash", "-c", f'export SAID="{value}"; printf %s "$SAID"'], capture_output=True, text=True, check=True
        )
        self.assertEqual(said_settings(out.stdout), said)
        self.assertEqual(said_settings(""), [])
        self.assertEqual(said_settings(said_value([])), [])
        # As earlier versions wrote it: one per line.
        self.assertEqual(said_settings("A=1,2\nB=3"), ["A=1,2", "B=3"])


class RunTargetsTest(unittest.TestCase):
    def test_the_scripts_folder_goes_first_on_a_python_without_safe_path(self):
        # Python 3.9 and 3.10 have no sys.flags.safe_path (pyproject.toml
        # allows them): `run script.py` failed there with an AttributeError.
        import types
        from unittest import mock

        import gpualloc.__main__ as m

        fake = types.SimpleNamespace(path=["", "/lib"], flags=types.SimpleNamespace())
        with mock.patch.object(m, "sys", fake):
            m._path_first("/scripts")
        self.assertEqual(fake.path, ["/scripts", "/lib"])

    """`python -m gpualloc run` on a module, a console script and a PATH program."""

    def write(self, path, text):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))

    def test_the_programs_classes_pickle_after_its_body_returned(self):
        # Note [The program's __main__ stays]: exit handlers and threads
        # still running pickle the program's own classes by name in
        # __main__; runpy put the launcher's __main__ back and that failed.
        body = """
            import atexit, pickle, sys, threading, time

            class Cfg:
                lr = 0.1

            def at_exit():
                print("atexit", pickle.loads(pickle.dumps(Cfg())).lr, sys.modules["__main__"].Cfg is Cfg, flush=True)

            def later():
                time.sleep(0.2)
                print("thread", pickle.loads(pickle.dumps(Cfg())).lr, flush=True)

            atexit.register(at_exit)
            threading.Thread(target=later).start()
            def typed(x: int) -> int:
                return x

            print("body", __name__, sys.argv[1:], __spec__ is None or __spec__.name, flush=True)
            print("annotations", typed.__annotations__["x"] is int, flush=True)
            print("file", __file__ if __file__ == "<stdin>" else __file__ == __loader__.path, flush=True)
            """
        with tempfile.TemporaryDirectory() as d:
            self.write(os.path.join(d, "prog.py"), body)
            self.write(os.path.join(d, "progpkg", "__init__.py"), "")
            self.write(os.path.join(d, "progpkg", "__main__.py"), body)
            for target, stdin, spec in (
                (["prog.py"], None, "True"),
                (["-m", "progpkg"], None, "progpkg.__main__"),
                (["-"], textwrap.dedent(body), "True"),
            ):
                out = run(["-m", "gpualloc", "run", "--no-bridge", *target, "a"], cwd=d, stdin=stdin)
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertIn(f"body __main__ ['a'] {spec}", out.stdout)
                # Not the launcher's `from __future__ import annotations`.
                self.assertIn("annotations True", out.stdout)
                # __file__ and __loader__ as python gives them.
                self.assertIn("file <stdin>" if target == ["-"] else "file True", out.stdout)
                self.assertIn("thread 0.1", out.stdout, out.stderr)
                self.assertIn("atexit 0.1 True", out.stdout, out.stderr)

    def test_a_module_that_is_not_there_fails_as_python_m_does(self):
        with tempfile.TemporaryDirectory() as d:
            self.write(os.path.join(d, "nomain", "__init__.py"), "")
            out = run(["-m", "gpualloc", "run", "--no-bridge", "-m", "nomain"], cwd=d)
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertIn("'nomain' is a package and cannot be directly executed", out.stderr)

    def test_module(self):
        with tempfile.TemporaryDirectory() as d:
            self.write(
                os.path.join(d, "trainpkg", "__main__.py"),
                """
                import sys, torch
                from gpualloc._lib import lib
                lib().free(lib().malloc(1 << 20))  # device 0 exists: it records the mark
                print("argv", sys.argv[1:], __name__, sys.argv[0].endswith("__main__.py"))
                torch.optim.SGD().step()
                """,
            )
            self.write(os.path.join(d, "trainpkg", "__init__.py"), "")
            trace = os.path.join(d, "m.gtrace")
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", trace, "-m", "trainpkg", "--lr", "0.1", "-m", "x"], cwd=d)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("argv ['--lr', '0.1', '-m', 'x'] __main__ True", out.stdout)
            from gpualloc.tracefile import annotations

            self.assertIn(("mark", "step"), [(a["kind"], a["name"]) for a in annotations(trace)])
            # run passed the path on to child processes in GPUALLOC_TRACE:
            # this process still starts its own trace once, quietly.
            self.assertNotIn("tracing", out.stderr.replace("trace written", ""))

    def test_console_script_entry_point(self):
        with tempfile.TemporaryDirectory() as d:
            self.write(
                os.path.join(d, "demo_cli.py"),
                """
                import sys
                def main():
                    print("entry", sys.argv[1:], sys.argv[0])
                    # As for the generated wrapper, a script: launchers that
                    # re-run `python -m <__main__.__spec__.name>` (Lightning)
                    # must not find gpualloc's own module there.
                    print("spec", sys.modules["__main__"].__spec__)
                    return 3
                """,
            )
            self.write(os.path.join(d, "demo-0.1.dist-info", "METADATA"), "Metadata-Version: 2.1\nName: demo\nVersion: 0.1\n")
            self.write(os.path.join(d, "demo-0.1.dist-info", "entry_points.txt"), "[console_scripts]\ndemo-train = demo_cli:main\n")
            env = {"PYTHONPATH": d + os.pathsep + FAKE_TORCH + os.pathsep + SHIM}
            out = run(["-m", "gpualloc", "run", "--no-bridge", "demo-train", "train", "--epochs", "2"], env)
            self.assertEqual(out.returncode, 3, out.stderr)
            self.assertIn("entry ['train', '--epochs', '2'] demo-train", out.stdout)
            self.assertIn("spec None", out.stdout)
            # A folder of the same name in the working folder, with or
            # without a __main__.py, does not hide the console script; as a
            # path (./demo-train) it is the folder.
            self.write(os.path.join(d, "demo-train", "__main__.py"), "print('the folder ran')\n")
            out = run(["-m", "gpualloc", "run", "--no-bridge", "demo-train", "train"], env, cwd=d)
            self.assertEqual(out.returncode, 3, out.stderr)
            self.assertIn("entry ['train'] demo-train", out.stdout)
            out = run(["-m", "gpualloc", "run", "--no-bridge", os.path.join(".", "demo-train")], env, cwd=d)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("the folder ran", out.stdout)

    def test_a_process_that_never_allocates_ends_quietly_with_a_trace_asked_for(self):
        # A launcher under run, a DataLoader worker: the trace, kept for a
        # start that never came, wrote nothing, and nothing is said of it.
        with tempfile.TemporaryDirectory() as d:
            prog = os.path.join(d, "idle.py")
            self.write(prog, "import torch\nprint('idle')\n")
            env_trace = os.path.join(d, "env-{pid}.gtrace")
            for args, env in (
                (["--trace", os.path.join(d, "t.gtrace"), prog], {}),
                ([prog], {"GPUALLOC_TRACE": env_trace}),
            ):
                out = run(["-m", "gpualloc", "run", "--no-bridge", *args], env)
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertIn("idle", out.stdout)
                self.assertNotIn("trace", out.stderr.lower(), out.stderr)
            self.assertEqual(os.listdir(d), ["idle.py"])

    def test_a_double_dash_after_the_script_reaches_it(self):
        # As `python train.py -- --x` passes it on.
        with tempfile.TemporaryDirectory() as d:
            prog = os.path.join(d, "argv.py")
            self.write(prog, "import sys\nprint('argv', sys.argv[1:])\n")
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", os.path.join(d, "t.gtrace"), prog, "--", "--x", "a"])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("argv ['--', '--x', 'a']", out.stdout)

    def test_a_package_of_the_module_is_imported_after_the_install(self):
        # Looking for -m's module imports none of its packages before
        # gpualloc is installed; and under -P the user's first PYTHONPATH
        # entry stays where it is.
        with tempfile.TemporaryDirectory() as d:
            self.write(os.path.join(d, "trainpkg", "__init__.py"), "import gpualloc\nprint('installed first', bool(gpualloc.installed()))\n")
            self.write(os.path.join(d, "trainpkg", "mod.py"), "print('module ran')\n")
            out = run(["-m", "gpualloc", "run", "--no-bridge", "-m", "trainpkg.mod"], cwd=d)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("installed first True", out.stdout)
            self.assertIn("module ran", out.stdout)
            if sys.version_info < (3, 11):
                return  # -P (safe_path) is Python 3.11's
            self.write(os.path.join(d, "lib", "helper.py"), "VALUE = 'helper'\n")
            self.write(os.path.join(d, "scripts", "use.py"), "import helper\nprint('found', helper.VALUE)\n")
            env = {"PYTHONPATH": os.pathsep.join([os.path.join(d, "lib"), FAKE_TORCH, SHIM])}
            out = subprocess.run(
                [sys.executable, "-P", "-m", "gpualloc", "run", "--no-bridge", os.path.join(d, "scripts", "use.py")],
                capture_output=True, text=True, env={**os.environ, **env}, cwd=os.path.join(d, "lib"), timeout=120,
            )
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("found helper", out.stdout)

    def test_an_unknown_module_is_one_line_and_installs_nothing(self):
        out = run(["-m", "gpualloc", "run", "--no-bridge", "-m", "no_such_module_here"])
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertEqual(out.stderr.strip(), "gpualloc: cannot run: No module named no_such_module_here")

    def test_a_module_gets_its_arguments_after_a_double_dash(self):
        with tempfile.TemporaryDirectory() as d:
            self.write(os.path.join(d, "argvmod.py"), "import sys\nprint('argv', sys.argv[1:])\n")
            for tail, want in ((["a", "--", "b"], "['a', '--', 'b']"), (["--", "x"], "['--', 'x']")):
                out = run(["-m", "gpualloc", "run", "--no-bridge", "-m", "argvmod", *tail], cwd=d)
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertIn(f"argv {want}", out.stdout)

    def test_a_folder_or_zip_archive_runs_its_main_as_python_does(self):
        import zipfile

        main = """
        import os, sys
        import sibling
        print("ran", sibling.VALUE, sys.argv[1:], os.path.basename(sys.path[0]))
        """
        with tempfile.TemporaryDirectory() as d:
            app = os.path.join(d, "app")
            self.write(os.path.join(app, "__main__.py"), main)
            self.write(os.path.join(app, "sibling.py"), "VALUE = 'sibling'\n")
            archive = os.path.join(d, "app.pyz")
            with zipfile.ZipFile(archive, "w") as z:
                for name in ("__main__.py", "sibling.py"):
                    z.write(os.path.join(app, name), name)
            for target, first in ((app, "app"), (archive, "app.pyz")):
                out = run(["-m", "gpualloc", "run", "--no-bridge", target, "x"], cwd=d)
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertIn(f"ran sibling ['x'] {first}", out.stdout)
            empty = os.path.join(d, "empty")
            os.makedirs(empty)
            bare = os.path.join(d, "bare.zip")
            with zipfile.ZipFile(bare, "w") as z:
                z.writestr("other.py", "print('not run')\n")
            for target in (empty, bare):
                out = run(["-m", "gpualloc", "run", "--no-bridge", target], cwd=d)
                self.assertEqual(out.returncode, 2, out.stderr)
                self.assertEqual(out.stderr.strip(), f"gpualloc: cannot run: {target}: no __main__.py in it")

    def test_a_program_from_standard_input_runs_as_under_python_dash(self):
        program = textwrap.dedent(
            """
            import sys, torch
            from gpualloc._lib import lib
            lib().free(lib().malloc(1 << 20))  # device 0 exists: it records the mark
            import onlyhere
            print("ran", __name__, sys.argv, onlyhere.VALUE, "__file__" in globals())
            torch.optim.SGD().step()
            raise SystemExit(3)
            """
        )
        from gpualloc.tracefile import annotations

        with tempfile.TemporaryDirectory() as d:
            self.write(os.path.join(d, "onlyhere.py"), "VALUE = 'the working folder'\n")
            trace = os.path.join(d, "s.gtrace")
            argv = ["-m", "gpualloc", "run", "--no-bridge", "--trace", trace, "-", "a", "--", "b"]
            out = run(argv, cwd=d, stdin=program)
            self.assertEqual(out.returncode, 3, out.stderr)
            # __file__ is "<stdin>", as `python -` sets it.
            self.assertIn("ran __main__ ['-', 'a', '--', 'b'] the working folder True", out.stdout)
            self.assertIn(("mark", "step"), [(a["kind"], a["name"]) for a in annotations(trace)])
            # A traceback names <stdin>, as under `python -`.
            out = run(["-m", "gpualloc", "run", "--no-bridge", "-"], cwd=d, stdin="x = 1\nraise ValueError('boom')\n")
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertIn('File "<stdin>", line 2', out.stderr)
            self.assertIn("ValueError: boom", out.stderr)

    def test_the_fallback_raises_on_out_of_memory_unless_told_otherwise(self):
        # PyTorch's plain wrapper gets the entry point that throws a C++
        # exception (RuntimeError in Python) by default; abort and null on
        # request; an unknown value warns and raises.
        program = textwrap.dedent(
            """
            import warnings, torch, gpualloc
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                gpualloc.install(bridge=False)
            print("fn", torch.cuda.memory.installed[-1].alloc_fn)
            print("warned", any("GPUALLOC_FALLBACK_OOM" in str(x.message) for x in w))
            """
        )
        for value, fn, warned in ((None, "gpualloc_malloc_or_raise", False), ("abort", "gpualloc_malloc_or_abort", False),
                                  ("null", "gpualloc_malloc", False), ("crash", "gpualloc_malloc_or_raise", True)):
            with self.subTest(value=value):
                out = run(["-c", program], env_extra={"GPUALLOC_FALLBACK_OOM": value} if value else None)
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertIn(f"fn {fn}\n", out.stdout)
                self.assertIn(f"warned {warned}", out.stdout)

    def test_the_fallbacks_snapshot_has_a_trace_per_device_and_filters_by_pool(self):
        # MemoryViz indexes device_traces by device; memory_snapshot(mempool_id)
        # gives only that pool's segments.
        program = textwrap.dedent(
            """
            import torch, gpualloc
            from gpualloc._lib import lib
            print("mode", gpualloc.install(bridge=False))
            p = lib().malloc(1 << 20)
            snap = torch.cuda.memory._snapshot()
            print("traces", snap["device_traces"])
            print("segments", len(snap["segments"]), [tuple(s["segment_pool_id"]) for s in snap["segments"]])
            print("pool", len(torch.cuda.memory.memory_snapshot(mempool_id=(7, 7))))
            print("default", len(torch.cuda.memory.memory_snapshot(mempool_id=(0, 0))))
            lib().free(p)
            """
        )
        out = run(["-c", program])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("mode fallback", out.stdout)
        self.assertIn("traces [[], []]", out.stdout)
        self.assertIn("segments 1 [(0, 0)]", out.stdout)
        self.assertIn("pool 0", out.stdout)
        self.assertIn("default 1", out.stdout)  # (0, 0): every pool, as PyTorch reads it

    def test_a_script_sees_what_python_script_py_gives_it(self):
        # __file__ absolute; sys.path[0] the folder of the linked-to script,
        # and not the working folder, which `python script.py` leaves out.
        with tempfile.TemporaryDirectory() as d:
            real, link, work = (os.path.join(d, n) for n in ("real", "link", "work"))
            self.write(os.path.join(real, "sibling.py"), "VALUE = 'sibling'\n")
            self.write(os.path.join(work, "onlyhere.py"), "VALUE = 'the working folder'\n")
            self.write(
                os.path.join(real, "probe.py"),
                """
                import os, sys
                import sibling
                print("file", os.path.isabs(__file__), sibling.VALUE)
                print("path0", sys.path[0] == os.path.dirname(os.path.realpath(__file__)))
                try:
                    import onlyhere
                    print("cwd on path", True)
                except ImportError:
                    print("cwd on path", False)
                """,
            )
            os.makedirs(link)
            os.symlink(os.path.join(real, "probe.py"), os.path.join(link, "probe.py"))
            out = run(["-m", "gpualloc", "run", "--no-bridge", os.path.join("..", "link", "probe.py")], cwd=work)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("file True sibling", out.stdout)
            self.assertIn("path0 True", out.stdout)
            self.assertIn("cwd on path False", out.stdout)

    def test_the_trace_holds_what_other_threads_and_exit_handlers_allocate(self):
        # The trace is completed at exit: a thread still running when the
        # script's body ends, and an exit handler, allocate into it. A
        # relative --trace is where run was started, though the program
        # changes folder first.
        with tempfile.TemporaryDirectory() as d:
            other = os.path.join(d, "other")
            os.makedirs(other)
            prog = os.path.join(d, "late.py")
            self.write(
                prog,
                f"""
                import atexit, os, threading, time, torch
                from gpualloc._lib import lib
                os.chdir({other!r})
                def late():
                    time.sleep(0.2)
                    lib().free(lib().malloc(3 << 20, 0, 0), 0)
                atexit.register(lambda: lib().free(lib().malloc(5 << 20, 0, 0), 0))
                threading.Thread(target=late).start()
                lib().free(lib().malloc(1 << 20, 0, 0), 0)
                """,
            )
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", "t.gtrace", prog], cwd=d)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(os.listdir(other), [])
            from gpualloc.tracefile import records

            sizes = sorted(r["requested"] for r in records(os.path.join(d, "t.gtrace")) if r["kind"] == "alloc")
            self.assertEqual(sizes, [1 << 20, 3 << 20, 5 << 20])
            out = run(["-m", "gpualloc", "run", "--no-bridge", "--trace", os.path.join(d, "none", "t.gtrace"), prog])
            self.assertEqual(out.returncode, 2, out.stderr)
            self.assertIn("does not exist", out.stderr)

    def test_python_program_on_path_and_unknown_names(self):
        with tempfile.TemporaryDirectory() as d:
            prog = os.path.join(d, "bin", "tool")
            self.write(prog, "#!/usr/bin/env python3\nimport sys\nprint('tool', sys.argv[1:], __name__)\n")
            self.write(os.path.join(d, "bin", "shell-tool"), "#!/bin/sh\necho no\n")
            for p in (prog, os.path.join(d, "bin", "shell-tool")):
                os.chmod(p, 0o755)
            env = {"PATH": os.path.join(d, "bin") + os.pathsep + os.environ.get("PATH", "")}
            out = run(["-m", "gpualloc", "run", "--no-bridge", "tool", "a"], env)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("tool ['a'] __main__", out.stdout)
            out = run(["-m", "gpualloc", "run", "shell-tool"], env)
            self.assertEqual(out.returncode, 2)
            self.assertIn("is not a Python program", out.stderr)
            out = run(["-m", "gpualloc", "run", "no-such-tool-xyz"], env)
            self.assertEqual(out.returncode, 2)
            self.assertIn("no-such-tool-xyz: no such file, console script entry point or Python program on PATH", out.stderr)
            out = run(["-m", "gpualloc", "run", "-m"], env)
            self.assertEqual(out.returncode, 2)
            self.assertIn("-m needs a module name", out.stderr)


if __name__ == "__main__":
    unittest.main()
