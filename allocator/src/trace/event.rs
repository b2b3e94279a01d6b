//! The trace vocabulary, defined once: PyTorch's actions plus phases and marks.

use crate::backend::{DevicePtr, StreamId};

/// What happened. The names (see [`Action::name`]) are PyTorch's trace actions
/// where PyTorch has one. What `size` and `aux` mean for each action is
/// written below and decoded by [`TraceEvent::kind`] into [`EventKind`]:
/// read events through that, not by position (Note [Typed trace events]).
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
    /// A call on a private (CUDA graph) pool. `size`: which call
    /// ([`PoolOp`]); `aux`: the pool's index on the device (its creation
    /// order, as in [`pool_code`]); `addr`: a checkpoint's number, for the
    /// checkpoint calls.
    PrivatePool = 18,
    /// A cap on reserved memory was set while the program ran
    /// (`set_per_process_memory_fraction`, `gpualloc_set_memory_limit`), or
    /// differed from the configuration when the trace started; and, with
    /// no cap (2), the device's memory as a trace starts on it. `size`:
    /// which cap ([`MemoryCap`]: 0 the fraction of device memory, 1 the
    /// byte cap, 2 none); `aux`: its value (the fraction as the bits of an `f64`,
    /// 1.0 for none; bytes, `u64::MAX` for none); `addr`: the device's
    /// memory as the allocator read it, which a fraction is taken of (0:
    /// not known). A replay sets the same cap at the same point, a fraction
    /// taken of its own device's capacity.
    MemoryLimit = 19,
    /// Mapped memory left the view that memory snapshots show (Note
    /// [Listed ranges]): the home runs of a stitch taken into use, whose
    /// pages are used through the stitch now, or (pool
    /// [`STITCH_CODE`]) a stitch's range when it stops being used or part
    /// of it is unmapped while in use. `size`: bytes; `aux`: pool.
    /// Reserved memory and the mappings stay as they were.
    SegmentUnlist = 20,
    /// Mapped memory came back into that view: a stitch's home runs when it
    /// stops being used (or a tail of it is trimmed), or (pool
    /// [`STITCH_CODE`]) a stitch's range when it is taken into use. `size`:
    /// bytes; `aux`: pool.
    SegmentList = 21,
}

impl Action {
    /// Every action, in code order.
    pub const ALL: [Action; 22] = [
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
        Action::PrivatePool,
        Action::MemoryLimit,
        Action::SegmentUnlist,
        Action::SegmentList,
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
            Action::PrivatePool => "private_pool",
            Action::MemoryLimit => "memory_limit",
            Action::SegmentUnlist => "segment_unlist",
            Action::SegmentList => "segment_list",
        }
    }
}

// Note [Listed ranges]
// Rationale: a stitch (Note [Stitching]) maps pages a second time, so
// the ranges backed by memory overlap in what they hold. A reader that
// wants each byte once, as a memory snapshot shows it (MemoryViz's
// segments, PyTorch's `segment_map` history), needs to know where those
// pages are in use: through the stitch, or at home. The live snapshot
// knows (Note [Segment events] in `observer.rs`); before minor version 4
// the trace recorded only a stitch's life, and readers guessed which
// pages at home a stitch in use held.
// Approach: `segment_unlist` and `segment_list` record exactly the
// observer's `Unlisted` and `Listed` of stitches: taken into use, a
// stitch's home runs are unlisted and its range listed (pool
// [`STITCH_CODE`]); given back, the reverse; a tail trimmed while in
// use is unlisted from the stitch and its homes listed. The free of the
// stitch's block is recorded before the listing it causes, as memory
// history is told, so its block lies in a listed range at every record.
// Neither changes reserved memory or any mapping. So a trace's listed ranges at any
// point are the mapped ranges of the pools, less the unlisted home runs,
// plus the listed stitch ranges: each byte once. `summary` counts pages a
// stitch holds at home as neither free nor allocated, and `export
// --torch-snapshot` writes the listed ranges as MemoryViz's segments.
// Only stitches are recorded so: other ranges that leave the snapshot
// early (pages moved whose old range waits for its work) are recorded as
// unmapped then. The calls run only when a stitch is taken or given back,
// off the hot path, and only while tracing or observed.

/// `aux` of `segment_map` / `segment_unmap` for a stitch (Note \[Stitching\]):
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

