// The caching allocator switched off: torch.cuda.memory.caching_allocator_enable(False).
//
// Note [The caching allocator switched off]
// Rationale: programs switch PyTorch's allocator off, for a while or for
// good, so that out-of-bounds accesses fault under compute-sanitizer, so
// that a tool hooked on cudaMalloc sees every tensor, or to keep loading a
// model from caching anything. PyTorch then hands each allocation to
// cudaMalloc and each free to cudaFree (`uncached_allocate`,
// `uncached_delete`). Raising instead, as gpualloc did, ended such programs.
// Approach: the same as PyTorch. While the switch is off, `allocate` and
// `raw_alloc` call cudaMalloc; the DataPtr's deleter is `uncached_delete`
// and `raw_deleter()` returns it, as PyTorch's does; the memory is outside
// gpualloc as it is outside PyTorch's allocator (not in the stats, the
// history or gpualloc's trace, which gets a mark each time the switch
// flips, so a trace says where allocations went missing). Where PyTorch
// fails, gpualloc does not:
// - cudaMalloc out of memory gives gpualloc's cached memory back to the
//   driver and tries once more, then raises torch.cuda.OutOfMemoryError
//   (PyTorch raises a plain CUDA error and keeps its cache);
// - a pointer is freed by who allocated it, not by the switch's state at
//   the free: `raw_delete` looks the pointer up among cudaMalloc's raw
//   allocations (a set, asked only while it is not empty), and
//   `uncached_delete` hands a pointer gpualloc owns to gpualloc (PyTorch
//   cudaFree's a cached pointer raw_delete'd after switching off); while
//   off, `raw_delete` of a pointer neither holds goes to cudaFree, as
//   PyTorch's does (a tensor made while off, freed by its data pointer);
// - a forked child (a DataLoader worker freeing what it inherited) leaves
//   the memory to the parent instead of calling cudaFree where CUDA cannot
//   run, as gpualloc's own deleter does.
// PYTORCH_NO_CUDA_MEMORY_CACHING=1 is PyTorch's other way in: its allocator
// checks `forceUncachedAllocator() || !isEnabled()` on every path, so the
// variable keeps the switch off for the whole process whatever `enable`
// says, and `isEnabled` still answers the switch alone. Programs set it for
// compute-sanitizer runs and to debug crashes; gpualloc honours it the same
// way (`forced_off`, read once when CUDA starts, before the first
// allocation; a trace mark says so), and reads it as PyTorch does since
// torch 2.7 (`no_caching_asked`): c10::utils::check_env, so only "1" turns
// caching off; "0" (which launch scripts set to say "keep caching") and any
// other value leave it on. PYTORCH_NO_HIP_MEMORY_CACHING=1 counts too, on
// CUDA builds as well. Taking the variable set to anything as the request,
// as torch before 2.7 did, sent every allocation of a process run with it
// at 0 to cudaMalloc, where PyTorch's allocator caches.
#pragma once

#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_set>

#include "api.h"

namespace gpualloc_bridge {

// Whether the caching allocator is on (`enable`, `isEnabled`).
inline std::atomic<bool> caching_on{true};

// PYTORCH_NO_CUDA_MEMORY_CACHING=1 when CUDA started: off for good.
inline std::atomic<bool> forced_off{false};

// Whether the environment turns the caching allocator off for good, as
// PyTorch's forceUncachedAllocator() reads it (see the Note above).
inline bool no_caching_asked() {
  return c10::utils::check_env("PYTORCH_NO_CUDA_MEMORY_CACHING") == true ||
         c10::utils::check_env("PYTORCH_NO_HIP_MEMORY_CACHING") == true;
}

// Whether allocations go to gpualloc now: the switch is on and the
// variable did not turn it off for good. Relaxed loads are enough: no other
// memory is published through these flags (each allocation takes its
// deleter from the same reading, and a pointer's owner is told by
// `uncached_raw` or by gpualloc itself, not by the flag), and a thread
// always sees its own switch; another thread's switch is seen at its next
// allocation or soon after, as under PyTorch's allocator, which reads a
// plain flag.
inline bool caching_now() {
  return caching_on.load(std::memory_order_relaxed) && !forced_off.load(std::memory_order_relaxed);
}

// cudaMalloc of `size` bytes on the current device, `device`, for the
// switched-off allocator; once more after gpualloc's cache went back to the
// driver, then OutOfMemoryError. NULL for 0 bytes (an empty tensor), with
// no call.
inline void* uncached_allocate(size_t size, c10::DeviceIndex device) {
  void* p = nullptr;
  if (size == 0) {
    return p;
  }
  cudaError_t err = cudaMalloc(&p, size);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    api.empty_cache();
    err = cudaMalloc(&p, size);
  }
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    // PyTorch's first words, which libraries that retry smaller batches
    // look for ("CUDA out of memory."); one string, numbers by snprintf
    // (Note [Numbers in the bridge's messages] in api.h).
    TORCH_CHECK_WITH(OutOfMemoryError, false,
                     "CUDA out of memory. Tried to allocate " + num(static_cast<unsigned long long>(size)) +
                         " bytes: cudaMalloc on device " + num(static_cast<long long>(device)) +
                         " failed with the caching allocator switched off "
                         "(torch.cuda.memory.caching_allocator_enable(False) or PYTORCH_NO_CUDA_MEMORY_CACHING=1); " +
                         num(static_cast<unsigned long long>(free_bytes)) + " of " +
                         num(static_cast<unsigned long long>(total_bytes)) +
                         " bytes free after gpualloc gave its cached memory back");
  }
  C10_CUDA_CHECK(err);
  if (const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace(); C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<uintptr_t>(p));
  }
  return p;
}

// The pointers `raw_alloc` got from cudaMalloc and `raw_delete` has not
// freed yet: raw_delete frees by who allocated.
class UncachedRaw {
 public:
  void add(void* p) {
    if (p == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> g(mu_);
    ptrs_.insert(p);
    any_.store(true, std::memory_order_relaxed);
  }
  // Whether any is outstanding (no lock taken).
  bool any() const { return any_.load(std::memory_order_relaxed); }
  // Whether `p` is one of them (and no longer, after this).
  bool take(void* p) {
    if (!any_.load(std::memory_order_relaxed)) {
      return false;
    }
    std::lock_guard<std::mutex> g(mu_);
    bool found = ptrs_.erase(p) != 0;
    any_.store(!ptrs_.empty(), std::memory_order_relaxed);
    return found;
  }

 private:
  std::mutex mu_;
  std::unordered_set<void*> ptrs_;
  std::atomic<bool> any_{false};
};

// Never destroyed (as `history`): a raw_delete during torch's static
// destruction (the bridge, loaded after libtorch, has its globals destroyed
// first) would otherwise erase from a freed set.
inline UncachedRaw& uncached_raw = *new UncachedRaw;

}  // namespace gpualloc_bridge
