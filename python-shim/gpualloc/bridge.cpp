// gpualloc's torch bridge: makes libgpualloc.so PyTorch's CUDA allocator.
//
// Compiled at gpualloc.install() time against the installed torch
// (torch.utils.cpp_extension, cached), loaded with ctypes, entered once
// through gpualloc_bridge_install(). It does not link libgpualloc.so: it
// dlopen()s the exact file the Python package loaded (bridge/api.h).
//
// The key decision: the bridge is a direct subclass of torch's
// c10::cuda::CUDACachingAllocator::CUDAAllocator, like PyTorch's own
// allocator, not a CUDAPluggableAllocator. Every virtual member PyTorch's
// allocator implements is implemented here, so what reaches into the
// allocator (cudagraph trees, memory history, MemPool, IPC, NCCL's
// registration hooks) finds a real answer; a member gpualloc cannot honour
// raises an error naming gpualloc and the reason. A DataPtr's context is the
// pointer itself and its deleter is raw_deleter(), as PyTorch's: cudagraph
// trees swap deleters and compare them with raw_deleter(). There is no
// per-allocation map on the way (the pluggable class kept one under a mutex).
// docs/torch-compat.md lists every member and the test that covers it.

#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bridge/api.h"
#include "bridge/device_scope.h"
#include "bridge/expandable_switch.h"
#include "bridge/history.h"
#include "bridge/ipc.h"
#include "bridge/registration.h"
#include "bridge/segment_order.h"
#include "bridge/served_pool.h"
#include "bridge/uncached.h"

#if TORCH_VERSION_MAJOR != 2 || TORCH_VERSION_MINOR < 9
#error "gpualloc's torch bridge supports torch 2.9 and later"
#endif

