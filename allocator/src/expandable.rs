//! Expandable segments: reserved address ranges per (pool, stream), with
//! physical pages mapped at the place a request fits best.
//!
//! Note [Expandable segments]
//! Rationale: plain segments never merge, so a cache full of freed 20 MiB
//! segments cannot serve a 30 MiB request and the pool grows; this is how
//! PyTorch reaches 1.8x reserved over allocated on multi-scale training.
//! Approach (PyTorch's `expandable_segments:True`): reserve about 1.125x the
//! device's memory of address space per (pool, stream) and map pages (2 MiB;
//! `expandable_page_mb` in the large pool, where PyTorch uses 20 MiB) on
//! demand in the window of free and unmapped space that needs the fewest
//! new pages. Freed space therefore stays contiguous with new space. The
//! physical memory behind pages comes from the page pool (Note [Page pool]).
//!
//! Note [Defragmentation]
//! Expandable segments alone leave long-lived blocks scattered among freed
//! ones; the free pages around them stay mapped, so reserved memory keeps
//! the high-water mark of every layout seen. With `defragment:true` (the
//! default), when a mapping needs more physical memory than the pool holds:
//! a request of at least `stitch_min_mb` is first served by a stitch (Note
//! [Stitching]), which maps free pages a second time and moves nothing;
//! otherwise, if holding more would pass `(1 + defragment_headroom)` times
//! (at least 1.05 times near a memory limit, Note [Headroom under pressure])
//! the peak of allocated memory (the device's own high-water mark, which
//! `reset_peak_memory_stats` leaves alone: a statistic reset for logging
//! changes no decision, and traces, which do not record resets, replay to
//! the same ones), whole free handles elsewhere are unmapped
//! into the pool, largest runs first (the fewest runs cut, and the small
//! free runs between live blocks left for the small requests that fit
//! there; smallest first while the stitch budget has no credit) and only
//! as many handles as needed, and mapped where the request
//! fits. Handles that a cached stitch aliases are taken last, only when the
//! others fall short and only within a budget of driver time (each handle
//! taken is unmapped from the stitch too, a hole filled when the stitch is
//! next needed, Note [Stitching]; Note [Defragmentation budget] in
//! `budget.rs`; the order: Note [Reclaim order] in `free_runs.rs`). Pages
//! leave their address only once the work on them is done (Note
//! [Event-ordered unmapping]). Below that bound the pool simply grows. The
//! choices were tuned by replaying GPU traces with `gpualloc replay --json`,
//! which predicts driver time (`docs/driver-costs.md`): moving a handle
//! costs about 65 µs, whatever its size up to 16 MiB, hence handles of up to
//! `expandable_handle_mb` and stitches that are kept for the next step.
//! When no window of the stream's reservations can hold the request at all
//! (address space scattered by live blocks), a fresh range is reserved for
//! it. On the out-of-memory path every cached stitch is dropped, every free
//! page unmapped and the pool released, so a request fails only when the
//! handles holding live blocks plus the request exceed the device.
//!
//! Note [Headroom under pressure]
//! Rationale: how much memory a run needs under a cap is not its uncapped
//! peak. Moving pages to stay within `defragment_headroom` of the live
//! peak scatters the layout (live blocks end up one by one between free
//! runs, a partly used page at each edge), and a cap below the peak that
//! this layout reached fails. A run that grew in place instead, and that
//! the out-of-memory path packs when it meets the cap (the cache flushed,
//! the request retried), fits in less: over 28 recorded traces the
//! smallest `memory_limit` without an OOM (`gpualloc replay --min-limit`)
//! averages 1.0281x the live peak by default and 1.0238x with a 5%
//! headroom from the start, and the README's example fails under its
//! recorded 1,700 MiB by default, not with the headroom. But a 5% headroom
//! reserves up to 1.05x the live peak where memory is plentiful, against
//! 1.005x (fifty-first study of `docs/policy-experiments.md`).
//! Approach: once the peak of allocated memory passes
//! `defragment_pressure` (half by default) of a memory limit in force
//! (`memory_limit`, or a fraction below 1: `per_process_memory_fraction`,
//! `set_per_process_memory_fraction`), the
//! headroom is at least [`PRESSURE_HEADROOM`]. A program that sets a
//! limit says that fitting under it is what counts; one that does not is
//! kept within 0.5% of its live peak however large it is, as the default
//! promises. Runs far from their limit defragment as before: every trace
//! replays as before uncapped. Judged with `--min-limit` over the 28
//! traces: mean 1.0281 → 1.0228, less memory needed on 19, more on 3
//! (FSDP2 +0.0071, the `Trainer` and the GNN +0.0013); shares of 0.35–0.6
//! give 1.0226–1.0233, 0.65 gives 1.0254, 0.8 gives 1.0260; a headroom of
//! 2, 3, 4, 7 or 10% gives 1.0275, 1.0260, 1.0244, 1.0221 and 1.0223.
//! Limitation: a run that holds between half and all of its limit but
//! never meets it keeps up to 5% over its live peak rather than 0.5%:
//! under limits of 1.06–1.4x the live peak the 28 traces reserve
//! 1.037–1.041x on average, against 1.024–1.028x (fifty-second study).
//! That is why the device's own capacity is not taken for a limit: there
//! it would cost every large training the 0.5% the default promises,
//! while the run that meets the device's capacity is answered by `gpualloc
//! report`, whose advice on an OOM replays `defragment_headroom:0.05`.
//! Granting the headroom only once a run has met its cap gains nothing:
//! by then the layout has scattered (the smallest limits are the old
//! default's, to the byte). Bounding it by the cap, so that pages move
//! there before the cache is flushed, retries less but fails more.
//!
//! Mappings that pooled handles cannot cover are widened to ones they
//! can (Note [Small pages from pooled handles], Note [Widening to pooled
//! handles], in `widen.rs`).
//!
//! Private (graph) pools have expandable segments of their own and take
//! pooled pages, but never move pages (Note [Private pools] in
//! `capture.rs`). Blocks in expandable segments are never counted as
//! `inactive_split`, and the `segment` stat counts only plain segments, as
//! in PyTorch.

