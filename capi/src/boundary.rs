//! The FFI boundary: status codes, the thread-local last error, and the one
//! helper every export goes through.
//!
//! Rules, stated once:
//! - Nothing unwinds across the boundary: [`ffi_boundary`] runs the body under
//!   `catch_unwind` and turns a panic into [`GPUALLOC_ERR_PANIC`].
//! - A failure stores a message in the calling thread's last error
//!   (`gpualloc_last_error`). Every call that can fail clears it at entry, so
//!   after any call a non-NULL last error means that call failed (after
//!   `gpualloc_malloc`, one that returned NULL for a non-zero size).
//! - Nothing is formatted or allocated on success.
//! - The last error lives in thread-local storage, which may already be gone
//!   when a call comes from a thread-exit destructor (a pthread key, a C++
//!   `thread_local`) or an `atexit` handler. Every access goes through
//!   `try_with`: there the error is not kept (the status code still says what
//!   happened), and nothing aborts.

use std::cell::{Cell, RefCell};
use std::ffi::{CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};

use gpualloc::{AllocError, BackendError, ConfigError};

use crate::oom::GpuallocOomInfo;

/// Success.
pub const GPUALLOC_OK: c_int = 0;
/// Out of memory: now (`GpuallocOomInfo.kind == 1`) or ever (`kind == 2`).
pub const GPUALLOC_ERR_OUT_OF_MEMORY: c_int = -1;
/// A bad argument (NULL pointer, bad fraction, invalid UTF-8, ...).
pub const GPUALLOC_ERR_INVALID_ARGUMENT: c_int = -2;
/// A pointer not allocated by gpualloc on that device, or freed already.
pub const GPUALLOC_ERR_INVALID_POINTER: c_int = -3;
/// No such device.
pub const GPUALLOC_ERR_INVALID_DEVICE: c_int = -4;
/// A private pool id never begun, or released already.
pub const GPUALLOC_ERR_UNKNOWN_POOL: c_int = -5;
/// A CUDA driver call failed.
pub const GPUALLOC_ERR_BACKEND: c_int = -6;
/// No usable CUDA driver or device.
pub const GPUALLOC_ERR_UNAVAILABLE: c_int = -7;
/// A bad configuration string (`GPUALLOC_CONF` or `gpualloc_init`).
pub const GPUALLOC_ERR_CONFIG: c_int = -8;
/// `gpualloc_init` after the allocator started with another configuration.
pub const GPUALLOC_ERR_ALREADY_INITIALIZED: c_int = -9;
/// The caller's buffer is too small; the size needed was written back.
pub const GPUALLOC_ERR_BUFFER_TOO_SMALL: c_int = -10;
/// An I/O error (trace files).
pub const GPUALLOC_ERR_IO: c_int = -11;
/// A bug inside gpualloc was caught at the boundary.
pub const GPUALLOC_ERR_PANIC: c_int = -12;
/// Nothing to report (`gpualloc_last_oom` without an earlier OOM).
pub const GPUALLOC_ERR_NOT_FOUND: c_int = -13;
/// An internal consistency check failed (`gpualloc_check_invariants`).
pub const GPUALLOC_ERR_INVARIANT: c_int = -14;

/// A failure on its way to the caller: a status code and a message.
#[derive(Debug)]
pub(crate) struct Error {
    pub code: c_int,
    pub message: String,
    pub oom: Option<Box<GpuallocOomInfo>>,
}

impl Error {
    pub fn new(code: c_int, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
            oom: None,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(GPUALLOC_ERR_INVALID_ARGUMENT, message)
    }
}

impl From<AllocError> for Error {
    fn from(e: AllocError) -> Error {
        let code = match &e {
            AllocError::OutOfMemory(_) | AllocError::TooLarge { .. } => GPUALLOC_ERR_OUT_OF_MEMORY,
            AllocError::InvalidPointer { .. } => GPUALLOC_ERR_INVALID_POINTER,
            AllocError::InvalidDevice { .. } => GPUALLOC_ERR_INVALID_DEVICE,
            AllocError::UnknownPool { .. } => GPUALLOC_ERR_UNKNOWN_POOL,
            AllocError::BadCheckpoint { .. }
            | AllocError::PoolBusy { .. }
            | AllocError::CalledBack { .. } => GPUALLOC_ERR_INVALID_ARGUMENT,
            AllocError::Backend(b) => return b.clone().into(),
            AllocError::Poisoned { .. } => GPUALLOC_ERR_PANIC,
            AllocError::HeldAtFork { .. } => GPUALLOC_ERR_UNAVAILABLE,
            _ => GPUALLOC_ERR_BACKEND,
        };
        let oom = GpuallocOomInfo::from_error(&e).map(Box::new);
        Error {
            code,
            message: e.to_string(),
            oom,
        }
    }
}

