"""Behaviour that needs a fresh process: start-up errors and `python -m gpualloc`."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

from gpualloc import tracefile

from . import __name__ as _env  # noqa: F401

SHIM = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, env_extra=None, drop=(), cwd=None):
    env = os.environ.copy()
    env["PYTHONPATH"] = SHIM + os.pathsep + env.get("PYTHONPATH", "")
    for k in drop:
        env.pop(k, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


class ProcessTest(unittest.TestCase):
    def test_summary_starts_nothing(self):
        # As stats(): a summary before the first use starts neither the
        # allocator nor the driver (Note [Starting on first use]).
        code = textwrap.dedent(
            """
            import gpualloc
            from gpualloc._lib import lib
            text = gpualloc.summary(0)
            print("started", lib().is_initialized(), "not started" in text)
            """
        )
        out = run(["-c", code])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("started False True", out.stdout)

    def test_bad_config_names_the_key(self):
        code = textwrap.dedent(
            """
            import gpualloc
            from gpualloc._lib import ERR_CONFIG
            try:
                gpualloc.backend()
            except gpualloc.GpuallocError as e:
                print("code", e.code == ERR_CONFIG, e)
            """
        )
        out = run(["-c", code], {"GPUALLOC_CONF": "no_such_key:3"})
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("code True", out.stdout)
        self.assertIn("no_such_key", out.stdout)

    def test_a_forked_child_leaves_the_parents_trace_alone(self):
        # Note [Traces across fork]: the child has no writer thread; its
        # exit handlers must neither hang nor panic, and the parent's trace
        # stays whole. A trace the child starts is its own.
        code = textwrap.dedent(
            """
            import os, sys
            from gpualloc import tracefile
            from gpualloc._lib import lib
            path, child_path = sys.argv[1], sys.argv[2]
            L = lib()
            L.trace_start(path)
            p = L.malloc(1 << 20, 0, 0)
            pid = os.fork()
            if pid == 0:
                print("child tracing", L.is_tracing(), flush=True)
                # Enough events to fill the inherited channel, which nothing
                # in the child reads: letting go of it must not wait.
                for _ in range(150_000):
                    L.free(L.malloc(2 << 20, 0, 0), 0)
                L.phase_push("child")
                L.trace_start(child_path)
                L.free(L.malloc(3 << 20, 0, 0), 0)
                sys.exit(0)  # exit handlers run
            _, status = os.waitpid(pid, 0)
            L.free(p, 0)
            L.trace_stop()
            sizes = [r["requested"] for r in tracefile.records(path) if r["kind"] == "alloc"]
            print("child exit", os.waitstatus_to_exitcode(status), "parent allocs", sizes)
            sizes = [r["requested"] for r in tracefile.records(child_path) if r["kind"] == "alloc"]
            print("child allocs", sizes)
            """
        )
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "parent.gtrace"), os.path.join(d, "child.gtrace")
            out = run(["-c", code, a, b])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("child tracing False", out.stdout)
        self.assertIn(f"child exit 0 parent allocs [{1 << 20}]", out.stdout)
        self.assertIn(f"child allocs [{3 << 20}]", out.stdout)
        self.assertNotIn("panicked", out.stderr)

    def test_a_failed_start_in_a_forked_child_leaves_no_inherited_buffers(self):
        # Note [Traces across fork]: a start that fails in the child lets go
        # of the parent's buffers all the same, so the next start records
        # the child's events, and its stop does not wait on the inherited
        # channel (full here, and read by nothing in the child).
        code = textwrap.dedent(
            """
            import faulthandler, os, signal, sys
            from gpualloc import tracefile
            from gpualloc._lib import lib, GpuallocError
            path, child_path = sys.argv[1], sys.argv[2]
            L = lib()
            L.trace_start(path)
            L.free(L.malloc(1 << 20, 0, 0), 0)
            pid = os.fork()
            if pid == 0:
                # A hang shows where the child waits (the call, on stderr),
                # then the alarm ends it (exit -14).
                faulthandler.dump_traceback_later(15)
                signal.alarm(20)
                try:
                    L.trace_start(os.path.join(os.path.dirname(path), "no-such-dir", "x.gtrace"))
                    print("child: the start did not fail", flush=True)
                except GpuallocError:
                    pass
                L.trace_start(child_path)
                for _ in range(200_000):
                    L.free(L.malloc(1 << 20, 0, 0), 0)
                s = L.trace_stop()
                allocs = sum(r["kind"] == "alloc" for r in tracefile.records(child_path))
                print("child allocs", allocs, "dropped", s["dropped"], flush=True)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            print("child exit", os.waitstatus_to_exitcode(status))
            L.trace_stop()
            """
        )
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "parent.gtrace"), os.path.join(d, "child.gtrace")
            out = run(["-c", code, a, b])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertNotIn("did not fail", out.stdout)
        self.assertIn("child allocs 200000 dropped 0", out.stdout, out.stderr)
        self.assertIn("child exit 0", out.stdout, out.stderr)

    def test_a_child_forked_during_trace_calls_does_not_hang_in_its_own(self):
        # Note [Trace control across fork]: threads flush and open phases in
        # a loop (holding the library's control lock and the Python phase
        # lock most of the time) while the main thread forks; each child
        # marks and opens a phase at once, and must not wait for a lock
        # held by a thread it does not have.
        code = textwrap.dedent(
            """
            import os, signal, sys, threading, time
            import gpualloc
            from gpualloc._lib import lib
            L = lib()
            L.trace_start(sys.argv[1])
            stop = False
            def flush():
                while not stop:
                    L.trace_flush()
            def phases():
                while not stop:
                    with gpualloc.phase("background"):
                        pass
            for f in (flush, phases):
                threading.Thread(target=f, daemon=True).start()
            time.sleep(0.1)
            pids = []
            for _ in range(40):
                pid = os.fork()
                if pid == 0:
                    signal.alarm(5)  # a hang ends the child (exit -14)
                    L.mark("in child")
                    with gpualloc.phase("eval"):
                        pass
                    os._exit(0)
                pids.append(pid)
                time.sleep(0.002)
            codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
            stop = True
            print("hung", sum(c != 0 for c in codes), "of", len(codes))
            L.trace_stop()
            """
        )
        with tempfile.TemporaryDirectory() as d:
            out = run(["-c", code, os.path.join(d, "t.gtrace")])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("hung 0 of 40", out.stdout)

    def test_info_names_a_bad_configuration_not_a_missing_backend(self):
        out = run(["-m", "gpualloc", "info"], {"GPUALLOC_CONF": "bogus:1"})
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn("backend: not started (the configuration is invalid)", out.stdout)
        self.assertTrue(out.stderr.startswith("gpualloc: config: `bogus`"), out.stderr)

    def test_no_cuda_is_a_clear_message_not_a_traceback(self):
        # This machine's backend is CUDA when GPUALLOC_BACKEND is unset; without
        # a driver, gpualloc must say so plainly.
        if os.path.exists("/dev/nvidiactl"):
            self.skipTest("a CUDA device may be present")
        out = run(["-c", "import gpualloc; print('backend', gpualloc.backend())"], drop=("GPUALLOC_BACKEND",))
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("backend unavailable", out.stdout)
        out = run(["-m", "gpualloc", "info"], drop=("GPUALLOC_BACKEND",))
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertNotIn("Traceback", out.stderr)
        self.assertIn("backend: unavailable", out.stdout)
        self.assertIn("CUDA", out.stderr)
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "s.py")
            with open(script, "w") as f:
                f.write("print('script ran')\n")
            out = run(["-m", "gpualloc", "run", script], drop=("GPUALLOC_BACKEND",))
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertNotIn("Traceback", out.stderr)
        self.assertNotIn("script ran", out.stdout)
        self.assertIn("gpualloc: cannot start", out.stderr)

    def test_init_with_a_config_string(self):
        code = textwrap.dedent(
            """
            import gpualloc
            from gpualloc._lib import lib
            try:
                lib().init("max_split_size_mb:1")
            except gpualloc.GpuallocError as e:
                print("rejected:", e)
            lib().init("max_split_size_mb:64")
            print("max_split_size", gpualloc.stats(0)["max_split_size"])
            """
        )
        out = run(["-c", code])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("rejected:", out.stdout)
        self.assertIn("max_split_size_mb", out.stdout)
        self.assertIn(f"max_split_size {64 << 20}", out.stdout)

    def test_missing_library_is_explained(self):
        out = run(["-c", "import gpualloc; gpualloc.stats()"], {"GPUALLOC_LIBRARY": "/nonexistent/libgpualloc.so"})
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("LibraryNotFound", out.stderr)
        self.assertIn("/nonexistent/libgpualloc.so", out.stderr)

    def test_a_folder_as_the_library_is_named_a_folder(self):
        # "no such file" for a folder that exists sends the user looking for
        # a path that is there; the folder itself is what is wrong.
        with tempfile.TemporaryDirectory() as d:
            out = run(["-c", "import gpualloc; gpualloc.stats()"], {"GPUALLOC_LIBRARY": d})
        self.assertNotEqual(out.returncode, 0)
        self.assertIn(f"GPUALLOC_LIBRARY={d!r} is a folder", out.stderr)
        self.assertNotIn("no such file", out.stderr)

    def test_run_without_a_library_says_so_only(self):
        # Without torch, run must not claim the allocator is loaded when the
        # library could not be.
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "s.py")
            with open(script, "w") as f:
                f.write("print('script ran')\n")
            out = run(["-m", "gpualloc", "run", script], {"GPUALLOC_LIBRARY": "/nonexistent/libgpualloc.so"})
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertNotIn("script ran", out.stdout)
        self.assertNotIn("Traceback", out.stderr)
        self.assertIn("gpualloc: cannot start: GPUALLOC_LIBRARY='/nonexistent/libgpualloc.so'", out.stderr)
        self.assertNotIn("is loaded", out.stderr)

    def test_info(self):
        out = run(["-m", "gpualloc", "info"])
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("backend: sim", out.stdout)

    def test_run_passes_arguments_exit_code_and_writes_the_trace(self):
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "train.py")
            with open(script, "w") as f:
                f.write(
                    textwrap.dedent(
                        """
                        import sys
                        import gpualloc
                        from gpualloc._lib import lib
                        print("argv", sys.argv[1:], __name__)
                        with gpualloc.phase("step"):
                            lib().free(lib().malloc(1 << 20))
                        sys.exit(3)
                        """
                    )
                )
            trace = os.path.join(d, "run.gtrace")
            out = run(["-m", "gpualloc", "run", "--trace", trace, script, "--lr", "0.1"])
            self.assertEqual(out.returncode, 3, out.stderr)
            self.assertIn("argv ['--lr', '0.1'] __main__", out.stdout)
            self.assertTrue(os.path.isfile(trace) and os.path.getsize(trace) > 0)
            self.assertIn("trace written", out.stderr)

    def test_the_environments_trace_wins_over_run_trace_without_torch(self):
        # README: GPUALLOC_TRACE, when set, wins over --trace (with a
        # warning); without torch too, the program runs and the
        # environment's trace is written, not --trace's.
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "s.py")
            with open(script, "w") as f:
                f.write("from gpualloc._lib import lib\nlib().free(lib().malloc(1 << 20))\nprint('script ran')\n")
            a, b = os.path.join(d, "a.gtrace"), os.path.join(d, "b.gtrace")
            out = run(["-m", "gpualloc", "run", "--trace", b, script], env_extra={"GPUALLOC_TRACE": a})
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("script ran", out.stdout)
            self.assertIn("ignored", out.stderr)
            self.assertTrue(os.path.isfile(a) and os.path.getsize(a) > 0, out.stderr)
            self.assertFalse(os.path.exists(b), out.stderr)

    def test_a_trace_started_by_the_environment_is_closed_at_exit(self):
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "env.gtrace")
            code = "from gpualloc._lib import lib\nL = lib()\nL.free(L.malloc(4096))\n"
            out = run(["-c", code], env_extra={"GPUALLOC_TRACE": trace})
            self.assertEqual(out.returncode, 0, out.stderr)
            tracefile.records(trace)  # every block reads back
            kinds = tracefile.block_kinds(trace)
            self.assertEqual(kinds[-1], tracefile.END, f"the last block is END (kinds {kinds})")
            self.assertIn(tracefile.EVENTS, kinds, "events were written")

    def test_devices_created_during_phases_record_them_balanced(self):
        # Note [Phases of a device that joins]: a device created while
        # another thread pushes and pops a phase records each push and pop
        # once (it used to record a push twice, or a pop of nothing).
        code = textwrap.dedent(
            """
            import sys, threading
            from gpualloc._lib import lib
            from gpualloc import tracefile
            L = lib(); L.init(None)
            L.trace_start(sys.argv[1])
            done = False
            def phases():
                while not done:
                    L.phase_push("p"); L.phase_pop()
            t = threading.Thread(target=phases); t.start()
            for d in range(L.device_count()):
                L.free(L.malloc(4096, d), d)
            done = True; t.join()
            L.trace_stop()
            bal = {}
            for a in tracefile.annotations(sys.argv[1]):
                step = {"phase_push": 1, "phase_pop": -1}.get(a["kind"], 0)
                bal[a["device"]] = bal.get(a["device"], 0) + step
            print("unbalanced", {d: b for d, b in bal.items() if b})
            """
        )
        with tempfile.TemporaryDirectory() as d:
            for i in range(3):
                trace = os.path.join(d, f"join-{i}.gtrace")
                out = run(["-c", code, trace], env_extra={"GPUALLOC_SIM_DEVICES": "64"})
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertIn("unbalanced {}", out.stdout)


if __name__ == "__main__":
    unittest.main()
