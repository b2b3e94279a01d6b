#!/usr/bin/env bash
# Hugging Face Trainer and PyTorch Lightning end to end under PyTorch's
# allocator and gpualloc (one command, on a machine with a GPU, torch,
# transformers and lightning):
#
#   bash tests/gpu/trainers.sh [--libraries hf,lightning] [--steps 40] [--repeats 2] [--variants ...]
#
# Writes trainers.md, trainers.json and trainers-logs.tar.gz to $OUT (or
# ./gpu-results). See tests/gpu/trainers.py.
set -u
source "$(dirname "$0")/env.sh"
python3 tests/gpu/trainers.py --out "$RESULTS" "$@" 2>&1 | tee "$RESULTS/trainers.log"
rc=${PIPESTATUS[0]}
if [ -d "$RESULTS/trainers-logs" ]; then
  tar czf "$RESULTS/trainers-logs.tar.gz" -C "$RESULTS" trainers-logs && rm -rf "$RESULTS/trainers-logs"
fi
exit "$rc"
