//! Private pools for CUDA graph capture and `torch.cuda.MemPool`.
//!
//! PyTorch's hooks pass a `MempoolId_t` (a pair of unsigned 64-bit ints) and
//! a `std::function<bool(cudaStream_t)>`; C cannot receive those, so the C
//! ABI takes the pair as two integers and the filter as a function pointer
//! plus a context pointer (the torch bridge wraps the `std::function`).

use std::ffi::{CStr, c_char, c_int, c_void};

use gpualloc::{AllocError, Allocator, BackendError, SegmentSource, StreamFilter};

use crate::boundary::{
    Error, GPUALLOC_ERR_UNKNOWN_POOL, GPUALLOC_OK, array_arg, copy_out, fits, status, write_out,
};
use crate::cudaStream_t;
use crate::global::{self, AnyBackend, existing, global};

/// [`status`] in the process whose pools these are; `GPUALLOC_OK` at once
/// in a forked child, which inherited them (a graph or MemPool destroyed,
/// a scope closed there) but cannot use them, and whose device locks a
/// thread the fork left behind may hold for good (Note [Freeing in a
/// forked child]).
fn status_in_parent(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    if crate::fork::in_forked_child() {
        return GPUALLOC_OK;
    }
    status(f)
}

/// Before the first allocation no pool exists (and none is created to say so).
pub(crate) fn no_pool(device: c_int, pool: (u64, u64)) -> Error {
    match global::idle(i64::from(device)) {
        Ok(_) => pool_error(device, AllocError::UnknownPool { pool }),
        Err(e) => e,
    }
}

/// A pool call's error, with the device named where the allocator's
/// message leaves it out.
pub(crate) fn pool_error(device: c_int, e: impl Into<Error>) -> Error {
    let mut err = e.into();
    if err.code == GPUALLOC_ERR_UNKNOWN_POOL {
        err.message.push_str(&format!(" on device {device}"));
    }
    err
}

/// What a message calls pool `(id_a, id_b)` of `device`.
pub(crate) fn pool_name(device: c_int, id_a: u64, id_b: u64) -> String {
    format!("private pool ({id_a}, {id_b}) on device {device}")
}

/// Decides whether an allocation on `stream` goes to the pool: non-zero yes.
/// Called under the allocator's lock: it must not call gpualloc.
pub type GpuallocStreamFilter =
    Option<unsafe extern "C" fn(ctx: *mut c_void, stream: cudaStream_t) -> c_int>;

struct CFilter {
    f: unsafe extern "C" fn(*mut c_void, cudaStream_t) -> c_int,
    ctx: *mut c_void,
}

// SAFETY: the contract of gpualloc_begin_allocate_to_pool requires that
// `filter(ctx, ..)` may be called from any thread until the matching
// gpualloc_end_allocate_to_pool returns.
unsafe impl Send for CFilter {}

impl CFilter {
    fn accepts(&self, stream: u64) -> bool {
        // SAFETY: `f` and `ctx` came together from the caller, who keeps them
        // valid until the scope ends (which drops this filter).
        unsafe { (self.f)(self.ctx, stream as usize as cudaStream_t) != 0 }
    }
}

/// Opens an allocation scope on `device`: until the matching
/// `gpualloc_end_allocate_to_pool`, allocations on streams that `filter`
/// accepts (every stream when `filter` is NULL) come from private pool
/// `(id_a, id_b)`, created on first use. Scopes of other pools nest; the innermost whose
/// filter accepts a stream wins. While a scope is open the allocator behaves
/// as during a CUDA graph capture (no event queries, no frees to the device).
/// A second scope of a pool whose scope is open is refused, as PyTorch
/// refuses it (`GPUALLOC_ERR_INVALID_ARGUMENT`, nothing changed).
///
/// # Safety
/// `filter(ctx, stream)` must be callable from any thread until
/// `gpualloc_end_allocate_to_pool(device, id_a, id_b)` returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_begin_allocate_to_pool(
    device: c_int,
    id_a: u64,
    id_b: u64,
    filter: GpuallocStreamFilter,
    ctx: *mut c_void,
) -> c_int {
    status(|| {
        let filter: Option<StreamFilter> = filter.map(|f| {
            let cf = CFilter { f, ctx };
            Box::new(move |s| cf.accepts(s)) as StreamFilter
        });
        Ok(global()?
            .alloc
            .begin_allocate_to_pool(i64::from(device), (id_a, id_b), filter)?)
    })
}

