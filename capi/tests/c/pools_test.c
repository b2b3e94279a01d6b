/* The private-pool calls PyTorch's CUDAAllocator needs beyond capture
 * scopes: holds without a scope, use counts, emptyCache(mempool_id), live
 * allocations, and checkpoints of cudagraph trees.
 *
 * Run by capi/tests/abi/pools.rs on the simulated backend (one device) with the
 * default policy (expandable private pools). Prints "ok <section>" per
 * section and "ALL OK" at the end; the first failed check prints its line
 * and exits with status 1. Invariants are checked after every step. */
#include "check.h"
#include "gpualloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MiB ((size_t)1 << 20)

#define OK(call) CHECK((call) == GPUALLOC_OK)

#define A 3
#define B 4
#define CAP ((cudaStream_t)(uintptr_t)5)

static int contains(const char *hay, const char *needle) {
  return hay != NULL && strstr(hay, needle) != NULL;
}

static uint32_t use_count(uint64_t a, uint64_t b) {
  uint32_t n = 12345;
  OK(gpualloc_pool_use_count(0, a, b, &n));
  return n;
}

/* A capture into the pool: its scope takes a hold, dropped once it ends
 * (the pool stays held by the caller's gpualloc_create_or_incref_pool). */
static void *alloc_in_pool(size_t size) {
  OK(gpualloc_begin_allocate_to_pool(0, A, B, NULL, NULL));
  void *p = gpualloc_malloc(size, 0, CAP);
  CHECK(p != NULL);
  OK(gpualloc_end_allocate_to_pool(0, A, B));
  OK(gpualloc_release_pool(0, A, B));
  OK(gpualloc_check_invariants(0));
  return p;
}

static size_t checkpoint(GpuallocBlockState *out, size_t cap) {
  size_t n = 0;
  OK(gpualloc_pool_checkpoint(0, A, B, out, cap, &n));
  return n;
}

/* How many entries a list call needs (asked with NULL, 0). */
#define OK_OR_TOO_SMALL(rc) CHECK((rc) == GPUALLOC_OK || (rc) == GPUALLOC_ERR_BUFFER_TOO_SMALL)

static size_t live_count(void) {
  size_t n = 0;
  int rc = gpualloc_pool_live_allocations(0, A, B, NULL, 0, &n);
  OK_OR_TOO_SMALL(rc);
  return n;
}

static size_t block_count(void) {
  size_t n = 0;
  int rc = gpualloc_pool_checkpoint(0, A, B, NULL, 0, &n);
  OK_OR_TOO_SMALL(rc);
  return n;
}

