//! The per-device state machine: PyTorch's `DeviceCachingAllocator`.
//!
//! One `DeviceAllocator` owns one device's backend and, as separate pieces
//! that each keep the methods changing their own state and never import
//! this file: the heap of blocks, segments and pools (`heap.rs`), the page
//! pool (`page_pool.rs`), the fences ordering unmaps (`fence.rs`), the
//! limits (`limits.rs`), the private pools (`private_pool.rs`) and the stitch
//! cache (`stitch_cache.rs`), the frees waiting for other streams
//! (`pending.rs`); plus stats. It is used
//! under one lock (see `Allocator`). This file holds the hot path
//! (`malloc`, `free`); the operations that span pieces live by topic:
//! `stream_events.rs` (events on the streams that used a block, before
//! it is reused), `expandable.rs` (mapping pages), `stitch.rs`,
//! `release.rs` (OOM retries, `empty_cache`, GC), `capture.rs` (graph
//! capture) and `oom.rs` (the out-of-memory report, built only when an
//! error is returned). A test (`tests/tests/all/structure.rs`) keeps the
//! crate free of import cycles.
//!
//! Note [Cross-stream reuse]
//! Rationale: PyTorch never reuses a cached block on another stream, so with
//! several streams each keeps its own cache and reserved memory grows.
//! Approach: when a stream finds nothing in its own free list and would
//! otherwise grow the pool, it may take the best-fitting block cached by
//! another stream. The owning stream records an event, and the taking stream
//! waits on it (`stream_wait_event`, no host blocking), so every kernel that
//! used the block finishes before any kernel of the new owner starts. No
//! driver call is made on an ordinary free. Limitation: blocks of different
//! streams in one segment merge only once they are owned by the same stream.

use rustc_hash::FxHashMap;

use crate::backend::BackendError;
use crate::backend::{Backend, DevicePtr, StreamId};
use crate::block::{Block, BlockId, BlockState, PoolId};
use crate::budget::DefragBudget;
use crate::capture_markers::CaptureMarkers;
use crate::config::Config;
use crate::cost::DriverCalls;
use crate::drain::Drains;
use crate::error::{AllocError, GrowError};
use crate::fence::Fences;
use crate::heap::{Heap, LARGE, SMALL, STITCH};
use crate::limits::Limits;
use crate::observer::{SegmentAction, SegmentObserver};
use crate::page_pool::PagePool;
use crate::pending::PendingFrees;
use crate::pool::PoolKey;
use crate::private_pool::PrivatePools;
use crate::shares::Shares;
use crate::size_class::{PoolKind, allocation_size, round_size};
use crate::stats::DeviceStats;
use crate::stitch_cache::Stitches;
use crate::trace::{Action, DeviceTrace, EventKind, MemoryCap, pool_code};

/// One device's caching allocator.
pub struct DeviceAllocator<B: Backend> {
    pub(crate) device: u32,
    pub(crate) backend: B,
    pub(crate) config: Config,
    /// Blocks, segments and pools (`heap.rs`).
    pub(crate) heap: Heap,
    /// Allocated and pending-free blocks by address.
    pub(crate) live: FxHashMap<DevicePtr, BlockId>,
    /// Frees waiting for other streams' work (`pending.rs`).
    pub(crate) pending: PendingFrees,
    /// Free markers of blocks a capture deferred (Note [Reuse inside a capture]).
    pub(crate) capture_reuse: CaptureMarkers,
    pub(crate) private: PrivatePools,
    pub(crate) stats: DeviceStats,
    /// Device capacity and the memory limits in force.
    pub(crate) limits: Limits,
    pub(crate) trace: Option<DeviceTrace>,
    /// While tracing, the clock as read once for the locked call under way
    /// (Note [One clock for decisions and traces] in `clock.rs`).
    call_ns: Option<u64>,
    /// Called on every segment event (Note [Segment events]).
    pub(crate) observer: Option<SegmentObserver>,
    /// Whether every pool (default and private) uses expandable segments:
    /// configured and supported by the backend (Note [Private pools]).
    pub(crate) expandable: bool,
    /// PyTorch's `expandable_segments` says off: requests outside private
    /// pools take plain segments (Note [PyTorch's expandable_segments
    /// switch] in `plain_requests.rs`).
    pub(crate) plain_requests: bool,
    /// Physical handles of expandable segments (Note [Page pool]).
    pub(crate) pages: PagePool,
    /// Live blocks shared with other processes (`shares.rs`).
    pub(crate) shares: Shares,
    /// When freed pages may be unmapped (Note [Event-ordered unmapping]).
    pub(crate) fences: Fences,
    /// Old addresses of pages that moved before their work was done
    /// (Note [Unmapping behind the work]).
    pub(crate) drains: Drains,
    /// Stitched ranges, in use or cached (Note [Stitching]).
    pub(crate) stitches: Stitches,
    /// Driver time defragmentation may still spend (Note [Defragmentation budget]).
    pub(crate) defrag_budget: DefragBudget,
    /// Driver time building and repairing stitches may still spend (Note
    /// [Stitch budget]); charged with the same calls.
    pub(crate) stitch_budget: DefragBudget,
    /// Driver calls counted before the last `reset_accumulated_stats`.
    driver_baseline: DriverCalls,
    /// The helper thread's calls at the last reset of accumulated stats.
    helper_baseline: DriverCalls,
    /// The peak of allocated bytes before the last `reset_peak_stats`:
    /// with the stats' peak, the high-water mark the policy reads, so that
    /// resetting a statistic (which traces do not record) changes no
    /// decision (see [`allocated_high`](Self::allocated_high)).
    allocated_high_before_reset: u64,
    /// The same for reserved memory ([`reserved_high`](Self::reserved_high)).
    pub(crate) reserved_high_before_reset: u64,
    /// Set when a panic unwound while this device was locked: its state may
    /// be half-updated, so `Allocator` refuses to use it again.
    pub(crate) poisoned: bool,
    /// Bytes of the `segment_alloc` and `segment_map` records made, whether
    /// or not a trace is on: device memory obtained as a trace counts it
    /// (a replay compares its own with the recording's, `Departure`).
    pub(crate) obtained_as_traced: u64,
}

