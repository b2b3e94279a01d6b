//! A helper thread that takes address ranges off the allocating thread.
//!
//! Note [Unmapping off the allocating thread]
//! Rationale: unmapping costs about 25 µs a handle (`docs/driver-costs.md`)
//! and nothing waits for its result: a range the allocator gave up (the old
//! address of pages that moved, a cached stitch torn down) only has to be
//! gone before its addresses are mapped again or its handles go back to the
//! driver. On the H200 the multi-scale detector spent 73–98 ms a run in
//! `cuMemUnmap` on the thread that allocates, most of it tearing down
//! stitches (`docs/results/h200-round19/`).
//! Approach: the CUDA backend hands such ranges to a helper thread as jobs
//! (unmap a handle's mapping, free a reservation), done in order. The driver runs
//! VMM calls from several threads one at a time (`docs/driver-costs.md`,
//! section 9), so a job running while the allocating thread maps would only
//! make it wait: the allocator holds the jobs back for the length of a
//! request that maps memory (`hold`) and lets them run when it returns to
//! the caller's work, kernel launches mostly, which a helper's VMM calls
//! slow by 3–20%; and while the allocating thread waits for the GPU
//! (`cuEventSynchronize`), when the helper costs it nothing. (A request
//! that panics leaves them held until the next request ends; waits and
//! dropping run them regardless.) The backend waits for the jobs over a
//! range before it maps or frees a reservation there (`wait_range`), and
//! for all of them before it releases a handle or drops (`wait_all`). A
//! job that fails is logged and kept, and a Free of a reservation with a
//! failed Unmap inside waits with it (decided when the Free is taken from
//! the queue, after every job before it ran); the backend does them again
//! itself, in order, at the next wait over their range ([`redo`]: the jobs
//! over the range, and the Unmaps a Free among them needs). Failing again
//! fails that call, as the unmapping would have failed before, but no call
//! over other addresses, and no release (the driver releases a handle still
//! mapped once its last mapping goes). Calls are counted
//! when given, so replays, the budget and every decision are the same with
//! the helper or without (`unmap_thread`); the simulator can leave the jobs
//! as long as the helper might (`backend/sim/later.rs`), which the checked
//! tests do. A child process after `fork` has no helper: it never waits for
//! one (CUDA cannot be used there anyway).
//!
//! Note [One VMM call at a time]
//! Rationale: the hold above keeps jobs from *starting* while a request
//! maps, but a job the helper started meanwhile (during a wait for an event,
//! between requests) still runs when the allocating thread makes its next
//! call, so the two threads could be inside the driver's VMM functions
//! together, on one physical handle even (its old address unmapped here, its
//! new one mapped there). The driver documents these calls as thread-safe,
//! but PyTorch, whose allocator makes them under one lock, never exercises
//! that; and one H200 run of the `churn_wide` GPU check died of SIGSEGV in a
//! way nothing else explained (round 48; once in eighteen runs). Since the
//! driver serializes these calls anyway (`docs/driver-costs.md`, section 9:
//! two to eight threads finish no sooner than one), taking turns costs
//! nothing but an uncontended lock.
//! Approach: the helper holds a lock for each job ([`Unmapper::turn`]
//! gives it to the other side), and the CUDA backend takes it for each of
//! its VMM calls (`DriverCall::is_vmm`: reserve, create, map, set access,
//! unmap, release, free an address range; and exporting a handle), and
//! for the failed jobs it does again itself. The lock covers a single call
//! only, never a wait, so neither thread can hold it while waiting for the
//! other. Like PyTorch's lock, it is one device's: the backends of other
//! devices, and of ranges imported from other processes, have their own.
//! It is taken only while the helper runs in this process (none before it
//! starts, none in a forked child, which would wait forever on a copy the
//! helper held at the fork).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::{BackendError, DevicePtr};

/// The helper's stack: a C thread's (glibc's default), not Rust's 2 MiB.
/// The helper spends its life inside the driver, which is built and tested
/// on C threads; and in a library loaded by Python no handler can report
/// an overflow (the thread has no stack left to run one on), so the
/// process would die of a bare SIGSEGV. Address space only: the pages a
/// thread never touches cost nothing.
const HELPER_STACK: usize = 8 << 20;

/// One piece of work for the helper.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Job {
    /// Unmap `[ptr, ptr + size)`, a run of whole mappings.
    Unmap {
        /// Start of the range.
        ptr: DevicePtr,
        /// Bytes.
        size: u64,
        /// Physical handles mapped there (for the counts).
        handles: u64,
    },
    /// Free the reservation `[ptr, ptr + size)` (all unmapped by then).
    Free {
        /// Start of the reservation.
        ptr: DevicePtr,
        /// Bytes.
        size: u64,
    },
}

