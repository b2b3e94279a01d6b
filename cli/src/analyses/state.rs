//! The allocator state that a trace implies, rebuilt event by event: live
//! blocks, reserved address ranges, the gauges, and the open phases.
//!
//! Reserved ranges come from `segment_alloc`/`segment_free` (kept apart even
//! when adjacent, as plain segments never merge) and from
//! `segment_map`/`segment_unmap` (merged with adjacent mapped ranges, as pages
//! of an expandable segment are contiguous). Free space is reserved space not
//! covered by a live block; its largest contiguous piece is the "largest free
//! block" of the fragmentation figures.
//!
//! Reserved bytes follow the same events, except in traces that hold
//! `pages_create`/`pages_release` (gpualloc's page pool): there physical
//! memory is created and released by those, and mapping or unmapping only
//! moves it, so `segment_map`/`segment_unmap` leave reserved as it is.
//!
//! What the states of a trace's devices hold is bounded for all of them
//! together, by the [`Budget`] of the pass that applies the events.

use std::collections::BTreeMap;

use gpualloc::trace::{EventKind, MemoryCap, Pool, TraceEvent};
use rustc_hash::FxHashMap;

use crate::analyses::budget::Budget;
use crate::analyses::range_set::RangeSet;

/// No phase open.
pub const NO_PHASE: u64 = u64::MAX;

/// A block handed out and not yet reusable.
#[derive(Clone, Copy, Debug)]
pub struct Live {
    /// Block bytes (rounded).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    /// Stream.
    pub stream: u64,
    /// Innermost phase at allocation (string id) or [`NO_PHASE`].
    pub phase: u64,
    /// Allocation time.
    pub time_ns: u64,
    /// Freed by the caller, waiting on stream events.
    pub pending: bool,
}

/// A reserved address range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Bytes.
    pub size: u64,
    /// Stream it was reserved for.
    pub stream: u64,
    /// Pool code (`trace::pool_code`).
    pub pool: u64,
    /// Mapped pages of an expandable segment.
    pub expandable: bool,
    /// Made up to hold an allocation whose segment the trace never showed.
    pub synthetic: bool,
}

/// Bytes by kind, PyTorch's meanings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gauges {
    /// Live allocations (block sizes).
    pub allocated: u64,
    /// Allocated plus blocks waiting on events.
    pub active: u64,
    /// Held from the device.
    pub reserved: u64,
    /// Bytes asked for by live allocations.
    pub requested: u64,
}

/// One device's state.
#[derive(Default)]
pub struct DeviceState {
    /// Live and pending blocks by address.
    pub live: FxHashMap<u64, Live>,
    /// Reserved ranges by start address.
    pub regions: BTreeMap<u64, Region>,
    /// Stitched ranges (`STITCH_CODE`): second mappings of pages counted in
    /// `regions`, by start address, with their size.
    pub aliases: BTreeMap<u64, u64>,
    /// The trace records which ranges a memory snapshot lists
    /// (`segment_list` / `segment_unlist`, trace minor 4, Note [Listed
    /// ranges] in `allocator/src/trace/event.rs`): the pages a stitch in
    /// use holds at home are known, not guessed.
    pub listing: bool,
    /// Home runs of stitches in use: reserved, neither free nor allocated.
    pub held_home: RangeSet,
    /// The listed parts of stitches in use.
    pub listed_stitches: RangeSet,
    /// Current gauges.
    pub g: Gauges,
    /// Open phases, outermost first (string ids).
    pub phases: Vec<u64>,
    /// Times of the marks.
    pub marks: Vec<u64>,
    /// Times each top-level phase was opened, by string id.
    pub top_pushes: FxHashMap<u64, Vec<u64>>,
    /// Frees and record_streams of blocks allocated before the trace began.
    pub unknown: u64,
    /// The trace counts physical memory with `pages_create`/`pages_release`.
    pub pooled: bool,
    /// The trace has reserved memory (a segment or page event).
    pub reserves: bool,
    /// Events that contradict the state (overflowing ranges, gauges that
    /// would go negative, allocated above reserved); the first is warned of.
    pub inconsistent: u64,
    /// Caps on reserved memory the program set while it ran.
    pub caps: SetCaps,
}

