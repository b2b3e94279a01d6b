//! Sharing an allocation with another process.
//!
//! Note [Sharing expandable memory]
//! Rationale: PyTorch shares a tensor of a plain segment through CUDA IPC
//! (`cudaIpcGetMemHandle` on the segment's base), which memory mapped with
//! `cuMemMap` does not support. Its expandable segments share by exporting
//! each physical handle as a POSIX file descriptor that the receiver copies
//! out of the sender with `pidfd_getfd`, a call unprivileged containers
//! refuse.
//! Approach: plain segments share as PyTorch's do ([`Sharing::Segment`]).
//! Expandable memory shares the physical handles behind the block, in
//! address order, each exported once by the backend and kept open until
//! the handle is released ([`Sharing::Handles`]); a stitched block shares
//! the handles its range aliases, in the stitch's order, those under the
//! block only (a stitch taken by a shorter request keeps a tail past it).
//! PyTorch's receiver maps handles of one size only, so before the first
//! share of a block whose handles differ in size, the run of handles under
//! it gets new handles of one size (at most `expandable_handle_mb`) with
//! the same contents: create, copy through a temporary mapping, map in
//! place, release the old ones, after waiting for the device. A handle at
//! either end of the run that holds another block's memory too (a
//! neighbour's) stays where it is, and the handles between get its size.
//! Only when nothing else lives in what moves (no other tensor's memory
//! moves; in a private pool, a graph's or a `MemPool`'s, no other block at all, since
//! the replays of a graph captured into it write the blocks freed during
//! the capture), none of its handles is under a live block shared already
//! (a receiver uses it there; a handle exported for a block since freed
//! may get new memory, `shares.rs`), no capture is open, and the copy fits under the memory limit and on the device;
//! otherwise the share keeps the handles of several sizes, which only a
//! receiver under gpualloc opens. While the run is remapped the block
//! itself is briefly unmapped: a kernel that another thread launches on
//! the tensor being shared at that moment would fault. Which wire format
//! carries them and how the descriptors reach the receiver (a Unix socket
//! with `SCM_RIGHTS`, `pidfd_getfd` as the fallback) is the C ABI's
//! business (`capi/src/ipc.rs`). The sender's memory stays alive as long as
//! the tensor does (PyTorch keeps a shared storage alive until every
//! receiver let go); the receiver's imported handles keep the physical
//! memory alive on their own even after that.

use crate::backend::{Backend, BackendError, DevicePtr, HandleId};
use crate::block::{BlockId, BlockState};
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::heap::STITCH;
use crate::observer::SegmentAction;
use crate::size_class::PoolKind;

/// How an allocation can be shared. See Note [Sharing expandable memory].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// A plain segment: share the whole segment from `base` through CUDA
    /// IPC; the allocation starts `offset` bytes into it.
    Segment {
        /// The segment's first address.
        base: DevicePtr,
        /// The allocation's offset in the segment.
        offset: u64,
    },
    /// Expandable memory: physical handles mapped one after another, as
    /// exported descriptors with their sizes; the allocation starts
    /// `offset` bytes into the first.
    Handles {
        /// The allocation's offset from the first handle's start.
        offset: u64,
        /// `(descriptor, bytes)` per handle, in address order.
        parts: Vec<(i32, u64)>,
    },
}

impl<B: Backend> DeviceAllocator<B> {
    /// How to share the allocation that starts at `ptr` with another process.
    ///
    /// # Errors
    /// [`AllocError::InvalidPointer`] for a pointer that is not an allocated
    /// block's start; [`AllocError::Backend`] when a handle cannot be
    /// exported (a device without POSIX descriptor export).
    pub fn share(&mut self, ptr: DevicePtr) -> Result<Sharing, AllocError> {
        let invalid = AllocError::InvalidPointer {
            ptr,
            device: self.device,
        };
        let Some(&id) = self.live.get(&ptr) else {
            return Err(invalid);
        };
        let b = &self.heap.blocks[id];
        if b.state != BlockState::Allocated {
            return Err(invalid);
        }
        let (size, seg_id) = (b.size, b.segment);
        let seg = self.heap.segments.get(seg_id);
        let stitch = self.stitches.list.iter().find(|s| s.in_use == Some(seg_id));
        let mut handles: Vec<(DevicePtr, u64, u64)> = if let Some(st) = stitch {
            // Only the parts under the block: those past its end (a tail
            // not yet given back, Note [Stitch tails]) go home to other
            // blocks once trimmed.
            let mut at = st.va;
            st.slots
                .iter()
                .filter_map(|slot| {
                    at += slot.size();
                    slot.part().map(|p| (at - p.size, p.handle, p.size))
                })
                .filter(|&(lo, _, s)| lo < ptr + size && lo + s > ptr)
                .collect()
        } else if seg.expandable {
            self.pages.covering(ptr, ptr + size)
        } else {
            return Ok(Sharing::Segment {
                base: seg.ptr,
                offset: ptr - seg.ptr,
            });
        };
        let uniform = handles.windows(2).all(|w| w[0].2 == w[1].2);
        if !uniform && stitch.is_none() && seg.expandable {
            let (lo, hi) = (handles[0].0, handles.last().map_or(0, |h| h.0 + h.2));
            if self.uniform_handles(id, lo, hi)? {
                handles = self.pages.covering(ptr, ptr + size);
            }
        }
        let start = handles.first().map_or(ptr, |h| h.0);
        let covered = handles.iter().map(|h| h.2).sum::<u64>();
        let contiguous = handles.windows(2).all(|w| w[0].0 + w[0].2 == w[1].0);
        if start > ptr || start + covered < ptr + size || !contiguous {
            return Err(invalid);
        }
        let mut parts = Vec::with_capacity(handles.len());
        for &(_, h, s) in &handles {
            parts.push((self.backend.export_handle(h)?, s));
        }
        self.shares
            .shared(ptr, handles.iter().map(|&(_, h, _)| h).collect());
        Ok(Sharing::Handles {
            offset: ptr - start,
            parts,
        })
    }