impl Job {
    /// Whether the job's range has an address in `[lo, hi)`.
    pub fn overlaps(&self, lo: DevicePtr, hi: DevicePtr) -> bool {
        let (Job::Unmap { ptr, size, .. } | Job::Free { ptr, size }) = *self;
        ptr < hi && lo < ptr + size
    }
}

/// Does one job on the helper thread. Called there only.
pub type Work = Box<dyn FnMut(Job) -> Result<(), BackendError> + Send>;

#[derive(Default)]
struct State {
    /// Jobs not started, oldest first, with their sequence numbers.
    queue: VecDeque<(u64, Job)>,
    /// The job being done.
    running: Option<(u64, Job)>,
    /// Sequence number of the next job.
    next: u64,
    /// The allocating thread holds the jobs back (`hold`).
    held: bool,
    /// Jobs numbered below this run even while held: someone waits for them.
    urgent_to: u64,
    /// The helper is to finish the queue and stop.
    stop: bool,
    /// Jobs that failed, oldest first, for the backend to do again.
    failed: Vec<Job>,
    /// The process is exiting: no job starts any more (Note [Helpers at
    /// exit]).
    exiting: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    /// Held for each job, and by the allocating thread for each of its VMM
    /// calls (`turn`; Note [One VMM call at a time]).
    vmm: Mutex<()>,
}

/// The helper thread and its queue. See Note [Unmapping off the allocating
/// thread]. Dropping it finishes the queue and joins the thread.
pub struct Unmapper {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// The process that started the thread: a forked child has none.
    pid: u32,
}

