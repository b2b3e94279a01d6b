//! Completing a trace when the process is told to end (SIGTERM).
//!
//! Note [Completing a trace on SIGTERM]
//! Rationale: SIGTERM's default action ends the process without exit
//! handlers, so a trace lost its last buffer per device (up to 4096
//! events each) and its END block. `torchrun` stops the other ranks with
//! SIGTERM when one fails, which is when the trace matters most. A Python
//! handler was tried and left out: Python runs it only when the main
//! thread returns to the interpreter, so a rank stuck in a hung collective
//! no longer ended on SIGTERM at all.
//! Approach: when a trace starts and SIGTERM still has its default action,
//! a C-level handler is installed, one-shot (`SA_RESETHAND`: a second
//! SIGTERM ends the process at once). It only writes a byte to a pipe
//! (async-signal-safe). A thread of the library, waiting on that pipe,
//! completes the trace, giving it at most a few seconds (a device lock
//! held by a thread stuck in the driver, storage that hangs:
//! `trace::complete_at_end`), then sends
//! SIGTERM to the process again, which the default action now takes: the
//! process ends as it would have (status -15), at most a few seconds
//! later. A handler installed before is left alone; one installed later
//! (Python's `signal.signal`, Lightning's signal connector) replaces this
//! one. A forked child (a DataLoader worker) has not the thread: the fork
//! handler gives it the default action back (`fork.rs`), and a SIGTERM that
//! reaches it earlier, while it still has the handler, ends it without
//! waking the parent's thread (the handler compares the process id). A
//! child that starts a trace of its own gets a handler, a pipe and a thread
//! of its own.
//! Limitations: SIGKILL still loses what was not handed to the writer.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicI32, Ordering};

/// The pipe's write end, once installed (-1 before).
static WAKE: AtomicI32 = AtomicI32::new(-1);

/// The process that installed the handler (0 before).
static OWNER: AtomicI32 = AtomicI32::new(0);

/// The handler: one byte into the pipe (async-signal-safe). In a forked
/// child that received SIGTERM before the fork's child handler gave it the
/// default action back, it does not wake the parent's thread through the
/// shared pipe: the child ends by SIGTERM, as it would have.
extern "C" fn on_sigterm(_signal: c_int) {
    // SAFETY: `getpid` is async-signal-safe and has no arguments.
    if unsafe { libc::getpid() } != OWNER.load(Ordering::Relaxed) {
        end_by_sigterm();
        return;
    }
    let fd = WAKE.load(Ordering::Relaxed);
    if fd >= 0 {
        let byte = 1u8;
        // SAFETY: `fd` is the pipe's write end, open for the life of the
        // process; `byte` lives for the call. `write` is async-signal-safe.
        unsafe {
            libc::write(fd, (&raw const byte).cast::<c_void>(), 1);
        }
    }
}

/// The process that last tried to install the handler (0 before): a
/// forked child that starts a trace of its own tries again, with a pipe and
/// a thread of its own (the fork handler gave it the default action back).
static TRIED: AtomicI32 = AtomicI32::new(0);

/// Installs the handler of Note [Completing a trace on SIGTERM], once per
/// process, when SIGTERM has its default action; `complete` finishes the
/// trace.
pub(crate) fn complete_trace_on_sigterm(complete: fn()) {
    // SAFETY: `getpid` has no arguments and cannot fail.
    let pid = unsafe { libc::getpid() };
    let seen = TRIED.load(Ordering::Acquire);
    if seen == pid
        || TRIED
            .compare_exchange(seen, pid, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
    {
        return; // tried in this process already, or being tried now
    }
    // A child must not inherit the handler: its SIGTERM would wake the
    // parent's thread through the shared pipe.
    crate::fork::watch();
    if let Err(e) = install(complete) {
        tracing::debug!(%e, "no SIGTERM handler for the trace");
    }
}

fn install(complete: fn()) -> std::io::Result<()> {
    // SAFETY: a zeroed `sigaction` is a valid value to be filled in.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: reads SIGTERM's disposition into `old`, a valid out-pointer.
    if unsafe { libc::sigaction(libc::SIGTERM, std::ptr::null(), &raw mut old) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if old.sa_sigaction != libc::SIG_DFL {
        return Ok(()); // the program's own handler, or SIGTERM ignored
    }
    let mut fds = [0 as c_int; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let read_end = fds[0];
    std::thread::Builder::new()
        .name("gpualloc-sigterm".into())
        .spawn(move || wait_and_end(read_end, complete))?;
    // SAFETY: `getpid` has no arguments and cannot fail.
    OWNER.store(unsafe { libc::getpid() }, Ordering::Relaxed);
    WAKE.store(fds[1], Ordering::Relaxed);
    // SAFETY: as above.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = on_sigterm as extern "C" fn(c_int) as usize;
    act.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
    // SAFETY: `act` is initialized; the mask is emptied before use, and the
    // handler is a plain function that lives as long as the library.
    unsafe {
        libc::sigemptyset(&raw mut act.sa_mask);
        if libc::sigaction(libc::SIGTERM, &raw const act, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The thread: waits for SIGTERM's byte, completes the trace (`complete`
/// gives it a bounded time) and ends the process by SIGTERM.
fn wait_and_end(read_end: c_int, complete: fn()) {
    let mut byte = 0u8;
    loop {
        // SAFETY: `read_end` is the pipe's read end, owned by this thread;
        // `byte` is a valid one-byte buffer.
        let n = unsafe { libc::read(read_end, (&raw mut byte).cast::<c_void>(), 1) };
        if n == 1 {
            break;
        }
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return; // the pipe is gone: nothing will wake this thread
    }
    complete();
    end_by_sigterm();
}

/// Gives SIGTERM its default action (the handler was one-shot, but a
/// program may have installed this process's handler again) and sends it
/// to the process, which ends with SIGTERM's status (from a handler: as
/// soon as it returns). Only async-signal-safe calls.
fn end_by_sigterm() {
    // SAFETY: a zeroed `sigaction` with `SIG_DFL` is a valid disposition;
    // `sigaction`, `getpid` and `kill` are async-signal-safe system calls
    // with valid arguments.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGTERM, &raw const dfl, std::ptr::null_mut());
        libc::kill(libc::getpid(), libc::SIGTERM);
    }
}

/// In a forked child: SIGTERM's default action back when this handler is
/// installed (the child has not the thread that would end it). Only
/// async-signal-safe calls: it runs in the fork's child handler.
pub(crate) fn reset_in_child() {
    if WAKE.load(Ordering::Relaxed) < 0 {
        return;
    }
    // SAFETY: zeroed `sigaction`s are valid to fill in; `sigaction` is
    // async-signal-safe and its pointers are valid for the call.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGTERM, std::ptr::null(), &raw mut old) != 0 {
            return;
        }
        if old.sa_sigaction == on_sigterm as extern "C" fn(c_int) as usize {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGTERM, &raw const dfl, std::ptr::null_mut());
        }
    }
}
