//! Best fit per stream (reference 1.5): the smallest cached block of the
//! request's own stream that fits; another stream's blocks only through
//! gpualloc's cross-stream reuse, ordered by an event.

use gpualloc_tests::{Checked, MIB};

const A: u64 = 7;
const B: u64 = 9;

#[test]
fn smallest_fitting_block_of_the_stream_is_chosen() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    // Three separate large segments (>= 10 MiB: sized to the request).
    let big = c.alloc(16 * MIB, A);
    let mid = c.alloc(12 * MIB, A);
    let small = c.alloc(10 * MIB, A);
    for p in [big, mid, small] {
        c.release(p);
    }
    let allocs = c.sim().counters.allocate;
    // 11 MiB fits in 12 and 16: the 12 MiB block is the best fit.
    assert_eq!(c.alloc(11 * MIB, A), mid);
    // 10 MiB: exactly the 10 MiB block.
    assert_eq!(c.alloc(10 * MIB, A), small);
    assert_eq!(c.sim().counters.allocate, allocs, "served from the cache");
}

#[test]
fn small_pool_best_fit_among_split_pieces() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let p: Vec<u64> = [4096, 512, 8192, 512, 2048, 512]
        .iter()
        .map(|&s| c.alloc(s, A))
        .collect();
    // Free the 4 KiB, 8 KiB and 2 KiB pieces; the 512 B ones keep them apart.
    c.release(p[0]);
    c.release(p[2]);
    c.release(p[4]);
    assert_eq!(
        c.alloc(2000, A),
        p[4],
        "2 KiB hole is the best fit for 2000 B"
    );
    assert_eq!(c.alloc(3000, A), p[0], "4 KiB hole next");
    assert_eq!(c.segments(), 1);
}

#[test]
fn another_streams_block_is_not_used_without_cross_stream_reuse() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:false");
    let a = c.alloc(12 * MIB, A);
    c.release(a);
    let allocs = c.sim().counters.allocate;
    let b = c.alloc(12 * MIB, B);
    assert_ne!(a, b, "stream B must not get stream A's cached block");
    assert_eq!(
        c.sim().counters.allocate,
        allocs + 1,
        "a new segment for stream B"
    );
    assert_eq!(c.sim().counters.stream_wait_event, 0);
    assert_eq!(c.stats().num_cross_stream_reuse, 0);
    // The same holds in the small pool.
    let s = c.alloc(1000, A);
    c.release(s);
    let t = c.alloc(1000, B);
    assert_ne!(s, t);
}

#[test]
fn cross_stream_reuse_waits_on_an_event_instead_of_growing() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(12 * MIB, A);
    let seq = c.use_on(a, A);
    c.release(a);
    let (allocs, waits) = (
        c.sim().counters.allocate,
        c.sim().counters.stream_wait_event,
    );
    let b = c.alloc(12 * MIB, B);
    assert_eq!(
        b, a,
        "the pool would otherwise grow: stream A's block is taken"
    );
    assert_eq!(c.sim().counters.allocate, allocs, "no new segment");
    assert_eq!(
        c.sim().counters.stream_wait_event,
        waits + 1,
        "B waits on an event of A"
    );
    assert_eq!(c.stats().num_cross_stream_reuse, 1);
    assert!(
        c.sim().is_ordered_after(B, A, seq),
        "A's kernel is ordered before B's work"
    );
    assert!(
        !c.sim().is_ordered_after(A + 100, A, seq),
        "nothing completed: the order comes from the wait"
    );
}

#[test]
fn own_stream_block_is_preferred_to_a_better_fitting_one_of_another_stream() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(12 * MIB, A);
    let b = c.alloc(16 * MIB, B);
    c.release(a);
    c.release(b);
    assert_eq!(
        c.alloc(11 * MIB, B),
        b,
        "B's own 16 MiB block before A's 12 MiB one"
    );
    assert_eq!(c.sim().counters.stream_wait_event, 0);
}

/// The cache-only lookup the C ABI makes before running a miss callback
/// (Note [Free-memory callbacks] in `capi/src/miss.rs`): it serves what
/// `malloc` would serve from the stream's own cached blocks, and on a miss
/// changes nothing (no growth, no mapping, no stitch, no other stream's
/// block, no out-of-memory error), so that `malloc` then runs as it would have.
fn cached_lookup_serves_hits_and_leaves_misses_to_malloc(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    assert_eq!(c.malloc_cached(0, A), Some(0));
    assert_eq!(c.malloc_cached(8 * MIB, A), None, "an empty cache misses");
    let p = c.alloc(8 * MIB, A);
    c.release(p);
    assert_eq!(
        c.malloc_cached(8 * MIB, B),
        None,
        "another stream's block is malloc's to take"
    );
    let q = c
        .malloc_cached(8 * MIB, A)
        .expect("the stream's own cached block");
    assert_eq!(q, p);
    assert_eq!(c.malloc_cached(64 * MIB, A), None);
    assert_eq!(
        c.malloc_cached(2 << 30, A),
        None,
        "a request over the device is malloc's to refuse"
    );
    assert!(c.malloc(2 << 30, A).is_err());
    let r = c.alloc(64 * MIB, A);
    c.release(r);
    c.release(q);
}

under_both_policies!(cached_lookup_serves_hits_and_leaves_misses_to_malloc);
