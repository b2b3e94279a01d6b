//! Fault injection: the k-th driver call of each kind fails, for every k
//! the workload reaches (up to a bound), under each policy. The allocator
//! returns the error or recovers; it never panics, and every invariant
//! holds after every call.

use std::panic::{AssertUnwindSafe, catch_unwind};

use gpualloc::backend::SimCall;
use gpualloc::workload::Rng;
use gpualloc::{DeviceAllocator, SimBackend};
use gpualloc_tests::cfg;

/// Largest k swept per kind.
const MAX_K: u64 = 25;

const CONFIGS: [&str; 6] = [
    "policy:pytorch",
    // PyTorch's expandable segments (no moves, no stitches, 20 MiB pages).
    "policy:pytorch,expandable_segments:true",
    "policy:gpualloc",
    // Moves and stitches with no stream taking another's cached blocks.
    "policy:gpualloc,cross_stream_reuse:false",
    // The same, with the unmapping given up left to the helper thread as
    // long as it may be, or done by it at once, so that faults strike
    // those jobs when they run rather than the calls that gave them.
    "policy:gpualloc,later",
    "policy:gpualloc,eager",
];

/// A fixed workload: allocations of mixed sizes on three streams, frees,
/// cross-stream uses, stream progress and cache releases; invariants
/// checked after every call. Returns the calls made, per kind, or the
/// first invariant that failed.
fn workload(label: &str, fault: Option<(SimCall, u64)>) -> Result<[u64; 15], String> {
    let mut config = label;
    let mut sim = SimBackend::new(2 << 30);
    if let Some((call, k)) = fault {
        sim.fail_call(call, k);
    }
    if let Some(c) = config.strip_suffix(",later") {
        sim.defer_later_work(true);
        config = c;
    } else if let Some(c) = config.strip_suffix(",eager") {
        sim.eager_later_work(true);
        config = c;
    }
    let mut d = DeviceAllocator::new(0, sim, cfg(config));
    let mut live = Vec::new();
    let mut rng = Rng::xorshift64(0x9e37_79b9_7f4a_7c15);
    let mut rnd = |n: u64| rng.below(n);
    for step in 0..300 {
        let stream = rnd(3);
        match rnd(10) {
            0..=3 => {
                let size = match rnd(3) {
                    0 => 1 + rnd(8192),
                    1 => 1 + rnd(4 << 20),
                    _ => (4 << 20) + rnd(120 << 20),
                };
                if let Ok(p) = d.malloc(size, stream) {
                    live.push(p);
                }
            }
            4..=6 if !live.is_empty() => {
                let p = live.swap_remove(rnd(live.len() as u64) as usize);
                if d.free(p).is_err() {
                    live.push(p);
                }
            }
            7 if !live.is_empty() => {
                let p = live[rnd(live.len() as u64) as usize];
                let _ = d.record_stream(p, (stream + 1) % 3);
            }
            8 => d.backend_mut().complete(stream),
            _ => {
                let _ = d.empty_cache();
            }
        }
        d.check_invariants()
            .map_err(|e| format!("{label}, {fault:?}: step {step}: {e}"))?;
    }
    for p in live {
        let _ = d.free(p);
    }
    d.backend_mut().complete_all();
    let _ = d.empty_cache();
    d.check_invariants()
        .map_err(|e| format!("{label}, {fault:?}: at the end: {e}"))?;
    Ok(SimCall::ALL.map(|c| d.backend().calls(c)))
}

