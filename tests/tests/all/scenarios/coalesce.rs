//! Free and coalescing (reference 1.7): a freed block merges with its free
//! neighbours inside one segment, never across segments.

use gpualloc_tests::{Checked, MIB};

#[test]
fn free_neighbours_merge_in_any_order() {
    for order in [[0, 1, 2], [0, 2, 1], [2, 0, 1], [1, 0, 2], [1, 2, 0]] {
        let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
        let p = [c.alloc(4096, 0), c.alloc(8192, 0), c.alloc(4096, 0)];
        for i in order {
            c.release(p[i]);
        }
        let snap = c.snapshot();
        assert_eq!(snap.len(), 1);
        assert_eq!(snap[0].blocks.len(), 1, "order {order:?}: one block again");
        assert_eq!(snap[0].blocks[0].size, 2 * MIB);
        assert_eq!(c.stats().inactive_split.all.current, 0);
        assert_eq!(c.stats().inactive_split_bytes.all.current, 0);
    }
}

#[test]
fn merge_with_the_middle_block_last_rebuilds_the_segment() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(4 * MIB, 0);
    let b = c.alloc(4 * MIB, 0);
    let d = c.alloc(4 * MIB, 0); // [a][b][d][8 free]
    c.release(a);
    c.release(d); // d merges with the tail
    assert_eq!(c.stats().inactive_split.large_pool.current, 2);
    assert_eq!(
        c.stats().inactive_split_bytes.large_pool.current,
        16 * MIB as i64
    );
    c.release(b);
    assert_eq!(c.stats().inactive_split.large_pool.current, 0);
    assert_eq!(c.largest(), 20 * MIB);
    // The whole segment is one block again: a 19 MiB request fits it.
    assert_eq!(c.alloc(19 * MIB, 0), a);
}

#[test]
fn adjacent_segments_are_never_merged() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(12 * MIB, 0);
    let b = c.alloc(12 * MIB, 0);
    assert_eq!(
        b,
        a + 12 * MIB,
        "the simulator hands out adjacent addresses"
    );
    c.release(a);
    c.release(b);
    assert_eq!(c.segments(), 2);
    assert_eq!(c.largest(), 12 * MIB, "no 24 MiB block across the boundary");
    let allocs = c.sim().counters.allocate;
    let d = c.alloc(24 * MIB, 0);
    assert_eq!(
        c.sim().counters.allocate,
        allocs + 1,
        "24 MiB needs a new segment"
    );
    assert!(d != a && d != b);
}

#[test]
fn a_block_waiting_on_events_is_not_merged_until_they_complete() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(4096, 0);
    let b = c.alloc(4096, 0);
    c.record_stream(a, 5);
    c.use_on(a, 5);
    c.release(a); // pending: an event on stream 5
    c.release(b); // b merges with the tail, not with a
    assert_eq!(c.snapshot()[0].blocks.len(), 2);
    c.complete(5);
    c.alloc(1 << 20, 0); // the next malloc polls the event; a is freed and merged
    let snap = c.snapshot();
    assert_eq!(snap.len(), 1);
    assert_eq!(
        snap[0].blocks.len(),
        2,
        "[1 MiB allocated][1 MiB free]: a merged"
    );
}
