//! Checkpoints of a private pool, for cudagraph trees (`torch.compile`,
//! `mode="reduce-overhead"`).
//!
//! Note [Pool checkpoints]
//! Rationale: cudagraph trees record several graphs into one private pool.
//! Before recording a graph that branches off an earlier point, PyTorch puts
//! the pool back to the layout it had there (`getCheckpointState`,
//! `setCheckpointPoolState`), so that the new graph's addresses agree with
//! those the earlier graphs' replays use; `checkPoolLiveAllocations` asks
//! which of the pool's blocks are still allocated.
//! Approach: a checkpoint lists every mapped block of the pool's segments
//! (the snapshot's segments: one per mapped run of an expandable segment),
//! free and allocated, with its stream. A restore (1) frees every block
//! allocated in the pool, as ordinary frees; (2) cuts the free memory so
//! that each checkpointed block exists exactly, with its stream; (3)
//! allocates the blocks the checkpoint had allocated, as ordinary
//! allocations. Stats and the trace see a free and an alloc of each, so a
//! trace still accounts for every block. Free blocks then merge with free
//! neighbours of their stream as always: a checkpointed free block comes
//! back larger when the pool has mapped more pages next to it since.
//! Everything is validated before anything changes: each block lies inside
//! memory the pool maps, at a 512-byte step from its start; blocks do not
//! overlap; no block of the pool waits on another stream's work (freeing it
//! would not make its memory free now; PyTorch refuses it too).
//! Limitation: a restore maps and unmaps nothing, so a checkpoint of memory
//! the pool no longer maps (released and emptied since) is refused.
//! While tracing, each checkpoint is numbered by its content and recorded
//! (`get_checkpoint_state`), and a restore records the number it puts back
//! (`set_checkpoint_pool_state`) before its frees and allocs: a replay
//! takes the same checkpoints of its own pool and restores them, so the
//! blocks come back where the recording put them (`replay_pools.rs`).

use crate::backend::{Backend, DevicePtr, StreamId};
use crate::block::{BlockId, BlockState, SegmentId};
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::pool::PoolKey;
use crate::size_class::{MIN_BLOCK_SIZE, PoolKind};
use crate::trace::PoolOp;

/// One block of a private pool's checkpoint ([`DeviceAllocator::pool_checkpoint`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CheckpointBlock {
    /// Start address.
    pub address: DevicePtr,
    /// Bytes (rounded, as allocated).
    pub size: u64,
    /// The block's stream.
    pub stream: StreamId,
    /// Start of the mapped run (snapshot segment) holding it.
    pub segment_address: DevicePtr,
    /// Allocated (else free, or waiting on other streams' work).
    pub allocated: bool,
}

/// What a restore frees and allocates ([`DeviceAllocator::restore_pool`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreDelta {
    /// Blocks that were allocated in the pool, in address order: all freed.
    pub freed: Vec<DevicePtr>,
    /// The checkpoint's allocated blocks, in the order given: all allocated.
    pub allocated: Vec<DevicePtr>,
}

/// What names a checkpoint in trace records (Note [Pool checkpoints]).
fn content_hash(blocks: &[CheckpointBlock]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = rustc_hash::FxHasher::default();
    blocks.hash(&mut h);
    h.finish()
}

/// Inactive-split figures `(blocks, bytes)` per pool kind (small, large).
type SplitTally = [(i64, i64); 2];

impl<B: Backend> DeviceAllocator<B> {
    /// The segments of private pool `key` (small and large).
    fn pool_segments(&self, key: PoolKey) -> Result<Vec<SegmentId>, AllocError> {
        let (small, large, _) = self
            .private
            .find(key)
            .ok_or(AllocError::UnknownPool { pool: key })?;
        Ok(self
            .heap
            .segments
            .iter()
            .filter(|(_, s)| s.pool == small || s.pool == large)
            .map(|(id, _)| id)
            .collect())
    }

    /// The mapped blocks of private pool `key` in address order, each with
    /// the start of its mapped run (as the snapshot cuts segments).
    fn pool_blocks(&self, key: PoolKey) -> Result<Vec<(BlockId, DevicePtr)>, AllocError> {
        let mut out = Vec::new();
        for seg in self.pool_segments(key)? {
            let mut run = None;
            let mut cur = Some(self.heap.segments.get(seg).first);
            while let Some(id) = cur {
                let b = &self.heap.blocks[id];
                cur = b.next;
                if matches!(b.state, BlockState::Unmapped | BlockState::Claimed) {
                    run = None;
                } else {
                    out.push((id, *run.get_or_insert(b.ptr)));
                }
            }
        }
        out.sort_unstable_by_key(|&(id, _)| self.heap.blocks[id].ptr);
        Ok(out)
    }

