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
//! `prepare` waits at most `FORK_WAIT`: a flush stuck on storage that
//! hangs must not hang the program's forks (DataLoader workers). Then the
//! fork goes ahead without the lock, the parent leaves it to its holder,
//! and the child frees it (nothing of its parent's call runs there; the
//! trace state may be half changed, which a child only reads as its
//! parent's trace, not its own). So does a thread that forks while it holds
//! the lock itself (nothing here forks). A program that forks without the
//! handlers (the core crate used without `capi`) has the old risk.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The longest a fork waits for the trace control call in progress.
pub(crate) const FORK_WAIT: Duration = Duration::from_secs(2);

/// Whether the `prepare` handler took the lock (Note [Trace control across fork]).
static TAKEN_FOR_FORK: AtomicBool = AtomicBool::new(false);

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
        self.acquire_until(None);
    }

    /// Takes the lock, waiting at most until `deadline`; whether it did.
    fn acquire_until(&self, deadline: Option<Instant>) -> bool {
        crate::backoff::poll_until(deadline, || {
            (!self.held.load(Ordering::Relaxed) && self.try_acquire()).then_some(())
        })
        .is_some()
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

/// The `pthread_atfork` `prepare` handler: waits (at most `FORK_WAIT`)
/// for the trace control call in progress and keeps any other from
/// starting until the fork is done (Note [Trace control across fork]).
pub fn before_fork() {
    let taken = CONTROL.acquire_until(Some(Instant::now() + FORK_WAIT));
    TAKEN_FOR_FORK.store(taken, Ordering::Relaxed);
}

/// The `pthread_atfork` `parent` handler: releases what [`before_fork`]
/// took, if it took it. Atomics only, async-signal-safe.
pub fn after_fork_in_parent() {
    if TAKEN_FOR_FORK.swap(false, Ordering::Relaxed) {
        CONTROL.release();
    }
}

/// The `pthread_atfork` `child` handler: the child starts with the lock
/// free, whoever held it in the parent. Atomics only, async-signal-safe.
pub fn after_fork_in_child() {
    TAKEN_FOR_FORK.store(false, Ordering::Relaxed);
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

    /// A fork waits at most `FORK_WAIT` for a control call that does not
    /// end (a flush on storage that hangs), then goes ahead without the
    /// lock: the parent leaves it to its holder, the child starts it free.
    #[test]
    fn a_fork_gives_up_waiting_for_a_stuck_holder() {
        let _held = CONTROL.lock(); // the stuck control call
        let start = Instant::now();
        before_fork();
        let waited = start.elapsed();
        assert!(waited >= FORK_WAIT, "{waited:?}");
        assert!(!TAKEN_FOR_FORK.load(Ordering::Relaxed));
        after_fork_in_parent();
        assert!(CONTROL.held.load(Ordering::Relaxed), "still its holder's");
        // Without a holder it is taken, and the parent gives it back.
        drop(_held);
        before_fork();
        assert!(TAKEN_FOR_FORK.load(Ordering::Relaxed));
        after_fork_in_parent();
        assert!(!CONTROL.held.load(Ordering::Relaxed));
    }
}
