//! Statistics, two ways: a versioned struct (typed, for C and the torch
//! bridge) and the flat list of every stat under the exact key
//! `torch.cuda.memory_stats()` uses (`allocated_bytes.all.peak`, ...):
//! `gpualloc_stat_count` / `gpualloc_stat_name` give the keys, in a fixed
//! order, and `gpualloc_stat_values` fills an `int64_t` array in that order.

use std::ffi::{CString, c_char, c_int};
use std::sync::OnceLock;

use gpualloc::{Backend, DeviceStats, Stat, StatArray};

use crate::boundary::{Error, GPUALLOC_ERR_BUFFER_TOO_SMALL, status, write_out};
use crate::global::{self, existing, global};
use crate::oom::write_versioned;

/// Version of [`GpuallocStats`] this library writes.
pub const GPUALLOC_STATS_VERSION: u32 = 2;

/// One gauge, PyTorch's `Stat`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuallocStat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Sum of increases since the last accumulated reset.
    pub allocated: i64,
    /// Sum of decreases since the last accumulated reset.
    pub freed: i64,
}

/// A gauge per pool, PyTorch's `StatArray` (`all`, `small_pool`, `large_pool`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuallocStatArray {
    /// Both pools.
    pub all: GpuallocStat,
    /// Blocks of at most 1 MiB.
    pub small_pool: GpuallocStat,
    /// Larger blocks.
    pub large_pool: GpuallocStat,
}

/// PyTorch's `DeviceStats`, plus gpualloc's counters and fragmentation figures.
///
/// Versioned (mimalloc style): set `size = sizeof(GpuallocStats)` before
/// calling `gpualloc_get_stats`; the library writes at most that many bytes
/// and sets `size` to the bytes it wrote and `version` to
/// [`GPUALLOC_STATS_VERSION`]. Later versions only append fields: version 2
/// appended the six counters from `num_oom_rejections` on.
///
/// Every stat field mirrors a row of the table in allocator/src/stats.rs
/// (docs/stats.md) with the same name and doc; capi/src/stats/table_tests.rs
/// checks the fields, their order, types and docs, and `to_c`, against it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuallocStats {
    /// In: `sizeof(GpuallocStats)` as the caller knows it. Out: bytes written.
    pub size: u32,
    /// Out: [`GPUALLOC_STATS_VERSION`].
    pub version: u32,
    /// Live allocations.
    pub allocation: GpuallocStatArray,
    /// Bytes of live allocations (rounded block sizes).
    pub allocated_bytes: GpuallocStatArray,
    /// Bytes the callers asked for, until the free completes.
    pub requested_bytes: GpuallocStatArray,
    /// Blocks allocated or waiting on events.
    pub active: GpuallocStatArray,
    /// Bytes of active blocks.
    pub active_bytes: GpuallocStatArray,
    /// Segments obtained from the backend.
    pub segment: GpuallocStatArray,
    /// Bytes obtained from the backend.
    pub reserved_bytes: GpuallocStatArray,
    /// Free pieces of split segments.
    pub inactive_split: GpuallocStatArray,
    /// Bytes of free pieces of split segments.
    pub inactive_split_bytes: GpuallocStatArray,
    /// Allocations of at least `max_split_size`.
    pub oversize_allocations: GpuallocStat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: GpuallocStat,
    /// Backend allocations retried after releasing every cached segment.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors returned.
    pub num_ooms: i64,
    /// Times every outstanding event was waited for.
    pub num_sync_all_streams: i64,
    /// Backend allocations: creations of physical memory (a batch of
    /// handles counts one; pages mapped again from the pool count none,
    /// where PyTorch counts every map of expandable segments).
    pub num_device_alloc: i64,
    /// Backend releases: physical memory handed back (one `empty_cache`
    /// counts one, however many ranges it unmaps).
    pub num_device_free: i64,
    /// Blocks taken from another stream's cache (gpualloc's addition).
    pub num_cross_stream_reuse: i64,
    /// Trace records that could not be written since the last accumulated
    /// reset (gpualloc's addition; the trace's own END block and
    /// `trace_stop` count every loss since `trace_start`).
    pub num_trace_dropped: i64,
    /// The configured `max_split_size` (-1 when unlimited, as PyTorch reports it).
    pub max_split_size: i64,
    /// The largest cached free block (what `cacheInfo` reports).
    pub largest_free_block: u64,
    /// Bytes cached in free blocks.
    pub cached_free_bytes: u64,
    /// `1 - largest free block / cached free bytes`.
    pub external_fragmentation: f64,
    /// `1 - allocated / reserved`.
    pub unallocated_fraction: f64,
    /// Requests rejected before any driver call (PyTorch's
    /// `throw_on_cudamalloc_oom`; gpualloc never rejects, so always 0).
    pub num_oom_rejections: i64,
    /// Times free pages were unmapped to be mapped where a request fits,
    /// instead of growing (Note \[Defragmentation\]; gpualloc's addition).
    pub num_defragment: i64,
    /// Stitched ranges built (Note \[Stitching\]; gpualloc's addition).
    pub num_stitch: i64,
    /// Driver calls of every kind (filled in when stats are read; the
    /// accumulated reset moves their baseline).
    pub num_driver_calls: i64,
    /// Driver calls that obtain, map, unmap or return memory.
    pub num_driver_memory_calls: i64,
    /// Nanoseconds spent in driver calls, where the backend measures it.
    pub driver_time_ns: i64,
}

