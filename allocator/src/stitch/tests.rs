//! Tests of `stitch.rs` (a sibling file: the module's own file stays short).

use crate::{Config, DeviceAllocator, DriverCall, SimBackend};

const MIB: u64 = 1 << 20;

fn ok(d: &DeviceAllocator<SimBackend>) {
    d.check_invariants()
        .unwrap_or_else(|e| panic!("invariant broken: {e}"));
}

fn fragmented() -> (DeviceAllocator<SimBackend>, Vec<u64>) {
    fragmented_with("expandable_handle_mb:2")
}

/// Frees `live`, empties the cache and checks that nothing is left: no
/// memory, no mapping (stitches are torn down too).
pub(crate) fn teardown(mut d: DeviceAllocator<SimBackend>, live: Vec<u64>) {
    for p in live {
        d.free(p).unwrap();
    }
    d.empty_cache().unwrap();
    ok(&d);
    assert_eq!(d.backend().used(), 0);
    assert_eq!(d.backend().mappings(), 0, "stitches are torn down too");
}

/// Eight 16 MiB blocks with 2 MiB live blocks between them, under
/// `conf`; freeing the large ones leaves 128 MiB free in pieces, none
/// of which holds 64 MiB. Returns the live blocks.
pub(crate) fn fragmented_with(conf: &str) -> (DeviceAllocator<SimBackend>, Vec<u64>) {
    fragmented_then_freed(conf, &[])
}

/// `fragmented_with(conf)`, with blocks of `tail` sizes allocated after
/// the pieces and freed with them.
fn fragmented_then_freed(conf: &str, tail: &[u64]) -> (DeviceAllocator<SimBackend>, Vec<u64>) {
    let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::parse(conf).unwrap());
    let mut large = Vec::new();
    let mut small = Vec::new();
    for _ in 0..8 {
        large.push(d.malloc(16 * MIB, 0).unwrap());
        small.push(d.malloc(2 * MIB, 0).unwrap());
    }
    large.extend(tail.iter().map(|&size| d.malloc(size, 0).unwrap()));
    for p in large {
        d.free(p).unwrap();
    }
    ok(&d);
    (d, small)
}

/// Under a limit `room` above what `d` reserves, less than a 64 MiB
/// request lacks, the request is stitched (the promise), holding no
/// more memory. Returns its block (the limit stays).
fn stitched_under_a_limit(d: &mut DeviceAllocator<SimBackend>, room: u64) -> u64 {
    let reserved = d.stats().reserved_bytes.all.current as u64;
    d.set_memory_limit(Some(reserved + room));
    let p = d.malloc(64 * MIB, 0).unwrap();
    ok(d);
    assert_eq!(d.stats().num_stitch, 1);
    assert_eq!(d.stats().reserved_bytes.all.current as u64, reserved);
    p
}

#[test]
fn without_stitch_budget_only_a_request_that_cannot_grow_builds_a_stitch() {
    // Credit spent (share 0): the 64 MiB request is served as without
    // stitching, by moving free pages.
    let (mut d, _small) = fragmented_with("expandable_handle_mb:2,stitch_budget:0");
    let p = d.malloc(64 * MIB, 0).unwrap();
    ok(&d);
    assert_eq!(d.stats().num_stitch, 0);
    d.free(p).unwrap();
    // Growing by the shortfall would pass the limit: it stitches
    // whatever the budget (the promise), holding no more.
    let (mut d, _small) = fragmented_with("expandable_handle_mb:2,stitch_budget:0");
    let p = stitched_under_a_limit(&mut d, 32 * MIB);
    // Claiming the cached stitch again makes no call: never refused.
    d.free(p).unwrap();
    d.set_memory_limit(None);
    let calls = d.driver_calls();
    let p2 = d.malloc(64 * MIB, 0).unwrap();
    ok(&d);
    assert_eq!(p2, p);
    assert_eq!(d.stats().num_stitch, 1);
    assert_eq!(d.driver_calls().since(&calls).memory_calls(), 0);
}

#[test]
fn a_large_request_is_stitched_from_free_pieces_and_the_stitch_is_reused() {
    let (mut d, small) = fragmented();
    let reserved = d.stats().reserved_bytes.all.current;
    let p = d.malloc(64 * MIB, 0).unwrap();
    ok(&d);
    assert_eq!(d.stats().num_stitch, 1);
    assert_eq!(
        d.stats().reserved_bytes.all.current,
        reserved,
        "a stitch maps memory already held"
    );
    assert_eq!(
        d.stats().allocated_bytes.all.current as u64,
        64 * MIB + 8 * 2 * MIB
    );
    // The four pieces it uses are claimed; the other four serve 16 MiB
    // requests without growing, and a fifth request grows.
    let qs: Vec<u64> = (0..4).map(|_| d.malloc(16 * MIB, 0).unwrap()).collect();
    ok(&d);
    assert_eq!(d.stats().reserved_bytes.all.current, reserved);
    let grown = d.malloc(16 * MIB, 0).unwrap();
    assert!(d.stats().reserved_bytes.all.current > reserved);
    for q in qs.into_iter().chain([grown]) {
        d.free(q).unwrap();
    }
    d.free(p).unwrap();
    ok(&d);
    // The same request again: the cached stitch, no driver call.
    assert_eq!((d.stitches.built, d.stitches.taken_whole), (1, 0));
    let calls = d.driver_calls();
    let p2 = d.malloc(64 * MIB, 0).unwrap();
    ok(&d);
    assert_eq!(p2, p);
    assert_eq!(d.stats().num_stitch, 1);
    assert_eq!((d.stitches.built, d.stitches.taken_whole), (1, 1));
    assert_eq!(d.driver_calls().since(&calls).calls(DriverCall::Map), 0);
    d.free(p2).unwrap();
    teardown(d, small);
}

