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
    /// Home addresses of the parts its last repair mapped in, until it is
    /// next taken whole (Note [Stitching]: a repair that would replace one
    /// builds a new stitch instead).
    pub fresh: Vec<DevicePtr>,
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
    /// Stitches built so far, and requests served by a cached stitch taken
    /// whole (no driver call): whether layouts repeat (Note [When a stitch
    /// pays]). Not `num_stitch`, which `reset_accumulated_memory_stats`
    /// clears: the policy does not follow the user's resets.
    pub built: u64,
    pub taken_whole: u64,
}

/// Note [When a stitch pays]
/// A stitch maps every handle of its request (about 45 µs each on an H200,
/// `cuMemSetAccess` being per handle), where moving pages maps only the
/// shortfall, at about twice that per handle (unmap, map, set access). A
/// request that lacks a small share of its size (a window at the end of a
/// segment already mostly mapped) pays for a stitch many times what the
/// move costs, and earns it back only when the stitch is taken whole again
/// later, with no call, as happens when layouts repeat (ResNet-50's steps
/// alternate between two). With `stitch_short_share:N`, a stitch is built
/// or repaired for a request that lacks less than 1/N of its size only
/// while cached stitches have been taken whole at least as often as
/// stitches were built (the first `FREE_BUILDS` builds are free, so that
/// the evidence can start). Replayed over the recorded traces and their
/// perturbations (forty-seventh study in `docs/policy-experiments.md`),
/// N = 8 lowers the mean predicted driver time by 6% at a slightly lower
/// mean R/A. On the GPU (forty-eighth study) the traces recorded under it
/// replay to the GPU's peaks, and the detector keeps 28% fewer memory
/// calls after warm-up but reserves 1.0409 of its live peak against the
/// default's 1.0337: off by default, as the R/A target comes first. The
/// counts are the device's whole life: `empty_cache` drops the stitches,
/// not what the workload showed of its layouts. Requests that would grow
/// past the capacity stitch whatever the rule (the promise,
/// `stitch_may_spend`).
pub(crate) const FREE_BUILDS: u64 = 2;

impl Stitches {
    /// Whether a stitch may be built or repaired, with driver calls, for a
    /// request of `rounded` bytes that lacks `short` of them in its window,
    /// under `stitch_short_share:share` (Note [When a stitch pays]). A
    /// cached stitch taken whole needs no call and is always allowed.
    pub fn worth_calls(&self, short: u64, rounded: u64, share: u64) -> bool {
        share == 0
            || short.saturating_mul(share) >= rounded
            || self.built < FREE_BUILDS
            || self.taken_whole >= self.built
    }

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
