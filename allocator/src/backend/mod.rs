//! Where device memory and stream ordering come from.
//!
//! The policy code talks only to [`Backend`], so it runs on the simulated
//! device ([`SimBackend`]) in tests, benchmarks and trace replay, and on the
//! CUDA driver (`CudaBackend`, feature `cuda`) inside PyTorch.

pub mod sim;
pub mod stream;
pub mod unmapper;

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod cuda;

use std::fmt;

pub use crate::cost::DriverCalls;
pub use sim::{SimBackend, SimCall};
pub use stream::{other_device_stream, stream_on_device};

/// A device address. Opaque: never dereferenced on the host. 0 is "null".
pub type DevicePtr = u64;
/// A stream, as the raw `cudaStream_t` value PyTorch passes (0 is the legacy default stream).
pub type StreamId = u64;
/// An event handle issued by a backend.
pub type EventId = u64;
/// A physical memory handle issued by a backend (`CUmemGenericAllocationHandle`).
pub type HandleId = u64;

/// A node of a graph under capture (`CUgraphNode`), opaque: only compared.
pub type GraphNode = u64;

/// What [`Backend::capture_terminals`] tells of a capturing stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CaptureNodes {
    /// The capture's id, unique in the process.
    pub capture: u64,
    /// The graph being captured (`CUgraph`), opaque.
    pub graph: u64,
    /// The stream's terminal nodes: what its next work will depend on.
    pub nodes: Vec<GraphNode>,
}

/// Free and total bytes of the device (`cudaMemGetInfo`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes the driver could still hand out.
    pub free: u64,
    /// Bytes of device memory in all.
    pub total: u64,
}

/// What a backend call can fail with.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendError {
    /// The device has no room for `requested` bytes *now*; releasing cached
    /// memory and retrying may help.
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
    },
    /// A driver call failed for another reason; retrying will not help.
    Driver {
        /// The driver function that failed.
        call: &'static str,
        /// Its numeric result code.
        code: i64,
        /// The driver's name for the code.
        name: String,
    },
    /// No driver could be loaded (no `libcuda.so`) or no such device.
    Unavailable(String),
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendError::OutOfMemory { requested } => {
                write!(f, "device out of memory allocating {requested} bytes")
            }
            BackendError::Driver { call, code, name } => {
                write!(f, "{call} failed: {name} ({code})")
            }
            BackendError::Unavailable(why) => write!(f, "CUDA unavailable: {why}"),
        }
    }
}

impl std::error::Error for BackendError {}

/// A source of device memory and of stream-ordering events.
///
/// Contract for all methods (stated once): sizes are non-zero multiples of
/// 512; pointers are opaque and never dereferenced; `release` receives only a
/// `(ptr, size)` pair that `allocate` returned and that was not released
/// since; events are used only through the methods here, and destroyed once.
/// A backend belongs to one device and is called under that device's lock.
///
/// # Reentrancy
/// Implementations must not call back into the allocator (no Python, no torch).
pub trait Backend: Send {
    /// Alignment of every pointer `allocate` returns (cudaMalloc: 256).
    fn alignment(&self) -> u64;

    /// Free and total device memory.
    fn mem_info(&mut self) -> Result<MemInfo, BackendError>;

    /// Obtains a new segment of exactly `size` bytes.
    ///
    /// `capturing` is true while a CUDA graph is being captured on some
    /// stream: the CUDA backend then allocates in relaxed capture mode so the
    /// capture is not invalidated.
    ///
    /// # Errors
    /// [`BackendError::OutOfMemory`] when the device is full now.
    fn allocate(&mut self, size: u64, capturing: bool) -> Result<DevicePtr, BackendError>;

    /// Runs `call`, another allocator's allocation for a pool it serves
    /// (Note [Pools served by another allocator]), as [`allocate`](Self::allocate)
    /// makes its own: while `capturing`, the CUDA backend switches the
    /// thread to relaxed capture mode around it, as PyTorch does around
    /// `raw_alloc` (`cudaMallocMaybeCapturing`), so that an allocator that
    /// calls `cudaMalloc` does not invalidate a capture.
    ///
    /// # Errors
    /// [`BackendError`] when the capture mode cannot be switched (`call`
    /// is not run then).
    fn call_other_allocator(
        &mut self,
        capturing: bool,
        call: &mut dyn FnMut(),
    ) -> Result<(), BackendError> {
        let _ = capturing;
        call();
        Ok(())
    }

