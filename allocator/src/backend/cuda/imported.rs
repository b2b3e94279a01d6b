//! Memory another process shared: its handles imported from descriptors and
//! mapped into an address range of exactly their size.
//!
//! PyTorch's receiver reserves 9/8 of the GPU's memory of address space for
//! every imported expandable segment; here a range reserves only what it
//! maps. Dropping the range waits for the device (the receiver's work on it
//! may still be queued), unmaps it, releases the imported handles (the
//! memory lives on in the sender) and frees the addresses.

use std::os::fd::{AsRawFd, OwnedFd};

use cudarc::driver::sys;

use super::{CudaBackend, check, driver};
use crate::backend::{Backend, BackendError, DevicePtr, HandleId};

/// An imported, mapped range. See the module docs.
pub struct ImportedRange {
    backend: CudaBackend,
    ptr: DevicePtr,
    size: u64,
    handles: Vec<(HandleId, u64)>,
}

impl ImportedRange {
    /// Imports `parts` (descriptors of exported handles, each with its size
    /// in bytes), maps them one after another into a fresh range on
    /// `device` and makes it readable and writable there and on `peers`
    /// (the devices granted access to `device`'s memory, as PyTorch's
    /// receiver grants its peers).
    ///
    /// # Errors
    /// A driver error, with nothing left imported or mapped.
    pub fn open(
        device: u32,
        peers: &[u32],
        parts: Vec<(OwnedFd, u64)>,
    ) -> Result<ImportedRange, BackendError> {
        let mut backend = CudaBackend::new(device)?;
        for &p in peers {
            backend.add_peer(p)?; // nothing mapped yet: only remembered
        }
        let _bound = backend.bind()?;
        let mut handles: Vec<(HandleId, u64)> = Vec::with_capacity(parts.len());
        for (fd, size) in &parts {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: context bound; for the POSIX descriptor type the driver
            // reads the descriptor from the pointer's value; `fd` is open
            // for the duration of the call; `h` is a valid out-pointer.
            let r = unsafe {
                driver::cuMemImportFromShareableHandle(
                    &mut h,
                    fd.as_raw_fd() as isize as *mut std::ffi::c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            };
            if let Err(e) = check("cuMemImportFromShareableHandle", r) {
                release_all(&mut backend, &handles);
                return Err(e);
            }
            backend.handles.insert(h);
            handles.push((h, *size));
        }
        drop(parts);
        let size: u64 = handles.iter().map(|h| h.1).sum();
        let ptr = match backend.reserve(size) {
            Ok(p) => p,
            Err(e) => {
                release_all(&mut backend, &handles);
                return Err(e);
            }
        };
        if let Err(e) = backend.map_handles(ptr, &handles, false) {
            let _ = backend.free_reservation(ptr, size);
            release_all(&mut backend, &handles);
            return Err(e);
        }
        Ok(ImportedRange {
            backend,
            ptr,
            size,
            handles,
        })
    }

    /// The first mapped address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Bytes mapped.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The device the range is mapped for.
    pub fn device(&self) -> u32 {
        self.backend.device()
    }

    /// Makes the range readable and writable on device `peer` too
    /// (`enablePeerAccess` after it was opened).
    ///
    /// # Errors
    /// The driver's refusal.
    pub fn add_peer(&mut self, peer: u32) -> Result<(), BackendError> {
        self.backend.add_peer(peer)
    }
}

fn release_all(backend: &mut CudaBackend, handles: &[(HandleId, u64)]) {
    for &(h, size) in handles {
        let _ = backend.release_handle(h, size);
    }
}

impl Drop for ImportedRange {
    fn drop(&mut self) {
        // Errors cannot be reported from here. If the unmap fails the
        // range may still be mapped: its handles and its address
        // reservation are then left as they are (leaked until the process
        // ends) rather than freed under a mapping, which the backend's
        // own drop does not track either.
        let _ = self.backend.synchronize();
        if self.backend.unmap(self.ptr, self.size).is_ok() {
            release_all(&mut self.backend, &self.handles);
            let _ = self.backend.free_reservation(self.ptr, self.size);
        }
    }
}
