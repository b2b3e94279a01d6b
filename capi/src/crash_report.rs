//! Saying where a process crashed: the thread and its native stack.
//!
//! Note [Crash reports]
//! Rationale: a process that dies of SIGSEGV inside the CUDA driver, this
//! library or torch leaves nothing that tells these apart. Python's
//! faulthandler shows Python frames only, and the GPU machines the tests
//! run on have no debugger. One run of the `churn_wide` GPU check died so
//! (round 48, once in eighteen runs of the same build), with an empty
//! stderr.
//! Approach: with `GPUALLOC_CRASH_REPORT=1`, the allocator's start installs
//! a handler of SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT. It writes to
//! stderr the signal, the faulting address, the thread's id and name
//! (`gpualloc-unmap-0` is the unmapping helper of device 0) and the native
//! stack, then gives the signal to the handler that was there before:
//! Python's faulthandler, which prints the Python stacks, or the default
//! action, which ends the process as it would have ended. Frames are
//! written by glibc's `backtrace_symbols_fd` (no allocation) as a library
//! and an offset; `addr2line -f -C -e libgpualloc.so OFFSET` names the
//! library's own (its symbol table is kept). A signal sent (`abort`,
//! `kill`) names its sender instead of an address. The report is made
//! once: a thread that crashes while another writes it waits for it (up to
//! 2 s) and then gives its own signal on.
//! Off by default, since a program's own crash handlers (a debugger, a
//! crash collector) expect to be the first to see its signals; the GPU
//! scripts turn it on (`tests/gpu/env.sh`).
//! Limitations: a thread that overflowed its stack has none left to run a
//! handler on, unless it set up an alternate stack (the handler asks for
//! one, `SA_ONSTACK`): such a crash ends the process without a report, as
//! before. Unwinding through the driver's frames may stop early. glibc's
//! unwinder takes the loader's lock: a crash inside the loader could make
//! the report wait forever, so an alarm ends the process after
//! [`REPORT_LIMIT_S`] (by SIGALRM, not the crash's signal).

use std::ffi::{c_int, c_void};
use std::fmt::Write as _;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

/// The variable that turns the reports on.
pub(crate) const VARIABLE: &str = "GPUALLOC_CRASH_REPORT";

/// The signals reported, with their names.
const SIGNALS: [(c_int, &str); 5] = [
    (libc::SIGSEGV, "SIGSEGV"),
    (libc::SIGBUS, "SIGBUS"),
    (libc::SIGILL, "SIGILL"),
    (libc::SIGFPE, "SIGFPE"),
    (libc::SIGABRT, "SIGABRT"),
];

/// The most frames written.
const FRAMES: usize = 64;

/// The handlers there before, by signal, read before any is replaced.
static OLD: OnceLock<Vec<(c_int, libc::sigaction)>> = OnceLock::new();

/// No report yet.
const NONE: u8 = 0;
/// A thread is writing the report.
const REPORTING: u8 = 1;
/// The report is written.
const DONE: u8 = 2;

/// Where the one report stands: [`NONE`], [`REPORTING`] or [`DONE`].
static STATE: AtomicU8 = AtomicU8::new(NONE);

/// How long a thread that crashed while another reports waits for that
/// report before it lets its own signal end the process, in steps of 10 ms.
const WAIT_STEPS: u32 = 200;

/// The longest a report may take (an unwinder stuck on a lock): then the
/// alarm's default action ends the process.
const REPORT_LIMIT_S: u32 = 10;

/// What `GPUALLOC_CRASH_REPORT` asks: `Ok(true)` for on. A value that is
/// neither on nor off is an error naming it.
pub(crate) fn wanted(value: Option<&str>) -> Result<bool, String> {
    let Some(v) = value.map(str::trim) else {
        return Ok(false);
    };
    match v.to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "no" | "off" => Ok(false),
        "1" | "true" | "yes" | "on" => Ok(true),
        _ => Err(format!(
            "gpualloc: {VARIABLE}={v} is neither on (1, true, yes, on) nor off (0, false, no, off); \
             crash reports stay off"
        )),
    }
}

