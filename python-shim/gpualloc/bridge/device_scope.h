// The current CUDA device, set for a scope and put back at its end.
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

namespace gpualloc_bridge {

// As c10::cuda::CUDAGuard (c10's ExchangeDevice on entry, nothing for device
// -1; MaybeSetDevice, which creates no context on a device that has none, on
// exit), except when putting the device back fails (after a sticky CUDA error): CUDAGuard's
// destructor then warns through a message of two pieces, built with a
// stream inside the bridge (Note [Numbers in the bridge's messages]); here
// the error is cleared and left for the program's next CUDA call to report.
class DeviceScope {
 public:
  explicit DeviceScope(c10::DeviceIndex device)
      : old_(device < 0 ? c10::cuda::current_device() : c10::cuda::ExchangeDevice(device)) {}
  explicit DeviceScope(int device) : DeviceScope(static_cast<c10::DeviceIndex>(device)) {}
  ~DeviceScope() {
    if (c10::cuda::MaybeSetDevice(old_) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  c10::DeviceIndex old_;
};

}  // namespace gpualloc_bridge
