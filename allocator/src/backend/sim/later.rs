//! The simulator's side of Note [Unmapping off the allocating thread]
//! (`backend/unmapper.rs`). Off by default, so replays do every call at
//! once, as before. With [`SimBackend::defer_later_work`] on, ranges and
//! reservations given to `unmap_later` and `free_reservation_later` wait in
//! a queue as long as the helper thread could leave them (it may be slow,
//! or held back), and are done in order only when the backend must: before
//! mapping over them, freeing their reservation or releasing a handle, the
//! points where the CUDA backend waits for its helper. So a test that
//! passes here does not count on the helper having run. They are counted
//! when given, as the CUDA backend counts them, so the defragmentation
//! budget reads the same counts either way.

use std::collections::VecDeque;

use super::SimBackend;
use crate::backend::unmapper::Job;
use crate::backend::{BackendError, DevicePtr};
use crate::cost::DriverCall;

/// Jobs waiting, and whether they may.
#[derive(Default)]
pub(super) struct LaterWork {
    on: bool,
    queue: VecDeque<Job>,
}

impl SimBackend {
    /// Queues later work while it is held back (see the module docs).
    pub fn defer_later_work(&mut self, on: bool) {
        self.later.on = on;
        if !on {
            self.run_later(|_| true);
        }
    }

    /// Jobs queued and not done yet.
    pub fn later_pending(&self) -> usize {
        self.later.queue.len()
    }

    /// Does every job queued (what the helper thread would do eventually).
    pub fn finish_later_work(&mut self) {
        self.run_later(|_| true);
    }

    /// Whether a queued job is to unmap the mapping at `ptr`: the range is
    /// given up, only not unmapped yet.
    pub fn unmapping_later(&self, ptr: DevicePtr) -> bool {
        self.later
            .queue
            .iter()
            .any(|j| matches!(j, Job::Unmap { .. }) && j.overlaps(ptr, ptr + 1))
    }

    /// Whether a job given now waits in the queue.
    pub(super) fn defers(&self) -> bool {
        self.later.on
    }

    /// Queues the unmapping of `[ptr, ptr + size)`, checked and counted now.
    pub(super) fn queue_unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.fault(super::SimCall::Unmap)?;
        self.forbid_in_capture("unmap");
        let (r, off) = self.reservation_of(ptr, size);
        let handles = r.mapped.range(off..off + size).count() as u64;
        self.counters.unmap += 1;
        self.driver.add(DriverCall::Unmap, handles, size, 0);
        self.later
            .queue
            .push_back(Job::Unmap { ptr, size, handles });
        Ok(())
    }

    /// Queues freeing the reservation at `va`, checked and counted now.
    pub(super) fn queue_free(&mut self, va: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.fault(super::SimCall::FreeReservation)?;
        self.forbid_in_capture("free_reservation");
        self.driver.add(DriverCall::AddressFree, 0, size, 0);
        self.later.queue.push_back(Job::Free { ptr: va, size });
        Ok(())
    }

    /// Does the queued jobs up to the last one `pick` selects.
    pub(super) fn run_later(&mut self, pick: impl Fn(&Job) -> bool) {
        let Some(last) = self.later.queue.iter().rposition(pick) else {
            return;
        };
        for job in self.later.queue.drain(..=last).collect::<Vec<_>>() {
            match job {
                Job::Unmap { ptr, size, .. } => self.unmap_now(ptr, size),
                Job::Free { ptr, size } => self.free_now(ptr, size),
            }
        }
    }

    /// Does the jobs over `[lo, hi)`, and those before them.
    pub(super) fn run_later_over(&mut self, lo: DevicePtr, hi: DevicePtr) {
        self.run_later(|j| j.overlaps(lo, hi));
    }
}
