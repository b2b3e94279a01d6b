//! The trace vocabulary, defined once: PyTorch's actions plus phases and marks.

use crate::backend::{DevicePtr, StreamId};

/// What happened. The names (see [`Action::name`]) are PyTorch's trace actions
/// where PyTorch has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Action {
    /// A block was handed out. `size`: requested bytes; `aux`: block size.
    Alloc = 0,
    /// The caller freed a block. `size`: requested bytes; `aux`: block size.
    FreeRequested = 1,
    /// The block became reusable (at once, or once its events completed).
    FreeCompleted = 2,
    /// A segment came from the backend. `size`: bytes; `aux`: pool (see [`pool_code`]).
    SegmentAlloc = 3,
    /// A segment went back to the backend. `size`: bytes; `aux`: pool.
    SegmentFree = 4,
    /// Pages were mapped into an expandable segment. `size`: bytes.
    SegmentMap = 5,
    /// Pages were unmapped from an expandable segment. `size`: bytes.
    SegmentUnmap = 6,
    /// An allocation failed. `size`: requested bytes; `aux`: free bytes on the device.
    Oom = 7,
    /// `empty_cache` ran. `size`: bytes released.
    EmptyCache = 8,
    /// A named phase began. `aux`: string id.
    PhasePush = 9,
    /// The innermost phase ended. `aux`: string id.
    PhasePop = 10,
    /// A named point in time (`gpualloc.mark("epoch 3")`). `aux`: string id.
    Mark = 11,
    /// A block was used on another stream (`record_stream`). `stream`: that stream.
    RecordStream = 12,
    /// A stream took another stream's cached block. `aux`: the stream it came from.
    StreamReuse = 13,
    /// The allocator waited for every outstanding event (`empty_cache`, the
    /// out-of-memory path); the `free_completed` records that follow in the
    /// same call come from that wait, not from polling.
    SyncAllStreams = 14,
    /// A free whose completion came in the same call (no other stream used
    /// the block): one record for `free_requested` + `free_completed`,
    /// fields as theirs. Only buffers and files hold it: readers yield the
    /// two events instead.
    Free = 15,
    /// Physical memory was created for the page pool (Note [Page pool]).
    /// `size`: bytes. Reserved memory grows by it; in traces holding these,
    /// `segment_map` and `segment_unmap` only move pooled memory.
    PagesCreate = 16,
    /// Pooled physical memory went back to the driver. `size`: bytes.
    PagesRelease = 17,
}

impl Action {
    /// Every action, in code order.
    pub const ALL: [Action; 18] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Oom,
        Action::EmptyCache,
        Action::PhasePush,
        Action::PhasePop,
        Action::Mark,
        Action::RecordStream,
        Action::StreamReuse,
        Action::SyncAllStreams,
        Action::Free,
        Action::PagesCreate,
        Action::PagesRelease,
    ];

    /// The action for a code, if valid.
    pub fn from_code(code: u8) -> Option<Action> {
        Action::ALL.get(code as usize).copied()
    }

    /// PyTorch's spelling (`alloc`, `free_requested`, `segment_alloc`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::EmptyCache => "empty_cache",
            Action::PhasePush => "phase_push",
            Action::PhasePop => "phase_pop",
            Action::Mark => "mark",
            Action::RecordStream => "record_stream",
            Action::StreamReuse => "stream_reuse",
            Action::SyncAllStreams => "sync_all_streams",
            Action::Free => "free",
            Action::PagesCreate => "pages_create",
            Action::PagesRelease => "pages_release",
        }
    }
}

/// `aux` of `segment_map` / `segment_unmap` for a stitch (Note [Stitching]):
/// a second mapping of pages already mapped, and counted, at home. Readers
/// count it neither as reserved memory nor as free space.
pub const STITCH_CODE: u64 = u64::MAX;

/// `aux` of segment events: 0 for the default small pool, 1 for the default
/// large pool, `2 + 2k` / `3 + 2k` for the small / large pool of the k-th
/// private (CUDA graph) pool created on the device ([`STITCH_CODE`] for a
/// stitch).
pub fn pool_code(private_index: Option<u32>, large: bool) -> u64 {
    let base = private_index.map_or(0, |k| 2 + 2 * u64::from(k));
    base + u64::from(large)
}

/// One trace record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// Nanoseconds since the trace started.
    pub time_ns: u64,
    /// What happened.
    pub action: Action,
    /// Device index.
    pub device: u32,
    /// Stream (raw `cudaStream_t`).
    pub stream: StreamId,
    /// Block or segment address (0 when none).
    pub addr: DevicePtr,
    /// Bytes, as [`Action`] documents per action.
    pub size: u64,
    /// Second operand, as [`Action`] documents per action.
    pub aux: u64,
    /// Small integer naming the calling thread.
    pub thread: u32,
}
