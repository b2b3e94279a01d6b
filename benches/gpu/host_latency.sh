#!/usr/bin/env bash
# host_latency.sh - build and run host_latency.cu (see its header): the
# host's cost of small copies, memsets, launches and pointer queries as the
# process maps more physical handles. Needs nvcc and a GPU with 33 GiB free.
#
#     bash benches/gpu/host_latency.sh     # writes ${OUT:-./host-latency}/host_latency.md
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${OUT:-./host-latency}
mkdir -p "$out"
bin=${TMPDIR:-/tmp}/host_latency
nvcc -O2 -std=c++17 -o "$bin" "$here/host_latency.cu" -lcuda
"$bin" | tee "$out/host_latency.md"
