//! The CUDA driver backend: segments from `cuMemAlloc`, stream ordering from
//! pooled events recorded on PyTorch's raw stream handles.
//!
//! The driver is loaded at run time (cudarc, `dynamic-loading`), so this
//! module builds, links and is tested on machines without CUDA. cudarc
//! *panics* when `libcuda.so` is missing, on the first call of any driver
//! function; every entry point here therefore checks, once per process, that
//! the library can be loaded and that `cuInit` succeeded, and returns
//! [`BackendError::Unavailable`] otherwise. Driver failures are values, never
//! panics; `DriverError`'s `Debug` (which calls the driver) is never used.
//! Driver results are integers, never the `CUresult` enum (`driver.rs` says
//! why): a code a newer driver adds is an error like any other.
//!
//! Contexts: a backend retains the device's *primary* context, the one the
//! CUDA runtime (and so PyTorch) uses, and makes it current on the calling
//! thread before each driver call when another context (or none) is current.
//!
//! Streams: a [`StreamId`] is the raw `cudaStream_t`; 0 is the legacy default
//! stream (the driver functions used here are the non-`_ptsz` ones). A
//! default stream of another device is a key that says which device's
//! (Note [Streams of other devices] in `stream.rs`): its calls are made in
//! that device's context.
//!
//! Virtual memory: physical handles (`cuMemCreate`) are created and
//! released only when the allocator's page pool asks; a mapping is one
//! `cuMemMap` per handle and one `cuMemSetAccess` per range, an unmapping
//! one `cuMemUnmap` per run of handles, with no synchronization (the
//! allocator orders unmapping after the work, Note [Event-ordered
//! unmapping]). Every memory and event call is counted and timed
//! ([`DriverCalls`]), so the cost model can be checked against the GPU.
//!
//! Sharing with other processes: handles are created exportable as POSIX
//! file descriptors where the device allows; `exported.rs` lists the
//! descriptors handed out, `imported.rs` maps another process's. Handles
//! are created capable of GPUDirect RDMA where the device allows, as
//! PyTorch's expandable segments are (network cards and storage that
//! libraries register tensors with read and write them directly).
//!
//! Beside this file: `driver.rs` (the driver's symbols), `context.rs`
//! (contexts bound for each call), `unmapping.rs` (the unmapping helper's
//! side here), `exported.rs` and `imported.rs`. This module and those are
//! the only ones of the crate that may use `unsafe`.

use std::collections::BTreeMap;
use std::mem::MaybeUninit;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use cudarc::driver::sys;
use driver::CuResult;
use rustc_hash::{FxHashMap, FxHashSet};

use super::unmapper::{Job, Unmapper};
use super::{
    Backend, BackendError, CaptureNodes, DevicePtr, EventId, GraphNode, HandleId, MemInfo,
    StreamId, other_device_stream,
};
use crate::cost::{DriverCall, DriverCalls};

mod context;
mod driver;
pub mod exported;
mod graph;
pub mod imported;
mod unmapping;

use context::{Bound, RelaxedCaptureMode, bind_context, cu_device};

/// Events kept for reuse after [`Backend::destroy_event`]; more are destroyed.
const EVENT_POOL_MAX: usize = 1024;

/// Whether `libcuda.so` could be loaded, and `cuInit(0)`'s outcome. Computed once.
fn driver() -> Result<(), BackendError> {
    static STATE: OnceLock<Result<(), BackendError>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            let present = driver::present();
            if !present {
                return Err(BackendError::Unavailable(
                    "the CUDA driver library (libcuda.so) could not be loaded".to_string(),
                ));
            }
            // SAFETY: the library is present (checked above), so cudarc's lazy
            // symbol lookup succeeds; cuInit takes no pointers.
            check("cuInit", unsafe { driver::cuInit(0) })
                .map_err(|e| BackendError::Unavailable(e.to_string()))?;
            driver::watch_forks();
            Ok(())
        })
        .clone()
}

