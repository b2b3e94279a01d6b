/* The stand-in driver of fake_cuda.c catches each misuse it is there to
 * catch, one count each, and lets the right uses pass: linked to it
 * directly, without gpualloc. Prints "ALL OK" at the end. */
#include <stdio.h>
#include <stdlib.h>

typedef unsigned long long u64;
int cuInit(unsigned);
int cuDevicePrimaryCtxRetain(void **, int);
int cuCtxSetCurrent(void *);
int cuEventCreate(void **, unsigned);
int cuEventDestroy_v2(void *);
int cuEventRecord(void *, void *);
int cuEventQuery(void *);
int cuMemAddressReserve(u64 *, size_t, size_t, u64, u64);
int cuMemAddressFree(u64, size_t);
int cuMemCreate(u64 *, size_t, const void *, u64);
int cuMemRelease(u64);
int cuMemMap(u64, size_t, size_t, u64, u64);
int cuMemSetAccess(u64, size_t, const void *, size_t);
int cuMemUnmap(u64, size_t);
int cuMemcpyDtoD_v2(u64, u64, size_t);
int cuEventSynchronize(void *);
int cuStreamSynchronize(void *);
int cuThreadExchangeStreamCaptureMode(unsigned *);
int cuStreamGetCaptureInfo_v3(void *, unsigned *, u64 *, void *, void *, void *, size_t *);
int fake_cuda_summary(u64 out[8]);
u64 fake_cuda_begin_capture(void *, int);
int fake_cuda_end_capture(void);

#define MIB (1ull << 20)

static u64 misuses(void) {
  u64 s[8];
  fake_cuda_summary(s);
  return s[0];
}

static int failures;

