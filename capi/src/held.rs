//! What a device's reserved memory is made of now, by the unit it can be
//! given back in (Note [Held memory by unit] in the core crate's
//! `held.rs`): the question "my tensors or the cache?" asked of the
//! running program, as `gpualloc replay` asks it of a trace's peak.

use std::ffi::c_int;

use crate::boundary::{status, write_out};
use crate::global::{self, existing};

/// Reserved bytes by unit: the four parts add up to reserved memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuallocHeld {
    /// Physical handles (expandable segments) or plain segments that back
    /// at least one byte in use.
    pub used_units: u64,
    /// Of `used_units`, the bytes no allocation holds: free bytes beside
    /// live blocks, given back only as those blocks are freed (with blocks
    /// waiting for events and the rest of stitches in use).
    pub used_units_unallocated: u64,
    /// Mapped units of the default pools (and of released private pools)
    /// that back no byte in use: cache, which `empty_cache` gives back.
    pub free_units: u64,
    /// Mapped units of private pools still held (CUDA graphs, `MemPool`)
    /// that back no byte in use: kept until the pool is released.
    pub free_private_units: u64,
    /// Physical handles unmapped and kept for reuse.
    pub pooled: u64,
}

/// Fills `*out` with `device`'s reserved memory by unit. A device not used
/// yet reports zeros and is not started.
///
/// # Safety
/// `out` is NULL or points to a writable `GpuallocHeld`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_held(device: c_int, out: *mut GpuallocHeld) -> c_int {
    status(|| {
        let held = match existing() {
            None => {
                global::idle(i64::from(device))?;
                GpuallocHeld::default()
            }
            Some(g) => match g.alloc.peek_healthy(i64::from(device))? {
                None => GpuallocHeld::default(),
                Some(d) => {
                    let h = d.held();
                    let allocated = d.stats().allocated_bytes.all.current as u64;
                    GpuallocHeld {
                        used_units: h.used_units,
                        used_units_unallocated: h.used_unallocated(allocated),
                        free_units: h.free_units,
                        free_private_units: h.free_private_units,
                        pooled: h.pooled,
                    }
                }
            },
        };
        write_out(out, held, "out")
    })
}
