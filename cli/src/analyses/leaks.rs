//! Leak candidates: allocations alive at the end, grouped by requested size
//! and phase, with how their survivors spread over the iterations. The
//! iteration boundaries are the marks, or else the openings of the most
//! frequent top-level phase; n boundaries make n + 1 iterations, the stretch
//! before the first boundary (set-up) counting as one, so a trace without
//! boundaries is one iteration. A group whose survivors were allocated in
//! most iterations since it first appeared grows per iteration: a leak
//! candidate.
//!
//! `--json` prints one object with stable field names: `file`, `dropped`
//! (events the recorder could not write, whose frees a survivor may miss;
//! the text says so on stderr) and `devices`, each with `device`, `iterations`, `alive_allocations`,
//! `alive_bytes`, `candidates`, `groups_total` and `groups` (at most
//! `--limit`), each group with the fields of [`LeakGroup`] under the names
//! `size`, `block`, `phase` (its name), `count`, `bytes`,
//! `iterations_with_survivors`, `first_iteration`, `iterations_since_first`,
//! `per_iteration`, `candidate` and `oldest_ns`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use serde_json::json;

use crate::analyses::analysis::{Analysis, DeviceAnalysis};
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
    /// First iteration with a survivor (0: the one before the first boundary).
    pub first_epoch: u32,
    /// Iterations from the first with a survivor to the last one.
    pub span: u32,
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
                bytes: count.saturating_mul(block),
                epochs: distinct,
                first_epoch: first,
                span,
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
    if a.info.events == 0 {
        let _ = writeln!(s, "{}", crate::commands::summary::NO_EVENTS);
    }
    for d in a.devices.values() {
        let gs = groups(d, a.duration_ns);
        let alive = gs.iter().fold(0u64, |a, g| a.saturating_add(g.bytes));
        let cands: Vec<&LeakGroup> = gs.iter().filter(|g| g.candidate).collect();
        let _ = writeln!(
            s,
            "device {}: {} allocations alive at the end ({}), {} iteration(s); {} leak candidate group(s)",
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
                format!("{}/{}", g.epochs, g.span),
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

/// Iterations of a device: its boundaries plus one (see the module docs).
pub fn iterations(d: &DeviceAnalysis) -> u32 {
    d.state.iterations().len() as u32 + 1
}

/// The `leaks --json` object (see the module docs for the fields).
pub fn render_json(a: &Analysis, file: &Path, limit: usize) -> String {
    let devices: Vec<serde_json::Value> = a
        .devices
        .values()
        .map(|d| {
            let gs = groups(d, a.duration_ns);
            json!({
                "device": d.device,
                "iterations": iterations(d),
                "alive_allocations": gs.iter().map(|g| g.count).sum::<u64>(),
                "alive_bytes": gs.iter().fold(0u64, |a, g| a.saturating_add(g.bytes)),
                "candidates": gs.iter().filter(|g| g.candidate).count(),
                "groups_total": gs.len(),
                "groups": gs.iter().take(limit).map(|g| json!({
                    "size": g.size,
                    "block": g.block,
                    "phase": a.info.name(g.phase),
                    "count": g.count,
                    "bytes": g.bytes,
                    "iterations_with_survivors": g.epochs,
                    "first_iteration": g.first_epoch,
                    "iterations_since_first": g.span,
                    "per_iteration": g.per_epoch,
                    "candidate": g.candidate,
                    "oldest_ns": g.oldest_ns,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let v =
        json!({"file": file.display().to_string(), "dropped": a.info.dropped, "devices": devices});
    let mut out = serde_json::to_string_pretty(&v).expect("plain values serialize");
    out.push('\n');
    out
}
