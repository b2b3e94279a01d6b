//! Out-of-memory details, so a caller (the torch bridge) can raise
//! `torch.cuda.OutOfMemoryError` with gpualloc's diagnosis.

use std::ffi::c_int;

use gpualloc::AllocError;

use crate::boundary::{
    Error, GPUALLOC_ERR_NOT_FOUND, GPUALLOC_ERR_OUT_OF_MEMORY, clear_last_error, ffi_boundary,
    last_error_code, last_oom,
};

/// Version of [`GpuallocOomInfo`] this library writes.
pub const GPUALLOC_OOM_INFO_VERSION: u32 = 1;

/// `GpuallocOomInfo.kind`: the device (or the memory limit) is full now;
/// freeing tensors and retrying may succeed.
pub const GPUALLOC_OOM_NOW: i32 = 1;
/// `GpuallocOomInfo.kind`: the request can never fit on this device (or
/// under the memory limit); only `device`, `requested`, `needed`, `limit`
/// and `device_total` (the most any allocation can get) are filled.
pub const GPUALLOC_OOM_NEVER: i32 = 2;

/// Everything the allocator knew when an allocation failed. Versioned like
/// [`GpuallocStats`](crate::stats::GpuallocStats): set `size` before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuallocOomInfo {
    /// In: `sizeof(GpuallocOomInfo)` as the caller knows it. Out: bytes written.
    pub size: u32,
    /// Out: [`GPUALLOC_OOM_INFO_VERSION`].
    pub version: u32,
    /// [`GPUALLOC_OOM_NOW`] or [`GPUALLOC_OOM_NEVER`].
    pub kind: i32,
    /// Device index.
    pub device: i32,
    /// Bytes asked for.
    pub requested: u64,
    /// The segment size that was needed from the device.
    pub needed: u64,
    /// Bytes in live allocations.
    pub allocated: u64,
    /// Bytes held from the device.
    pub reserved: u64,
    /// Bytes of live allocations in private (CUDA graph) pools.
    pub private_pools_allocated: u64,
    /// Free bytes on the device, as the driver reported them.
    pub device_free: u64,
    /// Device capacity (for `GPUALLOC_OOM_NEVER`: the most any allocation can get).
    pub device_total: u64,
    /// The memory limit in force, 0 when none.
    pub limit: u64,
    /// The largest cached free block.
    pub largest_free_block: u64,
    /// `1 - largest free block / cached free bytes`.
    pub external_fragmentation: f64,
    /// `1 - allocated / reserved`.
    pub unallocated_fraction: f64,
}

impl GpuallocOomInfo {
    pub(crate) fn from_error(e: &AllocError) -> Option<GpuallocOomInfo> {
        let full = std::mem::size_of::<GpuallocOomInfo>() as u32;
        match e {
            AllocError::OutOfMemory(r) => Some(GpuallocOomInfo {
                size: full,
                version: GPUALLOC_OOM_INFO_VERSION,
                kind: GPUALLOC_OOM_NOW,
                device: r.device as i32,
                requested: r.requested,
                needed: r.needed,
                allocated: r.allocated,
                reserved: r.reserved,
                private_pools_allocated: r.private_pools_allocated,
                device_free: r.device_free,
                device_total: r.device_total,
                limit: r.limit.unwrap_or(0),
                largest_free_block: r.largest_free_block,
                external_fragmentation: r.external_fragmentation,
                unallocated_fraction: r.unallocated_fraction,
            }),
            AllocError::TooLarge {
                requested,
                needed,
                max,
                device,
                limit,
                ..
            } => Some(GpuallocOomInfo {
                size: full,
                version: GPUALLOC_OOM_INFO_VERSION,
                kind: GPUALLOC_OOM_NEVER,
                device: *device as i32,
                requested: *requested,
                needed: *needed,
                device_total: *max,
                limit: limit.unwrap_or(0),
                ..GpuallocOomInfo::default()
            }),
            _ => None,
        }
    }
}

/// Copies a versioned `#[repr(C)]` struct that starts with `u32 size, u32
/// version` into the caller's, writing no more than the caller's `size` says.
pub(crate) fn write_versioned<T: Copy>(out: *mut T, value: &T) -> Result<(), Error> {
    if out.is_null() {
        return Err(Error::invalid("gpualloc: output struct is NULL"));
    }
    // SAFETY: `out` is non-NULL and, by the header's contract, points to a
    // struct whose first field is its `uint32_t size`.
    let caller_size = unsafe { out.cast::<u32>().read_unaligned() } as usize;
    let ours = std::mem::size_of::<T>();
    if caller_size < 8 {
        return Err(Error::invalid(format!(
            "gpualloc: set the struct's `size` field to its sizeof before the call (got {caller_size})"
        )));
    }
    let n = caller_size.min(ours);
    // SAFETY: `value` is a valid T (ours bytes readable); the caller's struct
    // has at least `caller_size >= n` writable bytes; the regions are
    // distinct objects, so they do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping((value as *const T).cast::<u8>(), out.cast::<u8>(), n);
        out.cast::<u32>().write_unaligned(n as u32);
    }
    Ok(())
}

/// The calling thread's last out-of-memory report: filled by a
/// `gpualloc_malloc` that returned NULL for lack of memory, kept until the
/// next one. Returns `GPUALLOC_ERR_NOT_FOUND` when this thread never had one.
/// `gpualloc_last_error()` holds the same diagnosis as a sentence; this
/// call keeps it there, and clears any other last error (one of its own
/// failures, say), as every fallible call does.
///
/// # Safety
/// `out` is NULL or points to a `GpuallocOomInfo` whose `size` is set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_last_oom(out: *mut GpuallocOomInfo) -> c_int {
    // Not `status()`: that would clear the last error this report goes with.
    if last_error_code() != GPUALLOC_ERR_OUT_OF_MEMORY {
        clear_last_error();
    }
    ffi_boundary(
        |code| code,
        || {
            let info = last_oom().ok_or_else(|| {
                Error::new(
                    GPUALLOC_ERR_NOT_FOUND,
                    "gpualloc: no out-of-memory error on this thread",
                )
            })?;
            write_versioned(out, &info)?;
            Ok(0)
        },
    )
}

/// Forgets the calling thread's last error message.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_clear_error() {
    clear_last_error();
}
