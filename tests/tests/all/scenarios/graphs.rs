//! Private pools for CUDA graph capture (reference 1.9, 4.4). While a scope
//! is open the simulator is capturing: any event query, event wait, release
//! or allocation without the capturing flag panics.

use gpualloc::AllocError;
use gpualloc_tests::{Checked, MIB};

const CAP: u64 = 5;
const OTHER: u64 = 6;
const THIRD: u64 = 7;
const G: (u64, u64) = (1, 0);

fn pool_of(c: &Checked, p: u64) -> (u64, u64) {
    c.snapshot()
        .into_iter()
        .find(|s| s.blocks.iter().any(|b| b.address == p))
        .map(|s| s.pool_id)
        .expect("pointer in a segment")
}

#[test]
fn allocations_of_the_capturing_stream_come_from_the_private_pool() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    c.begin_pool(G, Some(CAP));
    let p = c.alloc(4096, CAP);
    let q = c.alloc(12 * MIB, CAP);
    let other = c.alloc(4096, OTHER);
    assert_eq!(pool_of(&c, p), G);
    assert_eq!(pool_of(&c, q), G);
    assert_eq!(
        pool_of(&c, other),
        (0, 0),
        "the filter rejects other streams"
    );
    assert_eq!(
        c.sim().counters.allocate_capturing,
        3,
        "every allocation in relaxed capture mode"
    );
    // Reuse inside the pool, without the backend.
    c.release(p);
    assert_eq!(c.alloc(4096, CAP), p);
    assert_eq!(c.sim().counters.allocate, 3);
    c.end_pool(G);
}

#[test]
fn memory_is_kept_until_release_pool() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    c.begin_pool(G, Some(CAP));
    let p = c.alloc(12 * MIB, CAP);
    c.release(p);
    c.end_pool(G);
    c.empty_cache();
    assert_eq!(c.reserved(), 12 * MIB, "the graph still holds its pool");
    // Outside the scope the private cache is not used.
    let q = c.alloc(12 * MIB, CAP);
    assert_ne!(q, p);
    c.release(q);
    c.release_pool(G).unwrap();
    assert_eq!(c.stats().num_device_free, 1, "released at release_pool");
    assert!(c.dev.private_pools().is_empty());
    assert!(matches!(
        c.release_pool(G),
        Err(AllocError::UnknownPool { .. })
    ));
}

#[test]
fn blocks_alive_at_release_pool_go_back_at_the_next_empty_cache() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    c.begin_pool(G, None);
    let p = c.alloc(12 * MIB, CAP);
    c.end_pool(G);
    c.release_pool(G).unwrap();
    assert_eq!(c.reserved(), 12 * MIB);
    c.release(p);
    c.empty_cache();
    assert_eq!(c.reserved(), 0);
    assert!(c.dev.private_pools().is_empty());
}

#[test]
fn nothing_is_released_or_queried_during_capture() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let cached = c.alloc(12 * MIB, OTHER);
    c.release(cached);
    let used = c.alloc(4096, OTHER);
    c.record_stream(used, CAP);
    c.use_on(used, CAP);
    c.begin_pool(G, Some(CAP));
    c.empty_cache(); // must not release (the simulator would panic)
    c.release(used); // deferred: no event is queried during capture
    c.complete_all();
    c.alloc(512, CAP); // no event polling during capture
    c.begin_pool((2, 0), Some(OTHER));
    c.end_pool((2, 0));
    c.release_pool((2, 0)).unwrap(); // freeable, but not released while capturing
    c.end_pool(G);
    assert_eq!(c.stats().num_device_free, 0);
    assert_eq!(
        c.stats().active.all.current,
        2,
        "the deferred block is still pending"
    );
    let events = c.sim().counters.record_event;
    c.alloc(512, OTHER); // after capture: the deferred free records its event
    assert_eq!(c.sim().counters.record_event, events + 1);
    assert_eq!(
        c.stats().active.all.current,
        3,
        "recorded after the capture: not done yet"
    );
    c.complete(CAP);
    c.alloc(512, OTHER);
    assert_eq!(
        c.stats().active.all.current,
        3,
        "the deferred block is free now"
    );
    c.empty_cache();
    assert_eq!(c.stats().num_device_free, 1, "the cached 12 MiB segment");
}

