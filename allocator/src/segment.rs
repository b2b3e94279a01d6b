//! Segments: one backend allocation each.
//!
//! Coalescing never crosses segments: two segments that happen to be
//! adjacent in the address space were obtained by separate driver calls and
//! must be released separately (RMM's `is_head` rule). This is the root of
//! the "reserved but unallocated" fragmentation PyTorch users see.

use crate::backend::{DevicePtr, StreamId};
use crate::block::{BlockId, PoolId};
use crate::size_class::PoolKind;

/// One backend allocation.
#[derive(Clone, Debug)]
pub(crate) struct Segment {
    /// Start address, as the backend returned it.
    pub ptr: DevicePtr,
    /// Bytes, as requested from the backend.
    pub size: u64,
    /// Small or large pool.
    pub kind: PoolKind,
    /// The pool this segment's blocks belong to.
    pub pool: PoolId,
    /// The stream it was allocated for.
    pub stream: StreamId,
    /// Its lowest block.
    pub first: BlockId,
    /// An expandable segment: a reserved address range whose pages are
    /// mapped on demand (blocks in `Unmapped` state cover the rest).
    pub expandable: bool,
    /// Bytes mapped (expandable), or `size` (plain).
    pub mapped: u64,
}

/// A free-list arena of segments.
#[derive(Default)]
pub(crate) struct SegmentArena {
    slots: Vec<Option<Segment>>,
    vacant: Vec<u32>,
}

impl SegmentArena {
    pub fn insert(&mut self, s: Segment) -> u32 {
        if let Some(id) = self.vacant.pop() {
            self.slots[id as usize] = Some(s);
            id
        } else {
            self.slots.push(Some(s));
            (self.slots.len() - 1) as u32
        }
    }

    pub fn remove(&mut self, id: u32) -> Segment {
        self.vacant.push(id);
        self.slots[id as usize]
            .take()
            .expect("segment removed twice")
    }

    pub fn get(&self, id: u32) -> &Segment {
        self.slots[id as usize]
            .as_ref()
            .expect("dangling segment id")
    }

    pub fn get_mut(&mut self, id: u32) -> &mut Segment {
        self.slots[id as usize]
            .as_mut()
            .expect("dangling segment id")
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &Segment)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
    }
}