namespace gpualloc_bridge {
namespace {

using cca::CUDAAllocator;
using c10::MempoolId_t;
using StreamFilterFn = std::function<bool(cudaStream_t)>;

constexpr const char* kExpandableBase =
    "gpualloc: this tensor lives in expandable memory (gpualloc's default), which has no fixed base allocation; "
    "share it with another process through torch.multiprocessing (shareIpcHandle), or run with "
    "GPUALLOC_CONF=expandable_segments:false for plain segments";

// ---- devices -------------------------------------------------------------

// The one device this process allocated on (-2: none yet, -1: several), so
// that a deleter, which gets only the pointer, names the device when it can.
std::atomic<int> only_device{-2};

inline void note_device(int device) {
  int seen = only_device.load(std::memory_order_relaxed);
  if (seen == device || seen == -1) {
    return;
  }
  if (seen == -2 && only_device.compare_exchange_strong(seen, device)) {
    return;
  }
  if (seen != device) {
    only_device.store(-1, std::memory_order_relaxed);
  }
}

// ---- observers -----------------------------------------------------------

// The bridge's shared state is never destroyed (as `history`): libtorch's
// statics, destroyed after the bridge's, may still free CUDA memory.
std::mutex& observers_mutex = *new std::mutex;
std::vector<cca::OutOfMemoryObserver>& oom_observers = *new std::vector<cca::OutOfMemoryObserver>;
#if TORCH_VERSION_MINOR >= 12
// Kept, never called: see attachOomRejectionObserver.
std::vector<cca::OomRejectionObserver>& oom_rejection_observers = *new std::vector<cca::OomRejectionObserver>;
#endif
std::vector<cca::AllocatorTraceTracker>& trace_trackers = *new std::vector<cca::AllocatorTraceTracker>;
std::atomic<bool> has_trackers{false};

void notify_trackers(const TraceEntry& e) {
  std::vector<cca::AllocatorTraceTracker> ts;
  {
    std::lock_guard<std::mutex> g(observers_mutex);
    ts = trace_trackers;
  }
  for (const auto& t : ts) {
    t(e);
  }
}

// PyTorch's action for a segment event; false for an action this bridge
// does not know (a newer library's), which it passes over.
bool segment_action(int action, TraceEntry::Action& out) {
  switch (action) {
    case GPUALLOC_SEGMENT_ALLOC:
      out = TraceEntry::SEGMENT_ALLOC;
      return true;
    case GPUALLOC_SEGMENT_FREE:
      out = TraceEntry::SEGMENT_FREE;
      return true;
    case GPUALLOC_SEGMENT_MAP:
    case GPUALLOC_SEGMENT_MAP_UNLISTED:
    case GPUALLOC_SEGMENT_LISTED:
      out = TraceEntry::SEGMENT_MAP;
      return true;
    case GPUALLOC_SEGMENT_UNMAP:
    case GPUALLOC_SEGMENT_UNMAP_UNLISTED:
    case GPUALLOC_SEGMENT_UNLISTED:
      out = TraceEntry::SEGMENT_UNMAP;
      return true;
    default:
      return false;
  }
}

// A trace tracker threw on a segment change: said on stderr the first time.
void tracker_refused(const char* what) {
  static std::atomic<bool> said{false};
  if (!said.exchange(true)) {
    std::fprintf(stderr,
                 "gpualloc: a memory trace tracker refused a segment change (said once; expected when NCCL "
                 "communicators started at different times hold the same memory in other pieces): %s\n",
                 what);
  }
}

// Ranges announced to the trackers (bridge/registration.h); under observers_mutex.
AnnouncedRanges& announced = *new AnnouncedRanges;
// The snapshot's segments in the order they came (Note [Registration order]).
SegmentOrder& segment_order = *new SegmentOrder;

// Called by gpualloc under its lock for every segment event: feeds the
// memory history (PyTorch's actions) and torch's trace trackers
// (ProcessGroupNCCL registers memory with NCCL there). Must not throw into
// gpualloc. Two views (Note [Segment events]): the history follows the
// snapshot's segments, which MemoryViz replays it backwards from, so it
// skips the unlisted ranges (stitches, old ranges of moved pages); the
// trackers follow the memory backed, so they skip LISTED and UNLISTED.
void on_segment(void*, int device, int action, uint64_t address, uint64_t size, uint64_t stream) {
  try {
    // A free's completion, not a segment's change.
    if (action == GPUALLOC_BLOCK_FREE_DEFERRED || action == GPUALLOC_BLOCK_FREE_COMPLETED) {
      if (history.tracking()) {
        void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
        action == GPUALLOC_BLOCK_FREE_DEFERRED ? history.on_block_deferred(p) : history.on_block_freed(p);
      }
      return;
    }
    TraceEntry::Action a;
    if (!segment_action(action, a)) {
      return;
    }
    auto s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream));
    bool listing = action != GPUALLOC_SEGMENT_MAP_UNLISTED && action != GPUALLOC_SEGMENT_UNMAP_UNLISTED;
    bool backing = action != GPUALLOC_SEGMENT_LISTED && action != GPUALLOC_SEGMENT_UNLISTED;
    // The private pool of the range (a MemPool's, a graph's), which
    // ProcessGroupNCCL's hook matches against the pools registered with it.
    uint64_t pool_a = 0, pool_b = 0;
    (void)api.segment_event_pool(&pool_a, &pool_b);
    const bool private_pool = pool_a != 0 || pool_b != 0;
    const bool grows = a == TraceEntry::SEGMENT_ALLOC || a == TraceEntry::SEGMENT_MAP;
    if (listing) {
      grows ? segment_order.listed(device, address, size, private_pool)
            : segment_order.unlisted(device, address, size);
      if (history.enabled()) {
        history.on_event(a, static_cast<c10::DeviceIndex>(device), address, size, s, {pool_a, pool_b});
      }
    }
    if (!backing || !has_trackers.load(std::memory_order_relaxed)) {
      return;
    }
    std::vector<AnnouncedRanges::Change> changes;
    std::vector<cca::AllocatorTraceTracker> ts;
    {
      std::lock_guard<std::mutex> g(observers_mutex);
      // Note [A pool's runs] in bridge/registration.h.
      bool joins = action == GPUALLOC_SEGMENT_MAP && private_pool;
      changes = grows ? announced.mapped(device, address, size, {pool_a, pool_b}, joins)
                      : announced.unmapped(device, address, size);
      ts = trace_trackers;
    }
    for (const auto& c : changes) {
      TraceEntry e = make_entry(c.alloc ? TraceEntry::SEGMENT_ALLOC : TraceEntry::SEGMENT_FREE,
                                static_cast<c10::DeviceIndex>(c.device), c.addr, c.size, s,
                                {c.pool.first, c.pool.second});
      for (const auto& t : ts) {
        // One tracker's failure neither keeps the others nor the next
        // changes from being told. A communicator refusing to withdraw a
        // start it never registered, or to register one it holds, is
        // expected once communicators started at different times (Note
        // [Communicators that register the snapshot]): said once.
        try {
          t(e);
        } catch (const std::exception& x) {
          tracker_refused(x.what());
        } catch (...) {
          tracker_refused("unknown exception");
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpualloc: a memory trace tracker failed: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "gpualloc: a memory trace tracker failed\n");
  }
}

// ---- allocation ----------------------------------------------------------

// gpualloc's stats of `device` into `s`; the status.
int get_stats(int device, GpuallocStats& s) {
  std::memset(&s, 0, sizeof s);
  s.size = static_cast<uint32_t>(sizeof s);
  return api.get_stats(device, &s);
}

// torch's memory profiler (`torch.profiler.profile(profile_memory=True)`,
// its memory timeline): an allocation (`delta` > 0) or a free, with the
// device's totals after it, as PyTorch's allocator reports them. Only
// while the profiler asks (`c10::memoryProfilingEnabled`).
void report_to_profiler(void* ptr, int64_t delta, int device) {
  GpuallocStats s;
  if (device < 0 || get_stats(device, s) != GPUALLOC_OK) {
    return;
  }
  c10::reportMemoryUsageToProfiler(ptr, delta, static_cast<size_t>(s.allocated_bytes.all.current),
                                   static_cast<size_t>(s.reserved_bytes.all.current),
                                   c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

// torch's CUDA sanitizer (`TORCH_CUDA_SANITIZER=1`) follows allocations
// and frees, so that a reused address is not taken for a race; as
// PyTorch's allocator tells it.
void sanitizer_alloc(void* p) {
  if (const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace(); C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<uintptr_t>(p));
  }
}
void sanitizer_free(void* p) {
  if (const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace(); C10_UNLIKELY(interp)) {
    (*interp)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<uintptr_t>(p));
  }
}

// An exception an observer of allocations threw (memory history's stack
// recorder, the CUDA sanitizer's Python hook, the profiler), said once: a
// deleter must not throw (it runs in destructors: std::terminate), and an
// allocation that was made must not be lost to an observer's failure.
void said_observer_failed(const char* who, const char* what) {
  static std::atomic<bool> said{false};
  if (!said.exchange(true)) {
    std::fprintf(stderr,
                 "gpualloc: an observer of allocations (%s) raised an exception: %s; the allocation or free goes on, "
                 "and the other observers are told (said once)\n",
                 who, what);
  }
}

// Runs `observer`, saying what it throws instead of throwing.
template <typename F>
void observe(const char* who, F&& observer) {
  try {
    observer();
  } catch (const std::exception& e) {
    said_observer_failed(who, e.what());
  } catch (...) {
    said_observer_failed(who, "not a std::exception");
  }
}

// An allocation, to the profiler when it asks: the block's size, as PyTorch reports.
void profile_alloc(void* p, size_t size, c10::DeviceIndex device) {
  observe("the CUDA sanitizer", [&] { sanitizer_alloc(p); });
  if (!c10::memoryProfilingEnabled()) {
    return;
  }
  uint64_t block = size;
  if (api.allocation_size(p, &block) != GPUALLOC_OK) {
    block = size;
  }
  observe("the profiler", [&] { report_to_profiler(p, static_cast<int64_t>(block), device); });
}

// The process whose PyTorch started CUDA through this allocator (init());
// 0 before that. A child forked after it cannot use CUDA and only frees
// what it inherited; one forked before it (`ddp_fork`, a `fork` start
// method, a worker pool made before the first CUDA call) starts CUDA
// itself and records its own frees. Taking the pid when the bridge was
// loaded instead left such children's memory history and profiler with
// allocations that were never freed.
std::atomic<pid_t> cuda_pid{0};

// Not a forked child (a DataLoader worker freeing what it inherited): the
// locks of history and of the devices may be held there for good by a
// thread the fork left behind (Note [Freeing in a forked child] in
// capi/src/fork.rs). A system call: asked only on the rare paths.
bool in_parent() {
  pid_t owner = cuda_pid.load(std::memory_order_relaxed);
  return owner == 0 || getpid() == owner;
}

// Set in a child forked after CUDA started here (a handler registered at
// install): the one check every free can afford, for what only the parent
// may ask torch (its current stream).
std::atomic<bool> forked_after_cuda{false};

void mark_forked_child() {
  if (cuda_pid.load(std::memory_order_relaxed) != 0) {
    forked_after_cuda.store(true, std::memory_order_relaxed);
  }
}

void delete_fn(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  int device = only_device.load(std::memory_order_relaxed);
  // Each observer on its own, so that one that throws keeps neither the
  // others nor the free from happening; the memory is freed exactly once
  // (`freed`).
  // While history records, FREE_REQUESTED now and FREE_COMPLETED once the
  // free is complete; after it stopped, a block that kept its stack is
  // only forgotten.
  uint64_t seq = 0;
  if (history.tracking() && in_parent()) {
    observe("memory history", [&] {
      if (history.enabled()) {
        seq = history.on_free_requested(ptr, static_cast<c10::DeviceIndex>(device),
                                        history.gather(RecordContext::ALL));
      } else {
        history.forget(ptr);
      }
    });
  }
  // Whatever happens below: a free gpualloc did not defer is complete.
  struct AfterFree {
    void* ptr;
    uint64_t seq;
    ~AfterFree() {
      if (seq != 0) {
        observe("memory history", [&] { history.after_free(ptr, seq); });
      }
    }
  } after_free{ptr, seq};
  observe("the CUDA sanitizer", [&] { sanitizer_free(ptr); });
  // The stream current here: work queued on it may still read the block,
  // if it is another than the block's (Note [Frees on another stream] in
  // the core). Known for the one device only.
  cudaStream_t current = nullptr;
  bool known = false;
  if (device >= 0 && !forked_after_cuda.load(std::memory_order_relaxed)) {
    observe("the current stream", [&] {
      current = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
      known = true;
    });
  }
  bool freed = false;
  if (c10::memoryProfilingEnabled() && in_parent()) {
    uint64_t size = 0;
    int owner = -1;
    int rc = GPUALLOC_OK;
    // The size first, then the free with its stream; anything else (not
    // gpualloc's, a free while a pool's allocator calls back) as before.
    // C functions: they never throw.
    if (known && api.allocation_size(ptr, &size) == GPUALLOC_OK) {
      owner = device;
      api.free_on(ptr, device, current);
    } else {
      api.clear_error();
      rc = api.free_sized(ptr, &size, &owner);
    }
    // Not gpualloc's (INVALID_POINTER): the plain free below reports it.
    freed = rc != GPUALLOC_ERR_INVALID_POINTER;
    if (rc == GPUALLOC_OK) {
      observe("the profiler", [&] { report_to_profiler(ptr, -static_cast<int64_t>(size), owner); });
    } else if (freed) {
      // Freed, or deferred: said as the plain free says it, not freed twice.
      observe("the free's report", [&] {
        std::fprintf(stderr, "%s\n", last_error("gpualloc: free failed").c_str());
      });
    }
  }
  if (!freed) {
    if (known) {
      api.free_on(ptr, device, current);  // never throws: runs in deleters
    } else {
      api.free_fn(ptr, 0, device >= 0 ? device : -1, nullptr);
    }
  }
}

// The deleter of memory the switched-off allocator took from cudaMalloc
// (Note [The caching allocator switched off] in bridge/uncached.h); a
// pointer gpualloc owns goes to gpualloc. Never throws: runs in deleters.
void uncached_delete(void* ptr) {
  if (ptr == nullptr || !in_parent()) {
    return;
  }
  uint64_t size = 0;
  if (api.allocation_size(ptr, &size) == GPUALLOC_OK) {
    delete_fn(ptr);
    return;
  }
  api.clear_error();
  observe("the CUDA sanitizer", [&] { sanitizer_free(ptr); });
  // C10_CUDA_CHECK_WARN, written out with one string (Note [Numbers in the
  // bridge's messages]).
  if (const cudaError_t e = cudaFree(ptr); e != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_WARN(std::string("CUDA warning: ") + cudaGetErrorString(e));
  }
}

// `ctx`: the stack gathered for the request, for memory history's OOM entry.
[[noreturn]] void raise_alloc_failure(size_t size, c10::DeviceIndex device, cudaStream_t stream,
                                      Context ctx = nullptr) {
  std::string msg = last_error("allocation failed");
  const bool gpualloc_oom = api.last_error_code() == GPUALLOC_ERR_OUT_OF_MEMORY;
  bool oom = gpualloc_oom || msg.find("out of memory") != std::string::npos;
  if (!oom) {
    // One string, numbers by snprintf (Note [Numbers in the bridge's messages]).
    TORCH_CHECK(false, "gpualloc failed to allocate " + num(static_cast<unsigned long long>(size)) +
                           " bytes on device " + num(static_cast<long long>(device)) + ": " + msg);
  }
  // What PyTorch's observers are told: the size needed from the device
  // and the memory allowed (the limit in force, else the device's total).
  GpuallocOomInfo info{};
  info.size = sizeof(info);
  // This request's report only (a driver's error has none; the thread's
  // last one may be an earlier request's, on another device).
  if (!gpualloc_oom || api.last_oom(&info) != GPUALLOC_OK || info.device != device) {
    info = GpuallocOomInfo{};
  }
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
  if (api.mem_info(device, &free_bytes, &total_bytes) != GPUALLOC_OK) {
    free_bytes = total_bytes = 0;
  }
  if (history.enabled()) {
    history.on_event(TraceEntry::OOM, device, free_bytes, size, stream, std::move(ctx));
  }
  if (has_trackers.load(std::memory_order_relaxed)) {
    notify_trackers(make_entry(TraceEntry::OOM, device, free_bytes, size, stream));
  }
  if (c10::memoryProfilingEnabled()) {
    GpuallocStats s;
    if (get_stats(device, s) == GPUALLOC_OK) {
      c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(size), static_cast<size_t>(s.allocated_bytes.all.current),
                                       static_cast<size_t>(s.reserved_bytes.all.current),
                                       c10::Device(c10::DeviceType::CUDA, device));
    }
  }
  std::vector<cca::OutOfMemoryObserver> obs;
  {
    std::lock_guard<std::mutex> g(observers_mutex);
    obs = oom_observers;
  }
  const size_t needed = info.needed != 0 ? info.needed : size;
  const size_t allowed = info.limit != 0 ? info.limit : total_bytes;
  for (const auto& o : obs) {
    o(device, needed, allowed, free_bytes);
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
}

// torch's free-memory callbacks (`cuda_ipc_collect`: tensors sent to other
// processes that they have let go of); whether one freed memory.
bool free_memory_callbacks_freed() {
  bool freed = false;
  for (const auto& name : c10::FreeCudaMemoryCallbacksRegistry()->Keys()) {
    freed |= c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
  }
  return freed;
}

// PyTorch's allocator runs them whenever a request finds no cached block,
// before it grows: gpualloc calls this then, with no lock of its own held
// (Note [Free-memory callbacks] in capi/src/miss.rs). Nothing may unwind
// into gpualloc; a callback that throws frees nothing. As in PyTorch they
// run there only, not again once a request is out of memory: a retry then
// would succeed after `num_ooms` and the trace's OOM record counted it.
int on_miss(void* /*ctx*/, int /*device*/) noexcept {
  try {
    return free_memory_callbacks_freed() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

void* alloc_on(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
  if (size == 0) {
    return nullptr;
  }
  if (!history.enabled()) {
    void* p = api.malloc_fn(size, device, stream);
    if (p == nullptr) {
      raise_alloc_failure(size, device, stream);
    }
    note_device(device);
    profile_alloc(p, size, device);
    return p;
  }
  Context ctx = history.gather(RecordContext::STATE);
  History::pending_context() = ctx;
  void* p = api.malloc_fn(size, device, stream);
  History::pending_context().reset();
  if (p == nullptr) {
    raise_alloc_failure(size, device, stream, ctx);
  }
  note_device(device);
  history.on_alloc(p, size, device, stream, std::move(ctx));
  profile_alloc(p, size, device);
  return p;
}

inline c10::DeviceIndex current_device() {
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return device;
}

// ---- stats ---------------------------------------------------------------

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
  check(get_stats(static_cast<int>(device), s), "getDeviceStats");
  return s;
}

// ---- snapshots -----------------------------------------------------------

struct Segments {
  std::vector<GpuallocSegmentInfo> segs;
  std::vector<GpuallocBlockInfo> blocks;
};

Segments read_segments(int device, const MempoolId_t* pool) {
  Segments out;
  out.segs.resize(16);
  out.blocks.resize(256);
  for (int attempt = 0; attempt < 8; ++attempt) {
    size_t ns = 0;
    size_t nb = 0;
    int rc = api.snapshot_segments(device, pool != nullptr ? 1 : 0, pool != nullptr ? pool->first : 0,
                                   pool != nullptr ? pool->second : 0, out.segs.data(), out.segs.size(), &ns,
                                   out.blocks.data(), out.blocks.size(), &nb);
    if (rc == GPUALLOC_OK) {
      out.segs.resize(ns);
      out.blocks.resize(nb);
      return out;
    }
    TORCH_CHECK(rc == GPUALLOC_ERR_BUFFER_TOO_SMALL, "gpualloc snapshot: " + last_error("unknown error"));
    out.segs.resize(ns + ns / 4 + 16);
    out.blocks.resize(nb + nb / 4 + 64);
  }
  TORCH_CHECK(false, "gpualloc snapshot: the segment list kept growing while being read");
}

// The segment holding `ptr`, on any device.
GpuallocSegmentInfo segment_of(void* ptr) {
  auto a = reinterpret_cast<uint64_t>(ptr);
  for (const auto& s : read_segments(-1, nullptr).segs) {
    if (a >= s.address && a < s.address + s.total_size) {
      return s;
    }
  }
  TORCH_CHECK(false, "gpualloc: pointer " + ptr_text(ptr) + " is not in memory gpualloc allocated");
}

// SegmentInfo's registration_counter (Note [Registration order]), where
// this torch has it.
template <class Info>
auto set_registration_counter(Info& si, int32_t n, int) -> decltype(si.registration_counter = n, void()) {
  si.registration_counter = n;
}
template <class Info>
void set_registration_counter(Info&, int32_t, long) {}

cca::SegmentInfo segment_info(const GpuallocSegmentInfo& s, const std::vector<GpuallocBlockInfo>& blocks) {
  cca::SegmentInfo si;
  si.device = static_cast<c10::DeviceIndex>(s.device);
  si.address = s.address;
  si.total_size = s.total_size;
  si.stream = reinterpret_cast<decltype(si.stream)>(static_cast<uintptr_t>(s.stream));
  si.is_large = s.is_large != 0;
  si.is_expandable = s.is_expandable != 0;
  si.owner_private_pool_id = {s.pool_a, s.pool_b};
  set_registration_counter(
      si, segment_order.of(s.device, s.address, s.total_size, s.pool_a != 0 || s.pool_b != 0), 0);
  for (uint64_t i = s.first_block; i < s.first_block + s.num_blocks && i < blocks.size(); ++i) {
    const auto& b = blocks[i];
    cca::BlockInfo bi;
    bi.size = b.size;
    bi.requested_size = b.requested_size;
    bi.allocated = b.state == 1;
    bi.active = b.state != 0;
    if (bi.allocated) {
      bi.context_when_allocated = history.context_of(reinterpret_cast<void*>(b.address));
      si.allocated_size += b.size;
    }
    if (bi.active) {
      si.active_size += b.size;
      si.requested_size += b.requested_size;
    }
    si.blocks.push_back(std::move(bi));
  }
  return si;
}

// ---- private pools -------------------------------------------------------

// Stream filters of open pool scopes, kept alive until their scope ends.
struct PoolKey {
  int device;
  unsigned long long a, b;
  bool operator<(const PoolKey& o) const { return std::tie(device, a, b) < std::tie(o.device, o.a, o.b); }
};
std::mutex& filters_mutex = *new std::mutex;
auto& filters = *new std::map<PoolKey, std::vector<std::unique_ptr<StreamFilterFn>>>;

int filter_trampoline(void* ctx, cudaStream_t stream) {
  try {
    return (*static_cast<StreamFilterFn*>(ctx))(stream) ? 1 : 0;
  } catch (...) {
    return 0;  // nothing may unwind into gpualloc
  }
}

// A private pool's layout, for cudagraph trees (getCheckpointState).
struct PoolState final : cca::AllocatorState {
  c10::DeviceIndex device = 0;
  MempoolId_t id{0, 0};
  std::vector<GpuallocBlockState> blocks;
};

std::vector<uint64_t> live_in_pool(c10::DeviceIndex device, MempoolId_t id) {
  return read_list<uint64_t>("checkPoolLiveAllocations", [&](uint64_t* out, size_t cap, size_t* n) {
    return api.pool_live_allocations(device, id.first, id.second, out, cap, n);
  });
}

// ---- the allocator -------------------------------------------------------

class GpuallocAllocator final : public CUDAAllocator {
 public:
  explicit GpuallocAllocator(CUDAAllocator* native) : native_(native) {}

  // c10::Allocator
  c10::DataPtr allocate(size_t n) override {
    // PyTorch's own first check, before any allocator is asked (no
    // observer, no OOM entry), on the uncached path too.
    constexpr size_t one_exa_bytes = size_t{1} << 60;
    TORCH_CHECK_WITH(OutOfMemoryError, n < one_exa_bytes, "CUDA out of memory. Tried to allocate more than 1EB memory.");
    c10::DeviceIndex device = current_device();
    if (C10_UNLIKELY(!caching_now())) {
      void* p = uncached_allocate(n, device);
      return {p, p, &uncached_delete, c10::Device(c10::DeviceType::CUDA, device)};
    }
    void* p = alloc_on(n, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {p, p, &delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return caching_now() ? &delete_fn : &uncached_delete;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const final {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // c10::DeviceAllocator
  bool initialized() override { return initialized_.load(); }
  void emptyCache(MempoolId_t id) override {
    if (id.first == 0 && id.second == 0) {
      // Frees it completes and segments it gives back are recorded with
      // its stack, as PyTorch's emptyCache hands it down.
      History::pending_context() = history.gather(RecordContext::ALL);
      api.empty_cache();
      History::pending_context().reset();
      raise_if_failed("empty_cache");
    } else {
      // A MemPool may be destroyed from any device: ask every device
      // (gpualloc creates none to answer). `~MemPool` calls this: a
      // failure is said, not thrown out of a destructor.
      for (int d = 0; d < device_count_.load(); ++d) {
        if (api.empty_pool_cache(d, id.first, id.second) != GPUALLOC_OK) {
          TORCH_WARN("gpualloc: emptyCache(mempool_id) on device " + num(static_cast<long long>(d)) + ": " +
                     last_error("failed"));
        }
      }
    }
  }
  cca::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    GpuallocStats s = read_stats(device);
    cca::DeviceStats out;
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

  // CUDAAllocator
  void* raw_alloc(size_t nbytes) override {
    c10::DeviceIndex device = current_device();
    return raw_alloc_on(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    return raw_alloc_on(nbytes, current_device(), stream);
  }
  void raw_delete(void* ptr) override {
    // cudaMalloc's pointers from raw_alloc while switched off; and, while
    // off, any pointer gpualloc does not own, which PyTorch's allocator
    // hands to cudaFree then too (uncached_delete gives gpualloc's own back
    // to gpualloc). A forked child never takes the set's lock, which a
    // thread the fork left behind may hold for good; what it inherited
    // stays its parent's (Note [Freeing in a forked child]).
    if (C10_UNLIKELY((uncached_raw.any() && in_parent() && uncached_raw.take(ptr)) || !caching_now())) {
      uncached_delete(ptr);
      return;
    }
    // Called by code (`torch.cuda.caching_allocator_delete`, C++
    // extensions' `raw_delete`), not by a deleter: a pointer no allocation
    // starts at (freed twice, or never allocated here) raises as PyTorch's
    // `free` does, with its words, instead of a line on stderr.
    uint64_t size = 0;
    if (ptr != nullptr && in_parent() && api.allocation_size(ptr, &size) == GPUALLOC_ERR_INVALID_POINTER) {
      api.clear_error();
      TORCH_CHECK(false, "invalid device pointer: " + ptr_text(ptr) +
                             " (gpualloc holds no allocation that starts there: freed already, or not "
                             "allocated by PyTorch's CUDA allocator)");
    }
    delete_fn(ptr);
  }
  // Called by PyTorch's lazy CUDA initialization: the allocator starts here,
  // with what install() configured (Note [Starting on first use] in
  // capi/src/pending.rs), so that a failure to start is torch's CUDA
  // initialization error.
  void init(int device_count) override {
    check(api.init(nullptr), "could not start");
    // Note [The caching allocator switched off] in bridge/uncached.h.
    if (no_caching_asked() && !forced_off.exchange(true)) {
      api.mark("PYTORCH_NO_CUDA_MEMORY_CACHING: caching allocator off");
    }
    cuda_pid.store(getpid(), std::memory_order_relaxed);
    device_count_.store(device_count);
    initialized_.store(true);
  }
  void mark_installed() { initialized_.store(true); }
  double getMemoryFraction(c10::DeviceIndex device) override {
    double f = 1.0;
    check(api.get_memory_fraction(static_cast<int>(device), &f), "getMemoryFraction");
    return f;
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    api.set_memory_fraction(fraction, device);
    raise_if_failed("set_per_process_memory_fraction");
  }
#if TORCH_VERSION_MINOR >= 10
  // As PyTorch's (which callers read to map as much again ahead of time):
  // one entry per expandable segment with the bytes mapped in it. PyTorch
  // has one segment per pool (private pools included), stream and pool
  // kind; gpualloc may reserve more than one range for them, whose bytes
  // are summed into that one entry. The snapshot lists each mapped run,
  // and a stitch in use in place of the runs it claims, so the sum counts
  // each mapped byte once. PyTorch leaves out the default stream's
  // segments (its stream handle is null), and so does this; a segment
  // with nothing mapped has no entry here.
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override {
    std::map<std::tuple<uint64_t, uint64_t, uint64_t, bool>, size_t> mapped;
    for (const auto& s : read_segments(device, nullptr).segs) {
      if (s.is_expandable != 0 && s.stream != 0) {
        mapped[{s.pool_a, s.pool_b, s.stream, s.is_large == 0}] += s.total_size;
      }
    }
    std::vector<cca::StreamSegmentSize> out;
    for (const auto& [key, bytes] : mapped) {
      out.emplace_back(reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(std::get<2>(key))), std::get<3>(key),
                       bytes);
    }
    return out;
  }
#endif
  // Note [The caching allocator switched off] in bridge/uncached.h.
  void enable(bool value) override {
    if (caching_on.exchange(value) != value) {
      api.mark(value ? "caching_allocator_enable(True)" : "caching_allocator_enable(False)");
      api.clear_error();
    }
  }
  bool isEnabled() const override { return caching_on.load(std::memory_order_relaxed); }
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
    check(api.cache_info(static_cast<int>(device), largestBlock), "cacheInfo");
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    GpuallocSegmentInfo s = segment_of(ptr);
    TORCH_CHECK(s.is_expandable == 0, kExpandableBase);
    if (size != nullptr) {
      *size = s.total_size;
    }
    return reinterpret_cast<void*>(s.address);
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Like PyTorch's allocator, ignore memory gpualloc does not own (DLPack, from_blob, IPC).
    if (ptr.get_deleter() != &delete_fn) {
      return;
    }
    // With the stream's device: another GPU's default stream has the same
    // handle as this one's (Note [Streams of other devices]).
    api.record_stream_on(ptr.get(), stream.stream(), static_cast<int>(stream.device_index()));
    raise_if_failed("record_stream");
  }
#if TORCH_VERSION_MINOR >= 11
  cca::SnapshotInfo snapshot(MempoolId_t id, bool include_traces) override { return snapshot_of(id, include_traces); }
#else
  cca::SnapshotInfo snapshot(MempoolId_t id) override { return snapshot_of(id, true); }
#endif
  cca::SnapshotInfo snapshot_of(MempoolId_t id, bool include_traces) {
    cca::SnapshotInfo out;
    bool only = id.first != 0 || id.second != 0;
    Segments all = read_segments(-1, only ? &id : nullptr);
    if (has_trackers.load(std::memory_order_relaxed)) {
      // A communicator starting now registers these segments by itself
      // (Note [Communicators that register the snapshot] in
      // bridge/registration.h), and ProcessGroupNCCL.register_mem_pool
      // the segments of one pool's snapshot.
      std::lock_guard<std::mutex> g(observers_mutex);
      for (const auto& s : all.segs) {
        announced.registered_from_snapshot(s.device, s.address, s.total_size, {s.pool_a, s.pool_b});
      }
    }
    for (const auto& s : all.segs) {
      out.segments.push_back(segment_info(s, all.blocks));
    }
    if (include_traces) {
      out.device_traces = history.traces(static_cast<size_t>(device_count_.load()));
      out.external_annotations = history.annotations();
    } else {
      out.device_traces.resize(static_cast<size_t>(device_count_.load()));
    }
    auto& md = out.config_metadata;
    md.garbage_collection_threshold = 0.0;
    // gpualloc's max_split_size (its configuration's, one for every device),
    // SIZE_MAX when unlimited, as PyTorch reports its own.
    md.max_split_size = std::numeric_limits<size_t>::max();
    GpuallocStats config_stats;
    if (get_stats(0, config_stats) == GPUALLOC_OK && config_stats.max_split_size >= 0) {
      md.max_split_size = static_cast<size_t>(config_stats.max_split_size);
    }
    // PyTorch's pinned host allocator stays PyTorch's, with its settings.
    md.pinned_num_register_threads = cca::CUDAAllocatorConfig::pinned_num_register_threads();
    // Whether new allocations land in expandable memory: some segment is,
    // and PyTorch's expandable_segments has not switched requests plain
    // (libraries that share memory read this to decide).
    md.expandable_segments = false;
    for (const auto& s : all.segs) {
      md.expandable_segments = md.expandable_segments || s.is_expandable != 0;
    }
    md.expandable_segments = md.expandable_segments && !expandable_switch.plain();
    md.release_lock_on_malloc = false;
    md.pinned_use_host_register = cca::CUDAAllocatorConfig::pinned_use_cuda_host_register();
    // PyTorch's setting, which gpualloc honours (its own key is in the string below).
    md.graph_capture_record_stream_reuse = cca::CUDAAllocatorConfig::graph_capture_record_stream_reuse();
    // PyTorch's own settings string, as PyTorch reports it: programs save
    // it and set it back (`_set_allocator_settings`), which a string of
    // gpualloc's keys would make PyTorch refuse. gpualloc's configuration
    // is gpualloc.config() and the trace's header.
    md.last_allocator_settings = c10::CachingAllocator::getAllocatorSettings();
    return out;
  }

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t id, StreamFilterFn filter) override {
    PoolKey key{device, id.first, id.second};
    std::unique_ptr<StreamFilterFn> owned;
    if (filter) {
      owned = std::make_unique<StreamFilterFn>(std::move(filter));
    }
    StreamFilterFn* ctx = owned.get();
    // One lock across gpualloc's scope and the filter kept for it, here and
    // in endAllocateToPool: two threads opening scopes on one pool push and
    // pop both stacks in the same order, so the filter freed is the one
    // whose scope closed. (The trampoline never takes this lock.)
    // PyTorch's graph_capture_record_stream_reuse (torch >= 2.9), from its
    // PYTORCH_CUDA_ALLOC_CONF or _set_allocator_settings, read where a
    // capture begins (Note [Reuse inside a capture] in the core).
    check(api.set_capture_reuse(device, cca::CUDAAllocatorConfig::graph_capture_record_stream_reuse() ? 1 : 0),
          "graph_capture_record_stream_reuse");
    // And its expandable_segments, which the pool takes if created now.
    expandable_switch.sync_and_warn();
    std::lock_guard<std::mutex> g(filters_mutex);
    // Room for the filter first: once gpualloc's scope holds `ctx`, keeping
    // it must not throw (a bad_alloc would free a filter still called).
    auto& kept = filters[key];
    kept.reserve(kept.size() + 1);
    int rc = api.begin_pool(device, key.a, key.b, ctx != nullptr ? &filter_trampoline : nullptr, ctx);
    check(rc, "beginAllocateToPool");
    kept.push_back(std::move(owned));
  }
  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t id) override {
    // A forked child: the filters' lock may be held for good by a thread
    // the fork left behind (one in beginAllocateToPool), and the scope is
    // its parent's (Note [Freeing in a forked child]).
    if (!in_parent()) {
      return;
    }
    PoolKey key{device, id.first, id.second};
    int rc = GPUALLOC_OK;
    {
      // gpualloc no longer calls the innermost filter of this pool: free it.
      std::lock_guard<std::mutex> g(filters_mutex);
      rc = api.end_pool(device, key.a, key.b);
      auto it = filters.find(key);
      if (it != filters.end() && !it->second.empty()) {
        it->second.pop_back();
        if (it->second.empty()) {
          filters.erase(it);
        }
      }
    }
    if (rc != GPUALLOC_OK) {
      TORCH_WARN("gpualloc endAllocateToPool: " + last_error("unknown error"));
    }
  }
  void releasePool(c10::DeviceIndex device, MempoolId_t id) override {
    // Called from CUDAGraph / MemPool destructors: must not throw.
    int rc = api.release_pool(device, id.first, id.second);
    if (rc != GPUALLOC_OK && rc != GPUALLOC_ERR_UNKNOWN_POOL) {
      std::fprintf(stderr, "gpualloc releasePool: %s\n", last_error("unknown error").c_str());
    }
  }
  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t id) override {
    uint32_t n = 0;
    check(api.pool_use_count(device, id.first, id.second, &n), "getPoolUseCount");
    return static_cast<int>(n);
  }
#if TORCH_VERSION_MINOR >= 11
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id, std::shared_ptr<CUDAAllocator> allocator) override {
    CUDAAllocator* other = allocator.get();
    create_pool(device, id, other, std::move(allocator));
  }
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t id, bool use_on_oom) override {
    set_use_on_oom(device, id, use_on_oom);
  }
#else
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t id, CUDAAllocator* allocator) override {
    create_pool(device, id, allocator, nullptr);
  }
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t id) override { set_use_on_oom(device, id, true); }
#endif
#if TORCH_VERSION_MINOR >= 10
  void setNoSplit(c10::DeviceIndex device, MempoolId_t id) override {
    pool_option(device, id, api.set_pool_no_split(device, id.first, id.second), "setNoSplit");
  }
