/* gpualloc's CUDA backend on the stand-in driver of fake_cuda.c: the
 * allocation loop of the GPU suite's churn_wide check (64 live blocks of
 * sizes drawn log-uniformly from 512 B to 64 MiB), then threads allocating
 * and freeing on their own streams (and devices, under FAKE_CUDA_DEVICES)
 * with blocks used on others
 * (record_stream), then CUDA graph captures with another thread
 * allocating meanwhile, announced and not, in each capture mode, a forked
 * child freeing what it inherited, then empty_cache. The driver must see no misuse (a call a capture forbids
 * included) and no two memory-mapping calls at once, the invariants must
 * hold, and after empty_cache, with nothing allocated, no physical memory
 * may be held.
 * Prints "ALL OK" at the end.
 * Usage: fake_cuda_test OPS THREADS MODE, MODE `vmm` (expandable segments,
 * the default configuration: memory-mapping calls, an unmapping helper),
 * `plain` (cuMemAlloc and cuMemFree only, as under policy:pytorch) or
 * `promise` (with expandable_handle_mb:2 and FAKE_CUDA_CAPACITY: the churn
 * loop alone, requests refused only beyond the promise's page bound).
 * The stand-in says on stderr when a call comes after its teardown at
 * exit. */
#define _GNU_SOURCE
#include "gpualloc.h"
#include "check.h"
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static long ops = 20000;

/* Ordinary streams: handles 0, 1 and 2 are CUDA's default streams. */
#define STREAM(k) ((cudaStream_t)(uintptr_t)(0x100 + (k)))

typedef void *(*alloc_fn)(size_t, int, cudaStream_t);

static uint64_t next(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1DULL;
}

/* Log-uniform in [512 B, 64 MiB], as checks.py's churn_wide. */
static size_t wide_size(uint64_t *s) {
  double u = (double)(next(s) >> 11) / 9007199254740992.0;
  double lo = log(512.0), hi = log((double)(64u << 20));
  return (size_t)exp(lo + u * (hi - lo));
}

struct slot { void *p; size_t size; cudaStream_t stream; int device; };

/* `n` allocations through `alloc` in a window of `width` live blocks; a
 * failure ends the process at once (exit handlers would run while other
 * threads still allocate). */
static void churn(struct slot *window, int width, long n, uint64_t seed, int device, cudaStream_t stream, int cross,
                  alloc_fn alloc) {
  uint64_t s = seed;
  for (long i = 0; i < n; i++) {
    struct slot *w = &window[i % width];
    if (w->p) gpualloc_free(w->p, w->size, w->device, w->stream);
    w->size = wide_size(&s);
    w->stream = stream;
    w->device = device;
    w->p = alloc(w->size, device, stream);
    if (!w->p) {
      fprintf(stderr, "malloc(%zu) failed: %s\n", w->size, gpualloc_last_error());
      fflush(stderr);
      _exit(3);
    }
    if (cross && next(&s) % 8 == 0) gpualloc_record_stream(w->p, STREAM(1 + next(&s) % 4));
  }
}

static void drain(struct slot *window, int width) {
  for (int i = 0; i < width; i++) {
    if (window[i].p) gpualloc_free(window[i].p, window[i].size, window[i].device, window[i].stream);
    window[i].p = NULL;
  }
}

#define PAGE (2ull << 20)

/* The 2 MiB pages the live blocks of `window` touch, each once. */
static uint64_t live_pages(const struct slot *window, int width) {
  uint64_t lo[64], hi[64], n = 0, pages = 0, last = 0;
  for (int i = 0; i < width; i++) {
    if (!window[i].p) continue;
    uint64_t a = (uint64_t)(uintptr_t)window[i].p;
    lo[n] = a / PAGE;
    hi[n] = (a + window[i].size - 1) / PAGE;
    n++;
  }
  /* Sort by first page, then count the union of the page ranges. */
  for (uint64_t i = 1; i < n; i++)
    for (uint64_t j = i; j > 0 && lo[j - 1] > lo[j]; j--) {
      uint64_t t = lo[j]; lo[j] = lo[j - 1]; lo[j - 1] = t;
      t = hi[j]; hi[j] = hi[j - 1]; hi[j - 1] = t;
    }
  for (uint64_t i = 0; i < n; i++) {
    uint64_t from = (i > 0 && lo[i] <= last) ? last + 1 : lo[i];
    if (hi[i] >= from) pages += hi[i] - from + 1;
    if (i == 0 || hi[i] > last) last = hi[i];
  }
  return pages;
}

/* The churn loop on a device of `capacity` bytes, where some requests
 * cannot be served: each one refused must be out of memory, and must not
 * fit by gpualloc's promise with 2 MiB handles (docs/configuration.md):
 * the pages the live blocks touch plus those the request needs exceed the
 * device. Returns the requests refused. */
