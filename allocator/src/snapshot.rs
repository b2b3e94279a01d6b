//! The allocator's state as PyTorch's `memory_snapshot()` describes it:
//! segments in address order, each with the blocks that tile it.

use crate::backend::{Backend, DevicePtr, StreamId};
use crate::block::BlockState;
use crate::device::DeviceAllocator;
use crate::pool::PoolKey;
use crate::size_class::PoolKind;

/// One block of a [`SegmentSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSnapshot {
    /// Start address.
    pub address: DevicePtr,
    /// Bytes.
    pub size: u64,
    /// Bytes asked for (0 when free).
    pub requested_size: u64,
    /// Life-cycle state.
    pub state: BlockState,
}

impl BlockSnapshot {
    /// PyTorch's state name: `active_allocated`, `active_pending_free` or `inactive`.
    pub fn state_name(&self) -> &'static str {
        match self.state {
            BlockState::Allocated => "active_allocated",
            BlockState::PendingFree => "active_pending_free",
            BlockState::Free => "inactive",
        }
    }
}

/// One segment and its blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// Device index.
    pub device: u32,
    /// Start address.
    pub address: DevicePtr,
    /// Bytes.
    pub total_size: u64,
    /// Stream it was allocated for.
    pub stream: StreamId,
    /// Small or large pool.
    pub kind: PoolKind,
    /// Private pool id, `(0, 0)` for the default pools.
    pub pool_id: PoolKey,
    /// Blocks in address order, tiling the segment.
    pub blocks: Vec<BlockSnapshot>,
}

impl<B: Backend> DeviceAllocator<B> {
    /// Every segment, sorted by address.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let mut out: Vec<SegmentSnapshot> = self
            .segments
            .iter()
            .map(|(_, seg)| {
                let mut blocks = Vec::new();
                let mut cur = Some(seg.first);
                while let Some(id) = cur {
                    let b = &self.blocks[id];
                    blocks.push(BlockSnapshot {
                        address: b.ptr,
                        size: b.size,
                        requested_size: b.requested,
                        state: b.state,
                    });
                    cur = b.next;
                }
                SegmentSnapshot {
                    device: self.device,
                    address: seg.ptr,
                    total_size: seg.size,
                    stream: seg.stream,
                    kind: seg.kind,
                    pool_id: self.pools[seg.pool as usize].private.unwrap_or((0, 0)),
                    blocks,
                }
            })
            .collect();
        out.sort_by_key(|s| s.address);
        out
    }
}
