//! Allocation errors: "can never fit" apart from "not now", with the numbers.

use std::fmt;

use crate::backend::{BackendError, DevicePtr};

/// Everything the allocator knew when an allocation failed.
#[derive(Clone, Debug, PartialEq)]
pub struct OomReport {
    /// Device index.
    pub device: u32,
    /// Bytes the caller asked for.
    pub requested: u64,
    /// The segment size that was needed from the device.
    pub needed: u64,
    /// Bytes in live allocations.
    pub allocated: u64,
    /// Bytes held from the device.
    pub reserved: u64,
    /// Bytes of live allocations in private (CUDA graph) pools.
    pub private_pools_allocated: u64,
    /// Free bytes on the device, as the driver reports them.
    pub device_free: u64,
    /// Device capacity.
    pub device_total: u64,
    /// The memory limit in force (fraction or bytes), if any.
    pub limit: Option<u64>,
    /// The largest cached free block.
    pub largest_free_block: u64,
    /// The largest cached free block the request could have used: of the
    /// pool and stream it was made for (the largest overall when the
    /// request had no pool yet).
    pub largest_free_usable: u64,
    /// A CUDA graph capture (or a pool scope) was underway: cached memory
    /// could not go back to the device to make room.
    pub capture_underway: bool,
    /// `1 - largest free block / total cached free bytes`.
    pub external_fragmentation: f64,
    /// `1 - allocated / reserved`.
    pub unallocated_fraction: f64,
    /// Why the backend refused, when it did.
    pub cause: Option<BackendError>,
}

/// `InvalidPointer::device` for a pointer looked up on every device.
pub const ANY_DEVICE: u32 = u32::MAX;

/// Why an allocator call failed.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum AllocError {
    /// Not now: the device (or the memory limit) has no room at the moment,
    /// even after releasing cached memory. Freeing tensors and retrying may
    /// succeed.
    OutOfMemory(Box<OomReport>),
    /// Never: the request exceeds the device's capacity (or the memory
    /// limit) even with nothing else allocated.
    TooLarge {
        /// Bytes asked for.
        requested: u64,
        /// The segment size it would need.
        needed: u64,
        /// The most any allocation can get: capacity or limit.
        max: u64,
        /// The device's total memory as the driver reports it (0 when it
        /// could not tell).
        total: u64,
        /// The device.
        device: u32,
        /// The memory limit in force (a memory fraction), if any.
        limit: Option<u64>,
    },
    /// The pointer was not handed out by this allocator on this device, or
    /// was freed already.
    InvalidPointer {
        /// The pointer.
        ptr: DevicePtr,
        /// The device it was presented to ([`ANY_DEVICE`] when the caller
        /// let gpualloc find the owner).
        device: u32,
    },
    /// No such device.
    InvalidDevice {
        /// The index given.
        device: i64,
        /// How many devices there are.
        count: usize,
    },
    /// A private pool id that was never begun, or was released already.
    UnknownPool {
        /// The pool id.
        pool: (u64, u64),
    },
    /// A scope of this private pool is open already (two captures into one
    /// pool at once): PyTorch's `beginAllocateToPool: already recording to
    /// mempool_id`. Nothing was changed.
    PoolBusy {
        /// The pool id.
        pool: (u64, u64),
    },
    /// A private pool cannot be put back to a checkpoint (a block outside
    /// the memory the pool maps, overlapping blocks, a block still used on
    /// other streams); nothing was changed.
    BadCheckpoint {
        /// The pool id.
        pool: (u64, u64),
        /// The device.
        device: u32,
        /// What is wrong, with the addresses.
        reason: String,
    },
    /// The backend failed in a way retrying will not fix.
    Backend(BackendError),
    /// An internal error (a panic) interrupted an operation on this device,
    /// so its bookkeeping can no longer be trusted; the device refuses
    /// further calls rather than hand out memory twice.
    Poisoned {
        /// The device.
        device: u32,
    },
    /// Another allocator serving a private pool called gpualloc from its
    /// own allocation, free or drop, which gpualloc runs holding the lock
    /// (Note [Pools served by another allocator]); nothing was done.
    CalledBack {
        /// The device called (-1: any, a call that looks for the owner of
        /// a pointer, or goes over every device).
        device: i64,
    },
    /// In a child forked from a process whose allocator runs, this device's
    /// lock was not released in time: most likely another thread of the
    /// parent held it at the fork, and no thread of the child will ever
    /// release it (Note [Locks held at a fork] in `allocator.rs`); nothing
    /// was done.
    HeldAtFork {
        /// The device.
        device: i64,
    },
}

impl AllocError {
    /// Whether this is an out-of-memory condition (either kind).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            AllocError::OutOfMemory(_) | AllocError::TooLarge { .. }
        )
    }
}