use crate::backend::{Backend, BackendError, DevicePtr, StreamId};
use crate::block::{BlockId, BlockState, PoolId, SegmentId};
use crate::cost::{CostModel, DriverCalls};
use crate::device::DeviceAllocator;
use crate::error::{AllocError, GrowError};
use crate::free_runs::RunOrder;
use crate::heap::{LARGE, SMALL, STITCH, Window};
use crate::observer::{SegmentAction, teller};
use crate::page_pool::KindDeltas;
use crate::size_class::{PoolKind, SMALL_BUFFER};
use crate::trace::{Action, pool_code};

/// The least headroom once the live peak nears the cap (Note [Headroom
/// under pressure]).
pub(crate) const PRESSURE_HEADROOM: f64 = 0.05;

impl<B: Backend> DeviceAllocator<B> {
    /// The address range past an expandable segment's end that it reserves
    /// and never maps: the mapped runs of two segments never touch, even
    /// where the driver places their reservations one after the other, so
    /// a consumer of segment events that joins touching ranges of a pool
    /// (the bridge, for NCCL's registration of a `MemPool`) joins only the
    /// runs the snapshot lists as one segment.
    fn guard(&mut self) -> u64 {
        self.backend
            .vmm_granularity()
            .unwrap_or(SMALL_BUFFER)
            .max(1)
    }

    /// The mapping granularity of a pool's expandable segments.
    pub(crate) fn page_size(&mut self, kind: PoolKind) -> u64 {
        let want = match kind {
            PoolKind::Small => SMALL_BUFFER,
            PoolKind::Large => self.config.expandable_page,
        };
        let g = self.backend.vmm_granularity().unwrap_or(want).max(1);
        want.div_ceil(g) * g
    }

    /// `(page, largest handle to create)` for a pool (Note [Page pool]).
    pub(crate) fn handle_sizes(&mut self, pool: PoolId) -> (u64, u64) {
        let page = self.page_size(self.heap.pools[pool as usize].kind);
        let max = if pool == SMALL {
            page
        } else {
            self.config.expandable_handle.max(page)
        };
        (page, max)
    }

    /// Reserves a new expandable segment for `(pool, stream)`.
    fn new_expandable_segment(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        at_least: u64,
    ) -> Result<SegmentId, GrowError> {
        let kind = self.heap.pools[pool as usize].kind;
        let page = self.page_size(kind);
        let total = self.device_total()?;
        // A private pool reserves less at a time (graphs are many, address
        // space is not endless); it gets more reservations as it grows.
        let want = if pool > STITCH {
            total / 8
        } else {
            total + total / 8
        };
        let size = want.max(at_least).div_ceil(page) * page;
        // Address space running out is "not now": releasing cached (fully
        // unmapped) ranges and retrying may help, as for memory.
        let guard = self.guard();
        let ptr = self.backend.reserve(size + guard).map_err(|e| match e {
            BackendError::OutOfMemory { .. } => {
                GrowError::Full(Some(BackendError::OutOfMemory { requested: size }))
            }
            e => GrowError::Failed(e.into()),
        })?;
        let (seg, _) = self.heap.new_segment(ptr, size, pool, stream, true);
        self.heap.pools[pool as usize]
            .expandable
            .push((stream, seg));
        self.private.segment_added(pool);
        Ok(seg)
    }

