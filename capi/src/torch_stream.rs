//! PyTorch's current stream, read from c10 where no bridge passes it.
//!
//! Note [The current stream without the bridge]
//! Rationale: a block freed while another stream than its own is current
//! counts as `record_stream` on that stream (Note [Frees on another stream]
//! in the core): work queued there may still read it, and gpualloc moves
//! and unmaps free pages, which PyTorch's allocator never does. The bridge's
//! deleter reads PyTorch's current stream and passes it (`gpualloc_free_on`),
//! but a plain `CUDAPluggableAllocator` (install()'s fallback where the
//! bridge cannot be built, or a program loading libgpualloc.so itself)
//! calls `gpualloc_free(ptr, size, device, stream)` with the stream the
//! block was allocated on, not the current one. There the queued reads of
//! another stream went unprotected: `streams.read_elsewhere_then_pages_move`
//! saw the next block's fill (round 70, on both routes).
//! Approach: where libc10_cuda.so is already loaded (PyTorch is in the
//! process), `gpualloc_free` asks it, as the bridge does:
//! `c10::cuda::getCurrentCUDAStream(device).stream()`, looked up once by
//! their Itanium-mangled names (`DeviceIndex` is `int8_t`; the call returns
//! `CUDAStream`, 16 bytes trivially copied, in registers). The library is
//! never loaded here (`RTLD_NOLOAD`), so a program without PyTorch, or one
//! whose c10 names differ, frees as before: without a current stream. The
//! lookup is made at the first free and kept. c10 checks the device index
//! and throws on a bad one, which must not cross a Rust frame: it is asked
//! only for a device that gpualloc counts (CUDA's devices, as c10 counts
//! them).

use std::ffi::{CStr, c_void};
use std::sync::OnceLock;

/// c10's `CUDAStream` as it is laid out: `c10::Stream` (a `Device` of two
/// `int8_t`, then the `int64_t` stream id).
#[repr(C)]
#[derive(Clone, Copy)]
struct CudaStream {
    device_type: i8,
    device_index: i8,
    id: i64,
}

/// `c10::cuda::getCurrentCUDAStream(DeviceIndex)`.
type GetCurrent = unsafe extern "C" fn(i8) -> CudaStream;
/// `c10::cuda::CUDAStream::stream() const`: `this` first.
type Handle = unsafe extern "C" fn(*const CudaStream) -> *mut c_void;

/// The library and the two names.
const LIBRARY: &CStr = c"libc10_cuda.so";
const GET_CURRENT: &CStr = c"_ZN3c104cuda20getCurrentCUDAStreamEa";
const HANDLE: &CStr = c"_ZNK3c104cuda10CUDAStream6streamEv";

/// The two functions, if c10 is in the process.
fn functions() -> Option<(GetCurrent, Handle)> {
    static FOUND: OnceLock<Option<(GetCurrent, Handle)>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        // SAFETY: a NUL-terminated name; RTLD_NOLOAD only finds a library
        // already loaded (it runs no initializer), and the handle is kept
        // for the process's life, as the library stays loaded with torch.
        let lib = unsafe { libc::dlopen(LIBRARY.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if lib.is_null() {
            return None;
        }
        let find = |name: &CStr| {
            // SAFETY: `lib` is a live handle and `name` is NUL-terminated.
            let f = unsafe { libc::dlsym(lib, name.as_ptr()) };
            (!f.is_null()).then_some(f)
        };
        let (get, handle) = (find(GET_CURRENT)?, find(HANDLE)?);
        // SAFETY: the symbols are c10's functions of these signatures
        // (Note [The current stream without the bridge]); a function
        // pointer and a data pointer have one size on the platforms that
        // run CUDA.
        unsafe {
            Some((
                std::mem::transmute::<*mut c_void, GetCurrent>(get),
                std::mem::transmute::<*mut c_void, Handle>(handle),
            ))
        }
    })
}

/// PyTorch's current stream of `device` on this thread, as gpualloc names
/// streams (the handle's address); None without c10. `device` must be one
/// CUDA counts (c10 throws otherwise).
pub(crate) fn current(device: i64) -> Option<u64> {
    let device = i8::try_from(device).ok().filter(|&d| d >= 0)?;
    let (get, handle) = functions()?;
    // SAFETY: c10's functions (`functions`); the caller passes a device
    // CUDA counts, so c10's device check passes and nothing throws.
    let stream = unsafe { get(device) };
    // SAFETY: `stream` is the value c10 returned, alive for the call.
    let ptr = unsafe { handle(&raw const stream) };
    Some(ptr as usize as u64)
}
