"""GPUALLOC_LOG: the allocator's decisions on stderr, off by default."""

import os
import tempfile
import unittest

from . import __name__ as _env  # noqa: F401
from .test_process import run

# Grows segments, runs out of memory after the retries, flushes the cache, traces.
CODE = """
import gpualloc
from gpualloc._lib import lib
L = lib()
L.trace_start(TRACE)
a = L.malloc(40 << 20)
L.free(L.malloc(100 << 20))  # cached: the retries release it
try:
    L.malloc(480 << 20)  # fits the 512 MiB device, but not beside the 40 MiB block
except gpualloc.GpuallocError:
    print("oom raised")
L.free(a)
gpualloc.empty_cache()
L.trace_stop()
"""


class LogTest(unittest.TestCase):
    def go(self, level, conf="policy:pytorch"):
        with tempfile.TemporaryDirectory() as d:
            code = f"TRACE = {os.path.join(d, 't.gtrace')!r}\n" + CODE
            env = {"GPUALLOC_SIM_CAPACITY": "512MiB", "GPUALLOC_CONF": conf}
            if level is not None:
                env["GPUALLOC_LOG"] = level
            out = run(["-c", code], env, drop=() if level is not None else ("GPUALLOC_LOG",))
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("oom raised", out.stdout)
        return out.stderr

    def test_info_shows_retries_flushes_and_the_trace(self):
        err = self.go("info")
        for line in (
            "allocator started",
            "trace started",
            "device full: releasing oversize cached blocks, then retrying",
            "device full: freeing every cached segment, then retrying",
            "out of memory after the retries",
            "cache flushed (empty_cache)",
            "trace stopped on request",
        ):
            self.assertIn(line, err)
        self.assertNotIn("new segment", err, "debug events stay hidden at info")

    def test_debug_adds_segment_growth(self):
        err = self.go("DEBUG")
        self.assertIn("new segment", err)
        self.assertIn("bytes=41943040", err)

    def test_off_by_default_and_a_bad_level_is_named(self):
        self.assertEqual(self.go(None), "")
        err = self.go("loud")
        self.assertIn("GPUALLOC_LOG=`loud` is not a level", err)
        self.assertNotIn("allocator started", err)


if __name__ == "__main__":
    unittest.main()