/// Installs the handler of Note [Crash reports] once per process when
/// `GPUALLOC_CRASH_REPORT` asks for it; says on stderr why not otherwise.
pub(crate) fn install_from_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let value = std::env::var(VARIABLE).ok();
        match wanted(value.as_deref()) {
            Ok(false) => {}
            Ok(true) => {
                if let Err(e) = install() {
                    crate::boundary::say(format_args!("gpualloc: no crash reports: {e}"));
                }
            }
            Err(e) => crate::boundary::say(format_args!("{e}")),
        }
    });
}

fn install() -> std::io::Result<()> {
    // The first call loads the unwinder (libgcc_s), which allocates: done
    // here, not in the handler.
    let mut frames = [std::ptr::null_mut::<c_void>(); 2];
    // SAFETY: `frames` has room for the 2 entries asked for.
    unsafe { libc::backtrace(frames.as_mut_ptr(), 2) };
    // Every old handler is read, and kept, before any is replaced, so that
    // a crash in between finds the one to give its signal to.
    let mut old = Vec::with_capacity(SIGNALS.len());
    for (signal, _) in SIGNALS {
        // SAFETY: a zeroed `sigaction` is a valid value to be filled in.
        let mut before: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: reads the disposition into `before`, a valid out-pointer.
        if unsafe { libc::sigaction(signal, std::ptr::null(), &raw mut before) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        old.push((signal, before));
    }
    let old = OLD.get_or_init(|| old);
    // SAFETY: as above.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = on_crash as extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) as usize;
    act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: empties the mask of `act`, a valid sigaction.
    unsafe { libc::sigemptyset(&raw mut act.sa_mask) };
    for (n, (signal, _)) in SIGNALS.iter().enumerate() {
        // SAFETY: `act` is initialized; the handler is a plain function
        // that lives as long as the library (never unloaded: the allocator
        // is a static).
        if unsafe { libc::sigaction(*signal, &raw const act, std::ptr::null_mut()) } != 0 {
            let e = std::io::Error::last_os_error();
            // All or none: the ones installed get their old handler back.
            for (signal, before) in &old[..n] {
                // SAFETY: `before` is the disposition read above.
                unsafe { libc::sigaction(*signal, before, std::ptr::null_mut()) };
            }
            return Err(e);
        }
    }
    Ok(())
}

/// The handler: the report (once), then the signal goes to the handler
/// installed before.
extern "C" fn on_crash(signal: c_int, info: *mut libc::siginfo_t, _context: *mut c_void) {
    if STATE
        .compare_exchange(NONE, REPORTING, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok()
    {
        // SAFETY: `alarm` is async-signal-safe; the process is ending, so
        // an alarm of its own it may have set no longer matters.
        unsafe { libc::alarm(REPORT_LIMIT_S) };
        report(signal, info);
        // SAFETY: as above.
        unsafe { libc::alarm(0) };
        STATE.store(DONE, Ordering::SeqCst);
    } else {
        // Another thread is writing the report: ending the process now
        // would cut it short.
        let step = libc::timespec {
            tv_sec: 0,
            tv_nsec: 10_000_000,
        };
        for _ in 0..WAIT_STEPS {
            if STATE.load(Ordering::SeqCst) == DONE {
                break;
            }
            // SAFETY: `nanosleep` is async-signal-safe; `step` is valid.
            unsafe { libc::nanosleep(&step, std::ptr::null_mut()) };
        }
    }
    give_back(signal, info);
}

/// Writes the report on stderr, without allocating.
fn report(signal: c_int, info: *mut libc::siginfo_t) {
    let name = SIGNALS
        .iter()
        .find(|(s, _)| *s == signal)
        .map_or("signal", |(_, n)| n);
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let info = (!info.is_null()).then(|| unsafe { &*info });
    // SAFETY: `gettid` has no arguments and cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    let mut thread = [0u8; 17];
    // SAFETY: PR_GET_NAME writes at most 16 bytes, NUL included, into the
    // buffer, which has 17.
    unsafe { libc::prctl(libc::PR_GET_NAME, thread.as_mut_ptr()) };
    let len = thread.iter().position(|&b| b == 0).unwrap_or(16);
    let thread = std::str::from_utf8(&thread[..len]).unwrap_or("?");
    let mut line = Line::default();
    let _ = write!(line, "\ngpualloc: crash report: {name} (signal {signal}) ");
    match info {
        Some(i) if i.si_code <= 0 => {
            // SAFETY: a signal sent (`kill`, `raise`, `abort`) carries the
            // sender's process id.
            let pid = unsafe { i.si_pid() };
            let _ = write!(line, "sent by process {pid}");
        }
        Some(i) => {
            // SAFETY: a fault carries the address.
            let address = unsafe { i.si_addr() } as usize;
            let _ = write!(line, "at address {address:#x}");
        }
        None => {}
    }
    let _ = writeln!(
        line,
        ", thread {tid} \"{thread}\"; native stack (library(+offset) [address]; \
         addr2line -f -C -e LIBRARY OFFSET names a frame):"
    );
    line.flush();
    let mut frames = [std::ptr::null_mut::<c_void>(); FRAMES];
    // SAFETY: `frames` has room for FRAMES entries; the unwinder was loaded
    // at installation.
    let n = unsafe { libc::backtrace(frames.as_mut_ptr(), FRAMES as c_int) };
    // SAFETY: the first `n` entries were filled in; fd 2 is stderr.
    unsafe { libc::backtrace_symbols_fd(frames.as_ptr(), n, 2) };
    let _ = write!(line, "gpualloc: end of crash report\n\n");
    line.flush();
}

/// Puts the handler there before back and lets it have the signal: a fault
/// happens again when the handler returns (the instruction runs again); a
/// signal sent (`abort`, `kill`) is sent again, and waits until it returns.
fn give_back(signal: c_int, info: *mut libc::siginfo_t) {
    // SAFETY: as in `report`.
    let sent = !info.is_null() && unsafe { (*info).si_code } <= 0;
    let old = OLD
        .get()
        .and_then(|old| old.iter().find(|(s, _)| *s == signal))
        .map(|(_, a)| *a);
    // SAFETY: a zeroed `sigaction` with SIG_DFL (0) is the default action.
    let default: libc::sigaction = unsafe { std::mem::zeroed() };
    let act = old.unwrap_or(default);
    // SAFETY: `act` is the disposition read at installation (or the
    // default); `sigaction` and `raise` are async-signal-safe.
    unsafe {
        libc::sigaction(signal, &raw const act, std::ptr::null_mut());
        if sent {
            libc::raise(signal);
        }
    }
}

/// A line built on the stack and written to stderr with one `write`.
struct Line {
    buf: [u8; 512],
    len: usize,
}

impl Default for Line {
    fn default() -> Line {
        Line {
            buf: [0; 512],
            len: 0,
        }
    }
}

impl Line {
    fn flush(&mut self) {
        // SAFETY: the first `len` bytes of `buf` are initialized; fd 2 is
        // stderr; `write` is async-signal-safe.
        unsafe { libc::write(2, self.buf.as_ptr().cast::<c_void>(), self.len) };
        self.len = 0;
    }
}

impl std::fmt::Write for Line {
    /// Keeps what fits; the rest of a long line is cut.
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_reads_on_and_off_and_names_a_bad_value() {
        assert_eq!(wanted(None), Ok(false));
        for off in ["", "0", "off", "False", " no "] {
            assert_eq!(wanted(Some(off)), Ok(false), "{off:?}");
        }
        for on in ["1", "on", "TRUE", "yes"] {
            assert_eq!(wanted(Some(on)), Ok(true), "{on:?}");
        }
        let e = wanted(Some("2")).unwrap_err();
        assert!(e.contains("GPUALLOC_CRASH_REPORT=2"), "{e}");
    }

    #[test]
    fn a_long_line_is_cut_to_its_buffer() {
        let mut line = Line::default();
        let _ = write!(line, "{}", "x".repeat(600));
        assert_eq!(line.len, 512);
        let _ = write!(line, "more");
        assert_eq!(line.len, 512);
    }
}
