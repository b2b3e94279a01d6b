//! The data behind the interactive report, aggregated on this side so that
//! the page stays small whatever the length of the trace.
//!
//! One streaming pass per report (after [`analysis::analyze`], whose
//! duration, peaks and iteration boundaries it needs) collects, per device:
//!
//! - the gauges in [`BUCKETS`] equal buckets from the first event to the
//!   last, each with the minimum and maximum of allocated, active and
//!   reserved bytes. A bucket's minimum includes the value carried into it,
//!   so a stretch without events draws as the flat line it was, not a ramp;
//! - the same at a finer resolution in short windows around the peaks and
//!   the first OOMs (`series`), for zooming in there;
//! - fragmentation at [`FRAG_SAMPLES`] evenly spaced moments;
//! - the layout of reserved memory (segments and the blocks in them) at a
//!   bounded set of moments: both peaks, the first OOMs, the end, and
//!   [`EVEN_SNAPSHOTS`] evenly spaced ones. A layout keeps the
//!   [`MAX_BLOCKS`] largest blocks and counts the rest;
//! - per-iteration peaks (iterations as in `leaks`), merged into at most
//!   [`MAX_STEPS`] bars;
//! - the spans of rare phases (checkpoint saves, and phases opened at most
//!   [`RARE_PHASE`] times and in at most half the iterations, such as
//!   evaluation), with the gauges at opening and their highest values while
//!   open.
//!
//! [`analysis::analyze`]: crate::analyses::analysis::analyze

use std::collections::BTreeMap;
use std::path::Path;

use gpualloc::trace::{Action, EventKind, TraceEvent};
use serde_json::{Value, json};

use crate::analyses::analysis::{self, Analysis, AtPeak};
use crate::analyses::budget::Budget;
use crate::analyses::state::{self, DeviceState, Gauges, NO_PHASE};
use crate::commands::report::series::{WINDOW_FRACTION, Window};
use crate::input::{self, CliError};

/// Buckets of the gauge series.
pub const BUCKETS: usize = 2000;
/// Moments at which fragmentation is measured (each sorts the live blocks).
pub const FRAG_SAMPLES: usize = 400;
/// Evenly spaced layouts, besides peaks, OOMs and the end.
pub const EVEN_SNAPSHOTS: usize = 30;
/// Blocks kept per layout (the largest).
pub const MAX_BLOCKS: usize = 1500;
/// Segments kept per layout (the largest).
pub const MAX_SEGMENTS: usize = 1000;
/// Bars of the per-iteration chart.
pub const MAX_STEPS: usize = 1000;
/// Phases opened at most this often get their spans drawn.
pub const RARE_PHASE: u64 = 300;
/// Spans kept per device.
pub const MAX_SPANS: usize = 3000;
/// OOMs whose layout is kept.
pub const MAX_OOM_SNAPSHOTS: usize = 5;

#[derive(Clone, Copy, Default)]
struct Bucket {
    min: Gauges,
    max: Gauges,
}

struct Span {
    phase: u64,
    start: u64,
    end: u64,
    at_open: Gauges,
    max: Gauges,
}

struct Collector {
    t0: u64,
    width: u64,
    frag_width: u64,
    s: DeviceState,
    n: u64,
    buckets: Vec<Bucket>,
    cur: usize,
    frag: Vec<(u64, u64, u64, u64, u64)>,
    next_frag: usize,
    snaps: Vec<Value>,
    ooms_seen: usize,
    targets: BTreeMap<u64, &'static str>,
    bounds: Vec<u64>,
    step: usize,
    steps: Vec<(Gauges, u64)>,
    rare: Vec<u64>,
    spans: Vec<Span>,
    open: Vec<(u64, usize)>,
    at_peak: Option<AtPeak>,
    /// The event count at the end of the call that raised reserved to its
    /// peak, and the streams' shares there.
    reserved_at: u64,
    streams: Option<crate::analyses::streams::StreamShares>,
    /// The pools' shares at the peak of reserved memory.
    pools: Option<crate::analyses::pools::PoolShares>,
    windows: Vec<Window>,
}

fn max_g(a: &mut Gauges, b: &Gauges) {
    a.allocated = a.allocated.max(b.allocated);
    a.active = a.active.max(b.active);
    a.reserved = a.reserved.max(b.reserved);
}

fn min_g(a: &mut Gauges, b: &Gauges) {
    a.allocated = a.allocated.min(b.allocated);
    a.active = a.active.min(b.active);
    a.reserved = a.reserved.min(b.reserved);
}

