/*
 * vmm_stall.cu - whether CUDA's virtual memory calls slow down the kernels
 * that run on the GPU meanwhile.
 *
 * vmm_threads.cu measures the host side (the calls serialize; a mapping
 * thread slows kernel launches by 3-20%). This measures the device side:
 * an allocator that moves pages while the GPU trains pays for it twice if
 * each map, access change or unmap also stalls the running kernels (page
 * table updates, TLB invalidation), and the replay's cost model, which
 * prices host time only, would miss that part.
 *
 * For each kind of host call, K kernels are queued on one stream between
 * two events (about 200 ms of GPU work), and the host then makes that kind
 * of call in a loop, on memory no kernel touches, until the second event
 * completes. The GPU time between the events, against the same with the
 * host only polling, gives the GPU time lost per call. Kinds:
 *   none                 - the host only polls the event;
 *   set access           - cuMemSetAccess again on one mapped 2 MiB handle;
 *   map + unmap          - cuMemMap and cuMemUnmap of a pooled 2 MiB handle;
 *   map + access + unmap - what moving one pooled 2 MiB handle costs;
 *   create + release     - cuMemCreate and cuMemRelease of 2 MiB.
 * Kernels: a memory-bound read-modify-write over a 1 GiB buffer, and a
 * compute-bound multiply-add loop; the buffer is either one cudaMalloc or
 * 512 mapped 2 MiB handles (what an expandable segment gives).
 * Median of 5 interleaved rounds.
 *
 * Build and run (`bash benches/gpu/cu_bench.sh vmm_stall` does both):
 *     nvcc -O2 -std=c++17 -o vmm_stall vmm_stall.cu -lcuda
 *     ./vmm_stall > out.md
 *
 * Uses device 0's primary context and about 1.5 GiB of device memory;
 * everything created is released. Every CUDA call is checked: on error the
 * call and its error are printed and the program exits with status 1.
 */
#include "check.h"

#include <algorithm>
#include <cstdio>
#include <vector>

static const size_t H = 2ull << 20;     // handle size
static const size_t WORK = 1ull << 30;  // the kernels' buffer
static const size_t POOL = 256;         // pooled handles the host moves
static const int ROUNDS = 5;
static const double TARGET_MS = 200.0;  // GPU work queued per measurement

__global__ void stream_rw(float4* p, size_t n) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) {
    float4 v = p[i];
    v.x += 1.f;
    v.y += 1.f;
    v.z += 1.f;
    v.w += 1.f;
    p[i] = v;
  }
}

__global__ void fma_loop(float* p, int iters) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  float a = p[i], b = 1.0001f;
  for (int k = 0; k < iters; ++k) a = a * b + 0.0001f;
  p[i] = a;
}

enum Kind { NONE, SET_ACCESS, MAP_UNMAP, REMAP, CREATE_RELEASE, NKIND };
static const char* KIND[NKIND] = {"none", "set access", "map + unmap", "map + access + unmap",
                                  "create + release"};

// Memory the host moves: POOL handles, a reservation to map them into, and
// one handle kept mapped for the access-only calls.
struct Moves {
  CUdeviceptr base = 0, fixed = 0;
  std::vector<CUmemGenericAllocationHandle> h;
  CUmemGenericAllocationHandle fixed_h = 0;
  size_t next = 0;

  Moves() : h(POOL) {
    CUmemAllocationProp p = device0_prop();
    CUmemAccessDesc a = device0_access();
    DRV(cuMemAddressReserve(&base, POOL * H, H, 0, 0));
    DRV(cuMemAddressReserve(&fixed, H, H, 0, 0));
    for (auto& x : h) DRV(cuMemCreate(&x, H, &p, 0));
    DRV(cuMemCreate(&fixed_h, H, &p, 0));
    DRV(cuMemMap(fixed, H, 0, fixed_h, 0));
    DRV(cuMemSetAccess(fixed, H, &a, 1));
  }
  ~Moves() {
    DRV(cuMemUnmap(fixed, H));
    DRV(cuMemRelease(fixed_h));
    for (auto x : h) DRV(cuMemRelease(x));
    DRV(cuMemAddressFree(fixed, H));
    DRV(cuMemAddressFree(base, POOL * H));
  }

  void one(Kind k) {
    static const CUmemAccessDesc a = device0_access();
    static const CUmemAllocationProp p = device0_prop();
    size_t j = next++ % POOL;
    CUdeviceptr at = base + j * H;
    switch (k) {
      case NONE: break;
      case SET_ACCESS: DRV(cuMemSetAccess(fixed, H, &a, 1)); break;
      case MAP_UNMAP:
        DRV(cuMemMap(at, H, 0, h[j], 0));
        DRV(cuMemUnmap(at, H));
        break;
      case REMAP:
        DRV(cuMemMap(at, H, 0, h[j], 0));
        DRV(cuMemSetAccess(at, H, &a, 1));
        DRV(cuMemUnmap(at, H));
        break;
      case CREATE_RELEASE: {
        CUmemGenericAllocationHandle x;
        DRV(cuMemCreate(&x, H, &p, 0));
        DRV(cuMemRelease(x));
        break;
      }
      default: break;
    }
  }
};

