//! Statistics with PyTorch's names (`torch.cuda.memory_stats`).
//!
//! Gauges ([`Stat`]: current and peak, with the cumulative `allocated` and
//! `freed` beside them) are kept per pool kind in a [`StatArray`] indexed by
//! `all`, `small_pool` and `large_pool`. Monotonic counters (`num_*`) are
//! plain integers. Ratios such as fragmentation are never stored: they are
//! computed by methods on the allocator from its blocks.

use crate::size_class::PoolKind;

/// One gauge: PyTorch's `Stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Sum of all increases since the last accumulated reset.
    pub allocated: i64,
    /// Sum of all decreases since the last accumulated reset.
    pub freed: i64,
}

impl Stat {
    /// Adds `amount` (which may be negative).
    #[inline]
    pub fn update(&mut self, amount: i64) {
        self.current += amount;
        if amount > 0 {
            self.allocated += amount;
            self.peak = self.peak.max(self.current);
        } else {
            self.freed -= amount;
        }
    }
}

/// A gauge for `all`, `small_pool` and `large_pool`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    /// Both pools together.
    pub all: Stat,
    /// The small pool (requests ≤ 1 MiB).
    pub small_pool: Stat,
    /// The large pool.
    pub large_pool: Stat,
}

impl StatArray {
    /// Adds `amount` to `all` and to the pool's own stat.
    #[inline]
    pub fn update(&mut self, kind: PoolKind, amount: i64) {
        self.all.update(amount);
        match kind {
            PoolKind::Small => self.small_pool.update(amount),
            PoolKind::Large => self.large_pool.update(amount),
        }
    }

    /// The three stats with PyTorch's pool names.
    pub fn named(&self) -> [(&'static str, &Stat); 3] {
        [
            ("all", &self.all),
            ("small_pool", &self.small_pool),
            ("large_pool", &self.large_pool),
        ]
    }

    fn for_each(&mut self, f: impl Fn(&mut Stat)) {
        f(&mut self.all);
        f(&mut self.small_pool);
        f(&mut self.large_pool);
    }
}

/// PyTorch's `DeviceStats`, key for key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Live allocations.
    pub allocation: StatArray,
    /// Bytes of live allocations (rounded block sizes).
    pub allocated_bytes: StatArray,
    /// Bytes the callers asked for, until the free completes.
    pub requested_bytes: StatArray,
    /// Blocks allocated or waiting on events.
    pub active: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Segments obtained from the backend.
    pub segment: StatArray,
    /// Bytes obtained from the backend.
    pub reserved_bytes: StatArray,
    /// Free pieces of split segments.
    pub inactive_split: StatArray,
    /// Bytes of free pieces of split segments.
    pub inactive_split_bytes: StatArray,
    /// Allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Backend allocations retried after releasing every cached segment.
    pub num_alloc_retries: i64,
    /// Out-of-memory errors returned.
    pub num_ooms: i64,
    /// Times every outstanding event was waited for.
    pub num_sync_all_streams: i64,
    /// Backend allocations.
    pub num_device_alloc: i64,
    /// Backend releases.
    pub num_device_free: i64,
    /// Requests rejected before any driver call (PyTorch's
    /// `throw_on_cudamalloc_oom`; gpualloc never rejects, so always 0).
    pub num_oom_rejections: i64,
    /// Blocks taken from another stream's cache (gpualloc's addition).
    pub num_cross_stream_reuse: i64,
    /// Trace records that could not be written (gpualloc's addition).
    pub num_trace_dropped: i64,
    /// Times free pages were unmapped to be mapped where a request fits,
    /// instead of growing (Note \[Defragmentation\]; gpualloc's addition).
    pub num_defragment: i64,
    /// Stitched ranges built (Note \[Stitching\]; gpualloc's addition).
    pub num_stitch: i64,
    /// Driver calls of every kind (filled in when stats are read).
    pub num_driver_calls: i64,
    /// Driver calls that obtain, map, unmap or return memory.
    pub num_driver_memory_calls: i64,
    /// Nanoseconds spent in driver calls, where the backend measures it.
    pub driver_time_ns: i64,
    /// The configured `max_split_size` (-1 when unlimited, as PyTorch reports it).
    pub max_split_size: i64,
}

impl DeviceStats {
    /// All-zero stats of a device under `config` (`max_split_size` filled in).
    pub fn for_config(config: &crate::config::Config) -> DeviceStats {
        DeviceStats {
            max_split_size: if config.max_split_size == u64::MAX {
                -1
            } else {
                config.max_split_size as i64
            },
            ..DeviceStats::default()
        }
    }

