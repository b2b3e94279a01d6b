// Memory history in PyTorch's own format (torch.cuda.memory._record_memory_history,
// _snapshot, _dump_snapshot, memory_viz).
//
// gpualloc keeps its own binary trace; this is the other record, the one
// PyTorch's tools read: TraceEntry rings per device with the stack contexts
// torch's recorder gathers, and the context of every live allocation for the
// snapshot's blocks. It costs one relaxed load per allocation while off.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <deque>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace gpualloc_bridge {

namespace cca = c10::cuda::CUDACachingAllocator;
using cca::RecordContext;
using cca::TraceEntry;
using Context = std::shared_ptr<c10::GatheredContext>;
using AnnotationEntry =
    std::remove_reference_t<decltype(std::declval<cca::SnapshotInfo>().external_annotations)>::value_type;
// An action of `_record_memory_history(skip_actions=...)`, by PyTorch's
// names (c10's parseTraceEntryAction); a name PyTorch does not know raises
// its RuntimeError, with its message built as one string (Note [Numbers in
// the bridge's messages]: c10's own parser streams the name into it).
inline TraceEntry::Action skip_action(const std::string& name) {
  static const std::pair<const char*, TraceEntry::Action> table[] = {
      {"alloc", TraceEntry::ALLOC},
      {"free_requested", TraceEntry::FREE_REQUESTED},
      {"free_completed", TraceEntry::FREE_COMPLETED},
      {"segment_alloc", TraceEntry::SEGMENT_ALLOC},
      {"segment_free", TraceEntry::SEGMENT_FREE},
      {"segment_map", TraceEntry::SEGMENT_MAP},
      {"segment_unmap", TraceEntry::SEGMENT_UNMAP},
      {"snapshot", TraceEntry::SNAPSHOT},
      {"oom", TraceEntry::OOM},
  };
  for (const auto& [k, v] : table) {
    if (name == k) {
      return v;
    }
  }
  TORCH_CHECK(false, std::string("Unknown TraceEntry action: ") + name);
}
// TraceEntry's stream is a cudaStream_t before torch 2.11 and a void* since.
using TraceStream = decltype(std::declval<TraceEntry>().stream_);

inline TraceStream trace_stream(cudaStream_t s) { return reinterpret_cast<TraceStream>(s); }
// A private pool's id as TraceEntry names it (`{0, 0}`: the default pools).
using TracePool = decltype(std::declval<TraceEntry>().mempool_);

// TraceEntry's constructor: user metadata came in torch 2.10.
inline TraceEntry make_entry(TraceEntry::Action action, c10::DeviceIndex device, size_t addr, size_t size,
                             cudaStream_t stream, TracePool pool = {0, 0},
                             std::shared_ptr<c10::GatheredContext> ctx = nullptr, std::string compile_context = "",
                             std::string user_metadata = "") {
#if TORCH_VERSION_MINOR >= 10
  return TraceEntry(action, device, addr, size, trace_stream(stream), pool, 0, std::move(ctx),
                    std::move(compile_context), std::move(user_metadata));
#else
  (void)user_metadata;
  return TraceEntry(action, device, addr, size, trace_stream(stream), pool, 0, std::move(ctx),
                    std::move(compile_context));
#endif
}

class History {
 public:
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  // Whether frees must be told: while history records, and after it stops
  // while blocks allocated during it live (their stacks stay in the
  // snapshot, as PyTorch's blocks keep `context_when_allocated`).
  bool tracking() const { return tracking_.load(std::memory_order_relaxed); }

  // PyTorch's recordHistory; `skip` holds TraceEntry actions not to record.
  void configure(bool enabled, cca::CreateContextFn recorder, size_t max_entries, RecordContext when,
                 bool clear, const std::vector<int>& skip) {
    TORCH_CHECK(!enabled || when == RecordContext::NEVER || recorder != nullptr,
                "gpualloc recordHistory: stack recording was asked for without a context recorder");
    std::lock_guard<std::mutex> g(mutex_);
    recorder_ = enabled ? recorder : nullptr;
    when_ = enabled ? when : RecordContext::NEVER;
    max_entries_ = std::max<size_t>(1, max_entries);
    skip_ = std::unordered_set<int>(skip.begin(), skip.end());
    if (!enabled || clear) {
      rings_.clear();
    }
    if (!enabled) {
      // Only stacks are worth keeping (the snapshot's frames): without
      // one, an entry would keep every free on the tracked path for good.
      for (auto it = live_.begin(); it != live_.end();) {
        it = it->second.ctx == nullptr ? live_.erase(it) : std::next(it);
      }
    }
    enabled_.store(enabled, std::memory_order_relaxed);
    update_tracking();
  }

