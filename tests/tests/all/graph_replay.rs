//! A program that captures CUDA graphs replays to its recorded peak and
//! memory calls: the trace holds every call on a private pool, and the
//! replay sends each allocation to the pool that served it
//! (`allocator/src/replay_pools.rs`).

use gpualloc::replay::replay;
use gpualloc::trace::{Action, TraceEvent, TraceReader};
use gpualloc::{Allocator, Config, SimBackend};

/// A program with captures: default-stream work between them, each
/// capture allocating on its stream (7) into a fresh pool while the
/// default stream keeps allocating, graphs released a few steps later.
/// Returns the trace and the recorded peak reserved and memory calls.
fn record_captures(seed: u64) -> (Vec<TraceEvent>, u64, u64) {
    let capacity = 4u64 << 30;
    let a = Allocator::new(
        Config::default(),
        1,
        Box::new(move |_| Ok(SimBackend::new(capacity))),
    );
    let path = std::env::temp_dir().join(format!(
        "gpualloc-graph-replay-{}-{seed}.gtrace",
        std::process::id()
    ));
    a.trace_start(&path).unwrap();
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut rnd = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let (mut live, mut graphs) = (Vec::new(), Vec::new());
    for step in 0..60u64 {
        for _ in 0..20 {
            let size = (1 << 20) + rnd(80 << 20);
            live.push(a.malloc(0, size, 0).unwrap());
            if live.len() > 12 {
                let i = rnd(live.len() as u64) as usize;
                a.free(0, live.swap_remove(i)).unwrap();
            }
        }
        if step % 3 == 0 {
            let key = (1, step);
            a.begin_allocate_to_pool(0, key, Some(Box::new(|s| s == 7)))
                .unwrap();
            let mut held = Vec::new();
            for _ in 0..10 {
                held.push(a.malloc(0, 4096 + rnd(60 << 20), 7).unwrap());
                let i = rnd(live.len() as u64) as usize;
                a.free(0, live.swap_remove(i)).unwrap();
                live.push(a.malloc(0, (1 << 20) + rnd(40 << 20), 0).unwrap());
                if rnd(2) == 0 {
                    a.free(0, held.swap_remove(0)).unwrap();
                }
            }
            a.end_allocate_to_pool(0, key).unwrap();
            for p in held {
                a.free(0, p).unwrap();
            }
            graphs.push(key);
        }
        if graphs.len() > 2 {
            a.release_pool(0, graphs.remove(0)).unwrap();
        }
        if step % 25 == 24 {
            a.create_or_incref_pool(0, (2, step)).unwrap();
            a.release_pool(0, (2, step)).unwrap();
            a.empty_cache().unwrap();
        }
    }
    a.trace_stop().unwrap();
    let peak = a.stats(0).unwrap().reserved_bytes.all.peak as u64;
    let calls = a.lock(0).unwrap().driver_calls().memory_calls();
    let evs: Vec<TraceEvent> = TraceReader::open(&path).unwrap().events().collect();
    std::fs::remove_file(&path).unwrap();
    (evs, peak, calls)
}

#[test]
fn captures_replay_to_the_recorded_peak_and_memory_calls() {
    for seed in 1..=4 {
        let (evs, peak, calls) = record_captures(seed);
        assert!(evs.iter().any(|e| e.action == Action::PrivatePool));
        let conf = Config::default();
        let r = replay(evs.iter().copied(), 4 << 30, &conf);
        assert_eq!(r.peak_reserved, peak, "seed {seed}");
        assert_eq!(r.driver.memory_calls(), calls, "seed {seed}");
        // Without the pool calls, graph memory lands in the default
        // pools and the replay parts from the recording.
        let r = replay(
            evs.iter()
                .copied()
                .filter(|e| e.action != Action::PrivatePool),
            4 << 30,
            &conf,
        );
        assert_ne!(
            (r.peak_reserved, r.driver.memory_calls()),
            (peak, calls),
            "seed {seed}"
        );
    }
}