    /// Gives the run of whole handles `[lo, hi)` under block `id` new
    /// handles of one size with the same contents (Note [Sharing expandable
    /// memory]). Returns whether it did; on `false` the run's memory and
    /// accounting are as they were (cached stitches over it may be gone).
    fn uniform_handles(
        &mut self,
        id: BlockId,
        lo: DevicePtr,
        hi: DevicePtr,
    ) -> Result<bool, AllocError> {
        let seg_id = self.heap.blocks[id].segment;
        let (stream, kind, pool) = {
            let seg = self.heap.segments.get(seg_id);
            (seg.stream, seg.kind, seg.pool)
        };
        let private = pool > STITCH;
        if self.private.capturing() {
            return Ok(false);
        }
        // The handle at either end may hold another block's memory too, or
        // be under a live shared block: it stays, and what lies between
        // gets handles of its size (Note [Sharing expandable memory]).
        let run = self.pages.handles_in(lo, hi);
        let (Some(&first), Some(&last)) = (run.first(), run.last()) else {
            return Ok(false);
        };
        let stays = |&(a, h, s): &(DevicePtr, HandleId, u64)| {
            self.shares.pins(h) || !self.only_block_in(id, a, a + s, private)
        };
        let (front, back) = (stays(&first), run.len() > 1 && stays(&last));
        let forced = match (front, back) {
            (false, false) => None,
            (true, false) => Some(first.2),
            (false, true) => Some(last.2),
            (true, true) if first.2 == last.2 => Some(first.2),
            (true, true) => return Ok(false),
        };
        // What moves: the run less the handles that stay.
        let old = &run[usize::from(front)..run.len() - usize::from(back)];
        let (Some(&(lo, _, _)), Some(&(end, _, s))) = (old.first(), old.last()) else {
            return Ok(false);
        };
        let (hi, len) = (end + s, end + s - lo);
        if forced.is_some_and(|s| !len.is_multiple_of(s))
            || old.iter().any(|&(_, h, _)| self.shares.pins(h))
            || !self.only_block_in(id, lo, hi, private)
        {
            return Ok(false);
        }
        if let Some(limit) = self.limit()?
            && self.stats.reserved_bytes.all.current as u64 + len > limit
        {
            return Ok(false);
        }
        let (page, max_handle) = self.handle_sizes(pool);
        let size = forced.unwrap_or_else(|| uniform_size(len, page, max_handle));
        self.drop_stitches_over(lo, hi)?;
        self.backend.synchronize()?;
        // The handles swapped out below go back to the driver: none may
        // still be mapped at an old address (Note [Unmapping behind the work]).
        self.finish_drains()?;
        let mut new: Vec<(HandleId, u64)> = Vec::new();
        while (new.len() as u64) * size < len {
            match self.backend.create_handle(size, false) {
                Ok(h) => new.push((h, size)),
                Err(e) => {
                    self.release_quietly(&new);
                    return match e {
                        BackendError::OutOfMemory { .. } => Ok(false),
                        e => Err(e.into()),
                    };
                }
            }
        }
        match self.copy_into(&new, lo, len) {
            Ok(()) => {}
            Err(CopyError::Clean(e)) => {
                self.release_quietly(&new);
                return match e {
                    BackendError::Driver { .. } => Err(e.into()),
                    _ => Ok(false),
                };
            }
            // Still mapped at the temporary range: leave them be.
            Err(CopyError::StillMapped(e)) => return Err(e.into()),
        }
        self.notify(SegmentAction::Unmap, pool, stream, lo, len);
        if let Err(e) = self.backend.unmap(lo, len) {
            self.notify(SegmentAction::Map, pool, stream, lo, len);
            self.release_quietly(&new);
            return Err(e.into());
        }
        if let Err(e) = self.backend.map_handles(lo, &new, false) {
            let back: Vec<(HandleId, u64)> = old.iter().map(|&(_, h, s)| (h, s)).collect();
            if self.backend.map_handles(lo, &back, false).is_ok() {
                self.notify(SegmentAction::Map, pool, stream, lo, len);
                self.release_quietly(&new);
            } else {
                // The blocks' memory is gone from their addresses.
                self.poisoned = true;
            }
            return Err(e.into());
        }
        self.notify(SegmentAction::Map, pool, stream, lo, len);
        let slot = usize::from(kind == PoolKind::Large);
        let mut created = [0i64; 2];
        created[slot] = len as i64;
        self.apply_deltas(created, len as i64);
        let mut released = [0i64; 2];
        for (oh, s) in self.pages.swap_in(lo, &new) {
            // A handle the driver keeps stays pooled, counted as before.
            match self.backend.release_handle(oh, s) {
                Ok(()) => released[slot] -= s as i64,
                Err(_) => self.pages.pool(oh, s, kind),
            }
        }
        self.apply_deltas(released, released[slot]);
        Ok(true)
    }

