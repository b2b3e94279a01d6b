//! The ranges one device holds, as the Parquet export's segments table
//! follows them: each range reserved or mapped is held until it is freed or
//! unmapped, then written as a row with its start and end. Unlike the
//! state's, mapped ranges are not merged (each mapping is a row), and a
//! partial unmap ends the unmapped part and keeps the rest open.
//!
//! What the devices of a trace hold together counts against one bound
//! ([`Budget::held`](crate::analyses::budget::Budget::held)): a range past
//! it, or the part above an unmap that would split a range in two with the
//! bound reached, is not followed, and the bound counts it refused.

use std::collections::BTreeMap;

use crate::analyses::budget::Bound;

/// A range held, not yet released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    /// Bytes.
    pub size: u64,
    /// Pool code.
    pub pool: u64,
    /// Stream.
    pub stream: u64,
    /// When it was reserved or mapped (ns).
    pub start: u64,
}

/// What a range is, as the `kind` column names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Reserved by `segment_alloc`.
    Segment = 0,
    /// Pages of an expandable segment.
    Mapped = 1,
    /// A stitched range.
    Stitch = 2,
}

/// The ranges of one device, by kind and start address.
#[derive(Default)]
pub struct Ranges {
    by_kind: [BTreeMap<u64, Held>; 3],
}

impl Ranges {
    fn len(&self) -> usize {
        self.by_kind.iter().map(BTreeMap::len).sum()
    }

    /// Holds `h` at `addr` (in place of a range held there), if `bound`
    /// has room for one more range.
    pub fn hold(&mut self, kind: Kind, addr: u64, h: Held, bound: &mut Bound) {
        let before = self.len();
        let m = &mut self.by_kind[kind as usize];
        if m.contains_key(&addr) || bound.room() {
            m.insert(addr, h);
        } else {
            bound.refused += 1;
        }
        bound.moved(before, self.len());
    }

    /// Releases the segment at `addr`.
    pub fn free(&mut self, addr: u64, bound: &mut Bound) -> Option<Held> {
        let h = self.by_kind[Kind::Segment as usize].remove(&addr);
        bound.moved(usize::from(h.is_some()), 0);
        h
    }

    /// Removes `[addr, addr + size)` from the ranges of `kind`; returns
    /// the parts removed. The rest of a range partly covered stays, with
    /// its start time; the part above the unmap only where `bound` has
    /// room, when the unmap splits a range in two.
    pub fn unmap(
        &mut self,
        kind: Kind,
        addr: u64,
        size: u64,
        bound: &mut Bound,
    ) -> Vec<(u64, Held)> {
        let before = self.len();
        let m = &mut self.by_kind[kind as usize];
        let gone = unmap(m, addr, size, bound);
        bound.moved(before, self.len());
        gone
    }

    /// The ranges still held, by kind and address.
    pub fn held(&self) -> impl Iterator<Item = (Kind, u64, Held)> + '_ {
        let kinds = [Kind::Segment, Kind::Mapped, Kind::Stitch];
        kinds
            .into_iter()
            .zip(&self.by_kind)
            .flat_map(|(k, m)| m.iter().map(move |(&a, &h)| (k, a, h)))
    }
}

/// [`Ranges::unmap`] in one map: holds no more ranges than before unless
/// `bound` has room (it is charged by the caller).
fn unmap(m: &mut BTreeMap<u64, Held>, addr: u64, size: u64, bound: &mut Bound) -> Vec<(u64, Held)> {
    let before = m.len();
    let end = addr.saturating_add(size);
    let hit: Vec<(u64, Held)> = m
        .range(..end)
        .rev()
        .take_while(|&(&a, h)| a.saturating_add(h.size) > addr)
        .map(|(&a, &h)| (a, h))
        .collect();
    let mut gone = Vec::with_capacity(hit.len());
    for (a, h) in hit.into_iter().rev() {
        m.remove(&a);
        let h_end = a.saturating_add(h.size);
        let (lo, hi) = (a.max(addr), h_end.min(end));
        if a < lo {
            m.insert(a, Held { size: lo - a, ..h });
        }
        if hi < h_end {
            // Only the last range hit goes on past the unmap: it is one
            // range more than before when it is the only one, split.
            if m.len() < before || bound.room() {
                let rest = Held {
                    size: h_end - hi,
                    ..h
                };
                m.insert(hi, rest);
            } else {
                bound.refused += 1;
            }
        }
        gone.push((lo, Held { size: hi - lo, ..h }));
    }
    gone
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(size: u64, start: u64) -> Held {
        Held {
            size,
            pool: 1,
            stream: 0,
            start,
        }
    }

    fn left(r: &Ranges) -> Vec<(u64, u64, u64)> {
        r.held().map(|(_, a, h)| (a, h.size, h.start)).collect()
    }

    #[test]
    fn a_partial_unmap_ends_the_part_and_keeps_the_rest() {
        let (mut r, mut b) = (Ranges::default(), Bound::new(10));
        r.hold(Kind::Mapped, 0, h(100, 5), &mut b);
        r.hold(Kind::Mapped, 100, h(50, 7), &mut b);
        let gone = r.unmap(Kind::Mapped, 80, 40, &mut b);
        let sizes: Vec<_> = gone.iter().map(|(a, h)| (*a, h.size, h.start)).collect();
        assert_eq!(sizes, [(80, 20, 5), (100, 20, 7)]);
        assert_eq!(left(&r), [(0, 80, 5), (120, 30, 7)]);
        assert!(r.unmap(Kind::Mapped, 200, 10, &mut b).is_empty());
        assert!(r.unmap(Kind::Stitch, 0, 10, &mut b).is_empty(), "by kind");
        assert_eq!(b.refused, 0);
    }

    /// Ranges of every kind count against one bound, and so does the part
    /// an unmap in the middle of a range leaves above it: with the bound
    /// reached it is not followed, and counted refused.
    #[test]
    fn ranges_and_the_parts_an_unmap_leaves_are_held_up_to_the_bound() {
        let mut b = Bound::new(3);
        let mut r = Ranges::default();
        r.hold(Kind::Segment, 0, h(100, 1), &mut b);
        r.hold(Kind::Stitch, 0, h(100, 2), &mut b);
        r.hold(Kind::Mapped, 1000, h(100, 3), &mut b);
        r.hold(Kind::Mapped, 2000, h(100, 4), &mut b);
        assert_eq!(b.refused, 1, "no room for a fourth range");
        r.hold(Kind::Mapped, 1000, h(50, 5), &mut b);
        assert_eq!(b.refused, 1, "a range held again takes no room");
        let gone = r.unmap(Kind::Mapped, 1010, 10, &mut b);
        assert_eq!(gone, [(1010, h(10, 5))]);
        assert_eq!(b.refused, 2, "the part above is not followed");
        let want = [(0, 100, 1), (1000, 10, 5), (0, 100, 2)];
        assert_eq!(left(&r), want);
        // A range released makes room, for a split too.
        assert_eq!(r.free(0, &mut b), Some(h(100, 1)));
        assert_eq!(r.free(0, &mut b), None);
        r.unmap(Kind::Stitch, 40, 10, &mut b);
        assert_eq!(left(&r), [(1000, 10, 5), (0, 40, 2), (50, 50, 2)]);
        assert_eq!(b.refused, 2);
        r.hold(Kind::Segment, 0, h(1, 6), &mut b);
        assert_eq!(b.refused, 3, "and no more");
    }
}
