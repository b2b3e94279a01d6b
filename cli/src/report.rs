//! The `report` command: one self-contained HTML page (inline CSS and SVG,
//! no scripts, nothing fetched) per trace.

use std::fmt::Write;
use std::path::Path;

use crate::analysis::{Analysis, DeviceAnalysis};
use crate::leaks;
use crate::svg::{self, Series, esc};
use crate::units::{bytes, duration, percent};

const CSS: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:24px auto;max-width:960px;color:#222}\
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px}\
table{border-collapse:collapse;margin:8px 0}td,th{padding:2px 10px;text-align:right;border-bottom:1px solid #eee}\
td:first-child,th:first-child{text-align:left}.chart{width:100%;height:auto}.tick{font:11px sans-serif;fill:#444}\
.warn{background:#fff4e0;padding:6px 10px;border-left:4px solid #f28e2c}.note{color:#666}";

/// Renders the page.
pub fn render(a: &Analysis, path: &Path) -> String {
    let mut s = String::new();
    let title = format!(
        "gpualloc report: {}",
        path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned()
        )
    );
    let _ = write!(
        s,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{CSS}</style></head><body>",
        esc(&title)
    );
    let _ = write!(s, "<h1>{}</h1>", esc(&title));
    let h = &a.info.header;
    s.push_str("<table>");
    row(&mut s, "events", &a.info.events.to_string());
    row(&mut s, "duration", &duration(a.duration_ns));
    row(
        &mut s,
        "recorded by",
        &format!("{} (pid {})", h.producer, h.pid),
    );
    row(
        &mut s,
        "configuration",
        if h.config.is_empty() {
            "(defaults)"
        } else {
            &h.config
        },
    );
    row(
        &mut s,
        "devices",
        &format!(
            "{} in the process, {} with events",
            h.device_count,
            a.devices.len()
        ),
    );
    row(
        &mut s,
        "file",
        &format!(
            "{}, {:.1} bytes per event",
            bytes(a.info.file_bytes),
            a.info.file_bytes as f64 / a.info.events.max(1) as f64
        ),
    );
    s.push_str("</table>");
    if a.info.dropped > 0 {
        let _ = write!(
            s,
            "<p class=\"warn\">{} events were recorded but could not be written (the writer fell behind); the figures miss them.</p>",
            a.info.dropped
        );
    }
    if let Some(w) = &a.info.warning {
        let _ = write!(s, "<p class=\"warn\">{}</p>", esc(w));
    }
    for d in a.devices.values() {
        device(&mut s, a, d);
    }
    s.push_str("</body></html>\n");
    s
}

fn row(s: &mut String, k: &str, v: &str) {
    let _ = write!(s, "<tr><td>{}</td><td>{}</td></tr>", esc(k), esc(v));
}

fn device(s: &mut String, a: &Analysis, d: &DeviceAnalysis) {
    let _ = write!(s, "<h2>Device {}</h2><table>", d.device);
    row(
        s,
        "peak allocated",
        &format!(
            "{} at {}",
            bytes(d.peak_allocated.value),
            duration(d.peak_allocated.time_ns)
        ),
    );
    row(
        s,
        "peak reserved",
        &format!(
            "{} at {}",
            bytes(d.peak_reserved.value),
            duration(d.peak_reserved.time_ns)
        ),
    );
    row(
        s,
        "peak active",
        &format!(
            "{} at {}",
            bytes(d.peak_active.value),
            duration(d.peak_active.time_ns)
        ),
    );
    row(
        s,
        "peak reserved / peak allocated",
        &format!(
            "{:.3}",
            d.peak_reserved.value as f64 / d.peak_allocated.value.max(1) as f64
        ),
    );
    if let Some(p) = &d.at_peak {
        row(
            s,
            "external fragmentation at peak allocated",
            &format!(
                "{} (largest free {} of {} free)",
                percent(p.frag.external),
                bytes(p.frag.largest_free),
                bytes(p.frag.total_free)
            ),
        );
    }
    row(s, "allocations", &d.allocs.to_string());
    row(s, "OOMs", &d.oom_count.to_string());
    s.push_str("</table>");
    timeline(s, d);
    fragmentation(s, d);
    phases(s, a, d);
    sizes(s, d);
    at_peak(s, a, d);
    leak_table(s, a, d);
    ooms(s, a, d);
}

fn secs(ns: f64) -> String {
    duration(ns as u64)
}

fn timeline(s: &mut String, d: &DeviceAnalysis) {
    let pts = d.timeline.points();
    let series = |name, color, f: fn(&crate::timeline::Point) -> u64| Series {
        name,
        color,
        points: pts.iter().map(|p| (p.t_ns as f64, f(p) as f64)).collect(),
    };
    s.push_str("<h3>Allocated, reserved and active over time</h3>");
    s.push_str(&svg::lines(
        "memory over time",
        &[
            series("reserved", "#e15759", |p| p.reserved),
            series("active", "#f28e2c", |p| p.active),
            series("allocated", "#4e79a7", |p| p.allocated),
        ],
        &secs,
        &|y| bytes(y as u64),
    ));
    s.push_str("<p class=\"note\">Each point is the highest value within its time bucket.</p>");
}

fn fragmentation(s: &mut String, d: &DeviceAnalysis) {
    if d.frag.is_empty() {
        return;
    }
    s.push_str("<h3>Fragmentation over time</h3>");
    let pts = |f: fn(&crate::analysis::Frag) -> f64| {
        d.frag.iter().map(|x| (x.t_ns as f64, f(x))).collect()
    };
    s.push_str(&svg::lines(
        "fragmentation over time",
        &[
            Series {
                name: "1 - largest free / total free",
                color: "#af7aa1",
                points: pts(|f| f.external),
            },
            Series {
                name: "1 - allocated / reserved",
                color: "#59a14f",
                points: pts(|f| f.unallocated),
            },
        ],
        &secs,
        &|y| percent(y),
    ));
}

fn phases(s: &mut String, a: &Analysis, d: &DeviceAnalysis) {
    if d.phases.by_id.is_empty() {
        return;
    }
    let mut ph: Vec<_> = d.phases.by_id.iter().collect();
    ph.sort_by_key(|x| std::cmp::Reverse(x.1.peak_allocated));
    s.push_str("<h3>Per-phase peaks</h3>");
    let items: Vec<(String, f64, u64)> = ph
        .iter()
        .take(20)
        .map(|(id, p)| (a.info.name(**id), p.peak_allocated as f64, **id))
        .collect();
    s.push_str(&svg::bars("peak allocated per phase", &items, &|v| {
        bytes(v as u64)
    }));
    s.push_str("<table><tr><th>phase</th><th>count</th><th>peak allocated</th><th>peak reserved</th><th>peak growth</th><th>allocations</th><th>time</th></tr>");
    for (id, p) in ph.iter().take(50) {
        let _ = write!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&a.info.name(**id)),
            p.count,
            bytes(p.peak_allocated),
            bytes(p.peak_reserved),
            bytes(p.peak_growth),
            p.allocs,
            duration(p.time_ns)
        );
    }
    s.push_str("</table>");
}