/// Closes the innermost open scope of pool `(id_a, id_b)` on `device`.
/// Nothing in a forked child, as for `gpualloc_release_pool`.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_end_allocate_to_pool(device: c_int, id_a: u64, id_b: u64) -> c_int {
    status_in_parent(|| {
        let g = existing().ok_or_else(|| no_pool(device, (id_a, id_b)))?;
        Ok(g.alloc
            .end_allocate_to_pool(i64::from(device), (id_a, id_b))?)
    })
}

/// PyTorch's `graph_capture_record_stream_reuse` on `device` (the bridge
/// passes its value when a capture's scope opens): nonzero turns reuse
/// inside a capture on, as the configuration key of the same name does;
/// 0 leaves only the key (Note [Reuse inside a capture] in the core).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_set_graph_capture_record_stream_reuse(
    device: c_int,
    on: c_int,
) -> c_int {
    status(|| {
        Ok(global()?
            .alloc
            .set_graph_capture_record_stream_reuse(i64::from(device), on != 0)?)
    })
}

/// PyTorch's `expandable_segments` setting, on every device: nonzero
/// `plain` when it says off (its `PYTORCH_CUDA_ALLOC_CONF`, or
/// `torch.cuda.memory._set_allocator_settings` at run time), 0 when it says
/// on again. While off, requests outside private pools take plain segments
/// (shareable with `cudaIpcGetMemHandle`, as PyTorch's), and a private pool
/// created meanwhile grows by plain segments; nothing mapped moves (Note
/// [PyTorch's expandable_segments switch] in the core). No effect where
/// `expandable_segments:false` makes every segment plain already. Before
/// the allocator starts it is kept for the start, and starts nothing.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_set_plain_requests(plain: c_int) -> c_int {
    status(|| crate::global::set_plain_requests(plain != 0))
}

/// Drops one hold on pool `(id_a, id_b)` (a graph or MemPool was destroyed);
/// at zero its cached memory goes back to the device. Nothing in a forked
/// child (a DataLoader worker's garbage collector destroying an inherited
/// graph or MemPool), as for frees (Note [Freeing in a forked child]).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_release_pool(device: c_int, id_a: u64, id_b: u64) -> c_int {
    status_in_parent(|| {
        let g = existing().ok_or_else(|| no_pool(device, (id_a, id_b)))?;
        Ok(g.alloc.release_pool(i64::from(device), (id_a, id_b))?)
    })
}

/// Creates private pool `(id_a, id_b)` on `device` if absent and takes one
/// hold on it, opening no allocation scope (PyTorch's `createOrIncrefPool`).
/// Each hold is dropped by one `gpualloc_release_pool`;
/// `gpualloc_begin_allocate_to_pool` takes a hold too.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_create_or_incref_pool(device: c_int, id_a: u64, id_b: u64) -> c_int {
    status(|| {
        Ok(global()?
            .alloc
            .create_or_incref_pool(i64::from(device), (id_a, id_b))?)
    })
}

/// Another allocator that serves a private pool's segments
/// (`torch.cuda.MemPool(allocator=...)`; Note [Pools served by another
/// allocator]). Its functions are called under the allocator's lock, from
/// any thread: they must not call gpualloc.
#[repr(C)]
pub struct GpuallocSegmentSource {
    /// Passed back to each function.
    pub ctx: *mut c_void,
    /// A segment of `size` bytes on `device` for work on `stream`; NULL
    /// when the other allocator has no room (gpualloc then gives its own
    /// cache back and asks again, then reports out of memory). During a
    /// capture it runs in relaxed capture mode, as PyTorch calls raw_alloc.
    pub alloc: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            size: usize,
            device: c_int,
            stream: cudaStream_t,
        ) -> *mut c_void,
    >,
    /// Gives back a segment `alloc` returned; called only once the device
    /// has finished all work queued before.
    pub free: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            ptr: *mut c_void,
            size: usize,
            device: c_int,
            stream: cudaStream_t,
        ),
    >,
    /// Called once when gpualloc no longer needs the source (the pool is
    /// gone, or it was not taken); may be NULL.
    pub drop: Option<unsafe extern "C" fn(ctx: *mut c_void)>,
    /// The other allocator's name, for messages (copied); may be NULL.
    pub name: *const c_char,
}

