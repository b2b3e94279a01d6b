//! The rest of PyTorch's private-pool interface: holds taken without a
//! scope (`createOrIncrefPool`), use counts, `emptyCache(mempool_id)`, and
//! the checkpoints of cudagraph trees (`checkPoolLiveAllocations`,
//! `getCheckpointState`, `setCheckpointPoolState`; Note [Pool checkpoints]).
//! `Checked` verifies the invariants and the stats after every step.

use gpualloc::trace::TraceReader;
use gpualloc::{AllocError, Allocator, BlockState, CheckpointBlock, SegmentSnapshot, SimBackend};
use gpualloc_tests::{Checked, KIB, MIB, cfg};

const CAP: u64 = 5;
const OTHER: u64 = 6;
const G: (u64, u64) = (1, 7);

/// The pool's segments as `(address, size, state)` of every block.
fn layout(c: &Checked, key: (u64, u64)) -> Vec<(u64, u64, BlockState)> {
    c.snapshot()
        .into_iter()
        .filter(|s| s.pool_id == key)
        .flat_map(|s| s.blocks)
        .map(|b| (b.address, b.size, b.state))
        .collect()
}

fn pool_segments(c: &Checked, key: (u64, u64)) -> Vec<SegmentSnapshot> {
    c.snapshot()
        .into_iter()
        .filter(|s| s.pool_id == key)
        .collect()
}

/// Captures into `G` on stream `CAP` (a scope of its own).
fn captured(c: &mut Checked, sizes: &[u64]) -> Vec<u64> {
    c.begin_pool(G, Some(CAP));
    let ps = sizes.iter().map(|&s| c.alloc(s, CAP)).collect();
    c.end_pool(G);
    ps
}

fn holds_are_counted_and_a_released_pool_empties_on_request(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    assert_eq!(c.dev.pool_use_count(G), 0, "unknown pool");
    c.create_or_incref_pool(G);
    c.create_or_incref_pool(G);
    assert_eq!(c.dev.pool_use_count(G), 2);
    assert!(c.snapshot().is_empty(), "a hold allocates nothing");
    let (p, q) = {
        let ps = captured(&mut c, &[4 * KIB, 12 * MIB]);
        (ps[0], ps[1])
    };
    assert_eq!(
        c.dev.pool_use_count(G),
        3,
        "begin takes a hold, end keeps it"
    );
    c.release_pool(G).unwrap();
    assert_eq!(c.dev.pool_use_count(G), 2);
    c.release(q);
    // Held: emptying the pool's cache does nothing; nor for an unknown pool.
    let before = c.snapshot();
    c.empty_pool_cache(G).unwrap();
    c.empty_pool_cache((9, 9)).unwrap();
    assert_eq!(c.snapshot(), before);
    c.release_pool(G).unwrap();
    c.release_pool(G).unwrap();
    assert_eq!(c.dev.pool_use_count(G), 0);
    assert!(c.release_pool(G).is_err(), "no hold left to drop");
    assert_eq!(
        c.dev.private_pools().len(),
        1,
        "a live block keeps the pool"
    );
    c.release(p);
    assert!(!pool_segments(&c, G).is_empty(), "cached until asked");
    c.empty_pool_cache(G).unwrap();
    assert!(
        pool_segments(&c, G).is_empty(),
        "the pool's memory went back"
    );
    assert!(
        c.dev.private_pools().is_empty(),
        "and the pool is forgotten"
    );
    c.empty_cache();
    assert_eq!(c.reserved(), 0);
}

fn live_allocations_are_the_pools_allocated_blocks(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    assert!(matches!(
        c.dev.pool_live_allocations(G),
        Err(AllocError::UnknownPool { pool: G })
    ));
    let ps = captured(&mut c, &[4 * KIB, 12 * MIB, 8 * MIB, 30 * MIB]);
    let outside = c.alloc(12 * MIB, OTHER);
    c.release(ps[2]);
    let mut want = vec![ps[0], ps[1], ps[3]];
    want.sort_unstable();
    assert_eq!(c.dev.pool_live_allocations(G).unwrap(), want);
    assert!(!want.contains(&outside));
    for p in [ps[0], ps[1], ps[3], outside] {
        c.release(p);
    }
    assert_eq!(c.dev.pool_live_allocations(G).unwrap(), Vec::<u64>::new());
}