/// The private-pool calls a trace records ([`Action::PrivatePool`]), named
/// as PyTorch's allocator names them. A replay makes the same calls, so
/// allocations go to the same pools and captures stop defragmentation at
/// the same moments as in the recording.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolOp {
    /// `begin_allocate_to_pool`: a scope opened, with a hold on the pool.
    BeginAllocate,
    /// `end_allocate_to_pool`: the pool's innermost scope closed.
    EndAllocate,
    /// `create_or_incref_pool`: a hold taken without a scope.
    Incref,
    /// `release_pool`: a hold dropped.
    Release,
    /// `empty_cache` of one pool (`emptyCache(mempool_id)`).
    EmptyCache,
    /// `getCheckpointState`: the pool's blocks were listed, as checkpoint
    /// number `checkpoint` of the device.
    Checkpoint,
    /// `setCheckpointPoolState`: the pool was put back to checkpoint
    /// number `checkpoint` (`u64::MAX`: one taken before the trace began);
    /// the frees and allocs it made follow in the same call.
    Restore,
    /// `create_or_incref_pool` with another allocator
    /// (`torch.cuda.MemPool(allocator=...)`): a hold taken without a
    /// scope; a pool it creates takes its segments from that allocator
    /// (Note [Pools served by another allocator]).
    IncrefServed,
    /// `setUseOnOOM` (`MemPool(use_on_oom=...)`): `checkpoint` is 1 for
    /// on, 0 for off.
    UseOnOom,
    /// `setNoSplit` (`MemPool(no_split=True)`).
    NoSplit,
    /// PyTorch's `expandable_segments` setting switched off (`checkpoint`
    /// is 1) or on again (0), by its variable or at run time: requests
    /// outside private pools take plain segments meanwhile, and a private
    /// pool created meanwhile grows by plain segments (Note [PyTorch's
    /// expandable_segments switch] in `plain_requests.rs`). The pool is
    /// `(0, 0)`.
    PlainRequests,
    /// A code this reader does not know (a later version's call).
    Other(u64),
}

impl PoolOp {
    /// The call's code (a record's `size`).
    pub fn code(self) -> u64 {
        match self {
            PoolOp::BeginAllocate => 0,
            PoolOp::EndAllocate => 1,
            PoolOp::Incref => 2,
            PoolOp::Release => 3,
            PoolOp::EmptyCache => 4,
            PoolOp::Checkpoint => 5,
            PoolOp::Restore => 6,
            PoolOp::IncrefServed => 7,
            PoolOp::UseOnOom => 8,
            PoolOp::NoSplit => 9,
            PoolOp::PlainRequests => 10,
            PoolOp::Other(c) => c,
        }
    }

    /// The call of a code (never fails: unknown codes are [`PoolOp::Other`]).
    pub fn from_code(code: u64) -> PoolOp {
        match code {
            0 => PoolOp::BeginAllocate,
            1 => PoolOp::EndAllocate,
            2 => PoolOp::Incref,
            3 => PoolOp::Release,
            4 => PoolOp::EmptyCache,
            5 => PoolOp::Checkpoint,
            6 => PoolOp::Restore,
            7 => PoolOp::IncrefServed,
            8 => PoolOp::UseOnOom,
            9 => PoolOp::NoSplit,
            10 => PoolOp::PlainRequests,
            c => PoolOp::Other(c),
        }
    }

    /// PyTorch's name of the call (`begin_allocate_to_pool`, ...).
    pub fn name(self) -> &'static str {
        match self {
            PoolOp::BeginAllocate => "begin_allocate_to_pool",
            PoolOp::EndAllocate => "end_allocate_to_pool",
            PoolOp::Incref => "create_or_incref_pool",
            PoolOp::Release => "release_pool",
            PoolOp::EmptyCache => "empty_pool_cache",
            PoolOp::Checkpoint => "get_checkpoint_state",
            PoolOp::Restore => "set_checkpoint_pool_state",
            PoolOp::IncrefServed => "create_or_incref_pool_with_allocator",
            PoolOp::UseOnOom => "set_use_on_oom",
            PoolOp::NoSplit => "set_no_split",
            PoolOp::PlainRequests => "set_allocator_settings",
            PoolOp::Other(_) => "unknown",
        }
    }
}

