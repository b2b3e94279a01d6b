//! libgpualloc.so: gpualloc's C ABI.
//!
//! `gpualloc_malloc` / `gpualloc_free` have exactly the signatures
//! `torch.cuda.memory.CUDAPluggableAllocator` loads; `gpualloc_record_stream`,
//! `gpualloc_empty_cache` and `gpualloc_set_memory_fraction` have exactly the
//! signatures of its hooks. The rest is control and introspection: stats
//! (a versioned struct, and every PyTorch-named stat as a flat array),
//! snapshots (JSON, or structs), segment events, out-of-memory details,
//! CUDA graph pools, tracing, and sharing allocations with other processes
//! (`ipc.rs`).
//!
//! Conventions (see `boundary.rs`): control functions return `int`
//! (`GPUALLOC_OK` or a negative `GPUALLOC_ERR_*`) and clear the calling
//! thread's last error at entry; `gpualloc_last_error()` explains a failure.
//! Nothing unwinds across the boundary. The header `include/gpualloc.h` is
//! generated from this crate by cbindgen.

// Nothing here may panic on a closed stderr or stdout (`boundary::say`).
#![cfg_attr(
    not(test),
    deny(clippy::print_stderr, clippy::print_stdout, clippy::dbg_macro)
)]

mod boundary;
mod checkpoint;
mod crash_report;
mod cxx_error;
mod driver_calls;
mod fd_passing;
mod fork;
mod global;
mod held;
mod ipc;
mod ipc_format;
mod miss;
mod observer;
mod oom;
mod pending;
mod pools;
mod sigterm;
mod snapshot;
mod stats;
mod torch_stream;
mod trace;
mod wsl;

use std::ffi::{c_char, c_double, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

use boundary::{Error, ffi_boundary, status, str_arg, void_call, write_out};
use global::{BackendKind, existing, global};

pub use boundary::*;
pub use checkpoint::*;
pub use driver_calls::*;
pub use ipc::*;
pub use miss::*;
pub use observer::*;
pub use oom::*;
pub use pools::*;
pub use snapshot::*;
pub use stats::*;
pub use trace::*;

/// CUDA's stream handle (`struct CUstream_st *`); NULL is the legacy default stream.
#[allow(non_camel_case_types)]
pub type cudaStream_t = *mut c_void;

/// Starts the allocator with a configuration string in `GPUALLOC_CONF`'s
/// syntax (`"max_split_size_mb:128,memory_limit:20GiB"`); NULL reads
/// `GPUALLOC_CONF`. Call before the first allocation: afterwards only the
/// configuration already in force is accepted (`GPUALLOC_ERR_ALREADY_INITIALIZED`
/// otherwise). A bad configuration is `GPUALLOC_ERR_CONFIG` and leaves the
/// allocator uninitialized, so a corrected call may follow.
///
/// # Safety
/// `config` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_init(config: *const c_char) -> c_int {
    status(|| {
        let cfg = if config.is_null() {
            None
        } else {
            Some(str_arg(config, "config")?)
        };
        global::init(cfg).map(|_| ())
    })
}

/// Checks `config` (NULL: none given; the allocator then reads
/// `GPUALLOC_CONF` when it starts) and keeps it, with a trace to record
/// (`trace_path`, NULL: none; placeholders as in `gpualloc_trace_start`,
/// filled in by the process that starts the trace),
/// for the allocator to start with at the first call that needs it (an
/// allocation, PyTorch's CUDA initialization through the bridge,
/// `gpualloc_init`, a mark or a phase): nothing starts and the CUDA driver
/// is not initialized (Note [Starting on first use] in `pending.rs`). A bad
/// configuration is `GPUALLOC_ERR_CONFIG`; another configuration than one
/// kept or in force, `GPUALLOC_ERR_ALREADY_INITIALIZED`; a second trace,
/// `GPUALLOC_ERR_IO`. Once the allocator runs, it is `gpualloc_init` then
/// `gpualloc_trace_start`.
///
/// # Safety
/// `config` and `trace_path` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_configure(
    config: *const c_char,
    trace_path: *const c_char,
) -> c_int {
    status(|| {
        let cfg = if config.is_null() {
            None
        } else {
            Some(str_arg(config, "config")?)
        };
        // Placeholders are filled in when the trace starts, by the process
        // that starts it.
        let trace = if trace_path.is_null() {
            None
        } else {
            Some(boundary::path_arg(trace_path, "trace path")?)
        };
        global::configure(cfg, trace.as_deref())
    })
}