/// From this many bytes on PyTorch's message says "more than 1EB" rather
/// than the size (its `one_exa_bytes`).
const ONE_EB: u64 = 1 << 60;

/// Formats bytes the way PyTorch's messages do (its `format_size`:
/// `512 bytes`, `1.50 GiB`): a size stays in the smaller unit up to and
/// including the next power of 1024 (`1024 bytes`, `1024.00 MiB` for
/// 1 GiB), and nothing goes above GiB.
pub fn format_bytes(b: u64) -> String {
    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    if b <= KIB {
        format!("{b} bytes")
    } else if b <= MIB {
        format!("{:.2} KiB", b as f64 / KIB as f64)
    } else if b <= GIB {
        format!("{:.2} MiB", b as f64 / MIB as f64)
    } else {
        format!("{:.2} GiB", b as f64 / GIB as f64)
    }
}

/// Formats bytes in the largest binary unit up to TiB that leaves at least
/// one, with two decimals (`1.50 GiB`); below 1 KiB, the count and `unit`
/// (`512 B` for `unit` "B").
pub fn format_bytes_as(b: u64, unit: &str) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if b < 1024 {
        return format!("{b} {unit}");
    }
    let mut v = b as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

/// PyTorch's opening of an out-of-memory message, which scripts and tests
/// match: `CUDA out of memory. Tried to allocate 1.50 GiB.` (its own text
/// from 1 EB on), then, when the capacity is known, ` GPU 0 has a total
/// capacity of 79.18 GiB` for the caller to end.
fn opening(f: &mut fmt::Formatter<'_>, requested: u64, device: u32, total: u64) -> fmt::Result {
    if requested >= ONE_EB {
        write!(
            f,
            "CUDA out of memory. Tried to allocate more than 1EB memory."
        )?;
    } else {
        write!(
            f,
            "CUDA out of memory. Tried to allocate {}.",
            format_bytes(requested)
        )?;
    }
    if total > 0 {
        write!(
            f,
            " GPU {device} has a total capacity of {}",
            format_bytes(total)
        )?;
    }
    Ok(())
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory(r) => {
                let b = format_bytes;
                opening(f, r.requested, r.device, r.device_total)?;
                write!(
                    f,
                    " of which {} is free. gpualloc needed {} for it.",
                    b(r.device_free),
                    b(r.needed)
                )?;
                if let Some(l) = r.limit {
                    write!(f, " gpualloc's memory limit is {}.", b(l))?;
                }
                write!(
                    f,
                    " Of the reserved memory {} is allocated by PyTorch",
                    b(r.allocated)
                )?;
                if r.private_pools_allocated > 0 {
                    write!(f, " ({} in private pools)", b(r.private_pools_allocated))?;
                }
                write!(
                    f,
                    " and {} is reserved but unallocated ({:.1}% of reserved {}); the largest cached free block is {} (external fragmentation {:.1}%).",
                    b(r.reserved.saturating_sub(r.allocated)),
                    r.unallocated_fraction * 100.0,
                    b(r.reserved),
                    b(r.largest_free_block),
                    r.external_fragmentation * 100.0
                )?;
                if r.capture_underway && r.reserved > r.allocated {
                    write!(
                        f,
                        " A CUDA graph was being captured, and cached memory cannot go back to the device during a capture."
                    )?;
                }
                if r.largest_free_block >= r.needed && r.largest_free_usable < r.needed {
                    write!(
                        f,
                        " The largest cached free block this request could use is {}: the larger ones are cached for other streams or in other pools (CUDA graphs, MemPool).",
                        b(r.largest_free_usable)
                    )?;
                } else if r.reserved > r.allocated && r.reserved - r.allocated >= r.needed {
                    write!(
                        f,
                        " Enough memory is cached but fragmented: try max_split_size_mb, or replay the trace with `gpualloc replay` to compare configurations."
                    )?;
                }
                if let Some(c) = &r.cause {
                    write!(f, " (backend: {c})")?;
                }
                Ok(())
            }
            AllocError::TooLarge {
                requested,
                needed,
                max,
                total,
                device,
                limit,
            } => {
                opening(f, *requested, *device, *total)?;
                if *total > 0 {
                    write!(f, ".")?;
                }
                write!(
                    f,
                    " gpualloc needed {} for it, which can never fit: ",
                    format_bytes(*needed)
                )?;
                if *total == 0 {
                    // The driver told no capacity: only the per-request
                    // maximum refuses.
                    return write!(
                        f,
                        "gpualloc serves at most {} a request.",
                        format_bytes_as(crate::size_class::MAX_REQUEST, "B")
                    );
                }
                write!(f, "the most this device can hold is {}", format_bytes(*max))?;
                if *limit == Some(*max) {
                    write!(f, " under the memory limit")?;
                }
                write!(f, ".")
            }
            AllocError::InvalidPointer { ptr, device } if *device == ANY_DEVICE => write!(
                f,
                "gpualloc: pointer {ptr:#x} was not allocated by gpualloc on any device, or was freed already"
            ),
            AllocError::InvalidPointer { ptr, device } => {
                write!(
                    f,
                    "gpualloc: pointer {ptr:#x} was not allocated by gpualloc on device {device}, or was freed already"
                )
            }
            AllocError::InvalidDevice { device, count } => {
                write!(f, "gpualloc: invalid device {device} ({count} devices)")
            }
            AllocError::UnknownPool { pool } => {
                write!(f, "gpualloc: unknown private pool ({}, {})", pool.0, pool.1)
            }
            AllocError::PoolBusy { pool } => write!(
                f,
                "gpualloc: beginAllocateToPool: already recording to mempool_id ({}, {}): \
                 one capture or use_mem_pool scope at a time per pool",
                pool.0, pool.1
            ),
            AllocError::BadCheckpoint {
                pool,
                device,
                reason,
            } => write!(
                f,
                "gpualloc: cannot restore private pool ({}, {}) on device {device} to its checkpoint: {reason}; nothing was changed",
                pool.0, pool.1
            ),
            AllocError::Backend(e) => write!(f, "gpualloc: {e}"),
            AllocError::Poisoned { device } => write!(
                f,
                "gpualloc: device {device} is unusable: an internal error interrupted an operation on it and its state may be inconsistent; restart the process"
            ),
            AllocError::HeldAtFork { device } => write!(
                f,
                "gpualloc: {} cannot be used in this process: this process was forked from one whose allocator runs, and the device's lock was not released within 2 s, most likely because another thread of the parent held it at the fork, which no thread here will release (start worker processes with the 'spawn' start method, or fork before using the GPU)",
                device_words(*device, "a device")
            ),
            AllocError::CalledBack { device } => write!(
                f,
                "gpualloc: called ({}) from another allocator's allocation, free or drop for a MemPool it serves, which gpualloc runs holding its lock; that allocator must not allocate through PyTorch's allocator",
                device_words(*device, "any device")
            ),
        }
    }
}

