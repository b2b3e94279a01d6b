//! Splitting (reference 1.6): small blocks split when at least 512 B
//! remain; large blocks only when the request is below `max_split_size` and
//! more than 1 MiB remains. The request is carved at the front.

use gpualloc_tests::{Checked, KIB, MIB};

#[test]
fn small_remainder_of_512_is_split_off() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(MIB, 0);
    let b = c.alloc(MIB - 512, 0);
    assert_eq!(b, a + MIB, "carved at the front of the remainder");
    assert_eq!(c.stats().inactive_split.small_pool.current, 1);
    assert_eq!(c.stats().inactive_split_bytes.small_pool.current, 512);
    let d = c.alloc(1, 0);
    assert_eq!(d, b + MIB - 512, "the 512 B remainder serves a 1 B request");
    assert_eq!(c.segments(), 1);
    assert_eq!(c.stats().inactive_split.small_pool.current, 0);
}

#[test]
fn large_remainder_of_exactly_1_mib_is_not_split() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    // 19 MiB needs a 20 MiB segment; 1 MiB would remain: not > 1 MiB.
    c.alloc(19 * MIB, 0);
    assert_eq!(c.stats().allocated_bytes.all.current, 20 * MIB as i64);
    assert_eq!(c.stats().requested_bytes.all.current, 19 * MIB as i64);
    assert_eq!(c.stats().inactive_split.all.current, 0);
}

#[test]
fn large_remainder_above_1_mib_is_split() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(19 * MIB - 512, 0);
    assert_eq!(
        c.stats().allocated_bytes.all.current,
        (19 * MIB - 512) as i64
    );
    assert_eq!(
        c.stats().inactive_split_bytes.large_pool.current,
        (MIB + 512) as i64
    );
    let b = c.alloc(MIB + 1, 0);
    assert_eq!(b, a + 19 * MIB - 512);
    assert_eq!(c.segments(), 1);
}

#[test]
fn cached_large_block_splits_for_a_smaller_request() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(3 * MIB, 0); // 20 MiB segment: [3][17 free]
    c.release(a);
    let b = c.alloc(4 * MIB, 0);
    assert_eq!(b, a);
    assert_eq!(c.stats().allocated_bytes.all.current, 4 * MIB as i64);
    assert_eq!(
        c.stats().inactive_split_bytes.large_pool.current,
        16 * MIB as i64
    );
}

#[test]
fn request_at_or_above_max_split_size_is_never_split() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:20",
    );
    let a = c.alloc(30 * MIB, 0);
    c.release(a);
    // 25 MiB is oversize: it takes the 30 MiB block whole (30 < 25 + 20).
    assert_eq!(c.alloc(25 * MIB, 0), a);
    assert_eq!(c.stats().allocated_bytes.all.current, 30 * MIB as i64);
    assert_eq!(c.stats().inactive_split.all.current, 0);
    assert_eq!(c.stats().oversize_allocations.current, 1);
}

#[test]
fn small_pool_pieces_are_exact() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    for s in [512, 1024, 4 * KIB, 100 * KIB] {
        let before = c.stats().allocated_bytes.all.current;
        c.alloc(s, 0);
        assert_eq!((c.stats().allocated_bytes.all.current - before) as u64, s);
    }
    assert_eq!(c.segments(), 1);
}