/// A cap on reserved memory, as a [`Action::MemoryLimit`] record sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryCap {
    /// A fraction of device memory, stored as the bits of an `f64` so that
    /// events stay `Eq` (1.0: no cap by fraction). Any bits decode: a
    /// damaged file may hold a NaN, which a replay refuses as a fraction.
    Fraction(u64),
    /// Bytes (`None`: no byte cap).
    Bytes(Option<u64>),
    /// No cap: the record only tells the device's memory (its `addr`),
    /// written first thing on a device when a trace starts (minor 5), so
    /// that a replay knows the size of the device the program ran on.
    DeviceSize,
    /// A code this reader does not know (a later version's cap), with its value.
    Other(u64, u64),
}

impl MemoryCap {
    /// The cap of a fraction.
    pub fn fraction(fraction: f64) -> MemoryCap {
        MemoryCap::Fraction(fraction.to_bits())
    }

    /// `(which, value)` as a record stores them (its `size` and `aux`).
    pub fn fields(self) -> (u64, u64) {
        match self {
            MemoryCap::Fraction(bits) => (0, bits),
            MemoryCap::Bytes(b) => (1, b.unwrap_or(u64::MAX)),
            MemoryCap::DeviceSize => (2, 0),
            MemoryCap::Other(which, value) => (which, value),
        }
    }

    /// The cap a record's `size` and `aux` store (never fails).
    pub fn from_fields(which: u64, value: u64) -> MemoryCap {
        match which {
            0 => MemoryCap::Fraction(value),
            1 => MemoryCap::Bytes((value != u64::MAX).then_some(value)),
            2 => MemoryCap::DeviceSize,
            _ => MemoryCap::Other(which, value),
        }
    }
}

/// A string-table id: the name of a phase or a mark
/// ([`TraceReader::string`](crate::trace::TraceReader::string) resolves it).
pub type StringId = u64;

/// The pool a segment event names (its `aux`, the pool code of
/// [`pool_code`]), with the stitch code told apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pool {
    /// A pool of the caching allocator: 0 default small, 1 default large,
    /// `2 + 2k` / `3 + 2k` small / large of the k-th private pool.
    Code(u64),
    /// [`STITCH_CODE`]: a second mapping of pages already mapped, and
    /// counted, at home (Note \[Stitching\]). Neither reserved memory nor
    /// free space. Traces written before the code existed record stitches
    /// as `Code(1)`.
    Stitch,
}

impl Pool {
    /// The pool of a segment event's pool code.
    #[inline]
    pub fn from_code(code: u64) -> Pool {
        if code == STITCH_CODE {
            Pool::Stitch
        } else {
            Pool::Code(code)
        }
    }

    /// The code as the file stores it ([`STITCH_CODE`] for a stitch).
    #[inline]
    pub fn code(self) -> u64 {
        match self {
            Pool::Code(c) => c,
            Pool::Stitch => STITCH_CODE,
        }
    }
}

