/*
 * vmm_costs.c - CUDA driver-API micro-benchmark of virtual memory management
 * (VMM) and synchronization costs, as seen by a caching allocator.
 *
 * What it measures (wall-clock time around single driver calls, with
 * clock_gettime(CLOCK_MONOTONIC); mean, p50 and p90 in microseconds over n
 * repetitions after a few unmeasured warm-up repetitions):
 *
 *   1. vmm_per_size       cuMemCreate, cuMemMap (one handle into a reserved
 *                         range), cuMemSetAccess (that handle's range),
 *                         cuMemUnmap and cuMemRelease for handles of
 *                         2 MiB .. 1 GiB; per call and per GiB.
 *   2. vmm_1gib_n_handles 1 GiB made of N handles (512 x 2 MiB, 64 x 16 MiB,
 *                         8 x 128 MiB, 1 x 1 GiB) in one reservation: the N
 *                         cuMemMap calls; ONE cuMemSetAccess over 1 GiB vs N
 *                         per-handle calls; ONE cuMemUnmap over 1 GiB vs N
 *                         per-handle calls (separate rounds per variant).
 *      vmm_remap_cached   cuMemMap + cuMemSetAccess of an already created
 *                         2 MiB handle at a new address (and its cuMemUnmap).
 *   3. va_reserve         cuMemAddressReserve / cuMemAddressFree of
 *                         1.125 x total device memory.
 *   4. sync_idle,         cuCtxSynchronize, cuStreamSynchronize (non-blocking
 *      sync_busy          stream), cuEventRecord, cuEventQuery and
 *                         cuEventSynchronize (completed event), with the GPU
 *                         idle and with ~20 ms of cuMemsetD32Async work queued
 *                         on another stream (busy: how long the call blocked).
 *   5. vmm_while_busy     Does VMM (un)mapping block on queued GPU work?  With
 *                         ~20 ms of work queued on an unrelated stream/buffer:
 *                         cuMemCreate / cuMemMap / cuMemSetAccess of a fresh
 *                         2 MiB handle, cuMemUnmap of an idle mapping,
 *                         cuMemRelease, a cached-handle remap, and cuMemAlloc /
 *                         cuMemFree for reference.  "blocked" = the call took
 *                         a large part of the queued work's duration.
 *   6. cumemalloc         cuMemAlloc / cuMemFree of 2 MiB, 20 MiB and 1 GiB
 *                         (idle), for comparison.
 *
 * Uses device 0's primary context.  Never uses managed memory and never
 * changes device settings.  Everything created is released again.
 * Every CUresult is checked; on error the call, the code and its name are
 * printed and the program exits with status 1.
 *
 * Build and run (normally via the runner next to this file):
 *     bash benches/gpu/vmm_costs.sh            # writes ${OUT:-./vmm-costs}/
 * or by hand:
 *     gcc -O2 -std=c11 -Wall -Wextra vmm_costs.c -I$CUDA_HOME/include \
 *         -L$CUDA_HOME/lib64/stubs -lcuda -o vmm_costs
 *     ./vmm_costs out.json out.md
 *
 * Environment: VMM_COSTS_SCALE (default 1.0) multiplies every repetition
 * count (e.g. 0.2 for a quick smoke run).  Progress goes to stderr.
 * Expected run time on an H200: well under a minute (every measurement loop
 * also has a time budget, so a slow driver cannot make it run away).
 */
#define _POSIX_C_SOURCE 200809L

#include <cuda.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

/* ------------------------------------------------------------------ */
/* Error checking and timing helpers                                  */
/* ------------------------------------------------------------------ */

static void die_cu(CUresult r, const char *call, int line)
{
    const char *name = NULL, *desc = NULL;
    if (cuGetErrorName(r, &name) != CUDA_SUCCESS || !name)
        name = "?";
    if (cuGetErrorString(r, &desc) != CUDA_SUCCESS || !desc)
        desc = "";
    fprintf(stderr, "vmm_costs: line %d: %s failed: %d (%s: %s)\n", line,
            call, (int)r, name, desc);
    exit(1);
}

/* Check a CUresult; exit with a message on anything but CUDA_SUCCESS. */
#define CK(call)                                                     \
    do {                                                             \
        CUresult ck_r_ = (call);                                     \
        if (ck_r_ != CUDA_SUCCESS) die_cu(ck_r_, #call, __LINE__);   \
    } while (0)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static double us_since(uint64_t t0) { return (double)(now_ns() - t0) / 1e3; }

/* Time one driver call: dst_us = its wall-clock duration in microseconds. */
#define TIMED(dst_us, call)                                          \
    do {                                                             \
        uint64_t tm_t0_ = now_ns();                                  \
        CUresult tm_r_ = (call);                                     \
        uint64_t tm_t1_ = now_ns();                                  \
        if (tm_r_ != CUDA_SUCCESS) die_cu(tm_r_, #call, __LINE__);   \
        (dst_us) = (double)(tm_t1_ - tm_t0_) / 1e3;                  \
    } while (0)

static void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz);
    if (!p) {
        fprintf(stderr, "vmm_costs: out of host memory\n");
        exit(1);
    }
    return p;
}

/* ------------------------------------------------------------------ */
/* Statistics and result rows                                         */
/* ------------------------------------------------------------------ */

typedef struct {
    double mean, p50, p90;
    int n;
} stats_t;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(const double *sorted, int n, double p)
{
    double pos = p * (double)(n - 1);
    int lo = (int)pos;
    if (lo >= n - 1) return sorted[n - 1];
    return sorted[lo] + (pos - (double)lo) * (sorted[lo + 1] - sorted[lo]);
}