impl Collector {
    /// A collector for a device whose events start at `t0` and span `span`
    /// ns, with iteration boundaries `bounds`, the phases whose spans are
    /// kept, and layouts to take after the given event counts.
    fn new(
        t0: u64,
        span: u64,
        bounds: Vec<u64>,
        rare: Vec<u64>,
        targets: BTreeMap<u64, &'static str>,
    ) -> Collector {
        Collector {
            t0,
            width: span.div_ceil(BUCKETS as u64).max(1),
            frag_width: span.div_ceil(FRAG_SAMPLES as u64).max(1),
            s: DeviceState::default(),
            n: 0,
            buckets: vec![Bucket::default(); BUCKETS],
            cur: 0,
            frag: Vec::with_capacity(FRAG_SAMPLES + 1),
            next_frag: 0,
            snaps: Vec::new(),
            ooms_seen: 0,
            targets,
            bounds,
            step: 0,
            steps: vec![(Gauges::default(), t0)],
            rare,
            spans: Vec::new(),
            open: Vec::new(),
            reserved_at: 0,
            streams: None,
            pools: None,
            at_peak: None,
            windows: Vec::new(),
        }
    }

    fn at(&self, t: u64) -> u64 {
        t.saturating_sub(self.t0)
    }

    fn apply(&mut self, e: &TraceEvent, budget: &mut Budget) {
        let t = self.at(e.time_ns);
        // Fragmentation and even layouts describe the state before `e`,
        // which held until `e`.
        while self.next_frag < FRAG_SAMPLES && t >= self.next_frag as u64 * self.frag_width {
            let at = self.next_frag as u64 * self.frag_width;
            self.sample_frag(at);
            if self.next_frag.is_multiple_of(FRAG_SAMPLES / EVEN_SNAPSHOTS) && self.next_frag > 0 {
                self.snapshot(at, "sample");
            }
            self.next_frag += 1;
        }
        let b = ((t / self.width) as usize).min(BUCKETS - 1);
        while self.cur < b {
            self.cur += 1;
            let g = self.s.g;
            self.buckets[self.cur] = Bucket { min: g, max: g };
        }
        if e.action == Action::Oom && self.ooms_seen < MAX_OOM_SNAPSHOTS {
            self.ooms_seen += 1;
            self.snapshot(t, "oom");
        }
        if let EventKind::PhasePop { name } = e.kind() {
            self.close_spans(name, t);
        }
        self.s.apply(e, budget);
        self.n += 1;
        let g = self.s.g;
        for w in &mut self.windows {
            w.observe(t, &g);
        }
        let bk = &mut self.buckets[self.cur];
        max_g(&mut bk.max, &g);
        min_g(&mut bk.min, &g);
        while self.step < self.bounds.len() && self.bounds[self.step] <= e.time_ns {
            self.step += 1;
            self.steps.push((g, e.time_ns));
        }
        if let Some(st) = self.steps.last_mut() {
            max_g(&mut st.0, &g);
        }
        for &(_, i) in &self.open {
            max_g(&mut self.spans[i].max, &g);
        }
        match e.kind() {
            EventKind::PhasePush { name }
                if self.rare.contains(&name) && self.spans.len() < MAX_SPANS =>
            {
                self.open.push((name, self.spans.len()));
                self.spans.push(Span {
                    phase: name,
                    start: t,
                    end: t,
                    at_open: g,
                    max: g,
                });
            }
            _ => {}
        }
        if self.n == self.reserved_at {
            self.streams = Some(crate::analyses::streams::shares(&self.s));
            self.pools = crate::analyses::pools::shares(&self.s);
        }
        if let Some(kind) = self.targets.get(&self.n).copied() {
            if kind == "peak allocated" {
                self.at_peak = Some(AtPeak {
                    frag: analysis::snapshot_frag(e.time_ns, &self.s),
                    reserved: self.s.g.reserved,
                });
            }
            self.snapshot(t, kind);
        }
    }

    fn close_spans(&mut self, phase: u64, t: u64) {
        if let Some(k) = self.open.iter().rposition(|o| o.0 == phase) {
            for (_, i) in self.open.drain(k..) {
                self.spans[i].end = t;
            }
        }
    }

    fn sample_frag(&mut self, at: u64) {
        let (largest, total) = self.s.free_space();
        self.frag
            .push((at, largest, total, self.s.g.allocated, self.s.g.reserved));
    }

    fn snapshot(&mut self, t: u64, kind: &str) {
        self.snaps.push(layout(&self.s, t, self.t0, kind));
    }
}

