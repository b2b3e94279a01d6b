//! Private pools served by another allocator (`torch.cuda.MemPool(
//! allocator=...)`; Note [Pools served by another allocator]): plain
//! segments of PyTorch's sizes from that allocator, cached, split and
//! merged as a plain pool's, given back to it only once the device is done
//! with them, under either policy.

use gpualloc::size_class::PoolKind;
use gpualloc::{AllocError, PoolKey};
use gpualloc_tests::foreign::Foreign;
use gpualloc_tests::{Checked, GIB, KIB, MIB};

const POOL: PoolKey = (5, 0);

/// Opens a scope as `torch.cuda.use_mem_pool` does.
fn enter(c: &mut Checked) {
    c.begin_pool(POOL, None);
}

/// Closes it as `use_mem_pool` does: the scope's hold goes too.
fn leave(c: &mut Checked) {
    c.end_pool(POOL);
    c.release_pool(POOL).unwrap();
}

/// A fresh allocator with `POOL` served by an allocator of `capacity` bytes.
fn served(policy: &str, capacity: u64) -> (Checked, Foreign) {
    let mut c = Checked::with(GIB, policy);
    let other = Foreign::new(capacity);
    c.create_or_incref_pool_from(POOL, &other);
    (c, other)
}

fn segments_come_from_the_other_allocator_in_pytorchs_sizes(policy: &str) {
    let (mut c, other) = served(policy, GIB);
    enter(&mut c);
    let small = c.alloc(KIB, 0);
    let small2 = c.alloc(3 * KIB, 0);
    let mid = c.alloc(5 * MIB, 0);
    let big = c.alloc(30 * MIB + 1, 0);
    leave(&mut c);
    let sizes: Vec<u64> = other.ledger().live.values().map(|v| v.0).collect();
    assert_eq!(sizes, [2 * MIB, 20 * MIB, 32 * MIB]);
    assert_eq!(c.sim().used(), 0, "nothing of the simulated device");
    for p in [small, small2] {
        assert_eq!(c.find_block(p).unwrap().1, PoolKind::Small);
    }
    let snap = c.snapshot();
    assert_eq!(snap.len(), 3);
    assert!(snap.iter().all(|s| !s.expandable && s.pool_id == POOL));
    assert_eq!(c.stat("segment.all.current"), 3);
    assert_eq!(c.reserved(), 54 * MIB);
    // Outside the scope, the device's own mode serves.
    let own = c.alloc(5 * MIB, 0);
    assert_eq!(other.ledger().allocated, 3);
    assert!(c.sim().used() > 0);
    for p in [small, small2, mid, big, own] {
        c.free(p).unwrap();
    }
    // Held: the pool keeps its cache, even through `empty_cache`.
    c.empty_cache();
    assert_eq!(other.ledger().live.len(), 3);
    c.release_pool(POOL).unwrap();
    let l = other.ledger();
    assert_eq!((l.live.len(), l.released), (0, 3));
    assert!(l.dropped, "the pool went, and its source with it");
}

fn blocks_split_and_are_reused_inside_the_pool(policy: &str) {
    let (mut c, other) = served(policy, GIB);
    enter(&mut c);
    let a = c.alloc(6 * MIB, 0);
    let b = c.alloc(6 * MIB, 0);
    assert_eq!(other.ledger().allocated, 1, "both in one 20 MiB segment");
    c.free(a).unwrap();
    let d = c.alloc(4 * MIB, 0);
    assert_eq!(d, a, "the freed block serves again");
    // [d 4][free 2][b 6][free 8]: two free pieces of a split segment.
    assert_eq!(c.stat("inactive_split.all.current"), 2);
    leave(&mut c);
    c.free(b).unwrap();
    c.free(d).unwrap();
    assert_eq!(
        c.stat("inactive_split.all.current"),
        0,
        "merged whole again"
    );
    assert_eq!(other.ledger().allocated, 1);
}

fn a_segment_goes_back_only_after_the_work_on_it(policy: &str) {
    let (mut c, other) = served(policy, GIB);
    enter(&mut c);
    let p = c.alloc(8 * MIB, 3);
    leave(&mut c);
    c.use_on(p, 3);
    c.free(p).unwrap();
    // Checked fails this call if the segment went back before stream 3's
    // work was done.
    c.release_pool(POOL).unwrap();
    assert_eq!(other.ledger().released, 1);
}