  // The stack of the calling thread, if stacks are recorded at level `needed`.
  Context gather(RecordContext needed) const {
    cca::CreateContextFn f = nullptr;
    {
      std::lock_guard<std::mutex> g(mutex_);
      if (when_ >= needed) {
        f = recorder_;
      }
    }
    return f != nullptr ? f() : nullptr;
  }

  // Seeds the sizes of allocations made before history started.
  void seed(void* ptr, size_t size, c10::DeviceIndex device) {
    std::lock_guard<std::mutex> g(mutex_);
    live_.emplace(ptr, Live{nullptr, size, device, nullptr});
  }

  void on_alloc(void* ptr, size_t size, c10::DeviceIndex device, cudaStream_t stream, Context ctx) {
    std::lock_guard<std::mutex> g(mutex_);
    push(TraceEntry::ALLOC, device, ptr, size, stream, ctx);
    live_[ptr] = Live{when_ >= RecordContext::STATE ? std::move(ctx) : nullptr, size, device, stream};
  }

  // A free that completes at once (a pool's checkpoint restored).
  void on_free(void* ptr, c10::DeviceIndex fallback_device, Context ctx) {
    std::lock_guard<std::mutex> g(mutex_);
    Live l = take_live(ptr, fallback_device);
    // As PyTorch's free: the free's stack, else the block's.
    Context used = ctx != nullptr ? std::move(ctx) : l.ctx;
    push(TraceEntry::FREE_REQUESTED, l.device, ptr, l.size, l.stream, used);
    push(TraceEntry::FREE_COMPLETED, l.device, ptr, l.size, l.stream, used);
    update_tracking();
  }

  // A free while history does not record (the stack of a block allocated
  // while it did is let go).
  void forget(void* ptr) {
    std::lock_guard<std::mutex> g(mutex_);
    live_.erase(ptr);
    update_tracking();
  }

  // A free asked for, before gpualloc frees: FREE_REQUESTED now;
  // FREE_COMPLETED in `after_free` (given the number this returns), or,
  // for a block used on other streams (`record_stream`), once gpualloc
  // says it is free (`on_block_freed`).
  uint64_t on_free_requested(void* ptr, c10::DeviceIndex fallback_device, Context ctx) {
    std::lock_guard<std::mutex> g(mutex_);
    auto earlier = freeing_.find(ptr);
    if (earlier != freeing_.end()) {
      // The block was freed at once and allocated again before that
      // free's `after_free` ran (another thread): that free is complete.
      complete(earlier);
    }
    Live l = take_live(ptr, fallback_device);
    // PyTorch's free: the free's stack, else its block's.
    push(TraceEntry::FREE_REQUESTED, l.device, ptr, l.size, l.stream, ctx != nullptr ? ctx : l.ctx);
    uint64_t seq = ++freeing_seq_;
    freeing_[ptr] = Freeing{std::move(l), std::move(ctx), false, seq};
    this_threads_frees().emplace_back(ptr, seq);
    update_tracking();
    return seq;
  }

  // Called by gpualloc (under its lock) during a free it defers: the
  // block waits for other streams' work.
  void on_block_deferred(void* ptr) {
    std::lock_guard<std::mutex> g(mutex_);
    auto it = freeing_.find(ptr);
    if (it != freeing_.end()) {
      it->second.deferred = true;
    }
  }

  // After gpualloc's free returned: the free `seq` is complete, unless
  // gpualloc deferred it.
  void after_free(void* ptr, uint64_t seq) {
    std::lock_guard<std::mutex> g(mutex_);
    auto& mine = this_threads_frees();
    mine.erase(std::remove(mine.begin(), mine.end(), std::make_pair(ptr, seq)), mine.end());
    auto it = freeing_.find(ptr);
    if (it != freeing_.end() && it->second.seq == seq && !it->second.deferred) {
      complete(it);
    }
  }

  // Called by gpualloc (under its lock) when a deferred free completes.
  void on_block_freed(void* ptr) {
    std::lock_guard<std::mutex> g(mutex_);
    auto it = freeing_.find(ptr);
    if (it != freeing_.end()) {
      complete(it);
    }
  }

