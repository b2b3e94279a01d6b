// The C ABI of libgpualloc.so as the bridge sees it: one table of function
// pointers, filled with dlsym from the exact file the Python package loaded
// (the bridge never links the library, so both share one allocator), and the
// helpers that turn its status codes into torch errors.
#pragma once

#include <c10/util/Exception.h>

#include <dlfcn.h>

#include <cstdio>

#include <string>
#include <vector>

#include "gpualloc.h"

namespace gpualloc_bridge {

// Note [Numbers in the bridge's messages]
// Rationale: on the GPU machine (torch 2.11, the bridge built by
// torch.utils.cpp_extension), a message that streamed a number through
// c10::str (TORCH_CHECK(false, "...", size, ...)) died of SIGSEGV inside
// std::ostream's number insertion, where an error was to be raised: the
// first run of the out-of-memory path with the caching allocator switched
// off ended the process. Messages made of strings alone are raised fine
// (every other error path of the bridge).
// Approach: numbers and pointers in messages are formatted with snprintf
// (num, ptr_text) and each message is one std::string (text() for C
// strings that may be null), which c10::str hands on as it is: no message
// of the bridge goes through a stream (python-shim/tests/test_bridge_messages.py).
// Limitation: the crash report named the bridge's own copy of
// std::ostream::_M_insert<unsigned long> (and of codecvt code), which a
// GCC 12 build here does not contain: the device's build may carry its own
// copy of libstdc++'s stream code, which inline code of torch's headers
// compiled into the bridge could still reach on a failure path. Not yet
// known (round 63 had no device time left): `nm -DC` of the device's
// bridge and its link line would tell.
inline std::string num(unsigned long long v) {
  char b[24];
  std::snprintf(b, sizeof b, "%llu", v);
  return b;
}
inline std::string num(long long v) {
  char b[24];
  std::snprintf(b, sizeof b, "%lld", v);
  return b;
}
inline std::string text(const char* s) { return s != nullptr ? std::string(s) : std::string(); }
inline std::string ptr_text(const void* p) {
  char b[24];
  std::snprintf(b, sizeof b, "%p", p);
  return b;
}

struct Api {
  decltype(&gpualloc_init) init = nullptr;
  decltype(&gpualloc_config_string) config_string = nullptr;
  decltype(&gpualloc_malloc) malloc_fn = nullptr;
  decltype(&gpualloc_free) free_fn = nullptr;
  decltype(&gpualloc_free_on) free_on = nullptr;
  decltype(&gpualloc_free_sized) free_sized = nullptr;
  decltype(&gpualloc_allocation_size) allocation_size = nullptr;
  decltype(&gpualloc_last_error) last_error = nullptr;
  decltype(&gpualloc_last_error_code) last_error_code = nullptr;
  decltype(&gpualloc_clear_error) clear_error = nullptr;
  decltype(&gpualloc_record_stream_on) record_stream_on = nullptr;
  decltype(&gpualloc_add_peer_access) add_peer_access = nullptr;
  decltype(&gpualloc_empty_cache) empty_cache = nullptr;
  decltype(&gpualloc_set_memory_fraction) set_memory_fraction = nullptr;
  decltype(&gpualloc_get_memory_fraction) get_memory_fraction = nullptr;
  decltype(&gpualloc_get_stats) get_stats = nullptr;
  decltype(&gpualloc_reset_peak_stats) reset_peak_stats = nullptr;
  decltype(&gpualloc_reset_accumulated_stats) reset_accumulated_stats = nullptr;
  decltype(&gpualloc_cache_info) cache_info = nullptr;
  decltype(&gpualloc_mem_info) mem_info = nullptr;
  decltype(&gpualloc_begin_allocate_to_pool) begin_pool = nullptr;
  decltype(&gpualloc_end_allocate_to_pool) end_pool = nullptr;
  decltype(&gpualloc_set_graph_capture_record_stream_reuse) set_capture_reuse = nullptr;
  decltype(&gpualloc_set_plain_requests) set_plain_requests = nullptr;
  decltype(&gpualloc_release_pool) release_pool = nullptr;
  decltype(&gpualloc_create_or_incref_pool) create_or_incref_pool = nullptr;
  decltype(&gpualloc_create_or_incref_pool_from) create_or_incref_pool_from = nullptr;
  decltype(&gpualloc_pool_use_count) pool_use_count = nullptr;
  decltype(&gpualloc_set_pool_use_on_oom) set_pool_use_on_oom = nullptr;
  decltype(&gpualloc_set_pool_no_split) set_pool_no_split = nullptr;
  decltype(&gpualloc_empty_pool_cache) empty_pool_cache = nullptr;
  decltype(&gpualloc_pool_live_allocations) pool_live_allocations = nullptr;
  decltype(&gpualloc_pool_checkpoint) pool_checkpoint = nullptr;
  decltype(&gpualloc_pool_restore) pool_restore = nullptr;
  decltype(&gpualloc_snapshot_segments) snapshot_segments = nullptr;
  decltype(&gpualloc_set_segment_observer) set_segment_observer = nullptr;
  decltype(&gpualloc_mark) mark = nullptr;
  decltype(&gpualloc_ipc_share) ipc_share = nullptr;
  decltype(&gpualloc_ipc_open) ipc_open = nullptr;
  decltype(&gpualloc_ipc_close) ipc_close = nullptr;
  decltype(&gpualloc_last_oom) last_oom = nullptr;
  decltype(&gpualloc_set_miss_callback) set_miss_callback = nullptr;
  decltype(&gpualloc_observe_block_frees) observe_block_frees = nullptr;
  decltype(&gpualloc_segment_event_pool) segment_event_pool = nullptr;

