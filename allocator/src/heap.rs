//! The heap: blocks, the segments they tile, and the pools that index the
//! free ones. It owns the layout operations (carve, merge, index) and the
//! search for where a request fits in an expandable segment; what memory is
//! mapped, when it may move and what it costs belongs to the pieces around
//! it (`page_pool.rs`, `fence.rs`, `expandable.rs`).

use crate::backend::{DevicePtr, StreamId};
use crate::block::{Block, BlockArena, BlockId, BlockState, PoolId, SegmentId};
use crate::pool::{Pool, PoolKey};
use crate::segment::{Segment, SegmentArena};
use crate::size_class::PoolKind;

/// Pool id of the default small pool.
pub(crate) const SMALL: PoolId = 0;
/// Pool id of the default large pool.
pub(crate) const LARGE: PoolId = 1;
/// Pool id of stitched blocks (Note [Stitching]); private pools come after.
pub(crate) const STITCH: PoolId = 2;

/// A place for a request: segment, start, and the unmapped ranges to map.
pub(crate) type Window = (SegmentId, u64, Vec<(u64, u64)>);

/// Blocks, segments and pools of one device.
pub(crate) struct Heap {
    pub(crate) blocks: BlockArena,
    pub(crate) segments: SegmentArena,
    /// Pool table: `SMALL`, `LARGE`, `STITCH`, then the private pools' pools.
    pub(crate) pools: Vec<Pool>,
}

impl Default for Heap {
    fn default() -> Self {
        Heap {
            blocks: BlockArena::default(),
            segments: SegmentArena::default(),
            pools: vec![
                Pool::new(PoolKind::Small, None),
                Pool::new(PoolKind::Large, None),
                Pool::new(PoolKind::Large, None),
            ],
        }
    }
}

impl Heap {
    /// A slot in the pool table for a new private pool: `vacant` (a slot
    /// an erased pool left) or a new one.
    pub(crate) fn pool_slot(&mut self, vacant: Option<PoolId>) -> PoolId {
        vacant.unwrap_or_else(|| {
            self.pools.push(Pool::new(PoolKind::Small, None));
            (self.pools.len() - 1) as PoolId
        })
    }

    /// Empties the slots of a new private pool's `(small, large)` pools,
    /// which belong to `key` (`None`: reported as the default pools).
    pub(crate) fn reset_pools(&mut self, (small, large): (PoolId, PoolId), key: Option<PoolKey>) {
        self.pools[small as usize] = Pool::new(PoolKind::Small, key);
        self.pools[large as usize] = Pool::new(PoolKind::Large, key);
    }

    /// The best window over every expandable segment of `(pool, stream)`:
    /// fewest bytes to map, then the oldest segment, then the lowest address.
    pub(crate) fn find_window(
        &self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
        page: u64,
    ) -> Option<Window> {
        let mut best: Option<Window> = None;
        for &(s, seg) in &self.pools[pool as usize].expandable {
            if s != stream {
                continue;
            }
            if let Some((ws, ranges)) = self.best_window(seg, stream, rounded, page) {
                let cost = |r: &[(u64, u64)]| r.iter().map(|x| x.1 - x.0).sum::<u64>();
                if best.as_ref().is_none_or(|b| cost(&ranges) < cost(&b.2)) {
                    best = Some((seg, ws, ranges));
                }
            }
        }
        best
    }