  // Segment events of pool `pool`, with the stack of the request that
  // caused them (the calling thread's pending context).
  void on_event(TraceEntry::Action action, c10::DeviceIndex device, size_t addr, size_t size, cudaStream_t stream,
                TracePool pool) {
    std::lock_guard<std::mutex> g(mutex_);
    // A segment change during a free that gpualloc did not defer comes
    // after the block is free (it gave back memory the block left): the
    // free's FREE_COMPLETED goes first, where PyTorch records it, so that
    // MemoryViz, undoing the entries newest first, finds the block's
    // segment when it brings the block back.
    const auto& mine = this_threads_frees();
    if (!mine.empty()) {
      auto [freeing, seq] = mine.back();
      auto it = freeing_.find(freeing);
      if (it != freeing_.end() && it->second.seq == seq && !it->second.deferred) {
        complete(it);
      }
    }
    push(action, device, reinterpret_cast<void*>(addr), size, stream, pending_context(), nullptr, pool);
  }

  // An entry with the stack `ctx` of the request it is about: an
  // out-of-memory entry is recorded once the request has failed, after its
  // pending context was reset, and carries the request's stack as PyTorch's
  // does (its OOM TraceEntry gets the context gathered for the malloc).
  void on_event(TraceEntry::Action action, c10::DeviceIndex device, size_t addr, size_t size, cudaStream_t stream,
                Context ctx) {
    std::lock_guard<std::mutex> g(mutex_);
    push(action, device, reinterpret_cast<void*>(addr), size, stream, std::move(ctx));
  }

#if TORCH_VERSION_MINOR >= 14
  // torch >= 2.14's post-facto annotation of the live allocation that
  // starts at `ptr`: an "annotate" entry carrying `metadata`, while
  // history records (entries exist only then). False: no live allocation
  // starts there.
  bool annotate_memory(const void* ptr, const std::string& metadata) {
    std::lock_guard<std::mutex> g(mutex_);
    if (!enabled()) {
      return true;
    }
    auto it = live_.find(const_cast<void*>(ptr));
    if (it == live_.end()) {
      return false;
    }
    const Live& l = it->second;
    push(TraceEntry::ANNOTATE, l.device, it->first, l.size, l.stream, nullptr, &metadata);
    return true;
  }
#endif

  // The context of the allocation at `ptr`, for the snapshot's blocks.
  Context context_of(void* ptr) const {
    std::lock_guard<std::mutex> g(mutex_);
    auto it = live_.find(ptr);
    return it != live_.end() ? it->second.ctx : nullptr;
  }

  // The rings, oldest entry first, one per device up to `devices`.
  std::vector<std::vector<TraceEntry>> traces(size_t devices) const {
    std::lock_guard<std::mutex> g(mutex_);
    std::vector<std::vector<TraceEntry>> out(std::max(devices, rings_.size()));
    for (size_t d = 0; d < rings_.size(); ++d) {
      const Ring& r = rings_[d];
      auto& v = out[d];
      v.reserve(r.entries.size());
      for (size_t i = 0; i < r.entries.size(); ++i) {
        v.push_back(r.entries[(r.next + i) % r.entries.size()]);
      }
    }
    return out;
  }

  void annotate(const std::vector<std::pair<std::string, std::string>>& md, c10::DeviceIndex device) {
    if (!enabled()) {
      return;
    }
    std::lock_guard<std::mutex> g(mutex_);
    AnnotationEntry e(device, 0);
    e.time_.t_ = now_us();
    for (const auto& [k, v] : md) {
      e.recordUserMetadata(k, v);
    }
    annotations_.push_back(std::move(e));
    if (annotations_.size() > max_entries_) {
      annotations_.pop_front();  // a deque: the vector's erase(begin) moved every entry
    }
  }

  std::vector<AnnotationEntry> annotations() const {
    std::lock_guard<std::mutex> g(mutex_);
    return {annotations_.begin(), annotations_.end()};
  }

  void push_compile_context(const std::string& md) { compile_stack().push_back(md); }
  void pop_compile_context() {
    if (!compile_stack().empty()) {
      compile_stack().pop_back();
    }
  }
  void set_user_metadata(const std::string& md) {
    std::lock_guard<std::mutex> g(mutex_);
    user_metadata_ = md;
  }
  std::string user_metadata() const {
    std::lock_guard<std::mutex> g(mutex_);
    return user_metadata_;
  }

  // The context gathered for the request this thread is serving, so that
  // the segment events it causes carry the same stack.
  // Never destroyed, nor is the compile stack below: a free made during
  // static destruction at exit, after the main thread's thread_locals are
  // gone, still reaches them. The cost: a few dozen bytes for each thread
  // that allocates while history is on (or compiles), kept after the
  // thread ends.
  static Context& pending_context() {
    thread_local Context* ctx = new Context();
    return *ctx;
  }

