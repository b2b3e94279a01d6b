//! Tests of `stitch_repair.rs` (a sibling file: the module's own file stays short).

use crate::stitch::tests::{fragmented_with, teardown};
use crate::stitch_cache::Slot;
use crate::{DeviceAllocator, DriverCall, DriverCalls, SimBackend};

const MIB: u64 = 1 << 20;

/// The invariants, and every stitch's range as the simulator maps it:
/// its parts' handles at their offsets, nothing in its holes but what
/// waits to leave (Note [Punching behind the work]).
fn ok(d: &DeviceAllocator<SimBackend>) {
    d.check_invariants()
        .unwrap_or_else(|e| panic!("invariant broken: {e}"));
    for s in &d.stitches.list {
        let mut want = Vec::new();
        let mut at = s.va;
        for slot in &s.slots {
            if let Slot::Mapped(p) = slot {
                want.push((at, p.handle, p.size));
            }
            at += slot.size();
        }
        for (lo, handles) in d.drains.mappings() {
            if s.va <= lo && lo < s.va + s.size {
                let mut at = lo;
                for &(h, size) in handles {
                    want.push((at, h, size));
                    at += size;
                }
            }
        }
        want.sort_unstable();
        assert_eq!(d.backend().handles_over(s.va, s.size), want);
    }
}

/// A checked request of `size` on stream 0: its address, the driver calls
/// it made, and the bytes reserved before it.
fn measured_malloc(d: &mut DeviceAllocator<SimBackend>, size: u64) -> (u64, DriverCalls, i64) {
    let reserved = d.stats().reserved_bytes.all.current;
    let calls = d.driver_calls();
    let p = d.malloc(size, 0).unwrap();
    ok(d);
    (p, d.driver_calls().since(&calls), reserved)
}

/// Headroom that puts the bound 1.99 MiB under what an 18 MiB request
/// needs in the layout of [`one_part_short`]: one 2 MiB handle.
const ONE_HANDLE: &str = "expandable_handle_mb:2,defragment_budget:1,defragment_headroom:0.0973";

/// The fragmented layout with a cached 64 MiB stitch over four pieces
/// and the other four pieces held, and the last small block (next to
/// the unmapped tail) freed: the only free pages are the stitch's.
/// Returns the device, the stitch's address and the blocks still live.
fn one_part_short(conf: &str) -> (DeviceAllocator<SimBackend>, u64, Vec<u64>) {
    let (mut d, mut live) = fragmented_with(conf);
    let stitched = d.malloc(64 * MIB, 0).unwrap();
    assert_eq!(d.stats().num_stitch, 1);
    live.extend((0..4).map(|_| d.malloc(16 * MIB, 0).unwrap()));
    d.free(stitched).unwrap();
    let last = live.remove(7);
    d.free(last).unwrap();
    ok(&d);
    (d, stitched, live)
}

#[test]
fn defragmentation_takes_one_part_and_the_next_claim_maps_one_handle() {
    let (mut d, stitched, mut live) = one_part_short(ONE_HANDLE);
    let reserved = d.stats().reserved_bytes.all.current;
    // 18 MiB fits in no free piece: the free 2 MiB at the end and 16 MiB
    // of pages after it, one handle of them moved from the stitch.
    let calls = d.driver_calls();
    let pushed = d.drains.unmaps().0.handles(DriverCall::Unmap);
    let p = d.malloc(18 * MIB, 0).unwrap();
    ok(&d);
    let spent = d.driver_calls().since(&calls);
    assert_eq!(
        d.stats().reserved_bytes.all.current,
        reserved + 14 * MIB as i64
    );
    // One handle unmapped at home and one in the stitch, nothing more
    // (now, or once the work on them is done).
    let later = d.drains.unmaps().0.handles(DriverCall::Unmap) - pushed;
    assert_eq!(spent.calls(DriverCall::Unmap) + later, 2, "{spent}");
    assert_eq!(spent.handles(DriverCall::Unmap) + later, 2, "{spent}");
    let in_stitch = d
        .drains
        .ranges()
        .filter(|r| d.stitches.list[0].holds(r.0, r.1))
        .count() as u64;
    assert_eq!(d.stitches.list.len(), 1, "the stitch stays cached");
    assert_eq!(d.stitches.list[0].holes(), 1);
    d.free(p).unwrap();
    let (again, spent, reserved) = measured_malloc(&mut d, 64 * MIB);
    assert_eq!(again, stitched, "the same range, repaired");
    assert_eq!(d.stats().num_stitch, 1, "no stitch built");
    // A repair is neither a build nor a whole take (Note [When a
    // stitch pays]).
    assert_eq!((d.stitches.built, d.stitches.taken_whole), (1, 0));
    assert_eq!(spent.calls(DriverCall::Map), 1, "{spent}");
    // Only the hole left to leave later, if it was, is unmapped now.
    assert_eq!(spent.calls(DriverCall::Unmap), in_stitch, "{spent}");
    assert_eq!(spent.calls(DriverCall::Reserve), 0, "{spent}");
    assert_eq!(d.stats().reserved_bytes.all.current, reserved);
    assert_eq!(d.stitches.list[0].holes(), 0);
    live.push(again);
    teardown(d, live);
}