impl From<BackendError> for Error {
    fn from(e: BackendError) -> Error {
        let code = match &e {
            BackendError::OutOfMemory { .. } => GPUALLOC_ERR_OUT_OF_MEMORY,
            BackendError::Unavailable(_) => GPUALLOC_ERR_UNAVAILABLE,
            _ => GPUALLOC_ERR_BACKEND,
        };
        Error::new(code, format!("gpualloc: {e}"))
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Error {
        Error::new(GPUALLOC_ERR_CONFIG, e.to_string())
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::new(GPUALLOC_ERR_IO, format!("gpualloc: {e}"))
    }
}

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
    static LAST_OOM: Cell<Option<GpuallocOomInfo>> = const { Cell::new(None) };
    static LAST_CODE: Cell<c_int> = const { Cell::new(0) };
}

fn set_last_error(e: Error) {
    let msg = CString::new(e.message.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            *l = Some(msg);
        }
    });
    let _ = LAST_CODE.try_with(|c| c.set(e.code));
    if let Some(oom) = e.oom {
        let _ = LAST_OOM.try_with(|o| o.set(Some(*oom)));
    }
}

/// Forgets the calling thread's last error (every fallible call does it
/// first). Cheap when there is none: one thread-local read.
#[inline]
pub(crate) fn clear_last_error() {
    if last_error_code() == 0 {
        return;
    }
    let _ = LAST_CODE.try_with(|c| c.set(0));
    let _ = LAST_ERROR.try_with(|l| {
        if let Ok(mut l) = l.try_borrow_mut() {
            *l = None;
        }
    });
}

/// The calling thread's last error message, or NULL.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|l| {
            l.try_borrow()
                .ok()
                .and_then(|l| l.as_ref().map(|s| s.as_ptr()))
        })
        .ok()
        .flatten()
        .unwrap_or(std::ptr::null())
}

/// The calling thread's last error code, 0 when none.
pub(crate) fn last_error_code() -> c_int {
    LAST_CODE.try_with(|c| c.get()).unwrap_or(0)
}

/// The calling thread's last out-of-memory report.
pub(crate) fn last_oom() -> Option<GpuallocOomInfo> {
    LAST_OOM.try_with(|o| o.get()).ok().flatten()
}

/// Writes one line to stderr, passing over a stderr that cannot be
/// written: a panic outside [`ffi_boundary`]'s guard (an error handler, an
/// exit handler) would abort the process.
pub(crate) use gpualloc::log::say;

/// Runs `f` so that no panic escapes: an `Err` or a panic stores the last
/// error and yields `on_error(code)`.
#[inline]
pub(crate) fn ffi_boundary<T>(
    on_error: impl FnOnce(c_int) -> T,
    f: impl FnOnce() -> Result<T, Error>,
) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            let code = e.code;
            set_last_error(e);
            on_error(code)
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            set_last_error(Error::new(
                GPUALLOC_ERR_PANIC,
                format!("gpualloc: internal error (panic): {what}"),
            ));
            on_error(GPUALLOC_ERR_PANIC)
        }
    }
}

/// A control call returning a status: clears the last error, runs `f`
/// through [`ffi_boundary`], and gives `GPUALLOC_OK` or the error code.
#[inline]
pub(crate) fn status(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    clear_last_error();
    ffi_boundary(|code| code, || f().map(|()| GPUALLOC_OK))
}

/// A control call on one string argument that answers yes or no: 1 or 0,
/// or the error code, with the last error set as [`status`] sets it.
pub(crate) fn str_flag_call(
    p: *const c_char,
    what: &str,
    f: impl FnOnce(&str) -> Result<bool, Error>,
) -> c_int {
    clear_last_error();
    ffi_boundary(|code| code, || f(str_arg(p, what)?).map(c_int::from))
}