/// The layout of reserved memory at `t`: segments `[address, size, stream,
/// expandable, live bytes, live blocks]` (the largest [`MAX_SEGMENTS`], by
/// address) and blocks `[segment index or -1, offset, size, requested,
/// phase, age ns, pending, stream]` (the largest [`MAX_BLOCKS`]; the live
/// figures of a segment count them all).
fn layout(s: &DeviceState, t: u64, t0: u64, kind: &str) -> Value {
    let all_segs: Vec<(u64, state::Region)> = s.regions.iter().map(|(&a, &r)| (a, r)).collect();
    let live = s.sorted_live();
    // Segment of each block (address order on both sides), and live figures.
    let mut used = vec![(0u64, 0u64); all_segs.len()];
    let mut seg_of = Vec::with_capacity(live.len());
    let mut i = 0;
    for (addr, l) in &live {
        while i + 1 < all_segs.len() && all_segs[i + 1].0 <= *addr {
            i += 1;
        }
        match all_segs.get(i) {
            Some(&(a, r)) if a <= *addr && *addr < a + r.size => {
                used[i].0 += l.size;
                used[i].1 += 1;
                seg_of.push(Some(i));
            }
            _ => seg_of.push(None),
        }
    }
    let mut keep: Vec<usize> = (0..all_segs.len()).collect();
    if keep.len() > MAX_SEGMENTS {
        keep.sort_unstable_by_key(|&k| std::cmp::Reverse(all_segs[k].1.size));
        keep.truncate(MAX_SEGMENTS);
        keep.sort_unstable();
    }
    let mut new_index = vec![-1i64; all_segs.len()];
    for (n, &k) in keep.iter().enumerate() {
        new_index[k] = n as i64;
    }
    let mut order: Vec<usize> = (0..live.len())
        .filter(|&b| seg_of[b].is_none_or(|k| new_index[k] >= 0))
        .collect();
    if order.len() > MAX_BLOCKS {
        order.sort_unstable_by_key(|&b| std::cmp::Reverse(live[b].1.size));
        order.truncate(MAX_BLOCKS);
        order.sort_unstable();
    }
    let blocks: Vec<Value> = order
        .iter()
        .map(|&b| {
            let (addr, l) = &live[b];
            let (seg, off) = match seg_of[b] {
                Some(k) => (new_index[k], addr - all_segs[k].0),
                None => (-1, *addr),
            };
            let phase = if l.phase == NO_PHASE {
                -1
            } else {
                l.phase as i64
            };
            let age = (t + t0).saturating_sub(l.time_ns);
            json!([
                seg,
                off,
                l.size,
                l.requested,
                phase,
                age,
                u8::from(l.pending),
                l.stream
            ])
        })
        .collect();
    let segments: Vec<Value> = keep
        .iter()
        .map(|&k| {
            let (a, r) = all_segs[k];
            json!([
                format!("{a:#x}"),
                r.size,
                r.stream,
                u8::from(r.expandable),
                used[k].0,
                used[k].1
            ])
        })
        .collect();
    let (largest, total) = s.free_space();
    json!({
        "t": t,
        "kind": kind,
        "allocated": s.g.allocated,
        "active": s.g.active,
        "reserved": s.g.reserved,
        "largest_free": largest,
        "free": total,
        "segments_total": all_segs.len(),
        "blocks_total": live.len(),
        "segments": segments,
        "blocks": blocks,
    })
}