/// The fragmented layout under 2 MiB handles with a cached 64 MiB
/// stitch over four free pieces and the other four pieces held: the
/// device, the live blocks, the stitch's address and the held pieces.
fn cached_stitch() -> (DeviceAllocator<SimBackend>, Vec<u64>, u64, Vec<u64>) {
    let (mut d, live) = fragmented_with("expandable_handle_mb:2");
    let stitched = d.malloc(64 * MIB, 0).unwrap();
    let held: Vec<u64> = (0..4).map(|_| d.malloc(16 * MIB, 0).unwrap()).collect();
    d.free(stitched).unwrap();
    (d, live, stitched, held)
}

#[test]
fn a_part_whose_home_is_in_use_is_replaced_alone() {
    let (mut d, mut live, stitched, mut held) = cached_stitch();
    // A small block lands in the first free piece: one handle of the
    // stitch is in use at home. A held piece is freed.
    live.push(d.malloc(2 * MIB, 0).unwrap());
    d.free(held.remove(0)).unwrap();
    ok(&d);
    let (again, spent, reserved) = measured_malloc(&mut d, 64 * MIB);
    assert_eq!(again, stitched, "the same range, one part replaced");
    assert_eq!(d.stats().num_stitch, 1, "no stitch built");
    assert_eq!(spent.handles(DriverCall::Unmap), 1, "{spent}");
    assert_eq!(spent.handles(DriverCall::Map), 1, "{spent}");
    assert_eq!(spent.calls(DriverCall::Reserve), 0, "{spent}");
    assert_eq!(d.stats().reserved_bytes.all.current, reserved);
    live.extend(held);
    live.push(again);
    teardown(d, live);
}

/// The stitch ranges still to be unmapped once their work is done.
fn draining_in_stitches(d: &DeviceAllocator<SimBackend>) -> usize {
    d.drains
        .ranges()
        .filter(|r| d.stitches.list.iter().any(|s| s.holds(r.0, r.1)))
        .count()
}

/// A handle moved for a request on the cached stitch's own stream
/// leaves the stitch without a host wait: its hole stays mapped until
/// the stitch's work is known done, and leaves at the next slow path
/// after that. With `defer_unmap:false` the punch waits, as it did.
#[test]
fn a_punch_for_the_stitchs_own_stream_does_not_wait() {
    let (mut d, _, mut live) = one_part_short(ONE_HANDLE);
    let waits = d.backend.counters.wait_event;
    live.push(d.malloc(18 * MIB, 0).unwrap());
    ok(&d);
    assert_eq!(d.backend.counters.wait_event, waits, "no host wait");
    assert_eq!(d.stitches.list[0].holes(), 1);
    assert_eq!(draining_in_stitches(&d), 1, "the hole is still mapped");
    d.backend.complete(0);
    d.retire_drains().unwrap();
    ok(&d);
    assert_eq!(draining_in_stitches(&d), 0, "gone once the work is done");
    assert_eq!(d.backend.counters.wait_event, waits, "still no host wait");
    teardown(d, live);

    let (mut d, _, mut live) = one_part_short(&format!("{ONE_HANDLE},defer_unmap:false"));
    let waits = d.backend.counters.wait_event;
    live.push(d.malloc(18 * MIB, 0).unwrap());
    ok(&d);
    assert!(d.backend.counters.wait_event > waits, "the punch waits");
    assert_eq!(draining_in_stitches(&d), 0);
    teardown(d, live);
}

