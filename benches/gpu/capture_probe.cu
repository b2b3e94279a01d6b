/*
 * capture_probe.cu - which virtual-memory and event calls may run while a
 * CUDA graph is being captured, and does the capture survive them?
 * (docs/policy-experiments.md, twenty-fourth study)
 *
 *     bash benches/gpu/cu_bench.sh capture_probe   # writes ${OUT:-./capture_probe}/capture_probe.md
 *
 * For every call, in a fresh capture of a stream in each capture mode: the
 * call's result, the capture's end, instantiation and launch, and whether
 * the captured work wrote what it should. The call is made on the capturing
 * thread or on another thread, each with the thread's own mode left as it
 * is or exchanged to relaxed (as gpualloc's CUDA backend does for its calls
 * while a capture is open). The memory the call touches is never used by
 * the captured work, and the work last queued on it completed before the
 * capture began (the case of a default pool's free pages).
 */
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "check.h"

static const char* name_of(CUresult r) {
  const char* s = nullptr;
  if (cuGetErrorName(r, &s) != CUDA_SUCCESS || s == nullptr) return "?";
  return s;
}

struct Vmm {
  size_t gran = 0;
  CUmemAllocationProp prop = device0_prop();
  CUmemAccessDesc access = device0_access();

  Vmm() { DRV(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)); }
  CUdeviceptr reserve(size_t n) {
    CUdeviceptr p = 0;
    DRV(cuMemAddressReserve(&p, n, 0, 0, 0));
    return p;
  }
  CUmemGenericAllocationHandle create() {
    CUmemGenericAllocationHandle h = 0;
    DRV(cuMemCreate(&h, gran, &prop, 0));
    return h;
  }
  void map(CUdeviceptr p, CUmemGenericAllocationHandle h) {
    DRV(cuMemMap(p, gran, 0, h, 0));
    DRV(cuMemSetAccess(p, gran, &access, 1));
  }
};

// What the probed call may use; everything is set up before the capture.
struct Scene {
  Vmm* vmm;
  CUdeviceptr old_place;                 // mapped, idle: a free page of a default pool
  CUmemGenericAllocationHandle old_handle;
  CUdeviceptr new_place;                 // reserved, unmapped: where a private pool grows
  CUevent done_before;                   // recorded and completed before the capture
};

struct Probe {
  const char* name;
  std::function<CUresult(Scene&)> call;
  bool unmaps_old;   // the old place is unmapped afterwards (if the call succeeded)
  bool maps_new;     // the new place is mapped afterwards
};

static CUresult with_mode(bool relaxed, const std::function<CUresult()>& f) {
  if (!relaxed) return f();
  CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
  CUresult e = cuThreadExchangeStreamCaptureMode(&m);
  if (e != CUDA_SUCCESS) return e;
  CUresult r = f();
  cuThreadExchangeStreamCaptureMode(&m);
  return r;
}

