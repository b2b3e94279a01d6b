//! Stitch repair under the stream-safety oracle (`Checked`): no part of a
//! cached stitch is unmapped while work that used the stitch may still run.

use gpualloc_tests::{Checked, MIB};

/// The layout of stitch_repair's tests under `conf` and the oracle: eight
/// 16 MiB pieces with 2 MiB live blocks between them, a 64 MiB stitch over
/// four pieces, used on stream 0 and freed with its work still queued, and
/// the other four pieces held. Returns the checker, the stitch's address,
/// the 2 MiB blocks and the held pieces.
fn cached_stitch_with_queued_work(conf: &str) -> (Checked, u64, Vec<u64>, Vec<u64>) {
    let mut c = Checked::with(1 << 30, conf);
    let mut large = Vec::new();
    let mut small = Vec::new();
    for _ in 0..8 {
        large.push(c.malloc(16 * MIB, 0).unwrap());
        small.push(c.malloc(2 * MIB, 0).unwrap());
    }
    for p in large {
        c.release(p);
    }
    let stitched = c.malloc(64 * MIB, 0).unwrap();
    let held: Vec<u64> = (0..4).map(|_| c.malloc(16 * MIB, 0).unwrap()).collect();
    c.use_on(stitched, 0);
    c.release(stitched);
    (c, stitched, small, held)
}

/// The next request replaces a busy part of the cached stitch.
#[test]
fn repair_waits_for_the_stitchs_work() {
    let (mut c, stitched, mut small, mut held) =
        cached_stitch_with_queued_work("expandable_handle_mb:2");
    small.push(c.malloc(2 * MIB, 0).unwrap());
    let h = held.remove(0);
    c.release(h);
    let again = c.malloc(64 * MIB, 0).unwrap();
    assert_eq!(again, stitched, "repaired");
}

/// Defragmentation punches a part out of a cached stitch whose work is queued.
#[test]
fn punch_waits_for_the_stitchs_work() {
    let (mut c, _, mut small, _held) = cached_stitch_with_queued_work(
        "expandable_handle_mb:2,defragment_budget:1,defragment_headroom:0.0973",
    );
    let last = small.remove(7);
    c.release(last);
    let _p = c.malloc(18 * MIB, 0).unwrap();
}