/// A hole still mapped is unmapped before the stitch is repaired over
/// it, and before a stitch that cannot be repaired is freed.
#[test]
fn a_hole_still_mapped_leaves_before_a_repair_or_a_drop() {
    let (mut d, stitched, mut live) = one_part_short(ONE_HANDLE);
    let p = d.malloc(18 * MIB, 0).unwrap();
    assert_eq!(draining_in_stitches(&d), 1);
    d.free(p).unwrap();
    let again = d.malloc(64 * MIB, 0).unwrap();
    ok(&d);
    assert_eq!(again, stitched, "repaired in place");
    assert_eq!(draining_in_stitches(&d), 0);
    live.push(again);
    teardown(d, live);

    let (mut d, _, mut live) = one_part_short(ONE_HANDLE);
    live.push(d.malloc(18 * MIB, 0).unwrap());
    assert_eq!(draining_in_stitches(&d), 1);
    // The hole cannot be filled: the stitch is dropped, its range freed.
    live.push(d.malloc(64 * MIB, 0).unwrap());
    ok(&d);
    assert!(d.stitches.list.is_empty());
    assert_eq!(draining_in_stitches(&d), 0);
    teardown(d, live);
}

/// A stitch freed while one of its holes is still mapped (Note
/// [Punching behind the work]): whichever unmapping fails, the stitch
/// is gone or still maps its parts, never left cached mapping nothing.
#[test]
fn a_failed_unmap_while_freeing_a_stitch_with_a_hole_still_mapped() {
    use crate::backend::SimCall;
    for (conf, size) in [
        // The hole cannot be filled: the stitch is dropped.
        (ONE_HANDLE, 64 * MIB),
        // Defragmentation takes every part it has left.
        (
            "expandable_handle_mb:2,defragment_budget:1,defragment_headroom:0,defragment_pressure:1",
            50 * MIB,
        ),
    ] {
        for n in 1..=4 {
            let (mut d, _, mut live) = one_part_short(conf);
            live.push(d.malloc(18 * MIB, 0).unwrap());
            assert_eq!(draining_in_stitches(&d), 1);
            d.backend_mut().fail_call(SimCall::Unmap, n);
            if let Ok(p) = d.malloc(size, 0) {
                live.push(p);
            }
            ok(&d);
            teardown(d, live);
        }
    }
}

/// The cached stitch repaired once (one busy part), then, as if its
/// repairs had replaced `worn(parts)` parts, claimed again with another
/// busy part and another piece free. Returns the device, the live
/// blocks (the claim's included), the stitch's address, the claim's
/// address, the driver calls the claim made and the old stitch's home
/// addresses before the claim.
#[allow(clippy::type_complexity)]
fn claim_when_repaired(
    worn: impl Fn(u64) -> u64,
) -> (
    DeviceAllocator<SimBackend>,
    Vec<u64>,
    u64,
    u64,
    crate::DriverCalls,
    Vec<u64>,
) {
    let (mut d, mut live, stitched, mut held) = cached_stitch();
    live.push(d.malloc(2 * MIB, 0).unwrap());
    d.free(held.remove(0)).unwrap();
    let again = d.malloc(64 * MIB, 0).unwrap();
    assert_eq!(again, stitched);
    assert_eq!(d.stitches.list[0].repaired, 1, "one part replaced");
    d.free(again).unwrap();
    d.stitches.list[0].repaired = worn(d.stitches.list[0].slots.len() as u64);
    live.push(d.malloc(2 * MIB, 0).unwrap());
    d.free(held.remove(0)).unwrap();
    let homes: Vec<u64> = d.stitches.list[0].parts().map(|p| p.addr).collect();
    let calls = d.driver_calls();
    let claim = d.malloc(64 * MIB, 0).unwrap();
    ok(&d);
    let spent = d.driver_calls().since(&calls);
    live.extend(held);
    live.push(claim);
    (d, live, stitched, claim, spent, homes)
}

/// Repairs that have replaced as many parts as the stitch has: the
/// next one that needs changing is left as it is (for the layout it
/// fits) and a new stitch is built over the free pieces.
#[test]
fn a_stitch_whose_repairs_cost_a_build_gets_a_second_stitch() {
    let (d, live, stitched, claim, spent, homes) = claim_when_repaired(|parts| parts);
    assert_ne!(claim, stitched, "a new stitch");
    assert_eq!(d.stats().num_stitch, 2);
    assert_eq!(spent.calls(DriverCall::Unmap), 0, "{spent}");
    let kept: Vec<u64> = d.stitches.list[0].parts().map(|p| p.addr).collect();
    assert_eq!(kept, homes, "the old stitch is kept as it was");
    teardown(d, live);
}

