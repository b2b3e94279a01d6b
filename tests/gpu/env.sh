# The environment every GPU script runs in; sourced by run.sh and bench.sh.
# Sets ROOT (the repository), the library and Python path, and RESULTS
# ($OUT, or ./gpu-results); unsets what would change what a run means.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
export GPUALLOC_LIBRARY=${GPUALLOC_LIBRARY:-$ROOT/target/release/libgpualloc.so}
export PYTHONPATH=$ROOT/python-shim${PYTHONPATH:+:$PYTHONPATH}
export GPUALLOC_BUILD_DIR=${GPUALLOC_BUILD_DIR:-${TMPDIR:-/tmp}/gpualloc-bridge}
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PYTHONUNBUFFERED=1
unset GPUALLOC_BACKEND GPUALLOC_CONF GPUALLOC_TRACE
RESULTS=${OUT:-$ROOT/gpu-results}
mkdir -p "$RESULTS"