    /// Applies the page pool's reserved-bytes changes to the stats, and
    /// counts and traces `created` (positive) or released (negative) bytes.
    pub(crate) fn apply_deltas(&mut self, deltas: KindDeltas, physical: i64) {
        // Decreases first, so that a move between kinds never shows as a peak.
        let mut by_kind = [(PoolKind::Small, deltas[0]), (PoolKind::Large, deltas[1])];
        by_kind.sort_unstable_by_key(|k| k.1);
        for (kind, d) in by_kind {
            self.stats.reserved_bytes.update(kind, d);
        }
        if physical != 0 {
            let action = if physical > 0 {
                self.stats.num_device_alloc += 1;
                Action::PagesCreate
            } else {
                self.stats.num_device_free += 1;
                Action::PagesRelease
            };
            self.record(action, 0, 0, physical.unsigned_abs(), 0);
        }
    }

    /// Maps pages into one of the stream's expandable segments so that a
    /// free block of at least `rounded` bytes exists; returns it, outside
    /// the free index.
    pub(crate) fn map_expandable(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
        capturing: bool,
    ) -> Result<BlockId, GrowError> {
        if capturing {
            // Nothing may wait during a capture. Moved pages are finished
            // when a scope opens; pooled ones still mapped at their old
            // address (that wait failed, or captures began to be followed
            // through the driver while some were pooled) are kept out of
            // the capture's reach: it maps other pages, or new ones.
            let pages = &self.pages;
            let drained = self
                .drains
                .pooled_handles(|h, size| pages.is_pooled(h, size));
            let aside = self.pages.set_aside(&drained);
            let mapped = self.map_expandable_once(pool, stream, rounded, true, false);
            self.pages.put_back(aside);
            return mapped;
        }
        // Pages that moved without waiting and are back in the pool must not
        // reach another stream before their work is done (Note [Unmapping
        // behind the work]): this stream is ordered after that work before
        // any page is taken. (No scope is open here: a request made while
        // one is counts as captured and moves nothing, and opening one
        // finishes every drain, so a capture never meets them.)
        // Ranges given up meanwhile are unmapped once the request is done
        // (Note [Unmapping off the allocating thread]).
        self.backend.hold_later_work(true);
        let mapped = self
            .order_after_pooled_drains(stream)
            .map_err(GrowError::from)
            .and_then(|polled| self.map_expandable_once(pool, stream, rounded, capturing, polled));
        self.backend.hold_later_work(false);
        mapped
    }