int main() {
  device0();
  CUcontext ctx;
  DRV(cuCtxGetCurrent(&ctx));
  Vmm vmm;
  CUstream capture_stream, other_stream;
  DRV(cuStreamCreate(&capture_stream, CU_STREAM_NON_BLOCKING));
  DRV(cuStreamCreate(&other_stream, CU_STREAM_NON_BLOCKING));
  // The graph's own memory, mapped before every capture.
  CUdeviceptr graph_mem = vmm.reserve(vmm.gran);
  vmm.map(graph_mem, vmm.create());

  std::vector<Probe> probes = {
      {"cuEventQuery(event done before)", [](Scene& s) { return cuEventQuery(s.done_before); }, false, false},
      {"cuEventSynchronize(event done before)", [](Scene& s) { return cuEventSynchronize(s.done_before); }, false, false},
      {"cuMemUnmap(idle page)", [](Scene& s) { return cuMemUnmap(s.old_place, s.vmm->gran); }, true, false},
      {"cuMemUnmap+cuMemMap+cuMemSetAccess(handle moved)",
       [](Scene& s) {
         CUresult r = cuMemUnmap(s.old_place, s.vmm->gran);
         if (r != CUDA_SUCCESS) return r;
         r = cuMemMap(s.new_place, s.vmm->gran, 0, s.old_handle, 0);
         if (r != CUDA_SUCCESS) return r;
         return cuMemSetAccess(s.new_place, s.vmm->gran, &s.vmm->access, 1);
       },
       true, true},
      {"cuMemCreate+cuMemMap+cuMemSetAccess(new handle)",
       [](Scene& s) {
         CUmemGenericAllocationHandle h = 0;
         CUresult r = cuMemCreate(&h, s.vmm->gran, &s.vmm->prop, 0);
         if (r != CUDA_SUCCESS) return r;
         r = cuMemMap(s.new_place, s.vmm->gran, 0, h, 0);
         cuMemRelease(h);  // the mapping keeps the memory
         if (r != CUDA_SUCCESS) return r;
         return cuMemSetAccess(s.new_place, s.vmm->gran, &s.vmm->access, 1);
       },
       false, true},
      {"cuMemUnmap+cuMemRelease(idle page)",
       [](Scene& s) {
         CUresult r = cuMemUnmap(s.old_place, s.vmm->gran);
         if (r != CUDA_SUCCESS) return r;
         return cuMemRelease(s.old_handle);
       },
       true, false},
  };
  const CUstreamCaptureMode modes[] = {CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                                       CU_STREAM_CAPTURE_MODE_RELAXED};
  const char* mode_names[] = {"global", "thread_local", "relaxed"};

  std::printf("| call | capture mode | thread | thread's mode | call result | end capture | instantiate | launch | graph's writes |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  int failures_of_the_capture = 0;
  for (const Probe& probe : probes) {
    for (int mi = 0; mi < 3; ++mi) {
      for (int other_thread = 0; other_thread < 2; ++other_thread) {
        for (int relaxed = 0; relaxed < 2; ++relaxed) {
          Scene s{&vmm, vmm.reserve(vmm.gran), vmm.create(), vmm.reserve(vmm.gran), nullptr};
          bool released = false;
          vmm.map(s.old_place, s.old_handle);
          DRV(cuMemsetD32Async(s.old_place, 1, vmm.gran / 4, other_stream));
          DRV(cuEventCreate(&s.done_before, CU_EVENT_DISABLE_TIMING));
          DRV(cuEventRecord(s.done_before, other_stream));
          DRV(cuStreamSynchronize(other_stream));
          DRV(cuMemsetD32Async(graph_mem, 0, vmm.gran / 4, capture_stream));
          DRV(cuStreamSynchronize(capture_stream));

          DRV(cuStreamBeginCapture(capture_stream, modes[mi]));
          CUresult before = cuMemsetD32Async(graph_mem, 7, 1024, capture_stream);
          CUresult result = CUDA_SUCCESS;
          auto call = [&] { result = with_mode(relaxed, [&] { return probe.call(s); }); };
          if (other_thread) {
            CUcontext c = ctx;
            std::thread t([&] {
              cuCtxSetCurrent(c);
              call();
            });
            t.join();
          } else {
            call();
          }
          CUresult after = cuMemsetD32Async(graph_mem + 4096, 9, 1024, capture_stream);
          CUgraph graph = nullptr;
          CUresult end = cuStreamEndCapture(capture_stream, &graph);
          CUresult inst = CUDA_ERROR_NOT_READY, launch = CUDA_ERROR_NOT_READY;
          bool writes_ok = false;
          if (end == CUDA_SUCCESS && graph != nullptr) {
            CUgraphExec exec = nullptr;
            inst = cuGraphInstantiateWithFlags(&exec, graph, 0);
            if (inst == CUDA_SUCCESS) {
              launch = cuGraphLaunch(exec, capture_stream);
              CUresult sync = cuStreamSynchronize(capture_stream);
              if (launch == CUDA_SUCCESS) launch = sync;
              unsigned a = 0, b = 0;
              if (cuMemcpyDtoH(&a, graph_mem, 4) == CUDA_SUCCESS &&
                  cuMemcpyDtoH(&b, graph_mem + 4096, 4) == CUDA_SUCCESS)
                writes_ok = a == 7 && b == 9 && before == CUDA_SUCCESS && after == CUDA_SUCCESS;
              cuGraphExecDestroy(exec);
            }
            cuGraphDestroy(graph);
          }
          bool capture_ok = end == CUDA_SUCCESS && inst == CUDA_SUCCESS && launch == CUDA_SUCCESS && writes_ok;
          if (result == CUDA_SUCCESS && !capture_ok) ++failures_of_the_capture;
          std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", probe.name, mode_names[mi],
                      other_thread ? "another" : "capturing", relaxed ? "relaxed" : "as is", name_of(result),
                      name_of(end), name_of(inst), name_of(launch), writes_ok ? "yes" : "no");
          std::fflush(stdout);
          // Clean up whatever state the call left.
          DRV(cuCtxSynchronize());
          bool old_unmapped = probe.unmaps_old && result == CUDA_SUCCESS;
          if (!old_unmapped) cuMemUnmap(s.old_place, vmm.gran);
          if (probe.maps_new && result == CUDA_SUCCESS) cuMemUnmap(s.new_place, vmm.gran);
          released = std::strstr(probe.name, "cuMemRelease") != nullptr && result == CUDA_SUCCESS;
          if (!released) cuMemRelease(s.old_handle);
          cuMemAddressFree(s.old_place, vmm.gran);
          cuMemAddressFree(s.new_place, vmm.gran);
          cuEventDestroy(s.done_before);
        }
      }
    }
  }
  std::printf("\nsucceeded calls whose capture then failed: %d\n", failures_of_the_capture);
  return 0;
}