/// Before the allocator starts: forgets the configuration
/// `gpualloc_configure` kept, when it is `config`, so that a caller whose
/// own set-up failed after keeping it (an installer interrupted while it
/// built its bridge) leaves the choice to a later call. 1 when it was
/// forgotten, 0 when none or another was kept; once the allocator runs,
/// `GPUALLOC_ERR_ALREADY_INITIALIZED` (its configuration holds for the
/// process). The trace kept with it is called off by `gpualloc_trace_stop`.
///
/// # Safety
/// `config` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_forget_config(config: *const c_char) -> c_int {
    boundary::str_flag_call(config, "config", global::forget_config)
}

/// 1 when the allocator has been created, else 0. Creates nothing.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_is_initialized() -> c_int {
    c_int::from(global::existing().is_some())
}

/// `"cuda"` or `"sim"`: the backend in use (creating the allocator if
/// needed), or NULL when it cannot start (see `gpualloc_last_error`).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_backend_name() -> *const c_char {
    boundary::clear_last_error();
    ffi_boundary(
        |_| std::ptr::null(),
        || {
            Ok(match global()?.kind {
                BackendKind::Cuda => c"cuda".as_ptr(),
                BackendKind::Sim => c"sim".as_ptr(),
            })
        },
    )
}

/// The configuration string the allocator runs with (as given to
/// `gpualloc_configure`, `gpualloc_init` or in `GPUALLOC_CONF`; `""` for
/// the defaults), or NULL before it starts. The string lives as long as
/// the process.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_config_string() -> *const c_char {
    static SOURCE: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();
    match global::existing() {
        Some(g) => SOURCE
            .get_or_init(|| {
                // A configuration parsed from a C string holds no NUL.
                std::ffi::CString::new(g.alloc.config().source.as_str()).unwrap_or_default()
            })
            .as_ptr(),
        None => std::ptr::null(),
    }
}

/// 1 when the configuration (in force, kept for the start, or
/// `GPUALLOC_CONF`'s) maps memory through the driver's
/// virtual memory management (`expandable_segments`, the default), 0 when
/// it takes plain segments, or a negative `GPUALLOC_ERR_*` (a bad
/// configuration). Creates nothing. A device whose driver lacks virtual
/// memory management takes plain segments whatever this says.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_maps_memory() -> c_int {
    boundary::clear_last_error();
    ffi_boundary(
        |code| code,
        || Ok(c_int::from(global::config_now()?.expandable_segments)),
    )
}

/// The library version, e.g. `"0.1.0"`.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The number of devices, or a negative `GPUALLOC_ERR_*`. Creates nothing.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_device_count() -> c_int {
    boundary::clear_last_error();
    ffi_boundary(
        |code| code,
        || {
            let n = match existing() {
                Some(g) => g.alloc.device_count(),
                None => global::idle_count()?.1,
            };
            Ok(c_int::try_from(n).unwrap_or(c_int::MAX))
        },
    )
}

/// The calling thread's last error message, or NULL. The string stays valid
/// until the thread's next gpualloc call other than `gpualloc_last_error*`.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_last_error() -> *const c_char {
    boundary::last_error_ptr()
}

/// The `GPUALLOC_ERR_*` code of the calling thread's last error, 0 when
/// none: the status of a void call (a PyTorch hook) that failed.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_last_error_code() -> c_int {
    boundary::last_error_code()
}

/// Allocates `size` bytes on `device` for use on `stream` (PyTorch's
/// pluggable `alloc`). Returns NULL for size 0, and NULL with the last error
/// set (and `gpualloc_last_oom` filled when out of memory) on failure; in a
/// child forked after CUDA started, `GPUALLOC_ERR_UNAVAILABLE`.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_malloc(size: usize, device: c_int, stream: cudaStream_t) -> *mut c_void {
    malloc_on(size, device, stream, false)
}

