"""PyTorch's allocator settings changed at run time reach gpualloc: torch's
setters wrapped (``gpualloc._settings``), and the switch they pass on
(``gpualloc_set_plain_requests``) on the simulated device."""

import types
import unittest

from . import __name__ as _env  # noqa: F401
from .test_process import run

from gpualloc import _settings


class FollowTest(unittest.TestCase):
    def test_each_setter_runs_then_the_bridge_reads_the_setting(self):
        calls = []
        torch_c = types.SimpleNamespace(
            _cuda_cudaCachingAllocator_set_allocator_settings=lambda env: calls.append(("old", env)),
            _accelerator_setAllocatorSettings=lambda env: calls.append(("new", env)) or "result",
        )
        self.assertEqual(_settings.follow(torch_c, lambda: calls.append("sync")), 2)
        self.assertEqual(torch_c._accelerator_setAllocatorSettings("expandable_segments:False"), "result")
        torch_c._cuda_cudaCachingAllocator_set_allocator_settings("expandable_segments:True")
        self.assertEqual(
            calls, [("new", "expandable_segments:False"), "sync", ("old", "expandable_segments:True"), "sync"]
        )
        # Installing again wraps nothing twice.
        self.assertEqual(_settings.follow(torch_c, lambda: calls.append("again")), 0)
        torch_c._accelerator_setAllocatorSettings("x:1")
        self.assertEqual(calls[-2:], [("new", "x:1"), "sync"])

    def test_a_refused_string_still_syncs_and_raises(self):
        synced = []

        def refuse(env):
            raise ValueError(f"Unrecognized key {env!r}")

        torch_c = types.SimpleNamespace(_accelerator_setAllocatorSettings=refuse)
        self.assertEqual(_settings.follow(torch_c, lambda: synced.append(1)), 1)
        with self.assertRaises(ValueError):
            torch_c._accelerator_setAllocatorSettings("nonsense:1")
        self.assertEqual(synced, [1])

    def test_a_torch_without_the_setters_is_left_alone(self):
        self.assertEqual(_settings.follow(types.SimpleNamespace(), lambda: None), 0)


# Told before the start, then switched off and on around allocations.
CODE = """
from gpualloc._lib import lib
L = lib()
L.set_plain_requests(True)
def expandable(p):
    for seg in L.snapshot()["segments"]:
        if seg["address"] <= p < seg["address"] + seg["total_size"]:
            return seg["is_expandable"], tuple(seg.get("segment_pool_id", (0, 0)))
a = L.malloc(30 << 20)
print("first", expandable(a))
L.set_plain_requests(False)
b = L.malloc(30 << 20)
print("on again", expandable(b))
L.free(a)
L.set_plain_requests(True)
c = L.malloc(30 << 20)
print("reused", c == a)
for p in (b, c):
    L.free(p)
L.check_invariants()
"""


class PlainRequestsTest(unittest.TestCase):
    def test_requests_take_plain_segments_while_pytorchs_setting_says_off(self):
        out = run(["-c", CODE], {"GPUALLOC_SIM_CAPACITY": "1GiB"})
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertEqual(lines[0], "first (False, (0, 0))")
        self.assertEqual(lines[1], "on again (True, (0, 0))")
        self.assertEqual(lines[2], "reused True")


if __name__ == "__main__":
    unittest.main()