#endif
  // MemPool(use_on_oom=...): Note [MemPool options] in allocator/src/device.rs.
  // Turning it off never throws: MemPool's destructor does it, perhaps
  // after the pool is gone.
  void set_use_on_oom(c10::DeviceIndex device, MempoolId_t id, bool on) {
    int rc = api.set_pool_use_on_oom(device, id.first, id.second, on ? 1 : 0);
    if (on) {
      pool_option(device, id, rc, "setUseOnOOM");
    } else if (rc != GPUALLOC_OK && rc != GPUALLOC_ERR_UNKNOWN_POOL) {
      std::fprintf(stderr, "gpualloc setUseOnOOM: %s\n", last_error("unknown error").c_str());
    }
  }
  // MemPool's constructor sets its options right after createOrIncrefPool;
  // an error thrown out of the constructor means its destructor never drops
  // that hold: drop it here first.
  void pool_option(c10::DeviceIndex device, MempoolId_t id, int rc, const char* what) {
    if (rc != GPUALLOC_OK) {
      std::string why = last_error("unknown error");
      api.release_pool(device, id.first, id.second);
      TORCH_CHECK(false, "gpualloc " + text(what) + ": " + why);
    }
  }
  // A pool with another allocator takes its segments from it (Note
  // [MemPool with another allocator] in bridge/served_pool.h); `keep` owns
  // it where torch passes a shared pointer.
  void create_pool(c10::DeviceIndex device, MempoolId_t id, CUDAAllocator* allocator,
                   std::shared_ptr<CUDAAllocator> keep) {
    if (allocator == nullptr || allocator == this) {
      expandable_switch.sync_and_warn();  // a pool created while it says off stays plain
      check(api.create_or_incref_pool(device, id.first, id.second), "createOrIncrefPool");
      return;
    }
    GpuallocSegmentSource source = serve_from(allocator, std::move(keep));
    check(api.create_or_incref_pool_from(device, id.first, id.second, &source), "createOrIncrefPool");
  }
  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    auto live = live_in_pool(device, id);
    if (live.size() != expected.size()) {
      return false;
    }
    for (uint64_t p : live) {
      if (expected.count(reinterpret_cast<void*>(p)) == 0) {
        return false;
      }
    }
    return true;
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, MempoolId_t id) override {
    auto s = std::make_shared<PoolState>();
    s->device = device;
    s->id = id;
    s->blocks = read_list<GpuallocBlockState>("getCheckpointState", [&](GpuallocBlockState* out, size_t cap, size_t* n) {
      return api.pool_checkpoint(device, id.first, id.second, out, cap, n);
    });
    return s;
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> as) override {
    auto s = std::dynamic_pointer_cast<PoolState>(as);
    TORCH_CHECK(s != nullptr, "gpualloc setCheckpointPoolState: the state was not made by gpualloc's getCheckpointState");
    TORCH_CHECK(s->device == device, "gpualloc setCheckpointPoolState: a state of device " +
                                         num(static_cast<long long>(s->device)) + " given for device " +
                                         num(static_cast<long long>(device)));
    std::vector<uint64_t> freed(live_in_pool(device, s->id).size() + 16);
    std::vector<uint64_t> allocd(s->blocks.size() + 1);
    size_t n_freed = 0;
    size_t n_allocd = 0;
    int rc = GPUALLOC_ERR_BUFFER_TOO_SMALL;
    for (int attempt = 0; attempt < 4 && rc == GPUALLOC_ERR_BUFFER_TOO_SMALL; ++attempt) {
      rc = api.pool_restore(device, s->id.first, s->id.second, s->blocks.data(), s->blocks.size(), freed.data(),
                            freed.size(), &n_freed, allocd.data(), allocd.size(), &n_allocd);
      if (rc == GPUALLOC_ERR_BUFFER_TOO_SMALL) {
        freed.resize(n_freed + 16);
        allocd.resize(n_allocd + 16);
      }
    }
    check(rc, "setCheckpointPoolState");
    cca::CheckpointDelta d;
    // The restore's stack, as PyTorch's setCheckpointPoolState frees and
    // allocates with it: the frees' (gathered at "all"; else their blocks'),
    // the blocks brought back (from "state" on).
    Context freeing = history.gather(RecordContext::ALL);
    for (size_t i = 0; i < n_freed; ++i) {
      void* p = reinterpret_cast<void*>(freed[i]);
      d.ptrs_freed.push_back(p);
      if (history.tracking()) {
        history.on_free(p, device, freeing);
      }
    }
    for (size_t i = 0; i < n_allocd; ++i) {
      void* p = reinterpret_cast<void*>(allocd[i]);
      d.dataptrs_allocd.emplace_back(p, p, &delete_fn, c10::Device(c10::DeviceType::CUDA, device));
    }
    if (history.enabled()) {
      Context restoring = history.gather(RecordContext::STATE);
      for (const auto& b : s->blocks) {
        if (b.allocated != 0) {
          history.on_alloc(reinterpret_cast<void*>(b.address), b.size, device,
                           reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(b.stream)), restoring);
        }
      }
    }
    return d;
  }

  cca::ShareableHandle shareIpcHandle(void* ptr) override { return ipc::share(segment_of(ptr).device, ptr); }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    if (ipc::opened_by_gpualloc(handle)) {
      if (auto p = opened_.open(handle)) {
        return p;
      }
    }
    // A CUDA IPC handle of a plain segment (or a share gpualloc does not
    // import): PyTorch's own allocator object (still alive, unused
    // otherwise) opens and caches it.
    TORCH_CHECK(native_ != nullptr, "gpualloc: PyTorch's allocator is unavailable to open an IPC handle");
    // Before PyTorch's CUDA initialization (an IPC handle opened without
    // `torch.cuda._lazy_init()`), `init` has not told the device count.
    std::call_once(native_init_, [&] {
      int n = device_count_.load();
      native_->init(n > 0 ? n : static_cast<int>(c10::cuda::device_count()));
    });
    return native_->getIpcDevPtr(std::move(handle));
  }

  bool isHistoryEnabled() override { return history.enabled(); }
