#!/usr/bin/env bash
# Ultralytics YOLO, multi-scale on synthetic images, under PyTorch's allocator
# and gpualloc (one command, on a machine with a GPU and torch):
#
#   bash tests/gpu/yolo.sh [--epochs 3] [--batch 32] [--repeats 1] [--variants ...]
#
# Ultralytics must be importable. Without network, download its wheels here
# first into .whl/ (see docs/results/README.md); this script installs every
# wheel found in .whl/ into a private directory and puts it on PYTHONPATH.
# Writes yolo.md, yolo.json and yolo-logs.tar.gz to $OUT (or ./gpu-results).
set -u
source "$(dirname "$0")/env.sh"
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/gpualloc-yolo-site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$ROOT"/.whl/*.whl || exit
  export PYTHONPATH=$PYTHONPATH:$site
fi
run_logged yolo yolo "$@"
rc=$?
rm -rf "$RESULTS/runs"
exit "$rc"
