//! Blocks: the pieces a segment is cut into, kept in an arena.
//!
//! A block is a contiguous range of one segment. The blocks of a segment form
//! a doubly linked list in address order (`prev`/`next` are arena indices,
//! never pointers) and tile the segment exactly. Free neighbours are merged
//! at once, so no two adjacent blocks of a segment are both free and
//! mergeable (same stream, no pending events): `check_invariants` checks it.

use crate::backend::{DevicePtr, StreamId};

/// Index of a block in the arena.
pub(crate) type BlockId = u32;
/// Index of a segment in the arena.
pub(crate) type SegmentId = u32;
/// Index of a pool in the device's pool table.
pub(crate) type PoolId = u32;

/// Where a block is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Cached: in its pool's free index, reusable by its stream.
    Free,
    /// Handed out to a caller.
    Allocated,
    /// Freed by the caller, waiting for events on the streams that used it
    /// (`record_stream`) before it becomes reusable (`active_pending_free`).
    PendingFree,
    /// Address space of an expandable segment with no memory behind it.
    Unmapped,
    /// Free memory lent to a stitch while the stitch is allocated
    /// (Note \[Stitching\]): neither free nor reusable at this address.
    Claimed,
}

/// One block. Field invariants are stated per field.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    /// Start address; `segment.ptr <= ptr`, `ptr + size <= segment end`.
    pub ptr: DevicePtr,
    /// Bytes; a multiple of 512.
    pub size: u64,
    /// Bytes the caller asked for (0 when free).
    pub requested: u64,
    /// The stream that may reuse this block without synchronization.
    pub stream: StreamId,
    /// The segment this block belongs to.
    pub segment: SegmentId,
    /// The pool whose free index holds this block when it is free.
    pub pool: PoolId,
    /// Lower neighbour in the same segment.
    pub prev: Option<BlockId>,
    /// Upper neighbour in the same segment.
    pub next: Option<BlockId>,
    /// Life-cycle state.
    pub state: BlockState,
    /// Other streams that used the block while allocated (`record_stream`).
    pub stream_uses: Vec<StreamId>,
    /// Outstanding events; the block is pending-free while non-zero.
    pub event_count: u32,
    /// Value of the pool's lookup counter when the block was cached (GC age).
    pub gc_base: u64,
    /// Free blocks: the fence epoch when its memory was last freed, 0 when
    /// no work ever touched it (Note [Event-ordered unmapping]).
    pub freed: u64,
}

impl Block {
    /// Its own stream, then every other stream that used it.
    pub fn streams(&self) -> Vec<StreamId> {
        std::iter::once(self.stream)
            .chain(self.stream_uses.iter().copied())
            .collect()
    }

    /// A block in `state` with no neighbours, no stream uses and no events.
    pub fn new(
        ptr: DevicePtr,
        size: u64,
        stream: StreamId,
        segment: SegmentId,
        pool: PoolId,
        state: BlockState,
    ) -> Block {
        Block {
            ptr,
            size,
            requested: 0,
            stream,
            segment,
            pool,
            prev: None,
            next: None,
            state,
            stream_uses: Vec::new(),
            event_count: 0,
            gc_base: 0,
            freed: 0,
        }
    }

    /// Whether the block shares its segment with other blocks.
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// A free-list arena of blocks.
#[derive(Default)]
pub(crate) struct BlockArena {
    slots: Vec<Block>,
    vacant: Vec<BlockId>,
    live: usize,
}

impl BlockArena {
    pub fn insert(&mut self, b: Block) -> BlockId {
        self.live += 1;
        if let Some(id) = self.vacant.pop() {
            self.slots[id as usize] = b;
            id
        } else {
            self.slots.push(b);
            (self.slots.len() - 1) as BlockId
        }
    }

    pub fn remove(&mut self, id: BlockId) {
        self.live -= 1;
        self.vacant.push(id);
    }

    pub fn len(&self) -> usize {
        self.live
    }
}

impl std::ops::Index<BlockId> for BlockArena {
    type Output = Block;
    #[inline]
    fn index(&self, id: BlockId) -> &Block {
        &self.slots[id as usize]
    }
}

impl std::ops::IndexMut<BlockId> for BlockArena {
    #[inline]
    fn index_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.slots[id as usize]
    }
}
