"""examples/python/basic.py runs as README says, on the simulated device, and
its trace holds the leak it demonstrates."""

import os
import re
import subprocess
import sys
import tempfile
import unittest

from . import __name__ as _env  # noqa: F401  (sets the simulated environment first)

SHIM = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(SHIM)
EXAMPLE = os.path.join(ROOT, "examples", "python", "basic.py")


def cli():
    """The gpualloc command built in this tree (tools/test.sh builds the debug one), or None."""
    for profile in ("debug", "release"):
        p = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), profile, "gpualloc")
        if os.path.isfile(p):
            return p
    return None


class ExampleTest(unittest.TestCase):
    def test_python_example_runs_on_the_simulated_device(self):
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(d, "basic.gtrace")
            env = os.environ.copy()
            env["PYTHONPATH"] = SHIM + os.pathsep + env.get("PYTHONPATH", "")
            out = subprocess.run([sys.executable, EXAMPLE, trace], capture_output=True, text=True, env=env, timeout=120)
            self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
            text = out.stdout
            self.assertIn("on the sim backend", text)
            self.assertIn("after 4 steps: 4 blocks alive, 16384 B allocated", text)
            self.assertRegex(text, r"out of memory: 68719476736 B requested, never fits: the most it can get is \d+ B")
            self.assertIn("can never fit", text)
            self.assertIn("gpualloc memory summary, device 0", text)
            events = int(re.search(r"basic\.gtrace: (\d+) events, \d+ bytes, 0 dropped", text).group(1))
            self.assertGreater(events, 50)
            with open(trace, "rb") as f:
                self.assertEqual(f.read(8), b"\x89GATRACE")
            g = cli()
            if g is None:
                self.skipTest("the gpualloc command is not built: the trace's leak was not checked")
            leaks = subprocess.run([g, "leaks", trace], capture_output=True, text=True, timeout=60)
            self.assertEqual(leaks.returncode, 0, leaks.stderr)
            self.assertIn("4 allocations alive at the end (16.00 KiB), 5 iteration(s); 1 leak candidate", leaks.stdout)


if __name__ == "__main__":
    unittest.main()
