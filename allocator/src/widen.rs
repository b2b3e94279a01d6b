//! Widening a mapping to the pooled handles it can use.
//!
//! Note [Small pages from pooled handles]
//! Rationale: the small pool maps 2 MiB pages, while the handles that
//! defragmentation unmaps from the large pool are up to
//! `expandable_handle_mb` (twice that after `empty_cache`). A small
//! request over the bound unmapped a 16 MiB handle it could not use and
//! then created a 2 MiB page anyway: reserved memory grew and a useless
//! handle stayed pooled.
//! Approach: when the pooled handles cannot cover a small-pool mapping, the
//! smallest pooled handle larger than it is mapped whole, in a window of its
//! size, and serves this and later small requests; this is checked before
//! defragmenting and again after it.
//!
//! Note [Widening to pooled handles]
//! Rationale: a handle is mapped whole, so pooled handles cover a mapping
//! only where they fit. FSDP2's all-gather stream maps 28 MiB windows while
//! defragmentation moves the default stream's 16 MiB handles: one handle
//! fits, the second stayed pooled, and 12 MiB were created, for every
//! layer of every step. Reserved memory crept from 1.015x to 1.089x peak
//! allocated after the peak, with 1.5 GB of free pages elsewhere.
//! Approach: in the large pool, when the last `short` bytes of a mapping
//! fit no pooled handle, the window is widened by what the smallest pooled
//! handle larger than `short` exceeds it, if the widened window creates
//! less. The extra bytes are free space after the request. Judged with
//! `placement_bench` over 55 replayed workloads: mean R/A 1.0302 to 1.0265
//! and driver time 160.5 to 154.8 ms; FSDP 1.089 to 1.014 (its
//! perturbations 1.061 and 1.109 to 1.027 and 1.019); 3 of 55 worse, the
//! recorded `churn_wide` by 0.026 for 38% less driver time
//! (`docs/policy-experiments.md`, twelfth study).

use crate::backend::{Backend, StreamId};
use crate::block::PoolId;
use crate::device::DeviceAllocator;
use crate::error::GrowError;
use crate::heap::{LARGE, SMALL, Window};

impl<B: Backend> DeviceAllocator<B> {
    /// Widens a mapping of `ranges` that pooled handles cannot cover to one
    /// they can, returning the new window and the bytes it maps. Small
    /// pool: [`widen_small`](Self::widen_small). Large pool (Note [Widening
    /// to pooled handles]): when the last `short` bytes fit no pooled
    /// handle, by what the smallest pooled handle larger than `short`
    /// exceeds it, if the widened window creates less.
    pub(crate) fn widen(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
        ranges: &[(u64, u64)],
        page: u64,
    ) -> Result<Option<(Window, u64)>, GrowError> {
        let bytes: u64 = ranges.iter().map(|r| r.1 - r.0).sum();
        if pool == SMALL {
            return self.widen_small(pool, stream, bytes, page);
        }
        if pool != LARGE {
            return Ok(None);
        }
        let short = bytes - self.pages.usable_in(ranges, page);
        if short == 0 {
            return Ok(None);
        }
        let Some(size) = self.pages.smallest_pooled(page, short + 1) else {
            return Ok(None);
        };
        // Only where a window exists: reserving a range for a window that
        // may not be taken would spend address space (or fail) for nothing.
        let Some((seg, ws, ranges)) =
            self.heap
                .find_window(pool, stream, rounded + (size - short), page)
        else {
            return Ok(None);
        };
        let mapped: u64 = ranges.iter().map(|r| r.1 - r.0).sum();
        if mapped - self.pages.usable_in(&ranges, page) >= short {
            return Ok(None);
        }
        Ok(Some(((seg, ws, ranges), mapped)))
    }

    /// See Note [Small pages from pooled handles]: a small-pool mapping of
    /// `bytes` that pooled handles cannot cover maps the smallest pooled
    /// handle larger than `bytes` whole instead, in a window of its size
    /// (`(segment, start, ranges, bytes to map)`), when one is pooled and a
    /// window maps it in one piece.
    fn widen_small(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        bytes: u64,
        page: u64,
    ) -> Result<Option<(Window, u64)>, GrowError> {
        if pool != SMALL || bytes == 0 || self.pages.usable(bytes, page) == bytes {
            return Ok(None);
        }
        let Some(size) = self.pages.smallest_pooled(page, bytes + 1) else {
            return Ok(None);
        };
        let (seg, ws, ranges) = self.plan_window(pool, stream, size, page)?;
        if !ranges.iter().any(|r| r.1 - r.0 >= size) {
            return Ok(None);
        }
        let mapped = ranges.iter().map(|r| r.1 - r.0).sum();
        Ok(Some(((seg, ws, ranges), mapped)))
    }
}
