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