#[test]
fn a_stitch_pays_when_its_request_lacks_much_or_layouts_have_repeated() {
    use crate::stitch_cache::{FREE_BUILDS, Stitches};
    let mut s = Stitches::default();
    let (short, rounded, share) = (MIB, 64 * MIB, 8);
    // The first builds are free; then only while taken whole as often.
    assert!(s.worth_calls(short, rounded, share));
    s.built = FREE_BUILDS;
    assert!(!s.worth_calls(short, rounded, share));
    assert!(s.worth_calls(short, rounded, 0), "off");
    assert!(s.worth_calls(rounded / share, rounded, share));
    assert!(!s.worth_calls(rounded / share - 1, rounded, share));
    s.taken_whole = FREE_BUILDS;
    assert!(s.worth_calls(short, rounded, share));
    s.built = u64::MAX;
    assert!(s.worth_calls(u64::MAX, u64::MAX, 1024), "no overflow");
}

/// As `fragmented_with(conf)`, with 60 MiB more at the segment's end
/// freed too: a 64 MiB request there lacks only 4 MiB of its window.
fn fragmented_with_a_free_end(conf: &str) -> (DeviceAllocator<SimBackend>, Vec<u64>) {
    let (d, small) = fragmented_then_freed(conf, &[60 * MIB]);
    assert_eq!(d.stats().num_stitch, 0);
    (d, small)
}

#[test]
fn a_request_that_lacks_little_builds_no_stitch_once_stitches_went_unused() {
    use crate::stitch_cache::FREE_BUILDS;
    let conf = "expandable_handle_mb:2,stitch_short_share:8";
    // Stitches built and never taken whole: the request that lacks 4
    // of its 64 MiB maps only what it lacks, and stays correct.
    let (mut d, small) = fragmented_with_a_free_end(conf);
    d.stitches.built = FREE_BUILDS;
    let maps = d.driver_calls();
    let p = d.malloc(64 * MIB, 0).unwrap();
    ok(&d);
    assert_eq!(d.stats().num_stitch, 0);
    let mapped = d.driver_calls().since(&maps).handles(DriverCall::Map);
    assert!(
        mapped < 32,
        "mapped {mapped} handles of 2 MiB for 4 MiB lacking"
    );
    d.free(p).unwrap();
    // Stitches taken whole as often as built, or the key left out: the
    // same request is stitched from the free runs (32 handles mapped).
    let (mut d2, small2) = fragmented_with_a_free_end(conf);
    d2.stitches.built = FREE_BUILDS;
    d2.stitches.taken_whole = FREE_BUILDS;
    let (mut d3, small3) = fragmented_with_a_free_end("expandable_handle_mb:2");
    d3.stitches.built = FREE_BUILDS;
    let mut done = vec![(d, small)];
    for (mut e, live) in [(d2, small2), (d3, small3)] {
        let p = e.malloc(64 * MIB, 0).unwrap();
        ok(&e);
        assert_eq!(e.stats().num_stitch, 1);
        assert_eq!(e.stitches.built, FREE_BUILDS + 1);
        e.free(p).unwrap();
        done.push((e, live));
    }
    // Growing by what it lacks would pass the limit: it stitches
    // whatever the rule (the promise), holding no more.
    let (mut e, live) = fragmented_with_a_free_end(conf);
    e.stitches.built = FREE_BUILDS;
    let p = stitched_under_a_limit(&mut e, 2 * MIB);
    e.free(p).unwrap();
    e.set_memory_limit(None);
    done.push((e, live));
    for (mut e, live) in done {
        for q in live {
            e.free(q).unwrap();
        }
        e.empty_cache().unwrap();
        ok(&e);
        assert_eq!(e.backend().used(), 0);
    }
}

#[test]
fn a_stitch_that_fails_leaves_the_request_to_moving_or_growing() {
    use crate::backend::SimCall;
    for call in [SimCall::Reserve, SimCall::Map] {
        let (mut d, small) = fragmented();
        // Out of address space (or a failed mapping) for the stitch
        // only: the request is served all the same.
        d.backend_mut().fail_call(call, 1);
        let p = d.malloc(64 * MIB, 0).unwrap();
        ok(&d);
        assert_eq!(d.stats().num_stitch, 0, "{call:?}");
        d.free(p).unwrap();
        for s in small {
            d.free(s).unwrap();
        }
        d.empty_cache().unwrap();
        ok(&d);
        assert_eq!(d.backend().used(), 0, "{call:?}");
    }
}