#[test]
fn out_of_memory_during_capture_takes_no_release_path() {
    let mut c = Checked::with(64 * MIB, "policy:pytorch,cross_stream_reuse:true");
    let cached = c.alloc(40 * MIB, OTHER);
    c.release(cached);
    c.begin_pool(G, Some(CAP));
    let err = c.malloc(30 * MIB, CAP).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    let s = c.stats();
    assert_eq!(
        (
            s.num_alloc_retries,
            s.num_sync_all_streams,
            s.num_device_free
        ),
        (0, 0, 0)
    );
    c.end_pool(G);
    c.alloc(30 * MIB, CAP); // after capture the cache serves it
}

#[test]
fn innermost_accepting_scope_decides() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    c.begin_pool(G, None);
    c.begin_pool((2, 0), Some(OTHER));
    let a = c.alloc(4096, CAP);
    let b = c.alloc(4096, OTHER);
    assert_eq!(
        pool_of(&c, a),
        G,
        "the inner scope rejects CAP; the outer one takes it"
    );
    assert_eq!(pool_of(&c, b), (2, 0));
    c.end_pool((2, 0));
    c.end_pool(G);
    assert!(matches!(
        c.dev.end_allocate_to_pool(G),
        Err(AllocError::UnknownPool { .. })
    ));
}

#[test]
fn reopening_a_held_pool_reuses_its_cache() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    c.begin_pool(G, Some(CAP));
    let p = c.alloc(12 * MIB, CAP);
    c.release(p);
    c.end_pool(G);
    c.begin_pool(G, Some(CAP)); // a second capture into the same pool
    assert_eq!(c.alloc(12 * MIB, CAP), p);
    c.end_pool(G);
    c.release_pool(G).unwrap();
    assert_eq!(c.dev.private_pools().len(), 1, "one hold left");
    c.release(p);
    c.release_pool(G).unwrap();
    assert_eq!(c.reserved(), 0);
}

#[test]
fn a_capture_no_hook_announces_is_followed_and_its_memory_kept_for_good() {
    // PyTorch's plain CUDAPluggableAllocator captures without pool hooks
    // (Note [Capture without a pool]); only the driver knows.
    for config in ["", "policy:pytorch"] {
        follow_a_capture(config);
    }
}

fn follow_a_capture(config: &str) {
    let mut c = Checked::with(1 << 30, config);
    let cached = c.alloc(12 * MIB, CAP);
    c.release(cached);
    c.follow_driver_capture(CAP);
    assert!(!c.in_capture_scope(), "no capture, no scope");

    let id = c.sim_mut().begin_stream_capture(&[CAP, OTHER]);
    c.follow_driver_capture(CAP);
    assert!(c.in_capture_scope());
    let p = c.alloc(12 * MIB, CAP);
    assert_ne!(
        p, cached,
        "the capture does not take the default pools' memory"
    );
    let key = pool_of(&c, p);
    assert_eq!(key.0, u64::MAX, "a pool of gpualloc's own");
    c.release(p); // freed during the capture: reusable by the same capture
    let q = c.alloc_following(12 * MIB, CAP);
    assert_eq!(q, p);
    let forked = c.alloc_following(4096, OTHER); // forked work is captured too
    assert_eq!(pool_of(&c, forked), key);
    let outside = c.alloc_following(4096, THIRD); // another stream meanwhile: kept as well
    assert_eq!(pool_of(&c, outside), key);
    c.sim_mut().end_stream_capture(id);

    c.follow_driver_capture(CAP); // the next allocation sees it ended
    assert!(!c.in_capture_scope());
    let r = c.alloc(12 * MIB, CAP);
    assert_eq!(pool_of(&c, r), (0, 0));
    c.release(q); // the graph's output, freed after the capture
    let s = c.alloc(12 * MIB, CAP);
    assert_ne!(
        s, q,
        "replays may still write the graph's memory: never handed out again"
    );
    c.empty_cache();
    assert_eq!(c.stats().num_device_free, 0, "the pool is held for good");
    for x in [r, s, forked, outside] {
        c.release(x);
    }

    // A second capture gets a pool of its own.
    let id = c.sim_mut().begin_stream_capture(&[CAP]);
    let t = c.alloc_following(4096, CAP);
    assert_eq!(pool_of(&c, t), (u64::MAX, key.1 + 1));
    c.release(t);
    c.sim_mut().end_stream_capture(id);
    c.follow_driver_capture(CAP);
    assert!(!c.in_capture_scope());
}

