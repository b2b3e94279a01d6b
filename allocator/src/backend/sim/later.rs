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
//! budget reads the same counts either way. An injected `Unmap` or
//! `FreeReservation` fault strikes a queued job when it runs, as a failure
//! on the helper would: the job is kept (with the Free of its reservation)
//! and done again at the next wait, whose call fails if it fails again.

use std::collections::VecDeque;

use super::SimBackend;
use super::SimCall;
use crate::backend::unmapper::{Job, blocked, redo};
use crate::backend::{BackendError, DevicePtr, HandleId};
use crate::cost::{DriverCall, DriverCalls};

/// Jobs waiting, and whether they may.
#[derive(Default)]
pub(super) struct LaterWork {
    on: bool,
    /// Jobs run as soon as given, as an idle helper would (`eager_later_work`).
    eager: bool,
    queue: VecDeque<Job>,
    /// Jobs that failed, oldest first, to be done again at the next wait.
    failed: Vec<Job>,
    /// Every call given to `unmap_later` and `free_reservation_later`,
    /// deferred or not: [`Backend::helper_calls`](crate::backend::Backend::helper_calls).
    pub(super) given: DriverCalls,
}

impl SimBackend {
    /// Queues later work (see the module docs).
    pub fn defer_later_work(&mut self, on: bool) {
        self.later.on = on;
        if !on {
            self.finish_later_work();
        }
    }

    /// Gives later work to the queue and runs it at once, as a helper that
    /// is never held and never behind would: a fault then strikes the job
    /// on the helper, not the call that gave it (see the module docs).
    pub fn eager_later_work(&mut self, on: bool) {
        self.defer_later_work(on);
        self.later.eager = on;
    }

    /// Jobs queued or failed, not done yet.
    pub fn later_pending(&self) -> usize {
        self.later.queue.len() + self.later.failed.len()
    }

    /// Does every job queued or failed (what the helper thread, and the
    /// backend's next waits, would do eventually); a job that fails again
    /// stays failed.
    pub fn finish_later_work(&mut self) {
        let _ = self.wait_later(None);
    }

    /// Whether a queued or failed job is to unmap the mapping at `ptr`: the
    /// range is given up, only not unmapped yet.
    pub fn unmapping_later(&self, ptr: DevicePtr) -> bool {
        self.later_jobs()
            .any(|j| matches!(j, Job::Unmap { .. }) && j.overlaps(ptr, ptr + 1))
    }

    fn later_jobs(&self) -> impl Iterator<Item = &Job> {
        self.later.failed.iter().chain(self.later.queue.iter())
    }

    /// How many of `handle`'s mappings lie in ranges given up.
    pub(super) fn later_mappings_of(&self, handle: HandleId) -> u32 {
        let mut n = 0;
        for job in self.later_jobs() {
            if let Job::Unmap { ptr, size, .. } = *job {
                n += self
                    .handles_over(ptr, size)
                    .iter()
                    .filter(|m| m.1 == handle)
                    .count() as u32;
            }
        }
        n
    }

    /// Whether a job given now waits in the queue.
    pub(super) fn defers(&self) -> bool {
        self.later.on
    }

