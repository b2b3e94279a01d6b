/* Exercises the whole C ABI of libgpualloc.so on the simulated backend.
 *
 * Run by capi/tests/abi/program.rs with GPUALLOC_BACKEND=sim, GPUALLOC_SIM_DEVICES=2,
 * GPUALLOC_SIM_CAPACITY=1GiB and GPUALLOC_ABI_TRACE=<path of a trace file>.
 * Prints "ok <section>" per section and "ALL OK" at the end; the first
 * failed check prints its line and exits with status 1. */
#include "check.h"
#include "gpualloc.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* PyTorch's rules with cross-stream reuse: the segment counts, reserved
 * bytes and cache reuse checked below are those of plain segments. */
#define CONFIG "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:256,garbage_collection_threshold:0.9"

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

/* PyTorch's pluggable-allocator function types (torch/csrc/cuda/CUDAPluggableAllocator.h). */
typedef void *(*torch_alloc_fn)(size_t, int, cudaStream_t);
typedef void (*torch_free_fn)(void *, size_t, int, cudaStream_t);
typedef void (*torch_record_stream_fn)(void *, cudaStream_t);
typedef void (*torch_reset_fn)(void);
typedef void (*torch_memory_fraction_fn)(double, int);

static cudaStream_t stream(uintptr_t s) { return (cudaStream_t)s; }

static int contains(const char *hay, const char *needle) {
  return hay != NULL && strstr(hay, needle) != NULL;
}

static GpuallocStats stats(int device) {
  GpuallocStats s;
  memset(&s, 0, sizeof s);
  s.size = (uint32_t)sizeof s;
  CHECK(gpualloc_get_stats(device, &s) == GPUALLOC_OK);
  CHECK(s.size == sizeof s);
  CHECK(s.version == GPUALLOC_STATS_VERSION);
  return s;
}

static size_t stat_index(const char *key) {
  size_t n = gpualloc_stat_count();
  for (size_t i = 0; i < n; i++) {
    if (strcmp(gpualloc_stat_name(i), key) == 0) return i;
  }
  fprintf(stderr, "FAILED: no stat named %s\n", key);
  exit(1);
}

static void test_init(void) {
  CHECK(gpualloc_is_initialized() == 0);
  CHECK(gpualloc_init("bogus_key:1") == GPUALLOC_ERR_CONFIG);
  CHECK(contains(gpualloc_last_error(), "bogus_key"));
  CHECK(gpualloc_init("max_split_size_mb:5") == GPUALLOC_ERR_CONFIG);
  CHECK(contains(gpualloc_last_error(), "max_split_size_mb"));
  CHECK(gpualloc_is_initialized() == 0);
  CHECK(gpualloc_init(CONFIG) == GPUALLOC_OK);
  CHECK(gpualloc_last_error() == NULL);
  CHECK(gpualloc_is_initialized() == 1);
  CHECK(gpualloc_init(CONFIG) == GPUALLOC_OK);
  CHECK(gpualloc_init("max_split_size_mb:128") == GPUALLOC_ERR_ALREADY_INITIALIZED);
  CHECK(contains(gpualloc_last_error(), "already initialized"));
  CHECK(strcmp(gpualloc_backend_name(), "sim") == 0);
  CHECK(gpualloc_version() != NULL && strlen(gpualloc_version()) > 0);
  CHECK(gpualloc_device_count() == 2);
  uint64_t free_b = 0, total_b = 0;
  CHECK(gpualloc_mem_info(0, &free_b, &total_b) == GPUALLOC_OK);
  CHECK(total_b == GiB && free_b == GiB);
  CHECK(gpualloc_mem_info(0, NULL, &total_b) == GPUALLOC_ERR_INVALID_ARGUMENT);
  SECTION_OK("init");
}