static long promise(long n, uint64_t capacity) {
  struct slot window[64] = {{0}};
  uint64_t s = 11;
  long refused = 0;
  for (long i = 0; i < n; i++) {
    struct slot *w = &window[i % 64];
    if (w->p) gpualloc_free(w->p, w->size, 0, w->stream);
    w->p = NULL;
    w->size = wide_size(&s) * 4; /* 2 KiB to 256 MiB: a device of 1 GiB runs short */
    w->stream = 0;
    uint64_t need = (w->size + PAGE - 1) / PAGE;
    uint64_t before = live_pages(window, 64);
    w->p = gpualloc_malloc(w->size, 0, 0);
    if (!w->p) {
      refused++;
      CHECK(gpualloc_last_error_code() == GPUALLOC_ERR_OUT_OF_MEMORY);
      if (before + need <= capacity / PAGE)
        fprintf(stderr, "refused %zu B with %llu live pages of %llu\n", w->size, (unsigned long long)before,
                (unsigned long long)(capacity / PAGE));
      CHECK(before + need > capacity / PAGE);
    }
  }
  drain(window, 64);
  return refused;
}

static unsigned long long (*begin_capture)(void *, int);
static int (*end_capture)(void);

static int accept7(void *ctx, cudaStream_t s) {
  (void)ctx;
  return s == STREAM(7);
}

struct bystander_args { long n; alloc_fn alloc; };

/* Another thread of the process allocating and freeing on stream 1 while
 * stream 7 captures, through the same entry point as the capturing thread
 * (a process has one route into the allocator). */
static void *bystander(void *arg) {
  const struct bystander_args *a = arg;
  struct slot window[16] = {{0}};
  churn(window, 16, a->n, 77, 0, STREAM(1), 0, a->alloc);
  drain(window, 16);
  return NULL;
}

/* A CUDA graph captured on stream 7 in `mode` (CUstreamCaptureMode), the
 * way PyTorch's bridge announces it (`gpualloc_begin_allocate_to_pool`)
 * or, `raw`, unannounced, as the plain CUDAPluggableAllocator leaves it
 * (gpualloc follows the capture through the driver), with another thread
 * allocating meanwhile. The graph's blocks stay allocated until the
 * capture has ended, then are freed and the pool released. */
static void capture(int mode, int raw, long n) {
  if (!raw) CHECK(gpualloc_begin_allocate_to_pool(0, 1, 0, accept7, NULL) == GPUALLOC_OK);
  alloc_fn alloc = raw ? gpualloc_malloc_or_abort : gpualloc_malloc;
  begin_capture(STREAM(7), mode);
  pthread_t other;
  struct bystander_args args = {n, alloc};
  CHECK(pthread_create(&other, NULL, bystander, &args) == 0);
  struct slot window[16] = {{0}};
  uint64_t s = 99;
  for (long i = 0; i < n; i++) {
    struct slot *w = &window[i % 16];
    if (w->p) gpualloc_free(w->p, w->size, 0, w->stream);
    w->size = wide_size(&s);
    w->stream = STREAM(7);
    w->p = alloc(w->size, 0, w->stream);
    CHECK(w->p != NULL);
  }
  pthread_join(other, NULL);
  CHECK(end_capture() == 0);
  if (!raw) CHECK(gpualloc_end_allocate_to_pool(0, 1, 0) == GPUALLOC_OK);
  drain(window, 16);
  if (!raw) CHECK(gpualloc_release_pool(0, 1, 0) == GPUALLOC_OK);
  /* The next allocation on stream 7 is no graph's. */
  void *p = alloc(4096, 0, STREAM(7));
  CHECK(p != NULL);
  gpualloc_free(p, 4096, 0, STREAM(7));
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
}

/* A child forked with blocks live (a DataLoader worker) frees what it
 * inherited, asks for the cache to be emptied and for memory: none of it
 * may reach the driver, which does not survive fork, and the allocation
 * fails with its reason. It ends through its exit handlers. */
static void forked_child_frees(int (*summary)(unsigned long long *)) {
  struct slot window[8] = {{0}};
  churn(window, 8, 8, 3, 0, STREAM(1), 0, gpualloc_malloc);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    drain(window, 8);
    gpualloc_empty_cache();
    /* Refused, with the reason, and no driver call. */
    if (gpualloc_malloc(4096, 0, STREAM(1)) != NULL || gpualloc_last_error_code() != GPUALLOC_ERR_UNAVAILABLE) exit(5);
    /* What else a library in a worker may ask: answered or refused, never
     * by the driver (the stand-in counts any call). */
    uint64_t free_b = 0, total_b = 0;
    if (gpualloc_mem_info(0, &free_b, &total_b) != GPUALLOC_ERR_UNAVAILABLE || !strstr(gpualloc_last_error(), "fork"))
      exit(6);
    (void)gpualloc_device_count();
    size_t largest = 0;
    (void)gpualloc_cache_info(0, &largest);
    (void)gpualloc_add_peer_access(0, 1);
    gpualloc_set_memory_fraction(0.5, 0);
    struct GpuallocHeld held;
    (void)gpualloc_held(0, &held);
    size_t needed = 0;
    (void)gpualloc_snapshot_json(0, NULL, 0, &needed);
    unsigned long long s[8];
    summary(s);
    exit(s[0] == 0 ? 0 : 4);
  }
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  drain(window, 8);
}