/// "device N", or `none` for the -1 of a call that names no device.
fn device_words(device: i64, none: &str) -> String {
    if device < 0 {
        none.to_string()
    } else {
        format!("device {device}")
    }
}

impl std::error::Error for AllocError {}

impl From<BackendError> for AllocError {
    fn from(e: BackendError) -> Self {
        AllocError::Backend(e)
    }
}

/// Why a pool could not grow. The out-of-memory report (which asks the
/// driver for free memory and scans the cache) is built only when the
/// allocator gives up and returns an error, not on every failed attempt.
#[derive(Debug)]
pub(crate) enum GrowError {
    /// The device or the memory limit has no room now; the driver's answer,
    /// when it gave one.
    Full(Option<BackendError>),
    /// Anything else: returned to the caller as it is.
    Failed(AllocError),
}

impl From<AllocError> for GrowError {
    fn from(e: AllocError) -> Self {
        GrowError::Failed(e)
    }
}

impl From<BackendError> for GrowError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::OutOfMemory { .. } => GrowError::Full(Some(e)),
            e => GrowError::Failed(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn too_large(requested: u64, total: u64, limit: Option<u64>) -> String {
        AllocError::TooLarge {
            requested,
            needed: requested,
            max: limit.unwrap_or(total),
            total,
            device: 1,
            limit,
        }
        .to_string()
    }

    #[test]
    fn too_large_names_pytorchs_sizes_up_to_one_exabyte() {
        let gib = 1u64 << 30;
        assert!(
            too_large(ONE_EB - 1, 80 * gib, None)
                .starts_with("CUDA out of memory. Tried to allocate 1073741824.00 GiB. GPU 1 has a total capacity of 80.00 GiB.")
        );
        assert!(
            too_large(ONE_EB, 80 * gib, None).starts_with(
                "CUDA out of memory. Tried to allocate more than 1EB memory. GPU 1 has a total capacity of 80.00 GiB."
            )
        );
    }

    #[test]
    fn too_large_without_a_capacity_names_the_request_maximum() {
        let msg = too_large(1 << 50, 0, None);
        assert_eq!(
            msg,
            "CUDA out of memory. Tried to allocate 1048576.00 GiB. gpualloc needed 1048576.00 GiB for it, \
             which can never fit: gpualloc serves at most 256.00 TiB a request."
        );
    }
}
