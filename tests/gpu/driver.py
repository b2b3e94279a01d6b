"""Runs every GPU check in its own subprocess, once with PyTorch's allocator
and once with gpualloc, with a timeout each; writes summary.json.

    python3 tests/gpu/driver.py --out DIR [--only dropin,streams] [--budget 480]
        [--steps N] [--variants native,gpualloc-pytorch,'gpualloc[expandable_segments:true]']
        [--check-variants gpualloc]

Failures and timeouts are reported in the summary, never fatal. bench.py
runs its benchmark through run_one and variant() from here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from promise import compare_promise  # noqa: E402 - needs HERE on the path

# (check, timeout seconds, steps) in the order they run: correctness first
# (a run that the time budget cuts short still says whether PyTorch's
# features work), then the timed loops, then the trainings.
PLAN = [
    ("dropin", 180, 0),
    ("streams", 90, 0),
    ("threads", 90, 0),
    ("multi_device", 90, 0),
    ("compat", 300, 0),
    ("ipc", 150, 0),
    ("launcher", 300, 0),
    ("auto_marks", 120, 0),
    ("promise", 240, 0),
    ("churn", 90, 200_000),
    ("churn_wide", 90, 200_000),
    ("churn_cpp", 150, 2_000_000),
    ("trace_cpp", 120, 0),
    ("kernel_speed", 120, 0),
    ("train_resnet", 150, 200),
    ("train_gpt2", 150, 200),
    ("train_detector", 150, 200),
    ("train_backbone", 240, 200),
]

# Allocator variants: name -> (checks.py --alloc, extra environment).
# "gpualloc" is gpualloc with no configuration (its defaults). Besides these
# names, variant() takes ad-hoc ones: gpualloc[CONF] (CONF in GPUALLOC_CONF
# syntax) and native[CONF] (CONF in PYTORCH_CUDA_ALLOC_CONF syntax).
# Training runs TRAIN_VARIANTS (or --variants); the other checks run
# "native" and "gpualloc", or their CHECK_VARIANTS (the TIMED_CHECKS: those,
# or "native" and --variants).
VARIANTS = {
    "native": ("native", {}),
    "native-expandable": ("native", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "gpualloc": ("gpualloc", {}),
    "gpualloc-expandable": ("gpualloc", {"GPUALLOC_TEST_CONF": "expandable_segments:true"}),
    "gpualloc-expandable-traced": ("gpualloc", {"GPUALLOC_TEST_CONF": "expandable_segments:true"}),
    "gpualloc-pytorch": ("gpualloc", {"GPUALLOC_TEST_CONF": "policy:pytorch"}),
    "gpualloc-traced": ("gpualloc", {}),
    # The two routes without gpualloc's C++ bridge: install()'s fallback, and
    # the library as a plain CUDAPluggableAllocator without the Python package.
    "gpualloc-fallback": ("gpualloc", {"GPUALLOC_BRIDGE": "0"}),
    "gpualloc-raw": ("raw", {}),
}
# Checks that run under more than "native" and "gpualloc".
CHECK_VARIANTS = {
    "dropin": ["native", "gpualloc", "gpualloc-fallback", "gpualloc-raw"],
    "streams": ["native", "gpualloc", "gpualloc-fallback", "gpualloc-raw"],
    "ipc": ["native", "native[expandable_segments:True]", "gpualloc", "gpualloc[expandable_segments:false]"],
    "kernel_speed": ["native", "native[expandable_segments:True]", "gpualloc"],
    "launcher": ["gpualloc"],
    "promise": ["native", "native[expandable_segments:True]", "gpualloc", "gpualloc[expandable_handle_mb:2]",
                "gpualloc-traced"],
}
# Checks that time a loop, by the key of their result, and that --variants
# reaches (with "native" first, to compare against).
TIMED_CHECKS = {"churn": "us_per_alloc_free", "churn_cpp": "ns_per_alloc_free", "trace_cpp": "ns_per_op",
                "kernel_speed": None}
# gpualloc's defaults are its expandable segments, so "gpualloc" is what
# "gpualloc-expandable" was; a second untraced run of the same settings only
# cost the trainings a fifth of their time (the backbone did not fit in a
# 540 s budget, round 41).
TRAIN_VARIANTS = ["native", "native-expandable", "gpualloc", "gpualloc-traced"]

# Inherited settings that would change what a variant means: each run gets
# only those of its variant.
CONFIG_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "GPUALLOC_CONF", "GPUALLOC_TEST_CONF", "GPUALLOC_TEST_TRACE", "GPUALLOC_BRIDGE")


def variant(name):
    """(checks.py --alloc, extra environment) of a variant name; ValueError if unknown.

    "gpualloc-b" and "gpualloc-b[CONF]" run the library at GPUALLOC_LIBRARY_B
    (a second build, for an A/B comparison in one interleaved run);
    "gpualloc-traced[CONF]" records its trainings' traces under CONF."""
    if name in VARIANTS:
        return VARIANTS[name]
    m = re.fullmatch(r"(gpualloc-b|gpualloc-traced|gpualloc|native)(?:\[(.*)\])?", name)
    if not m or (m[2] is None and m[1] != "gpualloc-b"):
        raise ValueError(
            f"unknown variant {name!r}: one of {', '.join(VARIANTS)}, gpualloc[CONF], gpualloc-traced[CONF], "
            "native[CONF] or gpualloc-b[CONF]"
        )
    env = {}
    if m[1] == "gpualloc-b":
        lib = os.environ.get("GPUALLOC_LIBRARY_B", "")
        if not os.path.isfile(lib):
            raise ValueError(f"variant {name!r} needs GPUALLOC_LIBRARY_B, a built library ({lib or 'unset'})")
        env["GPUALLOC_LIBRARY"] = lib
    if m[2] is not None:
        env["GPUALLOC_TEST_CONF" if m[1] != "native" else "PYTORCH_CUDA_ALLOC_CONF"] = m[2]
    return ("native" if m[1] == "native" else "gpualloc"), env


