"""A trace survives SIGTERM (Note [Completing a trace on SIGTERM] in
``capi/src/sigterm.rs``), each case in a process of its own."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import unittest

from gpualloc import tracefile

from . import __name__ as _env  # noqa: F401

SHIM = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

END = tracefile.END
block_kinds = tracefile.block_kinds

PRELUDE = """
import os, signal, sys, time
from gpualloc._lib import lib
L = lib()
"""


def run(code, *args):
    env = os.environ.copy()
    env["PYTHONPATH"] = SHIM + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


class SigtermTest(unittest.TestCase):
    def test_sigterm_completes_the_trace_and_still_ends_the_process(self):
        # The main thread waits in C (a sleep, as a hung collective would):
        # the library's own thread completes the trace and ends the process.
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "t.gtrace")
            out = run(
                """
                L.trace_start(sys.argv[1])
                for _ in range(1000):
                    L.free(L.malloc(4096))
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(60)
                print("not ended")
                """,
                trace,
            )
            self.assertEqual(out.returncode, -signal.SIGTERM, out.stdout + out.stderr)
            self.assertNotIn("not ended", out.stdout)
            self.assertEqual(block_kinds(trace)[-1], END, "the trace ends with its END block")
            allocs = [r for r in tracefile.records(trace) if r["kind"] == "alloc"]
            self.assertEqual(len(allocs), 1000)

    def test_a_forked_child_ends_on_sigterm_and_leaves_its_parent_alone(self):
        # The child has not the library's thread: the default action is back.
        with tempfile.TemporaryDirectory() as d:
            out = run(
                """
                L.trace_start(sys.argv[1])
                L.free(L.malloc(4096))
                ended = []
                t = time.time()
                # SIGTERM at once, often before the fork's child handler ran:
                # the inherited handler must not wake the parent's thread.
                for _ in range(8):
                    pid = os.fork()
                    if pid == 0:
                        time.sleep(60)
                        os._exit(0)
                    os.kill(pid, signal.SIGTERM)
                    _, status = os.waitpid(pid, 0)
                    ended.append(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
                print("children", all(ended), time.time() - t < 30)
                time.sleep(0.5)
                L.free(L.malloc(4096))
                print("parent alive, tracing", L.is_tracing())
                """,
                os.path.join(d, "t.gtrace"),
            )
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("children True True", out.stdout)
            self.assertIn("parent alive, tracing True", out.stdout)

    def test_a_trace_started_on_a_running_allocator_is_completed_too(self):
        # configure() with a path once the allocator runs (what
        # gpualloc.trace_start and a second install(trace=...) call).
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "t.gtrace")
            out = run(
                """
                L.free(L.malloc(4096))
                L.configure(None, sys.argv[1])
                for _ in range(100):
                    L.free(L.malloc(4096))
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(60)
                print("not ended")
                """,
                trace,
            )
            self.assertEqual(out.returncode, -signal.SIGTERM, out.stdout + out.stderr)
            self.assertEqual(block_kinds(trace)[-1], END, "the trace ends with its END block")
            allocs = [r for r in tracefile.records(trace) if r["kind"] == "alloc"]
            self.assertEqual(len(allocs), 100)

    def test_a_handler_the_program_installed_first_is_kept(self):
        with tempfile.TemporaryDirectory() as d:
            out = run(
                """
                signal.signal(signal.SIGTERM, lambda *_: print("own handler", flush=True))
                L.trace_start(sys.argv[1])
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)
                print("went on", L.trace_stop()["events"] >= 0)
                """,
                os.path.join(d, "t.gtrace"),
            )
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("own handler", out.stdout)
            self.assertIn("went on True", out.stdout)


class ForkedWorkerTest(unittest.TestCase):
    def test_a_fork_started_workers_trace_is_completed_when_it_ends(self):
        # As under Lightning's ddp_fork/ddp_notebook or mp.Process with the
        # fork start method: install() ran in the parent (no CUDA yet), each
        # worker starts the allocator and its own trace ({pid}), returns, and
        # multiprocessing ends it with os._exit, past every exit handler.
        with tempfile.TemporaryDirectory() as d:
            out = run(
                """
                import multiprocessing as mp
                from gpualloc import _torch
                L.configure(None, os.path.join(sys.argv[1], "run-{pid}.gtrace"))
                _torch._complete_trace_in_workers(L)  # what install() does
                def worker():
                    for _ in range(100):
                        L.free(L.malloc(4096))
                if __name__ == "__main__":
                    p = mp.get_context("fork").Process(target=worker)
                    p.start()
                    p.join()
                    print("exit", p.exitcode)
                """,
                d,
            )
            self.assertIn("exit 0", out.stdout, out.stdout + out.stderr)
            (name,) = os.listdir(d)
            kinds = block_kinds(os.path.join(d, name))
            self.assertEqual(kinds[-1:], [END], f"the worker's trace ends with its END block: {kinds}")


if __name__ == "__main__":
    unittest.main()