static stats_t stats_of(const double *us, int n)
{
    stats_t s = {0, 0, 0, n};
    if (n <= 0) return s;
    double *c = xcalloc((size_t)n, sizeof *c);
    memcpy(c, us, (size_t)n * sizeof *c);
    qsort(c, (size_t)n, sizeof *c, cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += c[i];
    s.mean = sum / n;
    s.p50 = percentile(c, n, 0.50);
    s.p90 = percentile(c, n, 0.90);
    free(c);
    return s;
}

enum {
    S_PER_SIZE,
    S_NHANDLES,
    S_REMAP,
    S_RESERVE,
    S_SYNC_IDLE,
    S_SYNC_BUSY,
    S_VMM_BUSY,
    S_MALLOC,
    S_COUNT
};

static const struct {
    const char *key;       /* JSON key */
    const char *title;     /* Markdown heading */
    const char *extra_key; /* JSON key of the optional extra number */
    const char *extra_hdr; /* Markdown header of that number */
    const char *note;      /* Markdown text under the heading */
} SEC[S_COUNT] = {
    [S_PER_SIZE] = {"vmm_per_size", "1. VMM calls per handle size",
                    "us_per_gib", "mean µs per GiB",
                    "One handle of the given size: cuMemCreate, cuMemMap into a "
                    "reserved range of that size, cuMemSetAccess over it, "
                    "cuMemUnmap, cuMemRelease."},
    [S_NHANDLES] = {"vmm_1gib_n_handles", "2. Mapping 1 GiB made of N handles",
                    "per_call_us", "mean µs per call",
                    "One 1 GiB reservation, N pre-created handles. Times are the "
                    "total of all N calls (or the one call over the whole 1 GiB). "
                    "Rounds with one call over 1 GiB and rounds with N "
                    "per-handle calls alternate."},
    [S_REMAP] = {"vmm_remap_cached", "2b. Remapping a cached 2 MiB handle",
                 NULL, NULL,
                 "An already created 2 MiB handle mapped at a new address each "
                 "time (then unmapped again)."},
    [S_RESERVE] = {"va_reserve", "3. Address reservation", NULL, NULL,
                   "cuMemAddressReserve / cuMemAddressFree of 1.125 x total "
                   "device memory (alignment 0, no fixed address)."},
    [S_SYNC_IDLE] = {"sync_idle", "4a. Synchronization, GPU idle", NULL, NULL,
                     "Events are created with CU_EVENT_DISABLE_TIMING; the "
                     "stream is a created CU_STREAM_NON_BLOCKING stream."},
    [S_SYNC_BUSY] = {"sync_busy",
                     "4b. Synchronization while ~20 ms of GPU work is queued",
                     NULL, NULL,
                     "The work (cuMemsetD32Async over a cuMemAlloc buffer) is "
                     "queued on a separate non-blocking stream right before "
                     "the timed call; the time is how long the call blocked."},
    [S_VMM_BUSY] = {"vmm_while_busy",
                    "5. Do VMM calls block on queued GPU work?", NULL, NULL,
                    "~20 ms of unrelated work (other stream, other memory) is "
                    "queued right before the timed call; all VMM objects here "
                    "are unrelated to that work. blocked = yes when "
                    "(busy p50 - idle p50) > half the queued work, sometimes "
                    "when only p90 is."},
    [S_MALLOC] = {"cumemalloc", "6. cuMemAlloc / cuMemFree (idle)",
                  "us_per_gib", "mean µs per GiB",
                  "Plain cuMemAlloc and cuMemFree with the GPU idle, for "
                  "comparison."},
};

typedef struct {
    int sec;
    char name[112];
    stats_t st;
    double extra;        /* NAN when absent; see SEC[].extra_key */
    double idle_p50;     /* NAN when absent (busy rows only) */
    const char *blocked; /* NULL when absent (busy rows only) */
} row_t;

#define MAX_ROWS 256
static row_t g_rows[MAX_ROWS];
static int g_nrows;

static row_t *add_row(int sec, const char *name, stats_t st)
{
    if (g_nrows >= MAX_ROWS) {
        fprintf(stderr, "vmm_costs: too many result rows\n");
        exit(1);
    }
    row_t *r = &g_rows[g_nrows++];
    r->sec = sec;
    snprintf(r->name, sizeof r->name, "%s", name);
    r->st = st;
    r->extra = NAN;
    r->idle_p50 = NAN;
    r->blocked = NULL;
    fprintf(stderr, "  %-58s n=%4d mean=%10.1f p50=%10.1f p90=%10.1f us\n",
            name, st.n, st.mean, st.p50, st.p90);
    return r;
}

static const row_t *find_row(int sec, const char *name)
{
    for (int i = 0; i < g_nrows; i++)
        if (g_rows[i].sec == sec && strcmp(g_rows[i].name, name) == 0)
            return &g_rows[i];
    return NULL;
}

/* ------------------------------------------------------------------ */
/* Global state                                                       */
/* ------------------------------------------------------------------ */

static struct {
    CUdevice dev;
    CUcontext ctx;
    char name[256];
    int driver_version;
    size_t gran, gran_min, total_mem;
    CUmemAllocationProp prop; /* pinned device memory on device 0 */
    CUmemAccessDesc access;   /* read/write from device 0 */
    double scale;             /* VMM_COSTS_SCALE */
    uint64_t t_start;

    CUstream side; /* non-blocking stream that stays idle */
    CUstream work; /* non-blocking stream that gets the busy work */
    CUevent ev_done, ev_rec, ev_pending;

    CUdeviceptr busy_buf;
    size_t busy_words;    /* 32-bit words per memset */
    int busy_memsets;     /* memsets per ~20 ms batch */
    double busy_us;       /* measured duration of one batch */
    int pending_was_ready;
} g;

#define WARMUP 3

/* Scaled repetition count (at least 3). */
static int reps(int n)
{
    int r = (int)(n * g.scale + 0.5);
    return r < 3 ? 3 : r;
}

/* Loop control: measure `want` repetitions, but stop after `budget_s`
 * seconds once at least `min(want, 10)` were measured. */
static int keep_going(int done, int want, uint64_t t0, double budget_s)
{
    if (done >= want) return 0;
    int floor = want < 10 ? want : 10;
    if (done >= floor && us_since(t0) > budget_s * 1e6) return 0;
    return 1;
}

static void mib_name(char *buf, size_t len, size_t bytes)
{
    if (bytes >= GIB && bytes % GIB == 0)
        snprintf(buf, len, "%zuGiB", bytes / GIB);
    else
        snprintf(buf, len, "%zuMiB", bytes / MIB);
}

/* ------------------------------------------------------------------ */
/* Section 1: cost of each VMM call per handle size                   */
/* ------------------------------------------------------------------ */

static const size_t PER_SIZE_MIB[] = {2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
#define N_PER_SIZE (sizeof PER_SIZE_MIB / sizeof PER_SIZE_MIB[0])
static const char *const VMM_CALLS[5] = {"cuMemCreate", "cuMemMap",
                                         "cuMemSetAccess", "cuMemUnmap",
                                         "cuMemRelease"};

static void bench_per_size(void)
{
    fprintf(stderr, "[1] VMM calls per handle size\n");
    for (size_t k = 0; k < N_PER_SIZE; k++) {
        size_t bytes = PER_SIZE_MIB[k] * MIB;
        if (bytes % g.gran) {
            fprintf(stderr, "  skip %zu MiB: not a multiple of granularity\n",
                    PER_SIZE_MIB[k]);
            continue;
        }
        size_t m = PER_SIZE_MIB[k];
        int want = reps(m <= 16 ? 200 : m <= 128 ? 100 : m <= 512 ? 50 : 30);
        double *t[5];
        for (int c = 0; c < 5; c++) t[c] = xcalloc((size_t)want, sizeof(double));

        CUdeviceptr va;
        CK(cuMemAddressReserve(&va, bytes, 0, 0, 0));
        int n = 0;
        uint64_t t0 = 0;
        /* i < 0: warm-up repetitions, not recorded. */
        for (int i = -WARMUP; i < 0 || keep_going(n, want, t0, 1.5); i++) {
            if (i == 0) t0 = now_ns();
            CUmemGenericAllocationHandle h;
            double d[5];
            TIMED(d[0], cuMemCreate(&h, bytes, &g.prop, 0));
            TIMED(d[1], cuMemMap(va, bytes, 0, h, 0));
            TIMED(d[2], cuMemSetAccess(va, bytes, &g.access, 1));
            TIMED(d[3], cuMemUnmap(va, bytes));
            TIMED(d[4], cuMemRelease(h));
            if (i >= 0) {
                for (int c = 0; c < 5; c++) t[c][n] = d[c];
                n++;
            }
        }
        CK(cuMemAddressFree(va, bytes));

        for (int c = 0; c < 5; c++) {
            char name[112], sz[32];
            mib_name(sz, sizeof sz, bytes);
            snprintf(name, sizeof name, "%s/%s", VMM_CALLS[c], sz);
            row_t *r = add_row(S_PER_SIZE, name, stats_of(t[c], n));
            r->extra = r->st.mean * (double)GIB / (double)bytes;
            free(t[c]);
        }
    }
}

/* ------------------------------------------------------------------ */
/* Section 2: 1 GiB made of N handles; remapping a cached handle      */
/* ------------------------------------------------------------------ */

static void map_all(CUdeviceptr va, const CUmemGenericAllocationHandle *h,
                    int n, size_t hs)
{
    for (int j = 0; j < n; j++)
        CK(cuMemMap(va + (CUdeviceptr)j * hs, hs, 0, h[j], 0));
}

static void bench_n_handles(void)
{
    static const struct { size_t mib; int n; } CFG[] = {
        {2, 512}, {16, 64}, {128, 8}, {1024, 1}};
    fprintf(stderr, "[2] 1 GiB made of N handles\n");

    for (size_t k = 0; k < sizeof CFG / sizeof CFG[0]; k++) {
        size_t hs = CFG[k].mib * MIB;
        int nh = CFG[k].n;
        if (hs % g.gran) {
            fprintf(stderr, "  skip %zu MiB handles: not a multiple of "
                    "granularity\n", CFG[k].mib);
            continue;
        }
        int want = reps(nh >= 64 ? 20 : 50);
        CUmemGenericAllocationHandle *h = xcalloc((size_t)nh, sizeof *h);
        for (int j = 0; j < nh; j++) CK(cuMemCreate(&h[j], hs, &g.prop, 0));
        CUdeviceptr va;
        CK(cuMemAddressReserve(&va, GIB, 0, 0, 0));

        /* 0: N maps (both variants), 1: one setaccess, 2: N setaccess,
         * 3: one unmap, 4: N unmaps */
        double *t[5];
        t[0] = xcalloc((size_t)want * 2, sizeof(double));
        for (int c = 1; c < 5; c++) t[c] = xcalloc((size_t)want, sizeof(double));

        int n = 0;
        uint64_t t0 = 0;
        for (int i = -WARMUP; i < 0 || keep_going(n, want, t0, 3.0); i++) {
            if (i == 0) t0 = now_ns();
            double map_a, map_b, set1, setn, unmap1, unmapn;
            uint64_t s;

            /* Variant A: one cuMemSetAccess / cuMemUnmap over the 1 GiB. */
            s = now_ns();
            map_all(va, h, nh, hs);
            map_a = us_since(s);
            TIMED(set1, cuMemSetAccess(va, GIB, &g.access, 1));
            TIMED(unmap1, cuMemUnmap(va, GIB));

            /* Variant B: one call per handle. */
            s = now_ns();
            map_all(va, h, nh, hs);
            map_b = us_since(s);
            s = now_ns();
            for (int j = 0; j < nh; j++)
                CK(cuMemSetAccess(va + (CUdeviceptr)j * hs, hs, &g.access, 1));
            setn = us_since(s);
            s = now_ns();
            for (int j = 0; j < nh; j++)
                CK(cuMemUnmap(va + (CUdeviceptr)j * hs, hs));
            unmapn = us_since(s);

            if (i >= 0) {
                t[0][2 * n] = map_a;
                t[0][2 * n + 1] = map_b;
                t[1][n] = set1;
                t[2][n] = setn;
                t[3][n] = unmap1;
                t[4][n] = unmapn;
                n++;
            }
        }
        CK(cuMemAddressFree(va, GIB));
        for (int j = 0; j < nh; j++) CK(cuMemRelease(h[j]));
        free(h);

        char pre[48];
        snprintf(pre, sizeof pre, "%dx%zuMiB", nh, CFG[k].mib);
        static const char *const what[5] = {
            "N x cuMemMap", "1 x cuMemSetAccess(1GiB)", "N x cuMemSetAccess",
            "1 x cuMemUnmap(1GiB)", "N x cuMemUnmap"};
        static const int calls_is_n[5] = {1, 0, 1, 0, 1};
        for (int c = 0; c < 5; c++) {
            char name[112];
            snprintf(name, sizeof name, "%s: %s", pre, what[c]);
            row_t *r = add_row(S_NHANDLES, name,
                               stats_of(t[c], c == 0 ? 2 * n : n));
            r->extra = r->st.mean / (calls_is_n[c] ? nh : 1);
            free(t[c]);
        }
    }
}

static void bench_remap_cached(void)
{
    fprintf(stderr, "[2b] remap a cached 2 MiB handle\n");
    size_t hs = 2 * MIB;
    if (hs % g.gran) {
        fprintf(stderr, "  skip: 2 MiB is not a multiple of granularity\n");
        return;
    }
    int want = reps(200);
    size_t slots = (size_t)want + WARMUP;
    CUmemGenericAllocationHandle h;
    CK(cuMemCreate(&h, hs, &g.prop, 0));
    CUdeviceptr va;
    CK(cuMemAddressReserve(&va, slots * hs, 0, 0, 0));

    double *t[4];
    for (int c = 0; c < 4; c++) t[c] = xcalloc((size_t)want, sizeof(double));
    int n = 0;
    uint64_t t0 = 0;
    for (int i = -WARMUP; i < 0 || keep_going(n, want, t0, 1.5); i++) {
        if (i == 0) t0 = now_ns();
        CUdeviceptr a = va + (CUdeviceptr)(i + WARMUP) * hs; /* new address */
        double m, s, u;
        TIMED(m, cuMemMap(a, hs, 0, h, 0));
        TIMED(s, cuMemSetAccess(a, hs, &g.access, 1));
        TIMED(u, cuMemUnmap(a, hs));
        if (i >= 0) {
            t[0][n] = m;
            t[1][n] = s;
            t[2][n] = m + s;
            t[3][n] = u;
            n++;
        }
    }
    CK(cuMemAddressFree(va, slots * hs));
    CK(cuMemRelease(h));

    static const char *const what[4] = {
        "cuMemMap(cached 2MiB handle, new VA)", "cuMemSetAccess(2MiB)",
        "cuMemMap+cuMemSetAccess (remap)", "cuMemUnmap(2MiB)"};
    for (int c = 0; c < 4; c++) {
        add_row(S_REMAP, what[c], stats_of(t[c], n));
        free(t[c]);
    }
}

/* ------------------------------------------------------------------ */
/* Section 3: reserving a very large address range                    */
/* ------------------------------------------------------------------ */

static void bench_reserve(void)
{
    fprintf(stderr, "[3] address reservation\n");
    size_t want_bytes = g.total_mem + g.total_mem / 8;
    size_t bytes = (want_bytes + g.gran - 1) / g.gran * g.gran;
    int want = reps(50);
    double *tr = xcalloc((size_t)want, sizeof(double));
    double *tf = xcalloc((size_t)want, sizeof(double));
    int n = 0;
    uint64_t t0 = 0;
    for (int i = -WARMUP; i < 0 || keep_going(n, want, t0, 2.0); i++) {
        if (i == 0) t0 = now_ns();
        CUdeviceptr va;
        double r, f;
        TIMED(r, cuMemAddressReserve(&va, bytes, 0, 0, 0));
        TIMED(f, cuMemAddressFree(va, bytes));
        if (i >= 0) {
            tr[n] = r;
            tf[n] = f;
            n++;
        }
    }
    char name[112];
    snprintf(name, sizeof name, "cuMemAddressReserve(%.1fGiB)",
             (double)bytes / (double)GIB);
    add_row(S_RESERVE, name, stats_of(tr, n));
    snprintf(name, sizeof name, "cuMemAddressFree(%.1fGiB)",
             (double)bytes / (double)GIB);
    add_row(S_RESERVE, name, stats_of(tf, n));
    free(tr);
    free(tf);
}

/* ------------------------------------------------------------------ */
/* Busy GPU work: ~20 ms of cuMemsetD32Async on g.work                */
/* ------------------------------------------------------------------ */

#define BUSY_TARGET_US 20000.0

static void enqueue_busy_work(void)
{
    for (int i = 0; i < g.busy_memsets; i++)
        CK(cuMemsetD32Async(g.busy_buf, (unsigned int)i, g.busy_words, g.work));
}

static void setup_busy_work(void)
{
    size_t bytes = 4 * GIB;
    if (bytes > g.total_mem / 4) bytes = g.total_mem / 4 / MIB * MIB;
    CK(cuMemAlloc(&g.busy_buf, bytes));
    g.busy_words = bytes / 4;

    /* Calibrate: time a few memsets end to end. */
    g.busy_memsets = 2;
    enqueue_busy_work(); /* warm-up */
    CK(cuStreamSynchronize(g.work));
    g.busy_memsets = 10;
    uint64_t t0 = now_ns();
    enqueue_busy_work();
    CK(cuStreamSynchronize(g.work));
    double per = us_since(t0) / g.busy_memsets;
    int k = (int)(BUSY_TARGET_US / per + 0.5);
    g.busy_memsets = k < 1 ? 1 : k > 2000 ? 2000 : k;

    /* Measure the batch we will actually queue. */
    double sum = 0;
    for (int i = 0; i < 3; i++) {
        t0 = now_ns();
        enqueue_busy_work();
        CK(cuStreamSynchronize(g.work));
        sum += us_since(t0);
    }
    g.busy_us = sum / 3;
    fprintf(stderr, "busy work: %d x cuMemsetD32Async(%zu MiB) = %.0f us "
            "(one memset %.0f us)\n", g.busy_memsets, bytes / MIB, g.busy_us,
            per);
}

/* ------------------------------------------------------------------ */
/* Cases timed idle and while busy (sections 4 and 5)                 */
/* ------------------------------------------------------------------ */

typedef struct {
    const char *name;
    int busy_only;           /* meaningless with an idle GPU */
    void (*setup)(void);     /* before the work is queued, untimed */
    void (*armed)(void);     /* after the work is queued, untimed */
    void (*op)(void);        /* the timed call(s) */
    void (*teardown)(void);  /* after the work drained, untimed */
} case_t;

/* Scratch state shared by the case callbacks. */
static CUmemGenericAllocationHandle c_h, c_cached;
static CUdeviceptr c_va_base, c_addr, c_ptr;
#define C_SLOTS 128
static unsigned c_slot;

static void next_addr(void)
{
    c_addr = c_va_base + (CUdeviceptr)(c_slot++ % C_SLOTS) * (2 * MIB);
}

/* --- synchronization ops --- */
static void op_ctx_sync(void) { CK(cuCtxSynchronize()); }
static void op_side_sync(void) { CK(cuStreamSynchronize(g.side)); }
static void op_work_sync(void) { CK(cuStreamSynchronize(g.work)); }
static void op_rec_side(void) { CK(cuEventRecord(g.ev_rec, g.side)); }
static void op_rec_work(void) { CK(cuEventRecord(g.ev_rec, g.work)); }
static void op_query_done(void) { CK(cuEventQuery(g.ev_done)); }
static void op_evsync_done(void) { CK(cuEventSynchronize(g.ev_done)); }
static void arm_pending(void) { CK(cuEventRecord(g.ev_pending, g.work)); }
static void op_query_pending(void)
{
    CUresult r = cuEventQuery(g.ev_pending);
    if (r == CUDA_SUCCESS)
        g.pending_was_ready++;
    else if (r != CUDA_ERROR_NOT_READY)
        die_cu(r, "cuEventQuery(ev_pending)", __LINE__);
}

/* --- VMM ops on 2 MiB handles unrelated to the busy work --- */
static void do_create(void) { CK(cuMemCreate(&c_h, 2 * MIB, &g.prop, 0)); }
static void do_map(void) { CK(cuMemMap(c_addr, 2 * MIB, 0, c_h, 0)); }
static void do_access(void) { CK(cuMemSetAccess(c_addr, 2 * MIB, &g.access, 1)); }
static void do_unmap(void) { CK(cuMemUnmap(c_addr, 2 * MIB)); }
static void do_release(void) { CK(cuMemRelease(c_h)); }

static void st_created(void) { do_create(); next_addr(); }
static void st_mapped(void) { st_created(); do_map(); }
static void st_accessible(void) { st_mapped(); do_access(); }
static void st_unmapped(void) { st_accessible(); do_unmap(); }
static void td_unmap_release(void) { do_unmap(); do_release(); }

static void op_create(void) { do_create(); }
static void op_create_map_access(void) { do_create(); do_map(); do_access(); }
static void pre_fresh(void) { next_addr(); }

static void pre_cached(void) { next_addr(); }
static void op_remap_cached(void)
{
    CK(cuMemMap(c_addr, 2 * MIB, 0, c_cached, 0));
    do_access();
}

static void op_alloc(void) { CK(cuMemAlloc(&c_ptr, 2 * MIB)); }
static void op_free(void) { CK(cuMemFree(c_ptr)); }

static const case_t SYNC_CASES[] = {
    {"cuCtxSynchronize", 0, NULL, NULL, op_ctx_sync, NULL},
    {"cuStreamSynchronize(idle non-blocking stream)", 0, NULL, NULL,
     op_side_sync, NULL},
    {"cuStreamSynchronize(the busy stream)", 1, NULL, NULL, op_work_sync, NULL},
    {"cuEventRecord(idle stream)", 0, NULL, NULL, op_rec_side, NULL},
    {"cuEventRecord(busy stream)", 1, NULL, NULL, op_rec_work, NULL},
    {"cuEventQuery(completed event)", 0, NULL, NULL, op_query_done, NULL},
    {"cuEventQuery(pending event, NOT_READY)", 1, NULL, arm_pending,
     op_query_pending, NULL},
    {"cuEventSynchronize(completed event)", 0, NULL, NULL, op_evsync_done,
     NULL},
};

static const case_t VMM_CASES[] = {
    {"cuMemCreate(2MiB)", 0, NULL, NULL, op_create, do_release},
    {"cuMemMap(fresh 2MiB handle)", 0, st_created, NULL, do_map,
     td_unmap_release},
    {"cuMemSetAccess(2MiB)", 0, st_mapped, NULL, do_access, td_unmap_release},
    {"(a) cuMemCreate+cuMemMap+cuMemSetAccess(fresh 2MiB)", 0, pre_fresh, NULL,
     op_create_map_access, td_unmap_release},
    {"(b) cuMemUnmap(unrelated idle 2MiB mapping)", 0, st_accessible, NULL,
     do_unmap, do_release},
    {"(c) cuMemRelease(unmapped 2MiB handle)", 0, st_unmapped, NULL,
     do_release, NULL},
    {"cuMemMap+cuMemSetAccess(cached 2MiB handle, new VA)", 0, pre_cached, NULL,
     op_remap_cached, do_unmap},
    {"reference: cuMemAlloc(2MiB)", 0, NULL, NULL, op_alloc, op_free},
    {"reference: cuMemFree(2MiB)", 0, op_alloc, NULL, op_free, NULL},
};

static stats_t run_case(const case_t *c, int busy, int want, double budget_s)
{
    double *us = xcalloc((size_t)want, sizeof(double));
    int n = 0;
    uint64_t t0 = 0;
    for (int i = -WARMUP; i < 0 || keep_going(n, want, t0, budget_s); i++) {
        if (i == 0) t0 = now_ns();
        if (c->setup) c->setup();
        if (busy) enqueue_busy_work();
        if (c->armed) c->armed();
        uint64_t s = now_ns();
        c->op();
        double d = us_since(s);
        if (busy) CK(cuStreamSynchronize(g.work));
        if (c->teardown) c->teardown();
        if (i >= 0) us[n++] = d;
    }
    stats_t st = stats_of(us, n);
    free(us);
    return st;
}

static const char *blocked_verdict(stats_t busy, double idle_p50)
{
    double base = isnan(idle_p50) ? 0.0 : idle_p50;
    double half = 0.5 * g.busy_us;
    if (busy.p50 - base > half) return "yes";
    if (busy.p90 - base > half) return "sometimes";
    return "no";
}

static void run_cases(const case_t *cases, size_t ncases, int idle_sec,
                      int busy_sec)
{
    for (size_t k = 0; k < ncases; k++) {
        const case_t *c = &cases[k];
        double idle_p50 = NAN;
        if (!c->busy_only) {
            stats_t st = run_case(c, 0, reps(100), 0.5);
            idle_p50 = st.p50;
            if (idle_sec >= 0) {
                add_row(idle_sec, c->name, st);
            } else {
                fprintf(stderr, "  %-58s (idle) p50=%.1f us\n", c->name,
                        st.p50);
            }
        }
        row_t *r = add_row(busy_sec, c->name, run_case(c, 1, reps(20), 1.2));
        r->idle_p50 = idle_p50;
        r->blocked = blocked_verdict(r->st, idle_p50);
    }
}

static void bench_sync(void)
{
    fprintf(stderr, "[4] synchronization, idle and busy\n");
    CK(cuEventRecord(g.ev_done, g.side));
    CK(cuEventSynchronize(g.ev_done));
    run_cases(SYNC_CASES, sizeof SYNC_CASES / sizeof SYNC_CASES[0], S_SYNC_IDLE,
              S_SYNC_BUSY);
    if (g.pending_was_ready)
        fprintf(stderr, "  warning: the 'pending' event had already completed "
                "in %d queries\n", g.pending_was_ready);
}

static void bench_vmm_busy(void)
{
    fprintf(stderr, "[5] VMM calls while GPU work is queued\n");
    if ((2 * MIB) % g.gran) {
        fprintf(stderr, "  skip: 2 MiB is not a multiple of granularity\n");
        return;
    }
    CK(cuMemAddressReserve(&c_va_base, C_SLOTS * 2 * MIB, 0, 0, 0));
    CK(cuMemCreate(&c_cached, 2 * MIB, &g.prop, 0));
    run_cases(VMM_CASES, sizeof VMM_CASES / sizeof VMM_CASES[0], -1,
              S_VMM_BUSY);
    CK(cuMemRelease(c_cached));
    CK(cuMemAddressFree(c_va_base, C_SLOTS * 2 * MIB));
}

/* ------------------------------------------------------------------ */
/* Section 6: cuMemAlloc / cuMemFree                                  */
/* ------------------------------------------------------------------ */

static void bench_cumemalloc(void)
{
    static const struct { size_t mib; int n; } CFG[] = {
        {2, 100}, {20, 100}, {1024, 30}};
    fprintf(stderr, "[6] cuMemAlloc / cuMemFree\n");
    for (size_t k = 0; k < sizeof CFG / sizeof CFG[0]; k++) {
        size_t bytes = CFG[k].mib * MIB;
        int want = reps(CFG[k].n);
        double *ta = xcalloc((size_t)want, sizeof(double));
        double *tf = xcalloc((size_t)want, sizeof(double));
        int n = 0;
        uint64_t t0 = 0;
        for (int i = -WARMUP; i < 0 || keep_going(n, want, t0, 1.0); i++) {
            if (i == 0) t0 = now_ns();
            CUdeviceptr p;
            double a, f;
            TIMED(a, cuMemAlloc(&p, bytes));
            TIMED(f, cuMemFree(p));
            if (i >= 0) {
                ta[n] = a;
                tf[n] = f;
                n++;
            }
        }
        char name[112], sz[32];
        mib_name(sz, sizeof sz, bytes);
        snprintf(name, sizeof name, "cuMemAlloc/%s", sz);
        row_t *r = add_row(S_MALLOC, name, stats_of(ta, n));
        r->extra = r->st.mean * (double)GIB / (double)bytes;
        snprintf(name, sizeof name, "cuMemFree/%s", sz);
        r = add_row(S_MALLOC, name, stats_of(tf, n));
        r->extra = r->st.mean * (double)GIB / (double)bytes;
        free(ta);
        free(tf);
    }
}

/* ------------------------------------------------------------------ */
/* Output                                                             */
/* ------------------------------------------------------------------ */

static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch < 0x20)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

static void write_json(FILE *f, double wall_s)
{
    fprintf(f, "{\n  \"device\": ");
    json_str(f, g.name);
    fprintf(f, ",\n  \"driver_version\": %d,\n", g.driver_version);
    fprintf(f, "  \"granularity_bytes\": %zu,\n", g.gran);
    fprintf(f, "  \"granularity_min_bytes\": %zu,\n", g.gran_min);
    fprintf(f, "  \"total_mem_bytes\": %zu,\n", g.total_mem);
    fprintf(f, "  \"busy_work_memsets\": %d,\n", g.busy_memsets);
    fprintf(f, "  \"busy_work_memset_bytes\": %zu,\n", g.busy_words * 4);
    fprintf(f, "  \"busy_work_us\": %.1f,\n", g.busy_us);
    fprintf(f, "  \"wall_s\": %.2f", wall_s);
    for (int s = 0; s < S_COUNT; s++) {
        fprintf(f, ",\n  \"%s\": {", SEC[s].key);
        int first = 1;
        for (int i = 0; i < g_nrows; i++) {
            const row_t *r = &g_rows[i];
            if (r->sec != s) continue;
            fprintf(f, "%s\n    ", first ? "" : ",");
            first = 0;
            json_str(f, r->name);
            fprintf(f, ": {\"mean_us\": %.3f, \"p50_us\": %.3f, "
                    "\"p90_us\": %.3f, \"n\": %d", r->st.mean, r->st.p50,
                    r->st.p90, r->st.n);
            if (!isnan(r->extra) && SEC[s].extra_key)
                fprintf(f, ", \"%s\": %.3f", SEC[s].extra_key, r->extra);
            if (r->blocked) {
                if (!isnan(r->idle_p50))
                    fprintf(f, ", \"idle_p50_us\": %.3f", r->idle_p50);
                fprintf(f, ", \"queued_work_us\": %.1f, \"blocked\": \"%s\"",
                        g.busy_us, r->blocked);
            }
            fputc('}', f);
        }
        fprintf(f, "%s}", first ? "" : "\n  ");
    }
    fprintf(f, "\n}\n");
}

/* One row per handle size, one column per VMM call: `p50 (p90)` of each
 * call, or (per_gib) the mean cost scaled to 1 GiB; the last column sums. */
static void md_per_size_table(FILE *f, int per_gib)
{
    for (size_t k = 0; k < N_PER_SIZE; k++) {
        char sz[32], name[112];
        mib_name(sz, sizeof sz, PER_SIZE_MIB[k] * MIB);
        double sum = 0;
        int found = 0;
        for (int c = 0; c < 5; c++) {
            snprintf(name, sizeof name, "%s/%s", VMM_CALLS[c], sz);
            const row_t *r = find_row(S_PER_SIZE, name);
            if (!r) continue;
            if (!found) fprintf(f, "| %zu MiB |", PER_SIZE_MIB[k]);
            found = 1;
            if (per_gib) {
                fprintf(f, " %.0f |", r->extra);
                sum += r->extra;
            } else {
                fprintf(f, " %.1f (%.1f) |", r->st.p50, r->st.p90);
                sum += r->st.p50;
            }
        }
        if (found) fprintf(f, per_gib ? " %.0f |\n" : " %.1f |\n", sum);
    }
}

static void md_per_size_pivot(FILE *f)
{
    fprintf(f, "p50 µs per call (p90 in parentheses):\n\n"
            "| handle size | cuMemCreate | cuMemMap | cuMemSetAccess | "
            "cuMemUnmap | cuMemRelease | sum of p50 |\n"
            "|---|---|---|---|---|---|---|\n");
    md_per_size_table(f, 0);
    fprintf(f, "\nmean µs per GiB (mean per call x 1 GiB / handle size):\n\n"
            "| handle size | cuMemCreate | cuMemMap | cuMemSetAccess | "
            "cuMemUnmap | cuMemRelease | total |\n"
            "|---|---|---|---|---|---|---|\n");
    md_per_size_table(f, 1);
    fprintf(f, "\n");
}

static void write_md(FILE *f, double wall_s)
{
    fprintf(f, "# CUDA VMM and synchronization costs\n\n");
    fprintf(f, "- Device: %s, total memory %.1f GiB\n", g.name,
            (double)g.total_mem / (double)GIB);
    fprintf(f, "- Driver API version: %d (%d.%d)\n", g.driver_version,
            g.driver_version / 1000, (g.driver_version % 1000) / 10);
    fprintf(f, "- Allocation granularity: recommended %zu KiB, minimum %zu KiB\n",
            g.gran / 1024, g.gran_min / 1024);
    fprintf(f, "- Busy work: %d x cuMemsetD32Async of %zu MiB = %.1f ms queued\n",
            g.busy_memsets, g.busy_words * 4 / MIB, g.busy_us / 1000.0);
    fprintf(f, "- Wall-clock µs around single driver calls (CLOCK_MONOTONIC), "
            "after %d warm-up repetitions; whole run %.1f s\n\n", WARMUP, wall_s);

    for (int s = 0; s < S_COUNT; s++) {
        fprintf(f, "## %s\n\n%s\n\n", SEC[s].title, SEC[s].note);
        if (s == S_PER_SIZE) md_per_size_pivot(f);
        int busy = (s == S_SYNC_BUSY || s == S_VMM_BUSY);
        fprintf(f, "| call | n | mean µs | p50 µs | p90 µs |");
        if (SEC[s].extra_hdr) fprintf(f, " %s |", SEC[s].extra_hdr);
        if (busy) fprintf(f, " idle p50 µs | blocked? |");
        fprintf(f, "\n|---|---:|---:|---:|---:|");
        if (SEC[s].extra_hdr) fprintf(f, "---:|");
        if (busy) fprintf(f, "---:|---|");
        fprintf(f, "\n");
        for (int i = 0; i < g_nrows; i++) {
            const row_t *r = &g_rows[i];
            if (r->sec != s) continue;
            fprintf(f, "| %s | %d | %.1f | %.1f | %.1f |", r->name, r->st.n,
                    r->st.mean, r->st.p50, r->st.p90);
            if (SEC[s].extra_hdr) fprintf(f, " %.1f |", r->extra);
            if (busy) {
                if (isnan(r->idle_p50))
                    fprintf(f, " - |");
                else
                    fprintf(f, " %.1f |", r->idle_p50);
                fprintf(f, " %s |", r->blocked ? r->blocked : "-");
            }
            fprintf(f, "\n");
        }
        fprintf(f, "\n");
    }
}

static void write_file(const char *path, void (*writer)(FILE *, double),
                       double wall_s)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        exit(1);
    }
    writer(f, wall_s);
    if (fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

/* ------------------------------------------------------------------ */
/* Setup, teardown, main                                              */
/* ------------------------------------------------------------------ */

static void setup(void)
{
    CK(cuInit(0));
    CK(cuDriverGetVersion(&g.driver_version));
    CK(cuDeviceGet(&g.dev, 0));
    CK(cuDeviceGetName(g.name, (int)sizeof g.name, g.dev));
    CK(cuDeviceTotalMem(&g.total_mem, g.dev));
    CK(cuDevicePrimaryCtxRetain(&g.ctx, g.dev));
    CK(cuCtxSetCurrent(g.ctx));

    memset(&g.prop, 0, sizeof g.prop);
    g.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    g.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    g.prop.location.id = (int)g.dev;
    CK(cuMemGetAllocationGranularity(&g.gran, &g.prop,
                                     CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CK(cuMemGetAllocationGranularity(&g.gran_min, &g.prop,
                                     CU_MEM_ALLOC_GRANULARITY_MINIMUM));

    memset(&g.access, 0, sizeof g.access);
    g.access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    g.access.location.id = (int)g.dev;
    g.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

    CK(cuStreamCreate(&g.side, CU_STREAM_NON_BLOCKING));
    CK(cuStreamCreate(&g.work, CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&g.ev_done, CU_EVENT_DISABLE_TIMING));
    CK(cuEventCreate(&g.ev_rec, CU_EVENT_DISABLE_TIMING));
    CK(cuEventCreate(&g.ev_pending, CU_EVENT_DISABLE_TIMING));

    fprintf(stderr, "device: %s, %.1f GiB, driver %d, granularity %zu "
            "(min %zu)\n", g.name, (double)g.total_mem / (double)GIB,
            g.driver_version, g.gran, g.gran_min);
}

static void teardown(void)
{
    CK(cuCtxSynchronize());
    CK(cuMemFree(g.busy_buf));
    CK(cuEventDestroy(g.ev_pending));
    CK(cuEventDestroy(g.ev_rec));
    CK(cuEventDestroy(g.ev_done));
    CK(cuStreamDestroy(g.work));
    CK(cuStreamDestroy(g.side));
    CK(cuDevicePrimaryCtxRelease(g.dev));
}

int main(int argc, char **argv)
{
    const char *json_path = argc > 1 ? argv[1] : "vmm_costs.json";
    const char *md_path = argc > 2 ? argv[2] : "vmm_costs.md";
    const char *sc = getenv("VMM_COSTS_SCALE");
    g.scale = sc ? atof(sc) : 1.0;
    if (!(g.scale > 0)) g.scale = 1.0;
    g.t_start = now_ns();

    setup();
    bench_per_size();
    bench_n_handles();
    bench_remap_cached();
    bench_reserve();
    setup_busy_work();
    bench_sync();
    bench_vmm_busy();
    bench_cumemalloc();
    teardown();

    double wall_s = us_since(g.t_start) / 1e6;
    write_file(json_path, write_json, wall_s);
    write_file(md_path, write_md, wall_s);
    fprintf(stderr, "done in %.1f s: %s, %s\n", wall_s, json_path, md_path);
    return 0;
}
