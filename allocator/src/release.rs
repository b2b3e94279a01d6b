//! Giving memory back: `empty_cache`, the out-of-memory retries and
//! garbage collection.

use crate::backend::{Backend, BackendError, StreamId};
use crate::block::{BlockId, BlockState, PoolId};
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::heap::{LARGE, SMALL};
use crate::observer::SegmentAction;
use crate::size_class::PoolKind;
use crate::trace::{Action, pool_code};

impl<B: Backend> DeviceAllocator<B> {
    /// Releases every cached segment that is entirely free, after waiting for
    /// outstanding events. Does nothing during a CUDA graph capture.
    ///
    /// # Errors
    /// [`AllocError::Backend`] when the driver fails.
    pub fn empty_cache(&mut self) -> Result<(), AllocError> {
        if self.capture_elsewhere()? || self.private.capturing() {
            return Ok(());
        }
        let before = self.stats.reserved_bytes.all.current;
        let owed = self.pages.regrowth();
        self.release_cached_blocks()?;
        let released = (before - self.stats.reserved_bytes.all.current) as u64;
        self.pages.set_regrowth(owed + released);
        self.record(Action::EmptyCache, 0, 0, released, 0);
        crate::log::cache_flushed(self.device, released);
        Ok(())
    }

    /// `release_cached_blocks`: wait for events, then release every unsplit
    /// cached segment of the default pools and of private pools no longer in use.
    pub(crate) fn release_cached_blocks(&mut self) -> Result<(), AllocError> {
        // On the out-of-memory path memory is created again in fine handles;
        // `empty_cache` sets its own credit afterwards (Note [Regrowth]).
        self.pages.set_regrowth(0);
        self.synchronize_and_free_events()?;
        if self.expandable {
            self.unmap_free_pages()?;
        }
        let mut pools = vec![SMALL, LARGE];
        pools.extend(self.private.freeable_pools());
        for pool in pools {
            self.fuse_and_release(pool)?;
        }
        self.private.erase_empty();
        Ok(())
    }

    /// Fuses `pool`'s free plain segments split among streams and releases
    /// every whole one. The fusing is safe because a release waits for the
    /// whole device; when one fails, the blocks fused and not released
    /// would be cached under one stream with other streams' work perhaps
    /// still queued on them, so the device is synchronized before the error
    /// is returned (a failure there too leaves nothing better to do).
    pub(crate) fn fuse_and_release(&mut self, pool: PoolId) -> Result<(), AllocError> {
        self.fuse_free_segments(pool);
        self.release_whole_segments(pool).inspect_err(|_| {
            let _ = self.backend.synchronize();
        })
    }

    /// Releases every cached block of `pool` that spans a whole plain segment.
    pub(crate) fn release_whole_segments(&mut self, pool: PoolId) -> Result<(), AllocError> {
        let whole: Vec<BlockId> = self.heap.pools[pool as usize]
            .iter()
            .filter(|k| self.is_whole_segment(k.3))
            .map(|k| k.3)
            .collect();
        for id in whole {
            self.release_segment(id)?;
        }
        Ok(())
    }