    /// Whether block `id` is the only block in `[lo, hi)` that is not free:
    /// the memory of no other tensor moves (Note [Sharing expandable memory]).
    /// In a private pool (`private`: a graph's or a `MemPool`'s), the only
    /// block at all: the replays of a graph captured into it write the
    /// blocks that were freed during the capture, and one replayed by
    /// another thread while the run moves would lose its writes.
    fn only_block_in(&self, id: BlockId, lo: DevicePtr, hi: DevicePtr, private: bool) -> bool {
        let mut b = Some(self.heap.block_at(self.heap.blocks[id].segment, lo));
        while let Some(x) = b {
            let blk = &self.heap.blocks[x];
            if blk.ptr >= hi {
                break;
            }
            if x != id && (private || blk.state != BlockState::Free) {
                return false;
            }
            b = blk.next;
        }
        true
    }

    fn release_quietly(&mut self, handles: &[(HandleId, u64)]) {
        for &(h, s) in handles {
            let _ = self.backend.release_handle(h, s);
        }
    }

    /// Maps `handles` at a temporary address and copies `[lo, lo + len)`
    /// into them.
    fn copy_into(
        &mut self,
        handles: &[(HandleId, u64)],
        lo: DevicePtr,
        len: u64,
    ) -> Result<(), CopyError> {
        let tmp = self.backend.reserve(len).map_err(CopyError::Clean)?;
        if let Err(e) = self.backend.map_handles(tmp, handles, false) {
            let _ = self.backend.free_reservation(tmp, len);
            return Err(CopyError::Clean(e));
        }
        let copied = self.backend.copy(tmp, lo, len);
        if let Err(e) = self.backend.unmap(tmp, len) {
            return Err(CopyError::StillMapped(e));
        }
        let _ = self.backend.free_reservation(tmp, len);
        copied.map_err(CopyError::Clean)
    }
}

/// Why [`DeviceAllocator::copy_into`] failed: with the new handles unmapped
/// again (free to release), or still mapped at the temporary range.
enum CopyError {
    Clean(BackendError),
    StillMapped(BackendError),
}

/// The handle size for a run of `len` bytes: the largest multiple of `page`
/// that divides `len` and is at most `max_handle` (`page` always does).
fn uniform_size(len: u64, page: u64, max_handle: u64) -> u64 {
    let pages = len / page;
    (1..=pages)
        .rev()
        .find(|&d| pages.is_multiple_of(d) && d * page <= max_handle.max(page))
        .map_or(page, |d| d * page)
}

#[cfg(test)]
mod tests {
    use super::uniform_size;

    const MIB: u64 = 1 << 20;

    #[test]
    fn runs_split_into_the_largest_even_handles_under_the_cap() {
        assert_eq!(uniform_size(100 * MIB, 2 * MIB, 32 * MIB), 20 * MIB);
        assert_eq!(uniform_size(98 * MIB, 2 * MIB, 32 * MIB), 14 * MIB);
        assert_eq!(uniform_size(94 * MIB, 2 * MIB, 32 * MIB), 2 * MIB);
        assert_eq!(uniform_size(8 * MIB, 2 * MIB, 2 * MIB), 2 * MIB);
        assert_eq!(uniform_size(16 * MIB, 2 * MIB, 64 * MIB), 16 * MIB);
    }
}
