//! The analysis of a trace: one streaming pass for gauges, peaks, phases,
//! sizes, OOMs and the final state; a second pass, up to the peak, for the
//! layout at the peak, which needs the peak's position found by the first.
//! Reports make one more pass of their own (`commands::report::data`).

use std::collections::BTreeMap;
use std::path::Path;

use gpualloc::trace::{Action, EventKind, TraceEvent};

use crate::analyses::budget::Budget;
use crate::analyses::caching_off::MarkTimes;
use crate::analyses::empty_cache::EmptyCaches;
use crate::analyses::graph_pools::GraphPools;
use crate::analyses::ooms::{self, Oom};
use crate::analyses::phases::Phases;
use crate::analyses::pools::{self, PoolShares};
use crate::analyses::sizes::Sizes;
use crate::analyses::state::{self, DeviceState};
use crate::analyses::streams::{self, StreamShares};
use crate::input::{self, CliError, ScanInfo};

/// A gauge's highest value and where it was reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peak {
    /// Bytes.
    pub value: u64,
    /// Time (ns since start).
    pub time_ns: u64,
    /// Position among the device's events (1-based: events applied).
    pub index: u64,
}

/// Fragmentation at a moment.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Frag {
    /// Time (ns since start).
    pub t_ns: u64,
    /// `1 - largest free / total free`.
    pub external: f64,
    /// `1 - allocated / reserved`.
    pub unallocated: f64,
    /// Largest free piece of reserved memory.
    pub largest_free: u64,
    /// Free reserved bytes.
    pub total_free: u64,
    /// Reserved bytes held by stitches in use past their blocks
    /// ([`DeviceState::stitch_tails`]).
    pub stitch_tails: u64,
}

/// The state at the peak of allocated bytes (second pass, or the report's).
pub struct AtPeak {
    /// Fragmentation there.
    pub frag: Frag,
    /// Reserved bytes there.
    pub reserved: u64,
}

/// Everything learned about one device.
pub struct DeviceAnalysis {
    /// Device index.
    pub device: u32,
    /// Events of the device.
    pub events: u64,
    /// Time of the device's first event (ns since start).
    pub first_ns: u64,
    /// Allocations.
    pub allocs: u64,
    /// Highest allocated bytes.
    pub peak_allocated: Peak,
    /// Highest reserved bytes.
    pub peak_reserved: Peak,
    /// Highest active bytes.
    pub peak_active: Peak,
    /// Allocated bytes when reserved peaked (after the call that raised it).
    pub allocated_at_peak_reserved: u64,
    /// Events applied when the call that raised reserved to its peak had
    /// finished (see [`DeviceAnalysis::settle_peak_reserved`]): where the
    /// state "at peak reserved" is taken.
    pub peak_reserved_settled: u64,
    peak_reserved_open: bool,
    /// Failed allocations.
    pub oom_count: u64,
    /// The first failed allocations, examined.
    pub ooms: Vec<Oom>,
    /// Per-phase figures.
    pub phases: Phases,
    /// Request sizes.
    pub sizes: Sizes,
    /// `empty_cache` calls and the memory created again after them.
    pub empty_caches: EmptyCaches,
    /// Private (CUDA graph) pools: captures and the memory held for them.
    pub graph_pools: GraphPools,
    /// The state after the last event.
    pub state: DeviceState,
    /// The state at the peak (second pass).
    pub at_peak: Option<AtPeak>,
    /// Each stream's reserved and allocated bytes at the peak of reserved
    /// memory (second pass).
    pub streams_at_peak_reserved: Option<StreamShares>,
    /// Each pool's reserved and allocated bytes at the peak of reserved
    /// memory (second pass; none in a trace without reserved memory).
    pub pools_at_peak_reserved: Option<PoolShares>,
}

impl DeviceAnalysis {
    fn new(device: u32) -> DeviceAnalysis {
        DeviceAnalysis {
            device,
            events: 0,
            first_ns: 0,
            allocs: 0,
            peak_allocated: Peak::default(),
            peak_reserved: Peak::default(),
            peak_active: Peak::default(),
            allocated_at_peak_reserved: 0,
            peak_reserved_settled: 0,
            peak_reserved_open: false,
            oom_count: 0,
            ooms: Vec::new(),
            phases: Phases::default(),
            sizes: Sizes::default(),
            empty_caches: EmptyCaches::default(),
            graph_pools: GraphPools::default(),
            state: DeviceState::default(),
            at_peak: None,
            streams_at_peak_reserved: None,
            pools_at_peak_reserved: None,
        }
    }

