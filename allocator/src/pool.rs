//! Pools: the best-fit index of cached blocks.
//!
//! A pool keeps one ordered set of cached blocks per stream, as PyTorch's
//! `(stream, size, address)` ordering does: the best fit for a stream is the
//! first entry at or after the request's size in that stream's set. Another
//! stream's blocks are searched only on the slow path (`best_fit_other_stream`).
//!
//! Note [Packed free keys]
//! The hot path is dominated by ordered-set inserts and removals (a split
//! inserts the remainder, a free removes it again when merging). Each entry
//! is packed into one `u128`, `size / 512` (40 bits) then address (57 bits)
//! then block id (31 bits), so comparisons are single integer compares and
//! the set's nodes move half the bytes of a tuple key. The order is the
//! tuple order `(size, address)`, so best fit is unchanged.
//!
//! Note [Hot entry]
//! A warm alloc+free pair splits a cached block (inserting the remainder)
//! and merges it back on free (removing the remainder, inserting the whole
//! block): four ordered-set updates for one lookup. Each stream's free list
//! therefore keeps its most recently inserted entry outside the set, in a
//! one-entry "hot" slot; inserting another entry moves the old one into the
//! set. Lookups consider both, so the best fit is exactly the same, and the
//! warm pair touches the set only for its one lookup.

use std::collections::BTreeSet;

use crate::backend::{DevicePtr, StreamId};
use crate::block::BlockId;
use crate::size_class::PoolKind;

/// A cached block as the index sees it: `(stream, size, address, block)`.
pub(crate) type FreeKey = (StreamId, u64, DevicePtr, BlockId);

/// A private pool's identity: PyTorch's `MempoolId_t`.
pub type PoolKey = (u64, u64);

const ID_BITS: u32 = 31;
const PTR_BITS: u32 = 57;

#[inline]
fn pack(size: u64, ptr: DevicePtr, id: BlockId) -> u128 {
    debug_assert!(
        size.is_multiple_of(512) && (size >> 9) < (1 << 40),
        "size {size} cannot be packed"
    );
    debug_assert!(
        ptr < (1 << PTR_BITS) && id < (1 << ID_BITS),
        "address {ptr:#x} or id {id} cannot be packed"
    );
    (u128::from(size >> 9) << (PTR_BITS + ID_BITS)) | (u128::from(ptr) << ID_BITS) | u128::from(id)
}

#[inline]
fn unpack(stream: StreamId, k: u128) -> FreeKey {
    let size = ((k >> (PTR_BITS + ID_BITS)) as u64) << 9;
    let ptr = ((k >> ID_BITS) as u64) & ((1 << PTR_BITS) - 1);
    (stream, size, ptr, (k as u32) & ((1 << ID_BITS) - 1))
}

/// One stream's cached blocks: an ordered set plus the hot entry (Note [Hot entry]).
#[derive(Default)]
struct FreeList {
    set: BTreeSet<u128>,
    hot: Option<u128>,
}

impl FreeList {
    #[inline]
    fn insert(&mut self, k: u128) {
        if let Some(old) = self.hot.replace(k) {
            self.set.insert(old);
        }
    }

    #[inline]
    fn remove(&mut self, k: u128) -> bool {
        if self.hot == Some(k) {
            self.hot = None;
            true
        } else {
            self.set.remove(&k)
        }
    }

    fn contains(&self, k: u128) -> bool {
        self.hot == Some(k) || self.set.contains(&k)
    }

    fn len(&self) -> usize {
        self.set.len() + usize::from(self.hot.is_some())
    }

    /// The smallest entry at or above `lo`.
    #[inline]
    fn first_from(&self, lo: u128) -> Option<u128> {
        let cold = self.set.range(lo..).next().copied();
        match (cold, self.hot.filter(|&h| h >= lo)) {
            (Some(c), Some(h)) => Some(c.min(h)),
            (c, h) => c.or(h),
        }
    }

    fn iter(&self) -> impl Iterator<Item = u128> + '_ {
        self.set.iter().copied().chain(self.hot)
    }
}

/// One pool of cached blocks.
pub(crate) struct Pool {
    /// Small or large blocks.
    pub kind: PoolKind,
    /// Cached blocks per stream. Invariant: exactly the `Free` blocks whose
    /// `pool` is this one, each under its current stream, size and address.
    lists: Vec<(StreamId, FreeList)>,
    /// Best-fit lookups so far (the clock of garbage collection ages).
    pub lookups: u64,
    /// The private pool this belongs to, if any.
    pub private: Option<PoolKey>,
    /// The expandable segment of each stream, when expandable segments are on.
    pub expandable: Vec<(StreamId, u32)>,
}

impl Pool {
    pub fn new(kind: PoolKind, private: Option<PoolKey>) -> Pool {
        Pool {
            kind,
            lists: Vec::new(),
            lookups: 0,
            private,
            expandable: Vec::new(),
        }
    }

    #[inline]
    fn list(&self, stream: StreamId) -> Option<&FreeList> {
        self.lists.iter().find(|l| l.0 == stream).map(|l| &l.1)
    }

