//! The `summary` command's text.

use std::fmt::Write;

use crate::analysis::{Analysis, DeviceAnalysis};
use crate::units::{bytes, duration, percent};

/// Renders the summary of an analysed trace.
pub fn render(a: &Analysis) -> String {
    let mut s = String::new();
    let h = &a.info.header;
    let _ = writeln!(
        s,
        "trace      {} events over {} ({} bytes, {:.1} bytes/event)",
        a.info.events,
        duration(a.duration_ns),
        a.info.file_bytes,
        a.info.file_bytes as f64 / a.info.events.max(1) as f64
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
    let pk =
        |p: &crate::analysis::Peak| format!("{:>12} at {}", bytes(p.value), duration(p.time_ns));
    let _ = writeln!(s, "  peak allocated  {}", pk(&d.peak_allocated));
    let _ = writeln!(s, "  peak reserved   {}", pk(&d.peak_reserved));
    let _ = writeln!(s, "  peak active     {}", pk(&d.peak_active));
    if d.peak_allocated.value > 0 {
        let _ = writeln!(
            s,
            "  reserved/allocated at the peaks {:.3}; at peak reserved {} allocated ({} unallocated)",
            d.peak_reserved.value as f64 / d.peak_allocated.value as f64,
            bytes(d.allocated_at_peak_reserved),
            percent(
                1.0 - d.allocated_at_peak_reserved as f64 / d.peak_reserved.value.max(1) as f64
            )
        );
    }
    if let Some(p) = &d.at_peak {
        let _ = writeln!(
            s,
            "  fragmentation at peak allocated: external {} (largest free {} of {} free), unallocated {} of {} reserved",
            percent(p.frag.external),
            bytes(p.frag.largest_free),
            bytes(p.frag.total_free),
            percent(p.frag.unallocated),
            bytes(p.reserved)
        );
    }
    let g = d.state.g;
    let _ = writeln!(
        s,
        "  at the end      allocated {}, reserved {}, {} live blocks",
        bytes(g.allocated),
        bytes(g.reserved),
        d.state.live.len()
    );
    let _ = writeln!(s, "  OOMs            {}", d.oom_count);
    for o in d.ooms.iter().take(3) {
        let _ = writeln!(
            s,
            "    at {}: requested {} in {}, device free {}, largest free block {} (allocated {}, reserved {})",
            duration(o.time_ns),
            bytes(o.requested),
            a.info.name(o.phase),
            bytes(o.device_free),
            bytes(o.largest_free),
            bytes(o.gauges.allocated),
            bytes(o.gauges.reserved)
        );
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
    let list = |v: Vec<(u64, u64)>| {
        v.iter()
            .map(|(sz, c)| format!("{sz} B x{c}"))
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
