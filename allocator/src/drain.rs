//! Drains: old addresses of pages that moved before their work was done.
//!
//! Note [Unmapping behind the work]
//! Rationale: defragmentation takes whole free handles from one place (A)
//! and maps them where a request fits (B). A handle may only leave A once
//! the work queued on A is done (Note [Event-ordered unmapping]); when it
//! is not known done, the host used to wait for it (`cuEventSynchronize`),
//! behind up to a step of queued kernels. On the H200 these waits were
//! most of the driver time gpualloc measured: 488 of 555 ms on ResNet-50,
//! 60 of 297 on the multi-scale detector, 26 of 125 on GPT-2
//! (`gpualloc.driver_calls()`, `docs/results/h200-round19/`).
//! Approach: a physical handle may be mapped at two addresses at once. When
//! the request is on the stream that freed A (and `defer_unmap` is on), the
//! handles are mapped at B at once and A is unmapped later, when a fence
//! shows its work done: the new work at B is queued behind the old work on
//! the same stream, so it cannot touch the memory first. The heap and the
//! page pool treat A as unmapped from the start, so every decision (and a
//! replay) is the same as with the wait; only when the host waits and when
//! `cuMemUnmap` runs differ. A drain is finished early, waiting if need be,
//! when its address range is mapped again (during a CUDA graph capture,
//! when nothing may wait, the mapping goes to a fresh reservation
//! instead), when one of its handles is left
//! in the pool instead of mapped at B (another stream could take it), and
//! before handles go back to the driver or reservations are freed
//! (`empty_cache`, the out-of-memory path, sharing memory with another
//! process). Requests of other streams wait as before.

use crate::backend::{Backend, BackendError, DevicePtr, HandleId, StreamId};
use crate::fence::Fences;
use crate::observer::SegmentAction;

/// Says a segment event: `(action, stream, address, bytes)`. A range's
/// `Unmap` comes when it leaves its address, not when its pages moved, so
/// that segment events describe the memory mapped (Note [Segment events]).
pub(crate) type Say<'a> = &'a dyn Fn(SegmentAction, StreamId, DevicePtr, u64);

/// One old address range still mapped: `[lo, lo + size)`, freed on
/// `stream` with `stamp`, over `handles` (with their sizes).
#[derive(Clone, Debug)]
struct Drain {
    lo: DevicePtr,
    size: u64,
    stream: StreamId,
    stamp: u64,
    handles: Vec<(HandleId, u64)>,
}

/// See Note [Unmapping behind the work].
#[derive(Default)]
pub(crate) struct Drains {
    pending: Vec<Drain>,
}

impl Drains {
    /// Remembers that `[lo, lo + size)` (freed on `stream` with `stamp`,
    /// over `handles`) is to be unmapped once its work is done.
    pub fn push(
        &mut self,
        lo: DevicePtr,
        size: u64,
        stream: StreamId,
        stamp: u64,
        handles: Vec<(HandleId, u64)>,
    ) {
        self.pending.push(Drain {
            lo,
            size,
            stream,
            stamp,
            handles,
        });
    }

    /// How many ranges wait to be unmapped.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether a range waiting to be unmapped overlaps `[lo, hi)`.
    pub fn overlaps(&self, lo: DevicePtr, hi: DevicePtr) -> bool {
        self.pending.iter().any(|d| d.lo < hi && lo < d.lo + d.size)
    }

    /// The ranges waiting, as `(start, end)`.
    pub fn ranges(&self) -> impl Iterator<Item = (DevicePtr, DevicePtr)> + '_ {
        self.pending.iter().map(|d| (d.lo, d.lo + d.size))
    }

    /// Unmaps the ranges whose work is known done, without waiting.
    pub fn retire<B: Backend>(
        &mut self,
        fences: &Fences,
        backend: &mut B,
        say: Say<'_>,
    ) -> Result<(), BackendError> {
        self.finish_where(fences, backend, say, |d| fences.is_idle(d.stream, d.stamp))
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
        self.finish_where(fences, backend, say, which)
    }

    /// Unmaps the ranges for which `done` holds; the others stay. On a
    /// driver error the range stays too (still mapped) and the error is
    /// returned.
    fn finish_where<B: Backend>(
        &mut self,
        fences: &Fences,
        backend: &mut B,
        say: Say<'_>,
        done: impl Fn(&Drain) -> bool,
    ) -> Result<(), BackendError> {
        let mut result = Ok(());
        self.pending.retain(|d| {
            if result.is_err() || !done(d) {
                return true;
            }
            debug_assert!(
                fences.is_idle(d.stream, d.stamp),
                "unmapping a range whose work may still run"
            );
            say(SegmentAction::Unmap, d.stream, d.lo, d.size);
            match backend.unmap(d.lo, d.size) {
                Ok(()) => false,
                Err(e) => {
                    // Still mapped: say so again.
                    say(SegmentAction::Map, d.stream, d.lo, d.size);
                    result = Err(e);
                    true
                }
            }
        });
        result
    }
}
