//! The driver functions the CUDA backend calls, with their results as plain
//! integers.
//!
//! cudarc declares every driver function as returning the `CUresult` enum.
//! A Rust enum may only hold its listed values, so a code that a newer
//! driver adds would be undefined behaviour the moment the call returned.
//! Here each function is looked up in the library cudarc loaded and called
//! through a pointer type that returns [`CuResult`], a `u32` (the C enum's
//! representation); names come from [`name`], which only compares integers.
//! Out-parameters of enum type are declared as `u32` for the same reason.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::{self, CUresult};

/// A driver result: `CUresult` as the integer the driver returned.
pub(super) type CuResult = u32;

pub(super) const SUCCESS: CuResult = CUresult::CUDA_SUCCESS as u32;
pub(super) const OUT_OF_MEMORY: CuResult = CUresult::CUDA_ERROR_OUT_OF_MEMORY as u32;
pub(super) const NOT_READY: CuResult = CUresult::CUDA_ERROR_NOT_READY as u32;
/// A capture query on the legacy stream while a capture forbids using it.
pub(super) const STREAM_CAPTURE_IMPLICIT: CuResult =
    CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT as u32;
/// Returned when the library lacks a symbol (an old driver).
pub(super) const NOT_FOUND: CuResult = CUresult::CUDA_ERROR_NOT_FOUND as u32;

/// Returned, without a call, in a child forked after `cuInit`: not a
/// driver code (those are below 1000). See Note [No driver call after fork].
pub(super) const FORKED_CHILD: CuResult = 0xF0_0001;

/// Note [No driver call after fork]
/// Rationale: CUDA does not survive `fork`. A child forked after `cuInit`
/// (a DataLoader worker under the `fork` start method) has the parent's
/// driver state without its threads or its context, and what a driver call
/// does there is undefined: the checking stand-in driver
/// (`capi/tests/c/fake_cuda.c`) counts every one. The C ABI already
/// refuses allocations and skips frees and `empty_cache` there (Note
/// [Freeing in a forked child] in the C ABI crate), but any other path to
/// the driver (`mem_info`, `cache_info`, peer access, a backend used from
/// Rust) would still reach it.
/// Approach: once gpualloc's own `cuInit` succeeded (a process that forks
/// after PyTorch started CUDA but before gpualloc's first driver call is
/// not covered; the C ABI's refusals above are), a `pthread_atfork` child
/// handler sets
/// a flag, and every function below returns [`FORKED_CHILD`] without
/// calling the driver while it is set: the backend reports it as
/// unavailable, naming the cause. One relaxed load per driver call.
static FORKED: AtomicBool = AtomicBool::new(false);

/// Registers, once, the fork handler of Note [No driver call after fork];
/// called after `cuInit` succeeded.
pub(super) fn watch_forks() {
    extern "C" fn child() {
        FORKED.store(true, Ordering::Relaxed);
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: `child` is a plain `extern "C"` function that lives as
        // long as the library, cannot unwind, and only stores an atomic
        // (async-signal-safe, as a fork handler must be).
        unsafe {
            libc::pthread_atfork(None, None, Some(child));
        }
    });
}

/// Whether this is a child forked after `cuInit` (Note [No driver call
/// after fork]).
#[inline]
pub(super) fn in_forked_child() -> bool {
    FORKED.load(Ordering::Relaxed)
}

/// Whether `cuMemCreate` failed because exportable memory is refused
/// (a platform without POSIX descriptor export, or a sandbox).
pub(super) fn refuses_export(code: CuResult) -> bool {
    code == CUresult::CUDA_ERROR_NOT_SUPPORTED as u32
        || code == CUresult::CUDA_ERROR_NOT_PERMITTED as u32
}

/// The codes named in messages; any other is shown as its number.
const KNOWN: &[CUresult] = &[
    CUresult::CUDA_ERROR_INVALID_VALUE,
    CUresult::CUDA_ERROR_OUT_OF_MEMORY,
    CUresult::CUDA_ERROR_NOT_INITIALIZED,
    CUresult::CUDA_ERROR_DEINITIALIZED,
    CUresult::CUDA_ERROR_NO_DEVICE,
    CUresult::CUDA_ERROR_STUB_LIBRARY,
    CUresult::CUDA_ERROR_INVALID_DEVICE,
    CUresult::CUDA_ERROR_INVALID_CONTEXT,
    CUresult::CUDA_ERROR_INVALID_HANDLE,
    CUresult::CUDA_ERROR_NOT_FOUND,
    CUresult::CUDA_ERROR_NOT_READY,
    CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
    CUresult::CUDA_ERROR_LAUNCH_FAILED,
    CUresult::CUDA_ERROR_NOT_PERMITTED,
    CUresult::CUDA_ERROR_NOT_SUPPORTED,
    CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
    CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUresult::CUDA_ERROR_CAPTURED_EVENT,
    CUresult::CUDA_ERROR_UNKNOWN,
];