fn the_other_allocator_full_is_out_of_memory_not_a_crash(policy: &str) {
    let (mut c, other) = served(policy, 64 * MIB);
    enter(&mut c);
    let p = c.alloc(40 * MIB, 0);
    match c.try_malloc(40 * MIB, 0) {
        Err(AllocError::OutOfMemory(r)) => assert_eq!(r.requested, 40 * MIB),
        other => panic!("{other:?}"),
    }
    assert!(other.ledger().refused >= 1);
    c.free(p).unwrap();
    let q = c.alloc(40 * MIB, 0);
    assert_eq!(q, p, "the cached segment serves once free");
    leave(&mut c);
    c.free(q).unwrap();
}

fn a_pool_released_with_live_blocks_gives_back_at_their_free(policy: &str) {
    let (mut c, other) = served(policy, GIB);
    enter(&mut c);
    let p = c.alloc(3 * MIB, 0);
    leave(&mut c);
    c.release_pool(POOL).unwrap();
    assert_eq!(other.ledger().live.len(), 1);
    assert!(!other.ledger().dropped);
    c.free(p).unwrap();
    c.empty_cache();
    let l = other.ledger();
    assert_eq!((l.live.len(), l.released), (0, 1));
    assert!(l.dropped);
}

under_both_policies!(
    segments_come_from_the_other_allocator_in_pytorchs_sizes,
    blocks_split_and_are_reused_inside_the_pool,
    a_segment_goes_back_only_after_the_work_on_it,
    the_other_allocator_full_is_out_of_memory_not_a_crash,
    a_pool_released_with_live_blocks_gives_back_at_their_free,
);

#[test]
fn an_existing_pool_keeps_how_it_is_served() {
    let mut c = Checked::with(GIB, "policy:gpualloc");
    c.create_or_incref_pool(POOL);
    let other = Foreign::new(GIB);
    c.create_or_incref_pool_from(POOL, &other);
    assert!(other.ledger().dropped, "the late source was not taken");
    enter(&mut c);
    let p = c.alloc(MIB, 0);
    leave(&mut c);
    assert_eq!(other.ledger().allocated, 0);
    c.free(p).unwrap();
    c.release_pool(POOL).unwrap();
    c.release_pool(POOL).unwrap();
}

/// A trace records that the pool is served so, and its replay, with plain
/// segments of the simulated device for the other allocator's, reserves
/// what the run reserved; without that record it would not.
#[test]
fn a_replay_serves_the_pool_from_plain_segments_to_the_recorded_peak() {
    use gpualloc::replay::replay;
    use gpualloc::trace::{Action, PoolOp, TraceEvent, TraceReader};
    use gpualloc::{Allocator, Config, SimBackend};
    const CAPACITY: u64 = 4 * GIB;
    let conf = Config::default();
    let a = Allocator::new(conf.clone(), 1, Box::new(|_| Ok(SimBackend::new(CAPACITY))));
    let path = std::env::temp_dir().join(format!(
        "gpualloc-served-pool-{}.gtrace",
        std::process::id()
    ));
    a.trace_start(&path).unwrap();
    let other = Foreign::new(GIB);
    let mut live = Vec::new();
    for step in 0..6u64 {
        live.push(a.malloc(0, (3 + step) * MIB + 512, 0).unwrap());
        if step == 1 {
            a.create_or_incref_pool_from(0, POOL, other.source())
                .unwrap();
        }
        if step >= 1 {
            a.begin_allocate_to_pool(0, POOL, None).unwrap();
            for k in 0..4 {
                live.push(
                    a.malloc(0, (k + 1) * 700 * KIB + step * 64 * KIB, 0)
                        .unwrap(),
                );
            }
            a.end_allocate_to_pool(0, POOL).unwrap();
            a.release_pool(0, POOL).unwrap();
        }
        while live.len() > 7 {
            a.free(0, live.remove(0)).unwrap();
        }
    }
    for p in live {
        a.free(0, p).unwrap();
    }
    a.release_pool(0, POOL).unwrap();
    a.empty_cache().unwrap();
    a.trace_stop().unwrap();
    let peak = a.stats(0).unwrap().reserved_bytes.all.peak as u64;
    assert!(other.ledger().allocated > 0 && other.ledger().live.is_empty());
    let evs: Vec<TraceEvent> = TraceReader::open(&path).unwrap().events().collect();
    std::fs::remove_file(&path).unwrap();
    let served =
        |e: &TraceEvent| e.action == Action::PrivatePool && e.size == PoolOp::IncrefServed.code();
    assert_eq!(evs.iter().filter(|e| served(e)).count(), 1);
    let r = replay(evs.iter().copied(), CAPACITY, &conf);
    assert_eq!((r.peak_reserved, r.ooms), (peak, 0));
    let without: Vec<TraceEvent> = evs.iter().copied().filter(|e| !served(e)).collect();
    assert_ne!(
        replay(without.into_iter(), CAPACITY, &conf).peak_reserved,
        peak
    );
}

