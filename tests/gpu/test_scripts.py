"""The GPU scripts' pure parts, on made-up results (no torch, no GPU):
run by tools/test.sh, so that a summary that crashes on a failed or
skipped run is found before a device run is spent on it."""

import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402
import checks  # noqa: E402
import compat  # noqa: E402
import driver  # noqa: E402
import listed_export  # noqa: E402
import promise  # noqa: E402
import sweep  # noqa: E402
import trainers  # noqa: E402
import yolo  # noqa: E402
from step_profiler import StepProfiler  # noqa: E402


def run(workload, variant, mean, median, outputs, reserved=101, allocated=100):
    return {"workload": workload, "variant": variant, "result": {
        "peak_reserved": reserved, "peak_allocated": allocated, "mean_s_all": mean, "median_s": median,
        "outputs": outputs, "counters": {"num_device_alloc": 7}}}


def seg(addr, size, blocks, stream=0):
    return {"device": 0, "address": addr, "total_size": size, "stream": stream, "blocks": blocks}


def blk(size, state="inactive"):
    return {"size": size, "state": state}


def ev(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream}


class MemoryVizReplay(unittest.TestCase):
    """compat._replay_backwards, MemoryViz's simulate_memory: what it accepts
    and where it would throw."""

    MB = 1 << 20

    def test_a_stitch_listed_in_place_of_its_home_runs_replays(self):
        M = self.MB
        # Home segment [0, 8M); a stitch at 100M over its 4M..8M, in use at the end.
        snap = {"segments": [seg(0, 4 * M, [blk(4 * M, "active_allocated")]), seg(100 * M, 4 * M, [blk(4 * M, "active_allocated")])],
                "device_traces": [[ev("segment_map", 0, 8 * M), ev("alloc", 0, 4 * M), ev("alloc", 4 * M, 2 * M),
                                   ev("free_requested", 4 * M, 2 * M), ev("free_completed", 4 * M, 2 * M),
                                   ev("segment_unmap", 4 * M, 4 * M), ev("segment_map", 100 * M, 4 * M),
                                   ev("alloc", 100 * M, 4 * M)]]}
        self.assertEqual(compat._replay_backwards(snap, 0), 8)

    def test_a_stitch_mapped_in_the_history_but_not_listed_throws(self):
        M = self.MB
        # The old bug: the stitch's map is in the history, the cached stitch is not in the snapshot.
        snap = {"segments": [seg(0, 8 * M, [blk(8 * M)])],
                "device_traces": [[ev("segment_map", 0, 8 * M), ev("segment_map", 100 * M, 4 * M),
                                   ev("alloc", 100 * M, 4 * M), ev("free_requested", 100 * M, 4 * M),
                                   ev("free_completed", 100 * M, 4 * M)]]}
        with self.assertRaisesRegex(AssertionError, "lies in no segment"):
            compat._replay_backwards(snap, 0)

    def test_a_map_no_single_segment_holds_throws(self):
        M = self.MB
        # Two adjacent segments of different streams do not merge in MemoryViz.
        snap = {"segments": [seg(0, 4 * M, [blk(4 * M)], stream=1), seg(4 * M, 4 * M, [blk(4 * M)], stream=2)],
                "device_traces": [[ev("segment_map", 0, 8 * M)]]}
        with self.assertRaisesRegex(AssertionError, "no segment holds"):
            compat._replay_backwards(snap, 0)


class SweepSummary(unittest.TestCase):
    def test_ratios_against_the_faster_pytorch_mode(self):
        runs = [run("w", "native", 0.2, 0.1, [1.0, 2.0]), run("w", "native-expandable", 0.1, 0.2, [1.0, 2.0]),
                run("w", "gpualloc", 0.15, 0.12, [1.0, 2.002])]
        rows = sweep.summarize(runs, ["w"], ["native", "native-expandable", "gpualloc"]).splitlines()
        ours = next(r for r in rows if "| gpualloc |" in r).split("|")
        # mean against the faster mean (0.1), median against the faster median (0.1)
        self.assertEqual(ours[7].strip(), "1.500")
        self.assertEqual(ours[8].strip(), "1.200")
        self.assertEqual(ours[9].strip(), "1.0e-03")

    def test_failed_and_missing_runs_are_rows_not_crashes(self):
        runs = [{"workload": "w", "variant": "native", "error": "boom"}, run("w", "gpualloc", 0.1, 0.1, [3.0])]
        text = sweep.summarize(runs, ["w", "v"], ["native", "gpualloc"])
        self.assertIn("failed: boom", text)
        self.assertIn("| v | gpualloc | 0 | failed: not run", text)
        ours = next(r for r in text.splitlines() if "| w | gpualloc |" in r).split("|")
        self.assertEqual(ours[7].strip(), "–", "no PyTorch run to compare with")

    def test_rounds_pair_within_a_repeat_against_the_faster_pytorch_mode(self):
        def timed(variant, rep, rounds, floor):
            r = run("w", variant, sum(rounds) / 1e3, 0.1, [1.0])
            r["repeat"], r["result"]["round_ms"], r["result"]["host_floor_us"] = rep, rounds, floor
            return r
        warm = [100.0] * 5  # the first fifth is left out of the pairing
        runs = [timed("native", 0, warm + [30.0] * 20, [1.4, 1.5]),
                timed("native-expandable", 0, warm + [10.0] * 20, [1.4, 1.6]),
                timed("gpualloc", 0, [1.0] * 5 + [12.0] * 20, [1.5, 1.5]),
                timed("native", 1, warm + [30.0] * 20, [1.4, 1.4]),
                timed("native-expandable", 1, warm + [20.0] * 20, [2.8, 2.8]),
                timed("gpualloc", 1, warm + [20.0] * 19, [1.4, 1.4])]
        rows = sweep.summarize(runs, ["w"], ["native", "native-expandable", "gpualloc"]).splitlines()
        ours = next(r for r in rows if "| gpualloc |" in r).split("|")
        # repeat 0: 240 / 200 ms; repeat 1 (24 rounds paired, after the first fifth of them): 480 / 480
        self.assertEqual(ours[11].strip(), "1.100")
        self.assertEqual(ours[12].strip(), "1.45")
        ref = next(r for r in rows if "| native-expandable |" in r).split("|")
        self.assertEqual(ref[11].strip(), "–", "the reference is not paired with itself")
        notes = sweep.host_notes(runs, ["w"])
        self.assertEqual(len(notes), 1, notes)
        self.assertIn("w, repeat 1: host speeds differ", notes[0])
        self.assertIn("native-expandable 2.80 µs", notes[0])

    def test_every_workload_is_documented_and_named_in_the_shell_script(self):
        # The module's docstring says what each workload measures; a new one
        # without its paragraph (or an old paragraph left behind) fails here.
        documented = {line[2:].split(":")[0] for line in sweep.__doc__.splitlines() if line.startswith("- ")}
        self.assertEqual(documented, set(sweep.WORKLOADS))
        for name, (fn, rounds) in sweep.WORKLOADS.items():
            self.assertTrue(callable(fn) and rounds > 0, name)

    def test_outputs_of_another_length_differ_infinitely(self):
        runs = [run("w", "native", 0.1, 0.1, [1.0, 2.0]), run("w", "gpualloc", 0.1, 0.1, [1.0])]
        self.assertIn("inf", sweep.summarize(runs, ["w"], ["native", "gpualloc"]))


