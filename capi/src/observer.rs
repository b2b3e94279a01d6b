//! Segment events for the torch bridge: PyTorch's `AllocatorTraceTracker`
//! (ProcessGroupNCCL registers memory with NCCL on `SEGMENT_ALLOC` and
//! `SEGMENT_MAP` and deregisters it on `SEGMENT_FREE` and `SEGMENT_UNMAP`)
//! and memory history. The core's observer (Note [Segment events] in
//! `allocator/src/observer.rs`) adapted to a C function pointer.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gpualloc::{SegmentAction, SegmentEvent, SegmentObserver};

use crate::boundary::status;
use crate::boundary::{GPUALLOC_ERR_INVALID_ARGUMENT, GPUALLOC_ERR_NOT_FOUND, GPUALLOC_OK};
use crate::global;

/// A plain segment was obtained from the device (PyTorch's
/// `TraceEntry::SEGMENT_ALLOC`).
pub const GPUALLOC_SEGMENT_ALLOC: c_int = 3;
/// A plain segment is about to go back to the device (`TraceEntry::SEGMENT_FREE`).
pub const GPUALLOC_SEGMENT_FREE: c_int = 4;
/// A range of expandable memory was mapped (`TraceEntry::SEGMENT_MAP`).
pub const GPUALLOC_SEGMENT_MAP: c_int = 5;
/// A range of expandable memory is about to be unmapped (`TraceEntry::SEGMENT_UNMAP`).
pub const GPUALLOC_SEGMENT_UNMAP: c_int = 6;
/// A range was mapped that the snapshot does not list (a stitch): backed
/// memory, not a segment (Note [Segment events]).
pub const GPUALLOC_SEGMENT_MAP_UNLISTED: c_int = 10;
/// A range the snapshot does not list is about to be unmapped (a cached
/// stitch, the old range of moved pages).
pub const GPUALLOC_SEGMENT_UNMAP_UNLISTED: c_int = 11;
/// A mapped range enters the snapshot's segments (memory history's
/// `SEGMENT_MAP`; nothing was mapped).
pub const GPUALLOC_SEGMENT_LISTED: c_int = 12;
/// A mapped range leaves the snapshot's segments (memory history's
/// `SEGMENT_UNMAP`; nothing is unmapped).
pub const GPUALLOC_SEGMENT_UNLISTED: c_int = 13;
/// Not a range's change: the block at the address, freed with uses on other
/// streams (`record_stream`), waits for their work before it is free
/// (memory history's `FREE_REQUESTED` without its `FREE_COMPLETED`); told
/// during the free, on the freeing thread.
pub const GPUALLOC_BLOCK_FREE_DEFERRED: c_int = 14;
/// Not a range's change: the block of a `GPUALLOC_BLOCK_FREE_DEFERRED` is
/// free now (memory history's `FREE_COMPLETED`). Every other free completes
/// at once and is told nothing.
pub const GPUALLOC_BLOCK_FREE_COMPLETED: c_int = 15;

/// Receives segment events: `action` is one of `GPUALLOC_SEGMENT_*`,
/// `stream` the `cudaStream_t` the memory was obtained for, as an integer.
/// Called under the allocator's lock: it must not call gpualloc, except
/// `gpualloc_segment_event_pool`.
pub type GpuallocSegmentObserver = Option<
    unsafe extern "C" fn(
        ctx: *mut c_void,
        device: c_int,
        action: c_int,
        address: u64,
        size: u64,
        stream: u64,
    ),
>;

struct CObserver {
    f: unsafe extern "C" fn(*mut c_void, c_int, c_int, u64, u64, u64),
    ctx: *mut c_void,
}

// SAFETY: the contract of gpualloc_set_segment_observer requires that
// `observer(ctx, ..)` may be called from any thread until another observer
// is installed (which drops this one under every device's lock).
unsafe impl Send for CObserver {}
// SAFETY: as above; the library never touches `ctx` itself.
unsafe impl Sync for CObserver {}

/// Whether the observer is told of deferred frees
/// (`gpualloc_observe_block_frees`).
static BLOCK_FREES: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The pool of the event this thread is telling the observer, while
    /// the observer runs (`gpualloc_segment_event_pool`).
    static TELLING: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
}

impl CObserver {
    fn call(&self, e: &SegmentEvent) {
        let block = matches!(
            e.action,
            SegmentAction::BlockFreeDeferred | SegmentAction::BlockFreeCompleted
        );
        if block && !BLOCK_FREES.load(Ordering::Relaxed) {
            return;
        }
        let action = match e.action {
            SegmentAction::Alloc => GPUALLOC_SEGMENT_ALLOC,
            SegmentAction::Free => GPUALLOC_SEGMENT_FREE,
            SegmentAction::Map => GPUALLOC_SEGMENT_MAP,
            SegmentAction::Unmap => GPUALLOC_SEGMENT_UNMAP,
            SegmentAction::MapUnlisted => GPUALLOC_SEGMENT_MAP_UNLISTED,
            SegmentAction::UnmapUnlisted => GPUALLOC_SEGMENT_UNMAP_UNLISTED,
            SegmentAction::Listed => GPUALLOC_SEGMENT_LISTED,
            SegmentAction::Unlisted => GPUALLOC_SEGMENT_UNLISTED,
            SegmentAction::BlockFreeDeferred => GPUALLOC_BLOCK_FREE_DEFERRED,
            SegmentAction::BlockFreeCompleted => GPUALLOC_BLOCK_FREE_COMPLETED,
        };
        let outer = TELLING.replace(Some(e.pool));
        // SAFETY: `f` and `ctx` came together from the caller, who keeps them
        // valid while this observer is installed.
        unsafe {
            (self.f)(
                self.ctx,
                e.device as c_int,
                action,
                e.address,
                e.size,
                e.stream,
            )
        }
        TELLING.set(outer);
    }
}

