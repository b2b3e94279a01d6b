//! Out-of-memory errors and the fragmentation figures they report. A report
//! asks the driver for free memory and scans the cache, so it is built only
//! when an error is returned (`GrowError` carries just the driver's answer).

use crate::backend::{Backend, BackendError, StreamId};
use crate::block::{BlockState, PoolId};
use crate::device::DeviceAllocator;
use crate::error::{AllocError, OomReport};
use crate::trace::Action;

impl<B: Backend> DeviceAllocator<B> {
    /// Builds the out-of-memory error, counts it and traces it. `pool`:
    /// the pool the request was made for, when it had one.
    pub(crate) fn out_of_memory(
        &mut self,
        stream: StreamId,
        pool: Option<PoolId>,
        requested: u64,
        needed: u64,
        cause: Option<BackendError>,
    ) -> AllocError {
        let report = self.report(stream, pool, requested, needed, cause);
        self.stats.num_ooms += 1;
        self.record(Action::Oom, stream, 0, requested, report.device_free);
        tracing::warn!(
            device = self.device,
            requested,
            needed,
            allocated = report.allocated,
            reserved = report.reserved,
            device_free = report.device_free,
            "out of memory after the retries"
        );
        let max = report
            .limit
            .unwrap_or(report.device_total)
            .min(report.device_total.max(1));
        if (report.device_total > 0 && needed > max) || needed > crate::size_class::MAX_REQUEST {
            return AllocError::TooLarge {
                requested,
                needed,
                max,
                total: report.device_total,
                device: self.device,
                limit: report.limit,
            };
        }
        AllocError::OutOfMemory(Box::new(report))
    }

    /// The figures of an out-of-memory report, as of now.
    pub(crate) fn report(
        &mut self,
        stream: StreamId,
        pool: Option<PoolId>,
        requested: u64,
        needed: u64,
        cause: Option<BackendError>,
    ) -> OomReport {
        let largest_free_usable = match pool {
            Some(p) => self.heap.pools[p as usize]
                .iter()
                .filter(|k| k.0 == stream)
                .map(|k| k.1)
                .max()
                .unwrap_or(0),
            None => self.largest_free_block(),
        };
        let info = self.backend.mem_info().unwrap_or_default();
        let limit = self.limit().ok().flatten();
        OomReport {
            device: self.device,
            requested,
            needed,
            allocated: self.stats.allocated_bytes.all.current as u64,
            reserved: self.stats.reserved_bytes.all.current as u64,
            private_pools_allocated: self.private_pools_allocated_bytes(),
            device_free: info.free,
            device_total: info.total,
            limit,
            largest_free_block: self.largest_free_block(),
            largest_free_usable,
            capture_underway: self.private.capturing(),
            external_fragmentation: self.external_fragmentation(),
            unallocated_fraction: self.unallocated_fraction(),
            cause,
        }
    }

    fn private_pools_allocated_bytes(&self) -> u64 {
        self.live
            .values()
            .map(|&id| &self.heap.blocks[id])
            .filter(|b| {
                b.state == BlockState::Allocated
                    && self.heap.pools[b.pool as usize].private.is_some()
            })
            .map(|b| b.size)
            .sum()
    }

    /// The largest cached free block, over every pool and stream.
    pub fn largest_free_block(&self) -> u64 {
        self.heap
            .pools
            .iter()
            .map(|p| p.free_bytes_and_largest().1)
            .max()
            .unwrap_or(0)
    }

    /// Bytes cached in free blocks, over every pool and stream.
    pub fn cached_free_bytes(&self) -> u64 {
        self.heap
            .pools
            .iter()
            .map(|p| p.free_bytes_and_largest().0)
            .sum()
    }

    /// `1 - largest free block / cached free bytes` (0 with nothing cached).
    pub fn external_fragmentation(&self) -> f64 {
        let total = self.cached_free_bytes();
        if total == 0 {
            0.0
        } else {
            1.0 - self.largest_free_block() as f64 / total as f64
        }
    }

    /// `1 - allocated / reserved` (0 with nothing reserved).
    pub fn unallocated_fraction(&self) -> f64 {
        let r = self.stats.reserved_bytes.all.current;
        if r == 0 {
            0.0
        } else {
            1.0 - self.stats.allocated_bytes.all.current as f64 / r as f64
        }
    }
}
