//! Drains: old addresses of pages that moved before their work was done.
//!
//! Note [Unmapping behind the work]
//! Rationale: defragmentation takes whole free handles from one place (A)
//! and maps them where a request fits (B). A handle may only leave A once
//! the work queued on A is done (Note [Event-ordered unmapping]); when it
//! is not known done, the host used to wait for it (`cuEventSynchronize`),
//! behind up to a step of queued kernels. On the H200 these waits were
//! most of the driver time gpualloc measured: 488 of 557 ms on ResNet-50,
//! 60 of 296 on the multi-scale detector, 26 of 108 on GPT-2
//! (`gpualloc.driver_calls()`, `docs/results/h200-round19/`).
//! Approach: a physical handle may be mapped at two addresses at once. When
//! `defer_unmap` is on, the handles are mapped at B at once and A is
//! unmapped later, when a fence shows its work done. The new work at B is
//! queued behind the old work: on the same stream when the request is on
//! the stream that freed A; otherwise the request's stream is first made
//! to wait on the GPU for a fence on that stream (`Fences::order_after`,
//! `cuStreamWaitEvent`), as a block taken from another stream's cache is
//! (Note [Cross-stream reuse]), so the host no longer blocks there. (It
//! used to: FSDP2's replayed trace counted 117 such host waits, its
//! compute stream taking pages its all-gather stream freed.) The heap and the
//! page pool treat A as unmapped from the start, so every decision (and a
//! replay) is the same as with the wait; only when the host waits and when
//! `cuMemUnmap` runs differ; the defragmentation budget is charged for the
//! unmapping when the pages move, not when it runs. A drain is finished
//! early, waiting if need be, when its address range is mapped again (or,
//! for a hole of a cached stitch, Note [Punching behind the work], when
//! the stitch is repaired over it or freed); when a pool scope opens
//! (PyTorch opens it before a capture begins, and nothing may wait during
//! one; a capture that would still map over a drain maps into a fresh
//! reservation instead; while a scope is open, every request counts as
//! captured and moves no page); and before handles go back to the driver
//! or reservations are freed (`empty_cache`, the out-of-memory path,
//! sharing memory with another process). Should the wait at a scope's
//! opening fail (or captures begin to be followed through the driver
//! while such pages are pooled), a capture maps new pages rather than
//! take them. A handle left in the pool otherwise stays there with its old
//! address mapped until a poll finds its work done (the next request that
//! maps pages polls first); a request orders its stream after the rest
//! before it takes any page
//! (`order_after_pooled_drains` in `expandable.rs`, the host waiting only
//! where the driver refuses). Pages of a drain mapped at B but not handed
//! out carry the drain's stamp (or, for a drain of another stream than
//! B's, a stamp of B's stream taken after it was made to wait), so that
//! another stream taking them waits. The host still waits when the driver
//! refuses the event or the stream wait, and for every request once
//! captures are followed through the driver (the plain
//! `CUDAPluggableAllocator` route, Note [Capture without a pool]): a
//! capture may then begin unannounced at any moment.

use crate::backend::{Backend, BackendError, DevicePtr, HandleId, StreamId, unmap_maybe_later};
use crate::cost::{DriverCall, DriverCalls};
use crate::fence::Fences;
use crate::observer::SegmentAction;
use crate::pool::PoolKey;

/// Says a segment event: `(action, stream, address, bytes, pool)`. A range's
/// `Unmap` comes when it leaves its address, not when its pages moved, so
/// that segment events describe the memory mapped (Note [Segment events]).
pub(crate) type Say<'a> = &'a dyn Fn(SegmentAction, StreamId, DevicePtr, u64, PoolKey);

/// One old address range still mapped: `[lo, lo + size)`, freed on
/// `stream` with `stamp`, over `handles` (with their sizes), of private
/// pool `pool` (`(0, 0)`: a default pool).
#[derive(Clone, Debug)]
struct Drain {
    lo: DevicePtr,
    size: u64,
    stream: StreamId,
    stamp: u64,
    handles: Vec<(HandleId, u64)>,
    pool: PoolKey,
}

