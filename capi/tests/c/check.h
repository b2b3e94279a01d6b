/* The check macros of the C test programs: the first failed check prints
 * its line and the last error, and exits with status 1. */
#ifndef GPUALLOC_TEST_CHECK_H
#define GPUALLOC_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "gpualloc.h"

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      const char *e_ = gpualloc_last_error();                                    \
      fprintf(stderr, "FAILED %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, \
              #cond, e_ ? e_ : "none");                                          \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

#define SECTION_OK(name) printf("ok %s\n", name)

#endif
