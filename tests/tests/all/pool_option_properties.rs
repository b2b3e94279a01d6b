//! Random programs mixing the default pools with a pool served by another
//! allocator (`MemPool(allocator=...)`) and a pool that lends its free
//! blocks on out-of-memory (`MemPool(use_on_oom=True)`), on a device small
//! enough to fill, under several configurations (Note [Pools served by
//! another allocator], Note [MemPool options]). Besides what `Checked`
//! checks after every call (invariants, the stats recounted with the other
//! allocator's bytes, no range given back while work on it may run):
//! every block of the served pool lies in the other allocator's memory,
//! every other block outside it, everything goes back at the end, and in
//! each configuration some request outside any pool borrowed.

use gpualloc::PoolKey;
use gpualloc_tests::foreign::Foreign;
use gpualloc_tests::{Checked, MIB, cases};
use proptest::prelude::RngCore;
use proptest::test_runner::{RngAlgorithm, TestRng};

const SERVED: PoolKey = (0, 1);
const LENDING: PoolKey = (0, 2);
const STREAMS: [u64; 2] = [3, 4];

fn below(rng: &mut TestRng, n: u64) -> u64 {
    rng.next_u64() % n
}

/// From 512 B to about `max_mib` MiB, often not a multiple of a page.
fn size(rng: &mut TestRng, max_mib: u64) -> u64 {
    match below(rng, 3) {
        0 => 512 + below(rng, 1 << 20),
        _ => (below(rng, max_mib) + 1) * MIB + below(rng, 8192),
    }
}

/// One allocation in `pool` as `torch.cuda.use_mem_pool` makes it (a
/// scope and its hold around it), or outside any pool.
fn alloc(c: &mut Checked, pool: Option<PoolKey>, bytes: u64, stream: u64) -> Option<u64> {
    if let Some(k) = pool {
        c.begin_pool(k, None);
    }
    let p = c.malloc(bytes, stream).ok();
    if let Some(k) = pool {
        c.end_pool(k);
        c.release_pool(k).unwrap();
    }
    p
}

fn in_other(other: &Foreign, p: u64) -> bool {
    other
        .ledger()
        .live
        .range(..=p)
        .next_back()
        .is_some_and(|(&a, &(s, _))| p < a + s)
}

/// Whether `p` lies in a segment of `pool`.
fn in_pool(c: &Checked, pool: PoolKey, p: u64) -> bool {
    c.snapshot()
        .iter()
        .any(|s| s.pool_id == pool && s.address <= p && p < s.address + s.total_size)
}

/// Runs one program; returns how many requests outside any pool the
/// lending pool served.
fn run(config: &str, seed: u64) -> usize {
    let mut c = Checked::with(256 * MIB, config);
    let other = Foreign::new(96 * MIB);
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed.to_le_bytes().repeat(4));
    c.create_or_incref_pool_from(SERVED, &other);
    c.create_or_incref_pool(LENDING);
    c.dev.set_pool_use_on_oom(LENDING, true).unwrap();
    let mut live: Vec<(u64, Option<PoolKey>)> = Vec::new();
    let mut borrowed = 0;
    for step in 0..250 {
        let stream = STREAMS[below(&mut rng, 2) as usize];
        match below(&mut rng, 11) {
            0..=4 => {
                let pool = match below(&mut rng, 4) {
                    0 => Some(SERVED),
                    1 => Some(LENDING),
                    _ => None,
                };
                if let Some(p) = alloc(&mut c, pool, size(&mut rng, 48), stream) {
                    assert_eq!(
                        in_other(&other, p),
                        pool == Some(SERVED),
                        "{config}, seed {seed}, step {step}: a block of {pool:?} at {p:#x}"
                    );
                    borrowed += usize::from(pool.is_none() && in_pool(&c, LENDING, p));
                    c.use_on(p, stream);
                    live.push((p, pool));
                }
            }
            5 => {
                let i = below(&mut rng, live.len().max(1) as u64) as usize;
                if let Some(&(p, _)) = live.get(i) {
                    let other_stream = STREAMS.into_iter().find(|&s| s != c.live[&p].stream);
                    if let Some(s) = other_stream {
                        c.record_stream(p, s);
                        c.use_on(p, s);
                    }
                }
            }
            6 => c.complete(stream),
            7 if below(&mut rng, 4) == 0 => c.empty_cache(),
            _ => {
                if !live.is_empty() {
                    let (p, _) = live.swap_remove(below(&mut rng, live.len() as u64) as usize);
                    c.release(p);
                }
            }
        }
    }
    for (p, _) in live {
        c.release(p);
    }
    c.release_pool(SERVED).unwrap();
    c.release_pool(LENDING).unwrap();
    c.complete_all();
    c.empty_cache();
    let l = other.ledger();
    assert!(
        l.live.is_empty() && l.dropped,
        "{config}, seed {seed}: the other allocator still lends {} bytes",
        l.bytes()
    );
    assert!(
        c.snapshot().iter().all(|s| s.pool_id == (0, 0)),
        "{config}, seed {seed}: a pool's segment outlived the pool"
    );
    borrowed
}

#[test]
fn pools_of_another_allocator_and_lending_pools_keep_every_invariant() {
    for config in [
        "",
        "expandable_handle_mb:2,defragment_headroom:0,defragment_pressure:1",
        "policy:pytorch",
        "policy:pytorch,expandable_segments:true",
        "cross_stream_reuse:false",
    ] {
        let borrowed: usize = (1..=u64::from(cases(6))).map(|s| run(config, s)).sum();
        assert!(
            borrowed > 0,
            "{config}: no run borrowed from the lending pool"
        );
    }
}
