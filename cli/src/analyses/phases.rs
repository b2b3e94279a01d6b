//! Per-phase peaks: the highest gauges seen while a phase was open.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::analyses::state::Gauges;

/// Open phases followed at once. Programs nest a few; only a trace whose
/// pushes are never popped (damaged, or crafted) goes deeper, and every
/// allocation would then visit every open phase (a 60 MB file of unpopped
/// pushes ran for minutes). Deeper pushes are counted, not followed.
const MAX_OPEN: usize = 256;

/// Figures of one phase name (all its occurrences together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhaseStats {
    /// Times the phase was opened.
    pub count: u64,
    /// Highest allocated bytes while open.
    pub peak_allocated: u64,
    /// Highest reserved bytes while open.
    pub peak_reserved: u64,
    /// Highest active bytes while open.
    pub peak_active: u64,
    /// Allocations made while it was the innermost phase.
    pub allocs: u64,
    /// Bytes requested by those allocations.
    pub alloc_bytes: u64,
    /// Highest growth of allocated bytes over the value at opening.
    pub peak_growth: u64,
    /// Time spent open (ns, over all occurrences).
    pub time_ns: u64,
}

/// Phase statistics of one device.
#[derive(Default)]
pub struct Phases {
    /// By string id (filled by [`finish`](Self::finish)).
    pub by_id: BTreeMap<u64, PhaseStats>,
    stats: Vec<PhaseStats>,
    ids: Vec<u64>,
    slot: FxHashMap<u64, usize>,
    /// Open phases: (slot, opened at, allocated at opening).
    open: Vec<(usize, u64, u64)>,
}

impl Phases {
    /// A phase opened at `t_ns` with gauges `g`.
    pub fn push(&mut self, id: u64, t_ns: u64, g: &Gauges) {
        let slot = *self.slot.entry(id).or_insert_with(|| {
            self.stats.push(PhaseStats::default());
            self.ids.push(id);
            self.stats.len() - 1
        });
        self.stats[slot].count += 1;
        if self.open.len() < MAX_OPEN {
            self.open.push((slot, t_ns, g.allocated));
            self.observe(g);
        }
    }

    /// The phase `id` closed at `t_ns` (and any opened inside it).
    pub fn pop(&mut self, id: u64, t_ns: u64) {
        let Some(&slot) = self.slot.get(&id) else {
            return;
        };
        if let Some(i) = self.open.iter().rposition(|o| o.0 == slot) {
            self.close_from(i, t_ns);
        }
    }

    /// Closes the open phases from the `i`-th outermost on at `t_ns`. A
    /// phase open inside itself (a recursive name) is timed once, by its
    /// outermost occurrence.
    fn close_from(&mut self, i: usize, t_ns: u64) {
        let closed: Vec<_> = self.open.drain(i..).collect();
        for (k, &(s, start, _)) in closed.iter().enumerate() {
            let outer = self.open.iter().chain(&closed[..k]).any(|o| o.0 == s);
            if !outer {
                self.stats[s].time_ns += t_ns.saturating_sub(start);
            }
        }
    }

    /// Gauges went up: raise the peaks of every open phase.
    #[inline]
    pub fn observe(&mut self, g: &Gauges) {
        for &(slot, _, base) in &self.open {
            let s = &mut self.stats[slot];
            s.peak_allocated = s.peak_allocated.max(g.allocated);
            s.peak_reserved = s.peak_reserved.max(g.reserved);
            s.peak_active = s.peak_active.max(g.active);
            s.peak_growth = s.peak_growth.max(g.allocated.saturating_sub(base));
        }
    }

    /// An allocation of `size` bytes in the innermost phase.
    #[inline]
    pub fn alloc(&mut self, size: u64) {
        if let Some(&(slot, _, _)) = self.open.last() {
            self.stats[slot].allocs += 1;
            self.stats[slot].alloc_bytes = self.stats[slot].alloc_bytes.saturating_add(size);
        }
    }

    /// Whether any phase is open.
    #[inline]
    pub fn any_open(&self) -> bool {
        !self.open.is_empty()
    }

    /// Publishes the figures in [`by_id`](Self::by_id); a phase still open
    /// at the trace's end (`end_ns`) counts as open until then.
    pub fn finish(&mut self, end_ns: u64) {
        self.close_from(0, end_ns);
        self.by_id = self
            .ids
            .iter()
            .copied()
            .zip(self.stats.iter().copied())
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_belong_to_every_open_phase() {
        let g = |allocated| Gauges {
            allocated,
            active: allocated,
            reserved: 2 * allocated,
            requested: 0,
        };
        let mut p = Phases::default();
        p.push(1, 0, &g(10));
        p.push(2, 5, &g(10));
        p.alloc(7);
        p.observe(&g(50));
        p.pop(2, 10);
        p.observe(&g(40));
        p.pop(1, 20);
        p.observe(&g(99));
        p.push(3, 30, &g(99)); // never closed
        p.finish(100);
        assert_eq!(p.by_id[&1].peak_allocated, 50);
        assert_eq!(p.by_id[&2].peak_growth, 40);
        assert_eq!(p.by_id[&2].allocs, 1);
        assert_eq!((p.by_id[&1].time_ns, p.by_id[&2].time_ns), (20, 5));
        assert_eq!(p.by_id[&3].time_ns, 70, "open until the end");
    }

    #[test]
    fn a_phase_open_inside_itself_is_timed_once() {
        let g = Gauges::default();
        let mut p = Phases::default();
        p.push(1, 0, &g);
        p.push(2, 1, &g);
        p.push(1, 2, &g); // 1 inside 2 inside 1
        p.pop(1, 4); // the inner one
        p.pop(2, 6);
        p.pop(1, 10);
        p.push(3, 10, &g);
        p.push(4, 11, &g);
        p.push(4, 12, &g);
        p.pop(3, 20); // closes both 4s inside it
        p.push(5, 20, &g);
        p.push(5, 25, &g);
        p.finish(30);
        let t = |id| p.by_id[&id].time_ns;
        assert_eq!((t(1), t(2), t(3), t(4), t(5)), (10, 5, 10, 9, 10));
        assert_eq!(p.by_id[&1].count, 2);
    }

    #[test]
    fn pushes_never_popped_are_counted_but_followed_only_so_deep() {
        let g = Gauges {
            allocated: 10,
            active: 10,
            reserved: 20,
            requested: 0,
        };
        let mut p = Phases::default();
        for i in 0..100_000u64 {
            p.push(i % 3, i, &g);
            p.alloc(1);
        }
        assert_eq!(p.open.len(), MAX_OPEN);
        p.finish(200_000);
        assert_eq!(p.by_id.values().map(|s| s.count).sum::<u64>(), 100_000);
        assert_eq!(p.by_id[&0].peak_allocated, 10);
    }
}