    /// `polled`: the fences were polled just before (by
    /// `order_after_pooled_drains`), so they are not asked again.
    fn map_expandable_once(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
        capturing: bool,
        polled: bool,
    ) -> Result<BlockId, GrowError> {
        let kind = self.heap.pools[pool as usize].kind;
        let page = self.page_size(kind);
        let (mut seg, mut ws, mut ranges) = self.plan_window(pool, stream, rounded, page)?;
        if capturing && ranges.iter().any(|&(lo, hi)| self.drains.overlaps(lo, hi)) {
            // Old mappings still there cannot be waited for during a
            // capture (Note [Unmapping behind the work]): map elsewhere.
            (seg, ws, ranges) = self.fresh_window(pool, stream, rounded, page)?;
        }
        let mut bytes: u64 = ranges.iter().map(|r| r.1 - r.0).sum();
        let mut charge_from = None;
        // A private pool takes pooled pages but never moves pages: its
        // requests come during captures, when events cannot be queried.
        if !capturing && pool <= LARGE {
            let streams = self.expandable_streams();
            if !polled {
                self.fences.poll(&mut self.backend)?;
            }
            // Tidying only: an error leaves the ranges for the next call.
            if let Err(e) = self.retire_idle_drains() {
                crate::log::drains_left(self.device, &e);
            }
            self.fences.cover_all(&mut self.backend, streams);
            if let Some(w) = self.widen(pool, stream, rounded, &ranges, page)? {
                ((seg, ws, ranges), bytes) = w;
            }
            let short = bytes - self.pages.usable_in(&ranges, page);
            let calls = (short > 0 && self.config.defragment).then(|| self.defrag_meter());
            // Stitches serve the large pool only (a small request of 1 MiB
            // under `stitch_min_mb:1` would be counted in the large pool).
            if short > 0
                && self.config.defragment
                && pool == LARGE
                && rounded >= self.config.stitch_min
            {
                let spend = self.stitch_may_spend(short, rounded)?;
                let stitched = self.stitch_for(stream, rounded, spend);
                self.charge_defragmentation(calls);
                // A stitch that fails (no address space left, a driver
                // error) leaves a consistent cache: moving pages or growing
                // may still serve the request, and the out-of-memory path
                // drops the cached stitches before it retries.
                match stitched {
                    Ok(Some(b)) => return Ok(b),
                    Ok(None) => {}
                    Err(e) => crate::log::stitch_failed(self.device, rounded, &e),
                }
            }
            if short > 0 && self.config.defragment {
                // See Note [Defragmentation].
                let high = self
                    .allocated_high()
                    .max(self.stats.allocated_bytes.all.current as u64 + rounded);
                let headroom = self.headroom(high)?;
                let s = &self.stats;
                let bound = (high as f64 * (1.0 + headroom)) as u64;
                let held = s.reserved_bytes.all.current as u64;
                let excess = (held + short).saturating_sub(bound);
                if excess > 0 {
                    crate::log::defragment(self.device, rounded, short, excess);
                    // Pages cached stitches alias are taken within the
                    // budget, or whenever growing instead would raise the
                    // peak of reserved memory (Note [Defragmentation budget]).
                    let now = self.call_time();
                    let within = self
                        .defrag_budget
                        .allows(now, self.config.defragment_budget);
                    let share = self.config.defragment_budget;
                    let pinned = within || (share > 0.0 && held + short > self.reserved_high());
                    // A device out of stitch credit keeps moving pages
                    // (Note [Reclaim order] in `free_runs.rs`).
                    let order = if self.stitch_budget.allows(now, self.config.stitch_budget) {
                        RunOrder::LargestFirst
                    } else {
                        RunOrder::SmallestFirst
                    };
                    let calls = Some(self.defrag_meter());
                    // The window, widened or not, is not taken apart.
                    let end = ranges.iter().map(|r| r.1).fold(ws + rounded, u64::max);
                    let moved =
                        self.reclaim(excess.min(short), stream, (seg, ws, end), pinned, order);
                    if !matches!(moved, Ok(m) if m > 0) {
                        self.charge_defragmentation(calls);
                    }
                    // Mapping the moved pages below is charged too.
                    charge_from = calls.filter(|_| matches!(moved, Ok(m) if m > 0));
                    moved?;
                    if let Some(w) = self.widen(pool, stream, rounded, &ranges, page)? {
                        ((seg, ws, ranges), bytes) = w;
                    }
                }
            }
        }
        let new_bytes = bytes - self.pages.usable_in(&ranges, page);
        let reserved = self.stats.reserved_bytes.all.current as u64;
        // Pooled handles this mapping cannot use (moved pages that do not
        // tile its holes) go back before creating would raise the most
        // memory ever reserved (Note [Spare handles at the high-water mark]).
        if !capturing && pool <= LARGE && new_bytes > 0 && self.config.defragment {
            let over = (reserved + new_bytes).saturating_sub(self.reserved_high());
            if over > 0 {
                self.release_spare(&ranges, page, over);
            }
        }
        let reserved = self.stats.reserved_bytes.all.current as u64;
        // Never create what cannot fit: the limit, or the device itself.
        let cap = self.capacity()?;
        if new_bytes > 0 && reserved + new_bytes > cap {
            return Err(GrowError::Full(None));
        }
        crate::log::expandable_grows(self.device, stream, rounded, bytes, new_bytes, reserved);
        let mut failure = None;
        for (lo, hi) in ranges {
            if let Err(e) = self.map_range(seg, stream, lo, hi, capturing) {
                failure = Some(e);
                break;
            }
        }
        self.heap.coalesce_segment(seg);
        self.charge_defragmentation(charge_from);
        if let Some(e) = failure {
            return Err(e.into());
        }
        let block = self.heap.block_at(seg, ws);
        debug_assert!(
            self.heap.blocks[block].state == BlockState::Free
                && self.heap.blocks[block].size >= rounded
        );
        self.heap.unindex(block);
        Ok(block)
    }

    /// How far held memory may pass `high` (the peak of allocated memory,
    /// or what it will be with the request) before pages move:
    /// `defragment_headroom`, and at least [`PRESSURE_HEADROOM`] once
    /// `high` passes `defragment_pressure` of a memory limit in force (Note
    /// [Headroom under pressure]).
    fn headroom(&mut self, high: u64) -> Result<f64, AllocError> {
        let own = self.config.defragment_headroom;
        let share = self.config.defragment_pressure;
        if share >= 1.0 {
            return Ok(own);
        }
        // A limit above the device is still the program's word: the rule
        // reads it as set, as the garbage collection's threshold does.
        let Some(cap) = self.limit()? else {
            return Ok(own);
        };
        Ok(if high as f64 > share * cap as f64 {
            own.max(PRESSURE_HEADROOM)
        } else {
            own
        })
    }

    /// Returns to the driver at least `over` bytes of pooled handles a
    /// mapping of `ranges` cannot use, or all it cannot use (Note [Spare
    /// handles at the high-water mark]); those still mapped at their old
    /// place are waited for and unmapped there first. Only a saving: a
    /// handle the driver keeps, or old work that cannot be waited for, is
    /// logged and the mapping creates what it would have.
    fn release_spare(&mut self, ranges: &[(DevicePtr, DevicePtr)], page: u64, over: u64) {
        let chosen = self.pages.spare(ranges, page, over);
        if chosen.is_empty() {
            return;
        }
        let finished = {
            let say = teller(&self.observer, self.device);
            self.drains.finish_pooled(
                &mut self.fences,
                &mut self.backend,
                |h, _| chosen.iter().any(|c| c.0 == h),
                &say,
            )
        };
        if let Err(e) = finished {
            crate::log::spare_release_failed(self.device, &e);
            return;
        }
        let (r, deltas) = self.pages.release_these(&mut self.backend, &chosen);
        self.apply_deltas(deltas, deltas[0] + deltas[1]);
        if let Err(e) = r {
            crate::log::spare_release_failed(self.device, &e);
        }
    }

