//! The `report` command: one self-contained HTML page per trace. Nothing is
//! fetched: the style sheet, the script (`report.js`) and the data it draws
//! (`data`) are inline.
//!
//! The tables (phases, leaks, OOM forensics, sizes) are plain HTML written
//! here and in `sections`, readable without the script; the charts
//! are drawn by the script from the aggregated data in a
//! `<script type="application/json">` element. Opening the page with
//! `#selftest` makes the script zoom, hover and click through its charts
//! and write the outcome into `#selftest-result` (see `tests/browser/`).

pub(crate) mod data;
pub(crate) mod oom;
pub(crate) mod sections;
pub(crate) mod series;
pub(crate) mod svg;

use std::fmt::Write;
use std::path::Path;

use crate::analyses::analysis::{Analysis, DeviceAnalysis};
use crate::analyses::ranks::Rank;
use crate::commands::report::sections as sec;
use crate::commands::report::svg::esc;
use crate::input::CliError;
use crate::units::{bytes, duration, percent};

const CSS: &str = include_str!("report.css");
const JS: &str = include_str!("report.js");

/// Renders the page; reads `path` again for the chart data and, when the
/// trace holds OOMs, replays it under candidate configurations.
pub fn render(a: &mut Analysis, path: &Path, allow_truncated: bool) -> Result<String, CliError> {
    let mut body = String::new();
    let data = trace(&mut body, a, path, allow_truncated, "")?;
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok(page(
        &format!("gpualloc report: {name}"),
        &body,
        &[("", data)],
    ))
}

/// The page of several traces, one per rank: the ranks table, then each
/// rank's report in a section of its own (ids prefixed `r{i}-`).
pub fn render_ranks(ranks: Vec<Rank>, allow_truncated: bool) -> Result<String, CliError> {
    let mut body = String::new();
    body.push_str("<section class=\"ranks\"><h2>Ranks</h2><table><tr>");
    for c in crate::analyses::ranks::COLUMNS {
        let _ = write!(body, "<th>{}</th>", esc(c));
    }
    body.push_str("</tr>");
    for (i, row) in crate::analyses::ranks::rows(&ranks).iter().enumerate() {
        let _ = write!(body, "<tr><td><a href=\"#r{i}-\">{}</a></td>", esc(&row[0]));
        for c in &row[1..] {
            let _ = write!(body, "<td>{}</td>", esc(c));
        }
        body.push_str("</tr>");
    }
    body.push_str("</table><ul>");
    for h in crate::analyses::ranks::highlights(&ranks) {
        let _ = write!(body, "<li>{}</li>", esc(&h));
    }
    body.push_str("</ul></section>");
    let n = ranks.len();
    let parts = crate::analyses::ranks::par_map(ranks, |i, mut r| {
        let prefix = format!("r{i}-");
        let mut s = String::new();
        let _ = write!(
            s,
            "<section class=\"rank\" id=\"{prefix}\"><h2>Rank {} <span class=\"note\">{}</span></h2>",
            esc(&r.label),
            esc(&r.path.display().to_string())
        );
        let data = trace(&mut s, &mut r.a, &r.path, allow_truncated, &prefix)?;
        s.push_str("</section>");
        Ok((s, (prefix, data)))
    })?;
    let mut datas = Vec::with_capacity(n);
    for (section, data) in parts {
        body.push_str(&section);
        datas.push(data);
    }
    Ok(page(&format!("gpualloc report: {n} ranks"), &body, &datas))
}

/// Writes one trace's tables into `s` (element ids prefixed with
/// `prefix`); returns the data its charts are drawn from.
fn trace(
    s: &mut String,
    a: &mut Analysis,
    path: &Path,
    allow_truncated: bool,
    prefix: &str,
) -> Result<serde_json::Value, CliError> {
    let data = crate::commands::report::data::collect(path, allow_truncated, a)?;
    let recorded = a.info.header.config.clone();
    for d in a.devices.values_mut() {
        crate::commands::report::oom::apply_limit(&mut d.ooms, &recorded);
    }
    let a = &*a;
    header(s, a);
    for d in a.devices.values() {
        device(s, a, d, path, prefix)?;
    }
    Ok(data)
}

/// The HTML page around `body`, with each trace's chart data (and the
/// prefix of its elements' ids) inline.
fn page<P: AsRef<str>>(title: &str, body: &str, datas: &[(P, serde_json::Value)]) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\"><title>{}</title>\
         <style>{CSS}</style></head><body><h1>{}</h1>",
        esc(title),
        esc(title)
    );
    s.push_str("<noscript><p class=\"warn\">The charts need JavaScript; the tables below do not.</p></noscript>");
    s.push_str("<div id=\"js-errors\" hidden></div>");
    s.push_str(body);
    s.push_str("<pre id=\"selftest-result\" hidden></pre>");
    for (i, (prefix, data)) in datas.iter().enumerate() {
        // `</` cannot end the JSON early once written as `<\/` (same string).
        let json = data.to_string().replace("</", "<\\/");
        // The first keeps the id scripts and tests have always read.
        let id = if i == 0 { " id=\"gpualloc-data\"" } else { "" };
        let _ = write!(
            s,
            "<script type=\"application/json\" class=\"gpualloc-data\" data-prefix=\"{}\"{id}>{json}</script>",
            esc(prefix.as_ref())
        );
    }
    let _ = writeln!(s, "<script>{JS}</script></body></html>");
    s
}

