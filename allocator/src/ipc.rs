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
//! the handles its range aliases, in the stitch's order. Which wire format
//! carries them and how the descriptors reach the receiver (a Unix socket
//! with `SCM_RIGHTS`, `pidfd_getfd` as the fallback) is the C ABI's
//! business (`capi/src/ipc.rs`). The sender's memory stays alive as long as
//! the tensor does (PyTorch keeps a shared storage alive until every
//! receiver let go); the receiver's imported handles keep the physical
//! memory alive on their own even after that.

use crate::backend::{Backend, DevicePtr};
use crate::block::BlockState;
use crate::device::DeviceAllocator;
use crate::error::AllocError;

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
        let handles: Vec<(DevicePtr, u64, u64)> = if let Some(st) = stitch {
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
        let start = handles.first().map_or(ptr, |h| h.0);
        let covered = handles.iter().map(|h| h.2).sum::<u64>();
        let contiguous = handles.windows(2).all(|w| w[0].0 + w[0].2 == w[1].0);
        if start > ptr || start + covered < ptr + size || !contiguous {
            return Err(invalid);
        }
        let mut parts = Vec::with_capacity(handles.len());
        for (_, h, s) in handles {
            parts.push((self.backend.export_handle(h)?, s));
        }
        Ok(Sharing::Handles {
            offset: ptr - start,
            parts,
        })
    }
}
