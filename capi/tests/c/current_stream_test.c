/* gpualloc_free, PyTorch's pluggable free, reads PyTorch's current stream
 * where libc10_cuda.so is loaded (here the stand-in of c10_stand_in.cpp,
 * linked in; with -DWITHOUT_C10 none is): a block freed while another
 * stream than its own is current is not reused before that stream's
 * queued work is done (Note [The current stream without the bridge]).
 * Prints "done" at the end. */
#include "gpualloc.h"
#include <stdint.h>
#include <stdio.h>

#ifndef WITHOUT_C10
void stand_in_set_current_stream(int device, int64_t id);
#else
static void stand_in_set_current_stream(int device, int64_t id) { (void)device, (void)id; }
#endif

#define STREAM(n) ((cudaStream_t)(uintptr_t)(n))
#define CHECK(cond, what)                            \
  do {                                               \
    if (!(cond)) {                                   \
      printf("failed: %s\n", what);                  \
      return 1;                                      \
    }                                                \
  } while (0)

int main(void) {
  const size_t size = (size_t)4 << 20;
  /* Freed while its own stream is current: reused at once. */
  stand_in_set_current_stream(0, 1);
  void *p = gpualloc_malloc(size, 0, STREAM(1));
  CHECK(p != NULL, "an allocation");
  gpualloc_free(p, size, 0, STREAM(1));
  void *q = gpualloc_malloc(size, 0, STREAM(1));
  CHECK(q == p, "freed on its own stream: reused at once");

  /* Freed while stream 2 is current: its reads may still be queued. */
  stand_in_set_current_stream(0, 2);
  gpualloc_free(q, size, 0, STREAM(1));
  void *r = gpualloc_malloc(size, 0, STREAM(1));
#ifndef WITHOUT_C10
  CHECK(r != q, "freed while stream 2 is current: not reused before its work is done");
#else
  CHECK(r == q, "without c10 the current stream is unknown: reused at once");
#endif
  /* A device the allocator does not count is never asked of c10 (which
   * throws for it): the free is refused as before. */
  gpualloc_free(r, size, 100, STREAM(1));
  gpualloc_free(r, size, 0, STREAM(1));
  printf("done\n");
  return 0;
}
