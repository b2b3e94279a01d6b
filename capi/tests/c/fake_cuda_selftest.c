/* The stand-in driver of fake_cuda.c catches each misuse it is there to
 * catch, one count each, and lets the right uses pass: linked to it
 * directly, without gpualloc. Run with FAKE_CUDA_DEVICES=2. The last check,
 * of calls after the driver's teardown, runs in an exit handler registered
 * before cuInit (so it runs after the stand-in's), which prints "ALL OK"
 * when everything passed. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef unsigned long long u64;
int cuInit(unsigned);
int cuDeviceGetCount(int *);
int cuDevicePrimaryCtxRetain(void **, int);
int cuCtxSetCurrent(void *);
int cuCtxSynchronize(void);
int cuMemAlloc_v2(u64 *, size_t);
int cuMemFree_v2(u64);
int cuEventCreate(void **, unsigned);
int cuEventDestroy_v2(void *);
int cuEventRecord(void *, void *);
int cuEventQuery(void *);
int cuEventSynchronize(void *);
int cuStreamSynchronize(void *);
int cuThreadExchangeStreamCaptureMode(unsigned *);
int cuStreamGetCaptureInfo_v3(void *, unsigned *, u64 *, void *, void *, void *, size_t *);
int cuMemAddressReserve(u64 *, size_t, size_t, u64, u64);
int cuMemAddressFree(u64, size_t);
int cuMemCreate(u64 *, size_t, const void *, u64);
int cuMemRelease(u64);
int cuMemMap(u64, size_t, size_t, u64, u64);
int cuMemSetAccess(u64, size_t, const void *, size_t);
int cuMemUnmap(u64, size_t);
int cuMemcpyDtoD_v2(u64, u64, size_t);
int fake_cuda_summary(u64 out[8]);
u64 fake_cuda_begin_capture(void *, int);
int fake_cuda_end_capture(void);

#define MIB (1ull << 20)
#define GLOBAL 0
#define THREAD_LOCAL 1
#define RELAXED 2
#define IMPLICIT 906

static u64 summary(int i) {
  u64 s[8];
  fake_cuda_summary(s);
  return s[i];
}

static int failures;

#define FAIL(...)                                  \
  do {                                             \
    fprintf(stderr, "FAILED line %d: ", __LINE__); \
    fprintf(stderr, __VA_ARGS__);                  \
    fprintf(stderr, "\n");                         \
    failures++;                                    \
  } while (0)

/* `call` must return `want` and add `more` misuses. */
#define EXPECT(call, want, more)                                                              \
  do {                                                                                        \
    u64 before_ = summary(0);                                                                 \
    int r_ = (call);                                                                          \
    if (r_ != (want) || summary(0) != before_ + (more))                                       \
      FAIL("%s returned %d (want %d), misuses +%llu (want %d)", #call, r_, (want),            \
           summary(0) - before_, (more));                                                     \
  } while (0)

static void *ctx0, *ctx1, *done;

/* Queries `done` from another thread with device 0's context. */
static void *query_elsewhere(void *arg) {
  (void)arg;
  cuCtxSetCurrent(ctx0);
  return (void *)(long)cuEventQuery(done);
}

/* Reserves and frees address space 20 times on `arg`'s context. */
static void *reserve_loop(void *arg) {
  cuCtxSetCurrent(arg);
  for (int i = 0; i < 20; i++) {
    u64 va;
    cuMemAddressReserve(&va, 2 * MIB, 0, 0, 0);
    cuMemAddressFree(va, 2 * MIB);
  }
  return NULL;
}

static u64 overlaps_of(void *a, void *b) {
  u64 before = summary(1);
  pthread_t t1, t2;
  pthread_create(&t1, NULL, reserve_loop, a);
  pthread_create(&t2, NULL, reserve_loop, b);
  pthread_join(t1, NULL);
  pthread_join(t2, NULL);
  return summary(1) - before;
}

/* Runs after the stand-in's teardown: a call now is a misuse. */
static void after_exit(void) {
  u64 before = summary(0);
  int n;
  cuDeviceGetCount(&n);
  if (summary(0) != before + 1) FAIL("a call after the teardown went unseen");
  if (failures) _exit(1);
  printf("ALL OK\n");
  fflush(stdout);
  _exit(0);
}

