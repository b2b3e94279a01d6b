//! Trace control: start and stop recording every allocation to a file,
//! name phases (`forward`, `checkpoint`, ...) and mark points in time.

use std::ffi::{c_char, c_int};

use gpualloc::{Allocator, Backend};

use crate::boundary::Error;
use crate::boundary::{ffi_boundary, status, str_arg};
use crate::global::{existing, global};

/// Before the allocator exists nothing can be tracing.
fn not_tracing() -> Error {
    Error::new(
        crate::boundary::GPUALLOC_ERR_IO,
        "gpualloc is not tracing (the allocator has not started)",
    )
}

/// Starts tracing if the environment asks for it (`GPUALLOC_TRACE=path`).
/// A trace that cannot start must not stop the program: it is reported on
/// stderr and the allocator runs untraced.
pub(crate) fn from_env<B: Backend>(alloc: &Allocator<B>) {
    match alloc.trace_from_env() {
        Ok(true) => {
            if let Some(v) = gpualloc::trace::trace_env() {
                // The path the allocator opened, which already said what
                // in it is no placeholder (said once, not again here).
                let vars = gpualloc::trace_path::PathVars::from_env();
                let path = gpualloc::trace_path::expand_with(&v, &vars);
                announce(alloc, &path, "GPUALLOC_TRACE");
            }
            stop_at_exit();
            complete_on_sigterm();
        }
        Ok(false) => {}
        Err(e) => crate::boundary::say(format_args!(
            "gpualloc: GPUALLOC_TRACE: could not start tracing: {e}"
        )),
    }
}

/// Starts a trace on a running allocator, as asked by `by`: placeholders
/// filled in, the start announced (and a path taken by another process
/// said on stderr), completed on SIGTERM like a trace started with the
/// allocator.
pub(crate) fn start_now<B: Backend>(
    alloc: &Allocator<B>,
    path: &std::path::Path,
    by: &str,
) -> Result<(), Error> {
    let path = gpualloc::trace_path::expand(path.as_os_str());
    alloc.trace_start(&path)?;
    announce(alloc, &path, by);
    stop_at_exit();
    complete_on_sigterm();
    Ok(())
}

/// Starts the trace `gpualloc_configure` kept for the allocator's start
/// (Note [Starting on first use] in `pending.rs`). As for `GPUALLOC_TRACE`,
/// a trace that cannot start is reported on stderr and the allocator runs
/// untraced.
pub(crate) fn start_kept<B: Backend>(alloc: &Allocator<B>, path: &std::path::Path) {
    // Placeholders are this process's: it may be a child forked since.
    let path = &gpualloc::trace_path::expand(path.as_os_str());
    match alloc.trace_start(path) {
        Ok(()) => {
            announce(alloc, path, "the trace asked for at install");
            stop_at_exit();
            complete_on_sigterm();
        }
        Err(e) => crate::boundary::say(format_args!(
            "gpualloc: could not start tracing to {}: {e}",
            path.display()
        )),
    }
}

/// Logs the trace's start and, on stderr, says where it goes when that is
/// not `asked` (another process was writing it: Note [One writer per
/// trace file]).
fn announce<B: Backend>(alloc: &Allocator<B>, asked: &std::path::Path, by: &str) {
    // The trace's path is absolute (`Recorder::start`); so is this, to compare.
    let asked = &std::path::absolute(asked).unwrap_or_else(|_| asked.to_path_buf());
    let path = alloc.trace_path().unwrap_or_else(|| asked.to_path_buf());
    tracing::info!(path = %path.display(), "trace started ({by})");
    if path != *asked {
        crate::boundary::say(format_args!(
            "gpualloc: {by}: {} is locked by another process (one writing it, or a child forked from the one that did); this one ({}) writes {}",
            asked.display(),
            std::process::id(),
            path.display()
        ));
    }
}

unsafe extern "C" {
    /// The C library's `atexit`.
    pub(crate) fn atexit(callback: extern "C" fn()) -> c_int;
}