/// A [`GpuallocSegmentSource`] as the allocator holds it.
struct CSource {
    ctx: *mut c_void,
    alloc: unsafe extern "C" fn(*mut c_void, usize, c_int, cudaStream_t) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int, cudaStream_t),
    drop: Option<unsafe extern "C" fn(*mut c_void)>,
    name: String,
    device: c_int,
}

// SAFETY: the contract of gpualloc_create_or_incref_pool_from requires that
// the source's functions may be called with `ctx` from any thread until
// its `drop` is called.
unsafe impl Send for CSource {}

impl SegmentSource for CSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn allocate(&mut self, size: u64, stream: u64) -> Result<u64, BackendError> {
        let bytes =
            usize::try_from(size).map_err(|_| BackendError::OutOfMemory { requested: size })?;
        // SAFETY: `alloc` and `ctx` came together from the caller, valid
        // until `drop` (see the contract above).
        let p = unsafe {
            (self.alloc)(
                self.ctx,
                bytes,
                self.device,
                stream as usize as cudaStream_t,
            )
        };
        if p.is_null() {
            return Err(BackendError::OutOfMemory { requested: size });
        }
        Ok(p as usize as u64)
    }

    fn release(&mut self, ptr: u64, size: u64, stream: u64) -> Result<(), BackendError> {
        // SAFETY: as in `allocate`; `ptr` and `size` are a segment `alloc`
        // returned and that was not given back before.
        unsafe {
            (self.free)(
                self.ctx,
                ptr as usize as *mut c_void,
                size as usize,
                self.device,
                stream as usize as cudaStream_t,
            )
        };
        Ok(())
    }
}

impl Drop for CSource {
    fn drop(&mut self) {
        if let Some(d) = self.drop {
            // SAFETY: called once, last; the caller may free `ctx` in it.
            unsafe { d(self.ctx) };
        }
    }
}

/// `gpualloc_create_or_incref_pool` for a pool whose segments come from
/// another allocator, `*source` (PyTorch's `createOrIncrefPool` with an
/// allocator, from `torch.cuda.MemPool(allocator=...)`): the pool grows by
/// plain segments of PyTorch's sizes from `source->alloc`, whatever the
/// configuration, caches, splits and merges them as PyTorch does, and gives
/// them back through `source->free` where a plain segment would go back to
/// the device. A pool that exists already keeps how it is served. In every
/// case `source->drop` is called exactly once, when gpualloc no longer
/// needs the source (at once when it is not taken, or on an error).
/// `GPUALLOC_ERR_INVALID_ARGUMENT` for a NULL `source`, `alloc` or `free`.
///
/// # Safety
/// `source` is NULL or points to a readable `GpuallocSegmentSource` whose
/// `name` is NULL or a NUL-terminated string; its functions may be called
/// with its `ctx`, from any thread, until its `drop` is called.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_create_or_incref_pool_from(
    device: c_int,
    id_a: u64,
    id_b: u64,
    source: *const GpuallocSegmentSource,
) -> c_int {
    status(|| {
        if source.is_null() {
            return Err(Error::invalid("source is NULL"));
        }
        // SAFETY: non-null, readable per the contract.
        let s = unsafe { &*source };
        let name = if s.name.is_null() {
            "another allocator".to_string()
        } else {
            // SAFETY: NUL-terminated per the contract.
            unsafe { CStr::from_ptr(s.name) }
                .to_string_lossy()
                .into_owned()
        };
        let (Some(alloc), Some(free)) = (s.alloc, s.free) else {
            if let Some(d) = s.drop {
                // SAFETY: the source is not taken: dropped at once, per the contract.
                unsafe { d(s.ctx) };
            }
            return Err(Error::invalid(
                "source->alloc and source->free must not be NULL",
            ));
        };
        let source = Box::new(CSource {
            ctx: s.ctx,
            alloc,
            free,
            drop: s.drop,
            name,
            device,
        });
        Ok(global()?
            .alloc
            .create_or_incref_pool_from(i64::from(device), (id_a, id_b), source)?)
    })
}

/// PyTorch's `setUseOnOOM` (`torch.cuda.MemPool(use_on_oom=True)`): while
/// held, pool `(id_a, id_b)`'s free blocks serve a request outside any
/// pool that would fail otherwise (`on` non-zero; 0 turns it off).
/// `GPUALLOC_ERR_UNKNOWN_POOL` for an unknown pool. Nothing in a forked
/// child (an inherited MemPool's destructor turns it off there), as for
/// `gpualloc_release_pool`.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_set_pool_use_on_oom(
    device: c_int,
    id_a: u64,
    id_b: u64,
    on: c_int,
) -> c_int {
    status_in_parent(|| {
        let g = existing().ok_or_else(|| no_pool(device, (id_a, id_b)))?;
        g.alloc
            .set_pool_use_on_oom(i64::from(device), (id_a, id_b), on != 0)
            .map_err(|e| pool_error(device, e))
    })
}

