/* gpualloc from C: start the allocator, allocate, free, read the stats,
 * handle an out-of-memory error and record a trace.
 *
 * From the repository root, on the simulated device (no GPU needed):
 *
 *   cargo build --release -p gpualloc-capi
 *   cc -std=c11 -Wall -Icapi/include examples/c/basic.c -Ltarget/release -lgpualloc -o basic
 *   GPUALLOC_BACKEND=sim LD_LIBRARY_PATH=target/release ./basic basic.gtrace
 *   gpualloc summary basic.gtrace
 *
 * Without GPUALLOC_BACKEND=sim the same program runs on the GPU. The trace
 * path is optional. Stream NULL is CUDA's default stream. */
#include "gpualloc.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define MiB ((size_t)1 << 20)

/* Prints the library's message for the call that failed, and exits. */
static void die(const char *call) {
  const char *e = gpualloc_last_error();
  fprintf(stderr, "basic: %s failed: %s\n", call, e ? e : "(no message)");
  exit(1);
}

/* Device 0's stats; `size` tells the library which version we know. */
static GpuallocStats stats(void) {
  GpuallocStats s = {0};
  s.size = (uint32_t)sizeof s;
  if (gpualloc_get_stats(0, &s) != GPUALLOC_OK) die("gpualloc_get_stats");
  return s;
}

static void print_stats(const char *when) {
  GpuallocStats s = stats();
  printf("%-12s allocated %lld B in %lld blocks, reserved %lld B, peak allocated %lld B\n", when,
         (long long)s.allocated_bytes.all.current, (long long)s.allocation.all.current,
         (long long)s.reserved_bytes.all.current, (long long)s.allocated_bytes.all.peak);
}

int main(int argc, char **argv) {
  /* The configuration, in GPUALLOC_CONF's syntax (NULL reads GPUALLOC_CONF).
   * A bad key or value is an error naming it, and nothing is started. */
  if (gpualloc_init("memory_limit:1GiB") != GPUALLOC_OK) die("gpualloc_init");
  const char *backend = gpualloc_backend_name();
  if (backend == NULL) die("gpualloc_backend_name");
  printf("gpualloc %s on the %s backend, %d device(s)\n", gpualloc_version(), backend,
         gpualloc_device_count());

  if (argc > 1 && gpualloc_trace_start(argv[1]) != GPUALLOC_OK) die("gpualloc_trace_start");
  gpualloc_phase_push("forward");
  size_t sizes[3] = {1000, 3 * MiB, 64 * MiB};
  void *blocks[3];
  for (int i = 0; i < 3; i++) {
    blocks[i] = gpualloc_malloc(sizes[i], 0, NULL);
    if (blocks[i] == NULL) die("gpualloc_malloc");
  }
  gpualloc_phase_pop();
  print_stats("allocated:");

  for (int i = 0; i < 3; i++) gpualloc_free(blocks[i], sizes[i], 0, NULL);
  print_stats("freed:");
  gpualloc_mark("step 1");

  /* More than the 1 GiB limit: NULL, with the reason and the figures. */
  if (gpualloc_malloc(2048 * MiB, 0, NULL) != NULL) {
    fprintf(stderr, "basic: 2 GiB fitted under a 1 GiB limit\n");
    return 1;
  }
  GpuallocOomInfo oom = {0};
  oom.size = (uint32_t)sizeof oom;
  if (gpualloc_last_oom(&oom) != GPUALLOC_OK) die("gpualloc_last_oom");
  if (oom.kind == GPUALLOC_OOM_NEVER) {
    printf("out of memory: %llu B can never fit (at most %llu B)\n",
           (unsigned long long)oom.requested, (unsigned long long)oom.device_total);
  } else {
    printf("out of memory now: %llu B requested, %llu B allocated, %llu B reserved\n",
           (unsigned long long)oom.requested, (unsigned long long)oom.allocated,
           (unsigned long long)oom.reserved);
  }

  gpualloc_empty_cache();
  print_stats("emptied:");

  if (argc > 1) {
    GpuallocTraceSummary t;
    if (gpualloc_trace_stop(&t) != GPUALLOC_OK) die("gpualloc_trace_stop");
    printf("trace %s: %llu events, %llu bytes\n", argv[1], (unsigned long long)t.events,
           (unsigned long long)t.bytes);
  }
  return 0;
}
