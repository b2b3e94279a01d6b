"""The churn loop without Python: allocation and free through torch's
current CUDA allocator from C++ (the path every torch operator takes), so
that the allocator's own cost is what is timed, not torch.empty's Python
overhead. Used by `checks.py churn_cpp`; and the same for the allocations
and frees of a recorded trace, in their order (`checks.py trace_cpp`:
examples/moe-varlen.gtrace, or the trace in GPUALLOC_TRACE_CPP), which
times the host cost of a real workload's calls without its kernels, in a
tight loop and with other memory touched between calls (cold caches)."""

from __future__ import annotations

import os
import random
import time

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <vector>

// Keeps a window of 64 live blocks, replacing one per iteration.
double churn(int64_t n, std::vector<int64_t> sizes) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  std::vector<c10::DataPtr> window(64);
  for (int64_t i = 0; i < 2000; ++i) {
    window[i % 64] = a->allocate(sizes[i % sizes.size()]);
  }
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    window[i % 64] = a->allocate(sizes[i % sizes.size()]);
  }
  auto t1 = std::chrono::steady_clock::now();
  window.clear();
  return std::chrono::duration<double>(t1 - t0).count();
}

// Reads and writes `bytes` of a buffer line by line: what the program does
// between two allocator calls, as far as the CPU caches see it.
static std::vector<int64_t> scratch(64 << 20 >> 3);
static inline int64_t pollute(int64_t bytes, int64_t at) {
  int64_t sum = 0;
  for (int64_t i = 0; i < bytes / 8; i += 8) {
    auto& x = scratch[(at + i) % scratch.size()];
    sum += x;
    x = sum;
  }
  return sum;
}

// Replays a recorded sequence `passes` times: ops[i] > 0 allocates that
// many bytes (allocations numbered in order), ops[i] < 0 frees allocation
// -ops[i] - 1; with `between` bytes of other memory touched between two
// calls (0: a tight loop). Returns the seconds of each pass less those of
// the touching alone, then (with `between`) the touching alone, timed
// after an untimed round that faults its memory in; what a pass leaves
// live is freed after its clock stops.
std::vector<double> replay(std::vector<int64_t> ops, int64_t passes, int64_t between) {
  auto* a = c10::cuda::CUDACachingAllocator::get();
  int64_t n = 0;
  for (auto o : ops) n += o > 0;
  std::vector<c10::DataPtr> live(n);
  std::vector<double> secs;
  int64_t sink = 0;
  double alone = 0;
  for (int round = 0; between > 0 && round < 2; ++round) {
    auto u0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < ops.size(); ++i) sink += pollute(between, (int64_t)i * between / 8);
    alone = std::chrono::duration<double>(std::chrono::steady_clock::now() - u0).count();
  }
  for (int64_t p = 0; p < passes; ++p) {
    int64_t k = 0;
    size_t i = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (auto o : ops) {
      if (between > 0) sink += pollute(between, (int64_t)(i++) * between / 8);
      if (o > 0) {
        live[k++] = a->allocate(o);
      } else {
        live[-o - 1] = c10::DataPtr();
      }
    }
    auto t1 = std::chrono::steady_clock::now();
    for (auto& d : live) d = c10::DataPtr();
    secs.push_back(std::chrono::duration<double>(t1 - t0).count() - alone + (sink == 42 ? 1e-12 : 0.0));
  }
  if (between > 0) secs.push_back(alone);
  return secs;
}

// What every allocate() pays before reaching an allocator: the current
// device and stream.
double baseline(int64_t n) {
  int64_t sink = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
    c10::DeviceIndex d = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&d));
    sink += reinterpret_cast<intptr_t>(c10::cuda::getCurrentCUDAStream(d).stream()) + d;
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count() + (sink == 42 ? 1e-12 : 0.0);
}
"""


def _module():
    """The C++ functions above."""
    import inline_cpp

    return inline_cpp.build("gpualloc_churn_cpp", SOURCE, ["churn", "replay", "baseline"])


def trace_ops(path) -> list:
    """A trace's allocations and frees on its first device, in order, as
    replay() takes them, all on one stream. A free is where the program
    freed the block (`free`, or `free_requested` for a block another
    stream still used; its `free_completed` is the allocator's, not the
    program's); frees of blocks allocated before the trace began are left
    out."""
    from gpualloc.tracefile import records

    ops, live, first, allocs = [], {}, None, 0
    for r in records(path):
        if r["kind"] not in ("alloc", "free", "free_requested"):
            continue
        first = r["device"] if first is None else first
        if r["device"] != first:
            continue
        if r["kind"] == "alloc":
            live[r["addr"]] = allocs
            allocs += 1
            ops.append(max(1, r["requested"]))
        elif r["addr"] in live:
            ops.append(-live.pop(r["addr"]) - 1)
    return ops


def check_trace_cpp(args) -> dict:
    import torch

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    path = os.environ.get("GPUALLOC_TRACE_CPP") or os.path.join(root, "examples", "moe-varlen.gtrace")
    ops = trace_ops(path)
    if not ops:
        raise ValueError(f"{path}: no allocations to replay")
    t0 = time.time()
    mod = _module()
    build_s = time.time() - t0
    torch.cuda.init()
    secs = mod.replay(ops, 3, 0)
    # The same with 64 KiB of other memory touched between calls (a
    # program's own work evicting the allocator's structures from the
    # CPU caches), its own cost subtracted.
    *cold, alone = mod.replay(ops, 2, 64 << 10)
    from checks import _counters

    # The touching alone varies between timings; a difference it swamps
    # (below a tenth of it, or negative) is reported as none.
    cold_ns = min(cold) / len(ops) * 1e9
    alone_ns = alone / len(ops) * 1e9

    return {"trace": os.path.basename(path), "ops": len(ops), "build_s": round(build_s, 1),
            "ns_per_op_by_pass": [t / len(ops) * 1e9 for t in secs], "ns_per_op": min(secs) / len(ops) * 1e9,
            "ns_per_op_cold_caches": cold_ns if cold_ns > alone_ns / 10 else None,
            "ns_per_op_touching_alone": alone_ns,
            "peak_reserved_over_allocated": torch.cuda.max_memory_reserved() / max(1, torch.cuda.max_memory_allocated()),
            "counters": _counters()}


def check_churn_cpp(args) -> dict:
    import torch

    t0 = time.time()
    mod = _module()
    build_s = time.time() - t0
    rng = random.Random(4)
    sizes = [rng.choice([256, 4096, 65536, 1 << 20, 5 << 20, 24 << 20]) for _ in range(4096)]
    torch.cuda.init()
    n = args.steps or 2_000_000
    dt = mod.churn(n, sizes)
    from checks import _counters

    counters = _counters()
    small = mod.churn(n, [rng.choice([512, 4096, 65536]) for _ in range(4096)])
    base = mod.baseline(n)
    return {"ops": n, "seconds": dt, "ns_per_alloc_free": dt / n * 1e9, "build_s": round(build_s, 1),
            "ns_per_alloc_free_small_only": small / n * 1e9, "ns_device_and_stream_lookup": base / n * 1e9,
            "peak_reserved_over_allocated": torch.cuda.max_memory_reserved() / max(1, torch.cuda.max_memory_allocated()),
            "counters": counters}
