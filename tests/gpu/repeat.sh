#!/usr/bin/env bash
# Repeated, interleaved timings (PyTorch's allocator and gpualloc in
# alternation) so that ratios can be read against run-to-run noise:
#   bash tests/gpu/repeat.sh [REPEATS]      (default 5)
# Prints one line per run and the median ratio per check; writes
# repeat.json to $OUT (or ./gpu-results).
set -eu
cd "$(dirname "$0")/../.."
export GPUALLOC_LIBRARY=${GPUALLOC_LIBRARY:-$PWD/target/release/libgpualloc.so}
export PYTHONPATH=$PWD/python-shim${PYTHONPATH:+:$PYTHONPATH}
export GPUALLOC_BUILD_DIR=${GPUALLOC_BUILD_DIR:-${TMPDIR:-/tmp}/gpualloc-bridge}
N=${1:-5}
R=${OUT:-gpu-results}
mkdir -p "$R"
python3 - "$N" "$R/repeat.json" <<'PY'
import json, os, statistics, subprocess, sys
n, out = int(sys.argv[1]), sys.argv[2]
plan = [  # (check, steps, metric, variants: name -> (alloc, env))
    ("churn", 200000, "us_per_alloc_free", {"native": ("native", {}), "gpualloc": ("gpualloc", {})}),
    ("train_detector", 60, "median_step_s", {"native": ("native", {}),
        "gpualloc-expandable": ("gpualloc", {"GPUALLOC_TEST_CONF": "expandable_segments:true"})}),
]
res = {}
for check, steps, metric, variants in plan:
    vals = {v: [] for v in variants}
    for i in range(n):
        for v, (alloc, env) in variants.items():
            p = subprocess.run([sys.executable, "tests/gpu/checks.py", check, "--alloc", alloc, "--steps", str(steps)],
                               capture_output=True, text=True, env=dict(os.environ, **env), timeout=300)
            line = next((l for l in p.stdout.splitlines() if l.startswith("GPUALLOC_RESULT ")), None)
            r = json.loads(line.split(" ", 1)[1]).get("result", {}) if line else {}
            if metric in r:
                vals[v].append(r[metric])
            print(check, i, v, r.get(metric, "failed: " + p.stderr[-300:]), flush=True)
    base = list(variants)[0]
    summary = {v: {"values": xs, "median": statistics.median(xs) if xs else None} for v, xs in vals.items()}
    for v in variants:
        if v != base and vals[v] and vals[base]:
            summary[v]["median_ratio_vs_" + base] = statistics.median(vals[v]) / statistics.median(vals[base])
            print(check, v, "median ratio", round(summary[v]["median_ratio_vs_" + base], 3), flush=True)
    res[check] = {"metric": metric, "steps": steps, "runs": summary}
json.dump(res, open(out, "w"), indent=2)
PY