/// One event, decoded by action: what `size` and `aux` mean for it, named.
///
/// Note [Typed trace events]: a record stores two positional operands,
/// `size` and `aux`, whose meaning depends on the action (the table in
/// docs/trace-format.md). [`TraceEvent::kind`] is the one place that reads
/// them by action, special values included ([`STITCH_CODE`] becomes
/// [`Pool::Stitch`]); every reader (the CLI, replay, tests) matches on this
/// enum instead, and a test (`tests/tests/all/structure.rs`) fails when a
/// file outside `allocator/src/trace/` reads `aux` itself. The file format
/// is unchanged: this is how code reads events, not how they are stored.
/// [`EventKind::fields`] is the inverse, for building records
/// ([`TraceEvent::from_kind`]). Time, device, stream and thread stay on
/// [`TraceEvent`]; `addr` is repeated here for the actions that have one.
///
/// Decoding never fails: every bit pattern of a record is some event, so a
/// damaged but checksummed file decodes too (its numbers may make no sense).
/// Operands an action does not use (the address of an `oom`, the `aux` of an
/// `empty_cache`) are left out, so `from_kind(e.kind())` zeroes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// [`Action::Alloc`]: `block_size` bytes (rounded) handed out for a
    /// request of `requested` bytes.
    Alloc {
        /// Block address.
        addr: DevicePtr,
        /// Bytes the caller asked for.
        requested: u64,
        /// Bytes of the block (rounded, as the allocator holds them).
        block_size: u64,
    },
    /// [`Action::FreeRequested`]: the caller freed the block.
    FreeRequested {
        /// Block address.
        addr: DevicePtr,
        /// Bytes the caller asked for.
        requested: u64,
        /// Bytes of the block (rounded, as the allocator holds them).
        block_size: u64,
    },
    /// [`Action::FreeCompleted`]: the block became reusable.
    FreeCompleted {
        /// Block address.
        addr: DevicePtr,
        /// Bytes the caller asked for.
        requested: u64,
        /// Bytes of the block (rounded, as the allocator holds them).
        block_size: u64,
    },
    /// [`Action::SegmentAlloc`]: a segment came from the backend.
    SegmentAlloc {
        /// First byte of the range.
        addr: DevicePtr,
        /// Bytes of the range.
        size: u64,
        /// Pool the range belongs to, or [`Pool::Stitch`].
        pool: Pool,
    },
    /// [`Action::SegmentFree`]: a segment went back to the backend.
    SegmentFree {
        /// First byte of the range.
        addr: DevicePtr,
        /// Bytes of the range.
        size: u64,
        /// Pool the range belongs to, or [`Pool::Stitch`].
        pool: Pool,
    },
    /// [`Action::SegmentMap`]: pages mapped at `addr` (a stitch when
    /// `pool` is [`Pool::Stitch`]).
    SegmentMap {
        /// First byte of the range.
        addr: DevicePtr,
        /// Bytes of the range.
        size: u64,
        /// Pool the range belongs to, or [`Pool::Stitch`].
        pool: Pool,
    },
    /// [`Action::SegmentUnmap`]: pages unmapped at `addr`.
    SegmentUnmap {
        /// First byte of the range.
        addr: DevicePtr,
        /// Bytes of the range.
        size: u64,
        /// Pool the range belongs to, or [`Pool::Stitch`].
        pool: Pool,
    },
    /// [`Action::Oom`]: a request of `requested` bytes failed with
    /// `device_free` bytes free on the device.
    Oom {
        /// Bytes the failed request asked for.
        requested: u64,
        /// Free bytes the device reported.
        device_free: u64,
    },
    /// [`Action::EmptyCache`]: `empty_cache` released `released` bytes.
    EmptyCache {
        /// Bytes released to the driver.
        released: u64,
    },
    /// [`Action::PhasePush`]: the phase `name` began.
    PhasePush {
        /// String id of the name.
        name: StringId,
    },
    /// [`Action::PhasePop`]: the phase `name` (the innermost) ended.
    PhasePop {
        /// String id of the name.
        name: StringId,
    },
    /// [`Action::Mark`]: a named point in time.
    Mark {
        /// String id of the name.
        name: StringId,
    },
    /// [`Action::RecordStream`]: the block at `addr` was used on
    /// `other_stream` (the event's stream field).
    RecordStream {
        /// Block address.
        addr: DevicePtr,
        /// The other stream (the record's stream field).
        other_stream: StreamId,
    },
    /// [`Action::StreamReuse`]: the event's stream took the cached block at
    /// `addr` of `block_size` bytes from `from_stream`.
    StreamReuse {
        /// Block address.
        addr: DevicePtr,
        /// Bytes of the block (rounded, as the allocator holds them).
        block_size: u64,
        /// The stream the block was cached on.
        from_stream: StreamId,
    },
    /// [`Action::SyncAllStreams`]: the allocator waited for `outstanding`
    /// events.
    SyncAllStreams {
        /// Events outstanding when the wait began.
        outstanding: u64,
    },
    /// [`Action::Free`]: `free_requested` and `free_completed` in one
    /// record (buffers and files only; readers yield the two events).
    Free {
        /// Block address.
        addr: DevicePtr,
        /// Bytes the caller asked for.
        requested: u64,
        /// Bytes of the block (rounded, as the allocator holds them).
        block_size: u64,
    },
    /// [`Action::PagesCreate`]: `bytes` of physical memory created for the
    /// page pool; reserved memory grows by it.
    PagesCreate {
        /// Bytes of physical memory.
        bytes: u64,
    },
    /// [`Action::PagesRelease`]: `bytes` of pooled physical memory went
    /// back to the driver.
    PagesRelease {
        /// Bytes of physical memory.
        bytes: u64,
    },
    /// [`Action::PrivatePool`]: the call `op` on the device's `pool`-th
    /// private pool.
    PrivatePool {
        /// Which call.
        op: PoolOp,
        /// The pool's index on the device (creation order; [`pool_code`]).
        pool: u64,
        /// The checkpoint's number on the device, for
        /// [`PoolOp::Checkpoint`] and [`PoolOp::Restore`] (0 otherwise).
        checkpoint: u64,
    },
    /// [`Action::MemoryLimit`]: a cap on reserved memory, from now on.
    MemoryLimit {
        /// The cap and its value.
        cap: MemoryCap,
        /// The device's memory as the allocator read it (the driver's
        /// total), which a fraction is taken of; 0 when not known.
        device_total: u64,
    },
    /// [`Action::SegmentUnlist`]: mapped memory left the snapshot's view.
    SegmentUnlist {
        /// First byte of the range.
        addr: DevicePtr,
        /// Bytes of the range.
        size: u64,
        /// Pool the range belongs to, or [`Pool::Stitch`].
        pool: Pool,
    },
    /// [`Action::SegmentList`]: mapped memory came back into it.
    SegmentList {
        /// First byte of the range.
        addr: DevicePtr,
        /// Bytes of the range.
        size: u64,
        /// Pool the range belongs to, or [`Pool::Stitch`].
        pool: Pool,
    },
}