/* `call` must return `ok` (0: success) and add `more` misuses. */
#define EXPECT(call, ok, more)                                                         \
  do {                                                                                 \
    u64 before_ = misuses();                                                           \
    int r_ = (call);                                                                   \
    if ((r_ == 0) != (ok) || misuses() != before_ + (more)) {                          \
      fprintf(stderr, "FAILED line %d: %s returned %d, misuses +%llu\n", __LINE__,     \
              #call, r_, misuses() - before_);                                         \
      failures++;                                                                      \
    }                                                                                  \
  } while (0)

int main(void) {
  unsigned prop[8] = {0}; /* CUmemAllocationProp: location.id (device 0) at byte 12 */
  unsigned desc[3] = {0};
  void *ctx, *ev;
  u64 va, bad, h1, h2;
  EXPECT(cuInit(0), 1, 0);
  EXPECT(cuEventCreate(&ev, 0), 0, 1); /* no current context */
  EXPECT(cuDevicePrimaryCtxRetain(&ctx, 0), 1, 0);
  EXPECT(cuCtxSetCurrent(ctx), 1, 0);
  EXPECT(cuMemAddressReserve(&va, 8 * MIB, 0, 0, 0), 1, 0);
  EXPECT(cuMemAddressReserve(&bad, 3 * MIB, 0, 0, 0), 0, 1); /* not a multiple of 2 MiB */
  EXPECT(cuMemCreate(&h1, 4 * MIB, prop, 0), 1, 0);
  EXPECT(cuMemCreate(&h2, 2 * MIB, prop, 0), 1, 0);
  EXPECT(cuMemMap(va, 4 * MIB, 0, h1, 0), 1, 0);
  EXPECT(cuMemMap(va + 2 * MIB, 2 * MIB, 0, h2, 0), 0, 1);  /* over a mapping */
  EXPECT(cuMemMap(va + 6 * MIB, 4 * MIB, 0, h1, 0), 0, 1);  /* past the reservation */
  EXPECT(cuMemMap(va + 4 * MIB, 4 * MIB, 0, h2, 0), 0, 1);  /* past the handle */
  EXPECT(cuMemSetAccess(va, 6 * MIB, desc, 1), 0, 1);       /* not all mapped */
  EXPECT(cuMemSetAccess(va, 4 * MIB, desc, 1), 1, 0);
  EXPECT(cuMemcpyDtoD_v2(va, va + 2 * MIB, MIB), 1, 0);
  EXPECT(cuMemMap(va + 4 * MIB, 2 * MIB, 0, h2, 0), 1, 0);
  EXPECT(cuMemcpyDtoD_v2(va + 4 * MIB, va, MIB), 0, 1);     /* mapped, no access */
  EXPECT(cuMemUnmap(va, 2 * MIB), 0, 1);                    /* part of a mapping */
  EXPECT(cuMemAddressFree(va, 8 * MIB), 0, 1);              /* still mapped */
  EXPECT(cuMemRelease(h1), 1, 0);                           /* mapped: kept until unmapped */
  EXPECT(cuMemRelease(h1), 0, 1);                           /* twice */
  EXPECT(cuMemMap(va + 6 * MIB, 2 * MIB, 0, h1, 0), 0, 1);  /* a released handle */
  EXPECT(cuMemUnmap(va, 6 * MIB), 1, 0);
  EXPECT(cuMemUnmap(va, 2 * MIB), 0, 1);                    /* not mapped */
  EXPECT(cuMemRelease(h2), 1, 0);
  EXPECT(cuMemAddressFree(va, 4 * MIB), 0, 1);              /* not its size */
  EXPECT(cuMemAddressFree(va, 8 * MIB), 1, 0);
  EXPECT(cuEventCreate(&ev, 0), 1, 0);
  EXPECT(cuEventRecord(ev, NULL), 1, 0);
  EXPECT(cuEventDestroy_v2(ev), 1, 0);
  EXPECT(cuEventQuery(ev), 0, 1);                           /* destroyed */

  /* Captures: what each forbids, and what invalidates them. */
  void *s7 = (void *)7, *s1 = (void *)1;
  unsigned status = 9, relaxed = 2;
  u64 id = 0;
  void *done;
  EXPECT(cuEventCreate(&done, 0), 1, 0);
  EXPECT(cuEventRecord(done, s1), 1, 0);
  u64 first = fake_cuda_begin_capture(s7, 0); /* global */
  EXPECT(cuStreamGetCaptureInfo_v3(s7, &status, &id, NULL, NULL, NULL, NULL), 1, 0);
  if (status != 1 || id != first) { fprintf(stderr, "FAILED: capture info %u %llu\n", status, id); failures++; }
  EXPECT(cuStreamGetCaptureInfo_v3(s1, &status, &id, NULL, NULL, NULL, NULL), 1, 0);
  if (status != 0) { fprintf(stderr, "FAILED: stream 1 captures\n"); failures++; }
  EXPECT(cuStreamGetCaptureInfo_v3(NULL, &status, &id, NULL, NULL, NULL, NULL), 0, 0); /* implicit */
  if (fake_cuda_end_capture() != 0) { fprintf(stderr, "FAILED: a valid capture invalidated\n"); failures++; }
  fake_cuda_begin_capture(s7, 0);
  EXPECT(cuEventQuery(done), 0, 1);                         /* global capture, global thread */
  if (fake_cuda_end_capture() != 1) { fprintf(stderr, "FAILED: not invalidated\n"); failures++; }
  fake_cuda_begin_capture(s7, 0);
  EXPECT(cuThreadExchangeStreamCaptureMode(&relaxed), 1, 0);
  EXPECT(cuEventSynchronize(done), 1, 0);                   /* relaxed thread */
  EXPECT(cuStreamSynchronize(s7), 0, 1);                    /* the capturing stream */
  EXPECT(cuThreadExchangeStreamCaptureMode(&relaxed), 1, 0);
  fake_cuda_end_capture();
  fake_cuda_begin_capture(s7, 0);
  void *node;
  EXPECT(cuEventCreate(&node, 0), 1, 0);
  EXPECT(cuEventRecord(node, s7), 1, 0);
  EXPECT(cuEventQuery(node), 0, 1);                         /* recorded in the capture */
  fake_cuda_end_capture();
  fake_cuda_begin_capture(s7, 2);                           /* relaxed capture */
  EXPECT(cuEventQuery(done), 1, 0);
  if (fake_cuda_end_capture() != 0) { fprintf(stderr, "FAILED: relaxed capture invalidated\n"); failures++; }
  u64 s[8];
  fake_cuda_summary(s);
  if (s[3] != 0 || s[4] != 0 || s[5] != 0 || s[7] != 0) {
    fprintf(stderr, "FAILED: left handles %llu, mapped %llu, reservations %llu, bytes %llu\n", s[3], s[4], s[5], s[7]);
    failures++;
  }
  if (failures) return 1;
  printf("ALL OK\n");
  return 0;
}
