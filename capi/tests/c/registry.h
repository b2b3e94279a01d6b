/* A consumer of gpualloc's segment events and structured snapshots, shared
 * by segments_test.c and fuzz_abi.c: a registry of the ranges announced by
 * the observer (registered on SEGMENT_ALLOC and SEGMENT_MAP, deregistered on
 * SEGMENT_FREE and SEGMENT_UNMAP, as ProcessGroupNCCL does with NCCL), each
 * with the pool gpualloc_segment_event_pool names (ProcessGroupNCCL
 * registers a MemPool's segments by it; a range must leave the pool it
 * entered), and check_segments(), which fails the program unless every
 * segment of gpualloc_snapshot_segments is registered in its own pool, its
 * blocks tile it, and the structs rendered as JSON equal
 * gpualloc_snapshot_json byte for byte. */
#ifndef GPUALLOC_TEST_REGISTRY_H
#define GPUALLOC_TEST_REGISTRY_H

#include "gpualloc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

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
  uint64_t pool_a, pool_b; /* the pool its event named */
} Range;
typedef struct {
  Range r[2][MAX_RANGES];
  size_t n[2];
  long events[16];
  long private_events; /* events that named a private pool */
  int bad; /* a contract violation, reported by check() */
  char why[200];
} Registry;

static Registry reg;

static void fail(const char *what, uint64_t lo, uint64_t hi) {
  if (!reg.bad) snprintf(reg.why, sizeof reg.why, "%s %#llx..%#llx", what,
                         (unsigned long long)lo, (unsigned long long)hi);
  reg.bad = 1;
}

static void reg_add(int d, uint64_t lo, uint64_t hi, uint64_t pa, uint64_t pb) {
  Range *r = reg.r[d];
  size_t n = reg.n[d], i = 0;
  while (i < n && r[i].hi <= lo) i++;
  if (i < n && r[i].lo < hi) { fail("registered twice:", lo, hi); return; }
  if (n == MAX_RANGES) { fail("too many ranges:", lo, hi); return; }
  memmove(&r[i + 1], &r[i], (n - i) * sizeof *r);
  r[i].lo = lo;
  r[i].hi = hi;
  r[i].pool_a = pa;
  r[i].pool_b = pb;
  reg.n[d] = n + 1;
}

static void reg_remove(int d, uint64_t lo, uint64_t hi, uint64_t pa, uint64_t pb) {
  Range *r = reg.r[d];
  size_t n = reg.n[d];
  /* Ranges registered one after another may be removed as one. */
  size_t i = 0;
  while (i < n && r[i].hi <= lo) i++;
  if (i == n || r[i].lo > lo) { fail("never registered:", lo, hi); return; }
  size_t j = i;
  while (j + 1 < n && r[j].hi < hi && r[j + 1].lo == r[j].hi) j++;
  if (r[j].hi < hi) { fail("not all registered:", lo, hi); return; }
  for (size_t k = i; k <= j; k++) {
    if (r[k].pool_a != pa || r[k].pool_b != pb) { fail("removed from another pool:", lo, hi); return; }
  }
  Range head = r[i], tail = r[j];
  head.hi = lo;
  tail.lo = hi;
  memmove(&r[i], &r[j + 1], (n - j - 1) * sizeof *r);
  n -= j + 1 - i;
  reg.n[d] = n;
  if (head.lo < head.hi) reg_add(d, head.lo, head.hi, head.pool_a, head.pool_b);
  if (tail.lo < tail.hi) reg_add(d, tail.lo, tail.hi, tail.pool_a, tail.pool_b);
}

/* Whether [lo, hi) is registered, all of it in pool (pa, pb). */
static int registered(int d, uint64_t lo, uint64_t hi, uint64_t pa, uint64_t pb) {
  for (size_t i = 0; i < reg.n[d]; i++) {
    if (reg.r[d][i].lo <= lo) {
      uint64_t end = reg.r[d][i].hi;
      size_t j = i;
      while (end < hi && j + 1 < reg.n[d] && reg.r[d][j + 1].lo == end) end = reg.r[d][++j].hi;
      if (lo < end) {
        for (size_t k = i; k <= j; k++) {
          int overlaps = reg.r[d][k].hi > lo && reg.r[d][k].lo < hi;
          if (overlaps && (reg.r[d][k].pool_a != pa || reg.r[d][k].pool_b != pb)) return 0;
        }
        return hi <= end;
      }
    }
  }
  return 0;
}

static void observer(void *ctx, int device, int action, uint64_t address, uint64_t size,
                     uint64_t stream) {
  (void)stream;
  if (ctx != &reg || device < 0 || device > 1 || size == 0 || action < 0 || action > 15) {
    { fail("bad event:", address, size); return; }
  }
  reg.events[action]++;
  uint64_t pa = 99, pb = 99;
  if (gpualloc_segment_event_pool(&pa, &pb) != GPUALLOC_OK) { fail("no pool for the event:", address, size); return; }
  reg.private_events += pa != 0 || pb != 0;
  switch (action) {
    case GPUALLOC_SEGMENT_ALLOC:
    case GPUALLOC_SEGMENT_MAP:
    case GPUALLOC_SEGMENT_MAP_UNLISTED:
      reg_add(device, address, address + size, pa, pb);
      break;
    case GPUALLOC_SEGMENT_FREE:
    case GPUALLOC_SEGMENT_UNMAP:
    case GPUALLOC_SEGMENT_UNMAP_UNLISTED:
      reg_remove(device, address, address + size, pa, pb);
      break;
    case GPUALLOC_SEGMENT_LISTED:
    case GPUALLOC_SEGMENT_UNLISTED:
      break; /* the snapshot's view: backed memory does not change */
    case GPUALLOC_BLOCK_FREE_DEFERRED:
    case GPUALLOC_BLOCK_FREE_COMPLETED:
      /* a block's free, not a range's change: the block is backed memory */
      if (!registered(device, address, address + size, pa, pb)) fail("a block freed outside its pool's backed memory:", address, size);
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

/* For `device` (-1: every device): blocks tile their segments; every
 * segment is registered; the registry saw no violation; with `with_json`,
 * the structs rendered as JSON equal gpualloc_snapshot_json. */
static void check_segments(const char *step, int device, int with_json) {
  if (reg.bad) {
    fprintf(stderr, "FAILED after %s: %s\n", step, reg.why);
    exit(1);
  }
  {
    Snap s = snap(device, 0, 0, 0);
    char *mine = with_json ? render(&s) : NULL, *theirs = with_json ? json(device) : NULL;
    if (with_json && strcmp(mine, theirs) != 0) {
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
      if (!registered(g->device, g->address, at, g->pool_a, g->pool_b)) {
        fprintf(stderr, "FAILED after %s: segment %#llx+%llu of pool (%llu, %llu) is not registered in it\n", step,
                (unsigned long long)g->address, (unsigned long long)g->total_size,
                (unsigned long long)g->pool_a, (unsigned long long)g->pool_b);
        exit(1);
      }
    }
    CHECK(next_block == s.nb);
    unsnap(&s);
  }
}

#endif