    /// The driver calls made, with the unmapping of old ranges of pages that
    /// moved without waiting counted when they moved rather than when the
    /// unmapping came, which depends on the GPU's progress: what the
    /// defragmentation budget is charged by, so that a replay makes the same
    /// decisions (Note [Unmapping behind the work]).
    fn defrag_meter(&self) -> DriverCalls {
        let (moved, unmapped) = self.drains.unmaps();
        let mut calls = self.backend.driver_calls().since(unmapped);
        calls.merge(moved);
        calls
    }

    /// Charges the memory calls made since `before` to the defragmentation
    /// budget at the cost model's price, never at the time measured, and
    /// not the event calls, whose number depends on which fences the GPU
    /// had passed (Note [Defragmentation budget]).
    fn charge_defragmentation(&mut self, before: Option<DriverCalls>) {
        let Some(before) = before else { return };
        let spent = self.defrag_meter().since(&before).without_events();
        let ns = CostModel::h200().predict_ms(&spent) * 1e6;
        self.defrag_budget.charge(ns);
        self.stitch_budget.charge(ns);
    }

    /// Whether serving a request of `rounded` bytes from a stitch may make
    /// driver calls (build or repair one) when its window lacks `short`
    /// bytes: always when growing by that much would pass the capacity (the
    /// promise holds whatever the budget), else where a stitch pays (Note
    /// [When a stitch pays] in `stitch_cache.rs`) and while the stitch
    /// budget has credit (Note [Stitch budget] in `budget.rs`).
    fn stitch_may_spend(&mut self, short: u64, rounded: u64) -> Result<bool, AllocError> {
        let held = self.stats.reserved_bytes.all.current as u64;
        if held + short > self.capacity()? {
            return Ok(true);
        }
        // The budget's clock starts and its credit is capped whatever the
        // request, so it is asked first.
        let now = self.call_time();
        let credit = self.stitch_budget.allows(now, self.config.stitch_budget);
        let share = self.config.stitch_short_share;
        Ok(credit && self.stitches.worth_calls(short, rounded, share))
    }

    /// Where `rounded` bytes go in `(pool, stream)`'s expandable segments:
    /// `(segment, window start, page ranges to map)`, in a new reservation
    /// when none can hold them.
    pub(crate) fn plan_window(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
        page: u64,
    ) -> Result<Window, GrowError> {
        if let Some(w) = self.heap.find_window(pool, stream, rounded, page) {
            return Ok(w);
        }
        self.fresh_window(pool, stream, rounded, page)
    }

    /// A window for `rounded` bytes in a new reservation of `(pool, stream)`.
    fn fresh_window(
        &mut self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
        page: u64,
    ) -> Result<Window, GrowError> {
        let seg = self.new_expandable_segment(pool, stream, rounded)?;
        let (ws, r) = self
            .heap
            .best_window(seg, stream, rounded, page)
            .expect("a fresh reservation holds the request");
        Ok((seg, ws, r))
    }

    /// Unmaps the old addresses of pages that moved without waiting whose
    /// work is now known done (Note [Unmapping behind the work]).
    pub(crate) fn retire_drains(&mut self) -> Result<(), BackendError> {
        if self.drains.is_empty() {
            return Ok(());
        }
        self.fences.poll(&mut self.backend)?;
        self.retire_idle_drains()
    }

    /// [`retire_drains`](Self::retire_drains) on what the fences knew at
    /// their last poll.
    fn retire_idle_drains(&mut self) -> Result<(), BackendError> {
        if self.drains.is_empty() {
            return Ok(());
        }
        let say = teller(&self.observer, self.device);
        let later = self.config.unmap_thread;
        self.drains
            .retire(&self.fences, &mut self.backend, later, &say)
    }

    /// Waits for and unmaps every old address of pages that moved without
    /// waiting (before handles go back to the driver).
    pub(crate) fn finish_drains(&mut self) -> Result<(), BackendError> {
        let say = teller(&self.observer, self.device);
        self.drains
            .finish_all(&mut self.fences, &mut self.backend, &say)
    }

    /// Waits for and unmaps the old addresses of pages that moved without
    /// waiting that lie in `[lo, hi)`, before something is mapped there or
    /// the range is freed.
    pub(crate) fn finish_drains_over(&mut self, lo: u64, hi: u64) -> Result<(), BackendError> {
        let say = teller(&self.observer, self.device);
        self.drains
            .finish_overlapping(&mut self.fences, &mut self.backend, lo, hi, &say)
    }

