//! Starting, flushing and stopping a trace on a running [`Allocator`], and
//! the phase and mark annotations. Every function here takes device locks
//! one at a time and never while holding the recorder slot, so it cannot
//! deadlock with `Allocator::lock`, which takes them in the other order.
//!
//! Note [Trace control lock]: starting attaches the new recorder to each
//! device after publishing it, and stopping detaches each device after
//! taking it down, one device lock at a time. Interleaved, a stop could run
//! between a start's publishing and its attaching, and leave devices
//! attached to a stopped recorder, their events lost with no dropped count
//! (and a later start would skip them as already attached). So every
//! function here that reads or changes which recorder is running holds
//! [`CONTROL`] throughout. It is taken before any device lock and never
//! under one, and the allocation path never takes it. Forking holds it too
//! (Note [Trace control across fork] in `trace/control_lock.rs`), so a
//! forked child finds it free and no control call half done.
//!
//! Note [Traces across fork]: a child forked from a tracing process
//! inherits the recorder but not its writer thread. Stopping or flushing
//! there would wait for a thread that does not exist (a hang, or a panic
//! in an exit handler, which a test of the Python package found with a
//! plain `os.fork()`). So a recorder knows the process that started it:
//! elsewhere `is_tracing` is false, stop and flush answer "not tracing"
//! (a stop lets the copy go and detaches the child's devices), and a new
//! trace may start, to a file of the child's own. A start lets the copy
//! and its device buffers go before it creates the file: a start that
//! failed there once left the buffers attached, so the next start skipped
//! those devices (a trace of nothing) and its stop waited on the copy's
//! channel, full and read by nobody. Until then the child's device buffers
//! never send on that channel: a send could spin forever on a lock of the
//! channel that the parent's writer thread held at the fork (a rare hang of
//! the Python package's fork test in CI); what they record is dropped.
//! Nor does the child drop its copies of the channel's ends: dropping the
//! last one disconnects the channel, which takes the same kind of lock (a
//! waker's, which the writer takes as it waits for a message), so the
//! copies are leaked (`Ends` in `recorder.rs`).

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::MutexGuard;

use crate::allocator::{Allocator, LOCK_WAIT_AFTER_FORK, in_forked_child, poll_lock};
use crate::backend::Backend;
use crate::device::DeviceAllocator;
use crate::trace::control_lock::CONTROL;
use crate::trace::format::check_name;
use crate::trace::recorder::{Recorder, TraceOptions, TraceSummary};
use crate::trace::{Action, trace_env};

/// Set to `1` by `python -m gpualloc run` for the processes it starts
/// (Note [Installing in child processes] in the Python package).
const RUN_CHILDREN: &str = "GPUALLOC_RUN_CHILDREN";

/// Whether a forked child waited in vain for the recorder's slot (Note
/// [Locks held at a fork] in `allocator.rs`): later calls fail at once.
static RECORDER_HELD_AT_FORK: AtomicBool = AtomicBool::new(false);

impl<B: Backend> Allocator<B> {
    /// Starts tracing to `path` with the default [`TraceOptions`].
    ///
    /// # Errors
    /// `AlreadyExists` when a trace is running; the file's creation error.
    pub fn trace_start(&self, path: &Path) -> io::Result<()> {
        self.trace_start_with(path, TraceOptions::default())
    }

