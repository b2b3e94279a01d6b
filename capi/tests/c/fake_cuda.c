/* A stand-in CUDA driver (built as libcuda.so) that checks every call the
 * CUDA backend makes, so that the backend's real code, its unmapping helper
 * thread included, runs on a machine without a GPU. Device memory is never
 * there: addresses are numbers, and nothing of gpualloc reads or writes
 * device memory.
 *
 * It keeps the state a driver keeps (address reservations, physical
 * handles, mappings and their access, plain allocations, events, contexts,
 * one CUDA graph capture) and counts as a misuse every call a real driver
 * would refuse or could crash on: mapping over a mapping, outside a
 * reservation or at an offset, unmapping part of a mapping or what is not
 * mapped, setting access on unmapped memory, releasing a handle twice,
 * freeing a reservation that still holds mappings, using an event after it
 * was destroyed (its memory is never reused, so the use is seen rather
 * than undefined), copying to memory that is not accessible, a call a
 * capture forbids (as docs/results/h200-round33/capture-probe.md measured,
 * and the driver's documentation says of the legacy stream), any call
 * before cuInit, in a child forked after it (Note [Freeing in a forked
 * child]) or after the driver's teardown, which cuInit registers as an
 * exit handler (Note [Helpers at exit]). It also counts two threads
 * inside memory-mapping calls for one device at the same time, which
 * gpualloc avoids (Note [One VMM call at a time]). Stream handles 0 and 1
 * are the legacy default stream, 2 the per-thread one.
 *
 * Events complete FAKE_CUDA_EVENT_US microseconds after they are recorded
 * (default 20), so that the backend sees work still running; each
 * memory-mapping call takes FAKE_CUDA_VMM_US (default 10), so that
 * overlaps have a window. FAKE_CUDA_CAPACITY is each device's memory in
 * MiB (default 4096), FAKE_CUDA_DEVICES their number (default 1, at most
 * 8). FAKE_CUDA_ABORT=1 aborts at the first misuse (for a debugger).
 * FAKE_CUDA_NO_VMM=1 makes devices without virtual memory management.
 * FAKE_CUDA_HANG=1, read at each call (a program may set it once it
 * started), makes cuMemCreate take 60 s, as a call stuck behind a hung
 * kernel does.
 *
 * `fake_cuda_summary` gives the counts to a test (found with dlopen's
 * RTLD_NOLOAD, as gpualloc loads this library itself). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUhandle;

enum {
  SUCCESS = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  INVALID_DEVICE = 101,
  INVALID_CONTEXT = 201,
  INVALID_HANDLE = 400,
  NOT_FOUND = 500,
  NOT_READY = 600,
  NOT_SUPPORTED = 801,
  STREAM_CAPTURE_UNSUPPORTED = 900,
  STREAM_CAPTURE_IMPLICIT = 906,
  CAPTURED_EVENT = 907,
};

/* CUstreamCaptureMode */
enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };

#define GRANULARITY (2ull << 20)
#define MAX_DEVICES 8
#define EVENT_MAGIC 0x45564e54u
#define DEAD_MAGIC 0xdeadbeefu
#define CTX_MAGIC 0x43545854u