#if TORCH_VERSION_MINOR >= 11
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries, RecordContext when,
                     bool clear_history, const std::vector<std::string>& skip_actions) override {
    std::vector<int> skip;
    for (const auto& a : skip_actions) {
      skip.push_back(static_cast<int>(skip_action(a)));
    }
    record_history(enabled, recorder, max_entries, when, clear_history, skip);
  }
#else
  void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries, RecordContext when,
                     bool clear_history) override {
    record_history(enabled, recorder, max_entries, when, clear_history, {});
  }
#endif
  void record_history(bool enabled, cca::CreateContextFn recorder, size_t max_entries, RecordContext when,
                      bool clear_history, const std::vector<int>& skip) {
    bool was = history.enabled();
    history.configure(enabled, recorder, max_entries, when, clear_history, skip);
    if (enabled && !was) {
      // Allocations made before history started still get their sizes
      // in the free entries.
      Segments all = read_segments(-1, nullptr);
      for (const auto& s : all.segs) {
        for (uint64_t i = s.first_block; i < s.first_block + s.num_blocks && i < all.blocks.size(); ++i) {
          if (all.blocks[i].state == 1) {
            history.seed(reinterpret_cast<void*>(all.blocks[i].address), all.blocks[i].requested_size,
                         static_cast<c10::DeviceIndex>(s.device));
          }
        }
      }
    }
  }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    c10::DeviceIndex device = 0;
    if (c10::cuda::GetDevice(&device) != cudaSuccess) {
      device = 0;
    }
    history.annotate(md, device);
  }
  void pushCompileContext(std::string& md) override { history.push_compile_context(md); }
  void popCompileContext() override { history.pop_compile_context(); }