impl Unmapper {
    /// Starts the helper thread, which does each job with `work`.
    ///
    /// # Errors
    /// When the thread cannot be started (the caller then does its work itself).
    pub fn start(name: String, mut work: Work) -> std::io::Result<Unmapper> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            vmm: Mutex::new(()),
        });
        // Registered under the lock `quiesce_all` takes, so that no helper
        // starts unseen while the process exits.
        let mut helpers = HELPERS.lock();
        if EXITING.load(Ordering::Relaxed) == std::process::id() {
            return Err(std::io::Error::other("the process is exiting"));
        }
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(name)
            .stack_size(HELPER_STACK)
            .spawn(move || {
                loop {
                    let (_, job) = {
                        let mut st = s.state.lock();
                        loop {
                            if st.exiting {
                                return;
                            }
                            if let Some(&(seq, _)) = st.queue.front()
                                && (!st.held || seq < st.urgent_to || st.stop)
                            {
                                break;
                            }
                            if st.stop {
                                return;
                            }
                            s.changed.wait(&mut st);
                        }
                        let next = st.queue.pop_front().expect("not empty");
                        // Jobs run in order, so every Unmap inside a Free's
                        // reservation has run: if one failed (and is not done
                        // again yet), the Free waits behind it.
                        if blocked(&st.failed, &next.1) {
                            st.failed.push(next.1);
                            s.changed.notify_all();
                            continue;
                        }
                        st.running = Some(next);
                        next
                    };
                    // A panic in a job fails that job, not the helper: a
                    // helper gone with a job marked running would hold every
                    // later wait over its range forever.
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let _turn = s.vmm.lock();
                        work(job)
                    }))
                    .unwrap_or_else(|_| {
                        Err(BackendError::Unavailable(
                            "the unmapping helper panicked on this job".into(),
                        ))
                    });
                    {
                        let mut st = s.state.lock();
                        st.running = None;
                        if result.is_err() {
                            st.failed.push(job);
                        }
                        s.changed.notify_all();
                    }
                    if let Err(e) = result {
                        crate::log::unmap_failed(&job, &e);
                    }
                }
            })?;
        helpers.push((std::process::id(), Arc::downgrade(&shared)));
        drop(helpers);
        Ok(Unmapper {
            shared,
            thread: Some(thread),
            pid: std::process::id(),
        })
    }

    /// Lets no job start any more and waits (at most `timeout`) for the
    /// running one to end; the jobs not started are listed as failed, for
    /// the caller's next wait to do again, and later ones are the caller's
    /// to do (`push` says `false`). See Note [Helpers at exit].
    pub fn quiesce(&self, timeout: Duration) {
        if self.here() {
            quiesce(&self.shared, timeout);
        }
    }

    /// The allocating thread's turn for one VMM call: while the guard
    /// lives, no job runs (Note [One VMM call at a time]). `None` in a
    /// forked child, which has no helper and whose copy of the lock may
    /// be held forever.
    pub fn turn(&self) -> Option<MutexGuard<'_, ()>> {
        self.here().then(|| self.shared.vmm.lock())
    }

    /// Whether this process has the thread (not a child forked since).
    fn here(&self) -> bool {
        std::process::id() == self.pid
    }

    /// Lists `jobs` as failed, for the caller's next wait over them to do,
    /// as [`quiesce`](Self::quiesce) lists the jobs not started: what a
    /// range given up part-way through an exit leaves (`unmap_later`).
    /// `false` (nothing listed) in a forked child, which has no helper.
    #[must_use]
    pub fn add_failed(&self, jobs: &[Job]) -> bool {
        if !self.here() {
            return false;
        }
        self.shared.state.lock().failed.extend_from_slice(jobs);
        true
    }

    /// Queues `job`, after every job queued before. `false` (nothing
    /// queued) in a forked child, which has no helper.
    #[must_use]
    pub fn push(&self, job: Job) -> bool {
        if !self.here() {
            return false;
        }
        let mut st = self.shared.state.lock();
        if st.exiting {
            return false;
        }
        let seq = st.next;
        st.next += 1;
        st.queue.push_back((seq, job));
        if !st.held {
            self.shared.changed.notify_all();
        }
        true
    }

    /// Holds the jobs back (`true`: the allocating thread is about to make
    /// driver calls) or lets them run (`false`). A job already running ends.
    pub fn hold(&self, held: bool) {
        if !self.here() {
            return;
        }
        let mut st = self.shared.state.lock();
        st.held = held;
        if !held {
            self.shared.changed.notify_all();
        }
    }

    /// Waits until every job over an address in `[lo, hi)` is done.
    pub fn wait_range(&self, lo: DevicePtr, hi: DevicePtr) {
        self.wait_for(|j| j.overlaps(lo, hi));
    }

    /// Waits until every job queued is done.
    pub fn wait_all(&self) {
        self.wait_for(|_| true);
    }

    /// Whether no job waits, runs or failed.
    pub fn is_idle(&self) -> bool {
        if !self.here() {
            return true;
        }
        let st = self.shared.state.lock();
        st.queue.is_empty() && st.running.is_none() && st.failed.is_empty()
    }

    /// The jobs that failed, oldest first, for the caller to do again. They
    /// stay listed (a Free taken off the queue meanwhile still waits behind
    /// them) until [`forget`](Self::forget) says they are done.
    pub fn failed(&self) -> Vec<Job> {
        if !self.here() {
            return Vec::new();
        }
        self.shared.state.lock().failed.clone()
    }

    /// Takes `done`, failed jobs the caller did again, off the list.
    pub fn forget(&self, done: &[Job]) {
        if !self.here() {
            return;
        }
        let mut st = self.shared.state.lock();
        for d in done {
            if let Some(i) = st.failed.iter().position(|f| f == d) {
                st.failed.remove(i);
            }
        }
    }

    fn wait_for(&self, pick: impl Fn(&Job) -> bool) {
        if !self.here() {
            return;
        }
        let mut st = self.shared.state.lock();
        let last = st
            .running
            .iter()
            .chain(st.queue.iter())
            .filter(|(_, j)| pick(j))
            .map(|&(seq, _)| seq)
            .max();
        let Some(last) = last else {
            return;
        };
        st.urgent_to = st.urgent_to.max(last + 1);
        self.shared.changed.notify_all();
        // Jobs run in order (and failed ones leave the queue): done when
        // neither the running one nor the oldest queued is at or below it.
        // Once quiesced (Note [Helpers at exit]) the queue is empty and the
        // running job still ends.
        while st.running.is_some_and(|r| r.0 <= last)
            || st.queue.front().is_some_and(|q| q.0 <= last)
        {
            self.shared.changed.wait(&mut st);
        }
    }
}

// Note [Helpers at exit]
// Rationale: the allocator lives in a static and is never dropped, so its
// helper threads still run while the process exits. The CUDA driver tears
// itself down after the C `atexit` handlers; a helper inside `cuMemUnmap`
// then would fail, or crash the process at its very end (a training job
// whose last line ran, reported as failed).
// Approach: an `atexit` handler (registered when the allocator starts,
// after CUDA, so it runs before the driver's teardown) calls
// [`quiesce_all`]: no job starts any more and the running one is waited
// for. The jobs not started go to the failed list, so that a request made
// after that (a static destructor freeing, another thread) does them
// itself at its next wait over them, as it does failed jobs; later ranges
// are unmapped on the requesting thread (`push` says `false`). A helper
// that would start after that (the first unmapping of a device that had
// none) does not: its device unmaps on the requesting thread.

