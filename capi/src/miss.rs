//! The miss callback: PyTorch's free-memory callbacks, run when a request
//! finds no cached block.
//!
//! Note [Free-memory callbacks]
//! Rationale: PyTorch's allocator runs torch's free-memory callbacks
//! (`cuda_ipc_collect`: tensors this process sent to other processes,
//! which those have let go of) whenever a request finds no cached free
//! block, before it grows. Run only once gpualloc was out of memory, they
//! left a process that sends CUDA tensors to others holding those tensors'
//! memory until the device filled: it grew instead of reusing it.
//! Approach: with a callback set (the torch bridge sets one), an
//! allocation first looks in the stream's cached free blocks only
//! (`DeviceAllocator::malloc_cached`). On a miss it lets the device go,
//! runs the callback (which may free memory, and freeing needs the
//! device), and then allocates as it would have. An allocation made from
//! inside the callback does not run it again. Without a callback the path
//! is the one it always was: one relaxed load more.

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::boundary::status;

/// Called when an allocation on `device` finds no cached free block, before
/// the allocator maps or creates memory for it, with no lock of gpualloc
/// held: it may free memory through gpualloc. Returns non-zero when it
/// freed some (not used today).
pub type GpuallocMissCallback =
    Option<unsafe extern "C" fn(ctx: *mut c_void, device: c_int) -> c_int>;

#[derive(Clone, Copy)]
struct Callback {
    f: unsafe extern "C" fn(*mut c_void, c_int) -> c_int,
    ctx: *mut c_void,
}

// SAFETY: the contract of gpualloc_set_miss_callback requires that
// `callback(ctx, ..)` may be called from any thread until another one is
// set; the library never touches `ctx` itself.
unsafe impl Send for Callback {}

static SET: AtomicBool = AtomicBool::new(false);
static CALLBACK: Mutex<Option<Callback>> = Mutex::new(None);

thread_local! {
    /// Whether this thread is running the callback.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Whether an allocation should look in the cache first and run the
/// callback on a miss: one is set, and this thread is not inside it.
#[inline(always)]
pub(crate) fn wanted() -> bool {
    SET.load(Ordering::Relaxed) && !INSIDE.with(Cell::get)
}

/// Runs the callback for `device`, if one is still set.
pub(crate) fn run(device: c_int) {
    let Some(cb) = *CALLBACK.lock() else {
        return;
    };
    INSIDE.with(|i| i.set(true));
    // SAFETY: the contract of gpualloc_set_miss_callback.
    let _ = unsafe { (cb.f)(cb.ctx, device) };
    INSIDE.with(|i| i.set(false));
}

/// Sets the callback that an allocation runs when it finds no cached free
/// block (Note [Free-memory callbacks]), replacing any earlier one; NULL
/// takes it away. Unlike the segment observer's, a call of the earlier
/// callback already under way on another thread may still run after this
/// returns. Returns `GPUALLOC_OK`.
///
/// # Safety
/// `callback(ctx, device)` must be callable from any thread until another
/// callback is set, and must not unwind. It runs with no lock of gpualloc
/// held, so it may free memory through gpualloc (an allocation it makes
/// does not run it again).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_set_miss_callback(
    callback: GpuallocMissCallback,
    ctx: *mut c_void,
) -> c_int {
    status(|| {
        let mut slot = CALLBACK.lock();
        *slot = callback.map(|f| Callback { f, ctx });
        SET.store(slot.is_some(), Ordering::Relaxed);
        Ok(())
    })
}
