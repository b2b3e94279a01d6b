/* Starts the allocator, then crashes on a thread named "crasher": with
 * `segv` by writing through a null pointer (a fault), with `abort` by
 * calling abort() (a signal sent). The process must die of that signal;
 * with GPUALLOC_CRASH_REPORT=1 the library's report comes first on stderr
 * (Note [Crash reports] in capi/src/crash_report.rs). */
#define _GNU_SOURCE
#include "gpualloc.h"
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int faults;

static void *crash(void *arg) {
  (void)arg;
  pthread_setname_np(pthread_self(), "crasher");
  if (faults) {
    /* Null, but not known to be null at compile time. */
    volatile int *p = (volatile int *)(uintptr_t)(faults - 1);
    *p = 1;
  } else {
    abort();
  }
  return NULL;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: crash_test segv|abort\n");
    return 2;
  }
  faults = strcmp(argv[1], "segv") == 0;
  void *p = gpualloc_malloc(4096, 0, 0);
  if (!p) {
    fprintf(stderr, "no allocation: %s\n", gpualloc_last_error());
    return 2;
  }
  fprintf(stderr, "crashing\n");
  pthread_t t;
  if (pthread_create(&t, NULL, crash, NULL) != 0) return 2;
  pthread_join(t, NULL);
  return 0;
}
