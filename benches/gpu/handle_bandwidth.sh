#!/usr/bin/env bash
# handle_bandwidth.sh - build and run handle_bandwidth.cu (see its header):
# streaming bandwidth over memory mapped from physical handles of 2 MiB ..
# 1 GiB, against cudaMalloc. Needs nvcc and a GPU with 9 GiB free.
#
#     bash benches/gpu/handle_bandwidth.sh     # writes ${OUT:-./handle-bandwidth}/handle_bandwidth.md
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-./handle-bandwidth}
mkdir -p "$out"
bin=${TMPDIR:-/tmp}/handle_bandwidth
nvcc -O2 -std=c++17 -o "$bin" "$here/handle_bandwidth.cu" -lcuda
"$bin" | tee "$out/handle_bandwidth.md"
