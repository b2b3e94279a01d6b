//! Private pools under the default policy: a graph's pool lives in
//! expandable segments of its own (Note [Private pools] in `capture.rs`).
//! While a scope is open the simulator is capturing: any event query, wait,
//! unmap or release, and any mapping without the capturing flag, panics.

use gpualloc::{Backend, DriverCall};
use gpualloc_tests::{Checked, MIB};

const CAP: u64 = 5;
const OTHER: u64 = 6;
const G: (u64, u64) = (1, 0);

fn pool_of(c: &Checked, p: u64) -> ((u64, u64), bool) {
    c.snapshot()
        .into_iter()
        .find(|s| s.blocks.iter().any(|b| b.address == p))
        .map(|s| (s.pool_id, s.expandable))
        .expect("pointer in a segment")
}

#[test]
fn a_graph_pool_maps_pages_in_its_own_expandable_segments() {
    let mut c = Checked::with(1 << 30, "");
    c.begin_pool(G, Some(CAP));
    let p = c.alloc(4096, CAP);
    let q = c.alloc(12 * MIB, CAP);
    let r = c.alloc(30 * MIB, CAP);
    let other = c.alloc(12 * MIB, OTHER);
    assert_eq!(pool_of(&c, p), (G, true));
    assert_eq!(pool_of(&c, q), (G, true));
    assert_eq!(pool_of(&c, r), (G, true));
    assert_eq!(
        pool_of(&c, other),
        ((0, 0), true),
        "the filter rejects other streams"
    );
    assert_eq!(c.stats().segment.all.current, 0, "no plain segment");
    // Freed inside the capture, reused inside the pool with no driver call.
    c.release(q);
    let calls = c.sim().driver_calls();
    assert_eq!(c.alloc(12 * MIB, CAP), q);
    assert_eq!(c.sim().driver_calls().since(&calls).total_calls(), 0);
    c.end_pool(G);
    for x in [p, r, other] {
        c.release(x);
    }
}

#[test]
fn a_held_pool_keeps_its_pages_through_empty_cache_and_defragmentation() {
    let mut c = Checked::with(256 * MIB, "");
    c.begin_pool(G, Some(CAP));
    let g = c.alloc(64 * MIB, CAP);
    c.release(g);
    c.end_pool(G);
    c.empty_cache();
    assert_eq!(c.reserved(), 64 * MIB, "the graph still holds its pool");
    c.sim_mut().log_unmaps(true);
    // The default pool fills the rest of the device; it may move its own
    // pages but never the graph's free ones.
    let big = c.alloc(190 * MIB, OTHER);
    assert!(
        c.sim_mut()
            .take_unmaps()
            .iter()
            .all(|&(lo, size)| lo + size <= g || lo >= g + 64 * MIB),
        "the graph's pages stayed mapped"
    );
    assert!(
        c.malloc(32 * MIB, OTHER).is_err(),
        "the graph's 64 MiB are not for others"
    );
    c.release(big);
    c.release_pool(G).unwrap();
    assert!(c.dev.private_pools().is_empty());
    c.empty_cache();
    assert_eq!(c.reserved(), 0);
    assert_eq!(c.sim().used(), 0);
}

#[test]
fn release_pool_waits_for_the_device_then_pools_the_pages_for_reuse() {
    let mut c = Checked::with(1 << 30, "");
    c.begin_pool(G, Some(CAP));
    let g = c.alloc(64 * MIB, CAP);
    c.use_on(g, CAP); // a replay still running
    c.release(g);
    c.end_pool(G);
    let handles = c.sim().counters.create;
    c.release_pool(G).unwrap();
    assert_eq!(c.sim().driver_calls().calls(DriverCall::CtxSync), 1);
    assert!(c.dev.private_pools().is_empty(), "the pool is gone");
    assert_eq!(c.reserved(), 64 * MIB, "its pages are pooled, still held");
    assert_eq!(c.dev.pooled_bytes(), 64 * MIB);
    // The default pool maps them again: no new handle.
    let p = c.alloc(64 * MIB, OTHER);
    assert_eq!(c.sim().counters.create, handles);
    assert_eq!(c.reserved(), 64 * MIB);
    c.release(p);
    c.empty_cache();
    assert_eq!(c.reserved(), 0);
}

#[test]
fn blocks_alive_at_release_pool_go_back_at_the_next_empty_cache() {
    let mut c = Checked::with(1 << 30, "");
    c.begin_pool(G, None);
    let p = c.alloc(12 * MIB, CAP);
    let q = c.alloc(12 * MIB, CAP);
    c.end_pool(G);
    c.release(q);
    c.release_pool(G).unwrap();
    assert_eq!(
        c.dev.private_pools().len(),
        1,
        "a live block keeps the pool"
    );
    c.release(p);
    c.empty_cache();
    assert_eq!(c.reserved(), 0);
    assert!(c.dev.private_pools().is_empty());
    assert_eq!(c.sim().used(), 0);
}

#[test]
fn nothing_is_unmapped_queried_or_released_during_capture() {
    let mut c = Checked::with(256 * MIB, "");
    let cached = c.alloc(100 * MIB, OTHER);
    let live = c.alloc(16 * MIB, OTHER);
    c.use_on(cached, OTHER);
    c.release(cached);
    c.begin_pool(G, Some(CAP));
    c.empty_cache(); // must not unmap or release (the simulator would panic)
    // Capture needs more than is free: fails rather than move pages.
    assert!(c.malloc(200 * MIB, CAP).is_err());
    let g = c.alloc(64 * MIB, CAP);
    c.release(g);
    c.end_pool(G);
    c.release(live);
    c.release_pool(G).unwrap();
    c.complete_all();
    c.empty_cache();
    assert_eq!(c.reserved(), 0);
}

/// Out of memory part-way through a mapping during a capture: the handles
/// just created are kept pooled, not released (nothing is released while a
/// capture runs), and the request fails cleanly.
#[test]
fn a_mapping_that_fails_during_a_capture_releases_nothing() {
    let mut c = Checked::with(1 << 30, "");
    c.begin_pool((1, 0), Some(5));
    c.sim_mut().fail_map_at(2);
    assert!(c.malloc(40 * MIB, 5).is_err());
    c.end_pool((1, 0));
    c.empty_cache();
    let p = c.alloc(40 * MIB, 0);
    c.release(p);
}