class Variants(unittest.TestCase):
    def test_names_and_configurations(self):
        self.assertEqual(driver.parse_variants("native,gpualloc[a:1,b:2]"), ["native", "gpualloc[a:1,b:2]"])
        self.assertEqual(driver.variant("gpualloc[x:1]"), ("gpualloc", {"GPUALLOC_TEST_CONF": "x:1"}))
        for bad in ("nope", "gpualloc[x", "", "native-traced[x:1]", "gpualloc-traced,gpualloc-traced[x:1]"):
            with self.assertRaises(ValueError):
                driver.parse_variants(bad)

    def test_a_traced_variant_may_carry_a_configuration(self):
        self.assertEqual(driver.variant("gpualloc-traced[x:1]"), ("gpualloc", {"GPUALLOC_TEST_CONF": "x:1"}))
        with tempfile.TemporaryDirectory() as d:
            logdir = os.path.join(d, "logs")
            self.assertIsNone(driver.trace_path(logdir, "train_gpt2", "gpualloc[x:1]"))
            path = driver.trace_path(logdir, "train_gpt2", "gpualloc-traced[x:1]")
            self.assertEqual(path, os.path.join(d, "traces", "train_gpt2.gtrace"))
            self.assertTrue(os.path.isdir(os.path.join(d, "traces")))

    def test_the_routes_without_the_bridge_need_the_library_and_no_inherited_switch(self):
        self.assertEqual(driver.variant("gpualloc-raw"), ("raw", {}))
        self.assertEqual(driver.variant("gpualloc-fallback"), ("gpualloc", {"GPUALLOC_BRIDGE": "0"}))
        self.assertIn("GPUALLOC_BRIDGE", driver.CONFIG_ENV)  # a bridge run never inherits the fallback's switch
        old = os.environ.pop("GPUALLOC_LIBRARY", None)
        try:
            with self.assertRaises(SystemExit):
                driver.require_library(["native", "gpualloc-raw"])
            self.assertFalse(driver.require_library(["native", "native-expandable"]))
        finally:
            if old is not None:
                os.environ["GPUALLOC_LIBRARY"] = old


class PairedSteps(unittest.TestCase):
    def test_steps_with_and_without_memory_calls_apart(self):
        ref = {"step_ms": [50.0, 10.0, 10.0, 10.0, 10.0]}
        ours = {"step_ms": [60.0, 10.0, 13.0, 10.5, 10.0], "step_driver_ms": [9.0, 0.0, 3.0, 0.06, 0.1],
                "warmup_steps": 1}
        got = driver.paired_steps(ref, ours)
        self.assertEqual(got["steps"], 4)
        self.assertEqual(got["mean_gap_ms"], 0.875)
        self.assertEqual(got["without_memory_calls"], {"steps": 3, "mean_gap_ms": 0.167})
        self.assertEqual(got["with_memory_calls"], {"steps": 1, "mean_gap_ms": 3.0, "mean_driver_ms": 3.0})
        self.assertIsNone(driver.paired_steps(ref, {"step_ms": [1.0]}))

    def test_training_comparisons_pair_with_both_pytorch_modes(self):
        def run(ms, driver_ms=None):
            r = {"losses": [1.0, 0.5], "median_step_s": 0.01, "peak_reserved_over_allocated": 1.0,
                 "peak_reserved": 1 << 30, "peak_allocated": 1 << 30, "step_ms": ms, "warmup_steps": 0}
            if driver_ms is not None:
                r["step_driver_ms"] = driver_ms
            return {"result": r}

        native, expandable = run([10.0, 12.0]), run([9.0, 11.0])
        c = driver.compare_training(native, run([10.0, 14.0], [0.0, 2.0]), expandable)
        self.assertEqual(c["paired_steps"]["native"]["with_memory_calls"]["mean_gap_ms"], 2.0)
        self.assertEqual(c["paired_steps"]["native-expandable"]["without_memory_calls"]["mean_gap_ms"], 1.0)
        self.assertEqual(driver.compare_training(native, expandable, expandable)["paired_steps"],
                         {"native": None, "native-expandable": None})

    def test_training_comparisons_count_memory_calls_after_warm_up(self):
        def run(**extra):
            r = {"losses": [1.0], "median_step_s": 0.01, "peak_reserved_over_allocated": 1.0,
                 "peak_reserved": 1 << 30, "peak_allocated": 1 << 30, "steps": 30, "warmup_steps": 10, **extra}
            return {"result": r}

        ours = run(driver_calls_after_warmup={"cuMemMap": {"calls": 6, "handles": 6, "bytes": 1, "ms": 0.1},
                                              "cuEventRecord": {"calls": 40, "handles": 0, "bytes": 0, "ms": 0.1}})
        c = driver.compare_training(run(), ours, run(device_allocs_after_warmup=1))
        self.assertEqual(c["memory_calls_per_100_after_warmup"], {"native-expandable": 5.0, "gpualloc": 30.0})
        c = driver.compare_training(run(), run())
        self.assertEqual(c["memory_calls_per_100_after_warmup"], {"native-expandable": None, "gpualloc": None})

    def test_runs_of_unlike_host_speed_are_named(self):
        def run(floor):
            r = {"losses": [1.0], "median_step_s": 0.01, "peak_reserved_over_allocated": 1.0,
                 "peak_reserved": 1 << 30, "peak_allocated": 1 << 30}
            if floor is not None:
                r["host_floor_us"] = floor
            return {"result": r}

        c = driver.compare_training(run([1.4, 1.5]), run([2.8, 2.9]), run([2.6, 2.8]))
        self.assertEqual(c["host_floor_us"], {"native": 1.45, "native-expandable": 2.7, "gpualloc": 2.85})
        self.assertEqual(c["host_speeds_differ"], ["native"])
        # Runs from before the floor was measured compare as before.
        c = driver.compare_training(run(None), run([2.8, 2.9]))
        self.assertEqual(c["host_floor_us"], {"native": None, "gpualloc": 2.85})
        self.assertEqual(c["host_speeds_differ"], [])


class CrashTail(unittest.TestCase):
    def test_a_crash_report_is_kept_from_its_start_and_other_stderr_by_its_end(self):
        report = "gpualloc: crash report: SIGSEGV (signal 11) at address 0x0, thread 7 \"gpualloc-unmap-0\""
        err = "x" * 5000 + "\n" + report + "\n" + "frame\n" * 4000
        tail = driver.stderr_tail(err)
        self.assertTrue(tail.startswith("x" * 999 + "\n" + report), tail[:100])
        self.assertEqual(len(tail), 16000)
        self.assertEqual(driver.stderr_tail("y" * 3000 + "end"), "y" * 1997 + "end")


