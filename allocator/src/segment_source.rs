//! Segments from another allocator, for one private pool.
//!
//! Note [Pools served by another allocator]
//! Rationale: `torch.cuda.MemPool(allocator=...)` asks for a pool whose
//! memory comes from another allocator: NCCL's `ncclMemAlloc` (user buffers
//! that NCCL registers for zero-copy collectives), symmetric memory's pool,
//! a program's own `CUDAPluggableAllocator`. PyTorch keeps caching such a
//! pool itself and only takes its segments from that allocator
//! (`raw_alloc` / `raw_delete` instead of `cudaMalloc` / `cudaFree`); the
//! other allocator's memory is what the caller needs (registered, shareable
//! across processes), so gpualloc's own pages cannot stand in for it.
//! Approach: such a pool gets a [`SegmentSource`] when it is created. It
//! grows by plain segments of PyTorch's sizes (2 MiB small, 20 MiB below
//! 10 MiB, else the request rounded to 2 MiB) from the source, whatever
//! the device's mode, so its blocks never move, never alias a stitch and
//! never give a page to defragmentation; it splits and merges as a plain
//! pool does, counts in the stats and the snapshot as PyTorch's does, and
//! gives a segment back to the source where a plain segment goes back to
//! the driver (`empty_cache`, the out-of-memory retries, the pool's last
//! hold dropped), after waiting for the device, as `cudaFree` would: the
//! other allocator's free may not wait for queued work. The trace records
//! that the pool is served so (call 7 of `private_pool`), and a replay
//! serves it from plain segments of the simulated device, of the same
//! sizes. The source goes when the pool goes (no hold and no segment left).
//! A source is called with the device's lock held, which is not
//! re-entrant (PyTorch's is): a source that calls gpualloc back, on any
//! device, gets [`AllocError::CalledBack`](crate::AllocError::CalledBack)
//! instead of a deadlock, except for frees (below).
//!
//! Note [Frees called back from a source]
//! Rationale: a source written in Python (vLLM's sleep-mode `CuMemAllocator`
//! and other `CUDAPluggableAllocator`s whose C functions call Python
//! callbacks) runs Python code inside the call, and Python's garbage
//! collector may run there and free CUDA tensors held in reference cycles:
//! their deleters call gpualloc's free on the same thread. PyTorch's
//! re-entrant lock frees them at once; a `CalledBack` error lost them (the
//! deleter cannot raise), so their memory stayed allocated for good.
//! Approach: a free called back from a source is kept in the allocator's
//! list of deferred frees and done once the call that called the source
//! has let go of the device (`Allocator::run_deferred_frees`: at the end
//! of `malloc`, `free`, `empty_cache`, `release_pool` and
//! `empty_pool_cache`, the entry points that call sources; and by any later
//! `malloc` or `free`, each one atomic load otherwise). So by the time the
//! caller that made the source run gets control back, the memory is freed,
//! as under PyTorch. A free with the profiler's size (`free_sized`)
//! reports 0 bytes for such a free: its block cannot be read meanwhile.
//! Allocations and other calls made from a source still get `CalledBack`.

use std::cell::Cell;

use crate::backend::{BackendError, DevicePtr, StreamId};

thread_local! {
    /// Whether this thread is inside a source's call.
    static IN_SOURCE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, which calls a source (or drops one), marking the thread as
/// inside it until `f` returns or unwinds.
pub(crate) fn calling_source<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_SOURCE.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(IN_SOURCE.with(|c| c.replace(true)));
    f()
}

/// Whether this thread is inside a source's call.
#[inline]
pub(crate) fn in_source_call() -> bool {
    IN_SOURCE.with(Cell::get)
}

/// Where a private pool served by another allocator gets its segments.
pub trait SegmentSource: Send {
    /// The other allocator's name, for messages.
    fn name(&self) -> &str;

    /// A segment of `size` bytes for work on `stream`.
    ///
    /// # Errors
    /// [`BackendError::OutOfMemory`] when the other allocator has no room
    /// (gpualloc then gives its own cache back and asks again), another
    /// [`BackendError`] when it failed otherwise.
    fn allocate(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, BackendError>;

    /// Gives back a segment [`allocate`](Self::allocate) returned, with no
    /// work queued on it any more.
    ///
    /// # Errors
    /// A [`BackendError`] when the other allocator failed; the segment is
    /// then kept.
    fn release(&mut self, ptr: DevicePtr, size: u64, stream: StreamId) -> Result<(), BackendError>;
}