// The kernels' buffer: one cudaMalloc, or 2 MiB handles mapped in a row.
struct Work {
  void* p = nullptr;
  bool mapped;
  CUdeviceptr base = 0;
  std::vector<CUmemGenericAllocationHandle> h;

  explicit Work(bool mapped_) : mapped(mapped_) {
    if (!mapped) {
      RT(cudaMalloc(&p, WORK));
    } else {
      CUmemAllocationProp pr = device0_prop();
      CUmemAccessDesc a = device0_access();
      DRV(cuMemAddressReserve(&base, WORK, H, 0, 0));
      h.resize(WORK / H);
      for (size_t i = 0; i < h.size(); ++i) {
        DRV(cuMemCreate(&h[i], H, &pr, 0));
        DRV(cuMemMap(base + i * H, H, 0, h[i], 0));
      }
      DRV(cuMemSetAccess(base, WORK, &a, 1));
      p = (void*)base;
    }
    RT(cudaMemset(p, 0, WORK));
  }
  ~Work() {
    if (!mapped) {
      RT(cudaFree(p));
      return;
    }
    RT(cudaDeviceSynchronize());
    DRV(cuMemUnmap(base, WORK));
    for (auto x : h) DRV(cuMemRelease(x));
    DRV(cuMemAddressFree(base, WORK));
  }
};

static int sms() {
  int n = 0;
  RT(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0));
  return n;
}

static void launch(bool memory_bound, void* buf, cudaStream_t s) {
  if (memory_bound) {
    stream_rw<<<sms() * 4, 512, 0, s>>>((float4*)buf, WORK / sizeof(float4));
  } else {
    fma_loop<<<sms() * 8, 256, 0, s>>>((float*)buf, 20000);
  }
}

struct Result {
  double gpu_ms;
  long calls;
};

// K kernels between two events; the host makes calls of `k` until the
// second completes.
static Result measure(Moves& m, Kind k, bool memory_bound, void* buf, int count, cudaStream_t s) {
  cudaEvent_t e0, e1;
  RT(cudaEventCreate(&e0));
  RT(cudaEventCreate(&e1));
  RT(cudaEventRecord(e0, s));
  for (int i = 0; i < count; ++i) launch(memory_bound, buf, s);
  RT(cudaGetLastError());
  RT(cudaEventRecord(e1, s));
  long calls = 0;
  cudaError_t q;
  while ((q = cudaEventQuery(e1)) == cudaErrorNotReady) {
    if (k != NONE) {
      m.one(k);
      ++calls;
    }
  }
  RT(q);
  float ms = 0;
  RT(cudaEventElapsedTime(&ms, e0, e1));
  RT(cudaEventDestroy(e0));
  RT(cudaEventDestroy(e1));
  return {ms, calls};
}

int main() {
  cudaDeviceProp dp = device0();
  cudaStream_t s;
  RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Moves moves;
  printf("# Kernels' GPU time while the host makes VMM calls on other memory (%s; median of %d rounds)\n\n",
         dp.name, ROUNDS);
  printf("| kernels' memory | kernel | host calls meanwhile | kernels | GPU ms | slowdown | calls | host µs per call "
         "| GPU µs lost per call |\n|---|---|---|---:|---:|---:|---:|---:|---:|\n");
  for (bool mapped : {false, true}) {
    Work w(mapped);
    for (bool memory_bound : {true, false}) {
      // Calibrate: how many kernels make about TARGET_MS of GPU work (after
      // a first measurement that loads the module and warms the clocks).
      measure(moves, NONE, memory_bound, w.p, 20, s);
      Result cal = measure(moves, NONE, memory_bound, w.p, 20, s);
      int count = std::max(1, (int)(TARGET_MS / (cal.gpu_ms / 20)));
      std::vector<double> ms[NKIND];
      std::vector<long> calls[NKIND];
      for (int r = 0; r < ROUNDS; ++r) {
        for (int k = 0; k < NKIND; ++k) {
          Result res = measure(moves, (Kind)k, memory_bound, w.p, count, s);
          ms[k].push_back(res.gpu_ms);
          calls[k].push_back(res.calls);
        }
      }
      double base = 0;
      for (int k = 0; k < NKIND; ++k) {
        std::vector<double> sorted = ms[k];
        std::sort(sorted.begin(), sorted.end());
        std::vector<long> c = calls[k];
        std::sort(c.begin(), c.end());
        double med = sorted[ROUNDS / 2];
        long n = c[ROUNDS / 2];
        if (k == NONE) base = med;
        double lost = n ? (med - base) * 1000.0 / n : 0.0;
        double host = n ? med * 1000.0 / n : 0.0;
        printf("| %s | %s | %s | %d | %.2f | %+.1f%% | %ld | %.1f | %.2f |\n",
               mapped ? "512 handles of 2 MiB" : "cudaMalloc", memory_bound ? "memory-bound" : "compute-bound",
               KIND[k], count, med, (med / base - 1) * 100, n, host, lost);
        fflush(stdout);
      }
    }
  }
  RT(cudaStreamDestroy(s));
  return 0;
}
