//! The `diff` command: two traces' peaks and fragmentation side by side.
//!
//! `--json` prints one object with stable field names: `a` and `b` (each
//! `file`, `events`, `dropped` (events the recorder could not write; the
//! text says so on stderr), `duration_ns`, `config`) and `devices`, each with
//! `device` and the figures of `a` and `b` (null where that trace has no
//! such device): `peak_allocated`, `peak_reserved`, `peak_active`,
//! `allocated_at_end` (bytes), `reserved_unallocated_at_peak`,
//! `external_fragmentation_at_peak` (0 to 1), `reserved_per_allocated` and
//! `ooms`. A trace without segment events (an RMM log) records no reserved
//! memory: its `peak_reserved` and the three figures drawn from it are
//! null, and the text says "not recorded"; `reserved_per_allocated` is
//! null too when nothing was allocated ("no allocations").

use std::fmt::Write;
use std::path::Path;

use serde_json::{Value, json};

use crate::analyses::analysis::{self, Analysis, DeviceAnalysis};
use crate::input::CliError;
use crate::units::{bytes, delta, duration, percent};

/// Analyses both traces and renders the comparison, as text or JSON.
pub fn run(a: &Path, b: &Path, as_json: bool, allow_truncated: bool) -> Result<String, CliError> {
    let mut x = analysis::analyze(a, allow_truncated)?;
    analysis::second_pass(a, allow_truncated, &mut x)?;
    let mut y = analysis::analyze(b, allow_truncated)?;
    analysis::second_pass(b, allow_truncated, &mut y)?;
    if as_json {
        return Ok(render_json(a, &x, b, &y));
    }
    Ok(render(a, &x, b, &y))
}

fn render_json(pa: &Path, a: &Analysis, pb: &Path, b: &Analysis) -> String {
    let trace = |p: &Path, t: &Analysis| {
        json!({
            "file": p.display().to_string(),
            "events": t.info.events,
            "dropped": t.info.dropped,
            "duration_ns": t.duration_ns,
            "config": t.info.header.config,
        })
    };
    let figures = |d: &DeviceAnalysis| {
        json!({
            "peak_allocated": d.peak_allocated.value,
            "peak_reserved": peak_reserved(d),
            "peak_active": d.peak_active.value,
            "allocated_at_end": d.state.g.allocated,
            "reserved_unallocated_at_peak": unallocated_at_peak(d),
            "external_fragmentation_at_peak": external(d),
            "reserved_per_allocated": ratio(d),
            "ooms": d.oom_count,
        })
    };
    let devices: std::collections::BTreeSet<u32> =
        a.devices.keys().chain(b.devices.keys()).copied().collect();
    let devices: Vec<Value> = devices
        .into_iter()
        .map(|d| {
            json!({
                "device": d,
                "a": a.devices.get(&d).map(figures),
                "b": b.devices.get(&d).map(figures),
            })
        })
        .collect();
    let v = json!({"a": trace(pa, a), "b": trace(pb, b), "devices": devices});
    let mut out = serde_json::to_string_pretty(&v).expect("plain values serialize");
    out.push('\n');
    out
}

/// Peak reserved bytes; `None` when the trace records no reserved memory
/// (an RMM log: no segment events), as for the figures below.
fn peak_reserved(d: &DeviceAnalysis) -> Option<u64> {
    d.state.reserves.then_some(d.peak_reserved.value)
}

/// Share of reserved memory not allocated when reserved peaked.
fn unallocated_at_peak(d: &DeviceAnalysis) -> Option<f64> {
    peak_reserved(d).map(|r| crate::analyses::state::unallocated(d.allocated_at_peak_reserved, r))
}

/// External fragmentation at the allocated peak.
fn external(d: &DeviceAnalysis) -> Option<f64> {
    peak_reserved(d).map(|_| d.at_peak.as_ref().map_or(0.0, |p| p.frag.external))
}

/// Peak reserved over peak allocated; `None` also when nothing was
/// allocated (a device that only reserved, a trace cut short).
fn ratio(d: &DeviceAnalysis) -> Option<f64> {
    peak_reserved(d)
        .filter(|_| d.peak_allocated.value > 0)
        .map(|r| r as f64 / d.peak_allocated.value as f64)
}

/// What the text prints for a figure a trace does not record.
const NOT_RECORDED: &str = "not recorded";

