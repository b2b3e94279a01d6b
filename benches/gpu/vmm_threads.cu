/*
 * vmm_threads.cu - whether CUDA's virtual memory calls run in parallel
 * when several host threads make them, and whether they slow down the
 * thread that launches kernels.
 *
 * An expandable segment that grows maps one handle per 2-16 MiB and makes
 * each accessible; `cuMemSetAccess` costs about 27 µs per handle whatever
 * its size (docs/driver-costs.md), so the first step of a training run
 * spends tens of milliseconds in it. If the driver lets threads make these
 * calls at once, an allocator can split a large mapping between helper
 * threads; if not, it cannot.
 *
 * Part 1, split mapping: N = 512 handles of 2 MiB (1 GiB) into one
 * reservation, split in T = 1, 2, 4, 8 contiguous parts, one host thread
 * each. Phases, each started together after a barrier and timed on the
 * wall clock until the last thread is done (median of 7 rounds, ms):
 * create (cuMemCreate), map (cuMemMap + cuMemSetAccess per handle),
 * unmap (cuMemUnmap per handle), release (cuMemRelease). Run with the GPU
 * idle, and with a kernel spinning on another stream (busy).
 *
 * Part 2, launches beside mapping: the main thread launches 20,000 empty
 * kernels on a stream without waiting (then syncs), alone, and while a
 * second thread maps and unmaps 2 MiB handles in a loop (create, map, set
 * access, unmap, release). Mean µs per launch, and the handles the helper
 * moved from 5 ms before the launches until they had all run.
 *
 * Build and run (`bash benches/gpu/cu_bench.sh vmm_threads` does both):
 *     nvcc -O2 -std=c++17 -o vmm_threads vmm_threads.cu -lcuda
 *     ./vmm_threads > out.md
 *
 * Uses device 0's primary context and about 1 GiB of device memory in
 * physical handles; everything created is released. Every CUDA call is checked: on error the
 * call and its error are printed and the program exits with status 1.
 */
#include "check.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <thread>
#include <vector>

static const size_t H = 2ull << 20;  // handle size
static const size_t N = 512;         // handles per round
static const int ROUNDS = 7;

using Clock = std::chrono::steady_clock;

// std::barrier is C++20; this folder builds as C++17.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> g(m_);
    long gen = gen_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(g, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, waiting_ = 0;
  long gen_ = 0;
};

__global__ void spin(volatile int* stop) {
  while (*stop == 0) {
  }
}
__global__ void empty_kernel() {}

static double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// One round of the four phases with `threads` threads; the wall ms of each.
static void round(CUcontext ctx, CUdeviceptr base, int threads, double out[4]) {
  std::vector<CUmemGenericAllocationHandle> h(N);
  Barrier sync(threads + 1);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      DRV(cuCtxSetCurrent(ctx));
      size_t lo = N * t / threads, hi = N * (t + 1) / threads;
      CUmemAllocationProp p = device0_prop();
      CUmemAccessDesc a = device0_access();
      for (int phase = 0; phase < 4; ++phase) {
        sync.arrive_and_wait();
        for (size_t i = lo; i < hi; ++i) {
          CUdeviceptr at = base + i * H;
          switch (phase) {
            case 0: DRV(cuMemCreate(&h[i], H, &p, 0)); break;
            case 1:
              DRV(cuMemMap(at, H, 0, h[i], 0));
              DRV(cuMemSetAccess(at, H, &a, 1));
              break;
            case 2: DRV(cuMemUnmap(at, H)); break;
            case 3: DRV(cuMemRelease(h[i])); break;
          }
        }
        sync.arrive_and_wait();
      }
    });
  }
  for (int phase = 0; phase < 4; ++phase) {
    sync.arrive_and_wait();
    auto t0 = Clock::now();
    sync.arrive_and_wait();
    out[phase] = ms_since(t0);
  }
  for (auto& th : pool) th.join();
}

