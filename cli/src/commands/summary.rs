//! The `summary` command's text, and its JSON (`--json`) for scripts.
//!
//! The JSON is one object whose field names are stable: `file`, `events`,
//! `duration_ns`, `file_bytes`, `dropped`, `warning`, `producer`, `pid`,
//! `device_count`, `config` and `devices`, one object per device with
//! `device`, `events`, `allocations`, `peak_allocated`, `peak_reserved`,
//! `peak_active` (bytes) and their times `peak_allocated_ns`, ...,
//! `allocated_at_peak_reserved`, `fragmentation_at_peak` (`external`,
//! `unallocated`, `largest_free`, `total_free`, `stitch_tails`: reserved
//! bytes stitches in use hold past their blocks, 0 in traces before minor
//! 4, `reserved`; null without allocations), `streams_at_peak_reserved` (`streams`: `stream`,
//! `reserved`, `allocated` for each stream, most reserved first;
//! `unmapped`: reserved bytes no range holds), `pools_at_peak_reserved`
//! (`small`, `large`, `private`: `reserved`, `allocated` for the default
//! small and large pools and every private pool together; `unmapped` as
//! for the streams; null in a trace without reserved memory),
//! `end_allocated`, `end_reserved`, `end_live_blocks`,
//! `caching_off` (null, or when allocations bypassed the cache and this
//! trace: `forced_at_ns`, when `PYTORCH_NO_CUDA_MEMORY_CACHING` switched it
//! off for good, or null; `switched_off`, calls of
//! `caching_allocator_enable(False)`; `off_ns`, the time they kept it off,
//! null when they, or the trace's mark names, were too many to follow),
//! `empty_cache` (`calls`, `released`: bytes given back, `recreated`: bytes
//! of them created again afterwards), `private_pools` (`captures`:
//! scopes opened, `pools`, `releases`, `restores`: checkpoint restores,
//! `peak_held`: the most bytes mapped for private pools at once,
//! `served_by_another_allocator` and `lending_on_oom`: how many pools
//! another allocator served and how many lent on out-of-memory),
//! `caps_set` (the caps on reserved memory the program set while it
//! ran, the last of each: `fraction`, `memory_limit`, bytes or
//! `"cleared"`, and `device_total`; null where none was set), `ooms`
//! (a count), `oom_details` (the first
//! [`MAX_DETAILED`](crate::analyses::ooms::MAX_DETAILED) failures; their
//! `device_free`, `largest_free` and `reserved` are null in a trace without
//! segment events),
//! `unknown_frees`, `phases`, `most_frequent_sizes` and `largest_sizes`.
//! Bytes are integers, times are nanoseconds since the trace began,
//! fractions are between 0 and 1.

use std::fmt::Write;
use std::path::Path;

use serde_json::{Value, json};

use crate::analyses::analysis::{Analysis, DeviceAnalysis};
use crate::analyses::state::SetCaps;
use crate::commands::report::oom;
use crate::units::{bytes, duration, percent, precise_bytes};

/// What the text commands say of a trace without events.
pub const NO_EVENTS: &str =
    "no events: the trace holds its header only (nothing was allocated while it recorded)";

/// Renders the summary of an analysed trace.
pub fn render(a: &Analysis) -> String {
    let mut s = String::new();
    let h = &a.info.header;
    // Without events there is no size per event (the header is not one).
    let per_event = match a.info.events {
        0 => String::new(),
        n => format!(", {:.1} bytes/event", a.info.file_bytes as f64 / n as f64),
    };
    let _ = writeln!(
        s,
        "trace      {} events over {} ({}{per_event})",
        a.info.events,
        duration(a.duration_ns),
        bytes(a.info.file_bytes),
    );
    let _ = writeln!(
        s,
        "recorded   by {}, pid {}, {} device(s), config {:?}",
        h.producer, h.pid, h.device_count, h.config
    );
    if a.info.dropped > 0 {
        let _ = writeln!(
            s,
            "dropped    {} events could not be written while recording: the figures below miss them",
            a.info.dropped
        );
    }
    if let Some(w) = &a.info.warning {
        // Said on stderr too; here it stays with the figures it qualifies.
        let _ = writeln!(s, "warning    {w}");
    }
    if a.info.events == 0 {
        let _ = writeln!(s, "{}", NO_EVENTS);
    }
    for d in a.devices.values() {
        device(&mut s, a, d);
    }
    s
}

