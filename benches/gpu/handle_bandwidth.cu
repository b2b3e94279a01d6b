/*
 * handle_bandwidth.cu - how fast kernels stream over memory mapped from
 * physical handles of a given size, against one cudaMalloc.
 *
 * A caching allocator on CUDA's virtual memory API chooses the size of the
 * physical handles (cuMemCreate) behind a tensor, and whether handles that
 * are mapped side by side were created together. Kernels see only virtual
 * addresses, but their bandwidth need not be the same: this benchmark maps
 * two 4 GiB buffers from handles of 2 MiB .. 1 GiB and times a copy kernel
 * (float4, grid-stride), a read-only reduction, cudaMemcpyAsync (what
 * torch's copy_ between same-typed contiguous tensors calls) and
 * cudaMemsetAsync over them, with CUDA events (median of 20 runs after 3
 * warm-ups), reported as GB/s moved; and the latency of an 8-byte copy to
 * or from a random place in them, waited for (what each `.item()` or
 * `nonzero()` pays), the mean of 2,000.
 *
 * Layouts, per handle size:
 *   in_order     the handles of each buffer created one after the other and
 *                mapped in creation order;
 *   interleaved  the handles of the two buffers created alternately (so
 *                neighbours in one buffer were never created together) and
 *                each buffer's handles mapped in a shuffled order: the
 *                layout a cache reaches after many steps of reuse.
 *
 * Build and run (`bash benches/gpu/cu_bench.sh handle_bandwidth` does both):
 *     nvcc -O2 -o handle_bandwidth handle_bandwidth.cu -lcuda
 *     ./handle_bandwidth > out.md
 *
 * Uses device 0's primary context; plain device memory only; everything
 * created is released. Every CUDA call is checked: on error the call and
 * its error are printed and the program exits with status 1.
 */
#include "check.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

static const size_t MiB = 1ull << 20;
static const size_t BUF = 4096 * MiB;

__global__ void copy_kernel(const float4* __restrict__ src, float4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

__global__ void sum_kernel(const float4* __restrict__ src, size_t n, float* out) {
  float s = 0.f;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float4 v = src[i];
    s += v.x + v.y + v.z + v.w;
  }
  if (s == 12345.678f) *out = s;  // keeps the loads; never true for zeros
}

