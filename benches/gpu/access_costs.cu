/*
 * access_costs.cu - what remapping pooled physical handles costs, by the
 * handles' properties and by where they are mapped.
 *
 * A defragmenting allocator maps handles it already holds at new addresses:
 * cuMemMap, then cuMemSetAccess over the new range, and cuMemUnmap when
 * they move again. docs/driver-costs.md found cuMemSetAccess and cuMemUnmap
 * to cost per handle (about 37 and 27 us per 2 MiB handle on an H200),
 * measured on handles created without an export type. gpualloc creates
 * its handles exportable as POSIX file descriptors (so that a tensor can
 * be sent to another process, as PyTorch's expandable segments do). This
 * benchmark asks what moves that cost per handle:
 *
 *   export     handles created with no export type, or exportable as
 *              POSIX file descriptors;
 *   address    mapped at a new address each time (a rotating slot of a
 *              large reservation), or at the same address every time;
 *   size       128 MiB made of 64 handles of 2 MiB or 8 of 16 MiB;
 *   others     with nothing else mapped, or with 8 GiB of other 2 MiB
 *              handles mapped and accessible in the process (a training
 *              run's footprint).
 *
 * For each case it times, over 40 cycles after 5 warm-ups, the cuMemMap
 * calls of the handles (one per handle), one cuMemSetAccess over the range
 * and one cuMemUnmap of the range, and prints the median microseconds per
 * handle of each, as a Markdown table.
 *
 * Build and run: bash benches/gpu/cu_bench.sh access_costs
 *
 * Uses device 0's primary context; plain device memory only; everything
 * created is released. Every CUDA call is checked (check.h).
 */
#include "check.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

static const size_t MiB = 1ull << 20;
static const size_t RANGE = 128 * MiB;
static const int SLOTS = 64;

static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// device0_prop(), exportable as a POSIX file descriptor or not.
static CUmemAllocationProp prop_of(bool exportable) {
  CUmemAllocationProp prop = device0_prop();
  if (exportable) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// 8 GiB of 2 MiB handles, mapped and accessible: what else a process holds.
struct Others {
  CUdeviceptr base = 0;
  size_t size = 0;
  std::vector<CUmemGenericAllocationHandle> handles;

  void map(size_t bytes) {
    size = bytes;
    CUmemAllocationProp prop = prop_of(true);
    DRV(cuMemAddressReserve(&base, size, 0, 0, 0));
    for (size_t off = 0; off < size; off += 2 * MiB) {
      CUmemGenericAllocationHandle h;
      DRV(cuMemCreate(&h, 2 * MiB, &prop, 0));
      DRV(cuMemMap(base + off, 2 * MiB, 0, h, 0));
      handles.push_back(h);
    }
    CUmemAccessDesc acc = device0_access();
    DRV(cuMemSetAccess(base, size, &acc, 1));
  }

  void release() {
    if (!size) return;
    DRV(cuMemUnmap(base, size));
    for (auto h : handles) DRV(cuMemRelease(h));
    DRV(cuMemAddressFree(base, size));
    handles.clear();
    size = 0;
  }
};

struct Row {
  double map, access, unmap;
};

static Row run_case(bool exportable, bool same_address, size_t handle) {
  CUmemAllocationProp prop = prop_of(exportable);
  CUmemAccessDesc acc = device0_access();
  size_t n = RANGE / handle;
  std::vector<CUmemGenericAllocationHandle> hs(n);
  for (auto& h : hs) DRV(cuMemCreate(&h, handle, &prop, 0));
  CUdeviceptr base = 0;
  DRV(cuMemAddressReserve(&base, RANGE * SLOTS, handle, 0, 0));
  std::vector<double> tm, ta, tu;
  for (int cycle = 0; cycle < 45; ++cycle) {
    CUdeviceptr at = base + (same_address ? 0 : (size_t)(cycle % SLOTS) * RANGE);
    double t0 = now_us();
    for (size_t i = 0; i < n; ++i) DRV(cuMemMap(at + i * handle, handle, 0, hs[i], 0));
    double t1 = now_us();
    DRV(cuMemSetAccess(at, RANGE, &acc, 1));
    double t2 = now_us();
    DRV(cuMemUnmap(at, RANGE));
    double t3 = now_us();
    if (cycle >= 5) {
      tm.push_back((t1 - t0) / n);
      ta.push_back((t2 - t1) / n);
      tu.push_back((t3 - t2) / n);
    }
  }
  DRV(cuMemAddressFree(base, RANGE * SLOTS));
  for (auto h : hs) DRV(cuMemRelease(h));
  return {median(tm), median(ta), median(tu)};
}

int main() {
  cudaDeviceProp p = device0();
  printf("# Remapping pooled handles, us per handle (%s)\n\n", p.name);
  printf("| others mapped | handle | export | address | cuMemMap | cuMemSetAccess | cuMemUnmap | all three |\n");
  printf("|---|---|---|---|---:|---:|---:|---:|\n");
  Others others;
  for (size_t other_bytes : {(size_t)0, 8192 * MiB}) {
    if (other_bytes) others.map(other_bytes);
    for (size_t handle : {2 * MiB, 16 * MiB})
      for (bool exportable : {false, true})
        for (bool same : {false, true}) {
          Row r = run_case(exportable, same, handle);
          printf("| %s | %zu MiB | %s | %s | %.2f | %.2f | %.2f | %.2f |\n", other_bytes ? "8 GiB" : "none",
                 handle / MiB, exportable ? "POSIX fd" : "none", same ? "same" : "new", r.map, r.access, r.unmap,
                 r.map + r.access + r.unmap);
          fflush(stdout);
        }
    others.release();
  }
  return 0;
}
