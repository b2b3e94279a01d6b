/* gpualloc_ipc_share / _open / _close, as the torch bridge uses them, on
 * the simulated backend.
 *
 * Run by capi/tests/abi/segments.rs with GPUALLOC_BACKEND=sim and GPUALLOC_CONF
 * unset (expandable segments: the share's bytes) or set to policy:pytorch
 * (plain segments: length 0 and the offset in the segment). Opening needs
 * the CUDA backend: here it must fail cleanly. Prints "ALL OK" at the end. */
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

#define MiB ((size_t)1 << 20)

static int32_t i32_at(const char *b) {
  int32_t v;
  memcpy(&v, b, 4);
  return v;
}
static uint64_t u64_at(const char *b) {
  uint64_t v;
  memcpy(&v, b, 8);
  return v;
}

/* The bytes covered by a share: handle sizes summed. */
static uint64_t covered(const char *buf, size_t len) {
  CHECK(len > 10 && buf[0] == 2);
  CHECK(i32_at(buf + 2) == (int32_t)getpid());
  if (buf[1] == 'e') {
    uint64_t size = u64_at(buf + 10), n = u64_at(buf + 18);
    CHECK(len == 26 + 4 * n);
    return size * n;
  }
  CHECK(buf[1] == 'g');
  uint32_t n;
  memcpy(&n, buf + 6, 4);
  CHECK(len == 10 + 16 * (size_t)n);
  uint64_t sum = 0;
  for (uint32_t i = 0; i < n; i++) sum += u64_at(buf + 10 + 16 * i + 8);
  return sum;
}

int main(void) {
  int plain = getenv("GPUALLOC_CONF") != NULL;
  size_t sizes[] = {512, 100000, 3 * MiB, 5 * MiB + 512, 64 * MiB};
  void *p[5];
  for (int i = 0; i < 5; i++) CHECK((p[i] = gpualloc_malloc(sizes[i], 0, NULL)) != NULL);

  char buf[4096];
  size_t len = 99;
  uint64_t off = 99;
  for (int i = 0; i < 5; i++) {
    if (plain) {
      CHECK(gpualloc_ipc_share(0, p[i], buf, sizeof buf, &len, &off) == GPUALLOC_OK);
      CHECK(len == 0 && off < 64 * MiB + 2 * MiB);
      continue;
    }
    /* Ask for the size first, then fetch. */
    CHECK(gpualloc_ipc_share(0, p[i], NULL, 0, &len, &off) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
    size_t need = len;
    CHECK(need > 10 && need <= sizeof buf);
    CHECK(gpualloc_ipc_share(0, p[i], buf, need, &len, &off) == GPUALLOC_OK);
    CHECK(len == need);
    CHECK(off + sizes[i] <= covered(buf, len));
  }
  SECTION_OK("share");

  /* Not the start of an allocation; another device; bad arguments. */
  CHECK(gpualloc_ipc_share(0, (char *)p[2] + 512, buf, sizeof buf, &len, &off) ==
        GPUALLOC_ERR_INVALID_POINTER);
  CHECK(gpualloc_ipc_share(3, p[2], buf, sizeof buf, &len, &off) == GPUALLOC_ERR_INVALID_DEVICE);
  CHECK(gpualloc_ipc_share(0, p[2], NULL, 8, &len, &off) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(gpualloc_ipc_share(0, p[2], buf, sizeof buf, &len, NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  SECTION_OK("refusals");

  /* Opening: bad bytes are named; good ones need the CUDA backend. */
  void *q = (void *)1;
  const char cuda[] = {2, 'c', 0, 0};
  CHECK(gpualloc_ipc_open(cuda, sizeof cuda, 0, &q) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(q == NULL && strstr(gpualloc_last_error(), "'c'") != NULL);
  CHECK(gpualloc_ipc_open(NULL, 4, 0, &q) == GPUALLOC_ERR_INVALID_ARGUMENT);
  if (!plain) {
    CHECK(gpualloc_ipc_share(0, p[3], buf, sizeof buf, &len, &off) == GPUALLOC_OK);
    CHECK(gpualloc_ipc_open(buf, len - 1, 0, &q) == GPUALLOC_ERR_INVALID_ARGUMENT);
    CHECK(gpualloc_ipc_open(buf, len, 0, &q) == GPUALLOC_ERR_UNAVAILABLE);
    CHECK(strstr(gpualloc_last_error(), "CUDA backend") != NULL);
  }
  CHECK(gpualloc_ipc_close(p[0]) == GPUALLOC_ERR_INVALID_POINTER);
  SECTION_OK("open");

  for (int i = 0; i < 5; i++) gpualloc_free(p[i], 0, 0, NULL);
  /* Freed: no longer shareable. */
  CHECK(gpualloc_ipc_share(0, p[1], buf, sizeof buf, &len, &off) == GPUALLOC_ERR_INVALID_POINTER);
  CHECK(gpualloc_check_invariants(0) == GPUALLOC_OK);
  printf("ALL OK\n");
  return 0;
}
