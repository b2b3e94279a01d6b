//! The report's HTML sections that need no script: the answers first, then
//! per-phase peaks with the checkpoint call-out, leak candidates, OOM
//! forensics with the replayed advice, and request sizes. Times are on the
//! trace's clock, as on the charts and in `gpualloc summary`.

use std::fmt::Write;

use crate::analyses::analysis::{Analysis, DeviceAnalysis};
use crate::analyses::leaks;
use crate::analyses::phases::PhaseStats;
use crate::commands::report::oom::{self, Advice};
use crate::commands::report::svg::{self, esc};
use crate::units::{bytes, delta, duration, percent};

/// Phase rows shown.
const PHASE_ROWS: usize = 50;
/// Leak groups shown.
const LEAK_ROWS: usize = 25;

/// Reserved memory of a trace without segment events (an RMM log).
pub const NOT_RECORDED: &str = "not recorded (the trace has no segment events)";

/// A two-cell table row.
pub fn row(s: &mut String, k: &str, v: &str) {
    let _ = write!(s, "<tr><td>{}</td><td>{}</td></tr>", esc(k), esc(v));
}

/// Whether a phase name reads as a checkpoint save.
pub fn is_checkpoint(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("checkpoint") || n.contains("save") || n.contains("ckpt")
}

fn shown(n: usize, of: usize, what: &str) -> String {
    if n < of {
        format!("<p class=\"note\">{n} of {of} {what}, largest first.</p>")
    } else {
        format!("<p class=\"note\">All {of} {what}.</p>")
    }
}

/// The five questions, answered in a sentence each.
pub fn findings(s: &mut String, a: &Analysis, d: &DeviceAnalysis, advice: Option<&Advice>) {
    s.push_str("<ul class=\"findings\">");
    let (pa, pr) = (d.peak_allocated.value, d.peak_reserved.value);
    let cache = if d.state.reserves {
        format!(
            "the cache held {} at its peak, {} more than the tensors needed ({} of it)",
            bytes(pr),
            bytes(pr.saturating_sub(pa)),
            percent(if pr == 0 {
                0.0
            } else {
                pr.saturating_sub(pa) as f64 / pr as f64
            })
        )
    } else {
        format!("what the cache held was {NOT_RECORDED}")
    };
    let _ = write!(
        s,
        "<li><b>Tensors or cache?</b> Tensors peaked at {}; {}.{}{}{}{}{}</li>",
        bytes(pa),
        esc(&cache),
        a.marks
            .caching_off(d.device, &a.info, a.duration_ns)
            .map_or(String::new(), |c| format!(
                " The caching allocator was off {}.",
                esc(&c.describe())
            )),
        d.empty_caches.describe().map_or(String::new(), |e| format!(
            " <code>empty_cache</code>: {}.",
            esc(&e)
        )),
        d.graph_pools
            .describe()
            .map_or(String::new(), |g| format!(" Private pools: {}.", esc(&g))),
        d.streams_at_peak_reserved
            .as_ref()
            .and_then(|x| x.describe())
            .map_or(String::new(), |x| format!(" {}.", esc(&x))),
        d.pools_at_peak_reserved
            .as_ref()
            .map_or(String::new(), |x| format!(" {}.", esc(&x.describe())))
    );
    let mut rare: Vec<(&u64, &PhaseStats)> = d
        .phases
        .by_id
        .iter()
        .filter(|(id, _)| is_checkpoint(&a.info.name(**id)))
        .collect();
    rare.sort_by_key(|x| std::cmp::Reverse(x.1.peak_growth));
    match rare.first() {
        Some((id, p)) => {
            let _ = write!(
                s,
                "<li><b>Checkpoint spike?</b> While <code>{}</code> was open ({} times), allocated memory rose by up to {}, to {}; reserved reached {}.</li>",
                esc(&a.info.name(**id)),
                p.count,
                bytes(p.peak_growth),
                bytes(p.peak_allocated),
                bytes(p.peak_reserved)
            );
        }
        None => s.push_str("<li><b>Checkpoint spike?</b> No phase named like a checkpoint save (checkpoint, save, ckpt) was recorded.</li>"),
    }
    if let Some(p) = d.at_peak.as_ref().filter(|_| d.state.reserves) {
        let _ = write!(
            s,
            "<li><b>Fragmentation?</b> At the allocated peak, {} of reserved memory was free, in pieces of at most {} (external fragmentation {}).</li>",
            bytes(p.frag.total_free),
            bytes(p.frag.largest_free),
            percent(p.frag.external)
        );
    }
    let producer = &a.info.header.producer;
    match (d.ooms.first(), advice.and_then(Advice::best)) {
        (None, _) => s.push_str("<li><b>Out of memory?</b> No allocation failed.</li>"),
        (Some(o), best) => {
            let _ = write!(
                s,
                "<li><b>Why the OOM?</b> {}",
                esc(&oom::explain_replayed(o, advice, &a.info.header.producer))
            );
            match best {
                Some(t) => {
                    let _ = write!(
                        s,
                        " Replayed with <code>{}</code>, the run fits (peak reserved {}).</li>",
                        esc(&t.config),
                        bytes(t.result.peak_reserved)
                    );
                }
                None if advice.is_none() => s.push_str(
                    " Not replayed: the trace records no reserved memory, so the device's capacity is unknown.</li>",
                ),
                None if advice.is_some_and(|a| {
                    a.avoided_by_this_build(o.time_ns, producer).is_some()
                }) =>
                {
                    s.push_str(" Running this build may be enough.</li>")
                }
                None if advice.is_some_and(|a| !a.reproduced()) => s.push_str(
                    " Replayed under the recorded configuration, the run does not fail, so the replays cannot tell which configuration would avoid it: the device may have held memory the trace does not show (other processes, the CUDA context).</li>",
                ),
                None => s.push_str(" No configuration tried avoids it in replay.</li>"),
            }
        }
    }
    let gs = leaks::groups(d, a.duration_ns);
    let cands: Vec<_> = gs.iter().filter(|g| g.candidate).collect();
    let _ = write!(
        s,
        "<li><b>Leaking?</b> {} leak candidate group(s) over {} iteration(s){}.</li></ul>",
        cands.len(),
        leaks::iterations(d),
        cands.first().map_or(String::new(), |g| format!(
            "; the largest keeps {} blocks of {} ({} in all) from phase {}",
            g.count,
            bytes(g.block),
            bytes(g.bytes),
            esc(&a.info.name(g.phase))
        ))
    );
}