static void test_malloc_free(void) {
  torch_alloc_fn alloc = gpualloc_malloc;
  torch_free_fn release = gpualloc_free;
  CHECK(alloc(0, 0, stream(0)) == NULL);
  void *p = alloc(1000, 0, stream(0));
  CHECK(p != NULL);
  CHECK(((uintptr_t)p % 512) == 0);
  GpuallocStats s = stats(0);
  CHECK(s.allocation.all.current == 1);
  CHECK(s.allocated_bytes.all.current == 1024);
  CHECK(s.allocated_bytes.small_pool.current == 1024);
  CHECK(s.requested_bytes.all.current == 1000);
  CHECK(s.segment.all.current == 1);
  CHECK(s.reserved_bytes.all.current == (int64_t)(2 * MiB));
  CHECK(s.max_split_size == (int64_t)(256 * MiB));
  void *q = alloc(30 * MiB, 0, stream(0));
  CHECK(q != NULL && q != p);
  s = stats(0);
  CHECK(s.allocated_bytes.large_pool.current == (int64_t)(30 * MiB));
  release(q, 30 * MiB, 0, stream(0));
  release(p, 1000, 0, stream(0));
  release(NULL, 0, 0, stream(0));
  s = stats(0);
  CHECK(s.allocation.all.current == 0);
  CHECK(s.allocated_bytes.all.peak == (int64_t)(30 * MiB + 1024));
  CHECK(s.reserved_bytes.all.current > 0); /* cached, not returned */
  /* the cache is reused: same size, same stream, same address */
  void *r = alloc(1000, 0, stream(0));
  CHECK(r == p);
  release(r, 1000, 0, stream(0));
  /* a pointer gpualloc never handed out: an error, never an abort */
  gpualloc_clear_error();
  CHECK(gpualloc_last_error_code() == 0);
  release((void *)(uintptr_t)0x1234500, 512, 0, stream(0));
  CHECK(contains(gpualloc_last_error(), "not allocated by gpualloc"));
  CHECK(gpualloc_last_error_code() == GPUALLOC_ERR_INVALID_POINTER);
  /* double free */
  void *d = alloc(4096, 0, stream(0));
  release(d, 4096, 0, stream(0));
  gpualloc_clear_error();
  release(d, 4096, 0, stream(0));
  CHECK(gpualloc_last_error() != NULL);
  /* an invalid device */
  CHECK(alloc(512, 7, stream(0)) == NULL);
  CHECK(contains(gpualloc_last_error(), "invalid device"));
  /* the second device has its own state */
  void *e = alloc(512, 1, stream(0));
  CHECK(e != NULL);
  CHECK(stats(1).allocation.all.current == 1);
  release(e, 512, 1, stream(0));
  CHECK(stats(1).allocation.all.current == 0);
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
  CHECK(gpualloc_check_invariants(1) == GPUALLOC_OK);
  CHECK(gpualloc_check_invariants(9) == GPUALLOC_ERR_INVALID_DEVICE);
  SECTION_OK("malloc_free");
}

