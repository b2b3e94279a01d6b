//! `torch.cuda.MemPool(use_on_oom=True)` and `MemPool(no_split=True)`
//! (Note [MemPool options] in `device.rs`), under either policy.

use gpualloc::{AllocError, DeviceAllocator, PoolKey, SimBackend};
use gpualloc_tests::{Checked, GIB, KIB, MIB, cfg};

const POOL: PoolKey = (0, 7);

/// A 64 MiB device whose pool `POOL` holds a free 40 MiB block; `lend`:
/// with `use_on_oom`.
fn pool_with_a_free_block(policy: &str, lend: bool) -> Checked {
    let mut c = Checked::with(64 * MIB, policy);
    c.create_or_incref_pool(POOL);
    if lend {
        c.dev.set_pool_use_on_oom(POOL, true).unwrap();
    }
    c.begin_pool(POOL, None);
    let p = c.alloc(40 * MIB, 0);
    c.end_pool(POOL);
    c.release_pool(POOL).unwrap();
    c.free(p).unwrap();
    c
}

fn a_use_on_oom_pool_lends_its_free_block_instead_of_failing(policy: &str) {
    let mut c = pool_with_a_free_block(policy, false);
    match c.try_malloc(40 * MIB, 0) {
        Err(AllocError::OutOfMemory(_)) => {}
        other => panic!("without use_on_oom: {other:?}"),
    }
    let mut c = pool_with_a_free_block(policy, true);
    let p = c.alloc(40 * MIB, 0);
    let in_pool = c
        .snapshot()
        .iter()
        .any(|s| s.pool_id == POOL && s.address <= p && p < s.address + s.total_size);
    assert!(in_pool, "served from the pool's free block");
    c.free(p).unwrap();
    // Off again, or no longer held: nothing is lent.
    c.dev.set_pool_use_on_oom(POOL, false).unwrap();
    assert!(c.try_malloc(40 * MIB, 0).is_err());
    c.dev.set_pool_use_on_oom(POOL, true).unwrap();
    c.release_pool(POOL).unwrap();
    let q = c.alloc(40 * MIB, 0);
    assert!(
        !c.snapshot().iter().any(|s| s.pool_id == POOL),
        "the released pool's memory went back first"
    );
    c.free(q).unwrap();
}

fn a_no_split_pool_hands_out_whole_blocks(policy: &str) {
    let mut d = DeviceAllocator::new(0, SimBackend::new(GIB), cfg(policy));
    d.create_or_incref_pool(POOL);
    d.set_pool_no_split(POOL).unwrap();
    d.begin_allocate_to_pool(POOL, None).unwrap();
    let a = d.malloc(KIB, 0).unwrap();
    let b = d.malloc(KIB, 0).unwrap();
    let big = d.malloc(5 * MIB, 0).unwrap();
    d.end_allocate_to_pool(POOL).unwrap();
    d.release_pool(POOL).unwrap();
    d.check_invariants().unwrap();
    let segs: Vec<_> = d
        .snapshot()
        .into_iter()
        .filter(|s| s.pool_id == POOL)
        .collect();
    assert_eq!(segs.len(), 3, "a segment each");
    assert!(segs.iter().all(|s| !s.expandable && s.blocks.len() == 1));
    let sizes: Vec<u64> = segs.iter().map(|s| s.total_size).collect();
    assert_eq!(sizes.iter().filter(|&&s| s == 2 * MIB).count(), 2);
    assert!(sizes.contains(&(20 * MIB)));
    for p in [a, b, big] {
        d.free(p).unwrap();
    }
    // A freed whole block serves again, whole.
    d.begin_allocate_to_pool(POOL, None).unwrap();
    let c = d.malloc(3 * MIB, 0).unwrap();
    d.end_allocate_to_pool(POOL).unwrap();
    d.release_pool(POOL).unwrap();
    assert_eq!(c, big);
    d.check_invariants().unwrap();
    assert_eq!(d.stats().inactive_split.all.current, 0);
    d.free(c).unwrap();
    d.release_pool(POOL).unwrap();
    d.empty_cache().unwrap();
    d.check_invariants().unwrap();
    assert!(d.snapshot().iter().all(|s| s.pool_id != POOL));
}

under_both_policies!(
    a_use_on_oom_pool_lends_its_free_block_instead_of_failing,
    a_no_split_pool_hands_out_whole_blocks,
    a_borrowed_block_returns_to_its_pool,
    a_replay_of_a_borrow_requests_from_the_default_pools,
    a_request_above_the_cap_borrows_a_block_that_fits,
);

