//! The `diff` command: two traces' peaks and fragmentation side by side.
//!
//! `--json` prints one object with stable field names: `a` and `b` (each
//! `file`, `events`, `dropped` (events the recorder could not write; the
//! text says so on stderr), `duration_ns`, `config`) and `devices`, each with
//! `device` and the figures of `a` and `b` (null where that trace has no
//! such device): `peak_allocated`, `peak_reserved`, `peak_active`,
//! `allocated_at_end` (bytes), `reserved_unallocated_at_peak`,
//! `external_fragmentation_at_peak` (0 to 1), `reserved_per_allocated` and
//! `ooms`.

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
            "peak_reserved": d.peak_reserved.value,
            "peak_active": d.peak_active.value,
            "allocated_at_end": d.state.g.allocated,
            "reserved_unallocated_at_peak": unallocated_at_peak(d),
            "external_fragmentation_at_peak": d.at_peak.as_ref().map_or(0.0, |p| p.frag.external),
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

/// Share of reserved memory not allocated when reserved peaked.
fn unallocated_at_peak(d: &DeviceAnalysis) -> f64 {
    crate::analyses::state::unallocated(d.allocated_at_peak_reserved, d.peak_reserved.value)
}

/// Peak reserved over peak allocated.
fn ratio(d: &DeviceAnalysis) -> f64 {
    d.peak_reserved.value as f64 / d.peak_allocated.value.max(1) as f64
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
        let mut bytes_row = |name: &str, f: &dyn Fn(&DeviceAnalysis) -> u64| {
            let (vx, vy) = (x.map_or(0, f), y.map_or(0, f));
            let _ = writeln!(
                s2,
                "  {name:<30} {:>22} {:>22} {:>14}",
                bytes(vx),
                bytes(vy),
                delta(vx, vy)
            );
        };
        bytes_row("peak allocated", &|d| d.peak_allocated.value);
        bytes_row("peak reserved", &|d| d.peak_reserved.value);
        bytes_row("peak active", &|d| d.peak_active.value);
        bytes_row("allocated at the end", &|d| d.state.g.allocated);
        let mut frac_row = |name: &str, f: &dyn Fn(&DeviceAnalysis) -> f64| {
            let (vx, vy) = (x.map_or(0.0, f), y.map_or(0.0, f));
            let _ = writeln!(
                s2,
                "  {name:<30} {:>22} {:>22} {:>+13.1}pt",
                percent(vx),
                percent(vy),
                (vy - vx) * 100.0
            );
        };
        frac_row("reserved unallocated at peak", &unallocated_at_peak);
        frac_row("external frag. at peak alloc", &|d| {
            d.at_peak.as_ref().map_or(0.0, |p| p.frag.external)
        });
        let _ = writeln!(
            s2,
            "  {:<30} {:>22.3} {:>22.3} {:>+14.3}",
            "peak reserved / peak allocated",
            x.map_or(0.0, ratio),
            y.map_or(0.0, ratio),
            y.map_or(0.0, ratio) - x.map_or(0.0, ratio)
        );
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