/// The name of a driver code, e.g. `CUDA_ERROR_INVALID_VALUE`, without
/// calling the driver; `CUDA error 1234` for codes not in the table.
pub(super) fn name(code: CuResult) -> String {
    if code == FORKED_CHILD {
        return "no driver call in a child forked after CUDA started".to_string();
    }
    KNOWN
        .iter()
        .find(|&&k| k as u32 == code)
        .map_or_else(|| format!("CUDA error {code}"), |k| format!("{k:?}"))
}

/// Note [The process's driver]
/// Rationale: PyTorch's CUDA runtime opens the driver by its SONAME,
/// `libcuda.so.1`; cudarc tries `libcuda.so` first. Where another file of
/// that name comes first on the search path (the toolkit's stub,
/// `lib64/stubs/libcuda.so`, is often on `LD_LIBRARY_PATH` in build
/// images), the process would hold two drivers: PyTorch's working, and
/// gpualloc's answering every call with CUDA_ERROR_STUB_LIBRARY (or, were
/// it another real driver, holding none of PyTorch's streams).
/// Approach: every driver function is looked up in `libcuda.so.1` as the
/// process has it loaded (`RTLD_NOLOAD`), or as the runtime would load it;
/// only where neither opens, in the library cudarc found.
pub(super) fn process_driver() -> *mut c_void {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    *HANDLE.get_or_init(|| {
        let name = c"libcuda.so.1";
        // SAFETY: `dlopen` with a NUL-terminated name; the handle is kept for
        // the life of the process (never closed), as cudarc keeps its own.
        let mut h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if h.is_null() {
            // SAFETY: as above.
            h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW) };
        }
        h as usize
    }) as *mut c_void
}

/// Whether a driver library can be loaded: the process's (Note [The
/// process's driver]) or one of cudarc's candidates.
pub(super) fn present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the library
    // candidates and drops the handles; it calls no driver function.
    !process_driver().is_null() || unsafe { sys::is_culib_present() }
}