    #[inline]
    fn list_mut(&mut self, stream: StreamId) -> &mut FreeList {
        let i = match self.lists.iter().position(|l| l.0 == stream) {
            Some(i) => i,
            None => {
                self.lists.push((stream, FreeList::default()));
                self.lists.len() - 1
            }
        };
        &mut self.lists[i].1
    }

    /// Caches a block.
    #[inline]
    pub fn insert(&mut self, (stream, size, ptr, id): FreeKey) {
        self.list_mut(stream).insert(pack(size, ptr, id));
    }

    /// Removes a cached block; returns whether it was there.
    #[inline]
    pub fn remove(&mut self, (stream, size, ptr, id): FreeKey) -> bool {
        self.list_mut(stream).remove(pack(size, ptr, id))
    }

    /// Whether a block is cached under exactly this key.
    pub fn contains(&self, (stream, size, ptr, id): FreeKey) -> bool {
        self.list(stream)
            .is_some_and(|l| l.contains(pack(size, ptr, id)))
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.lists.iter().map(|l| l.1.len()).sum()
    }

    /// Every cached block, stream by stream (in no particular order).
    pub fn iter(&self) -> impl Iterator<Item = FreeKey> + '_ {
        self.lists
            .iter()
            .flat_map(|(s, l)| l.iter().map(move |k| unpack(*s, k)))
    }

    /// The smallest cached block of `stream` with at least `size` bytes.
    #[inline]
    pub fn best_fit(&self, stream: StreamId, size: u64) -> Option<FreeKey> {
        let l = self.list(stream)?;
        l.first_from(pack(size.div_ceil(512) * 512, 0, 0))
            .map(|k| unpack(stream, k))
    }

    /// The smallest block of at least `size` bytes cached by a stream other
    /// than `stream`, satisfying `accept` (ties go to the lower address).
    pub fn best_fit_other_stream(
        &self,
        stream: StreamId,
        size: u64,
        accept: impl Fn(u64) -> bool,
    ) -> Option<FreeKey> {
        self.lists
            .iter()
            .filter(|l| l.0 != stream)
            .filter_map(|l| self.best_fit(l.0, size))
            .filter(|k| accept(k.1))
            .min_by_key(|k| (k.1, k.2))
    }

    /// Total cached bytes and the largest cached block.
    pub fn free_bytes_and_largest(&self) -> (u64, u64) {
        self.iter().fold((0, 0), |(t, m), k| (t + k.1, m.max(k.1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_and_orders_like_the_tuple() {
        let a = (5u64, 512 * 3, 0x7f00_0000_0000u64, 7u32);
        assert_eq!(unpack(5, pack(a.1, a.2, a.3)), a);
        assert!(pack(1024, 0x10_0000, 9) < pack(1536, 0x1000, 1));
        assert!(pack(1024, 0x1000, 9) < pack(1024, 0x2000, 1));
        let mut p = Pool::new(PoolKind::Small, None);
        p.insert((1, 2048, 0x2000, 1));
        p.insert((1, 1024, 0x9000, 2));
        p.insert((2, 1024, 0x1000, 3));
        assert_eq!(p.best_fit(1, 1000), Some((1, 1024, 0x9000, 2)));
        assert_eq!(p.best_fit(1, 1536), Some((1, 2048, 0x2000, 1)));
        assert_eq!(p.best_fit(3, 512), None);
        assert_eq!(
            p.best_fit_other_stream(1, 512, |_| true),
            Some((2, 1024, 0x1000, 3))
        );
        assert!(p.remove((1, 1024, 0x9000, 2)));
        assert!(!p.contains((1, 1024, 0x9000, 2)));
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn the_hot_entry_takes_part_in_every_lookup() {
        let mut p = Pool::new(PoolKind::Large, None);
        p.insert((0, 8192, 0x10000, 1)); // hot
        assert_eq!(p.best_fit(0, 4096), Some((0, 8192, 0x10000, 1)));
        p.insert((0, 4096, 0x20000, 2)); // 1 moves to the set, 2 is hot
        p.insert((0, 6144, 0x30000, 3)); // 2 moves to the set, 3 is hot
        assert_eq!(
            p.best_fit(0, 4096),
            Some((0, 4096, 0x20000, 2)),
            "the set's smaller entry wins"
        );
        assert_eq!(
            p.best_fit(0, 5000),
            Some((0, 6144, 0x30000, 3)),
            "the hot entry wins"
        );
        assert_eq!(p.best_fit(0, 9000), None);
        assert_eq!(p.len(), 3);
        assert!(p.contains((0, 6144, 0x30000, 3)) && p.contains((0, 8192, 0x10000, 1)));
        assert!(p.remove((0, 6144, 0x30000, 3)));
        assert!(!p.remove((0, 6144, 0x30000, 3)));
        assert_eq!(p.best_fit(0, 5000), Some((0, 8192, 0x10000, 1)));
        let mut all: Vec<_> = p.iter().collect();
        all.sort();
        assert_eq!(all, vec![(0, 4096, 0x20000, 2), (0, 8192, 0x10000, 1)]);
    }
}
