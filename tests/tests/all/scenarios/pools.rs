//! Pool and segment size (reference 1.4): requests of at most 1 MiB use the
//! small pool and 2 MiB segments; below 10 MiB a 20 MiB segment; otherwise
//! the request rounded up to 2 MiB.

use gpualloc::size_class::PoolKind;
use gpualloc_tests::{Checked, KIB, MIB};

/// Allocates `size` on a fresh allocator: the pool kind and the segment size obtained.
fn segment_for(config: &str, size: u64) -> (PoolKind, u64) {
    let mut c = Checked::with(1 << 30, config);
    let p = c.alloc(size, 0);
    assert_eq!(c.sim().counters.allocate, 1);
    let snap = c.snapshot();
    assert_eq!(snap.len(), 1);
    let kind = c.find_block(p).unwrap().1;
    assert_eq!(kind, snap[0].kind);
    (kind, snap[0].total_size)
}

#[test]
fn segment_sizes_follow_pytorch() {
    for (size, kind, seg) in [
        (1, PoolKind::Small, 2 * MIB),
        (MIB, PoolKind::Small, 2 * MIB),
        (MIB + 1, PoolKind::Large, 20 * MIB),
        (5 * MIB, PoolKind::Large, 20 * MIB),
        (10 * MIB - 512, PoolKind::Large, 20 * MIB),
        (10 * MIB, PoolKind::Large, 10 * MIB),
        (10 * MIB + 1, PoolKind::Large, 12 * MIB),
        (21 * MIB, PoolKind::Large, 22 * MIB),
        (100 * MIB + 512, PoolKind::Large, 102 * MIB),
    ] {
        assert_eq!(
            segment_for("policy:pytorch,cross_stream_reuse:true", size),
            (kind, seg),
            "{size} B"
        );
    }
}

#[test]
fn large_segment_size_mb_changes_the_mid_range_segment() {
    assert_eq!(
        segment_for(
            "policy:pytorch,cross_stream_reuse:true,large_segment_size_mb:32",
            5 * MIB
        ),
        (PoolKind::Large, 32 * MIB)
    );
    assert_eq!(
        segment_for(
            "policy:pytorch,cross_stream_reuse:true,large_segment_size_mb:32",
            12 * MIB
        ),
        (PoolKind::Large, 12 * MIB)
    );
}

#[test]
fn small_requests_share_a_2_mib_segment() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let ps: Vec<u64> = (0..4).map(|_| c.alloc(512 * KIB, 0)).collect();
    assert_eq!(
        c.segments(),
        1,
        "four 512 KiB blocks fill one 2 MiB segment"
    );
    assert_eq!(c.stats().allocated_bytes.small_pool.current, 2 * MIB as i64);
    assert_eq!(c.stats().allocated_bytes.large_pool.current, 0);
    c.alloc(512, 0);
    assert_eq!(c.segments(), 2);
    assert_eq!(c.stats().segment.small_pool.current, 2);
    assert_eq!(c.stats().reserved_bytes.small_pool.current, 4 * MIB as i64);
    for p in ps {
        c.release(p);
    }
}

#[test]
fn small_and_large_pools_never_share_blocks() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let big = c.alloc(2 * MIB, 0); // 20 MiB large segment, 18 MiB cached
    let small = c.alloc(4 * KIB, 0);
    assert_eq!(
        c.segments(),
        2,
        "a small request does not carve the large remainder"
    );
    assert_eq!(c.find_block(small).unwrap().1, PoolKind::Small);
    c.release(small);
    c.release(big);
    assert_eq!(c.stats().reserved_bytes.large_pool.current, 20 * MIB as i64);
    assert_eq!(c.stats().reserved_bytes.small_pool.current, 2 * MIB as i64);
}
