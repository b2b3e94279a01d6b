//! Segment observers: a callback on every change of the device memory the
//! allocator holds at an address.
//!
//! Note [Segment events]
//! Rationale: PyTorch's `AllocatorTraceTracker` lets ProcessGroupNCCL
//! register memory with NCCL when it appears and deregister it when it goes,
//! and memory history (memory_viz) wants the same events. Both need to know
//! exactly which addresses are backed by memory at any moment.
//! Approach: one observer per device, called under the device's lock:
//! [`SegmentAction::Alloc`] after a plain segment is obtained,
//! [`SegmentAction::Free`] before it is released; [`SegmentAction::Map`]
//! after a range of an expandable segment (or a stitch, Note \[Stitching\]) is
//! mapped, [`SegmentAction::Unmap`] before it is unmapped, with the range's
//! address and size. A consumer that adds a range on `Alloc`/`Map` and
//! removes it on `Free`/`Unmap` (and their unlisted forms, below) holds
//! exactly the ranges backed by memory.
//! If the driver refuses a release or an unmap announced before the call,
//! the range is announced again (`Alloc`/`Map`): it is still there.
//! An `Unmap` range always lies inside ranges announced by `Map`, but need
//! not be one of them (pages are unmapped in runs of whole handles). Private
//! pools are included. Pages held in the page pool (Note [Page pool]) are
//! at no address and are not announced. Segment events are off the
//! per-allocation hot path; without an observer each costs one branch.
//!
//! Two views, one stream of events. Memory history replays its events
//! backwards from the snapshot's segments (MemoryViz), so it needs the
//! ranges the snapshot lists, which are not always the ranges backed: a
//! stitch's range aliases pages of its home segments, and the snapshot
//! lists the stitch while it is in use and its home runs otherwise; the old
//! range of moved pages leaves the snapshot at once and is unmapped when its
//! work is done (Note [Unmapping behind the work]). So `Alloc`, `Free`,
//! `Map` and `Unmap` change both views; [`SegmentAction::MapUnlisted`] and
//! [`SegmentAction::UnmapUnlisted`] only the backed ranges (a stitch built,
//! repaired or torn down, an old range unmapped at last); and
//! [`SegmentAction::Listed`] and [`SegmentAction::Unlisted`] only the
//! listed ones (a stitch taken from or given back to the cache, with its
//! home runs the other way; an old range left behind). A consumer of
//! backed ranges (NCCL registration) takes the first six, a consumer of
//! listed ones (memory history) the four that change both and the last
//! two; after every call, the listed ranges are the snapshot's segments.
//!
//! Memory history also wants to know when a free completes, which is
//! later than the free for a block used on other streams
//! (`record_stream`): [`SegmentAction::BlockFreeDeferred`] during such a
//! free and [`SegmentAction::BlockFreeCompleted`] once the block is free,
//! with the block's address and size. Any other free completes at once and
//! is told nothing (it is the hot path).
//!
//! Every event names the private pool that holds the range (the id given
//! to `begin_allocate_to_pool`: a CUDA graph's or a `MemPool`'s), `(0, 0)`
//! for the default pools and stitches: ProcessGroupNCCL registers the new
//! segments of a `MemPool` registered with it by that id.

use std::sync::Arc;

use crate::backend::{DevicePtr, StreamId};
use crate::pool::PoolKey;

/// What happened to a range of device memory (Note [Segment events]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SegmentAction {
    /// A plain segment was obtained from the device (`cudaMalloc`).
    Alloc,
    /// A plain segment is about to go back to the device (`cudaFree`).
    Free,
    /// A range of an expandable segment or a stitch was mapped.
    Map,
    /// A range of an expandable segment or a stitch is about to be unmapped.
    Unmap,
    /// A range was mapped that the snapshot does not list (a stitch's
    /// range, or its holes filled).
    MapUnlisted,
    /// A range the snapshot no longer lists is about to be unmapped (a
    /// cached stitch's range or parts; the old range of moved pages).
    UnmapUnlisted,
    /// A mapped range enters the snapshot (a stitch taken from the cache,
    /// or the home runs of one given back).
    Listed,
    /// A mapped range leaves the snapshot (the home runs a stitch takes, a
    /// stitch given back to the cache, the old range of moved pages).
    Unlisted,
    /// Not a range's change: the block at the address, freed with uses on
    /// other streams (`record_stream`), waits for their work before it is
    /// free (PyTorch's `TraceEntry::FREE_REQUESTED` without its
    /// `FREE_COMPLETED`). Told during the free, on the freeing thread.
    BlockFreeDeferred,
    /// Not a range's change: the block of a [`SegmentAction::BlockFreeDeferred`]
    /// is free now (PyTorch's `TraceEntry::FREE_COMPLETED`).
    BlockFreeCompleted,
}

impl SegmentAction {
    /// Whether the range is backed by memory after the event; `None` when
    /// the event does not change that.
    pub fn backed(self) -> Option<bool> {
        match self {
            SegmentAction::Alloc | SegmentAction::Map | SegmentAction::MapUnlisted => Some(true),
            SegmentAction::Free | SegmentAction::Unmap | SegmentAction::UnmapUnlisted => {
                Some(false)
            }
            SegmentAction::Listed
            | SegmentAction::Unlisted
            | SegmentAction::BlockFreeDeferred
            | SegmentAction::BlockFreeCompleted => None,
        }
    }

    /// Whether the snapshot lists the range after the event; `None` when
    /// the event does not change that.
    pub fn listed(self) -> Option<bool> {
        match self {
            SegmentAction::Alloc | SegmentAction::Map | SegmentAction::Listed => Some(true),
            SegmentAction::Free | SegmentAction::Unmap | SegmentAction::Unlisted => Some(false),
            SegmentAction::MapUnlisted
            | SegmentAction::UnmapUnlisted
            | SegmentAction::BlockFreeDeferred
            | SegmentAction::BlockFreeCompleted => None,
        }
    }
}

/// One segment event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentEvent {
    /// Device index.
    pub device: u32,
    /// What happened.
    pub action: SegmentAction,
    /// Start of the range.
    pub address: DevicePtr,
    /// Bytes.
    pub size: u64,
    /// The stream the segment or range was obtained for.
    pub stream: StreamId,
    /// The private pool that holds the range; `(0, 0)` for the default
    /// pools and stitches.
    pub pool: PoolKey,
}

/// Called on every segment event, under the device's lock: it must not call
/// back into the allocator.
pub type SegmentObserver = Arc<dyn Fn(&SegmentEvent) + Send + Sync>;

/// What tells `observer` (if any) about device `device`'s segment events:
/// `(action, stream, address, bytes, pool)`. It borrows only the observer,
/// so the caller may change the rest of the device meanwhile (`drain.rs`).
pub(crate) fn teller(
    observer: &Option<SegmentObserver>,
    device: u32,
) -> impl Fn(SegmentAction, StreamId, DevicePtr, u64, PoolKey) + '_ {
    move |action, stream, address, size, pool| {
        if let Some(o) = observer {
            o(&SegmentEvent {
                device,
                action,
                address,
                size,
                stream,
                pool,
            });
        }
    }
}