/// Both allocation entry points: `follow_captures` for the one whose caller
/// cannot announce CUDA graph captures (Note [Capture without a pool]).
#[inline(always)]
fn malloc_on(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
    follow_captures: bool,
) -> *mut c_void {
    boundary::clear_last_error();
    ffi_boundary(
        |_| std::ptr::null_mut(),
        || {
            if fork::cuda_in_forked_child() && size > 0 {
                return Err(fork::refused());
            }
            let stream = stream as usize as u64;
            let g = global()?;
            let size = size as u64;
            let on_device = |cached: bool| -> Result<Option<u64>, gpualloc::AllocError> {
                let mut d = g.alloc.lock(i64::from(device))?;
                if follow_captures && size > 0 {
                    d.follow_driver_capture(stream)?;
                }
                if cached {
                    d.malloc_cached(size, stream)
                } else {
                    d.malloc(size, stream).map(Some)
                }
            };
            // Note [Free-memory callbacks]: a miss runs the callback with
            // the device let go.
            let p = if size > 0 && miss::wanted() {
                match on_device(true) {
                    Ok(None) => {
                        miss::run(device);
                        on_device(false)
                    }
                    r => r,
                }
            } else {
                on_device(false)
            }
            .map(|p| p.unwrap_or(0));
            // Frees another allocator's call made meanwhile (Note [Frees
            // called back from a source]), now that the device is let go.
            g.alloc.run_deferred_frees();
            Ok(p? as usize as *mut c_void)
        },
    )
}

/// `gpualloc_malloc` for a PyTorch that cannot receive an exception (the
/// plain `CUDAPluggableAllocator`, without gpualloc's torch bridge): PyTorch
/// would turn a NULL into a tensor at address 0 and fail later, far from the
/// cause. So on failure for a non-zero size this prints the diagnosis to
/// stderr and aborts the process. That PyTorch cannot tell gpualloc about
/// CUDA graph captures either, so this asks the driver and keeps a graph's
/// memory apart itself, for the life of the process (Note [Capture without
/// a pool] in the core). Not for other callers: `gpualloc_malloc` itself
/// never aborts and follows no capture. `gpualloc_malloc_or_raise` raises
/// instead where it can.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_malloc_or_abort(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
) -> *mut c_void {
    let p = malloc_on(size, device, stream, true);
    if p.is_null() && size > 0 {
        abort_for_failure();
    }
    p
}

/// `gpualloc_malloc_or_abort`, except that a failure throws a C++
/// `std::runtime_error` with gpualloc's diagnosis (opening, for an
/// out-of-memory error, with PyTorch's "CUDA out of memory. Tried to
/// allocate"), which PyTorch raises in Python as `RuntimeError`, so that
/// the program can catch it (Note [An error PyTorch can catch without the
/// bridge] in `cxx_error.rs`). For callers in C++ only, such as PyTorch's
/// plain `CUDAPluggableAllocator`; where the process has no libstdc++ to
/// throw with, it aborts as `gpualloc_malloc_or_abort`.
#[unsafe(no_mangle)]
pub extern "C-unwind" fn gpualloc_malloc_or_raise(
    size: usize,
    device: c_int,
    stream: cudaStream_t,
) -> *mut c_void {
    let p = malloc_on(size, device, stream, true);
    if p.is_null() && size > 0 {
        cxx_error::throw_runtime_error(&failure_message());
        abort_for_failure(); // nothing to throw with
    }
    p
}

/// The calling thread's last error, or a general one.
fn failure_message() -> String {
    last_error_string().unwrap_or_else(|| "gpualloc: allocation failed".to_string())
}

fn abort_for_failure() -> ! {
    let msg = failure_message();
    crate::boundary::say(format_args!(
        "{msg}\ngpualloc: aborting: PyTorch was given gpualloc without its bridge and cannot receive an error from it (see the gpualloc package docs)"
    ));
    crate::trace::complete_before_abort();
    std::process::abort();
}

/// Frees a pointer from `gpualloc_malloc` (PyTorch's pluggable `free`).
/// `size` and `stream` are ignored: the allocator knows both; a negative
/// `device` lets gpualloc find the device that allocated `ptr`. NULL is a no-op
/// (it creates nothing). A pointer gpualloc does not know is reported on
/// stderr and in the last error; an allocator that cannot start (a bad
/// `GPUALLOC_CONF`) is reported on stderr once. In a child forked after
/// the allocator started, a no-op: the memory is the parent's. Where
/// PyTorch is loaded, its current stream on `device` is read: a free made
/// while another stream than the block's is current waits for that
/// stream's queued work, as `gpualloc_free_on` (Note [The current stream
/// without the bridge]).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: cudaStream_t,
) {
    let _ = (size, stream);
    // PyTorch's current stream, where it is in the process (Note [The
    // current stream without the bridge] in `torch_stream.rs`).
    free_from(ptr, device, || torch_stream::current(i64::from(device)));
}

