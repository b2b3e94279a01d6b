//! A set of disjoint address ranges, adjacent ones merged: the pages that
//! stitches in use hold at home, and the parts of stitches listed (Note
//! [Listed ranges] in `allocator/src/trace/event.rs`).

use std::collections::BTreeMap;

/// Disjoint, non-adjacent ranges by start address, with their sizes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeSet(BTreeMap<u64, u64>);

impl RangeSet {
    /// Adds `[addr, addr + size)`, merging what it overlaps or touches.
    /// A range past the end of the address space is clipped to it.
    pub fn insert(&mut self, addr: u64, size: u64) {
        let (mut lo, mut hi) = (addr, addr.saturating_add(size));
        if lo >= hi {
            return;
        }
        if let Some((&s, &n)) = self.0.range(..=lo).next_back()
            && s.saturating_add(n) >= lo
        {
            lo = s;
            hi = hi.max(s.saturating_add(n));
            self.0.remove(&s);
        }
        while let Some((&s, &n)) = self.0.range(lo..=hi).next() {
            hi = hi.max(s.saturating_add(n));
            self.0.remove(&s);
        }
        self.0.insert(lo, hi - lo);
    }

    /// Removes `[addr, addr + size)`, splitting a range it falls inside.
    pub fn remove(&mut self, addr: u64, size: u64) {
        let (lo, hi) = (addr, addr.saturating_add(size));
        if lo >= hi {
            return;
        }
        if let Some((&s, &n)) = self.0.range(..lo).next_back()
            && s.saturating_add(n) > lo
        {
            self.0.insert(s, lo - s);
            if s.saturating_add(n) > hi {
                self.0.insert(hi, s.saturating_add(n) - hi);
            }
        }
        while let Some((&s, &n)) = self.0.range(lo..hi).next() {
            self.0.remove(&s);
            if s.saturating_add(n) > hi {
                self.0.insert(hi, s.saturating_add(n) - hi);
            }
        }
    }

    /// The ranges in address order, as (start, bytes).
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().map(|(&a, &n)| (a, n))
    }

    /// How many ranges.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds no range.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether one range holds all of `[addr, addr + size)`.
    pub fn covers(&self, addr: u64, size: u64) -> bool {
        self.0
            .range(..=addr)
            .next_back()
            .is_some_and(|(&s, &n)| addr.saturating_add(size) <= s.saturating_add(n))
    }

    /// Whether some range shares a byte with `[addr, addr + size)`.
    pub fn overlaps(&self, addr: u64, size: u64) -> bool {
        let end = addr.saturating_add(size);
        self.0
            .range(..end)
            .next_back()
            .is_some_and(|(&s, &n)| s.saturating_add(n) > addr)
    }

    /// The parts of `[addr, addr + size)` that no range holds, in order.
    pub fn gaps(&self, addr: u64, size: u64) -> Vec<(u64, u64)> {
        let (mut cur, end) = (addr, addr.saturating_add(size));
        let mut out = Vec::new();
        let first = self.0.range(..=addr).next_back().map_or(addr, |(&s, _)| s);
        for (&s, &n) in self.0.range(first..end) {
            if s > cur {
                out.push((cur, s - cur));
            }
            cur = cur.max(s.saturating_add(n));
        }
        if cur < end {
            out.push((cur, end - cur));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::RangeSet;

    fn ranges(s: &RangeSet) -> Vec<(u64, u64)> {
        s.iter().collect()
    }

    #[test]
    fn inserts_merge_and_removes_split() {
        let mut s = RangeSet::default();
        s.insert(10, 10);
        s.insert(30, 10);
        assert_eq!(ranges(&s), [(10, 10), (30, 10)]);
        s.insert(20, 10); // touches both: one range
        assert_eq!(ranges(&s), [(10, 30)]);
        s.insert(15, 2); // inside: nothing changes
        assert_eq!(ranges(&s), [(10, 30)]);
        s.remove(18, 4); // splits it
        assert_eq!(ranges(&s), [(10, 8), (22, 18)]);
        assert!(s.covers(10, 8) && s.covers(22, 18) && !s.covers(10, 9));
        assert!(s.overlaps(17, 1) && !s.overlaps(18, 4) && s.overlaps(0, 11));
        assert_eq!(s.gaps(0, 50), [(0, 10), (18, 4), (40, 10)]);
        assert_eq!(s.gaps(12, 4), []);
        assert_eq!(s.gaps(12, 12), [(18, 4)]);
        s.remove(5, 10); // the head of the first
        assert_eq!(ranges(&s), [(15, 3), (22, 18)]);
        s.remove(0, 100);
        assert!(s.is_empty());
        s.insert(0, 0); // an empty range is nothing
        assert!(s.is_empty());
    }

    #[test]
    fn overlapping_inserts_cover_their_union() {
        let mut s = RangeSet::default();
        s.insert(40, 10);
        s.insert(10, 5);
        s.insert(12, 30); // overlaps both
        assert_eq!(ranges(&s), [(10, 40)]);
        s.insert(u64::MAX - 4, 100); // clipped at the end of the address space
        assert!(s.covers(u64::MAX - 4, 4) && !s.covers(u64::MAX - 5, 4));
        assert_eq!(s.len(), 2);
    }
}
