//! Private pools for CUDA graph capture and `torch.cuda.MemPool`.
//!
//! PyTorch's hooks pass a `MempoolId_t` (a pair of unsigned 64-bit ints) and
//! a `std::function<bool(cudaStream_t)>`; C cannot receive those, so the C
//! ABI takes the pair as two integers and the filter as a function pointer
//! plus a context pointer (the torch bridge wraps the `std::function`).

use std::ffi::{c_int, c_void};

use gpualloc::{AllocError, StreamFilter};

use crate::boundary::{Error, status};
use crate::cudaStream_t;
use crate::global::{self, existing, global};

/// Before the first allocation no pool exists (and none is created to say so).
fn no_pool(device: c_int, pool: (u64, u64)) -> Error {
    match global::idle(i64::from(device)) {
        Ok(_) => AllocError::UnknownPool { pool }.into(),
        Err(e) => e,
    }
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
/// `(id_a, id_b)`, created on first use. Scopes nest; the innermost whose
/// filter accepts a stream wins. While a scope is open the allocator behaves
/// as during a CUDA graph capture (no event queries, no frees to the device).
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
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_end_allocate_to_pool(device: c_int, id_a: u64, id_b: u64) -> c_int {
    status(|| {
        let g = existing().ok_or_else(|| no_pool(device, (id_a, id_b)))?;
        Ok(g.alloc
            .end_allocate_to_pool(i64::from(device), (id_a, id_b))?)
    })
}

/// Drops one hold on pool `(id_a, id_b)` (a graph or MemPool was destroyed);
/// at zero its cached memory goes back to the device.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_release_pool(device: c_int, id_a: u64, id_b: u64) -> c_int {
    status(|| {
        let g = existing().ok_or_else(|| no_pool(device, (id_a, id_b)))?;
        Ok(g.alloc.release_pool(i64::from(device), (id_a, id_b))?)
    })
}