#if TORCH_VERSION_MINOR >= 10
  void setUserMetadata(const std::string& md) override { history.set_user_metadata(md); }
  std::string getUserMetadata() override { return history.user_metadata(); }
#endif

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(observers_mutex);
    oom_observers.push_back(std::move(observer));
  }
#if TORCH_VERSION_MINOR >= 12
  // PyTorch's allocator calls these when its `throw_on_cudamalloc_oom`
  // setting refuses a request before asking cudaMalloc. gpualloc has no
  // such refusal (a request it cannot serve is an out-of-memory error,
  // told to the observers above), so they are kept and never called.
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    std::lock_guard<std::mutex> g(observers_mutex);
    oom_rejection_observers.push_back(std::move(observer));
  }
  // The stack memory history recorded for the allocation that starts at
  // `ptr`; nullptr when history is off or kept no stack for it.
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override {
    return history.context_of(const_cast<void*>(ptr));
  }
#endif
#if TORCH_VERSION_MINOR >= 14
  // setUserMetadata above keeps it, and every history entry carries it;
  // annotateMemory records its "annotate" entries.
  bool supportsUserMetadata() override { return true; }
  void annotateMemory(const void* ptr, const std::string& metadata) override {
    if (!history.annotate_memory(ptr, metadata)) {
      TORCH_WARN_ONCE("gpualloc: torch.cuda.memory._annotate_memory: no live allocation starts at " + ptr_text(ptr) +
                      " (a tensor's base data pointer is needed); the annotation is not recorded");
    }
  }