fn stat(s: &Stat) -> GpuallocStat {
    GpuallocStat {
        current: s.current,
        peak: s.peak,
        allocated: s.allocated,
        freed: s.freed,
    }
}

fn array(a: &StatArray) -> GpuallocStatArray {
    GpuallocStatArray {
        all: stat(&a.all),
        small_pool: stat(&a.small_pool),
        large_pool: stat(&a.large_pool),
    }
}

/// `s` in the C struct (`table_tests` checks every field against the table).
fn to_c(s: &DeviceStats) -> GpuallocStats {
    GpuallocStats {
        size: std::mem::size_of::<GpuallocStats>() as u32,
        version: GPUALLOC_STATS_VERSION,
        allocation: array(&s.allocation),
        allocated_bytes: array(&s.allocated_bytes),
        requested_bytes: array(&s.requested_bytes),
        active: array(&s.active),
        active_bytes: array(&s.active_bytes),
        segment: array(&s.segment),
        reserved_bytes: array(&s.reserved_bytes),
        inactive_split: array(&s.inactive_split),
        inactive_split_bytes: array(&s.inactive_split_bytes),
        oversize_allocations: stat(&s.oversize_allocations),
        oversize_segments: stat(&s.oversize_segments),
        num_alloc_retries: s.num_alloc_retries,
        num_ooms: s.num_ooms,
        num_sync_all_streams: s.num_sync_all_streams,
        num_device_alloc: s.num_device_alloc,
        num_device_free: s.num_device_free,
        num_cross_stream_reuse: s.num_cross_stream_reuse,
        num_trace_dropped: s.num_trace_dropped,
        max_split_size: s.max_split_size,
        num_oom_rejections: s.num_oom_rejections,
        num_defragment: s.num_defragment,
        num_stitch: s.num_stitch,
        num_driver_calls: s.num_driver_calls,
        num_driver_memory_calls: s.num_driver_memory_calls,
        driver_time_ns: s.driver_time_ns,
        ..GpuallocStats::default()
    }
}

/// Fills `*out` with `device`'s stats (see [`GpuallocStats`] for `size`).
///
/// # Safety
/// `out` is NULL or points to a `GpuallocStats` (of any version) whose
/// `size` field is set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_get_stats(device: c_int, out: *mut GpuallocStats) -> c_int {
    status(|| {
        let Some(g) = existing() else {
            let config = global::idle(i64::from(device))?;
            return write_versioned(out, &to_c(&DeviceStats::for_config(&config)));
        };
        // A device not used yet reports zeros and is not started (no context).
        let s = match g.alloc.peek(i64::from(device))? {
            Some(d) => {
                let mut s = to_c(&d.stats_snapshot());
                s.largest_free_block = d.largest_free_block();
                s.cached_free_bytes = d.cached_free_bytes();
                s.external_fragmentation = d.external_fragmentation();
                s.unallocated_fraction = d.unallocated_fraction();
                s
            }
            None => to_c(&g.alloc.stats(i64::from(device))?),
        };
        write_versioned(out, &s)
    })
}