#[test]
fn back_to_back_captures_on_one_stream_get_separate_pools() {
    // torch.cuda.graph captures every graph on one stream; inputs made
    // beforehand mean no allocation between two captures.
    let mut c = Checked::with(1 << 30, "");
    c.follow_driver_capture(CAP);
    let first = c.sim_mut().begin_stream_capture(&[CAP]);
    let temp = c.alloc_following(4 * MIB, CAP);
    c.release(temp);
    let out1 = c.alloc(4 * MIB, CAP);
    c.sim_mut().end_stream_capture(first);
    let second = c.sim_mut().begin_stream_capture(&[CAP]);
    let out2 = c.alloc_following(4 * MIB, CAP);
    assert_ne!(out2, temp, "graph 1's replays still write its temporary");
    assert_ne!(pool_of(&c, out2), pool_of(&c, out1));
    c.sim_mut().end_stream_capture(second);
    c.release(out1);
    c.release(out2);
}

#[test]
fn overlapping_captures_never_take_the_default_pools() {
    // Two captures under way at once (two threads, or a second begun
    // before the first ends): the driver gives them different ids.
    let mut c = Checked::with(1 << 30, "");
    c.follow_driver_capture(CAP);
    let x = c.sim_mut().begin_stream_capture(&[CAP]);
    let a = c.alloc_following(4 * MIB, CAP);
    let y = c.sim_mut().begin_stream_capture(&[THIRD]);
    let temp = c.alloc_following(4 * MIB, THIRD);
    assert_ne!(pool_of(&c, temp), (0, 0));
    c.release(temp);
    c.sim_mut().end_stream_capture(x);
    let b = c.alloc_following(4 * MIB, THIRD); // x's scope closes, y's opens
    assert_ne!(pool_of(&c, b), (0, 0));
    assert_ne!(pool_of(&c, b), pool_of(&c, a));
    c.sim_mut().end_stream_capture(y);
    let later = c.alloc_following(4 * MIB, THIRD);
    assert_eq!(pool_of(&c, later), (0, 0));
    assert_ne!(later, temp, "y's replays still write its temporary");
    for p in [a, b, later] {
        c.release(p);
    }
}

#[test]
fn a_free_that_opens_a_capture_records_no_event_in_it() {
    // A capture whose first call is a free: the block's stream, or a
    // stream it was used on, captures, and an event recorded there would
    // belong to the graph (the simulator panics at such a record).
    for config in ["", "policy:pytorch"] {
        let mut c = Checked::with(1 << 30, config);
        let used = c.alloc_following(MIB, OTHER); // the route that follows captures
        c.record_stream(used, CAP);
        c.use_on(used, CAP);
        let large: Vec<_> = (0..20).map(|_| c.alloc(12 * MIB, CAP)).collect();
        let id = c.sim_mut().begin_stream_capture(&[CAP]);
        c.release(used); // used on the capturing stream
        for p in large {
            c.release(p); // fences would go on the capturing stream
        }
        assert!(c.in_capture_scope());
        c.sim_mut().end_stream_capture(id);
        c.complete_all();
        c.empty_cache(); // closes the ended capture's scope, then releases
        assert!(!c.in_capture_scope());
    }
}