#[test]
fn the_kth_driver_call_of_each_kind_fails_cleanly() {
    let mut swept = 0;
    let mut failed = Vec::new();
    for config in CONFIGS {
        let clean = workload(config, None).unwrap();
        for call in SimCall::ALL {
            for k in 1..=clean[call as usize].min(MAX_K) {
                match catch_unwind(AssertUnwindSafe(|| workload(config, Some((call, k))))) {
                    Err(_) => failed.push(format!("{config}: failing {call:?} call {k} panicked")),
                    Ok(Err(why)) => failed.push(why),
                    Ok(Ok(_)) => {}
                }
                swept += 1;
            }
        }
    }
    assert!(swept > 100, "only {swept} faults injected");
    assert!(
        failed.is_empty(),
        "{} of {swept} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// A workload of captures with reuse inside a capture on: each capture
/// begins on stream 0, takes streams 1 and 2 in, allocates, uses blocks
/// across the three (`record_stream`), frees and launches work at random,
/// joins them back and ends; between captures, eager work. Invariants
/// checked after every call. Returns the calls of the two capture queries.
fn capture_workload(fault: Option<(SimCall, u64)>) -> Result<[u64; 2], String> {
    let mut sim = SimBackend::new(2 << 30);
    if let Some((call, k)) = fault {
        sim.fail_call(call, k);
    }
    let mut d = DeviceAllocator::new(0, sim, cfg("graph_capture_record_stream_reuse:true"));
    let mut rng = Rng::xorshift64(0x2545_f491_4f6c_dd1d);
    let mut rnd = |n: u64| rng.below(n);
    let mut live: Vec<u64> = Vec::new();
    for round in 0..12u64 {
        let pool = (1, round % 2);
        d.begin_allocate_to_pool(pool, None)
            .map_err(|e| format!("{fault:?}: begin: {e}"))?;
        let capture = d.backend_mut().begin_graph_capture(0);
        d.backend_mut().capture_launch(0);
        for s in [1, 2] {
            d.backend_mut().capture_wait(s, 0);
        }
        for step in 0..80 {
            let stream = rnd(3);
            match rnd(8) {
                0..=2 => {
                    if let Ok(p) = d.malloc(1 + rnd(24 << 20), stream) {
                        live.push(p);
                    }
                }
                3 | 4 if !live.is_empty() => {
                    let p = live.swap_remove(rnd(live.len() as u64) as usize);
                    if d.free(p).is_err() {
                        live.push(p);
                    }
                }
                5 if !live.is_empty() => {
                    let p = live[rnd(live.len() as u64) as usize];
                    let _ = d.record_stream(p, stream);
                }
                6 => {
                    d.backend_mut().capture_launch(stream);
                }
                _ => {
                    let from = rnd(3);
                    if from != stream {
                        d.backend_mut().capture_wait(stream, from);
                    }
                }
            }
            d.check_invariants()
                .map_err(|e| format!("{fault:?}: capture {round}, step {step}: {e}"))?;
        }
        for s in [1, 2] {
            d.backend_mut().capture_wait(0, s);
        }
        d.backend_mut().end_stream_capture(capture);
        d.end_allocate_to_pool(pool)
            .map_err(|e| format!("{fault:?}: end: {e}"))?;
        // Eager work between captures: frees wait for events, which complete.
        for _ in 0..10 {
            if !live.is_empty() && rnd(2) == 0 {
                let p = live.swap_remove(rnd(live.len() as u64) as usize);
                if d.free(p).is_err() {
                    live.push(p);
                }
            } else if let Ok(p) = d.malloc(1 + rnd(8 << 20), rnd(3)) {
                live.push(p);
            }
            d.backend_mut().complete(rnd(3));
            d.check_invariants()
                .map_err(|e| format!("{fault:?}: after capture {round}: {e}"))?;
        }
    }
    for p in live {
        let _ = d.free(p);
    }
    d.backend_mut().complete_all();
    let _ = d.empty_cache();
    d.check_invariants()
        .map_err(|e| format!("{fault:?}: at the end: {e}"))?;
    let b = d.backend();
    Ok([
        b.calls(SimCall::CaptureTerminals),
        b.calls(SimCall::NodeDependencies),
    ])
}

#[test]
fn the_kth_capture_query_fails_cleanly() {
    let clean = capture_workload(None).unwrap();
    assert!(
        clean.iter().all(|&n| n > 0),
        "the workload asks both queries: {clean:?}"
    );
    let mut failed = Vec::new();
    for (i, call) in [SimCall::CaptureTerminals, SimCall::NodeDependencies]
        .into_iter()
        .enumerate()
    {
        for k in 1..=clean[i].min(4 * MAX_K) {
            match catch_unwind(AssertUnwindSafe(|| capture_workload(Some((call, k))))) {
                Err(_) => failed.push(format!("failing {call:?} call {k} panicked")),
                Ok(Err(why)) => failed.push(why),
                Ok(Ok(_)) => {}
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