/// One part short of that, the stitch is repaired in place again.
#[test]
fn a_stitch_repaired_less_than_its_parts_is_repaired_again() {
    let (d, live, stitched, claim, spent, _) = claim_when_repaired(|parts| parts - 1);
    assert_eq!(claim, stitched, "repaired in place");
    assert_eq!(d.stats().num_stitch, 1);
    assert_eq!(spent.handles(DriverCall::Map), 1, "{spent}");
    assert_eq!(
        d.stitches.list[0].repaired,
        d.stitches.list[0].slots.len() as u64
    );
    teardown(d, live);
}

/// The cached stitch repaired once (one busy part, its handle replaced
/// by one of the first held piece's), then, with `whole_between`,
/// taken whole and freed again; then a block lands on the handle the
/// repair put in and the other held pieces are freed. Claims the
/// stitch's size again and tears down; returns whether the claim got the
/// stitch's own range, and the host waits and stitch builds it made.
fn claim_when_the_repaired_part_is_busy(whole_between: bool) -> (bool, u64, i64) {
    let (mut d, mut live, stitched, mut held) = cached_stitch();
    live.push(d.malloc(2 * MIB, 0).unwrap());
    d.free(held.remove(0)).unwrap();
    let again = d.malloc(64 * MIB, 0).unwrap();
    assert_eq!(again, stitched, "repaired in place");
    let fresh = d.stitches.list[0].fresh.clone();
    assert_eq!(fresh.len(), 1, "one handle put in");
    // The rest of the piece the repair took a handle from fills up, so
    // that the handle, once the stitch is freed, is the smallest free
    // block and the next block lands on it: its home is in use again.
    let before = live.len();
    for _ in 0..7 {
        live.push(d.malloc(2 * MIB, 0).unwrap());
    }
    d.free(again).unwrap();
    if whole_between {
        let whole = d.malloc(64 * MIB, 0).unwrap();
        assert_eq!(whole, stitched, "taken whole");
        assert!(d.stitches.list[0].fresh.is_empty());
        d.free(whole).unwrap();
    }
    live.push(d.malloc(2 * MIB, 0).unwrap());
    let busy = d.busy_parts(&d.stitches.list[0]);
    assert_eq!(busy, fresh, "{} blocks placed", live.len() - before);
    // Still a stitch a repair would take (at most a quarter of its
    // handles to change), and room for a new one.
    assert!(busy.len() * 4 <= d.stitches.list[0].slots.len());
    for p in held.drain(..) {
        d.free(p).unwrap();
    }
    ok(&d);
    let (waits, built) = (d.backend.counters.wait_event, d.stats().num_stitch);
    let claim = d.malloc(64 * MIB, 0).unwrap();
    ok(&d);
    let waited = d.backend.counters.wait_event - waits;
    let built = d.stats().num_stitch - built;
    live.push(claim);
    teardown(d, live);
    (claim == stitched, waited, built)
}

/// A repair that would replace a busy part the last repair put in
/// builds a stitch instead: the layouts swing between two, and waiting
/// for the stitch's work to swap the part back every time buys nothing
/// (Note [Stitching]).
#[test]
fn a_busy_part_the_last_repair_put_in_gets_a_new_stitch_without_a_wait() {
    let (in_place, waited, built) = claim_when_the_repaired_part_is_busy(false);
    assert!(!in_place, "a new stitch");
    assert_eq!((waited, built), (0, 1), "no host wait, one stitch built");
}

/// Once the stitch has been taken whole since that repair, the busy
/// part is a new layout's: the stitch is repaired in place (waiting for
/// its work, still queued on the simulated device).
#[test]
fn a_stitch_taken_whole_since_its_repair_is_repaired_again() {
    let (in_place, waited, built) = claim_when_the_repaired_part_is_busy(true);
    assert!(in_place, "repaired in place");
    assert_eq!((waited, built), (1, 0), "one host wait, no stitch built");
}

