//! `max_split_size_mb` and oversize blocks (reference 1.5, 1.6): an oversize
//! cached block never serves a non-oversize request, and serves an oversize
//! one only within `max_non_split_rounding`.

use gpualloc_tests::{Checked, MIB};

#[test]
fn oversize_block_never_serves_a_smaller_class_request() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:32",
    );
    let big = c.alloc(40 * MIB, 0);
    c.release(big);
    let allocs = c.sim().counters.allocate;
    let p = c.alloc(30 * MIB, 0);
    assert_ne!(
        p, big,
        "30 MiB < max_split_size must not take the 40 MiB block"
    );
    assert_eq!(c.sim().counters.allocate, allocs + 1);
    let q = c.alloc(2 * MIB, 0);
    assert_ne!(q, big);
}

#[test]
fn oversize_request_takes_a_block_within_the_rounding_slack() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:32",
    );
    let big = c.alloc(40 * MIB, 0);
    c.release(big);
    // 40 < 36 + 20: usable, and not split.
    assert_eq!(c.alloc(36 * MIB, 0), big);
    assert_eq!(c.stats().allocated_bytes.all.current, 40 * MIB as i64);
    assert_eq!(c.stats().requested_bytes.all.current, 36 * MIB as i64);
}

#[test]
fn oversize_request_skips_a_block_beyond_the_rounding_slack() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:32",
    );
    let huge = c.alloc(60 * MIB, 0);
    c.release(huge);
    // 60 >= 36 + 20: too wasteful, a new segment.
    let p = c.alloc(36 * MIB, 0);
    assert_ne!(p, huge);
    assert_eq!(c.segments(), 2);
}

#[test]
fn max_non_split_rounding_mb_narrows_the_slack() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:32,max_non_split_rounding_mb:4",
    );
    let big = c.alloc(40 * MIB, 0);
    c.release(big);
    assert_ne!(c.alloc(36 * MIB, 0), big, "40 >= 36 + 4");
    assert_eq!(c.alloc(37 * MIB, 0), big, "40 < 37 + 4");
}

#[test]
fn oversize_stats_count_allocations_and_segments() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:32",
    );
    assert_eq!(c.stats().max_split_size, 32 * MIB as i64);
    let a = c.alloc(40 * MIB, 0);
    let b = c.alloc(4 * MIB, 0);
    assert_eq!(c.stats().oversize_allocations.current, 1);
    assert_eq!(c.stats().oversize_segments.current, 1);
    c.release(a);
    c.release(b);
    assert_eq!(c.stats().oversize_allocations.current, 0);
    assert_eq!(c.stats().oversize_allocations.freed, 1);
    assert_eq!(c.stats().oversize_segments.current, 1, "still cached");
    c.empty_cache();
    assert_eq!(c.stats().oversize_segments.current, 0);
    assert_eq!(c.stats().oversize_segments.peak, 1);
}

#[test]
fn without_max_split_size_nothing_is_oversize() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    assert_eq!(
        c.stats().max_split_size,
        -1,
        "PyTorch reports SIZE_MAX as -1"
    );
    let a = c.alloc(100 * MIB, 0);
    c.release(a);
    // 30 MiB may carve the cached 100 MiB block.
    assert_eq!(c.alloc(30 * MIB, 0), a);
    assert_eq!(c.stats().oversize_allocations.allocated, 0);
}
