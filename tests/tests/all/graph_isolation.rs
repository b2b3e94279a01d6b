//! A CUDA graph's private pool, while held, keeps its memory: whatever the
//! default pools do afterwards (defragmentation, stitching, the
//! out-of-memory retries, `empty_cache`), no block of theirs lies in the
//! pool's address ranges or maps one of its physical handles, and the
//! pool's mappings do not change (Note [Private pools] in `capture.rs`).
//! A graph replays at its captured addresses, so either would let another
//! tensor share memory with the graph's intermediates.
//!
//! Each run captures a graph on one stream after some default-pool history,
//! keeps about half its outputs alive, then makes random default-pool
//! requests of up to 60 MiB on the capture's stream and another, frees,
//! completions and `empty_cache` on a device small enough to fill.

use std::collections::BTreeSet;

use gpualloc::PoolKey;
use gpualloc_tests::{Checked, MIB};
use proptest::prelude::RngCore;
use proptest::test_runner::{RngAlgorithm, TestRng};

/// The stream the graph is captured on.
const CAPTURE: u64 = 5;
/// Another stream of the program.
const OTHER: u64 = 6;
const GRAPH: PoolKey = (1, 0);

/// The mapped memory of `pool`: its address ranges and its mappings
/// `(address, handle, bytes)`.
type PoolMemory = (Vec<(u64, u64)>, BTreeSet<(u64, u64, u64)>);

fn pool_memory(c: &Checked, pool: PoolKey) -> PoolMemory {
    let mut ranges = Vec::new();
    let mut mappings = BTreeSet::new();
    for s in c.snapshot().into_iter().filter(|s| s.pool_id == pool) {
        ranges.push((s.address, s.address + s.total_size));
        mappings.extend(c.sim().handles_over(s.address, s.total_size));
    }
    ranges.sort_unstable();
    (ranges, mappings)
}

/// A number below `n`.
fn below(rng: &mut TestRng, n: u64) -> u64 {
    rng.next_u64() % n
}

/// Up to `max_mib` MiB, not a whole number of pages.
fn size(rng: &mut TestRng, max_mib: u64) -> u64 {
    (below(rng, max_mib) + 1) * MIB + below(rng, 4096)
}

/// Frees a random one of `live`.
fn free_one(c: &mut Checked, rng: &mut TestRng, live: &mut Vec<u64>) {
    if !live.is_empty() {
        let p = live.swap_remove(below(rng, live.len() as u64) as usize);
        c.release(p);
    }
}

fn run(config: &str, seed: u64) {
    let mut c = Checked::with(512 * MIB, config);
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed as u8; 32]);
    let mut live = Vec::new();
    for _ in 0..20 {
        if let Ok(p) = c.malloc(size(&mut rng, 40), OTHER) {
            c.use_on(p, OTHER);
            live.push(p);
        }
        if live.len() > 5 {
            free_one(&mut c, &mut rng, &mut live);
        }
    }
    c.begin_pool(GRAPH, Some(CAPTURE));
    let mut graph = Vec::new();
    for _ in 0..12 {
        if let Ok(p) = c.malloc(size(&mut rng, 30), CAPTURE) {
            graph.push(p);
        }
        if graph.len() > 3 && below(&mut rng, 2) == 0 {
            free_one(&mut c, &mut rng, &mut graph);
        }
    }
    c.end_pool(GRAPH);
    // About half the outputs stay alive; the rest go back to the pool.
    for p in std::mem::take(&mut graph) {
        if below(&mut rng, 2) == 0 {
            c.release(p);
        }
    }
    let held = pool_memory(&c, GRAPH);
    let handles: BTreeSet<u64> = held.1.iter().map(|m| m.1).collect();
    for step in 0..300 {
        match below(&mut rng, 10) {
            0 => c.empty_cache(),
            1..=5 => {
                let stream = if below(&mut rng, 3) == 0 {
                    CAPTURE
                } else {
                    OTHER
                };
                if let Ok(p) = c.malloc(size(&mut rng, 60), stream) {
                    c.use_on(p, stream);
                    let end = p + c.live[&p].block;
                    for &(lo, hi) in &held.0 {
                        assert!(
                            end <= lo || hi <= p,
                            "{config}, seed {seed}, step {step}: a block at {p:#x}..{end:#x} \
                             lies in the graph's range {lo:#x}..{hi:#x}"
                        );
                    }
                    for (_, h, _) in c.sim().handles_over(p, end - p) {
                        assert!(
                            !handles.contains(&h),
                            "{config}, seed {seed}, step {step}: a block at {p:#x} maps \
                             handle {h} of the graph's pool"
                        );
                    }
                    live.push(p);
                }
            }
            6 => c.complete(if below(&mut rng, 2) == 0 {
                CAPTURE
            } else {
                OTHER
            }),
            _ => free_one(&mut c, &mut rng, &mut live),
        }
        assert_eq!(
            pool_memory(&c, GRAPH),
            held,
            "{config}, seed {seed}, step {step}: the held pool's memory changed"
        );
    }
}

#[test]
fn a_held_graph_pool_keeps_its_memory_whatever_the_default_pools_do() {
    for config in [
        "",
        "expandable_handle_mb:2,defragment_headroom:0,defragment_pressure:1",
        "defragment_headroom:0,defragment_pressure:1,stitch_min_mb:0",
        "policy:pytorch",
    ] {
        for seed in 1..=8 {
            run(config, seed);
        }
    }
}