/// Per-phase peaks, with checkpoint phases called out.
pub fn phases(s: &mut String, a: &Analysis, d: &DeviceAnalysis) {
    s.push_str("<h3>Per-phase peaks</h3>");
    if d.phases.by_id.is_empty() {
        s.push_str("<p class=\"note\">No phases were recorded (gpualloc.phase / phase_push).</p>");
        return;
    }
    let mut ph: Vec<_> = d.phases.by_id.iter().collect();
    ph.sort_by_key(|x| std::cmp::Reverse(x.1.peak_allocated));
    for (id, p) in ph
        .iter()
        .filter(|(id, _)| is_checkpoint(&a.info.name(**id)))
    {
        let _ = write!(
            s,
            "<p class=\"callout\">Checkpoint save <code>{}</code>: opened {} time(s); allocated memory grew by up to {} while it was open (peak allocated {}, peak reserved {}, against {} reserved at the run's peak). The spans are shaded on the memory chart.</p>",
            esc(&a.info.name(**id)),
            p.count,
            bytes(p.peak_growth),
            bytes(p.peak_allocated),
            bytes(p.peak_reserved),
            bytes(d.peak_reserved.value)
        );
    }
    s.push_str(&shown(PHASE_ROWS.min(ph.len()), ph.len(), "phases"));
    s.push_str("<table><tr><th>phase</th><th>count</th><th>peak allocated</th><th>peak reserved</th><th>peak growth</th><th>allocations</th><th>time open</th></tr>");
    for (id, p) in ph.iter().take(PHASE_ROWS) {
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

/// Leak candidates.
pub fn leaks(s: &mut String, a: &Analysis, d: &DeviceAnalysis) {
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
    s.push_str(&shown(
        LEAK_ROWS.min(gs.len()),
        gs.len(),
        "groups (candidates first)",
    ));
    s.push_str("<table><tr><th>size</th><th>phase</th><th>alive</th><th>bytes</th><th>iterations with survivors</th><th>per iteration</th><th>candidate</th></tr>");
    for g in gs.iter().take(LEAK_ROWS) {
        let _ = write!(
            s,
            "<tr{}><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>+{:.2}</td><td>{}</td></tr>",
            if g.candidate { " class=\"hot\"" } else { "" },
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

/// OOM forensics and the replayed advice.
pub fn ooms(s: &mut String, a: &Analysis, d: &DeviceAnalysis, advice: Option<&Advice>) {
    let _ = write!(
        s,
        "<h3 id=\"ooms-{}\">Out-of-memory forensics</h3><p>{} failed allocation(s){}.</p>",
        d.device,
        d.oom_count,
        if d.oom_count > d.ooms.len() as u64 {
            format!("; the first {} examined", d.ooms.len())
        } else {
            String::new()
        }
    );
    for o in &d.ooms {
        let _ = write!(
            s,
            "<div class=\"oom\"><p><b>At {}</b> in phase <b>{}</b>: requested {} on stream {:#x} (allocated {}, reserved {}).</p><p class=\"callout\">{}</p>",
            duration(o.time_ns),
            esc(&a.info.name(o.phase)),
            bytes(o.requested),
            o.stream,
            bytes(o.gauges.allocated),
            if o.reserves {
                bytes(o.gauges.reserved)
            } else {
                "not recorded".into()
            },
            esc(&oom::explain_replayed(o, advice, &a.info.header.producer))
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
        s.push_str("</table></div>");
    }
    let Some(adv) = advice else { return };
    let _ = write!(
        s,
        "<h4>Configurations replayed on a simulated device of {}</h4>",
        bytes(adv.capacity)
    );
    if adv.recorded.is_none() {
        let _ = write!(
            s,
            "<p class=\"warn\">The trace's configuration (<code>{}</code>) does not parse in this build (a key of another version), so it was not replayed: the candidates below are compared with one another only.</p>",
            esc(&a.info.header.config)
        );
    }
    let base = adv.recorded.as_ref().map(|t| t.result.peak_reserved);
    let change = |peak: u64| base.map_or("n/a".to_string(), |b| delta(b, peak));
    s.push_str("<table><tr><th>configuration</th><th>OOMs in replay</th><th>peak reserved</th><th>vs the trace's configuration</th><th>peak allocated</th><th>first OOM</th></tr>");
    let best = adv.best().map(|t| t.config.clone());
    let rows = adv.recorded.iter().map(|t| (true, t));
    for (recorded, t) in rows.chain(adv.candidates.iter().map(|t| (false, t))) {
        let r = &t.result;
        let name = match (recorded, t.config.is_empty()) {
            (true, true) => "(defaults: the trace's configuration)".to_string(),
            (true, false) => format!("{} (the trace's configuration)", t.config),
            _ => t.config.clone(),
        };
        let _ = write!(
            s,
            "<tr{}><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            if !recorded && best.as_ref() == Some(&t.config) {
                " class=\"good\""
            } else {
                ""
            },
            esc(&name),
            r.ooms,
            bytes(r.peak_reserved),
            change(r.peak_reserved),
            bytes(r.peak_allocated),
            r.first_oom.as_ref().map_or("none".into(), |o| format!(
                "{} at {}",
                bytes(o.requested),
                duration(o.time_ns)
            ))
        );
    }
    s.push_str("</table>");
    let first = d.ooms.first().map_or(u64::MAX, |o| o.time_ns);
    if adv
        .avoided_by_this_build(first, &a.info.header.producer)
        .is_some()
    {
        s.push_str("<p class=\"good\">Under the recorded configuration this build's policy avoids the OOM in replay: it chose otherwise than the recording before the failed request, and no request fails.</p>");
        return;
    }
    if !adv.reproduced() {
        s.push_str("<p class=\"warn\">The replay under the recorded configuration does not reproduce the OOM: the device may have held memory the trace does not show (other processes, the CUDA context), so a configuration that does not fail in replay either cannot be said to avoid it.</p>");
        return;
    }
    match adv.best() {
        Some(t) => {
            let _ = write!(
                s,
                "<p class=\"good\">Use <code>GPUALLOC_CONF={}</code>: the replay has no OOM and its reserved peak is {}{}.</p>",
                esc(&t.config),
                bytes(t.result.peak_reserved),
                base.map_or(String::new(), |b| format!(
                    " ({} against the recorded configuration's replay)",
                    delta(b, t.result.peak_reserved)
                ))
            );
        }
        None => s.push_str("<p class=\"warn\">No configuration tried avoids the OOM in replay: none of them fits the live tensors, with the rounding and fragmentation each leaves, in what the device held. Reduce the batch or sequence length, or free tensors sooner.</p>"),
    }
}

/// Request sizes.
pub fn sizes(s: &mut String, d: &DeviceAnalysis) {
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
