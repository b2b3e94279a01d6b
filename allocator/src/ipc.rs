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
//! the handles its range aliases, in the stitch's order. PyTorch's
//! receiver maps handles of one size only, so before the first share of a
//! block whose handles differ in size, the run of handles under it is given
//! one new handle with the same contents ([`DeviceAllocator::share`]:
//! create, copy through a temporary mapping, map in place, release the old
//! ones), after waiting for the device; never for handles exported
//! already (a receiver maps them), during a capture, or when the device has
//! no room for the copy (then the share keeps the handles of several
//! sizes, which only a receiver under gpualloc opens). Which wire format
//! carries them and how the descriptors reach the receiver (a Unix socket
//! with `SCM_RIGHTS`, `pidfd_getfd` as the fallback) is the C ABI's
//! business (`capi/src/ipc.rs`). The sender's memory stays alive as long as
//! the tensor does (PyTorch keeps a shared storage alive until every
//! receiver let go); the receiver's imported handles keep the physical
//! memory alive on their own even after that.

use crate::backend::{Backend, BackendError, DevicePtr, HandleId, StreamId};
use crate::block::BlockState;
use crate::device::DeviceAllocator;
use crate::error::AllocError;
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
            let mut at = st.va;
            st.parts
                .iter()
                .map(|p| {
                    at += p.size;
                    (at - p.size, p.handle, p.size)
                })
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
            let stream = seg.stream;
            let (lo, hi) = (handles[0].0, handles.last().map_or(0, |h| h.0 + h.2));
            if self.one_handle(stream, seg.kind, lo, hi)? {
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
        for (_, h, s) in handles {
            parts.push((self.backend.export_handle(h)?, s));
            self.pages.mark_exported(h);
        }
        Ok(Sharing::Handles {
            offset: ptr - start,
            parts,
        })
    }

    /// Gives the run of whole handles `[lo, hi)` one new handle with the
    /// same contents (Note [Sharing expandable memory]). Returns whether it
    /// did; `false` leaves everything as it was.
    fn one_handle(
        &mut self,
        stream: StreamId,
        kind: PoolKind,
        lo: DevicePtr,
        hi: DevicePtr,
    ) -> Result<bool, AllocError> {
        let old = self.pages.handles_in(lo, hi);
        if self.private.capturing() || old.iter().any(|&(_, h, _)| self.pages.is_exported(h)) {
            return Ok(false);
        }
        let len = hi - lo;
        self.drop_stitches_over(lo, hi)?;
        self.backend.synchronize()?;
        let h = match self.backend.create_handle(len, false) {
            Ok(h) => h,
            Err(BackendError::OutOfMemory { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        if let Err(e) = self.copy_into(h, lo, len) {
            let _ = self.backend.release_handle(h, len);
            return match e {
                BackendError::OutOfMemory { .. } | BackendError::Unavailable(_) => Ok(false),
                e => Err(e.into()),
            };
        }
        let mut created = [0i64; 2];
        created[usize::from(kind == PoolKind::Large)] = len as i64;
        self.apply_deltas(created, len as i64);
        self.notify(SegmentAction::Unmap, stream, lo, len);
        let mut moved = self.backend.unmap(lo, len);
        if moved.is_ok() {
            moved = self.backend.map_handles(lo, &[(h, len)], false);
            if moved.is_err() {
                let back: Vec<(HandleId, u64)> = old.iter().map(|&(_, h, s)| (h, s)).collect();
                if self.backend.map_handles(lo, &back, false).is_err() {
                    // The block's memory is gone from its addresses.
                    self.poisoned = true;
                }
            }
        }
        self.notify(SegmentAction::Map, stream, lo, len);
        if let Err(e) = moved {
            let _ = self.backend.release_handle(h, len);
            let mut undo = [0i64; 2];
            undo[usize::from(kind == PoolKind::Large)] = -(len as i64);
            self.apply_deltas(undo, -(len as i64));
            return Err(e.into());
        }
        let mut released = [0i64; 2];
        for (oh, s) in self.pages.swap_in(lo, h, len) {
            // A handle the driver keeps stays pooled, counted as before.
            match self.backend.release_handle(oh, s) {
                Ok(()) => released[usize::from(kind == PoolKind::Large)] -= s as i64,
                Err(_) => self.pages.pool(oh, s, kind),
            }
        }
        let total: i64 = released.iter().sum();
        self.apply_deltas(released, total);
        Ok(true)
    }

    /// Maps `h` at a temporary address and copies `[lo, lo + len)` into it.
    fn copy_into(&mut self, h: HandleId, lo: DevicePtr, len: u64) -> Result<(), BackendError> {
        let tmp = self.backend.reserve(len)?;
        let r = self
            .backend
            .map_handles(tmp, &[(h, len)], false)
            .and_then(|()| {
                let c = self.backend.copy(tmp, lo, len);
                let u = self.backend.unmap(tmp, len);
                c.and(u)
            });
        let f = self.backend.free_reservation(tmp, len);
        r.and(f)
    }
}
