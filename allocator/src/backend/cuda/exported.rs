//! Descriptors of exported memory handles, and copies of them for another
//! process.
//!
//! A backend exports a handle once (`cuMemExportToShareableHandle`) and
//! keeps the descriptor open until it releases the handle. Every open
//! descriptor is listed here, so that the process's descriptor server
//! (`capi`'s `fd_passing`) hands out copies of these descriptors and of
//! nothing else: listing, copying and closing happen under one lock, so a
//! number closed and reused for another file is never handed out.

use std::collections::BTreeSet;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::Mutex;

use cudarc::driver::sys;

use super::{check, driver};
use crate::backend::{BackendError, HandleId};

/// Open descriptors of exported handles, in this process.
static OPEN: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// Exports `handle` (a live handle created exportable, its context current)
/// as a new descriptor and lists it.
pub(super) fn export(handle: HandleId) -> Result<i32, BackendError> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `handle` is a live handle of the current context, created with
    // the POSIX descriptor handle type; for that type the driver writes an
    // `int` through the pointer.
    let r = unsafe {
        driver::cuMemExportToShareableHandle(
            (&raw mut fd).cast(),
            handle,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    check("cuMemExportToShareableHandle", r)?;
    // SAFETY: the driver just opened `fd` for us; nothing else owns it.
    Ok(adopt(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Lists `fd` as the descriptor of exported memory, to be handed out on
/// request until [`close`]d. The backend lists its exports; a test may list
/// any file. Not for other callers: a backend keeps using the numbers it
/// listed.
#[doc(hidden)]
pub fn adopt(fd: OwnedFd) -> i32 {
    let raw = fd.into_raw_fd();
    OPEN.lock().unwrap_or_else(|e| e.into_inner()).insert(raw);
    raw
}

/// Closes a descriptor [`export`] or [`adopt`] listed, and unlists it; a
/// number not listed is left alone. Not for other callers (see [`adopt`]).
#[doc(hidden)]
pub fn close(fd: i32) {
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    if open.remove(&fd) {
        // SAFETY: `fd` was listed by `adopt`, which took ownership of it,
        // and is still listed (so not closed yet): taking ownership back
        // closes it.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
}

/// Copies of the listed descriptors `fds`, for sending to another process.
///
/// # Errors
/// The first descriptor that is not an open exported handle (with no
/// I/O error), or that could not be copied (with the system's reason: this
/// process at its descriptor limit, say).
pub fn duplicate(fds: &[i32]) -> Result<Vec<OwnedFd>, (i32, Option<std::io::Error>)> {
    let open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = Vec::with_capacity(fds.len());
    for &fd in fds {
        if !open.contains(&fd) {
            return Err((fd, None));
        }
        // SAFETY: `fd` is listed, so open, and stays open while the lock is
        // held (only `close` closes it, under the same lock).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        out.push(borrowed.try_clone_to_owned().map_err(|e| (fd, Some(e)))?);
    }
    Ok(out)
}

/// Whether `fd` is an open exported descriptor.
pub fn is_exported(fd: i32) -> bool {
    OPEN.lock().unwrap_or_else(|e| e.into_inner()).contains(&fd)
}
