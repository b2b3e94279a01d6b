//! The allocator's state as PyTorch's `memory_snapshot()` describes it:
//! segments in address order, each with the blocks that tile it.

use crate::backend::{Backend, DevicePtr, StreamId};
use crate::block::BlockState;
use crate::device::DeviceAllocator;
use crate::heap::STITCH;
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
            BlockState::Free | BlockState::Unmapped | BlockState::Claimed => "inactive",
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
    /// Part of an expandable segment (one mapped run of it).
    pub expandable: bool,
    /// Blocks in address order, tiling the segment.
    pub blocks: Vec<BlockSnapshot>,
}

impl<B: Backend> DeviceAllocator<B> {
    /// Every segment, sorted by address.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let mut out = Vec::new();
        for (_, seg) in self.heap.segments.iter() {
            let pool_id = self.heap.pools[seg.pool as usize].private.unwrap_or((0, 0));
            let mut run: Option<SegmentSnapshot> = None;
            let mut cur = Some(seg.first);
            while let Some(id) = cur {
                let b = &self.heap.blocks[id];
                cur = b.next;
                let claimed_at_home = b.state == BlockState::Claimed && seg.pool != STITCH;
                if b.state == BlockState::Unmapped || claimed_at_home {
                    // An expandable segment shows as one segment per mapped
                    // run; claimed runs show as the stitch that uses them.
                    out.extend(run.take());
                    continue;
                }
                let r = run.get_or_insert_with(|| SegmentSnapshot {
                    device: self.device,
                    address: b.ptr,
                    total_size: 0,
                    stream: seg.stream,
                    kind: seg.kind,
                    pool_id,
                    expandable: seg.expandable,
                    blocks: Vec::new(),
                });
                r.total_size += b.size;
                r.blocks.push(BlockSnapshot {
                    address: b.ptr,
                    size: b.size,
                    requested_size: b.requested,
                    state: b.state,
                });
            }
            out.extend(run);
        }
        out.sort_by_key(|s| s.address);
        out
    }
}
