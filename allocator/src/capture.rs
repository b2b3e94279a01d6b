//! Private pools for CUDA graph capture.
//!
//! While a graph is captured, every allocation made on a capturing stream
//! must come from a pool private to that graph: replays reuse the exact
//! addresses, so nothing else may receive them until PyTorch releases the
//! pool. PyTorch brackets a capture with `begin_allocate_to_pool(id, filter)`
//! and `end_allocate_to_pool(id)`, and calls `release_pool(id)` when the graph
//! is destroyed. Scopes nest; the innermost one whose filter accepts the
//! stream decides the pool.
//!
//! While any scope is open the allocator is "capturing": it queries no event
//! (the driver refuses `cuEventQuery` and `cuEventSynchronize` during a
//! global capture, and invalidates the capture, unless the calling thread
//! is in relaxed mode), releases and unmaps nothing (the driver allows
//! every virtual-memory call during a capture, `benches/gpu/capture_probe.cu`,
//! but without an event no page is known idle), and asks the backend for
//! new segments only with the `capturing` flag (relaxed capture mode on
//! CUDA). Frees of blocks used on other streams are deferred until the
//! capture ends.
//!
//! Note [Private pools]
//! With expandable segments (the default policy) a private pool maps pages
//! into reservations of its own, per stream, like the default pools, and
//! takes handles from the page pool first: memory another pool gave back
//! serves the graph without `cuMemCreate`. Its pages never move while the
//! pool is held: a graph's replays reuse its addresses, including those of
//! blocks freed during the capture, so defragmentation and stitching take
//! pages of the default pools only, and a pool's requests (made while a
//! scope is open, when no event may be queried) never defragment. Once
//! released, a graph may still be running on any stream, and no stream's
//! event orders it, so unmapping its free pages waits for the whole device
//! (`cuCtxSynchronize`, the one device-wide wait outside the out-of-memory
//! path; PyTorch's `cudaFree` of the pool's segments waits the same way).
//! The pages go to the page pool; blocks still alive return at the next
//! `empty_cache`. Fences are not recorded during a capture (the event
//! would belong to the graph). A trace records every call on a pool by the
//! pool's index on the device (`private_pool` records), so a replay opens
//! and closes the same scopes at the same moments (`replay_pools.rs`).
//!
//! Note [Capture without a pool]
//! PyTorch's plain `CUDAPluggableAllocator` (the library loaded without
//! gpualloc's bridge) never opens a scope: its pool hooks take C++ objects
//! that a C function cannot receive. A graph captured through it would get
//! memory from the default pools, and after the capture its intermediate
//! blocks, freed, would be handed to other tensors while replays still
//! write them. So that route's entry points (`gpualloc_malloc_or_raise`,
//! `gpualloc_malloc_or_abort`) follow captures themselves ([`follow_driver_capture`]), and from its first
//! call on the device's frees and `empty_cache` do too:
//! - it asks the driver for the capture the allocating stream takes part
//!   in (`cuStreamGetCaptureInfo`: the capture's id, unique in the process);
//! - with no scope open, a capture opens one, of a pool of gpualloc's own
//!   (keys `(FOLLOWED_POOL, n)`), which takes every allocation on the
//!   device while it is open: the capture's forked streams, and a second
//!   capture under way at the same time, whose streams the driver gives
//!   another id (or none, for the legacy stream), are served from it too;
//! - the scope closes at the first call that finds the stream it was
//!   opened on out of that capture: ended, or in a new capture, as when
//!   `torch.cuda.graph` captures graph after graph on its one stream (so
//!   each gets a pool of its own);
//! - a free asks about the block's stream and every stream it was used on
//!   before anything else, so that a capture whose first call is a free is
//!   followed before an event could be recorded in it; and before it
//!   queries the fences of a full queue, it asks the legacy stream, which
//!   reports a global capture elsewhere (found by `follow_properties` at
//!   150,000 cases).
//! - `empty_cache`, and an allocation before its slow path, ask about the
//!   legacy stream and the streams of the device's segments: a capture
//!   found with an id is followed, and a global-mode capture the legacy
//!   stream reports without one leaves the cache as it is and makes the
//!   allocation one a capture allows (no event queried or waited for, no
//!   page moved, nothing given back, driver allocations made as during a
//!   capture); an allocation with frees pending asks the legacy stream
//!   before it queries their events.
//!
//! Nothing tells that route when a graph is destroyed, so such a pool is
//! never released: a graph captured this way keeps its memory for the life
//! of the process, and graphs that PyTorch would let share a pool (`pool=`)
//! get one each, and what other streams allocate while a capture is open is
//! kept too. That is the price of replays that never write memory given to
//! another tensor; the bridge has none of it. What stays unsafe: work of
//! another stream while a capture has not been seen yet (no allocation or
//! free on its streams since it began) and that neither the legacy stream
//! nor a stream of the device's segments reports (a capture on a
//! non-blocking stream nothing of ours has used) can query an event or
//! make a driver call the capture forbids; only the hooks would tell.
//!
//! [`follow_driver_capture`]: DeviceAllocator::follow_driver_capture

