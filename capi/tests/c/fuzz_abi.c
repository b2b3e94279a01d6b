/* Random sequences of C ABI calls on the simulated backend, with valid,
 * misused and extreme arguments (never memory the caller does not own).
 * After every call each device's invariants must hold, and every segment
 * of the snapshot must be registered by the segment observer (and, every
 * eighth call, agree with the JSON snapshot: registry.h); at the end the program prints "FUZZ OK".
 * Usage: fuzz_abi SEED CALLS TRACE_DIR */
#include "gpualloc.h"
#include "registry.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t state;

static uint64_t next(void) {
  state ^= state >> 12;
  state ^= state << 25;
  state ^= state >> 27;
  return state * 0x2545F4914F6CDD1DULL;
}

static uint64_t below(uint64_t n) { return n ? next() % n : 0; }
static uint64_t restores;

/* Small, boundary or random sizes. */
static uint64_t size_value(void) {
  switch (below(6)) {
  case 0: return below(4097);
  case 1: return 1 + below(64u << 20);
  case 2: return (uint64_t)1 << below(64);
  case 3: return UINT64_MAX - below(4);
  case 4: return 1 + below(4u << 30);
  default: return next();
  }
}

static int device_value(void) {
  static const int devices[] = {0, 0, 0, 1, 1, -1, 2, 7, 1 << 30};
  return devices[below(sizeof devices / sizeof devices[0])];
}

static cudaStream_t stream_value(void) {
  return (cudaStream_t)(uintptr_t)below(4);
}

static int accept_odd(void *ctx, cudaStream_t s) {
  (void)ctx;
  return (int)((uintptr_t)s & 1);
}

#define LIVE 256
static struct {
  void *p;
  size_t size;
  int device;
  cudaStream_t stream;
} live[LIVE];
static int nlive;

static void check(uint64_t call, const char *what) {
  for (int d = 0; d < 2; d++) {
    int rc = gpualloc_check_invariants(d);
    if (rc != GPUALLOC_OK && rc != GPUALLOC_ERR_INVALID_DEVICE) {
      const char *e = gpualloc_last_error();
      printf("FAILED after call %llu (%s): device %d invariants: %d %s\n",
             (unsigned long long)call, what, d, rc, e ? e : "");
      exit(1);
    }
  }
  check_segments(what, -1, call % 8 == 0);
}

