//! Pools: the best-fit index of cached blocks.
//!
//! A pool's free index is ordered by `(stream, size, address)`, so it is one
//! free list per stream, as in PyTorch: the best fit for a stream is the first
//! entry at or after `(stream, size)`. Another stream's blocks are found by
//! jumping from stream to stream (see `best_fit_other_stream`).

use std::collections::BTreeSet;

use crate::backend::{DevicePtr, StreamId};
use crate::block::BlockId;
use crate::size_class::PoolKind;

/// A free-index key: stream first, then size, then address.
pub(crate) type FreeKey = (StreamId, u64, DevicePtr, BlockId);

/// A private pool's identity: PyTorch's `MempoolId_t`.
pub type PoolKey = (u64, u64);

/// One pool of cached blocks.
pub(crate) struct Pool {
    /// Small or large blocks.
    pub kind: PoolKind,
    /// Cached blocks. Invariant: exactly the `Free` blocks whose `pool` is this one.
    pub free: BTreeSet<FreeKey>,
    /// Best-fit lookups so far (the clock of garbage collection ages).
    pub lookups: u64,
    /// The private pool this belongs to, if any.
    pub private: Option<PoolKey>,
}

impl Pool {
    pub fn new(kind: PoolKind, private: Option<PoolKey>) -> Pool {
        Pool { kind, free: BTreeSet::new(), lookups: 0, private }
    }

    /// The smallest cached block of `stream` with at least `size` bytes.
    #[inline]
    pub fn best_fit(&self, stream: StreamId, size: u64) -> Option<FreeKey> {
        self.free
            .range((stream, size, 0, 0)..)
            .next()
            .copied()
            .filter(|k| k.0 == stream)
    }

    /// The smallest block of at least `size` bytes cached by a stream other
    /// than `stream`, satisfying `accept`.
    pub fn best_fit_other_stream(
        &self,
        stream: StreamId,
        size: u64,
        accept: impl Fn(u64) -> bool,
    ) -> Option<FreeKey> {
        let mut best: Option<FreeKey> = None;
        let mut cursor = self.free.iter().next().map(|k| k.0);
        while let Some(s) = cursor {
            if s != stream
                && let Some(k) = self.best_fit(s, size)
                && accept(k.1)
                && best.is_none_or(|b| k.1 < b.1)
            {
                best = Some(k);
            }
            cursor = match s.checked_add(1) {
                Some(n) => self.free.range((n, 0, 0, 0)..).next().map(|k| k.0),
                None => None,
            };
        }
        best
    }

    /// Total cached bytes and the largest cached block.
    pub fn free_bytes_and_largest(&self) -> (u64, u64) {
        self.free.iter().fold((0, 0), |(t, m), k| (t + k.1, m.max(k.1)))
    }
}