/// A void control call (a PyTorch hook): like [`status`], the outcome is in
/// the last error only.
#[inline]
pub(crate) fn void_call(f: impl FnOnce() -> Result<(), Error>) {
    clear_last_error();
    ffi_boundary(|_| (), f);
}

/// Writes `v` through an out-pointer, refusing NULL.
pub(crate) fn write_out<T>(out: *mut T, v: T, what: &str) -> Result<(), Error> {
    if out.is_null() {
        return Err(Error::invalid(format!("gpualloc: {what} is NULL")));
    }
    // SAFETY: non-NULL checked above; the caller promises (header docs) that
    // a non-NULL out-pointer points to writable storage of its type.
    unsafe { out.write(v) };
    Ok(())
}

/// A NUL-terminated UTF-8 string argument.
pub(crate) fn str_arg<'a>(p: *const c_char, what: &str) -> Result<&'a str, Error> {
    if p.is_null() {
        return Err(Error::invalid(format!("gpualloc: {what} is NULL")));
    }
    // SAFETY: non-NULL checked above; the caller promises a NUL-terminated
    // string that stays valid for the duration of the call.
    let c = unsafe { std::ffi::CStr::from_ptr(p) };
    c.to_str()
        .map_err(|_| Error::invalid(format!("gpualloc: {what} is not valid UTF-8")))
}

/// A path argument: bytes, UTF-8 or not (as in `GPUALLOC_TRACE`); NULL is
/// an error naming `what`. Placeholders are left as given.
pub(crate) fn path_arg(p: *const c_char, what: &str) -> Result<std::path::PathBuf, Error> {
    if p.is_null() {
        return Err(Error::invalid(format!("gpualloc: {what} is NULL")));
    }
    // SAFETY: non-NULL checked above; the caller promises a NUL-terminated
    // string that stays valid for the duration of the call.
    let bytes = unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes();
    Ok(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes).into())
}

/// Checks a caller's array argument: `n` (where the count goes) is not
/// NULL, `out` is NULL only when `cap` is 0; sets `*n` to 0 until the count
/// is known.
pub(crate) fn array_arg<T>(
    out: *mut T,
    cap: usize,
    n: *mut usize,
    what: &str,
) -> Result<(), Error> {
    write_out(n, 0, what)?;
    if out.is_null() && cap > 0 {
        return Err(Error::invalid(format!(
            "gpualloc: the array for {what} is NULL with room for {cap}"
        )));
    }
    Ok(())
}

/// Writes the count `len` to `*n` (checked by [`array_arg`]);
/// `GPUALLOC_ERR_BUFFER_TOO_SMALL` when `cap` is below it (`what()` names
/// the array in the message).
pub(crate) fn fits(
    len: usize,
    cap: usize,
    n: *mut usize,
    what: impl FnOnce() -> String,
) -> Result<(), Error> {
    // SAFETY: `array_arg` checked `n` is not NULL; the caller promises a
    // writable size_t.
    unsafe { n.write(len) };
    if cap < len {
        return Err(Error::new(
            GPUALLOC_ERR_BUFFER_TOO_SMALL,
            format!("gpualloc: {} needs {len} entries, {cap} given", what()),
        ));
    }
    Ok(())
}

/// Copies `items` to the caller's array, whose room [`array_arg`] and
/// [`fits`] checked.
pub(crate) fn copy_out<T: Copy>(items: &[T], out: *mut T) {
    if !items.is_empty() {
        // SAFETY: `out` is not NULL (cap >= len > 0, `array_arg`) and has
        // room for `cap >= items.len()` entries (`fits`); a caller's array
        // never overlaps our Vec.
        unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_status_codes() {
        let code = status(|| panic!("boom"));
        assert_eq!(code, GPUALLOC_ERR_PANIC);
        // SAFETY: the pointer is the thread's own live CString.
        let msg = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) }
            .to_str()
            .unwrap();
        assert!(msg.contains("boom"), "{msg}");
        assert_eq!(status(|| Ok(())), GPUALLOC_OK);
        assert!(last_error_ptr().is_null());
    }
}
