"""The bridge's announced-range bookkeeping (bridge/registration.h), which
keeps NCCL's buffer registrations equal to gpualloc's mapped memory.
Compiled with the system's C++ compiler; SKIPPED without one."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
BRIDGE_DIR = os.path.join(os.path.dirname(HERE), "gpualloc")


class AnnouncedRangesTest(unittest.TestCase):
    def test_registrations_track_mapped_memory(self):
        cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
        if cxx is None:
            print("\nSKIPPED: no C++ compiler", flush=True)
            self.skipTest("no C++ compiler")
        with tempfile.TemporaryDirectory() as d:
            exe = os.path.join(d, "registration_test")
            src = os.path.join(HERE, "cpp", "registration_test.cpp")
            subprocess.run([cxx, "-std=c++17", "-O1", "-I", BRIDGE_DIR, src, "-o", exe], check=True)
            p = subprocess.run([exe], capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("ok", p.stdout)


if __name__ == "__main__":
    unittest.main()