    #[inline]
    fn apply(&mut self, e: &TraceEvent, budget: &mut Budget) {
        if self.events == 0 {
            self.first_ns = e.time_ns;
        }
        self.events += 1;
        let kind = e.kind();
        self.empty_caches.apply(&kind);
        self.graph_pools.apply(&kind);
        match kind {
            EventKind::Alloc { requested, .. } => {
                self.allocs += 1;
                self.sizes.add(requested);
                self.phases.alloc(requested);
            }
            EventKind::Oom {
                requested,
                device_free,
            } => {
                self.oom_count += 1;
                if self.ooms.len() < ooms::MAX_DETAILED {
                    self.ooms
                        .push(ooms::examine(e, requested, device_free, &self.state));
                }
            }
            EventKind::PhasePop { name } => self.phases.pop(name, e.time_ns),
            _ => {}
        }
        self.state.apply(e, budget);
        let g = self.state.g;
        if let EventKind::PhasePush { name } = kind {
            self.phases.push(name, e.time_ns, &g);
        }
        let events = self.events;
        let at = |value| Peak {
            value,
            time_ns: e.time_ns,
            index: events,
        };
        if g.allocated > self.peak_allocated.value {
            self.peak_allocated = at(g.allocated);
        }
        if g.active > self.peak_active.value {
            self.peak_active = at(g.active);
        }
        self.settle_peak_reserved(e);
        if g.reserved > self.peak_reserved.value {
            self.peak_reserved = at(g.reserved);
            self.allocated_at_peak_reserved = g.allocated;
            self.peak_reserved_settled = self.events;
            self.peak_reserved_open = true;
        }
        if self.phases.any_open()
            && matches!(
                e.action,
                Action::Alloc | Action::SegmentAlloc | Action::SegmentMap
            )
        {
            self.phases.observe(&g);
        }
    }

    /// Follows the call that raised reserved to its peak to its end, so
    /// that the state "at peak reserved" includes the allocation that
    /// needed the memory. A call records the memory it creates and moves
    /// first (`segment_alloc`, or `pages_create` then `segment_map`, with
    /// `segment_unmap`s when pages move) and its `alloc` (or `oom`) last.
    /// A call reads the clock once, so its events share a time stamp; but
    /// older traces, and snapshots, whose entries read the clock one by
    /// one, stamp each event, so those steps count as the call's whatever
    /// their time. The call is over at its `alloc` or `oom`, at any other
    /// event with a new time stamp, or when reserved moves off the peak.
    fn settle_peak_reserved(&mut self, e: &TraceEvent) {
        if !self.peak_reserved_open {
            return;
        }
        let g = self.state.g;
        let ends = matches!(e.action, Action::Alloc | Action::Oom);
        let step = ends
            || matches!(
                e.action,
                Action::SegmentAlloc
                    | Action::SegmentMap
                    | Action::SegmentUnmap
                    | Action::PagesCreate
            );
        let in_call = step || e.time_ns == self.peak_reserved.time_ns;
        if !in_call || g.reserved != self.peak_reserved.value {
            self.peak_reserved_open = false;
            return;
        }
        self.allocated_at_peak_reserved = g.allocated;
        self.peak_reserved_settled = self.events;
        self.peak_reserved_open = !ends;
    }
}

/// Everything learned about a trace.
pub struct Analysis {
    /// Header, strings, totals of the scan.
    pub info: ScanInfo,
    /// Time of the last event (ns since start).
    pub duration_ns: u64,
    /// Per device.
    pub devices: BTreeMap<u32, DeviceAnalysis>,
    /// Marks by device and name, for the switches of the caching allocator.
    pub marks: MarkTimes,
}

/// First pass over `path`.
pub fn analyze(path: &Path, allow_truncated: bool) -> Result<Analysis, CliError> {
    let mut devices: BTreeMap<u32, DeviceAnalysis> = BTreeMap::new();
    let mut last: Option<(u32, DeviceAnalysis)> = None;
    let mut duration_ns = 0u64;
    let mut marks = MarkTimes::default();
    let mut budget = Budget::default();
    let info = input::scan(path, allow_truncated, |e| {
        duration_ns = duration_ns.max(e.time_ns);
        if let EventKind::Mark { name } = e.kind() {
            marks.add(e.device, name, e.time_ns);
        }
        // Events come in per-device blocks: keep the current device at hand.
        if last.as_ref().is_none_or(|(d, _)| *d != e.device) {
            if let Some((d, a)) = last.take() {
                devices.insert(d, a);
            }
            let a = devices
                .remove(&e.device)
                .unwrap_or_else(|| DeviceAnalysis::new(e.device));
            last = Some((e.device, a));
        }
        last.as_mut().expect("set above").1.apply(e, &mut budget);
    })?;
    if let Some((d, a)) = last {
        devices.insert(d, a);
    }
    budget.warn_refused(path);
    if let Some(end) = &info.end {
        duration_ns = duration_ns.max(end.end_ns);
    }
    for d in devices.values_mut() {
        d.phases.finish(duration_ns);
    }
    Ok(Analysis {
        info,
        duration_ns,
        devices,
        marks,
    })
}

