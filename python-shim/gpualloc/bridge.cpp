// gpualloc's torch bridge: makes libgpualloc.so a drop-in CUDA allocator.
//
// Compiled at gpualloc.install() time against the installed torch
// (torch.utils.cpp_extension, cached), loaded with ctypes, entered once
// through gpualloc_bridge_install(). It does not link libgpualloc.so: it
// dlopen()s the exact file the Python package loaded, so both share one
// allocator.
//
// A subclass of torch's CUDAPluggableAllocator:
// - its alloc function throws c10::OutOfMemoryError (torch.cuda.OutOfMemoryError
//   in Python) with gpualloc's diagnosis when gpualloc returns NULL for a
//   non-zero size; allocate(), raw_alloc() and raw_alloc_with_stream() all
//   reach it through the base class, so none of them can return a silent NULL;
// - getDeviceStats / resetPeakStats / resetAccumulatedStats / cacheInfo /
//   getMemoryFraction read gpualloc instead of raising "does not yet support";
// - the empty_cache, memory-fraction and record_stream hooks call gpualloc and
//   raise its error; the CUDA-graph pool hooks unpack MempoolId_t and pass the
//   std::function stream filter through a C trampoline.
// Every virtual overridden here has had the same signature in torch 2.6-2.11;
// version-dependent ones (snapshot, recordHistory) are left alone (the Python
// side patches torch.cuda.memory_snapshot).

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gpualloc.h"

namespace {

using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using StreamFilterFn = std::function<bool(cudaStream_t)>;

// The C ABI, resolved with dlsym.
struct Api {
  decltype(&gpualloc_malloc) malloc_fn = nullptr;
  decltype(&gpualloc_free) free_fn = nullptr;
  decltype(&gpualloc_last_error) last_error = nullptr;
  decltype(&gpualloc_last_error_code) last_error_code = nullptr;
  decltype(&gpualloc_record_stream) record_stream = nullptr;
  decltype(&gpualloc_empty_cache) empty_cache = nullptr;
  decltype(&gpualloc_set_memory_fraction) set_memory_fraction = nullptr;
  decltype(&gpualloc_get_memory_fraction) get_memory_fraction = nullptr;
  decltype(&gpualloc_get_stats) get_stats = nullptr;
  decltype(&gpualloc_reset_peak_stats) reset_peak_stats = nullptr;
  decltype(&gpualloc_reset_accumulated_stats) reset_accumulated_stats = nullptr;
  decltype(&gpualloc_cache_info) cache_info = nullptr;
  decltype(&gpualloc_begin_allocate_to_pool) begin_pool = nullptr;
  decltype(&gpualloc_end_allocate_to_pool) end_pool = nullptr;
  decltype(&gpualloc_release_pool) release_pool = nullptr;
};

Api api;

template <class F>
void resolve(void* handle, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(handle, name));
  TORCH_CHECK(out != nullptr, "gpualloc bridge: symbol ", name, " not found in libgpualloc: ", dlerror());
}

std::string last_error(const char* fallback) {
  const char* e = api.last_error();
  return e != nullptr ? std::string(e) : std::string(fallback);
}

// Raises the error of the void hook that just ran, if any (void hooks report
// through the thread's last error, which they clear at entry).
void raise_if_failed(const char* what) {
  const char* e = api.last_error();
  TORCH_CHECK(e == nullptr, "gpualloc ", what, ": ", e == nullptr ? "" : e);
}

void check(int rc, const char* what) {
  TORCH_CHECK(rc == GPUALLOC_OK, "gpualloc ", what, ": ", last_error("unknown error"));
}

void raise_alloc_failure(size_t size, int device) {
  std::string msg = last_error("allocation failed");
  if (msg.find("out of memory") != std::string::npos) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }
  TORCH_CHECK(false, "gpualloc failed to allocate ", size, " bytes on device ", device, ": ", msg);
}

void* bridge_alloc(size_t size, int device, cudaStream_t stream) {
  void* p = api.malloc_fn(size, device, stream);
  if (p == nullptr && size > 0) {
    raise_alloc_failure(size, device);
  }
  return p;
}

void bridge_free(void* ptr, size_t size, int device, cudaStream_t stream) {
  api.free_fn(ptr, size, device, stream);  // never throws: runs in deleters
}