    /// Starts tracing to `path`: writes the header (configuration string,
    /// device count, start time) and attaches a buffer to every device,
    /// including devices created later.
    ///
    /// # Errors
    /// `AlreadyExists` when a trace is running; the file's creation error.
    pub fn trace_start_with(&self, path: &Path, opts: TraceOptions) -> io::Result<()> {
        let _control = CONTROL.lock();
        // A fork's copy of its parent's trace (Note [Traces across fork]):
        // let go of it and of its device buffers before anything can fail,
        // so that a failed start leaves none attached for the next start
        // to skip. The slot is emptied first: a device created meanwhile
        // does not join the copy.
        let inherited = {
            let mut slot = self.recorder_slot()?;
            if slot.as_ref().is_some_and(|r| !r.is_own()) {
                slot.take()
            } else {
                None
            }
        };
        if inherited.is_some() {
            self.abandon_inherited();
        }
        drop(inherited);
        let rec = {
            let mut slot = self.recorder_slot()?;
            if let Some(r) = &*slot {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("gpualloc is already tracing to {}", r.path().display()),
                ));
            }
            let rec = Arc::new(
                Recorder::start(path, &self.config.source, self.devices.len() as u32, opts)
                    .map_err(|e| naming(path, e))?,
            );
            *slot = Some(rec.clone());
            rec
        };
        self.each_device(|d| {
            if d.trace.is_none() {
                let now = d.backend.now_ns();
                d.start_trace(rec.device_trace(d.device, now));
                // Checkpoints taken before this trace are unknown to it.
                d.private.forget_checkpoint_numbers();
            }
        });
        Ok(())
    }

    /// Starts a trace when `GPUALLOC_TRACE` names a file; `Ok(false)` when
    /// unset or blank ([`trace_env`]).
    ///
    /// # Errors
    /// As [`trace_start`](Self::trace_start).
    pub fn trace_from_env(&self) -> io::Result<bool> {
        match trace_env() {
            Some(v) if !self.is_tracing() => {
                let path = with_pid(&v);
                // Note [One writer per trace file]: a run's processes keep
                // each other's finished traces.
                let path = if std::env::var_os(RUN_CHILDREN).is_some_and(|r| r == "1") {
                    crate::trace::trace_file::past_finished(&path)
                } else {
                    path
                };
                self.trace_start(&path)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Whether this process is recording a trace: not a child forked from
    /// one that is (Note [Traces across fork]).
    pub fn is_tracing(&self) -> bool {
        self.own_recorder().is_some()
    }

    /// The file being written, while tracing: the path asked for (made
    /// absolute when it was relative, against the folder current at the
    /// start), or one beside it when another process was writing that
    /// (Note [One writer per trace file]).
    pub fn trace_path(&self) -> Option<std::path::PathBuf> {
        self.recorder_slot()
            .ok()?
            .as_ref()
            .map(|r| r.path().to_path_buf())
    }

    /// Hands every device's buffer to the writer and waits until it is written.
    ///
    /// # Errors
    /// `NotFound` when not tracing; the writer's I/O error.
    pub fn trace_flush(&self) -> io::Result<()> {
        let _control = CONTROL.lock();
        let rec = self.current_recorder()?;
        // Each batch goes to the writer under its device's lock, as full
        // buffers do, so a device's events reach the file in order.
        self.each_device(|d| {
            if let Some(b) = d.trace.as_mut().and_then(|t| t.take_batch()) {
                rec.send(b);
            }
        });
        rec.flush().map_err(|e| naming(rec.path(), e))
    }

    /// Stops tracing: flushes every buffer, writes the END block, joins the
    /// writer and detaches the devices.
    ///
    /// # Errors
    /// `NotFound` when not tracing; the writer's I/O error.
    pub fn trace_stop(&self) -> io::Result<TraceSummary> {
        let _control = CONTROL.lock();
        let rec = self.recorder_slot()?.take().ok_or_else(not_tracing)?;
        if !rec.is_own() {
            // Note [Traces across fork]: the child lets go of the parent's
            // trace, whose events it must not write.
            self.abandon_inherited();
            return Err(not_tracing());
        }
        let mut traces = Vec::new();
        self.each_device(|d| traces.extend(d.trace.take()));
        for t in traces {
            t.finish();
        }
        rec.record_held_marks();
        let result = rec.stop().map_err(|e| naming(rec.path(), e));
        // What the writer failed to write after the devices detached.
        self.each_device(|d| d.stats.num_trace_dropped += rec.take_lost(d.device) as i64);
        result
    }

    /// Opens a named phase on every device (no-op when not tracing).
    ///
    /// # Errors
    /// `InvalidInput` for a name longer than
    /// [`MAX_NAME_LEN`](crate::trace::format::MAX_NAME_LEN) bytes, tracing
    /// or not.
    pub fn phase_push(&self, name: &str) -> io::Result<()> {
        check_name(name, "phase")?;
        let _control = CONTROL.lock();
        // The recorder lock is released before any device lock is taken:
        // `Allocator::lock` takes them in the other order.
        let rec = self.own_recorder();
        if let Some(rec) = rec {
            let (id, op) = rec.push_phase(name);
            self.record_everywhere(Action::PhasePush, id, Some(op));
        }
        Ok(())
    }

    /// Closes the innermost phase (no-op when not tracing or none is open).
    pub fn phase_pop(&self) {
        let _control = CONTROL.lock();
        let rec = self.own_recorder();
        if let Some(rec) = rec
            && let Some((id, op)) = rec.pop_phase()
        {
            self.record_everywhere(Action::PhasePop, id, Some(op));
        }
    }

    /// Records a named point in time on every device (no-op when not tracing).
    ///
    /// # Errors
    /// `InvalidInput` for a name longer than
    /// [`MAX_NAME_LEN`](crate::trace::format::MAX_NAME_LEN) bytes, tracing
    /// or not.
    pub fn mark(&self, name: &str) -> io::Result<()> {
        check_name(name, "mark")?;
        let _control = CONTROL.lock();
        let rec = self.own_recorder();
        if let Some(rec) = rec {
            let id = rec.intern(name);
            // No device yet: the first one to join records it (decided
            // under the lock it joins under, so none joins in between).
            if !rec.hold_mark_if_alone(id, crate::clock::now_ns()) {
                self.record_everywhere(Action::Mark, id, None);
            }
        }
        Ok(())
    }

    /// Records on every device that traces. For phase
    /// push or pop number `phase_op`, not on a device that joined after it:
    /// the phases it replayed when it joined include it.
    ///
    /// Note [Phases of a device that joins]
    /// A device joins a running trace when it is created (its first
    /// allocation), under its own lock and not under [`CONTROL`], and
    /// records the phases open then (`Recorder::device_trace`). A push or
    /// pop updates the open phases first and then visits the devices one
    /// by one; a device created between the two replayed the push already
    /// (and would record it twice) or never saw the popped phase (and
    /// would record a pop of nothing), leaving its phases unbalanced for
    /// the rest of the trace (a review found 9 runs of 40 with 8 devices).
    /// So the open phases carry a count of pushes and pops, a device keeps
    /// the count it joined at, and the visit passes over devices that
    /// joined at or after the operation's number. A mark made before any
    /// device joined is kept for the first, decided under the same lock,
    /// so that a device joining meanwhile cannot miss it.
    fn record_everywhere(&self, action: Action, id: u64, phase_op: Option<u64>) {
        self.each_device(|d| {
            let Some(t) = &d.trace else {
                return;
            };
            if phase_op.is_some_and(|op| t.joined_after(op)) {
                return;
            }
            d.record(action, 0, 0, 0, id);
        });
    }

    fn current_recorder(&self) -> io::Result<Arc<Recorder>> {
        self.own_recorder().ok_or_else(not_tracing)
    }

    /// The running recorder, unless it is a forked child's copy of its
    /// parent's (Note [Traces across fork]).
    fn own_recorder(&self) -> Option<Arc<Recorder>> {
        self.recorder_slot().ok()?.clone().filter(|r| r.is_own())
    }

    /// The recorder's slot, locked; in a forked child polled for at most
    /// [`LOCK_WAIT_AFTER_FORK`] (once: later calls fail at once), so that a
    /// slot a thread of the parent held at the fork fails the call instead
    /// of hanging it (Note [Locks held at a fork] in `allocator.rs`).
    pub(crate) fn recorder_slot(&self) -> io::Result<MutexGuard<'_, Option<Arc<Recorder>>>> {
        if !in_forked_child() {
            return Ok(self.recorder.lock());
        }
        let wait = if RECORDER_HELD_AT_FORK.load(Ordering::Relaxed) {
            Duration::ZERO
        } else {
            LOCK_WAIT_AFTER_FORK
        };
        poll_lock(&self.recorder, wait).ok_or_else(|| {
            RECORDER_HELD_AT_FORK.store(true, Ordering::Relaxed);
            io::Error::new(
                io::ErrorKind::WouldBlock,
                "gpualloc cannot trace in this process: it was forked from one whose allocator runs while another thread of it held the trace's lock, which no thread here will release",
            )
        })
    }

    /// Detaches every device from a forked child's copy of its parent's
    /// trace without handing its buffers on: nothing in the child reads the
    /// channel, which may be full (Note [Traces across fork]).
    fn abandon_inherited(&self) {
        self.each_device(|d| {
            if let Some(t) = d.trace.take() {
                t.abandon();
            }
        });
    }

    /// Runs `f` on every created device, one lock at a time, then publishes
    /// the device's newly dropped trace events in its stats.
    /// A device whose lock a forked child cannot take is passed over (Note
    /// [Locks held at a fork] in `allocator.rs`).
    fn each_device(&self, mut f: impl FnMut(&mut DeviceAllocator<B>)) {
        for (i, slot) in self.devices.iter().enumerate() {
            if let Ok(mut g) = crate::allocator::take(slot, i as i64)
                && let Some(d) = g.as_mut()
            {
                d.begin_call();
                sync_drops(d);
                f(d);
                sync_drops(d);
            }
        }
    }
}

fn sync_drops<B: Backend>(d: &mut DeviceAllocator<B>) {
    if let Some(t) = d.trace.as_mut() {
        d.stats.num_trace_dropped += t.take_unsynced_drops() as i64;
    }
}

/// `GPUALLOC_TRACE`'s value with `{pid}`, `{rank}` and `{local_rank}`
/// replaced (`trace_path.rs`). The rest of the path is kept byte for byte,
/// UTF-8 or not.
fn with_pid(v: &std::ffi::OsStr) -> std::path::PathBuf {
    crate::trace_path::expand(v)
}

/// `e`, its message prefixed with the trace file's name.
fn naming(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("trace {}: {e}", path.display()))
}

fn not_tracing() -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, "gpualloc is not tracing")
}

#[cfg(test)]
mod tests;
