//! A synthetic training run on the simulated device, traced: the input of
//! benchmarks and demonstrations. Each step opens `forward` (activations of
//! a size that varies per step, as multi-scale training does), `backward`
//! (activations freed in reverse, gradients allocated and freed) and
//! `optimizer`, which keeps one 4 KiB tensor per step forever (a leak);
//! every tenth step is marked.

use std::path::Path;

use gpualloc::trace::{TraceOptions, TraceSummary};
use gpualloc::workload::Rng;
use gpualloc::{Allocator, Config, SimBackend};

use crate::input::CliError;

/// Writes about `events` events to `out`.
pub fn generate(out: &Path, events: u64, seed: u64) -> Result<TraceSummary, CliError> {
    let a = Allocator::new(
        Config::default(),
        1,
        Box::new(|_| Ok(SimBackend::new(80 << 30).with_wall_clock())),
    );
    let werr = |e: std::io::Error| CliError(format!("{}: cannot write: {e}", out.display()));
    a.trace_start_with(
        out,
        TraceOptions {
            lossless: true,
            ..TraceOptions::default()
        },
    )
    .map_err(werr)?;
    let mut rng = Rng::xorshift64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut kept = Vec::new();
    let per_step_events = 3 * (64 + 64 + 8) + 10;
    let steps = events.div_ceil(per_step_events);
    let fail = |e: gpualloc::AllocError| {
        CliError(format!("generate: the simulated allocator failed: {e}"))
    };
    for step in 0..steps {
        let scale = 1 + rng.below(8);
        a.phase_push("forward").map_err(werr)?;
        let mut acts = Vec::with_capacity(64);
        for layer in 0..64u64 {
            let size = (1 + rng.below(4)) * scale * (64 << 10) * (1 + layer % 7) + rng.below(4096);
            acts.push(a.malloc(0, size, 0).map_err(fail)?);
        }
        a.phase_pop();
        a.phase_push("backward").map_err(werr)?;
        for p in acts.into_iter().rev() {
            let g = a.malloc(0, 1 + rng.below(2 << 20), 0).map_err(fail)?;
            a.free(0, p).map_err(fail)?;
            a.free(0, g).map_err(fail)?;
        }
        a.phase_pop();
        a.phase_push("optimizer").map_err(werr)?;
        for _ in 0..8 {
            let p = a.malloc(0, 512 + rng.below(16 << 10), 0).map_err(fail)?;
            a.free(0, p).map_err(fail)?;
        }
        if kept.len() < 100_000 {
            kept.push(a.malloc(0, 4096, 0).map_err(fail)?);
        }
        a.phase_pop();
        if step % 10 == 9 {
            a.mark("step").map_err(werr)?;
        }
    }
    a.trace_stop().map_err(werr)
}