static void test_stats(void) {
  size_t n = gpualloc_stat_count();
  CHECK(n >= 9 * 3 * 4 + 2 * 4 + 8); /* PyTorch's keys plus gpualloc's counters */
  CHECK(gpualloc_stat_name(n) == NULL);
  for (size_t i = 0; i < n; i++) CHECK(gpualloc_stat_name(i) != NULL);
  int64_t *v = calloc(n, sizeof *v);
  CHECK(v != NULL);
  CHECK(gpualloc_stat_values(0, v, n - 1) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(gpualloc_stat_values(0, NULL, n) == GPUALLOC_ERR_INVALID_ARGUMENT);
  void *p = gpualloc_malloc(3 * MiB, 0, stream(0));
  CHECK(p != NULL);
  CHECK(gpualloc_stat_values(0, v, n) == GPUALLOC_OK);
  GpuallocStats s = stats(0);
  CHECK(v[stat_index("allocated_bytes.all.current")] == s.allocated_bytes.all.current);
  CHECK(v[stat_index("allocated_bytes.all.current")] == (int64_t)(3 * MiB));
  CHECK(v[stat_index("reserved_bytes.all.peak")] == s.reserved_bytes.all.peak);
  CHECK(v[stat_index("segment.large_pool.current")] == s.segment.large_pool.current);
  CHECK(v[stat_index("num_device_alloc")] == s.num_device_alloc);
  CHECK(v[stat_index("max_split_size")] == (int64_t)(256 * MiB));
  /* version 2's counters, read with the driver calls filled in */
  CHECK(s.num_driver_memory_calls > 0);
  CHECK(v[stat_index("num_driver_memory_calls")] == s.num_driver_memory_calls);
  CHECK(v[stat_index("num_stitch")] == s.num_stitch);
  CHECK(s.num_oom_rejections == 0);
  /* the same calls by kind */
  {
    size_t rows = 0;
    CHECK(gpualloc_driver_calls(0, NULL, 0, &rows) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
    CHECK(rows >= 14);
    GpuallocDriverCall *d = calloc(rows, sizeof *d);
    CHECK(d != NULL);
    CHECK(gpualloc_driver_calls(0, d, rows - 1, NULL) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
    CHECK(gpualloc_driver_calls(42, d, rows, NULL) == GPUALLOC_ERR_INVALID_DEVICE);
    CHECK(gpualloc_driver_calls(0, d, rows, NULL) == GPUALLOC_OK);
    uint64_t total = 0, memory = 0, created = 0;
    for (size_t i = 0; i < rows; i++) {
      CHECK(d[i].name != NULL && strncmp(d[i].name, "cu", 2) == 0);
      for (size_t j = 0; j < i; j++) CHECK(strcmp(d[i].name, d[j].name) != 0);
      total += d[i].calls;
      if (strcmp(d[i].name, "cuMemCreate") == 0 || strcmp(d[i].name, "cuMemMap") == 0 ||
          strcmp(d[i].name, "cuMemUnmap") == 0 || strcmp(d[i].name, "cuMemRelease") == 0 ||
          strcmp(d[i].name, "cuMemAlloc") == 0 || strcmp(d[i].name, "cuMemFree") == 0)
        memory += d[i].calls;
      if (strcmp(d[i].name, "cuMemCreate") == 0 || strcmp(d[i].name, "cuMemAlloc") == 0) created += d[i].bytes;
    }
    CHECK(created >= 3 * MiB); /* what backs the 3 MiB block */
    CHECK(total == (uint64_t)s.num_driver_calls);
    CHECK(memory == (uint64_t)s.num_driver_memory_calls);
    /* nothing was given to the unmapping thread here: the same rows, all zero */
    size_t helper_rows = 0;
    CHECK(gpualloc_helper_driver_calls(0, NULL, 0, &helper_rows) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
    CHECK(helper_rows == rows);
    CHECK(gpualloc_helper_driver_calls(42, d, rows, NULL) == GPUALLOC_ERR_INVALID_DEVICE);
    CHECK(gpualloc_helper_driver_calls(0, d, rows, NULL) == GPUALLOC_OK);
    for (size_t i = 0; i < rows; i++) CHECK(d[i].name != NULL && d[i].calls == 0 && d[i].nanos == 0);
    free(d);
  }
  /* reserved memory by unit: the parts add up to it, the used units hold
     the live 3 MiB block */
  {
    GpuallocHeld h;
    CHECK(gpualloc_held(0, &h) == GPUALLOC_OK);
    CHECK(h.used_units + h.free_units + h.free_private_units + h.pooled ==
          (uint64_t)s.reserved_bytes.all.current);
    CHECK(h.used_units >= 3 * MiB);
    CHECK(h.used_units_unallocated == h.used_units - (uint64_t)s.allocated_bytes.all.current);
    CHECK(gpualloc_held(42, &h) == GPUALLOC_ERR_INVALID_DEVICE);
    CHECK(gpualloc_held(0, NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  }
  /* an older caller's smaller struct gets only what it knows */
  GpuallocStats old;
  memset(&old, 0x5a, sizeof old);
  old.size = (uint32_t)offsetof(GpuallocStats, requested_bytes);
  CHECK(gpualloc_get_stats(0, &old) == GPUALLOC_OK);
  CHECK(old.size == offsetof(GpuallocStats, requested_bytes));
  CHECK(old.allocated_bytes.all.current == (int64_t)(3 * MiB));
  {
    GpuallocStatArray untouched;
    memset(&untouched, 0x5a, sizeof untouched);
    CHECK(memcmp(&old.requested_bytes, &untouched, sizeof untouched) == 0);
  }
  GpuallocStats bad;
  memset(&bad, 0, sizeof bad);
  CHECK(gpualloc_get_stats(0, &bad) == GPUALLOC_ERR_INVALID_ARGUMENT); /* size not set */
  CHECK(gpualloc_get_stats(0, NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  /* peaks and accumulated counters */
  gpualloc_free(p, 3 * MiB, 0, stream(0));
  s = stats(0);
  CHECK(s.allocated_bytes.all.peak > s.allocated_bytes.all.current);
  CHECK(gpualloc_reset_peak_stats(0) == GPUALLOC_OK);
  s = stats(0);
  CHECK(s.allocated_bytes.all.peak == s.allocated_bytes.all.current);
  CHECK(s.allocation.all.allocated > 0);
  CHECK(gpualloc_reset_accumulated_stats(0) == GPUALLOC_OK);
  s = stats(0);
  CHECK(s.allocation.all.allocated == 0 && s.allocation.all.freed == 0 && s.num_device_alloc == 0);
  {
    GpuallocDriverCall d[64];
    size_t rows = 0;
    CHECK(gpualloc_driver_calls(0, d, 64, &rows) == GPUALLOC_OK);
    for (size_t i = 0; i < rows; i++) CHECK(d[i].calls == 0 && d[i].nanos == 0);
  }
  CHECK(gpualloc_reset_peak_stats(42) == GPUALLOC_ERR_INVALID_DEVICE);
  /* cacheInfo: 0 means "start from the device's free memory" */
  size_t largest = 0;
  CHECK(gpualloc_cache_info(0, &largest) == GPUALLOC_OK);
  uint64_t free_b = 0, total_b = 0;
  CHECK(gpualloc_mem_info(0, &free_b, &total_b) == GPUALLOC_OK);
  CHECK(largest == free_b);
  largest = 1;
  CHECK(gpualloc_cache_info(0, &largest) == GPUALLOC_OK);
  CHECK(largest == s.largest_free_block && largest >= 3 * MiB);
  CHECK(gpualloc_cache_info(0, NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  free(v);
  SECTION_OK("stats");
}

static void test_record_stream_and_empty_cache(void) {
  torch_record_stream_fn record = gpualloc_record_stream;
  torch_reset_fn reset = gpualloc_empty_cache;
  void *p = gpualloc_malloc(5 * MiB, 0, stream(11));
  CHECK(p != NULL);
  record(p, stream(12));
  CHECK(gpualloc_last_error() == NULL);
  gpualloc_free(p, 5 * MiB, 0, stream(11));
  GpuallocStats s = stats(0);
  CHECK(s.allocation.all.current == 0);
  CHECK(s.active.all.current == 1); /* waits for stream 12's work */
  /* not reusable by its stream while stream 12 may still use it */
  void *q = gpualloc_malloc(5 * MiB, 0, stream(11));
  CHECK(q != NULL && q != p);
  gpualloc_free(q, 5 * MiB, 0, stream(11));
  reset();
  CHECK(gpualloc_last_error() == NULL);
  s = stats(0);
  CHECK(s.active.all.current == 0);
  CHECK(s.num_sync_all_streams >= 1);
  CHECK(s.reserved_bytes.all.current == 0); /* every unsplit segment released */
  CHECK(s.num_device_free > 0);
  /* Another GPU's default stream has this one's handle (0), but is
   * another stream: the block waits for it. This device's own default
   * stream, the allocation stream, adds nothing. */
  void *d = gpualloc_malloc(5 * MiB, 0, stream(0));
  CHECK(d != NULL);
  gpualloc_record_stream_on(d, stream(0), 0);
  gpualloc_free(d, 5 * MiB, 0, stream(0));
  CHECK(stats(0).active.all.current == 0);
  d = gpualloc_malloc(5 * MiB, 0, stream(0));
  gpualloc_record_stream_on(d, stream(0), 1);
  CHECK(gpualloc_last_error() == NULL);
  gpualloc_free(d, 5 * MiB, 0, stream(0));
  CHECK(stats(0).active.all.current == 1);
  reset();
  CHECK(stats(0).active.all.current == 0);
  gpualloc_record_stream_on((void *)(uintptr_t)0xdead000, stream(0), 1);
  CHECK(gpualloc_last_error_code() == GPUALLOC_ERR_INVALID_POINTER);
  d = gpualloc_malloc(5 * MiB, 0, stream(0));
  gpualloc_record_stream_on(d, stream(0), 7); /* no device 7 */
  CHECK(gpualloc_last_error_code() == GPUALLOC_ERR_INVALID_DEVICE);
  CHECK(contains(gpualloc_last_error(), "7"));
  gpualloc_free(d, 5 * MiB, 0, stream(0));
  CHECK(stats(0).active.all.current == 0); /* nothing was recorded */
  /* record_stream of a pointer gpualloc does not know */
  record((void *)(uintptr_t)0xdead000, stream(3));
  CHECK(contains(gpualloc_last_error(), "record_stream"));
  CHECK(gpualloc_last_error_code() == GPUALLOC_ERR_INVALID_POINTER);
  record(NULL, stream(3));
  CHECK(gpualloc_last_error() == NULL);
  CHECK(gpualloc_last_error_code() == 0);
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
  /* enablePeerAccess(0, 1): device 1's memory becomes accessible to 0 */
  CHECK(gpualloc_add_peer_access(1, 0) == GPUALLOC_OK);
  CHECK(gpualloc_add_peer_access(1, 7) == GPUALLOC_ERR_INVALID_DEVICE);
  CHECK(contains(gpualloc_last_error(), "7"));
  SECTION_OK("record_stream_empty_cache");
}

static void test_limits_and_oom(void) {
  torch_memory_fraction_fn set_fraction = gpualloc_set_memory_fraction;
  double f = 0.0;
  CHECK(gpualloc_get_memory_fraction(0, &f) == GPUALLOC_OK && f == 1.0);
  set_fraction(0.25, 0);
  CHECK(gpualloc_last_error() == NULL);
  CHECK(gpualloc_get_memory_fraction(0, &f) == GPUALLOC_OK && f == 0.25);
  set_fraction(1.5, 0);
  CHECK(contains(gpualloc_last_error(), "fraction"));
  CHECK(gpualloc_get_memory_fraction(0, NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  /* 0.25 of 1 GiB: 300 MiB can never fit */
  GpuallocOomInfo info;
  CHECK(gpualloc_malloc(300 * MiB, 0, stream(0)) == NULL);
  CHECK(contains(gpualloc_last_error(), "out of memory"));
  memset(&info, 0, sizeof info);
  info.size = (uint32_t)sizeof info;
  CHECK(gpualloc_last_oom(&info) == GPUALLOC_OK);
  CHECK(info.version == GPUALLOC_OOM_INFO_VERSION && info.size == sizeof info);
  CHECK(info.kind == GPUALLOC_OOM_NEVER);
  CHECK(info.requested == 300 * MiB);
  /* what PyTorch's out-of-memory observers are told as allowed */
  CHECK(info.device == 0 && info.limit == GiB / 4 && info.device_total == GiB / 4);
  set_fraction(1.0, 0);
  /* a byte limit: the second 40 MiB does not fit now */
  CHECK(gpualloc_set_memory_limit(0, 64 * MiB) == GPUALLOC_OK);
  void *a = gpualloc_malloc(40 * MiB, 0, stream(0));
  CHECK(a != NULL);
  CHECK(gpualloc_malloc(40 * MiB, 0, stream(0)) == NULL);
  const char *msg = gpualloc_last_error();
  CHECK(contains(msg, "out of memory") && contains(msg, "Tried to allocate 40.00 MiB"));
  memset(&info, 0, sizeof info);
  info.size = (uint32_t)sizeof info;
  CHECK(gpualloc_last_oom(&info) == GPUALLOC_OK);
  CHECK(info.kind == GPUALLOC_OOM_NOW);
  CHECK(info.device == 0);
  CHECK(info.requested == 40 * MiB);
  CHECK(info.limit == 64 * MiB);
  CHECK(info.allocated == 40 * MiB);
  CHECK(info.device_total == GiB);
  CHECK(stats(0).num_ooms >= 1);
  /* the limit lifted, it fits */
  CHECK(gpualloc_set_memory_limit(0, 0) == GPUALLOC_OK);
  void *b = gpualloc_malloc(40 * MiB, 0, stream(0));
  CHECK(b != NULL);
  /* beyond the device */
  CHECK(gpualloc_malloc(2 * GiB, 0, stream(0)) == NULL);
  memset(&info, 0, sizeof info);
  info.size = (uint32_t)sizeof info;
  CHECK(gpualloc_last_oom(&info) == GPUALLOC_OK && info.kind == GPUALLOC_OOM_NEVER);
  CHECK(info.device == 0 && info.limit == 0 && info.device_total == GiB);
  CHECK(contains(gpualloc_last_error(), "out of memory")); /* the report keeps its sentence */
  /* its own failure replaces the sentence; its next success clears that */
  info.size = 4;
  CHECK(gpualloc_last_oom(&info) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(contains(gpualloc_last_error(), "size"));
  info.size = (uint32_t)sizeof info;
  CHECK(gpualloc_last_oom(&info) == GPUALLOC_OK && info.kind == GPUALLOC_OOM_NEVER);
  CHECK(gpualloc_last_error() == NULL);
  gpualloc_free(a, 40 * MiB, 0, stream(0));
  gpualloc_free(b, 40 * MiB, 0, stream(0));
  gpualloc_empty_cache();
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
  SECTION_OK("limits_oom");
}

static void *oom_elsewhere(void *arg) {
  GpuallocOomInfo info;
  memset(&info, 0, sizeof info);
  info.size = (uint32_t)sizeof info;
  *(int *)arg = gpualloc_last_oom(&info);
  return NULL;
}

static void test_thread_local_errors(void) {
  CHECK(gpualloc_init("max_split_size_mb:1") == GPUALLOC_ERR_ALREADY_INITIALIZED);
  int rc = 0;
  pthread_t t;
  CHECK(pthread_create(&t, NULL, oom_elsewhere, &rc) == 0);
  CHECK(pthread_join(t, NULL) == 0);
  CHECK(rc == GPUALLOC_ERR_NOT_FOUND); /* that thread never ran out of memory */
  CHECK(gpualloc_last_error() != NULL); /* this thread's error is still here */
  gpualloc_clear_error();
  CHECK(gpualloc_last_error() == NULL);
  SECTION_OK("thread_local_errors");
}

static void test_snapshot(void) {
  void *p = gpualloc_malloc(700, 0, stream(0));
  CHECK(p != NULL);
  size_t needed = 0;
  CHECK(gpualloc_snapshot_json(0, NULL, 0, &needed) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(needed > 2);
  char *buf = malloc(needed);
  CHECK(buf != NULL);
  CHECK(gpualloc_snapshot_json(0, buf, needed - 1, NULL) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(gpualloc_snapshot_json(0, buf, needed, &needed) == GPUALLOC_OK);
  CHECK(strlen(buf) + 1 == needed);
  CHECK(strncmp(buf, "{\"segments\":[", 13) == 0);
  CHECK(contains(buf, "\"state\":\"active_allocated\""));
  CHECK(contains(buf, "\"requested_size\":700"));
  CHECK(contains(buf, "\"segment_type\":\"small\""));
  char addr[64];
  snprintf(addr, sizeof addr, "\"address\":%llu", (unsigned long long)(uintptr_t)p);
  CHECK(contains(buf, addr));
  free(buf);
  /* every device */
  CHECK(gpualloc_snapshot_json(-1, NULL, 0, &needed) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  gpualloc_free(p, 700, 0, stream(0));
  SECTION_OK("snapshot");
}

struct filter_ctx {
  uintptr_t capture_stream;
  int calls;
};

static int only_capture_stream(void *ctx, cudaStream_t s) {
  struct filter_ctx *c = ctx;
  c->calls++;
  return (uintptr_t)s == c->capture_stream;
}

static void test_pools(void) {
  struct filter_ctx ctx = {77, 0};
  CHECK(gpualloc_begin_allocate_to_pool(0, 5, 6, only_capture_stream, &ctx) == GPUALLOC_OK);
  void *in_pool = gpualloc_malloc(2048, 0, stream(77));
  void *outside = gpualloc_malloc(2048, 0, stream(78));
  CHECK(in_pool != NULL && outside != NULL);
  CHECK(ctx.calls >= 2);
  size_t needed = 0;
  gpualloc_snapshot_json(0, NULL, 0, &needed);
  char *buf = malloc(needed);
  CHECK(buf != NULL);
  CHECK(gpualloc_snapshot_json(0, buf, needed, NULL) == GPUALLOC_OK);
  CHECK(contains(buf, "\"segment_pool_id\":[5,6]"));
  free(buf);
  CHECK(gpualloc_end_allocate_to_pool(0, 5, 6) == GPUALLOC_OK);
  CHECK(gpualloc_end_allocate_to_pool(0, 5, 6) == GPUALLOC_ERR_UNKNOWN_POOL);
  /* a NULL filter takes every stream */
  CHECK(gpualloc_begin_allocate_to_pool(0, 9, 9, NULL, NULL) == GPUALLOC_OK);
  void *any = gpualloc_malloc(4096, 0, stream(123));
  CHECK(any != NULL);
  CHECK(gpualloc_end_allocate_to_pool(0, 9, 9) == GPUALLOC_OK);
  gpualloc_free(any, 4096, 0, stream(123));
  CHECK(gpualloc_release_pool(0, 9, 9) == GPUALLOC_OK);
  gpualloc_free(in_pool, 2048, 0, stream(77));
  gpualloc_free(outside, 2048, 0, stream(78));
  CHECK(gpualloc_release_pool(0, 5, 6) == GPUALLOC_OK);
  CHECK(gpualloc_release_pool(0, 5, 6) == GPUALLOC_ERR_UNKNOWN_POOL);
  CHECK(gpualloc_begin_allocate_to_pool(99, 1, 1, NULL, NULL) == GPUALLOC_ERR_INVALID_DEVICE);
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
  SECTION_OK("pools");
}

static void test_trace(void) {
  const char *path = getenv("GPUALLOC_ABI_TRACE");
  CHECK(path != NULL);
  CHECK(gpualloc_is_tracing() == 0);
  CHECK(gpualloc_trace_start(NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(gpualloc_trace_start("/nonexistent-dir/x/y.gtrace") == GPUALLOC_ERR_IO);
  CHECK(gpualloc_trace_start(path) == GPUALLOC_OK);
  CHECK(gpualloc_is_tracing() == 1);
  CHECK(gpualloc_phase_push("forward") == GPUALLOC_OK);
  void *p = gpualloc_malloc(4 * MiB, 0, stream(0));
  CHECK(p != NULL);
  CHECK(gpualloc_mark("step 1") == GPUALLOC_OK);
  gpualloc_free(p, 4 * MiB, 0, stream(0));
  CHECK(gpualloc_phase_pop() == GPUALLOC_OK);
  CHECK(gpualloc_phase_push(NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(gpualloc_trace_flush() == GPUALLOC_OK);
  GpuallocTraceSummary summary;
  memset(&summary, 0, sizeof summary);
  CHECK(gpualloc_trace_stop(&summary) == GPUALLOC_OK);
  CHECK(gpualloc_is_tracing() == 0);
  CHECK(summary.events >= 5); /* phase push, alloc, mark, free, phase pop, ... */
  CHECK(summary.dropped == 0);
  CHECK(gpualloc_trace_stop(NULL) == GPUALLOC_ERR_IO); /* not tracing */
  FILE *f = fopen(path, "rb");
  CHECK(f != NULL);
  CHECK(fseek(f, 0, SEEK_END) == 0);
  long size = ftell(f);
  fclose(f);
  CHECK(size > 0 && (uint64_t)size == summary.bytes);
  printf("trace bytes %ld events %llu\n", size, (unsigned long long)summary.events);
  SECTION_OK("trace");
}

#define THREADS 4
#define ROUNDS 20000

static void *churn(void *arg) {
  uintptr_t id = (uintptr_t)arg;
  void *live[8] = {0};
  size_t sizes[8] = {512, 3000, 70000, 1 << 20, 2 << 20, 5000, 12 << 20, 256};
  for (int i = 0; i < ROUNDS; i++) {
    int k = (int)((i * 7 + id) % 8);
    if (live[k]) {
      gpualloc_free(live[k], sizes[k], (int)(id % 2), stream(id + 100));
      live[k] = NULL;
    } else {
      live[k] = gpualloc_malloc(sizes[k], (int)(id % 2), stream(id + 100));
      if (live[k] == NULL) return (void *)1;
    }
  }
  for (int k = 0; k < 8; k++) {
    if (live[k]) gpualloc_free(live[k], sizes[k], (int)(id % 2), stream(id + 100));
  }
  return NULL;
}

static void test_threads(void) {
  pthread_t t[THREADS];
  for (uintptr_t i = 0; i < THREADS; i++) CHECK(pthread_create(&t[i], NULL, churn, (void *)i) == 0);
  for (int i = 0; i < THREADS; i++) {
    void *ret = NULL;
    CHECK(pthread_join(t[i], &ret) == 0);
    CHECK(ret == NULL);
  }
  CHECK(stats(0).allocation.all.current == 0);
  CHECK(stats(1).allocation.all.current == 0);
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
  CHECK(gpualloc_check_invariants(1) == GPUALLOC_OK);
  SECTION_OK("threads");
}

int main(void) {
  test_init();
  test_malloc_free();
  test_stats();
  test_record_stream_and_empty_cache();
  test_limits_and_oom();
  test_thread_local_errors();
  test_snapshot();
  test_pools();
  test_trace();
  test_threads();
  printf("ALL OK\n");
  return 0;
}