fn sizes(s: &mut String, d: &DeviceAnalysis) {
    s.push_str("<h3>Request sizes</h3>");
    let items: Vec<(String, f64, u64)> = (0..64)
        .filter(|&k| d.sizes.hist[k] > 0)
        .map(|k| {
            (
                format!(
                    "{} - {}",
                    bytes(1 << k),
                    bytes((1u64 << k).saturating_mul(2))
                ),
                d.sizes.hist[k] as f64,
                0,
            )
        })
        .collect();
    s.push_str(&svg::bars("allocations per size bucket", &items, &|v| {
        format!("{v:.0}")
    }));
    let list = |v: Vec<(u64, u64)>| {
        v.iter()
            .map(|(sz, c)| format!("{sz} B ({}) &times;{c}", bytes(*sz)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = write!(
        s,
        "<p>Most frequent: {}</p><p>Largest: {}</p>",
        list(d.sizes.most_frequent(10)),
        list(d.sizes.largest())
    );
}

fn at_peak(s: &mut String, a: &Analysis, d: &DeviceAnalysis) {
    let Some(p) = &d.at_peak else { return };
    let _ = write!(
        s,
        "<h3>Live blocks at the peak ({} allocated, {} reserved)</h3>",
        bytes(d.peak_allocated.value),
        bytes(p.reserved)
    );
    let mut regions: Vec<(u64, Vec<svg::MapBlock>)> = Vec::new();
    let mut i = 0;
    let bounds: Vec<(u64, u64)> = regions_at_peak(p);
    for (start, size) in bounds.iter().take(300) {
        while i < p.live.len() && p.live[i].0 < *start {
            i += 1;
        }
        let mut blocks = Vec::new();
        while i < p.live.len() && p.live[i].0 < start + size {
            let (addr, l) = p.live[i];
            let tip = format!(
                "{:#x}: {} ({} requested) on stream {:#x} in {}, allocated at {}",
                addr,
                bytes(l.size),
                bytes(l.requested),
                l.stream,
                a.info.name(l.phase),
                duration(l.time_ns)
            );
            blocks.push((addr - start, l.size, l.phase, tip));
            i += 1;
        }
        regions.push((*size, blocks));
    }
    s.push_str(&svg::memory_map(
        "reserved memory at the peak, blocks coloured by phase",
        &regions,
    ));
    let mut big: Vec<_> = p.live.iter().filter(|(_, l)| !l.pending).collect();
    big.sort_by_key(|x| std::cmp::Reverse(x.1.size));
    s.push_str("<table><tr><th>address</th><th>size</th><th>requested</th><th>phase</th><th>allocated at</th></tr>");
    for (addr, l) in big.iter().take(20) {
        let _ = write!(
            s,
            "<tr><td>{addr:#x}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            bytes(l.size),
            bytes(l.requested),
            esc(&a.info.name(l.phase)),
            duration(l.time_ns)
        );
    }
    s.push_str("</table>");
}

/// Reserved ranges at the peak are not kept; blocks are drawn within the
/// spans they cover, split where they are more than 2 MiB apart.
fn regions_at_peak(p: &crate::analysis::AtPeak) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (addr, l) in &p.live {
        match out.last_mut() {
            Some((s, len)) if *addr <= *s + *len + (2 << 20) => {
                *len = (*len).max(addr + l.size - *s)
            }
            _ => out.push((*addr, l.size)),
        }
    }
    out
}

fn leak_table(s: &mut String, a: &Analysis, d: &DeviceAnalysis) {
    let gs = leaks::groups(d, a.duration_ns);
    let _ = write!(
        s,
        "<h3>Leak candidates</h3><p>{} allocations alive at the end; {} iteration(s) (between marks, or openings of the most frequent top-level phase; the stretch before the first counts as one).</p>",
        gs.iter().map(|g| g.count).sum::<u64>(),
        leaks::iterations(d)
    );
    if gs.is_empty() {
        return;
    }
    s.push_str("<table><tr><th>size</th><th>phase</th><th>alive</th><th>bytes</th><th>iterations with survivors</th><th>per iteration</th><th>candidate</th></tr>");
    for g in gs.iter().take(25) {
        let _ = write!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>+{:.2}</td><td>{}</td></tr>",
            bytes(g.size),
            esc(&a.info.name(g.phase)),
            g.count,
            bytes(g.bytes),
            g.epochs,
            g.span,
            g.per_epoch,
            if g.candidate { "yes" } else { "" }
        );
    }
    s.push_str("</table>");
}

fn ooms(s: &mut String, a: &Analysis, d: &DeviceAnalysis) {
    let _ = write!(
        s,
        "<h3>Out-of-memory forensics</h3><p>{} failed allocation(s).</p>",
        d.oom_count
    );
    for o in &d.ooms {
        let _ = write!(
            s,
            "<p><b>At {}</b> in phase <b>{}</b>: requested {} on stream {:#x}; the device had {} free; the largest free block in reserved memory was {} of {} free (allocated {}, reserved {}).</p>",
            duration(o.time_ns),
            esc(&a.info.name(o.phase)),
            bytes(o.requested),
            o.stream,
            bytes(o.device_free),
            bytes(o.largest_free),
            bytes(o.cached_free),
            bytes(o.gauges.allocated),
            bytes(o.gauges.reserved)
        );
        s.push_str("<table><tr><th>held by phase</th><th>bytes</th></tr>");
        for (ph, b) in o.by_phase.iter().take(8) {
            let _ = write!(
                s,
                "<tr><td>{}</td><td>{}</td></tr>",
                esc(&a.info.name(*ph)),
                bytes(*b)
            );
        }
        s.push_str("</table><table><tr><th>largest live block</th><th>size</th><th>requested</th><th>phase</th><th>age</th></tr>");
        for (addr, size, req, ph, age) in &o.largest_live {
            let _ = write!(
                s,
                "<tr><td>{addr:#x}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                bytes(*size),
                bytes(*req),
                esc(&a.info.name(*ph)),
                duration(*age)
            );
        }
        s.push_str("</table>");
    }
}
