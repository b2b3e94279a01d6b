#!/usr/bin/env bash
# vmm_costs.sh - build and run the CUDA VMM / synchronization cost
# micro-benchmark in vmm_costs.c (see the header comment there).
#
# Usage (from anywhere, on a machine with an NVIDIA GPU and cuda.h):
#     bash benches/gpu/vmm_costs.sh
# Writes ${OUT:-./vmm-costs}/vmm_costs.json, vmm_costs.md and vmm_costs.log,
# and prints the Markdown to stdout (progress goes to stderr).
#
# Environment:
#   OUT                 output directory (default ./vmm-costs)
#   CUDA_HOME/CUDA_PATH where to look first for include/cuda.h
#   CC                  C compiler (default gcc)
#   VMM_COSTS_SCALE     multiplies all repetition counts (default 1)
#   VMM_COSTS_TIMEOUT   kill the benchmark after this many seconds (default 150)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src="$here/vmm_costs.c"
out_dir=${OUT:-./vmm-costs}
cc=${CC:-gcc}
mkdir -p "$out_dir"

say() { echo "vmm_costs.sh: $*" >&2; }

# ---------------------------------------------------------------- cuda.h
# Candidate CUDA homes, in order of preference.
cuda_homes=()
[[ -n ${CUDA_HOME:-} ]] && cuda_homes+=("$CUDA_HOME")
[[ -n ${CUDA_PATH:-} ]] && cuda_homes+=("$CUDA_PATH")
cuda_homes+=(/usr/local/cuda)
if command -v nvcc >/dev/null 2>&1; then
    cuda_homes+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
fi

find_include() {
    local d inc
    for d in "$@"; do
        for inc in "$d/include" "$d/targets/x86_64-linux/include" \
                   "$d/targets/sbsa-linux/include"; do
            if [[ -f $inc/cuda.h ]]; then
                echo "$d|$inc"
                return 0
            fi
        done
    done
    return 1
}

found=$(find_include "${cuda_homes[@]}" || true)
if [[ -z $found ]]; then
    # PyTorch knows where the toolkit it was built against lives (slow import,
    # so only when the usual places failed).
    torch_home=$(python3 -c 'import torch.utils.cpp_extension as c; print(c.CUDA_HOME or "")' 2>/dev/null || true)
    extra=()
    [[ -n $torch_home ]] && extra+=("$torch_home")
    for d in /usr/local/cuda-*; do [[ -d $d ]] && extra+=("$d"); done
    if ((${#extra[@]})); then
        found=$(find_include "${extra[@]}" || true)
    fi
fi
if [[ -z $found && -f /usr/include/cuda.h ]]; then
    found="/usr|/usr/include"
fi
if [[ -z $found ]]; then
    # cuda.h shipped in pip wheels (nvidia-cuda-runtime*, e.g. next to torch).
    pip_inc=$(python3 - <<'EOF' 2>/dev/null || true
import glob, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
for d in dirs:
    for h in sorted(glob.glob(d + "/nvidia/*/include/cuda.h"), reverse=True):
        print(h[: -len("/include/cuda.h")])
        raise SystemExit
EOF
)
    [[ -n $pip_inc ]] && found="$pip_inc|$pip_inc/include"
fi
if [[ -z $found ]]; then
    say "cannot find cuda.h; set CUDA_HOME to the CUDA toolkit"
    exit 1
fi
cuda_home=${found%%|*}
cuda_inc=${found#*|}
say "cuda.h: $cuda_inc/cuda.h"

# ---------------------------------------------------------------- build
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
bin="$build/vmm_costs"
cflags=(-O2 -std=c11 -Wall -Wextra)

# Directories where the real driver library usually lives.
driver_dirs=()
if command -v ldconfig >/dev/null 2>&1; then
    while read -r p; do
        [[ -n $p ]] && driver_dirs+=("$(dirname "$p")")
    done < <(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF}' || true)
fi
driver_dirs+=(/usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64
              /usr/local/nvidia/lib /usr/lib/wsl/lib)

try_build() {
    # "$@": extra linker arguments
    "$cc" "${cflags[@]}" "$src" -I"$cuda_inc" "$@" -o "$bin" \
        2>>"$build/cc.log"
}

linked=""
if try_build -lcuda; then
    linked="-lcuda"
else
    for d in "${driver_dirs[@]}"; do
        if [[ -e $d/libcuda.so ]] && try_build -L"$d" -lcuda; then
            linked="-L$d -lcuda"; break
        fi
        if [[ -e $d/libcuda.so.1 ]] && try_build "$d/libcuda.so.1"; then
            linked="$d/libcuda.so.1"; break
        fi
    done
fi
if [[ -z $linked ]]; then
    # Link against the toolkit's stub; the real libcuda.so.1 is loaded at run time.
    for d in "$cuda_home/lib64/stubs" "$cuda_home/targets/x86_64-linux/lib/stubs" \
             "$cuda_home/lib/stubs" "$cuda_home/lib/x64/stubs"; do
        if [[ -e $d/libcuda.so ]] && try_build -L"$d" -lcuda; then
            linked="-L$d -lcuda (stub)"; break
        fi
    done
fi
if [[ -z $linked ]]; then
    say "could not compile/link vmm_costs.c; compiler output:"
    cat "$build/cc.log" >&2
    exit 1
fi
if grep -q 'warning' "$build/cc.log" 2>/dev/null; then
    cat "$build/cc.log" >&2
fi
say "built with: $cc ${cflags[*]} vmm_costs.c -I$cuda_inc $linked"

# ---------------------------------------------------------------- run
# The stub must never be loaded at run time: drop stub directories from
# LD_LIBRARY_PATH and append the usual driver directories.
ld_path=""
IFS=':' read -r -a ld_parts <<<"${LD_LIBRARY_PATH:-}"
for p in ${ld_parts[@]+"${ld_parts[@]}"}; do
    [[ -z $p || $p == *stubs* ]] && continue
    ld_path+="${ld_path:+:}$p"
done
for d in "${driver_dirs[@]}"; do
    if [[ -e $d/libcuda.so.1 && ":$ld_path:" != *":$d:"* ]]; then
        ld_path+="${ld_path:+:}$d"
    fi
done
export LD_LIBRARY_PATH="$ld_path"

runner=()
if command -v timeout >/dev/null 2>&1; then
    runner=(timeout "${VMM_COSTS_TIMEOUT:-150}")
fi
say "running (progress below; expect 20-60 s)"
start=$SECONDS
${runner[@]+"${runner[@]}"} "$bin" "$out_dir/vmm_costs.json" "$out_dir/vmm_costs.md" 2>&1 \
    | tee "$out_dir/vmm_costs.log" >&2
say "finished in $((SECONDS - start)) s; results in $out_dir/vmm_costs.{json,md}"

cat "$out_dir/vmm_costs.md"
