//! Many workloads from a few: perturbed copies of recorded traces and
//! synthetic ones, to judge a placement policy on more than a handful of
//! replays (`docs/policy-experiments.md`: single replays are chaotic).
//!
//! [`perturbed`] scales every requested size of a trace by a factor drawn
//! per trace (0.8–1.2) times a jitter drawn per distinct size (±5%), so a
//! fixed-shape workload stays fixed-shape (equal sizes stay equal) while its
//! layout changes. [`churn`], [`churn_wide`] and [`multiscale`] build event sequences
//! for [`replay`](crate::replay::replay) directly. [`longer`] draws a long
//! run from a recorded one's steps (Note [Longer runs]).
//! `allocator/examples/placement_bench.rs` runs them all under several
//! configurations.
//!
//! [`stitching_step`] drives a live allocator through a random program that
//! stitches, for the tests of what traces and snapshots say about stitches.
//!
//! [`Rng`] draws the inputs of tests, benchmarks and `gpualloc generate`
//! from a seed (`rng.rs`).

use crate::backend::{Backend, DevicePtr};
use crate::trace::{Action, TraceEvent};
use crate::{AllocError, Allocator};

pub use crate::rng::Rng;
pub use fixed_shape::fixed_shape;
pub use longer::{MAX_STEPS, longer};
pub use python_random::PythonRandom;

mod fixed_shape;
mod longer;
mod python_random;

/// SplitMix64: a well-mixed 64-bit value from any input.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A uniform value in `[0, 1)` from a hash.
fn unit(x: u64) -> f64 {
    (mix(x) >> 11) as f64 / (1u64 << 53) as f64
}

/// The events of a trace with every requested size (`alloc`, `oom`)
/// scaled: by `0.8 + 0.4 u` for the whole trace, times `0.95 + 0.1 v` per
/// distinct size (`u`, `v` drawn from `seed`). Seed 0 leaves the trace as it is.
pub fn perturbed(
    events: impl Iterator<Item = TraceEvent>,
    seed: u64,
) -> impl Iterator<Item = TraceEvent> {
    let global = 0.8 + 0.4 * unit(seed);
    events.map(move |mut e| {
        if seed != 0 && matches!(e.action, Action::Alloc | Action::Oom) && e.size > 0 {
            let jitter = 0.95 + 0.1 * unit(mix(seed) ^ e.size);
            e.size = ((e.size as f64 * global * jitter) as u64).max(1);
        }
        e
    })
}

/// Builds an event list: allocations and frees on stream 0 of device 0,
/// `ns_per_event` apart (time budgets read the trace's clock).
#[derive(Default)]
struct Builder {
    events: Vec<TraceEvent>,
    next: DevicePtr,
    ns_per_event: u64,
}

impl Builder {
    fn push(&mut self, action: Action, addr: DevicePtr, size: u64) {
        self.events.push(TraceEvent {
            time_ns: self.events.len() as u64 * self.ns_per_event,
            action,
            device: 0,
            stream: 0,
            addr,
            size,
            aux: 0,
            thread: 0,
        });
    }

    /// An allocation of `size` bytes; returns its (trace) address.
    fn alloc(&mut self, size: u64) -> DevicePtr {
        self.next += 1 << 12;
        let a = self.next;
        self.push(Action::Alloc, a, size);
        a
    }

    fn free(&mut self, addr: DevicePtr) {
        self.push(Action::FreeRequested, addr, 0);
    }
}

/// The churn loop of `tests/gpu/checks.py` (`check_churn_wide`, the issue's
/// loop): sizes log-uniform from 512 B to 64 MiB, so that no two large
/// sizes repeat exactly (see `window_loop`), drawn by Python's
/// `random.Random(seed)`: seed 5 is the check's own loop.
pub fn churn_wide(seed: u32, ops: usize) -> Vec<TraceEvent> {
    let mut r = PythonRandom::new(seed);
    let (lo, hi) = ((512f64).ln(), ((64u64 << 20) as f64).ln());
    let sizes: Vec<u64> = (0..4096).map(|_| r.uniform(lo, hi).exp() as u64).collect();
    window_loop(&sizes, ops)
}

/// The other churn loop of `tests/gpu/checks.py` (`check_churn`): sizes
/// drawn from six, 256 B to 24 MiB, so that the same few sizes come back
/// in a fixed order and no request reaches `stitch_min_mb`; what it costs
/// is defragmentation alone (see `window_loop`). Drawn by Python's
/// `random.Random(seed)`: seed 4 is the check's own loop.
pub fn churn(seed: u32, ops: usize) -> Vec<TraceEvent> {
    const SIZES: [u64; 6] = [256, 4096, 65536, 1 << 20, 5 << 20, 24 << 20];
    let mut r = PythonRandom::new(seed);
    let sizes: Vec<u64> = (0..4096).map(|_| r.choice(&SIZES)).collect();
    window_loop(&sizes, ops)
}