/// Declares `pub(super) unsafe fn name(args) -> CuResult` for each driver
/// function, resolved once from the process's driver (Note [The process's
/// driver]), else from the library cudarc loaded.
macro_rules! driver_fns {
    ($($fname:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {$(
        /// The driver function of the same name, its result an integer.
        ///
        /// # Safety
        /// As the driver documents for the function; the library must be
        /// present ([`present`]), or cudarc panics.
        #[allow(non_snake_case)]
        pub(super) unsafe fn $fname($($arg: $ty),*) -> CuResult {
            type F = unsafe extern "C" fn($($ty),*) -> CuResult;
            static SYM: OnceLock<Option<F>> = OnceLock::new();
            // First: a symbol first looked up in a forked child could wait
            // on a lookup a parent thread had under way at the fork.
            if in_forked_child() {
                return FORKED_CHILD;
            }
            let f = SYM.get_or_init(|| {
                let symbol = concat!(stringify!($fname), "\0").as_bytes();
                let own = process_driver();
                if !own.is_null() {
                    // SAFETY: `own` is a live handle of the driver library
                    // (never closed); the symbol name is NUL-terminated.
                    let p = unsafe { libc::dlsym(own, symbol.as_ptr().cast()) };
                    // SAFETY: the driver exports this symbol with this C
                    // signature (its `CUresult` read as the u32 it is), so a
                    // non-null address is a function of type `F`, valid for
                    // the life of the process.
                    return (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, F>(p) });
                }
                // SAFETY: the driver exports this symbol with this C
                // signature, except that its `CUresult` is read as the u32
                // it is represented by. The library is never unloaded
                // (cudarc keeps it in a static), so the pointer stays valid.
                unsafe { sys::culib().get::<F>(symbol).ok().map(|s| *s) }
            });
            match f {
                // SAFETY: the caller upholds the driver's contract.
                Some(f) => unsafe { f($($arg),*) },
                None => NOT_FOUND,
            }
        }
    )*};
}

driver_fns! {
    cuInit(flags: c_uint);
    cuDeviceGetCount(count: *mut c_int);
    cuDeviceGet(device: *mut sys::CUdevice, ordinal: c_int);
    cuDevicePrimaryCtxRetain(ctx: *mut sys::CUcontext, device: sys::CUdevice);
    cuDevicePrimaryCtxRelease_v2(device: sys::CUdevice);
    cuCtxGetCurrent(ctx: *mut sys::CUcontext);
    cuCtxSetCurrent(ctx: sys::CUcontext);
    cuMemGetInfo_v2(free: *mut usize, total: *mut usize);
    cuMemAlloc_v2(ptr: *mut sys::CUdeviceptr, bytes: usize);
    cuMemFree_v2(ptr: sys::CUdeviceptr);
    cuEventCreate(event: *mut sys::CUevent, flags: c_uint);
    cuEventDestroy_v2(event: sys::CUevent);
    cuEventRecord(event: sys::CUevent, stream: sys::CUstream);
    cuEventQuery(event: sys::CUevent);
    cuEventSynchronize(event: sys::CUevent);
    cuCtxSynchronize();
    cuStreamSynchronize(stream: sys::CUstream);
    cuStreamWaitEvent(stream: sys::CUstream, event: sys::CUevent, flags: c_uint);
    cuStreamGetCtx(stream: sys::CUstream, ctx: *mut sys::CUcontext);
    cuThreadExchangeStreamCaptureMode(mode: *mut u32);
    cuStreamIsCapturing(stream: sys::CUstream, status: *mut u32);
    cuStreamGetCaptureInfo_v3(
        stream: sys::CUstream,
        status: *mut u32,
        id: *mut u64,
        graph: *mut c_void,
        dependencies: *mut c_void,
        edge_data: *mut c_void,
        count: *mut usize,
    );
    cuStreamGetCaptureInfo_v2(
        stream: sys::CUstream,
        status: *mut u32,
        id: *mut u64,
        graph: *mut c_void,
        dependencies: *mut c_void,
        count: *mut usize,
    );
    cuGraphNodeGetDependencies_v2(
        node: *mut c_void,
        dependencies: *mut c_void,
        edge_data: *mut c_void,
        count: *mut usize,
    );
    cuGraphNodeGetDependencies(node: *mut c_void, dependencies: *mut c_void, count: *mut usize);
    cuMemGetAllocationGranularity(
        granularity: *mut usize,
        prop: *const sys::CUmemAllocationProp,
        option: sys::CUmemAllocationGranularity_flags,
    );
    cuMemAddressReserve(
        ptr: *mut sys::CUdeviceptr,
        size: usize,
        alignment: usize,
        addr: sys::CUdeviceptr,
        flags: u64,
    );
    cuMemAddressFree(ptr: sys::CUdeviceptr, size: usize);
    cuMemCreate(
        handle: *mut sys::CUmemGenericAllocationHandle,
        size: usize,
        prop: *const sys::CUmemAllocationProp,
        flags: u64,
    );
    cuMemRelease(handle: sys::CUmemGenericAllocationHandle);
    cuMemMap(
        ptr: sys::CUdeviceptr,
        size: usize,
        offset: usize,
        handle: sys::CUmemGenericAllocationHandle,
        flags: u64,
    );
    cuMemSetAccess(
        ptr: sys::CUdeviceptr,
        size: usize,
        desc: *const sys::CUmemAccessDesc,
        count: usize,
    );
    cuMemUnmap(ptr: sys::CUdeviceptr, size: usize);
    cuMemcpyDtoD_v2(dst: sys::CUdeviceptr, src: sys::CUdeviceptr, bytes: usize);
    cuDeviceGetAttribute(value: *mut c_int, attribute: sys::CUdevice_attribute, device: sys::CUdevice);
    cuMemExportToShareableHandle(
        shareable: *mut std::ffi::c_void,
        handle: sys::CUmemGenericAllocationHandle,
        kind: sys::CUmemAllocationHandleType,
        flags: u64,
    );
    cuMemImportFromShareableHandle(
        handle: *mut sys::CUmemGenericAllocationHandle,
        os_handle: *mut std::ffi::c_void,
        kind: sys::CUmemAllocationHandleType,
    );
}
