/* gpualloc_free, PyTorch's pluggable free, reads PyTorch's current stream
 * where libc10_cuda.so is loaded (here the stand-in of c10_stand_in.cpp,
 * linked in; with -DWITHOUT_C10 none is at first): a block freed while
 * another stream than its own is current is not reused before that
 * stream's queued work is done (Note [The current stream without the
 * bridge]). Prints "done" at the end. */
#define _GNU_SOURCE
#include "gpualloc.h"
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define STREAM(n) ((cudaStream_t)(uintptr_t)(n))
#define CHECK(cond, what)                            \
  do {                                               \
    if (!(cond)) {                                   \
      printf("failed: %s\n", what);                  \
      return 1;                                      \
    }                                                \
  } while (0)

typedef void (*set_current_fn)(int device, int64_t id);
#ifndef WITHOUT_C10
void stand_in_set_current_stream(int device, int64_t id);
static set_current_fn set_current = stand_in_set_current_stream;
#else
static void no_c10(int device, int64_t id) { (void)device, (void)id; }
static set_current_fn set_current = no_c10;
#endif

static const size_t size = (size_t)4 << 20;

/* Frees a block of stream 1 while stream 2 is current, then asks for
 * the same size on stream 1: whether it got the block back. */
static int reused_after_a_free_elsewhere(void) {
  set_current(0, 1);
  void *q = gpualloc_malloc(size, 0, STREAM(1));
  set_current(0, 2);
  gpualloc_free(q, size, 0, STREAM(1));
  void *r = gpualloc_malloc(size, 0, STREAM(1));
  gpualloc_free(r, size, 0, STREAM(1));
  set_current(0, 1);
  return r == q;
}

int main(void) {
  /* Freed while its own stream is current: reused at once. */
  set_current(0, 1);
  void *p = gpualloc_malloc(size, 0, STREAM(1));
  CHECK(p != NULL, "an allocation");
  gpualloc_free(p, size, 0, STREAM(1));
  void *q = gpualloc_malloc(size, 0, STREAM(1));
  CHECK(q == p, "freed on its own stream: reused at once");
  gpualloc_free(q, size, 0, STREAM(1));

#ifndef WITHOUT_C10
  CHECK(!reused_after_a_free_elsewhere(), "freed while stream 2 is current: not reused before its work is done");
#else
  CHECK(reused_after_a_free_elsewhere(), "without c10 the current stream is unknown: reused at once");
  /* c10 loaded later (a program that imports torch after its first free):
   * found once the lookup is tried again, within 4096 frees. */
  const char *path = getenv("C10_STAND_IN");
  CHECK(path != NULL, "C10_STAND_IN names the stand-in");
  void *lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  CHECK(lib != NULL, "the stand-in loads");
  *(void **)(&set_current) = dlsym(lib, "stand_in_set_current_stream"); /* POSIX's way past ISO C */
  CHECK(set_current != NULL, "the stand-in's setter");
  set_current(0, 1);
  for (int i = 0; i < 4096; ++i) {
    void *x = gpualloc_malloc(size, 0, STREAM(1));
    gpualloc_free(x, size, 0, STREAM(1));
  }
  CHECK(!reused_after_a_free_elsewhere(), "c10 loaded later: found, and the free elsewhere waits");
#endif

  /* A device that gpualloc or c10 does not count is never asked of c10
   * (which throws for it; the stand-in aborts): the pointer is found and
   * freed on its own device. Run with GPUALLOC_SIM_DEVICES=2, device 1 is
   * gpualloc's but not c10's. */
  void *r = gpualloc_malloc(size, 0, STREAM(1));
  gpualloc_free(r, size, 100, STREAM(1));
  void *t = gpualloc_malloc(size, 1, STREAM(1));
  CHECK(t != NULL, "an allocation on device 1");
  gpualloc_free(t, size, 1, STREAM(1));
  printf("done\n");
  return 0;
}
