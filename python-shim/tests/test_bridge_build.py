"""The bridge's build cache when several processes install at once.

torch is not installed here: a stand-in `torch.utils.cpp_extension.load`
writes the library the way a build would, and counts its calls.
"""

import contextlib
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
        self.nvml_check_during_load = []

    def load(self, name, build_directory, **_):
        self.loads += 1
        self.nvml_check_during_load.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
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

    def test_a_build_says_so_and_a_cached_one_is_quiet(self):
        import io

        for expect in (True, False):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                _torch._build_bridge(self.torch, verbose=False)
            self.assertEqual("compiling the C++ bridge" in err.getvalue(), expect, err.getvalue())

    def test_a_cached_bridge_is_found_without_importing_the_build_tools(self):
        # Every spawned worker and rank installs: importing cpp_extension
        # (setuptools, a device count) is for builds only.
        so = _torch._build_bridge(self.torch, verbose=False)
        utils = self.torch.utils

        def attribute(name):
            raise AssertionError(f"torch.utils.{name} imported for a cached bridge")

        del utils.cpp_extension
        utils.__getattr__ = attribute  # what `from torch.utils import cpp_extension` asks
        try:
            with mock.patch.dict(sys.modules):
                sys.modules.pop("torch.utils.cpp_extension")
                self.assertEqual(_torch._build_bridge(self.torch, verbose=False), so)
        finally:
            del utils.__getattr__
            utils.cpp_extension = self.ext

    def test_the_build_counts_devices_without_starting_the_driver(self):
        # cpp_extension asks torch.cuda.is_available(): through NVML during
        # the build (Note [Starting on first use]), as the user had it after.
        for before in (None, "0"):
            with mock.patch.dict(os.environ, {"GPUALLOC_REBUILD_BRIDGE": "1"}):
                if before is None:
                    os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
                else:
                    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = before
                _torch._build_bridge(self.torch, verbose=False)
                self.assertEqual(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"), before)
        self.assertEqual(self.ext.nvml_check_during_load, ["1", "1"])

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

    def test_a_build_directory_that_cannot_be_made_is_the_fallback_not_a_crash(self):
        blocker = os.path.join(self.dir.name, "a-file")
        with open(blocker, "w") as f:
            f.write("not a directory")
        with mock.patch.dict(os.environ, {"GPUALLOC_BUILD_DIR": os.path.join(blocker, "sub")}):
            with self.assertRaisesRegex(_torch._BridgeUnavailable, "GPUALLOC_BUILD_DIR"):
                _torch._build_bridge(self.torch, verbose=False)
        self.assertEqual(self.ext.loads, 0)

    def test_a_build_lock_left_by_a_killed_build_is_removed(self):
        key_dirs = lambda: [d for d in os.listdir(self.dir.name) if d.startswith("bridge-")]  # noqa: E731
        _torch._build_bridge(self.torch, verbose=False)
        (build_dir,) = key_dirs()
        lock = os.path.join(self.dir.name, build_dir, "lock")
        with open(lock, "w"):
            pass
        # Holding the build turn, no live gpualloc build owns torch's lock.
        with mock.patch.dict(os.environ, {"GPUALLOC_REBUILD_BRIDGE": "yes"}):
            with self.assertWarnsRegex(RuntimeWarning, "did not finish"):
                _torch._build_bridge(self.torch, verbose=False)
        self.assertFalse(os.path.exists(lock))
        self.assertEqual(self.ext.loads, 2)
        # Without locks on the file system, only an old one is taken for a leftover.
        refused = mock.patch("fcntl.flock", side_effect=OSError(37, "No locks available"))
        with open(lock, "w"):
            pass
        with refused, mock.patch.dict(os.environ, {"GPUALLOC_REBUILD_BRIDGE": "1"}):
            _torch._build_bridge(self.torch, verbose=False)
            self.assertTrue(os.path.exists(lock), "a fresh lock may be a live build's")
            old = _torch.time.time() - _torch.STALE_LOCK_S - 5
            os.utime(lock, (old, old))
            with self.assertWarnsRegex(RuntimeWarning, "did not finish"):
                _torch._build_bridge(self.torch, verbose=False)
        self.assertFalse(os.path.exists(lock))
        self.assertEqual(self.ext.loads, 4)

    def test_a_process_that_waited_for_its_turn_takes_the_finished_build(self):
        # The marker appears while this process waits for the build turn.
        so = _torch._build_bridge(self.torch, verbose=False)
        os.remove(so + ".complete")
        real_turn = _torch._build_turn

        @contextlib.contextmanager
        def turn_after_another_build(build_dir):
            _torch._write_marker(so + ".complete")  # the other process finished
            with real_turn(build_dir) as held:
                yield held

        with mock.patch.object(_torch, "_build_turn", turn_after_another_build):
            self.assertEqual(_torch._build_bridge(self.torch, verbose=False), so)
        self.assertEqual(self.ext.loads, 1, "no second build")

    def test_a_failed_build_names_its_first_error(self):
        out = "\n".join([
            "[1/2] c++ -MMD -c bridge.cpp -o bridge.o",
            "FAILED: bridge.o",
            "bridge.cpp:12:10: fatal error: bridge/api.h: No such file or directory",
            "compilation terminated.",
            "ninja: build stopped: subcommand failed.",
        ])
        self.ext.load = mock.Mock(side_effect=RuntimeError("Error building extension 'gpualloc_bridge':\n" + out))
        with self.assertRaises(_torch._BridgeUnavailable) as e:
            _torch._build_bridge(self.torch, verbose=False)
        self.assertIn("bridge/api.h: No such file or directory", str(e.exception))
        self.assertIn("ninja: build stopped", str(e.exception))


class EnvSwitch(unittest.TestCase):
    def test_spellings_and_a_warning_for_anything_else(self):
        for v, want in [("1", True), ("TRUE", True), (" on ", True), ("no", False), ("Off", False), ("0", False)]:
            with mock.patch.dict(os.environ, {"GPUALLOC_BRIDGE": v}):
                self.assertIs(_torch._env_switch("GPUALLOC_BRIDGE", not want), want, v)
        with mock.patch.dict(os.environ, {"GPUALLOC_BRIDGE": ""}):
            self.assertIs(_torch._env_switch("GPUALLOC_BRIDGE", True), True)
        with mock.patch.dict(os.environ, {"GPUALLOC_BRIDGE": "maybe"}):
            with self.assertWarnsRegex(RuntimeWarning, "'maybe'"):
                self.assertIs(_torch._env_switch("GPUALLOC_BRIDGE", True), True)


class PackageData(unittest.TestCase):
    def test_the_package_ships_every_file_the_bridge_includes(self):
        # `pip install ./python-shim` must carry what bridge.cpp includes,
        # or every install from the package falls back without the bridge.
        import fnmatch
        import re

        shim = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(shim, "pyproject.toml")) as f:
            data = re.search(r'^gpualloc = \[(.*)\]$', f.read(), re.M).group(1)
        globs = re.findall(r'"([^"]+)"', data)
        with open(os.path.join(shim, "gpualloc", "bridge.cpp")) as f:
            local = re.findall(r'^#include "([^"]+)"', f.read(), re.M)
        self.assertTrue(local, "bridge.cpp includes files of its own")
        for inc in local + ["bridge.cpp", "include/gpualloc.h"]:
            path = os.path.join(shim, "gpualloc", inc)
            if not os.path.exists(path):  # an include found through include/
                inc, path = "include/" + inc, os.path.join(shim, "gpualloc", "include", inc)
            self.assertTrue(os.path.exists(path), inc)
            self.assertTrue(any(fnmatch.fnmatch(inc, g) for g in globs), f"{inc} is not in package-data {globs}")

    def test_the_package_ships_the_childrens_sitecustomize(self):
        # run's children install gpualloc through it (Note [Installing in
        # child processes]): not a module of the package, so data.
        import re

        shim = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(shim, "pyproject.toml")) as f:
            data = re.search(r'^gpualloc = \[(.*)\]$', f.read(), re.M).group(1)
        self.assertIn('"_child/sitecustomize.py"', data)
        self.assertTrue(os.path.isfile(os.path.join(shim, "gpualloc", "_child", "sitecustomize.py")))


if __name__ == "__main__":
    unittest.main()