#[test]
fn a_capture_announced_by_the_hooks_is_not_followed_twice() {
    let mut c = Checked::with(1 << 30, "");
    c.begin_pool(G, Some(CAP));
    let p = c.alloc_following(4096, CAP);
    assert_eq!(pool_of(&c, p), G);
    c.release(p);
    c.end_pool(G);
    assert!(!c.in_capture_scope());
}

/// Without pool hooks (the plain `CUDAPluggableAllocator`), `empty_cache`
/// during a capture nobody followed yet: the streams it would wait on are
/// asked first, the capture is followed and nothing is recorded or waited
/// for in it (an event recorded there would belong to the graph); once the
/// capture ends, the cache empties as usual.
#[test]
fn empty_cache_during_an_unfollowed_capture_records_nothing_in_it() {
    for config in ["", "policy:pytorch"] {
        let mut c = Checked::with(1 << 30, config);
        let p = c.alloc_following(64 * MIB, CAP);
        let q = c.alloc_following(MIB, CAP);
        c.record_stream(q, OTHER);
        c.release(p);
        c.release(q);
        let id = c.sim_mut().begin_stream_capture(&[CAP]);
        c.dev.empty_cache().unwrap();
        assert!(c.in_capture_scope(), "{config}: the capture is followed");
        c.sim_mut().end_stream_capture(id);
        c.follow_driver_capture(CAP);
        assert!(!c.in_capture_scope());
        c.complete_all();
        c.empty_cache();
        assert_eq!(c.reserved(), 0, "{config}");
    }
}

/// The same with the capture on a stream this device never used, in
/// global mode: only the legacy stream tells of it, without an id. Nothing
/// is followed and nothing is released until it ends.
#[test]
fn empty_cache_during_a_global_capture_elsewhere_releases_nothing() {
    for config in ["", "policy:pytorch"] {
        let mut c = Checked::with(1 << 30, config);
        let p = c.alloc_following(64 * MIB, CAP);
        c.release(p);
        let reserved = c.reserved();
        let id = c.sim_mut().begin_global_capture(THIRD + 100);
        c.dev.empty_cache().unwrap();
        assert!(!c.in_capture_scope(), "{config}: nothing to follow");
        assert_eq!(c.reserved(), reserved, "{config}: nothing released");
        c.sim_mut().end_stream_capture(id);
        c.complete_all();
        c.empty_cache();
        assert_eq!(c.reserved(), 0, "{config}");
    }
}

/// Without pool hooks, an allocation on a stream of ours while a global
/// capture runs on a stream nothing of ours touched yet: the legacy stream
/// reports it, so the allocation queries no event, moves no page and, when
/// nothing fits, gives no cached memory back (each would fail the capture,
/// and the simulator panics); plain segments report out of memory instead.
/// Once the capture ends, the same request succeeds.
#[test]
fn an_allocation_during_a_global_capture_elsewhere_does_only_what_a_capture_allows() {
    for config in ["", "policy:pytorch"] {
        let mut c = Checked::with(1 << 30, config);
        // Pending frees (events to query) and cached memory to give back.
        let busy = c.alloc_following(8 * MIB, OTHER);
        c.record_stream(busy, THIRD);
        c.use_on(busy, THIRD);
        let cached: Vec<_> = (0..6)
            .map(|_| c.alloc_following(100 * MIB, OTHER))
            .collect();
        for p in cached {
            c.release(p);
        }
        c.release(busy);
        let id = c.sim_mut().begin_global_capture(THIRD + 100);
        // Fits in what is cached and in what the device has left.
        let small = c.alloc_following(MIB, OTHER);
        assert!(!c.in_capture_scope(), "{config}: nothing to follow");
        // Plain segments: fits only if the cache gives memory back.
        // Expandable segments map it over the cached pages, moving none.
        c.follow_driver_capture(OTHER);
        match (c.malloc(900 * MIB, OTHER), config) {
            (Err(AllocError::OutOfMemory(_)), "policy:pytorch") => {}
            (Ok(p), "") => c.release(p),
            (other, _) => panic!("{config}: {other:?}"),
        }
        c.sim_mut().end_stream_capture(id);
        c.complete_all();
        let big = c.alloc_following(900 * MIB, OTHER);
        c.release(big);
        c.release(small);
    }
}