/// Caps on reserved memory set while the program ran (`memory_limit`
/// records), over those of the recorded configuration; `None` where the
/// program set none.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SetCaps {
    /// The fraction of device memory last set.
    pub fraction: Option<f64>,
    /// The byte cap last set (`Some(None)`: cleared).
    pub bytes: Option<Option<u64>>,
    /// The device's memory as the allocator read it (a fraction is taken
    /// of it), from the records that carry it.
    pub device_total: Option<u64>,
}

/// The end of the range `[addr, addr + size)`; `None` when it passes the
/// end of the address space (a corrupt file).
pub fn range_end(addr: u64, size: u64) -> Option<u64> {
    addr.checked_add(size)
}

impl DeviceState {
    /// Reserved bytes no range holds: physical memory held unmapped
    /// (gpualloc's page pool), or 0 where the ranges add up to more.
    pub fn outside_ranges(&self) -> u64 {
        let in_ranges = self
            .regions
            .values()
            .fold(0u64, |t, r| t.saturating_add(r.size));
        self.g.reserved.saturating_sub(in_ranges)
    }

    /// Applies one event, charging what the state grows by to `budget`
    /// (shared by all the devices of the trace). An event that contradicts
    /// the state, or whose block or range the budget has no room for, is
    /// applied as far as it makes sense, counted in `inconsistent`, and the
    /// first one is warned of: a corrupt file never panics or wraps a gauge.
    /// Marks and phases past the budget are not kept; the budget counts them.
    #[inline]
    pub fn apply(&mut self, e: &TraceEvent, budget: &mut Budget) {
        let held = (self.live.len(), self.ranges());
        self.apply_within(e, budget);
        budget.live.moved(held.0, self.live.len());
        budget.ranges.moved(held.1, self.ranges());
    }

    /// Reserved and stitched ranges held.
    fn ranges(&self) -> usize {
        self.regions.len() + self.aliases.len() + self.held_home.len() + self.listed_stitches.len()
    }

