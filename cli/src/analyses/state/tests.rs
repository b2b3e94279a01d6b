use gpualloc::trace::{Action, STITCH_CODE};

use super::*;

fn ev(action: Action, addr: u64, size: u64, aux: u64) -> TraceEvent {
    TraceEvent {
        time_ns: 0,
        action,
        device: 0,
        stream: 0,
        addr,
        size,
        aux,
        thread: 0,
    }
}

#[test]
fn iterations_of_phases_opened_equally_often_start_at_the_first_opened() {
    let mut s = DeviceState::default();
    // Either phase opened first: the map's order must not decide.
    for (first, second) in [(7u64, 9u64), (9, 7)] {
        s.top_pushes.clear();
        s.top_pushes.insert(first, vec![10, 20, 30]);
        s.top_pushes.insert(second, vec![12, 22, 32]);
        assert_eq!(s.iterations(), &[10, 20, 30], "phase {first} opened first");
    }
    s.top_pushes.insert(5, vec![1, 2, 3, 4]);
    assert_eq!(
        s.iterations(),
        &[1, 2, 3, 4],
        "the most frequent still wins"
    );
}

#[test]
fn a_stitch_is_neither_reserved_nor_free_and_its_block_claims_home_pages() {
    const M: u64 = 1 << 20;
    let (mut s, mut b) = (DeviceState::default(), Budget::default());
    s.apply(&ev(Action::PagesCreate, 0, 64 * M, 0), &mut b);
    s.apply(&ev(Action::SegmentMap, 0x1000_0000, 64 * M, 1), &mut b);
    assert_eq!(s.free_space(), (64 * M, 64 * M));
    s.apply(
        &ev(Action::SegmentMap, 0x9000_0000, 32 * M, STITCH_CODE),
        &mut b,
    );
    assert_eq!(s.g.reserved, 64 * M, "a stitch adds no reserved memory");
    assert_eq!(
        s.free_space(),
        (64 * M, 64 * M),
        "an unused stitch claims nothing"
    );
    // A block in the stitch (Alloc: size = requested, aux = block size).
    s.apply(&ev(Action::Alloc, 0x9000_0000, 30 * M, 32 * M), &mut b);
    assert_eq!(
        s.free_space().1,
        32 * M,
        "its 32 MiB of home pages are in use"
    );
    s.apply(
        &ev(Action::FreeCompleted, 0x9000_0000, 30 * M, 32 * M),
        &mut b,
    );
    s.apply(
        &ev(Action::SegmentUnmap, 0x9000_0000, 32 * M, STITCH_CODE),
        &mut b,
    );
    assert!(s.aliases.is_empty());
    assert_eq!(s.free_space(), (64 * M, 64 * M));
    assert_eq!(s.inconsistent, 0);
}

