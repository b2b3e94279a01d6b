/*
 * host_latency.cu - whether the host's small CUDA calls get slower as a
 * process maps more physical handles.
 *
 * A host-bound training loop waits on the GPU at every `.item()` and
 * `nonzero()`: an 8-byte copy to the host and a stream synchronization. A
 * caching allocator on CUDA's virtual memory API leaves thousands of
 * handles mapped (gpualloc: handles of 2-16 MiB, stitched ranges that map
 * some of them twice), where `cudaMalloc` segments or PyTorch's 20 MiB
 * expandable pages leave hundreds. If the driver's lookup of a device
 * pointer (which every copy and `cudaPointerGetAttributes` makes) costs
 * more with more mappings, each sync pays it.
 *
 * For N = 0, 512, 2048, 8192 and 16384 extra handles of 2 MiB mapped (all
 * into one reservation, or each into a reservation of its own, the shape
 * of many segments or stitches), it times, as the mean of 5,000 calls:
 *   attrs      cudaPointerGetAttributes of a pointer in the last mapping;
 *   d2h mapped an 8-byte cudaMemcpyAsync to pinned host memory from a
 *              random mapped handle, then cudaStreamSynchronize;
 *   d2h malloc the same from a cudaMalloc buffer (the control);
 *   memset     an 8-byte cudaMemsetAsync on a random mapped handle + sync;
 *   launch     an empty kernel + sync.
 *
 * Build and run (`bash benches/gpu/cu_bench.sh host_latency` does both):
 *     nvcc -O2 -o host_latency host_latency.cu -lcuda
 *     ./host_latency > out.md
 *
 * Uses device 0's primary context and up to 32 GiB of plain device memory;
 * everything created is released. Every CUDA call is checked: on error the
 * call and its error are printed and the program exits with status 1.
 */
#include "check.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

static const size_t H = 2ull << 20;  // handle size
static const int CALLS = 5000;

__global__ void empty_kernel() {}

// `n` handles of H bytes mapped and made accessible: into one reservation
// (`one`), or each into its own.
struct Mappings {
  std::vector<CUdeviceptr> bases;  // reservation starts
  std::vector<size_t> sizes;       // reservation sizes
  std::vector<CUdeviceptr> at;     // each handle's address
  std::vector<CUmemGenericAllocationHandle> handles;

  Mappings(size_t n, bool one) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemAccessDesc acc = {};
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (n == 0) return;
    if (one) {
      CUdeviceptr b;
      DRV(cuMemAddressReserve(&b, n * H, H, 0, 0));
      bases.push_back(b);
      sizes.push_back(n * H);
    }
    for (size_t i = 0; i < n; ++i) {
      CUmemGenericAllocationHandle h;
      DRV(cuMemCreate(&h, H, &prop, 0));
      handles.push_back(h);
      CUdeviceptr a;
      if (one) {
        a = bases[0] + i * H;
      } else {
        DRV(cuMemAddressReserve(&a, H, H, 0, 0));
        bases.push_back(a);
        sizes.push_back(H);
      }
      DRV(cuMemMap(a, H, 0, h, 0));
      DRV(cuMemSetAccess(a, H, &acc, 1));
      at.push_back(a);
    }
  }

  ~Mappings() {
    for (size_t i = 0; i < handles.size(); ++i) {
      DRV(cuMemUnmap(at[i], H));
      DRV(cuMemRelease(handles[i]));
    }
    for (size_t i = 0; i < bases.size(); ++i) DRV(cuMemAddressFree(bases[i], sizes[i]));
  }
};

// Mean microseconds of `call(i)` over CALLS calls.
template <class F>
static double mean_us(F call) {
  for (int i = 0; i < 100; ++i) call(i);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < CALLS; ++i) call(i);
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / CALLS;
}

int main() {
  cudaDeviceProp p = device0();
  void* host;
  RT(cudaMallocHost(&host, 8));
  void* plain;
  RT(cudaMalloc(&plain, 64 << 20));
  cudaStream_t s;
  RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("# Host latency of small CUDA calls by handles mapped (%s, handles of 2 MiB; mean µs of %d calls)\n\n",
         p.name, CALLS);
  printf("| handles mapped | reservations | attrs | d2h mapped | d2h malloc | memset | launch |\n"
         "|---|---|---|---|---|---|---|\n");
  for (size_t n : {0, 512, 2048, 8192, 16384}) {
    for (bool one : {true, false}) {
      if (n == 0 && !one) continue;
      Mappings m(n, one);
      // With nothing mapped, the "mapped" columns use the cudaMalloc buffer.
      std::mt19937_64 rng(7);
      auto pick = [&]() -> void* {
        return n ? (void*)(m.at[rng() % n] + (rng() % (H / 8)) * 8) : (char*)plain + (rng() % 1024) * 8;
      };
      void* last = n ? (void*)m.at[n - 1] : plain;
      cudaPointerAttributes a;
      double attrs = mean_us([&](int) { RT(cudaPointerGetAttributes(&a, last)); });
      double d2h = mean_us([&](int) {
        RT(cudaMemcpyAsync(host, pick(), 8, cudaMemcpyDeviceToHost, s));
        RT(cudaStreamSynchronize(s));
      });
      double d2h_plain = mean_us([&](int i) {
        RT(cudaMemcpyAsync(host, (char*)plain + (i % 1024) * 8, 8, cudaMemcpyDeviceToHost, s));
        RT(cudaStreamSynchronize(s));
      });
      double memset = mean_us([&](int) {
        RT(cudaMemsetAsync(pick(), 0, 8, s));
        RT(cudaStreamSynchronize(s));
      });
      double launch = mean_us([&](int) {
        empty_kernel<<<1, 32, 0, s>>>();
        RT(cudaStreamSynchronize(s));
      });
      RT(cudaGetLastError());
      printf("| %zu | %s | %.2f | %.2f | %.2f | %.2f | %.2f |\n", n, n == 0 ? "-" : (one ? "one" : "one each"), attrs,
             d2h, d2h_plain, memset, launch);
      fflush(stdout);
    }
  }
  RT(cudaStreamDestroy(s));
  RT(cudaFree(plain));
  RT(cudaFreeHost(host));
  return 0;
}