    #[inline]
    fn apply_within(&mut self, e: &TraceEvent, budget: &mut Budget) {
        use EventKind as K;
        let kind = e.kind();
        let span = match kind {
            K::Alloc { block_size, .. } | K::Free { block_size, .. } => block_size,
            K::SegmentAlloc { size, .. }
            | K::SegmentMap { size, .. }
            | K::SegmentUnmap { size, .. }
            | K::SegmentList { size, .. }
            | K::SegmentUnlist { size, .. } => size,
            _ => 0,
        };
        if range_end(e.addr, span).is_none() {
            return self.contradiction(e, "a range past the end of the address space");
        }
        let full = match kind {
            K::Alloc { addr, .. } => !budget.live.room() && !self.live.contains_key(&addr),
            K::SegmentAlloc { .. }
            | K::SegmentMap { .. }
            | K::SegmentList { .. }
            | K::SegmentUnlist { .. } => !budget.ranges.room(),
            // An unmap inside a range splits it in two; one at either end
            // only shortens it.
            K::SegmentUnmap { pool, size, .. } => {
                pool != Pool::Stitch && !budget.ranges.room() && self.splits(e.addr, size)
            }
            _ => false,
        };
        if full {
            let max = budget.live.max();
            return self.contradiction(
                e,
                format_args!(
                    "more live blocks or ranges than are tracked ({max} each, all devices)"
                ),
            );
        }
        match kind {
            K::Alloc {
                addr,
                requested,
                block_size,
            } => {
                let phase = self.phases.last().copied().unwrap_or(NO_PHASE);
                let old = self.live.insert(
                    addr,
                    Live {
                        size: block_size,
                        requested,
                        stream: e.stream,
                        phase,
                        time_ns: e.time_ns,
                        pending: false,
                    },
                );
                if let Some(o) = old {
                    self.sub(e, |g| &mut g.allocated, if o.pending { 0 } else { o.size });
                    self.sub(e, |g| &mut g.active, o.size);
                    self.sub(e, |g| &mut g.requested, o.requested);
                    self.contradiction(e, "an allocation of a block already live");
                }
                self.add(e, |g| &mut g.allocated, block_size);
                self.add(e, |g| &mut g.active, block_size);
                self.add(e, |g| &mut g.requested, requested);
                if self.reserves && self.g.allocated > self.g.reserved {
                    self.contradiction(e, "allocated bytes above reserved bytes");
                }
            }
            K::FreeRequested { addr, .. } => match self.live.get_mut(&addr) {
                Some(l) if !l.pending => {
                    l.pending = true;
                    let size = l.size;
                    self.sub(e, |g| &mut g.allocated, size);
                }
                _ => self.unknown += 1,
            },
            K::FreeCompleted { addr, .. } => {
                if let Some(l) = self.live.remove(&addr) {
                    if !l.pending {
                        self.sub(e, |g| &mut g.allocated, l.size);
                    }
                    self.sub(e, |g| &mut g.active, l.size);
                    self.sub(e, |g| &mut g.requested, l.requested);
                }
            }
            K::SegmentAlloc { addr, size, pool } => {
                self.reserves = true;
                self.regions.insert(
                    addr,
                    Region {
                        size,
                        stream: e.stream,
                        pool: pool.code(),
                        expandable: false,
                        synthetic: false,
                    },
                );
                self.add(e, |g| &mut g.reserved, size);
            }
            K::SegmentFree { addr, size, .. } if self.regions.remove(&addr).is_some() => {
                self.held_home.remove(addr, size);
                self.sub(e, |g| &mut g.reserved, size);
            }
            K::SegmentMap {
                addr,
                size,
                pool: Pool::Stitch,
            } => {
                self.aliases.insert(addr, size);
            }
            K::SegmentUnmap {
                addr,
                pool: Pool::Stitch,
                ..
            } => {
                if let Some(size) = self.aliases.remove(&addr) {
                    self.listed_stitches.remove(addr, size);
                }
            }
            K::SegmentUnlist { addr, size, pool } => {
                self.listing = true;
                if pool == Pool::Stitch {
                    self.listed_stitches.remove(addr, size);
                } else {
                    self.held_home.insert(addr, size);
                }
            }
            K::SegmentList { addr, size, pool } => {
                self.listing = true;
                if pool == Pool::Stitch {
                    self.listed_stitches.insert(addr, size);
                } else {
                    self.held_home.remove(addr, size);
                }
            }
            K::SegmentMap { addr, size, pool } => {
                self.reserves = true;
                self.map(addr, size, e.stream, pool.code());
                if !self.pooled {
                    self.add(e, |g| &mut g.reserved, size);
                }
            }
            K::SegmentUnmap { addr, size, .. } if self.unmap(addr, size) && !self.pooled => {
                self.sub(e, |g| &mut g.reserved, size);
            }
            K::PagesCreate { bytes } => {
                self.pooled = true;
                self.reserves = true;
                self.add(e, |g| &mut g.reserved, bytes);
            }
            K::PagesRelease { bytes } => {
                self.pooled = true;
                self.sub(e, |g| &mut g.reserved, bytes);
            }
            K::PhasePush { name } => {
                if self.phases.is_empty() && budget.boundaries.take() {
                    self.top_pushes.entry(name).or_default().push(e.time_ns);
                }
                if budget.open.take() {
                    self.phases.push(name);
                }
            }
            K::PhasePop { name } => {
                if let Some(i) = self.phases.iter().rposition(|&p| p == name) {
                    budget.open.moved(self.phases.len(), i);
                    self.phases.truncate(i);
                }
            }
            K::Mark { .. } if budget.boundaries.take() => self.marks.push(e.time_ns),
            K::MemoryLimit { cap, device_total } => {
                match cap {
                    // As the allocator, which refuses what is no fraction
                    // (a damaged file's NaN included).
                    MemoryCap::Fraction(bits)
                        if gpualloc::is_memory_fraction(f64::from_bits(bits)) =>
                    {
                        self.caps.fraction = Some(f64::from_bits(bits))
                    }
                    MemoryCap::Bytes(b) => self.caps.bytes = Some(b),
                    _ => {}
                }
                if device_total > 0 {
                    self.caps.device_total = Some(device_total);
                }
            }
            _ => {}
        }
    }

    fn add(&mut self, e: &TraceEvent, gauge: fn(&mut Gauges) -> &mut u64, n: u64) {
        let g = gauge(&mut self.g);
        match g.checked_add(n) {
            Some(v) => *g = v,
            None => {
                *g = u64::MAX;
                self.contradiction(e, "a gauge above 2^64 bytes");
            }
        }
    }