struct ctx { unsigned magic; int device; };
struct event { unsigned magic; int recorded; int captured; uint64_t done_at; struct ctx *ctx; };
/* The one capture at a time a test may open (`fake_cuda_begin_capture`). */
struct capture { void *stream; unsigned long long id; int mode; pthread_t thread; int active; int invalidated; };
struct range { CUdeviceptr ptr; uint64_t size; int device; };
struct mapping { CUdeviceptr ptr; uint64_t size; CUhandle handle; int access; };
struct handle { uint64_t size; int device; int mapped; int released; int gone; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct ctx ctxs[MAX_DEVICES];
static __thread struct ctx *current;
static __thread unsigned capture_mode; /* this thread's, MODE_GLOBAL at first */
static struct capture cap;
static unsigned long long captures;
static int devices = 1;
static uint64_t capacity = 4096ull << 20, used[MAX_DEVICES];
static uint64_t event_ns = 20000, vmm_ns = 10000;
static int abort_on_misuse;
static CUdeviceptr next_va = 0x100000000000ull;

static struct range *reservations; static size_t n_reservations, cap_reservations;
static struct range *allocs; static size_t n_allocs, cap_allocs;
static struct mapping *maps; static size_t n_maps, cap_maps;
static struct handle *handles; static size_t n_handles, cap_handles;

static atomic_ullong misuses, overlaps, vmm_calls;
static atomic_int in_vmm[MAX_DEVICES], torn_down;

#define PUSH(arr, n, cap, value) do { \
    if (n == cap) { cap = cap ? 2 * cap : 64; arr = realloc(arr, cap * sizeof *arr); if (!arr) abort(); } \
    arr[n++] = value; } while (0)

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* Waits `ns`: spinning below 100 µs, where a sleep would last 50 µs more
 * (the kernel's timer slack). */
static void pause_ns(uint64_t ns) {
  if (!ns) return;
  if (ns < 100000) {
    uint64_t end = now_ns() + ns;
    while (now_ns() < end) {
    }
    return;
  }
  struct timespec t = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
  nanosleep(&t, NULL);
}

/* Counts a misuse and says what it was (the first 20); returns `code`. */
static CUresult misuse(CUresult code, const char *fmt, ...) {
  unsigned long long n = atomic_fetch_add(&misuses, 1);
  if (n < 20) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fake cuda: misuse: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
  }
  if (abort_on_misuse) abort();
  return code;
}

static uint64_t env_u64(const char *name, uint64_t fallback) {
  const char *v = getenv(name);
  return v && *v ? strtoull(v, NULL, 10) : fallback;
}

/* The driver's teardown at exit, registered by cuInit as an exit handler:
 * after it, every call is a misuse (a process that crashes at its end). */
static void teardown(void) {
  atomic_store(&torn_down, 1);
  pause_ns(20 * 1000000ull); /* a teardown takes time: threads still calling are seen */
}

static atomic_int initialized; /* by cuInit, under the lock */
static pid_t init_pid; /* the process that called cuInit */

/* Every entry point's first check: a call before cuInit, after the
 * teardown at exit or in a child forked after cuInit is a misuse. */
static void check_entry(const char *call) {
  if (!atomic_load(&initialized)) misuse(0, "%s before cuInit", call);
  if (atomic_load(&torn_down)) misuse(0, "%s after the driver's teardown at exit", call);
  /* CUDA does not survive fork: a child's call fails, or worse. */
  if (atomic_load(&initialized) && getpid() != init_pid) misuse(0, "%s in a forked child", call);
}

/* The legacy default stream (NULL or CU_STREAM_LEGACY); CU_STREAM_PER_THREAD
 * (2) is the calling thread's default stream of the current context. */
static int legacy(void *stream) { return stream == NULL || stream == (void *)1; }
static int default_stream(void *stream) { return legacy(stream) || stream == (void *)2; }

/* A memory-mapping call: counts it, and an overlap when another thread is
 * inside one for the same device (that of the calling thread's context:
 * gpualloc's lock is per device, as PyTorch's); `vmm_leave` ends it. */
static __thread int vmm_device;

static void vmm_enter(void) {
  check_entry("a memory-mapping call");
  atomic_fetch_add(&vmm_calls, 1);
  vmm_device = current ? current->device : 0;
  if (atomic_fetch_add(&in_vmm[vmm_device], 1) > 0) atomic_fetch_add(&overlaps, 1);
  pause_ns(vmm_ns);
  pthread_mutex_lock(&lock);
}

static CUresult vmm_leave(CUresult r) {
  pthread_mutex_unlock(&lock);
  check_entry("a memory-mapping call still running");
  atomic_fetch_sub(&in_vmm[vmm_device], 1);
  return r;
}