/// A fence is recorded when a stitch is freed: once the device has
/// passed it, replacing a busy part unmaps without waiting, even with
/// later work queued on the stream.
#[test]
fn a_repair_after_the_stitchs_work_is_done_does_not_wait() {
    let (mut d, mut live, stitched, mut held) = cached_stitch();
    d.backend.complete(0);
    d.backend.launch(0);
    live.push(d.malloc(2 * MIB, 0).unwrap());
    d.free(held.remove(0)).unwrap();
    let waits = d.backend.counters.wait_event;
    let again = d.malloc(64 * MIB, 0).unwrap();
    ok(&d);
    assert_eq!(again, stitched, "one part replaced");
    assert_eq!(d.backend.counters.wait_event, waits, "no host wait");
    live.extend(held);
    live.push(again);
    teardown(d, live);
}

/// The fence at a stitch's free is not recorded while a graph is
/// captured (the event would belong to the graph, Note [Private pools]);
/// after the capture, a free records it again.
#[test]
fn a_stitch_freed_during_a_capture_records_no_fence() {
    let (mut d, live) = fragmented_with("expandable_handle_mb:2");
    let stitched = d.malloc(64 * MIB, 0).unwrap();
    d.begin_allocate_to_pool((1, 1), Some(Box::new(|s| s == 9)))
        .unwrap();
    let events = d.backend.counters.record_event;
    d.free(stitched).unwrap();
    ok(&d);
    assert_eq!(
        d.backend.counters.record_event, events,
        "no event in the capture"
    );
    d.end_allocate_to_pool((1, 1)).unwrap();
    d.release_pool((1, 1)).unwrap();
    let again = d.malloc(64 * MIB, 0).unwrap();
    assert_eq!(again, stitched, "the cached stitch, whole");
    let events = d.backend.counters.record_event;
    d.free(again).unwrap();
    assert_eq!(d.backend.counters.record_event, events + 1, "a fence");
    teardown(d, live);
}

#[test]
fn a_hole_that_cannot_be_filled_drops_the_stitch() {
    let (mut d, _, mut live) = one_part_short(ONE_HANDLE);
    // The moved handle stays in use: the only free handles left are
    // the stitch's own, so its hole cannot be filled. It is torn down
    // (as before repair existed) and, with too little free memory to
    // stitch, the request grows the pool.
    live.push(d.malloc(18 * MIB, 0).unwrap());
    assert_eq!(d.stitches.list[0].holes(), 1);
    let (p, spent, reserved) = measured_malloc(&mut d, 64 * MIB);
    live.push(p);
    assert!(d.stitches.list.is_empty(), "the holey stitch is gone");
    assert_eq!(d.stats().num_stitch, 1, "none built");
    assert_eq!(spent.calls(DriverCall::AddressFree), 1, "{spent}");
    assert!(d.stats().reserved_bytes.all.current > reserved);
    teardown(d, live);
}

#[test]
fn a_stitch_that_loses_every_part_is_freed() {
    // 68 MiB, more than is free to stitch: the free 2 MiB at the end
    // and 66 MiB of pages, every handle of the stitch and 2 MiB new.
    let (mut d, _, mut live) = one_part_short(
        "expandable_handle_mb:2,defragment_budget:1,defragment_headroom:0,defragment_pressure:1",
    );
    let (p, spent, reserved) = measured_malloc(&mut d, 68 * MIB);
    live.push(p);
    assert!(d.stitches.list.is_empty());
    assert_eq!(
        d.stats().reserved_bytes.all.current,
        reserved + 2 * MIB as i64
    );
    assert_eq!(spent.calls(DriverCall::AddressFree), 1, "{spent}");
    teardown(d, live);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(crate::proptest_cases(64)))]
    /// Random large and small requests under unlimited tear-down: holes
    /// are punched and filled (with handles of several sizes), and
    /// every stitch's range maps exactly its parts after every call.
    #[test]
    fn random_ops_keep_stitches_exact(
        ops in proptest::collection::vec((0u8..10, 1u64..(96 << 20)), 1..160),
    ) {
        let conf = crate::Config::parse("defragment_budget:1,defragment_headroom:0,defragment_pressure:1").unwrap();
        let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), conf);
        let mut live: Vec<u64> = Vec::new();
        for (op, size) in ops {
            match op {
                0..=5 => {
                    if let Ok(p) = d.malloc(size, 0) {
                        live.push(p);
                    }
                }
                6..=8 if !live.is_empty() => {
                    let p = live.swap_remove((size as usize) % live.len());
                    d.free(p).unwrap();
                }
                _ => {}
            }
            ok(&d);
        }
        teardown(d, live);
    }
}
