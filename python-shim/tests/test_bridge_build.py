"""The bridge's build cache when several processes install at once.

torch is not installed here: a stand-in `torch.utils.cpp_extension.load`
writes the library the way a build would, and counts its calls.
"""

import os
import sys
import tempfile
import types
import unittest
from unittest import mock

from . import __name__ as _env  # noqa: F401
from gpualloc import _torch


class FakeExtensions:
    """`torch.utils.cpp_extension` with a `load` that "builds" the .so."""

    def __init__(self):
        self.loads = 0
        self.marked_during_load = []

    def load(self, name, build_directory, **_):
        self.loads += 1
        path = os.path.join(build_directory, f"{name}.so")
        self.marked_during_load.append(os.path.exists(path + ".complete"))
        with open(path, "wb") as f:
            f.write(b"\x7fELF built")
        return path


class BridgeCache(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.ext = FakeExtensions()
        utils = types.ModuleType("torch.utils")
        utils.cpp_extension = self.ext
        torch = types.ModuleType("torch")
        torch.__version__ = "2.11.0+test"
        torch.__file__ = os.path.join(self.dir.name, "torch", "__init__.py")
        torch.utils = utils
        patches = [
            mock.patch.dict(os.environ, {"GPUALLOC_BUILD_DIR": self.dir.name}),
            mock.patch.dict(sys.modules, {"torch": torch, "torch.utils": utils, "torch.utils.cpp_extension": self.ext}),
            mock.patch.object(_torch, "_cuda_include_dirs", lambda _t: ["/cuda/include"]),
        ]
        for p in patches:
            p.start()
            self.addCleanup(p.stop)
        os.environ.pop("GPUALLOC_REBUILD_BRIDGE", None)
        self.torch = torch

    def tearDown(self):
        self.dir.cleanup()

    def test_a_library_without_its_marker_goes_through_the_locked_build(self):
        so = _torch._build_bridge(self.torch, verbose=False)
        self.assertEqual(self.ext.loads, 1)
        self.assertTrue(os.path.isfile(so + ".complete"))
        # Another process, later: the marker says the build finished.
        self.assertEqual(_torch._build_bridge(self.torch, verbose=False), so)
        self.assertEqual(self.ext.loads, 1)
        # A library seen while another process may still be linking it (no
        # marker yet) is not trusted: load() waits for that build.
        os.remove(so + ".complete")
        with open(so, "wb") as f:
            f.write(b"\x7fEL")  # partial
        self.assertEqual(_torch._build_bridge(self.torch, verbose=False), so)
        self.assertEqual(self.ext.loads, 2)
        self.assertTrue(os.path.isfile(so + ".complete"))
        leftovers = [n for n in os.listdir(os.path.dirname(so)) if n.startswith(".complete-")]
        self.assertEqual(leftovers, [])

    def test_rebuild_on_request_despite_the_marker(self):
        so = _torch._build_bridge(self.torch, verbose=False)
        with mock.patch.dict(os.environ, {"GPUALLOC_REBUILD_BRIDGE": "1"}):
            _torch._build_bridge(self.torch, verbose=False)
        self.assertEqual(self.ext.loads, 2)
        # While the library is relinked in place, no process may trust it.
        self.assertEqual(self.ext.marked_during_load, [False, False])
        self.assertTrue(os.path.isfile(so + ".complete"))

    def test_a_marker_that_cannot_be_written_costs_a_warning_not_the_install(self):
        with mock.patch.object(_torch.tempfile, "mkstemp", side_effect=OSError(28, "No space left on device")):
            with self.assertWarns(RuntimeWarning):
                so = _torch._build_bridge(self.torch, verbose=False)
        self.assertTrue(os.path.isfile(so))
        self.assertFalse(os.path.exists(so + ".complete"))
        # A rename refused leaves no temporary file behind.
        with mock.patch.object(_torch.os, "replace", side_effect=PermissionError(13, "Permission denied")):
            with self.assertWarns(RuntimeWarning):
                _torch._build_bridge(self.torch, verbose=False)
        self.assertEqual([n for n in os.listdir(os.path.dirname(so)) if n.startswith(".complete-")], [])

    def test_a_marker_that_cannot_be_removed_does_not_stop_a_rebuild(self):
        so = _torch._build_bridge(self.torch, verbose=False)
        real_remove = os.remove

        def refuse(path):
            if path.endswith(".complete"):
                raise PermissionError(13, "Permission denied")
            real_remove(path)

        with mock.patch.dict(os.environ, {"GPUALLOC_REBUILD_BRIDGE": "1"}), mock.patch.object(_torch.os, "remove", refuse):
            self.assertEqual(_torch._build_bridge(self.torch, verbose=False), so)
        self.assertEqual(self.ext.loads, 2)


if __name__ == "__main__":
    unittest.main()