    /// Waits for and unmaps the old addresses of pages that moved without
    /// waiting and are back in the pool, unmapped from their new place or
    /// never mapped there (Note [Unmapping behind the work]).
    fn finish_pooled_drains(&mut self) -> Result<(), BackendError> {
        if self.drains.is_empty() {
            return Ok(());
        }
        let pages = &self.pages;
        let say = teller(&self.observer, self.device);
        self.drains.finish_pooled(
            &mut self.fences,
            &mut self.backend,
            |h, size| pages.is_pooled(h, size),
            &say,
        )
    }

    /// Orders `stream` after the work that may still use, at their old
    /// addresses, pages that moved without waiting and are back in the
    /// pool, as a request of `stream` may take them: it waits for that work
    /// on the GPU (`Fences::order_after`), and the pages it maps carry a
    /// stamp of its own (`map_range`). Where the driver refuses, or while
    /// captures are followed through the driver, the host waits for that
    /// work and the old addresses are unmapped instead. Returns whether it
    /// polled the fences (without error).
    fn order_after_pooled_drains(&mut self, stream: StreamId) -> Result<bool, BackendError> {
        if self.drains.is_empty() {
            return Ok(false);
        }
        // Those whose work a poll shows done leave first (tidying only: an
        // error leaves them, ordered below like the others).
        let polled = match self.retire_drains() {
            Ok(()) => true,
            Err(e) => {
                crate::log::drains_left(self.device, &e);
                false
            }
        };
        let pages = &self.pages;
        let owners = self
            .drains
            .pooled_owners(|h, size| pages.is_pooled(h, size));
        let ordered = !self.private.following()
            && owners.into_iter().all(|(s, stamp)| {
                self.fences
                    .order_after(&mut self.backend, stream, s, stamp)
                    .is_ok()
            });
        if ordered {
            Ok(polled)
        } else {
            self.finish_pooled_drains().map(|()| polled)
        }
    }

    /// Maps `[lo, hi)`, which lies inside one unmapped block of `seg`, and
    /// turns it into a free block (not yet indexed or merged).
    fn map_range(
        &mut self,
        seg: SegmentId,
        stream: StreamId,
        lo: u64,
        hi: u64,
        capturing: bool,
    ) -> Result<(), BackendError> {
        let (kind, pool) = (
            self.heap.segments.get(seg).kind,
            self.heap.segments.get(seg).pool,
        );
        let sizes = self.handle_sizes(pool);
        // The old mappings of pages that moved without waiting leave this
        // address range first (Note [Unmapping behind the work]).
        self.finish_drains_over(lo, hi)?;
        let (result, deltas, created) =
            self.pages
                .map(&mut self.backend, lo, hi - lo, kind, sizes, capturing);
        self.apply_deltas(deltas, created as i64);
        result?;
        self.notify(SegmentAction::Map, pool, stream, lo, hi - lo);
        let u = self.heap.block_at(seg, lo);
        debug_assert_eq!(self.heap.blocks[u].state, BlockState::Unmapped);
        let u_start = self.heap.blocks[u].ptr;
        if lo > u_start {
            self.heap.carve_front(u, lo - u_start, BlockState::Unmapped);
        }
        let mapped = self.heap.carve_front(u, hi - lo, BlockState::Free);
        let pool = self.heap.blocks[mapped].pool;
        self.heap.blocks[mapped].gc_base = self.heap.pools[pool as usize].lookups;
        self.heap.blocks[mapped].stream = stream;
        // Pages still mapped where work of this stream may run carry that
        // work's stamp, so another stream taking them waits for it (Note
        // [Unmapping behind the work]); new pages are untouched (0).
        // Pages whose old work runs on another stream, which this one was
        // made to wait for, carry this stream's stamp from now on.
        self.heap.blocks[mapped].freed = if self.drains.is_empty() {
            0
        } else {
            let handles = self.pages.handles_in(lo, hi);
            match self.drains.stamp_of(stream, handles.iter().map(|h| h.1)) {
                (own, false) => own,
                (own, true) => own.max(self.fences.stamp()),
            }
        };
        self.heap.segments.get_mut(seg).mapped += hi - lo;
        let code = pool_code(self.private.index_of(pool), kind == PoolKind::Large);
        self.count_obtained(hi - lo);
        self.record(Action::SegmentMap, stream, lo, hi - lo, code);
        Ok(())
    }

    /// The default pools' expandable segments.
    pub(crate) fn expandable_segments(&self) -> Vec<SegmentId> {
        self.segments_of(&[SMALL, LARGE])
    }

