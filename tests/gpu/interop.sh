#!/usr/bin/env bash
# Interoperability with PyTorch's own tools, on a machine with torch
# (no GPU needed for the first part):
#   1. a gpualloc trace recorded on a GPU, exported as a snapshot pickle,
#      read by torch.cuda._memory_viz (stats = segsum, trace, trace_plot);
#   2. a snapshot dumped by PyTorch's allocator imported into a gpualloc trace
#      and summarised and replayed;
#   3. under gpualloc, a stitching detector traced with PyTorch's memory
#      history on: the exported trace and PyTorch's dump list each byte once
#      and end with the same segments (tests/gpu/listed_export.py).
# Expects target/release/gpualloc; writes to $OUT (or ./gpu-results/interop).
set -eu
cd "$(dirname "$0")/../.."
G=${GPUALLOC_CLI:-target/release/gpualloc}
R=${OUT:-gpu-results}/interop
mkdir -p "$R"
TMP=$(mktemp -d)

"$G" export examples/gpt2-varlen.gtrace --torch-snapshot "$TMP/gpt2.pickle"
python3 -m torch.cuda._memory_viz stats "$TMP/gpt2.pickle" > "$R/memory_viz-stats.txt"
python3 -m torch.cuda._memory_viz trace "$TMP/gpt2.pickle" > "$TMP/trace.txt"
tail -n 3 "$TMP/trace.txt" > "$R/memory_viz-trace-tail.txt"
python3 -m torch.cuda._memory_viz trace_plot "$TMP/gpt2.pickle" -o "$TMP/plot.html"
echo "memory_viz: stats $(wc -l < "$R/memory_viz-stats.txt") lines, trace $(wc -l < "$TMP/trace.txt") lines, trace_plot $(wc -c < "$TMP/plot.html") bytes"

if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  python3 - "$TMP/native.pickle" <<'PY'
import random, sys, torch
torch.cuda.memory._record_memory_history(max_entries=100000)
random.seed(0)
keep = []
for step in range(50):
    n = random.randrange(64, 512)
    x = torch.randn(8, n, 768, device="cuda")
    y = (x @ torch.randn(768, 3072, device="cuda")).relu()
    if step % 10 == 0:
        keep.append(y.sum(0))
    del x, y
torch.cuda.memory._dump_snapshot(sys.argv[1])
print("native peaks", torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated())
PY
  "$G" import "$TMP/native.pickle" -o "$TMP/native.gtrace"
  "$G" summary "$TMP/native.gtrace" > "$R/imported-summary.txt"
  "$G" replay "$TMP/native.gtrace" --capacity 80GiB --config "" --config expandable_segments:true > "$R/imported-replay.txt"
  head -n 12 "$R/imported-summary.txt"
  grep -E "peak reserved /" "$R/imported-replay.txt"
  source tests/gpu/env.sh
  GPUALLOC_CLI=$G python3 tests/gpu/listed_export.py --out "$TMP/listed" | tee "$R/listed-export.json"
fi
rm -rf "$TMP"