fn header(s: &mut String, a: &Analysis) {
    let h = &a.info.header;
    s.push_str("<table class=\"kv\">");
    sec::row(s, "events", &a.info.events.to_string());
    sec::row(s, "duration", &duration(a.duration_ns));
    sec::row(s, "recorded by", &format!("{} (pid {})", h.producer, h.pid));
    let config = if h.config.is_empty() {
        "(defaults)"
    } else {
        &h.config
    };
    sec::row(s, "configuration", config);
    sec::row(
        s,
        "devices",
        &format!(
            "{} in the process, {} with events",
            h.device_count,
            a.devices.len()
        ),
    );
    // Without events there is no size per event (the header is not one).
    let file = match a.info.events {
        0 => bytes(a.info.file_bytes),
        n => format!(
            "{}, {:.1} bytes per event",
            bytes(a.info.file_bytes),
            a.info.file_bytes as f64 / n as f64
        ),
    };
    sec::row(s, "file", &file);
    s.push_str("</table>");
    if a.info.events == 0 {
        let _ = write!(
            s,
            "<p class=\"warn\">{}.</p>",
            esc(crate::commands::summary::NO_EVENTS)
        );
    }
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
}

fn device(
    s: &mut String,
    a: &Analysis,
    d: &DeviceAnalysis,
    path: &Path,
    p: &str,
) -> Result<(), CliError> {
    let _ = write!(
        s,
        "<section class=\"device\" data-device=\"{0}\"><h2>Device {0}</h2>",
        d.device
    );
    // A trace without reserved memory (an RMM log) records no capacity:
    // replaying on a device of 0 B would advise nothing true.
    let advice = match d.ooms.first() {
        Some(first) if d.state.reserves && oom::capacity(first) > 0 => {
            Some(oom::advise(path, &a.info.header.config, d.device, first)?)
        }
        _ => None,
    };
    sec::findings(s, a, d, advice.as_ref());
    figures(s, d);
    let _ = write!(
        s,
        "<h3>Memory over time</h3>\
         <div class=\"chart-box\" id=\"{p}timeline-{0}\" data-device=\"{0}\"></div>\
         <h3>Fragmentation over time</h3>\
         <div class=\"chart-box\" id=\"{p}frag-{0}\" data-device=\"{0}\"></div>\
         <h3>Memory at a moment</h3>\
         <div class=\"layout-box\" id=\"{p}layout-{0}\" data-device=\"{0}\">\
         <p class=\"note\">Click the memory chart to see the segments and live blocks at that moment.</p></div>\
         <h3>Per-step peaks</h3>\
         <div class=\"chart-box\" id=\"{p}steps-{0}\" data-device=\"{0}\"></div>",
        d.device
    );
    sec::phases(s, a, d);
    sec::leaks(s, a, d);
    sec::ooms(s, a, d, advice.as_ref());
    sec::sizes(s, d);
    s.push_str("</section>");
    Ok(())
}

fn figures(s: &mut String, d: &DeviceAnalysis) {
    s.push_str("<table class=\"kv\">");
    let at = |p: &crate::analyses::analysis::Peak| {
        format!("{} at {}", bytes(p.value), duration(p.time_ns))
    };
    sec::row(s, "peak allocated", &at(&d.peak_allocated));
    if d.state.reserves {
        sec::row(s, "peak reserved", &at(&d.peak_reserved));
    } else {
        sec::row(s, "peak reserved", sec::NOT_RECORDED);
    }
    sec::row(s, "peak active", &at(&d.peak_active));
    // As the summary: no ratio to nothing allocated.
    if d.state.reserves && d.peak_allocated.value > 0 {
        sec::row(
            s,
            "peak reserved / peak allocated",
            &format!(
                "{:.3}",
                d.peak_reserved.value as f64 / d.peak_allocated.value as f64
            ),
        );
    }
    if let Some(p) = d.at_peak.as_ref().filter(|_| d.state.reserves) {
        sec::row(
            s,
            "external fragmentation at peak allocated",
            &format!(
                "{} (largest free {} of {} free)",
                percent(p.frag.external),
                bytes(p.frag.largest_free),
                bytes(p.frag.total_free)
            ),
        );
        if p.frag.stitch_tails > 0 {
            sec::row(
                s,
                "held by stitches past their blocks at peak allocated",
                &bytes(p.frag.stitch_tails),
            );
        }
    }
    sec::row(s, "allocations", &d.allocs.to_string());
    sec::row(s, "OOMs", &d.oom_count.to_string());
    sec::row(
        s,
        "time axis",
        &format!(
            "the trace's clock, as `gpualloc summary` and `replay` count (the device's first event at {})",
            duration(d.first_ns)
        ),
    );
    s.push_str("</table>");
}