fn a_checkpoint_lists_the_pools_blocks_as_the_snapshot_does(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let ps = captured(&mut c, &[4 * KIB, 12 * MIB, 8 * MIB, 30 * MIB]);
    c.release(ps[2]);
    let ck = c.dev.pool_checkpoint(G).unwrap();
    let mut from_snapshot = Vec::new();
    for s in pool_segments(&c, G) {
        for b in &s.blocks {
            from_snapshot.push(CheckpointBlock {
                address: b.address,
                size: b.size,
                stream: CAP,
                segment_address: s.address,
                allocated: b.state == BlockState::Allocated,
            });
        }
    }
    from_snapshot.sort_unstable_by_key(|b| b.address);
    assert_eq!(ck, from_snapshot);
    assert_eq!(ck.iter().filter(|b| b.allocated).count(), 3);
    for p in [ps[0], ps[1], ps[3]] {
        c.release(p);
    }
}

fn restore_brings_back_the_checkpointed_layout(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    c.create_or_incref_pool(G); // the tree's hold
    let ps = captured(&mut c, &[4 * KIB, 12 * MIB, 8 * MIB, 30 * MIB, 64 * KIB]);
    c.release(ps[2]);
    let ck = c.dev.pool_checkpoint(G).unwrap();
    let at_checkpoint = layout(&c, G);
    let allocated_then: Vec<u64> = ck
        .iter()
        .filter(|b| b.allocated)
        .map(|b| b.address)
        .collect();
    // The tree goes on: more captures allocate and free in the pool.
    c.release(ps[0]);
    c.release(ps[1]);
    let more = captured(&mut c, &[6 * MIB, 4 * KIB, 2 * MIB]);
    assert_ne!(layout(&c, G), at_checkpoint);
    let live_now = c.dev.pool_live_allocations(G).unwrap();
    let stats = c.stats().clone();

    let delta = c.restore_pool(G, &ck).unwrap();
    assert_eq!(delta.freed, live_now, "every block allocated in the pool");
    assert_eq!(delta.allocated, allocated_then, "in the checkpoint's order");
    assert!(
        delta.freed.contains(&ps[3]) && delta.allocated.contains(&ps[3]),
        "a block alive at both points is freed and allocated again"
    );
    for p in more.iter().filter(|p| !allocated_then.contains(p)) {
        assert!(!c.live.contains_key(p), "{p:#x} was freed");
    }
    assert_eq!(layout(&c, G), at_checkpoint);
    assert_eq!(c.dev.pool_checkpoint(G).unwrap(), ck);
    // Ordinary frees and allocations for the stats.
    let s = c.stats();
    assert_eq!(
        s.allocation.all.allocated,
        stats.allocation.all.allocated + allocated_then.len() as i64
    );
    assert_eq!(
        s.allocation.all.freed,
        stats.allocation.all.freed + live_now.len() as i64
    );
    for p in allocated_then {
        c.release(p);
    }
    assert_eq!(
        c.dev.pool_use_count(G),
        3,
        "the tree's hold and two captures'"
    );
    for _ in 0..3 {
        c.release_pool(G).unwrap();
    }
    c.empty_cache();
    assert_eq!(c.reserved(), 0);
}