int main(int argc, char **argv) {
  if (argc != 4) return 2;
  state = strtoull(argv[1], NULL, 10) * 0x9E3779B97F4A7C15ULL | 1;
  uint64_t calls = strtoull(argv[2], NULL, 10);
  char path[4096];
  static char name[6000];
  static char snapshot[1 << 16];
  int64_t values[512];
  CHECK(gpualloc_set_segment_observer(observer, &reg) == GPUALLOC_OK);
  CHECK(gpualloc_observe_block_frees(1) == GPUALLOC_OK);
  for (uint64_t i = 0; i < calls; i++) {
    const char *what = "";
    switch (below(28)) {
    case 0: case 1: case 2: case 3: case 4: {
      what = "malloc";
      int device = device_value();
      cudaStream_t s = stream_value();
      size_t size = (size_t)(below(4) ? 1 + below(8u << 20) : size_value());
      void *p = gpualloc_malloc(size, device, s);
      if (p && nlive < LIVE) {
        live[nlive].p = p;
        live[nlive].size = size;
        live[nlive].device = device;
        live[nlive].stream = s;
        nlive++;
      } else if (p) {
        gpualloc_free(p, size, device, s);
      }
      break;
    }
    case 5: case 6: case 7: {
      what = "free";
      if (!nlive) break;
      int k = (int)below((uint64_t)nlive);
      size_t size = below(5) ? live[k].size : (size_t)size_value();
      int device = below(5) ? live[k].device : device_value();
      gpualloc_free(live[k].p, size, device, below(3) ? live[k].stream : stream_value());
      if (gpualloc_last_error_code() == 0) live[k] = live[--nlive];
      break;
    }
    case 8:
      what = "bad free";
      gpualloc_free((void *)(uintptr_t)size_value(), (size_t)size_value(), device_value(),
                    stream_value());
      break;
    case 9:
      what = "record_stream";
      gpualloc_record_stream(nlive && below(4) ? live[below((uint64_t)nlive)].p
                                               : (void *)(uintptr_t)size_value(),
                             stream_value());
      break;
    case 10:
      what = "empty_cache";
      gpualloc_empty_cache();
      break;
    case 11: {
      what = "memory fraction";
      static const double f[] = {0.0, 0.5, 1.0, -1.0, 2.0, 1e-300, INFINITY, NAN};
      gpualloc_set_memory_fraction(f[below(8)], device_value());
      double out;
      gpualloc_get_memory_fraction(device_value(), &out);
      break;
    }
    case 12:
      what = "memory limit";
      gpualloc_set_memory_limit(device_value(), below(2) ? 0 : size_value());
      break;
    case 13: {
      what = "stats";
      GpuallocStats s;
      memset(&s, 0, sizeof s);
      s.size = (uint32_t)below(sizeof s + 1);
      gpualloc_get_stats(device_value(), &s);
      size_t n = gpualloc_stat_count();
      gpualloc_stat_values(device_value(), values, below(n < 512 ? n + 1 : 512));
      gpualloc_stat_name((size_t)below(n + 3));
      if (below(4) == 0) gpualloc_reset_peak_stats(device_value());
      if (below(4) == 0) gpualloc_reset_accumulated_stats(device_value());
      GpuallocDriverCall rows[32];
      size_t nrows = 0;
      gpualloc_driver_calls(device_value(), below(4) ? rows : NULL, (size_t)below(33), below(2) ? &nrows : NULL);
      gpualloc_helper_driver_calls(device_value(), below(4) ? rows : NULL, (size_t)below(33), below(2) ? &nrows : NULL);
      /* In and out, as PyTorch's cacheInfo: 0 asks for the driver's free
       * memory as a floor, anything else is its own floor. */
      size_t largest = below(2) ? 0 : (size_t)next();
      gpualloc_cache_info(device_value(), &largest);
      uint64_t fr, tot;
      gpualloc_mem_info(device_value(), &fr, &tot);
      GpuallocOomInfo o;
      memset(&o, 0, sizeof o);
      o.size = (uint32_t)below(sizeof o + 1);
      gpualloc_last_oom(&o);
      break;
    }
    case 14: {
      what = "snapshot";
      size_t needed = 0;
      gpualloc_snapshot_json(device_value(), snapshot, (size_t)below(sizeof snapshot), &needed);
      break;
    }
    case 15:
      what = "trace start";
      snprintf(path, sizeof path, "%s/t%llu.gtrace", argv[3], (unsigned long long)below(3));
      gpualloc_trace_start(below(8) ? path : "/nonexistent-dir/t.gtrace");
      break;
    case 16: {
      what = "trace stop";
      GpuallocTraceSummary s;
      gpualloc_trace_stop(below(2) ? &s : NULL);
      break;
    }
    case 17:
      what = "trace flush";
      gpualloc_trace_flush();
      gpualloc_is_tracing();
      break;
    case 18: case 19: {
      what = "phase or mark";
      size_t len = below(4) ? below(16) : below(sizeof name);
      memset(name, 'a' + (int)below(26), len);
      name[len] = 0;
      switch (below(3)) {
      case 0: gpualloc_phase_push(name); break;
      case 1: gpualloc_phase_pop(); break;
      default: gpualloc_mark(name); break;
      }
      break;
    }
    case 20:
      what = "begin pool";
      gpualloc_begin_allocate_to_pool(device_value(), below(3), below(3),
                                      below(2) ? NULL : accept_odd, NULL);
      break;
    case 21:
      what = "end pool";
      gpualloc_end_allocate_to_pool(device_value(), below(3), below(3));
      break;
    case 22:
      what = "release pool";
      gpualloc_release_pool(device_value(), below(3), below(3));
      break;
    case 23: {
      what = "pool holds";
      uint32_t n;
      switch (below(3)) {
      case 0: gpualloc_create_or_incref_pool(device_value(), below(3), below(3)); break;
      case 1: gpualloc_pool_use_count(device_value(), below(3), below(3), below(8) ? &n : NULL); break;
      default: gpualloc_empty_pool_cache(device_value(), below(3), below(3)); break;
      }
      break;
    }
    case 24: {
      what = "pool live allocations";
      static uint64_t addrs[64];
      size_t n;
      gpualloc_pool_live_allocations(device_value(), below(3), below(3), below(8) ? addrs : NULL,
                                     (size_t)below(65), below(8) ? &n : NULL);
      break;
    }
    case 25: {
      /* Checkpoints of a random pool, restored later (perhaps to another
       * pool or device, perhaps altered): refused or applied whole. */
      static GpuallocBlockState ck[256];
      static size_t nck;
      static uint64_t freed[256], allocd[256];
      size_t n = 0, nf, na;
      if (below(2)) {
        what = "pool checkpoint";
        if (gpualloc_pool_checkpoint(device_value(), below(3), below(3), ck,
                                     (size_t)below(257), &n) == GPUALLOC_OK)
          nck = n;
        break;
      }
      what = "pool restore";
      if (nck && below(4) == 0) {
        GpuallocBlockState *b = &ck[below(nck)];
        switch (below(3)) {
        case 0: b->size += 512 * below(3) - 512; break;
        case 1: b->address += 256 * below(5); break;
        default: b->allocated ^= 1; break;
        }
      }
      if (gpualloc_pool_restore(device_value(), below(3), below(3), below(16) ? ck : NULL,
                                below(8) ? nck : (size_t)below(4), freed, (size_t)below(257), &nf,
                                allocd, (size_t)below(257), &na) == GPUALLOC_OK)
        restores++;
      break;
    }
    case 26: {
      /* Sharing live (or bogus) pointers, and opening damaged shares:
       * refused cleanly; a share may give a block one handle (a copy). */
      static char share[4096];
      size_t len = 0;
      uint64_t off = 0;
      void *q = NULL;
      if (below(3)) {
        what = "ipc share";
        void *p = nlive && below(4) ? live[below((uint64_t)nlive)].p : (void *)(uintptr_t)size_value();
        gpualloc_ipc_share(below(4) ? 0 : device_value(), p, below(8) ? share : NULL,
                           below(8) ? sizeof share : 0, &len, below(16) ? &off : NULL);
        break;
      }
      what = "ipc open";
      size_t n = (size_t)below(64);
      for (size_t k = 0; k < n; k++) share[k] = (char)below(256);
      if (n > 1 && below(2)) share[0] = 2, share[1] = below(2) ? 'e' : 'g';
      gpualloc_ipc_open(share, n, device_value(), &q);
      gpualloc_ipc_close(q);
      break;
    }
    default: {
      what = "init and queries";
      static const char *configs[] = {"", "max_split_size_mb:64", "bogus", "memory_limit:0",
                                      "expandable_segments:true"};
      gpualloc_init(configs[below(5)]);
      gpualloc_is_initialized();
      gpualloc_backend_name();
      gpualloc_version();
      gpualloc_device_count();
      gpualloc_clear_error();
      break;
    }
    }
    check(i, what);
  }
  for (int d = 0; d < 2; d++)
    for (int k = 0; k < 8; k++) gpualloc_end_allocate_to_pool(d, (uint64_t)k / 3, (uint64_t)k % 3);
  while (nlive) {
    nlive--;
    gpualloc_free(live[nlive].p, live[nlive].size, live[nlive].device, live[nlive].stream);
  }
  gpualloc_empty_cache();
  check(calls, "the end");
  if (gpualloc_is_tracing() == 1) gpualloc_trace_stop(NULL);
  printf("pool restores applied: %llu\n", (unsigned long long)restores);
  /* every free told as deferred completed, or is still pending (a scope
     left open keeps empty_cache from waiting) */
  long pending = 0;
  for (int d = 0; d < 2; d++) {
    static char json[1 << 22];
    size_t needed = 0;
    CHECK(gpualloc_snapshot_json(d, json, sizeof json, &needed) == GPUALLOC_OK);
    for (const char *q = json; (q = strstr(q, "\"active_pending_free\"")) != NULL; q++) pending++;
  }
  CHECK(reg.events[GPUALLOC_BLOCK_FREE_DEFERRED] == reg.events[GPUALLOC_BLOCK_FREE_COMPLETED] + pending);
  printf("deferred frees: %ld, %ld still pending\n", reg.events[GPUALLOC_BLOCK_FREE_DEFERRED], pending);
  printf("FUZZ OK\n");
  return 0;
}