#endif
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    bool first = !has_trackers.exchange(true);
    // What is mapped now is what a consumer registers from the snapshot
    // (ProcessGroupNCCL does when a communicator starts); read it without
    // observers_mutex, which segment events take under gpualloc's lock.
    Segments now = first ? read_segments(-1, nullptr) : Segments{};
    std::lock_guard<std::mutex> g(observers_mutex);
    for (const auto& s : now.segs) {
      announced.seed(s.device, s.address, s.total_size, {s.pool_a, s.pool_b});
    }
    trace_trackers.push_back(std::move(tracker));
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    DeviceScope scope(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
    // As PyTorch's addPeerAccess: mapped memory is accessible only where
    // access was set, so dev_to_access's mappings are opened to dev (a copy
    // kernel on dev may write into them once P2P is on).
    check(api.add_peer_access(static_cast<int>(dev_to_access), static_cast<int>(dev)), "enablePeerAccess");
  }
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    // Across devices the Peer copy works whether or not peer access was
    // enabled (and so gpualloc_add_peer_access called), whatever P2P says.
    if (srcDevice == dstDevice) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    (void)p2p_enabled;
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }
  std::string name() override { return "gpualloc"; }

 private:
  // raw_alloc's allocation: from cudaMalloc while the caching allocator is
  // switched off, remembered for raw_delete (bridge/uncached.h).
  static void* raw_alloc_on(size_t nbytes, c10::DeviceIndex device, cudaStream_t stream) {
    if (C10_UNLIKELY(!caching_now())) {
      void* p = uncached_allocate(nbytes, device);
      uncached_raw.add(p);
      return p;
    }
    return alloc_on(nbytes, device, stream);
  }

  CUDAAllocator* native_;
  std::once_flag native_init_;
  ipc::Opened opened_;
  std::atomic<bool> initialized_{false};
  std::atomic<int> device_count_{0};  // written by init(), read by other threads
};

