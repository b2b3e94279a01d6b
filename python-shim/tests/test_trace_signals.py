"""A trace survives the signals that end a process (Note [Completing a
trace on SIGTERM] in ``_lib.py``), each case in a process of its own."""

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

END = 4  # the END block's kind (docs/trace-format.md)


def run(code, *args, env_extra=None):
    env = os.environ.copy()
    env["PYTHONPATH"] = SHIM + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, env=env, timeout=120
    )


def block_kinds(path):
    """The kinds of the file's blocks, in order (`BK`, kind, flags, device,
    length, crc, then the payload)."""
    with open(path, "rb") as f:
        data = f.read()
    kinds, pos = [], data.find(b"BK")
    while 0 <= pos < len(data):
        assert data[pos : pos + 2] == b"BK", pos
        kinds.append(data[pos + 2])
        pos += 16 + int.from_bytes(data[pos + 8 : pos + 12], "little")
    return kinds


# Records 1000 allocations and a mark, far less than a buffer, then sends
# itself SIGTERM; what follows the kill must not run.
RECORD_AND_TERMINATE = """
    import os, signal, sys, time
    from gpualloc._lib import lib
    L = lib()
    if len(sys.argv) > 1:
        L.trace_start(sys.argv[1])
    for _ in range(1000):
        L.free(L.malloc(4096))
    L.mark("just before the kill")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
    print("still running")
"""


class SigtermTest(unittest.TestCase):
    def check_complete(self, out, path):
        self.assertEqual(out.returncode, -signal.SIGTERM, out.stderr)
        self.assertNotIn("still running", out.stdout)
        self.assertEqual(block_kinds(path)[-1:], [END], "the last block is END")
        recs = tracefile.records(path)
        self.assertEqual(sum(r["kind"] == "alloc" for r in recs), 1000)
        marks = [a["name"] for a in tracefile.annotations(path) if a["kind"] == "mark"]
        self.assertEqual(marks, ["just before the kill"])

    def test_a_trace_started_from_python_is_completed_on_sigterm(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "term.gtrace")
            out = run(RECORD_AND_TERMINATE, path)
            self.check_complete(out, path)

    def test_a_trace_from_the_environment_is_completed_on_sigterm(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "env.gtrace")
            out = run(RECORD_AND_TERMINATE, env_extra={"GPUALLOC_TRACE": path})
            self.check_complete(out, path)

    def test_a_handler_the_program_installed_is_left_alone(self):
        code = """
            import signal, sys
            from gpualloc._lib import lib
            def mine(signum, frame):
                pass
            signal.signal(signal.SIGTERM, mine)
            lib().trace_start(sys.argv[1])
            print("kept", signal.getsignal(signal.SIGTERM) is mine)
            lib().trace_stop()
        """
        with tempfile.TemporaryDirectory() as d:
            out = run(code, os.path.join(d, "t.gtrace"))
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("kept True", out.stdout)

    def test_no_handler_without_a_trace_or_off_the_main_thread(self):
        code = """
            import signal, sys, threading
            from gpualloc._lib import lib
            L = lib()
            L.free(L.malloc(4096))
            print("untraced", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
            t = threading.Thread(target=L.trace_start, args=(sys.argv[1],))
            t.start(); t.join()
            print("from a thread", L.is_tracing(), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
            L.trace_stop()
        """
        with tempfile.TemporaryDirectory() as d:
            out = run(code, os.path.join(d, "t.gtrace"))
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("untraced True", out.stdout)
        self.assertIn("from a thread True True", out.stdout)


if __name__ == "__main__":
    unittest.main()