/// Where the trace lists (minor 4, Note [Listed ranges]), the home
/// pages a stitch in use holds are known: the largest free piece is
/// never one of them, as it could be when they were guessed.
#[test]
fn listed_home_runs_of_a_stitch_in_use_are_not_free() {
    const M: u64 = 1 << 20;
    let (mut s, mut b) = (DeviceState::default(), Budget::default());
    let home = 0x1000_0000;
    s.apply(&ev(Action::PagesCreate, 0, 64 * M, 0), &mut b);
    s.apply(&ev(Action::SegmentMap, home, 64 * M, 1), &mut b);
    // Live: 2 MiB at 32 MiB and at 50 MiB; free: 32, 16 and 12 MiB.
    s.apply(&ev(Action::Alloc, home + 32 * M, 2 * M, 2 * M), &mut b);
    s.apply(&ev(Action::Alloc, home + 50 * M, 2 * M, 2 * M), &mut b);
    assert_eq!(s.free_space(), (32 * M, 60 * M));
    // A 48 MiB stitch over the 32 and the 16 MiB runs, taken into use.
    let stitch = 0x9000_0000;
    s.apply(&ev(Action::SegmentMap, stitch, 48 * M, STITCH_CODE), &mut b);
    s.apply(&ev(Action::SegmentUnlist, home, 32 * M, 1), &mut b);
    s.apply(&ev(Action::SegmentUnlist, home + 34 * M, 16 * M, 1), &mut b);
    s.apply(
        &ev(Action::SegmentList, stitch, 48 * M, STITCH_CODE),
        &mut b,
    );
    s.apply(&ev(Action::Alloc, stitch, 40 * M, 40 * M), &mut b);
    assert!(s.listing);
    assert_eq!(
        s.free_space(),
        (12 * M, 12 * M),
        "only the 12 MiB run is free"
    );
    assert_eq!(s.largest_free_on_stream(0), 12 * M);
    assert_eq!(s.g.reserved, 64 * M);
    assert_eq!(s.stitch_tails(), 8 * M, "48 MiB held for a 40 MiB block");
    // Its tail trimmed: 8 MiB of the second run come back home.
    s.apply(
        &ev(Action::SegmentUnlist, stitch + 40 * M, 8 * M, STITCH_CODE),
        &mut b,
    );
    s.apply(&ev(Action::SegmentList, home + 42 * M, 8 * M, 1), &mut b);
    assert_eq!(s.free_space(), (12 * M, 20 * M));
    assert_eq!(s.stitch_tails(), 0);
    assert_eq!(
        s.listed_stitches.iter().collect::<Vec<_>>(),
        [(stitch, 40 * M)]
    );
    // Given back: all of it is free at home again.
    s.apply(&ev(Action::FreeCompleted, stitch, 40 * M, 40 * M), &mut b);
    s.apply(
        &ev(Action::SegmentUnlist, stitch, 40 * M, STITCH_CODE),
        &mut b,
    );
    s.apply(&ev(Action::SegmentList, home, 32 * M, 1), &mut b);
    s.apply(&ev(Action::SegmentList, home + 34 * M, 8 * M, 1), &mut b);
    assert_eq!(s.free_space(), (32 * M, 60 * M));
    assert!(s.held_home.is_empty() && s.listed_stitches.is_empty());
    assert_eq!(s.inconsistent, 0);
}

#[test]
fn the_largest_free_range_of_a_stream_counts_its_own_segments_only() {
    let (mut s, mut b) = (DeviceState::default(), Budget::default());
    s.apply(&ev(Action::SegmentAlloc, 0, 1000, 1), &mut b);
    let other = TraceEvent {
        stream: 7,
        ..ev(Action::SegmentAlloc, 4096, 3000, 1)
    };
    s.apply(&other, &mut b);
    s.apply(&ev(Action::Alloc, 100, 90, 100), &mut b);
    assert_eq!(s.free_space().0, 3000);
    assert_eq!(s.largest_free_on_stream(0), 800);
    assert_eq!(s.largest_free_on_stream(7), 3000);
    assert_eq!(s.largest_free_on_stream(9), 0, "no memory of its own");
}

#[test]
fn gauges_and_free_space_follow_the_events() {
    let (mut s, mut b) = (DeviceState::default(), Budget::default());
    s.apply(&ev(Action::SegmentAlloc, 0, 1000, 1), &mut b);
    s.apply(&ev(Action::Alloc, 100, 90, 100), &mut b);
    s.apply(&ev(Action::Alloc, 500, 90, 100), &mut b);
    assert_eq!(
        s.g,
        Gauges {
            allocated: 200,
            active: 200,
            reserved: 1000,
            requested: 180
        }
    );
    assert_eq!(s.free_space(), (400, 800));
    s.apply(&ev(Action::FreeRequested, 100, 90, 100), &mut b);
    assert_eq!(
        (s.g.allocated, s.g.active),
        (100, 200),
        "pending: active, not allocated"
    );
    s.apply(&ev(Action::FreeCompleted, 100, 90, 100), &mut b);
    assert_eq!(s.free_space(), (500, 900));
    s.apply(&ev(Action::FreeRequested, 77, 1, 1), &mut b);
    assert_eq!(s.unknown, 1);
    s.apply(&ev(Action::SegmentMap, 4096, 2048, 1), &mut b);
    s.apply(&ev(Action::SegmentMap, 6144, 2048, 1), &mut b);
    assert_eq!(s.regions.len(), 2, "adjacent mapped pages merge");
    s.apply(&ev(Action::SegmentUnmap, 5000, 100, 1), &mut b);
    assert_eq!(s.regions.len(), 3, "an unmap in the middle splits");
    assert_eq!(s.g.reserved, 1000 + 4096 - 100);
}