/// The same with a capture, not yet seen, on a stream that holds cached
/// segments: the out-of-memory path asks that stream before it would wait
/// on it or give memory back, follows the capture and reports out of
/// memory.
#[test]
fn the_out_of_memory_path_follows_a_capture_on_a_stream_of_its_segments() {
    let mut c = Checked::with(1 << 30, "policy:pytorch");
    let cached: Vec<_> = (0..6).map(|_| c.alloc_following(100 * MIB, CAP)).collect();
    for p in cached {
        c.release(p);
    }
    let small = c.alloc_following(MIB, OTHER);
    let id = c.sim_mut().begin_stream_capture(&[CAP]);
    c.follow_driver_capture(OTHER);
    match c.malloc(900 * MIB, OTHER) {
        Err(AllocError::OutOfMemory(_)) => {}
        other => panic!("{other:?}"),
    }
    assert!(c.in_capture_scope(), "the capture on CAP is followed");
    c.sim_mut().end_stream_capture(id);
    c.complete_all();
    let big = c.alloc_following(900 * MIB, OTHER);
    assert!(!c.in_capture_scope());
    c.release(big);
    c.release(small);
}

/// Two scopes of one pool at once (two threads capturing into one pool, or
/// inside `use_mem_pool` together): the second is refused, as PyTorch
/// refuses it, and nothing changes; otherwise the first `end` would close
/// the other caller's scope and its graph would take default-pool memory.
#[test]
fn a_second_scope_of_an_open_pool_is_refused() {
    let mut c = Checked::with(1 << 30, "");
    c.begin_pool(G, Some(CAP));
    let holds = c.dev.pool_use_count(G);
    match c
        .dev
        .begin_allocate_to_pool(G, Some(Box::new(|s| s == OTHER)))
    {
        Err(AllocError::PoolBusy { pool }) => assert_eq!(pool, G),
        other => panic!("{other:?}"),
    }
    assert_eq!(c.dev.pool_use_count(G), holds, "no hold taken");
    let p = c.alloc(4096, CAP);
    assert_eq!(pool_of(&c, p), G, "the first scope is still open");
    c.end_pool(G);
    assert!(!c.in_capture_scope());
    // Once closed, the pool can be recorded to again.
    c.begin_pool(G, Some(OTHER));
    let q = c.alloc(4096, OTHER);
    assert_eq!(pool_of(&c, q), G);
    c.end_pool(G);
    c.release(p);
    c.release(q);
}

/// A pool's last hold dropped after one of its blocks was freed with
/// `record_stream` and that stream's work finished: the block comes back
/// and the pool's memory goes to the device then, not at the next global
/// `empty_cache`.
#[test]
fn releasing_a_pool_takes_back_blocks_whose_other_streams_are_done() {
    for config in ["", "policy:pytorch"] {
        let mut c = Checked::with(1 << 30, config);
        c.begin_pool(G, Some(CAP)); // the scope's hold is the only one
        let p = c.alloc(30 * MIB, CAP);
        c.end_pool(G);
        c.record_stream(p, OTHER);
        c.use_on(p, OTHER);
        c.release(p);
        c.complete_all();
        let reserved = c.reserved();
        c.release_pool(G).unwrap();
        assert!(
            c.dev.private_pools().is_empty(),
            "{config}: the pool is gone: {:?}",
            c.dev.private_pools()
        );
        if config.is_empty() {
            // Expandable: its pages go to the page pool, for any pool to map.
            let q = c.alloc(30 * MIB, OTHER);
            assert_eq!(c.reserved(), reserved, "{config}: reused, not grown");
            c.release(q);
        } else {
            assert_eq!(c.reserved(), 0, "{config}: back to the device");
        }
    }
}
