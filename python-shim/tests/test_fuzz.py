"""Random sequences of the Python API, each case in its own process (``fuzz_worker.py``).

A case passes when its process exits with status 0 after printing ``FUZZ
OK``: no crash, only documented exceptions (GpuallocError, ValueError,
TypeError), ``check_invariants`` after every call. CI runs a bounded number
of cases (a few seconds); for hours::

    GPUALLOC_FUZZ_CASES=100000 GPUALLOC_FUZZ_SEED=$RANDOM \\
    GPUALLOC_LIBRARY=$PWD/target/release/libgpualloc.so PYTHONPATH=$PWD/python-shim \\
    python3 -m unittest discover -s python-shim/tests -t python-shim -p test_fuzz.py

``GPUALLOC_FUZZ_SEED`` picks another sequence of cases; a failure names the
seed, the case's arguments and its last calls.
"""

import ctypes
import os
import subprocess
import sys
import tempfile
import unittest

from . import __name__ as _env  # noqa: F401

import gpualloc
from gpualloc import GpuallocError
from gpualloc._lib import ERR_INVALID_DEVICE, ERR_INVALID_POINTER, lib
from gpualloc.tracefile import annotations

MiB = 1 << 20

SHIM = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_worker.py")

CI_CASES = 24
CALLS = 500


def run_case(seed: int, calls: int, threads: int, d: str) -> subprocess.CompletedProcess:
    env = os.environ.copy()
    env["PYTHONPATH"] = SHIM + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, WORKER, str(seed), str(calls), str(threads), d],
        capture_output=True,
        text=True,
        errors="replace",
        env=env,
        timeout=300,
    )