    /// Returns a segment. Work still queued on any stream that used it is
    /// waited for by the backend (cudaFree synchronizes the device).
    fn release(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError>;

    /// Records an event marking all work enqueued on `stream` so far.
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError>;

    /// Non-blocking: has the device passed this event?
    fn event_done(&mut self, event: EventId) -> Result<bool, BackendError>;

    /// Blocks the host until the event has completed (OOM and empty_cache paths only).
    fn wait_event(&mut self, event: EventId) -> Result<(), BackendError>;

    /// Makes all future work on `stream` wait for `event` (no host blocking).
    fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<(), BackendError>;

    /// Destroys (or recycles) an event. Pending waits on it stay valid.
    fn destroy_event(&mut self, event: EventId);

    // ---- Virtual memory, for expandable segments. Optional: the defaults
    // say "unsupported" and the allocator falls back to plain segments. ----

    /// Granularity of handles and mappings, or `None` without virtual memory support.
    fn vmm_granularity(&mut self) -> Option<u64> {
        None
    }

    /// Reserves `size` bytes of address space (no memory behind it).
    fn reserve(&mut self, size: u64) -> Result<DevicePtr, BackendError> {
        let _ = size;
        Err(BackendError::Unavailable(
            "virtual memory is not supported by this backend".into(),
        ))
    }

    /// Frees a reservation whose pages are all unmapped.
    fn free_reservation(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        let _ = (ptr, size);
        Err(BackendError::Unavailable(
            "virtual memory is not supported by this backend".into(),
        ))
    }

    /// Creates a physical memory handle of `size` bytes (a multiple of the
    /// granularity), not mapped anywhere (`cuMemCreate`).
    /// `capturing` as for [`allocate`](Self::allocate).
    ///
    /// # Errors
    /// [`BackendError::OutOfMemory`] when the device is full now.
    fn create_handle(&mut self, size: u64, capturing: bool) -> Result<HandleId, BackendError> {
        let _ = (size, capturing);
        Err(BackendError::Unavailable(
            "virtual memory is not supported by this backend".into(),
        ))
    }

    /// Returns an unmapped handle's memory to the driver (`cuMemRelease`).
    fn release_handle(&mut self, handle: HandleId, size: u64) -> Result<(), BackendError> {
        let _ = (handle, size);
        Err(BackendError::Unavailable(
            "virtual memory is not supported by this backend".into(),
        ))
    }

    /// Maps `handles` one after another from `ptr` (one `cuMemMap` each) and
    /// makes the whole range accessible with one `cuMemSetAccess`. The range
    /// lies in a reservation and is unmapped. On failure nothing stays mapped.
    /// Each handle is mapped whole: the driver takes no offset into a
    /// handle (`cuMemMap`'s must be zero; docs/policy-experiments.md, eighth
    /// study), so part of a handle cannot be mapped alone. A handle may be
    /// mapped at another address too (a stitch, or an old range waiting to
    /// be unmapped: Note [Unmapping behind the work] in `drain.rs`).
    fn map_handles(
        &mut self,
        ptr: DevicePtr,
        handles: &[(HandleId, u64)],
        capturing: bool,
    ) -> Result<(), BackendError> {
        let _ = (ptr, handles, capturing);
        Err(BackendError::Unavailable(
            "virtual memory is not supported by this backend".into(),
        ))
    }

    /// Unmaps `[ptr, ptr + size)`, a run of whole mappings, with one
    /// `cuMemUnmap`; the handles stay alive. Does *not* wait for queued work:
    /// the caller guarantees that no work still queued touches the range
    /// (Note [Event-ordered unmapping] in `fence.rs`).
    fn unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        let _ = (ptr, size);
        Err(BackendError::Unavailable(
            "virtual memory is not supported by this backend".into(),
        ))
    }

    /// [`unmap`](Self::unmap), but the backend may do it later, on a helper
    /// thread (Note [Unmapping off the allocating thread] in
    /// `backend/unmapper.rs`): the caller gives the range up now, and the
    /// backend finishes it before it maps over any of its addresses,
    /// releases a handle, frees a reservation over it, or drops. The
    /// default unmaps at once.
    fn unmap_later(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.unmap(ptr, size)
    }

    /// [`free_reservation`](Self::free_reservation), later as
    /// [`unmap_later`](Self::unmap_later) is, after the ranges given to it
    /// before. The default frees at once.
    fn free_reservation_later(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.free_reservation(ptr, size)
    }

    /// The allocating thread starts (`true`) or ends (`false`) a request
    /// that maps memory: work given to [`unmap_later`](Self::unmap_later)
    /// waits meanwhile, since the driver runs VMM calls one at a time.
    /// Nothing to do for a backend that does that work at once.
    fn hold_later_work(&mut self, held: bool) {
        let _ = held;
    }

    /// Copies `bytes` from `src` to `dst` (both mapped device memory) and
    /// waits until the copy is done. Only for rare paths: giving a shared
    /// block handles of one size (Note [Sharing expandable memory]).
    fn copy(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let _ = (dst, src, bytes);
        Err(BackendError::Unavailable(
            "this backend cannot copy device memory".into(),
        ))
    }

    /// Exports a live handle as a POSIX file descriptor that another process
    /// can import (`cuMemExportToShareableHandle`), for sharing memory
    /// between processes (Note [Sharing expandable memory] in `ipc.rs`).
    /// The backend keeps the descriptor open until the handle is released
    /// and returns the same one each time.
    fn export_handle(&mut self, handle: HandleId) -> Result<i32, BackendError> {
        let _ = handle;
        Err(BackendError::Unavailable(
            "this backend cannot export memory handles".into(),
        ))
    }

