#!/usr/bin/env bash
# Compiles the C++ bridge to PyTorch (python-shim/gpualloc/bridge.cpp and
# bridge/*.h) against torch's own headers, without a GPU, without CUDA and
# without installing torch: a syntax and type check (g++ -fsyntax-only) of
# what `gpualloc.install()` builds on a user's machine.
#
#   bash tools/check_bridge.sh          # torch 2.11.0, the version the GPU tests run
#   GPUALLOC_CHECK_TORCH=2.12.0 bash tools/check_bridge.sh
#
# Rationale: the bridge is compiled only where torch is installed, at
# install() time; a mistake in it shows on a GPU machine, as the fallback
# taking over ("bridge build failed"), rather than here. This fetches the
# torch wheel and the CUDA runtime's and compiler's headers from the
# package registry once (pip download, about 600 MB; kept in
# $GPUALLOC_CHECK_CACHE, default ~/.cache/gpualloc-bridge-check), unpacks
# their headers only, and compiles with the flags and defines
# torch.utils.cpp_extension uses. Where the registry cannot be reached it
# prints SKIPPED and passes, like the browser test; a compile error fails.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${GPUALLOC_CHECK_TORCH:-2.11.0}
cache=${GPUALLOC_CHECK_CACHE:-$HOME/.cache/gpualloc-bridge-check}/torch-$version
cxx=${CXX:-g++}
py=${PYTHON:-python3}

skip() {
  echo "SKIPPED: the bridge's compile check ($1)"
  exit 0
}
command -v "$cxx" >/dev/null 2>&1 || skip "no C++ compiler $cxx"
pyinc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$pyinc/Python.h" ] || skip "no Python.h in $pyinc"

if [ ! -f "$cache/ready" ]; then
  rm -rf "$cache"
  mkdir -p "$cache/wheels"
  # torch's wheel for this Python and x86-64 Linux; the CUDA 12 runtime and
  # compiler packages carry the headers torch's CUDA headers include (the
  # interfaces the bridge uses are the same in CUDA 13).
  tag=$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  pip_dl() { "$py" -m pip download -q --no-deps -d "$cache/wheels" "$@"; }
  pip_dl "torch==$version" --only-binary=:all: --platform manylinux_2_28_x86_64 \
    --python-version "$tag" >/dev/null 2>&1 || skip "could not download torch $version"
  pip_dl nvidia-cuda-runtime-cu12 >/dev/null 2>&1 || skip "could not download nvidia-cuda-runtime-cu12"
  pip_dl nvidia-cuda-nvcc-cu12 >/dev/null 2>&1 || skip "could not download nvidia-cuda-nvcc-cu12"
  "$py" - "$cache" <<'EOF'
import pathlib, sys, zipfile
cache = pathlib.Path(sys.argv[1])
for wheel in (cache / "wheels").glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if "/include/" in name and not name.endswith("/"):
                z.extract(name, cache / "headers")
EOF
  rm -rf "$cache/wheels"
  touch "$cache/ready"
fi

h=$cache/headers
"$cxx" -std=c++17 -fsyntax-only -Wall -Werror \
  -D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_EXTENSION_NAME=gpualloc_bridge -DTORCH_API_INCLUDE_EXTENSION_H \
  -I python-shim/gpualloc/include -I python-shim/gpualloc \
  -I "$h/torch/include" -I "$h/torch/include/torch/csrc/api/include" \
  -I "$h/nvidia/cuda_runtime/include" -I "$h/nvidia/cuda_nvcc/include" \
  -I "$pyinc" \
  python-shim/gpualloc/bridge.cpp
echo "the bridge compiles against torch $version's headers"