def is_traced(name):
    """Whether variant `name` records traces: a -traced variant, with or
    without [CONF]."""
    return name.split("[")[0].endswith("-traced")


def parse_variants(text):
    """Splits a comma-separated variant list (commas inside [...] belong to the
    variant) and checks every name; ValueError on an unknown one."""
    names, depth, cur = [], 0, ""
    for ch in text + ",":
        if ch == "," and depth == 0:
            if cur.strip():
                names.append(cur.strip())
            cur = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        cur += ch
    if depth or not names:
        raise ValueError(f"--variants {text!r}: unbalanced brackets or no variant")
    for n in names:
        variant(n)
    traced = [n for n in names if is_traced(n)]
    if len(traced) > 1:
        # Each would record traces/CHECK.gtrace (`trace_path`), the last overwriting the others.
        raise ValueError(f"--variants {text!r}: {', '.join(traced)} would record the same traces; keep one")
    return names


def run_order(variants, rep):
    """The variants in the order repeat `rep` runs them: turned by one each
    repeat, so that over a multiple of len(variants) repeats each variant
    runs in each position equally often."""
    k = rep % len(variants)
    return variants[k:] + variants[:k]


def order_note(variants, repeats, first=None):
    """A warning for the Markdown when the repeats do not balance the order:
    on the H200 the second of two back-to-back GPT-2 runs was 7-11% slower
    whichever allocator it used (docs/results/h200-round16), so a ratio over
    unbalanced repeats carries that order. Empty when balanced. `first`:
    the variant each repeat ran first, when the repeats were not
    run_order's 0..repeats-1 (repeats pooled from several runs)."""
    if first is None:
        first = [run_order(variants, r)[0] for r in range(repeats)]
    if len(variants) < 2 or all(first.count(v) == first.count(variants[0]) for v in variants):
        return ""
    counts = ", ".join(f"{v} {first.count(v)}" for v in variants)
    return (f"Order not balanced: {repeats} repeat(s) of {len(variants)} variants ran first {counts} time(s); "
            f"a run right after another can be slower whatever its allocator: use a multiple of {len(variants)} repeats, "
            f"each run to its end.")


