"""Allocator benchmark, side by side in one run: training steps and churn
under PyTorch's allocator (with and without expandable segments) and under
gpualloc's configurations.

    python3 tests/gpu/bench.py --out DIR [--steps 60] [--repeats 1]
        [--only train_gpt2,churn] [--budget 540]
        [--variants native,native-expandable,gpualloc,'gpualloc[expandable_segments:true]']
        [--max-batch [--max-batch-gib 12]]

    python3 tests/gpu/bench.py --out DIR --pool A/bench.json B/bench.json ...

(tests/gpu/bench.sh sets up the environment and calls this.) Repeat r runs
every workload under every variant, each in its own process through
driver.run_one; the order of the variants turns by one each repeat so that
drift of the machine does not always fall on the same one. --max-batch then
runs checks.py max_batch once per training workload and variant. Runs that
no longer fit in --budget seconds (the longest run of their kind so far, at
least 20 s) are skipped and listed. Prints Markdown tables (medians over
repeats, each time ratio with its 95% interval), then the targets of
gpualloc's default configuration, each met, missed or beyond what the
repeats can tell (`targets`), and writes them to DIR/bench.md, everything
to DIR/bench.json and one log a run to DIR/bench-logs/.

--pool runs nothing: it reads the runs of earlier bench.json files of the
same steps (several device calls of one build, since one call holds only a
few repeats) as the repeats of one bench, and writes the same tables from
all of them: on the host-bound trainings, where the host's speed moves
single runs by up to 20%, the interval narrows only with repeats.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import driver  # noqa: E402

WORKLOADS = ["churn", "churn_wide", "train_gpt2", "train_detector", "train_resnet", "train_backbone"]
# The same programs on small footprints (checks.WORKLOADS): run only when
# --only names them, and not among the issue's targets.
SMALL = ["train_resnet_small", "train_detector_small"]
ALL = WORKLOADS + SMALL
DEFAULT_VARIANTS = "native,native-expandable,gpualloc,gpualloc-expandable,gpualloc-pytorch"
NATIVE = ("native", "native-expandable")
CHURN_OPS = 200_000
CHURN_TIMEOUT_S = 90
INTERVAL_NOTE = ("The ratio is taken within each repeat, the column shows the median; the interval is the 95% "
                 "confidence interval of the ratios' geometric mean (Student's t on their logarithms, two "
                 "repeats or more): a target is met when its upper end is at or below it.")
MAX_BATCH_TIMEOUT_S = 420
MIN_LEFT_S = 20


def train_timeout(steps):
    return 120 + 3 * steps


def ok(run):
    return "result" in run and "error" not in run and "skipped" not in run["result"]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize_training(runs, workload, variants):
    """One row a variant: medians over repeats; the ratio is taken within each
    repeat against the faster of native and native-expandable."""
    by = {(r["variant"], r["repeat"]): r for r in runs if r["workload"] == workload and ok(r)}
    repeats = sorted({rep for _, rep in by})
    base = {rep: min((by[(v, rep)]["result"]["mean_step_s_all"] for v in NATIVE if (v, rep) in by), default=None)
            for rep in repeats}
    rows = []
    for v in variants:
        mine = [(rep, by[(v, rep)]) for rep in repeats if (v, rep) in by]
        res = [r["result"] for _, r in mine]
        agree = [driver.compare_training(by[("native", rep)], r)["losses_agree"] for rep, r in mine if ("native", rep) in by]
        ratios = [r["result"]["mean_step_s_all"] / base[rep] for rep, r in mine if base[rep]]
        # Within each repeat, against PyTorch expandable step by step
        # (driver.paired_steps): what the driver calls cost apart from noise.
        pairs = [driver.paired_steps(by[("native-expandable", rep)]["result"], r["result"])
                 for rep, r in mine if ("native-expandable", rep) in by]
        pairs = [x for x in pairs if x]
        rows.append({
            "variant": v,
            "runs": len(res),
            "peak_reserved_over_allocated": median([x["peak_reserved_over_allocated"] for x in res]),
            "mean_step_ms_all": median([x["mean_step_s_all"] * 1e3 for x in res]),
            "median_step_ms": median([x["median_step_s"] * 1e3 for x in res]),
            "mean_step_ms": median([x["mean_step_s"] * 1e3 for x in res]),
            "device_allocs_after_warmup": median([x.get("device_allocs_after_warmup") for x in res]),
            "memory_calls_per_100_after_warmup": median([driver.memory_calls_per_100(x, v) for x in res]),
            "ratio_mean_all_vs_faster_native": median(ratios),
            "ratio_mean_all_interval95": ratio_interval(ratios),
            "losses_agree_with_native": all(agree) if agree else None,
            "peak_reserved_gib": median([x["peak_reserved"] / 2**30 for x in res]),
            "host_floor_us": median([driver.host_floor(x) for x in res]),
            "gap_to_native_expandable_ms": {
                "after_warmup": median([x["mean_gap_ms"] for x in pairs]),
                "steps_without_memory_calls": median([x["without_memory_calls"]["mean_gap_ms"] for x in pairs]),
                "steps_with_memory_calls": median([x["with_memory_calls"]["mean_gap_ms"] for x in pairs]),
                "their_driver_ms": median([x["with_memory_calls"]["mean_driver_ms"] for x in pairs]),
            } if pairs else None,
        })
    return rows


# The driver calls the table shows a column of; the rest add up to "other".
DRIVER_KINDS = ("cuMemSetAccess", "cuMemCreate", "cuMemUnmap", "cuEventSynchronize")


def driver_ms(kinds, keep):
    """The milliseconds of the kinds of driver call (a driver_calls reading)
    whose name `keep` accepts."""
    return sum(k["ms"] for name, k in (kinds or {}).items() if keep(name))


def summarize_driver(runs, workload, variants):
    """One row a variant that measured its driver calls (gpualloc's): the
    milliseconds of the kinds in DRIVER_KINDS, of the others, of all steps,
    of step 0 and of the setup before the loop (building the model),
    medians over repeats, and the milliseconds the unmapping thread spent
    in the whole run. Runs recorded before the setup was read apart
    (round 19's first two) count it within step 0 and the steps and show
    no setup."""
    rows = []
    for v in variants:
        res = [r["result"] for r in runs if r["workload"] == workload and r["variant"] == v and ok(r)]
        res = [x for x in res if x.get("driver_calls")]
        if not res:
            continue
        row = {"variant": v, "runs": len(res),
               "total_ms": median([driver_ms(x["driver_calls"], lambda n: True) for x in res]),
               "step0_ms": median([driver_ms(x.get("driver_calls_step0"), lambda n: True) for x in res]),
               "setup_ms": median([driver_ms(x["driver_calls_setup"], lambda n: True) if "driver_calls_setup" in x else None
                                   for x in res]),
               "other_ms": median([driver_ms(x["driver_calls"], lambda n: n not in DRIVER_KINDS) for x in res]),
               "helper_ms": median([driver_ms(x["helper_driver_calls"], lambda n: True)
                                    if x.get("helper_driver_calls") is not None else None for x in res])}
        for kind in DRIVER_KINDS:
            row[kind] = median([driver_ms(x["driver_calls"], lambda n, k=kind: n == k) for x in res])
            row[kind + " calls"] = median([x["driver_calls"].get(kind, {}).get("calls", 0) for x in res])
        rows.append(row)
    return rows


def summarize_churn(runs, variants, workload):
    """One row a variant, as summarize_training does for training."""
    by = {(r["variant"], r["repeat"]): r["result"] for r in runs if r["workload"] == workload and ok(r)}
    repeats = sorted({rep for _, rep in by})
    base = {rep: min((by[(v, rep)]["us_per_alloc_free"] for v in NATIVE if (v, rep) in by), default=None) for rep in repeats}
    rows = []
    for v in variants:
        res = [(rep, by[(v, rep)]) for rep in repeats if (v, rep) in by]
        ratios = [x["us_per_alloc_free"] / base[rep] for rep, x in res if base[rep]]
        rows.append({
            "variant": v,
            "runs": len(res),
            "peak_reserved_over_allocated": median([x["peak_reserved_over_allocated"] for _, x in res]),
            "us_per_alloc_free": median([x["us_per_alloc_free"] for _, x in res]),
            "ratio_vs_faster_native": median(ratios),
            "ratio_interval95": ratio_interval(ratios),
            "floor_us_per_call": median([x.get("floor_us_per_call") for _, x in res]),
        })
    return rows


def fastest_floor_ratio(runs, workload):
    """The fastest floor any run of `workload` measured over the fastest
    time per alloc+free of a PyTorch mode: on a machine whose load only
    ever slows a loop down, the least disturbed estimate of floor_ratios;
    None without both."""
    ok_runs = [r for r in runs if r["workload"] == workload and ok(r)]
    floors = [r["result"]["floor_us_per_call"] for r in ok_runs if r["result"].get("floor_us_per_call")]
    base = [r["result"]["us_per_alloc_free"] for r in ok_runs if r["variant"] in NATIVE]
    return min(floors) / min(base) if floors and base else None


def floor_ratios(runs, workload):
    """Per repeat, the churn loop's floor (the same loop with tensors of 0
    bytes, the lowest floor any variant measured in that repeat) over the
    faster PyTorch mode's time per alloc+free: the lowest time ratio any
    allocator could reach on this machine."""
    by = {}
    for r in runs:
        if r["workload"] == workload and ok(r):
            by.setdefault(r["repeat"], {})[r["variant"]] = r["result"]
    out = []
    for per in by.values():
        base = [per[v]["us_per_alloc_free"] for v in NATIVE if v in per]
        floors = [x["floor_us_per_call"] for x in per.values() if x.get("floor_us_per_call")]
        if base and floors:
            out.append(min(floors) / min(base))
    return out


# Student's t, two-sided 95%, by degrees of freedom (beyond 30: 2.0, a bit
# wider than the normal's 1.96).
T975 = [None, 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052,
        2.048, 2.045, 2.042]


def ratio_interval(ratios):
    """The geometric mean of per-repeat ratios and its 95% confidence
    interval (Student's t on the logarithms), as [mean, low, high]; None
    with fewer than two ratios. A ratio target is met when `high` is at or
    below it, missed when `low` is above it; in between the repeats cannot
    tell."""
    logs = [math.log(r) for r in ratios if r]
    n = len(logs)
    if n < 2:
        return None
    m = statistics.fmean(logs)
    half = (T975[n - 1] if n - 1 < len(T975) else 2.0) * statistics.stdev(logs) / math.sqrt(n)
    return [math.exp(m), math.exp(m - half), math.exp(m + half)]


def memory_calls_verdict(mine, theirs):
    """Whether a run's memory calls after warm-up (per 100 steps) are no
    more than PyTorch expandable's. PyTorch expandable's figure counts
    ranges, each one call or more: at or under it is met, over it a miss
    only where PyTorch expandable made none."""
    if mine is None or theirs is None:
        return "not measured"
    if mine <= theirs:
        return "met"
    if theirs == 0:
        return "missed"
    return "cannot tell (PyTorch expandable's figure is a lower bound of its calls)"


def verdict_ratio(ratios, limit):
    """Whether per-repeat ratios meet `ratio <= limit`: by the 95% interval
    with two repeats or more, by the one ratio otherwise."""
    ratios = [r for r in ratios if r]
    if not ratios:
        return "not run"
    iv = ratio_interval(ratios)
    if iv is None:
        return ("met" if ratios[0] <= limit else "missed") + " (one repeat)"
    if iv[2] <= limit:
        return "met"
    if iv[1] > limit:
        return "missed"
    return f"cannot tell ({fmt_interval(iv)})"


def targets(bench, ours="gpualloc"):
    """The issue's targets for variant `ours` (gpualloc's default), one row
    each: (workload, target, value, verdict). R/A and device allocations
    compare medians over repeats; time ratios use the interval."""
    rows = []
    per_repeat = {}
    for r in bench["runs"]:
        if ok(r):
            per_repeat.setdefault((r["workload"], r["variant"]), {})[r["repeat"]] = r["result"]

    def ratios(w, key):
        mine = per_repeat.get((w, ours), {})
        out = []
        for rep, x in mine.items():
            base = [per_repeat.get((w, v), {}).get(rep, {}).get(key) for v in NATIVE]
            base = [b for b in base if b]
            if base and x.get(key):
                out.append(x[key] / min(base))
        return out

    def ran(kind):
        """(workload, its rows by variant, our R/A) for each workload ours ran; a row for the others."""
        for w, table in (bench.get(kind) or {}).items():
            if w in SMALL:  # not the issue's workloads
                continue
            by = {r["variant"]: r for r in table}
            if ours in by and by[ours]["runs"]:
                yield w, by, by[ours]["peak_reserved_over_allocated"]
            else:
                rows.append((w, "all", "–", "not run"))

    def ra_row(w, ra, limit):
        return (w, f"R/A <= {limit}", fmt(ra, ".3f"), "met" if ra is not None and ra <= limit else "missed")

    for w, by, ra in ran("training"):
        rows.append(ra_row(w, ra, 1.01))
        rs = ratios(w, "mean_step_s_all")
        rows.append((w, "mean step <= 1.00x the faster PyTorch mode", fmt(median(rs), ".3f"), verdict_ratio(rs, 1.0)))
        mine, theirs = by[ours]["device_allocs_after_warmup"], by.get("native-expandable", {}).get("device_allocs_after_warmup")
        verdict = "not run" if mine is None or theirs is None else ("met" if mine <= theirs else "missed")
        rows.append((w, "device allocations after warm-up <= PyTorch expandable's",
                     f"{fmt(mine, '.0f')} vs {fmt(theirs, '.0f')}", verdict))
        mine = by[ours].get("memory_calls_per_100_after_warmup")
        theirs = by.get("native-expandable", {}).get("memory_calls_per_100_after_warmup")
        rows.append((w, "memory calls per 100 steps after warm-up <= PyTorch expandable's (its maps and unmaps, "
                        "each one call or more)", f"{fmt(mine, '.1f')} vs {fmt(theirs, '.1f')}",
                     memory_calls_verdict(mine, theirs)))
    for w, by, ra in ran("churn"):
        if w == "churn":
            rows.append(ra_row(w, ra, 1.05))
        rs = ratios(w, "us_per_alloc_free")
        rows.append((w, ">= 1.5x faster than the faster PyTorch mode (time ratio <= 0.667)",
                     fmt(median(rs), ".3f"), verdict_ratio(rs, 1 / 1.5)))
        fs = floor_ratios(bench["runs"], w)
        if fs:
            reach = verdict_ratio(fs, 1 / 1.5)
            reach = {"met": "within reach", "missed": "out of reach of any allocator"}.get(
                reach.split(" (")[0], reach) + (" (one repeat)" if len(fs) == 1 else "")
            rows.append((w, "floor: the loop with 0-byte tensors over the faster PyTorch mode (the lowest ratio "
                            "any allocator can reach)", fmt(median(fs), ".3f"), reach))
            best = fastest_floor_ratio(bench["runs"], w)
            rows.append((w, "floor, fastest runs: the fastest floor over the fastest PyTorch run (timing noise "
                            "only slows a run)", fmt(best, ".3f"),
                         "within reach" if best <= 1 / 1.5 else "out of reach of any allocator"))
    return rows


def fmt_interval(iv):
    return "–" if iv is None else f"{iv[1]:.3f}–{iv[2]:.3f}"


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


HOST_NOTE = ("host µs: the median over runs of each process's host speed, µs per `torch.empty(0)` "
             "(checks._host_floor_us); processes of one machine differ by up to 2x in it, and host-bound "
             "steps with them (tests/gpu/host_probe.py).")


def markdown(bench):
    """The tables (and what failed or did not run), as Markdown."""
    a = bench["args"]
    sections = []
    if a["repeats"] and bench["training"]:
        sec = [f"## Training, {a['steps']} steps, medians over {a['repeats']} repeat(s)", "",
               "| workload | variant | runs | R/A | mean, all steps (ms) | median (ms) | device allocs after warm-up "
               "| memory calls per 100 steps after warm-up | mean / faster native | 95% interval | losses agree "
               "| host µs |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for w, rows in bench["training"].items():
            for r in rows:
                agree = {True: "yes", False: "**no**", None: "–"}[r["losses_agree_with_native"]]
                sec.append(f"| {w} | {r['variant']} | {r['runs']} | {fmt(r['peak_reserved_over_allocated'], '.3f')} "
                           f"| {fmt(r['mean_step_ms_all'], '.1f')} | {fmt(r['median_step_ms'], '.1f')} "
                           f"| {fmt(r['device_allocs_after_warmup'], '.0f')} "
                           f"| {fmt(r.get('memory_calls_per_100_after_warmup'), '.1f')} "
                           f"| {fmt(r['ratio_mean_all_vs_faster_native'], '.3f')} "
                           f"| {fmt_interval(r.get('ratio_mean_all_interval95'))} | {agree} "
                           f"| {fmt(r.get('host_floor_us'), '.2f')} |")
        sec += ["", INTERVAL_NOTE, "", HOST_NOTE]
        sections.append(sec)
    if a["repeats"] and any(bench.get("driver", {}).values()):
        sec = ["## Driver time measured by gpualloc (ms, medians over repeats; calls in parentheses)", "",
               "| workload | variant | all steps | step 0 | setup | " + " | ".join(DRIVER_KINDS)
               + " | other | unmapping thread |",
               "|---|---|---|---|---|" + "---|" * (len(DRIVER_KINDS) + 2)]
        for w, rows in bench["driver"].items():
            for r in rows:
                kinds = " | ".join(f"{fmt(r[k], '.1f')} ({fmt(r[k + ' calls'], 'g')})" for k in DRIVER_KINDS)
                sec.append(f"| {w} | {r['variant']} | {fmt(r['total_ms'], '.1f')} | {fmt(r['step0_ms'], '.1f')} "
                           f"| {fmt(r['setup_ms'], '.1f')} | {kinds} | {fmt(r['other_ms'], '.1f')} "
                           f"| {fmt(r.get('helper_ms'), '.1f')} |")
        sec += ["", "The columns by kind (and other) cover all steps. Setup is what came before the first step "
                "(building the model); runs that did not read it apart show –, and count it within step 0 and "
                "all steps. The allocating thread's time: the unmapping handed to the helper thread "
                "(`unmap_thread`) counts there with the time spent waiting for it, and the last column is "
                "that thread's own time over the whole run (– where not measured)."]
        sections.append(sec)
    for w, rows in (bench.get("churn") or {}).items() if a["repeats"] else ():
        sec = [f"## {w}, {CHURN_OPS} torch.empty calls, medians over {a['repeats']} repeat(s)", "",
               "| variant | runs | R/A | µs per alloc+free | / faster native | 95% interval | floor µs (0 bytes) |",
               "|---|---|---|---|---|---|---|"]
        for r in rows:
            sec.append(f"| {r['variant']} | {r['runs']} | {fmt(r['peak_reserved_over_allocated'], '.3f')} "
                       f"| {fmt(r['us_per_alloc_free'], '.3f')} | {fmt(r['ratio_vs_faster_native'], '.3f')} "
                       f"| {fmt_interval(r.get('ratio_interval95'))} | {fmt(r.get('floor_us_per_call'), '.3f')} |")
        sections.append(sec)
    if bench.get("max_batch"):
        sec = [f"## Largest batch under {a['max_batch_gib']:g} GiB (checks.py max_batch)", "",
               "| workload | variant | max batch | first OOM batch | attempts | peak reserved at max (GiB) |",
               "|---|---|---|---|---|---|"]
        for w, per in bench["max_batch"].items():
            for v, r in per.items():
                res = r.get("result", {})
                if not ok(r):
                    sec.append(f"| {w} | {v} | {r.get('error') or res.get('skipped')} | | | |")
                    continue
                best = [t for t in res["attempts"] if t["batch"] == res["max_batch"]]
                sec.append(f"| {w} | {v} | {res['max_batch']} | {fmt(res['first_oom_batch'], 'd')} | {len(res['attempts'])} "
                           f"| {fmt(best[0]['peak_reserved'] / 2**30 if best else None, '.2f')} |")
        sections.append(sec)
    if a["repeats"] and (rows := targets(bench)):
        sec = ["## Targets (gpualloc's default configuration)", "",
               "| workload | target | value | verdict |", "|---|---|---|---|"]
        sec += [f"| {w} | {t} | {v} | {x} |" for w, t, v, x in rows]
        sections.append(sec)
    if a["repeats"]:
        workloads = [*(bench.get("training") or {}), *(bench.get("churn") or {})]
        sections += [[note] for note in driver.order_notes(bench["runs"], workloads, list(bench["variants"]), ok)]
    if a.get("pool"):
        sections.append([f"Pooled from {len(a['pool'])} benches (repeats numbered in this order): "
                         + ", ".join(f"`{x}`" for x in a["pool"])])
    failed = [f"- {r['workload']} {r['variant']} repeat {r['repeat']}: {r.get('error') or r['result'].get('skipped')}"
              for r in bench["runs"] if not ok(r)]
    if failed:
        sections.append(["Failed, or skipped by the check:", ""] + failed)
    if bench["skipped"]:
        budget = "each bench's time budget" if a.get("pool") else f"time budget of {a['budget']:.0f} s"
        sections.append([f"Not run ({budget}):", ""] + [f"- {x}" for x in bench["skipped"]])
    return "\n\n".join("\n".join(sec) for sec in sections) + "\n"


def pooled(benches):
    """One bench of the runs of `benches` (`(name, bench.json contents)`
    pairs), their repeats numbered one bench after the other, in the order
    given. A ValueError when they are not like with like: other steps,
    other variants, or one bench twice (the same start time)."""
    steps = {b["args"]["steps"] for _, b in benches}
    if len(steps) != 1:
        raise ValueError(f"the benches ran different steps ({', '.join(map(str, sorted(steps)))}): pool like with like")
    kinds = {tuple(sorted(b["variants"])) for _, b in benches}
    if len(kinds) != 1:
        raise ValueError(f"the benches ran different variants ({' against '.join(map(','.join, sorted(kinds)))}): "
                         "each repeat's ratio must have the same baseline")
    started = [str(b.get("started")) for _, b in benches]
    if len(set(started)) != len(started):
        raise ValueError("one bench given twice (two files started at the same time): its repeats would count twice")
    runs, skipped, offset = [], [], 0
    for name, b in benches:
        runs += [{**r, "repeat": r["repeat"] + offset, "pooled_from": r.get("pooled_from", name)} for r in b["runs"]]
        skipped += [x if b["args"].get("pool") else f"{name}: {x}" for x in b["skipped"]]
        offset += max([b["args"]["repeats"]] + [r["repeat"] + 1 for r in b["runs"]])
    variants = list(benches[0][1]["variants"])
    args = {**benches[0][1]["args"], "repeats": offset,
            "pool": [x for name, b in benches for x in b["args"].get("pool") or [name]]}
    workloads = [w for w in ALL if any(r["workload"] == w for r in runs)]
    return {"started": started, "args": args, "variants": variants, "runs": runs, "skipped": skipped,
            "training": {w: summarize_training(runs, w, variants) for w in workloads if w.startswith("train_")},
            "driver": {w: summarize_driver(runs, w, variants) for w in workloads if w.startswith("train_")},
            "churn": {w: summarize_churn(runs, variants, w) for w in workloads if w.startswith("churn")}}


def write(bench, out):
    """bench.md and bench.json in `out`; prints the tables."""
    table = markdown(bench)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(bench, f, indent=2, default=str)
    print("\n" + table)
    took = f" ({bench['total_s']} s)" if "total_s" in bench else ""
    print(f"bench: {os.path.join(out, 'bench.json')}{took}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60, help="training steps a run")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every workload under every variant (0: none)")
    p.add_argument("--only", default="", help=f"workloads, of {','.join(ALL)} (default: all but the small ones)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="variant names (driver.VARIANTS), gpualloc[CONF] or native[CONF]")
    p.add_argument("--budget", type=float, default=540, help="seconds for everything, the bridge build included")
    p.add_argument("--max-batch", action="store_true", help="also find each training workload's largest batch per variant")
    p.add_argument("--max-batch-gib", type=float, default=12.0, help="the memory budget of --max-batch")
    p.add_argument("--pool", nargs="+", metavar="BENCH_JSON", help="run nothing: the tables of these benches' runs together")
    args = p.parse_args()
    if args.pool:
        benches = []
        for path in args.pool:
            try:
                with open(path) as f:
                    benches.append((path, json.load(f)))
            except (OSError, ValueError) as e:
                p.error(f"--pool: cannot read {path}: {e}")
        if any(b.get("max_batch") for _, b in benches):
            print("bench: --pool leaves out the --max-batch results (one search a variant, nothing to pool)",
                  file=sys.stderr)
        try:
            bench = pooled(benches)
        except ValueError as e:
            p.error(f"--pool: {e}")
        except (KeyError, TypeError, AttributeError) as e:
            p.error(f"--pool: one of the files is not a bench.json of this script ({e!r})")
        os.makedirs(args.out, exist_ok=True)
        write(bench, args.out)
        return
    try:
        variants = driver.parse_variants(args.variants)
    except ValueError as e:
        p.error(str(e))
    workloads = [w for w in ALL if w in args.only.split(",") or (not args.only and w in WORKLOADS)]
    unknown = set(filter(None, args.only.split(","))) - set(ALL)
    if unknown or not workloads:
        p.error(f"--only takes {','.join(ALL)} (got {args.only!r})")
    uses_gpualloc = driver.require_library(variants)

    logdir = os.path.join(args.out, "bench-logs")
    os.makedirs(logdir, exist_ok=True)
    start = time.time()
    bench = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
             "variants": {v: driver.variant(v) for v in variants}, "runs": [], "skipped": []}
    if uses_gpualloc:
        bench["bridge_build"] = driver.build_bridge(logdir)
    longest = {}

    def run(check, name, kind, timeout, steps, label, extra_args=()):
        """driver.run_one within the budget; None (and listed) when it does not fit."""
        left = args.budget - (time.time() - start)
        need = max(MIN_LEFT_S, longest.get(kind, 0))
        if left < need:
            bench["skipped"].append(f"{label}: needs about {need:.0f} s, {left:.0f} s left")
            print(f"{label}: skipped (needs about {need:.0f} s, {left:.0f} s left)", flush=True)
            return None
        r = driver.run_one(check, name, min(timeout, left), steps, logdir, extra_args, label)
        longest[kind] = max(longest.get(kind, 0), r["wall_s"])
        return r

    for rep in range(args.repeats):
        order = driver.run_order(variants, rep)
        for w in workloads:
            for v in order:
                churn = w.startswith("churn")
                r = run(w, v, w, CHURN_TIMEOUT_S if churn else train_timeout(args.steps),
                        CHURN_OPS if churn else args.steps, f"{w}-{v}-r{rep}")
                if r is None:
                    continue
                bench["runs"].append({"workload": w, "variant": v, "repeat": rep, **r})
                res = r.get("result", {})
                if not ok(r):
                    brief = r.get("error") or res.get("skipped")
                elif churn:
                    brief = f"{res['us_per_alloc_free']:.3f} us/alloc+free, R/A {res['peak_reserved_over_allocated']:.3f}"
                else:
                    brief = (f"mean(all) {res['mean_step_s_all'] * 1e3:.1f} ms, median {res['median_step_s'] * 1e3:.1f} ms, "
                             f"R/A {res['peak_reserved_over_allocated']:.3f}, "
                             f"device allocs after warm-up {res['device_allocs_after_warmup']}")
                print(f"{w} {v} r{rep}: {brief} ({r['wall_s']} s)", flush=True)

    if args.max_batch:
        bench["max_batch"] = {}
        for w in workloads:
            # A small workload's builder is its big one's, at another batch.
            if not w.startswith("train_") or w in SMALL:
                continue
            name = w[len("train_"):]
            for v in variants:
                r = run("max_batch", v, f"max_batch/{name}", MAX_BATCH_TIMEOUT_S, 0, f"max_batch-{name}-{v}",
                        ["--workload", name, "--budget-gib", str(args.max_batch_gib)])
                if r is None:
                    continue
                bench["max_batch"].setdefault(name, {})[v] = r
                res = r.get("result", {})
                brief = f"max batch {res['max_batch']} ({len(res['attempts'])} attempts)" if ok(r) else r.get("error") or res.get("skipped")
                print(f"max_batch {name} {v}: {brief} ({r['wall_s']} s)", flush=True)

    bench["training"] = {w: summarize_training(bench["runs"], w, variants) for w in workloads if w.startswith("train_")}
    bench["driver"] = {w: summarize_driver(bench["runs"], w, variants) for w in workloads if w.startswith("train_")}
    bench["churn"] = {w: summarize_churn(bench["runs"], variants, w) for w in workloads if w.startswith("churn")}
    bench["total_s"] = round(time.time() - start, 1)
    write(bench, args.out)


if __name__ == "__main__":
    main()