/// `gpualloc_free` of `ptr`, made where `current` is the current stream of
/// `device` (which must be the device that allocated `ptr`, or negative:
/// then `current` is not used). Work queued on a stream other than the
/// block's may still use it: the free then counts as `record_stream` on
/// that stream first (Note [Frees on another stream] in the core). What
/// the torch bridge calls from its deleters.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_free_on(ptr: *mut c_void, device: c_int, current: cudaStream_t) {
    free_from(ptr, device, || {
        (device >= 0).then_some(current as usize as u64)
    });
}

/// The body of `gpualloc_free` and `gpualloc_free_on`; `current` is asked
/// for the current stream only in the process that started the allocator.
fn free_from(ptr: *mut c_void, device: c_int, current: impl FnOnce() -> Option<u64>) {
    boundary::clear_last_error();
    if ptr.is_null() {
        return;
    }
    if fork::in_forked_child() {
        fork::free(ptr as usize as u64);
        return;
    }
    ffi_boundary(
        |code| {
            static START_FAILURE_SHOWN: AtomicBool = AtomicBool::new(false);
            let start_failure = existing().is_none();
            if start_failure && START_FAILURE_SHOWN.swap(true, Ordering::Relaxed) {
                return;
            }
            match last_error_string() {
                Some(msg) => crate::boundary::say(format_args!("{msg}")),
                None => crate::boundary::say(format_args!(
                    "gpualloc: free of {ptr:p} failed with status {code}"
                )),
            }
        },
        || {
            let Some(g) = existing() else {
                // Nothing was allocated: report a configuration that cannot
                // start first, without starting the allocator.
                global::idle_count()?;
                return Err(not_ours("free", ptr));
            };
            let ptr = ptr as usize as u64;
            if device >= 0 {
                return Ok(g.alloc.free_from(i64::from(device), ptr, current())?);
            }
            // A deleter that cannot name the device (the bridge, once the
            // process has allocated on several): the block's own device is
            // found, and PyTorch's current stream there read, so that a
            // free while another stream is current still waits for that
            // stream's work (Note [The current stream without the bridge]).
            // Two lookups, not one with the stream read inside: c10 is not
            // called while a device's lock is held.
            match g.alloc.with_owner(ptr, |d| Ok(d.ordinal())) {
                Some(Ok(owner)) => {
                    let owner = i64::from(owner);
                    Ok(g.alloc
                        .free_from(owner, ptr, torch_stream::current(owner))?)
                }
                _ => Ok(g.alloc.free_from(-1, ptr, None)?),
            }
        },
    );
}

/// `gpualloc_free` of `ptr` that finds its device and writes the block size
/// it gave back to `*size` and the device to `*device` (either may be NULL):
/// what torch's memory profiler is told of a free. `GPUALLOC_OK`, or
/// `GPUALLOC_ERR_INVALID_POINTER` for a pointer gpualloc does not hold
/// (NULL included); nothing is printed. In a child forked after the
/// allocator started, as `gpualloc_free` there, with a size of 0 and a
/// device of -1.
///
/// # Safety
/// `size` and `device` are NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_free_sized(
    ptr: *mut c_void,
    size: *mut u64,
    device: *mut c_int,
) -> c_int {
    status(|| {
        // In a forked child no device is named (-1): nothing there may
        // ask a device about the free (its lock may be held for good).
        let (d, s) = if fork::in_forked_child() {
            fork::free(ptr as usize as u64);
            (-1, 0)
        } else {
            let g = existing().ok_or_else(|| not_ours("free_sized", ptr))?;
            if ptr.is_null() {
                return Err(not_ours("free_sized", ptr));
            }
            let (d, s) = g.alloc.free_sized(ptr as usize as u64)?;
            (d as c_int, s)
        };
        if !size.is_null() {
            boundary::write_out(size, s, "size")?;
        }
        if !device.is_null() {
            boundary::write_out(device, d, "device")?;
        }
        Ok(())
    })
}

