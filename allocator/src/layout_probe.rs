//! Where reserved memory goes: a breakdown of the expandable segments'
//! physical handles at one moment, by what lies in them (test-only).
//!
//! Every mapped handle of the default pools is classified by the blocks it
//! backs: a handle that backs any live (or claimed) byte keeps its free
//! bytes as a "tail", which cannot be unmapped while the live block lives;
//! a handle that is wholly free is reclaimable, unless a cached stitch
//! aliases it. Pooled handles are unmapped memory kept for reuse. The
//! probe test (`cargo test -p gpualloc layout_probe -- --ignored
//! --nocapture`, with `LAYOUT_PROBE` naming traces) replays a trace and
//! prints the breakdown at the peaks of reserved and of allocated memory.

use crate::backend::{Backend, SimBackend};
use crate::block::BlockState;
use crate::device::DeviceAllocator;
use crate::heap::{LARGE, SMALL};

/// Bytes of reserved memory by what they hold, per pool `[small, large]`.
#[derive(Clone, Debug, Default)]
pub(crate) struct Breakdown {
    /// Live bytes (allocated, pending free, or claimed by a stitch).
    pub live: [u64; 2],
    /// Of `live`, the bytes claimed by a stitch (its pages, lent whole).
    pub claimed: [u64; 2],
    /// Bytes of stitches in use past the end of their blocks (Note
    /// [Stitch tails]): claimed, holding no live byte.
    pub stitch_tails: u64,
    /// Free bytes inside handles that also back live bytes.
    pub tails: [u64; 2],
    /// Wholly free handles no cached stitch aliases.
    pub whole: [u64; 2],
    /// Wholly free handles a cached stitch aliases.
    pub pinned: [u64; 2],
    /// Handles that back live bytes (the footprint of live memory).
    pub touched: [u64; 2],
    /// Bytes of whole-handle free runs that defragmentation skips because
    /// a cached stitch aliases some handle of the run (a superset of `pinned`).
    pub run_pinned: u64,
    /// Pooled (unmapped) bytes, all kinds.
    pub pooled: u64,
    /// Free tail pieces: `(pool, free bytes in the handle, handle size)`.
    pub pieces: Vec<(usize, u64, u64)>,
    /// The live byte ranges of each handle with a tail, relative to the
    /// handle's start: `(handle size, ranges)`.
    pub tail_use: Vec<(u64, Vec<(u64, u64)>)>,
}

impl Breakdown {
    /// One line per pool and a summary.
    pub fn render(&self) -> String {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let mut s = String::new();
        for (i, name) in ["small", "large"].iter().enumerate() {
            s += &format!(
                "  {name}: live {:.1} MiB ({:.1} claimed by stitches) in handles of {:.1} MiB; tails {:.1}, whole free {:.1}, stitch-pinned {:.1}\n",
                mib(self.live[i]),
                mib(self.claimed[i]),
                mib(self.touched[i]),
                mib(self.tails[i]),
                mib(self.whole[i]),
                mib(self.pinned[i])
            );
        }
        s += &format!(
            "  pooled {:.1} MiB; free runs skipped for a stitch {:.1} MiB; stitch tails in use {:.1} MiB\n",
            mib(self.pooled),
            mib(self.run_pinned),
            mib(self.stitch_tails)
        );
        let mut hist = [0u64; 5];
        for &(_, free, _) in &self.pieces {
            let k = match free >> 20 {
                0 => 0,
                1 => 1,
                2..=3 => 2,
                4..=7 => 3,
                _ => 4,
            };
            hist[k] += free;
        }
        s += &format!(
            "  tail bytes by piece size <1/1-2/2-4/4-8/8+ MiB: {:.1} {:.1} {:.1} {:.1} {:.1} ({} pieces)\n",
            mib(hist[0]),
            mib(hist[1]),
            mib(hist[2]),
            mib(hist[3]),
            mib(hist[4]),
            self.pieces.len()
        );
        // By the size of the handle each tail lies in: what finer handles
        // could give back (a 2 MiB handle's tail is the page floor).
        let mut by_handle = std::collections::BTreeMap::<u64, u64>::new();
        for &(_, free, handle) in &self.pieces {
            *by_handle.entry(handle >> 20).or_default() += free;
        }
        s += "  tail bytes by handle size:";
        for (h, b) in &by_handle {
            s += &format!(" {h} MiB: {:.1};", mib(*b));
        }
        s += "\n";
        let (pairs, saved) = self.shareable();
        s += &format!(
            "  handles with tails whose live bytes do not overlap: {pairs} pairs, {:.1} MiB if each pair shared one handle\n",
            mib(saved)
        );
        s
    }

