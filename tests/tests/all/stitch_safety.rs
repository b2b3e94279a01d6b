//! Stitch repair under the stream-safety oracle (`Checked`): no part of a
//! cached stitch is unmapped while work that used the stitch may still run.

use gpualloc_tests::{Checked, MIB};

/// The layout of stitch_repair's tests, under the stream-safety oracle:
/// work that used the stitched allocation is still queued when the next
/// request replaces a busy part of the cached stitch.
#[test]
fn repair_waits_for_the_stitchs_work() {
    let mut c = Checked::with(1 << 30, "expandable_handle_mb:2");
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
    let mut held: Vec<u64> = (0..4).map(|_| c.malloc(16 * MIB, 0).unwrap()).collect();
    c.use_on(stitched, 0);
    c.release(stitched);
    small.push(c.malloc(2 * MIB, 0).unwrap());
    let h = held.remove(0);
    c.release(h);
    let again = c.malloc(64 * MIB, 0).unwrap();
    assert_eq!(again, stitched, "repaired");
}

/// Defragmentation punches a part out of a cached stitch whose work is queued.
#[test]
fn punch_waits_for_the_stitchs_work() {
    let mut c = Checked::with(
        1 << 30,
        "expandable_handle_mb:2,defragment_budget:1,defragment_headroom:0.0973",
    );
    let mut large = Vec::new();
    let mut live = Vec::new();
    for _ in 0..8 {
        large.push(c.malloc(16 * MIB, 0).unwrap());
        live.push(c.malloc(2 * MIB, 0).unwrap());
    }
    for p in large {
        c.release(p);
    }
    let stitched = c.malloc(64 * MIB, 0).unwrap();
    live.extend((0..4).map(|_| c.malloc(16 * MIB, 0).unwrap()));
    c.use_on(stitched, 0);
    c.release(stitched);
    let last = live.remove(7);
    c.release(last);
    let _p = c.malloc(18 * MIB, 0).unwrap();
}
