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
//! `c10::cuda::getCurrentCUDAStream(device).stream()`, looked up by their
//! Itanium-mangled names (`DeviceIndex` is `int8_t`; the call returns
//! `CUDAStream`, 16 bytes trivially copied, in registers). The library is
//! never loaded here (`RTLD_NOLOAD`), so a program without PyTorch, or one
//! whose c10 names differ, frees as before: without a current stream. A
//! lookup that found the names is kept; one that did not is tried again
//! at every `RETRY`th free of a thread (a program may use gpualloc before
//! it imports torch), not at each, since `dlopen` takes the loader's lock;
//! the count is the thread's own, so frees of several threads share no
//! counter. c10 throws
//! for a device it does not count (and its first stream setup fails where
//! CUDA cannot start), which must not cross a Rust frame: the device is
//! asked only when c10's own `device_count()` (`noexcept`, 0 without a
//! driver) counts it. The stream c10 returns must name
//! a CUDA device, the one asked (a `c10::Stream` laid out otherwise would
//! not), before its handle is read. Where the bridge's own call failed,
//! its deleter frees through `gpualloc_free`, which asks c10 again: once
//! c10's streams are set up (they are, where a tensor was made), that
//! call makes no CUDA call and checks only the device index.

use std::cell::Cell;
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

/// c10's `DeviceType::CUDA`.
const CUDA: i8 = 1;

/// `c10::cuda::device_count()`, `noexcept`.
type DeviceCount = unsafe extern "C" fn() -> i8;
/// `c10::cuda::getCurrentCUDAStream(DeviceIndex)`.
type GetCurrent = unsafe extern "C" fn(i8) -> CudaStream;
/// `c10::cuda::CUDAStream::stream() const`: `this` first.
type Handle = unsafe extern "C" fn(*const CudaStream) -> *mut c_void;

/// The library and the three names.
const LIBRARY: &CStr = c"libc10_cuda.so";
const DEVICE_COUNT: &CStr = c"_ZN3c104cuda12device_countEv";
const GET_CURRENT: &CStr = c"_ZN3c104cuda20getCurrentCUDAStreamEa";
const HANDLE: &CStr = c"_ZNK3c104cuda10CUDAStream6streamEv";

/// A failed lookup is tried again at every this many frees of a thread.
const RETRY: u32 = 4096;

#[derive(Clone, Copy)]
struct C10 {
    device_count: DeviceCount,
    get_current: GetCurrent,
    handle: Handle,
}

/// c10's functions, if it is in the process.
fn functions() -> Option<C10> {
    static FOUND: OnceLock<C10> = OnceLock::new();
    thread_local! {
        static MISSES: Cell<u32> = const { Cell::new(0) };
    }
    if let Some(&f) = FOUND.get() {
        return Some(f);
    }
    let misses = MISSES.with(|m| m.replace(m.get().wrapping_add(1)));
    if !misses.is_multiple_of(RETRY) {
        return None;
    }
    let found = look_up()?;
    Some(*FOUND.get_or_init(|| found))
}

/// Looks the three functions up in a libc10_cuda.so already loaded.
fn look_up() -> Option<C10> {
    // SAFETY: a NUL-terminated name; RTLD_NOLOAD only finds a library
    // already loaded (it runs no initializer) and takes a reference to it,
    // which is never given back: the functions stay valid for the process.
    let lib = unsafe { libc::dlopen(LIBRARY.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if lib.is_null() {
        return None;
    }
    let find = |name: &CStr| {
        // SAFETY: `lib` is a live handle and `name` is NUL-terminated.
        let f = unsafe { libc::dlsym(lib, name.as_ptr()) };
        (!f.is_null()).then_some(f)
    };
    let (count, get, handle) = (find(DEVICE_COUNT)?, find(GET_CURRENT)?, find(HANDLE)?);
    // SAFETY: the symbols are c10's functions of these signatures (Note
    // [The current stream without the bridge]); a function pointer and a
    // data pointer have one size on the platforms that run CUDA.
    unsafe {
        Some(C10 {
            device_count: std::mem::transmute::<*mut c_void, DeviceCount>(count),
            get_current: std::mem::transmute::<*mut c_void, GetCurrent>(get),
            handle: std::mem::transmute::<*mut c_void, Handle>(handle),
        })
    }
}

/// PyTorch's current stream of `device` on this thread, as gpualloc names
/// streams (the handle's address); None without c10, or for a device c10
/// does not count.
pub(crate) fn current(device: i64) -> Option<u64> {
    let device = i8::try_from(device).ok().filter(|&d| d >= 0)?;
    let c10 = functions()?;
    // SAFETY: c10's `noexcept` function (`look_up`).
    if device >= unsafe { (c10.device_count)() } {
        return None;
    }
    // SAFETY: c10's function (`look_up`), for a device it counts: its
    // device check passes and nothing throws.
    let stream = unsafe { (c10.get_current)(device) };
    if stream.device_type != CUDA || stream.device_index != device {
        return None;
    }
    // SAFETY: `stream` is the value c10 returned, alive for the call; a
    // stream c10 made, which it can always name.
    let ptr = unsafe { (c10.handle)(&raw const stream) };
    Some(ptr as usize as u64)
}
