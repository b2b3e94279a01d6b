//! The lock that serializes trace control (Note [Trace control lock] in
//! `trace_control.rs`), made safe to hold across `fork`.
//!
//! Note [Trace control across fork]
//! Rationale: a child forked while another thread of its parent held the
//! control lock (a flush waiting for the writer, a phase from an autograd
//! thread) inherited it held, by a thread the child does not have: its
//! first mark, phase or trace call waited forever. The automatic hooks of
//! the Python package make such calls in DataLoader workers
//! (`model.eval()`, `inference_mode`, `torch.save`); a review found 63 of
//! 100 children hung when a thread flushed in a loop.
//! Approach: the process's fork handlers (`pthread_atfork`, registered by
//! whoever forks around the allocator: `capi/src/fork.rs`) take the lock
//! in `prepare`, so no control call is half done at the fork, and release
//! it in `parent` and in `child`. A fork waits for the control call in
//! progress (a flush, a stop: bounded by the writer's I/O); the child
//! starts with the lock free and the trace state whole. The lock is a flag
//! with no queue of waiters, so that releasing it in the child is one
//! atomic store (async-signal-safe, as a fork handler must be): a queued
//! lock (`parking_lot`'s) may hand itself on release to a waiter, which in
//! the child is a thread that does not exist. Waiters back off to short
//! sleeps; control calls are rare and short.
//! Limitations: a thread that forks while it holds the lock itself waits
//! for ever in `prepare` (nothing here forks). A program that forks without
//! the handlers (the core crate used without `capi`) has the old risk.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A lock with no queue of waiters, released by a plain store (see the Note).
pub(crate) struct ControlLock {
    held: AtomicBool,
}

/// Holds a [`ControlLock`] until dropped.
pub(crate) struct ControlGuard<'a> {
    lock: &'a ControlLock,
}

impl ControlLock {
    pub(crate) const fn new() -> Self {
        ControlLock {
            held: AtomicBool::new(false),
        }
    }

    /// Waits until the lock is free and takes it.
    pub(crate) fn lock(&self) -> ControlGuard<'_> {
        self.acquire();
        ControlGuard { lock: self }
    }

    fn try_acquire(&self) -> bool {
        self.held
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    fn acquire(&self) {
        let mut sleep = Duration::from_micros(20);
        for spins in 0u32.. {
            if !self.held.load(Ordering::Relaxed) && self.try_acquire() {
                return;
            }
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 80 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(Duration::from_millis(1));
            }
        }
    }

    fn release(&self) {
        self.held.store(false, Ordering::Release);
    }
}

impl Drop for ControlGuard<'_> {
    fn drop(&mut self) {
        self.lock.release();
    }
}

/// Serializes trace start, stop, flush and annotations: Note [Trace control
/// lock] in `trace_control.rs`. One for the process: these calls are rare,
/// and allocators rarely more than one.
pub(crate) static CONTROL: ControlLock = ControlLock::new();

/// The `pthread_atfork` `prepare` handler: waits for the trace control call
/// in progress and keeps any other from starting until [`after_fork`]
/// (Note [Trace control across fork]).
pub fn before_fork() {
    CONTROL.acquire();
}

/// The `pthread_atfork` `parent` and `child` handler: releases what
/// [`before_fork`] took. One atomic store, async-signal-safe.
pub fn after_fork() {
    CONTROL.release();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn one_holder_at_a_time() {
        let lock = Arc::new(ControlLock::new());
        let inside = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (lock, inside) = (lock.clone(), inside.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _g = lock.lock();
                        assert_eq!(inside.fetch_add(1, Ordering::Relaxed), 0);
                        std::hint::spin_loop();
                        inside.fetch_sub(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(lock.try_acquire(), "free once every guard is dropped");
    }
}
