/*
 * check.h - what the CUDA benchmarks in this folder share: every driver
 * (DRV) and runtime (RT) call is checked, on error the call and its error
 * are printed and the program exits with status 1; device0() starts
 * device 0's primary context for both APIs; device0_prop() and
 * device0_access() describe pinned memory on device 0, read-write there.
 */
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define DRV(call)                                                              \
  do {                                                                         \
    CUresult r_ = (call);                                                      \
    if (r_ != CUDA_SUCCESS) {                                                  \
      const char* n_ = nullptr;                                                \
      cuGetErrorName(r_, &n_);                                                 \
      fprintf(stderr, "%s failed: %s (%d)\n", #call, n_ ? n_ : "?", (int)r_);  \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)
#define RT(call)                                                               \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_));       \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

// Device 0's primary context, current for the runtime and the driver; its
// properties.
inline cudaDeviceProp device0() {
  RT(cudaSetDevice(0));
  RT(cudaFree(0));
  DRV(cuInit(0));
  cudaDeviceProp p;
  RT(cudaGetDeviceProperties(&p, 0));
  return p;
}

// Pinned physical memory on device 0 (`cuMemCreate`).
inline CUmemAllocationProp device0_prop() {
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  return p;
}

// Read-write access from device 0 (`cuMemSetAccess`).
inline CUmemAccessDesc device0_access() {
  CUmemAccessDesc a = {};
  a.location = device0_prop().location;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return a;
}