/// See Note [Unmapping behind the work].
#[derive(Default)]
pub(crate) struct Drains {
    pending: Vec<Drain>,
    /// The unmapping each range will need, counted when it was pushed.
    moved: DriverCalls,
    /// The unmapping done for ranges, counted when done.
    unmapped: DriverCalls,
}

impl Drains {
    /// Remembers that `[lo, lo + size)` (freed on `stream` with `stamp`,
    /// over `handles`, of pool `pool`) is to be unmapped once its work is
    /// done.
    pub fn push(
        &mut self,
        lo: DevicePtr,
        size: u64,
        stream: StreamId,
        stamp: u64,
        handles: Vec<(HandleId, u64)>,
        pool: PoolKey,
    ) {
        self.moved
            .add(DriverCall::Unmap, handles.len() as u64, size, 0);
        self.pending.push(Drain {
            lo,
            size,
            stream,
            stamp,
            handles,
            pool,
        });
    }

    /// How many ranges wait to be unmapped.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether no range waits to be unmapped.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// `(moved, unmapped)`: the `cuMemUnmap` calls ranges needed, counted
    /// when pushed, and those made, counted when made.
    pub fn unmaps(&self) -> (&DriverCalls, &DriverCalls) {
        (&self.moved, &self.unmapped)
    }

    /// The newest stamp of the ranges of `stream` over any of `handles`
    /// (0 if none): work that may still use them elsewhere; and whether a
    /// range of another stream lies over any of them (work that `stream`
    /// was made to wait for).
    pub fn stamp_of(
        &self,
        stream: StreamId,
        handles: impl Iterator<Item = HandleId>,
    ) -> (u64, bool) {
        let handles: Vec<HandleId> = handles.collect();
        let mut own = 0;
        let mut other = false;
        for d in &self.pending {
            if d.handles.iter().any(|h| handles.contains(&h.0)) {
                if d.stream == stream {
                    own = own.max(d.stamp);
                } else {
                    other = true;
                }
            }
        }
        (own, other)
    }

    /// Per stream, the newest stamp of its ranges with a handle (of the
    /// size given) for which `pooled` holds: the work that may still use
    /// pages the pool holds, one stream wait each.
    pub fn pooled_owners(&self, pooled: impl Fn(HandleId, u64) -> bool) -> Vec<(StreamId, u64)> {
        let mut owners: Vec<(StreamId, u64)> = Vec::new();
        for d in self
            .pending
            .iter()
            .filter(|d| d.handles.iter().any(|&(h, s)| pooled(h, s)))
        {
            match owners.iter_mut().find(|o| o.0 == d.stream) {
                Some(o) => o.1 = o.1.max(d.stamp),
                None => owners.push((d.stream, d.stamp)),
            }
        }
        owners
    }

    /// Whether a range waiting to be unmapped overlaps `[lo, hi)`.
    pub fn overlaps(&self, lo: DevicePtr, hi: DevicePtr) -> bool {
        self.pending.iter().any(|d| d.lo < hi && lo < d.lo + d.size)
    }