/// The longest a trace may take to complete as the process ends (at exit,
/// on SIGTERM, before an abort): a device lock held by a thread stuck in
/// the driver (behind a hung kernel), or storage that hangs, must not keep
/// the process from ending.
const COMPLETE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Stops the trace when the process exits normally, so that a program that
/// never calls `gpualloc_trace_stop` still gets its last events and the END
/// block written.
fn stop_at_exit() {
    extern "C" fn stop() {
        complete_at_end("at exit", "the trace is incomplete (at exit)");
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: `stop` is a plain `extern "C"` function with no arguments
        // that lives as long as the library (which is never unloaded while
        // PyTorch holds its function pointers), and it cannot unwind.
        unsafe {
            atexit(stop);
        }
    });
}

/// Completes the running trace as the process ends (`when`: at exit, on
/// SIGTERM, before an abort), giving it at most [`COMPLETE_WAIT`] on a
/// thread of its own (here when no thread can start), and saying `failed`
/// on stderr when the file could not be completed. Never unwinds.
fn complete_at_end(when: &'static str, failed: &'static str) {
    if let Err(u) = within(move || complete_now(when, failed)) {
        crate::boundary::say(format_args!("gpualloc: {failed}: {}", u.say()));
    }
}

/// Why [`within`] has no result.
enum Unfinished {
    /// The end's time ran out (the work goes on, on its thread).
    TimedOut,
    /// The work panicked.
    Panicked,
}

/// The threads of [`within`] still running after their caller stopped
/// waiting (an attempt to complete the trace as the process ends, an exit
/// handler, `gpualloc_trace_stop_at_end`, SIGTERM or an abort, that ran
/// out of time, stuck behind a thread that holds the allocator). A later
/// attempt would only wait behind them, so it gives up at once: two
/// attempts in turn cannot make the wait twice as long.
static STUCK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs `f` on a thread of its own (here when no thread can start) and
/// gives it at most [`COMPLETE_WAIT`]: its result, or why there is none.
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Unfinished> {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::sync::atomic::Ordering;
    if STUCK.load(Ordering::Acquire) > 0 {
        return Err(Unfinished::TimedOut);
    }
    let (done, finished) = std::sync::mpsc::channel();
    // Whether the caller stopped waiting: then this thread counts in
    // [`STUCK`] until it ends.
    let given_up = std::sync::Arc::new(std::sync::Mutex::new(false));
    let f = std::sync::Arc::new(std::sync::Mutex::new(Some(f)));
    let (g, gave_up) = (f.clone(), given_up.clone());
    let spawned = std::thread::Builder::new()
        .name("gpualloc-trace-end".into())
        .spawn(move || {
            let f = g.lock().ok().and_then(|mut f| f.take());
            if let Some(f) = f {
                let _ = done.send(catch_unwind(AssertUnwindSafe(f)));
            }
            if *gave_up.lock().unwrap_or_else(|e| e.into_inner()) {
                STUCK.fetch_sub(1, Ordering::AcqRel);
            }
        });
    let result = if spawned.is_err() {
        let f = f.lock().ok().and_then(|mut f| f.take());
        f.map(|f| catch_unwind(AssertUnwindSafe(f)))
    } else {
        use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
        match finished.recv_timeout(COMPLETE_WAIT) {
            Ok(r) => Some(r),
            Err(RecvTimeoutError::Disconnected) => None,
            Err(RecvTimeoutError::Timeout) => {
                let mut g = given_up.lock().unwrap_or_else(|e| e.into_inner());
                // It sends before it looks at `given_up`: either it has
                // sent by now, or it counts in STUCK until it ends.
                match finished.try_recv() {
                    Ok(r) => Some(r),
                    Err(TryRecvError::Disconnected) => None,
                    Err(TryRecvError::Empty) => {
                        *g = true;
                        STUCK.fetch_add(1, Ordering::AcqRel);
                        return Err(Unfinished::TimedOut);
                    }
                }
            }
        }
    };
    match result {
        Some(Ok(t)) => Ok(t),
        _ => Err(Unfinished::Panicked),
    }
}