template <class S>
void fill_stat(S& out, const GpuallocStat& in) {
  out.current = in.current;
  out.peak = in.peak;
  out.allocated = in.allocated;
  out.freed = in.freed;
}

// c10's StatArray is indexed by StatType: AGGREGATE = 0, SMALL_POOL = 1, LARGE_POOL = 2.
template <class A>
void fill_array(A& out, const GpuallocStatArray& in) {
  fill_stat(out[0], in.all);
  fill_stat(out[1], in.small_pool);
  fill_stat(out[2], in.large_pool);
}

GpuallocStats read_stats(c10::DeviceIndex device) {
  GpuallocStats s;
  std::memset(&s, 0, sizeof s);
  s.size = static_cast<uint32_t>(sizeof s);
  check(api.get_stats(static_cast<int>(device), &s), "getDeviceStats");
  return s;
}

using DeviceStatsT = decltype(std::declval<Pluggable&>().getDeviceStats(c10::DeviceIndex{0}));

class GpuallocAllocator final : public Pluggable {
 public:
  GpuallocAllocator()
      : Pluggable(
            std::function<void*(size_t, int, cudaStream_t)>(bridge_alloc),
            std::function<void(void*, size_t, int, cudaStream_t)>(bridge_free)) {}

  DeviceStatsT getDeviceStats(c10::DeviceIndex device) override {
    GpuallocStats s = read_stats(device);
    DeviceStatsT out;
    fill_array(out.allocation, s.allocation);
    fill_array(out.segment, s.segment);
    fill_array(out.active, s.active);
    fill_array(out.inactive_split, s.inactive_split);
    fill_array(out.allocated_bytes, s.allocated_bytes);
    fill_array(out.reserved_bytes, s.reserved_bytes);
    fill_array(out.active_bytes, s.active_bytes);
    fill_array(out.inactive_split_bytes, s.inactive_split_bytes);
    fill_array(out.requested_bytes, s.requested_bytes);
    out.num_alloc_retries = s.num_alloc_retries;
    out.num_ooms = s.num_ooms;
    fill_stat(out.oversize_allocations, s.oversize_allocations);
    fill_stat(out.oversize_segments, s.oversize_segments);
    out.num_sync_all_streams = s.num_sync_all_streams;
    out.num_device_alloc = s.num_device_alloc;
    out.num_device_free = s.num_device_free;
    out.max_split_size = s.max_split_size;
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check(api.reset_accumulated_stats(static_cast<int>(device)), "resetAccumulatedStats");
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check(api.reset_peak_stats(static_cast<int>(device)), "resetPeakStats");
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    check(api.cache_info(static_cast<int>(device), largestBlock), "cacheInfo");
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    double f = 1.0;
    check(api.get_memory_fraction(static_cast<int>(device), &f), "getMemoryFraction");
    return f;
  }
};

// Stream filters of open pool scopes, kept alive until their scope ends.
struct PoolKey {
  int device;
  unsigned long long a, b;
  bool operator<(const PoolKey& o) const {
    return std::tie(device, a, b) < std::tie(o.device, o.a, o.b);
  }
};
std::mutex filters_mutex;
std::map<PoolKey, std::vector<std::unique_ptr<StreamFilterFn>>> filters;

int filter_trampoline(void* ctx, cudaStream_t stream) {
  try {
    return (*static_cast<StreamFilterFn*>(ctx))(stream) ? 1 : 0;
  } catch (...) {
    return 0;  // nothing may unwind into gpualloc
  }
}

template <class Id>
void begin_pool(int device, Id id, StreamFilterFn filter) {
  PoolKey key{device, static_cast<unsigned long long>(id.first), static_cast<unsigned long long>(id.second)};
  std::unique_ptr<StreamFilterFn> owned;
  if (filter) {
    owned = std::make_unique<StreamFilterFn>(std::move(filter));
  }
  StreamFilterFn* ctx = owned.get();
  int rc = api.begin_pool(device, key.a, key.b, ctx != nullptr ? &filter_trampoline : nullptr, ctx);
  check(rc, "beginAllocateToPool");
  std::lock_guard<std::mutex> g(filters_mutex);
  filters[key].push_back(std::move(owned));
}