class Failures(unittest.TestCase):
    def test_crashes_errors_and_failed_sub_checks_fail_but_limited_modes_outside_strict_checks_and_skips_do_not(self):
        ok = {"ok": True}
        runs = {
            "dropin/native": {"rc": 0, "result": {"passed": 2, "total": 2, "checks": {"a": ok, "b": ok}}},
            "dropin/gpualloc": {"rc": 0, "result": {"passed": 1, "total": 2, "checks": {"a": ok, "b": {"ok": False}}}},
            "dropin/gpualloc-raw": {"rc": 0, "result": {"passed": 0, "total": 2, "checks": {}}},
            "churn_wide/gpualloc": {"rc": -11, "error": "no result (rc=-11)", "stderr_tail": ""},
            "streams/gpualloc-fallback": {"rc": 1, "error": "RuntimeError: boom"},
            "churn/gpualloc": {"rc": 0, "result": {"us_per_alloc_free": 5.0}},
            "churn/native": {"rc": -11, "result": {"us_per_alloc_free": 5.0}},
            "train_gpt2/gpualloc": {"skipped": "time budget of 480 s spent"},
            "streams/gpualloc-raw": {"rc": 0, "result": {"passed": 1, "total": 2, "checks": {"a": ok, "b": {"ok": False}}}},
        }
        self.assertEqual(driver.failures(runs), {
            "dropin/gpualloc": "1/2 passed; failed: b",
            "streams/gpualloc-raw": "1/2 passed; failed: b",
            "churn_wide/gpualloc": "no result (rc=-11)",
            "streams/gpualloc-fallback": "RuntimeError: boom",
            "churn/native": "exit status -11 after its result",
        })
        self.assertEqual(driver.failures({"churn/native": runs["churn/gpualloc"]}), {})


class KernelSpeed(unittest.TestCase):
    def test_ratios_to_native_leave_failed_runs_out(self):
        runs = {"kernel_speed/native": {"result": {"median_ms": {"copy": 2.0, "mm": 1.0}, "host_us": {"item": 10.0}}},
                "kernel_speed/gpualloc": {"result": {"median_ms": {"copy": 2.5, "mm": 1.0}, "host_us": {"item": 12.0}}},
                "kernel_speed/other": {"error": "boom"}}
        got = driver.compare_kernel_speed(runs, ["native", "gpualloc", "other"])
        self.assertEqual(got, {"copy": {"gpualloc": 1.25}, "mm": {"gpualloc": 1.0}, "item": {"gpualloc": 1.2}})
        self.assertEqual(driver.compare_kernel_speed({}, ["native", "gpualloc"]), {})


class TimedLoops(unittest.TestCase):
    def test_each_variant_against_native_and_failed_runs_left_out(self):
        runs = {"churn_cpp/native": {"result": {"ns_per_alloc_free": 1000.0}},
                "churn_cpp/gpualloc": {"result": {"ns_per_alloc_free": 1250.0}},
                "churn_cpp/gpualloc-b": {"result": {"ns_per_alloc_free": 900.0}},
                "churn_cpp/gpualloc[defragment:false]": {"error": "boom"}}
        got = driver.compare_timed("churn_cpp", runs, ["native", "gpualloc", "gpualloc-b", "gpualloc[defragment:false]"])
        self.assertEqual(got["ns_per_alloc_free"], {"native": 1000.0, "gpualloc": 1250.0, "gpualloc-b": 900.0})
        self.assertEqual(got["ratio_over_native"], {"gpualloc": 1.25, "gpualloc-b": 0.9})
        self.assertEqual(got["ratio_gpualloc_over_native"], 1.25)
        self.assertNotIn("ratio_gpualloc_over_native", driver.compare_timed("churn_cpp", runs, ["native", "gpualloc-b"]))
        self.assertIsNone(driver.compare_timed("churn", runs, ["native", "gpualloc"]))


class CheckVariants(unittest.TestCase):
    def test_check_variants_keep_only_the_named_ones_and_leave_trainings_alone(self):
        train = ["native", "native-expandable", "gpualloc"]
        self.assertEqual(driver.variants_of("dropin", train, False, None), driver.CHECK_VARIANTS["dropin"])
        self.assertEqual(driver.variants_of("dropin", train, False, ["gpualloc"]), ["gpualloc"])
        self.assertEqual(driver.variants_of("threads", train, False, ["gpualloc"]), ["gpualloc"])
        self.assertEqual(driver.variants_of("churn", ["native", "gpualloc", "gpualloc-b"], True, None),
                         ["native", "gpualloc", "gpualloc-b"])
        self.assertEqual(driver.variants_of("churn", ["gpualloc-b"], True, ["gpualloc-b"]), ["gpualloc-b"])
        self.assertEqual(driver.variants_of("train_gpt2", train, False, ["gpualloc"]), train)
        self.assertEqual(driver.variants_of("launcher", train, False, ["native"]), [])


class SummaryFile(unittest.TestCase):
    def test_written_whole_after_each_check_and_marked_complete_at_the_end(self):
        import json
        import tempfile
        import time
        with tempfile.TemporaryDirectory() as out:
            summary = {"runs": {"churn/native": {"result": {"us_per_alloc_free": 1.0}},
                                "churn/gpualloc": {"error": "no result (rc -11)"}}}
            driver.save_summary(out, summary, time.time(), complete=False)
            with open(os.path.join(out, "summary.json")) as f:
                got = json.load(f)
            self.assertFalse(got["complete"])
            self.assertIn("churn/gpualloc", got["failures"])
            driver.save_summary(out, summary, time.time(), complete=True)
            with open(os.path.join(out, "summary.json")) as f:
                self.assertTrue(json.load(f)["complete"])
            self.assertEqual(os.listdir(out), ["summary.json"])


class Profiler(unittest.TestCase):
    def test_off_without_a_window_and_clear_about_a_bad_one(self):
        p = StepProfiler("")
        for _ in range(3):
            p.begin()  # would import torch if it profiled
            p.end()
        self.assertIsNone(p.kernels)
        self.assertEqual(p.report(), {})
        p.finish()  # nothing open: a no-op
        for bad in ("20", "a:b", "5:5", "7:3", "-1:4"):
            with self.assertRaisesRegex(ValueError, "FIRST"):
                StepProfiler(bad)


class RunOrder(unittest.TestCase):
    def test_each_variant_leads_equally_over_a_multiple_of_the_variants(self):
        vs = ["native-expandable", "gpualloc", "gpualloc[x:1]"]
        firsts = [driver.run_order(vs, r)[0] for r in range(6)]
        self.assertEqual(sorted(firsts), sorted(vs * 2))
        self.assertEqual(sorted(driver.run_order(vs, 4)), sorted(vs))
        self.assertEqual(driver.order_note(vs, 6), "")
        self.assertEqual(driver.order_note(["gpualloc"], 3), "")

    def test_unbalanced_repeats_are_named(self):
        note = driver.order_note(["native-expandable", "gpualloc"], 3)
        self.assertIn("native-expandable 2", note)
        self.assertIn("gpualloc 1", note)
        self.assertIn("multiple of 2", note)