  // Resolves every symbol from the library at `handle`.
  void resolve_all(void* handle) {
    resolve(handle, "gpualloc_init", init);
    resolve(handle, "gpualloc_config_string", config_string);
    resolve(handle, "gpualloc_malloc", malloc_fn);
    resolve(handle, "gpualloc_free", free_fn);
    resolve(handle, "gpualloc_free_on", free_on);
    resolve(handle, "gpualloc_free_sized", free_sized);
    resolve(handle, "gpualloc_allocation_size", allocation_size);
    resolve(handle, "gpualloc_last_error", last_error);
    resolve(handle, "gpualloc_last_error_code", last_error_code);
    resolve(handle, "gpualloc_clear_error", clear_error);
    resolve(handle, "gpualloc_record_stream_on", record_stream_on);
    resolve(handle, "gpualloc_add_peer_access", add_peer_access);
    resolve(handle, "gpualloc_empty_cache", empty_cache);
    resolve(handle, "gpualloc_set_memory_fraction", set_memory_fraction);
    resolve(handle, "gpualloc_get_memory_fraction", get_memory_fraction);
    resolve(handle, "gpualloc_get_stats", get_stats);
    resolve(handle, "gpualloc_reset_peak_stats", reset_peak_stats);
    resolve(handle, "gpualloc_reset_accumulated_stats", reset_accumulated_stats);
    resolve(handle, "gpualloc_cache_info", cache_info);
    resolve(handle, "gpualloc_mem_info", mem_info);
    resolve(handle, "gpualloc_begin_allocate_to_pool", begin_pool);
    resolve(handle, "gpualloc_end_allocate_to_pool", end_pool);
    resolve(handle, "gpualloc_set_graph_capture_record_stream_reuse", set_capture_reuse);
    resolve(handle, "gpualloc_set_plain_requests", set_plain_requests);
    resolve(handle, "gpualloc_release_pool", release_pool);
    resolve(handle, "gpualloc_create_or_incref_pool", create_or_incref_pool);
    resolve(handle, "gpualloc_create_or_incref_pool_from", create_or_incref_pool_from);
    resolve(handle, "gpualloc_pool_use_count", pool_use_count);
    resolve(handle, "gpualloc_set_pool_use_on_oom", set_pool_use_on_oom);
    resolve(handle, "gpualloc_set_pool_no_split", set_pool_no_split);
    resolve(handle, "gpualloc_empty_pool_cache", empty_pool_cache);
    resolve(handle, "gpualloc_pool_live_allocations", pool_live_allocations);
    resolve(handle, "gpualloc_pool_checkpoint", pool_checkpoint);
    resolve(handle, "gpualloc_pool_restore", pool_restore);
    resolve(handle, "gpualloc_snapshot_segments", snapshot_segments);
    resolve(handle, "gpualloc_set_segment_observer", set_segment_observer);
    resolve(handle, "gpualloc_mark", mark);
    resolve(handle, "gpualloc_ipc_share", ipc_share);
    resolve(handle, "gpualloc_ipc_open", ipc_open);
    resolve(handle, "gpualloc_ipc_close", ipc_close);
    resolve(handle, "gpualloc_last_oom", last_oom);
    resolve(handle, "gpualloc_set_miss_callback", set_miss_callback);
    resolve(handle, "gpualloc_observe_block_frees", observe_block_frees);
    resolve(handle, "gpualloc_segment_event_pool", segment_event_pool);
  }

 private:
  template <class F>
  static void resolve(void* handle, const char* name, F& out) {
    out = reinterpret_cast<F>(dlsym(handle, name));
    TORCH_CHECK(out != nullptr, "gpualloc bridge: symbol " + text(name) +
                                    " not found in libgpualloc (is the library older than the Python package?): " +
                                    text(dlerror()));
  }
};

inline Api api;

inline std::string last_error(const char* fallback) {
  const char* e = api.last_error();
  return e != nullptr ? std::string(e) : std::string(fallback);
}

// Raises the error of the void call that just ran, if any (void calls report
// through the thread's last error, which they clear at entry).
inline void raise_if_failed(const char* what) {
  const char* e = api.last_error();
  TORCH_CHECK(e == nullptr, "gpualloc " + text(what) + ": " + text(e));
}

inline void check(int rc, const char* what) {
  TORCH_CHECK(rc == GPUALLOC_OK, "gpualloc " + text(what) + ": " + last_error("unknown error"));
}

// Calls `fill(buffer, cap, &count)` with a buffer that grows until it fits
// (the ABI's BUFFER_TOO_SMALL convention: the count is always written).
template <class T, class Fill>
std::vector<T> read_list(const char* what, Fill fill) {
  std::vector<T> out(64);
  for (int attempt = 0; attempt < 8; ++attempt) {
    size_t n = 0;
    int rc = fill(out.data(), out.size(), &n);
    if (rc == GPUALLOC_OK) {
      out.resize(n);
      return out;
    }
    TORCH_CHECK(rc == GPUALLOC_ERR_BUFFER_TOO_SMALL, "gpualloc " + text(what) + ": " + last_error("unknown error"));
    out.resize(n + n / 4 + 16);  // it may grow between the calls
  }
  TORCH_CHECK(false, "gpualloc " + text(what) + ": the list kept growing while being read");
}

}  // namespace gpualloc_bridge