impl EventKind {
    /// The action of this kind.
    #[inline]
    pub fn action(&self) -> Action {
        self.fields().0
    }

    /// `(action, addr, size, aux)` as a record stores them: the inverse of
    /// [`TraceEvent::kind`].
    #[inline]
    pub fn fields(&self) -> (Action, DevicePtr, u64, u64) {
        use EventKind as K;
        match *self {
            K::Alloc {
                addr,
                requested,
                block_size,
            } => (Action::Alloc, addr, requested, block_size),
            K::FreeRequested {
                addr,
                requested,
                block_size,
            } => (Action::FreeRequested, addr, requested, block_size),
            K::FreeCompleted {
                addr,
                requested,
                block_size,
            } => (Action::FreeCompleted, addr, requested, block_size),
            K::SegmentAlloc { addr, size, pool } => (Action::SegmentAlloc, addr, size, pool.code()),
            K::SegmentFree { addr, size, pool } => (Action::SegmentFree, addr, size, pool.code()),
            K::SegmentMap { addr, size, pool } => (Action::SegmentMap, addr, size, pool.code()),
            K::SegmentUnmap { addr, size, pool } => (Action::SegmentUnmap, addr, size, pool.code()),
            K::Oom {
                requested,
                device_free,
            } => (Action::Oom, 0, requested, device_free),
            K::EmptyCache { released } => (Action::EmptyCache, 0, released, 0),
            K::PhasePush { name } => (Action::PhasePush, 0, 0, name),
            K::PhasePop { name } => (Action::PhasePop, 0, 0, name),
            K::Mark { name } => (Action::Mark, 0, 0, name),
            K::RecordStream { addr, .. } => (Action::RecordStream, addr, 0, 0),
            K::StreamReuse {
                addr,
                block_size,
                from_stream,
            } => (Action::StreamReuse, addr, block_size, from_stream),
            K::SyncAllStreams { outstanding } => (Action::SyncAllStreams, 0, outstanding, 0),
            K::Free {
                addr,
                requested,
                block_size,
            } => (Action::Free, addr, requested, block_size),
            K::PagesCreate { bytes } => (Action::PagesCreate, 0, bytes, 0),
            K::PagesRelease { bytes } => (Action::PagesRelease, 0, bytes, 0),
            K::PrivatePool {
                op,
                pool,
                checkpoint,
            } => (Action::PrivatePool, checkpoint, op.code(), pool),
            K::MemoryLimit { cap, device_total } => {
                let (which, value) = cap.fields();
                (Action::MemoryLimit, device_total, which, value)
            }
            K::SegmentUnlist { addr, size, pool } => {
                (Action::SegmentUnlist, addr, size, pool.code())
            }
            K::SegmentList { addr, size, pool } => (Action::SegmentList, addr, size, pool.code()),
        }
    }
}

/// One trace record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// Nanoseconds since the trace started, as read once by the call that
    /// recorded the event (Note [One clock for decisions and traces]).
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