def bench_run(workload, variant, repeat, mean_s):
    return {"workload": workload, "variant": variant, "repeat": repeat, "result": {
        "mean_step_s_all": mean_s, "mean_step_s": mean_s, "median_step_s": mean_s, "peak_reserved": 2**30,
        "peak_allocated": 2**30,
        "peak_reserved_over_allocated": 1.01, "losses": [1.0], "device_allocs_after_warmup": 0,
        "host_floor_us": [1.4 + repeat / 10, 1.5 + repeat / 10]}}


class BenchInterval(unittest.TestCase):
    def test_the_interval_of_round_17s_gpt2_repeats_holds_one(self):
        # The three per-repeat ratios of round 17's GPT-2 runs.
        mean, low, high = bench.ratio_interval([1.049, 1.027, 0.982])
        self.assertAlmostEqual(mean, 1.0189, places=4)
        self.assertAlmostEqual(low, 0.9371, places=4)
        self.assertAlmostEqual(high, 1.1079, places=4)

    def test_equal_ratios_have_no_width_and_one_ratio_no_interval(self):
        self.assertEqual([round(x, 9) for x in bench.ratio_interval([0.9, 0.9, 0.9])], [0.9, 0.9, 0.9])
        self.assertIsNone(bench.ratio_interval([1.2]))
        self.assertIsNone(bench.ratio_interval([]))

    def test_training_rows_carry_it_and_the_table_prints_it(self):
        runs = [bench_run("w", "native", rep, 0.100) for rep in range(3)]
        runs += [bench_run("w", "gpualloc", rep, t) for rep, t in enumerate([0.098, 0.099, 0.097])]
        rows = bench.summarize_training(runs, "w", ["native", "gpualloc"])
        ours = next(r for r in rows if r["variant"] == "gpualloc")
        self.assertAlmostEqual(ours["ratio_mean_all_vs_faster_native"], 0.98)
        self.assertGreater(ours["ratio_mean_all_interval95"][2], 1.0, "three repeats 1-3% faster cannot tell")
        args = {"repeats": 3, "steps": 60}
        text = bench.markdown({"args": args, "variants": ["native", "gpualloc"], "training": {"w": rows},
                               "runs": runs, "skipped": []})
        self.assertIn("| 0.980 | 0.955–1.005 | yes | 1.55 |", text)  # host µs: the median of 1.45, 1.55, 1.65
        self.assertIn("95% confidence interval", text)
        runs = [r for r in runs if r["variant"] == "native"]
        runs += [bench_run("w", "gpualloc", rep, t) for rep, t in enumerate([0.0980, 0.0981, 0.0979])]
        ours = bench.summarize_training(runs, "w", ["gpualloc"])[0]
        self.assertLess(ours["ratio_mean_all_interval95"][2], 1.0, "three repeats 2% faster, closely: met")


class BenchPool(unittest.TestCase):
    VARIANTS = ["native-expandable", "gpualloc"]

    def bench(self, ratios, steps=100, skipped=(), started="then", missing=()):
        """A bench.json's contents: repeat r ran both variants in run_order,
        gpualloc at `ratios[r]` of PyTorch expandable's time, except the
        (variant, repeat) runs in `missing` (skipped for time)."""
        runs = []
        for rep, x in enumerate(ratios):
            for v in driver.run_order(self.VARIANTS, rep):
                if (v, rep) not in missing:
                    runs.append(bench_run("train_gpt2", v, rep, 0.100 * (x if v == "gpualloc" else 1.0)))
        return {"args": {"steps": steps, "repeats": len(ratios), "budget": 500}, "started": started,
                "variants": {v: None for v in self.VARIANTS}, "runs": runs, "skipped": list(skipped)}

    def test_repeats_of_several_benches_make_one_interval(self):
        a = self.bench([1.02, 0.99], started="a")
        b = self.bench([1.01, 1.00, 0.98, 1.03], skipped=["x-r4: needs 20 s"], started="b")
        out = bench.pooled([("a.json", a), ("b.json", b)])
        self.assertEqual(sorted({r["repeat"] for r in out["runs"]}), list(range(6)))
        self.assertEqual(out["args"]["repeats"], 6)
        row = next(r for r in out["training"]["train_gpt2"] if r["variant"] == "gpualloc")
        self.assertEqual(row["runs"], 6)
        want = bench.ratio_interval([1.02, 0.99, 1.01, 1.00, 0.98, 1.03])
        self.assertEqual([round(x, 9) for x in row["ratio_mean_all_interval95"]], [round(x, 9) for x in want])
        self.assertEqual(out["skipped"], ["b.json: x-r4: needs 20 s"])
        # Each bench's repeats began with run_order's variant of their own number.
        self.assertEqual(driver.first_variants(out["runs"], "train_gpt2", self.VARIANTS, bench.ok), self.VARIANTS * 3)
        text = bench.markdown(out)
        self.assertIn("medians over 6 repeat(s)", text)
        self.assertIn("Pooled from 2 benches", text)
        self.assertNotIn("Order not balanced", text)
        self.assertIn("each bench's time budget", text)

    def test_the_order_is_judged_on_the_repeats_that_ran_both(self):
        # Two repeats each, balanced as planned; the second bench's last
        # repeat lost its PyTorch run to the budget, so of the three
        # repeats with a ratio PyTorch expandable ran first twice.
        a = self.bench([1.0, 1.0], started="a")
        b = self.bench([1.0, 1.0], started="b", missing={("native-expandable", 1)})
        out = bench.pooled([("a.json", a), ("b.json", b)])
        self.assertEqual(driver.first_variants(out["runs"], "train_gpt2", self.VARIANTS, bench.ok),
                         ["native-expandable", "gpualloc", "native-expandable"])
        self.assertIn("train_gpt2: Order not balanced", bench.markdown(out))
        single = {**b, "training": {"train_gpt2": bench.summarize_training(b["runs"], "train_gpt2", self.VARIANTS)}}
        self.assertIn("Order not balanced", bench.markdown(single), "a single bench is judged the same way")
        # Pooled again, with a third bench: the runs keep their order and their files.
        c = self.bench([1.0], started="c")
        again = bench.pooled([("ab.json", out), ("c.json", c)])
        self.assertEqual(driver.first_variants(again["runs"], "train_gpt2", self.VARIANTS, bench.ok),
                         ["native-expandable", "gpualloc", "native-expandable", "native-expandable"])
        self.assertEqual(again["args"]["pool"], ["a.json", "b.json", "c.json"])
        self.assertEqual({r["pooled_from"] for r in again["runs"]}, {"a.json", "b.json", "c.json"})

    def test_small_workloads_pool_and_stay_out_of_the_targets(self):
        a = self.bench([1.0, 1.0], started="a")
        for r in a["runs"]:
            r["workload"] = "train_detector_small"
        out = bench.pooled([("a.json", a), ("b.json", self.bench([1.0], started="b"))])
        self.assertEqual(set(out["training"]), {"train_gpt2", "train_detector_small"})
        named = {row[0] for row in bench.targets(out)}
        self.assertIn("train_gpt2", named)
        self.assertNotIn("train_detector_small", named)

    def test_a_bench_that_ran_pools_as_one_that_names_no_pool(self):
        # A bench that ran writes its arguments whole, `"pool": null` among them.
        a = self.bench([1.0], started="a", skipped=["x-r1: needs 20 s"])
        a["args"]["pool"] = None
        out = bench.pooled([("a.json", a), ("b.json", self.bench([1.0], started="b"))])
        self.assertEqual(out["args"]["pool"], ["a.json", "b.json"])
        self.assertEqual(out["skipped"], ["a.json: x-r1: needs 20 s"])

    def test_unlike_benches_are_refused(self):
        with self.assertRaisesRegex(ValueError, "different steps"):
            bench.pooled([("a.json", self.bench([1.0], started="a")),
                          ("b.json", self.bench([1.0], steps=60, started="b"))])
        with self.assertRaisesRegex(ValueError, "given twice"):
            a = self.bench([1.0])
            bench.pooled([("a.json", a), ("a2.json", a)])
        other = self.bench([1.0], started="b")
        other["variants"] = {"native": None, "gpualloc": None}
        with self.assertRaisesRegex(ValueError, "different variants"):
            bench.pooled([("a.json", self.bench([1.0], started="a")), ("b.json", other)])


