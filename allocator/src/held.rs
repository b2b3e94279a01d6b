//! What reserved memory is made of at one moment, by the unit it can be
//! given back in.
//!
//! Note [Held memory by unit]
//! Rationale: when reserved memory exceeds allocated memory, a user asks
//! whether a setting could lower it. Memory leaves (or moves) only in
//! whole units: one physical handle of an expandable segment, or one plain
//! segment. So the free bytes of a unit that also backs a live byte stay
//! reserved until that block is freed, under any policy: these are the
//! handles' tails of `docs/policy-experiments.md` (seventh and
//! thirty-sixth studies), which only smaller units shrink. A unit that
//! backs no byte in use is different. In the default pools, and in a
//! private pool already released, it is cache that `empty_cache` gives
//! back and that defragmentation may move. In a private pool still held (a
//! CUDA graph's, a `MemPool`) it stays until the pool is released: a
//! graph's intermediates live there between replays. Pooled handles are
//! physical memory that is no longer mapped and is kept for reuse.
//! Approach: every segment but the stitches (which map handles already
//! counted at their home address) is walked once: expandable segments
//! handle by handle, plain segments whole. A unit is *used* when any
//! block over it is allocated, waiting for events, or lent to a stitch.
//! The four parts add up to reserved memory. The used units less allocated
//! memory is free bytes beside live blocks, plus the blocks that wait for
//! events and the claimed rest of stitches in use (given back when the
//! events complete and when the stitch is trimmed or freed).

use crate::backend::Backend;
use crate::block::BlockState;
use crate::device::DeviceAllocator;
use crate::heap::STITCH;

/// Reserved bytes by unit. See Note [Held memory by unit].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Units (handles, plain segments) that back at least one byte in use.
    pub used_units: u64,
    /// Mapped units of the default pools (and of private pools already
    /// released) that back no byte in use: cache.
    pub free_units: u64,
    /// Mapped units of private pools still held that back no byte in use:
    /// kept for their graphs (or `MemPool`) until the pool is released.
    pub free_private_units: u64,
    /// Pooled handles: physical memory kept unmapped for reuse.
    pub pooled: u64,
}

impl Held {
    /// All four: reserved memory.
    pub fn total(&self) -> u64 {
        self.used_units + self.free_units + self.free_private_units + self.pooled
    }

    /// Of the used units, what no allocation holds when `allocated` bytes
    /// are: free bytes beside live blocks, with the blocks that wait for
    /// events and the claimed rest of stitches in use.
    pub fn used_unallocated(&self, allocated: u64) -> u64 {
        self.used_units.saturating_sub(allocated)
    }
}

impl<B: Backend> DeviceAllocator<B> {
    /// Reserved memory now, by unit (Note [Held memory by unit]).
    pub fn held(&self) -> Held {
        let mut held = Held {
            pooled: self.pooled_bytes(),
            ..Held::default()
        };
        let released = self.private.freeable_pools();
        for (_, seg) in self.heap.segments.iter() {
            if seg.pool == STITCH {
                continue;
            }
            // The blocks over the segment, as (start, end, in use).
            let mut blocks = Vec::new();
            let mut cur = Some(seg.first);
            while let Some(id) = cur {
                let b = &self.heap.blocks[id];
                let in_use = !matches!(b.state, BlockState::Free | BlockState::Unmapped);
                blocks.push((b.ptr, b.ptr + b.size, in_use));
                cur = b.next;
            }
            let units = if seg.expandable {
                self.pages
                    .handles_in(seg.ptr, seg.ptr + seg.size)
                    .into_iter()
                    .map(|(a, _, n)| (a, n))
                    .collect()
            } else {
                vec![(seg.ptr, seg.size)]
            };
            // Both lists are in address order: one pass over the blocks.
            let mut k = 0;
            for (a, n) in units {
                while blocks[k].1 <= a {
                    k += 1;
                }
                let used = blocks[k..].iter().take_while(|b| b.0 < a + n).any(|b| b.2);
                if used {
                    held.used_units += n;
                } else if seg.pool > STITCH && !released.contains(&seg.pool) {
                    held.free_private_units += n;
                } else {
                    held.free_units += n;
                }
            }
        }
        held
    }
}

#[cfg(test)]
mod tests {
    use super::Held;
    use crate::{Config, DeviceAllocator, SimBackend};

    const MIB: u64 = 1 << 20;

    fn dev(conf: &str) -> DeviceAllocator<SimBackend> {
        DeviceAllocator::new(0, SimBackend::new(8 << 30), Config::parse(conf).unwrap())
    }

