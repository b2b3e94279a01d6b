//! Gauges over time in a bounded number of buckets.
//!
//! The trace's duration is unknown while streaming, so buckets start narrow
//! and double in width (merging pairs) whenever there are too many. Each
//! bucket keeps the maximum of each gauge within it, so no peak is lost.

use crate::state::Gauges;

/// One bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Point {
    /// Start of the bucket (ns since trace start).
    pub t_ns: u64,
    /// Highest allocated bytes in the bucket.
    pub allocated: u64,
    /// Highest reserved bytes.
    pub reserved: u64,
    /// Highest active bytes.
    pub active: u64,
}

/// Bucketed gauges.
pub struct Timeline {
    width: u64,
    max_points: usize,
    points: Vec<Point>,
}

impl Timeline {
    /// A timeline of at most `max_points` buckets (at least 4).
    pub fn new(max_points: usize) -> Timeline {
        Timeline {
            width: 1_000,
            max_points: max_points.max(4) & !1,
            points: Vec::new(),
        }
    }

    /// Records the gauges after an event at `t_ns` (non-decreasing).
    #[inline]
    pub fn observe(&mut self, t_ns: u64, g: &Gauges) {
        let start = t_ns - t_ns % self.width;
        match self.points.last_mut() {
            Some(p) if p.t_ns == start => {
                p.allocated = p.allocated.max(g.allocated);
                p.reserved = p.reserved.max(g.reserved);
                p.active = p.active.max(g.active);
            }
            _ => self.open(start, t_ns, g),
        }
    }

    #[cold]
    fn open(&mut self, start: u64, t_ns: u64, g: &Gauges) {
        if self.points.last().is_some_and(|p| p.t_ns > start) {
            // Out of order (another thread's event): fold into the last bucket.
            let p = self.points.last_mut().expect("checked");
            p.allocated = p.allocated.max(g.allocated);
            p.reserved = p.reserved.max(g.reserved);
            p.active = p.active.max(g.active);
            return;
        }
        while self.points.len() >= self.max_points {
            self.width *= 2;
            let mut merged: Vec<Point> = Vec::with_capacity(self.max_points);
            for p in self.points.drain(..) {
                let s = p.t_ns - p.t_ns % self.width;
                match merged.last_mut() {
                    Some(m) if m.t_ns == s => {
                        m.allocated = m.allocated.max(p.allocated);
                        m.reserved = m.reserved.max(p.reserved);
                        m.active = m.active.max(p.active);
                    }
                    _ => merged.push(Point { t_ns: s, ..p }),
                }
            }
            self.points = merged;
        }
        let start = t_ns - t_ns % self.width;
        if let Some(p) = self.points.last_mut().filter(|p| p.t_ns == start) {
            p.allocated = p.allocated.max(g.allocated);
            p.reserved = p.reserved.max(g.reserved);
            p.active = p.active.max(g.active);
        } else {
            self.points.push(Point {
                t_ns: start,
                allocated: g.allocated,
                reserved: g.reserved,
                active: g.active,
            });
        }
    }

    /// The buckets, in time order.
    pub fn points(&self) -> &[Point] {
        &self.points
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_peaks_within_the_bound() {
        let mut t = Timeline::new(8);
        for i in 0..10_000u64 {
            let g = Gauges {
                allocated: if i == 7777 { 1 << 30 } else { i },
                reserved: i,
                active: i,
                requested: 0,
            };
            t.observe(i * 1_000, &g);
        }
        assert!(t.points().len() <= 8);
        assert_eq!(t.points().iter().map(|p| p.allocated).max(), Some(1 << 30));
        assert_eq!(t.points().last().unwrap().reserved, 9_999);
        assert!(t.points().windows(2).all(|w| w[0].t_ns < w[1].t_ns));
    }
}
