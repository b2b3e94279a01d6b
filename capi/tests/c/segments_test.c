/* gpualloc_snapshot_segments and gpualloc_set_segment_observer, as the torch
 * bridge uses them, on the simulated backend.
 *
 * Run by capi/tests/abi.rs with GPUALLOC_BACKEND=sim, GPUALLOC_SIM_DEVICES=2,
 * GPUALLOC_SIM_CAPACITY=1GiB and GPUALLOC_CONF unset (expandable segments,
 * page moves, stitches) or set to policy:pytorch (plain segments). The
 * observer feeds a registry of ranges, as ProcessGroupNCCL registers memory
 * with NCCL; after each step every segment of the snapshot must be
 * registered, and at the end (everything freed, empty_cache) nothing may be.
 * The structs are rendered as JSON and compared with gpualloc_snapshot_json
 * byte for byte. Prints "ALL OK" at the end. */
#include "gpualloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MiB ((size_t)1 << 20)

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      const char *e_ = gpualloc_last_error();                                    \
      fprintf(stderr, "FAILED %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, \
              #cond, e_ ? e_ : "none");                                          \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

/* torch 2.11, c10/core/CachingDeviceAllocator.h: TraceEntry::Action is
 * ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE,
 * SEGMENT_MAP, SEGMENT_UNMAP, SNAPSHOT, OOM. */
_Static_assert(GPUALLOC_SEGMENT_ALLOC == 3, "TraceEntry::SEGMENT_ALLOC");
_Static_assert(GPUALLOC_SEGMENT_FREE == 4, "TraceEntry::SEGMENT_FREE");
_Static_assert(GPUALLOC_SEGMENT_MAP == 5, "TraceEntry::SEGMENT_MAP");
_Static_assert(GPUALLOC_SEGMENT_UNMAP == 6, "TraceEntry::SEGMENT_UNMAP");

/* ---- The registry: disjoint ranges sorted by start, per device ---- */

#define MAX_RANGES 4096
typedef struct {
  uint64_t lo, hi;
} Range;
typedef struct {
  Range r[2][MAX_RANGES];
  size_t n[2];
  long events[16];
  int bad; /* a contract violation, reported by check() */
  char why[200];
} Registry;

static Registry reg;

static void fail(const char *what, uint64_t lo, uint64_t hi) {
  if (!reg.bad) snprintf(reg.why, sizeof reg.why, "%s %#llx..%#llx", what,
                         (unsigned long long)lo, (unsigned long long)hi);
  reg.bad = 1;
}

static void reg_add(int d, uint64_t lo, uint64_t hi) {
  Range *r = reg.r[d];
  size_t n = reg.n[d], i = 0;
  while (i < n && r[i].hi <= lo) i++;
  if (i < n && r[i].lo < hi) return fail("registered twice:", lo, hi);
  if (n == MAX_RANGES) return fail("too many ranges:", lo, hi);
  memmove(&r[i + 1], &r[i], (n - i) * sizeof *r);
  r[i].lo = lo;
  r[i].hi = hi;
  reg.n[d] = n + 1;
}

static void reg_remove(int d, uint64_t lo, uint64_t hi) {
  Range *r = reg.r[d];
  size_t n = reg.n[d];
  /* Ranges registered one after another may be removed as one. */
  size_t i = 0;
  while (i < n && r[i].hi <= lo) i++;
  if (i == n || r[i].lo > lo) return fail("never registered:", lo, hi);
  size_t j = i;
  while (j + 1 < n && r[j].hi < hi && r[j + 1].lo == r[j].hi) j++;
  if (r[j].hi < hi) return fail("not all registered:", lo, hi);
  Range head = {r[i].lo, lo}, tail = {hi, r[j].hi};
  memmove(&r[i], &r[j + 1], (n - j - 1) * sizeof *r);
  n -= j + 1 - i;
  reg.n[d] = n;
  if (head.lo < head.hi) reg_add(d, head.lo, head.hi);
  if (tail.lo < tail.hi) reg_add(d, tail.lo, tail.hi);
}

static int registered(int d, uint64_t lo, uint64_t hi) {
  for (size_t i = 0; i < reg.n[d]; i++) {
    if (reg.r[d][i].lo <= lo) {
      uint64_t end = reg.r[d][i].hi;
      size_t j = i;
      while (end < hi && j + 1 < reg.n[d] && reg.r[d][j + 1].lo == end) end = reg.r[d][++j].hi;
      if (lo < end) return hi <= end;
    }
  }
  return 0;
}

static void observer(void *ctx, int device, int action, uint64_t address, uint64_t size,
                     uint64_t stream) {
  (void)stream;
  if (ctx != &reg || device < 0 || device > 1 || size == 0 || action < 0 || action > 15) {
    return fail("bad event:", address, size);
  }
  reg.events[action]++;
  switch (action) {
    case GPUALLOC_SEGMENT_ALLOC:
    case GPUALLOC_SEGMENT_MAP:
      reg_add(device, address, address + size);
      break;
    case GPUALLOC_SEGMENT_FREE:
    case GPUALLOC_SEGMENT_UNMAP:
      reg_remove(device, address, address + size);
      break;
    default:
      fail("unknown action:", address, size);
  }
}

/* ---- Snapshots ---- */

typedef struct {
  GpuallocSegmentInfo *segs;
  GpuallocBlockInfo *blocks;
  size_t ns, nb;
} Snap;

static Snap snap(int device, int only_pool, uint64_t a, uint64_t b) {
  Snap s = {NULL, NULL, 0, 0};
  for (;;) {
    size_t ns = 0, nb = 0;
    int rc = gpualloc_snapshot_segments(device, only_pool, a, b, s.segs, s.ns, &ns, s.blocks,
                                        s.nb, &nb);
    if (rc == GPUALLOC_OK) {
      CHECK(ns <= s.ns && nb <= s.nb);
      s.ns = ns;
      s.nb = nb;
      return s;
    }
    CHECK(rc == GPUALLOC_ERR_BUFFER_TOO_SMALL);
    CHECK(ns > s.ns || nb > s.nb);
    free(s.segs);
    free(s.blocks);
    s.ns = ns;
    s.nb = nb;
    s.segs = calloc(ns + 1, sizeof *s.segs);
    s.blocks = calloc(nb + 1, sizeof *s.blocks);
  }
}

static void unsnap(Snap *s) {
  free(s->segs);
  free(s->blocks);
}

static const char *state_name(uint8_t s) {
  return s == 1 ? "active_allocated" : s == 2 ? "active_pending_free" : "inactive";
}

/* The JSON gpualloc_snapshot_json writes, rebuilt from the structs. */
static char *render(const Snap *s) {
  size_t cap = 64 + s->ns * 512 + s->nb * 160, len = 0;
  char *out = malloc(cap);
  CHECK(out != NULL);
#define PUT(...) len += (size_t)snprintf(out + len, cap - len, __VA_ARGS__)
  PUT("{\"segments\":[");
  for (size_t i = 0; i < s->ns; i++) {
    const GpuallocSegmentInfo *g = &s->segs[i];
    unsigned long long allocated = 0, active = 0, requested = 0;
    for (uint64_t k = g->first_block; k < g->first_block + g->num_blocks; k++) {
      const GpuallocBlockInfo *b = &s->blocks[k];
      if (b->state == 1) allocated += b->size;
      if (b->state != 0) {
        active += b->size;
        requested += b->requested_size;
      }
    }
    PUT("%s{\"device\":%d,\"address\":%llu,\"total_size\":%llu,\"allocated_size\":%llu,"
        "\"active_size\":%llu,\"requested_size\":%llu,\"stream\":%llu,\"segment_type\":\"%s\","
        "\"segment_pool_id\":[%llu,%llu],\"is_expandable\":%s,\"blocks\":[",
        i ? "," : "", g->device, (unsigned long long)g->address,
        (unsigned long long)g->total_size, allocated, active, requested,
        (unsigned long long)g->stream, g->is_large ? "large" : "small",
        (unsigned long long)g->pool_a, (unsigned long long)g->pool_b,
        g->is_expandable ? "true" : "false");
    for (uint64_t k = g->first_block; k < g->first_block + g->num_blocks; k++) {
      const GpuallocBlockInfo *b = &s->blocks[k];
      PUT("%s{\"address\":%llu,\"size\":%llu,\"requested_size\":%llu,\"state\":\"%s\"}",
          k > g->first_block ? "," : "", (unsigned long long)b->address,
          (unsigned long long)b->size, (unsigned long long)b->requested_size,
          state_name(b->state));
    }
    PUT("]}");
  }
  PUT("]}");
#undef PUT
  CHECK(len < cap);
  return out;
}

static char *json(int device) {
  size_t needed = 0;
  CHECK(gpualloc_snapshot_json(device, NULL, 0, &needed) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  char *buf = malloc(needed);
  CHECK(buf != NULL);
  CHECK(gpualloc_snapshot_json(device, buf, needed, NULL) == GPUALLOC_OK);
  return buf;
}

/* Structs and JSON agree; blocks tile their segments; every segment is
 * registered; the registry saw no violation. */
static void check(const char *step) {
  if (reg.bad) {
    fprintf(stderr, "FAILED after %s: %s\n", step, reg.why);
    exit(1);
  }
  for (int device = -1; device < 2; device++) {
    Snap s = snap(device, 0, 0, 0);
    char *mine = render(&s), *theirs = json(device);
    if (strcmp(mine, theirs) != 0) {
      fprintf(stderr, "FAILED after %s: device %d\nstructs: %s\njson:    %s\n", step, device,
                      mine, theirs);
      exit(1);
    }
    free(mine);
    free(theirs);
    uint64_t next_block = 0;
    for (size_t i = 0; i < s.ns; i++) {
      const GpuallocSegmentInfo *g = &s.segs[i];
      CHECK(g->first_block == next_block && g->num_blocks > 0);
      next_block += g->num_blocks;
      CHECK(device < 0 || g->device == device);
      uint64_t at = g->address;
      for (uint64_t k = g->first_block; k < next_block; k++) {
        CHECK(s.blocks[k].address == at && s.blocks[k].state <= 2);
        at += s.blocks[k].size;
      }
      CHECK(at == g->address + g->total_size);
      if (!registered(g->device, g->address, at)) {
        fprintf(stderr, "FAILED after %s: segment %#llx+%llu is not registered\n", step,
                (unsigned long long)g->address, (unsigned long long)g->total_size);
        exit(1);
      }
    }
    CHECK(next_block == s.nb);
    unsnap(&s);
  }
}

int main(void) {
  int plain = getenv("GPUALLOC_CONF") != NULL;
  cudaStream_t s0 = NULL, s7 = (cudaStream_t)(uintptr_t)7;

  /* Nothing allocated: empty, and the allocator is not started by asking. */
  size_t ns = 99, nb = 99;
  CHECK(gpualloc_snapshot_segments(-1, 0, 0, 0, NULL, 0, &ns, NULL, 0, &nb) == GPUALLOC_OK);
  CHECK(ns == 0 && nb == 0);
  CHECK(gpualloc_snapshot_segments(5, 0, 0, 0, NULL, 0, &ns, NULL, 0, &nb) ==
        GPUALLOC_ERR_INVALID_DEVICE);
  /* Installed before the allocator starts. */
  CHECK(gpualloc_set_segment_observer(observer, &reg) == GPUALLOC_OK);
  check("start");

  /* Growth on two devices and two streams. */
  void *p[64] = {0};
  size_t sizes[] = {4096, 3 * MiB, 50 * MiB, 700, 12 * MiB, 90 * MiB, 1 * MiB, 30 * MiB};
  for (int i = 0; i < 32; i++) {
    int d = i % 5 == 4;
    p[i] = gpualloc_malloc(sizes[i % 8] + (size_t)i * 512, d, i % 3 ? s0 : s7);
    CHECK(p[i] != NULL);
  }
  check("growth");
  CHECK(reg.n[0] > 0 && reg.n[1] > 0);

  /* Caps too small: the counts come back, nothing is written. */
  CHECK(gpualloc_snapshot_segments(0, 0, 0, 0, NULL, 0, &ns, NULL, 0, &nb) ==
        GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(ns > 0 && nb >= ns);
  GpuallocSegmentInfo *segs = calloc(ns, sizeof *segs);
  GpuallocBlockInfo *blocks = calloc(nb, sizeof *blocks);
  size_t ns2 = 0, nb2 = 0;
  CHECK(gpualloc_snapshot_segments(0, 0, 0, 0, segs, ns, &ns2, blocks, nb - 1, &nb2) ==
        GPUALLOC_ERR_BUFFER_TOO_SMALL);
  CHECK(ns2 == ns && nb2 == nb && segs[0].num_blocks == 0);
  CHECK(gpualloc_snapshot_segments(0, 0, 0, 0, segs, ns, &ns2, blocks, nb, &nb2) == GPUALLOC_OK);
  CHECK(ns2 == ns && nb2 == nb && segs[0].num_blocks > 0);
  free(segs);
  free(blocks);

  /* Frees in a scattered order, then larger requests: page moves and
   * stitches under the default configuration. */
  for (int i = 0; i < 32; i += 2) gpualloc_free(p[i], 0, i % 5 == 4, i % 3 ? s0 : s7);
  check("scattered frees");
  for (int i = 32; i < 40; i++) {
    p[i] = gpualloc_malloc(120 * MiB + (size_t)i * MiB, 0, s0);
  }
  check("large requests");

  /* A graph pool on device 0: captured, filtered out, released. */
  CHECK(gpualloc_begin_allocate_to_pool(0, 42, 7, NULL, NULL) == GPUALLOC_OK);
  void *g1 = gpualloc_malloc(8 * MiB, 0, s0), *g2 = gpualloc_malloc(4096, 0, s0);
  CHECK(g1 != NULL && g2 != NULL);
  CHECK(gpualloc_end_allocate_to_pool(0, 42, 7) == GPUALLOC_OK);
  check("capture");
  Snap pool = snap(0, 1, 42, 7), all = snap(0, 0, 0, 0);
  CHECK(pool.ns >= 2);
  size_t matched = 0;
  for (size_t i = 0; i < all.ns; i++) {
    if (all.segs[i].pool_a == 42 && all.segs[i].pool_b == 7) {
      GpuallocSegmentInfo a = all.segs[i], b = pool.segs[matched];
      CHECK(a.address == b.address && a.total_size == b.total_size && a.num_blocks == b.num_blocks);
      CHECK(memcmp(&all.blocks[a.first_block], &pool.blocks[b.first_block],
                   a.num_blocks * sizeof *all.blocks) == 0);
      matched++;
    }
  }
  CHECK(matched == pool.ns);
  unsnap(&pool);
  unsnap(&all);
  Snap none = snap(0, 1, 43, 7);
  CHECK(none.ns == 0 && none.nb == 0);
  unsnap(&none);
  gpualloc_free(g1, 0, 0, s0);
  gpualloc_free(g2, 0, 0, s0);
  CHECK(gpualloc_release_pool(0, 42, 7) == GPUALLOC_OK);
  check("pool released");

  gpualloc_empty_cache();
  check("empty_cache");

  /* Everything back: nothing registered. */
  for (int i = 0; i < 40; i++) {
    if (p[i] != NULL && (i % 2 == 1 || i >= 32)) {
      gpualloc_free(p[i], 0, i < 32 && i % 5 == 4, i < 32 && i % 3 == 0 ? s7 : s0);
    }
  }
  check("all freed");
  gpualloc_empty_cache();
  check("emptied");
  CHECK(reg.n[0] == 0 && reg.n[1] == 0);
  if (plain) {
    CHECK(reg.events[GPUALLOC_SEGMENT_ALLOC] > 0 && reg.events[GPUALLOC_SEGMENT_FREE] > 0);
    CHECK(reg.events[GPUALLOC_SEGMENT_MAP] == 0 && reg.events[GPUALLOC_SEGMENT_UNMAP] == 0);
  } else {
    CHECK(reg.events[GPUALLOC_SEGMENT_MAP] > 0 && reg.events[GPUALLOC_SEGMENT_UNMAP] > 0);
    CHECK(reg.events[GPUALLOC_SEGMENT_ALLOC] == 0 && reg.events[GPUALLOC_SEGMENT_FREE] == 0);
  }

  /* Removed: no more calls. */
  CHECK(gpualloc_set_segment_observer(NULL, NULL) == GPUALLOC_OK);
  long before = 0, after = 0;
  for (int a = 0; a < 16; a++) before += reg.events[a];
  void *q = gpualloc_malloc(64 * MiB, 1, s0);
  CHECK(q != NULL);
  gpualloc_free(q, 0, 1, s0);
  gpualloc_empty_cache();
  for (int a = 0; a < 16; a++) after += reg.events[a];
  CHECK(before == after);

  printf("events: alloc %ld free %ld map %ld unmap %ld\n", reg.events[GPUALLOC_SEGMENT_ALLOC],
         reg.events[GPUALLOC_SEGMENT_FREE], reg.events[GPUALLOC_SEGMENT_MAP],
         reg.events[GPUALLOC_SEGMENT_UNMAP]);
  printf("ALL OK\n");
  return 0;
}
