#!/usr/bin/env bash
# cu_bench.sh - build one of this folder's CUDA benchmarks with nvcc and run
# it (see the header of NAME.cu for what it measures and needs):
#
#     bash benches/gpu/cu_bench.sh host_latency       # writes ${OUT:-./host_latency}/host_latency.md
#     bash benches/gpu/cu_bench.sh handle_bandwidth   # writes ${OUT:-./handle_bandwidth}/handle_bandwidth.md
#     bash benches/gpu/cu_bench.sh vmm_threads        # writes ${OUT:-./vmm_threads}/vmm_threads.md
#     bash benches/gpu/cu_bench.sh vmm_stall          # writes ${OUT:-./vmm_stall}/vmm_stall.md
#     bash benches/gpu/cu_bench.sh capture_probe      # writes ${OUT:-./capture_probe}/capture_probe.md
#     bash benches/gpu/cu_bench.sh access_costs       # writes ${OUT:-./access_costs}/access_costs.md
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
name=${1:?usage: cu_bench.sh NAME (host_latency, handle_bandwidth, vmm_threads, vmm_stall, capture_probe or access_costs)}
src="$here/$name.cu"
[[ -f $src ]] || { echo "cu_bench.sh: no $src" >&2; exit 2; }
out=${OUT:-./$name}
mkdir -p "$out"
bin=${TMPDIR:-/tmp}/$name
nvcc -O2 -std=c++17 -o "$bin" "$src" -lcuda
"$bin" | tee "$out/$name.md"
