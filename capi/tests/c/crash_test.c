/* Starts the allocator, then crashes on a thread named "crasher": with
 * `segv` by writing through a null pointer (a fault), with `abort` by
 * calling abort() (a signal sent), with `two` by two threads writing
 * through null pointers at once. The process must die of that signal;
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
static pthread_barrier_t together;
/* Null, but read as volatile: never known to be null at compile time. */
static volatile uintptr_t null_address = 0;

static void *crash(void *arg) {
  (void)arg;
  pthread_setname_np(pthread_self(), "crasher");
  if (faults == 2) pthread_barrier_wait(&together);
  if (faults) {
    *(volatile int *)null_address = 1;
  } else {
    abort();
  }
  return NULL;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: crash_test segv|abort|two\n");
    return 2;
  }
  faults = strcmp(argv[1], "segv") == 0 ? 1 : strcmp(argv[1], "two") == 0 ? 2 : 0;
  void *p = gpualloc_malloc(4096, 0, 0);
  if (!p) {
    fprintf(stderr, "no allocation: %s\n", gpualloc_last_error());
    return 2;
  }
  fprintf(stderr, "crashing\n");
  pthread_barrier_init(&together, NULL, 2);
  pthread_t t[2];
  int n = faults == 2 ? 2 : 1;
  for (int i = 0; i < n; i++)
    if (pthread_create(&t[i], NULL, crash, NULL) != 0) return 2;
  for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
  return 0;
}
