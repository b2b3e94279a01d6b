// A MemPool served by another allocator: torch.cuda.MemPool(allocator=...).
//
// Note [MemPool with another allocator]
// Rationale: NCCL's user buffers (`torch.cuda.MemPool(backend.mem_allocator)`,
// memory from ncclMemAlloc that NCCL registers for zero-copy collectives),
// symmetric memory's pool and programs' own CUDAPluggableAllocators give a
// MemPool another allocator. PyTorch caches such a pool itself and takes
// its segments from that allocator's raw_alloc / raw_delete. gpualloc
// refused such pools, so those programs could not run under it.
// Approach: the core does what PyTorch does (Note [Pools served by another
// allocator] in allocator/src/segment_source.rs); the bridge hands it the
// other allocator as a GpuallocSegmentSource whose context owns a
// reference to it, so the allocator outlives the MemPool object as long as
// the pool holds its segments, and is let go by the core's `drop`. The
// callbacks run under gpualloc's lock, on the device the pool belongs to,
// and turn an exception into NULL (alloc: out of memory, which gpualloc
// meets by giving its own cache back and asking again) or a message on
// stderr (free: the segment is gone from gpualloc either way).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "api.h"
#include "device_scope.h"

namespace gpualloc_bridge {

// The context of a GpuallocSegmentSource: the other allocator, kept alive.
struct OtherAllocator {
  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> keep;
  c10::cuda::CUDACachingAllocator::CUDAAllocator* allocator;
  std::string name;
};

inline void* other_alloc(void* ctx, size_t size, int device, cudaStream_t stream) {
  auto* o = static_cast<OtherAllocator*>(ctx);
  try {
    DeviceScope scope(device);
    return o->allocator->raw_alloc_with_stream(size, stream);
  } catch (const c10::OutOfMemoryError&) {
    // Called from the library's C ABI: no exception may cross it. Out of
    // memory is what the null pointer says.
    return nullptr;
  } catch (const std::exception& e) {
    // Anything else still reaches PyTorch as out of memory (the C ABI has
    // no other answer for a source), so its own message is shown here.
    std::fprintf(stderr, "gpualloc: %s failed to allocate %zu bytes for a MemPool: %s\n", o->name.c_str(), size,
                 e.what());
    return nullptr;
  } catch (...) {
    std::fprintf(stderr, "gpualloc: %s failed to allocate %zu bytes for a MemPool\n", o->name.c_str(), size);
    return nullptr;
  }
}

inline void other_free(void* ctx, void* ptr, size_t /*size*/, int device, cudaStream_t /*stream*/) {
  auto* o = static_cast<OtherAllocator*>(ctx);
  try {
    DeviceScope scope(device);
    o->allocator->raw_delete(ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpualloc: %s failed to free %p of a MemPool: %s\n", o->name.c_str(), ptr, e.what());
  } catch (...) {
    std::fprintf(stderr, "gpualloc: %s failed to free %p of a MemPool\n", o->name.c_str(), ptr);
  }
}

inline void other_drop(void* ctx) { delete static_cast<OtherAllocator*>(ctx); }

// The source for a pool served by `allocator` (`keep` owns it, where the
// caller has a shared pointer). The core calls its `drop` exactly once.
inline GpuallocSegmentSource serve_from(c10::cuda::CUDACachingAllocator::CUDAAllocator* allocator,
                                        std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> keep) {
  auto* o = new OtherAllocator{std::move(keep), allocator, allocator->name()};
  return GpuallocSegmentSource{o, other_alloc, other_free, other_drop, o->name.c_str()};
}

}  // namespace gpualloc_bridge