    /// `release_available_cached_blocks`: with `max_split_size` set, release
    /// one oversize cached block large enough for the request, or else the
    /// largest oversize blocks of the stream until enough is released
    /// (the requesting stream's blocks only, as PyTorch).
    pub(crate) fn release_available_cached_blocks(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
    ) -> Result<bool, AllocError> {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return Ok(false);
        }
        let want = rounded.max(max_split);
        let p = &self.heap.pools[pool as usize];
        let mut oversize: Vec<(u64, BlockId)> = p
            .iter()
            .filter(|k| k.0 == stream && k.1 >= max_split && self.is_whole_segment(k.3))
            .map(|k| (k.1, k.3))
            .collect();
        oversize.sort_unstable();
        if let Some(&(_, id)) = oversize.iter().find(|(s, _)| *s >= want) {
            self.release_segment(id)?;
            return Ok(true);
        }
        let mut released = 0;
        while released < want {
            let Some((s, id)) = oversize.pop() else { break };
            self.release_segment(id)?;
            released += s;
        }
        Ok(released >= want)
    }

    /// Garbage collection (`garbage_collection_threshold`): while reserved
    /// memory exceeds the threshold times the limit, release whole cached
    /// large segments whose age (lookups since cached) is at least the average.
    pub(crate) fn garbage_collect(&mut self) -> Result<(), AllocError> {
        let Some(limit) = self.limit()? else {
            return Ok(());
        };
        let threshold = (self.config.gc_threshold * limit as f64) as i64;
        let reserved = self.stats.reserved_bytes.all.current;
        if reserved <= threshold {
            return Ok(());
        }
        let target = (reserved - threshold) as u64;
        // PyTorch's loop: the average age counts the cached large blocks
        // that are not split pieces (`!is_split()`); a pass frees every
        // whole segment at least that old, without stopping at the target
        // (so GC does not run again at once).
        // The plain large segments of the default pools: those of the
        // pool serving requests while PyTorch's expandable_segments is off.
        let gc_pool = match self.private.plain_requests_ids() {
            Some((_, large)) if self.expandable => large,
            _ => LARGE,
        };
        let now = self.heap.pools[gc_pool as usize].lookups;
        let mut total_age = 0u64;
        let mut freeable = 0u64;
        for k in self.heap.pools[gc_pool as usize].iter() {
            let b = &self.heap.blocks[k.3];
            if !b.is_split() && !self.heap.segments.get(b.segment).expandable {
                total_age += now - b.gc_base;
                freeable += 1;
            }
        }
        let mut reclaimed = 0u64;
        let mut freed_any = true;
        while reclaimed < target && freed_any && freeable > 0 {
            let threshold_age = total_age as f64 / freeable as f64;
            freed_any = false;
            let old: Vec<(u64, u64, BlockId)> = self.heap.pools[gc_pool as usize]
                .iter()
                .filter(|k| self.is_whole_segment(k.3))
                .map(|k| (now - self.heap.blocks[k.3].gc_base, k.1, k.3))
                .filter(|&(age, _, _)| age as f64 >= threshold_age)
                .collect();
            for (age, size, id) in old {
                freed_any = true;
                reclaimed += size;
                total_age -= age;
                freeable -= 1;
                self.release_segment(id)?;
            }
        }
        crate::log::garbage_collected(self.device, reserved, threshold, reclaimed);
        Ok(())
    }

    /// Merges the blocks of every plain segment of `pool` that is entirely
    /// free but split among several streams (Note [Cross-stream reuse]):
    /// releasing it waits for all work anyway, so the streams do not matter.
    pub(crate) fn fuse_free_segments(&mut self, pool: PoolId) {
        let firsts: Vec<BlockId> = self
            .heap
            .segments
            .iter()
            .filter(|(_, s)| s.pool == pool && !s.expandable)
            .map(|(_, s)| s.first)
            .collect();
        let kind = self.heap.pools[pool as usize].kind;
        for first in firsts {
            let mut all_free = true;
            let mut cur = Some(first);
            while let Some(id) = cur {
                all_free &= self.heap.blocks[id].state == BlockState::Free;
                cur = self.heap.blocks[id].next;
            }
            if !all_free || self.heap.blocks[first].next.is_none() {
                continue;
            }
            let mut pieces = 0i64;
            let mut bytes = 0i64;
            let mut cur = Some(first);
            while let Some(id) = cur {
                let b = &self.heap.blocks[id];
                let key = (b.stream, b.size, b.ptr, id);
                pieces += 1;
                bytes += b.size as i64;
                cur = b.next;
                self.heap.pools[pool as usize].remove(key);
                if id != first {
                    self.heap.blocks.remove(id);
                }
            }
            let b = &mut self.heap.blocks[first];
            b.size = bytes as u64;
            b.next = None;
            let key = (b.stream, b.size, b.ptr, first);
            self.heap.pools[pool as usize].insert(key);
            self.stats.inactive_split.update(kind, -pieces);
            self.stats.inactive_split_bytes.update(kind, -bytes);
        }
    }

    /// Whether a block spans a whole plain segment (and so can be released).
    pub(crate) fn is_whole_segment(&self, id: BlockId) -> bool {
        let b = &self.heap.blocks[id];
        !b.is_split() && !self.heap.segments.get(b.segment).expandable
    }

    /// Gives a plain segment of `pool` back to where it came from: the
    /// backend, or the other allocator serving the pool after the device
    /// finished its work (Note [Pools served by another allocator]).
    fn give_back(
        &mut self,
        pool: PoolId,
        ptr: u64,
        size: u64,
        stream: StreamId,
    ) -> Result<(), BackendError> {
        if self.private.source_mut(pool).is_some() {
            self.backend.synchronize()?;
        }
        match self.private.source_mut(pool) {
            Some(source) => {
                crate::segment_source::calling_source(|| source.release(ptr, size, stream))
            }
            None => self.backend.release(ptr, size),
        }
    }

    /// Returns a cached block that spans its whole segment to the backend.
    pub(crate) fn release_segment(&mut self, id: BlockId) -> Result<(), AllocError> {
        let b = &self.heap.blocks[id];
        debug_assert!(b.state == BlockState::Free && !b.is_split());
        let (ptr, size, stream, pool, seg) = (b.ptr, b.size, b.stream, b.pool, b.segment);
        let seg_stream = self.heap.segments.get(seg).stream;
        self.notify(SegmentAction::Free, pool, seg_stream, ptr, size);
        if let Err(e) = self.give_back(pool, ptr, size, seg_stream) {
            // Still there: say so again (Note [Segment events]).
            self.notify(SegmentAction::Alloc, pool, seg_stream, ptr, size);
            return Err(e.into());
        }
        self.heap.pools[pool as usize].remove((stream, size, ptr, id));
        let kind = self.heap.pools[pool as usize].kind;
        self.heap.segments.remove(seg);
        self.heap.blocks.remove(id);
        self.stats.segment.update(kind, -1);
        self.stats.reserved_bytes.update(kind, -(size as i64));
        self.stats.num_device_free += 1;
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.update(-1);
        }
        let code = pool_code(self.private.index_of(pool), kind == PoolKind::Large);
        self.private.segment_removed(pool);
        self.record(Action::SegmentFree, seg_stream, ptr, size, code);
        Ok(())
    }
}
