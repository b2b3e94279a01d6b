// Sharing tensors with other processes (torch.multiprocessing): what
// shareIpcHandle returns and what getIpcDevPtr opens.
//
// A tensor in a plain segment is shared as PyTorch shares one: a CUDA IPC
// handle of the segment, PyTorch's format (version 2, type 'c'). A tensor
// in expandable memory is shared as the bytes gpualloc_ipc_share writes:
// PyTorch's own expandable format ('e') when its handles are all of one
// size, so a receiver under PyTorch's allocator opens it too, else
// gpualloc's ('g'). Memory shared in those two formats is opened by
// gpualloc (descriptors over a Unix socket, no pidfd_getfd needed; only
// the shared bytes reserved), the rest by PyTorch's allocator object.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "api.h"
#include "device_scope.h"

namespace gpualloc_bridge {

namespace ipc {

namespace cca = c10::cuda::CUDACachingAllocator;

// The shareable handle of the allocation that starts at `ptr` on `device`.
inline cca::ShareableHandle share(int device, void* ptr) {
  std::string bytes(512, '\0');
  size_t len = 0;
  uint64_t offset = 0;
  int rc = api.ipc_share(device, ptr, bytes.data(), bytes.size(), &len, &offset);
  if (rc == GPUALLOC_ERR_BUFFER_TOO_SMALL) {
    bytes.resize(len);
    rc = api.ipc_share(device, ptr, bytes.data(), bytes.size(), &len, &offset);
  }
  check(rc, "shareIpcHandle");
  if (len == 0) {
    // A plain segment: its CUDA IPC handle, in PyTorch's format.
    DeviceScope scope(device);
    void* base = static_cast<char*>(ptr) - offset;
    cudaIpcMemHandle_t h;
    C10_CUDA_CHECK(cudaIpcGetMemHandle(&h, base));
    bytes.assign({static_cast<char>(2), 'c'});
    bytes.append(reinterpret_cast<const char*>(&h), CUDA_IPC_HANDLE_SIZE);
  } else {
    bytes.resize(len);
    if (bytes[1] == 'g') {
      TORCH_WARN_ONCE(
          "gpualloc: a tensor was shared in gpualloc's format (its memory spans physical pages of several "
          "sizes): a receiving process must run gpualloc too; PyTorch's allocator opens only shares of one page "
          "size. If receivers use PyTorch's allocator, allocate what is shared while PyTorch's expandable_segments "
          "is off (torch.cuda.memory._set_allocator_settings(\"expandable_segments:False\"), plain segments) or run "
          "the sender with GPUALLOC_CONF=expandable_segments:false.");
    }
  }
  return cca::ShareableHandle{static_cast<ptrdiff_t>(offset), bytes};
}

// Whether gpualloc opens `handle` (expandable memory) rather than PyTorch.
inline bool opened_by_gpualloc(const std::string& handle) {
  return handle.size() > 2 && handle[0] == 2 && (handle[1] == 'e' || handle[1] == 'g');
}

// Shares opened in this process, each once while any tensor uses it (as
// PyTorch caches opened handles).
class Opened {
 public:
  // nullptr when gpualloc does not import this share (PyTorch's fabric
  // handles): PyTorch's allocator opens it then.
  std::shared_ptr<void> open(const std::string& handle) {
    std::lock_guard<std::mutex> g(mutex_);
    auto it = open_.find(handle);
    if (it != open_.end()) {
      if (auto p = it->second.lock()) {
        return p;
      }
    }
    for (auto e = open_.begin(); e != open_.end();) {
      e = e->second.expired() ? open_.erase(e) : std::next(e);
    }
    void* ptr = nullptr;
    int rc = api.ipc_open(handle.data(), handle.size(), c10::cuda::current_device(), &ptr);
    if (rc == GPUALLOC_ERR_INVALID_ARGUMENT && handle[1] == 'e') {
      return nullptr;
    }
    check(rc, "getIpcDevPtr");
    // Closing waits for the device and unmaps; an error there has no one to go to.
    std::shared_ptr<void> out(ptr, [](void* p) { api.ipc_close(p); });
    open_[handle] = out;
    return out;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> open_;
};

}  // namespace ipc

}  // namespace gpualloc_bridge