    /// The parts add up to reserved memory, and the used units hold at
    /// least the allocated bytes.
    fn held(d: &DeviceAllocator<SimBackend>) -> Held {
        d.check_invariants().unwrap();
        let h = d.held();
        let s = d.stats();
        assert_eq!(h.total(), s.reserved_bytes.all.current as u64, "{h:?}");
        assert!(
            h.used_units >= s.allocated_bytes.all.current as u64,
            "{h:?}"
        );
        h
    }

    #[test]
    fn handles_split_into_used_and_free() {
        // 2 MiB handles: a 3 MiB block uses two, 1 MiB of them beside it.
        let mut d = dev("expandable_handle_mb:2");
        let a = d.malloc(3 * MIB, 0).unwrap();
        let b = d.malloc(8 * MIB, 0).unwrap();
        assert_eq!(
            held(&d),
            Held {
                used_units: 12 * MIB,
                ..Held::default()
            }
        );
        // b freed: its handles hold no live byte but the one it shares
        // with a.
        d.free(b).unwrap();
        let h = held(&d);
        assert_eq!(h.used_units, 4 * MIB);
        assert_eq!(h.free_units, 8 * MIB);
        d.free(a).unwrap();
        assert_eq!(held(&d).used_units, 0);
        d.empty_cache().unwrap();
        assert_eq!(held(&d), Held::default());
    }

    #[test]
    fn a_plain_segment_is_one_unit() {
        let mut d = dev("policy:pytorch");
        let a = d.malloc(30 * MIB, 0).unwrap();
        let b = d.malloc(MIB / 2, 0).unwrap();
        // PyTorch's rounding: a 30 MiB request gets a segment of its own,
        // a small one a 2 MiB segment.
        assert_eq!(held(&d).used_units, 32 * MIB);
        d.free(a).unwrap();
        let h = held(&d);
        assert_eq!((h.used_units, h.free_units), (2 * MIB, 30 * MIB));
        d.free(b).unwrap();
        assert_eq!(held(&d).free_units, 32 * MIB);
    }

    #[test]
    fn a_released_private_pools_free_segments_are_cache() {
        let mut d = dev("policy:pytorch");
        let key = (1, 1);
        d.begin_allocate_to_pool(key, None).unwrap();
        let a = d.malloc(30 * MIB, 0).unwrap();
        let b = d.malloc(30 * MIB, 0).unwrap();
        d.end_allocate_to_pool(key).unwrap();
        d.free(a).unwrap();
        let h = held(&d);
        assert_eq!((h.free_units, h.free_private_units), (0, 30 * MIB));
        // Released: its free segment goes back to the device at once. The
        // other, freed later, is cache that `empty_cache` gives back, no
        // longer the pool's.
        d.release_pool(key).unwrap();
        let h = held(&d);
        assert_eq!(
            (h.used_units, h.free_units, h.free_private_units),
            (30 * MIB, 0, 0)
        );
        d.free(b).unwrap();
        let h = held(&d);
        assert_eq!(
            (h.used_units, h.free_units, h.free_private_units),
            (0, 30 * MIB, 0)
        );
        d.empty_cache().unwrap();
        assert_eq!(held(&d), Held::default());
    }

    #[test]
    fn a_private_pools_free_units_are_its_own() {
        let mut d = dev("");
        let key = (1, 1);
        d.begin_allocate_to_pool(key, None).unwrap();
        let a = d.malloc(64 * MIB, 0).unwrap();
        d.end_allocate_to_pool(key).unwrap();
        assert!(held(&d).used_units >= 64 * MIB);
        d.free(a).unwrap();
        let h = held(&d);
        assert_eq!(h.used_units, 0);
        assert_eq!(h.free_units, 0);
        assert!(h.free_private_units >= 64 * MIB, "{h:?}");
        // The cache of the default pools is given back; the pool's stays.
        d.empty_cache().unwrap();
        assert_eq!(held(&d).free_private_units, h.free_private_units);
        // Released, once for each scope that used it, while a block of it
        // lives on.
        d.begin_allocate_to_pool(key, None).unwrap();
        let b = d.malloc(MIB, 0).unwrap();
        d.end_allocate_to_pool(key).unwrap();
        d.release_pool(key).unwrap();
        assert_eq!(held(&d).free_private_units, h.free_private_units);
        d.release_pool(key).unwrap();
        // Its free units went to the page pool at once; none is counted as
        // the pool's any more.
        let h = held(&d);
        assert_eq!(h.free_private_units, 0, "{h:?}");
        assert!(h.pooled >= 64 * MIB, "{h:?}");
        d.free(b).unwrap();
        d.empty_cache().unwrap();
        assert_eq!(held(&d), Held::default());
    }
}