    fn sub(&mut self, e: &TraceEvent, gauge: fn(&mut Gauges) -> &mut u64, n: u64) {
        let g = gauge(&mut self.g);
        match g.checked_sub(n) {
            Some(v) => *g = v,
            None => {
                *g = 0;
                self.contradiction(e, "a gauge below zero");
            }
        }
    }

    #[cold]
    fn contradiction(&mut self, e: &TraceEvent, what: impl std::fmt::Display) {
        self.inconsistent += 1;
        if self.inconsistent == 1 {
            let msg = format!(
                "device {}: the {} event at {} ns (address {:#x}, {} bytes) gives {what}: the trace is inconsistent (damaged, or recorded after memory was in use); its figures may be wrong",
                e.device,
                e.action.name(),
                e.time_ns,
                e.addr,
                e.size
            );
            crate::input::warn_once_in_file(&format!("inconsistent device {}", e.device), &msg);
        }
    }

    fn map(&mut self, addr: u64, size: u64, stream: u64, pool: u64) {
        let (mut start, mut len) = (addr, size);
        if let Some((&s, r)) = self.regions.range(..addr).next_back()
            && r.expandable
            && range_end(s, r.size) == Some(addr)
            && r.stream == stream
        {
            start = s;
            len += r.size;
        }
        let end = addr.saturating_add(size);
        if let Some(r) = self.regions.get(&end).copied()
            && r.expandable
            && r.stream == stream
            && range_end(start, len.saturating_add(r.size)).is_some()
        {
            self.regions.remove(&end);
            len += r.size;
        }
        self.regions.insert(
            start,
            Region {
                size: len,
                stream,
                pool,
                expandable: true,
                synthetic: false,
            },
        );
    }

    /// Whether unmapping `size` bytes at `addr` would leave two pieces of
    /// a reserved range (mapped space on both sides of it).
    fn splits(&self, addr: u64, size: u64) -> bool {
        self.regions
            .range(..addr)
            .next_back()
            .is_some_and(|(&s, r)| {
                // `unmap` leaves plain segments alone.
                r.expandable
                    && match (range_end(addr, size), range_end(s, r.size)) {
                        (Some(end), Some(r_end)) => addr < r_end && end < r_end,
                        _ => false,
                    }
            })
    }

    fn unmap(&mut self, addr: u64, size: u64) -> bool {
        let Some((&s, &r)) = self.regions.range(..=addr).next_back() else {
            return false;
        };
        let (Some(end), Some(r_end)) = (range_end(addr, size), range_end(s, r.size)) else {
            return false;
        };
        if !r.expandable || end > r_end {
            return false;
        }
        // No stitch holds pages that are gone (a damaged trace may say so).
        self.held_home.remove(addr, size);
        self.regions.remove(&s);
        if addr > s {
            self.regions.insert(
                s,
                Region {
                    size: addr - s,
                    ..r
                },
            );
        }
        if end < r_end {
            self.regions.insert(
                end,
                Region {
                    size: r_end - end,
                    ..r
                },
            );
        }
        true
    }

    /// Whether [`Self::iterations`] are the ends of steps (marks, which
    /// `install()` records as each optimizer step ends) rather than their
    /// starts (the openings of a top-level phase).
    pub fn iterations_end_steps(&self) -> bool {
        self.marks.len() >= 3
    }

    /// Iteration boundaries: the marks when there are at least three, else
    /// the openings of the most frequent top-level phase.
    pub fn iterations(&self) -> &[u64] {
        if self.marks.len() >= 3 {
            return &self.marks;
        }
        // Ties (the automatic `backward` and `optimizer`, opened once a
        // step each) go to the phase opened first, so that the answer does
        // not depend on the map's order.
        self.top_pushes
            .values()
            .max_by_key(|v| (v.len(), std::cmp::Reverse(v.first().copied())))
            .map_or(&[], |v| v.as_slice())
    }

    /// Live blocks sorted by address.
    pub fn sorted_live(&self) -> Vec<(u64, Live)> {
        let mut v: Vec<(u64, Live)> = self.live.iter().map(|(&a, &l)| (a, l)).collect();
        v.sort_unstable_by_key(|x| x.0);
        v
    }

