"""A PYTORCH_CUDA_ALLOC_CONF that PyTorch refuses is the user's to mend:
install() raises GpuallocError naming the variable, before anything is
swapped, instead of taking the refusal for a bridge that cannot be built
and falling back with a warning (review, round 79). The bridge library is
stood in for: its install entry point answers as bridge.cpp does."""

from __future__ import annotations

import ctypes
import unittest
from unittest import mock

from . import __name__ as _env  # noqa: F401
from gpualloc import GpuallocError, _torch


class _Entry:
    """A C function stand-in: writes `message` into the error buffer and
    returns `rc`."""

    def __init__(self, rc: int, message: bytes):
        self.rc, self.message = rc, message
        self.restype = self.argtypes = None

    def __call__(self, libpath, err, errlen):
        ctypes.memmove(err, self.message + b"\0", min(len(self.message) + 1, errlen))
        return self.rc


class _Bridge:
    def __init__(self, rc: int, message: bytes):
        self.gpualloc_bridge_install = _Entry(rc, message)


class SettingsRefusedTest(unittest.TestCase):
    def install_answering(self, rc: int, message: bytes):
        with mock.patch.object(_torch, "_build_bridge", return_value="/nowhere/bridge.so"), \
                mock.patch.object(_torch.ctypes, "CDLL", return_value=_Bridge(rc, message)):
            _torch._install_bridge(object(), "/nowhere/libgpualloc.so", False)

    def test_a_refused_setting_raises_naming_the_variable(self):
        with self.assertRaises(GpuallocError) as caught:
            self.install_answering(2, b"Unrecognized key 'expandable_segment' in CUDA allocator config.")
        text = str(caught.exception)
        self.assertIn("PYTORCH_CUDA_ALLOC_CONF", text)
        self.assertIn("Unrecognized key 'expandable_segment'", text)

    def test_any_other_failure_still_means_the_bridge_is_unavailable(self):
        with self.assertRaises(_torch._BridgeUnavailable) as caught:
            self.install_answering(1, b"dlopen(/nowhere/libgpualloc.so) failed: no such file")
        self.assertIn("dlopen", str(caught.exception))

    def test_a_swap_refused_because_cuda_started_is_the_users_error_too(self):
        with self.assertRaises(GpuallocError) as caught:
            self.install_answering(1, b"Can't swap an already initialized allocator")
        self.assertIn("before gpualloc.install()", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