/// PyTorch calls the other allocator's `raw_alloc` as it calls `cudaMalloc`
/// (`cudaMallocMaybeCapturing`): in relaxed capture mode while a graph is
/// captured, so that an allocator that calls `cudaMalloc` (a
/// `CUDAPluggableAllocator`, `ncclMemAlloc`) does not invalidate a capture
/// in the default global mode. The simulator counts the calls made so.
#[test]
fn the_other_allocator_is_called_in_relaxed_capture_mode_during_a_capture() {
    for policy in ["policy:pytorch", "policy:gpualloc"] {
        let (mut c, other) = served(policy, GIB);
        enter(&mut c);
        let p = c.alloc(3 * MIB, 0);
        leave(&mut c);
        assert_eq!(other.ledger().allocated, 1);
        assert_eq!(c.sim().counters.other_allocator_capturing, 1, "{policy}");
        c.free(p).unwrap();
    }
}

/// A source that hands out addresses of its own and runs `hook` inside
/// each of its calls (`"allocate"`, `"release"`, and `"drop"` when it is
/// dropped): an allocator whose callbacks call back into gpualloc.
struct Reentrant<F: FnMut(&str) + Send> {
    hook: F,
    next: gpualloc::DevicePtr,
}

impl<F: FnMut(&str) + Send> Reentrant<F> {
    fn new(hook: F) -> Reentrant<F> {
        Reentrant {
            hook,
            next: 0x5f00_0000_0000,
        }
    }
}

impl<F: FnMut(&str) + Send> gpualloc::SegmentSource for Reentrant<F> {
    fn name(&self) -> &str {
        "re-entrant"
    }
    fn allocate(
        &mut self,
        size: u64,
        _: gpualloc::StreamId,
    ) -> Result<gpualloc::DevicePtr, gpualloc::BackendError> {
        (self.hook)("allocate");
        let p = self.next;
        self.next += size.next_multiple_of(2 * MIB);
        Ok(p)
    }
    fn release(
        &mut self,
        _: gpualloc::DevicePtr,
        _: u64,
        _: gpualloc::StreamId,
    ) -> Result<(), gpualloc::BackendError> {
        (self.hook)("release");
        Ok(())
    }
}

impl<F: FnMut(&str) + Send> Drop for Reentrant<F> {
    fn drop(&mut self) {
        (self.hook)("drop");
    }
}