impl Unfinished {
    fn say(&self) -> String {
        match self {
            Unfinished::TimedOut => format!(
                "not completed within {} s (another thread holds the allocator)",
                COMPLETE_WAIT.as_secs()
            ),
            Unfinished::Panicked => "a panic inside gpualloc (a bug)".to_string(),
        }
    }

    fn error(&self) -> Error {
        let code = match self {
            Unfinished::TimedOut => crate::boundary::GPUALLOC_ERR_IO,
            Unfinished::Panicked => crate::boundary::GPUALLOC_ERR_PANIC,
        };
        Error::new(code, format!("gpualloc: the trace stop: {}", self.say()))
    }
}

/// Completes the running trace before the process aborts (an allocation
/// PyTorch cannot be told of failed): the out-of-memory event is what
/// the trace is for.
pub(crate) fn complete_before_abort() {
    complete_at_end("before abort", "the trace is incomplete (before abort)");
}

/// [`complete_at_end`]'s work, on the calling thread.
fn complete_now(when: &str, failed: &str) {
    let _ = std::panic::catch_unwind(|| {
        if let Some(g) = existing()
            && g.alloc.is_tracing()
        {
            let s = g.alloc.trace_stop();
            log_stop(&s, when);
            if let Err(e) = s {
                // The only place left to say that the trace is incomplete.
                crate::boundary::say(format_args!("gpualloc: {failed}: {e}"));
            }
        }
    });
}

/// After a trace started: complete it on SIGTERM too (Note [Completing a
/// trace on SIGTERM] in `sigterm.rs`).
fn complete_on_sigterm() {
    crate::sigterm::complete_trace_on_sigterm(|| {
        complete_at_end("on SIGTERM", "the trace is incomplete (on SIGTERM)");
    });
}

/// Starts recording every allocator event of the process to `path`
/// (a gpualloc trace file; `gpualloc report` reads it). `{pid}`, `{rank}`
/// and `{local_rank}` in `path` become the process id and the `RANK` and
/// `LOCAL_RANK` variables (`0` when unset), as in `GPUALLOC_TRACE`.
///
/// # Safety
/// `path` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_trace_start(path: *const c_char) -> c_int {
    status(|| {
        let path = crate::boundary::path_arg(path, "path")?;
        start_now(&global()?.alloc, &path, "gpualloc_trace_start")
    })
}

/// What a finished trace holds.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuallocTraceSummary {
    /// Events written to the file.
    pub events: u64,
    /// Events recorded but not written (writer behind, or an I/O error).
    pub dropped: u64,
    /// Bytes of the file.
    pub bytes: u64,
}

/// Stops tracing, flushes and closes the file; fills `*summary` unless NULL.
/// `GPUALLOC_ERR_IO` when not tracing or the file could not be completed.
///
/// # Safety
/// `summary` is NULL or points to a writable `GpuallocTraceSummary`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_trace_stop(summary: *mut GpuallocTraceSummary) -> c_int {
    status(|| write_summary(summary, stop("on request")?))
}

/// As `gpualloc_trace_stop`, for the end of a process (an exit handler):
/// the trace gets at most 5 s to complete, so that a thread stuck in the
/// driver while it holds the allocator (behind a hung kernel) cannot keep
/// the process from ending; `GPUALLOC_ERR_IO` when it was not done by then.
///
/// # Safety
/// `summary` is NULL or points to a writable `GpuallocTraceSummary`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_trace_stop_at_end(summary: *mut GpuallocTraceSummary) -> c_int {
    status(|| {
        let s = within(|| stop("at the end")).map_err(|u| u.error())??;
        write_summary(summary, s)
    })
}

/// Stops the trace (`when`, for the log).
fn stop(when: &str) -> Result<gpualloc::trace::TraceSummary, Error> {
    // Before the start the trace it would record is called off: it
    // recorded nothing (Note [Starting on first use]).
    Ok(match crate::global::stop_trace_before_start() {
        Some(false) => return Err(not_tracing()),
        Some(true) => gpualloc::trace::TraceSummary::default(),
        None => {
            let s = existing().ok_or_else(not_tracing)?.alloc.trace_stop();
            log_stop(&s, when);
            s?
        }
    })
}