// Part 2: mean µs per launch of `launches` empty kernels, with or without a
// helper thread moving handles meanwhile; `moved` gets the helper's count.
static double launches_us(CUcontext ctx, CUdeviceptr base, cudaStream_t s, bool helper, long* moved) {
  const int launches = 20000;
  std::atomic<bool> stop{false};
  std::atomic<long> n{0};
  std::thread th;
  if (helper) {
    th = std::thread([&] {
      DRV(cuCtxSetCurrent(ctx));
      CUmemAllocationProp p = device0_prop();
      CUmemAccessDesc a = device0_access();
      size_t i = 0;
      while (!stop.load()) {
        CUdeviceptr at = base + (i++ % N) * H;
        CUmemGenericAllocationHandle hd;
        DRV(cuMemCreate(&hd, H, &p, 0));
        DRV(cuMemMap(at, H, 0, hd, 0));
        DRV(cuMemSetAccess(at, H, &a, 1));
        DRV(cuMemUnmap(at, H));
        DRV(cuMemRelease(hd));
        n.fetch_add(1);
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto t0 = Clock::now();
  for (int i = 0; i < launches; ++i) empty_kernel<<<1, 32, 0, s>>>();
  double us = ms_since(t0) * 1000.0 / launches;
  RT(cudaStreamSynchronize(s));
  stop.store(true);
  if (th.joinable()) th.join();
  *moved = n.load();
  return us;
}

int main() {
  cudaDeviceProp dp = device0();
  CUcontext ctx;
  DRV(cuCtxGetCurrent(&ctx));
  CUdeviceptr base;
  DRV(cuMemAddressReserve(&base, N * H, H, 0, 0));
  int* stop;
  RT(cudaMalloc(&stop, sizeof(int)));
  cudaStream_t busy, s;
  RT(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  RT(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  printf("# VMM calls from several host threads (%s; %zu handles of 2 MiB, median of %d rounds, wall ms)\n\n",
         dp.name, N, ROUNDS);
  printf("| GPU | threads | create | map + set access | unmap | release | total | speed-up |\n"
         "|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (bool is_busy : {false, true}) {
    if (is_busy) {
      // On the kernel's own stream: the legacy stream's memset would not
      // order before a kernel on a non-blocking stream.
      RT(cudaMemsetAsync(stop, 0, sizeof(int), busy));
      spin<<<1, 1, 0, busy>>>(stop);
      RT(cudaGetLastError());
    }
    double one = 0;
    for (int threads : {1, 2, 4, 8}) {
      std::vector<double> ph[4];
      for (int r = 0; r < ROUNDS; ++r) {
        double out[4];
        round(ctx, base, threads, out);
        for (int k = 0; k < 4; ++k) ph[k].push_back(out[k]);
      }
      double med[4], total = 0;
      for (int k = 0; k < 4; ++k) {
        std::sort(ph[k].begin(), ph[k].end());
        med[k] = ph[k][ROUNDS / 2];
        total += med[k];
      }
      if (threads == 1) one = total;
      printf("| %s | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2fx |\n", is_busy ? "busy" : "idle", threads, med[0],
             med[1], med[2], med[3], total, one / total);
      fflush(stdout);
    }
    if (is_busy) {
      // The busy rows count only if the kernel was still spinning.
      if (cudaStreamQuery(busy) != cudaErrorNotReady) {
        fprintf(stderr, "vmm_threads: the spinning kernel ended early; the busy rows are not busy\n");
        return 1;
      }
      int one_ = 1;
      RT(cudaMemcpy(stop, &one_, sizeof(int), cudaMemcpyHostToDevice));
      RT(cudaStreamSynchronize(busy));
    }
  }

  printf("\n# Kernel launches beside a thread that maps handles (mean µs per launch of 20,000, no waits)\n\n");
  printf("| helper | µs per launch | handles moved meanwhile |\n|---|---:|---:|\n");
  for (int rep = 0; rep < 2; ++rep) {
    for (bool helper : {false, true}) {
      long moved = 0;
      double us = launches_us(ctx, base, s, helper, &moved);
      printf("| %s | %.3f | %ld |\n", helper ? "mapping" : "none", us, moved);
      fflush(stdout);
    }
  }
  RT(cudaStreamDestroy(s));
  RT(cudaStreamDestroy(busy));
  RT(cudaFree(stop));
  DRV(cuMemAddressFree(base, N * H));
  return 0;
}
