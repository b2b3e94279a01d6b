#!/usr/bin/env bash
# Compiles the C++ bridge to PyTorch (python-shim/gpualloc/bridge.cpp and
# bridge/*.h) against torch's own headers, without a GPU, without CUDA and
# without installing torch: a syntax and type check (g++ -fsyntax-only) of
# what `gpualloc.install()` builds on a user's machine; builds and runs
# the memory history's test (python-shim/tests/cpp/history_test.cpp, linked
# with the wheel's libc10, which needs no CUDA); and checks that
# docs/torch-compat.md lists every virtual member of each torch's
# allocator interface (python-shim/tests/test_torch_compat.py).
#
#   bash tools/check_bridge.sh                                 # torch 2.11.0 and 2.15.0
#   GPUALLOC_CHECK_TORCH="2.9.1 2.12.0" bash tools/check_bridge.sh
#
# Rationale: the bridge is compiled only where torch is installed, at
# install() time; a mistake in it, or a member a newer torch made pure
# virtual, shows on a user's machine as the fallback taking over ("bridge
# build failed") rather than here. Torch 2.11 is the version the GPU tests
# run; 2.15 the newest release when this was written (every release from
# 2.12 on declares a pure virtual member that 2.11 lacks). For each
# version this fetches the torch wheel, and once the CUDA runtime's and
# compiler's headers, from the package registry (pip download, about 550
# MB a torch version, 5 s here), keeps their headers and torch's libc10
# only (about 70 MB, in $GPUALLOC_CHECK_CACHE, default
# ~/.cache/gpualloc-bridge-check; a failed download leaves it as it was), and
# compiles with the C++ standard, flags and defines that torch's
# cpp_extension uses. Where the registry cannot be reached it prints
# SKIPPED and passes, like the browser test; a compile error fails.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=${GPUALLOC_CHECK_TORCH:-2.11.0 2.15.0}
root=${GPUALLOC_CHECK_CACHE:-$HOME/.cache/gpualloc-bridge-check}
cxx=${CXX:-g++}
py=${PYTHON:-python3}

skip() {
  echo "SKIPPED: the bridge's compile check ($1)"
  exit 0
}
command -v "$cxx" >/dev/null 2>&1 || skip "no C++ compiler $cxx"
pyinc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[ -f "$pyinc/Python.h" ] || skip "no Python.h in $pyinc"
tag=$("$py" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')

# Unpacks the headers of every wheel in $1/wheels into $1/headers (and
# torch's C++ standard into $1/std), then drops the wheels.
unpack() {
  "$py" - "$1" <<'EOF'
import pathlib, re, sys, zipfile
cache = pathlib.Path(sys.argv[1])
for wheel in (cache / "wheels").glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if "/include/" in name and not name.endswith("/"):
                z.extract(name, cache / "headers")
            if name == "torch/lib/libc10.so":
                # What the history test links with (no CUDA behind it).
                z.extract(name, cache / "lib")
            if name == "torch/utils/cpp_extension.py":
                # The C++ standard torch's extension builds use.
                m = re.search(r"""common_cflags \+= \[['"]-std=(c\+\+\d+)['"]""", z.read(name).decode())
                if m is None:
                    sys.exit(f"{wheel.name}: no -std=c++NN in torch/utils/cpp_extension.py's common_cflags")
                (cache / "std").write_text(m.group(1))
        if wheel.name.startswith("torch-") and "torch/lib/libc10.so" not in z.namelist():
            sys.exit(f"{wheel.name}: no torch/lib/libc10.so")
EOF
  rm -rf "$1/wheels"
  touch "$1/ready"
}
# Unpacks what fetch DIR downloaded and only then puts it in DIR's place:
# a cache that a failed download would have emptied stays as it was.
install_fetched() {
  unpack "$1.new"
  rm -rf "$1"
  mv "$1.new" "$1"
}
fetch() {  # DIR, then pip's arguments, into DIR.new; on failure, pip's last line in $why
  local dir=$1.new
  shift
  rm -rf "$dir"
  mkdir -p "$dir/wheels"
  local log
  log=$("$py" -m pip download -q --no-deps --no-cache-dir -d "$dir/wheels" "$@" 2>&1) && return 0
  why=$(printf '%s\n' "$log" | grep -v '^\s*$' | tail -n 1)
  return 1
}
why=""

# The CUDA 12 runtime's and compiler's headers: what torch's CUDA headers
# include (the interfaces the bridge uses are the same in CUDA 13).
cuda=$root/cuda
if [ ! -f "$cuda/ready" ]; then
  fetch "$cuda" nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12 || skip "could not download the CUDA headers: $why"
  install_fetched "$cuda"
fi

for version in $versions; do
  cache=$root/torch-$version
  if [ ! -f "$cache/ready" ] || [ ! -f "$cache/lib/torch/lib/libc10.so" ]; then
    fetch "$cache" "torch==$version" --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --python-version "$tag" || skip "could not download torch $version for Python $tag: $why"
    install_fetched "$cache"
  fi
  inc=$cache/headers/torch/include
  # Warnings are errors in the bridge's own code; the other headers are
  # system headers, as cpp_extension passes them (a newer compiler's
  # warning inside torch's headers is not the bridge's).
  flags=(-std="$(cat "$cache/std")" -Wall -Werror -D_GLIBCXX_USE_CXX11_ABI=1
    -I python-shim/gpualloc/include -I python-shim/gpualloc
    -isystem "$inc" -isystem "$inc/torch/csrc/api/include"
    -isystem "$cuda/headers/nvidia/cuda_runtime/include" -isystem "$cuda/headers/nvidia/cuda_nvcc/include")
  "$cxx" "${flags[@]}" -fsyntax-only -DTORCH_EXTENSION_NAME=gpualloc_bridge -DTORCH_API_INCLUDE_EXTENSION_H \
    -isystem "$pyinc" python-shim/gpualloc/bridge.cpp
  # The memory history's rules (which entry carries which stack), built
  # and run against this torch's TraceEntry and its libc10.
  lib=$cache/lib/torch/lib
  "$cxx" "${flags[@]}" -O1 python-shim/tests/cpp/history_test.cpp -o "$cache/history_test" \
    -L"$lib" -lc10 -Wl,-rpath,"$lib"
  "$cache/history_test"
  # PyTorch's expandable_segments as the bridge reads it, from this torch's parser.
  "$cxx" "${flags[@]}" -O1 python-shim/tests/cpp/expandable_switch_test.cpp -o "$cache/expandable_switch_test" \
    -L"$lib" -lc10 -Wl,-rpath,"$lib"
  "$cache/expandable_switch_test"
  GPUALLOC_TORCH_INCLUDE=$inc "$py" -m unittest -q python-shim/tests/test_torch_compat.py
  echo "the bridge compiles against torch $version's headers, its memory history keeps torch's rules, and docs/torch-compat.md lists its allocator interface"
done
