//! The driver calls a device has made, by kind, with the time measured in
//! them: the GPU's side of what `gpualloc replay --json` predicts
//! (`driver_calls_by_kind`), so the two can be set side by side.

use std::ffi::{CString, c_char, c_int};
use std::sync::OnceLock;

use gpualloc::{DriverCall, DriverCalls};

use crate::boundary::{Error, GPUALLOC_ERR_BUFFER_TOO_SMALL, status};
use crate::global::{self, existing};

/// One kind of driver call and what calls of that kind covered.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GpuallocDriverCall {
    /// The driver function (`"cuMemSetAccess"`), a static string.
    pub name: *const c_char,
    /// Calls made.
    pub calls: u64,
    /// Physical handles they covered (0 for calls on no handle).
    pub handles: u64,
    /// Bytes they covered.
    pub bytes: u64,
    /// Nanoseconds spent in them, where the backend measures it (0 where not).
    pub nanos: u64,
}

fn names() -> &'static [CString] {
    static NAMES: OnceLock<Vec<CString>> = OnceLock::new();
    NAMES.get_or_init(|| {
        DriverCall::ALL
            .iter()
            .map(|c| CString::new(c.name()).expect("driver call names have no NUL"))
            .collect()
    })
}

/// Fills `rows[0 .. n]` with `device`'s driver calls since it started or
/// its accumulated stats were last reset, one row per kind of call (every
/// kind, in a fixed order, zeros included), and writes `n` to `*needed`.
/// `GPUALLOC_ERR_BUFFER_TOO_SMALL` when `cap < n` (`rows == NULL, cap == 0`
/// asks for `n`). A device not used yet reports zeros and is not started.
/// Calls a helper thread made (`gpualloc_helper_driver_calls`) count here
/// with the time the allocating thread spent on them, not theirs.
///
/// # Safety
/// `rows` is NULL or points to `cap` writable `GpuallocDriverCall`;
/// `needed` is NULL or points to a writable size_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_driver_calls(
    device: c_int,
    rows: *mut GpuallocDriverCall,
    cap: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: the caller's promises, passed on.
    unsafe { fill(device, rows, cap, needed, |d| d.driver_calls()) }
}

/// `gpualloc_driver_calls` for the calls a helper thread made for `device`,
/// with the time they took there: the unmapping the allocator hands off
/// (`unmap_thread`, Note [Unmapping off the allocating thread]); on the
/// simulated device, the calls it would leave to that thread, with no
/// time. Zeros where none was made.
///
/// # Safety
/// As for `gpualloc_driver_calls`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_helper_driver_calls(
    device: c_int,
    rows: *mut GpuallocDriverCall,
    cap: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: the caller's promises, passed on.
    unsafe { fill(device, rows, cap, needed, |d| d.helper_driver_calls()) }
}

/// Writes the rows of the calls `read` gives for `device`.
///
/// # Safety
/// As for `gpualloc_driver_calls`.
unsafe fn fill(
    device: c_int,
    rows: *mut GpuallocDriverCall,
    cap: usize,
    needed: *mut usize,
    read: impl Fn(&gpualloc::DeviceAllocator<crate::global::AnyBackend>) -> DriverCalls,
) -> c_int {
    status(|| {
        let calls = match existing() {
            Some(g) => g
                .alloc
                .peek(i64::from(device))?
                .map_or_else(DriverCalls::default, |d| read(&d)),
            None => global::idle(i64::from(device)).map(|_| DriverCalls::default())?,
        };
        let n = DriverCall::ALL.len();
        if !needed.is_null() {
            // SAFETY: non-NULL; the caller promises a writable size_t.
            unsafe { needed.write(n) };
        }
        if rows.is_null() || cap < n {
            return Err(Error::new(
                GPUALLOC_ERR_BUFFER_TOO_SMALL,
                format!("gpualloc: {n} driver call rows needed, {cap} given"),
            ));
        }
        // SAFETY: non-NULL, and the caller promises `cap >= n` writable rows.
        let out = unsafe { std::slice::from_raw_parts_mut(rows, n) };
        for ((slot, &call), name) in out.iter_mut().zip(&DriverCall::ALL).zip(names()) {
            *slot = GpuallocDriverCall {
                name: name.as_ptr(),
                calls: calls.calls(call),
                handles: calls.handles(call),
                bytes: calls.bytes(call),
                nanos: calls.nanos(call),
            };
        }
        Ok(())
    })
}