/// What the text prints for a figure of `d` that is `None`: not recorded,
/// or (reserved memory recorded) a ratio to nothing allocated.
fn missing(d: Option<&DeviceAnalysis>) -> &'static str {
    match d {
        Some(d) if d.state.reserves => "no allocations",
        _ => NOT_RECORDED,
    }
}

fn render(pa: &Path, a: &Analysis, pb: &Path, b: &Analysis) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<32} {:>22} {:>22} {:>14}",
        "",
        short(pa),
        short(pb),
        "change"
    );
    let mut row = |name: &str, x: String, y: String, d: String| {
        let _ = writeln!(s, "{name:<32} {x:>22} {y:>22} {d:>14}");
    };
    row(
        "events",
        a.info.events.to_string(),
        b.info.events.to_string(),
        String::new(),
    );
    row(
        "duration",
        duration(a.duration_ns),
        duration(b.duration_ns),
        String::new(),
    );
    row(
        "config",
        a.info.header.config.clone(),
        b.info.header.config.clone(),
        String::new(),
    );
    let devices: std::collections::BTreeSet<u32> =
        a.devices.keys().chain(b.devices.keys()).copied().collect();
    for d in devices {
        let (x, y) = (a.devices.get(&d), b.devices.get(&d));
        let _ = writeln!(s, "device {d}");
        let mut s2 = String::new();
        // A figure of each trace, `None` where it is not recorded (or the
        // trace has no such device: 0, as before).
        let pair = |f: &dyn Fn(&DeviceAnalysis) -> Option<u64>| {
            (x.map_or(Some(0), f), y.map_or(Some(0), f))
        };
        let show = |v: Option<u64>| v.map_or(NOT_RECORDED.into(), bytes);
        let mut bytes_row = |name: &str, f: &dyn Fn(&DeviceAnalysis) -> Option<u64>| {
            let (vx, vy) = pair(f);
            let change = match (vx, vy) {
                (Some(a), Some(b)) => delta(a, b),
                _ => String::new(),
            };
            let _ = writeln!(
                s2,
                "  {name:<30} {:>22} {:>22} {change:>14}",
                show(vx),
                show(vy),
            );
        };
        bytes_row("peak allocated", &|d| Some(d.peak_allocated.value));
        bytes_row("peak reserved", &peak_reserved);
        bytes_row("peak active", &|d| Some(d.peak_active.value));
        bytes_row("allocated at the end", &|d| Some(d.state.g.allocated));
        let fpair = |f: &dyn Fn(&DeviceAnalysis) -> Option<f64>| {
            (x.map_or(Some(0.0), f), y.map_or(Some(0.0), f))
        };
        let mut frac_row = |name: &str, (vx, vy): (Option<f64>, Option<f64>), pct: bool| {
            let show = |v: Option<f64>, d: Option<&DeviceAnalysis>| match v {
                None => missing(d).to_string(),
                Some(v) if pct => percent(v),
                Some(v) => format!("{v:.3}"),
            };
            let change = match (vx, vy) {
                (Some(a), Some(b)) if pct => format!("{:>+13.1}pt", (b - a) * 100.0),
                (Some(a), Some(b)) => format!("{:>+14.3}", b - a),
                _ => String::new(),
            };
            let _ = writeln!(
                s2,
                "  {name:<30} {:>22} {:>22} {change:>14}",
                show(vx, x),
                show(vy, y)
            );
        };
        frac_row(
            "reserved unallocated at peak",
            fpair(&unallocated_at_peak),
            true,
        );
        frac_row("external frag. at peak alloc", fpair(&external), true);
        frac_row("peak reserved / peak allocated", fpair(&ratio), false);
        let _ = writeln!(
            s2,
            "  {:<30} {:>22} {:>22}",
            "OOMs",
            x.map_or(0, |d| d.oom_count),
            y.map_or(0, |d| d.oom_count)
        );
        s.push_str(&s2);
    }
    for (p, t) in [(pa, a), (pb, b)] {
        if t.info.events == 0 {
            let _ = writeln!(s, "{}: {}", short(p), crate::commands::summary::NO_EVENTS);
        }
    }
    s
}

fn short(p: &Path) -> String {
    let name = p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let n = name.chars().count();
    if n > 22 {
        format!("...{}", name.chars().skip(n - 19).collect::<String>())
    } else {
        name
    }
}
