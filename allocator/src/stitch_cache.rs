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

/// A stitched address range and the home runs it aliases.
pub(crate) struct Stitch {
    pub va: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
    /// Home handles in the order they are mapped from `va`.
    pub parts: Vec<Part>,
    /// The segment of its allocated block, while in use.
    pub in_use: Option<SegmentId>,
    /// Fence stamp of its last free (Note [Event-ordered unmapping]).
    pub freed: u64,
    /// Use counter value at its last use (least recently used goes first).
    pub used_at: u64,
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
            s.in_use.is_none() && s.parts.iter().any(|p| p.addr < hi && lo < p.addr + p.size)
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
