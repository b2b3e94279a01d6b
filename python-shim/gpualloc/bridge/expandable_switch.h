// PyTorch's expandable_segments setting, passed on to gpualloc.
//
// Note [PyTorch's expandable_segments switch] (in the core's
// plain_requests.rs) says why gpualloc honours it. What PyTorch's setting
// says is read here: `AcceleratorAllocatorConfig::use_expandable_segments()`
// is false both when nobody set it and when someone set it false, and only
// the latter asks for plain segments. So it counts as stated once it was
// true, or once PyTorch's last settings string (its variable at start, or
// the last `_set_allocator_settings`) named the key; stated and false, it
// says off. PyTorch parses a new string without calling its allocator, so
// the setting is read when the bridge is installed (the variable), each
// time the Python package's wrapper of torch's setter returns, and where a
// private pool may be created (a capture's scope, a MemPool), which also
// catches a setter called from C++.
#pragma once

#include <c10/core/AllocatorConfig.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <mutex>
#include <string>

#include "api.h"

namespace gpualloc_bridge {

// Whether PyTorch's settings string names the key `expandable_segments`
// (not `expandable_segments_handle_type` or another key it begins).
inline bool names_expandable_segments(const std::string& settings) {
  static const std::string key = "expandable_segments";
  for (size_t at = settings.find(key); at != std::string::npos; at = settings.find(key, at + 1)) {
    bool starts = at == 0 || settings[at - 1] == ',' || std::isspace(static_cast<unsigned char>(settings[at - 1]));
    size_t end = at + key.size();
    while (end < settings.size() && std::isspace(static_cast<unsigned char>(settings[end]))) {
      end++;
    }
    if (starts && end < settings.size() && settings[end] == ':') {
      return true;
    }
  }
  return false;
}

// Said when the switch turns gpualloc plain: code that sets it false to
// restore what it takes for PyTorch's default leaves gpualloc plain.
inline const char* const kPlainRequestsWarning =
    "gpualloc: PyTorch's expandable_segments is set to False (PYTORCH_CUDA_ALLOC_CONF or "
    "torch.cuda.memory._set_allocator_settings): new allocations come from plain segments, as under "
    "PyTorch's allocator (shareable with cudaIpcGetMemHandle), until it is set to True again; meanwhile "
    "reserved memory is not kept close to live memory";

class ExpandableSwitch {
 public:
  // Tells gpualloc what PyTorch's setting says, if that changed since the
  // last call (gpualloc keeps it for its start when it has not started).
  // True when this call turned requests plain (the caller says so).
  bool sync() {
    std::lock_guard<std::mutex> g(mutex_);
    bool on = c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
    if (on) {
      stated_ = true;
    } else if (!stated_) {
      stated_ = names_expandable_segments(c10::CachingAllocator::getAllocatorSettings());
    }
    int plain = stated_ && !on ? 1 : 0;
    if (plain == told_) {
      return false;
    }
    check(api.set_plain_requests(plain), "PyTorch's expandable_segments setting");
    told_ = plain;
    return plain != 0;
  }

  // Whether gpualloc was last told that requests take plain segments.
  bool plain() {
    std::lock_guard<std::mutex> g(mutex_);
    return told_ != 0;
  }

  // sync() inside one of torch's calls: a warning torch raises in Python.
  void sync_and_warn() {
    if (sync()) {
      TORCH_WARN(kPlainRequestsWarning);
    }
  }

 private:
  std::mutex mutex_;
  bool stated_ = false;
  int told_ = 0;
};

// Never destroyed, as the bridge's other globals.
inline ExpandableSwitch& expandable_switch = *new ExpandableSwitch;

}  // namespace gpualloc_bridge