    /// Queues the unmapping of `[ptr, ptr + size)`, checked and counted now.
    pub(super) fn queue_unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.forbid_in_capture("unmap");
        let handles = self.whole_mappings(ptr, size).len() as u64;
        self.counters.unmap += 1;
        self.driver.add(DriverCall::Unmap, handles, size, 0);
        self.later
            .queue
            .push_back(Job::Unmap { ptr, size, handles });
        self.run_queue();
        Ok(())
    }

    /// Queues freeing the reservation at `va`, checked and counted now.
    pub(super) fn queue_free(&mut self, va: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.forbid_in_capture("free_reservation");
        self.reservation_sized(va, size);
        assert!(
            self.handles_over(va, size)
                .iter()
                .all(|m| self.unmapping_later(m.0)),
            "SimBackend: reservation {va:#x} given up with pages still mapped"
        );
        self.driver.add(DriverCall::AddressFree, 0, size, 0);
        self.later.queue.push_back(Job::Free { ptr: va, size });
        self.run_queue();
        Ok(())
    }

    /// Runs one job as the helper would: an injected fault fails it.
    fn run_job(&mut self, job: Job) -> Result<(), BackendError> {
        match job {
            Job::Unmap { ptr, size, .. } => {
                self.fault(SimCall::Unmap)?;
                self.unmap_now(ptr, size);
            }
            Job::Free { ptr, size } => {
                self.fault(SimCall::FreeReservation)?;
                self.free_now(ptr, size);
            }
        }
        Ok(())
    }

    /// What the helper does on its own, with `eager_later_work`: the queued
    /// jobs, in order; failed ones are kept, not done again.
    fn run_queue(&mut self) {
        if !self.later.eager {
            return;
        }
        while let Some(job) = self.later.queue.pop_front() {
            if blocked(&self.later.failed, &job) || self.run_job(job).is_err() {
                self.later.failed.push(job);
            }
        }
    }

    /// The backend's wait (where the CUDA backend waits for its helper):
    /// the queued jobs up to the last over `[lo, hi)` (all with `None`) run
    /// in order, as the helper's; a failed Unmap keeps the Frees of its
    /// reservation with it. Then the failed jobs up to the last over the
    /// range are done again ([`redo`]); an error: one failed again.
    pub(super) fn wait_later(
        &mut self,
        range: Option<(DevicePtr, DevicePtr)>,
    ) -> Result<(), BackendError> {
        let pick = |j: &Job| range.is_none_or(|(lo, hi)| j.overlaps(lo, hi));
        if let Some(last) = self.later.queue.iter().rposition(pick) {
            for job in self.later.queue.drain(..=last).collect::<Vec<_>>() {
                if blocked(&self.later.failed, &job) || self.run_job(job).is_err() {
                    self.later.failed.push(job);
                }
            }
        }
        if self.later.failed.is_empty() {
            return Ok(());
        }
        let failed = self.later.failed.clone();
        let (result, done) = redo(&failed, range, |job| self.run_job(job));
        for d in done {
            if let Some(i) = self.later.failed.iter().position(|f| *f == d) {
                self.later.failed.remove(i);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::{Backend, SimBackend, SimCall};

    const MIB: u64 = 1 << 20;

    /// A simulator with later work left as long as may be, and a 4 MiB
    /// reservation mapped with two 2 MiB handles and given up; returns it
    /// with the reservation's address.
    fn given_up() -> (SimBackend, u64) {
        let mut s = SimBackend::new(1 << 30);
        s.defer_later_work(true);
        let va = s.reserve(4 * MIB).unwrap();
        let h: Vec<_> = (0..2)
            .map(|_| (s.create_handle(2 * MIB, false).unwrap(), 2 * MIB))
            .collect();
        s.map_handles(va, &h, false).unwrap();
        s.unmap_later(va, 4 * MIB).unwrap();
        assert!(s.unmapping_later(va));
        assert_eq!(s.handles_over(va, 4 * MIB).len(), 2, "not unmapped yet");
        (s, va)
    }

    #[test]
    fn a_job_that_fails_when_it_runs_is_done_again_at_the_same_wait() {
        let (mut s, va) = given_up();
        s.fail_call(SimCall::Unmap, 1);
        let h = s.create_handle(4 * MIB, false).unwrap();
        // Mapping there waits: the job fails, is done again, and succeeds.
        s.map_handles(va, &[(h, 4 * MIB)], false).unwrap();
        assert_eq!(s.later_pending(), 0);
        assert_eq!(s.calls(SimCall::Unmap), 2);
    }

    #[test]
    fn failing_again_fails_the_call_that_waited_and_the_free_waits_with_it() {
        let (mut s, va) = given_up();
        s.free_reservation_later(va, 4 * MIB).unwrap();
        s.fail_calls(SimCall::Unmap, 1, 2);
        // Releasing a handle waits for everything: the Unmap fails twice,
        // and the Free of its reservation is not tried meanwhile; the
        // release itself goes ahead (that handle is mapped nowhere).
        let spare = s.create_handle(2 * MIB, false).unwrap();
        s.release_handle(spare, 2 * MIB).unwrap();
        assert_eq!(s.calls(SimCall::FreeReservation), 0);
        assert_eq!(s.later_pending(), 2, "the Unmap and its Free, kept");
        assert!(s.unmapping_later(va), "still given up");
        // A map over the range fails as long as the unmapping does.
        s.fail_call(SimCall::Unmap, 1);
        let h = s.create_handle(4 * MIB, false).unwrap();
        assert!(s.map_handles(va, &[(h, 4 * MIB)], false).is_err());
        assert_eq!(s.later_pending(), 2);
        // The next wait does both.
        let spare = s.create_handle(2 * MIB, false).unwrap();
        s.release_handle(spare, 2 * MIB).unwrap();
        assert_eq!(s.later_pending(), 0);
        assert_eq!(s.calls(SimCall::FreeReservation), 1);
        assert!(s.handles_over(va, 4 * MIB).is_empty());
    }

    #[test]
    fn a_wait_over_another_range_does_not_fail_for_this_one() {
        let (mut s, va) = given_up();
        // A second range given up after the first.
        let other = s.reserve(2 * MIB).unwrap();
        let h = s.create_handle(2 * MIB, false).unwrap();
        s.map_handles(other, &[(h, 2 * MIB)], false).unwrap();
        s.unmap_later(other, 2 * MIB).unwrap();
        s.fail_call(SimCall::Unmap, 1);
        // Freeing the second reservation runs the queue in order up to its
        // job: the first job fails, the second succeeds, and the free does
        // not do the first again nor fail for it.
        s.free_reservation(other, 2 * MIB).unwrap();
        assert_eq!(s.later_pending(), 1);
        assert!(s.unmapping_later(va));
        s.finish_later_work();
        assert_eq!(s.later_pending(), 0);
        assert!(s.handles_over(va, 4 * MIB).is_empty());
    }

    /// A Free given after the Unmap inside its reservation failed waits
    /// behind it too, however many times that fails again.
    #[test]
    fn a_free_given_after_its_unmap_failed_waits_for_it() {
        let (mut s, va) = given_up();
        s.fail_calls(SimCall::Unmap, 1, 3);
        let release_spare = |s: &mut SimBackend| {
            let spare = s.create_handle(2 * MIB, false).unwrap();
            s.release_handle(spare, 2 * MIB).unwrap();
        };
        release_spare(&mut s); // the Unmap fails, and again when redone
        s.free_reservation_later(va, 4 * MIB).unwrap();
        release_spare(&mut s); // the Free waits; the Unmap fails a third time
        assert_eq!(s.calls(SimCall::FreeReservation), 0);
        assert_eq!(s.later_pending(), 2);
        release_spare(&mut s); // now both, in order
        assert_eq!(s.calls(SimCall::FreeReservation), 1);
        assert_eq!(s.later_pending(), 0);
    }
}