/// Second pass: the state at each device's allocated peak, and its streams
/// at the reserved peak once the call that raised it had finished (the file
/// is read up to the last of them).
pub fn second_pass(path: &Path, allow_truncated: bool, a: &mut Analysis) -> Result<(), CliError> {
    let mut states: BTreeMap<u32, (DeviceState, u64)> = a
        .devices
        .keys()
        .map(|&d| (d, (DeviceState::default(), 0u64)))
        .collect();
    let mut budget = Budget::default();
    let targets: BTreeMap<u32, (u64, u64)> = a
        .devices
        .iter()
        .map(|(&d, x)| (d, (x.peak_allocated.index, x.peak_reserved_settled)))
        .collect();
    let mut remaining: usize = targets
        .values()
        .map(|&(p, r)| usize::from(p > 0) + usize::from(r > 0))
        .sum();
    let mut at_peak: BTreeMap<u32, AtPeak> = BTreeMap::new();
    let mut at_reserved: BTreeMap<u32, (StreamShares, Option<PoolShares>)> = BTreeMap::new();
    input::scan_until(path, allow_truncated, |e| {
        let Some((s, n)) = states.get_mut(&e.device) else {
            return true;
        };
        s.apply(e, &mut budget);
        *n += 1;
        let (peak, reserved) = targets[&e.device];
        if *n == peak {
            at_peak.insert(
                e.device,
                AtPeak {
                    frag: snapshot_frag(e.time_ns, s),
                    reserved: s.g.reserved,
                },
            );
            remaining -= 1;
        }
        if *n == reserved {
            at_reserved.insert(e.device, (streams::shares(s), pools::shares(s)));
            remaining -= 1;
        }
        remaining > 0
    })?;
    for d in states.keys() {
        let dev = a.devices.get_mut(d).expect("same keys");
        dev.at_peak = at_peak.remove(d);
        let (streams, pools) = at_reserved.remove(d).unzip();
        dev.streams_at_peak_reserved = streams;
        dev.pools_at_peak_reserved = pools.flatten();
    }
    Ok(())
}

/// Fragmentation of `s` at `t_ns`.
pub fn snapshot_frag(t_ns: u64, s: &DeviceState) -> Frag {
    let (largest_free, total_free) = s.free_space();
    Frag {
        t_ns,
        external: state::external_fragmentation(largest_free, total_free),
        unallocated: state::unallocated_fraction(&s.g),
        largest_free,
        total_free,
        stitch_tails: s.stitch_tails(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpualloc::trace::Pool;

    const MIB: u64 = 1 << 20;

    fn ev(time_ns: u64, kind: EventKind) -> TraceEvent {
        TraceEvent::from_kind(time_ns, 0, 0, 0, kind)
    }

    fn alloc(addr: u64, size: u64) -> EventKind {
        EventKind::Alloc {
            addr,
            requested: size,
            block_size: size,
        }
    }

    fn run(events: &[TraceEvent]) -> DeviceAnalysis {
        let mut d = DeviceAnalysis::new(0);
        let mut budget = Budget::default();
        for e in events {
            d.apply(e, &mut budget);
        }
        d
    }

    #[test]
    fn peak_reserved_is_taken_after_the_allocation_of_a_page_pool_call() {
        // gpualloc's page pool: one call creates pages, maps them, then
        // allocates, all at one time stamp.
        let map = EventKind::SegmentMap {
            addr: 0x100_0000,
            size: 20 * MIB,
            pool: Pool::Code(1),
        };
        let d = run(&[
            ev(10, EventKind::PagesCreate { bytes: 20 * MIB }),
            ev(10, map),
            ev(10, alloc(0x100_0000, 20 * MIB)),
            // The next call, at the same time stamp: not part of the peak's.
            ev(10, alloc(0x200_0000, 0)),
            ev(
                20,
                EventKind::FreeRequested {
                    addr: 0x100_0000,
                    requested: 20 * MIB,
                    block_size: 20 * MIB,
                },
            ),
        ]);
        assert_eq!(d.peak_reserved.value, 20 * MIB);
        assert_eq!(d.peak_reserved.index, 1, "where reserved rose");
        assert_eq!(d.allocated_at_peak_reserved, 20 * MIB);
        assert_eq!(d.peak_reserved_settled, 3, "after the call's alloc");
    }

    #[test]
    fn a_call_that_raised_reserved_ends_at_its_alloc_or_another_event() {
        let seg = EventKind::SegmentAlloc {
            addr: 0,
            size: 20 * MIB,
            pool: Pool::Code(1),
        };
        let free = EventKind::FreeRequested {
            addr: 0x900_0000,
            requested: 0,
            block_size: 0,
        };
        let d = run(&[
            ev(5, alloc(0x900_0000, 0)),
            ev(10, seg),
            ev(10, EventKind::Mark { name: 0 }),
            // Another call: the peak's had no allocation.
            ev(11, free),
            ev(12, alloc(0, MIB)),
        ]);
        assert_eq!(d.allocated_at_peak_reserved, 0);
        assert_eq!(d.peak_reserved_settled, 3);
        // Each event stamped on its own (older traces, snapshots).
        let map = EventKind::SegmentMap {
            addr: 0,
            size: 20 * MIB,
            pool: Pool::Code(1),
        };
        let d = run(&[
            ev(10_000, EventKind::PagesCreate { bytes: 20 * MIB }),
            ev(11_000, map),
            ev(12_000, alloc(0, MIB)),
            ev(13_000, alloc(MIB, MIB)),
        ]);
        assert_eq!(d.allocated_at_peak_reserved, MIB);
        assert_eq!(d.peak_reserved_settled, 3);
    }
}
