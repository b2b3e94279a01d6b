//! Fixed-shape training loops: every step makes the same requests in the
//! same order, as image classification at one resolution or language
//! models on packed sequences of one length do. An allocator should reach
//! a layout that serves every later step without a memory call; one whose
//! moves reproduce their own cause keeps moving pages at every step (a
//! limit cycle: the fifty-third study of `docs/policy-experiments.md`).

use super::{Builder, mix, unit};
use crate::trace::TraceEvent;

/// A fixed-shape training loop drawn from `seed`, `steps` steps long: 10
/// to 129 layers on a scale of 0.1, 1, 10 or 50 MB, each with weights
/// (1% to 2x the scale, log-uniform; kept from the start), an activation
/// (5% to 10x) kept for the backward pass, a small tensor (4 B to 1 MB)
/// freed at once, and in two layers of five a workspace (512 B to 5x,
/// half of it again in the backward pass). The backward pass allocates
/// a gradient per layer, frees the activations in reverse, and the
/// optimizer step takes one temporary per weight; in half the loops the
/// optimizer's two states per weight are allocated after the first
/// backward pass (as Adam does), otherwise never. Events are 20 µs apart.
pub fn fixed_shape(seed: u64, steps: usize) -> Vec<TraceEvent> {
    let mut b = Builder {
        ns_per_event: 20_000,
        ..Builder::default()
    };
    let mut k = 0u64;
    let base = mix(seed);
    let mut draw = || {
        k += 1;
        unit(base ^ k)
    };
    let mut log_uniform = |lo: f64, hi: f64| (lo.ln() + draw() * (hi.ln() - lo.ln())).exp() as u64;
    let layers = 10 + (log_uniform(1.0, 1e9) % 120) as usize;
    let scale = [1e5, 1e6, 1e7, 5e7][(log_uniform(1.0, 1e9) % 4) as usize];
    let weights: Vec<u64> = (0..layers)
        .map(|_| log_uniform(scale * 0.01, scale * 2.0))
        .collect();
    let acts: Vec<u64> = (0..layers)
        .map(|_| log_uniform(scale * 0.05, scale * 10.0))
        .collect();
    let small: Vec<u64> = (0..layers).map(|_| log_uniform(4.0, 1e6)).collect();
    let work: Vec<u64> = (0..layers)
        .map(|_| {
            let w = log_uniform(512.0, scale * 5.0);
            if log_uniform(1.0, 1e9) % 5 < 2 { w } else { 0 }
        })
        .collect();
    let adam = log_uniform(1.0, 1e9) % 2 == 0;
    // Weights (and Adam's states below) are never freed.
    for &w in &weights {
        b.alloc(w);
    }
    for step in 0..steps {
        let mut live = Vec::with_capacity(layers);
        for l in 0..layers {
            live.push(b.alloc(acts[l]));
            let s = b.alloc(small[l]);
            if work[l] > 0 {
                let t = b.alloc(work[l]);
                b.free(t);
            }
            b.free(s);
        }
        let mut grads = Vec::with_capacity(layers);
        for l in (0..layers).rev() {
            grads.push(b.alloc(weights[l]));
            if work[l] > 0 {
                let t = b.alloc(work[l] / 2 + 512);
                b.free(t);
            }
            b.free(live[l]);
        }
        if step == 0 && adam {
            for &w in &weights {
                b.alloc(w);
                b.alloc(w);
            }
        }
        for &w in &weights {
            let t = b.alloc(w);
            b.free(t);
        }
        for g in grads {
            b.free(g);
        }
    }
    b.events
}

#[cfg(test)]
mod tests {
    use super::fixed_shape;
    use crate::trace::Action;

    #[test]
    fn every_step_requests_the_same_sizes() {
        for seed in 1..6 {
            let one = fixed_shape(seed, 1);
            let three = fixed_shape(seed, 3);
            let sizes = |evs: &[crate::trace::TraceEvent]| -> Vec<u64> {
                evs.iter()
                    .filter(|e| e.action == Action::Alloc)
                    .map(|e| e.size)
                    .collect()
            };
            let (a, b) = (sizes(&one), sizes(&three));
            let per_step = (b.len() - a.len()) / 2;
            assert!(per_step > 0, "seed {seed}: steps allocate");
            // Steps 2 and 3 repeat step 2's requests exactly.
            let step2 = &b[a.len()..a.len() + per_step];
            let step3 = &b[a.len() + per_step..];
            assert_eq!(step2, step3, "seed {seed}");
            assert_eq!(fixed_shape(seed, 3), three, "seed {seed}: deterministic");
        }
    }
}