/// The JSON object the page's script draws from (see the module docs).
/// Also sets each device's state at the allocated peak and its streams and
/// pools at the reserved peak, so that reports need no
/// `analysis::second_pass`.
pub fn collect(path: &Path, allow_truncated: bool, a: &mut Analysis) -> Result<Value, CliError> {
    let mut cs: BTreeMap<u32, Collector> = BTreeMap::new();
    for (&dev, d) in &a.devices {
        // One layout per event: the allocated peak wins over the others.
        let mut targets = BTreeMap::new();
        targets.insert(d.events, "end");
        targets.insert(d.peak_reserved_settled, "peak reserved");
        targets.insert(d.peak_allocated.index, "peak allocated");
        // Per-iteration phases would only stripe the chart: a phase is rare
        // when opened in at most half the iterations (checkpoints always).
        let iterations = d.state.iterations().len() as u64 + 1;
        let rare = d
            .phases
            .by_id
            .iter()
            .filter(|&(&id, p)| {
                crate::commands::report::sections::is_checkpoint(&a.info.name(id))
                    || (p.count <= RARE_PHASE && p.count * 2 <= iterations)
            })
            .map(|(&id, _)| id)
            .collect();
        let span = a.duration_ns.saturating_sub(d.first_ns) + 1;
        let bounds = d.state.iterations().to_vec();
        let mut c = Collector::new(d.first_ns, span, bounds, rare, targets);
        c.reserved_at = d.peak_reserved_settled;
        // Detail windows around the peaks and the first OOMs, apart.
        let moments = [d.peak_allocated.time_ns, d.peak_reserved.time_ns]
            .into_iter()
            .chain(d.ooms.iter().take(MAX_OOM_SNAPSHOTS).map(|o| o.time_ns));
        let mut centres: Vec<u64> = Vec::new();
        for m in moments.map(|m| m.saturating_sub(d.first_ns)) {
            if centres
                .iter()
                .all(|&c| c.abs_diff(m) > span / WINDOW_FRACTION / 2)
            {
                centres.push(m);
                c.windows.push(Window::around(m, span));
            }
        }
        cs.insert(dev, c);
    }
    let mut budget = Budget::default();
    input::scan_until(path, allow_truncated, |e| {
        if let Some(c) = cs.get_mut(&e.device) {
            c.apply(e, &mut budget);
        }
        true
    })?;
    let mut devices = Vec::with_capacity(cs.len());
    for (dev, mut c) in cs {
        let end = c.at(a.duration_ns);
        c.sample_frag(end);
        if let Some(d) = a.devices.get_mut(&dev) {
            d.at_peak = c.at_peak.take();
            d.streams_at_peak_reserved = c.streams.take();
            d.pools_at_peak_reserved = c.pools.take();
        }
        devices.push(device_json(dev, c, end));
    }
    let info = &a.info;
    let names: Vec<&str> = info.strings.iter().map(String::as_str).collect();
    Ok(json!({"names": names, "devices": devices}))
}