fn device(s: &mut String, a: &Analysis, d: &DeviceAnalysis) {
    let _ = writeln!(
        s,
        "\ndevice {}: {} events, {} allocations",
        d.device, d.events, d.allocs
    );
    let pk = |p: &crate::analyses::analysis::Peak| {
        format!("{:>12} at {}", bytes(p.value), duration(p.time_ns))
    };
    let _ = writeln!(s, "  peak allocated  {}", pk(&d.peak_allocated));
    if d.state.reserves {
        let _ = writeln!(s, "  peak reserved   {}", pk(&d.peak_reserved));
    } else {
        // An allocation log without segments (RMM's): no reserved figures,
        // rather than ratios of 0.
        let _ = writeln!(
            s,
            "  peak reserved   not recorded (the trace has no segment events)"
        );
    }
    let _ = writeln!(s, "  peak active     {}", pk(&d.peak_active));
    if d.peak_allocated.value > 0 && d.state.reserves {
        let _ = writeln!(
            s,
            "  reserved/allocated at the peaks {:.3}; at peak reserved {} allocated ({} unallocated)",
            d.peak_reserved.value as f64 / d.peak_allocated.value as f64,
            bytes(d.allocated_at_peak_reserved),
            percent(crate::analyses::state::unallocated(
                d.allocated_at_peak_reserved,
                d.peak_reserved.value
            ))
        );
    }
    if let Some(p) = d.at_peak.as_ref().filter(|_| d.state.reserves) {
        let tails = if p.frag.stitch_tails > 0 {
            format!(
                ", {} held by stitches past their blocks",
                bytes(p.frag.stitch_tails)
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "  fragmentation at peak allocated: external {} (largest free {} of {} free{tails}), unallocated {} of {} reserved",
            percent(p.frag.external),
            bytes(p.frag.largest_free),
            bytes(p.frag.total_free),
            percent(p.frag.unallocated),
            bytes(p.reserved)
        );
    }
    if let Some(line) = d
        .streams_at_peak_reserved
        .as_ref()
        .and_then(|x| x.describe())
    {
        let _ = writeln!(s, "  {line}");
    }
    if let Some(p) = &d.pools_at_peak_reserved {
        let _ = writeln!(s, "  {}", p.describe());
    }
    let g = d.state.g;
    let _ = writeln!(
        s,
        "  at the end      allocated {}, reserved {}, {} live blocks",
        bytes(g.allocated),
        if d.state.reserves {
            bytes(g.reserved)
        } else {
            "not recorded".into()
        },
        d.state.live.len()
    );
    if let Some(off) = a.marks.caching_off(d.device, &a.info, a.duration_ns) {
        let _ = writeln!(s, "  caching off     {}", off.describe());
    }
    if let Some(e) = d.empty_caches.describe() {
        let _ = writeln!(s, "  empty_cache     {e}");
    }
    if let Some(g) = d.graph_pools.describe() {
        let _ = writeln!(s, "  private pools   {g}");
    }
    if let Some(c) = describe_caps(&d.state.caps) {
        // Set at run time, or when the device started (PyTorch's
        // per_process_memory_fraction, Note [PyTorch's settings under
        // gpualloc]); neither is in the configuration.
        let _ = writeln!(
            s,
            "  caps set        {c} (outside the configuration: while running, or PyTorch's per_process_memory_fraction when the device started; the last of each)"
        );
    }
    let _ = writeln!(s, "  OOMs            {}", d.oom_count);
    // What each OOM had left is under the cap in force, if any, as the
    // report reads it.
    let mut ooms: Vec<_> = d.ooms.iter().take(3).cloned().collect();
    oom::apply_limit(&mut ooms, &a.info.header.config);
    for o in &ooms {
        let _ = write!(
            s,
            "    at {}: requested {} in {}, ",
            duration(o.time_ns),
            bytes(o.requested),
            a.info.name(o.phase),
        );
        if !o.reserves {
            let _ = writeln!(
                s,
                "allocated {}; free and reserved memory unknown (the trace has no segment events)",
                bytes(o.gauges.allocated)
            );
            continue;
        }
        let _ = writeln!(
            s,
            "device free {}{}, largest free block {} (allocated {}, reserved {})",
            bytes(o.device_free),
            o.limit_left.map_or(String::new(), |l| format!(
                " (the memory limit left {})",
                bytes(l)
            )),
            bytes(o.largest_free),
            bytes(o.gauges.allocated),
            bytes(o.gauges.reserved)
        );
        // Why, as the report says it (a free block larger than the request
        // is no contradiction: the sentence says whose it was).
        let _ = writeln!(s, "      {}", oom::explain(o));
    }
    if d.state.unknown > 0 {
        let _ = writeln!(
            s,
            "  {} frees of blocks allocated before the trace began were skipped",
            d.state.unknown
        );
    }
    if !d.phases.by_id.is_empty() {
        let _ = writeln!(
            s,
            "  phases          {:<24} {:>6} {:>12} {:>12} {:>12} {:>10}",
            "name", "count", "peak alloc", "peak resv", "growth", "allocs"
        );
        let mut ph: Vec<_> = d.phases.by_id.iter().collect();
        ph.sort_by_key(|x| std::cmp::Reverse(x.1.peak_allocated));
        for (id, p) in ph.iter().take(15) {
            let _ = writeln!(
                s,
                "                  {:<24} {:>6} {:>12} {:>12} {:>12} {:>10}",
                a.info.name(**id),
                p.count,
                bytes(p.peak_allocated),
                bytes(p.peak_reserved),
                bytes(p.peak_growth),
                p.allocs
            );
        }
    }
    // Sizes whose rounded labels would read alike are given in bytes.
    let list = |v: Vec<(u64, u64)>| {
        let labels: Vec<String> = v.iter().map(|(sz, _)| bytes(*sz)).collect();
        v.iter()
            .zip(&labels)
            .map(|((sz, c), l)| {
                if labels.iter().filter(|m| *m == l).count() > 1 {
                    format!("{} x{c}", precise_bytes(*sz))
                } else {
                    format!("{l} x{c}")
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(s, "  most frequent   {}", list(d.sizes.most_frequent(6)));
    let _ = writeln!(
        s,
        "  largest         {}",
        list(d.sizes.largest().into_iter().take(6).collect())
    );
}

/// The summary as one JSON object (see the module docs for the fields).
pub fn render_json(a: &Analysis, file: &Path) -> String {
    pretty(&json_value(a, file))
}

/// The summary's JSON object, unprinted.
pub fn json_value(a: &Analysis, file: &Path) -> Value {
    let h = &a.info.header;
    json!({
        "file": file.display().to_string(),
        "events": a.info.events,
        "duration_ns": a.duration_ns,
        "file_bytes": a.info.file_bytes,
        "dropped": a.info.dropped,
        "warning": a.info.warning,
        "producer": h.producer,
        "pid": h.pid,
        "device_count": h.device_count,
        "config": h.config,
        "devices": a.devices.values().map(|d| device_json(a, d)).collect::<Vec<_>>(),
    })
}

/// `v` printed over several lines, with a final newline.
pub fn pretty(v: &Value) -> String {
    let mut out = serde_json::to_string_pretty(v).expect("plain values serialize");
    out.push('\n');
    out
}

fn device_json(a: &Analysis, d: &DeviceAnalysis) -> Value {
    let sizes = |v: Vec<(u64, u64)>| -> Vec<Value> {
        v.into_iter()
            .map(|(size, count)| json!({"size": size, "count": count}))
            .collect()
    };
    let mut phases: Vec<_> = d.phases.by_id.iter().collect();
    phases.sort_by_key(|x| std::cmp::Reverse(x.1.peak_allocated));
    json!({
        "device": d.device,
        "events": d.events,
        "allocations": d.allocs,
        "peak_allocated": d.peak_allocated.value,
        "peak_allocated_ns": d.peak_allocated.time_ns,
        "peak_reserved": d.peak_reserved.value,
        "peak_reserved_ns": d.peak_reserved.time_ns,
        "peak_active": d.peak_active.value,
        "peak_active_ns": d.peak_active.time_ns,
        "allocated_at_peak_reserved": d.allocated_at_peak_reserved,
        "fragmentation_at_peak": d.at_peak.as_ref().map(|p| json!({
            "external": p.frag.external,
            "unallocated": p.frag.unallocated,
            "largest_free": p.frag.largest_free,
            "total_free": p.frag.total_free,
            "stitch_tails": p.frag.stitch_tails,
            "reserved": p.reserved,
        })),
        "streams_at_peak_reserved": d.streams_at_peak_reserved.as_ref().map(|x| json!({
            "streams": x.streams.iter().map(|s| json!({
                "stream": s.stream,
                "reserved": s.reserved,
                "allocated": s.allocated,
            })).collect::<Vec<_>>(),
            "unmapped": x.unmapped,
        })),
        "pools_at_peak_reserved": d.pools_at_peak_reserved.as_ref().map(|x| {
            let share = |p: &crate::analyses::pools::PoolShare| json!({
                "reserved": p.reserved,
                "allocated": p.allocated,
            });
            json!({
                "small": share(&x.small),
                "large": share(&x.large),
                "private": share(&x.private),
                "unmapped": x.unmapped,
            })
        }),
        "end_allocated": d.state.g.allocated,
        "end_reserved": d.state.g.reserved,
        "end_live_blocks": d.state.live.len(),
        "private_pools": json!({
            "captures": d.graph_pools.captures,
            "pools": d.graph_pools.pools(),
            "releases": d.graph_pools.releases,
            "restores": d.graph_pools.restores,
            "peak_held": d.graph_pools.peak_held,
            "served_by_another_allocator": d.graph_pools.served(),
            "lending_on_oom": d.graph_pools.lending(),
        }),
        "caching_off": a.marks.caching_off(d.device, &a.info, a.duration_ns).map(|c| json!({
            "forced_at_ns": c.forced_at_ns,
            "switched_off": c.switched_off,
            "off_ns": c.off_ns,
        })),
        "empty_cache": json!({
            "calls": d.empty_caches.calls,
            "released": d.empty_caches.released,
            "recreated": d.empty_caches.recreated,
        }),
        "caps_set": json!({
            "fraction": d.state.caps.fraction,
            "memory_limit": d.state.caps.bytes.map(|b| b.map_or(json!("cleared"), |b| json!(b))),
            "device_total": d.state.caps.device_total,
        }),
        "ooms": d.oom_count,
        "oom_details": d.ooms.iter().map(|o| json!({
            "time_ns": o.time_ns,
            "requested": o.requested,
            "phase": a.info.name(o.phase),
            "device_free": o.reserves.then_some(o.device_free),
            "largest_free": o.reserves.then_some(o.largest_free),
            "allocated": o.gauges.allocated,
            "reserved": o.reserves.then_some(o.gauges.reserved),
        })).collect::<Vec<_>>(),
        "unknown_frees": d.state.unknown,
        "phases": phases.iter().map(|(id, p)| json!({
            "name": a.info.name(**id),
            "count": p.count,
            "peak_allocated": p.peak_allocated,
            "peak_reserved": p.peak_reserved,
            "peak_growth": p.peak_growth,
            "allocations": p.allocs,
        })).collect::<Vec<_>>(),
        "most_frequent_sizes": sizes(d.sizes.most_frequent(6)),
        "largest_sizes": sizes(d.sizes.largest()),
    })
}

/// The caps on reserved memory the program set while it ran, if any.
fn describe_caps(c: &SetCaps) -> Option<String> {
    let fraction = c.fraction.map(|f| match c.device_total {
        Some(total) if f < 1.0 => format!(
            "fraction {f:.3} of the device ({} of {})",
            bytes(oom::fraction_of(total, f)),
            bytes(total)
        ),
        _ => format!("fraction {f:.3} of the device"),
    });
    let limit = c.bytes.map(|b| match b {
        Some(b) => format!("memory limit {}", bytes(b)),
        None => "memory limit cleared".into(),
    });
    let parts: Vec<String> = fraction.into_iter().chain(limit).collect();
    (!parts.is_empty()).then(|| parts.join(", "))
}