fn restore_after_the_pool_grew_leaves_the_new_memory_free(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    c.create_or_incref_pool(G);
    let ps = captured(&mut c, &[12 * MIB, 8 * MIB]);
    let ck = c.dev.pool_checkpoint(G).unwrap();
    let mapped = |c: &Checked| {
        pool_segments(c, G)
            .iter()
            .map(|s| s.total_size)
            .sum::<u64>()
    };
    let before = mapped(&c);
    let grown = captured(&mut c, &[40 * MIB, 24 * MIB]);
    assert!(mapped(&c) > before, "the pool grew");
    let delta = c.restore_pool(G, &ck).unwrap();
    let mut freed = vec![ps[0], ps[1], grown[0], grown[1]];
    freed.sort_unstable();
    assert_eq!(delta.freed, freed);
    assert_eq!(
        delta.allocated,
        ck.iter()
            .filter(|b| b.allocated)
            .map(|b| b.address)
            .collect::<Vec<_>>()
    );
    assert!(mapped(&c) > before, "nothing unmapped");
    let mut ps = ps;
    ps.sort_unstable();
    let now = layout(&c, G);
    for b in &ck {
        if b.allocated {
            assert!(now.contains(&(b.address, b.size, BlockState::Allocated)));
        } else {
            assert!(now.iter().any(|&(a, s, st)| st == BlockState::Free
                && a <= b.address
                && b.address + b.size <= a + s));
        }
    }
    let allocated: Vec<u64> = now
        .iter()
        .filter(|b| b.2 == BlockState::Allocated)
        .map(|b| b.0)
        .collect();
    assert_eq!(allocated, ps, "the rest is free");
    assert_eq!(c.dev.pool_live_allocations(G).unwrap(), ps);
    for p in ps {
        c.release(p);
    }
    c.release_pool(G).unwrap();
}