class BenchPairedGap(unittest.TestCase):
    def test_the_median_over_repeats_of_each_repeats_pairing(self):
        runs = []
        for rep, (extra, driver_ms) in enumerate([(1.0, 0.0), (3.0, 2.0), (2.0, 0.0)]):
            e = bench_run("w", "native-expandable", rep, 0.01)
            e["result"].update(step_ms=[10.0, 10.0], warmup_steps=0)
            g = bench_run("w", "gpualloc", rep, 0.01)
            g["result"].update(step_ms=[10.0, 10.0 + extra], step_driver_ms=[0.0, driver_ms], warmup_steps=0)
            runs += [e, g]
        ours = bench.summarize_training(runs, "w", ["native-expandable", "gpualloc"])[1]
        self.assertEqual(ours["gap_to_native_expandable_ms"], {
            "after_warmup": 1.0, "steps_without_memory_calls": 0.5, "steps_with_memory_calls": 3.0,
            "their_driver_ms": 2.0})
        self.assertIsNone(bench.summarize_training(runs, "w", ["native-expandable"])[0]["gap_to_native_expandable_ms"])


class BenchDriverTime(unittest.TestCase):
    def test_kinds_medians_and_the_table(self):
        def measured(rep, sync_ms):
            r = bench_run("w", "gpualloc", rep, 0.1)
            r["result"]["driver_calls"] = {
                "cuMemSetAccess": {"calls": 10, "handles": 80, "bytes": 1, "ms": 40.0},
                "cuEventSynchronize": {"calls": 3, "handles": 0, "bytes": 0, "ms": sync_ms},
                "cuEventRecord": {"calls": 100, "handles": 0, "bytes": 0, "ms": 0.5},
            }
            r["result"]["driver_calls_step0"] = {"cuMemSetAccess": {"calls": 5, "handles": 40, "bytes": 1, "ms": 20.0}}
            return r

        runs = [measured(0, 10.0), measured(1, 30.0), measured(2, 20.0), bench_run("w", "native", 0, 0.1)]
        runs[0]["result"]["driver_calls_setup"] = {"cuMemCreate": {"calls": 2, "handles": 2, "bytes": 1, "ms": 5.0}}
        for rep, ms in enumerate((7.0, 9.0)):
            runs[rep]["result"]["helper_driver_calls"] = {"cuMemUnmap": {"calls": 4, "handles": 0, "bytes": 1, "ms": ms}}
        rows = bench.summarize_driver(runs, "w", ["native", "gpualloc"])
        self.assertEqual([r["variant"] for r in rows], ["gpualloc"], "only variants that measured")
        r = rows[0]
        self.assertEqual((r["runs"], r["total_ms"], r["step0_ms"], r["setup_ms"]), (3, 60.5, 20.0, 5.0))
        self.assertEqual((r["cuEventSynchronize"], r["cuEventSynchronize calls"]), (20.0, 3))
        self.assertEqual((r["cuMemCreate"], r["other_ms"]), (0, 0.5))
        self.assertEqual(r["helper_ms"], 8.0, "the median of the runs that measured it")
        text = bench.markdown({"args": {"repeats": 3, "steps": 60}, "variants": ["gpualloc"], "training": {},
                               "driver": {"w": rows}, "runs": runs, "skipped": []})
        self.assertIn("| w | gpualloc | 60.5 | 20.0 | 5.0 | 40.0 (10) | 0.0 (0) | 0.0 (0) | 20.0 (3) | 0.5 | 8.0 |", text)

    def test_a_reading_since_another_leaves_out_kinds_without_new_calls(self):
        class Fake:
            calls = {"cuMemMap": {"calls": 5, "handles": 5, "bytes": 10, "ms": 2.0},
                     "cuMemCreate": {"calls": 1, "handles": 1, "bytes": 4, "ms": 1.0}}

            def driver_calls(self):
                return self.calls

        before = {"cuMemMap": {"calls": 3, "handles": 3, "bytes": 6, "ms": 1.5},
                  "cuMemCreate": {"calls": 1, "handles": 1, "bytes": 4, "ms": 1.0}}
        self.assertEqual(checks._driver_calls_since(Fake(), before),
                         {"cuMemMap": {"calls": 2, "handles": 2, "bytes": 4, "ms": 0.5}})
        self.assertIsNone(checks._driver_calls_since(Fake(), None))
        self.assertIsNone(checks._driver_calls_since(object(), before))