use crate::backend::{Backend, StreamId};
use crate::block::{BlockId, PoolId};
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::pool::PoolKey;
use crate::private_pool::{Serving, StreamFilter};
use crate::segment_source::SegmentSource;
use crate::trace::{EventKind, PoolOp};

impl<B: Backend> DeviceAllocator<B> {
    /// Opens an allocation scope: until [`end_allocate_to_pool`](Self::end_allocate_to_pool),
    /// allocations on streams that `filter` accepts (every stream when `None`)
    /// come from private pool `key`, created on first use.
    ///
    /// # Errors
    /// [`AllocError::PoolBusy`] when a scope of `key` is open already, as
    /// PyTorch refuses it: the first `end` would close the other caller's
    /// scope, and that caller's graph would take memory from the default
    /// pools. Nothing is changed then.
    pub fn begin_allocate_to_pool(
        &mut self,
        key: PoolKey,
        filter: Option<StreamFilter>,
    ) -> Result<(), AllocError> {
        if self.private.scope_open(key) {
            return Err(AllocError::PoolBusy { pool: key });
        }
        // PyTorch opens the scope before the capture begins: the last time
        // old ranges of moved pages can be waited for and unmapped, so that
        // where the capture maps memory never depends on the GPU's progress
        // (Note [Unmapping behind the work]). An error leaves them: the
        // capture maps around their ranges and leaves their pages pooled.
        if !self.private.capturing()
            && let Err(e) = self.finish_drains()
        {
            crate::log::drains_left(self.device, &e);
        }
        self.open_scope(key, filter);
        Ok(())
    }

    /// [`begin_allocate_to_pool`](Self::begin_allocate_to_pool) without
    /// finishing drains: for a capture found already running, when nothing
    /// may wait (pages do not move without waiting while captures are
    /// followed, so there are none).
    fn open_scope(&mut self, key: PoolKey, filter: Option<StreamFilter>) {
        self.private.push_scope(key, filter);
        self.incref_pool(key, Serving::Own);
        self.record_pool_call(PoolOp::BeginAllocate, key);
    }

    /// Takes a hold on private pool `key`, creating it if absent, without
    /// opening a scope (PyTorch's `createOrIncrefPool`, used by
    /// `torch.cuda.MemPool` and cudagraph trees). Each hold is dropped by one
    /// [`release_pool`](Self::release_pool); a scope opened by
    /// [`begin_allocate_to_pool`](Self::begin_allocate_to_pool) takes one too.
    pub fn create_or_incref_pool(&mut self, key: PoolKey) {
        self.incref_pool(key, Serving::Own);
        self.record_pool_call(PoolOp::Incref, key);
    }

    /// [`create_or_incref_pool`](Self::create_or_incref_pool) for a pool
    /// whose segments come from another allocator (`torch.cuda.MemPool(
    /// allocator=...)`; Note [Pools served by another allocator] in
    /// `segment_source.rs`). `source` serves a new pool; a pool that exists
    /// already keeps how it is served, as PyTorch gives the allocator only
    /// to a new pool, and `source` is dropped.
    pub fn create_or_incref_pool_from(&mut self, key: PoolKey, source: Box<dyn SegmentSource>) {
        self.incref_pool(key, Serving::From(source));
        self.record_pool_call(PoolOp::IncrefServed, key);
    }

    /// A replay's [`create_or_incref_pool_from`](Self::create_or_incref_pool_from):
    /// the pool grows by plain segments of the backend.
    pub(crate) fn create_or_incref_plain_pool(&mut self, key: PoolKey) {
        self.incref_pool(key, Serving::Plain);
        self.record_pool_call(PoolOp::IncrefServed, key);
    }