/// A window of 64 live tensors; each new tensor (cycling through `sizes`)
/// replaces the one in its slot after it is allocated, as `window[i % 64]
/// = torch.empty(...)` does: 2000 warm-up operations, then `ops` that
/// start again from the first size and the first slot, as the check's
/// timed loop does. Events at the H200's pace under PyTorch (about 2.5 µs
/// per iteration).
fn window_loop(sizes: &[u64], ops: usize) -> Vec<TraceEvent> {
    let mut b = Builder {
        ns_per_event: 1_250,
        ..Builder::default()
    };
    let mut window = [0; 64];
    for i in (0..2000).chain(0..ops) {
        let p = b.alloc(sizes[i % sizes.len()]);
        if window[i % 64] != 0 {
            b.free(window[i % 64]);
        }
        window[i % 64] = p;
    }
    for p in window.into_iter().filter(|&p| p != 0) {
        b.free(p);
    }
    b.events
}

/// A multi-scale training loop: weights and optimizer state allocated once;
/// each step draws an input scale, allocates `layers` activations whose
/// sizes grow with the scale's square (plus workspaces freed at once), then
/// frees them in reverse while gradients come and go; a few small tensors
/// live across steps (metrics, a leak-like history). Events are 50 µs
/// apart, as in the recorded GPU-bound training traces.
pub fn multiscale(seed: u64, steps: usize) -> Vec<TraceEvent> {
    let mut b = Builder {
        ns_per_event: 50_000,
        ..Builder::default()
    };
    let layers = 40u64;
    let r = |k: u64| unit(mix(seed) ^ k);
    let weights: Vec<u64> = (0..layers)
        .map(|l| (r(l) * (24 << 20) as f64) as u64 + 4096)
        .collect();
    let mut kept = Vec::new();
    for &w in &weights {
        kept.push(b.alloc(w));
        kept.push(b.alloc(w)); // optimizer state
    }
    let mut history = std::collections::VecDeque::new();
    for step in 0..steps as u64 {
        let scale = 0.5 + r(1 << 20 | step);
        let mut acts = Vec::new();
        for l in 0..layers {
            let base = (1 << 20) as f64 * (1.0 + 15.0 * r(2 << 20 | l));
            acts.push(b.alloc((base * scale * scale) as u64 + 512 * (l % 7)));
            if l % 5 == 0 {
                let ws = b.alloc((base * scale * 0.7) as u64);
                b.free(ws);
            }
        }
        for (l, a) in acts.into_iter().enumerate().rev() {
            let g = b.alloc(weights[l]);
            b.free(a);
            b.free(g);
        }
        history.push_back(b.alloc(1024 + (r(3 << 20 | step) * 65536.0) as u64));
        if history.len() > 50 {
            let h = history.pop_front().expect("not empty");
            b.free(h);
        }
    }
    b.events
}