def first_variants(runs, workload, variants, done):
    """The variant that ran `workload` first in each repeat in which every
    one of `variants` ran it to a result (`done(run)`; the repeats a ratio
    comes from), in repeat order: `runs` are in the order they ran."""
    first, finished = {}, {}
    for r in runs:
        if r["workload"] == workload:
            first.setdefault(r["repeat"], r["variant"])
            if done(r):
                finished.setdefault(r["repeat"], set()).add(r["variant"])
    return [first[rep] for rep in sorted(first) if finished.get(rep, set()) >= set(variants)]


def order_notes(runs, workloads, variants, done):
    """order_note for each workload, over the repeats that ran all
    `variants` (a repeat the budget cut short gives no ratio), each note
    naming its workload."""
    notes = []
    for w in workloads:
        first = first_variants(runs, w, variants, done)
        if note := order_note(variants, len(first), first):
            notes.append(f"{w}: {note}")
    return notes


def require_library(variants):
    """Whether any of `variants` runs gpualloc; exits with a message when
    one does and GPUALLOC_LIBRARY names no built library."""
    uses_gpualloc = any(variant(v)[0] != "native" for v in variants)
    lib = os.environ.get("GPUALLOC_LIBRARY", "")
    if uses_gpualloc and not os.path.isfile(lib):
        sys.exit(f"missing GPUALLOC_LIBRARY ({lib or 'unset'}): run 'cargo build --release -p gpualloc-capi' (or carry it)")
    return uses_gpualloc


def build_bridge(logdir):
    """Builds gpualloc's C++ bridge once (it is cached), so that no check pays
    for the compiler; writes bridge-build.log and returns what happened."""
    t0 = time.time()
    pre = subprocess.run(
        [sys.executable, "-c", "import gpualloc, torch; m = gpualloc.install(verbose=True); print('MODE', m, torch.__version__)"],
        capture_output=True, text=True, timeout=600,
    )
    with open(os.path.join(logdir, "bridge-build.log"), "w") as f:
        f.write(pre.stdout + "\n--- stderr\n" + pre.stderr)
    mode = next((l.split()[1] for l in pre.stdout.splitlines() if l.startswith("MODE ")), None)
    info = {"mode": mode, "rc": pre.returncode, "seconds": round(time.time() - t0, 1),
            "stderr_tail": pre.stderr[-1500:] if mode != "bridge" else ""}
    print(f"bridge build: mode={mode} rc={pre.returncode} ({info['seconds']} s)", flush=True)
    return info


def run_one(check, name, timeout, steps, logdir, extra_args=(), label=None):
    """Runs one check under one variant in its own process; its log goes to
    logdir/LABEL.log (default label: CHECK-VARIANT). Returns the check's
    GPUALLOC_RESULT payload with rc and wall_s added."""
    cmd = [sys.executable, os.path.join(HERE, "checks.py"), check, "--alloc", variant(name)[0], *extra_args]
    if steps:
        cmd += ["--steps", str(steps)]
    return run_child(cmd, name, timeout, logdir, label or f"{check}-{name}", trace_path(logdir, check, name))


def trace_path(logdir, check, name):
    """Where a run of `check` under variant `name` records its trace: for
    a -traced variant (with or without [CONF]; one such variant a run),
    traces/CHECK.gtrace beside logdir (created); else None."""
    if not is_traced(name):
        return None
    os.makedirs(os.path.join(logdir, "..", "traces"), exist_ok=True)
    return os.path.abspath(os.path.join(logdir, "..", "traces", f"{check}.gtrace"))


def save_summary(out, summary, start, complete):
    """Writes OUT/summary.json (through a temporary file and a rename, so a
    kill leaves the last whole one) with the time so far, the failures so
    far and whether every planned check has run ("complete")."""
    summary["total_s"] = round(time.time() - start, 1)
    summary["failures"] = failures(summary["runs"])
    summary["complete"] = complete
    path = os.path.join(out, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2, default=str)
    os.replace(path + ".tmp", path)


def write_results(out, name, md, runs):
    """Prints the Markdown table `md` and writes it to OUT/NAME.md, and
    `runs` to OUT/NAME.json."""
    print(md)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(runs, f, indent=1)


