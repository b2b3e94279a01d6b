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
run_logged trainers trainers "$@"
