#!/usr/bin/env bash
# Workloads the benchmark does not tune for, one command (on a machine with a
# GPU, torch, torchvision, timm, transformers, g++ and ninja; no cargo needed):
#
#   bash tests/gpu/sweep.sh [--only generate,empty_cache] [--repeats 1]
#       [--variants native,native-expandable,gpualloc] [--budget 540]
#
# Runs KV-cache generation, training with empty_cache() every step, gradient
# checkpointing with bf16, a ViT with fp16 and a GradScaler, torch.compile
# with dynamic shapes and with CUDA graphs (reduce-overhead), Faster R-CNN,
# a side-stream prefetch, a cuDNN LSTM, fp16 serving of random batches,
# cudagraph-tree branches, cudnn.benchmark, FSDP2, four-stream training, a
# mixture of experts, a torch_geometric GNN, peft LoRA, accelerate, a
# wav2vec2 CTC model on raw audio and T5 with Adafactor
# under PyTorch's allocator and gpualloc, each in its own process (the
# default budget covers about a third: pick with --only). Writes sweep.md, sweep.json, environment.txt and
# sweep-logs.tar.gz to $OUT (or ./gpu-results). See tests/gpu/sweep.py.
set -u
source "$(dirname "$0")/env.sh"
environment
run_logged sweep sweep "$@"