/// The block size of the live allocation at `ptr` (its request rounded as
/// the allocator rounds it), written to `*size`: what torch's memory
/// profiler is told of an allocation. `GPUALLOC_OK`, or
/// `GPUALLOC_ERR_INVALID_POINTER` for a pointer gpualloc does not hold.
///
/// # Safety
/// `size` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_allocation_size(ptr: *mut c_void, size: *mut u64) -> c_int {
    status(|| {
        let g = existing().ok_or_else(|| not_ours("allocation_size", ptr))?;
        let s = g
            .alloc
            .allocation_size(ptr as usize as u64)?
            .ok_or_else(|| not_ours("allocation_size", ptr))?;
        boundary::write_out(size, s, "size")
    })
}

/// The error of call `what` for a pointer gpualloc never allocated.
fn not_ours(what: &str, ptr: *mut c_void) -> Error {
    Error::new(
        GPUALLOC_ERR_INVALID_POINTER,
        format!("gpualloc: {what}: pointer {ptr:p} was not allocated by gpualloc"),
    )
}

fn last_error_string() -> Option<String> {
    let p = boundary::last_error_ptr();
    if p.is_null() {
        return None;
    }
    // SAFETY: a non-NULL last error is this thread's live, NUL-terminated CString.
    let s = unsafe { std::ffi::CStr::from_ptr(p) };
    Some(s.to_string_lossy().into_owned())
}

/// PyTorch's `enablePeerAccess(peer, device)` after the driver enabled
/// it: lets kernels on device `peer` read and write device `device`'s
/// memory, which expandable segments map for `device` alone until asked.
/// Every mapping of `device`, present and future, becomes accessible to
/// `peer` (PyTorch's `addPeerAccess`). Returns `GPUALLOC_OK` or an error
/// code (an index out of range, or the driver's refusal).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_add_peer_access(device: c_int, peer: c_int) -> c_int {
    status(|| {
        let g = global()?;
        let own = g.alloc.add_peer_access(i64::from(device), i64::from(peer));
        // Memory other processes shared too, even when one of the device's
        // own mappings was refused (both remember the peer for later ones).
        if g.kind == global::BackendKind::Cuda
            && !matches!(own, Err(gpualloc::AllocError::InvalidDevice { .. }))
        {
            ipc::add_peer(device as u32, peer as u32)?;
        }
        Ok(own?)
    })
}

/// Marks `ptr` as used on `stream` too (`Tensor.record_stream`; PyTorch's
/// `record_stream` hook): its memory is reused only after the work queued on
/// `stream` at free time completes. The device is found from the pointer.
/// A default stream (handle 0, 1 or 2) is taken for the pointer's own
/// device's: `gpualloc_record_stream_on` says which device's it is.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_record_stream(ptr: *mut c_void, stream: cudaStream_t) {
    void_call(|| record_stream(ptr, stream, None));
}

/// `gpualloc_record_stream` with the device `stream` belongs to
/// (`stream_device`; negative: the pointer's own), so that another GPU's
/// default stream is not taken for the pointer's own device's (PyTorch's
/// `record_stream` passes a `CUDAStream`, which knows its device).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_record_stream_on(
    ptr: *mut c_void,
    stream: cudaStream_t,
    stream_device: c_int,
) {
    void_call(|| record_stream(ptr, stream, u32::try_from(stream_device).ok()));
}

fn record_stream(
    ptr: *mut c_void,
    stream: cudaStream_t,
    stream_device: Option<u32>,
) -> Result<(), Error> {
    if ptr.is_null() {
        return Ok(());
    }
    let Some(g) = existing() else {
        return Err(Error::new(
            GPUALLOC_ERR_INVALID_POINTER,
            format!("gpualloc: record_stream: pointer {ptr:p} was not allocated by gpualloc"),
        ));
    };
    let (ptr, stream) = (ptr as usize as u64, stream as usize as u64);
    match g.alloc.record_stream_anywhere(ptr, stream, stream_device) {
        Err(gpualloc::AllocError::InvalidPointer { .. }) => Err(Error::new(
            GPUALLOC_ERR_INVALID_POINTER,
            format!("gpualloc: record_stream: pointer {ptr:#x} was not allocated by gpualloc"),
        )),
        r => Ok(r?),
    }
}