/* The event behind `e`, or NULL after saying why it is none. Called with
 * the lock held (an event's fields are read and written under it). */
static struct event *live_event(void *e, const char *call) {
  struct event *ev = e;
  if (!ev) { misuse(0, "%s: NULL event", call); return NULL; }
  if (ev->magic == DEAD_MAGIC) { misuse(0, "%s: event %p used after cuEventDestroy", call, e); return NULL; }
  if (ev->magic != EVENT_MAGIC) { misuse(0, "%s: %p is no event", call, e); return NULL; }
  return ev;
}

/* Whether the open capture forbids `call` from this thread, as the driver
 * does (docs/results/h200-round33/capture-probe.md): a global capture from
 * any thread, a thread-local one from its own, unless the thread's mode
 * is relaxed. A forbidden call fails and invalidates the capture. */
static int capture_forbids_locked(const char *call) {
  int forbidden = cap.active && capture_mode != MODE_RELAXED && cap.mode != MODE_RELAXED &&
                  (cap.mode == MODE_GLOBAL || pthread_equal(cap.thread, pthread_self()));
  if (forbidden) {
    cap.invalidated = 1;
    misuse(0, "%s during a capture (mode %d) from a thread in mode %u: the capture is invalidated", call, cap.mode,
           capture_mode);
  }
  return forbidden;
}

static int capture_forbids(const char *call) {
  pthread_mutex_lock(&lock);
  int forbidden = capture_forbids_locked(call);
  pthread_mutex_unlock(&lock);
  return forbidden;
}

/* Synchronizing with the capturing stream (itself, or the whole context)
 * is refused in every mode, and invalidates the capture. */
static int syncs_capture(const char *call, void *stream) {
  pthread_mutex_lock(&lock);
  int yes = cap.active && (stream == NULL ? 1 : cap.stream == stream);
  if (yes) cap.invalidated = 1;
  pthread_mutex_unlock(&lock);
  if (yes) misuse(0, "%s during a capture: it would wait for the capturing stream", call);
  return yes;
}

static int covered(CUdeviceptr ptr, uint64_t size, int need_access) {
  /* Whether [ptr, ptr+size) is wholly mapped (with access if asked) or
   * inside one plain allocation. Called with the lock held. */
  for (size_t i = 0; i < n_allocs; i++)
    if (ptr >= allocs[i].ptr && ptr + size <= allocs[i].ptr + allocs[i].size) return 1;
  CUdeviceptr at = ptr;
  while (at < ptr + size) {
    size_t i = 0;
    for (; i < n_maps; i++)
      if (at >= maps[i].ptr && at < maps[i].ptr + maps[i].size) break;
    if (i == n_maps || (need_access && !maps[i].access)) return 0;
    at = maps[i].ptr + maps[i].size;
  }
  return 1;
}

static void drop_handle_if_done(CUhandle h) {
  struct handle *x = &handles[h - 1];
  if (x->released && x->mapped == 0 && !x->gone) {
    x->gone = 1;
    used[x->device] -= x->size;
  }
}

/* ---- initialization, devices, contexts ---- */

CUresult cuInit(unsigned flags) {
  (void)flags;
  pthread_mutex_lock(&lock);
  if (!atomic_load(&initialized)) {
    devices = (int)env_u64("FAKE_CUDA_DEVICES", 1);
    if (devices < 1) devices = 1;
    if (devices > MAX_DEVICES) devices = MAX_DEVICES;
    capacity = env_u64("FAKE_CUDA_CAPACITY", 4096) << 20;
    event_ns = env_u64("FAKE_CUDA_EVENT_US", 20) * 1000;
    vmm_ns = env_u64("FAKE_CUDA_VMM_US", 10) * 1000;
    abort_on_misuse = env_u64("FAKE_CUDA_ABORT", 0) != 0;
    for (int d = 0; d < MAX_DEVICES; d++) ctxs[d] = (struct ctx){CTX_MAGIC, d};
    atexit(teardown);
    init_pid = getpid();
    atomic_store(&initialized, 1);
  }
  pthread_mutex_unlock(&lock);
  return SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
  check_entry("cuDeviceGetCount");
  *count = devices;
  return SUCCESS;
}