/// What [`DeviceAllocator::cached_block`] found.
struct Cached {
    pool: PoolId,
    rounded: u64,
    capturing: bool,
    block: Option<BlockId>,
}

impl<B: Backend> DeviceAllocator<B> {
    /// A device allocator over `backend`.
    pub fn new(device: u32, mut backend: B, config: Config) -> Self {
        let expandable = config.expandable_segments && backend.vmm_granularity().is_some();
        let stats = DeviceStats::for_config(&config);
        DeviceAllocator {
            device,
            backend,
            limits: Limits::new(&config),
            config,
            heap: Heap::default(),
            live: FxHashMap::default(),
            pending: PendingFrees::default(),
            capture_reuse: CaptureMarkers::default(),
            private: PrivatePools::default(),
            stats,
            trace: None,
            call_ns: None,
            observer: None,
            expandable,
            plain_requests: false,
            pages: PagePool::default(),
            shares: Shares::default(),
            fences: Fences::default(),
            drains: Drains::default(),
            stitches: Stitches::default(),
            defrag_budget: DefragBudget::default(),
            stitch_budget: DefragBudget::default(),
            driver_baseline: DriverCalls::default(),
            helper_baseline: DriverCalls::default(),
            allocated_high_before_reset: 0,
            reserved_high_before_reset: 0,
            poisoned: false,
            obtained_as_traced: 0,
        }
    }

