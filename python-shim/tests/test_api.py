import ctypes
import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest

from . import __name__ as _env  # noqa: F401  (sets the simulated environment first)

import gpualloc
from gpualloc import GpuallocError
from gpualloc._lib import ERR_ALREADY_INITIALIZED, ERR_INVALID_POINTER, STATS_VERSION, Stats, lib

MiB = 1 << 20
HAVE_TORCH = importlib.util.find_spec("torch") is not None


class ApiTest(unittest.TestCase):
    def test_backend_and_version(self):
        self.assertEqual(gpualloc.backend(), "sim")
        self.assertRegex(gpualloc.version(), r"^\d+\.\d+\.\d+")
        self.assertEqual(lib().device_count(), 2)
        self.assertEqual(lib().mem_info(0)[1], 2 << 30)
        # Started by now (mem_info): the configuration in force.
        self.assertEqual(gpualloc.config(), os.environ.get("GPUALLOC_CONF", ""))

    def test_stats_use_torch_names_and_follow_allocations(self):
        before = gpualloc.stats(0)
        self.assertGreaterEqual(len(before), 9 * 3 * 4 + 2 * 4 + 8)  # PyTorch's keys plus gpualloc's counters
        self.assertEqual(list(before), sorted(before))
        for key in ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak", "num_alloc_retries", "max_split_size", "oversize_allocations.current"):
            self.assertIn(key, before)
        p = lib().malloc(3 * MiB, 0, 0)
        try:
            during = gpualloc.stats(0)
            self.assertEqual(during["allocated_bytes.all.current"] - before["allocated_bytes.all.current"], 3 * MiB)
            self.assertEqual(during["allocation.large_pool.current"] - before["allocation.large_pool.current"], 1)
            self.assertGreaterEqual(during["reserved_bytes.all.current"], during["allocated_bytes.all.current"])
        finally:
            lib().free(p, 0)
        self.assertEqual(gpualloc.stats(0)["allocated_bytes.all.current"], before["allocated_bytes.all.current"])
        lib().check_invariants(0)

    def test_driver_calls_by_kind_add_up_to_the_counters(self):
        p = lib().malloc(3 * MiB, 0, 0)
        lib().free(p, 0)
        calls, stats = gpualloc.driver_calls(0), gpualloc.stats(0)
        self.assertTrue(all(k.startswith("cu") for k in calls))
        self.assertTrue(all(set(v) == {"calls", "handles", "bytes", "ms"} and v["calls"] > 0 for v in calls.values()))
        self.assertEqual(sum(v["calls"] for v in calls.values()), stats["num_driver_calls"])
        self.assertGreaterEqual(sum(calls.get(k, {}).get("bytes", 0) for k in ("cuMemCreate", "cuMemAlloc")), 3 * MiB)
        with self.assertRaises(gpualloc.GpuallocError):
            gpualloc.driver_calls(42)
        # Nothing here was given to the unmapping thread.
        self.assertEqual(gpualloc.driver_calls(0, helper=True), {})
        with self.assertRaises(gpualloc.GpuallocError):
            gpualloc.driver_calls(42, helper=True)

    def test_held_splits_reserved_memory_by_unit(self):
        p = lib().malloc(3 * MiB, 0, 0)
        try:
            h, s = gpualloc.held(0), gpualloc.stats(0)
            self.assertEqual(set(h), {"used_units", "used_units_unallocated", "free_units", "free_private_units", "pooled"})
            parts = h["used_units"] + h["free_units"] + h["free_private_units"] + h["pooled"]
            self.assertEqual(parts, s["reserved_bytes.all.current"])
            self.assertGreaterEqual(h["used_units"], 3 * MiB)
            self.assertEqual(h["used_units_unallocated"], h["used_units"] - s["allocated_bytes.all.current"])
        finally:
            lib().free(p, 0)
        gpualloc.empty_cache()
        h = gpualloc.held(0)
        self.assertEqual(h["free_units"], 0, h)
        self.assertEqual(gpualloc.held("cuda:0"), h)
        with self.assertRaises(gpualloc.GpuallocError):
            gpualloc.held(42)

    def test_private_pool_holds_and_live_allocations(self):
        pool = (41, 42)
        L = lib()
        self.assertEqual(L.pool_use_count(pool, 1), 0)
        L.create_or_incref_pool(pool, 1)
        L.check(L.dll.gpualloc_begin_allocate_to_pool(1, pool[0], pool[1], None, None))
        p = L.malloc(12 * MiB, 1, 9)
        L.check(L.dll.gpualloc_end_allocate_to_pool(1, pool[0], pool[1]))
        self.assertEqual(L.pool_use_count(pool, 1), 2)
        self.assertEqual(L.pool_live_allocations(pool, 1), [p])
        L.free(p, 1)
        self.assertEqual(L.pool_live_allocations(pool, 1), [])
        for _ in range(2):
            L.check(L.dll.gpualloc_release_pool(1, pool[0], pool[1]))
        self.assertEqual(L.pool_use_count(pool, 1), 0)
        L.empty_pool_cache(pool, 1)
        with self.assertRaises(GpuallocError):
            L.pool_live_allocations(pool, 1)
        L.check_invariants(1)

    def test_struct_layout_agrees_with_the_library(self):
        p = lib().malloc(5000, 1, 7)
        try:
            s = lib().stats_struct(1)
            self.assertEqual(s.size, ctypes.sizeof(Stats), "the library wrote a struct of another size")
            self.assertEqual(s.version, STATS_VERSION)
            flat = gpualloc.stats(1)
            self.assertEqual(s.allocated_bytes.all.current, flat["allocated_bytes.all.current"])
            self.assertEqual(s.segment.small_pool.current, flat["segment.small_pool.current"])
            self.assertEqual(s.requested_bytes.all.current, flat["requested_bytes.all.current"])
            self.assertEqual(s.num_device_alloc, flat["num_device_alloc"])
            frag = gpualloc.fragmentation(1)
            self.assertGreater(frag["largest_free_block"], 0)
            self.assertGreaterEqual(frag["cached_free_bytes"], frag["largest_free_block"])
        finally:
            lib().free(p, 1)

    def test_reset_peak_and_accumulated(self):
        p = lib().malloc(8 * MiB)
        lib().free(p)
        s = gpualloc.stats(0)
        self.assertGreater(s["allocated_bytes.all.peak"], s["allocated_bytes.all.current"])
        gpualloc.reset_peak_stats(0)
        s = gpualloc.stats(0)
        self.assertEqual(s["allocated_bytes.all.peak"], s["allocated_bytes.all.current"])
        gpualloc.reset_accumulated_stats(0)
        self.assertEqual(gpualloc.stats(0)["allocation.all.allocated"], 0)

    def test_summary_is_a_table(self):
        p = lib().malloc(3 * MiB)
        try:
            text = gpualloc.summary(0)
        finally:
            lib().free(p)
        for row in ("Allocated memory", "GPU reserved memory", "Non-releasable memory", "Allocations", "from large pool", "external fragmentation", "reserved by unit: used "):
            self.assertIn(row, text)
        self.assertIn("3.00 MiB", text)

    def test_snapshot_lists_segments_and_blocks(self):
        p = lib().malloc(700, 0, 0)
        try:
            segs = gpualloc.snapshot(0)
            blocks = [b for s in segs for b in s["blocks"]]
            mine = [b for b in blocks if b["address"] == p]
            self.assertEqual(len(mine), 1)
            self.assertEqual(mine[0]["state"], "active_allocated")
            self.assertEqual(mine[0]["requested_size"], 700)
            for s in segs:
                self.assertEqual(sum(b["size"] for b in s["blocks"]), s["total_size"])
        finally:
            lib().free(p)

    def test_empty_cache_returns_memory(self):
        p = lib().malloc(64 * MiB)
        lib().free(p)
        self.assertGreaterEqual(gpualloc.stats(0)["reserved_bytes.large_pool.current"], 64 * MiB)
        gpualloc.empty_cache()
        self.assertEqual(gpualloc.stats(0)["reserved_bytes.large_pool.current"], 0)

    def test_record_stream_tells_devices_default_streams_apart(self):
        L = lib()
        active = lambda: gpualloc.stats(0)["active_bytes.all.current"]  # noqa: E731
        before = active()
        p = L.malloc(3 * MiB, 0, 0)
        L.record_stream(p, 0)  # this device's default stream: the allocation stream
        L.free(p, 0)
        self.assertEqual(active(), before)
        p = L.malloc(3 * MiB, 0, 0)
        L.record_stream(p, 0, device=1)  # device 1's default stream
        L.free(p, 0)
        self.assertEqual(active() - before, 3 * MiB, "waits for device 1's work")
        gpualloc.empty_cache()
        self.assertEqual(active(), before)
        with self.assertRaises(GpuallocError):
            L.record_stream(0xDEAD000, 0, device=1)
        p = L.malloc(3 * MiB, 0, 0)
        with self.assertRaisesRegex(GpuallocError, "7"):
            L.record_stream(p, 0, device=7)  # no such device
        L.free(p, 0)
        self.assertEqual(active(), before)

    def test_errors_are_clear(self):
        with self.assertRaisesRegex(GpuallocError, "fraction"):
            gpualloc.set_memory_fraction(1.5, 0)
        with self.assertRaises(GpuallocError) as cm:
            lib().free(0xDEAD000, 0)
        self.assertEqual(cm.exception.code, ERR_INVALID_POINTER)
        self.assertIn("not allocated by gpualloc", str(cm.exception))
        with self.assertRaisesRegex(GpuallocError, "out of memory"):
            lib().malloc(64 << 30)
        oom = gpualloc.last_oom()
        self.assertEqual(oom["kind"], 2)
        self.assertEqual(oom["requested"], 64 << 30)
        with self.assertRaises(GpuallocError) as cm:
            lib().init("max_split_size_mb:999")  # the allocator is running with another configuration
        self.assertEqual(cm.exception.code, ERR_ALREADY_INITIALIZED)

    def test_values_ctypes_would_wrap_or_cut_are_refused(self):
        for call in (
            lambda: lib().malloc(-1),
            lambda: lib().malloc(1 << 64),
            lambda: gpualloc.set_memory_limit(-1, 1),
            lambda: gpualloc.set_memory_limit(0, 1),
            lambda: lib().init("max_split_size_mb:64\0,bogus:1"),
            lambda: gpualloc.mark("a\0b"),
            lambda: gpualloc.trace_start("/tmp/x\0y.gtrace"),
        ):
            with self.assertRaises(ValueError):
                call()
        with self.assertRaises(TypeError):
            lib().malloc(1.5)
        self.assertFalse(gpualloc.is_tracing())

    def test_names_longer_than_a_trace_holds_are_refused(self):
        with self.assertRaisesRegex(GpuallocError, "mark name of 5000 bytes is above the limit of 4096"):
            gpualloc.mark("x" * 5000)
        with self.assertRaisesRegex(GpuallocError, "phase name of 5000 bytes"):
            with gpualloc.phase("y" * 5000):
                pass
        gpualloc.mark("x" * 4096)

    def test_memory_limit_and_fraction(self):
        gpualloc.set_memory_fraction(0.5, 1)
        self.assertEqual(lib().memory_fraction(1), 0.5)
        gpualloc.set_memory_fraction(1.0, 1)
        gpualloc.set_memory_limit(32 * MiB, 1)
        try:
            with self.assertRaisesRegex(GpuallocError, "out of memory"):
                lib().malloc(40 * MiB, 1)
        finally:
            gpualloc.set_memory_limit(None, 1)
        lib().free(lib().malloc(40 * MiB, 1), 1)

    def test_caps_set_while_tracing_are_in_the_trace(self):
        from gpualloc.tracefile import records

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "caps.gtrace")
            gpualloc.trace_start(path)
            try:
                gpualloc.set_memory_fraction(0.5, 1)
                gpualloc.set_memory_limit(32 * MiB, 1)
                with self.assertRaisesRegex(GpuallocError, "out of memory"):
                    lib().malloc(40 * MiB, 1)
            finally:
                gpualloc.set_memory_limit(None, 1)
                gpualloc.set_memory_fraction(1.0, 1)
                gpualloc.trace_stop()
            on_1 = [r for r in records(path) if r["device"] == 1]
        caps = [{k: v for k, v in r.items() if k in ("fraction", "bytes")} for r in on_1 if r["kind"] == "memory_limit"]
        self.assertTrue(all(r["device_total"] > 0 for r in on_1 if r["kind"] == "memory_limit"))
        # First the record that tells the device's memory (no cap), as the
        # trace starts on the device.
        self.assertEqual(caps, [{}, {"fraction": 0.5}, {"bytes": 32 * MiB}, {"bytes": None}, {"fraction": 1.0}])
        kinds = [r["kind"] for r in on_1]
        self.assertLess(kinds.index("memory_limit"), kinds.index("oom"), "the cap comes before the failure it caused")

    def test_phases_marks_and_trace_file(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.gtrace")
            gpualloc.trace_start(path)
            self.assertTrue(gpualloc.is_tracing())

            @gpualloc.phase("decorated")
            def work():
                lib().free(lib().malloc(4096))
                return 42

            with gpualloc.phase("outer"):
                self.assertEqual(work(), 42)
                gpualloc.mark("epoch 1")
            with self.assertRaises(ValueError):
                with gpualloc.phase("raises"):
                    raise ValueError("the phase still ends")
            gpualloc.trace_flush()
            summary = gpualloc.trace_stop()
            self.assertFalse(gpualloc.is_tracing())
            self.assertTrue(os.path.isfile(path))
            self.assertEqual(os.path.getsize(path), summary["bytes"])
            # outer push, decorated push, alloc, free requested, free completed,
            # decorated pop, mark, outer pop, raises push and pop
            self.assertGreaterEqual(summary["events"], 9)
            self.assertEqual(summary["dropped"], 0)
        with self.assertRaises(GpuallocError):
            gpualloc.trace_stop()  # not tracing

    @unittest.skipIf(HAVE_TORCH, "PyTorch is installed here")
    def test_install_without_torch_is_a_clear_error(self):
        with self.assertRaisesRegex(GpuallocError, "needs PyTorch"):
            gpualloc.install()

    def test_device_arguments(self):
        from gpualloc import _device

        self.assertEqual(_device(1), 1)
        self.assertEqual(_device("cuda:1"), 1)
        # No index: the current device (0 while torch has not started CUDA).
        self.assertEqual(_device("cuda"), 0)
        self.assertEqual(_device(None), 0)

    def test_import_does_not_import_torch(self):
        code = "import sys, gpualloc; gpualloc.stats(0); print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy(), timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "False")


if __name__ == "__main__":
    unittest.main()