/// Returns every cached, entirely free segment to the device
/// (`torch.cuda.empty_cache`; PyTorch's `reset` hook). Before the first
/// allocation there is nothing cached, and nothing is created. Nothing in
/// a child forked after CUDA started (Note [Freeing in a forked child]).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_empty_cache() {
    if fork::cuda_in_forked_child() {
        return; // Note [Freeing in a forked child]
    }
    void_call(|| match existing() {
        Some(g) => Ok(g.alloc.empty_cache()?),
        None => Ok(()),
    });
}

/// Caps reserved memory on `device` at `fraction` of its capacity
/// (`set_per_process_memory_fraction`; PyTorch's `memory_fraction` hook,
/// hence the argument order).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_set_memory_fraction(fraction: c_double, device: c_int) {
    void_call(|| {
        if !gpualloc::is_memory_fraction(fraction) {
            return Err(Error::invalid(format!(
                "gpualloc: memory fraction {fraction} is not in [0, 1]"
            )));
        }
        Ok(global()?
            .alloc
            .set_memory_fraction(i64::from(device), fraction)?)
    });
}

/// PyTorch's settings string `settings`, as torch took it at run time
/// (`torch.cuda.memory._set_allocator_settings`): before the allocator
/// starts, its `per_process_memory_fraction` becomes the cap each device
/// starts with, as PyTorch's allocator applies it when CUDA starts (Note
/// [PyTorch's fraction set at run time] in `global.rs`). 1 when it will; 0
/// when it changes nothing: the string has no such key, the allocator runs
/// already (as under PyTorch, where CUDA has started), or gpualloc's
/// configuration gives its own fraction, which wins. `GPUALLOC_ERR_CONFIG`
/// for a value PyTorch refuses too. Starts nothing.
///
/// # Safety
/// `settings` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_set_torch_settings(settings: *const c_char) -> c_int {
    boundary::str_flag_call(settings, "settings", global::set_torch_settings)
}

/// The fraction set for `device` (1.0 when none) into `*out`.
///
/// # Safety
/// `out` is NULL or points to a writable double.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_get_memory_fraction(device: c_int, out: *mut c_double) -> c_int {
    status(|| {
        let Some(g) = existing() else {
            // The cap the device would start with (PyTorch's setting too).
            let config = global::idle(i64::from(device))?;
            let f = global::start_fraction(&config)?.or(config.memory_fraction);
            return write_out(out, f.unwrap_or(1.0), "out");
        };
        let f = match g.alloc.peek(i64::from(device))? {
            Some(d) => d.memory_fraction(),
            None => g.alloc.start_fraction(),
        };
        write_out(out, f, "out")
    })
}

/// Caps reserved memory on `device` at `bytes`; 0 removes the byte limit,
/// as leaving `memory_limit` out of the configuration does (the
/// configuration refuses `memory_limit:0` for that reason: a 0-byte cap
/// would forbid every allocation).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_set_memory_limit(device: c_int, bytes: u64) -> c_int {
    status(|| {
        global()?
            .alloc
            .lock(i64::from(device))?
            .set_memory_limit((bytes > 0).then_some(bytes));
        Ok(())
    })
}

/// Free and total bytes of `device`, as the driver reports them;
/// `GPUALLOC_ERR_INVALID_ARGUMENT` when either pointer is NULL.
///
/// # Safety
/// `free_bytes` and `total_bytes` are NULL or point to writable uint64_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_mem_info(
    device: c_int,
    free_bytes: *mut u64,
    total_bytes: *mut u64,
) -> c_int {
    use gpualloc::Backend;
    status(|| {
        let info = global()?
            .alloc
            .lock(i64::from(device))?
            .backend_mut()
            .mem_info()?;
        write_out(free_bytes, info.free, "free_bytes")?;
        write_out(total_bytes, info.total, "total_bytes")
    })
}

/// Checks `device`'s internal invariants (tests, debugging): blocks tile
/// segments, free lists agree with blocks, stats agree with both. Before
/// the first allocation there is nothing to check, and nothing is created.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_check_invariants(device: c_int) -> c_int {
    status(|| {
        let Some(g) = existing() else {
            return global::idle(i64::from(device)).map(drop);
        };
        // A device never used has nothing to check and is not started.
        let Some(d) = g.alloc.peek_healthy(i64::from(device))? else {
            return Ok(());
        };
        d.check_invariants().map_err(|e| {
            Error::new(
                GPUALLOC_ERR_INVARIANT,
                format!("gpualloc: invariant violated: {e}"),
            )
        })
    })
}