 private:
  struct Live {
    Context ctx;
    size_t size;
    c10::DeviceIndex device;
    cudaStream_t stream;
  };
  struct Ring {
    std::vector<TraceEntry> entries;
    size_t next = 0;  // oldest entry once full
  };
  struct Freeing {
    Live live;
    Context ctx;    // the free's stack
    bool deferred;  // gpualloc waits for other streams' work
    uint64_t seq;   // which free of the address
  };

  // Under mutex_: the live allocation at `ptr`, taken out of live_.
  Live take_live(void* ptr, c10::DeviceIndex fallback_device) {
    auto it = live_.find(ptr);
    if (it == live_.end()) {
      return Live{nullptr, 0, fallback_device, nullptr};
    }
    Live l = std::move(it->second);
    live_.erase(it);
    return l;
  }

  // Under mutex_: FREE_COMPLETED for a free requested, with the free's
  // stack, or the allocation's where it has none. A free completed later
  // (deferred) gets the stack of the request that completes it on this
  // thread (the pending context: a malloc's, or emptyCache's), else the
  // allocation's: PyTorch's process_events and synchronize_and_free_events
  // hand their caller's context to free_block.
  void complete(std::unordered_map<void*, Freeing>::iterator it) {
    const Live& l = it->second.live;
    const Context& by = it->second.deferred ? pending_context() : it->second.ctx;
    const Context& ctx = by != nullptr ? by : l.ctx;
    push(TraceEntry::FREE_COMPLETED, l.device, it->first, l.size, l.stream, ctx);
    freeing_.erase(it);
    update_tracking();
  }

  // Under mutex_ (or before the first use): frees are told while history
  // records, or while a block allocated during it lives or is being freed.
  void update_tracking() {
    tracking_.store(enabled() || !live_.empty() || !freeing_.empty(), std::memory_order_relaxed);
  }

  // The frees this thread is in (between `on_free_requested` and
  // `after_free`), innermost last: block and number. A free may run inside
  // another's window (a garbage collection during a callback). Never
  // destroyed, as the pending context.
  static std::vector<std::pair<void*, uint64_t>>& this_threads_frees() {
    thread_local auto* f = new std::vector<std::pair<void*, uint64_t>>();
    return *f;
  }

  static std::vector<std::string>& compile_stack() {
    thread_local auto* s = new std::vector<std::string>();
    return *s;
  }

  static int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  // `metadata`: the entry's user metadata, if not the one set now; `pool`:
  // a segment event's pool.
  void push(TraceEntry::Action action, c10::DeviceIndex device, void* addr, size_t size, cudaStream_t stream,
            Context ctx, const std::string* metadata = nullptr, TracePool pool = {0, 0}) {
    if (!enabled() || skip_.count(static_cast<int>(action)) != 0 || device < 0) {
      return;
    }
    if (when_ < RecordContext::ALLOC) {
      // PyTorch's record_trace: below "alloc" no entry has a stack, not
      // even a free's completion that would carry its block's (kept for
      // the snapshot's live blocks only, with context="state").
      ctx = nullptr;
    }
    const auto& cs = compile_stack();
    TraceEntry e = make_entry(action, device, reinterpret_cast<size_t>(addr), size, stream, pool, std::move(ctx),
                              cs.empty() ? "N/A" : cs.back(), metadata != nullptr ? *metadata : user_metadata_);
    e.time_.t_ = now_us();
    if (rings_.size() <= static_cast<size_t>(device)) {
      rings_.resize(device + 1);
    }
    Ring& r = rings_[device];
    if (r.entries.size() < max_entries_) {
      r.entries.push_back(std::move(e));
    } else {
      r.entries[r.next] = std::move(e);
      r.next = (r.next + 1) % r.entries.size();
    }
  }

  std::atomic<bool> enabled_{false};
  std::atomic<bool> tracking_{false};
  mutable std::mutex mutex_;
  cca::CreateContextFn recorder_ = nullptr;
  RecordContext when_ = RecordContext::NEVER;
  size_t max_entries_ = 1;
  std::unordered_set<int> skip_;
  std::vector<Ring> rings_;
  std::unordered_map<void*, Live> live_;
  std::unordered_map<void*, Freeing> freeing_;
  uint64_t freeing_seq_ = 0;
  std::deque<AnnotationEntry> annotations_;
  std::string user_metadata_;
};

// Never destroyed: a CUDA tensor freed during torch's static destruction
// (the bridge, loaded after libtorch, has its globals destroyed first)
// still finds it.
inline History& history = *new History;

}  // namespace gpualloc_bridge