    /// Lets device `peer` read and write this device's mapped memory, now
    /// and in every later mapping (PyTorch's `addPeerAccess`: a kernel on
    /// `peer` may copy into a tensor of this device once peer access is
    /// enabled, and mapped memory is accessible only where access was
    /// set). Nothing to do for a backend without mapped memory.
    fn add_peer(&mut self, peer: u32) -> Result<(), BackendError> {
        let _ = peer;
        Ok(())
    }

    /// The id of the CUDA graph capture `stream` takes part in, `None` when
    /// it captures nothing (`cuStreamGetCaptureInfo`; 0 for a capture whose
    /// id the driver does not give, and for the legacy default stream while
    /// another stream's capture forbids using it). gpualloc learns of
    /// captures from PyTorch's pool hooks; this asks the driver, for callers
    /// that cannot give those hooks (Note [Capture without a pool]). Never
    /// capturing for a backend without graphs.
    fn stream_capture(&mut self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        let _ = stream;
        Ok(None)
    }

    /// The capture `stream` takes part in and the graph nodes that work
    /// queued on it next would depend on (`cuStreamGetCaptureInfo`'s
    /// dependencies: the stream's terminal nodes); `None` when it captures
    /// nothing, or the driver gives no graph (the legacy stream during
    /// another stream's global capture). For reuse inside a capture (Note
    /// [Reuse inside a capture] in `capture_reuse.rs`). Never capturing for
    /// a backend without graphs.
    fn capture_terminals(
        &mut self,
        stream: StreamId,
    ) -> Result<Option<CaptureNodes>, BackendError> {
        let _ = stream;
        Ok(None)
    }

    /// The nodes `node` of a graph under capture depends on
    /// (`cuGraphNodeGetDependencies`); a node of
    /// [`capture_terminals`](Self::capture_terminals)'s, or one of these.
    fn node_dependencies(&mut self, node: GraphNode) -> Result<Vec<GraphNode>, BackendError> {
        let _ = node;
        Ok(Vec::new())
    }

    /// Blocks until all work queued on the device is done
    /// (`cuCtxSynchronize`). Only for what no stream's event can order: the
    /// pages of a released graph pool, which a replay on any stream may use.
    fn synchronize(&mut self) -> Result<(), BackendError> {
        Err(BackendError::Unavailable(
            "device synchronization is not supported by this backend".into(),
        ))
    }

    /// Blocks until the work queued on `stream` is done: for a default
    /// stream, its device's work (this device's, or another device's, Note
    /// [Streams of other devices]); for a side stream, that stream's, on
    /// whichever device it belongs to. Only for a block whose event the
    /// driver refused twice.
    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), BackendError> {
        let _ = stream;
        self.synchronize()
    }

    /// Nanoseconds on a monotonic clock, for time budgets (Note
    /// [Defragmentation budget]) and trace stamps. The process clock by
    /// default (Note [One clock for decisions and traces] in `clock.rs`);
    /// the simulator's clock is virtual and set by whoever drives it
    /// (replay: the trace's time), unless it is made to follow real time.
    fn now_ns(&mut self) -> u64 {
        crate::clock::now_ns()
    }

    /// Driver calls a helper thread made for this backend so far (Note
    /// [Unmapping off the allocating thread] in `backend/unmapper.rs`), by
    /// kind, with their time. [`driver_calls`](Self::driver_calls) counts
    /// them too, when they were given, but without that time: it is the
    /// allocating thread's. The simulator gives the calls it would leave to
    /// such a thread (replays report their predicted time); none by default.
    fn helper_calls(&self) -> DriverCalls {
        DriverCalls::default()
    }

    /// Driver calls made so far, by kind, and the time they took where the
    /// backend measures it (the CUDA backend does; the simulator predicts it
    /// from a [`CostModel`](crate::cost::CostModel) instead).
    fn driver_calls(&self) -> DriverCalls {
        DriverCalls::default()
    }
}

/// [`Backend::unmap_later`] with `later`, else [`Backend::unmap`]: how the
/// allocator gives a range up, on the helper thread or on this one (Note
/// [Unmapping off the allocating thread] in `backend/unmapper.rs`).
pub(crate) fn unmap_maybe_later<B: Backend>(
    backend: &mut B,
    ptr: DevicePtr,
    size: u64,
    later: bool,
) -> Result<(), BackendError> {
    if later {
        backend.unmap_later(ptr, size)
    } else {
        backend.unmap(ptr, size)
    }
}

/// Whether the legacy stream reports a capture under way: a global-mode
/// capture anywhere in the process, seen by an allocator that follows
/// captures through the driver (Note [Capture without a pool] in `capture.rs`). A query
/// the driver refuses counts as none.
pub(crate) fn legacy_reports_capture<B: Backend>(backend: &mut B) -> bool {
    backend.stream_capture(0).ok().flatten().is_some()
}