CUresult cuDeviceGet(int *device, int ordinal) {
  check_entry("cuDeviceGet");
  if (ordinal < 0 || ordinal >= devices) return INVALID_DEVICE;
  *device = ordinal;
  return SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
  check_entry("cuDeviceGetAttribute");
  (void)attribute;
  if (device < 0 || device >= devices) return INVALID_DEVICE;
  /* every capability asked about: VMM, descriptor export, RDMA; under
   * FAKE_CUDA_NO_VMM=1 the device says no to virtual memory management
   * (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 102) and
   * refuses cuMemCreate, while the granularity query still answers. */
  *value = attribute == 102 && env_u64("FAKE_CUDA_NO_VMM", 0) ? 0 : 1;
  return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int device) {
  check_entry("cuDevicePrimaryCtxRetain");
  if (device < 0 || device >= devices) return INVALID_DEVICE;
  *ctx = &ctxs[device];
  return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(int device) {
  check_entry("cuDevicePrimaryCtxRelease_v2");
  return device >= 0 && device < devices ? SUCCESS : INVALID_DEVICE;
}

CUresult cuCtxGetCurrent(void **ctx) {
  check_entry("cuCtxGetCurrent");
  *ctx = current;
  return SUCCESS;
}

CUresult cuCtxSetCurrent(void *ctx) {
  struct ctx *c = ctx;
  check_entry("cuCtxSetCurrent");
  if (c && c->magic != CTX_MAGIC) return misuse(INVALID_CONTEXT, "cuCtxSetCurrent: %p is no context", ctx);
  current = c;
  return SUCCESS;
}

static CUresult need_context(const char *call) {
  check_entry(call);
  return current ? SUCCESS : misuse(INVALID_CONTEXT, "%s without a current context", call);
}

CUresult cuStreamGetCtx(void *stream, void **ctx) {
  check_entry("cuStreamGetCtx");
  (void)stream;
  *ctx = current ? current : &ctxs[0];
  return SUCCESS;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
  CUresult r = need_context("cuMemGetInfo");
  if (r) return r;
  pthread_mutex_lock(&lock);
  *free_bytes = capacity - used[current->device];
  *total = capacity;
  pthread_mutex_unlock(&lock);
  return SUCCESS;
}

/* ---- plain allocations ---- */

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes) {
  CUresult r = need_context("cuMemAlloc");
  if (r) return r;
  if (capture_forbids("cuMemAlloc")) return STREAM_CAPTURE_UNSUPPORTED;
  if (bytes == 0) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  int d = current->device;
  if (used[d] + bytes > capacity) { pthread_mutex_unlock(&lock); return OUT_OF_MEMORY; }
  used[d] += bytes;
  uint64_t size = (bytes + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
  *ptr = next_va;
  next_va += size + GRANULARITY;
  PUSH(allocs, n_allocs, cap_allocs, ((struct range){*ptr, bytes, d}));
  pthread_mutex_unlock(&lock);
  return SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
  check_entry("cuMemFree");
  if (capture_forbids("cuMemFree")) return STREAM_CAPTURE_UNSUPPORTED;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < n_allocs; i++) {
    if (allocs[i].ptr == ptr) {
      used[allocs[i].device] -= allocs[i].size;
      allocs[i] = allocs[--n_allocs];
      pthread_mutex_unlock(&lock);
      return SUCCESS;
    }
  }
  pthread_mutex_unlock(&lock);
  return misuse(INVALID_VALUE, "cuMemFree(0x%llx): not allocated", ptr);
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
  check_entry("cuMemcpyDtoD_v2");
  pthread_mutex_lock(&lock);
  int ok = covered(dst, bytes, 1) && covered(src, bytes, 1);
  pthread_mutex_unlock(&lock);
  return ok ? SUCCESS : misuse(INVALID_VALUE, "cuMemcpyDtoD(0x%llx, 0x%llx, %zu): not accessible", dst, src, bytes);
}

