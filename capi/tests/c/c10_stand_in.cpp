// A stand-in for PyTorch's libc10_cuda.so: the two functions gpualloc_free
// reads PyTorch's current stream with (Note [The current stream without
// the bridge] in src/torch_stream.rs), declared as c10 declares them, so
// that the compiler mangles their names and passes their values as c10's
// do. A stream's handle is its id; the test sets the current one.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace c10 {
using DeviceIndex = int8_t;
using StreamId = int64_t;
enum class DeviceType : int8_t { CPU = 0, CUDA = 1 };
struct Device {
  DeviceType type_;
  DeviceIndex index_;
};
class Stream final {
 public:
  Stream(Device device, StreamId id) : device_(device), id_(id) {}
  StreamId id() const { return id_; }

 private:
  Device device_;
  StreamId id_;
};
namespace cuda {
struct Opaque;  // cudaStream_t is a pointer to CUDA's CUstream_st
class CUDAStream {
 public:
  explicit CUDAStream(Stream stream) : stream_(stream) {}
  Opaque *stream() const;

 private:
  Stream stream_;
};
CUDAStream getCurrentCUDAStream(DeviceIndex device_index = -1);
DeviceIndex device_count() noexcept;
}  // namespace cuda
}  // namespace c10

static c10::StreamId current_ids[16];

// One device, as GPUALLOC_SIM_DEVICES's default; a test may count more
// on gpualloc's side (c10 is asked only for the devices it counts).
c10::DeviceIndex c10::cuda::device_count() noexcept { return 1; }

c10::cuda::Opaque *c10::cuda::CUDAStream::stream() const {
  return reinterpret_cast<Opaque *>(static_cast<uintptr_t>(stream_.id()));
}

// c10 throws for a device it does not count; the stand-in counts one
// (GPUALLOC_SIM_DEVICES's default) and aborts for any other.
c10::cuda::CUDAStream c10::cuda::getCurrentCUDAStream(DeviceIndex device_index) {
  if (device_index != 0) {
    std::fprintf(stderr, "stand-in c10: device %d asked for\n", device_index);
    std::abort();
  }
  Device device{DeviceType::CUDA, device_index};
  return CUDAStream(Stream(device, current_ids[device_index & 15]));
}

extern "C" void stand_in_set_current_stream(int device, int64_t id) { current_ids[device & 15] = id; }
