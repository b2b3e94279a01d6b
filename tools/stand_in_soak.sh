#!/usr/bin/env bash
# The CUDA backend on the checking stand-in driver (capi/tests/c/fake_cuda.c),
# again and again with random settings, for as long as asked; no GPU needed.
#
#   bash tools/stand_in_soak.sh [SECONDS] [OUT]     # default 600 s, ./stand-in-soak
#
# Each run takes 20,000 to 150,000 steps, 2 to 12 threads, one or two
# devices, events that complete 0 to 500 us after they are recorded,
# memory-mapping calls of 0 to 60 us, and one of five configurations. A run
# fails when it ends with a status other than 0 or the stand-in reports a
# misuse; its settings go to OUT/summary.txt and its output to
# OUT/run-N.{out,err}. The status is 1 when a run failed.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
out=${2:-stand-in-soak}
mkdir -p "$out"
out=$(cd "$out" && pwd)

cargo build --release -p gpualloc-capi
target=$(cargo metadata --no-deps --format-version 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
lib="$target/release"
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
gcc -std=c11 -O1 -g -shared -fPIC -pthread capi/tests/c/fake_cuda.c -o "$bin/libcuda.so"
gcc -std=c11 -O1 -g -pthread -I capi/include capi/tests/c/fake_cuda_test.c -o "$bin/fake_cuda_test" \
  -L "$lib" -lgpualloc -lm

confs=("" "expandable_handle_mb:2" "garbage_collection_threshold:0.5" "max_split_size_mb:64" "defragment_budget:0.01")
end=$(($(date +%s) + seconds))
runs=0
failed=0
: >"$out/summary.txt"
while [ "$(date +%s)" -lt "$end" ]; do
  runs=$((runs + 1))
  ops=$((20000 + RANDOM * 4))
  threads=$((2 + RANDOM % 11))
  devices=$((1 + RANDOM % 2))
  event_us=$((RANDOM % 3 == 0 ? 0 : RANDOM % 500))
  vmm_us=$((RANDOM % 3 == 0 ? 0 : RANDOM % 60))
  conf=${confs[$((RANDOM % ${#confs[@]}))]}
  settings="ops=$ops threads=$threads devices=$devices event_us=$event_us vmm_us=$vmm_us conf=$conf"
  rc=0
  env LD_LIBRARY_PATH="$bin:$lib" FAKE_CUDA_DEVICES="$devices" FAKE_CUDA_CAPACITY=16384 \
    FAKE_CUDA_EVENT_US="$event_us" FAKE_CUDA_VMM_US="$vmm_us" GPUALLOC_CONF="$conf" \
    timeout 600 "$bin/fake_cuda_test" "$ops" "$threads" vmm >"$out/run.out" 2>"$out/run.err" || rc=$?
  if [ "$rc" -ne 0 ] || grep -q "misuse:" "$out/run.err"; then
    failed=$((failed + 1))
    mv "$out/run.out" "$out/run-$runs.out"
    mv "$out/run.err" "$out/run-$runs.err"
    echo "FAILED run $runs rc=$rc $settings" | tee -a "$out/summary.txt"
  fi
done
rm -f "$out/run.out" "$out/run.err"
echo "$runs runs, $failed failed, $seconds s" | tee -a "$out/summary.txt"
[ "$failed" -eq 0 ]