int main(void) {
  unsigned prop[8] = {0}; /* CUmemAllocationProp: location.id (device 0) at byte 12 */
  unsigned desc[3] = {0};
  void *ev, *s1 = (void *)0x101, *s7 = (void *)0x107;
  u64 va, bad, h1, h2, plain;
  int n;
  atexit(after_exit);
  EXPECT(cuDeviceGetCount(&n), 0, 1); /* before cuInit */
  EXPECT(cuInit(0), 0, 0);
  EXPECT(cuEventCreate(&ev, 0), 201, 1); /* no current context */
  EXPECT(cuDevicePrimaryCtxRetain(&ctx0, 0), 0, 0);
  EXPECT(cuDevicePrimaryCtxRetain(&ctx1, 1), 0, 0);
  EXPECT(cuCtxSetCurrent(ctx0), 0, 0);

  /* Virtual memory. */
  EXPECT(cuMemAddressReserve(&va, 8 * MIB, 0, 0, 0), 0, 0);
  EXPECT(cuMemAddressReserve(&bad, 3 * MIB, 0, 0, 0), 1, 1); /* not a multiple of 2 MiB */
  EXPECT(cuMemCreate(&h1, 4 * MIB, prop, 0), 0, 0);
  EXPECT(cuMemCreate(&h2, 2 * MIB, prop, 0), 0, 0);
  EXPECT(cuMemMap(va, 4 * MIB, 0, h1, 0), 0, 0);
  EXPECT(cuMemMap(va + 2 * MIB, 2 * MIB, 0, h2, 0), 1, 1);     /* over a mapping */
  EXPECT(cuMemMap(va + 6 * MIB, 4 * MIB, 0, h1, 0), 1, 1);     /* past the reservation */
  EXPECT(cuMemMap(va + 4 * MIB, 4 * MIB, 0, h2, 0), 1, 1);     /* past the handle */
  EXPECT(cuMemMap(va + 4 * MIB, 2 * MIB, 2 * MIB, h1, 0), 1, 1); /* at an offset */
  EXPECT(cuMemSetAccess(va, 6 * MIB, desc, 1), 1, 1);          /* not all mapped */
  EXPECT(cuMemSetAccess(va, 4 * MIB, desc, 1), 0, 0);
  EXPECT(cuMemcpyDtoD_v2(va, va + 2 * MIB, MIB), 0, 0);
  EXPECT(cuMemMap(va + 4 * MIB, 2 * MIB, 0, h2, 0), 0, 0);
  EXPECT(cuMemcpyDtoD_v2(va + 4 * MIB, va, MIB), 1, 1); /* mapped, no access */
  EXPECT(cuMemUnmap(va, 2 * MIB), 1, 1);                /* part of a mapping */
  EXPECT(cuMemAddressFree(va, 8 * MIB), 1, 1);          /* still mapped */
  EXPECT(cuMemRelease(h1), 0, 0);                       /* mapped: kept until unmapped */
  EXPECT(cuMemRelease(h1), 400, 1);                     /* twice */
  EXPECT(cuMemMap(va + 6 * MIB, 2 * MIB, 0, h1, 0), 400, 1); /* a released handle */
  EXPECT(cuMemUnmap(va, 6 * MIB), 0, 0);
  EXPECT(cuMemUnmap(va, 2 * MIB), 1, 1); /* not mapped */
  EXPECT(cuMemRelease(h2), 0, 0);
  EXPECT(cuMemAddressFree(va, 4 * MIB), 1, 1); /* not its size */
  EXPECT(cuMemAddressFree(va, 8 * MIB), 0, 0);

  /* Events and contexts. */
  EXPECT(cuEventCreate(&ev, 0), 0, 0);
  EXPECT(cuEventRecord(ev, NULL), 0, 0);
  EXPECT(cuCtxSetCurrent(ctx1), 0, 0);
  EXPECT(cuEventRecord(ev, NULL), 400, 1);     /* device 0's event on device 1's legacy stream */
  EXPECT(cuEventRecord(ev, (void *)2), 400, 1); /* ... on its per-thread stream */
  EXPECT(cuEventRecord(ev, s1), 0, 0);          /* an ordinary stream: the caller's business */
  EXPECT(cuCtxSetCurrent(ctx0), 0, 0);
  EXPECT(cuEventDestroy_v2(ev), 0, 0);
  EXPECT(cuEventQuery(ev), 400, 1); /* destroyed */

  /* Two threads in memory-mapping calls for one device at once are
   * counted (each call takes FAKE_CUDA_VMM_US); for two devices, not. */
  if (overlaps_of(ctx0, ctx0) == 0) FAIL("two threads on one device never overlapped");
  if (overlaps_of(ctx0, ctx1) != 0) FAIL("two devices counted as overlapping");

  /* Captures: what each forbids, and what invalidates them. */
  unsigned status = 9, relaxed = RELAXED;
  u64 id = 0;
  EXPECT(cuEventCreate(&done, 0), 0, 0);
  EXPECT(cuEventRecord(done, s1), 0, 0);
  u64 first = fake_cuda_begin_capture(s7, GLOBAL);
  EXPECT(cuStreamGetCaptureInfo_v3(s7, &status, &id, NULL, NULL, NULL, NULL), 0, 0);
  if (status != 1 || id != first) FAIL("capture info %u %llu", status, id);
  EXPECT(cuStreamGetCaptureInfo_v3(s1, &status, &id, NULL, NULL, NULL, NULL), 0, 0);
  if (status != 0) FAIL("stream 0x101 captures");
  EXPECT(cuStreamGetCaptureInfo_v3(NULL, &status, &id, NULL, NULL, NULL, NULL), IMPLICIT, 0);
  EXPECT(cuStreamGetCaptureInfo_v3((void *)1, &status, &id, NULL, NULL, NULL, NULL), IMPLICIT, 0);
  if (fake_cuda_end_capture() != 0) FAIL("a valid capture invalidated");

  fake_cuda_begin_capture(s7, GLOBAL);
  EXPECT(cuEventQuery(done), 900, 1); /* a global capture, a thread in global mode */
  if (fake_cuda_end_capture() != 1) FAIL("not invalidated");
  fake_cuda_begin_capture(s7, GLOBAL);
  EXPECT(cuMemAlloc_v2(&plain, MIB), 900, 1);
  EXPECT(cuMemFree_v2(0x1000), 900, 1);
  fake_cuda_end_capture();
  fake_cuda_begin_capture(s7, GLOBAL);
  EXPECT(cuThreadExchangeStreamCaptureMode(&relaxed), 0, 0);
  EXPECT(cuEventSynchronize(done), 0, 0); /* a relaxed thread */
  EXPECT(cuMemAlloc_v2(&plain, MIB), 0, 0);
  EXPECT(cuMemFree_v2(plain), 0, 0);
  EXPECT(cuStreamSynchronize(s7), 900, 1);   /* the capturing stream, in any mode */
  EXPECT(cuStreamSynchronize(NULL), 900, 1); /* the legacy stream waits for it */
  EXPECT(cuCtxSynchronize(), 900, 1);        /* so does the context */
  EXPECT(cuStreamSynchronize(s1), 0, 0);
  EXPECT(cuThreadExchangeStreamCaptureMode(&relaxed), 0, 0);
  if (fake_cuda_end_capture() != 1) FAIL("not invalidated by the syncs");

  fake_cuda_begin_capture(s7, THREAD_LOCAL);
  pthread_t t;
  void *r;
  pthread_create(&t, NULL, query_elsewhere, NULL);
  pthread_join(t, &r);
  if ((long)r != 0) FAIL("another thread's query refused by a thread-local capture: %ld", (long)r);
  EXPECT(cuEventQuery(done), 900, 1); /* the capturing thread itself */
  fake_cuda_end_capture();

  fake_cuda_begin_capture(s7, GLOBAL);
  void *node;
  EXPECT(cuEventCreate(&node, 0), 0, 0);
  EXPECT(cuEventRecord(node, s7), 0, 0);
  EXPECT(cuThreadExchangeStreamCaptureMode(&relaxed), 0, 0);
  EXPECT(cuEventQuery(node), 907, 1); /* recorded in the capture: in any mode */
  EXPECT(cuThreadExchangeStreamCaptureMode(&relaxed), 0, 0);
  fake_cuda_end_capture();
  fake_cuda_begin_capture(s7, RELAXED);
  EXPECT(cuEventQuery(done), 0, 0);
  if (fake_cuda_end_capture() != 0) FAIL("a relaxed capture invalidated");

  u64 s[8];
  fake_cuda_summary(s);
  if (s[3] != 0 || s[4] != 0 || s[5] != 0 || s[6] != 0 || s[7] != 0)
    FAIL("left handles %llu, mapped %llu, reservations %llu, allocations %llu, bytes %llu", s[3], s[4], s[5], s[6],
         s[7]);
  printf("misuses %llu\n", s[0]);
  return 0; /* after_exit has the last word */
}