class BenchMemoryCalls(unittest.TestCase):
    """Memory calls after warm-up: gpualloc's driver calls against PyTorch
    expandable's maps and unmaps, per 100 steps."""

    def runs(self, ours_calls, theirs_events):
        runs = []
        for rep, (calls, events) in enumerate(zip(ours_calls, theirs_events)):
            e = bench_run("w", "native-expandable", rep, 0.1)
            e["result"].update(steps=60, warmup_steps=10, device_allocs_after_warmup=events)
            g = bench_run("w", "gpualloc", rep, 0.1)
            g["result"].update(steps=60, warmup_steps=10, driver_calls_after_warmup={
                "cuMemMap": {"calls": calls, "handles": calls, "bytes": 1, "ms": 0.1},
                "cuMemUnmap": {"calls": min(calls, 1), "handles": calls, "bytes": 1, "ms": 0.1},
                # none of these is a memory call
                "cuMemSetAccess": {"calls": 5, "handles": calls, "bytes": 1, "ms": 0.1},
                "cuEventQuery": {"calls": 500, "handles": 0, "bytes": 0, "ms": 1.0},
                "cuMemAddressReserve": {"calls": 7, "handles": 0, "bytes": 1, "ms": 0.0}})
            runs += [e, bench_run("w", "native", rep, 0.1), g]
        return runs

    def verdict(self, ours_calls, theirs_events):
        runs = self.runs(ours_calls, theirs_events)
        vs = ["native", "native-expandable", "gpualloc"]
        b = {"runs": runs, "training": {"w": bench.summarize_training(runs, "w", vs)}, "churn": {}}
        return next((v, x) for w, t, v, x in bench.targets(b) if t.startswith("memory calls"))

    def test_per_100_steps_after_warm_up_and_medians(self):
        runs = self.runs([4, 9, 19], [0, 1, 0])
        rows = {r["variant"]: r for r in bench.summarize_training(runs, "w", ["native", "native-expandable", "gpualloc"])}
        self.assertEqual(rows["gpualloc"]["memory_calls_per_100_after_warmup"], 20.0, "(9 + 1) calls in 50 steps")
        self.assertEqual(rows["native-expandable"]["memory_calls_per_100_after_warmup"], 0.0)
        self.assertIsNone(rows["native"]["memory_calls_per_100_after_warmup"], "PyTorch's counters count no calls")
        text = bench.markdown({"args": {"repeats": 3, "steps": 60}, "variants": ["gpualloc"],
                               "training": {"w": list(rows.values())}, "runs": runs, "skipped": []})
        self.assertIn("| w | gpualloc | 3 | 1.010 | 100.0 | 100.0 | 0 | 20.0 | 1.000 |", text)

    def test_met_missed_and_cannot_tell(self):
        self.assertEqual(self.verdict([0, 0], [0, 0]), ("0.0 vs 0.0", "met"))
        self.assertEqual(self.verdict([1, 1], [3, 3]), ("4.0 vs 6.0", "met"))
        self.assertEqual(self.verdict([2, 2], [0, 0]), ("6.0 vs 0.0", "missed"))
        value, verdict = self.verdict([9, 9], [1, 1])
        self.assertEqual(value, "20.0 vs 2.0")
        self.assertTrue(verdict.startswith("cannot tell ("), verdict)

    def test_a_run_that_did_not_count_its_calls_is_not_judged(self):
        runs = self.runs([1], [0])
        del runs[-1]["result"]["driver_calls_after_warmup"]
        vs = ["native-expandable", "gpualloc"]
        b = {"runs": runs, "training": {"w": bench.summarize_training(runs, "w", vs)}, "churn": {}}
        self.assertIn(("w", "not measured"), [(w, x) for w, t, v, x in bench.targets(b) if t.startswith("memory calls")])


class BenchTargets(unittest.TestCase):
    def bench(self, ours_times, ra=1.008, allocs=(2, 3)):
        runs = [bench_run("w", "native", rep, 0.100) for rep in range(len(ours_times))]
        runs += [bench_run("w", "native-expandable", rep, 0.110) for rep in range(len(ours_times))]
        runs += [bench_run("w", "gpualloc", rep, t) for rep, t in enumerate(ours_times)]
        for r in runs:
            r["result"]["peak_reserved_over_allocated"] = ra if r["variant"] == "gpualloc" else 1.2
            r["result"]["device_allocs_after_warmup"] = {"gpualloc": allocs[0], "native-expandable": allocs[1]}.get(r["variant"], 9)
        churn = [{"workload": "churn", "variant": v, "repeat": rep,
                  "result": {"us_per_alloc_free": us, "peak_reserved_over_allocated": 1.03}}
                 for rep in range(2) for v, us in [("native", 4.0), ("native-expandable", 4.2), ("gpualloc", 2.0 + rep * 0.01)]]
        runs += churn
        vs = ["native", "native-expandable", "gpualloc"]
        return {"runs": runs, "training": {"w": bench.summarize_training(runs, "w", vs)},
                "churn": {"churn": bench.summarize_churn(runs, vs, "churn")}}

    def verdicts(self, b):
        return {(w, t.split()[0]): x for w, t, _, x in bench.targets(b)}

    def test_met_missed_and_cannot_tell(self):
        v = self.verdicts(self.bench([0.0980, 0.0981, 0.0979]))
        self.assertEqual(v[("w", "R/A")], "met")
        self.assertEqual(v[("w", "mean")], "met")
        self.assertEqual(v[("w", "device")], "met")
        self.assertEqual(v[("churn", "R/A")], "met")
        self.assertEqual(v[("churn", ">=")], "met", "2.00-2.01 µs against 4.0: 2x")
        v = self.verdicts(self.bench([0.103, 0.104, 0.105], ra=1.02, allocs=(20, 2)))
        self.assertEqual((v[("w", "R/A")], v[("w", "mean")], v[("w", "device")]), ("missed", "missed", "missed"))
        v = self.verdicts(self.bench([0.098, 0.101, 0.100]))
        self.assertTrue(v[("w", "mean")].startswith("cannot tell ("), v)
        v = self.verdicts(self.bench([0.099]))
        self.assertEqual(v[("w", "mean")], "met (one repeat)")

    def test_the_churn_floor_tells_whether_the_speed_target_is_within_reach(self):
        def floor_rows(floors):
            b = self.bench([0.1, 0.1])
            for r in b["runs"]:
                if r["workload"] == "churn":
                    f = floors[r["repeat"]]
                    r["result"]["floor_us_per_call"] = f and f + (0.1 if r["variant"] == "gpualloc" else 0)
            b["churn"] = {"churn": bench.summarize_churn(b["runs"], ["native", "native-expandable", "gpualloc"], "churn")}
            return {t.split()[0]: (v, x) for w, t, v, x in bench.targets(b) if w == "churn"}

        self.assertEqual(bench.floor_ratios(self.bench([0.1])["runs"], "churn"), [], "no floor measured")
        self.assertNotIn("floor:", floor_rows([None, None]))
        self.assertEqual(floor_rows([3.4, 3.5])["floor:"], ("0.863", "out of reach of any allocator"),
                         "3.4 and 3.5 µs (the lowest variant's) against PyTorch's 4.0")
        self.assertEqual(floor_rows([1.2, 1.3])["floor:"], ("0.312", "within reach"))
        self.assertEqual(floor_rows([3.4, 2.5])["floor,"], ("0.625", "within reach"), "2.5 against 4.0")
        self.assertEqual(floor_rows([3.4, 3.0])["floor,"], ("0.750", "out of reach of any allocator"))
        self.assertTrue(floor_rows([2.0, 3.2])["floor:"][1].startswith("cannot tell ("))

    def test_a_variant_that_did_not_run_is_named(self):
        b = self.bench([0.1, 0.1])
        b["runs"] = [r for r in b["runs"] if r["variant"] != "gpualloc"]
        b["training"] = {"w": bench.summarize_training(b["runs"], "w", ["native", "gpualloc"])}
        b["churn"] = {}
        self.assertEqual(bench.targets(b), [("w", "all", "–", "not run")])


def yolo_run(variant, rep, epochs, allocs=(5, 0, 1), driver=None):
    eps = [{"epoch_s": t, "train_s": t - 0.1, "device_allocs": a, "driver_ms": d}
           for t, a, d in zip(epochs, allocs, driver or [None] * len(epochs))]
    return {"variant": variant, "repeat": rep, "rc": 0, "wall_s": 30.0, "result": {
        "epochs": eps, "total_s": sum(epochs) + 1.0, "peak_reserved_over_allocated": 1.02,
        "final_losses": {"box": 1.5}, "counters": {}}}


