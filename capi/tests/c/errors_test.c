/* Read-only calls create nothing; a successful call clears the last error;
 * with BAD_CONF set, GPUALLOC_CONF is bad and frees must not flood stderr. */
#include "gpualloc.h"
#include <stdio.h>
#include <string.h>
#include <stdlib.h>

#define CHECK(c)                                                   \
  do {                                                             \
    if (!(c)) {                                                    \
      printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #c);        \
      const char *e_ = gpualloc_last_error();                      \
      printf("last error: %s\n", e_ ? e_ : "none");                \
      return 1;                                                    \
    }                                                              \
  } while (0)

int main(void) {
  if (getenv("BAD_CONF")) {
    for (int i = 0; i < 100; i++) {
      gpualloc_free(NULL, 0, 0, 0);
      gpualloc_free((void *)0x1000, 16, 0, 0);
    }
    CHECK(gpualloc_malloc(4096, 0, 0) == NULL);
    CHECK(gpualloc_last_error_code() == GPUALLOC_ERR_CONFIG);
    return 0;
  }
  GpuallocStats s = {0};
  s.size = sizeof s;
  CHECK(gpualloc_get_stats(0, &s) == GPUALLOC_OK);
  CHECK(gpualloc_get_stats(7, &s) == GPUALLOC_ERR_INVALID_DEVICE);
  int64_t values[512];
  CHECK(gpualloc_stat_values(0, values, 512) == GPUALLOC_OK);
  gpualloc_free(NULL, 0, 0, 0);
  gpualloc_free((void *)0x1000, 16, 0, 0);
  CHECK(gpualloc_last_error_code() == GPUALLOC_ERR_INVALID_POINTER);
  CHECK(gpualloc_is_tracing() == 0);
  CHECK(gpualloc_device_count() == 1);
  double f = 0;
  CHECK(gpualloc_get_memory_fraction(0, &f) == GPUALLOC_OK && f == 1.0);
  gpualloc_empty_cache();
  CHECK(gpualloc_reset_peak_stats(0) == GPUALLOC_OK);
  size_t needed = 0;
  CHECK(gpualloc_snapshot_json(0, NULL, 0, &needed) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(gpualloc_trace_flush() != GPUALLOC_OK);
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
  CHECK(gpualloc_end_allocate_to_pool(0, 1, 2) == GPUALLOC_ERR_UNKNOWN_POOL);
  CHECK(gpualloc_release_pool(0, 1, 2) == GPUALLOC_ERR_UNKNOWN_POOL);
  CHECK(gpualloc_release_pool(9, 1, 2) == GPUALLOC_ERR_INVALID_DEVICE);
  CHECK(gpualloc_is_initialized() == 0);
  CHECK(gpualloc_init("max_split_size_mb:64") == GPUALLOC_OK);
  CHECK(gpualloc_is_initialized() == 1);

  /* A failure sets the last error; the next successful call clears it. */
  gpualloc_free((void *)0x1000, 16, 0, 0);
  CHECK(gpualloc_last_error() != NULL);
  void *p = gpualloc_malloc(4096, 0, 0);
  CHECK(p != NULL);
  CHECK(gpualloc_last_error() == NULL && gpualloc_last_error_code() == 0);
  gpualloc_free((void *)0x1000, 16, 0, 0);
  CHECK(gpualloc_last_error_code() == GPUALLOC_ERR_INVALID_POINTER);
  gpualloc_free(p, 4096, 0, 0);
  CHECK(gpualloc_last_error() == NULL && gpualloc_last_error_code() == 0);

  /* A name longer than a trace holds is refused, tracing or not. */
  static char name[5001];
  memset(name, 'x', 5000);
  CHECK(gpualloc_mark(name) != GPUALLOC_OK);
  CHECK(strstr(gpualloc_last_error(), "5000 bytes is above the limit of 4096") != NULL);
  CHECK(gpualloc_phase_push(name) != GPUALLOC_OK);
  CHECK(strstr(gpualloc_last_error(), "phase name of 5000 bytes") != NULL);
  name[4096] = 0;
  CHECK(gpualloc_mark(name) == GPUALLOC_OK);
  printf("ALL OK\n");
  return 0;
}