fn stat_names() -> &'static [CString] {
    static NAMES: OnceLock<Vec<CString>> = OnceLock::new();
    NAMES.get_or_init(|| {
        DeviceStats::flat_keys()
            .into_iter()
            .map(|k| CString::new(k).expect("stat names have no NUL"))
            .collect()
    })
}

/// How many flat stats there are (the length `gpualloc_stat_values` needs).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_stat_count() -> usize {
    stat_names().len()
}

/// The PyTorch key of flat stat `index` (`"allocated_bytes.all.current"`),
/// a static string; NULL past the end.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_stat_name(index: usize) -> *const c_char {
    stat_names()
        .get(index)
        .map_or(std::ptr::null(), |s| s.as_ptr())
}

/// Writes `device`'s stats into `values[0 .. gpualloc_stat_count()]`, in
/// the order of `gpualloc_stat_name`. `GPUALLOC_ERR_BUFFER_TOO_SMALL` when
/// `len` is below the count.
///
/// # Safety
/// `values` is NULL or points to `len` writable int64_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_stat_values(
    device: c_int,
    values: *mut i64,
    len: usize,
) -> c_int {
    status(|| {
        let flat = match existing() {
            Some(g) => g.alloc.stats(i64::from(device))?,
            None => DeviceStats::for_config(&global::idle(i64::from(device))?),
        }
        .flat();
        if values.is_null() {
            return Err(Error::invalid("gpualloc: values is NULL"));
        }
        if len < flat.len() {
            return Err(Error::new(
                GPUALLOC_ERR_BUFFER_TOO_SMALL,
                format!("gpualloc: {len} values given, {} needed", flat.len()),
            ));
        }
        // SAFETY: non-NULL, and the caller promises `len >= flat.len()` writable slots.
        let out = unsafe { std::slice::from_raw_parts_mut(values, flat.len()) };
        for (slot, (_, v)) in out.iter_mut().zip(flat) {
            *slot = v;
        }
        Ok(())
    })
}

/// `torch.cuda.reset_peak_memory_stats`: every peak becomes its current value.
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_reset_peak_stats(device: c_int) -> c_int {
    status(|| match existing() {
        Some(g) => Ok(g.alloc.reset_peak_stats(i64::from(device))?),
        None => global::idle(i64::from(device)).map(drop),
    })
}

/// `torch.cuda.reset_accumulated_memory_stats`: cumulative fields and every
/// counter (`num_*`, `driver_time_ns`) go to 0 (docs/stats.md).
#[unsafe(no_mangle)]
pub extern "C" fn gpualloc_reset_accumulated_stats(device: c_int) -> c_int {
    status(|| match existing() {
        Some(g) => Ok(g.alloc.reset_accumulated_stats(i64::from(device))?),
        None => global::idle(i64::from(device)).map(drop),
    })
}

/// PyTorch's `cacheInfo` (cuDNN benchmark sizes its workspace with it): if
/// `*largest` is 0 it first becomes the device's free memory; then it is
/// raised to the largest cached free block.
///
/// # Safety
/// `largest` is NULL or points to a readable and writable size_t.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpualloc_cache_info(device: c_int, largest: *mut usize) -> c_int {
    status(|| {
        if largest.is_null() {
            return Err(Error::invalid("gpualloc: largest is NULL"));
        }
        // SAFETY: non-NULL; the caller promises a readable size_t.
        let mut v = unsafe { largest.read() } as u64;
        let mut d = global()?.alloc.lock(i64::from(device))?;
        if v == 0 {
            v = d.backend_mut().mem_info()?.free;
        }
        v = v.max(d.largest_free_block());
        drop(d);
        write_out(largest, usize::try_from(v).unwrap_or(usize::MAX), "largest")
    })
}

#[cfg(test)]
mod table_tests;