    /// Each range waiting, as its start and the handles mapped there in order.
    pub fn mappings(&self) -> impl Iterator<Item = (DevicePtr, &[(HandleId, u64)])> + '_ {
        self.pending.iter().map(|d| (d.lo, d.handles.as_slice()))
    }

    /// The handles (with their sizes) of ranges waiting to be unmapped for
    /// which `pooled` holds.
    pub fn pooled_handles(&self, pooled: impl Fn(HandleId, u64) -> bool) -> Vec<(HandleId, u64)> {
        self.pending
            .iter()
            .flat_map(|d| d.handles.iter().copied())
            .filter(|&(h, s)| pooled(h, s))
            .collect()
    }

    /// The ranges waiting, as `(start, end)`.
    pub fn ranges(&self) -> impl Iterator<Item = (DevicePtr, DevicePtr)> + '_ {
        self.pending.iter().map(|d| (d.lo, d.lo + d.size))
    }

    /// Unmaps the ranges whose work is known done, without waiting; with
    /// `later`, through [`Backend::unmap_later`] (Note [Unmapping off the
    /// allocating thread] in `backend/unmapper.rs`).
    pub fn retire<B: Backend>(
        &mut self,
        fences: &Fences,
        backend: &mut B,
        later: bool,
        say: Say<'_>,
    ) -> Result<(), BackendError> {
        self.finish_where(fences, backend, later, say, |d| {
            fences.is_idle(d.stream, d.stamp)
        })
    }

    /// Waits for and unmaps the ranges that overlap `[lo, hi)`.
    pub fn finish_overlapping<B: Backend>(
        &mut self,
        fences: &mut Fences,
        backend: &mut B,
        lo: DevicePtr,
        hi: DevicePtr,
        say: Say<'_>,
    ) -> Result<(), BackendError> {
        if !self.overlaps(lo, hi) {
            return Ok(());
        }
        self.finish(fences, backend, say, |d| d.lo < hi && lo < d.lo + d.size)
    }

    /// Waits for and unmaps the ranges over any handle (of the size given)
    /// for which `pooled` holds.
    pub fn finish_pooled<B: Backend>(
        &mut self,
        fences: &mut Fences,
        backend: &mut B,
        pooled: impl Fn(HandleId, u64) -> bool,
        say: Say<'_>,
    ) -> Result<(), BackendError> {
        self.finish(fences, backend, say, |d| {
            d.handles.iter().any(|&(h, s)| pooled(h, s))
        })
    }

    /// Waits for and unmaps every range.
    pub fn finish_all<B: Backend>(
        &mut self,
        fences: &mut Fences,
        backend: &mut B,
        say: Say<'_>,
    ) -> Result<(), BackendError> {
        self.finish(fences, backend, say, |_| true)
    }

    fn finish<B: Backend>(
        &mut self,
        fences: &mut Fences,
        backend: &mut B,
        say: Say<'_>,
        which: impl Fn(&Drain) -> bool,
    ) -> Result<(), BackendError> {
        for d in self.pending.iter().filter(|d| which(d)) {
            fences.wait(backend, d.stream, d.stamp)?;
        }
        self.finish_where(fences, backend, false, say, which)
    }

    /// Unmaps the ranges for which `done` holds; the others stay. On a
    /// driver error the range stays too (still mapped) and the error is
    /// returned.
    fn finish_where<B: Backend>(
        &mut self,
        fences: &Fences,
        backend: &mut B,
        later: bool,
        say: Say<'_>,
        done: impl Fn(&Drain) -> bool,
    ) -> Result<(), BackendError> {
        let mut result = Ok(());
        let unmapped = &mut self.unmapped;
        self.pending.retain(|d| {
            if result.is_err() || !done(d) {
                return true;
            }
            debug_assert!(
                fences.is_idle(d.stream, d.stamp),
                "unmapping a range whose work may still run"
            );
            // Unlisted when it was left behind (`release_run`).
            say(SegmentAction::UnmapUnlisted, d.stream, d.lo, d.size, d.pool);
            match unmap_maybe_later(backend, d.lo, d.size, later) {
                Ok(()) => {
                    unmapped.add(DriverCall::Unmap, d.handles.len() as u64, d.size, 0);
                    false
                }
                Err(e) => {
                    // Still mapped: say so again.
                    say(SegmentAction::MapUnlisted, d.stream, d.lo, d.size, d.pool);
                    result = Err(e);
                    true
                }
            }
        });
        result
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, DeviceAllocator, SimBackend};

    const MIB: u64 = 1 << 20;

    /// Frees a busy 16 MiB block next to a live one, optionally lets its
    /// work finish (its pages are then unmapped at once, else later), and
    /// asks for 20 MiB (its pages move); returns the defragmentation budget
    /// spent.
    fn spent(done: bool) -> f64 {
        let conf = Config::parse(
            "expandable_handle_mb:2,defragment_headroom:0,defragment_pressure:1,stitch_min_mb:0",
        )
        .unwrap();
        let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), conf);
        let a = d.malloc(16 * MIB, 0).unwrap();
        let _b = d.malloc(2 * MIB, 0).unwrap();
        d.backend_mut().launch(0);
        d.free(a).unwrap();
        // A fence over a's work, as the next slow path records one.
        d.fences.cover_all(&mut d.backend, [0]);
        if done {
            d.backend_mut().complete(0);
        }
        let _p = d.malloc(20 * MIB, 0).unwrap();
        assert_eq!(d.drains.len(), usize::from(!done));
        // Whether the old range is unmapped now or later, the same is charged.
        let _q = d.malloc(40 * MIB, 0).unwrap();
        d.check_invariants().unwrap();
        d.defrag_budget.spent_ns()
    }

    /// Moved pages left in the pool with their old range mapped; a request
    /// of another stream that may take them cannot be ordered after their
    /// work on the GPU (the stream wait fails): the host waits instead and
    /// the request succeeds. Should that wait fail too, the request fails,
    /// nothing is lost, and the next one succeeds.
    #[test]
    fn a_failed_stream_wait_before_taking_pooled_pages_waits_on_the_host() {
        use crate::backend::sim::SimCall;
        // A sequence a search found to leave moved pages in the pool.
        let setup = || {
            let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::default());
            let mut live = Vec::new();
            let ops = "a6291456 a19398656 a39321600 a17301504 a18350080 f2 a17825792 f1 \
                       a33030144 f4 f3 a4718592 a29884416 a16777216 f5 a30932992 f2 \
                       a38797312 f0 f4 f3 f2 f1 a8388608 a7340032 a11534336 f1 a8388608 \
                       a25165824 a23592960";
            for op in ops.split_whitespace() {
                let n: u64 = op[1..].parse().unwrap();
                if op.starts_with('a') {
                    live.push(d.malloc(n, 0).unwrap());
                } else {
                    let p = live.swap_remove(n as usize);
                    d.backend_mut().launch(0);
                    d.free(p).unwrap();
                }
            }
            d.check_invariants().unwrap();
            let pages = &d.pages;
            assert!(
                !d.drains
                    .pooled_handles(|h, s| pages.is_pooled(h, s))
                    .is_empty(),
                "moved pages pooled, their old range still mapped"
            );
            d
        };
        let mut d = setup();
        let waits = d.backend.counters.wait_event;
        d.backend_mut().fail_call(SimCall::StreamWaitEvent, 1);
        let r = d.malloc(12587008, 1);
        assert!(r.is_ok(), "{r:?}");
        assert!(d.backend.counters.wait_event > waits, "the host waited");
        d.check_invariants().unwrap();
        d.free(r.unwrap()).unwrap();
        d.check_invariants().unwrap();

        let mut d = setup();
        d.backend_mut().fail_call(SimCall::StreamWaitEvent, 1);
        d.backend_mut().fail_call(SimCall::WaitEvent, 1);
        assert!(d.malloc(12587008, 1).is_err());
        d.check_invariants().unwrap();
        let r = d.malloc(12587008, 1);
        assert!(r.is_ok(), "{r:?}");
        d.check_invariants().unwrap();
    }

    /// A range of the mapping's own stream gives its stamp; one of another
    /// stream over the same handles says so instead (its work is ordered
    /// before the mapping's stream, not stamped in its epochs).
    #[test]
    fn stamps_of_handles_name_their_own_streams_ranges_and_flag_others() {
        use super::Drains;
        let mut d = Drains::default();
        let key = (0, 0);
        d.push(0x1000, 4 * MIB, 0, 7, vec![(1, 2 * MIB), (2, 2 * MIB)], key);
        d.push(0x9000, 2 * MIB, 0, 9, vec![(3, 2 * MIB)], key);
        d.push(0xf000, 2 * MIB, 5, 11, vec![(4, 2 * MIB)], key);
        assert_eq!(d.stamp_of(0, [2].into_iter()), (7, false));
        assert_eq!(d.stamp_of(0, [2, 3].into_iter()), (9, false));
        assert_eq!(d.stamp_of(0, [3, 4].into_iter()), (9, true));
        assert_eq!(d.stamp_of(5, [1, 4].into_iter()), (11, true));
        assert_eq!(d.stamp_of(0, [8].into_iter()), (0, false));
    }

    #[test]
    fn the_budget_is_charged_alike_however_far_the_gpu_got() {
        let (done, busy) = (spent(true), spent(false));
        assert!(done > 0.0);
        assert_eq!(done, busy);
    }
}