    /// The nine per-pool gauges with their PyTorch names.
    pub fn arrays(&self) -> [(&'static str, &StatArray); 9] {
        [
            ("allocation", &self.allocation),
            ("allocated_bytes", &self.allocated_bytes),
            ("requested_bytes", &self.requested_bytes),
            ("active", &self.active),
            ("active_bytes", &self.active_bytes),
            ("segment", &self.segment),
            ("reserved_bytes", &self.reserved_bytes),
            ("inactive_split", &self.inactive_split),
            ("inactive_split_bytes", &self.inactive_split_bytes),
        ]
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.allocated_bytes,
            &mut self.requested_bytes,
            &mut self.active,
            &mut self.active_bytes,
            &mut self.segment,
            &mut self.reserved_bytes,
            &mut self.inactive_split,
            &mut self.inactive_split_bytes,
        ]
    }

    /// Every stat as flat `(key, value)` pairs, named exactly as
    /// `torch.cuda.memory_stats()` names them (`allocated_bytes.all.peak`, ...).
    pub fn flat(&self) -> Vec<(String, i64)> {
        let mut out = Vec::with_capacity(128);
        for (name, arr) in self.arrays() {
            for (pool, s) in arr.named() {
                for (field, v) in [
                    ("current", s.current),
                    ("peak", s.peak),
                    ("allocated", s.allocated),
                    ("freed", s.freed),
                ] {
                    out.push((format!("{name}.{pool}.{field}"), v));
                }
            }
        }
        for (name, s) in [
            ("oversize_allocations", &self.oversize_allocations),
            ("oversize_segments", &self.oversize_segments),
        ] {
            for (field, v) in [
                ("current", s.current),
                ("peak", s.peak),
                ("allocated", s.allocated),
                ("freed", s.freed),
            ] {
                out.push((format!("{name}.{field}"), v));
            }
        }
        for (name, v) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
            ("num_oom_rejections", self.num_oom_rejections),
            ("num_cross_stream_reuse", self.num_cross_stream_reuse),
            ("num_trace_dropped", self.num_trace_dropped),
            ("num_defragment", self.num_defragment),
            ("num_stitch", self.num_stitch),
            ("num_driver_calls", self.num_driver_calls),
            ("num_driver_memory_calls", self.num_driver_memory_calls),
            ("driver_time_ns", self.driver_time_ns),
            ("max_split_size", self.max_split_size),
        ] {
            out.push((name.to_string(), v));
        }
        out.sort();
        out
    }

    /// `reset_peak_memory_stats`: every peak becomes its current value.
    pub fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            a.for_each(|s| s.peak = s.current);
        }
        for s in [&mut self.oversize_allocations, &mut self.oversize_segments] {
            s.peak = s.current;
        }
    }

    /// `reset_accumulated_memory_stats`: cumulative fields and `num_*` counters go to 0.
    pub fn reset_accumulated(&mut self) {
        for a in self.arrays_mut() {
            a.for_each(|s| {
                s.allocated = 0;
                s.freed = 0;
            });
        }
        for s in [&mut self.oversize_allocations, &mut self.oversize_segments] {
            s.allocated = 0;
            s.freed = 0;
        }
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_cross_stream_reuse = 0;
        self.num_defragment = 0;
        self.num_stitch = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.update(10);
        s.update(-4);
        s.update(2);
        assert_eq!(
            s,
            Stat {
                current: 8,
                peak: 10,
                allocated: 12,
                freed: 4
            }
        );
    }

    #[test]
    fn flat_keys_are_pytorchs() {
        let mut d = DeviceStats::default();
        d.allocated_bytes.update(PoolKind::Small, 512);
        let flat = d.flat();
        let get = |k: &str| flat.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
        assert_eq!(get("allocated_bytes.all.current"), Some(512));
        assert_eq!(get("allocated_bytes.small_pool.peak"), Some(512));
        assert_eq!(get("allocated_bytes.large_pool.current"), Some(0));
        assert!(get("inactive_split_bytes.all.freed").is_some());
        assert!(get("num_alloc_retries").is_some());
        assert_eq!(flat.len(), 9 * 3 * 4 + 2 * 4 + 14);
        d.reset_accumulated();
        d.update_noop();
    }

    impl DeviceStats {
        fn update_noop(&mut self) {
            self.reset_peak();
            assert_eq!(self.allocated_bytes.all.peak, 512);
            assert_eq!(self.allocated_bytes.all.allocated, 0);
        }
    }
}