def stderr_tail(err: str) -> str:
    """What a child that printed no result leaves in the summary of its
    stderr: when it has gpualloc's crash report (the thread and native
    stack, then Python's faulthandler: Note [Crash reports] in
    capi/src/crash_report.rs), 16,000 characters from 1,000 before the
    report; else the last 2,000."""
    at = err.rfind("gpualloc: crash report: ")
    if at < 0:
        return err[-2000:]
    start = max(0, at - 1000)
    return err[start:start + 16000]


def run_child(cmd, name, timeout, logdir, label, trace=None):
    """Runs `cmd` (which takes the allocator from its --alloc argument) under
    the environment of variant `name`, with a timeout; its log goes to
    logdir/LABEL.log. Returns the last GPUALLOC_RESULT payload it printed
    (or an error with the end of its stderr), with rc and wall_s added."""
    extra = variant(name)[1]
    env = {k: v for k, v in os.environ.items() if k not in CONFIG_ENV}
    env.update(extra)
    if trace:
        env["GPUALLOC_TEST_TRACE"] = trace
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = "timeout"
    wall = round(time.time() - t0, 1)
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", label)
    with open(os.path.join(logdir, f"{label}.log"), "w") as f:
        f.write(f"$ {' '.join([f'{k}={v}' for k, v in extra.items()] + cmd)}\nrc={rc} wall={wall}s\n"
                f"--- stdout\n{out}\n--- stderr\n{err}\n")
    payload = None
    for line in out.splitlines():
        if line.startswith("GPUALLOC_RESULT "):
            payload = json.loads(line[len("GPUALLOC_RESULT "):])
    if payload is None:
        payload = {"error": f"no result (rc={rc})", "stderr_tail": stderr_tail(err)}
    payload["rc"] = rc
    payload["wall_s"] = wall
    return payload


# Variants with documented limits (README, the drop-in table): their
# sub-checks may fail, and say what the mode cannot do; a crash or an error
# of theirs is still a failure.
LIMITED = ("gpualloc-fallback", "gpualloc-raw")
# Checks every variant must pass whole, the LIMITED ones included: since
# round 71 the library reads PyTorch's current stream without the bridge
# too (Note [The current stream without the bridge]).
STRICT = ("streams",)


def failures(runs):
    """{run key: why} for each run that failed: it printed no result (a
    crash, a timeout the time budget did not cause) or its check raised, it
    ended with a status other than 0 after its result (a crash at exit), or,
    outside LIMITED variants (or in a STRICT check), not all of its
    sub-checks passed. A run the
    budget skipped or stopped is no failure."""
    out = {}
    for key, r in runs.items():
        if "skipped" in r:
            continue
        if r.get("error"):
            out[key] = str(r["error"])[:300]
            continue
        if r.get("rc") not in (0, None):
            # Its result printed, then the process died: a crash at exit.
            out[key] = f"exit status {r['rc']} after its result"
            continue
        res = r.get("result")
        check, _, variant = key.partition("/")
        if (variant in LIMITED and check not in STRICT) or not isinstance(res, dict):
            continue
        if "passed" in res and "total" in res and res["passed"] < res["total"]:
            failed = [n for n, v in (res.get("checks") or {}).items() if not (isinstance(v, dict) and v.get("ok"))]
            out[key] = f"{res['passed']}/{res['total']} passed" + (f"; failed: {', '.join(failed)}" if failed else "")
    return out


def budget_cut(r, cut, budget):
    """A run's result, or, when its timeout was cut to what was left of the
    time budget (`cut`) and it timed out, a skip that says so: the budget
    stopped it, not a failure of the check."""
    if not cut or r.get("rc") != "timeout":
        return r
    return {"skipped": f"stopped after {r.get('wall_s')} s: the time budget of {budget:.0f} s ran out",
            "rc": r.get("rc"), "wall_s": r.get("wall_s")}


# A step whose driver time is below this (ms) made no memory call: what
# remains are event records and queries, a few microseconds each.
DRIVER_FREE_MS = 0.15


