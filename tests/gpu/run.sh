#!/usr/bin/env bash
# GPU tests, one command (on a machine with a GPU, torch, g++ and ninja; no cargo needed):
#
#   bash tests/gpu/run.sh            # expects target/release/libgpualloc.so
#   bash tests/gpu/run.sh --only dropin,streams,compat,threads --check-variants gpualloc
#                                    # a build's quick check, gpualloc only (about 2 min)
#
# Everything takes longer than one 10-minute device call (round 52: 400 s
# on an H100 reached compat under gpualloc, with the trainings left): split it, the
# correctness checks first (the order they run in), then the timed loops,
# then the trainings:
#
#   bash tests/gpu/run.sh --only dropin,streams,threads,multi_device,compat,ipc,launcher,auto_marks,promise
#   bash tests/gpu/run.sh --only churn,churn_wide,churn_cpp,trace_cpp,kernel_speed
#   bash tests/gpu/run.sh --only train_resnet,train_gpt2,train_detector,train_backbone
#
# Runs every check of tests/gpu/checks.py under PyTorch's allocator and under
# gpualloc, each in its own subprocess with a timeout, and writes
# summary.json plus one log per run (packed as logs.tar.gz) to $OUT (or
# ./gpu-results).
# GPUALLOC_LIBRARY overrides the library; GPUALLOC_GPU_BUDGET_S (default 480)
# caps the total time; extra arguments go to driver.py (e.g. --only dropin,streams).
set -u
source "$(dirname "$0")/env.sh"
if [ ! -f "$GPUALLOC_LIBRARY" ]; then
  echo "missing $GPUALLOC_LIBRARY: run 'cargo build --release -p gpualloc-capi' (or carry it)" | tee "$RESULTS/error.txt"
  exit 1
fi
environment
# docs/torch-compat.md against this torch's allocator interface.
python3 -m unittest python-shim/tests/test_torch_compat.py -v 2>&1 | tee "$RESULTS/torch-compat.log"
python3 tests/gpu/driver.py --out "$RESULTS" "$@" 2>&1 | tee "$RESULTS/driver.log"
rc=${PIPESTATUS[0]}
# One file for the runs' logs (a device run brings back only so many files;
# a run.sh killed before this line leaves them in logs/, and summary.json
# with the checks that finished, marked "complete": false). The status is
# driver.py's: 1 when a run failed (it prints each, and summary.json's
# "failures" lists them), 0 when none did; a run the time budget skipped is
# no failure.
if [ -d "$RESULTS/logs" ]; then
  tar czf "$RESULTS/logs.tar.gz" -C "$RESULTS" logs && rm -rf "$RESULTS/logs"
fi
exit "$rc"
