"""PyTorch's allocator settings changed at run time reach gpualloc: torch's
setters wrapped (``gpualloc._settings``), and the switch they pass on
(``gpualloc_set_plain_requests``) on the simulated device."""

import types
import unittest
import warnings

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


class IgnoredKeysTest(unittest.TestCase):
    def setUp(self):
        _settings._SAID.clear()

    def test_keys_are_read_as_torch_splits_the_string(self):
        self.assertEqual(
            _settings.keys_in(" max_split_size_mb : 128, roundup_power2_divisions:[256:1, 512:2,>:8],expandable_segments:False,"),
            ["max_split_size_mb", "roundup_power2_divisions", "expandable_segments"],
        )
        self.assertEqual(_settings.keys_in(""), [])

    def test_strings_that_hold_as_written_under_gpualloc(self):
        for settings in ("expandable_segments:True", " expandable_segments : True ,pinned_use_cuda_host_register:True", ""):
            self.assertTrue(_settings.holds_as_written(settings), settings)
        # gpualloc's own fraction would win over PyTorch's: said.
        for settings in ("expandable_segments:False", "expandable_segments:True,max_split_size_mb:128",
                         "garbage_collection_threshold:0.6", "backend:cudaMallocAsync", "per_process_memory_fraction:0.5"):
            self.assertFalse(_settings.holds_as_written(settings), settings)
        # torch 2.11 reads only True and False; gpualloc without mapped
        # memory does not do what True asks.
        self.assertFalse(_settings.holds_as_written("expandable_segments:true"))
        self.assertFalse(_settings.holds_as_written("expandable_segments:True", maps_memory=False))
        self.assertEqual(_settings.entries_in("a:1, b:[256:1,>:2] ,c"), [("a", "1"), ("b", "[256:1,>:2]"), ("c", "")])

    def test_each_ignored_key_is_said_once_and_followed_ones_never(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            said = _settings.say_ignored(
                "expandable_segments:False,garbage_collection_threshold:0.6,pinned_use_cuda_host_register:True,"
                "per_process_memory_fraction:0.5,graph_capture_record_stream_reuse:True",
                _settings.BRIDGE_HONOURS,
            )
            again = _settings.say_ignored("garbage_collection_threshold:0.8", _settings.BRIDGE_HONOURS)
        self.assertEqual(said, ["garbage_collection_threshold", "per_process_memory_fraction"])
        self.assertEqual(again, [])
        texts = [str(w.message) for w in caught]
        self.assertEqual(len(texts), 2)
        self.assertIn("'garbage_collection_threshold'", texts[0])
        self.assertIn("GPUALLOC_CONF", texts[0])
        self.assertIn("set_per_process_memory_fraction", texts[1])
        self.assertTrue(all(w.category is RuntimeWarning for w in caught))

    def test_a_setter_says_what_gpualloc_ignores_after_torch_took_the_string(self):
        torch_c = types.SimpleNamespace(_accelerator_setAllocatorSettings=lambda env: None)
        _settings.follow(torch_c, lambda: None, honoured=())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch_c._accelerator_setAllocatorSettings("expandable_segments:False")
        # Without the bridge (honoured empty) even the switch is said.
        self.assertEqual(len(caught), 1)
        self.assertIn("'expandable_segments'", str(caught[0].message))

    def test_a_fraction_the_library_takes_is_not_said(self):
        # Before CUDA starts the library takes the fraction (the callable
        # says so); after, it is said as every other ignored key.
        seen, takes = [], [True]
        torch_c = types.SimpleNamespace(_accelerator_setAllocatorSettings=lambda env: None)
        _settings.follow(torch_c, lambda: None, start_fraction=lambda env: seen.append(env) or takes[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch_c._accelerator_setAllocatorSettings("expandable_segments:False")
            torch_c._accelerator_setAllocatorSettings("per_process_memory_fraction:0.5, max_split_size_mb:64")
            self.assertEqual([str(w.message).split("'")[1] for w in caught], ["max_split_size_mb"])
            takes[0] = False
            torch_c._accelerator_setAllocatorSettings("per_process_memory_fraction:0.25")
        # Only strings naming the key reach the library.
        self.assertEqual(seen, ["per_process_memory_fraction:0.5, max_split_size_mb:64", "per_process_memory_fraction:0.25"])
        self.assertEqual(len(caught), 2)
        self.assertIn("'per_process_memory_fraction'", str(caught[1].message))
        self.assertIn("before CUDA starts", str(caught[1].message))

    def test_the_warning_names_the_programs_line_past_torchs_wrappers(self):
        # torch >= 2.10 wraps _set_allocator_settings in a deprecation
        # wrapper around torch._C's setter: the warning passes over both.
        torch_c = types.SimpleNamespace(_accelerator_setAllocatorSettings=lambda env: None)
        _settings.follow(torch_c, lambda: None, honoured=())
        wrappers = {"__name__": "torch.cuda.memory", "torch_c": torch_c}
        exec("def inner(s):\n    return torch_c._accelerator_setAllocatorSettings(s)\n"
             "def _set_allocator_settings(s):\n    return inner(s)\n", wrappers)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrappers["_set_allocator_settings"]("max_split_size_mb:64")  # this line
            torch_c._accelerator_setAllocatorSettings("roundup_power2_divisions:4")  # and this one
        self.assertEqual([w.filename for w in caught], [__file__, __file__])
        self.assertEqual(caught[1].lineno, caught[0].lineno + 1)

    def test_a_refused_string_says_nothing(self):
        def refuse(env):
            raise ValueError("Unrecognized key")

        torch_c = types.SimpleNamespace(_accelerator_setAllocatorSettings=refuse)
        _settings.follow(torch_c, lambda: None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with self.assertRaises(ValueError):
                torch_c._accelerator_setAllocatorSettings("max_split_size_mb:64")
        self.assertEqual(caught, [])


# PyTorch's fraction set at run time: before the start it caps each device
# from its start (replacing the variable's); after, it changes nothing.
FRACTION_CODE = """
import sys
from gpualloc import GpuallocError
from gpualloc._lib import lib
L = lib()
print("none", L.set_torch_settings("expandable_segments:False"))
try:
    L.set_torch_settings("per_process_memory_fraction:2")
except GpuallocError as e:
    print("refused", "not a number in [0, 1]" in str(e))
print("taken", L.set_torch_settings(sys.argv[1]), L.memory_fraction(0), L.memory_fraction(1), L.is_initialized())
try:
    L.malloc(300 << 20)
    print("fits 300 MiB")
except GpuallocError:
    print("over the cap")
print("later", L.set_torch_settings("per_process_memory_fraction:0.75"), L.memory_fraction(0), L.memory_fraction(1))
L.check_invariants()
"""


class TorchFractionTest(unittest.TestCase):
    def fraction(self, settings, env=None):
        out = run(["-c", FRACTION_CODE, settings], dict({"GPUALLOC_SIM_CAPACITY": "1GiB"}, **(env or {})))
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout.splitlines()

    def test_set_before_the_start_caps_each_device_from_its_start(self):
        lines = self.fraction("expandable_segments:True, per_process_memory_fraction:0.5,per_process_memory_fraction:0.25")
        self.assertEqual(lines[:2], ["none False", "refused True"])
        self.assertEqual(lines[2], "taken True 0.25 0.25 False")
        self.assertEqual(lines[3], "over the cap")
        # Once running: no effect, as under PyTorch once CUDA started.
        self.assertEqual(lines[4], "later False 0.25 0.25")

    def test_it_replaces_the_variables_and_gpuallocs_own_wins(self):
        env = {"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:0.1"}
        self.assertEqual(self.fraction("per_process_memory_fraction:1", env)[2:4], ["taken True 1.0 1.0 False", "fits 300 MiB"])
        own = dict(env, GPUALLOC_CONF="per_process_memory_fraction:0.5")
        self.assertEqual(self.fraction("per_process_memory_fraction:0.25", own)[2:4], ["taken False 0.5 0.5 False", "fits 300 MiB"])


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


TRACED_SWITCH = """
import sys
from gpualloc import tracefile
from gpualloc._lib import lib
L = lib()
L.trace_start(sys.argv[1])
L.set_plain_requests(True)
L.free(L.malloc(1 << 20))
L.set_plain_requests(False)
L.trace_stop()
print([r["op"] for r in tracefile.records(sys.argv[1]) if r["kind"] == "private_pool"])
"""


class PlainRequestsTest(unittest.TestCase):
    def test_the_trace_names_each_switch_as_the_library_does(self):
        import tempfile, os

        with tempfile.TemporaryDirectory() as d:
            out = run(["-c", TRACED_SWITCH, os.path.join(d, "t.gtrace")], {"GPUALLOC_SIM_CAPACITY": "1GiB"})
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("'set_allocator_settings', 'set_allocator_settings'", out.stdout.strip())


    def test_requests_take_plain_segments_while_pytorchs_setting_says_off(self):
        out = run(["-c", CODE], {"GPUALLOC_SIM_CAPACITY": "1GiB"})
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertEqual(lines[0], "first (False, (0, 0))")
        self.assertEqual(lines[1], "on again (True, (0, 0))")
        self.assertEqual(lines[2], "reused True")


if __name__ == "__main__":
    unittest.main()
