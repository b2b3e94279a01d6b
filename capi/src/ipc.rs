//! Sharing allocations with other processes (PyTorch's `shareIpcHandle` and
//! `getIpcDevPtr`), for expandable memory; see Note [Sharing expandable
//! memory] (`allocator/src/ipc.rs`) and Note [Descriptor passing]
//! (`fd_passing.rs`). A plain segment is shared through CUDA IPC by the
//! caller, which the runtime API does best.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};

use gpualloc::Sharing;
use gpualloc::backend::cuda::imported::ImportedRange;
use parking_lot::Mutex;

use crate::boundary::{
    Error, GPUALLOC_ERR_INVALID_POINTER, GPUALLOC_ERR_UNAVAILABLE, GPUALLOC_OK, array_arg,
    copy_out, fits, status, write_out,
};
use crate::global::{BackendKind, global};
use crate::{fd_passing, ipc_format};

/// Ranges opened by `gpualloc_ipc_open`, by address, until closed.
static OPENED: Mutex<Option<HashMap<u64, ImportedRange>>> = Mutex::new(None);

/// Peer access granted so far, `(device, peer)` (`gpualloc_add_peer_access`):
/// a range opened on `device` is made accessible to `peer` too, as the
/// allocator's own mappings of `device` are.
static PEERS: Mutex<Vec<(u32, u32)>> = Mutex::new(Vec::new());

/// After `peer` was granted access to `device`'s memory: ranges opened on
/// `device` so far become accessible to it, and those opened later too.
pub(crate) fn add_peer(device: u32, peer: u32) -> Result<(), Error> {
    {
        let mut peers = PEERS.lock();
        if peers.contains(&(device, peer)) {
            return Ok(());
        }
        peers.push((device, peer));
    }
    let mut opened = OPENED.lock();
    // Every range is tried; the first refusal is reported.
    let result = opened
        .iter_mut()
        .flat_map(|m| m.values_mut())
        .filter(|r| r.device() == device)
        .map(|r| r.add_peer(peer))
        .fold(Ok(()), Result::and);
    Ok(result?)
}

/// Describes how to share the allocation that starts at `ptr` on `device`
/// with another process.
///
/// Expandable memory: writes the share's bytes to `buf` (PyTorch's format
/// `'e'` when the handles under the allocation are all of one size, so a
/// receiver under PyTorch's allocator opens it too; gpualloc's `'g'`
/// otherwise), their count to `*len`, and the allocation's offset from the
/// start of the shared range to `*offset`. `GPUALLOC_ERR_BUFFER_TOO_SMALL`
/// (with `*len` set) when `cap` is less. The first share starts this
/// process's descriptor server (Note [Descriptor passing]).
///
/// A plain segment: writes 0 to `*len` and the allocation's offset in its
/// segment to `*offset`; share the segment, from `ptr - *offset`, with
/// `cudaIpcGetMemHandle`.
///
/// `GPUALLOC_ERR_INVALID_POINTER` for a pointer that is not the start of a
/// live allocation on `device`.
///
/// # Safety
/// `buf` is NULL (only with `cap == 0`) or points to `cap` writable bytes;
/// `len` and `offset` point to a writable size_t and uint64_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_ipc_share(
    device: c_int,
    ptr: *mut c_void,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
    offset: *mut u64,
) -> c_int {
    status(|| {
        write_out(len, 0, "len")?;
        array_arg(buf, cap, len, "the share")?;
        write_out(offset, 0, "offset")?;
        let g = global()?;
        let sharing = g.alloc.lock(i64::from(device))?.share(ptr as u64)?;
        match sharing {
            Sharing::Segment { offset: off, .. } => write_out(offset, off, "offset"),
            Sharing::Handles { offset: off, parts } => {
                let bytes = ipc_format::encode(std::process::id() as i32, &parts);
                fits(bytes.len(), cap, len, || "the share".into())?;
                if g.kind == BackendKind::Cuda {
                    fd_passing::serve();
                }
                copy_out(&bytes, buf.cast::<u8>());
                write_out(offset, off, "offset")
            }
        }
    })
}