    /// Sets the memory limit as a fraction of device memory
    /// (`set_per_process_memory_fraction`).
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), AllocError> {
        self.limits.set_fraction(fraction)?;
        self.record_cap(self.limits.fraction_cap());
        Ok(())
    }

    /// The fraction set by [`set_memory_fraction`](Self::set_memory_fraction), 1.0 when none.
    pub fn memory_fraction(&self) -> f64 {
        self.limits.fraction()
    }

    /// Sets (or clears) a memory limit in bytes.
    pub fn set_memory_limit(&mut self, bytes: Option<u64>) {
        self.limits.set_bytes(bytes);
        self.record_cap(self.limits.bytes_cap());
    }

    /// Records a cap set, so that a replay sets it at the same point (caps
    /// set at run time are not in the configuration the trace's header holds).
    /// The record carries the device's memory that a fraction is taken of
    /// (read once from the driver, 0 if it refuses), so that readers
    /// compute the cap as this allocator does.
    fn record_cap(&mut self, cap: MemoryCap) {
        if self.trace.is_none() {
            return;
        }
        let device_total = self.device_total().unwrap_or(0);
        let (action, addr, size, aux) = EventKind::MemoryLimit { cap, device_total }.fields();
        self.record(action, 0, addr, size, aux);
    }

    /// Starts recording into `trace`; the device's memory and the caps set
    /// at run time before it are recorded first.
    pub(crate) fn start_trace(&mut self, trace: DeviceTrace) {
        self.trace = Some(trace);
        // The device's size, so that a replay runs on a device like this
        // one without being told (none where the driver refuses to say).
        if self.device_total().is_ok() {
            self.record_cap(MemoryCap::DeviceSize);
        }
        for cap in self.limits.set_at_run_time(&self.config) {
            self.record_cap(cap);
        }
        if self.plain_requests {
            self.record_plain_requests();
        }
    }

    /// The memory limit in force, if any (`limits.rs`).
    pub(crate) fn limit(&mut self) -> Result<Option<u64>, AllocError> {
        self.limits.limit(&mut self.backend)
    }

    /// The most reserved memory may reach: the limit, or the device.
    pub(crate) fn capacity(&mut self) -> Result<u64, AllocError> {
        self.limits.capacity(&mut self.backend)
    }

    /// Device capacity, read once from the backend.
    pub(crate) fn device_total(&mut self) -> Result<u64, AllocError> {
        self.limits.device_total(&mut self.backend)
    }

    /// The backend, for inspection (tests drive the simulator through it).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably (tests complete simulated events through it).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The stats, PyTorch's `DeviceStats`.
    pub fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    /// The stats with the driver-call counters filled in.
    pub fn stats_snapshot(&self) -> DeviceStats {
        let mut s = self.stats.clone();
        let d = self.driver_calls();
        s.num_driver_calls = d.total_calls() as i64;
        s.num_driver_memory_calls = d.memory_calls() as i64;
        s.driver_time_ns = d.total_nanos() as i64;
        s
    }

    /// Physical memory held in the page pool, not mapped (Note [Page pool]).
    pub fn pooled_bytes(&self) -> u64 {
        self.pages.pooled_bytes(PoolKind::Small) + self.pages.pooled_bytes(PoolKind::Large)
    }

    /// Driver calls since the device started or its accumulated stats were reset.
    pub fn driver_calls(&self) -> DriverCalls {
        self.backend.driver_calls().since(&self.driver_baseline)
    }

    /// Driver calls a helper thread made for the device, with their time,
    /// since the same moment (Note [Unmapping off the allocating thread]).
    pub fn helper_driver_calls(&self) -> DriverCalls {
        self.backend.helper_calls().since(&self.helper_baseline)
    }

    /// `reset_peak_memory_stats`.
    pub fn reset_peak_stats(&mut self) {
        self.allocated_high_before_reset = self.allocated_high();
        self.reserved_high_before_reset = self.reserved_high();
        self.stats.reset_peak();
    }

    /// The device's index (what [`Allocator`](crate::Allocator)'s calls
    /// name it by).
    pub fn ordinal(&self) -> u32 {
        self.device
    }

    /// The most bytes ever allocated at once on this device, whatever
    /// `reset_peak_stats` did to the statistics: what defragmentation
    /// measures reserved memory against (Note [Defragmentation]).
    pub(crate) fn allocated_high(&self) -> u64 {
        (self.stats.allocated_bytes.all.peak as u64).max(self.allocated_high_before_reset)
    }

    /// The most bytes ever reserved at once on this device, whatever
    /// `reset_peak_stats` did to the statistics: the defragmentation budget
    /// never lets it rise (Note [Defragmentation budget]).
    pub(crate) fn reserved_high(&self) -> u64 {
        (self.stats.reserved_bytes.all.peak as u64).max(self.reserved_high_before_reset)
    }

    /// `reset_accumulated_memory_stats`.
    pub fn reset_accumulated_stats(&mut self) {
        // Drops counted before the reset belong to the old totals.
        if let Some(t) = &mut self.trace {
            t.take_unsynced_drops();
        }
        self.stats.reset_accumulated();
        self.driver_baseline = self.backend.driver_calls();
        self.helper_baseline = self.backend.helper_calls();
    }

    /// Counts `size` bytes of a `segment_alloc` or `segment_map` record as
    /// obtained ([`obtained_as_traced`](Self::obtained_as_traced)), made
    /// just before the record.
    pub(crate) fn count_obtained(&mut self, size: u64) {
        self.obtained_as_traced = self.obtained_as_traced.saturating_add(size);
    }

    #[inline]
    pub(crate) fn record(
        &mut self,
        action: Action,
        stream: StreamId,
        addr: DevicePtr,
        size: u64,
        aux: u64,
    ) {
        let Some(t) = &mut self.trace else {
            return;
        };
        let backend = &mut self.backend;
        let now = *self.call_ns.get_or_insert_with(|| backend.now_ns());
        t.record(now, action, stream, addr, size, aux);
        self.stats.num_trace_dropped += t.take_unsynced_drops() as i64;
    }

    /// The backend's clock for the call under way: while tracing, read once
    /// per locked call, so that the call's events and any decision by time
    /// see the same instant, as a replay of the trace will (Note [One clock
    /// for decisions and traces] in `clock.rs`); read afresh otherwise.
    pub(crate) fn call_time(&mut self) -> u64 {
        if self.trace.is_none() {
            return self.backend.now_ns();
        }
        let backend = &mut self.backend;
        *self.call_ns.get_or_insert_with(|| backend.now_ns())
    }

    /// Starts a locked call: it reads the clock afresh when it first needs it.
    #[inline]
    pub(crate) fn begin_call(&mut self) {
        self.call_ns = None;
    }

    /// Installs (or, with `None`, removes) the observer of segment events
    /// (Note [Segment events] in `observer.rs`).
    pub fn set_segment_observer(&mut self, observer: Option<SegmentObserver>) {
        self.observer = observer;
    }

    /// Tells the observer, if any, about a segment event of a range in
    /// `pool`.
    #[inline]
    pub(crate) fn notify(
        &self,
        action: SegmentAction,
        pool: PoolId,
        stream: StreamId,
        address: DevicePtr,
        size: u64,
    ) {
        if self.observer.is_some() {
            let key = self.pool_key(pool);
            crate::observer::teller(&self.observer, self.device)(
                action, stream, address, size, key,
            );
        }
    }

    /// The private pool id of `pool`; `(0, 0)` for the default pools and
    /// stitches.
    #[inline]
    pub(crate) fn pool_key(&self, pool: PoolId) -> PoolKey {
        self.heap.pools[pool as usize].private.unwrap_or((0, 0))
    }

    /// Allocates `size` bytes for use on `stream`. Size 0 gives the null pointer.
    ///
    /// # Errors
    /// [`AllocError::OutOfMemory`] when nothing fits now even after releasing
    /// the cache; [`AllocError::TooLarge`] when it never could;
    /// [`AllocError::Backend`] for driver failures.
    pub fn malloc(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        self.malloc_into(size, stream, None)
    }

    /// [`malloc`](Self::malloc) from private pool `into` whatever the open
    /// scopes say (`None`, or a pool that does not exist: as `malloc`). A
    /// replay serves this way the blocks that a checkpoint restore put
    /// back into a pool outside any capture (Note [Pool checkpoints];
    /// `replay_pools.rs`), which the recording placed by address.
    pub(crate) fn malloc_into(
        &mut self,
        size: u64,
        stream: StreamId,
        into: Option<PoolKey>,
    ) -> Result<DevicePtr, AllocError> {
        if size == 0 {
            return Ok(0);
        }
        if size > crate::size_class::MAX_REQUEST {
            return Err(self.out_of_memory(stream, None, size, size, None));
        }
        let cached = self.cached_block(size, stream, into)?;
        let block = match cached.block {
            Some(b) => b,
            None => {
                let capturing = cached.capturing || self.capture_elsewhere()?;
                self.malloc_slow(cached.pool, stream, size, cached.rounded, capturing)?
            }
        };
        // A stitch serves a large-pool request from the stitch pool.
        let pool = self.heap.blocks[block].pool;
        Ok(self.alloc_found_block(block, pool, stream, size, cached.rounded))
    }

    /// [`malloc`](Self::malloc) from the stream's cached free blocks only:
    /// `None` where `malloc` would take its slow path (grow, map pooled
    /// pages, stitch, or fail), having changed nothing a later `malloc`
    /// depends on. The C ABI's miss callback runs between the two (Note
    /// [Free-memory callbacks] in `capi/src/miss.rs`).
    ///
    /// # Errors
    /// [`AllocError::Backend`] when the driver fails while events are read.
    pub fn malloc_cached(
        &mut self,
        size: u64,
        stream: StreamId,
    ) -> Result<Option<DevicePtr>, AllocError> {
        if size == 0 {
            return Ok(Some(0));
        }
        if size > crate::size_class::MAX_REQUEST {
            return Ok(None); // `malloc` says why
        }
        let cached = self.cached_block(size, stream, None)?;
        let Some(block) = cached.block else {
            // The lookup `malloc` makes next counts: the lookups are the
            // clock that ages cached blocks for garbage collection.
            self.heap.pools[cached.pool as usize].lookups -= 1;
            return Ok(None);
        };
        let pool = self.heap.blocks[block].pool;
        Ok(Some(self.alloc_found_block(
            block,
            pool,
            stream,
            size,
            cached.rounded,
        )))
    }

    /// The fast path of an allocation: the pool, the rounded size, whether
    /// a capture is known to be under way, and a fitting cached free block
    /// of the stream (taken out of the free index), if one exists.
    #[inline]
    fn cached_block(
        &mut self,
        size: u64,
        stream: StreamId,
        into: Option<PoolKey>,
    ) -> Result<Cached, AllocError> {
        // A stream that allocates is alive (Note [Streams that refuse events]).
        self.fences.revive(stream);
        let mut capturing = self.private.capturing();
        if capturing && !self.capture_reuse.is_empty() {
            self.free_safe_blocks_in_capture(stream);
        }
        // On the route without pool hooks, a capture nobody announced may
        // forbid what a capture does; asked only before the first call it
        // would forbid (Note [Capture without a pool]): the legacy stream
        // before event queries, every stream of ours before the slow path.
        if !capturing && !self.pending.is_idle() {
            capturing = self.capture_unseen();
            if !capturing {
                self.process_events()?;
            }
        }
        let rounded = round_size(size, &self.config);
        let forced = into
            .and_then(|key| self.private.find(key))
            .map(|(small, large, _)| match PoolKind::of(rounded) {
                PoolKind::Small => small,
                PoolKind::Large => large,
            });
        let mut pool = forced.unwrap_or_else(|| self.pool_for(rounded, stream));
        if self.plain_requests && self.expandable && pool <= LARGE {
            pool = self.plain_request_pool(PoolKind::of(rounded));
        }
        let mut block = self.get_free_block(pool, stream, rounded);
        if block.is_none()
            && pool <= LARGE
            && let Some(ids) = self.private.plain_requests_ids()
        {
            // Note [PyTorch's expandable_segments switch]: blocks cached
            // while it was off serve requests after it, as PyTorch's one
            // pool serves them.
            let plain = match PoolKind::of(rounded) {
                PoolKind::Small => ids.0,
                PoolKind::Large => ids.1,
            };
            match self.get_free_block(plain, stream, rounded) {
                Some(b) => (pool, block) = (plain, Some(b)),
                // One lookup per request ages the cache (garbage collection).
                None => self.heap.pools[plain as usize].lookups -= 1,
            }
        }
        Ok(Cached {
            pool,
            rounded,
            capturing,
            block,
        })
    }

    /// The allocation path when the stream's own cache has no fit.
    fn malloc_slow(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        size: u64,
        rounded: u64,
        capturing: bool,
    ) -> Result<BlockId, AllocError> {
        let alloc_size = allocation_size(rounded, &self.config);
        // Expandable segments reclaim other streams' free pages by unmapping
        // them instead (Note [Defragmentation]).
        if !capturing
            && self.config.cross_stream_reuse
            && self.plain_pool(pool)
            && let Some(b) = self.take_from_other_stream(pool, stream, rounded)?
        {
            return Ok(b);
        }
        if self.config.gc_threshold > 0.0 && !capturing {
            self.garbage_collect()?;
        }
        let mut cause = match self.grow(pool, alloc_size, rounded, stream, capturing) {
            Ok(b) => return Ok(b),
            Err(GrowError::Full(cause)) => cause,
            Err(GrowError::Failed(e)) => return Err(e),
        };
        // A request larger than the device (or the limit) can never fit:
        // report it without flushing the cache for nothing. Expandable
        // segments need only its pages, not a plain segment's size.
        let needed = if !self.plain_pool(pool) {
            let page = self.page_size(self.heap.pools[pool as usize].kind);
            rounded.div_ceil(page).saturating_mul(page)
        } else {
            alloc_size
        };
        let max = self.capacity()?;
        if needed > max {
            // A pool's free block grows nothing: it may fit what a cap
            // lowered since the pool filled never would.
            if let Some(b) = self.borrow_from_use_on_oom_pools(pool, stream, rounded) {
                return Ok(b);
            }
            return Err(self.out_of_memory(stream, Some(pool), size, needed, cause));
        }
        if !capturing {
            // PyTorch's order: release oversize cached blocks, retry; then
            // wait for every event, release every unsplit cached segment, retry.
            crate::log::oom_retry(self.device, needed, "releasing oversize cached blocks");
            if self.release_available_cached_blocks(pool, stream, rounded)? {
                match self.grow(pool, alloc_size, rounded, stream, false) {
                    Ok(b) => return Ok(b),
                    Err(GrowError::Full(_)) => {}
                    Err(GrowError::Failed(e)) => return Err(e),
                }
            }
            crate::log::oom_retry(self.device, needed, "freeing every cached segment");
            self.release_cached_blocks()?;
            self.stats.num_alloc_retries += 1;
            match self.grow(pool, alloc_size, rounded, stream, false) {
                Ok(b) => return Ok(b),
                Err(GrowError::Full(c)) => cause = c,
                Err(GrowError::Failed(e)) => return Err(e),
            }
        }
        if let Some(b) = self.borrow_from_use_on_oom_pools(pool, stream, rounded) {
            return Ok(b);
        }
        Err(self.out_of_memory(stream, Some(pool), size, needed, cause))
    }

    /// Note [MemPool options]
    /// Rationale: `torch.cuda.MemPool(use_on_oom=True)` lends a pool's free
    /// blocks to requests outside any pool that would fail otherwise
    /// (libraries keep a pool of scratch or KV memory and let the rest of
    /// the program borrow it under pressure); `MemPool(no_split=True)`
    /// hands out whole blocks (a segment per allocation, for memory that is
    /// registered or exported per allocation). Programs that ask for
    /// either stopped with an error under gpualloc.
    /// Approach: PyTorch's rules. After every retry of the out-of-memory
    /// path, a request of a default pool takes a fitting free block of its
    /// stream from the held `use_on_oom` pools, in creation order (no pool
    /// grows for it); the block stays its pool's. A `no_split` pool never
    /// splits a block and, created so as `MemPool` creates it, grows by
    /// plain segments of PyTorch's sizes whatever the device's mode, as a
    /// pool served by another allocator does.
    fn borrow_from_use_on_oom_pools(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
    ) -> Option<BlockId> {
        // The default pools, or the pool serving them while PyTorch's
        // expandable_segments is off (a private pool with no key), which
        // borrows plain blocks only, as PyTorch skips expandable ones then.
        let plain_only = pool > STITCH && self.heap.pools[pool as usize].private.is_none();
        if pool > LARGE && !plain_only {
            return None;
        }
        let kind = self.heap.pools[pool as usize].kind;
        self.private.use_on_oom(kind).into_iter().find_map(|p| {
            if plain_only && !self.plain_pool(p) {
                return None;
            }
            self.get_free_block(p, stream, rounded)
        })
    }

    /// PyTorch's `get_pool`: the innermost private-pool scope whose filter
    /// accepts the stream, else the default pool of the size's kind.
    #[inline]
    fn pool_for(&self, rounded: u64, stream: StreamId) -> PoolId {
        let kind = PoolKind::of(rounded);
        if let Some(p) = self.private.pool_for(stream, kind) {
            return p;
        }
        match kind {
            PoolKind::Small => SMALL,
            PoolKind::Large => LARGE,
        }
    }

    /// Whether a cached block of `candidate` bytes may serve a rounded request
    /// (PyTorch's oversize rules).
    #[inline]
    fn oversize_ok(&self, rounded: u64, candidate: u64) -> bool {
        let max_split = self.config.max_split_size;
        if rounded < max_split && candidate >= max_split {
            return false;
        }
        !(rounded >= max_split
            && candidate >= rounded.saturating_add(self.config.max_non_split_rounding))
    }

    /// Best fit in the stream's own free list, removed from the index.
    #[inline]
    fn get_free_block(&mut self, pool: PoolId, stream: StreamId, rounded: u64) -> Option<BlockId> {
        let p = &mut self.heap.pools[pool as usize];
        p.lookups += 1;
        let key = p.best_fit(stream, rounded)?;
        if !self.oversize_ok(rounded, key.1) {
            return None;
        }
        self.heap.pools[pool as usize].remove(key);
        Some(key.3)
    }

    /// See Note [Cross-stream reuse].
    fn take_from_other_stream(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
    ) -> Result<Option<BlockId>, AllocError> {
        let Some(key) =
            self.heap.pools[pool as usize]
                .best_fit_other_stream(stream, rounded, |c| self.oversize_ok(rounded, c))
        else {
            return Ok(None);
        };
        let owner = key.0;
        // A driver error here (a stream that no longer exists) only means
        // this block cannot be taken: grow instead.
        let Ok(event) = self.backend.record_event(owner) else {
            return Ok(None);
        };
        let waited = self.backend.stream_wait_event(stream, event);
        self.backend.destroy_event(event);
        if waited.is_err() {
            return Ok(None);
        }
        self.heap.pools[pool as usize].remove(key);
        // The block changes hands in `alloc_found_block`; a split-off
        // remainder stays with the owner, which never used it.
        self.stats.num_cross_stream_reuse += 1;
        self.record(Action::StreamReuse, stream, key.2, key.1, owner);
        Ok(Some(key.3))
    }

    /// Adds memory to `pool` for a rounded request: pages in the stream's
    /// expandable segment, or a new segment of `alloc_size` bytes.
    fn grow(
        &mut self,
        pool: PoolId,
        alloc_size: u64,
        rounded: u64,
        stream: StreamId,
        capturing: bool,
    ) -> Result<BlockId, GrowError> {
        if !self.plain_pool(pool) {
            self.map_expandable(pool, stream, rounded, capturing)
        } else {
            self.alloc_block(pool, alloc_size, stream, capturing)
        }
    }

    /// Obtains a new segment for `pool` from the backend, honouring the limit.
    /// The returned block is free and outside the free index.
    pub(crate) fn alloc_block(
        &mut self,
        pool: PoolId,
        size: u64,
        stream: StreamId,
        capturing: bool,
    ) -> Result<BlockId, GrowError> {
        let reserved = self.stats.reserved_bytes.all.current as u64;
        if let Some(limit) = self.limit()?
            && reserved + size > limit
        {
            return Err(GrowError::Full(None));
        }
        let ptr = match self.private.source_mut(pool) {
            // As PyTorch calls `raw_alloc`: as `cudaMalloc`, in relaxed
            // capture mode during a capture.
            Some(source) => {
                let mut got = Err(BackendError::OutOfMemory { requested: size });
                self.backend
                    .call_other_allocator(capturing, &mut || {
                        got =
                            crate::segment_source::calling_source(|| source.allocate(size, stream));
                    })
                    .and(got)
            }
            None => self.backend.allocate(size, capturing),
        }
        .map_err(|e| match e {
            BackendError::OutOfMemory { .. } => {
                GrowError::Full(Some(BackendError::OutOfMemory { requested: size }))
            }
            e => GrowError::Failed(e.into()),
        })?;
        let kind = self.heap.pools[pool as usize].kind;
        let (_, block) = self.heap.new_segment(ptr, size, pool, stream, false);
        self.notify(SegmentAction::Alloc, pool, stream, ptr, size);
        self.private.segment_added(pool);
        self.stats.segment.update(kind, 1);
        self.stats.reserved_bytes.update(kind, size as i64);
        self.stats.num_device_alloc += 1;
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.update(1);
        }
        let code = pool_code(self.private.index_of(pool), kind == PoolKind::Large);
        self.count_obtained(size);
        self.record(Action::SegmentAlloc, stream, ptr, size, code);
        crate::log::new_segment(self.device, size, pool, reserved + size);
        Ok(block)
    }

    /// Whether `pool` grows by plain segments: the device's mode, or a
    /// pool served by another allocator (Note [Pools served by another
    /// allocator] in `segment_source.rs`).
    #[inline]
    pub(crate) fn plain_pool(&self, pool: PoolId) -> bool {
        !self.expandable || self.private.plain(pool)
    }

    /// PyTorch's `should_split`.
    #[inline]
    fn should_split(&self, pool: PoolId, kind: PoolKind, block_size: u64, rounded: u64) -> bool {
        let remaining = block_size - rounded;
        if pool == STITCH || self.private.no_split(pool) {
            return false;
        }
        if !self.plain_pool(pool) {
            return remaining >= crate::size_class::MIN_BLOCK_SIZE;
        }
        match kind {
            PoolKind::Small => remaining >= crate::size_class::MIN_BLOCK_SIZE,
            PoolKind::Large => {
                rounded < self.config.max_split_size && remaining > crate::size_class::SMALL_SIZE
            }
        }
    }

    /// Hands out a found block: splits off the remainder when worth it,
    /// updates stats and the trace. PyTorch's `alloc_found_block`.
    fn alloc_found_block(
        &mut self,
        id: BlockId,
        pool: PoolId,
        stream: StreamId,
        size: u64,
        rounded: u64,
    ) -> DevicePtr {
        let kind = self.heap.pools[pool as usize].kind;
        // Expandable blocks are never counted as inactive splits (PyTorch).
        let counted = self.plain_pool(pool);
        let already_split = counted && self.heap.blocks[id].is_split();
        let block_size = self.heap.blocks[id].size;
        if self.should_split(pool, kind, block_size, rounded) {
            let b = &self.heap.blocks[id];
            let rest = Block {
                prev: Some(id),
                next: b.next,
                gc_base: self.heap.pools[pool as usize].lookups,
                freed: b.freed,
                ..Block::new(
                    b.ptr + rounded,
                    block_size - rounded,
                    b.stream,
                    b.segment,
                    pool,
                    BlockState::Free,
                )
            };
            let (rest_ptr, rest_size, rest_stream) = (rest.ptr, rest.size, rest.stream);
            let rest_id = self.heap.blocks.insert(rest);
            if let Some(n) = self.heap.blocks[id].next {
                self.heap.blocks[n].prev = Some(rest_id);
            }
            self.heap.blocks[id].next = Some(rest_id);
            self.heap.blocks[id].size = rounded;
            self.heap.pools[pool as usize].insert((rest_stream, rest_size, rest_ptr, rest_id));
            if !counted {
            } else if already_split {
                self.stats
                    .inactive_split_bytes
                    .update(kind, -(rounded as i64));
            } else {
                self.stats
                    .inactive_split_bytes
                    .update(kind, rest_size as i64);
                self.stats.inactive_split.update(kind, 1);
            }
        } else if already_split {
            self.stats
                .inactive_split_bytes
                .update(kind, -(block_size as i64));
            self.stats.inactive_split.update(kind, -1);
        }
        self.mark_allocated(id, pool, stream, size)
    }

    /// Marks a block (out of the free index, split as it will stay) as
    /// handed out for `size` bytes on `stream`: address map, stats, trace.
    #[inline]
    pub(crate) fn mark_allocated(
        &mut self,
        id: BlockId,
        pool: PoolId,
        stream: StreamId,
        size: u64,
    ) -> DevicePtr {
        let kind = self.heap.pools[pool as usize].kind;
        let b = &mut self.heap.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = size;
        b.stream = stream;
        let (ptr, bsize) = (b.ptr, b.size);
        self.live.insert(ptr, id);
        let s = &mut self.stats;
        s.allocation.update(kind, 1);
        s.allocated_bytes.update(kind, bsize as i64);
        s.requested_bytes.update(kind, size as i64);
        s.active.update(kind, 1);
        s.active_bytes.update(kind, bsize as i64);
        if bsize >= self.config.max_split_size {
            s.oversize_allocations.update(1);
        }
        self.private.block_allocated(pool);
        self.record(Action::Alloc, stream, ptr, size, bsize);
        ptr
    }

    /// Frees a block. Reusable at once on its stream, unless other streams
    /// used it (`record_stream`): then it waits for an event on each.
    ///
    /// # Errors
    /// [`AllocError::InvalidPointer`] for a pointer not allocated here.
    #[inline]
    pub fn free(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.free_from(ptr, None)
    }

    /// [`free`](Self::free) made where `current` is the current stream, if
    /// known: a block freed while another stream than its own is current
    /// counts as used on that stream (`record_stream`), whose queued work
    /// may still read it (Note [Frees on another stream]).
    ///
    /// # Errors
    /// As [`free`](Self::free).
    pub fn free_from(
        &mut self,
        ptr: DevicePtr,
        current: Option<StreamId>,
    ) -> Result<(), AllocError> {
        if ptr == 0 {
            return Ok(());
        }
        let Some(&id) = self.live.get(&ptr) else {
            return Err(AllocError::InvalidPointer {
                ptr,
                device: self.device,
            });
        };
        if self.heap.blocks[id].state != BlockState::Allocated {
            return Err(AllocError::InvalidPointer {
                ptr,
                device: self.device,
            });
        }
        // Not in private pools (the pool of plain requests is none): their
        // memory never moves and stays theirs (Note [Private pools]), and
        // cudagraph trees free a graph's outputs on the default stream,
        // then restore checkpoints that refuse blocks still pending.
        if let Some(current) = current
            && current != self.heap.blocks[id].stream
            && self.private.index_of(self.heap.blocks[id].pool).is_none()
        {
            self.add_stream_use(id, ptr, current);
        }
        if self.private.following() {
            self.follow_before_free(id)?;
        }
        let b = &mut self.heap.blocks[id];
        b.state = BlockState::PendingFree;
        let (size, requested, stream, pool) = (b.size, b.requested, b.stream, b.pool);
        let kind = self.heap.pools[pool as usize].kind;
        self.stats.allocation.update(kind, -1);
        self.stats.allocated_bytes.update(kind, -(size as i64));
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.update(-1);
        }
        self.private.block_freed(pool);
        if self.heap.blocks[id].stream_uses.is_empty() {
            // Request and completion in one record (`Action::Free`).
            self.free_block_as(id, Action::Free);
            return Ok(());
        }
        self.record(Action::FreeRequested, stream, ptr, requested, size);
        self.notify(SegmentAction::BlockFreeDeferred, pool, stream, ptr, size);
        let captured_uses = self.capture_reuse.take_captured_uses(id);
        if self.private.capturing() {
            self.defer_in_capture(id, captured_uses);
        } else if let Err(e) = self.insert_events(id) {
            self.pending.defer(id);
            return Err(e.into());
        }
        Ok(())
    }

    /// The block size of the live allocation at `ptr` (what freeing it
    /// gives back to the cache); None for a pointer not allocated here.
    pub fn allocation_size(&self, ptr: DevicePtr) -> Option<u64> {
        let &id = self.live.get(&ptr)?;
        let b = &self.heap.blocks[id];
        (b.state == BlockState::Allocated).then_some(b.size)
    }

    /// Returns a block to its pool, merging it with free neighbours of the
    /// same stream. PyTorch's `free_block`.
    pub(crate) fn free_block(&mut self, id: BlockId) {
        let b = &self.heap.blocks[id];
        let (stream, ptr, size, pool) = (b.stream, b.ptr, b.size, b.pool);
        // Told before the segment changes the free causes (a stitch given
        // back), so that memory history records the completion first, as
        // PyTorch does.
        self.notify(SegmentAction::BlockFreeCompleted, pool, stream, ptr, size);
        self.free_block_as(id, Action::FreeCompleted);
    }

    /// [`free_block`](Self::free_block), traced as `action`.
    fn free_block_as(&mut self, id: BlockId, action: Action) {
        let (pool, ptr, stream, requested, size) = {
            let b = &self.heap.blocks[id];
            (b.pool, b.ptr, b.stream, b.requested, b.size)
        };
        let kind = self.heap.pools[pool as usize].kind;
        let mut net_blocks = 0i64;
        let mut net_bytes = 0i64;
        for neighbour in [self.heap.blocks[id].prev, self.heap.blocks[id].next]
            .into_iter()
            .flatten()
        {
            let subsumed = self.heap.try_merge(id, neighbour);
            if subsumed > 0 {
                net_blocks -= 1;
                net_bytes -= subsumed as i64;
            }
        }
        self.live.remove(&ptr);
        self.shares.freed(ptr);
        let lookups = self.heap.pools[pool as usize].lookups;
        let epoch = self.fences.stamp();
        // An event recorded during a capture belongs to the graph: it would
        // never tell when this work is done.
        if self.expandable && !self.private.capturing() {
            // On the route without pool hooks, a global capture no call of
            // ours has seen yet forbids the event queries of a full queue
            // (Note [Capture without a pool]): the legacy stream says.
            let following = self.private.following();
            self.fences
                .after_free(&mut self.backend, stream, size, |b| {
                    !following || !crate::backend::legacy_reports_capture(b)
                });
        }
        let b = &mut self.heap.blocks[id];
        b.state = BlockState::Free;
        b.requested = 0;
        b.gc_base = lookups;
        b.freed = epoch;
        let key = (b.stream, b.size, b.ptr, id);
        if b.is_split() {
            net_blocks += 1;
            net_bytes += b.size as i64;
        }
        // Recorded before a stitch given back changes what is listed, as
        // the observer is told (Note [Listed ranges]).
        self.record(action, stream, ptr, requested, size);
        if pool == STITCH {
            self.unclaim_stitch(id, epoch);
        } else {
            self.heap.pools[pool as usize].insert(key);
        }
        if self.plain_pool(pool) {
            self.stats.inactive_split.update(kind, net_blocks);
            self.stats.inactive_split_bytes.update(kind, net_bytes);
        }
        self.stats.active.update(kind, -1);
        self.stats.active_bytes.update(kind, -(size as i64));
        self.stats.requested_bytes.update(kind, -(requested as i64));
    }
}
