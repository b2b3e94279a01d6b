//! Checkpoints of a private pool for cudagraph trees (`torch.compile`,
//! `mode="reduce-overhead"`): PyTorch's `getCheckpointState` and
//! `setCheckpointPoolState` (Note [Pool checkpoints] in the allocator crate).

use std::ffi::c_int;

use gpualloc::CheckpointBlock;

use crate::boundary::{Error, array_arg, copy_out, fits, status};
use crate::global::existing;
use crate::pools::{no_pool, pool_array, pool_error, pool_name};

/// One block of a private pool's checkpoint.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuallocBlockState {
    /// Start address.
    pub address: u64,
    /// Block size (rounded, as allocated).
    pub size: u64,
    /// The block's stream.
    pub stream: u64,
    /// Start of the mapped segment holding it.
    pub segment_address: u64,
    /// 1 allocated, 0 free.
    pub allocated: u8,
}

impl From<CheckpointBlock> for GpuallocBlockState {
    fn from(b: CheckpointBlock) -> Self {
        GpuallocBlockState {
            address: b.address,
            size: b.size,
            stream: b.stream,
            segment_address: b.segment_address,
            allocated: u8::from(b.allocated),
        }
    }
}

impl From<GpuallocBlockState> for CheckpointBlock {
    fn from(b: GpuallocBlockState) -> Self {
        CheckpointBlock {
            address: b.address,
            size: b.size,
            stream: b.stream,
            segment_address: b.segment_address,
            allocated: b.allocated != 0,
        }
    }
}

/// Writes every block (free and allocated) of pool `(id_a, id_b)` of
/// `device`, in address order, to `out`, and their count to `*n` (always).
/// `GPUALLOC_ERR_BUFFER_TOO_SMALL` when `cap` is below the count: then
/// nothing is written to `out` (ask with `out == NULL, cap == 0`).
/// `GPUALLOC_ERR_UNKNOWN_POOL` for an unknown pool.
///
/// # Safety
/// `out` is NULL (only with `cap == 0`) or points to `cap` writable
/// `GpuallocBlockState`; `n` points to a writable size_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_pool_checkpoint(
    device: c_int,
    id_a: u64,
    id_b: u64,
    out: *mut GpuallocBlockState,
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
            "checkpoint",
            |a, d, k| {
                // Recorded only when the caller's buffer takes it.
                let blocks = a.pool_checkpoint_if(d, k, |b| b.len() <= cap)?;
                Ok(blocks.into_iter().map(GpuallocBlockState::from).collect())
            },
        )
    })
}

/// PyTorch's `setCheckpointPoolState` for pool `(id_a, id_b)` of `device`:
/// (1) frees every block allocated in the pool (their addresses go to
/// `freed`, in address order); (2) cuts the pool's free memory so that each
/// of the `n` checkpointed `blocks` exists exactly (a free one may merge
/// with free memory the pool mapped next to it since); (3) allocates the
/// blocks with `allocated == 1` (their addresses go to `allocd`, in the
/// order given). A block freed in (1) and allocated in (3) is in both lists.
/// These are ordinary frees and allocations for the stats and the trace.
/// A block's `segment_address` is not used (a segment may have grown at
/// either end since the checkpoint).
///
/// Everything is checked first, and a failure changes nothing:
/// `GPUALLOC_ERR_INVALID_ARGUMENT` when a block is not inside memory the
/// pool maps, blocks overlap, or a block of the pool is still used on other
/// streams (`gpualloc_record_stream`); `GPUALLOC_ERR_BUFFER_TOO_SMALL` when
/// `freed_cap` or `allocd_cap` is below the count it needs. `*n_freed` and
/// `*n_allocd` receive the needed counts (0 when the call failed before
/// knowing them).
///
/// # Safety
/// `blocks` is NULL (only with `n == 0`) or points to `n` readable
/// `GpuallocBlockState`; `freed` and `allocd` are NULL (only with a cap of
/// 0) or point to as many writable uint64_t as their caps say; `n_freed` and
/// `n_allocd` point to writable size_t.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpualloc_pool_restore(
    device: c_int,
    id_a: u64,
    id_b: u64,
    blocks: *const GpuallocBlockState,
    n: usize,
    freed: *mut u64,
    freed_cap: usize,
    n_freed: *mut usize,
    allocd: *mut u64,
    allocd_cap: usize,
    n_allocd: *mut usize,
) -> c_int {
    status(|| {
        array_arg(freed, freed_cap, n_freed, "n_freed")?;
        array_arg(allocd, allocd_cap, n_allocd, "n_allocd")?;
        let blocks: Vec<CheckpointBlock> = match n {
            0 => Vec::new(),
            _ if blocks.is_null() => {
                return Err(Error::invalid(format!(
                    "gpualloc: blocks is NULL with {n} blocks"
                )));
            }
            // SAFETY: non-NULL; the caller promises `n` readable blocks
            // that stay valid for the call.
            _ => unsafe { std::slice::from_raw_parts(blocks, n) }
                .iter()
                .map(|&b| CheckpointBlock::from(b))
                .collect(),
        };
        let key = (id_a, id_b);
        let g = existing().ok_or_else(|| no_pool(device, key))?;
        let name = || pool_name(device, id_a, id_b);
        let delta = g
            .alloc
            .restore_pool_if(i64::from(device), key, &blocks, |d| {
                let f = fits(d.freed.len(), freed_cap, n_freed, || {
                    format!("restoring {}: freed", name())
                });
                let a = fits(d.allocated.len(), allocd_cap, n_allocd, || {
                    format!("restoring {}: allocd", name())
                });
                f.and(a)
            })
            .map_err(|e| pool_error(device, e))?;
        copy_out(&delta.freed, freed);
        copy_out(&delta.allocated, allocd);
        Ok(())
    })
}