    /// The expandable segments of `pools`.
    fn segments_of(&self, pools: &[PoolId]) -> Vec<SegmentId> {
        pools
            .iter()
            .flat_map(|&p| self.heap.pools[p as usize].expandable.iter().map(|e| e.1))
            .collect()
    }

    /// The streams that own the default pools' expandable segments.
    fn expandable_streams(&self) -> Vec<StreamId> {
        let mut v: Vec<StreamId> = self
            .expandable_segments()
            .into_iter()
            .map(|s| self.heap.segments.get(s).stream)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Unmaps whole free handles into the page pool, in the order of
    /// [`reclaim_candidates`](Self::reclaim_candidates), until at least
    /// `want` bytes moved or none are left; never inside `keep`
    /// (`(segment, lo, hi)`). Pages whose work is not known to be done go
    /// to the pool at once and leave their address later, the request's
    /// stream ordered after that work if it ran on another
    /// (`may_leave_later`); where that cannot be, they are waited for
    /// first, on their stream only (Note [Unmapping behind the work]).
    fn reclaim(
        &mut self,
        want: u64,
        stream: StreamId,
        keep: (SegmentId, u64, u64),
        pinned: bool,
        order: RunOrder,
    ) -> Result<u64, AllocError> {
        let runs = self.reclaim_candidates(keep, want, pinned, order);
        let mut took = 0;
        let mut chosen = Vec::new();
        // The last run taken gives only the handles still wanted.
        for (bytes, lo, seg, stream, freed) in runs {
            if took >= want {
                break;
            }
            let end = self.pages.prefix_end(lo, lo + bytes, want - took);
            took += end - lo;
            chosen.push((end - lo, lo, seg, stream, freed));
        }
        let mut later = Vec::with_capacity(chosen.len());
        for &(_, _, _, s, freed) in &chosen {
            let defer = self.may_leave_later(stream, s, freed);
            if !defer {
                self.fences.wait(&mut self.backend, s, freed)?;
            }
            later.push(defer.then_some((s, freed)));
        }
        let mut moved = 0;
        for ((bytes, lo, seg, _, _), later) in chosen.into_iter().zip(later) {
            self.release_run(
                seg,
                lo,
                lo + bytes,
                later,
                Some(stream),
                self.config.unmap_thread,
            )?;
            moved += bytes;
        }
        self.stats.num_defragment += u64::from(moved > 0) as i64;
        crate::log::defragmented(self.device, want, moved);
        Ok(moved)
    }

    /// Whether pages freed on `owner` with stamp `freed`, moving for a
    /// request on `requester`, may leave their old address later instead
    /// of the host waiting for their work (Note [Unmapping behind the
    /// work]): that work is not known done, and it is queued on the
    /// requester's stream, or the requester's stream is made to wait for
    /// it on the GPU (`Fences::order_after`; if the driver refuses, the
    /// host waits as before). Not while captures are followed through the
    /// driver: one may begin at any moment, and then nothing may wait.
    pub(crate) fn may_leave_later(
        &mut self,
        requester: StreamId,
        owner: StreamId,
        freed: u64,
    ) -> bool {
        self.config.defer_unmap
            && !self.private.following()
            && !self.fences.is_idle(owner, freed)
            && (owner == requester
                || self
                    .fences
                    .order_after(&mut self.backend, requester, owner, freed)
                    .is_ok())
    }

    /// Unmaps `[lo, hi)`, a run of whole handles inside one free block of
    /// `seg`, into the page pool, and marks it unmapped (on this thread:
    /// its handles go back to the driver next, which would wait for the
    /// helper anyway).
    fn unmap_run(&mut self, seg: SegmentId, lo: u64, hi: u64) -> Result<(), AllocError> {
        self.release_run(seg, lo, hi, None, None, false)
    }

    /// [`unmap_run`](Self::unmap_run), or, with `later` (the stream and
    /// stamp of the work that may still use the run), pools its handles at
    /// once and unmaps the run once that work is done (Note [Unmapping
    /// behind the work]); `requester` is the stream of the request the
    /// pages move for, if any (Note [Punching behind the work]). With
    /// `helper`, an unmapping now is given to the helper thread (Note
    /// [Unmapping off the allocating thread]).
    fn release_run(
        &mut self,
        seg: SegmentId,
        lo: u64,
        hi: u64,
        later: Option<(StreamId, u64)>,
        requester: Option<StreamId>,
        helper: bool,
    ) -> Result<(), AllocError> {
        self.punch_stitches_over(lo, hi, requester)?;
        // Punching may have waited for work that covers this run too.
        let later = later.filter(|&(s, stamp)| !self.fences.is_idle(s, stamp));
        let (kind, pool) = (
            self.heap.segments.get(seg).kind,
            self.heap.segments.get(seg).pool,
        );
        let id = self.heap.block_at(seg, lo);
        let (ptr, size, stream) = (
            self.heap.blocks[id].ptr,
            self.heap.blocks[id].size,
            self.heap.blocks[id].stream,
        );
        debug_assert!(self.heap.blocks[id].state == BlockState::Free && hi <= ptr + size);
        if let Some((s, stamp)) = later {
            // It leaves the snapshot now; its `UnmapUnlisted` event comes
            // when it leaves its address (`drain.rs`).
            self.notify(SegmentAction::Unlisted, pool, stream, lo, hi - lo);
            let handles = self.pages.detach(lo, hi, kind);
            self.drains
                .push(lo, hi - lo, s, stamp, handles, self.pool_key(pool));
        } else {
            self.notify(SegmentAction::Unmap, pool, stream, lo, hi - lo);
            if let Err(e) = self.pages.unmap(&mut self.backend, lo, hi, kind, helper) {
                // Still mapped: say so again (Note [Segment events]).
                self.notify(SegmentAction::Map, pool, stream, lo, hi - lo);
                return Err(e.into());
            }
        }
        self.heap.unindex(id);
        let mut mid = id;
        if lo > ptr {
            let head = self.heap.carve_front(mid, lo - ptr, BlockState::Free);
            self.heap.reindex(head);
        }
        if hi < ptr + size {
            let m = self.heap.carve_front(mid, hi - lo, BlockState::Unmapped);
            self.heap.reindex(mid);
            mid = m;
        } else {
            self.heap.blocks[mid].state = BlockState::Unmapped;
        }
        if let Some(n) = self.heap.blocks[mid].next
            && self.heap.blocks[n].state == BlockState::Unmapped
        {
            self.heap.absorb_next(mid);
        }
        if let Some(p) = self.heap.blocks[mid].prev
            && self.heap.blocks[p].state == BlockState::Unmapped
        {
            self.heap.absorb_next(p);
        }
        self.heap.segments.get_mut(seg).mapped -= hi - lo;
        let pool = self.heap.segments.get(seg).pool;
        let code = pool_code(self.private.index_of(pool), kind == PoolKind::Large);
        self.record(Action::SegmentUnmap, stream, lo, hi - lo, code);
        Ok(())
    }

    /// Unmaps every whole free handle of the default pools' and of released
    /// private pools' expandable segments (after waiting for their work),
    /// frees reservations left with nothing mapped, and returns the pooled
    /// handles to the driver.
    pub(crate) fn unmap_free_pages(&mut self) -> Result<(), AllocError> {
        self.drop_cached_stitches()?;
        let streams = self.expandable_streams();
        self.fences.wait_all(&mut self.backend, streams)?;
        // The fences of other streams (one whose blocks were all in a
        // graph's pool has no segment here), or they would outlive
        // `empty_cache`: waited for as they are, none recorded.
        self.fences.wait_queued(&mut self.backend)?;
        self.finish_drains()?;
        self.trim_stitch_tails()?;
        self.unmap_pools(&[SMALL, LARGE], false)?;
        let released = self.private.freeable_pools();
        self.unmap_released_pools(&released)?;
        let (result, deltas) = self.pages.release(&mut self.backend, u64::MAX);
        self.apply_deltas(deltas, deltas[0] + deltas[1]);
        result?;
        Ok(())
    }

    /// Unmaps the free pages of released private pools into the page pool.
    /// A graph may have run on any stream, so this waits for the whole
    /// device first (Note [Private pools]); nothing to unmap, no wait.
    pub(crate) fn unmap_released_pools(&mut self, pools: &[PoolId]) -> Result<(), AllocError> {
        self.unmap_pools(pools, true)
    }

    /// Unmaps every whole free handle of `pools`' expandable segments and
    /// frees reservations left with nothing mapped. Their work is known done,
    /// or, with `sync`, waited for on the whole device (only when there is
    /// something to unmap).
    fn unmap_pools(&mut self, pools: &[PoolId], sync: bool) -> Result<(), AllocError> {
        let segs = self.segments_of(pools);
        let mut runs = self.free_runs_in(&segs, None);
        if sync && !runs.is_empty() {
            self.backend.synchronize()?;
        }
        runs.sort_unstable_by_key(|r| r.1);
        for (bytes, lo, seg, _, _) in runs {
            self.unmap_run(seg, lo, lo + bytes)?;
        }
        for &pool in pools {
            let empty: Vec<SegmentId> = self.heap.pools[pool as usize]
                .expandable
                .iter()
                .map(|e| e.1)
                .filter(|&s| self.heap.segments.get(s).mapped == 0)
                .collect();
            for seg in empty {
                let s = self.heap.segments.remove(seg);
                debug_assert!(self.heap.blocks[s.first].next.is_none());
                self.heap.blocks.remove(s.first);
                self.heap.pools[pool as usize]
                    .expandable
                    .retain(|e| e.1 != seg);
                self.private.segment_removed(pool);
                let guard = self.guard();
                self.backend.free_reservation(s.ptr, s.size + guard)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
