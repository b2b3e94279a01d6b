#!/usr/bin/env bash
# DDP with NCCL on two GPUs (torchrun), gpualloc in every rank, against
# PyTorch's allocator, with and without NCCL's tensor-registration hook:
#
#   bash tests/gpu/ddp.sh        # expects target/release/libgpualloc.so
#
# On a machine with one GPU it runs one rank (DDP_NPROC overrides): NCCL's
# process group, DDP's buckets and the registration hook under gpualloc,
# without an exchange between GPUs (parameters are trivially in sync).
# Writes ddp.json to $OUT (or ./gpu-results): per variant the losses of every
# rank, whether they equal PyTorch's, and whether parameters stayed in sync.
# DDP_VARIANTS picks variants (default: all five); NCCL_DEBUG=INFO
# NCCL_DEBUG_SUBSYS=REG shows NCCL's buffer registrations in the logs.
set -u
source "$(dirname "$0")/env.sh"
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -lt 1 ]; then
  echo "ddp.sh needs a GPU, found none" | tee "$RESULTS/ddp.txt"
  exit 0
fi
nproc=${DDP_NPROC:-$(( n < 2 ? n : 2 ))}
echo "ranks: $nproc ($n GPUs)" | tee "$RESULTS/ddp.txt"
python3 -c "import gpualloc; gpualloc.install()" >/dev/null  # builds the bridge once
for variant in ${DDP_VARIANTS:-native gpualloc native-hook gpualloc-hook gpualloc-plain-hook}; do
  alloc=${variant%%-*}
  env=()
  case $variant in
    *-hook) env+=(TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1) ;;
  esac
  case $variant in
    *-plain-*) env+=(GPUALLOC_TEST_CONF=expandable_segments:false) ;;
  esac
  echo "== $variant"
  env "${env[@]}" timeout 300 torchrun --standalone --nproc_per_node="$nproc" tests/gpu/ddp.py --alloc "$alloc" \
    --out "$RESULTS/ddp-$variant.json" > "$RESULTS/ddp-$variant.log" 2>&1
  echo "rc=$?" >> "$RESULTS/ddp-$variant.log"
  tail -3 "$RESULTS/ddp-$variant.log"
done
python3 - "$RESULTS" "$nproc" <<'PY'
import json, os, sys
out, nproc = sys.argv[1], int(sys.argv[2])
def load(v):
    try:
        return [json.load(open(os.path.join(out, f"ddp-{v}.json.rank{r}"))) for r in range(nproc)]
    except (OSError, ValueError) as e:
        return {"error": str(e)}
runs = {v: load(v) for v in ("native", "gpualloc", "native-hook", "gpualloc-hook", "gpualloc-plain-hook")}
summary = {}
for v, r in runs.items():
    if isinstance(r, dict):
        summary[v] = r
        continue
    ref = runs["native"]
    same = None if isinstance(ref, dict) else r[0]["losses"] == ref[0]["losses"]  # None: no native run
    summary[v] = {"ranks": nproc, "backend": r[0]["backend"], "params_in_sync": all(x["params_in_sync"] for x in r),
                  "losses_equal_native": same, "last_losses": r[0]["losses"][-1],
                  "graph_allreduce_ok": all(x.get("graph_allreduce_ok") for x in r),
                  "nccl_graph_register": r[0].get("nccl_graph_register"),
                  "peak_reserved_over_allocated": [x["peak_reserved"] / max(1, x["peak_allocated"]) for x in r]}
json.dump(summary, open(os.path.join(out, "ddp.json"), "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
