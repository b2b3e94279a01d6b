#!/usr/bin/env bash
# Runs every test that needs no GPU: the Rust workspace (unit, property,
# scenario, C ABI and CLI tests), the Python package's tests on the
# simulated backend, the C++ bridge's compile check against torch's
# headers, and the GPU scripts' summaries on made-up results.
# This is the command README.md gives and .ci/run runs.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p gpualloc-capi
# Where cargo put it, wherever the target folder is configured.
target=$(cargo metadata --no-deps --format-version 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
lib="$target/release/libgpualloc.so"
# Every target, criterion's benchmarks included, each run once as a test (a
# benchmark that panics, as tracing to /dev/null did for a while, fails
# here rather than when timed); then the doc tests, which --all-targets
# leaves out (cargo notes that the C ABI's crate, a cdylib, has none;
# excluding it would change the features the others build with, and
# rebuild them). The C programs of the tests link to the release library
# just built, the one users load, rather than build a debug one: the debug
# assertions it would add are those the Rust tests already run with every
# invariant checked; a plain `cargo test` still builds and links the
# debug library.
GPUALLOC_TEST_LIBRARY="$lib" cargo test --workspace --all-targets
cargo test --workspace --doc

if [ -d python-shim/tests ]; then
  GPUALLOC_LIBRARY="$lib" PYTHONPATH="$PWD/python-shim" \
    python3 -m unittest discover -s python-shim/tests -t python-shim -v
  if [ -z "${GPUALLOC_TEST_TORCH_PYTHON:-}" ]; then
    echo "test_auto_torch.py skipped: GPUALLOC_TEST_TORCH_PYTHON names no Python with torch (a CPU build is enough)"
  fi
fi

# The package on the oldest Python pyproject.toml allows, when this machine
# has one (a call new in 3.11 once broke `python -m gpualloc run` on 3.9).
oldest=""
for py in python3.9 "$(pyenv root 2>/dev/null)"/versions/3.9*/bin/python3; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import sys; assert sys.version_info[:2] == (3, 9)' 2>/dev/null; then
    oldest="$py"
    break
  fi
done
if [ -n "$oldest" ] && [ -d python-shim/tests ]; then
  GPUALLOC_LIBRARY="$lib" PYTHONPATH="$PWD/python-shim" \
    "$oldest" -m unittest discover -s python-shim/tests -t python-shim
else
  echo "SKIPPED: the package on Python 3.9 (none found)"
fi

# The C++ bridge to PyTorch compiled against torch's headers (fetched once
# from the package registry; SKIPPED where it cannot be reached).
bash tools/check_bridge.sh

# The GPU scripts' summaries on made-up results (no torch needed).
python3 -m unittest discover -s tests/gpu -p 'test_*.py'

# The HTML report in headless Chromium; prints SKIPPED when there is none.
GPUALLOC_CLI="$target/debug/gpualloc" \
  GPUALLOC_LIBRARY="$lib" \
  python3 tests/browser/test_report.py
