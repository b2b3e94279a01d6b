# The environment every GPU script runs in; sourced by the scripts here.
# Sets ROOT (the repository), the library and Python path, and RESULTS
# ($OUT, or ./gpu-results); unsets what would change what a run means;
# defines environment and run_logged (below).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
export GPUALLOC_LIBRARY=${GPUALLOC_LIBRARY:-$ROOT/target/release/libgpualloc.so}
export PYTHONPATH=$ROOT/python-shim${PYTHONPATH:+:$PYTHONPATH}
# The command-line tool the checks replay and read traces with: the one
# beside the library when both were carried together (target/gpu/), else
# the build's.
if [ -z "${GPUALLOC_CLI:-}" ]; then
  GPUALLOC_CLI=$(dirname "$GPUALLOC_LIBRARY")/gpualloc
  [ -x "$GPUALLOC_CLI" ] || GPUALLOC_CLI=$ROOT/target/release/gpualloc
fi
export GPUALLOC_CLI
export GPUALLOC_BUILD_DIR=${GPUALLOC_BUILD_DIR:-${TMPDIR:-/tmp}/gpualloc-bridge}
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PYTHONUNBUFFERED=1
# A process that dies of a signal (SIGSEGV, SIGABRT, SIGBUS) prints every
# thread's Python stack to stderr, which the logs keep.
export PYTHONFAULTHANDLER=1
# ... and, before that, the library's report: the crashing thread's name
# and native stack (Note [Crash reports] in capi/src/crash_report.rs).
export GPUALLOC_CRASH_REPORT=${GPUALLOC_CRASH_REPORT:-1}
unset GPUALLOC_BACKEND GPUALLOC_CONF GPUALLOC_TRACE
RESULTS=${OUT:-$ROOT/gpu-results}
mkdir -p "$RESULTS"

# Writes the library, Python, torch and GPU in use to $RESULTS/environment.txt.
environment() {
  {
    echo "library: $GPUALLOC_LIBRARY"
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  } 2>&1 | tee "$RESULTS/environment.txt"
}

# run_logged NAME SCRIPT ARGS...: runs tests/gpu/SCRIPT.py with --out
# $RESULTS, its output also in $RESULTS/NAME.log, then packs the per-run
# logs it left in $RESULTS/NAME-logs into NAME-logs.tar.gz. Returns the
# script's status.
run_logged() {
  local name=$1 script=$2
  shift 2
  python3 "tests/gpu/$script.py" --out "$RESULTS" "$@" 2>&1 | tee "$RESULTS/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ -d "$RESULTS/$name-logs" ]; then
    tar czf "$RESULTS/$name-logs.tar.gz" -C "$RESULTS" "$name-logs" && rm -rf "$RESULTS/$name-logs"
  fi
  return "$rc"
}