static void test_holds(void) {
  /* Before the first allocation: nothing exists, and nothing is created. */
  CHECK(use_count(A, B) == 0);
  OK(gpualloc_empty_pool_cache(0, A, B));
  CHECK(gpualloc_is_initialized() == 0);
  CHECK(gpualloc_pool_use_count(0, A, B, NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(gpualloc_pool_use_count(7, A, B, &(uint32_t){0}) == GPUALLOC_ERR_INVALID_DEVICE);
  size_t n = 99;
  CHECK(gpualloc_pool_live_allocations(0, A, B, NULL, 0, &n) == GPUALLOC_ERR_UNKNOWN_POOL);
  CHECK(n == 0);
  CHECK(contains(gpualloc_last_error(), "(3, 4) on device 0"));

  OK(gpualloc_create_or_incref_pool(0, A, B));
  OK(gpualloc_create_or_incref_pool(0, A, B));
  CHECK(use_count(A, B) == 2);
  CHECK(use_count(A, 99) == 0);
  OK(gpualloc_begin_allocate_to_pool(0, A, B, NULL, NULL));
  CHECK(use_count(A, B) == 3);
  void *p = gpualloc_malloc(3 * MiB, 0, CAP);
  CHECK(p != NULL);
  OK(gpualloc_end_allocate_to_pool(0, A, B));
  CHECK(use_count(A, B) == 3);
  OK(gpualloc_release_pool(0, A, B));
  OK(gpualloc_release_pool(0, A, B));
  CHECK(use_count(A, B) == 1);
  gpualloc_free(p, 3 * MiB, 0, CAP);
  /* Held: emptying its cache leaves it alone. */
  size_t blocks = block_count();
  CHECK(blocks > 0);
  OK(gpualloc_empty_pool_cache(0, A, B));
  CHECK(block_count() == blocks);
  OK(gpualloc_release_pool(0, A, B));
  CHECK(use_count(A, B) == 0);
  CHECK(gpualloc_release_pool(0, A, B) == GPUALLOC_ERR_UNKNOWN_POOL);
  OK(gpualloc_empty_pool_cache(0, A, B));
  OK(gpualloc_empty_pool_cache(0, 77, 77));
  /* Released to zero while a block lives: cached once it is freed, until
   * emptyCache(mempool_id) gives the memory back and forgets the pool. */
  OK(gpualloc_create_or_incref_pool(0, A, B));
  p = alloc_in_pool(MiB);
  OK(gpualloc_release_pool(0, A, B));
  CHECK(use_count(A, B) == 0 && live_count() == 1);
  gpualloc_free(p, MiB, 0, CAP);
  CHECK(block_count() > 0);
  OK(gpualloc_empty_pool_cache(0, A, B));
  n = 99;
  CHECK(gpualloc_pool_checkpoint(0, A, B, NULL, 0, &n) == GPUALLOC_ERR_UNKNOWN_POOL && n == 0);
  OK(gpualloc_check_invariants(0));
  SECTION_OK("holds");
}

static void test_live_allocations(void) {
  OK(gpualloc_create_or_incref_pool(0, A, B));
  void *p = alloc_in_pool(4096);
  void *q = alloc_in_pool(12 * MiB);
  void *outside = gpualloc_malloc(4096, 0, CAP);
  size_t n = 0;
  CHECK(gpualloc_pool_live_allocations(0, A, B, NULL, 0, &n) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(n == 2);
  CHECK(contains(gpualloc_last_error(), "needs 2 entries, 0 given"));
  uint64_t live[3] = {0, 0, 7};
  CHECK(gpualloc_pool_live_allocations(0, A, B, live, 1, &n) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(n == 2 && live[0] == 0);
  CHECK(gpualloc_pool_live_allocations(0, A, B, NULL, 2, &n) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(gpualloc_pool_live_allocations(0, A, B, live, 3, NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  OK(gpualloc_pool_live_allocations(0, A, B, live, 3, &n));
  CHECK(n == 2 && live[2] == 7);
  uint64_t lo = (uint64_t)(uintptr_t)p < (uint64_t)(uintptr_t)q ? (uint64_t)(uintptr_t)p : (uint64_t)(uintptr_t)q;
  CHECK(live[0] == lo && live[0] < live[1]);
  CHECK(live[0] != (uint64_t)(uintptr_t)outside && live[1] != (uint64_t)(uintptr_t)outside);
  gpualloc_free(p, 4096, 0, CAP);
  gpualloc_free(q, 12 * MiB, 0, CAP);
  gpualloc_free(outside, 4096, 0, CAP);
  CHECK(live_count() == 0);
  SECTION_OK("live_allocations");
}

static void test_checkpoint_restore(void) {
  /* The pool of test_live_allocations, held once. */
  void *a = alloc_in_pool(12 * MiB);
  void *b = alloc_in_pool(8 * MiB);
  void *c = alloc_in_pool(30 * MiB);
  gpualloc_free(b, 8 * MiB, 0, CAP);
  size_t n = 0;
  CHECK(gpualloc_pool_checkpoint(0, A, B, NULL, 0, &n) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(n >= 3);
  GpuallocBlockState *ck = calloc(n, sizeof *ck);
  CHECK(ck != NULL);
  CHECK(checkpoint(ck, n) == n);
  size_t allocated = 0;
  for (size_t i = 0; i < n; i++) {
    CHECK(ck[i].stream == (uint64_t)(uintptr_t)CAP);
    CHECK(ck[i].segment_address <= ck[i].address);
    CHECK(i == 0 || ck[i - 1].address + ck[i - 1].size <= ck[i].address);
    allocated += ck[i].allocated;
  }
  CHECK(allocated == 2);

  /* The tree goes on, and the pool grows. */
  gpualloc_free(a, 12 * MiB, 0, CAP);
  void *d = alloc_in_pool(6 * MiB);
  void *e = alloc_in_pool(100 * MiB);
  (void)d;
  (void)e;

  uint64_t freed[8], allocd[8];
  size_t n_freed = 99, n_allocd = 99;
  /* Too small: the counts come back, and nothing changes. */
  CHECK(gpualloc_pool_restore(0, A, B, ck, n, freed, 2, &n_freed, allocd, 8, &n_allocd) ==
        GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(n_freed == 3 && n_allocd == 2);
  CHECK(contains(gpualloc_last_error(), "freed needs 3 entries, 2 given"));
  size_t live_n = 0;
  uint64_t live[3];
  OK(gpualloc_pool_live_allocations(0, A, B, live, 3, &live_n));
  CHECK(live_n == 3);
  CHECK(gpualloc_pool_restore(0, A, B, ck, n, freed, 8, &n_freed, allocd, 1, &n_allocd) ==
        GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(n_freed == 3 && n_allocd == 2);
  /* Invalid: overlapping blocks; a NULL array with blocks; nothing changes. */
  GpuallocBlockState twice[2] = {ck[0], ck[0]};
  CHECK(gpualloc_pool_restore(0, A, B, twice, 2, freed, 8, &n_freed, allocd, 8, &n_allocd) ==
        GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(contains(gpualloc_last_error(), "overlap") &&
        contains(gpualloc_last_error(), "private pool (3, 4) on device 0"));
  CHECK(n_freed == 0 && n_allocd == 0);
  CHECK(gpualloc_pool_restore(0, A, B, NULL, 1, freed, 8, &n_freed, allocd, 8, &n_allocd) ==
        GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(gpualloc_pool_restore(0, 8, 8, ck, n, freed, 8, &n_freed, allocd, 8, &n_allocd) ==
        GPUALLOC_ERR_UNKNOWN_POOL);
  uint64_t still[3];
  OK(gpualloc_pool_live_allocations(0, A, B, still, 3, &live_n));
  CHECK(live_n == 3 && memcmp(still, live, sizeof live) == 0);
  OK(gpualloc_check_invariants(0));

  /* The restore. */
  OK(gpualloc_pool_restore(0, A, B, ck, n, freed, 8, &n_freed, allocd, 8, &n_allocd));
  CHECK(n_freed == 3 && memcmp(freed, live, sizeof live) == 0);
  CHECK(n_allocd == 2);
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (ck[i].allocated) CHECK(allocd[k++] == ck[i].address);
  }
  int c_in_both = 0;
  for (size_t i = 0; i < n_freed; i++) c_in_both |= freed[i] == (uint64_t)(uintptr_t)c;
  CHECK(c_in_both);
  OK(gpualloc_check_invariants(0));
  /* The checkpointed blocks are back exactly. */
  size_t m = block_count();
  GpuallocBlockState *now = calloc(m, sizeof *now);
  CHECK(now != NULL && checkpoint(now, m) == m);
  for (size_t i = 0; i < n; i++) {
    if (!ck[i].allocated) continue;
    int found = 0;
    for (size_t j = 0; j < m; j++) {
      found |= now[j].address == ck[i].address && now[j].size == ck[i].size && now[j].allocated;
    }
    CHECK(found);
  }
  CHECK(live_count() == 2);
  for (k = 0; k < n_allocd; k++) gpualloc_free((void *)(uintptr_t)allocd[k], 0, 0, CAP);
  free(ck);
  free(now);
  OK(gpualloc_release_pool(0, A, B));
  OK(gpualloc_empty_pool_cache(0, A, B));
  CHECK(use_count(A, B) == 0);
  OK(gpualloc_check_invariants(0));
  SECTION_OK("checkpoint_restore");
}

/* Another allocator serving a pool (torch.cuda.MemPool(allocator=...)):
 * hands out addresses of its own from a static arena (the simulated device
 * never touches them), counts its calls, and is dropped exactly once. */
struct other {
  uintptr_t next;
  int allocs, frees, drops;
  size_t out;
};

static void *other_alloc(void *ctx, size_t size, int device, cudaStream_t stream) {
  struct other *o = ctx;
  (void)device;
  (void)stream;
  if (o->out + size > 64 * MiB) {
    return NULL;
  }
  void *p = (void *)o->next;
  o->next += size;
  o->out += size;
  o->allocs++;
  return p;
}

static void other_free(void *ctx, void *ptr, size_t size, int device, cudaStream_t stream) {
  struct other *o = ctx;
  (void)ptr;
  (void)device;
  (void)stream;
  o->out -= size;
  o->frees++;
}

static void other_drop(void *ctx) { ((struct other *)ctx)->drops++; }

static void test_served_pool(void) {
  struct other o = {(uintptr_t)0x5f0000000000ull, 0, 0, 0, 0};
  GpuallocSegmentSource src = {&o, other_alloc, other_free, other_drop, "test allocator"};
  const uint64_t a = 77, b = 0;
  OK(gpualloc_create_or_incref_pool_from(0, a, b, &src));
  OK(gpualloc_begin_allocate_to_pool(0, a, b, NULL, NULL));
  void *p = gpualloc_malloc(5 * MiB, 0, CAP);
  void *q = gpualloc_malloc(1000, 0, CAP);
  CHECK(p != NULL && q != NULL);
  CHECK(o.allocs == 2 && o.out == 22 * MiB); /* 20 MiB and 2 MiB, PyTorch's sizes */
  CHECK((uintptr_t)p >= 0x5f0000000000ull && (uintptr_t)p < o.next);
  /* The other allocator full: out of memory, not a crash. */
  CHECK(gpualloc_malloc(50 * MiB, 0, CAP) == NULL);
  CHECK(gpualloc_last_error_code() == GPUALLOC_ERR_OUT_OF_MEMORY);
  OK(gpualloc_end_allocate_to_pool(0, a, b));
  OK(gpualloc_release_pool(0, a, b));
  OK(gpualloc_check_invariants(0));
  gpualloc_free(p, 5 * MiB, 0, CAP);
  gpualloc_free(q, 1000, 0, CAP);
  OK(gpualloc_release_pool(0, a, b));
  CHECK(o.frees == 2 && o.out == 0 && o.drops == 1);
  OK(gpualloc_check_invariants(0));
  /* Refused sources are dropped too. */
  GpuallocSegmentSource bad = {&o, NULL, other_free, other_drop, NULL};
  CHECK(gpualloc_create_or_incref_pool_from(0, 78, 0, &bad) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(contains(gpualloc_last_error(), "source->alloc"));
  CHECK(o.drops == 2);
  CHECK(gpualloc_create_or_incref_pool_from(0, 78, 0, NULL) == GPUALLOC_ERR_INVALID_ARGUMENT);
  printf("ok served pool\n");
}

/* Whether the segment holding p is expandable memory, and its pool. */
static int expandable_at(void *p, uint64_t *pool_a) {
  GpuallocSegmentInfo segs[64];
  GpuallocBlockInfo blocks[256];
  size_t n = 0;
  OK(gpualloc_snapshot_segments(0, 0, 0, 0, segs, 64, &n, blocks, 256, NULL));
  for (size_t i = 0; i < n; i++) {
    if (segs[i].address <= (uintptr_t)p && (uintptr_t)p < segs[i].address + segs[i].total_size) {
      *pool_a = segs[i].pool_a;
      return segs[i].is_expandable;
    }
  }
  CHECK(!"pointer in no segment");
  return -1;
}

/* PyTorch's expandable_segments switched off: plain segments, reported in
 * the default pools; a pool created meanwhile stays plain; on again,
 * expandable memory. Told before the start, it is kept for it. */
static void test_plain_requests(void) {
  uint64_t pool = 99;
  OK(gpualloc_set_plain_requests(1));
  void *p = gpualloc_malloc(30 * MiB, 0, NULL);
  CHECK(p != NULL);
  CHECK(expandable_at(p, &pool) == 0 && pool == 0);
  OK(gpualloc_create_or_incref_pool(0, 9, 0));
  OK(gpualloc_set_plain_requests(0));
  void *q = gpualloc_malloc(30 * MiB, 0, NULL);
  CHECK(expandable_at(q, &pool) == 1 && pool == 0);
  OK(gpualloc_begin_allocate_to_pool(0, 9, 0, NULL, NULL));
  void *r = gpualloc_malloc(30 * MiB, 0, CAP);
  OK(gpualloc_end_allocate_to_pool(0, 9, 0));
  CHECK(expandable_at(r, &pool) == 0 && pool == 9);
  OK(gpualloc_check_invariants(0));
  gpualloc_free(p, 0, 0, NULL);
  gpualloc_free(q, 0, 0, NULL);
  gpualloc_free(r, 0, 0, CAP);
  OK(gpualloc_release_pool(0, 9, 0));
  gpualloc_empty_cache();
  OK(gpualloc_check_invariants(0));
  printf("ok plain requests\n");
}

int main(void) {
  /* Told before the start: kept, and starts nothing. */
  OK(gpualloc_set_plain_requests(1));
  OK(gpualloc_set_plain_requests(0));
  CHECK(gpualloc_is_initialized() == 0);
  test_holds();
  test_served_pool();
  test_live_allocations();
  test_checkpoint_restore();
  test_plain_requests();
  printf("ALL OK\n");
  return 0;
}
