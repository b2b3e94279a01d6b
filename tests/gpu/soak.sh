#!/usr/bin/env bash
# Runs one GPU check again and again, to catch a failure that comes once in
# many runs (a crash, a wrong result):
#
#   bash tests/gpu/soak.sh churn_wide            # 20 runs under gpualloc
#   bash tests/gpu/soak.sh churn_wide 50 native  # 50 runs under PyTorch's allocator
#
# Each run is `python3 tests/gpu/checks.py CHECK --alloc ALLOC` in a fresh
# process, under the environment of every GPU script (tests/gpu/env.sh:
# Python's faulthandler and gpualloc's crash report on). Prints one line a
# run (its status, its time, the result's main figures); keeps the output
# of each run that failed (a status not 0, no result, or an error in it)
# as $RESULTS/soak-CHECK-N.log and writes $RESULTS/soak-CHECK.txt with every
# line. GPUALLOC_TEST_CONF gives gpualloc a configuration;
# GPUALLOC_GPU_BUDGET_S (default 480) stops the runs early. Exits 1 when a
# run failed.
set -u
source "$(dirname "$0")/env.sh"
check=${1:?usage: soak.sh CHECK [RUNS] [ALLOC]}
runs=${2:-20}
alloc=${3:-gpualloc}
budget=${GPUALLOC_GPU_BUDGET_S:-480}
summary="$RESULTS/soak-$check.txt"
: >"$summary"
failed=0
for ((i = 1; i <= runs; i++)); do
  if ((SECONDS > budget)); then
    echo "stopped after $((i - 1)) runs: time budget of $budget s spent" | tee -a "$summary"
    break
  fi
  t0=$SECONDS
  log="$RESULTS/soak-$check-$i.log"
  # A run that hangs ends with the budget (at least a minute, at most ten).
  limit=$((budget - SECONDS))
  limit=$((limit < 60 ? 60 : limit > 600 ? 600 : limit))
  timeout "$limit" python3 tests/gpu/checks.py "$check" --alloc "$alloc" >"$log.out" 2>"$log.err"
  rc=$?
  figures=$(grep -o '"\(us_per_alloc_free\|ns_per_alloc_free\|peak_reserved_over_allocated\|passed\|total\)": [^,}]*' "$log.out" | tr '\n' ' ')
  # The result's own error (not a sub-check's), or none.
  error=$(python3 -c 'import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("GPUALLOC_RESULT ")]
print("no result" if not lines else json.loads(lines[-1][len("GPUALLOC_RESULT "):]).get("error", ""))' "$log.out")
  echo "run $i: rc=$rc $((SECONDS - t0)) s $figures${error:+error: $error}" | tee -a "$summary"
  if [ "$rc" -ne 0 ] || [ -n "$error" ]; then
    failed=$((failed + 1))
    { echo "--- stdout"; cat "$log.out"; echo "--- stderr"; cat "$log.err"; } >"$log"
    tail -60 "$log.err"
  fi
  rm -f "$log.out" "$log.err"
done
echo "$check under $alloc: $failed failed of $((i - 1))" | tee -a "$summary"
[ "$failed" -eq 0 ]