/// Opens a share of expandable memory made by `gpualloc_ipc_share` in
/// another process (or by PyTorch's expandable segments) on `device`:
/// fetches the handles' descriptors from the sender, imports and maps them
/// into a fresh range of exactly their size, and writes its first address
/// to `*out` (add the sender's offset). `gpualloc_ipc_close` unmaps it.
///
/// `GPUALLOC_ERR_INVALID_ARGUMENT` for bytes that are not such a share;
/// `GPUALLOC_ERR_UNAVAILABLE` when the descriptors cannot be had (the
/// message says why) or without the CUDA backend; `GPUALLOC_ERR_BACKEND`
/// when the driver refuses the import.
///
/// # Safety
/// `handle` points to `len` readable bytes; `out` to a writable pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_ipc_open(
    handle: *const c_char,
    len: usize,
    device: c_int,
    out: *mut *mut c_void,
) -> c_int {
    status(|| {
        write_out(out, std::ptr::null_mut(), "out")?;
        if handle.is_null() {
            return Err(Error::invalid("gpualloc: the share is NULL"));
        }
        // SAFETY: non-NULL; the caller promises `len` readable bytes.
        let bytes = unsafe { std::slice::from_raw_parts(handle.cast::<u8>(), len) };
        let shared = ipc_format::decode(bytes)
            .map_err(|e| Error::invalid(format!("gpualloc: cannot open the share: {e}")))?;
        if global()?.kind != BackendKind::Cuda {
            return Err(Error::new(
                GPUALLOC_ERR_UNAVAILABLE,
                "gpualloc: opening shared memory needs the CUDA backend",
            ));
        }
        let device = u32::try_from(device)
            .map_err(|_| Error::invalid(format!("gpualloc: no device {device}")))?;
        let numbers: Vec<i32> = shared.parts.iter().map(|p| p.0).collect();
        let fds = fd_passing::fetch(shared.pid, &numbers).map_err(|e| {
            Error::new(
                GPUALLOC_ERR_UNAVAILABLE,
                format!(
                    "gpualloc: cannot open memory shared by process {}: {e}",
                    shared.pid
                ),
            )
        })?;
        let parts = fds
            .into_iter()
            .zip(shared.parts.iter().map(|p| p.1))
            .collect();
        let peers_of = || -> Vec<u32> {
            let peers = PEERS.lock();
            peers
                .iter()
                .filter(|p| p.0 == device)
                .map(|p| p.1)
                .collect()
        };
        let granted = peers_of();
        let mut range = ImportedRange::open(device, &granted, parts)?;
        let ptr = range.ptr();
        let mut opened = OPENED.lock();
        // A peer granted while the range was being opened: `add_peer` did
        // not see the range, so it is given access here, under the lock
        // that `add_peer` walks the ranges under.
        let late: Vec<u32> = peers_of()
            .into_iter()
            .filter(|p| !granted.contains(p))
            .collect();
        if let Err(e) = late.iter().try_for_each(|&p| range.add_peer(p)) {
            drop(opened);
            drop(range); // unmapped again: nothing opened
            return Err(e.into());
        }
        opened.get_or_insert_with(HashMap::new).insert(ptr, range);
        drop(opened);
        write_out(out, ptr as *mut c_void, "out")
    })
}

/// Unmaps a range `gpualloc_ipc_open` opened, after the device's queued
/// work (the memory lives on in the sender).
/// `GPUALLOC_ERR_INVALID_POINTER` for any other pointer.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_ipc_close(ptr: *mut c_void) -> c_int {
    // A forked child (a DataLoader worker dropping a tensor it inherited)
    // must not take a lock a parent thread may have held at the fork, nor
    // unmap in a CUDA context it cannot use (Note [Freeing in a forked
    // child]); the parent closes what it opened.
    if crate::fork::in_forked_child() {
        return GPUALLOC_OK;
    }
    status(|| {
        let range = OPENED.lock().as_mut().and_then(|m| m.remove(&(ptr as u64)));
        match range {
            Some(r) => {
                drop(r);
                Ok(())
            }
            None => Err(Error::new(
                GPUALLOC_ERR_INVALID_POINTER,
                format!("gpualloc: {ptr:p} is not memory opened by gpualloc_ipc_open"),
            )),
        }
    })
}
