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

/// Defragmentation punches a part out of a cached stitch whose work is
/// queued, for a request on the stitch's stream: no host wait; the hole
/// leaves its address only once the work is done (Note [Punching behind
/// the work]), which the oracle checks, and then at the next slow path.
#[test]
fn punch_for_the_stitchs_stream_leaves_after_its_work() {
    let (mut c, _, mut small, _held) = cached_stitch_with_queued_work(PUNCH);
    let last = small.remove(7);
    c.release(last);
    let waits = c.sim().counters.wait_event;
    let _p = c.malloc(18 * MIB, 0).unwrap();
    assert_eq!(c.sim().counters.wait_event, waits, "no host wait");
    c.complete(0);
    c.empty_cache();
}

/// The same punch with `defer_unmap:false`: the host waits for the
/// stitch's work first. For a request of another stream, that stream waits
/// for it on the GPU instead.
#[test]
fn punch_without_deferral_waits_and_another_stream_is_ordered() {
    let (mut c, _, mut small, _held) =
        cached_stitch_with_queued_work(&format!("{PUNCH},defer_unmap:false"));
    let last = small.remove(7);
    c.release(last);
    let waits = c.sim().counters.wait_event;
    let _p = c.malloc(18 * MIB, 0).unwrap();
    assert!(c.sim().counters.wait_event > waits, "the punch waits");

    let (mut c, _, mut small, _held) = cached_stitch_with_queued_work(PUNCH);
    let last = small.remove(7);
    c.release(last);
    let waits = c.sim().counters.wait_event;
    let ordered = c.sim().counters.stream_wait_event;
    let _p = c.malloc(18 * MIB, 1).unwrap();
    assert_eq!(c.sim().counters.wait_event, waits, "no host wait");
    assert!(c.sim().counters.stream_wait_event > ordered);
    assert!(c.ordered(1, 0, 1), "stream 1 after the stitch's work");
    c.complete_all();
    c.empty_cache();
}

/// Headroom that makes an 18 MiB request take one handle of the cached
/// stitch (stitch_repair's `ONE_HANDLE`).
const PUNCH: &str = "expandable_handle_mb:2,defragment_budget:1,defragment_headroom:0.0973";
