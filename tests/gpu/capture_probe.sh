#!/usr/bin/env bash
# Which virtual-memory and event calls may run while a CUDA graph is being
# captured (one command, on a machine with a GPU and nvcc; no torch needed):
#
#   bash tests/gpu/capture_probe.sh
#
# Builds tests/gpu/capture_probe.cpp against the driver API and writes its
# table to $OUT/capture-probe.md (or ./gpu-results).
set -eu
cd "$(dirname "$0")/../.."
RESULTS=${OUT:-$PWD/gpu-results}
mkdir -p "$RESULTS"
bin=${TMPDIR:-/tmp}/gpualloc-capture-probe
nvcc -O1 -std=c++17 -o "$bin" tests/gpu/capture_probe.cpp -lcuda -lpthread
"$bin" | tee "$RESULTS/capture-probe.md"