/// PyTorch's `setNoSplit` (`torch.cuda.MemPool(no_split=True)`): pool
/// `(id_a, id_b)`'s blocks are never split; a pool with no segment yet
/// grows by plain segments from then on. `GPUALLOC_ERR_UNKNOWN_POOL` for an
/// unknown pool. Nothing in a forked child, as for `gpualloc_release_pool`.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_set_pool_no_split(device: c_int, id_a: u64, id_b: u64) -> c_int {
    status_in_parent(|| {
        let g = existing().ok_or_else(|| no_pool(device, (id_a, id_b)))?;
        g.alloc
            .set_pool_no_split(i64::from(device), (id_a, id_b))
            .map_err(|e| pool_error(device, e))
    })
}

/// Writes the holds on pool `(id_a, id_b)` of `device` to `*out`: 0 for an
/// unknown pool (not an error), or one released to zero that still has
/// live blocks.
///
/// # Safety
/// `out` is NULL (`GPUALLOC_ERR_INVALID_ARGUMENT`) or points to a writable uint32_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_pool_use_count(
    device: c_int,
    id_a: u64,
    id_b: u64,
    out: *mut u32,
) -> c_int {
    status(|| {
        let count = match existing() {
            Some(g) => g.alloc.pool_use_count(i64::from(device), (id_a, id_b))?,
            None => global::idle(i64::from(device)).map(|_| 0)?,
        };
        write_out(out, count, "out")
    })
}

/// PyTorch's `emptyCache(mempool_id)`: when pool `(id_a, id_b)` exists and
/// nothing holds it (use count 0), its cached free memory goes back to the
/// device, as `gpualloc_release_pool` does at zero. A held or unknown pool
/// is left alone (`GPUALLOC_OK`); so is every pool while a capture is open,
/// and everything in a forked child (as `gpualloc_release_pool`).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_empty_pool_cache(device: c_int, id_a: u64, id_b: u64) -> c_int {
    status_in_parent(|| match existing() {
        Some(g) => Ok(g.alloc.empty_pool_cache(i64::from(device), (id_a, id_b))?),
        None => global::idle(i64::from(device)).map(|_| ()),
    })
}

/// Writes the addresses of the blocks allocated in pool `(id_a, id_b)` of
/// `device` (small and large sub-pools), in address order, to `out`, and
/// their count to `*n` (always). `GPUALLOC_ERR_BUFFER_TOO_SMALL` when `cap`
/// is below the count: then nothing is written to `out` (ask with
/// `out == NULL, cap == 0`). `GPUALLOC_ERR_UNKNOWN_POOL` for an unknown pool.
///
/// # Safety
/// `out` is NULL (only with `cap == 0`) or points to `cap` writable
/// uint64_t; `n` points to a writable size_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_pool_live_allocations(
    device: c_int,
    id_a: u64,
    id_b: u64,
    out: *mut u64,
    cap: usize,
    n: *mut usize,
) -> c_int {
    status(|| {
        pool_array(
            device,
            (id_a, id_b),
            out,
            cap,
            n,
            "live allocations",
            |a, d, k| a.pool_live_allocations(d, k),
        )
    })
}

/// Copies what `list` gives for pool `key` of `device` to the caller's array
/// `out` of `cap` entries, and the count to `*n` (see `array_arg`, `fits`).
pub(crate) fn pool_array<T: Copy>(
    device: c_int,
    key: (u64, u64),
    out: *mut T,
    cap: usize,
    n: *mut usize,
    what: &str,
    list: impl FnOnce(&Allocator<AnyBackend>, i64, (u64, u64)) -> Result<Vec<T>, AllocError>,
) -> Result<(), Error> {
    array_arg(out, cap, n, "n")?;
    let g = existing().ok_or_else(|| no_pool(device, key))?;
    let items = list(&g.alloc, i64::from(device), key).map_err(|e| pool_error(device, e))?;
    fits(items.len(), cap, n, || {
        format!("the {what} of {}", pool_name(device, key.0, key.1))
    })?;
    copy_out(&items, out);
    Ok(())
}
