// A small CUDAPluggableAllocator for the compat check
// `mempool_with_another_allocator` (tests/gpu/compat.py): cudaMalloc and
// cudaFree, counting, and telling whether a pointer lies in one of its
// live allocations. Built by the check with nvcc into a shared library.
#include <cuda_runtime_api.h>
#include <sys/types.h>

#include <cstdint>
#include <map>
#include <mutex>

namespace {
std::mutex mu;
std::map<uintptr_t, size_t> live;
long allocs = 0, frees = 0;
}  // namespace

extern "C" {

void* other_malloc(ssize_t size, int device, cudaStream_t stream) {
  (void)device;
  (void)stream;
  void* p = nullptr;
  if (cudaMalloc(&p, static_cast<size_t>(size)) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  std::lock_guard<std::mutex> g(mu);
  live[reinterpret_cast<uintptr_t>(p)] = static_cast<size_t>(size);
  ++allocs;
  return p;
}

void other_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  (void)size;
  (void)device;
  (void)stream;
  cudaFree(ptr);
  std::lock_guard<std::mutex> g(mu);
  live.erase(reinterpret_cast<uintptr_t>(ptr));
  ++frees;
}

long other_allocs() { return allocs; }
long other_frees() { return frees; }

long other_live_bytes() {
  std::lock_guard<std::mutex> g(mu);
  long n = 0;
  for (auto& kv : live) n += static_cast<long>(kv.second);
  return n;
}

int other_owns(uintptr_t p) {
  std::lock_guard<std::mutex> g(mu);
  auto it = live.upper_bound(p);
  if (it == live.begin()) return 0;
  --it;
  return p < it->first + it->second ? 1 : 0;
}
}