/// Every helper started in this process (and, after a fork, its parent's).
static HELPERS: Mutex<Vec<(u32, std::sync::Weak<Shared>)>> = Mutex::new(Vec::new());

/// The process that called [`quiesce_all`] (0: none): no helper starts in
/// it any more. A process id, so that a child forked later is unaffected.
static EXITING: AtomicU32 = AtomicU32::new(0);

/// [`Unmapper::quiesce`] for every helper of this process that still runs;
/// no helper starts in this process afterwards.
pub fn quiesce_all(timeout: Duration) {
    let pid = std::process::id();
    let helpers: Vec<Arc<Shared>> = {
        let registered = HELPERS.lock();
        EXITING.store(pid, Ordering::Relaxed);
        registered
            .iter()
            .filter(|(p, _)| *p == pid)
            .filter_map(|(_, w)| w.upgrade())
            .collect()
    };
    for shared in helpers {
        quiesce(&shared, timeout);
    }
}

fn quiesce(shared: &Shared, timeout: Duration) {
    let mut st = shared.state.lock();
    st.exiting = true;
    // The jobs not started are the caller's now: listed as failed, the
    // backend's next wait over them does them itself (`redo`), so its
    // bookkeeping (a range still mapped until unmapped) holds.
    let left: Vec<Job> = st.queue.drain(..).map(|(_, j)| j).collect();
    st.failed.extend(left);
    shared.changed.notify_all();
    let deadline = std::time::Instant::now() + timeout;
    while st.running.is_some() {
        if shared.changed.wait_until(&mut st, deadline).timed_out() {
            return;
        }
    }
}

/// Whether `job` is a Free of a reservation over which an Unmap failed
/// (in `failed`): it must wait until that is done.
pub fn blocked(failed: &[Job], job: &Job) -> bool {
    match *job {
        Job::Free { ptr, size } => failed
            .iter()
            .any(|f| matches!(f, Job::Unmap { .. }) && f.overlaps(ptr, ptr + size)),
        Job::Unmap { .. } => false,
    }
}

/// Does failed `jobs` again (oldest first) with `run`: those over
/// `[lo, hi)` and, for a Free among them, the Unmaps inside its
/// reservation (all jobs with `None`). Every Unmap runs before every Free:
/// the list need not be in the order the jobs were queued (`quiesce` lists
/// the queue as failed while a job still runs, and that job, if it fails,
/// comes after a Free over it), and a Free while a range inside it is
/// still mapped would free mapped addresses. A job that fails again does
/// not hold back the others, except a Free over it, which waits with it
/// (as on the helper: [`blocked`]). Returns the first error and the jobs
/// done.
pub fn redo(
    jobs: &[Job],
    range: Option<(DevicePtr, DevicePtr)>,
    mut run: impl FnMut(Job) -> Result<(), BackendError>,
) -> (Result<(), BackendError>, Vec<Job>) {
    let mut pick: Vec<bool> = jobs
        .iter()
        .map(|j| range.is_none_or(|(lo, hi)| j.overlaps(lo, hi)))
        .collect();
    for (i, j) in jobs.iter().enumerate() {
        if let (true, Job::Free { ptr, size }) = (pick[i], *j) {
            for (k, u) in jobs.iter().enumerate() {
                if matches!(u, Job::Unmap { .. }) && u.overlaps(ptr, ptr + size) {
                    pick[k] = true;
                }
            }
        }
    }
    let mut done = Vec::new();
    let mut again: Vec<Job> = Vec::new();
    let mut first = Ok(());
    let unmaps = jobs
        .iter()
        .enumerate()
        .filter(|(_, j)| matches!(j, Job::Unmap { .. }));
    let frees = jobs
        .iter()
        .enumerate()
        .filter(|(_, j)| matches!(j, Job::Free { .. }));
    for (i, &job) in unmaps.chain(frees) {
        if !pick[i] || blocked(&again, &job) {
            continue;
        }
        match run(job) {
            Ok(()) => done.push(job),
            Err(e) => {
                again.push(job);
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
    }
    (first, done)
}

impl Drop for Unmapper {
    fn drop(&mut self) {
        if !self.here() {
            // A forked child: no thread to stop, and the lock may have been
            // held at the fork.
            std::mem::forget(self.thread.take());
            return;
        }
        self.shared.state.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests;
