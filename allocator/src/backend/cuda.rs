//! The CUDA driver backend: segments from `cuMemAlloc`, stream ordering from
//! pooled events recorded on PyTorch's raw stream handles.
//!
//! The driver is loaded at run time (cudarc, `dynamic-loading`), so this
//! module builds, links and is tested on machines without CUDA. cudarc
//! *panics* when `libcuda.so` is missing, on the first call of any driver
//! function; every entry point here therefore checks, once per process, that
//! the library can be loaded and that `cuInit` succeeded, and returns
//! [`BackendError::Unavailable`] otherwise. Driver failures are values, never
//! panics; `DriverError`'s `Debug` (which calls the driver) is never used:
//! codes are named through the `CUresult` enum's derived `Debug`.
//!
//! Contexts: a backend retains the device's *primary* context, the one the
//! CUDA runtime (and so PyTorch) uses, and makes it current on the calling
//! thread before each driver call when another context (or none) is current.
//!
//! Streams: a [`StreamId`] is the raw `cudaStream_t`; 0 is the legacy default
//! stream (the driver functions used here are the non-`_ptsz` ones).
//!
//! This is the only module of the crate that may use `unsafe`.

use std::sync::OnceLock;

use cudarc::driver::sys;

use super::{Backend, BackendError, DevicePtr, EventId, MemInfo, StreamId};

/// Events kept for reuse after [`Backend::destroy_event`]; more are destroyed.
const EVENT_POOL_MAX: usize = 1024;

/// Whether `libcuda.so` could be loaded, and `cuInit(0)`'s outcome. Computed once.
fn driver() -> Result<(), BackendError> {
    static STATE: OnceLock<Result<(), BackendError>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries to dlopen the library
            // candidates and drops the handles; it calls no driver function.
            let present = unsafe { sys::is_culib_present() };
            if !present {
                return Err(BackendError::Unavailable(
                    "the CUDA driver library (libcuda.so) could not be loaded".to_string(),
                ));
            }
            // SAFETY: the library is present (checked above), so cudarc's lazy
            // symbol lookup succeeds; cuInit takes no pointers.
            check("cuInit", unsafe { sys::cuInit(0) })
                .map_err(|e| BackendError::Unavailable(format!("cuInit failed: {e}")))
        })
        .clone()
}

/// A driver result as a [`BackendError`]; out-of-memory gets its own variant.
fn check(call: &'static str, r: sys::CUresult) -> Result<(), BackendError> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(BackendError::OutOfMemory { requested: 0 }),
        // The enum's derived Debug prints the variant name without calling the driver.
        other => Err(BackendError::Driver {
            call,
            code: other as u32 as i64,
            name: format!("{other:?}"),
        }),
    }
}

/// Number of CUDA devices visible to this process.
///
/// # Errors
/// [`BackendError::Unavailable`] without a usable driver.
pub fn device_count() -> Result<usize, BackendError> {
    driver()?;
    let mut n: std::ffi::c_int = 0;
    // SAFETY: the driver is loaded and initialized (`driver()`); `n` is a
    // valid out-pointer for the duration of the call.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// One device's driver backend. See the module docs.
pub struct CudaBackend {
    ordinal: u32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    /// Destroyed-by-the-allocator events kept for reuse.
    spare_events: Vec<sys::CUevent>,
}

// SAFETY: a CUcontext and CUevents are process-wide driver handles, valid on
// any thread (the driver serializes access to them). The backend is only
// ever used by one thread at a time (it lives behind its device's lock), and
// it makes its context current on whichever thread calls it.
unsafe impl Send for CudaBackend {}

impl CudaBackend {
    /// A backend for device `device`, retaining its primary context.
    ///
    /// # Errors
    /// [`BackendError::Unavailable`] without a driver or for a device that
    /// does not exist; [`BackendError::Driver`] when retaining fails.
    pub fn new(device: u32) -> Result<CudaBackend, BackendError> {
        let count = device_count()?;
        if device as usize >= count {
            return Err(BackendError::Unavailable(format!(
                "no CUDA device {device} ({count} devices)"
            )));
        }
        let ordinal = std::ffi::c_int::try_from(device)
            .map_err(|_| BackendError::Unavailable(format!("no CUDA device {device}")))?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: driver initialized by device_count(); `dev` is a valid out-pointer.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `dev` came from cuDeviceGet; `ctx` is a valid out-pointer.
        // The retain is balanced by the release in `Drop`.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        Ok(CudaBackend {
            ordinal: device,
            device: dev,
            ctx,
            spare_events: Vec::new(),
        })
    }

    /// The device ordinal.
    pub fn device(&self) -> u32 {
        self.ordinal
    }

    /// Makes the primary context current on this thread if it is not.
    #[inline]
    fn bind(&self) -> Result<(), BackendError> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is initialized (a backend exists only after
        // `new` succeeded); `cur` is a valid out-pointer.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur != self.ctx {
            // SAFETY: `self.ctx` is a primary context retained by `new` and
            // not released before `Drop`.
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })?;
        }
        Ok(())
    }

    fn take_event(&mut self) -> Result<sys::CUevent, BackendError> {
        if let Some(e) = self.spare_events.pop() {
            return Ok(e);
        }
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: context bound by the caller; `ev` is a valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut ev, flags)
        })?;
        Ok(ev)
    }
}

/// An [`EventId`] is the `CUevent` handle's address.
#[inline]
fn event_of(id: EventId) -> sys::CUevent {
    id as usize as sys::CUevent
}

/// PyTorch's `cudaStream_t` is the driver's `CUstream`.
#[inline]
fn stream_of(id: StreamId) -> sys::CUstream {
    id as usize as sys::CUstream
}