/// One operation of a random program on device 0 that stitches (Note
/// \[Stitching\] in `stitch.rs`): half of them allocate (up to 96 MiB, a quarter within a
/// sixteenth of 60 MiB, which take a cached stitch with a tail past their
/// block), most others free one of `live`, the rest call `empty_cache`
/// when `empty_cache` is set (trimming the tails of stitches in use and
/// tearing cached ones down). A request that does not fit is skipped.
/// `below(n)` draws a value in `0..n` (from an [`Rng`], or a test's own
/// generator, whose programs stay as they were).
///
/// # Errors
/// A free or `empty_cache` that fails.
pub fn stitching_step<B: Backend>(
    a: &Allocator<B>,
    below: &mut impl FnMut(u64) -> u64,
    live: &mut Vec<DevicePtr>,
    empty_cache: bool,
) -> Result<(), AllocError> {
    const MIB: u64 = 1 << 20;
    match below(100) {
        0..=49 => {
            let size = match below(4) {
                0 => 1 + below(MIB),
                1 => MIB + below(15 * MIB),
                2 => 16 * MIB + below(80 * MIB),
                _ => 60 * MIB - below(4) * MIB,
            };
            if let Ok(p) = a.malloc(0, size, 0) {
                live.push(p);
            }
            Ok(())
        }
        50..=93 if !live.is_empty() => {
            let p = live.swap_remove(below(live.len() as u64) as usize);
            a.free(0, p)
        }
        _ if empty_cache => a.empty_cache(),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::replay::replay;

    #[test]
    fn perturbation_keeps_equal_sizes_equal_and_seed_zero_is_identity() {
        let evs = churn_wide(1, 200);
        let same: Vec<_> = perturbed(evs.iter().copied(), 0).collect();
        assert_eq!(same, evs);
        let p: Vec<_> = perturbed(evs.iter().copied(), 7).collect();
        assert_eq!(p.len(), evs.len());
        for (a, b) in evs.iter().zip(&p) {
            let ratio = b.size as f64 / a.size.max(1) as f64;
            if a.action == Action::Alloc {
                assert!((0.75..=1.27).contains(&ratio), "{} -> {}", a.size, b.size);
            }
            for (c, d) in evs.iter().zip(&p).take(300) {
                if c.size == a.size {
                    assert_eq!(d.size, b.size, "equal sizes stay equal");
                }
            }
        }
        assert_ne!(p, evs);
    }

    /// The sizes of the checks' loops: the values CPython 3.11 gives for
    /// the expressions of `tests/gpu/checks.py`, the warm-up's first and
    /// then the timed loop's, again from the first size.
    #[test]
    fn the_churn_loops_are_the_checks_loops() {
        let sizes = |evs: Vec<TraceEvent>| -> Vec<u64> {
            evs.iter()
                .filter(|e| e.action == Action::Alloc)
                .map(|e| e.size)
                .collect()
        };
        let wide = sizes(churn_wide(5, 4096));
        assert_eq!(wide.len(), 2000 + 4096);
        assert_eq!(wide[..2], [788_815, 3_201_638]);
        assert_eq!(wide[1999], 5562);
        assert_eq!(wide[2000..2002], wide[..2], "the timed loop starts again");
        assert_eq!(wide[2000 + 4095], 17_395_846);
        let narrow = sizes(churn(4, 4096));
        assert_eq!(narrow[..3], [4096, 65536, 256]);
        assert_eq!(narrow[1999], 65536);
        assert_eq!(narrow[2000 + 4095], 5 << 20);
    }

    #[test]
    fn synthetic_workloads_replay_without_unknown_frees() {
        for evs in [churn(3, 2000), churn_wide(3, 2000), multiscale(3, 5)] {
            let r = replay(evs.into_iter(), 8 << 30, &Config::default());
            assert_eq!((r.unknown_frees, r.ooms), (0, 0));
            assert!(r.peak_reserved >= r.peak_allocated && r.peak_allocated > 0);
        }
    }
}

#[cfg(test)]
pub(crate) mod later_tests {
    use super::{churn_wide, multiscale};
    use crate::Config;
    use crate::replay::{replay, replay_deferring};
    use crate::trace::{TraceEvent, TraceReader};

    /// The events of `examples/NAME.gtrace`.
    pub(crate) fn example(name: &str) -> Vec<TraceEvent> {
        let path = format!("{}/../examples/{name}.gtrace", env!("CARGO_MANIFEST_DIR"));
        TraceReader::open(std::path::Path::new(&path))
            .expect("a readable example")
            .events()
            .collect()
    }

    /// Holding the unmapping back changes when it is done, never what is
    /// decided: peaks, every driver call and the out-of-memory errors are
    /// those of doing it at once, on recorded traces (stitches torn down,
    /// moved pages, several streams) and on the synthetic loops.
    #[test]
    fn holding_unmapping_back_decides_the_same() {
        let traces = [
            ("detector", example("detector-multiscale")),
            ("four streams", example("four-streams")),
            ("churn_wide", churn_wide(3, 6_000)),
            ("multiscale", multiscale(5, 30)),
        ];
        for conf in ["", "expandable_handle_mb:2,defragment_budget:1"] {
            let config = Config::parse(conf).unwrap();
            let mut off = config.clone();
            off.unmap_thread = false;
            for (name, evs) in &traces {
                let now = replay(evs.iter().copied(), 140 << 30, &config);
                let held = replay_deferring(evs.iter().copied(), 140 << 30, &config);
                assert_eq!(now, held, "{name} under `{conf}`");
                if *name == "detector" {
                    assert!(
                        now.helper.total_calls() > 100,
                        "work was left to the thread"
                    );
                }
                let mut without = replay_deferring(evs.iter().copied(), 140 << 30, &off);
                // Only what is left to the thread differs.
                assert!(
                    without.helper.total_calls() == 0
                        && without.devices.iter().all(|d| d.helper.total_calls() == 0)
                );
                without.helper = now.helper;
                for (d, n) in without.devices.iter_mut().zip(&now.devices) {
                    d.helper = n.helper;
                }
                assert_eq!(now, without, "{name} under `{conf}` without the thread");
            }
        }
    }
}
