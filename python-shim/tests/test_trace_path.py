"""`{pid}`, `{rank}`, `{local_rank}` and `{restart}` in trace paths, from `trace=` and GPUALLOC_TRACE."""

import os
import tempfile
import unittest

from gpualloc import tracefile

from . import __name__ as _env  # noqa: F401
from .test_process import run

CODE = "import sys\nfrom gpualloc._lib import lib\nL = lib()\n{start}L.free(L.malloc(4096))\n{stop}print('pid', __import__('os').getpid())\n"


class TracePathTest(unittest.TestCase):
    def check(self, start_by_env, env_rank, want):
        with tempfile.TemporaryDirectory() as d:
            pattern = os.path.join(d, "run-{rank}-{local_rank}-{restart}-{pid}.gtrace")
            if start_by_env:
                code, env = CODE.format(start="", stop=""), {"GPUALLOC_TRACE": pattern}
            else:
                code, env = CODE.format(start=f"L.trace_start({pattern!r})\n", stop="L.trace_stop()\n"), {}
            drop = [k for k in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT") if k not in env_rank]
            out = run(["-c", code], {**env, **env_rank}, drop=drop)
            self.assertEqual(out.returncode, 0, out.stderr)
            pid = out.stdout.split("pid ")[1].strip()
            self.assertEqual(os.listdir(d), [want.format(pid=pid)])
            self.assertGreater(os.path.getsize(os.path.join(d, want.format(pid=pid))), 0)

    def test_trace_start_fills_in_the_launcher_ranks(self):
        self.check(False, {"RANK": "3", "LOCAL_RANK": "1"}, "run-3-1-0-{pid}.gtrace")

    def test_environment_trace_fills_in_the_launcher_ranks(self):
        self.check(True, {"RANK": "12", "LOCAL_RANK": "4"}, "run-12-4-0-{pid}.gtrace")

    def test_a_restarted_worker_gets_a_file_of_its_own(self):
        # torchrun restarts failed workers with the same rank: {restart}
        # keeps the failed attempt's trace.
        self.check(True, {"RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2"}, "run-1-1-2-{pid}.gtrace")

    def test_without_a_launcher_the_ranks_are_zero(self):
        self.check(True, {}, "run-0-0-0-{pid}.gtrace")
        self.check(False, {}, "run-0-0-0-{pid}.gtrace")

    def test_a_relative_path_survives_a_change_of_folder(self):
        # The path is made absolute at the start: a flush or stop after a
        # chdir (Hydra's default) checks the file written, not another.
        code = (
            "import os\nfrom gpualloc._lib import lib\nL = lib()\nL.trace_start('rel.gtrace')\n"
            "L.free(L.malloc(4096))\nos.chdir('..')\nL.trace_flush()\nprint('stop', L.trace_stop())\n"
        )
        with tempfile.TemporaryDirectory() as d:
            sub = os.path.join(d, "a")
            os.mkdir(sub)
            out = run(["-c", code], cwd=sub)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("'dropped': 0", out.stdout)
            self.assertEqual(os.listdir(sub), ["rel.gtrace"])
            recs = tracefile.records(os.path.join(sub, "rel.gtrace"))
            self.assertEqual([r["kind"] for r in recs if r["kind"] == "alloc"], ["alloc"])
            self.assertEqual(out.stderr, "")

    def test_a_blank_environment_trace_is_no_trace(self):
        # GPUALLOC_TRACE of spaces only is unset, before the start and at it.
        code = "from gpualloc._lib import lib\nL = lib()\nprint('before', L.is_tracing())\nL.init(None)\nprint('after', L.is_tracing())\n"
        with tempfile.TemporaryDirectory() as d:
            out = run(["-c", code], {"GPUALLOC_TRACE": " "}, cwd=d)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertEqual(out.stdout, "before False\nafter False\n")
            self.assertEqual(os.listdir(d), [])


if __name__ == "__main__":
    unittest.main()