fn device_json(dev: u32, c: Collector, end: u64) -> Value {
    let used = c.cur + 1;
    let col = |f: fn(&Bucket) -> u64| c.buckets[..used].iter().map(f).collect::<Vec<u64>>();
    let active_differs = c.buckets[..used]
        .iter()
        .any(|b| b.max.active != b.max.allocated || b.min.active != b.min.allocated);
    // Steps: merged into at most MAX_STEPS bars of consecutive iterations.
    let per = c.steps.len().div_ceil(MAX_STEPS).max(1);
    let steps: Vec<Value> = c
        .steps
        .chunks(per)
        .enumerate()
        .map(|(k, ch)| {
            let mut g = Gauges::default();
            for s in ch {
                max_g(&mut g, &s.0);
            }
            json!([
                k * per,
                ch.len(),
                ch[0].1.saturating_sub(c.t0),
                g.allocated,
                g.reserved
            ])
        })
        .collect();
    json!({
        "device": dev,
        "t0": c.t0,
        "end": end,
        "width": c.width,
        "active_differs": active_differs,
        "series": {
            "alloc_min": col(|b| b.min.allocated),
            "alloc_max": col(|b| b.max.allocated),
            "active_min": col(|b| b.min.active),
            "active_max": col(|b| b.max.active),
            "res_min": col(|b| b.min.reserved),
            "res_max": col(|b| b.max.reserved),
        },
        "frag": c.frag.iter().map(|f| json!([f.0, f.1, f.2, f.3, f.4])).collect::<Vec<_>>(),
        "snapshots": c.snaps,
        "steps": steps,
        "steps_per_bar": per,
        "windows": c.windows.into_iter().map(Window::into_json).collect::<Vec<_>>(),
        "spans": c.spans.iter().map(|s| json!([
            s.phase, s.start, s.end, s.at_open.allocated, s.max.allocated,
            s.at_open.reserved, s.max.reserved
        ])).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(time_ns: u64, action: Action, addr: u64, size: u64, aux: u64) -> TraceEvent {
        TraceEvent {
            time_ns,
            action,
            device: 0,
            stream: 0,
            addr,
            size,
            aux,
            thread: 0,
        }
    }

    /// A segment at 1 s, an allocation, ten quiet seconds, a free at 11 s.
    fn quiet_stretch() -> Value {
        let (t0, end) = (1_000_000_000u64, 11_000_000_000u64);
        let mut targets = BTreeMap::new();
        targets.insert(2, "peak allocated");
        let mut c = Collector::new(t0, end - t0 + 1, vec![], vec![], targets);
        let mut b = Budget::default();
        c.apply(&ev(t0, Action::SegmentAlloc, 0, 1 << 20, 1), &mut b);
        c.apply(&ev(t0 + 5, Action::Alloc, 0, 1000, 1024), &mut b);
        c.apply(&ev(end, Action::FreeRequested, 0, 1000, 1024), &mut b);
        c.apply(&ev(end, Action::FreeCompleted, 0, 1000, 1024), &mut b);
        c.sample_frag(end - t0);
        device_json(0, c, end - t0)
    }

    #[test]
    fn the_axis_starts_at_the_first_event_and_quiet_stretches_stay_flat() {
        let d = quiet_stretch();
        let s = &d["series"];
        let (lo, hi) = (
            s["alloc_min"].as_array().unwrap(),
            s["alloc_max"].as_array().unwrap(),
        );
        assert_eq!(lo.len(), BUCKETS, "every bucket up to the last event");
        assert_eq!((lo[0].as_u64(), hi[0].as_u64()), (Some(0), Some(1024)));
        // No ramp: every bucket of the quiet stretch holds exactly 1024 bytes.
        for k in 1..BUCKETS - 1 {
            assert_eq!(
                (lo[k].as_u64(), hi[k].as_u64()),
                (Some(1024), Some(1024)),
                "bucket {k}"
            );
        }
        assert_eq!(
            lo[BUCKETS - 1].as_u64(),
            Some(0),
            "freed in the last bucket"
        );
        assert_eq!(s["res_max"][BUCKETS / 2].as_u64(), Some(1 << 20));
        assert_eq!(d["active_differs"], json!(false));
        let frag = d["frag"].as_array().unwrap();
        assert_eq!(frag.len(), FRAG_SAMPLES + 1);
        assert_eq!(
            frag[FRAG_SAMPLES / 2],
            json!([
                (FRAG_SAMPLES / 2) as u64 * 25_000_001,
                (1 << 20) - 1024,
                (1 << 20) - 1024,
                1024,
                1 << 20
            ])
        );
    }

    #[test]
    fn layouts_are_taken_at_the_targets_and_bounded() {
        let mut targets = BTreeMap::new();
        let n = MAX_BLOCKS as u64 + 10;
        targets.insert(n + 1, "peak allocated");
        let mut c = Collector::new(0, 1000, vec![], vec![], targets);
        let mut b = Budget::default();
        c.apply(&ev(0, Action::SegmentAlloc, 0, 1 << 30, 1), &mut b);
        for k in 0..n {
            c.apply(&ev(1, Action::Alloc, k * 4096, 4000, 512 + k), &mut b);
        }
        let d = device_json(0, c, 1000);
        let snaps = d["snapshots"].as_array().unwrap();
        let peak = snaps
            .iter()
            .find(|s| s["kind"] == "peak allocated")
            .unwrap();
        assert_eq!(peak["blocks_total"].as_u64(), Some(n));
        let blocks = peak["blocks"].as_array().unwrap();
        assert_eq!(blocks.len(), MAX_BLOCKS);
        assert_eq!(
            blocks[0][2].as_u64(),
            Some(512 + 10),
            "the smallest ten dropped"
        );
        assert_eq!(
            peak["segments"][0][5].as_u64(),
            Some(n),
            "the segment counts them all"
        );
    }

    #[test]
    fn steps_and_rare_phase_spans_keep_their_peaks() {
        let mut c = Collector::new(0, 100, vec![10, 20], vec![7], BTreeMap::new());
        let mut b = Budget::default();
        c.apply(&ev(0, Action::SegmentAlloc, 0, 1 << 20, 1), &mut b);
        c.apply(&ev(5, Action::Alloc, 0, 100, 512), &mut b);
        c.apply(&ev(10, Action::Mark, 0, 0, 0), &mut b);
        c.apply(&ev(12, Action::PhasePush, 0, 0, 7), &mut b);
        c.apply(&ev(13, Action::Alloc, 512, 100, 2048), &mut b);
        c.apply(&ev(14, Action::FreeRequested, 512, 100, 2048), &mut b);
        c.apply(&ev(14, Action::FreeCompleted, 512, 100, 2048), &mut b);
        c.apply(&ev(15, Action::PhasePop, 0, 0, 7), &mut b);
        c.apply(&ev(20, Action::Mark, 0, 0, 0), &mut b);
        let d = device_json(0, c, 100);
        let steps: Vec<u64> = d["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s[3].as_u64().unwrap())
            .collect();
        assert_eq!(steps, vec![512, 2560, 512], "peak allocated per iteration");
        assert_eq!(
            d["spans"],
            json!([[7, 12, 15, 512, 2560, 1 << 20, 1 << 20]])
        );
    }
}
