//! The device's stitched ranges, in use or cached for the next request of
//! their size (Note [Stitching] in `stitch.rs`).

use crate::backend::{DevicePtr, HandleId, StreamId};
use crate::block::SegmentId;

/// Cached stitches kept per device; beyond, the least recently used goes.
pub(crate) const MAX_CACHED: usize = 16;

/// One handle of a stitch: where it lives at home, and its size.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Part {
    pub seg: SegmentId,
    pub addr: DevicePtr,
    pub handle: HandleId,
    pub size: u64,
}

/// One handle's place in a stitch: mapped from its home, or a hole of that
/// many bytes, unmapped when defragmentation took the handle (Note
/// [Stitching]); a stitch in use has holes only past its block, where the
/// out-of-memory path gave its tail back (Note [Stitch tails]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Slot {
    Mapped(Part),
    Hole(u64),
}

impl Slot {
    pub fn size(&self) -> u64 {
        match self {
            Slot::Mapped(p) => p.size,
            Slot::Hole(s) => *s,
        }
    }

    pub fn part(&self) -> Option<&Part> {
        match self {
            Slot::Mapped(p) => Some(p),
            Slot::Hole(_) => None,
        }
    }
}

/// A stitched address range and the home runs it aliases.
pub(crate) struct Stitch {
    pub va: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
    /// Home handles (or holes) in the order they are mapped from `va`.
    pub slots: Vec<Slot>,
    /// The segment of its allocated block, while in use.
    pub in_use: Option<SegmentId>,
    /// Fence stamp of its last free (Note [Event-ordered unmapping]).
    pub freed: u64,
    /// Use counter value at its last use (least recently used goes first).
    pub used_at: u64,
    /// Parts its repairs have replaced since it was built (a hole or busy
    /// part counts once, however many handles fill it).
    pub repaired: u64,
}

impl Stitch {
    /// The home handles it maps (not its holes).
    pub fn parts(&self) -> impl Iterator<Item = &Part> {
        self.slots.iter().filter_map(Slot::part)
    }

    /// Whether its range holds `[lo, hi)`.
    pub fn holds(&self, lo: DevicePtr, hi: DevicePtr) -> bool {
        self.va <= lo && hi <= self.va + self.size
    }

    /// Its holes.
    pub fn holes(&self) -> usize {
        self.slots.iter().filter(|s| s.part().is_none()).count()
    }

    /// Runs of consecutive slots that `pick` selects, as `(first slot, end
    /// slot, address, bytes)`: each is one range of whole mappings (or holes).
    pub fn runs(&self, pick: impl Fn(&Slot) -> bool) -> Vec<(usize, usize, DevicePtr, u64)> {
        let mut out: Vec<(usize, usize, DevicePtr, u64)> = Vec::new();
        let mut at = self.va;
        for (i, slot) in self.slots.iter().enumerate() {
            if pick(slot) {
                match out.last_mut() {
                    Some(r) if r.1 == i => {
                        r.1 = i + 1;
                        r.3 += slot.size();
                    }
                    _ => out.push((i, i + 1, at, slot.size())),
                }
            }
            at += slot.size();
        }
        out
    }
}

/// The device's stitches (Note [Stitching]).
#[derive(Default)]
pub(crate) struct Stitches {
    pub list: Vec<Stitch>,
    /// Claims so far (the clock of `used_at`).
    pub uses: u64,
}

impl Stitches {
    /// Whether a cached stitch aliases a handle mapped in `[lo, hi)`.
    pub fn aliased(&self, lo: DevicePtr, hi: DevicePtr) -> bool {
        self.cached_over(lo, hi).is_some()
    }

    /// A cached stitch that aliases a handle mapped in `[lo, hi)`.
    pub fn cached_over(&self, lo: DevicePtr, hi: DevicePtr) -> Option<usize> {
        self.list.iter().position(|s| {
            s.in_use.is_none() && s.parts().any(|p| p.addr < hi && lo < p.addr + p.size)
        })
    }

    /// Any cached stitch.
    pub fn any_cached(&self) -> Option<usize> {
        self.list.iter().position(|s| s.in_use.is_none())
    }

    /// The least recently used cached stitch.
    pub fn least_recent(&self) -> Option<usize> {
        self.list
            .iter()
            .enumerate()
            .filter(|(_, s)| s.in_use.is_none())
            .min_by_key(|(_, s)| s.used_at)
            .map(|(i, _)| i)
    }
}