class YoloSummary(unittest.TestCase):
    VARIANTS = ["native", "native-expandable", "gpualloc"]

    def runs(self, ours):
        out = []
        for rep, epochs in enumerate(ours):
            out.append(yolo_run("native", rep, [7.0, 1.6, 1.6]))
            out.append(yolo_run("native-expandable", rep, [6.0, 1.5, 1.7]))
            out.append(yolo_run("gpualloc", rep, epochs, driver=[80.0, 2.5, 0.5]))
        return out

    def test_each_epoch_against_the_faster_pytorch_mode_of_its_repeat(self):
        r = yolo.time_ratios(self.runs([[5.0, 1.65, 1.5], [5.5, 1.80, 1.55]]))
        self.assertEqual(list(r), ["epoch 1", "epoch 2", "epoch 3", "total"])
        self.assertEqual([round(x, 4) for x in r["epoch 1"]], [0.8333, 0.9167], "against 6.0, the faster")
        self.assertEqual([round(x, 4) for x in r["epoch 2"]], [1.1, 1.2], "against 1.5")
        self.assertEqual([round(x, 4) for x in r["epoch 3"]], [0.9375, 0.9688], "against native's 1.6")
        self.assertEqual([round(x, 4) for x in r["total"]], [round(9.15 / 10.2, 4), round(9.85 / 10.2, 4)])

    def test_verdicts_per_epoch_and_the_table(self):
        md = yolo.table(self.runs([[5.0, 1.65, 1.5], [5.1, 1.70, 1.55], [5.05, 1.68, 1.52]]), self.VARIANTS)
        rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
        self.assertIn("| met |", rows["epoch 1"])
        self.assertIn("| missed |", rows["epoch 2"])
        self.assertIn("| met |", rows["total"])
        self.assertIn("| 5.05 / 1.68 / 1.52 |", rows["gpualloc"])
        self.assertIn("| 5 / 0 / 1 | 80.0 / 2.5 / 0.5 |", rows["gpualloc"])
        self.assertIn("| 5 / 0 / 1 | – / – / – |", rows["native"], "PyTorch counts no driver time")

    def test_an_epochs_counters_and_pytorchs_missing_ones(self):
        self.assertEqual(yolo.epoch_counters({"num_device_alloc": 2, "driver_time_ns": 1_000_000},
                                             {"num_device_alloc": 5, "driver_time_ns": 3_500_000}),
                         {"device_allocs": 3, "driver_ms": 2.5})
        self.assertEqual(yolo.epoch_counters({}, {"num_device_alloc": 5}), {"device_allocs": 5, "driver_ms": None},
                         "PyTorch lists no counter before its first allocation, and never driver time")

    def test_one_repeat_a_failed_run_and_no_pytorch_mode(self):
        runs = self.runs([[5.0, 1.4, 1.5]])
        md = yolo.table(runs, self.VARIANTS)
        self.assertIn("met (one repeat)", md)
        runs[0] = {"variant": "native", "repeat": 0, "rc": 1, "wall_s": 1.0, "error": "boom"}
        md = yolo.table(runs, self.VARIANTS)
        self.assertIn("| native | 0 | failed rc=1 |", md)
        self.assertIn("met (one repeat)", md, "against native-expandable alone")
        self.assertEqual(yolo.ratio_table(runs, ["gpualloc"]), [])
        only_ours = [r for r in runs if r["variant"] == "gpualloc"]
        self.assertIn("no repeat where both ran", yolo.table(only_ours, self.VARIANTS))


class TrainersSummary(unittest.TestCase):
    def run_(self, variant, rep, mean_ms):
        return {"library": "hf", "variant": variant, "repeat": rep, "rc": 0, "wall_s": 9.0, "result": {
            "mean_step_ms": mean_ms, "median_step_ms": mean_ms, "total_s": 8.0, "final_loss": 2.5,
            "peak_reserved_over_allocated": 1.005, "counters": {"num_device_alloc": 3}}}

    def rows(self, ours):
        runs = []
        for rep, ms in enumerate(ours):
            runs += [self.run_("native", rep, 200.0), self.run_("native-expandable", rep, 190.0),
                     self.run_("gpualloc", rep, ms)]
        md = trainers.table(runs, ["hf"], ["native", "native-expandable", "gpualloc"])
        return {line.split("|")[2].strip(): line for line in md.splitlines() if line.startswith("| hf ")}

    def test_the_mean_step_ratio_has_an_interval_and_a_verdict(self):
        self.assertIn("| 0.947 | 0.934–0.961 | met |", self.rows([180.0, 181.0, 179.0])["gpualloc"])
        self.assertIn("| missed |", self.rows([200.0, 201.0, 199.0])["gpualloc"])
        self.assertIn("| cannot tell (", self.rows([180.0, 200.0])["gpualloc"])
        self.assertIn("| met (one repeat) |", self.rows([185.0])["gpualloc"])
        self.assertIn("| 1.000 | 1.000–1.000 | – |", self.rows([180.0, 181.0])["native-expandable"])


class ListedExport(unittest.TestCase):
    """listed_export.py's reading of snapshots: final segments coalesced,
    and check_snapshot.py's verdict with the most bytes in segments."""

    def test_final_segments_coalesce_and_other_devices_are_left_out(self):
        snap = {"segments": [seg(40, 10, []), seg(10, 20, []), seg(30, 10, []),
                             dict(seg(0, 5, []), device=1)]}
        self.assertEqual(listed_export.coalesced(snap), [(10, 50)])

    def test_a_snapshot_is_checked_as_memory_viz_reads_it(self):
        import pickle
        import tempfile

        good = {"segments": [dict(seg(4096, 8192, [dict(blk(8192), address=4096)]), is_expandable=True,
                                  allocated_size=0)],
                "device_traces": [[ev("segment_map", 4096, 8192), ev("alloc", 4096, 4096),
                                   ev("free_requested", 4096, 4096), ev("free_completed", 4096, 4096),
                                   ev("segment_map", 65536, 4096), ev("segment_unmap", 65536, 4096)]]}
        twice = {"segments": good["segments"],
                 "device_traces": [[ev("segment_map", 4096, 8192), ev("segment_map", 8192, 4096)]]}
        with tempfile.TemporaryDirectory() as d:
            for name, snap in (("good", good), ("twice", twice)):
                with open(os.path.join(d, name), "wb") as f:
                    pickle.dump(snap, f, protocol=2)
            ok = listed_export.checked(os.path.join(d, "good"))
            self.assertEqual(ok, {"ok": True, "error": "", "most_in_segments": 8192 + 4096})
            bad = listed_export.checked(os.path.join(d, "twice"))
            self.assertFalse(bad["ok"])
            self.assertIn("already mapped", bad["error"])