    /// How much one physical handle mapped at two addresses could save:
    /// pairs of equal-sized handles with tails whose live ranges do not
    /// overlap (relative to the handle's start), matched greedily, the
    /// fullest first. Returns `(pairs, bytes)`.
    pub fn shareable(&self) -> (usize, u64) {
        let used = |r: &[(u64, u64)]| r.iter().map(|(a, b)| b - a).sum::<u64>();
        let mut order: Vec<usize> = (0..self.tail_use.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(used(&self.tail_use[i].1)));
        let disjoint = |x: &[(u64, u64)], y: &[(u64, u64)]| {
            x.iter()
                .all(|&(a, b)| y.iter().all(|&(c, d)| b <= c || d <= a))
        };
        let mut taken = vec![false; self.tail_use.len()];
        let (mut pairs, mut bytes) = (0, 0);
        for (k, &i) in order.iter().enumerate() {
            if taken[i] {
                continue;
            }
            let (size, ref ri) = self.tail_use[i];
            let partner = order[k + 1..].iter().copied().find(|&j| {
                !taken[j] && self.tail_use[j].0 == size && disjoint(ri, &self.tail_use[j].1)
            });
            if let Some(j) = partner {
                taken[i] = true;
                taken[j] = true;
                pairs += 1;
                bytes += size;
            }
        }
        (pairs, bytes)
    }
}

impl<B: Backend> DeviceAllocator<B> {
    /// The breakdown of the default pools' handles now.
    pub(crate) fn breakdown(&self) -> Breakdown {
        let run_pinned = self
            .free_runs(None)
            .iter()
            .filter(|r| self.aliased(r.1, r.1 + r.0))
            .map(|r| r.0)
            .sum();
        let stitch_tails = self
            .stitches
            .list
            .iter()
            .filter_map(|st| {
                let seg = st.in_use?;
                let b = &self.heap.blocks[self.heap.segments.get(seg).first];
                Some(st.size - b.size)
            })
            .sum();
        let mut out = Breakdown {
            pooled: self.pooled_bytes(),
            run_pinned,
            stitch_tails,
            ..Breakdown::default()
        };
        for (slot, pool) in [(0usize, SMALL), (1, LARGE)] {
            for &(_, seg) in &self.heap.pools[pool as usize].expandable {
                let sg = self.heap.segments.get(seg);
                let mut blocks = Vec::new();
                let mut cur = Some(sg.first);
                while let Some(id) = cur {
                    let b = &self.heap.blocks[id];
                    blocks.push((b.ptr, b.ptr + b.size, b.state));
                    cur = b.next;
                }
                let mut k = 0;
                for (a, _, s) in self.pages.handles_in(sg.ptr, sg.ptr + sg.size) {
                    let (mut live, mut free) = (0, 0);
                    let mut ranges: Vec<(u64, u64)> = Vec::new();
                    while blocks[k].1 <= a {
                        k += 1;
                    }
                    let mut j = k;
                    while j < blocks.len() && blocks[j].0 < a + s {
                        let (lo, hi, st) = blocks[j];
                        let n = hi.min(a + s) - lo.max(a);
                        match st {
                            BlockState::Free => free += n,
                            BlockState::Unmapped => unreachable!("a handle over unmapped space"),
                            st => {
                                live += n;
                                if st == BlockState::Claimed {
                                    out.claimed[slot] += n;
                                }
                                let r = (lo.max(a) - a, hi.min(a + s) - a);
                                match ranges.last_mut() {
                                    Some(last) if last.1 == r.0 => last.1 = r.1,
                                    _ => ranges.push(r),
                                }
                            }
                        }
                        j += 1;
                    }
                    out.live[slot] += live;
                    if live > 0 {
                        out.touched[slot] += s;
                        out.tails[slot] += free;
                        if free > 0 {
                            out.pieces.push((slot, free, s));
                            out.tail_use.push((s, ranges));
                        }
                    } else if self.stitches.aliased(a, a + s) {
                        out.pinned[slot] += s;
                    } else {
                        out.whole[slot] += s;
                    }
                }
            }
        }
        out
    }
}

