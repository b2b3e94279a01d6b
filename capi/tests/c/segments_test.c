/* gpualloc_snapshot_segments and gpualloc_set_segment_observer, as the torch
 * bridge uses them, on the simulated backend.
 *
 * Run by capi/tests/abi/segments.rs with GPUALLOC_BACKEND=sim, GPUALLOC_SIM_DEVICES=2,
 * GPUALLOC_SIM_CAPACITY=1GiB and GPUALLOC_CONF unset (expandable segments,
 * page moves, stitches) or set to policy:pytorch (plain segments). The
 * observer feeds a registry of ranges, as ProcessGroupNCCL registers memory
 * with NCCL; after each step every segment of the snapshot must be
 * registered, and at the end (everything freed, empty_cache) nothing may be.
 * The structs are rendered as JSON and compared with gpualloc_snapshot_json
 * byte for byte. Prints "ALL OK" at the end. */
#include "registry.h"

#define MiB ((size_t)1 << 20)

/* check_segments, with JSON, on every device together and on each one. */
static void check(const char *step) {
  for (int device = -1; device < 2; device++) check_segments(step, device, 1);
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
  /* Its growth named the pool; outside an observer's call there is no event. */
  CHECK(reg.private_events > 0);
  uint64_t pa = 5, pb = 5;
  CHECK(gpualloc_segment_event_pool(&pa, &pb) == GPUALLOC_ERR_NOT_FOUND && pa == 5 && pb == 5);
  CHECK(gpualloc_segment_event_pool(NULL, &pb) == GPUALLOC_ERR_INVALID_ARGUMENT);
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