    /// `(largest free piece, total free)` of reserved memory.
    pub fn free_space(&self) -> (u64, u64) {
        let live = self.sorted_live();
        if self.listing {
            // Exact: the pages a stitch in use holds at home are taken.
            return free_in_regions(&self.regions, &self.taken(&live));
        }
        let spans: Vec<(u64, u64)> = live.iter().map(|(a, l)| (*a, l.size)).collect();
        let (largest, total) = free_in_regions(&self.regions, &spans);
        // Traces before minor 4 do not say which home pages a stitch in
        // use holds: a live block in a stitch holds as many as the stitch
        // maps, which look free above.
        let claimed: u64 = self
            .aliases
            .iter()
            .filter(|&(&a, &size)| {
                let i = live.partition_point(|l| l.0 < a);
                i < live.len() && live[i].0 < a.saturating_add(size)
            })
            .map(|(_, &size)| size)
            .sum();
        let total = total.saturating_sub(claimed);
        (largest.min(total), total)
    }

    /// The largest free piece of the memory reserved for `stream` (in
    /// traces before minor 4, pages a stitch in use claims are not told
    /// apart: bound it by [`free_space`](Self::free_space)'s).
    pub fn largest_free_on_stream(&self, stream: u64) -> u64 {
        let own: BTreeMap<u64, Region> = self
            .regions
            .iter()
            .filter(|(_, r)| r.stream == stream)
            .map(|(&a, r)| (a, *r))
            .collect();
        free_in_regions(&own, &self.taken(&self.sorted_live())).0
    }

    /// Reserved bytes that stitches in use hold past their blocks (a
    /// cached stitch taken by a smaller request holds all its pages at
    /// home): neither free nor allocated. 0 where the trace does not list
    /// (Note [Listed ranges]).
    pub fn stitch_tails(&self) -> u64 {
        if self.listed_stitches.is_empty() {
            return 0;
        }
        let live = self.sorted_live();
        self.listed_stitches.iter().fold(0u64, |t, (a, n)| {
            let i = live.partition_point(|l| l.0 < a);
            let used: u64 = live[i..]
                .iter()
                .take_while(|l| l.0 < a.saturating_add(n))
                .map(|l| l.1.size)
                .sum();
            t.saturating_add(n.saturating_sub(used))
        })
    }

    /// What is not free in reserved memory, sorted by address: the live
    /// blocks and the home runs stitches in use hold.
    fn taken(&self, live: &[(u64, Live)]) -> Vec<(u64, u64)> {
        let mut spans: Vec<(u64, u64)> = live.iter().map(|(a, l)| (*a, l.size)).collect();
        if !self.held_home.is_empty() {
            spans.extend(self.held_home.iter());
            spans.sort_unstable();
        }
        spans
    }
}

/// Free space inside `regions` around the `taken` spans (address, bytes;
/// sorted by address).
fn free_in_regions(regions: &BTreeMap<u64, Region>, taken: &[(u64, u64)]) -> (u64, u64) {
    let mut i = 0;
    let (mut largest, mut total) = (0u64, 0u64);
    for (&start, r) in regions {
        let end = start.saturating_add(r.size);
        while i < taken.len() && taken[i].0 < start {
            i += 1;
        }
        let mut cur = start;
        while i < taken.len() && taken[i].0 < end {
            let gap = taken[i].0.saturating_sub(cur);
            largest = largest.max(gap);
            total += gap;
            cur = cur.max(taken[i].0.saturating_add(taken[i].1));
            i += 1;
        }
        let gap = end.saturating_sub(cur);
        largest = largest.max(gap);
        total += gap;
    }
    (largest, total)
}

/// `1 - largest free / total free` (0 with nothing free).
pub fn external_fragmentation(largest: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        1.0 - largest as f64 / total as f64
    }
}

/// `1 - allocated / reserved` (0 with nothing reserved).
pub fn unallocated_fraction(g: &Gauges) -> f64 {
    unallocated(g.allocated, g.reserved)
}

/// `1 - allocated / reserved`, never negative: allocated above reserved
/// (an inconsistent trace, warned of when read) counts as 0 unallocated.
pub fn unallocated(allocated: u64, reserved: u64) -> f64 {
    if reserved == 0 {
        0.0
    } else {
        1.0 - allocated.min(reserved) as f64 / reserved as f64
    }
}

#[cfg(test)]
mod tests;