fn write_summary(
    summary: *mut GpuallocTraceSummary,
    s: gpualloc::trace::TraceSummary,
) -> Result<(), Error> {
    if !summary.is_null() {
        let c = GpuallocTraceSummary {
            events: s.events,
            dropped: s.dropped,
            bytes: s.bytes,
        };
        crate::boundary::write_out(summary, c, "summary")?;
    }
    Ok(())
}

/// A trace stop, at info level (at warn when the file could not be completed).
fn log_stop(s: &std::io::Result<gpualloc::trace::TraceSummary>, when: &str) {
    match s {
        Ok(s) => tracing::info!(
            events = s.events,
            dropped = s.dropped,
            bytes = s.bytes,
            "trace stopped {when}"
        ),
        Err(e) => tracing::warn!(error = %e, "trace stop {when} failed"),
    }
}

/// Writes everything recorded so far to the trace file. Before the
/// allocator starts with a trace to record (`gpualloc_is_tracing` says 1),
/// nothing is recorded yet: nothing to write.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_trace_flush() -> c_int {
    status(|| match existing() {
        Some(g) => Ok(g.alloc.trace_flush()?),
        None if crate::pending::tracing() => Ok(()),
        None => Err(not_tracing()),
    })
}

/// 1 while tracing (or, before the allocator starts, when a trace will be
/// recorded from its start), 0 when not, negative on error.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_is_tracing() -> c_int {
    crate::boundary::clear_last_error();
    ffi_boundary(
        |code| code,
        || {
            Ok(c_int::from(match existing() {
                Some(g) => g.alloc.is_tracing(),
                // One will be recorded from the start (Note [Starting on
                // first use]).
                None => crate::pending::tracing(),
            }))
        },
    )
}

/// The allocator a mark or a phase goes to: none, and nothing started,
/// before the start when no trace would be recorded from it, since there
/// is nothing to record them in (a spawned worker running a script's
/// `with gpualloc.phase(...)` again starts no CUDA for it; Note [Starting
/// on first use]). With a trace to record, the allocator starts, as before.
fn recording() -> Result<Option<&'static crate::global::Global>, Error> {
    match existing() {
        Some(g) => Ok(Some(g)),
        None if crate::pending::tracing() => global().map(Some),
        None => Ok(None),
    }
}

/// Enters a named phase (nestable); recorded in the trace.
///
/// # Safety
/// `name` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_phase_push(name: *const c_char) -> c_int {
    status(|| {
        let name = str_arg(name, "name")?;
        match recording()? {
            Some(g) => g.alloc.phase_push(name).map_err(name_error),
            // Nothing to record it in; the name is still checked.
            None => gpualloc::trace::format::check_name(name, "phase").map_err(name_error),
        }
    })
}

/// A phase's or mark's error: a name refused (too long for a trace) is a
/// bad argument, anything else an I/O error.
fn name_error(e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::InvalidInput {
        Error::new(
            crate::boundary::GPUALLOC_ERR_INVALID_ARGUMENT,
            format!("gpualloc: {e}"),
        )
    } else {
        e.into()
    }
}

/// Leaves the innermost phase.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_phase_pop() -> c_int {
    status(|| {
        if let Some(g) = recording()? {
            g.alloc.phase_pop();
        }
        Ok(())
    })
}

/// Records a named point in time (`"epoch 3"`).
///
/// # Safety
/// `name` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_mark(name: *const c_char) -> c_int {
    status(|| {
        let name = str_arg(name, "name")?;
        match recording()? {
            Some(g) => g.alloc.mark(name).map_err(name_error),
            // Nothing to record it in; the name is still checked.
            None => gpualloc::trace::format::check_name(name, "mark").map_err(name_error),
        }
    })
}
