//! The cache-miss callback and the segment observer's deferred frees.

use crate::support::{build_inline, ran_to_done, run_sim};
use std::path::Path;

/// Note [Free-memory callbacks]: with a miss callback set, a request that
/// finds no cached block runs it before growing, with the device let go,
/// so that memory it frees serves the request; a hit does not run it, nor
/// does an allocation made inside it, and NULL takes it away.
#[test]
fn a_cache_miss_runs_the_callback_before_growing() {
    let (_out, exe) = build_inline(
        "miss_callback",
        r#"#include "gpualloc.h"
#include <stdio.h>
#include <string.h>
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s\n", __LINE__, #c); return 1; } } while (0)
#define MiB (1024u * 1024u)
static int calls = 0, last_device = -1;
static void *to_free = NULL;
static int on_miss(void *ctx, int device) {
  (void)ctx;
  calls++;
  last_device = device;
  if (calls == 1) { /* a miss inside: it runs nothing */
    void *inner = gpualloc_malloc(3 * MiB, device, 0);
    if (inner != NULL) gpualloc_free(inner, 3 * MiB, device, 0);
  }
  if (to_free != NULL) {
    gpualloc_free(to_free, 32 * MiB, device, 0); /* needs the device */
    to_free = NULL;
    return 1;
  }
  return 0;
}
static int64_t reserved(void) {
  GpuallocStats s;
  memset(&s, 0, sizeof s);
  s.size = (uint32_t)sizeof s;
  if (gpualloc_get_stats(0, &s) != GPUALLOC_OK) return -1;
  return s.reserved_bytes.all.current;
}
int main(void) {
  CHECK(gpualloc_set_miss_callback(on_miss, NULL) == GPUALLOC_OK);
  void *p = gpualloc_malloc(8 * MiB, 0, 0);
  CHECK(p != NULL && calls == 1 && last_device == 0);
  gpualloc_free(p, 8 * MiB, 0, 0);
  void *q = gpualloc_malloc(8 * MiB, 0, 0); /* cached: a hit */
  CHECK(q != NULL && calls == 1);
  void *held = gpualloc_malloc(32 * MiB, 0, 0);
  CHECK(held != NULL && calls == 2);
  int64_t before = reserved();
  to_free = held; /* a tensor let go of by the process it was sent to */
  void *r = gpualloc_malloc(32 * MiB, 0, 0);
  CHECK(r != NULL && calls == 3 && to_free == NULL);
  CHECK(r == held);            /* the memory the callback freed */
  CHECK(reserved() == before); /* nothing grew */
  CHECK(gpualloc_set_miss_callback(NULL, NULL) == GPUALLOC_OK);
  void *s = gpualloc_malloc(64 * MiB, 0, 0);
  CHECK(s != NULL && calls == 3);
  gpualloc_free(s, 64 * MiB, 0, 0);
  gpualloc_free(r, 32 * MiB, 0, 0);
  gpualloc_free(q, 8 * MiB, 0, 0);
  printf("done\n");
  return 0;
}
"#,
    );
    done_quietly_under_both_policies(&exe);
}

/// A free that waits for other streams' work is told to the segment
/// observer (deferred, then completed, with the block's address and size)
/// only once asked for with `gpualloc_observe_block_frees`: an observer
/// written before these events never sees an action it does not know.
#[test]
fn deferred_frees_are_told_only_when_asked_for() {
    let (_out, exe) = build_inline(
        "block_frees",
        r#"#include "gpualloc.h"
#include <stdio.h>
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s\n", __LINE__, #c); return 1; } } while (0)
#define MiB (1024u * 1024u)
static long seen[32];
static uint64_t block_addr, block_size;
static void observer(void *ctx, int device, int action, uint64_t address, uint64_t size, uint64_t stream) {
  (void)ctx; (void)device; (void)stream;
  if (action >= 0 && action < 32) seen[action]++;
  if (action == GPUALLOC_BLOCK_FREE_DEFERRED || action == GPUALLOC_BLOCK_FREE_COMPLETED) {
    block_addr = address;
    block_size = size;
  }
}
static int freed_on_another_stream(void) {
  void *p = gpualloc_malloc(6 * MiB, 0, 0);
  if (p == NULL) return 0;
  gpualloc_record_stream(p, (cudaStream_t)7);
  gpualloc_free(p, 6 * MiB, 0, 0);
  gpualloc_empty_cache(); /* waits for the other stream */
  return 1;
}
int main(void) {
  CHECK(gpualloc_set_segment_observer(observer, NULL) == GPUALLOC_OK);
  CHECK(freed_on_another_stream());
  CHECK(seen[GPUALLOC_BLOCK_FREE_DEFERRED] == 0 && seen[GPUALLOC_BLOCK_FREE_COMPLETED] == 0);
  CHECK(gpualloc_observe_block_frees(1) == GPUALLOC_OK);
  CHECK(freed_on_another_stream());
  CHECK(seen[GPUALLOC_BLOCK_FREE_DEFERRED] == 1 && seen[GPUALLOC_BLOCK_FREE_COMPLETED] == 1);
  CHECK(block_addr != 0 && block_size == 6 * MiB);
  void *q = gpualloc_malloc(6 * MiB, 0, 0); /* freed at once: told nothing */
  CHECK(q != NULL);
  gpualloc_free(q, 6 * MiB, 0, 0);
  CHECK(seen[GPUALLOC_BLOCK_FREE_DEFERRED] == 1 && seen[GPUALLOC_BLOCK_FREE_COMPLETED] == 1);
  CHECK(gpualloc_observe_block_frees(0) == GPUALLOC_OK);
  CHECK(freed_on_another_stream());
  CHECK(seen[GPUALLOC_BLOCK_FREE_DEFERRED] == 1);
  printf("done\n");
  return 0;
}
"#,
    );
    done_quietly_under_both_policies(&exe);
}

/// Runs `exe` under gpualloc's default policy and under `policy:pytorch`;
/// each run must print only `done`.
fn done_quietly_under_both_policies(exe: &Path) {
    for conf in ["", "policy:pytorch"] {
        let err = ran_to_done(&run_sim(exe, &[("GPUALLOC_CONF", conf.as_ref())]));
        assert!(err.is_empty(), "{conf}: nothing is printed: {err}");
    }
}