/* ---- events and streams ---- */

CUresult cuEventCreate(void **event, unsigned flags) {
  (void)flags;
  CUresult r = need_context("cuEventCreate");
  if (r) return r;
  struct event *e = calloc(1, sizeof *e);
  if (!e) return OUT_OF_MEMORY;
  e->magic = EVENT_MAGIC;
  e->ctx = current;
  *event = e;
  return SUCCESS;
}

CUresult cuEventDestroy_v2(void *event) {
  check_entry("cuEventDestroy");
  pthread_mutex_lock(&lock);
  struct event *e = live_event(event, "cuEventDestroy");
  if (e) e->magic = DEAD_MAGIC; /* never freed: a later use is seen */
  pthread_mutex_unlock(&lock);
  return e ? SUCCESS : INVALID_HANDLE;
}

CUresult cuEventRecord(void *event, void *stream) {
  check_entry("cuEventRecord");
  pthread_mutex_lock(&lock);
  CUresult r = SUCCESS;
  struct event *e = live_event(event, "cuEventRecord");
  if (!e) {
    r = INVALID_HANDLE;
  } else if (default_stream(stream) && e->ctx != current) {
    /* A default stream is the current context's; the event must be its. */
    r = misuse(INVALID_HANDLE, "cuEventRecord: an event of device %d on a default stream of device %d (-1: none)",
               e->ctx ? e->ctx->device : -1, current ? current->device : -1);
  } else {
    e->recorded = 1;
    e->captured = cap.active && cap.stream == stream; /* a node of the graph, never done as such */
    e->done_at = now_ns() + event_ns;
  }
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuEventQuery(void *event) {
  check_entry("cuEventQuery");
  pthread_mutex_lock(&lock);
  CUresult r;
  struct event *e = live_event(event, "cuEventQuery");
  if (!e) r = INVALID_HANDLE;
  else if (e->captured) r = misuse(CAPTURED_EVENT, "cuEventQuery on an event recorded in a capture");
  else if (capture_forbids_locked("cuEventQuery")) r = STREAM_CAPTURE_UNSUPPORTED;
  else r = now_ns() >= e->done_at ? SUCCESS : NOT_READY;
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuEventSynchronize(void *event) {
  check_entry("cuEventSynchronize");
  pthread_mutex_lock(&lock);
  CUresult r = SUCCESS;
  uint64_t done_at = 0;
  struct event *e = live_event(event, "cuEventSynchronize");
  if (!e) r = INVALID_HANDLE;
  else if (e->captured) r = misuse(CAPTURED_EVENT, "cuEventSynchronize on an event recorded in a capture");
  else if (capture_forbids_locked("cuEventSynchronize")) r = STREAM_CAPTURE_UNSUPPORTED;
  else done_at = e->done_at;
  pthread_mutex_unlock(&lock);
  uint64_t t = now_ns();
  if (r == SUCCESS && t < done_at) pause_ns(done_at - t);
  return r;
}

CUresult cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
  (void)stream; (void)flags;
  check_entry("cuStreamWaitEvent");
  pthread_mutex_lock(&lock);
  struct event *e = live_event(event, "cuStreamWaitEvent");
  pthread_mutex_unlock(&lock);
  return e ? SUCCESS : INVALID_HANDLE;
}

CUresult cuCtxSynchronize(void) {
  CUresult r = need_context("cuCtxSynchronize");
  if (r) return r;
  if (syncs_capture("cuCtxSynchronize", NULL)) return STREAM_CAPTURE_UNSUPPORTED;
  pause_ns(event_ns); /* everything recorded so far is done */
  return SUCCESS;
}

CUresult cuStreamSynchronize(void *stream) {
  check_entry("cuStreamSynchronize");
  /* The legacy stream waits for every blocking stream, the capturing one too. */
  if (syncs_capture("cuStreamSynchronize", legacy(stream) ? NULL : stream)) return STREAM_CAPTURE_UNSUPPORTED;
  if (capture_forbids("cuStreamSynchronize")) return STREAM_CAPTURE_UNSUPPORTED;
  pause_ns(event_ns);
  return SUCCESS;
}

CUresult cuThreadExchangeStreamCaptureMode(unsigned *mode) {
  check_entry("cuThreadExchangeStreamCaptureMode");
  unsigned old = capture_mode;
  capture_mode = *mode;
  *mode = old;
  return SUCCESS;
}

CUresult cuStreamGetCaptureInfo_v3(void *stream, unsigned *status, unsigned long long *id, void *graph,
                                   void *deps, void *edges, size_t *count) {
  (void)graph; (void)deps; (void)edges;
  check_entry("cuStreamGetCaptureInfo");
  pthread_mutex_lock(&lock);
  int active = cap.active && cap.stream == stream;
  /* The legacy stream while a (blocking) stream captures, in any mode, as
   * the driver's documentation says. */
  int implicit = cap.active && !active && legacy(stream);
  unsigned long long capture_id = cap.id;
  pthread_mutex_unlock(&lock);
  if (implicit) return STREAM_CAPTURE_IMPLICIT;
  *status = active ? 1 : 0; /* CU_STREAM_CAPTURE_STATUS_ACTIVE */
  if (id) *id = active ? capture_id : 0;
  if (count) *count = 0;
  return SUCCESS;
}

CUresult cuStreamIsCapturing(void *stream, unsigned *status) {
  return cuStreamGetCaptureInfo_v3(stream, status, NULL, NULL, NULL, NULL, NULL);
}

CUresult cuStreamGetCaptureInfo_v2(void *stream, unsigned *status, unsigned long long *id, void *graph,
                                   void *deps, size_t *count) {
  return cuStreamGetCaptureInfo_v3(stream, status, id, graph, deps, NULL, count);
}

/* ---- virtual memory ---- */

CUresult cuMemGetAllocationGranularity(size_t *granularity, const void *prop, int option) {
  check_entry("cuMemGetAllocationGranularity");
  (void)prop; (void)option;
  *granularity = GRANULARITY;
  return SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
  (void)addr; (void)flags;
  vmm_enter();
  if (size == 0 || size % GRANULARITY) return vmm_leave(misuse(INVALID_VALUE, "cuMemAddressReserve(%zu): not a multiple of the granularity", size));
  uint64_t align = alignment ? alignment : GRANULARITY;
  CUdeviceptr at = (next_va + align - 1) / align * align;
  next_va = at + size + GRANULARITY;
  *ptr = at;
  PUSH(reservations, n_reservations, cap_reservations, ((struct range){at, size, 0}));
  return vmm_leave(SUCCESS);
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  vmm_enter();
  for (size_t i = 0; i < n_reservations; i++) {
    if (reservations[i].ptr == ptr) {
      if (reservations[i].size != size)
        return vmm_leave(misuse(INVALID_VALUE, "cuMemAddressFree(0x%llx, %zu): reserved with %llu", ptr, size,
                                (unsigned long long)reservations[i].size));
      for (size_t m = 0; m < n_maps; m++)
        if (maps[m].ptr < ptr + size && ptr < maps[m].ptr + maps[m].size)
          return vmm_leave(misuse(INVALID_VALUE, "cuMemAddressFree(0x%llx): 0x%llx is still mapped", ptr, maps[m].ptr));
      reservations[i] = reservations[--n_reservations];
      return vmm_leave(SUCCESS);
    }
  }
  return vmm_leave(misuse(INVALID_VALUE, "cuMemAddressFree(0x%llx, %zu): not reserved", ptr, size));
}

CUresult cuMemCreate(CUhandle *handle, size_t size, const void *prop, unsigned long long flags) {
  (void)flags;
  int device = 0;
  memcpy(&device, (const char *)prop + 12, sizeof device); /* location.id */
  if (env_u64("FAKE_CUDA_HANG", 0)) sleep(60);
  vmm_enter();
  if (env_u64("FAKE_CUDA_NO_VMM", 0)) return vmm_leave(NOT_SUPPORTED);
  if (device < 0 || device >= devices) return vmm_leave(misuse(INVALID_DEVICE, "cuMemCreate: device %d", device));
  if (size == 0 || size % GRANULARITY) return vmm_leave(misuse(INVALID_VALUE, "cuMemCreate(%zu): not a multiple of the granularity", size));
  if (used[device] + size > capacity) return vmm_leave(OUT_OF_MEMORY);
  used[device] += size;
  PUSH(handles, n_handles, cap_handles, ((struct handle){size, device, 0, 0, 0}));
  *handle = n_handles; /* ids from 1 */
  return vmm_leave(SUCCESS);
}

CUresult cuMemRelease(CUhandle handle) {
  vmm_enter();
  if (handle == 0 || handle > n_handles) return vmm_leave(misuse(INVALID_HANDLE, "cuMemRelease(%llu): no such handle", handle));
  struct handle *h = &handles[handle - 1];
  if (h->released) return vmm_leave(misuse(INVALID_HANDLE, "cuMemRelease(%llu): released twice", handle));
  h->released = 1;
  drop_handle_if_done(handle);
  return vmm_leave(SUCCESS);
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUhandle handle, unsigned long long flags) {
  (void)flags;
  vmm_enter();
  if (handle == 0 || handle > n_handles || handles[handle - 1].released)
    return vmm_leave(misuse(INVALID_HANDLE, "cuMemMap(0x%llx): handle %llu is not live", ptr, handle));
  struct handle *h = &handles[handle - 1];
  if (offset != 0) return vmm_leave(misuse(INVALID_VALUE, "cuMemMap(0x%llx): offset %zu, which must be 0", ptr, offset));
  if (ptr % GRANULARITY || size % GRANULARITY || size == 0 || size > h->size)
    return vmm_leave(misuse(INVALID_VALUE, "cuMemMap(0x%llx, %zu, offset %zu): bad range for a handle of %llu", ptr, size,
                            offset, (unsigned long long)h->size));
  int inside = 0;
  for (size_t i = 0; i < n_reservations && !inside; i++)
    inside = ptr >= reservations[i].ptr && ptr + size <= reservations[i].ptr + reservations[i].size;
  if (!inside) return vmm_leave(misuse(INVALID_VALUE, "cuMemMap(0x%llx, %zu): not inside one reservation", ptr, size));
  for (size_t m = 0; m < n_maps; m++)
    if (maps[m].ptr < ptr + size && ptr < maps[m].ptr + maps[m].size)
      return vmm_leave(misuse(INVALID_VALUE, "cuMemMap(0x%llx, %zu): over the mapping at 0x%llx", ptr, size, maps[m].ptr));
  h->mapped++;
  PUSH(maps, n_maps, cap_maps, ((struct mapping){ptr, size, handle, 0}));
  return vmm_leave(SUCCESS);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
  vmm_enter();
  if (!desc || count == 0) return vmm_leave(misuse(INVALID_VALUE, "cuMemSetAccess: no descriptors"));
  if (!covered(ptr, size, 0)) return vmm_leave(misuse(INVALID_VALUE, "cuMemSetAccess(0x%llx, %zu): not all mapped", ptr, size));
  for (size_t m = 0; m < n_maps; m++)
    if (maps[m].ptr < ptr + size && ptr < maps[m].ptr + maps[m].size) maps[m].access = 1;
  return vmm_leave(SUCCESS);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  vmm_enter();
  if (!covered(ptr, size, 0)) return vmm_leave(misuse(INVALID_VALUE, "cuMemUnmap(0x%llx, %zu): not all mapped", ptr, size));
  for (size_t m = 0; m < n_maps; m++)
    if (maps[m].ptr < ptr + size && ptr < maps[m].ptr + maps[m].size &&
        (maps[m].ptr < ptr || maps[m].ptr + maps[m].size > ptr + size))
      return vmm_leave(misuse(INVALID_VALUE, "cuMemUnmap(0x%llx, %zu): splits the mapping at 0x%llx of %llu", ptr, size,
                              maps[m].ptr, (unsigned long long)maps[m].size));
  for (size_t m = 0; m < n_maps;) {
    if (maps[m].ptr >= ptr && maps[m].ptr + maps[m].size <= ptr + size) {
      CUhandle h = maps[m].handle;
      handles[h - 1].mapped--;
      drop_handle_if_done(h);
      maps[m] = maps[--n_maps];
    } else {
      m++;
    }
  }
  return vmm_leave(SUCCESS);
}

CUresult cuMemExportToShareableHandle(void *shareable, CUhandle handle, int kind, unsigned long long flags) {
  check_entry("cuMemExportToShareableHandle");
  (void)kind; (void)flags;
  pthread_mutex_lock(&lock);
  int live = handle != 0 && handle <= n_handles && !handles[handle - 1].released;
  pthread_mutex_unlock(&lock);
  if (!live) return misuse(INVALID_HANDLE, "cuMemExportToShareableHandle(%llu): not live", handle);
  int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return NOT_SUPPORTED;
  memcpy(shareable, &fd, sizeof fd);
  return SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUhandle *handle, void *os_handle, int kind) {
  check_entry("cuMemImportFromShareableHandle");
  (void)handle; (void)os_handle; (void)kind;
  return NOT_SUPPORTED;
}

/* ---- for tests ---- */

/* Opens a capture on `stream` in `mode` (CUstreamCaptureMode) from the
 * calling thread, as cuStreamBeginCapture would; returns its id. */
unsigned long long fake_cuda_begin_capture(void *stream, int mode) {
  pthread_mutex_lock(&lock);
  if (cap.active) misuse(0, "fake_cuda_begin_capture: a capture is open already");
  cap = (struct capture){stream, ++captures, mode, pthread_self(), 1, 0};
  unsigned long long id = cap.id;
  pthread_mutex_unlock(&lock);
  return id;
}

/* Ends the capture; 0 when it is valid, 1 when a call invalidated it. */
int fake_cuda_end_capture(void) {
  pthread_mutex_lock(&lock);
  int invalidated = cap.invalidated;
  cap.active = 0;
  pthread_mutex_unlock(&lock);
  return invalidated;
}

/* out[0] misuses, [1] overlapping memory-mapping calls, [2] memory-mapping
 * calls, [3] handles not yet given back, [4] mapped bytes, [5] reservations,
 * [6] plain allocations, [7] bytes in use on all devices. Returns 8. */
int fake_cuda_summary(unsigned long long out[8]) {
  pthread_mutex_lock(&lock);
  unsigned long long alive = 0, mapped = 0;
  for (size_t i = 0; i < n_handles; i++) alive += !handles[i].gone;
  for (size_t i = 0; i < n_maps; i++) mapped += maps[i].size;
  out[0] = atomic_load(&misuses);
  out[1] = atomic_load(&overlaps);
  out[2] = atomic_load(&vmm_calls);
  out[3] = alive;
  out[4] = mapped;
  out[5] = n_reservations;
  out[6] = n_allocs;
  out[7] = 0;
  for (int d = 0; d < MAX_DEVICES; d++) out[7] += used[d];
  pthread_mutex_unlock(&lock);
  return 8;
}
