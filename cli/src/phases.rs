//! Per-phase peaks: the highest gauges seen while a phase was open.

use std::collections::BTreeMap;

use crate::state::Gauges;

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

/// Phase statistics of one device, keyed by string id.
#[derive(Default)]
pub struct Phases {
    /// By string id.
    pub by_id: BTreeMap<u64, PhaseStats>,
    open: Vec<(u64, u64, u64)>,
}

impl Phases {
    /// A phase opened at `t_ns` with gauges `g`.
    pub fn push(&mut self, id: u64, t_ns: u64, g: &Gauges) {
        let s = self.by_id.entry(id).or_default();
        s.count += 1;
        s.peak_allocated = s.peak_allocated.max(g.allocated);
        s.peak_reserved = s.peak_reserved.max(g.reserved);
        s.peak_active = s.peak_active.max(g.active);
        self.open.push((id, t_ns, g.allocated));
    }

    /// The phase `id` closed at `t_ns` (and any opened inside it).
    pub fn pop(&mut self, id: u64, t_ns: u64) {
        if let Some(i) = self.open.iter().rposition(|o| o.0 == id) {
            for (pid, start, _) in self.open.drain(i..) {
                if let Some(s) = self.by_id.get_mut(&pid) {
                    s.time_ns += t_ns.saturating_sub(start);
                }
            }
        }
    }

    /// Gauges changed upward: raise the peaks of every open phase.
    #[inline]
    pub fn observe(&mut self, g: &Gauges) {
        for &(id, _, base) in &self.open {
            if let Some(s) = self.by_id.get_mut(&id) {
                s.peak_allocated = s.peak_allocated.max(g.allocated);
                s.peak_reserved = s.peak_reserved.max(g.reserved);
                s.peak_active = s.peak_active.max(g.active);
                s.peak_growth = s.peak_growth.max(g.allocated.saturating_sub(base));
            }
        }
    }

    /// An allocation of `size` bytes in the innermost phase.
    #[inline]
    pub fn alloc(&mut self, size: u64) {
        if let Some(&(id, _, _)) = self.open.last()
            && let Some(s) = self.by_id.get_mut(&id)
        {
            s.allocs += 1;
            s.alloc_bytes += size;
        }
    }

    /// Whether any phase is open.
    #[inline]
    pub fn any_open(&self) -> bool {
        !self.open.is_empty()
    }
}