/// The events of a trace file, or of a synthetic workload named
/// `churn:SEED`, `churn_wide:SEED` or `multiscale:SEED` (`workload.rs`;
/// `LAYOUT_PROBE_OPS` sets the churn loops' length); `FILE@SEED` is
/// the trace perturbed with that seed; `long:STEPS:SEED:FILE` a run of
/// STEPS steps drawn from FILE's (`workload::longer`); `scaled:K:FILE`
/// the trace with every request K times smaller (a smaller model).
fn load(path: &std::path::Path) -> Vec<crate::trace::TraceEvent> {
    let name = path.to_string_lossy();
    let seed = |s: &str| s.parse::<u64>().expect("a seed");
    // The churn loops' length: `LAYOUT_PROBE_OPS` (the GPU check runs 200,000).
    let ops = || {
        std::env::var("LAYOUT_PROBE_OPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(30_000)
    };
    if let Some(s) = name.strip_prefix("churn_wide:") {
        return crate::workload::churn_wide(s.parse().expect("a seed"), ops());
    }
    if let Some(s) = name.strip_prefix("churn:") {
        return crate::workload::churn(s.parse().expect("a seed"), ops());
    }
    if let Some(s) = name.strip_prefix("multiscale:") {
        return crate::workload::multiscale(seed(s), 60);
    }
    if let Some(rest) = name.strip_prefix("long:") {
        let (steps, rest) = rest.split_once(':').expect("long:STEPS:SEED:FILE");
        let (s, file) = rest.split_once(':').expect("long:STEPS:SEED:FILE");
        let evs = load(std::path::Path::new(file));
        let steps = steps.parse().expect("a number of steps");
        return crate::workload::longer(&evs, steps, seed(s)).expect("a trace with steps");
    }
    if let Some((k, file)) = name.strip_prefix("scaled:").and_then(|r| r.split_once(':')) {
        // Every request `k` times smaller: the same program on a smaller model.
        let k: u64 = k
            .parse()
            .ok()
            .filter(|&k| k > 0)
            .expect("a divisor above 0");
        return load(std::path::Path::new(file))
            .into_iter()
            .map(|mut e| {
                if matches!(e.action, crate::trace::Action::Alloc) {
                    e.size = (e.size / k).max(1);
                }
                e
            })
            .collect();
    }
    if let Some((file, s)) = name.rsplit_once('@') {
        let evs = load(std::path::Path::new(file));
        return crate::workload::perturbed(evs.into_iter(), seed(s)).collect();
    }
    let mut r = crate::trace::TraceReader::open(path).expect("a readable trace");
    r.events().collect()
}

/// Replays `evs` under `conf` on a 140 GiB simulated device, showing
/// `observe` the allocator after every event.
fn replay_each(
    evs: &[crate::trace::TraceEvent],
    conf: &str,
    observe: &mut dyn FnMut(u64, &DeviceAllocator<SimBackend>),
) -> crate::replay::ReplayResult {
    let config = crate::config::Config::parse(conf).expect("a valid config");
    crate::replay::replay_observed(evs.iter().copied(), 140 << 30, &config, observe)
}

/// Replays `path` and returns the breakdowns at the first moments peak
/// reserved and peak allocated were reached, with the stats then.
pub(crate) fn probe(path: &std::path::Path, conf: &str) -> String {
    let evs = load(path);
    let (mut top_r, mut top_a, mut at_r, mut at_a) = (0, 0, 0, 0);
    replay_each(&evs, conf, &mut |i, d: &DeviceAllocator<SimBackend>| {
        let s = d.stats();
        if s.reserved_bytes.all.current > top_r {
            (top_r, at_r) = (s.reserved_bytes.all.current, i);
        }
        if s.allocated_bytes.all.current > top_a {
            (top_a, at_a) = (s.allocated_bytes.all.current, i);
        }
    });
    let mut out = format!("{} ({conf:?})\n", path.display());
    replay_each(&evs, conf, &mut |i, d: &DeviceAllocator<SimBackend>| {
        for (at, what) in [(at_r, "peak reserved"), (at_a, "peak allocated")] {
            if i == at {
                let s = d.stats();
                out += &format!(
                    "at {what} (event {i}): reserved {:.1} MiB, allocated {:.1} MiB\n{}",
                    s.reserved_bytes.all.current as f64 / (1 << 20) as f64,
                    s.allocated_bytes.all.current as f64 / (1 << 20) as f64,
                    d.breakdown().render()
                );
            }
        }
    });
    out
}

/// Every growth of reserved memory past `1.005 ×` the peak of allocated
/// memory so far: the request, and the breakdown just before it. Two
/// replays: the first finds the growths, the second takes the breakdown
/// only before them (taking it at every event is too slow for long runs).
pub(crate) fn growth(path: &std::path::Path, conf: &str) -> String {
    let evs = load(path);
    let mut out = format!("{} ({conf:?}): growth past the bound\n", path.display());
    let mut grew = std::collections::BTreeMap::new();
    let mut last = None;
    replay_each(&evs, conf, &mut |i, d: &DeviceAllocator<SimBackend>| {
        let s = d.stats();
        let (res, peak) = (s.reserved_bytes.all.current, s.allocated_bytes.all.peak);
        if let Some(r0) = last
            && res > r0
            && res as f64 > peak as f64 * 1.005
        {
            grew.insert(i, (r0, res, peak));
        }
        last = Some(res);
    });
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    replay_each(&evs, conf, &mut |i, d: &DeviceAllocator<SimBackend>| {
        let Some(&(r0, res, peak)) = grew.get(&(i + 1)) else {
            return;
        };
        let k = d.breakdown();
        let e = evs[i as usize + 1];
        out += &format!(
            "ev {} {:?} {:.2} MiB: reserved {:.0} -> {:.0} (+{:.0}), peak alloc {:.0}; before: tails L{:.1}/S{:.1} whole L{:.0}/S{:.0} pinned {:.0} (runs {:.0}) pooled {:.0}\n",
            i + 1,
            e.action,
            mib(e.size),
            mib(r0 as u64),
            mib(res as u64),
            mib((res - r0) as u64),
            mib(peak as u64),
            mib(k.tails[1]),
            mib(k.tails[0]),
            mib(k.whole[1]),
            mib(k.whole[0]),
            mib(k.pinned[1]),
            mib(k.run_pinned),
            mib(k.pooled),
        );
    });
    out
}

/// Peak reserved over peak allocated split into its causes, as fractions
/// of peak allocated: `[total, tails, whole free, stitch-pinned, pooled,
/// growth after the peak of allocated memory]`, the middle four read at
/// the (first) peak of allocated memory.
pub(crate) fn split(evs: &[crate::trace::TraceEvent], conf: &str) -> [f64; 6] {
    let (mut top, mut at) = (0, 0);
    let r = replay_each(evs, conf, &mut |i, d: &DeviceAllocator<SimBackend>| {
        if d.stats().allocated_bytes.all.current > top {
            (top, at) = (d.stats().allocated_bytes.all.current, i);
        }
    });
    let mut out = [0.0; 6];
    let peak = r.peak_allocated as f64;
    replay_each(evs, conf, &mut |i, d: &DeviceAllocator<SimBackend>| {
        if i == at {
            let k = d.breakdown();
            let held = d.stats().reserved_bytes.all.current as f64;
            out[1] = (k.tails[0] + k.tails[1]) as f64 / peak;
            out[2] = (k.whole[0] + k.whole[1]) as f64 / peak;
            out[3] = (k.pinned[0] + k.pinned[1]) as f64 / peak;
            out[4] = k.pooled as f64 / peak;
            out[5] = (r.peak_reserved as f64 - held) / peak;
        }
    });
    out[0] = r.peak_reserved as f64 / peak - 1.0;
    out
}

#[cfg(test)]
mod tests {
    use crate::{Config, DeviceAllocator, SimBackend};

    #[test]
    fn the_breakdown_adds_up_to_reserved() {
        let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::default());
        let a = d.malloc(3 << 20, 0).unwrap();
        let b = d.malloc(5000, 0).unwrap();
        let c = d.malloc(40 << 20, 0).unwrap();
        d.free(c).unwrap();
        let k = d.breakdown();
        let sum: u64 = (0..2)
            .map(|i| k.live[i] + k.tails[i] + k.whole[i] + k.pinned[i])
            .sum::<u64>()
            + k.pooled;
        assert_eq!(sum, d.stats().reserved_bytes.all.current as u64);
        assert_eq!(k.live[1], 3 << 20);
        assert_eq!(k.tails[1], 1 << 20, "the rest of the second 2 MiB page");
        assert_eq!(k.tails[0], (2 << 20) - 5120);
        d.free(a).unwrap();
        d.free(b).unwrap();
    }

    /// The causes of R/A over many workloads: `LAYOUT_PROBE=trace[,...]`
    /// perturbed with seeds 0–6, and the synthetic loops with seeds 1–6.
    #[test]
    #[ignore = "a probe over recorded traces, run by hand"]
    fn layout_split_many() {
        use crate::workload::{churn_wide, multiscale, perturbed};
        let conf = std::env::var("LAYOUT_PROBE_CONFIG").unwrap_or_default();
        let mut work = Vec::new();
        for p in std::env::var("LAYOUT_PROBE").unwrap_or_default().split(',') {
            if !p.is_empty() {
                let evs = super::load(std::path::Path::new(p));
                for s in 0..=6 {
                    work.push((
                        format!("{p}/{s}"),
                        perturbed(evs.iter().copied(), s).collect(),
                    ));
                }
            }
        }
        for s in 1..=6 {
            // Python's seeds 5.. : churn_wide/1 is the GPU check's loop.
            work.push((format!("churn_wide/{s}"), churn_wide(4 + s as u32, 30_000)));
            work.push((format!("multiscale/{s}"), multiscale(s, 60)));
        }
        let mut sum = [0.0; 6];
        println!(
            "workload: R/A-1 = at the peak of allocated (tails + whole free + pinned + pooled) + growth after, in % of peak allocated"
        );
        for (name, evs) in &work {
            let v: Vec<crate::trace::TraceEvent> = evs.clone();
            let x = super::split(&v, &conf);
            let pct: Vec<String> = x.iter().map(|f| format!("{:.2}", f * 100.0)).collect();
            println!("{name}: {}", pct.join(" "));
            for (a, b) in sum.iter_mut().zip(x) {
                *a += b / work.len() as f64;
            }
        }
        let pct: Vec<String> = sum.iter().map(|f| format!("{:.2}", f * 100.0)).collect();
        println!("mean: {}", pct.join(" "));
    }

    /// Predicted driver time by tenth of each trace's duration:
    /// `LAYOUT_PROBE=trace[,...] [LAYOUT_PROBE_CONFIG=...]`.
    #[test]
    #[ignore = "a probe over recorded traces, run by hand"]
    fn driver_timeline() {
        let conf = std::env::var("LAYOUT_PROBE_CONFIG").unwrap_or_default();
        let model = crate::CostModel::h200();
        for p in std::env::var("LAYOUT_PROBE").unwrap_or_default().split(',') {
            if p.is_empty() {
                continue;
            }
            let evs = super::load(std::path::Path::new(p));
            let end = evs.last().map_or(1, |e| e.time_ns.max(1));
            let mut ms = [0.0f64; 10];
            let mut last = 0.0;
            super::replay_each(&evs, &conf, &mut |i, d| {
                let tenth = (evs[i as usize].time_ns * 10 / end).min(9) as usize;
                let now = model.predict_ms(&crate::Backend::driver_calls(&d.backend));
                ms[tenth] += now - last;
                last = now;
            });
            let cells: Vec<String> = ms.iter().map(|m| format!("{m:.1}")).collect();
            println!(
                "{p} ({conf:?}), ms per tenth of {:.1} s: {}",
                end as f64 / 1e9,
                cells.join(" ")
            );
        }
    }

    /// Memory calls, unmaps, host waits, handle creations, handles made
    /// accessible and predicted driver µs per training step (steps begin
    /// where the trace's last phase begins, the optimizer's in a training
    /// loop; row 0 is what comes before the first), their sum from the step
    /// a fifth of the way in, and the replay's ratio and driver time.
    /// `LAYOUT_PROBE=trace[,trace...] [LAYOUT_PROBE_ROWS=1]
    /// [LAYOUT_PROBE_HIGHS=K] [LAYOUT_PROBE_EMPTY=K]`: the first prints
    /// the highs of reserved and allocated memory every K steps, the last
    /// puts an `empty_cache` where every K-th step begins (every step for
    /// K = 1), as a loop that empties the cache that often.
    #[test]
    #[ignore = "a probe over recorded traces, run by hand"]
    fn step_calls() {
        use crate::cost::DriverCall as C;
        use crate::trace::EventKind;
        let conf = std::env::var("LAYOUT_PROBE_CONFIG").unwrap_or_default();
        for p in std::env::var("LAYOUT_PROBE").unwrap_or_default().split(',') {
            if p.is_empty() {
                continue;
            }
            let evs = super::load(std::path::Path::new(p));
            let phase = |e: &crate::trace::TraceEvent| match e.kind() {
                EventKind::PhasePush { name } => Some(name),
                _ => None,
            };
            let Some(last) = evs.iter().rev().find_map(phase) else {
                println!("{p}: no phases");
                continue;
            };
            // LAYOUT_PROBE_EMPTY=K: an `empty_cache` as every K-th step begins.
            let evs: Vec<_> = if let Ok(k) = std::env::var("LAYOUT_PROBE_EMPTY") {
                let every: usize = k.parse().unwrap_or(1).max(1);
                let empty = EventKind::EmptyCache { released: 0 };
                let mut n = 0usize;
                evs.iter()
                    .flat_map(|e| {
                        let at = phase(e) == Some(last) && {
                            n += 1;
                            n.is_multiple_of(every)
                        };
                        let lead = at.then(|| e.with_kind(empty));
                        lead.into_iter().chain([*e])
                    })
                    .collect()
            } else {
                evs
            };
            let mut step = 0usize;
            let highs = std::env::var("LAYOUT_PROBE_HIGHS")
                .ok()
                .and_then(|k| k.parse::<usize>().ok())
                .filter(|&k| k > 0);
            let model = crate::cost::CostModel::h200();
            let mut rows = vec![[0u64; 10]];
            // Each device's counts so far (each has its own backend).
            let mut seen: rustc_hash::FxHashMap<u32, [u64; 10]> = Default::default();
            let r = super::replay_each(&evs, &conf, &mut |i, d| {
                if phase(&evs[i as usize]) == Some(last) {
                    step += 1;
                    // LAYOUT_PROBE_HIGHS=K: the highs of reserved and
                    // allocated memory (MiB) as every K-th step begins.
                    if let Some(k) = highs
                        && step.is_multiple_of(k)
                    {
                        let (r, a) = (d.reserved_high(), d.allocated_high().max(1));
                        println!(
                            "step {step}: highs {} / {} MiB, {:.4}",
                            r >> 20,
                            a >> 20,
                            r as f64 / a as f64
                        );
                    }
                    rows.push([0; 10]);
                }
                let c = crate::Backend::driver_calls(&d.backend);
                let now = [
                    c.memory_calls(),
                    c.calls(C::Unmap),
                    c.calls(C::EventSync),
                    c.calls(C::Create),
                    c.handles(C::SetAccess),
                    (model.predict_ms(&c) * 1000.0) as u64,
                    c.calls(C::Map),
                    d.stats.num_defragment as u64,
                    d.stitches.built,
                    d.stitches.taken_whole,
                ];
                let seen = seen.entry(d.device).or_default();
                for j in 0..now.len() {
                    rows[step][j] += now[j] - seen[j];
                }
                *seen = now;
            });
            let warm = rows.len() / 5;
            let late = rows[warm..]
                .iter()
                .fold([0u64; 10], |a, r| std::array::from_fn(|j| a[j] + r[j]));
            println!(
                "{p} {conf:?}: {} steps, R/A {:.4}, {:.1} ms; from step {warm} on: memory calls, unmaps, waits, creates, handles made accessible, predicted µs, maps, moves, stitches built, stitches taken whole {late:?}",
                rows.len() - 1,
                r.peak_reserved as f64 / r.peak_allocated.max(1) as f64,
                r.driver_ms(&model),
            );
            if std::env::var("LAYOUT_PROBE_ROWS").is_ok() {
                for (k, r) in rows.iter().enumerate() {
                    println!("{k:2} {r:?}");
                }
            }
        }
    }

    /// `LAYOUT_PROBE=trace[,trace...] [LAYOUT_PROBE_CONFIG=...]`.
    #[test]
    #[ignore = "a probe over recorded traces, run by hand"]
    fn layout_probe() {
        let conf = std::env::var("LAYOUT_PROBE_CONFIG").unwrap_or_default();
        for p in std::env::var("LAYOUT_PROBE").unwrap_or_default().split(',') {
            if !p.is_empty() {
                println!("{}", super::probe(std::path::Path::new(p), &conf));
                if std::env::var("LAYOUT_PROBE_GROWTH").is_ok() {
                    println!("{}", super::growth(std::path::Path::new(p), &conf));
                }
            }
        }
    }

    /// The handles that hold free tails at one event, each with the live
    /// blocks in it (MiB, `@` the event that allocated the block, `*` a
    /// block that crosses the handle's edge): `LAYOUT_PROBE=trace
    /// LAYOUT_PROBE_AT=event [LAYOUT_PROBE_CONFIG=...]`.
    #[test]
    #[ignore = "a probe over recorded traces, run by hand"]
    fn tails_at() {
        use super::{DeviceAllocator, SimBackend, load, replay_each};
        use crate::block::BlockState;
        use crate::heap::{LARGE, SMALL};
        let p = std::env::var("LAYOUT_PROBE").unwrap();
        let at: u64 = std::env::var("LAYOUT_PROBE_AT").unwrap().parse().unwrap();
        let conf = std::env::var("LAYOUT_PROBE_CONFIG").unwrap_or_default();
        let evs = load(std::path::Path::new(&p));
        let mut born: std::collections::HashMap<(u64, u64), u64> = Default::default();
        replay_each(&evs, &conf, &mut |i, d: &DeviceAllocator<SimBackend>| {
            if i > at {
                return;
            }
            let mut now = std::collections::HashMap::new();
            for pool in [SMALL, LARGE] {
                for &(_, seg) in &d.heap.pools[pool as usize].expandable {
                    let sg = d.heap.segments.get(seg);
                    let mut cur = Some(sg.first);
                    while let Some(id) = cur {
                        let b = &d.heap.blocks[id];
                        if !matches!(b.state, BlockState::Free | BlockState::Unmapped) {
                            let k = (b.ptr, b.size);
                            now.insert(k, *born.get(&k).unwrap_or(&i));
                        }
                        cur = b.next;
                    }
                }
            }
            born = now;
            if i != at {
                return;
            }
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            for (pool, name) in [(SMALL, "small"), (LARGE, "large")] {
                for &(_, seg) in &d.heap.pools[pool as usize].expandable {
                    let sg = d.heap.segments.get(seg);
                    let mut blocks = Vec::new();
                    let mut cur = Some(sg.first);
                    while let Some(id) = cur {
                        let b = &d.heap.blocks[id];
                        blocks.push((b.ptr, b.size, b.state));
                        cur = b.next;
                    }
                    for (a, _, s) in d.pages.handles_in(sg.ptr, sg.ptr + sg.size) {
                        let inside: Vec<_> = blocks
                            .iter()
                            .filter(|b| b.0 < a + s && b.0 + b.1 > a)
                            .collect();
                        let live: Vec<String> = inside
                            .iter()
                            .filter(|b| !matches!(b.2, BlockState::Free))
                            .map(|b| {
                                format!(
                                    "{:.2}@{}{}",
                                    mib(b.1),
                                    born.get(&(b.0, b.1)).unwrap_or(&0),
                                    if b.0 < a || b.0 + b.1 > a + s {
                                        "*"
                                    } else {
                                        ""
                                    }
                                )
                            })
                            .collect();
                        let free: u64 = inside
                            .iter()
                            .filter(|b| matches!(b.2, BlockState::Free))
                            .map(|b| (b.0 + b.1).min(a + s) - b.0.max(a))
                            .sum();
                        if !live.is_empty() && free > 0 {
                            println!(
                                "{name} handle {:.0} MiB at +{:.0}: free {:.2} live {}",
                                mib(s),
                                mib(a - sg.ptr),
                                mib(free),
                                live.join(" ")
                            );
                        }
                    }
                }
            }
        });
    }
}
