//! The CUDA backend's side of the unmapping helper (Note [Unmapping off
//! the allocating thread] and Note [One VMM call at a time] in
//! `backend/unmapper.rs`): the helper started on first use in the device's
//! context, ranges queued for it, waits for its jobs over a range, and the
//! jobs that failed there done again here.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;

use super::context::RelaxedCaptureMode;
use super::{CudaBackend, check, driver};
use crate::backend::unmapper::{self, Job, Unmapper};
use crate::backend::{Backend, BackendError, DevicePtr};
use crate::cost::DriverCall;

/// A context handle moved to the helper thread.
struct SendContext(sys::CUcontext);

// SAFETY: a CUcontext is a process-wide driver handle, valid on any thread;
// the helper only makes it current there. The backend that retained it
// joins the helper before releasing it (`Drop`).
unsafe impl Send for SendContext {}

impl CudaBackend {
    /// The lock of Note [One VMM call at a time], taken while the helper
    /// runs in this process (none without it, or in a forked child).
    pub(super) fn vmm_turn(&self) -> Option<parking_lot::MutexGuard<'_, ()>> {
        self.unmapper.as_ref().and_then(Unmapper::turn)
    }

    /// The helper thread, started on first use; `None` when it cannot start.
    pub(super) fn unmapper(&mut self) -> Option<&Unmapper> {
        if self.unmapper.is_none() && !self.no_unmapper {
            let ctx = SendContext(self.ctx);
            let calls = Arc::clone(&self.helper_calls);
            let mut bound = false;
            let work = Box::new(move |job: Job| {
                let ctx = &ctx;
                if !bound {
                    // The helper's own thread: the context stays current.
                    // SAFETY: `ctx.0` is the primary context the backend
                    // retains until it has joined this thread.
                    check("cuCtxSetCurrent", unsafe { driver::cuCtxSetCurrent(ctx.0) })?;
                    // A job may run while another thread captures a graph:
                    // in relaxed mode its calls neither fail nor spoil that
                    // capture (the range it unmaps is no captured work's).
                    std::mem::forget(RelaxedCaptureMode::enter()?);
                    bound = true;
                }
                let t = Instant::now();
                let r = run_job(job);
                let (call, size, handles) = match job {
                    Job::Unmap { size, handles, .. } => (DriverCall::Unmap, size, handles),
                    Job::Free { size, .. } => (DriverCall::AddressFree, size, 0),
                };
                calls
                    .lock()
                    .add(call, handles, size, t.elapsed().as_nanos() as u64);
                r
            });
            match Unmapper::start(format!("gpualloc-unmap-{}", self.ordinal), work) {
                Ok(u) => {
                    u.hold(self.held);
                    self.unmapper = Some(u);
                }
                Err(e) => {
                    tracing::warn!(
                        "gpualloc: device {}: no unmapping thread ({e}); unmapping on the allocating thread",
                        self.ordinal
                    );
                    self.no_unmapper = true;
                }
            }
        }
        self.unmapper.as_ref()
    }

    /// Waits for the helper's jobs over `[lo, hi)` (all of them with
    /// `None`) and does again, here, those that failed on the helper, up to
    /// the last one over the range, counting the time as `cuMemUnmap`'s. An
    /// error: one of those failed again (it and the rest are kept for the
    /// next wait).
    pub(super) fn wait_later(
        &mut self,
        range: Option<(DevicePtr, DevicePtr)>,
    ) -> Result<(), BackendError> {
        let Some(u) = &self.unmapper else {
            return Ok(());
        };
        if u.is_idle() {
            return Ok(());
        }
        let t = Instant::now();
        match range {
            Some((lo, hi)) => u.wait_range(lo, hi),
            None => u.wait_all(),
        }
        let failed = u.failed();
        let result = if failed.is_empty() {
            Ok(())
        } else {
            self.redo(&failed, range)
        };
        self.calls
            .add_time(DriverCall::Unmap, t.elapsed().as_nanos() as u64);
        result
    }

    /// [`unmapper::redo`] with the driver on this thread, in relaxed
    /// capture mode as on the helper (a map during a capture waits here);
    /// the jobs done leave the helper's failed list, the others stay.
    pub(super) fn redo(
        &mut self,
        jobs: &[Job],
        range: Option<(DevicePtr, DevicePtr)>,
    ) -> Result<(), BackendError> {
        let _bound = self.bind()?;
        let _relaxed = RelaxedCaptureMode::enter().ok();
        let (result, done) = unmapper::redo(jobs, range, |job| {
            let _turn = self.vmm_turn();
            run_job(job)
        });
        if let Some(u) = &self.unmapper {
            u.forget(&done);
        }
        result
    }
    /// [`Backend::unmap_later`](crate::backend::Backend::unmap_later): the
    /// range's handles as jobs for the helper, or unmapped now without one.
    pub(super) fn queue_unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        let inside: Vec<(DevicePtr, u64)> = self
            .mappings
            .range(ptr..ptr + size)
            .map(|(&a, &s)| (a, s))
            .collect();
        if self.unmapper().is_none() {
            return self.unmap(ptr, size);
        }
        // One job a handle (the driver's cost is per handle either way), so
        // that a request starting meanwhile waits for one handle at most;
        // one for the range if the record does not cover it exactly.
        let handles = inside.len() as u64;
        // Whole mappings, one after another from `ptr` to its end.
        let mut at = ptr;
        let whole = inside.iter().all(|&(a, s)| {
            let next = a == at;
            at = a + s;
            next
        }) && at == ptr + size;
        let jobs: Vec<Job> = if whole {
            inside
                .iter()
                .map(|&(a, s)| Job::Unmap {
                    ptr: a,
                    size: s,
                    handles: 1,
                })
                .collect()
        } else {
            vec![Job::Unmap { ptr, size, handles }]
        };
        let queued = jobs
            .iter()
            .take_while(|&&job| self.unmapper.as_ref().is_some_and(|u| u.push(job)))
            .count();
        let range = |j: &Job| match *j {
            Job::Unmap { ptr, size, .. } => (ptr, size),
            Job::Free { .. } => unreachable!("only unmaps here"),
        };
        if queued == 0 {
            // A forked child (no helper), or a helper stopped for the exit
            // (Note [Helpers at exit]): all of it now, in one call, which
            // unmaps the range or leaves it mapped, whole either way.
            return self.unmap(ptr, size);
        }
        if queued < jobs.len() {
            // The exit stopped the helper part-way: the jobs queued are its
            // (or listed for a redo). The rest are listed as failed too, for
            // the next wait over them to do here, rather than done now: a
            // failure among them must not leave the caller holding a range
            // whose other part the helper will still unmap.
            let listed = self
                .unmapper
                .as_ref()
                .is_some_and(|u| u.add_failed(&jobs[queued..]));
            debug_assert!(listed, "a helper that took jobs lists the rest");
            for j in &jobs {
                self.calls.add(DriverCall::Unmap, 1, range(j).1, 0);
            }
            self.forget_mappings(ptr, size);
            return Ok(());
        }
        // Counted now, as one call made at once would be (the
        // defragmentation budget reads the counts); its time is the helper's.
        self.calls.add(DriverCall::Unmap, handles, size, 0);
        self.forget_mappings(ptr, size);
        Ok(())
    }

    /// [`Backend::free_reservation_later`](crate::backend::Backend::free_reservation_later):
    /// a job for the helper, or freed now without one.
    pub(super) fn queue_free(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        let queued = self
            .unmapper
            .as_ref()
            .is_some_and(|u| u.push(Job::Free { ptr, size }));
        if !queued {
            return self.free_reservation(ptr, size);
        }
        self.calls.add(DriverCall::AddressFree, 0, size, 0);
        Ok(())
    }
}

/// Does one of the helper's jobs on the calling thread, in the context the
/// caller made current: on the helper, or on the allocating thread when a
/// job that failed there is done again (`CudaBackend::redo`).
pub(super) fn run_job(job: Job) -> Result<(), BackendError> {
    match job {
        // SAFETY: the allocator gave the range up (`unmap_later`): a run of
        // whole mappings no queued work touches, which the backend maps
        // over only after this job is done.
        Job::Unmap { ptr, size, .. } => check("cuMemUnmap", unsafe {
            driver::cuMemUnmap(ptr, size as usize)
        }),
        // SAFETY: a reservation of this backend whose ranges were unmapped
        // by the jobs before this one (a Free waits behind a failed Unmap
        // inside it: `unmapper::blocked`, `unmapper::redo`).
        Job::Free { ptr, size } => check("cuMemAddressFree", unsafe {
            driver::cuMemAddressFree(ptr, size as usize)
        }),
    }
}