class PromiseBounds(unittest.TestCase):
    """promise.py's bounds, sequences and summary."""

    MB = 1 << 20

    def test_pages_count_each_page_a_byte_of_a_live_block_lies_on_once(self):
        P = 2 * self.MB
        # One block across a page boundary, two small blocks on one page.
        blocks = [(P - 512, 1024), (5 * P, 512), (5 * P + 512, 512)]
        self.assertEqual(promise.pages_held(blocks), 3 * P)
        self.assertEqual(promise.pages_held([(0, 0)]), 0)
        self.assertEqual(promise.pages_held([(0, P)]), P, "a block ending on a boundary holds one page")

    def test_handles_count_each_block_with_a_handle_on_either_side(self):
        self.assertEqual(promise.handles_held([(0, 100), (7, 5)], 16 * self.MB), 105 + 64 * self.MB)

    def test_a_probe_is_whole_pages_and_never_negative(self):
        P = 2 * self.MB
        self.assertEqual(promise.probe_size(10 * P + self.MB, 3 * P), 7 * P)
        self.assertEqual(promise.probe_size(P, 3 * P), 0)

    def test_handle_size_from_the_configuration(self):
        self.assertEqual(promise.handle_mb(""), 16)
        self.assertEqual(promise.handle_mb("defragment:true,expandable_handle_mb:2"), 2)
        self.assertEqual(promise.handle_mb("expandable_handle_mb: 64"), 64)
        self.assertEqual(promise.handle_mb("max_expandable_handle_mb:2"), 16, "only the key itself")

    def test_sequences_are_seeded_and_probe_at_a_fixed_rhythm(self):
        a, b = promise.sequence(1, 100), promise.sequence(1, 100)
        self.assertEqual(a, b)
        self.assertNotEqual(a, promise.sequence(2, 100))
        self.assertEqual(sum(op[0] == "probe" for op in a), 100 // promise.PROBE_EVERY)
        sizes = [op[1] for op in a if op[0] == "alloc"]
        self.assertTrue(all(512 <= s <= 512 * self.MB for s in sizes), sizes)

    def test_the_summary_reads_every_variant_and_names_what_did_not_run(self):
        r = {"page_probes": 4, "page_served": 3, "handle_probes": 1, "handle_served": 1, "over_probes": 5,
             "over_raised": 5, "corrupt": [], "failures": [], "ok": True}
        runs = {"promise/gpualloc": {"result": r}, "promise/native": {"error": "TimeoutExpired"}}
        t = promise.compare_promise(runs, ["native", "gpualloc", "gpualloc[expandable_handle_mb:2]"])
        self.assertEqual(t["gpualloc"]["page_served"], "3/4")
        self.assertEqual(t["gpualloc"]["page_share"], 0.75)
        self.assertEqual(t["native"], {"error": "TimeoutExpired"})
        self.assertEqual(t["gpualloc[expandable_handle_mb:2]"], {"error": "did not run"})

    def test_a_replay_agrees_only_with_the_same_peaks_and_failures_and_a_recorded_fraction(self):
        rec = {"peak_reserved": 6 << 30, "peak_allocated": 5 << 30, "ooms": 87}
        caps = [{"kind": "memory_limit", "fraction": 0.043}]
        self.assertTrue(promise.replay_verdict(rec, {**rec, "device": 0}, caps)["agrees"])
        self.assertFalse(promise.replay_verdict(rec, {**rec, "ooms": 86}, caps)["agrees"])
        self.assertFalse(promise.replay_verdict(rec, {**rec, "peak_reserved": (6 << 30) + 1}, caps)["agrees"])
        self.assertFalse(promise.replay_verdict(rec, rec, [])["agrees"], "no fraction in the trace")
        uncapped = [{"kind": "memory_limit", "fraction": 1.0}]
        self.assertFalse(promise.replay_verdict(rec, rec, uncapped)["agrees"])
        v = promise.replay_verdict(rec, {}, caps)
        self.assertEqual((v["agrees"], v["replayed"]["ooms"]), (False, None))

    def test_the_summary_shows_a_replays_verdict(self):
        r = {"page_probes": 4, "page_served": 4, "handle_probes": 0, "handle_served": 0, "over_probes": 5,
             "over_raised": 5, "corrupt": [], "failures": [], "ok": True, "replay": {"agrees": True}}
        t = promise.compare_promise({"promise/gpualloc-traced": {"result": r}}, ["gpualloc-traced"])
        self.assertIs(t["gpualloc-traced"]["replay_agrees"], True)
        r["replay"] = {"error": "FileNotFoundError: gpualloc"}
        t = promise.compare_promise({"promise/gpualloc-traced": {"result": r}}, ["gpualloc-traced"])
        self.assertEqual(t["gpualloc-traced"]["replay_agrees"], "FileNotFoundError: gpualloc")


class Environment(unittest.TestCase):
    """tests/gpu/env.sh, sourced by every GPU script."""

    def cli_of(self, library, cli=None):
        env = {k: v for k, v in os.environ.items() if k not in ("GPUALLOC_CLI", "GPUALLOC_LIBRARY", "OUT")}
        env.update(GPUALLOC_LIBRARY=library, OUT=os.path.join(os.path.dirname(library), "out"))
        if cli is not None:
            env["GPUALLOC_CLI"] = cli
        script = f'source "{os.path.join(os.path.dirname(os.path.abspath(__file__)), "env.sh")}"; echo "$GPUALLOC_CLI"'
        p = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout.strip()

    def test_the_command_line_tool_beside_the_library_is_taken_when_there(self):
        with tempfile.TemporaryDirectory() as d:
            lib = os.path.join(d, "libgpualloc.so")
            root = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
            self.assertEqual(self.cli_of(lib), os.path.join(root, "target", "release", "gpualloc"))
            beside = os.path.join(d, "gpualloc")
            with open(beside, "w") as f:
                f.write("#!/bin/sh\n")
            os.chmod(beside, 0o755)
            self.assertEqual(self.cli_of(lib), beside)
            self.assertEqual(self.cli_of(lib, "/elsewhere/gpualloc"), "/elsewhere/gpualloc")


class BudgetCut(unittest.TestCase):
    """driver.budget_cut: a run the time budget stopped is a skip, not a failure."""

    def test_a_run_stopped_by_the_budget_is_skipped_and_the_comparison_says_so(self):
        timed_out = {"error": "no result (rc=timeout)", "rc": "timeout", "wall_s": 25.0}
        cut = driver.budget_cut(dict(timed_out), True, 330)
        self.assertIn("time budget of 330 s", cut["skipped"])
        self.assertNotIn("error", cut)
        done = {"result": {"losses": [1.0], "median_step_s": 1.0}, "rc": 0, "wall_s": 30}
        self.assertEqual(driver.compare_training(cut, done), {"skipped": cut["skipped"]})

    def test_a_run_that_timed_out_on_its_own_timeout_or_failed_stays_a_failure(self):
        timed_out = {"error": "no result (rc=timeout)", "rc": "timeout", "wall_s": 150.0}
        self.assertEqual(driver.budget_cut(dict(timed_out), False, 330), timed_out)
        failed = {"error": "no result (rc=1)", "rc": 1, "wall_s": 3.0}
        self.assertEqual(driver.budget_cut(dict(failed), True, 330), failed)
        self.assertEqual(driver.compare_training(failed, {"result": {}})["error"], "a run failed")


if __name__ == "__main__":
    unittest.main()