    /// Addresses of the blocks allocated in private pool `key`, in address
    /// order (PyTorch's `checkPoolLiveAllocations` compares them).
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`].
    pub fn pool_live_allocations(&self, key: PoolKey) -> Result<Vec<DevicePtr>, AllocError> {
        Ok(self
            .pool_blocks(key)?
            .into_iter()
            .map(|(id, _)| &self.heap.blocks[id])
            .filter(|b| b.state == BlockState::Allocated)
            .map(|b| b.ptr)
            .collect())
    }

    /// Every mapped block of private pool `key`, free and allocated, in
    /// address order (PyTorch's `getCheckpointState`; Note [Pool checkpoints]).
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`].
    pub fn pool_checkpoint(&mut self, key: PoolKey) -> Result<Vec<CheckpointBlock>, AllocError> {
        self.pool_checkpoint_if(key, |_| true)
    }

    /// [`pool_checkpoint`](Self::pool_checkpoint), recorded in the trace
    /// only when `taken` says the caller keeps it (the C ABI asks again
    /// with a larger buffer when the first was too small: one checkpoint,
    /// one record).
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`].
    pub fn pool_checkpoint_if(
        &mut self,
        key: PoolKey,
        taken: impl FnOnce(&[CheckpointBlock]) -> bool,
    ) -> Result<Vec<CheckpointBlock>, AllocError> {
        let blocks = self.checkpoint_blocks(key)?;
        if self.trace.is_some() && taken(&blocks) {
            let n = self.private.number_checkpoint(content_hash(&blocks));
            self.record_pool_checkpoint_call(PoolOp::Checkpoint, key, n);
        }
        Ok(blocks)
    }

    fn checkpoint_blocks(&self, key: PoolKey) -> Result<Vec<CheckpointBlock>, AllocError> {
        Ok(self
            .pool_blocks(key)?
            .into_iter()
            .map(|(id, run)| {
                let b = &self.heap.blocks[id];
                CheckpointBlock {
                    address: b.ptr,
                    size: b.size,
                    stream: b.stream,
                    segment_address: run,
                    allocated: b.state == BlockState::Allocated,
                }
            })
            .collect())
    }

    /// Checks that private pool `key` can be put back to `blocks` and says
    /// what that would free and allocate; changes nothing.
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`], or [`AllocError::BadCheckpoint`] naming
    /// the first problem (Note [Pool checkpoints]).
    pub fn plan_pool_restore(
        &self,
        key: PoolKey,
        blocks: &[CheckpointBlock],
    ) -> Result<RestoreDelta, AllocError> {
        let current = self.pool_blocks(key)?;
        let bad = |reason: String| AllocError::BadCheckpoint {
            pool: key,
            device: self.device,
            reason,
        };
        // The pool's mapped runs, `[start, end)`, in address order.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &(id, start) in &current {
            let b = &self.heap.blocks[id];
            match runs.last_mut() {
                Some(r) if r.0 == start => r.1 = b.ptr + b.size,
                _ => runs.push((start, b.ptr + b.size)),
            }
            if b.state == BlockState::PendingFree || !b.stream_uses.is_empty() {
                return Err(bad(format!(
                    "its block at {:#x} is used on other streams (record_stream) and cannot be freed before their work is done",
                    b.ptr
                )));
            }
        }
        for c in blocks {
            let end = c.address.saturating_add(c.size);
            let run = runs.get(runs.partition_point(|r| r.1 <= c.address));
            let Some(&(start, _)) = run.filter(|r| r.0 <= c.address && end <= r.1) else {
                return Err(bad(format!(
                    "block {:#x}+{} is not inside memory the pool maps",
                    c.address, c.size
                )));
            };
            if c.size == 0
                || c.size % MIN_BLOCK_SIZE != 0
                || (c.address - start) % MIN_BLOCK_SIZE != 0
            {
                return Err(bad(format!(
                    "block {:#x}+{} is not a positive multiple of {MIN_BLOCK_SIZE} bytes at a {MIN_BLOCK_SIZE}-byte step from its segment {start:#x}",
                    c.address, c.size
                )));
            }
        }
        let mut sorted: Vec<&CheckpointBlock> = blocks.iter().collect();
        sorted.sort_unstable_by_key(|c| c.address);
        if let Some(w) = sorted
            .windows(2)
            .find(|w| w[0].address + w[0].size > w[1].address)
        {
            return Err(bad(format!(
                "blocks {:#x}+{} and {:#x}+{} overlap",
                w[0].address, w[0].size, w[1].address, w[1].size
            )));
        }
        Ok(RestoreDelta {
            freed: current
                .iter()
                .map(|&(id, _)| &self.heap.blocks[id])
                .filter(|b| b.state == BlockState::Allocated)
                .map(|b| b.ptr)
                .collect(),
            allocated: blocks
                .iter()
                .filter(|c| c.allocated)
                .map(|c| c.address)
                .collect(),
        })
    }

    /// Puts private pool `key` back to a checkpoint taken by
    /// [`pool_checkpoint`](Self::pool_checkpoint) (PyTorch's
    /// `setCheckpointPoolState`; Note [Pool checkpoints]).
    ///
    /// # Errors
    /// As [`plan_pool_restore`](Self::plan_pool_restore); nothing changes then.
    pub fn restore_pool(
        &mut self,
        key: PoolKey,
        blocks: &[CheckpointBlock],
    ) -> Result<RestoreDelta, AllocError> {
        self.restore_pool_if(key, blocks, |_| Ok(()))
    }

    /// [`restore_pool`](Self::restore_pool) once `accept` agrees with what
    /// it would free and allocate (the C ABI checks its buffers there); when
    /// validation or `accept` refuses, nothing changes.
    ///
    /// # Errors
    /// As [`plan_pool_restore`](Self::plan_pool_restore), or `accept`'s.
    pub fn restore_pool_if<E: From<AllocError>>(
        &mut self,
        key: PoolKey,
        blocks: &[CheckpointBlock],
        accept: impl FnOnce(&RestoreDelta) -> Result<(), E>,
    ) -> Result<RestoreDelta, E> {
        let delta = self.plan_pool_restore(key, blocks)?;
        accept(&delta)?;
        if self.trace.is_some() {
            let n = self.private.checkpoint_number(content_hash(blocks));
            self.record_pool_checkpoint_call(PoolOp::Restore, key, n.unwrap_or(u64::MAX));
        }
        for &p in &delta.freed {
            self.free(p)?;
        }
        // Every mapped block of the pool is free and indexed now.
        let segs = self.pool_segments(key)?;
        let seg_of = |this: &Self, addr: u64| {
            *segs
                .iter()
                .find(|&&s| {
                    let s = this.heap.segments.get(s);
                    s.ptr <= addr && addr < s.ptr + s.size
                })
                .expect("validated: inside the pool")
        };
        let before = self.split_tally(&segs);
        let mut carved = Vec::with_capacity(blocks.len());
        for c in blocks {
            let seg = seg_of(self, c.address);
            carved.push(self.carve_exact(seg, c.address, c.size, c.stream));
        }
        for (c, &id) in blocks.iter().zip(&carved).filter(|(c, _)| c.allocated) {
            self.heap.unindex(id);
            let pool = self.heap.blocks[id].pool;
            self.mark_allocated(id, pool, c.stream, c.size);
        }
        for &seg in &segs {
            self.heap.coalesce_segment(seg);
        }
        let after = self.split_tally(&segs);
        let plain = self
            .private
            .find(key)
            .is_some_and(|(small, _, _)| self.plain_pool(small));
        if plain {
            for (i, kind) in [PoolKind::Small, PoolKind::Large].into_iter().enumerate() {
                let s = &mut self.stats;
                s.inactive_split.update(kind, after[i].0 - before[i].0);
                s.inactive_split_bytes
                    .update(kind, after[i].1 - before[i].1);
            }
        }
        Ok(delta)
    }

    /// Cuts the free memory of `seg` so that one free block covers exactly
    /// `[addr, addr + size)` with `stream`; returns it (indexed). Pre: the
    /// range lies in mapped memory of `seg` whose blocks are all free.
    fn carve_exact(&mut self, seg: SegmentId, addr: u64, size: u64, stream: StreamId) -> BlockId {
        let heap = &mut self.heap;
        let mut id = heap.block_at(seg, addr);
        heap.unindex(id);
        let start = heap.blocks[id].ptr;
        if start < addr {
            let front = heap.carve_front(id, addr - start, BlockState::Free);
            heap.reindex(front);
        }
        while heap.blocks[id].size < size {
            let n = heap.blocks[id]
                .next
                .expect("validated: inside a mapped run");
            debug_assert_eq!(heap.blocks[n].state, BlockState::Free);
            heap.unindex(n);
            heap.absorb_next(id);
        }
        if heap.blocks[id].size > size {
            let exact = heap.carve_front(id, size, BlockState::Free);
            heap.reindex(id);
            id = exact;
        }
        heap.blocks[id].stream = stream;
        heap.reindex(id);
        id
    }

    /// Free blocks of split plain segments among `segs` (what the
    /// `inactive_split` stats count), per pool kind.
    fn split_tally(&self, segs: &[SegmentId]) -> SplitTally {
        let mut t = [(0, 0); 2];
        for &seg in segs {
            let s = self.heap.segments.get(seg);
            if s.expandable || self.heap.blocks[s.first].next.is_none() {
                continue;
            }
            let k = usize::from(s.kind == PoolKind::Large);
            let mut cur = Some(s.first);
            while let Some(id) = cur {
                let b = &self.heap.blocks[id];
                if b.state == BlockState::Free {
                    t[k].0 += 1;
                    t[k].1 += b.size as i64;
                }
                cur = b.next;
            }
        }
        t
    }
}
