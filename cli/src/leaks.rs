//! Leak candidates: allocations alive at the end, grouped by requested size
//! and phase, with how their survivors spread over the iterations (between
//! marks, or else between openings of the most frequent top-level phase).
//! A group whose survivors were allocated in most iterations since it first
//! appeared grows per iteration: a leak candidate.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::analysis::{Analysis, DeviceAnalysis};
use crate::units;

/// Allocations alive at the end that share a size and a phase.
#[derive(Clone, Debug, PartialEq)]
pub struct LeakGroup {
    /// Requested bytes of each.
    pub size: u64,
    /// Block bytes of each.
    pub block: u64,
    /// Phase that allocated them (string id or `NO_PHASE`).
    pub phase: u64,
    /// How many are alive.
    pub count: u64,
    /// Block bytes alive.
    pub bytes: u64,
    /// Distinct iterations that left survivors.
    pub epochs: u32,
    /// First iteration with a survivor.
    pub first_epoch: u32,
    /// Survivors per iteration since the first.
    pub per_epoch: f64,
    /// Whether the group grows steadily with the iterations.
    pub candidate: bool,
    /// Age of the oldest survivor at the end (ns).
    pub oldest_ns: u64,
}

/// The groups of one device, candidates first, then by bytes.
pub fn groups(d: &DeviceAnalysis, end_ns: u64) -> Vec<LeakGroup> {
    // (requested, block, phase) -> (count, survivors per epoch, oldest time)
    type Group = (u64, BTreeMap<u32, u64>, u64);
    let mut by: BTreeMap<(u64, u64, u64), Group> = BTreeMap::new();
    let bounds = d.state.iterations();
    for l in d.state.live.values().filter(|l| !l.pending) {
        let g = by
            .entry((l.requested, l.size, l.phase))
            .or_insert((0, BTreeMap::new(), u64::MAX));
        g.0 += 1;
        let epoch = bounds.partition_point(|&t| t <= l.time_ns) as u32;
        *g.1.entry(epoch).or_default() += 1;
        g.2 = g.2.min(l.time_ns);
    }
    let total = bounds.len() as u32;
    let mut out: Vec<LeakGroup> = by
        .into_iter()
        .map(|((size, block, phase), (count, epochs, oldest))| {
            let first = *epochs.keys().next().expect("non-empty");
            let span = total.saturating_sub(first) + 1;
            let distinct = epochs.len() as u32;
            LeakGroup {
                size,
                block,
                phase,
                count,
                bytes: count * block,
                epochs: distinct,
                first_epoch: first,
                per_epoch: count as f64 / f64::from(span),
                candidate: total >= 3 && distinct >= 3 && distinct * 2 >= span,
                oldest_ns: end_ns.saturating_sub(oldest),
            }
        })
        .collect();
    out.sort_by(|a, b| b.candidate.cmp(&a.candidate).then(b.bytes.cmp(&a.bytes)));
    out
}

/// The `leaks` command's text.
pub fn render(a: &Analysis, limit: usize) -> String {
    let mut s = String::new();
    for d in a.devices.values() {
        let gs = groups(d, a.duration_ns);
        let alive: u64 = gs.iter().map(|g| g.bytes).sum();
        let cands: Vec<&LeakGroup> = gs.iter().filter(|g| g.candidate).collect();
        let _ = writeln!(
            s,
            "device {}: {} allocations alive at the end ({}), {} iterations; {} leak candidate group(s)",
            d.device,
            gs.iter().map(|g| g.count).sum::<u64>(),
            units::bytes(alive),
            iterations(d),
            cands.len()
        );
        if gs.is_empty() {
            continue;
        }
        let _ = writeln!(
            s,
            "  {:>8} {:>12} {:>12} {:<20} {:>10} {:>14} {:>10}  leak?",
            "count", "size", "bytes", "phase", "iters", "per iteration", "oldest"
        );
        for g in gs.iter().take(limit) {
            let _ = writeln!(
                s,
                "  {:>8} {:>12} {:>12} {:<20} {:>10} {:>14} {:>10}  {}",
                g.count,
                units::bytes(g.size),
                units::bytes(g.bytes),
                a.info.name(g.phase),
                format!(
                    "{}/{}",
                    g.epochs,
                    iterations(d).saturating_sub(g.first_epoch) + 1
                ),
                format!("+{:.2}", g.per_epoch),
                units::duration(g.oldest_ns),
                if g.candidate { "yes" } else { "" }
            );
        }
        if gs.len() > limit {
            let _ = writeln!(s, "  ... {} more groups", gs.len() - limit);
        }
    }
    s
}

/// Iterations of a device (see the module docs).
pub fn iterations(d: &DeviceAnalysis) -> u32 {
    d.state.iterations().len() as u32
}
