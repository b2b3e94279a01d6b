#!/usr/bin/env bash
# Allocator benchmark, one command (on a machine with a GPU, torch, g++ and ninja; no cargo needed):
#
#   bash tests/gpu/bench.sh [--steps 60] [--repeats 1] [--only train_gpt2,churn]
#       [--variants native,native-expandable,gpualloc,'gpualloc[expandable_segments:true]']
#       [--budget 540] [--max-batch [--max-batch-gib 12]]
#
# Trains GPT-2, the multi-scale detector, resnet50 and a multi-scale backbone
# and runs churn under PyTorch's allocator (native, native-expandable) and
# gpualloc's variants (default: gpualloc, gpualloc-expandable,
# gpualloc-pytorch; gpualloc[CONF] for any configuration: quote it, the shell
# globs brackets), interleaved per repeat, each run in its own process.
# Prints Markdown tables and writes bench.md, bench.json, bench.log,
# environment.txt and bench-logs.tar.gz (one log a run) to $OUT (or
# ./gpu-results). See tests/gpu/bench.py for the options. ResNet-50 and the
# detector on small footprints (batch 4 and 1) run only when named:
# --only train_resnet_small,train_detector_small.
# GPUALLOC_LIBRARY overrides the library (default target/release/libgpualloc.so).
set -u
source "$(dirname "$0")/env.sh"
environment
run_logged bench bench "$@"