/// Restores the thread's previous stream-capture mode when dropped.
struct RelaxedCaptureMode {
    previous: sys::CUstreamCaptureMode,
}

impl RelaxedCaptureMode {
    fn enter() -> Result<RelaxedCaptureMode, BackendError> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out pointer; the call only swaps the
        // calling thread's capture mode.
        check("cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        })?;
        Ok(RelaxedCaptureMode { previous: mode })
    }
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `enter`; restores the mode saved there. A failure
        // cannot be reported from `drop` and leaves the mode relaxed, which
        // only makes later calls on this thread more permissive.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
}

impl Backend for CudaBackend {
    fn alignment(&self) -> u64 {
        256
    }

    fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: context bound; both out-pointers are valid.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn allocate(&mut self, size: u64, capturing: bool) -> Result<DevicePtr, BackendError> {
        self.bind()?;
        let bytes =
            usize::try_from(size).map_err(|_| BackendError::OutOfMemory { requested: size })?;
        let mut ptr: sys::CUdeviceptr = 0;
        let _relaxed = if capturing {
            Some(RelaxedCaptureMode::enter()?)
        } else {
            None
        };
        // SAFETY: context bound; `ptr` is a valid out-pointer.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) };
        match check("cuMemAlloc", r) {
            Ok(()) => Ok(ptr),
            Err(BackendError::OutOfMemory { .. }) => {
                Err(BackendError::OutOfMemory { requested: size })
            }
            Err(e) => Err(e),
        }
    }

    fn release(&mut self, ptr: DevicePtr, _size: u64) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: the Backend contract guarantees `ptr` came from `allocate`
        // (cuMemAlloc in this context) and was not released since.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) })
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        self.bind()?;
        let ev = self.take_event()?;
        // SAFETY: `ev` is a live event of this context; `stream` is a stream
        // handle PyTorch passed (0 = legacy default stream) that is alive
        // while work is queued on it.
        if let Err(e) = check("cuEventRecord", unsafe {
            sys::cuEventRecord(ev, stream_of(stream))
        }) {
            self.spare_events.push(ev);
            return Err(e);
        }
        Ok(ev as usize as EventId)
    }

    fn event_done(&mut self, event: EventId) -> Result<bool, BackendError> {
        self.bind()?;
        // SAFETY: `event` came from `record_event` and was not destroyed (contract).
        match unsafe { sys::cuEventQuery(event_of(event)) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|()| false),
        }
    }

    fn wait_event(&mut self, event: EventId) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: `event` is live (contract).
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(event_of(event))
        })
    }

    fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: `event` is live (contract); `stream` is a live stream
        // handle from PyTorch. Flags must be 0.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream_of(stream), event_of(event), 0)
        })
    }

    fn destroy_event(&mut self, event: EventId) {
        let ev = event_of(event);
        if self.spare_events.len() < EVENT_POOL_MAX {
            // Re-recording a pooled event later is fine: waits already
            // enqueued on it keep referring to the earlier record.
            self.spare_events.push(ev);
        } else {
            // SAFETY: `ev` is live and destroyed once (contract). Pending
            // stream waits on it stay valid after destruction (CUDA semantics).
            let _ = unsafe { sys::cuEventDestroy_v2(ev) };
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        for ev in self.spare_events.drain(..) {
            // SAFETY: every pooled event is live and owned only by the pool.
            let _ = unsafe { sys::cuEventDestroy_v2(ev) };
        }
        // SAFETY: balances the retain in `new`; the device handle is valid.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver every entry point is an error value, never a panic;
    /// with one (a GPU machine) the basic round trips work.
    #[test]
    fn works_or_reports_unavailable() {
        // SAFETY: only probes whether the library can be dlopened.
        let present = unsafe { sys::is_culib_present() };
        match CudaBackend::new(0) {
            Err(BackendError::Unavailable(why)) if !present => {
                assert!(why.contains("libcuda"), "{why}");
                assert!(matches!(device_count(), Err(BackendError::Unavailable(_))));
            }
            Err(e) => {
                assert!(
                    present,
                    "an error other than Unavailable without a driver: {e}"
                );
                // A machine with a driver but no usable GPU.
                assert!(
                    matches!(
                        e,
                        BackendError::Unavailable(_) | BackendError::Driver { .. }
                    ),
                    "{e}"
                );
            }
            Ok(mut b) => {
                assert!(present);
                let info = b.mem_info().unwrap();
                assert!(info.total > 0 && info.free <= info.total);
                let p = b.allocate(2 << 20, false).unwrap();
                assert_ne!(p, 0);
                assert_eq!(p % b.alignment(), 0);
                let e = b.record_event(0).unwrap();
                b.wait_event(e).unwrap();
                assert!(b.event_done(e).unwrap());
                b.stream_wait_event(0, e).unwrap();
                b.destroy_event(e);
                b.release(p, 2 << 20).unwrap();
                assert!(
                    matches!(b.allocate(1 << 50, false), Err(BackendError::OutOfMemory { requested }) if requested == 1 << 50)
                );
            }
        }
        assert!(CudaBackend::new(1 << 20).is_err());
    }

    #[test]
    fn codes_are_named_without_the_driver() {
        let e = check("cuX", sys::CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err();
        assert_eq!(
            e,
            BackendError::Driver {
                call: "cuX",
                code: 1,
                name: "CUDA_ERROR_INVALID_VALUE".to_string()
            }
        );
        assert_eq!(
            check("cuX", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            Err(BackendError::OutOfMemory { requested: 0 })
        );
        assert_eq!(check("cuX", sys::CUresult::CUDA_SUCCESS), Ok(()));
    }
}