// Median milliseconds of `launch` over 20 runs after 3 warm-ups.
template <class F>
static float median_ms(F launch) {
  cudaEvent_t a, b;
  RT(cudaEventCreate(&a));
  RT(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < 23; ++i) {
    RT(cudaEventRecord(a));
    launch();
    RT(cudaEventRecord(b));
    RT(cudaEventSynchronize(b));
    float ms = 0;
    RT(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) t.push_back(ms);
  }
  RT(cudaEventDestroy(a));
  RT(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Mapped {
  CUdeviceptr base = 0;
  std::vector<CUmemGenericAllocationHandle> handles;
};

// Two BUF-sized ranges mapped from handles of `h` bytes.
static void map_pair(size_t h, bool interleaved, Mapped& x, Mapped& y, std::mt19937& rng) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t n = BUF / h;
  for (Mapped* m : {&x, &y}) {
    DRV(cuMemAddressReserve(&m->base, BUF, h, 0, 0));  // aligned to the handle
    m->handles.resize(n);
  }
  for (size_t i = 0; i < 2 * n; ++i) {
    // in_order: all of x's handles, then all of y's; interleaved: x, y, x, y, ...
    Mapped* m = interleaved ? (i % 2 ? &y : &x) : (i < n ? &x : &y);
    size_t k = interleaved ? i / 2 : i % n;
    DRV(cuMemCreate(&m->handles[k], h, &prop, 0));
  }
  for (Mapped* m : {&x, &y}) {
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    if (interleaved) std::shuffle(order.begin(), order.end(), rng);
    for (size_t i = 0; i < n; ++i) DRV(cuMemMap(m->base + i * h, h, 0, m->handles[order[i]], 0));
    CUmemAccessDesc acc = {};
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    DRV(cuMemSetAccess(m->base, BUF, &acc, 1));
  }
}

static void unmap(Mapped& m) {
  DRV(cuMemUnmap(m.base, BUF));
  for (auto hd : m.handles) DRV(cuMemRelease(hd));
  DRV(cuMemAddressFree(m.base, BUF));
  m.handles.clear();
}

// Mean microseconds of an 8-byte cudaMemcpyAsync between pinned host memory
// and a random place in `dev` (2,000 draws over 2,048 pages of 2 MiB reach
// about 1,300 of them), each waited for: what `.item()`, `nonzero()` and
// other host syncs pay per copy.
static double small_copy_us(void* dev, cudaMemcpyKind kind, void* host, cudaStream_t s) {
  std::mt19937_64 rng(3);
  const int n = 2000;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    char* at = (char*)dev + (rng() % (BUF / 8)) * 8;
    if (kind == cudaMemcpyDeviceToHost) {
      RT(cudaMemcpyAsync(host, at, 8, kind, s));
    } else {
      RT(cudaMemcpyAsync(at, host, 8, kind, s));
    }
    RT(cudaStreamSynchronize(s));
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
}

static void measure(const char* label, void* src, void* dst, float* sink, int sms) {
  size_t n = BUF / sizeof(float4);
  RT(cudaMemset(src, 0, BUF));
  RT(cudaMemset(dst, 0, BUF));
  int grid = sms * 8;
  float copy = median_ms([&] { copy_kernel<<<grid, 512>>>((const float4*)src, (float4*)dst, n); });
  float sum = median_ms([&] { sum_kernel<<<grid, 512>>>((const float4*)src, n, sink); });
  float memcpy_ms = median_ms([&] { RT(cudaMemcpyAsync(dst, src, BUF, cudaMemcpyDeviceToDevice)); });
  float memset_ms = median_ms([&] { RT(cudaMemsetAsync(dst, 1, BUF)); });
  void* host;
  RT(cudaMallocHost(&host, 8));
  cudaStream_t s;
  RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double d2h = small_copy_us(src, cudaMemcpyDeviceToHost, host, s);
  double h2d = small_copy_us(dst, cudaMemcpyHostToDevice, host, s);
  RT(cudaStreamDestroy(s));
  RT(cudaFreeHost(host));
  RT(cudaGetLastError());
  printf("| %s | %.0f | %.0f | %.0f | %.0f | %.1f | %.1f |\n", label, 2.0 * BUF / (copy * 1e-3) / 1e9,
         BUF / (sum * 1e-3) / 1e9, 2.0 * BUF / (memcpy_ms * 1e-3) / 1e9, BUF / (memset_ms * 1e-3) / 1e9, d2h, h2d);
  fflush(stdout);
}

int main() {
  cudaDeviceProp p = device0();
  float* sink;
  RT(cudaMalloc(&sink, sizeof(float)));
  printf("# Streaming bandwidth by physical handle size (%s, two buffers of %zu MiB)\n\n", p.name, BUF / MiB);
  printf("| layout | copy kernel GB/s | read kernel GB/s | cudaMemcpyAsync GB/s | cudaMemsetAsync GB/s "
         "| 8 B to host µs | 8 B from host µs |\n|---|---|---|---|---|---|---|\n");
  void *a, *b;
  RT(cudaMalloc(&a, BUF));
  RT(cudaMalloc(&b, BUF));
  measure("cudaMalloc", a, b, sink, p.multiProcessorCount);
  RT(cudaFree(a));
  RT(cudaFree(b));
  std::mt19937 rng(7);
  for (size_t h : {2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB, 1024 * MiB}) {
    for (bool inter : {false, true}) {
      Mapped x, y;
      map_pair(h, inter, x, y, rng);
      char label[64];
      snprintf(label, sizeof label, "%zu MiB handles, %s", h / MiB, inter ? "interleaved" : "in_order");
      measure(label, (void*)x.base, (void*)y.base, sink, p.multiProcessorCount);
      unmap(x);
      unmap(y);
    }
  }
  RT(cudaFree(sink));
  return 0;
}