    /// Where to place `rounded` bytes in an expandable segment: the
    /// window of free and unmapped space that needs the fewest new pages
    /// (lowest address on ties). Returns its start and the page ranges to map.
    pub(crate) fn best_window(
        &self,
        seg: SegmentId,
        stream: StreamId,
        rounded: u64,
        page: u64,
    ) -> Option<(u64, Vec<(u64, u64)>)> {
        let base = self.segments.get(seg).ptr;
        let floor = |x: u64| base + (x - base) / page * page;
        let ceil = |x: u64| base + (x - base).div_ceil(page) * page;
        let mut blocks = Vec::new();
        let mut cur = Some(self.segments.get(seg).first);
        while let Some(id) = cur {
            let b = &self.blocks[id];
            let usable = b.state == BlockState::Unmapped
                || (b.state == BlockState::Free && b.stream == stream);
            blocks.push((
                b.ptr,
                b.ptr + b.size,
                usable,
                b.state == BlockState::Unmapped,
            ));
            cur = b.next;
        }
        // The pages to map for a window: the unmapped parts it touches,
        // widened to whole pages (unmapped blocks are page-aligned).
        let to_map = |first: usize, ws: u64, we: u64| -> Vec<(u64, u64)> {
            blocks[first..]
                .iter()
                .take_while(|b| b.0 < we)
                .filter(|b| b.3 && b.1 > ws)
                .map(|b| (b.0.max(floor(ws)), b.1.min(ceil(we))))
                .collect()
        };
        let mut best: Option<(u64, u64, usize)> = None;
        let mut i = 0;
        while i < blocks.len() {
            if !blocks[i].2 {
                i += 1;
                continue;
            }
            let mut j = i;
            while j + 1 < blocks.len() && blocks[j + 1].2 {
                j += 1;
            }
            let (run_start, run_end) = (blocks[i].0, blocks[j].1);
            if run_end - run_start >= rounded {
                let starts = blocks[i..=j].iter().map(|b| b.0);
                let ends = blocks[i..=j]
                    .iter()
                    .filter(|b| b.1 >= run_start + rounded)
                    .map(|b| b.1 - rounded);
                for ws in starts.chain(ends).filter(|&ws| ws + rounded <= run_end) {
                    let first = i + blocks[i..=j].partition_point(|b| b.1 <= ws);
                    let cost: u64 = to_map(first, ws, ws + rounded)
                        .iter()
                        .map(|r| r.1 - r.0)
                        .sum();
                    if best.is_none_or(|b| (cost, ws) < (b.0, b.1)) {
                        best = Some((cost, ws, first));
                    }
                }
            }
            i = j + 1;
        }
        best.map(|(_, ws, first)| (ws, to_map(first, ws, ws + rounded)))
    }

    /// The block of `seg` that contains address `addr`.
    pub(crate) fn block_at(&self, seg: SegmentId, addr: u64) -> BlockId {
        self.find_block(seg, addr)
            .unwrap_or_else(|| panic!("address {addr:#x} is outside segment {seg}"))
    }

    /// The block of `seg` that contains address `addr`, if any.
    pub(crate) fn find_block(&self, seg: SegmentId, addr: u64) -> Option<BlockId> {
        let mut cur = Some(self.segments.get(seg).first);
        while let Some(id) = cur {
            let b = &self.blocks[id];
            if b.ptr <= addr && addr < b.ptr + b.size {
                return Some(id);
            }
            cur = b.next;
        }
        None
    }

    /// Merges a free, unindexed block with free neighbours of its stream
    /// and indexes the result.
    pub(crate) fn merge_free(&mut self, id: BlockId) {
        let stream = self.blocks[id].stream;
        let mergeable = |b: &Block| b.state == BlockState::Free && b.stream == stream;
        if let Some(n) = self.blocks[id].next
            && mergeable(&self.blocks[n])
        {
            self.ensure_unindexed(n);
            self.absorb_next(id);
        }
        let mut id = id;
        if let Some(p) = self.blocks[id].prev
            && mergeable(&self.blocks[p])
        {
            self.ensure_unindexed(p);
            id = self.absorb_next(p);
        }
        self.reindex(id);
    }

    /// Merges adjacent free blocks of the same stream in `seg` and makes sure
    /// every free block is in its pool's index.
    pub(crate) fn coalesce_segment(&mut self, seg: SegmentId) {
        let mut cur = Some(self.segments.get(seg).first);
        while let Some(id) = cur {
            if self.blocks[id].state == BlockState::Free {
                self.ensure_unindexed(id);
                while let Some(n) = self.blocks[id].next
                    && self.blocks[n].state == BlockState::Free
                    && self.blocks[n].stream == self.blocks[id].stream
                {
                    self.ensure_unindexed(n);
                    self.absorb_next(id);
                }
                self.reindex(id);
            }
            cur = self.blocks[id].next;
        }
    }