/// Refused restores: the error, and nothing changed.
fn refused(c: &mut Checked, blocks: &[CheckpointBlock], says: &str) {
    let (snap, stats, live) = (c.snapshot(), c.stats().clone(), c.live.len());
    let e = c.restore_pool(G, blocks).unwrap_err();
    assert!(matches!(e, AllocError::BadCheckpoint { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("private pool (1, 7) on device 0") && msg.contains(says),
        "{msg}"
    );
    assert_eq!(c.snapshot(), snap, "{says}: the layout changed");
    assert_eq!(c.stats(), &stats, "{says}: the stats changed");
    assert_eq!(c.live.len(), live);
}

fn invalid_checkpoints_change_nothing(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let ps = captured(&mut c, &[12 * MIB, 8 * MIB]);
    let outside = c.alloc(4 * MIB, OTHER);
    let ck = c.dev.pool_checkpoint(G).unwrap();
    c.release(ps[1]);
    let with = |f: &dyn Fn(&mut Vec<CheckpointBlock>)| {
        let mut v = ck.clone();
        f(&mut v);
        v
    };
    let foreign = CheckpointBlock {
        address: outside,
        size: 4 * MIB,
        ..ck[0]
    };
    refused(
        &mut c,
        &with(&|v| v.push(foreign)),
        "not inside memory the pool maps",
    );
    let beyond = CheckpointBlock {
        address: u64::MAX - 1024,
        size: 4096,
        ..ck[0]
    };
    refused(
        &mut c,
        &with(&|v| v.push(beyond)),
        "not inside memory the pool maps",
    );
    refused(&mut c, &with(&|v| v.push(v[0])), "overlap");
    refused(&mut c, &with(&|v| v[0].size -= 256), "multiple of 512");
    refused(
        &mut c,
        &with(&|v| {
            v[0].address += 256;
            v[0].size -= 512;
        }),
        "multiple of 512",
    );
    // A refusal by the caller (the C ABI's buffers) changes nothing either.
    let snap = c.snapshot();
    let r: Result<_, AllocError> = c.dev.restore_pool_if(G, &[], |d| {
        assert_eq!(d.freed, vec![ps[0]]);
        Err(AllocError::UnknownPool { pool: G })
    });
    assert!(r.is_err());
    c.check();
    assert_eq!(c.snapshot(), snap);
    // A block used on another stream cannot be freed now.
    c.record_stream(ps[0], OTHER);
    refused(&mut c, &ck, "used on other streams");
    assert!(matches!(
        c.restore_pool((4, 4), &ck),
        Err(AllocError::UnknownPool { .. })
    ));
    c.release(ps[0]);
    c.release(outside);
    c.complete_all();
    let t = c.alloc(512, OTHER); // polls the completed events
    c.release(t);
    // An empty checkpoint frees everything and allocates nothing.
    let p = captured(&mut c, &[MIB])[0];
    let d = c.restore_pool(G, &[]).unwrap();
    assert_eq!((d.freed, d.allocated), (vec![p], vec![]));
}

/// cudagraph trees free a graph's outputs (made on the tree's stream) on
/// the default stream, then restore a checkpoint, which refuses blocks
/// still pending: such frees are not held as frees from another stream
/// are in the default pools (Note [Frees on another stream]).
fn outputs_freed_on_the_default_stream_leave_the_pool_restorable(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    c.create_or_incref_pool(G);
    let ps = captured(&mut c, &[4 * MIB, 8 * MIB]);
    let ck = c.dev.pool_checkpoint(G).unwrap();
    let events = c.sim().counters.record_event;
    c.dev
        .free_from(ps[0], Some(0))
        .expect("free on the default stream");
    c.live.remove(&ps[0]);
    assert_eq!(c.sim().counters.record_event, events, "not held");
    c.complete_all();
    c.restore_pool(G, &ck).expect("restorable");
    assert_eq!(c.dev.pool_checkpoint(G).unwrap(), ck);
}

under_both_policies!(
    outputs_freed_on_the_default_stream_leave_the_pool_restorable,
    holds_are_counted_and_a_released_pool_empties_on_request,
    live_allocations_are_the_pools_allocated_blocks,
    a_checkpoint_lists_the_pools_blocks_as_the_snapshot_does,
    restore_brings_back_the_checkpointed_layout,
    restore_after_the_pool_grew_leaves_the_new_memory_free,
    invalid_checkpoints_change_nothing,
);

/// A restore's frees and allocations are ordinary trace records: replayed,
/// the trace frees only what it allocated and ends with the same memory
/// allocated, at the same peak.
#[test]
fn a_trace_through_a_restore_replays_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("restore.gtrace");
    let config = cfg("");
    let a = Allocator::new(
        config.clone(),
        1,
        Box::new(|_| Ok(SimBackend::new(1 << 30))),
    );
    a.trace_start(&path).unwrap();
    a.create_or_incref_pool(0, G).unwrap();
    a.begin_allocate_to_pool(0, G, None).unwrap();
    let ps: Vec<u64> = [12 * MIB, 8 * MIB, 4 * KIB]
        .iter()
        .map(|&s| a.malloc(0, s, CAP).unwrap())
        .collect();
    a.end_allocate_to_pool(0, G).unwrap();
    let ck = a.pool_checkpoint(0, G).unwrap();
    a.free(0, ps[0]).unwrap();
    a.begin_allocate_to_pool(0, G, None).unwrap();
    let q = a.malloc(0, 30 * MIB, CAP).unwrap();
    a.end_allocate_to_pool(0, G).unwrap();
    let d = a
        .restore_pool_if(0, G, &ck, |_| Ok::<(), AllocError>(()))
        .unwrap();
    assert!(d.freed.contains(&q));
    a.free(0, ps[1]).unwrap();
    let stats = a.stats(0).unwrap();
    a.lock(0).unwrap().check_invariants().unwrap();
    a.trace_stop().unwrap();
    let mut r = TraceReader::open(&path).unwrap();
    let events: Vec<_> = r.events().collect();
    let out = gpualloc::replay::replay(events.into_iter(), 1 << 30, &config);
    assert_eq!(
        (out.unknown_frees, out.frees_of_failed, out.ooms),
        (0, 0, 0)
    );
    let dev = &out.devices[0];
    assert_eq!(
        dev.final_allocated,
        stats.allocated_bytes.all.current as u64
    );
    assert_eq!(dev.peak_allocated, stats.allocated_bytes.all.peak as u64);
    assert_eq!(dev.allocs, stats.allocation.all.allocated as u64);
}

mod random {
    //! Random captures, frees and restores of earlier checkpoints, checked
    //! after every step; every restore brings back its checkpoint's blocks.

    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        /// Allocates in the pool.
        Alloc(u64),
        /// Allocates in the default pools.
        Outside(u64),
        Free(usize),
        Checkpoint,
        Restore(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let size = prop_oneof![1u64..=MIB, (MIB + 1)..(12 * MIB), (12 * MIB)..(40 * MIB),];
        prop_oneof![
            5 => size.clone().prop_map(Op::Alloc),
            1 => size.prop_map(Op::Outside),
            4 => any::<usize>().prop_map(Op::Free),
            2 => Just(Op::Checkpoint),
            2 => any::<usize>().prop_map(Op::Restore),
        ]
    }

    /// The checkpoint's blocks are in the pool now: allocated ones exactly
    /// and alone, free ones inside free blocks.
    fn restored(c: &Checked, ck: &[CheckpointBlock]) {
        let now = layout(c, G);
        let allocated: Vec<u64> = now
            .iter()
            .filter(|b| b.2 == BlockState::Allocated)
            .map(|b| b.0)
            .collect();
        let want: Vec<u64> = ck
            .iter()
            .filter(|b| b.allocated)
            .map(|b| b.address)
            .collect();
        assert_eq!(allocated, want);
        for b in ck {
            let covered = now.iter().any(|&(a, s, st)| {
                if b.allocated {
                    (a, s, st) == (b.address, b.size, BlockState::Allocated)
                } else {
                    st == BlockState::Free && a <= b.address && b.address + b.size <= a + s
                }
            });
            assert!(covered, "{b:?} in {now:x?}");
        }
    }

    fn run(policy: &str, ops: Vec<Op>) {
        let mut c = Checked::with(2 << 30, policy);
        c.create_or_incref_pool(G);
        c.begin_pool(G, Some(CAP));
        let (mut in_pool, mut outside, mut checkpoints) = (Vec::new(), Vec::new(), Vec::new());
        for op in ops {
            match op {
                Op::Alloc(size) => in_pool.extend(c.malloc(size, CAP).ok()),
                Op::Outside(size) => outside.extend(c.malloc(size, OTHER).ok()),
                Op::Free(i) => {
                    let n = in_pool.len() + outside.len();
                    if n > 0 {
                        let i = i % n;
                        let p = if i < in_pool.len() {
                            in_pool.swap_remove(i)
                        } else {
                            outside.swap_remove(i - in_pool.len())
                        };
                        c.release(p);
                    }
                }
                Op::Checkpoint => checkpoints.push(c.dev.pool_checkpoint(G).unwrap()),
                Op::Restore(i) if !checkpoints.is_empty() => {
                    let ck = &checkpoints[i % checkpoints.len()];
                    let live = c.dev.pool_live_allocations(G).unwrap();
                    let d = c.restore_pool(G, ck).unwrap();
                    assert_eq!(d.freed, live);
                    restored(&c, ck);
                    in_pool = d.allocated;
                }
                Op::Restore(_) => {}
            }
        }
        c.end_pool(G);
        for p in in_pool.into_iter().chain(outside) {
            c.release(p);
        }
        c.release_pool(G).unwrap();
        c.release_pool(G).unwrap();
        c.empty_cache();
        assert_eq!(c.reserved(), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(gpualloc_tests::cases(48)))]

        #[test]
        fn restores_bring_back_their_checkpoints(
            ops in prop::collection::vec(op(), 1..60),
            pytorch in any::<bool>(),
        ) {
            let policy = if pytorch {
                "policy:pytorch,cross_stream_reuse:true"
            } else {
                "policy:gpualloc"
            };
            run(policy, ops);
        }
    }
}