/// The states of a trace's devices, each event applied to its own
/// device's state, with one budget for them all.
fn states(b: &mut Budget, devices: usize, events: &[TraceEvent]) -> Vec<DeviceState> {
    let mut v: Vec<DeviceState> = (0..devices).map(|_| DeviceState::default()).collect();
    for e in events {
        v[e.device as usize].apply(e, b);
    }
    v
}

fn total(states: &[DeviceState], f: fn(&DeviceState) -> usize) -> usize {
    states.iter().map(f).sum()
}

/// A file allocating at millions of addresses, on one device or spread
/// over many, is tracked up to one bound for all the devices together,
/// and the rest is counted as inconsistent, not stored.
#[test]
fn live_blocks_are_tracked_up_to_a_bound_for_all_devices_together() {
    let alloc = |t: u64, d: u32, addr: u64| {
        let block = EventKind::Alloc {
            addr,
            requested: 512,
            block_size: 512,
        };
        TraceEvent::from_kind(t, d, 0, 0, block)
    };
    let events: Vec<TraceEvent> = (0..10u64)
        .flat_map(|i| (0..16).map(move |d| alloc(i, d, (i + 1) * 512)))
        .collect();
    let mut b = Budget::new(100, 100);
    let mut s = states(&mut b, 16, &events);
    assert_eq!(total(&s, |s| s.live.len()), 100);
    assert_eq!(total(&s, |s| s.inconsistent as usize), 60);
    assert_eq!((s[0].live.len(), s[15].live.len()), (7, 6));
    s[15].apply(&alloc(20, 15, 512), &mut b);
    assert_eq!(
        s[15].inconsistent, 5,
        "an address already live is a double allocation"
    );
    // A block freed makes room, on any device.
    let free = EventKind::FreeCompleted {
        addr: 512,
        requested: 512,
        block_size: 512,
    };
    s[0].apply(&TraceEvent::from_kind(30, 0, 0, 0, free), &mut b);
    s[15].apply(&alloc(31, 15, 1 << 20), &mut b);
    assert_eq!((s[0].live.len(), s[15].live.len()), (6, 7));
    assert_eq!(total(&s, |s| s.inconsistent as usize), 61);
}

/// Reserved ranges, stitched ranges and the pieces an unmap leaves
/// count against one bound for all the devices together.
#[test]
fn ranges_are_tracked_up_to_a_bound_for_all_devices_together() {
    let range = |d: u32, addr: u64, pool: Pool| {
        let kind = match pool {
            Pool::Code(1) => EventKind::SegmentAlloc {
                addr,
                size: 1 << 20,
                pool,
            },
            _ => EventKind::SegmentMap {
                addr,
                size: 1 << 20,
                pool,
            },
        };
        TraceEvent::from_kind(0, d, 0, 0, kind)
    };
    let unmap = |d: u32, addr: u64| {
        let kind = EventKind::SegmentUnmap {
            addr,
            size: 4096,
            pool: Pool::Code(2),
        };
        TraceEvent::from_kind(0, d, 0, 0, kind)
    };
    let mut b = Budget::new(4, 4);
    let events = [
        range(0, 1 << 30, Pool::Code(1)),
        range(1, 1 << 30, Pool::Stitch),
        range(2, 1 << 30, Pool::Code(2)),
        // Splits the mapped range in two.
        unmap(2, (1 << 30) + 8192),
        // No room left for these.
        range(3, 1 << 30, Pool::Code(1)),
        range(3, 1 << 31, Pool::Stitch),
        unmap(2, (1 << 30) + 65536),
    ];
    let mut s = states(&mut b, 4, &events);
    assert_eq!(total(&s, DeviceState::ranges), 4);
    assert_eq!(s[1].aliases.len(), 1);
    assert_eq!(s[2].regions.len(), 2);
    assert_eq!(total(&s, |s| s.inconsistent as usize), 3);
    // Unmaps at either end of a range only shorten it: applied at the
    // bound too.
    let reserved = s[2].g.reserved;
    s[2].apply(&unmap(2, 1 << 30), &mut b);
    s[2].apply(&unmap(2, (1 << 30) + (1 << 20) - 4096), &mut b);
    assert_eq!(s[2].regions.len(), 2);
    assert_eq!(s[2].g.reserved, reserved - 2 * 4096);
    assert_eq!(total(&s, |s| s.inconsistent as usize), 3);
}