    /// PyTorch's `setUseOnOOM`: while held, pool `key`'s free blocks serve
    /// a request outside any pool that would otherwise fail (Note [MemPool
    /// options] in `device.rs`).
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`] for a pool that does not exist.
    pub fn set_pool_use_on_oom(&mut self, key: PoolKey, on: bool) -> Result<(), AllocError> {
        self.private.set_use_on_oom(key, on)?;
        self.record_pool_checkpoint_call(PoolOp::UseOnOom, key, u64::from(on));
        Ok(())
    }

    /// PyTorch's `setNoSplit`: pool `key`'s blocks are never split; a pool
    /// with no segment yet grows by plain segments from now on.
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`] for a pool that does not exist.
    pub fn set_pool_no_split(&mut self, key: PoolKey) -> Result<(), AllocError> {
        self.private.set_no_split(key)?;
        self.record_pool_call(PoolOp::NoSplit, key);
        Ok(())
    }

    fn incref_pool(&mut self, key: PoolKey, serving: Serving) {
        // Note [PyTorch's expandable_segments switch]: a pool created
        // while it is off stays plain.
        let serving = match serving {
            Serving::Own if self.plain_requests => Serving::Plain,
            s => s,
        };
        let heap = &mut self.heap;
        if let Some(ids) = self.private.incref(key, serving, |v| heap.pool_slot(v)) {
            heap.reset_pools(ids, Some(key));
        }
    }

    /// The holds on private pool `key`: 0 for a pool that does not exist
    /// (or that nothing holds any more but still has live blocks).
    pub fn pool_use_count(&self, key: PoolKey) -> u32 {
        self.private.find(key).map_or(0, |p| p.2)
    }

    /// Closes the innermost scope of pool `key`.
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`] when no scope of that pool is open.
    pub fn end_allocate_to_pool(&mut self, key: PoolKey) -> Result<(), AllocError> {
        if !self.capture_reuse.is_empty() && self.private.scope_open(key) {
            self.free_deferred_at_capture_end(key);
        }
        self.private.close(key)?;
        if !self.private.capturing() {
            self.capture_reuse.end_captures();
        }
        self.record_pool_call(PoolOp::EndAllocate, key);
        Ok(())
    }

    /// Drops one hold on pool `key` (a graph was destroyed). At zero holds its
    /// cached segments are given up (now when no capture is open, else at
    /// the next `empty_cache`), and blocks still allocated follow when
    /// freed. Plain segments go back to the backend; expandable ones' pages
    /// go to the page pool, still reserved and reused by the next mapping,
    /// until `empty_cache` or the out-of-memory path releases them.
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`] for a pool that does not exist.
    pub fn release_pool(&mut self, key: PoolKey) -> Result<(), AllocError> {
        let unheld = self.private.release(key)?;
        // Recorded before the pool may be forgotten (below).
        self.record_pool_call(PoolOp::Release, key);
        if let Some((small, large)) = unheld {
            self.release_pool_cache(small, large)?;
        }
        Ok(())
    }

    /// PyTorch's `emptyCache(mempool_id)`: when private pool `key` exists
    /// and nothing holds it, its cached memory is given up as
    /// [`release_pool`](Self::release_pool) does at zero holds (pages of
    /// expandable segments to the page pool). A held or
    /// unknown pool is left alone; so is everything while a capture is open.
    pub fn empty_pool_cache(&mut self, key: PoolKey) -> Result<(), AllocError> {
        self.record_pool_call(PoolOp::EmptyCache, key);
        match self.private.find(key) {
            Some((small, large, 0)) => self.release_pool_cache(small, large),
            _ => Ok(()),
        }
    }

    /// Gives the cached memory of a released private pool back (not while a
    /// capture is open: then at the next `empty_cache`), and forgets released
    /// pools left with no segment.
    fn release_pool_cache(&mut self, small: PoolId, large: PoolId) -> Result<(), AllocError> {
        if self.private.capturing() {
            return Ok(());
        }
        // Blocks whose other streams are done by now (`record_stream`) come
        // back first, without waiting, and segments split among streams
        // are whole again (their release waits for the device anyway).
        if !self.pending.is_idle() {
            self.process_events()?;
        }
        self.fuse_and_release(small)?;
        self.fuse_and_release(large)?;
        if self.expandable {
            self.unmap_released_pools(&[small, large])?;
        }
        self.private.erase_empty();
        Ok(())
    }

    /// Records a call on pool `key` by the pool's index on this device
    /// (nothing for a pool that does not exist: the call changed nothing).
    /// A replay makes the same calls (Note [Private pools]).
    pub(crate) fn record_pool_call(&mut self, op: PoolOp, key: PoolKey) {
        self.record_pool_checkpoint_call(op, key, 0);
    }

    /// [`record_pool_call`](Self::record_pool_call) with a checkpoint's number.
    pub(crate) fn record_pool_checkpoint_call(
        &mut self,
        op: PoolOp,
        key: PoolKey,
        checkpoint: u64,
    ) {
        if self.trace.is_none() {
            return;
        }
        let Some(k) = self
            .private
            .find(key)
            .and_then(|(small, _, _)| self.private.index_of(small))
        else {
            return;
        };
        let (action, addr, size, aux) = EventKind::PrivatePool {
            op,
            pool: u64::from(k),
            checkpoint,
        }
        .fields();
        self.record(action, 0, addr, size, aux);
    }

    /// Before an allocation on `stream` by a caller that cannot announce
    /// captures (Note [Capture without a pool]): from now on this device
    /// follows captures through the driver. Closes the followed capture's
    /// scope once the driver says it ended; opens one when `stream`
    /// captures and no scope is open. A query the driver refuses counts as
    /// no capture.
    pub fn follow_driver_capture(&mut self, stream: StreamId) -> Result<(), AllocError> {
        self.private.start_following();
        self.close_ended_capture()?;
        self.follow_stream(stream)
    }

    /// On the route without pool hooks, with no scope open: whether the
    /// legacy stream reports a capture under way (a global-mode capture on
    /// a stream no allocation or free of ours has touched yet), during which
    /// an allocation must do only what a capture allows: no event queries,
    /// no moved pages, no memory given back, driver allocations made as
    /// during a capture. Nothing is followed: the driver gives no id. One
    /// query; none on the bridge's route, whose hooks announce captures.
    pub(crate) fn capture_unseen(&mut self) -> bool {
        self.private.following()
            && !self.private.capturing()
            && crate::backend::legacy_reports_capture(&mut self.backend)
    }

    /// On the route without pool hooks, whether a capture nobody announced
    /// forbids what a capture forbids (`empty_cache`, an allocation's slow
    /// path): a stream a release or a move would record or wait for an
    /// event on may be capturing, or a global capture elsewhere may forbid
    /// driver calls. A capture found on a stream of ours is followed (Note
    /// [Capture without a pool]). Always false on the bridge's route, whose
    /// hooks announce every capture (the caller checks `capturing()`).
    pub(crate) fn capture_elsewhere(&mut self) -> Result<bool, AllocError> {
        if !self.private.following() {
            return Ok(false);
        }
        self.close_ended_capture()?;
        for s in self.capture_probe_streams() {
            match self.backend.stream_capture(s).ok().flatten() {
                None => {}
                // The legacy stream answers for a global capture on
                // another stream, without its id: nothing to follow.
                Some(0) => return Ok(true),
                Some(_) => {
                    self.follow_stream(s)?;
                    break;
                }
            }
        }
        Ok(self.private.capturing())
    }

    /// The streams `capture_elsewhere` asks about before releasing on the route
    /// without pool hooks: the legacy stream (always valid; it reports a
    /// global capture anywhere) and the streams of this device's segments
    /// (those a release records fences on). Not the streams of pending
    /// frees or fences alone: they may be gone, and only their events are
    /// used.
    fn capture_probe_streams(&self) -> Vec<StreamId> {
        let mut v: Vec<StreamId> = self.heap.segments.iter().map(|(_, s)| s.stream).collect();
        v.push(0);
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Closes the followed capture's scope when its first stream no longer
    /// takes part in it (ended, or another capture began there). One driver
    /// query, only while a capture is followed.
    pub(crate) fn close_ended_capture(&mut self) -> Result<(), AllocError> {
        let Some((key, stream, id)) = self.private.followed() else {
            return Ok(());
        };
        if self.backend.stream_capture(stream).ok().flatten() == Some(id) {
            return Ok(());
        }
        self.private.unfollow();
        self.end_allocate_to_pool(key)
    }

    /// Opens a scope when `stream` takes part in a capture and no scope is
    /// open (see [`follow_driver_capture`](Self::follow_driver_capture)).
    pub(crate) fn follow_stream(&mut self, stream: StreamId) -> Result<(), AllocError> {
        if self.private.capturing() {
            return Ok(()); // the followed capture's scope, or the hooks', decides
        }
        if let Some(id) = self.backend.stream_capture(stream).ok().flatten() {
            let key = self.private.follow(stream, id);
            // Every stream: see the Note on why not only the capture's.
            self.open_scope(key, None);
        }
        Ok(())
    }

    /// Before a free while captures are followed: the block's streams may
    /// capture a graph nobody announced, and no event may be recorded on
    /// them then (Note [Capture without a pool]).
    pub(crate) fn follow_before_free(&mut self, block: BlockId) -> Result<(), AllocError> {
        self.close_ended_capture()?;
        for s in self.heap.blocks[block].streams() {
            self.follow_stream(s)?;
        }
        Ok(())
    }

    /// Whether an allocation scope is open: announced by the hooks, or a
    /// capture followed through the driver.
    pub fn in_capture_scope(&self) -> bool {
        self.private.capturing()
    }

    /// Private pools alive: `(id, use count, segments, live allocations)`.
    pub fn private_pools(&self) -> Vec<(PoolKey, u32, usize, usize)> {
        self.private.list()
    }
}