/// A driver result as a [`BackendError`]; out-of-memory gets its own variant.
fn check(call: &'static str, r: CuResult) -> Result<(), BackendError> {
    match r {
        driver::SUCCESS => Ok(()),
        driver::OUT_OF_MEMORY => Err(BackendError::OutOfMemory { requested: 0 }),
        driver::FORKED_CHILD => Err(BackendError::Unavailable(format!(
            "{call}: CUDA does not survive fork, and this is a child forked after CUDA \
             started in its parent: make no CUDA call here, or start workers with the \
             'spawn' start method"
        ))),
        other => Err(BackendError::Driver {
            call,
            code: i64::from(other),
            name: driver::name(other),
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
    check("cuDeviceGetCount", unsafe {
        driver::cuDeviceGetCount(&mut n)
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Whether `device` says yes to the boolean `attribute`; no when the driver
/// cannot answer.
fn device_flag(device: sys::CUdevice, attribute: sys::CUdevice_attribute) -> bool {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: the driver is initialized (a device handle exists); `v` is a
    // valid out-pointer.
    let r = unsafe { driver::cuDeviceGetAttribute(&mut v, attribute, device) };
    r == driver::SUCCESS && v != 0
}

/// One device's driver backend. See the module docs.
pub struct CudaBackend {
    ordinal: u32,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    /// Destroyed-by-the-allocator events kept for reuse.
    spare_events: Vec<sys::CUevent>,
    /// Devices granted access to every mapping (`add_peer`), besides this one.
    peers: Vec<sys::CUdevice>,
    /// Events recorded on streams of other contexts, with their context
    /// (`record_foreign`).
    foreign_events: FxHashMap<usize, sys::CUcontext>,
    /// Primary contexts of other devices whose default streams blocks were
    /// recorded on (Note [Streams of other devices]), retained until drop.
    other_contexts: FxHashMap<u32, sys::CUcontext>,
    /// Virtual memory: the mapping granularity, once queried (0 = unsupported).
    granularity: Option<u64>,
    /// Virtual memory: live physical handles (released on drop).
    handles: FxHashSet<HandleId>,
    /// Virtual memory: mappings in place, address -> bytes (unmapped on drop).
    mappings: BTreeMap<DevicePtr, u64>,
    /// Driver calls made, with their measured time.
    calls: DriverCalls,
    /// Whether new handles may be exported as POSIX file descriptors
    /// (asked of the device once; dropped if a creation refuses it).
    exportable: bool,
    /// Whether new handles are created capable of GPUDirect RDMA, which a
    /// network card or storage reads and writes directly (asked of the
    /// device once, as PyTorch's expandable segments ask; dropped if a
    /// creation refuses it). PyTorch's expandable segments, NCCL's
    /// `ncclMemAlloc` and cudaMalloc's memory are such memory where the
    /// platform allows it, and libraries that register tensors for RDMA
    /// (KV-cache transfer between inference servers, NCCL's user buffers
    /// over InfiniBand, GPUDirect Storage) rely on it.
    rdma: bool,
    /// Descriptors of exported handles, closed when the handle is released.
    exported: FxHashMap<HandleId, i32>,
    /// The helper thread for `unmap_later`, started on first use (`None`
    /// until then, or when it could not start: the work is then done at once).
    unmapper: Option<Unmapper>,
    /// Whether starting the helper thread failed (not tried again).
    no_unmapper: bool,
    /// Whether the allocator holds the helper's jobs back (`hold_later_work`).
    held: bool,
    /// Whether a release has warned that unmapping given up earlier failed
    /// again (once: `empty_cache` releases many handles, each would).
    redo_warned: bool,
    /// Driver calls the helper thread made, with their time.
    helper_calls: Arc<parking_lot::Mutex<DriverCalls>>,
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
        let dev = cu_device(device)?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `dev` came from cuDeviceGet; `ctx` is a valid out-pointer.
        // The retain is balanced by the release in `Drop`.
        check("cuDevicePrimaryCtxRetain", unsafe {
            driver::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        Ok(CudaBackend {
            ordinal: device,
            device: dev,
            ctx,
            spare_events: Vec::new(),
            foreign_events: FxHashMap::default(),
            other_contexts: FxHashMap::default(),
            peers: Vec::new(),
            granularity: None,
            handles: FxHashSet::default(),
            mappings: BTreeMap::new(),
            calls: DriverCalls::default(),
            exportable: device_flag(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            ),
            rdma: device_flag(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            ),
            exported: FxHashMap::default(),
            unmapper: None,
            no_unmapper: false,
            held: false,
            redo_warned: false,
            helper_calls: Arc::default(),
        })
    }

    /// The device ordinal.
    pub fn device(&self) -> u32 {
        self.ordinal
    }

    /// Makes the primary context current on this thread until the returned
    /// guard drops, which puts back the context that was current before
    /// (none included): the thread's current device, which the CUDA runtime
    /// and torch read from it, is the caller's again once a call returns,
    /// as PyTorch's own allocator switches devices under a guard.
    #[inline]
    fn bind(&self) -> Result<Bound, BackendError> {
        bind_context(self.ctx)
    }

    /// Read-write access for this device and each peer (`add_peer`).
    fn access(&self) -> Vec<sys::CUmemAccessDesc> {
        std::iter::once(self.device)
            .chain(self.peers.iter().copied())
            .map(|d| sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: d,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect()
    }

    /// Pinned device memory on this device, exportable as a POSIX file
    /// descriptor where the device supports it (as PyTorch's expandable
    /// segments ask), so that it can be shared with another process, and
    /// capable of GPUDirect RDMA where the device supports that (as
    /// PyTorch's expandable segments ask too).
    fn allocation_prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero
        // bytes are valid (null pointers, zero flags); the fields that
        // matter are set below.
        let mut prop: sys::CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = self.device;
        if self.exportable {
            prop.requestedHandleTypes =
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        }
        if self.rdma {
            prop.allocFlags.gpuDirectRDMACapable = 1;
        }
        prop
    }

    /// Runs one driver call, counting it and its time; a VMM call waits
    /// for the helper's (Note [One VMM call at a time]).
    #[inline]
    fn timed(
        &mut self,
        call: DriverCall,
        (handles, bytes): (u64, u64),
        f: impl FnOnce() -> CuResult,
    ) -> CuResult {
        let t = Instant::now();
        let vmm = if call.is_vmm() { self.vmm_turn() } else { None };
        let r = f();
        drop(vmm);
        self.calls
            .add(call, handles, bytes, t.elapsed().as_nanos() as u64);
        r
    }

    /// Unmaps `[ptr, ptr + size)`, a run of whole mappings, with one call.
    fn unmap_run(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        let handles = self.mappings.range(ptr..ptr + size).count() as u64;
        // SAFETY: `[ptr, ptr + size)` is a run of whole mappings made by
        // `map_handles` (contract), so the driver unmaps exactly those.
        let r = self.timed(DriverCall::Unmap, (handles, size), || unsafe {
            driver::cuMemUnmap(ptr, size as usize)
        });
        check("cuMemUnmap", r)?;
        self.forget_mappings(ptr, size);
        Ok(())
    }

    /// Drops the record of the mappings in `[ptr, ptr + size)`.
    fn forget_mappings(&mut self, ptr: DevicePtr, size: u64) {
        let inside: Vec<DevicePtr> = self
            .mappings
            .range(ptr..ptr + size)
            .map(|(&a, _)| a)
            .collect();
        for a in inside {
            self.mappings.remove(&a);
        }
    }

    /// Unmaps what a failed `map_handles` mapped, `[ptr, ptr + size)`. The
    /// caller takes the range for unmapped (its handles go back to the pool
    /// or the driver), so should the unmap fail too, the range is listed
    /// for the helper's redo: the next map over it, the release of a handle
    /// and the free of its reservation wait for it (and try it again)
    /// first, instead of finding it still mapped.
    fn undo_map(&mut self, ptr: DevicePtr, size: u64) {
        let Err(e) = self.unmap_run(ptr, size) else {
            return;
        };
        let handles = self.mappings.range(ptr..ptr + size).count() as u64;
        let job = Job::Unmap { ptr, size, handles };
        if self.unmapper().is_some_and(|u| u.add_failed(&[job])) {
            self.forget_mappings(ptr, size);
        } else {
            // No helper (a forked child): the range stays recorded as
            // mapped, so a map over it fails instead of faulting.
            tracing::warn!(
                "gpualloc: device {}: unmapping a failed mapping failed: {e}",
                self.ordinal
            );
        }
    }

    fn take_event(&mut self) -> Result<sys::CUevent, BackendError> {
        match self.spare_events.pop() {
            Some(e) => Ok(e),
            None => create_event(),
        }
    }
}

/// A new event without timing, in the context the caller made current.
fn create_event() -> Result<sys::CUevent, BackendError> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: a context is current (the caller bound it); `ev` is a valid
    // out-pointer.
    check("cuEventCreate", unsafe {
        driver::cuEventCreate(&mut ev, flags)
    })?;
    Ok(ev)
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

impl Backend for CudaBackend {
    fn alignment(&self) -> u64 {
        256
    }

    fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
        let _bound = self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: context bound; both out-pointers are valid.
        check("cuMemGetInfo", unsafe {
            driver::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn call_other_allocator(
        &mut self,
        capturing: bool,
        call: &mut dyn FnMut(),
    ) -> Result<(), BackendError> {
        let _relaxed = if capturing {
            Some(RelaxedCaptureMode::enter()?)
        } else {
            None
        };
        call();
        Ok(())
    }

    fn allocate(&mut self, size: u64, capturing: bool) -> Result<DevicePtr, BackendError> {
        let _bound = self.bind()?;
        let bytes =
            usize::try_from(size).map_err(|_| BackendError::OutOfMemory { requested: size })?;
        let mut ptr: sys::CUdeviceptr = 0;
        let _relaxed = if capturing {
            Some(RelaxedCaptureMode::enter()?)
        } else {
            None
        };
        // SAFETY: context bound; `ptr` is a valid out-pointer.
        let r = self.timed(DriverCall::MemAlloc, (0, size), || unsafe {
            driver::cuMemAlloc_v2(&mut ptr, bytes)
        });
        match check("cuMemAlloc", r) {
            Ok(()) => Ok(ptr),
            Err(BackendError::OutOfMemory { .. }) => {
                Err(BackendError::OutOfMemory { requested: size })
            }
            Err(e) => Err(e),
        }
    }

    fn release(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        let _bound = self.bind()?;
        // SAFETY: the Backend contract guarantees `ptr` came from `allocate`
        // (cuMemAlloc in this context) and was not released since.
        let r = self.timed(DriverCall::MemFree, (0, size), || unsafe {
            driver::cuMemFree_v2(ptr)
        });
        check("cuMemFree", r)
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        if let Some((device, handle)) = other_device_stream(stream) {
            let ctx = self.context_of(device)?;
            return self.record_in(ctx, stream_of(handle));
        }
        let _bound = self.bind()?;
        let ev = self.take_event()?;
        // SAFETY: `ev` is a live event of this context; `stream` is a stream
        // handle PyTorch passed (0 = legacy default stream) that is alive
        // while work is queued on it.
        let r = self.timed(DriverCall::EventRecord, (0, 0), || unsafe {
            driver::cuEventRecord(ev, stream_of(stream))
        });
        if let Err(e) = check("cuEventRecord", r) {
            self.spare_events.push(ev);
            // A stream of another device (`t.record_stream(s)` with `s` on
            // another GPU): an event must be recorded in the stream's own
            // context, as PyTorch records it on the stream's device.
            // Where the stream's context could not be read (a handle
            // destroyed since) or is this one, this first answer stands;
            // a live stream of another context answers for itself, so that
            // a passing failure there is not taken for a dead stream (Note
            // [Streams that refuse events] in `fence.rs`).
            return self.record_foreign(stream).map_err(|f| match f {
                BackendError::Unavailable(_)
                | BackendError::Driver {
                    call: "cuStreamGetCtx",
                    ..
                } => e,
                f => f,
            });
        }
        Ok(ev as usize as EventId)
    }

    fn event_done(&mut self, event: EventId) -> Result<bool, BackendError> {
        let _bound = self.bind_for(event)?;
        // SAFETY: `event` came from `record_event` and was not destroyed (contract).
        let r = self.timed(DriverCall::EventQuery, (0, 0), || unsafe {
            driver::cuEventQuery(event_of(event))
        });
        match r {
            driver::SUCCESS => Ok(true),
            driver::NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|()| false),
        }
    }

    fn wait_event(&mut self, event: EventId) -> Result<(), BackendError> {
        // The helper's held jobs may run while this thread only waits.
        let let_go = self.held;
        self.hold_later_work(false);
        let r = self.bind_for(event).map(|_bound| {
            // SAFETY: `event` is live (contract).
            self.timed(DriverCall::EventSync, (0, 0), || unsafe {
                driver::cuEventSynchronize(event_of(event))
            })
        });
        self.hold_later_work(let_go);
        check("cuEventSynchronize", r?)
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        let _bound = self.bind()?;
        // SAFETY: the device's context is current (`bind`); no arguments.
        let r = self.timed(DriverCall::CtxSync, (0, 0), || unsafe {
            driver::cuCtxSynchronize()
        });
        check("cuCtxSynchronize", r)
    }

    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), BackendError> {
        let (_bound, s) = self.bind_stream(stream)?;
        if !s.is_null() {
            // A stream handle of any device (a side stream of another GPU
            // is keyed as its handle): the driver knows its context, which
            // this device's synchronization would not cover.
            // SAFETY: `s` is a stream handle the caller passed. CUDA leaves a
            // call on a stream destroyed since undefined; the allocator makes
            // it only for a stream an event record refused (a side stream
            // such as `torch.cuda.ExternalStream` destroyed while its blocks
            // were cached), where PyTorch's own allocator has already made
            // the same kind of call (`cudaEventRecord`), and the driver
            // reports an invalid handle.
            let r = self.timed(DriverCall::CtxSync, (0, 0), || unsafe {
                driver::cuStreamSynchronize(s)
            });
            return check("cuStreamSynchronize", r);
        }
        // SAFETY: the stream's device's context is current; no arguments.
        let r = self.timed(DriverCall::CtxSync, (0, 0), || unsafe {
            driver::cuCtxSynchronize()
        });
        check("cuCtxSynchronize", r)
    }

    fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<(), BackendError> {
        let (_bound, s) = self.bind_stream(stream)?;
        // SAFETY: `event` is live (contract); `s` is a live stream handle
        // from PyTorch, of the bound context. Flags must be 0.
        let r = self.timed(DriverCall::StreamWait, (0, 0), || unsafe {
            driver::cuStreamWaitEvent(s, event_of(event), 0)
        });
        check("cuStreamWaitEvent", r)
    }

    fn destroy_event(&mut self, event: EventId) {
        let ev = event_of(event);
        if let Some(ctx) = self.foreign_events.remove(&(ev as usize)) {
            // Another context's event: destroyed there, never pooled here.
            let _bound = bind_context(ctx);
            // SAFETY: `ev` is live, made in `ctx` by `record_foreign`, and
            // destroyed once (contract).
            let _ = unsafe { driver::cuEventDestroy_v2(ev) };
            return;
        }
        if self.spare_events.len() < EVENT_POOL_MAX {
            // Re-recording a pooled event later is fine: waits already
            // enqueued on it keep referring to the earlier record.
            self.spare_events.push(ev);
        } else {
            let _bound = self.bind();
            // SAFETY: `ev` is live and destroyed once (contract). Pending
            // stream waits on it stay valid after destruction (CUDA semantics).
            let _ = unsafe { driver::cuEventDestroy_v2(ev) };
        }
    }

    fn vmm_granularity(&mut self) -> Option<u64> {
        if let Some(g) = self.granularity {
            return (g > 0).then_some(g);
        }
        let bound = self.bind().ok();
        // A device without virtual memory management gets plain segments;
        // the granularity query may answer there all the same.
        let vmm = device_flag(
            self.device,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        );
        let g = bound.as_ref().filter(|_| vmm).and_then(|_| {
            let prop = self.allocation_prop();
            let mut g = 0usize;
            // SAFETY: context bound; `prop` and `g` are valid for the call.
            let r = unsafe {
                driver::cuMemGetAllocationGranularity(
                    &mut g,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            };
            check("cuMemGetAllocationGranularity", r)
                .ok()
                .map(|()| g as u64)
        });
        self.granularity = Some(g.unwrap_or(0));
        g.filter(|&g| g > 0)
    }

    fn reserve(&mut self, size: u64) -> Result<DevicePtr, BackendError> {
        let _bound = self.bind()?;
        let align = self.vmm_granularity().unwrap_or(2 << 20) as usize;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: context bound; `va` is a valid out-pointer; no fixed address requested.
        let r = self.timed(DriverCall::Reserve, (0, size), || unsafe {
            driver::cuMemAddressReserve(&mut va, size as usize, align, 0, 0)
        });
        check("cuMemAddressReserve", r)?;
        Ok(va)
    }

    fn free_reservation(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.wait_later(Some((ptr, ptr + size)))?;
        let _bound = self.bind()?;
        // SAFETY: `ptr`/`size` came from `reserve` (contract) and every page
        // in it was unmapped by the allocator before this call.
        let r = self.timed(DriverCall::AddressFree, (0, size), || unsafe {
            driver::cuMemAddressFree(ptr, size as usize)
        });
        check("cuMemAddressFree", r)
    }

    fn create_handle(&mut self, size: u64, capturing: bool) -> Result<HandleId, BackendError> {
        let _bound = self.bind()?;
        let _relaxed = if capturing {
            Some(RelaxedCaptureMode::enter()?)
        } else {
            None
        };
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        let mut r = driver::NOT_FOUND;
        // A platform that refuses memory capable of GPUDirect RDMA, or
        // exportable memory, still gets memory, only without what it
        // refuses: each combination is tried in turn, keeping what it can.
        let asked = (self.rdma, self.exportable);
        let order = [asked, (false, asked.1), (asked.0, false), (false, false)];
        for (i, &flags) in order.iter().enumerate() {
            if order[..i].contains(&flags) {
                continue;
            }
            (self.rdma, self.exportable) = flags;
            let prop = self.allocation_prop();
            // SAFETY: context bound; `prop` describes pinned memory on this
            // device; `h` is a valid out-pointer; `size` is a multiple of
            // the granularity (contract).
            r = self.timed(DriverCall::Create, (1, size), || unsafe {
                driver::cuMemCreate(&mut h, size as usize, &prop, 0)
            });
            if !driver::refuses_export(r) {
                break;
            }
        }
        if !driver::refuses_export(r) {
            if asked.0 && !self.rdma {
                tracing::warn!(
                    "gpualloc: device {} refused memory capable of GPUDirect RDMA; new memory is created without it",
                    self.ordinal
                );
            }
            if asked.1 && !self.exportable {
                tracing::warn!(
                    "gpualloc: device {} refused exportable memory; new memory cannot be shared with other processes",
                    self.ordinal
                );
            }
        } else {
            // Refused whatever was asked: not for these flags.
            (self.rdma, self.exportable) = asked;
        }
        match check("cuMemCreate", r) {
            Ok(()) => {
                self.handles.insert(h);
                Ok(h)
            }
            Err(BackendError::OutOfMemory { .. }) => {
                Err(BackendError::OutOfMemory { requested: size })
            }
            Err(e) => Err(e),
        }
    }

    fn release_handle(&mut self, handle: HandleId, size: u64) -> Result<(), BackendError> {
        // The handle may still be mapped where the helper has yet to unmap.
        // Releasing a mapped handle is allowed (its memory goes once the
        // last mapping does), so a failure there fails no release.
        if let Err(e) = self.wait_later(None)
            && !std::mem::replace(&mut self.redo_warned, true)
        {
            tracing::warn!(
                "gpualloc: device {}: unmapping given up earlier failed again: {e} \
                 (its handles' memory returns once it succeeds; not reported again)",
                self.ordinal
            );
        }
        let _bound = self.bind()?;
        // SAFETY: `handle` came from `create_handle` and the allocator has
        // unmapped it everywhere (contract), or given the range up to the
        // helper, whose jobs were waited for above; should one have failed
        // twice, the driver releases the memory once that mapping goes.
        let r = self.timed(DriverCall::Release, (1, size), || unsafe {
            driver::cuMemRelease(handle)
        });
        check("cuMemRelease", r)?;
        self.handles.remove(&handle);
        if let Some(fd) = self.exported.remove(&handle) {
            exported::close(fd);
        }
        Ok(())
    }

    fn map_handles(
        &mut self,
        ptr: DevicePtr,
        handles: &[(HandleId, u64)],
        capturing: bool,
    ) -> Result<(), BackendError> {
        let total: u64 = handles.iter().map(|h| h.1).sum();
        self.wait_later(Some((ptr, ptr + total)))?;
        let _bound = self.bind()?;
        let _relaxed = if capturing {
            Some(RelaxedCaptureMode::enter()?)
        } else {
            None
        };
        let mut at = ptr;
        for &(h, size) in handles {
            // SAFETY: `[at, at + size)` lies in a reservation of this backend
            // and is unmapped (contract); `h` is a live handle of exactly
            // `size` bytes (which the driver lets be mapped at other
            // addresses too: stitches, old ranges waiting to be unmapped).
            let r = self.timed(DriverCall::Map, (1, size), || unsafe {
                driver::cuMemMap(at, size as usize, 0, h, 0)
            });
            if let Err(e) = check("cuMemMap", r) {
                if at > ptr {
                    self.undo_map(ptr, at - ptr);
                }
                return Err(e);
            }
            self.mappings.insert(at, size);
            at += size;
        }
        let desc = self.access();
        let total = at - ptr;
        // SAFETY: `[ptr, ptr + total)` was mapped above; `desc` holds
        // `desc.len()` valid descriptors for the call.
        let r = self.timed(
            DriverCall::SetAccess,
            (handles.len() as u64, total),
            || unsafe { driver::cuMemSetAccess(ptr, total as usize, desc.as_ptr(), desc.len()) },
        );
        if let Err(e) = check("cuMemSetAccess", r) {
            self.undo_map(ptr, total);
            return Err(e);
        }
        Ok(())
    }

    fn stream_capture(&mut self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        let (_bound, s) = self.bind_stream(stream)?;
        let none = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as u32;
        let (mut status, mut id) = (none, 0u64);
        let (null, no_count) = (std::ptr::null_mut(), std::ptr::null_mut());
        // The three calls below: `s` is a stream handle the caller passed
        // (0 = the bound context's legacy stream), alive for the call;
        // `status` and `id` are valid out-pointers; the other outputs are
        // optional and null. Each signature is the driver's for that
        // symbol (CUDA 12.3+, 11.3+, 10.0+); a symbol the driver lacks
        // returns NOT_FOUND without a call. Whatever the newer calls
        // refuse, the oldest answers, without an id.
        let answered = |r| r == driver::SUCCESS || r == driver::STREAM_CAPTURE_IMPLICIT;
        // SAFETY: as said above, with the CUDA 12.3 signature.
        let mut r = unsafe {
            driver::cuStreamGetCaptureInfo_v3(s, &mut status, &mut id, null, null, null, no_count)
        };
        if !answered(r) {
            // SAFETY: as above, with the 11.3 signature.
            r = unsafe {
                driver::cuStreamGetCaptureInfo_v2(s, &mut status, &mut id, null, null, no_count)
            };
        }
        if !answered(r) {
            id = 0;
            // SAFETY: as above; `status` is the only output.
            r = unsafe { driver::cuStreamIsCapturing(s, &mut status) };
        }
        match r {
            driver::SUCCESS => Ok((status != none).then_some(id)),
            // The legacy stream while another stream captures in global mode.
            driver::STREAM_CAPTURE_IMPLICIT => Ok(Some(0)),
            other => check("cuStreamGetCaptureInfo", other).map(|()| None),
        }
    }

    fn capture_terminals(
        &mut self,
        stream: StreamId,
    ) -> Result<Option<CaptureNodes>, BackendError> {
        self.graph_capture_terminals(stream)
    }

    fn node_dependencies(&mut self, node: GraphNode) -> Result<Vec<GraphNode>, BackendError> {
        self.graph_node_dependencies(node)
    }

    fn add_peer(&mut self, peer: u32) -> Result<(), BackendError> {
        let dev = cu_device(peer)?;
        if dev == self.device || self.peers.contains(&dev) {
            return Ok(());
        }
        // Remembered first: mappings made from now on grant it access even
        // if one below is refused (PyTorch counts peer access as enabled
        // before asking its segments).
        self.peers.push(dev);
        let _bound = self.bind()?;
        let desc = [sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: dev,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }];
        // What is mapped now, one call per mapping: adjacent mappings may
        // lie in two reservations, which one call must not cross, and the
        // driver's cost is per handle anyway (docs/driver-costs.md).
        let mapped: Vec<(DevicePtr, u64)> = self.mappings.iter().map(|(&a, &s)| (a, s)).collect();
        // Every mapping is tried; the first refusal is reported.
        mapped
            .into_iter()
            .map(|(a, size)| {
                // SAFETY: `[a, a + size)` is one live mapping of this
                // backend; `desc` is one valid descriptor.
                let r = self.timed(DriverCall::SetAccess, (1, size), || unsafe {
                    driver::cuMemSetAccess(a, size as usize, desc.as_ptr(), 1)
                });
                check("cuMemSetAccess", r)
            })
            .fold(Ok(()), Result::and)
    }

    fn unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        let _bound = self.bind()?;
        self.unmap_run(ptr, size)
    }

    fn unmap_later(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.queue_unmap(ptr, size)
    }

    fn free_reservation_later(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.queue_free(ptr, size)
    }

    fn hold_later_work(&mut self, held: bool) {
        self.held = held;
        if let Some(u) = &self.unmapper {
            u.hold(held);
        }
    }

    fn copy(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        let _bound = self.bind()?;
        // SAFETY: both ranges are mapped and accessible on this device
        // (contract); the copy runs on the legacy default stream.
        check("cuMemcpyDtoD", unsafe {
            driver::cuMemcpyDtoD_v2(dst, src, bytes as usize)
        })?;
        self.synchronize()
    }

    fn export_handle(&mut self, handle: HandleId) -> Result<i32, BackendError> {
        if let Some(&fd) = self.exported.get(&handle) {
            return Ok(fd);
        }
        if !self.handles.contains(&handle) {
            return Err(BackendError::Driver {
                call: "cuMemExportToShareableHandle",
                code: 0,
                name: format!("handle {handle:#x} is not one of this backend's"),
            });
        }
        if !self.exportable {
            return Err(BackendError::Unavailable(
                "this device cannot export memory as POSIX file descriptors".into(),
            ));
        }
        let _bound = self.bind()?;
        let fd = {
            let _vmm = self.vmm_turn();
            exported::export(handle)?
        };
        self.exported.insert(handle, fd);
        Ok(fd)
    }

    fn driver_calls(&self) -> DriverCalls {
        self.calls
    }

    fn helper_calls(&self) -> DriverCalls {
        // A child forked while the helper thread added to the count holds
        // a copy of the lock that nothing will release (Note [No driver
        // call after fork]): it reads what it can without waiting.
        if driver::in_forked_child() {
            return self
                .helper_calls
                .try_lock()
                .map_or_else(DriverCalls::default, |c| *c);
        }
        *self.helper_calls.lock()
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // The helper finishes its jobs while the context is still retained,
        // and what failed there is tried once more here.
        if let Some(u) = &self.unmapper {
            u.wait_all();
            let failed = u.failed();
            let _ = self.redo(&failed, None);
        }
        drop(self.unmapper.take());
        let Ok(_bound) = self.bind() else {
            return;
        };
        for (a, size) in std::mem::take(&mut self.mappings) {
            // SAFETY: each entry is a live mapping made by `map_handles`.
            let _ = unsafe { driver::cuMemUnmap(a, size as usize) };
        }
        for (_, fd) in self.exported.drain() {
            exported::close(fd);
        }
        for h in std::mem::take(&mut self.handles) {
            // SAFETY: each handle is live and, after the loop above, unmapped.
            let _ = unsafe { driver::cuMemRelease(h) };
        }
        // Events of other contexts (`record_foreign`) are left to their
        // contexts, which may already be gone: binding one could fault.
        for ev in self.spare_events.drain(..) {
            // SAFETY: every pooled event is live and owned only by the pool.
            let _ = unsafe { driver::cuEventDestroy_v2(ev) };
        }
        for (ordinal, _) in self.other_contexts.drain() {
            if let Ok(dev) = cu_device(ordinal) {
                // SAFETY: balances the retain in `context_of`.
                let _ = unsafe { driver::cuDevicePrimaryCtxRelease_v2(dev) };
            }
        }
        // SAFETY: balances the retain in `new`; the device handle is valid.
        let _ = unsafe { driver::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver every entry point is an error value, never a panic;
    /// with one (a GPU machine) the basic round trips work.
    #[test]
    fn works_or_reports_unavailable() {
        let present = driver::present();
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
                if let Some(g) = b.vmm_granularity() {
                    let va = b.reserve(8 * g).unwrap();
                    let h1 = b.create_handle(2 * g, false).unwrap();
                    let h2 = b.create_handle(g, false).unwrap();
                    b.map_handles(va, &[(h1, 2 * g), (h2, g)], false).unwrap();
                    b.unmap(va, 3 * g).unwrap();
                    // A handle maps again at another address.
                    b.map_handles(va + 4 * g, &[(h2, g)], false).unwrap();
                    b.unmap(va + 4 * g, g).unwrap();
                    b.release_handle(h1, 2 * g).unwrap();
                    b.release_handle(h2, g).unwrap();
                    b.free_reservation(va, 8 * g).unwrap();
                    let calls = b.driver_calls();
                    assert_eq!(calls.calls(DriverCall::Map), 3);
                    assert_eq!(calls.calls(DriverCall::SetAccess), 2);
                    assert!(calls.total_nanos() > 0);
                }
                assert!(
                    matches!(b.allocate(1 << 50, false), Err(BackendError::OutOfMemory { requested }) if requested == 1 << 50)
                );
            }
        }
        assert!(CudaBackend::new(1 << 20).is_err());
    }

    #[test]
    fn codes_are_named_without_the_driver() {
        let e = check("cuX", sys::CUresult::CUDA_ERROR_INVALID_VALUE as u32).unwrap_err();
        assert_eq!(
            e,
            BackendError::Driver {
                call: "cuX",
                code: 1,
                name: "CUDA_ERROR_INVALID_VALUE".to_string()
            }
        );
        assert_eq!(
            check("cuX", driver::OUT_OF_MEMORY),
            Err(BackendError::OutOfMemory { requested: 0 })
        );
        assert_eq!(check("cuX", driver::SUCCESS), Ok(()));
        // The answer in a forked child (Note [No driver call after fork]).
        assert!(
            matches!(check("cuMemGetInfo", driver::FORKED_CHILD), Err(BackendError::Unavailable(m)) if m.contains("fork") && m.contains("cuMemGetInfo"))
        );
        // A code this build does not know is an error, not undefined behaviour.
        assert_eq!(
            check("cuX", 123_456).unwrap_err(),
            BackendError::Driver {
                call: "cuX",
                code: 123_456,
                name: "CUDA error 123456".to_string()
            }
        );
    }
}