/// Marks and top-level phase openings are kept as iteration boundaries
/// up to one bound for all the devices together, and so are the phases
/// followed open; what the bounds refused is counted.
#[test]
fn boundaries_and_open_phases_are_bounded_for_all_devices_together() {
    let at = |t: u64, d: u32, kind| TraceEvent::from_kind(t, d, 0, 0, kind);
    let mut events: Vec<TraceEvent> = (0..10u64)
        .flat_map(|t| (0..16).map(move |d| at(t, d, EventKind::Mark { name: 0 })))
        .collect();
    for d in 0..4 {
        events.extend((0..3).map(|n| at(20, d, EventKind::PhasePush { name: n })));
    }
    let mut b = Budget::new(100, 50);
    let mut s = states(&mut b, 16, &events);
    assert_eq!(total(&s, |s| s.marks.len()), 50);
    assert_eq!((s[0].iterations().len(), s[2].iterations().len()), (4, 3));
    assert!(s[..4].iter().all(|s| s.top_pushes.is_empty()), "no room");
    assert_eq!(b.boundaries.refused, 110 + 4, "the top-level openings too");
    assert_eq!(total(&s, |s| s.phases.len()), 12);
    // Closing phases makes room to follow others.
    let mut b = Budget::new(100, 5);
    s = states(&mut b, 4, &events[160..]);
    assert_eq!(total(&s, |s| s.phases.len()), 5);
    assert_eq!(b.open.refused, 7);
    s[0].apply(&at(30, 0, EventKind::PhasePop { name: 0 }), &mut b);
    s[3].apply(&at(31, 3, EventKind::PhasePush { name: 9 }), &mut b);
    assert_eq!((s[0].phases.len(), s[3].phases.len()), (0, 1));
    assert_eq!(b.open.refused, 7, "followed, not refused");
}

#[test]
fn page_pool_traces_count_physical_memory() {
    let (mut s, mut b) = (DeviceState::default(), Budget::default());
    s.apply(&ev(Action::PagesCreate, 0, 8192, 0), &mut b);
    s.apply(&ev(Action::SegmentMap, 4096, 8192, 1), &mut b);
    assert_eq!(s.g.reserved, 8192, "mapping created pages adds nothing");
    s.apply(&ev(Action::SegmentUnmap, 4096, 4096, 1), &mut b);
    assert_eq!(s.g.reserved, 8192, "unmapped pages stay in the pool");
    assert_eq!(s.regions.len(), 1);
    s.apply(&ev(Action::PagesRelease, 0, 4096, 0), &mut b);
    assert_eq!(s.g.reserved, 4096);
}

/// Caps as the allocator takes them: a fraction it would refuse (NaN,
/// above 1, from a damaged file) changes nothing; the device's memory
/// is kept from the records that carry it.
#[test]
fn caps_follow_the_records_the_allocator_would_accept() {
    let (mut s, mut b) = (DeviceState::default(), Budget::default());
    s.apply(
        &ev(Action::MemoryLimit, 8 << 30, 0, 0.5f64.to_bits()),
        &mut b,
    );
    s.apply(&ev(Action::MemoryLimit, 0, 0, f64::NAN.to_bits()), &mut b);
    s.apply(&ev(Action::MemoryLimit, 0, 0, 1.5f64.to_bits()), &mut b);
    s.apply(&ev(Action::MemoryLimit, 0, 1, 3 << 30), &mut b);
    let want = SetCaps {
        fraction: Some(0.5),
        bytes: Some(Some(3 << 30)),
        device_total: Some(8 << 30),
    };
    assert_eq!(s.caps, want);
    s.apply(&ev(Action::MemoryLimit, 0, 1, u64::MAX), &mut b);
    assert_eq!(s.caps.bytes, Some(None), "cleared");
}