/// Installs the one segment observer (NULL removes it), on every device,
/// now or when the allocator starts. It is called synchronously, under the
/// allocator's lock, after each successful device allocation
/// (`GPUALLOC_SEGMENT_ALLOC`) and before each release to the device
/// (`GPUALLOC_SEGMENT_FREE`) of a plain segment, and for expandable memory
/// after each range is mapped (`GPUALLOC_SEGMENT_MAP`) and before it is
/// unmapped (`GPUALLOC_SEGMENT_UNMAP`), with the range's address and size;
/// this includes private pools. Ranges the snapshot does not list as
/// segments come as `GPUALLOC_SEGMENT_MAP_UNLISTED` and
/// `GPUALLOC_SEGMENT_UNMAP_UNLISTED` (stitched, aliased ranges; the old
/// range of moved pages, unmapped once its work is done), and mapped ranges
/// entering or leaving the snapshot without a driver call as
/// `GPUALLOC_SEGMENT_LISTED` and `GPUALLOC_SEGMENT_UNLISTED`: a consumer
/// of backed memory (NCCL registration) takes ALLOC, MAP and MAP_UNLISTED
/// against FREE, UNMAP and UNMAP_UNLISTED; one of the snapshot's segments
/// (memory history) takes ALLOC, MAP and LISTED against FREE, UNMAP and
/// UNLISTED (Note [Segment events]). An unmapped
/// range lies inside mapped ones but may span or split them. When the driver
/// refuses a release or an unmap, the range is announced again (ALLOC or MAP).
/// Once this returns, the previous observer is no longer called. An
/// observer installed after the first allocation was not told about memory
/// already there: the segments `gpualloc_snapshot_segments` lists, and
/// stitched ranges cached for reuse (which no snapshot lists), whose FREE or
/// UNMAP may still come. Returns `GPUALLOC_OK`.
///
/// # Safety
/// `observer(ctx, ...)` must be callable from any thread until another
/// observer is installed, and must not call gpualloc, except
/// `gpualloc_segment_event_pool` (the event's pool).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_set_segment_observer(
    observer: GpuallocSegmentObserver,
    ctx: *mut c_void,
) -> c_int {
    status(|| {
        let o = observer.map(|f| {
            let c = CObserver { f, ctx };
            Arc::new(move |e: &SegmentEvent| c.call(e)) as SegmentObserver
        });
        global::set_segment_observer(o);
        Ok(())
    })
}

/// Has the segment observer told of frees that wait for other streams'
/// work as well (`on` non-zero), or not (0, the default, so that an
/// observer written before these events never sees them):
/// `GPUALLOC_BLOCK_FREE_DEFERRED` during a free of a block used on other
/// streams (`record_stream`), and `GPUALLOC_BLOCK_FREE_COMPLETED` once the
/// block is free, with the block's address and size. They change no range.
/// Every other free completes at once and is told nothing. Returns
/// `GPUALLOC_OK`.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_observe_block_frees(on: c_int) -> c_int {
    status(|| {
        BLOCK_FREES.store(on != 0, Ordering::Relaxed);
        Ok(())
    })
}

/// From inside the segment observer: the private pool that holds the
/// range of the event being told, `(id_a, id_b)` as given to
/// `gpualloc_begin_allocate_to_pool` (a CUDA graph's or a `MemPool`'s),
/// `(0, 0)` for the default pools and stitched ranges. ProcessGroupNCCL
/// registers a `MemPool`'s new segments by it. The one call the observer
/// may make: it takes no lock, and sets no error message (it runs inside
/// another call). `GPUALLOC_ERR_NOT_FOUND` outside an observer's call,
/// `GPUALLOC_ERR_INVALID_ARGUMENT` for a NULL pointer.
///
/// # Safety
/// `id_a` and `id_b` are NULL or point to writable `uint64_t`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_segment_event_pool(id_a: *mut u64, id_b: *mut u64) -> c_int {
    if id_a.is_null() || id_b.is_null() {
        return GPUALLOC_ERR_INVALID_ARGUMENT;
    }
    match TELLING.get() {
        Some((a, b)) => {
            // SAFETY: both are non-null and writable (the caller's contract).
            unsafe {
                *id_a = a;
                *id_b = b;
            }
            GPUALLOC_OK
        }
        None => GPUALLOC_ERR_NOT_FOUND,
    }
}
