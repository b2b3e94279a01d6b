"""The churn loop without Python: allocation and free through torch's
current CUDA allocator from C++ (the path every torch operator takes), so
that the allocator's own cost is what is timed, not torch.empty's Python
overhead. Used by `checks.py churn_cpp`."""

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


def check_churn_cpp(args) -> dict:
    import torch
    from torch.utils.cpp_extension import load_inline

    build = os.path.join(os.environ.get("GPUALLOC_BUILD_DIR") or "/tmp", "churn_cpp")
    os.makedirs(build, exist_ok=True)
    t0 = time.time()
    mod = load_inline("gpualloc_churn_cpp", cpp_sources=[SOURCE], functions=["churn", "baseline"], build_directory=build,
                      extra_cflags=["-O2"], with_cuda=True)
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
