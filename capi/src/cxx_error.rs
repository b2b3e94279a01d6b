//! A C++ `std::runtime_error`, thrown from Rust into PyTorch.
//!
//! Note [An error PyTorch can catch without the bridge]
//! Rationale: without gpualloc's torch bridge (a machine where it cannot
//! be compiled), PyTorch calls `gpualloc_malloc_or_raise` through its plain
//! `CUDAPluggableAllocator`, which never checks the pointer it gets back: a
//! NULL would become a tensor at address 0 and a fault far from the cause.
//! PyTorch's own allocator raises a C++ exception there, which torch turns
//! into a Python error. So does this, without a C++ compiler at build time
//! or a C++ runtime the library links: the process that loaded torch
//! already has libstdc++, and the Itanium C++ ABI that g++ and clang follow
//! on Linux fixes how to throw (`__cxa_allocate_exception`, construct,
//! `__cxa_throw` with the type's `type_info`). The five symbols come from
//! that libstdc++ (`dlopen` with `RTLD_NOLOAD`: one already loaded, never
//! another). The object is a `std::runtime_error` made from the message,
//! which torch's Python layer raises as `RuntimeError` with the text
//! (libraries that retry a smaller batch look for "CUDA out of memory." in
//! it); not `torch.cuda.OutOfMemoryError`, a c10 type whose layout changes
//! with torch's version. Where no libstdc++ is loaded, or a symbol is
//! missing, there is nothing to throw and the caller aborts, as before.
//! The exception passes through two Rust frames only, once the allocator
//! has let go of everything: the one that throws and the entry point,
//! `extern "C-unwind"` and called from C++; unwinding them drops the
//! message's text they hold (the release profile unwinds, never aborts, on
//! a panic, which such an unwind needs).

use std::ffi::{CString, c_char, c_void};
use std::sync::OnceLock;

/// `std::runtime_error` is two words (a vtable and a reference-counted
/// string) in libstdc++; room for more costs nothing.
const OBJECT_BYTES: usize = 64;

/// libstdc++'s entry points for throwing a `std::runtime_error`.
struct Thrower {
    allocate: unsafe extern "C" fn(usize) -> *mut c_void,
    /// `std::runtime_error::runtime_error(const char*)`.
    construct: unsafe extern "C-unwind" fn(*mut c_void, *const c_char),
    /// `std::runtime_error::~runtime_error()`.
    destroy: unsafe extern "C" fn(*mut c_void),
    throw: unsafe extern "C-unwind" fn(
        *mut c_void,
        *const c_void,
        unsafe extern "C" fn(*mut c_void),
    ) -> !,
    /// `typeid(std::runtime_error)`.
    type_info: *const c_void,
}

// SAFETY: function pointers and the address of a static `type_info`, all
// immutable and valid for the life of the process (libstdc++ is never
// unloaded: the handle that found them is kept open).
unsafe impl Send for Thrower {}
// SAFETY: as for Send; nothing in it changes.
unsafe impl Sync for Thrower {}

fn thrower() -> Option<&'static Thrower> {
    static THROWER: OnceLock<Option<Thrower>> = OnceLock::new();
    THROWER.get_or_init(find).as_ref()
}

fn find() -> Option<Thrower> {
    // SAFETY: `dlopen` of a NUL-terminated name with RTLD_NOLOAD loads
    // nothing; the handle, if any, is kept open for the process's life.
    let lib = unsafe {
        libc::dlopen(
            c"libstdc++.so.6".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        )
    };
    if lib.is_null() {
        return None;
    }
    let symbol = |name: &std::ffi::CStr| {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let allocate = symbol(c"__cxa_allocate_exception")?;
    let throw = symbol(c"__cxa_throw")?;
    let construct = symbol(c"_ZNSt13runtime_errorC1EPKc")?;
    let destroy = symbol(c"_ZNSt13runtime_errorD1Ev")?;
    let type_info = symbol(c"_ZTISt13runtime_error")?;
    // SAFETY: each address is libstdc++'s definition of the named symbol,
    // whose C++ signature (Itanium ABI: `this` first, `__cxa_*` as
    // declared in <cxxabi.h>) is the function type it is given here.
    unsafe {
        Some(Thrower {
            allocate: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(usize) -> *mut c_void>(
                allocate,
            ),
            construct: std::mem::transmute::<
                *mut c_void,
                unsafe extern "C-unwind" fn(*mut c_void, *const c_char),
            >(construct),
            destroy: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut c_void)>(destroy),
            throw: std::mem::transmute::<
                *mut c_void,
                unsafe extern "C-unwind" fn(
                    *mut c_void,
                    *const c_void,
                    unsafe extern "C" fn(*mut c_void),
                ) -> !,
            >(throw),
            type_info: type_info.cast_const(),
        })
    }
}

/// Throws `std::runtime_error(message)` to the C++ code that called into
/// the library; returns only when this process has no libstdc++ to throw
/// with. A NUL inside `message` ends it there.
///
/// Call it only from an `extern "C-unwind"` function whose caller is C++
/// that can take an exception (PyTorch), holding no lock.
pub(crate) fn throw_runtime_error(message: &str) {
    let Some(t) = thrower() else { return };
    let text = message.split('\0').next().unwrap_or_default();
    let text = CString::new(text).unwrap_or_default();
    // SAFETY: `allocate` returns storage for an exception object of at
    // least OBJECT_BYTES (or terminates), which `construct` fills with a
    // runtime_error copying the NUL-terminated `text` into its own string
    // (so `text` may go before the throw). `throw` takes the object with
    // its type and destructor, and unwinds to the C++ caller.
    unsafe {
        let object = (t.allocate)(OBJECT_BYTES);
        (t.construct)(object, text.as_ptr());
        drop(text);
        (t.throw)(object, t.type_info, t.destroy)
    }
}
