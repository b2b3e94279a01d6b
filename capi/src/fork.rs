//! What a child forked from a process whose allocator runs may still do.
//!
//! Note [Freeing in a forked child]
//! Rationale: a child forked from a process whose allocator runs (a
//! DataLoader worker under `fork`) inherits the allocator's memory but
//! only the thread that forked: a device lock another thread held at that
//! moment (an autograd thread allocating, a thread freeing) stays held in
//! the child forever. The child cannot use CUDA, but its garbage collector
//! still frees the CUDA tensors it inherited (autograd graphs, tracebacks),
//! and each free took that device lock: the worker hung for good, in most
//! forks taken while other threads allocated.
//! Approach: a `pthread_atfork` child handler, registered when the
//! allocator starts, marks the child. With CUDA a free there does nothing:
//! the memory is the parent's, in a CUDA context the child cannot use. On
//! the simulator, whose devices a child may go on using (tests of traces
//! across fork do), it frees unless the owning device's lock is held, and
//! then leaves the pointer alone. With CUDA, `empty_cache` there does
//! nothing either, and an allocation fails with an error naming the cause
//! (no driver call: CUDA does not survive fork, and the checking stand-in
//! driver of `tests/c/fake_cuda.c` counts any call from a child). Any
//! other path to the driver is answered by the backend itself (Note [No
//! driver call after fork] in the core crate's `backend/cuda/driver.rs`). The exit
//! handler for the unmapping helpers, which are the parent's, returns at
//! once. One relaxed load on the free path and on the allocation path.
//! Every other call that needs a device's lock waits for it a bounded time
//! in such a child and then fails, naming the cause (Note [Locks held at a
//! fork] in the core crate's `allocator.rs`).
//!
//! The same registration holds the trace control lock across the fork
//! (`prepare` takes it, `parent` and `child` release it), so a child never
//! inherits it held by a thread it does not have (Note [Trace control
//! across fork] in `allocator/src/trace/control_lock.rs`).

/// Whether this process is a child forked after the allocator started.
#[inline]
pub(crate) fn in_forked_child() -> bool {
    gpualloc::allocator::in_forked_child()
}

/// Registers, once, the handlers that mark forked children and hold the
/// trace control lock across a fork.
pub(crate) fn watch() {
    extern "C" fn prepare() {
        gpualloc::trace::control_lock::before_fork();
    }
    extern "C" fn parent() {
        gpualloc::trace::control_lock::after_fork_in_parent();
    }
    extern "C" fn child() {
        gpualloc::allocator::note_forked_child();
        gpualloc::trace::control_lock::after_fork_in_child();
        crate::sigterm::reset_in_child();
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are plain `extern "C"` functions that live
        // as long as the library and cannot unwind (they neither allocate
        // nor panic). `parent` and `child` only store atomics
        // (async-signal-safe, as a fork handler must be); `prepare` runs
        // before the fork, where waiting for a lock is allowed.
        unsafe {
            libc::pthread_atfork(Some(prepare), Some(parent), Some(child));
        }
    });
}

/// Whether this is a child forked after a CUDA allocator started: its
/// CUDA context and memory are the parent's, and no call of the child may
/// reach the driver (Note [Freeing in a forked child]). The simulator's
/// children may go on using their devices.
#[inline]
pub(crate) fn cuda_in_forked_child() -> bool {
    in_forked_child()
        && crate::global::existing().is_some_and(|g| g.kind == crate::global::BackendKind::Cuda)
}

/// The error of an allocation in a child forked after a CUDA allocator
/// started ([`cuda_in_forked_child`]).
pub(crate) fn refused() -> crate::boundary::Error {
    crate::boundary::Error::new(
        crate::boundary::GPUALLOC_ERR_UNAVAILABLE,
        "gpualloc: CUDA cannot be used in a process forked after the allocator started (the CUDA context and its memory are the parent's): start workers with the 'spawn' method",
    )
}

/// A free in a forked child (Note [Freeing in a forked child]); never
/// waits for a lock and reports nothing (its stderr may be the parent's).
pub(crate) fn free(ptr: u64) {
    let Some(g) = crate::global::existing() else {
        return;
    };
    if g.kind == crate::global::BackendKind::Sim {
        let free = std::panic::AssertUnwindSafe(|| g.alloc.free_if_unlocked(ptr));
        let _ = std::panic::catch_unwind(free);
    }
}