static int devices = 1;

/* Thread k churns on device k % devices, on stream k + 1. */
static void *worker(void *arg) {
  uintptr_t k = (uintptr_t)arg;
  struct slot window[16] = {{0}};
  churn(window, 16, ops / 4, 1000 + k, (int)(k % (uintptr_t)devices), STREAM(k + 1), 1, gpualloc_malloc);
  drain(window, 16);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc > 1) ops = atol(argv[1]);
  int threads = argc > 2 ? atoi(argv[2]) : 4;
  const char *mode = argc > 3 ? argv[3] : "vmm";
  int vmm = strcmp(mode, "plain") != 0;

  devices = gpualloc_device_count();
  CHECK(devices >= 1);
  /* Starts the allocator, so that the driver is loaded. */
  void *first = gpualloc_malloc(1, 0, 0);
  CHECK(first != NULL);
  gpualloc_free(first, 1, 0, 0);
  const char *backend = gpualloc_backend_name();
  CHECK(backend && strcmp(backend, "cuda") == 0);
  void *lib = dlopen("libcuda.so", RTLD_NOW | RTLD_NOLOAD);
  CHECK(lib != NULL);
  int (*summary)(unsigned long long *);
  void *sym = dlsym(lib, "fake_cuda_summary");
  CHECK(sym != NULL);
  memcpy(&summary, &sym, sizeof summary); /* ISO C has no cast from data to function pointers */
  sym = dlsym(lib, "fake_cuda_begin_capture");
  CHECK(sym != NULL);
  memcpy(&begin_capture, &sym, sizeof begin_capture);
  sym = dlsym(lib, "fake_cuda_end_capture");
  CHECK(sym != NULL);
  memcpy(&end_capture, &sym, sizeof end_capture);

  if (strcmp(mode, "promise") == 0) {
    const char *c = getenv("FAKE_CUDA_CAPACITY");
    CHECK(c != NULL);
    long refused = promise(ops, strtoull(c, NULL, 10) << 20);
    printf("refused %ld of %ld requests, each beyond the promise\n", refused, ops);
    CHECK(refused > 0 && refused < ops / 2);
    gpualloc_empty_cache();
    unsigned long long s[8];
    CHECK(summary(s) == 8);
    CHECK(s[0] == 0 && s[1] == 0 && s[2] > 0 && s[3] == 0 && s[7] == 0);
    printf("ALL OK\n");
    return 0;
  }

  struct slot window[64] = {{0}};
  churn(window, 64, ops, 5, 0, 0, 0, gpualloc_malloc);
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
  drain(window, 64);
  printf("ok churn_wide\n");

  pthread_t t[16];
  if (threads > 16) threads = 16;
  for (int k = 0; k < threads; k++) CHECK(pthread_create(&t[k], NULL, worker, (void *)(uintptr_t)k) == 0);
  for (int k = 0; k < threads; k++) pthread_join(t[k], NULL);
  for (int d = 0; d < devices; d++) CHECK(gpualloc_check_invariants(d) == GPUALLOC_OK);
  printf("ok threads\n");

  /* CU_STREAM_CAPTURE_MODE_GLOBAL, THREAD_LOCAL and RELAXED. */
  for (int mode = 0; mode < 3; mode++) capture(mode, 0, ops / 10);
  printf("ok captures\n");

  forked_child_frees(summary);
  printf("ok forked child\n");

  gpualloc_empty_cache();
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
  unsigned long long s[8];
  CHECK(summary(s) == 8);
  printf("driver: misuses %llu, overlapping calls %llu, memory-mapping calls %llu, handles held %llu, "
         "mapped bytes %llu, reservations %llu, allocations %llu, bytes in use %llu\n",
         s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]);
  CHECK(s[0] == 0);
  CHECK(s[1] == 0);
  CHECK(vmm ? s[2] > 0 : s[2] == 0);
  CHECK(s[3] == 0 && s[4] == 0 && s[5] == 0 && s[6] == 0 && s[7] == 0);
  printf("ok empty_cache\n");

  /* The unmapping helper thread took part: its calls could have overlapped. */
  GpuallocDriverCall rows[32];
  size_t n = 0;
  CHECK(gpualloc_helper_driver_calls(0, rows, 32, &n) == GPUALLOC_OK);
  unsigned long long helper = 0;
  for (size_t i = 0; i < n; i++) helper += rows[i].calls;
  printf("helper thread: %llu driver calls\n", helper);
  CHECK(vmm ? helper > 0 : helper == 0);

  /* Captures gpualloc follows through the driver keep their memory for the
   * life of the process (nobody says when their graph is destroyed), so
   * they come after the check of what empty_cache leaves. */
  for (int mode = 0; mode < 3; mode++) capture(mode, 1, ops / 10);
  CHECK(summary(s) == 8);
  CHECK(s[0] == 0 && s[1] == 0);
  printf("ok unannounced captures\n");
  printf("ALL OK\n");
  return 0;
}