/// An allocator that allocates through gpualloc from its own callbacks
/// (PyTorch's lock is re-entrant, gpualloc's is not) gets an error, not a
/// deadlock; the call that called it goes on.
#[test]
fn a_source_calling_back_gets_an_error_not_a_deadlock() {
    use gpualloc::{Allocator, Config, SimBackend};
    use std::sync::{Arc, Mutex};

    let a = Arc::new(Allocator::new(
        Config::default(),
        1,
        Box::new(|_| Ok(SimBackend::new(GIB))),
    ));
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (alloc, log) = (Arc::downgrade(&a), Arc::clone(&seen));
    let source = Reentrant::new(move |what: &str| {
        let a = alloc.upgrade().expect("alive");
        let e = a
            .malloc(0, 4096, 0)
            .expect_err("a call back cannot be served");
        assert!(matches!(e, AllocError::CalledBack { device: 0 }), "{e:?}");
        assert!(a.empty_cache().is_err());
        assert!(matches!(
            a.with_owner(0x1234, |_| Ok(())),
            Some(Err(AllocError::CalledBack { device: -1 }))
        ));
        log.lock().unwrap().push(format!("{what}: {e}"));
    });
    a.create_or_incref_pool_from(0, POOL, Box::new(source))
        .unwrap();
    a.begin_allocate_to_pool(0, POOL, None).unwrap();
    let p = a.malloc(0, 3 * MIB, 0).unwrap();
    a.end_allocate_to_pool(0, POOL).unwrap();
    a.release_pool(0, POOL).unwrap();
    a.free(0, p).unwrap();
    a.release_pool(0, POOL).unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen[0].starts_with("allocate: gpualloc: called (device 0) from another allocator"));
    assert!(seen[1].starts_with("release:") && seen[2].starts_with("drop:"));
    // Outside the callbacks, the allocator serves as before.
    let q = a.malloc(0, 4096, 0).unwrap();
    a.free(0, q).unwrap();
    a.lock(0).unwrap().check_invariants().unwrap();
}

/// A source that frees a live allocation from its own calls (a Python
/// `CUDAPluggableAllocator` whose callback runs the garbage collector,
/// which frees a CUDA tensor held in a cycle): PyTorch's re-entrant lock
/// frees it at once; gpualloc defers it until the call that called the
/// source lets go of the device, so it is freed when that call returns
/// (Note [Frees called back from a source]), not lost.
#[test]
fn a_free_called_back_from_a_source_is_done_when_the_call_returns() {
    use gpualloc::{Allocator, Config, DevicePtr, SimBackend};
    use std::sync::{Arc, Mutex};

    for policy in ["policy:pytorch", ""] {
        let a = Arc::new(Allocator::new(
            Config::parse(policy).unwrap(),
            1,
            Box::new(|_| Ok(SimBackend::new(GIB))),
        ));
        let allocated = |a: &Allocator<SimBackend>| a.stats(0).unwrap().allocated_bytes.all.current;
        let first = a.malloc(0, 8 * MIB, 0).unwrap();
        let second = a.malloc(0, 6 * MIB, 0).unwrap();
        let victims: Arc<Mutex<Vec<DevicePtr>>> = Arc::new(Mutex::new(vec![second, first]));
        let base = allocated(&a);
        let (alloc, queue) = (Arc::downgrade(&a), Arc::clone(&victims));
        // Frees one victim inside each allocate and release.
        let source = Reentrant::new(move |what: &str| {
            if what == "drop" {
                return;
            }
            let a = alloc.upgrade().expect("alive");
            let victim = queue.lock().unwrap().pop();
            if let Some(p) = victim {
                a.free(0, p).expect("a free called back is accepted");
            }
        });
        a.create_or_incref_pool_from(0, POOL, Box::new(source))
            .unwrap();
        // The pool grows: the source frees `first` from inside the call.
        a.begin_allocate_to_pool(0, POOL, None).unwrap();
        let p = a.malloc(0, 3 * MIB, 0).unwrap();
        a.end_allocate_to_pool(0, POOL).unwrap();
        assert_eq!(victims.lock().unwrap().len(), 1, "{policy}: the source ran");
        assert!(
            a.allocation_size(first).unwrap().is_none(),
            "{policy}: the free called back was lost"
        );
        let pool_block = a.allocation_size(p).unwrap().unwrap() as i64;
        assert_eq!(
            allocated(&a),
            base - 8 * MIB as i64 + pool_block,
            "{policy}"
        );
        // The pool's segment goes back: the source frees `second`.
        a.free(0, p).unwrap();
        a.release_pool(0, POOL).unwrap();
        a.release_pool(0, POOL).unwrap();
        a.empty_cache().unwrap();
        assert!(
            victims.lock().unwrap().is_empty(),
            "{policy}: the source's release ran"
        );
        assert!(
            a.allocation_size(second).unwrap().is_none(),
            "{policy}: the free called back was lost"
        );
        assert_eq!(allocated(&a), 0, "{policy}");
        a.lock(0).unwrap().check_invariants().unwrap();
    }
}