impl TraceEvent {
    /// A record of `kind` (its stream field is `other_stream` for a
    /// [`EventKind::RecordStream`], whatever `stream` says).
    pub fn from_kind(
        time_ns: u64,
        device: u32,
        stream: StreamId,
        thread: u32,
        kind: EventKind,
    ) -> TraceEvent {
        let (action, addr, size, aux) = kind.fields();
        let stream = match kind {
            EventKind::RecordStream { other_stream, .. } => other_stream,
            _ => stream,
        };
        TraceEvent {
            time_ns,
            action,
            device,
            stream,
            addr,
            size,
            aux,
            thread,
        }
    }

    /// An event of `kind` at the same time, on the same device, stream and
    /// thread as this one (the stream is `other_stream` for a
    /// [`EventKind::RecordStream`]).
    pub fn with_kind(&self, kind: EventKind) -> TraceEvent {
        TraceEvent::from_kind(self.time_ns, self.device, self.stream, self.thread, kind)
    }

    /// This event decoded by action: the one reader of `size` and `aux` by
    /// position. Fields an action does not use (the address of an `oom`,
    /// the `aux` of an `empty_cache`) are left out.
    #[inline]
    pub fn kind(&self) -> EventKind {
        use EventKind as K;
        let (addr, size, aux) = (self.addr, self.size, self.aux);
        match self.action {
            Action::Alloc => K::Alloc {
                addr,
                requested: size,
                block_size: aux,
            },
            Action::FreeRequested => K::FreeRequested {
                addr,
                requested: size,
                block_size: aux,
            },
            Action::FreeCompleted => K::FreeCompleted {
                addr,
                requested: size,
                block_size: aux,
            },
            Action::SegmentAlloc => K::SegmentAlloc {
                addr,
                size,
                pool: Pool::from_code(aux),
            },
            Action::SegmentFree => K::SegmentFree {
                addr,
                size,
                pool: Pool::from_code(aux),
            },
            Action::SegmentMap => K::SegmentMap {
                addr,
                size,
                pool: Pool::from_code(aux),
            },
            Action::SegmentUnmap => K::SegmentUnmap {
                addr,
                size,
                pool: Pool::from_code(aux),
            },
            Action::Oom => K::Oom {
                requested: size,
                device_free: aux,
            },
            Action::EmptyCache => K::EmptyCache { released: size },
            Action::PhasePush => K::PhasePush { name: aux },
            Action::PhasePop => K::PhasePop { name: aux },
            Action::Mark => K::Mark { name: aux },
            Action::RecordStream => K::RecordStream {
                addr,
                other_stream: self.stream,
            },
            Action::StreamReuse => K::StreamReuse {
                addr,
                block_size: size,
                from_stream: aux,
            },
            Action::SyncAllStreams => K::SyncAllStreams { outstanding: size },
            Action::Free => K::Free {
                addr,
                requested: size,
                block_size: aux,
            },
            Action::PagesCreate => K::PagesCreate { bytes: size },
            Action::PagesRelease => K::PagesRelease { bytes: size },
            Action::PrivatePool => K::PrivatePool {
                op: PoolOp::from_code(size),
                pool: aux,
                checkpoint: addr,
            },
            Action::MemoryLimit => K::MemoryLimit {
                cap: MemoryCap::from_fields(size, aux),
                device_total: addr,
            },
            Action::SegmentUnlist => K::SegmentUnlist {
                addr,
                size,
                pool: Pool::from_code(aux),
            },
            Action::SegmentList => K::SegmentList {
                addr,
                size,
                pool: Pool::from_code(aux),
            },
        }
    }

    /// The string id of a `phase_push`, `phase_pop` or `mark`; `None` for
    /// other actions.
    #[inline]
    pub fn name_id(&self) -> Option<StringId> {
        match self.kind() {
            EventKind::PhasePush { name }
            | EventKind::PhasePop { name }
            | EventKind::Mark { name } => Some(name),
            _ => None,
        }
    }

    /// The bytes of the block an `alloc`, `free_requested`,
    /// `free_completed` or `free` names (rounded, as the allocator holds
    /// them); `None` for other actions.
    #[inline]
    pub fn block_size(&self) -> Option<u64> {
        match self.kind() {
            EventKind::Alloc { block_size, .. }
            | EventKind::FreeRequested { block_size, .. }
            | EventKind::FreeCompleted { block_size, .. }
            | EventKind::Free { block_size, .. } => Some(block_size),
            _ => None,
        }
    }
}
