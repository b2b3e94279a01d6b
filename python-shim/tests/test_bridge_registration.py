"""The bridge's bookkeeping for NCCL's buffer registration: the announced
ranges (bridge/registration.h), which keep the registrations equal to
gpualloc's mapped memory, and the segments' order (bridge/segment_order.h),
by which register_mem_pool registers a MemPool's segments. Compiled with the
system's C++ compiler; SKIPPED without one."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
BRIDGE_DIR = os.path.join(os.path.dirname(HERE), "gpualloc")


class AnnouncedRangesTest(unittest.TestCase):
    def run_program(self, name):
        """Compiles tests/cpp/NAME.cpp against the bridge's headers and runs it."""
        cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
        if cxx is None:
            print("\nSKIPPED: no C++ compiler", flush=True)
            self.skipTest("no C++ compiler")
        with tempfile.TemporaryDirectory() as d:
            exe = os.path.join(d, name)
            src = os.path.join(HERE, "cpp", name + ".cpp")
            subprocess.run([cxx, "-std=c++17", "-O1", "-I", BRIDGE_DIR, src, "-o", exe], check=True)
            p = subprocess.run([exe], capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("ok", p.stdout)

    def test_registrations_track_mapped_memory(self):
        self.run_program("registration_test")

    def test_segments_are_numbered_in_the_order_their_memory_came(self):
        self.run_program("segment_order_test")


if __name__ == "__main__":
    unittest.main()