// Never destroyed, as the other globals here: torch keeps raw pointers to
// the allocator (the one it calls, c10's table of allocators) besides its
// own shared pointer, which static destruction at exit frees; a free or a
// query made after that (a later static destructor, a thread still
// running) would call into freed memory.
std::shared_ptr<GpuallocAllocator>* installed = nullptr;

}  // namespace
}  // namespace gpualloc_bridge

// Reads PyTorch's expandable_segments setting again (the Python package
// calls it once installed, for PyTorch's variable, and after each of
// torch's setters). 0 when nothing is to be said; 1 with the warning to
// give in `msg` when requests turned plain; -1 with an error in `msg`.
extern "C" int gpualloc_bridge_sync_settings(char* msg, size_t msglen) {
  auto say = [&](const char* text, int rc) {
    if (msg != nullptr && msglen > 0) {
      std::snprintf(msg, msglen, "%s", text);
    }
    return rc;
  };
  try {
    return gpualloc_bridge::expandable_switch.sync() ? say(gpualloc_bridge::kPlainRequestsWarning, 1) : 0;
  } catch (const c10::Error& e) {
    return say(e.what_without_backtrace(), -1);
  } catch (const std::exception& e) {
    return say(e.what(), -1);
  }
}

// Loads libgpualloc.so from `libpath`, builds the allocator and makes it
// PyTorch's CUDA allocator. 0 on success; otherwise 1 with a message in
// `err`, or 2 when PyTorch refuses its own allocator settings (nothing is
// swapped then: the user's setting is wrong, not the bridge).
extern "C" int gpualloc_bridge_install(const char* libpath, char* err, size_t errlen) {
  using namespace gpualloc_bridge;
  auto fail = [&](const std::string& msg) {
    if (err != nullptr && errlen > 0) {
      std::snprintf(err, errlen, "%s", msg.c_str());
    }
    return 1;
  };
  try {
    if (installed != nullptr) {
      return 0;
    }
    void* h = dlopen(libpath, RTLD_NOW | RTLD_GLOBAL);  // never closed: blocks outlive everything
    if (h == nullptr) {
      const char* e = dlerror();
      return fail(std::string("dlopen(") + libpath + ") failed: " + (e != nullptr ? e : "?"));
    }
    api.resolve_all(h);
    // Note [PyTorch's settings read before the swap]: PyTorch parses its
    // CUDA allocator settings (PYTORCH_CUDA_ALLOC_CONF) once, on first
    // use, and asserts there that a `backend:` they name is the current
    // allocator's name. Under `backend:cudaMallocAsync`, a first use after
    // the swap (a snapshot, a capture, the pinned host allocator) would
    // compare against "gpualloc" and raise an internal assert; parsed
    // here, it compares against the allocator the variable chose, as
    // PyTorch meant. (A settings string set later that names a backend
    // fails as it would after any swap.)
    try {
      (void)cca::CUDAAllocatorConfig::graph_capture_record_stream_reuse();
    } catch (const c10::Error& e) {
      fail(e.what_without_backtrace());
      return 2;
    } catch (const std::exception& e) {
      fail(e.what());
      return 2;
    }
    CUDAAllocator* native = cca::allocator.load();
    auto a = std::make_shared<GpuallocAllocator>(native);
    // Not started here: PyTorch calls init() when it initializes CUDA. But
    // initialized() is true from now on, as before, so that PyTorch refuses
    // to swap in yet another allocator ("Can't swap an already initialized
    // allocator"), which would leave c10::GetAllocator on gpualloc.
    a->mark_installed();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    // c10::GetAllocator(kCUDA) (storages made without a tensor, torch.accelerator)
    // must find gpualloc too; PyTorch registers its own at priority 0.
    c10::SetAllocator(c10::DeviceType::CUDA, a.get(), 1);
    check(api.set_segment_observer(&on_segment, nullptr), "set_segment_observer");
    check(api.observe_block_frees(1), "observe_block_frees");
    check(api.set_miss_callback(&on_miss, nullptr), "set_miss_callback");
    pthread_atfork(nullptr, nullptr, &mark_forked_child);
    installed = new std::shared_ptr<GpuallocAllocator>(a);
    return 0;
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(e.what());
  } catch (...) {
    return fail("unknown C++ exception");
  }
}