def paired_steps(ref, ours):
    """Step by step after warm-up, how much longer `ours` (a run that
    reports `step_driver_ms`) took than `ref`, a run of the same steps on
    the same seeds: the mean difference over all steps, over the steps in
    which `ours` made no memory call (DRIVER_FREE_MS), and over the others,
    with their mean driver time. The gap on steps with memory calls, less
    their driver time, and the gap on steps without are either noise
    between processes or a cost of the allocator's own, which only repeats
    tell apart: the detector's steps without memory calls ran 0.03 ms
    longer than PyTorch expandable's in round 31, 1.13 ms in round 32 and
    1.05 ms in round 35. None when a run lacks per-step times."""
    steps, mine, driver = ref.get("step_ms"), ours.get("step_ms"), ours.get("step_driver_ms")
    if not steps or not mine or not driver:
        return None
    w = ours.get("warmup_steps", 0)
    n = min(len(steps), len(mine), len(driver))
    gap = [(mine[i] - steps[i], driver[i]) for i in range(w, n)]
    quiet = [g for g, d in gap if d < DRIVER_FREE_MS]
    busy = [(g, d) for g, d in gap if d >= DRIVER_FREE_MS]

    def mean(xs):
        return round(sum(xs) / len(xs), 3) if xs else None

    return {"steps": len(gap), "mean_gap_ms": mean([g for g, _ in gap]),
            "without_memory_calls": {"steps": len(quiet), "mean_gap_ms": mean(quiet)},
            "with_memory_calls": {"steps": len(busy), "mean_gap_ms": mean([g for g, _ in busy]),
                                  "mean_driver_ms": mean([d for _, d in busy])}}


# Two processes whose host speeds (checks._host_floor_us) differ by more
# than this factor cannot rank allocators on host-bound steps.
HOST_SPEED_TOLERANCE = 1.25


def host_floor(result):
    """A training run's host speed: the mean of its floors before and after
    the loop, µs per call (None for runs that did not measure it)."""
    xs = result.get("host_floor_us") or []
    return round(sum(xs) / len(xs), 3) if xs else None


def speeds_apart(floors):
    """Whether host floors (µs, None where not measured) are more than
    HOST_SPEED_TOLERANCE apart: host-bound steps of such runs cannot rank
    the allocators."""
    xs = [f for f in floors if f]
    return len(xs) > 1 and max(xs) / min(xs) > HOST_SPEED_TOLERANCE


def host_speeds(refs, ours):
    """{"host_floor_us": {name: floor}, "host_speeds_differ": [names]}: the
    host speed of each run, and the references (`refs`, name -> result)
    whose speed differs from `ours` by more than HOST_SPEED_TOLERANCE."""
    mine = host_floor(ours)
    floors = {name: host_floor(r) for name, r in refs.items()}
    differ = [name for name, f in floors.items() if speeds_apart([f, mine])]
    return {"host_floor_us": {**floors, "gpualloc": mine}, "host_speeds_differ": differ}