#[test]
fn options_of_an_unknown_pool_are_refused() {
    let mut c = Checked::with(GIB, "policy:gpualloc");
    assert!(matches!(
        c.dev.set_pool_use_on_oom((9, 9), true),
        Err(AllocError::UnknownPool { .. })
    ));
    assert!(matches!(
        c.dev.set_pool_no_split((9, 9)),
        Err(AllocError::UnknownPool { .. })
    ));
    c.check();
}

/// A borrowed block, split, used on another stream and freed after its
/// pool's last hold went: it goes back to its pool, whose memory the next
/// `empty_cache` gives back.
fn a_borrowed_block_returns_to_its_pool(policy: &str) {
    let mut c = pool_with_a_free_block(policy, true);
    let p = c.alloc(30 * MIB, 0);
    c.record_stream(p, 5);
    c.use_on(p, 5);
    let q = c.alloc(6 * MIB, 0);
    c.release_pool(POOL).unwrap();
    c.free(p).unwrap();
    c.free(q).unwrap();
    c.complete_all();
    c.empty_cache();
    assert_eq!(c.reserved(), 0, "{:?}", c.snapshot());
    assert!(c.dev.private_pools().is_empty());
}

/// A run that borrowed from a `use_on_oom` pool: the borrowed request is
/// one of the default pools, so a replay makes it as such (through the
/// out-of-memory path, to the borrow), and on a device where it fits it
/// comes from the default pools as in a run on that device.
fn a_replay_of_a_borrow_requests_from_the_default_pools(policy: &str) {
    use gpualloc::replay::replay;
    use gpualloc::trace::{TraceEvent, TraceReader};
    use gpualloc::{Allocator, Config};
    const CAPACITY: u64 = 64 * MIB;
    let conf = Config::parse(policy).unwrap();
    let run = |capacity: u64, path: Option<&std::path::Path>| {
        let a = Allocator::new(
            conf.clone(),
            1,
            Box::new(move |_| Ok(SimBackend::new(capacity))),
        );
        if let Some(path) = path {
            a.trace_start(path).unwrap();
        }
        a.create_or_incref_pool(0, POOL).unwrap();
        a.set_pool_use_on_oom(0, POOL, true).unwrap();
        a.begin_allocate_to_pool(0, POOL, None).unwrap();
        let p = a.malloc(0, 40 * MIB, 0).unwrap();
        a.end_allocate_to_pool(0, POOL).unwrap();
        a.release_pool(0, POOL).unwrap();
        a.free(0, p).unwrap();
        let d = a.malloc(0, 12 * MIB, 0).unwrap();
        a.free(0, d).unwrap();
        let b = a.malloc(0, 40 * MIB, 0).unwrap();
        a.free(0, b).unwrap();
        let c = a.malloc(0, 10 * MIB, 0).unwrap();
        a.free(0, c).unwrap();
        a.release_pool(0, POOL).unwrap();
        a.empty_cache().unwrap();
        if path.is_some() {
            a.trace_stop().unwrap();
        }
        a.stats(0).unwrap()
    };
    let path = std::env::temp_dir().join(format!(
        "gpualloc-use-on-oom-{}-{}.gtrace",
        std::process::id(),
        policy.len()
    ));
    let recorded = run(CAPACITY, Some(&path));
    let evs: Vec<TraceEvent> = TraceReader::open(&path).unwrap().events().collect();
    std::fs::remove_file(&path).unwrap();
    assert!(recorded.num_alloc_retries > 0, "the run borrowed");
    let r = replay(evs.iter().copied(), CAPACITY, &conf);
    assert_eq!(r.ooms, 0);
    assert_eq!(
        (r.devices[0].alloc_retries, r.peak_reserved),
        (
            recorded.num_alloc_retries as u64,
            recorded.reserved_bytes.all.peak as u64
        ),
        "replay on the recorded device"
    );
    let big = run(GIB, None);
    assert_eq!(big.num_alloc_retries, 0);
    let r = replay(evs.iter().copied(), GIB, &conf);
    assert_eq!(
        r.peak_reserved, big.reserved_bytes.all.peak as u64,
        "replay on a device where nothing runs out"
    );
}

/// Under a cap lowered after the pool filled, a request larger than the
/// cap still fits the pool's free block: PyTorch lends it (the borrow
/// does not grow anything), so gpualloc must not report it as one that
/// can never fit.
fn a_request_above_the_cap_borrows_a_block_that_fits(policy: &str) {
    let mut c = pool_with_a_free_block(policy, true);
    c.set_memory_fraction(0.5).unwrap();
    let p = c.alloc(36 * MIB, 0);
    assert!(
        c.snapshot()
            .iter()
            .any(|s| s.pool_id == POOL && s.address <= p && p < s.address + s.total_size)
    );
    c.free(p).unwrap();
}