template <class Id>
void end_pool(int device, Id id) {
  PoolKey key{device, static_cast<unsigned long long>(id.first), static_cast<unsigned long long>(id.second)};
  int rc = api.end_pool(device, key.a, key.b);
  {
    // gpualloc no longer calls the innermost filter of this pool: free it.
    std::lock_guard<std::mutex> g(filters_mutex);
    auto it = filters.find(key);
    if (it != filters.end() && !it->second.empty()) {
      it->second.pop_back();
      if (it->second.empty()) {
        filters.erase(it);
      }
    }
  }
  if (rc != GPUALLOC_OK) {
    TORCH_WARN("gpualloc endAllocateToPool: ", last_error("unknown error"));
  }
}

template <class Id>
void release_pool(int device, Id id) {
  // Called from CUDAGraph / MemPool destructors: must not throw.
  int rc = api.release_pool(device, static_cast<uint64_t>(id.first), static_cast<uint64_t>(id.second));
  if (rc != GPUALLOC_OK && rc != GPUALLOC_ERR_UNKNOWN_POOL) {
    std::fprintf(stderr, "gpualloc releasePool: %s\n", last_error("unknown error").c_str());
  }
}

std::shared_ptr<GpuallocAllocator> installed;

}  // namespace

// Loads libgpualloc.so from `libpath`, builds the allocator and makes it
// PyTorch's CUDA allocator. 0 on success; otherwise 1 with a message in `err`.
extern "C" int gpualloc_bridge_install(const char* libpath, char* err, size_t errlen) {
  auto fail = [&](const std::string& msg) {
    if (err != nullptr && errlen > 0) {
      std::snprintf(err, errlen, "%s", msg.c_str());
    }
    return 1;
  };
  try {
    if (installed) {
      return 0;
    }
    void* h = dlopen(libpath, RTLD_NOW | RTLD_GLOBAL);  // never closed: blocks outlive everything
    if (h == nullptr) {
      const char* e = dlerror();
      return fail(std::string("dlopen(") + libpath + ") failed: " + (e != nullptr ? e : "?"));
    }
    resolve(h, "gpualloc_malloc", api.malloc_fn);
    resolve(h, "gpualloc_free", api.free_fn);
    resolve(h, "gpualloc_last_error", api.last_error);
    resolve(h, "gpualloc_last_error_code", api.last_error_code);
    resolve(h, "gpualloc_record_stream", api.record_stream);
    resolve(h, "gpualloc_empty_cache", api.empty_cache);
    resolve(h, "gpualloc_set_memory_fraction", api.set_memory_fraction);
    resolve(h, "gpualloc_get_memory_fraction", api.get_memory_fraction);
    resolve(h, "gpualloc_get_stats", api.get_stats);
    resolve(h, "gpualloc_reset_peak_stats", api.reset_peak_stats);
    resolve(h, "gpualloc_reset_accumulated_stats", api.reset_accumulated_stats);
    resolve(h, "gpualloc_cache_info", api.cache_info);
    resolve(h, "gpualloc_begin_allocate_to_pool", api.begin_pool);
    resolve(h, "gpualloc_end_allocate_to_pool", api.end_pool);
    resolve(h, "gpualloc_release_pool", api.release_pool);

    auto a = std::make_shared<GpuallocAllocator>();
    a->set_reset_fn([]() {
      api.empty_cache();
      raise_if_failed("empty_cache");
    });
    a->set_memory_fraction_fn([](double fraction, int device) {
      api.set_memory_fraction(fraction, device);
      raise_if_failed("set_per_process_memory_fraction");
    });
    a->set_record_stream_fn([](void* ptr, cudaStream_t stream) {
      api.record_stream(ptr, stream);
      // Like PyTorch's allocator, ignore memory gpualloc does not own
      // (tensors from DLPack or from_blob).
      if (api.last_error_code() == GPUALLOC_ERR_INVALID_POINTER) {
        return;
      }
      raise_if_failed("record_stream");
    });
    a->set_begin_allocate_to_pool(
        [](int device, auto id, StreamFilterFn filter) { begin_pool(device, id, std::move(filter)); });
    a->set_end_allocate_to_pool_fn([](int device, auto id) { end_pool(device, id); });
    a->set_release_pool([](int device, auto id) { release_pool(device, id); });
    // As torch's createCustomAllocator does.
    a->init(static_cast<int>(c10::cuda::device_count()));
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    installed = a;
    return 0;
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown C++ exception");
  }
}