class FuzzTest(unittest.TestCase):
    def test_random_api_call_sequences(self):
        cases = int(os.environ.get("GPUALLOC_FUZZ_CASES", CI_CASES))
        seed0 = int(os.environ.get("GPUALLOC_FUZZ_SEED", 0x5EED))
        for case in range(cases):
            seed = (seed0 * 1_000_003 + case) % (1 << 62)
            threads = (1, 1, 2, 4)[case % 4]
            with tempfile.TemporaryDirectory() as d:
                out = run_case(seed, CALLS, threads, d)
            self.assertTrue(
                out.returncode == 0 and out.stdout.rstrip().endswith("FUZZ OK"),
                f"case {case} (GPUALLOC_FUZZ_SEED={seed0}): python {WORKER} {seed} {CALLS} {threads} DIR "
                f"exited with {out.returncode}\n{out.stdout[-6000:]}\nstderr: {out.stderr[-3000:]}",
            )

    def test_the_worker_can_fail(self):
        # A worker whose invariant check is broken must fail the case, so a
        # passing run above means something.
        code = (
            "import sys, runpy; sys.argv = [%r, '1', '20', '1', %r];"
            "import gpualloc._lib as l; l.Library.check_invariants = lambda self, d=0: (_ for _ in ()).throw(l.GpuallocError('forced', -14));"
            "runpy.run_path(%r, run_name='__main__')"
        )
        with tempfile.TemporaryDirectory() as d:
            env = os.environ.copy()
            env["PYTHONPATH"] = SHIM + os.pathsep + env.get("PYTHONPATH", "")
            out = subprocess.run([sys.executable, "-c", code % (WORKER, d, WORKER)], capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("FAILED", out.stdout)
        self.assertIn("forced", out.stdout)


class FoundByTheFuzzerTest(unittest.TestCase):
    """Regressions: each of these once wrapped silently, reached ctypes
    (``ctypes.ArgumentError``, an undocumented exception) or ``pool[0]``
    (IndexError), or turned a value into another."""

    def test_a_device_beyond_a_c_int_is_invalid_not_device_0(self):
        # ctypes kept the low 32 bits: malloc(..., 2**32) allocated on device 0,
        # stats(2**40) read device 0, reset_peak_stats(2**32) reset it.
        before = gpualloc.stats(0)["allocation.all.allocated"]
        for call in (
            lambda: lib().malloc(4096, 1 << 32),
            lambda: gpualloc.stats(1 << 40),
            lambda: gpualloc.reset_peak_stats(1 << 32),
            lambda: gpualloc.snapshot("cuda:4294967296"),
            lambda: gpualloc.set_memory_fraction(0.5, -(1 << 32)),
            lambda: lib().create_or_incref_pool((7, 7), 1 << 32),
            lambda: lib().check_invariants(1 << 32),
        ):
            with self.assertRaises(GpuallocError) as cm:
                call()
            self.assertEqual(cm.exception.code, ERR_INVALID_DEVICE)
        self.assertEqual(gpualloc.stats(0)["allocation.all.allocated"], before)
        self.assertEqual(lib().memory_fraction(0), 1.0)

    def test_device_arguments_that_are_no_device(self):
        # 1.5, "gpu" and "cpu" meant the current device; "cuda:1:2" device 1.
        for bad in (1.5, [1], True):
            with self.assertRaises(TypeError):
                gpualloc.stats(bad)
        for bad in ("gpu", "cpu", "", "cuda:", "cuda:x", "cuda:1:2", "cuda:-1", "cuda: 1"):
            with self.assertRaises(ValueError, msg=bad):
                gpualloc.set_memory_fraction(0.5, bad)
        self.assertEqual(lib().memory_fraction(0), 1.0)
        self.assertEqual(lib().memory_fraction(1), 1.0)
        with self.assertRaises(TypeError):
            lib().malloc(4096, "0")

    def test_pointers_and_streams_ctypes_would_wrap_or_take_the_address_of(self):
        p = lib().malloc(MiB, 0)
        try:
            # 2**64 wrapped to NULL: a silent no-op instead of an error.
            for bad in (1 << 64, p + (1 << 64), -1, -p):
                with self.assertRaises(ValueError):
                    lib().free(bad)
                with self.assertRaises(ValueError):
                    lib().record_stream(bad, 0)
            # A str or bytes was passed as the address of its characters.
            for bad in ("x", b"x", 1.5, [p]):
                with self.assertRaises(TypeError):
                    lib().free(bad)
                with self.assertRaises(TypeError):
                    lib().record_stream(p, bad)
            with self.assertRaises(ValueError):
                lib().malloc(4096, 0, 1 << 64)
            with self.assertRaises(ValueError):
                lib().malloc(4096, 0, -1)
            lib().record_stream(p, None)  # the default stream
            lib().check_invariants(0)
        finally:
            lib().free(p)
        with self.assertRaises(GpuallocError) as cm:
            lib().free(p)
        self.assertEqual(cm.exception.code, ERR_INVALID_POINTER)

    def test_fractions_that_are_not_numbers(self):
        for bad in ("0.5", None, b"1", True, object()):
            with self.assertRaises(TypeError, msg=repr(bad)):
                gpualloc.set_memory_fraction(bad, 1)
        with self.assertRaises(ValueError):
            gpualloc.set_memory_fraction(10**400, 1)  # beyond a double
        with self.assertRaises(GpuallocError):
            gpualloc.set_memory_fraction(float("nan"), 1)
        gpualloc.set_memory_fraction(1, 1)  # an int is a number
        self.assertEqual(lib().memory_fraction(1), 1.0)

    def test_pool_ids(self):
        # (-1, 0) wrapped to (2**64-1, 0); (1,) was an IndexError; ("a", "b") a ctypes.ArgumentError.
        for bad in ((-1, 0), (1 << 64, 0)):
            with self.assertRaises(ValueError):
                lib().create_or_incref_pool(bad, 1)
        for bad in ((1,), (1, 2, 3), None, ("a", "b"), (1.0, 2), 5):
            for fn in (lib().create_or_incref_pool, lib().pool_use_count, lib().empty_pool_cache, lib().pool_live_allocations):
                with self.assertRaises(TypeError, msg=f"{fn.__name__}({bad!r})"):
                    fn(bad, 1)
        self.assertEqual(lib().pool_use_count(((1 << 64) - 1, 0), 1), 0)
        self.assertEqual(lib().pool_use_count([3, 4], 1), 0)

    def test_bytes_paths_and_names_are_used_as_they_are(self):
        # trace_start(b"t.gtrace") wrote to a file named "b't.gtrace'", and
        # mark(b"x") recorded the name "b'x'".
        with tempfile.TemporaryDirectory() as d:
            cwd = os.getcwd()
            os.chdir(d)
            try:
                lib().free(lib().malloc(4096))  # a mark is recorded on the devices created so far
                gpualloc.trace_start(b"t.gtrace")
                gpualloc.mark(b"bytes mark")
                with gpualloc.phase(b"bytes phase"):
                    pass
                with self.assertRaises(ValueError):
                    gpualloc.phase(b"\xff")
                with self.assertRaisesRegex(GpuallocError, "not valid UTF-8"):
                    gpualloc.mark(b"\xff")
                with self.assertRaises(ValueError):
                    gpualloc.mark("\udcff")  # a lone surrogate has no UTF-8
                lib().free(lib().malloc(4096))
                gpualloc.trace_stop()
            finally:
                os.chdir(cwd)
            self.assertEqual(os.listdir(d), ["t.gtrace"])
            names = [(a["kind"], a["name"]) for a in annotations(os.path.join(d, "t.gtrace")) if a["device"] == 0]
            self.assertEqual(names, [("mark", "bytes mark"), ("phase_push", "bytes phase"), ("phase_pop", "bytes phase")])

    def test_a_trace_path_need_not_be_utf8(self):
        # A Linux path is bytes: trace_start refused one that is not UTF-8
        # ("path is not valid UTF-8"), though GPUALLOC_TRACE takes it.
        with tempfile.TemporaryDirectory() as d:
            raw = os.fsencode(d) + b"/caf\xe9-{pid}.gtrace"
            gpualloc.trace_start(raw)
            lib().free(lib().malloc(4096))
            gpualloc.trace_stop()
            self.assertEqual(os.listdir(os.fsencode(d)), [b"caf\xe9-%d.gtrace" % os.getpid()])
            # The same path as os.listdir gives it in str (surrogateescape).
            gpualloc.trace_start(os.path.join(d, os.fsdecode(b"\xff.gtrace")))
            gpualloc.trace_stop()
            self.assertIn(b"\xff.gtrace", os.listdir(os.fsencode(d)))

    def test_ctypes_never_reaches_the_caller(self):
        # The checks above raise before ctypes converts anything.
        with self.assertRaises(TypeError) as cm:
            lib().free(1.5)
        self.assertNotIsInstance(cm.exception, ctypes.ArgumentError)


if __name__ == "__main__":
    unittest.main()