# The driver calls that obtain, map, unmap or return device memory, as
# `gpualloc replay` counts them (`DriverCalls::memory_calls`): what a run
# after warm-up should not need more of than PyTorch expandable.
MEMORY_KINDS = ("cuMemAlloc", "cuMemFree", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap")


def memory_calls_per_100(result, variant):
    """Memory calls per 100 steps after warm-up. A run that measured its
    driver calls (gpualloc's, checks._train's driver_calls_after_warmup,
    the unmapping thread's included): the calls of MEMORY_KINDS. PyTorch
    expandable: its maps and unmaps of ranges (num_device_alloc +
    num_device_free, which count them there), each one driver call or
    more, so a lower bound of its calls. None for other runs, or where the
    run lacks what it takes."""
    after = result.get("steps", 0) - result.get("warmup_steps", 0)
    calls = result.get("driver_calls_after_warmup")
    if calls is not None:
        n = sum(d["calls"] for kind, d in calls.items() if kind in MEMORY_KINDS)
    elif variant == "native-expandable":
        n = result.get("device_allocs_after_warmup")
    else:
        return None
    return None if n is None or after <= 0 else 100 * n / after


def compare_training(native, ours, expandable=None):
    if "skipped" in native or "skipped" in ours:
        return {"skipped": native.get("skipped") or ours.get("skipped")}
    if "result" not in native or "result" not in ours:
        return {"error": "a run failed", "native": native.get("error"), "gpualloc": ours.get("error")}
    a, b = native["result"], ours["result"]
    if "skipped" in a or "skipped" in b:
        return {"skipped": a.get("skipped") or b.get("skipped")}
    la, lb = a["losses"], b["losses"]
    refs = {name: ref["result"] for name, ref in (("native", native), ("native-expandable", expandable))
            if ref and "result" in ref}
    diffs = [abs(x - y) / max(1e-12, abs(x)) for x, y in zip(la, lb)]
    return {
        "model": a.get("model"),
        "steps": len(la),
        "losses_identical": la == lb,
        "loss_max_rel_diff": max(diffs) if diffs else None,
        "losses_agree": bool(diffs) and len(la) == len(lb) and max(diffs) <= 1e-4,
        "first_last_loss": [la[0], la[-1]],
        "step_time_ratio": b["median_step_s"] / a["median_step_s"],
        "median_step_s": {"native": a["median_step_s"], "gpualloc": b["median_step_s"]},
        "peak_reserved_over_allocated": {"native": a["peak_reserved_over_allocated"], "gpualloc": b["peak_reserved_over_allocated"]},
        "peak_reserved_gib": {"native": a["peak_reserved"] / 2**30, "gpualloc": b["peak_reserved"] / 2**30},
        "peak_allocated_gib": {"native": a["peak_allocated"] / 2**30, "gpualloc": b["peak_allocated"] / 2**30},
        "paired_steps": {name: paired_steps(ref, b) for name, ref in refs.items()},
        "memory_calls_per_100_after_warmup": {
            "native-expandable": memory_calls_per_100(refs["native-expandable"], "native-expandable")
            if "native-expandable" in refs else None,
            "gpualloc": memory_calls_per_100(b, "gpualloc")},
        **host_speeds(refs, b),
    }


def compare_timed(check, runs, variants):
    """A loop check's time under each variant that printed a result, and its
    ratio to "native" (ratio_gpualloc_over_native for "gpualloc", as before
    --variants reached these checks; ratio_over_native for each); None
    without a native result."""
    key = TIMED_CHECKS[check]
    n = runs.get(f"{check}/native", {}).get("result")
    if not n:
        return None
    times = {v: runs[f"{check}/{v}"]["result"][key] for v in variants if "result" in runs.get(f"{check}/{v}", {})}
    out = {key: times, "ratio_over_native": {v: t / n[key] for v, t in times.items() if v != "native"}}
    if "gpualloc" in times:
        out["ratio_gpualloc_over_native"] = times["gpualloc"] / n[key]
    return out


def compare_kernel_speed(runs, variants):
    """Each kernel's median time (and each host-side wait's mean) under
    each variant over that under "native" ({kernel: {variant: ratio}}); a
    variant whose run failed is left out, and nothing is compared without a
    "native" run."""
    ms = {}
    for a in variants:
        r = runs.get(f"kernel_speed/{a}", {}).get("result", {})
        ms[a] = {**r["median_ms"], **r.get("host_us", {})} if "median_ms" in r else None
    base = ms.pop("native", None)
    if not base:
        return {}
    return {k: {a: round(m[k] / t, 3) for a, m in ms.items() if m and k in m} for k, t in base.items()}


def variants_of(check: str, train_variants: list, variants_given: bool, kept: Optional[list]) -> list:
    """The variants `check` runs under: a training check's are
    `train_variants`; a timed loop's, "native" and `train_variants` when
    --variants was given; another check's, its CHECK_VARIANTS (or "native"
    and "gpualloc"). `kept` (--check-variants) keeps, of a check that is not
    a training, only the variants it names."""
    if check.startswith("train_"):
        return list(train_variants)
    variants = CHECK_VARIANTS.get(check, ["native", "gpualloc"])
    if check in TIMED_CHECKS and variants_given:  # compared with "native", which runs first
        variants = ["native"] + [v for v in train_variants if v != "native"]
    if kept is not None:
        variants = [v for v in variants if v in kept]
    return variants


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="")
    p.add_argument("--budget", type=float, default=float(os.environ.get("GPUALLOC_GPU_BUDGET_S", 480)))
    p.add_argument("--steps", type=int, default=0, help="training steps (default: the plan's)")
    p.add_argument("--variants", default="", help="variants of the training checks and the timed loops (TIMED_CHECKS; default: TRAIN_VARIANTS)")
    p.add_argument("--check-variants", default="",
                   help="the other checks run only those of their variants named here (e.g. gpualloc: a quick "
                        "check of a build in one short device call)")
    args = p.parse_args()
    try:
        train_variants = parse_variants(args.variants) if args.variants else TRAIN_VARIANTS
        kept = parse_variants(args.check_variants) if args.check_variants else None
    except ValueError as e:
        p.error(str(e))
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    start = time.time()
    summary = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": {}, "compare": {}}

    summary["bridge_build"] = build_bridge(os.path.join(args.out, "logs"))
    save_summary(args.out, summary, start, complete=False)

    for check, timeout, steps in PLAN:
        if only and check not in only:
            continue
        variants = variants_of(check, train_variants, bool(args.variants), kept)
        if check.startswith("train_"):
            steps = args.steps or steps
        for alloc in variants:
            key = f"{check}/{alloc}"
            left = args.budget - (time.time() - start)
            if left < 20:
                summary["runs"][key] = {"skipped": f"time budget of {args.budget:.0f} s spent"}
                print(f"{key}: skipped (budget)", flush=True)
                continue
            r = run_one(check, alloc, min(timeout, left), steps, os.path.join(args.out, "logs"))
            r = budget_cut(r, left < timeout, args.budget)
            summary["runs"][key] = r
            save_summary(args.out, summary, start, complete=False)
            res = r.get("result", {})
            brief = r.get("error") or r.get("skipped") or (f"{res.get('passed')}/{res.get('total')} passed" if "passed" in res else "done")
            print(f"{key}: {brief} ({r['wall_s']} s)", flush=True)
        if check.startswith("train_"):
            n = summary["runs"].get(f"{check}/native", {})
            e = summary["runs"].get(f"{check}/native-expandable")
            summary["compare"][check] = {
                v: compare_training(n, summary["runs"].get(f"{check}/{v}", {}), e) for v in variants if v != "native"
            }
            for v, c in summary["compare"][check].items():
                print(f"  {check} {v}: {json.dumps(c)}", flush=True)
        if check in TIMED_CHECKS and check != "kernel_speed":
            if c := compare_timed(check, summary["runs"], variants):
                summary["compare"][check] = c
                print(f"  {check}: {json.dumps(c)}", flush=True)
        if check == "promise":
            summary["compare"][check] = compare_promise(summary["runs"], variants)
            for v, c in summary["compare"][check].items():
                print(f"  promise {v}: {json.dumps(c)}", flush=True)
        if check == "kernel_speed":
            summary["compare"][check] = compare_kernel_speed(summary["runs"], variants)
            print(f"  {check}: {json.dumps(summary['compare'][check])}", flush=True)
        if check in ("dropin", "streams", "compat", "ipc"):
            table = {}
            for alloc in variants:
                for name, v in summary["runs"].get(f"{check}/{alloc}", {}).get("result", {}).get("checks", {}).items():
                    table.setdefault(name, {})[alloc] = v["ok"]
            summary["compare"][check] = table
            for name, v in table.items():
                print(f"  {check}.{name}: " + " ".join(f"{a}={v.get(a)}" for a in variants), flush=True)
        # What ran so far, with the comparisons, in case this process is
        # killed before its end (a device call's time limit): "complete"
        # says which it is.
        save_summary(args.out, summary, start, complete=False)
    save_summary(args.out, summary, start, complete=True)
    for key, why in summary["failures"].items():
        print(f"FAILED {key}: {why}", flush=True)
    print(f"summary: {os.path.join(args.out, 'summary.json')} ({summary['total_s']} s); "
          f"{len(summary['failures'])} of {len(summary['runs'])} runs failed")
    # The command's status says whether anything failed (run.sh passes it on).
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