    pub(crate) fn ensure_unindexed(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let key = (b.stream, b.size, b.ptr, id);
        self.pools[b.pool as usize].remove(key);
    }

    /// Splits `bytes` off the front of block `id` as a new block in `state`
    /// (or changes the whole block when it is exactly that size); returns it.
    pub(crate) fn carve_front(&mut self, id: BlockId, bytes: u64, state: BlockState) -> BlockId {
        let b = &self.blocks[id];
        if b.size == bytes {
            self.blocks[id].state = state;
            return id;
        }
        let front = Block {
            prev: b.prev,
            next: Some(id),
            gc_base: b.gc_base,
            freed: b.freed,
            ..Block::new(b.ptr, bytes, b.stream, b.segment, b.pool, state)
        };
        let (prev, seg) = (b.prev, b.segment);
        let f = self.blocks.insert(front);
        match prev {
            Some(p) => self.blocks[p].next = Some(f),
            None => self.segments.get_mut(seg).first = f,
        }
        let b = &mut self.blocks[id];
        b.prev = Some(f);
        b.ptr += bytes;
        b.size -= bytes;
        f
    }

    /// Merges the block after `id` into `id`; returns `id`.
    pub(crate) fn absorb_next(&mut self, id: BlockId) -> BlockId {
        let n = self.blocks[id].next.expect("a next block to absorb");
        let (size, next, freed) = (
            self.blocks[n].size,
            self.blocks[n].next,
            self.blocks[n].freed,
        );
        let b = &mut self.blocks[id];
        b.size += size;
        b.next = next;
        b.freed = b.freed.max(freed);
        if let Some(nn) = next {
            self.blocks[nn].prev = Some(id);
        }
        self.blocks.remove(n);
        id
    }

    /// Removes a free block from its pool's index.
    pub(crate) fn unindex(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let key = (b.stream, b.size, b.ptr, id);
        let removed = self.pools[b.pool as usize].remove(key);
        debug_assert!(removed, "free block {id} was not indexed");
    }

    /// Puts a free block (back) into its pool's index.
    pub(crate) fn reindex(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let key = (b.stream, b.size, b.ptr, id);
        self.pools[b.pool as usize].insert(key);
    }

    /// Records a segment of `size` bytes at `ptr` with one block covering it:
    /// free (a plain segment) or unmapped (an expandable one).
    pub(crate) fn new_segment(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        pool: PoolId,
        stream: StreamId,
        expandable: bool,
    ) -> (u32, BlockId) {
        let state = if expandable {
            BlockState::Unmapped
        } else {
            BlockState::Free
        };
        let block = self
            .blocks
            .insert(Block::new(ptr, size, stream, 0, pool, state));
        let seg = self.segments.insert(Segment {
            ptr,
            size,
            kind: self.pools[pool as usize].kind,
            pool,
            stream,
            first: block,
            expandable,
            mapped: if expandable { 0 } else { size },
        });
        self.blocks[block].segment = seg;
        (seg, block)
    }

    /// Merges a free neighbour into `dst`; returns the bytes subsumed (0 if not mergeable).
    pub(crate) fn try_merge(&mut self, dst: BlockId, src: BlockId) -> u64 {
        let (s, d) = (&self.blocks[src], &self.blocks[dst]);
        if s.state != BlockState::Free || s.stream != d.stream {
            return 0;
        }
        let (src_size, src_ptr, src_stream, src_pool) = (s.size, s.ptr, s.stream, s.pool);
        self.pools[src_pool as usize].remove((src_stream, src_size, src_ptr, src));
        if self.blocks[dst].prev == Some(src) {
            let prev = self.blocks[src].prev;
            let d = &mut self.blocks[dst];
            d.ptr = src_ptr;
            d.prev = prev;
            if let Some(p) = prev {
                self.blocks[p].next = Some(dst);
            } else {
                let seg = self.blocks[dst].segment;
                self.segments.get_mut(seg).first = dst;
            }
        } else {
            let next = self.blocks[src].next;
            self.blocks[dst].next = next;
            if let Some(n) = next {
                self.blocks[n].prev = Some(dst);
            }
        }
        self.blocks[dst].size += src_size;
        self.blocks.remove(src);
        src_size
    }
}
