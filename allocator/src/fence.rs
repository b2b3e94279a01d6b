//! Fences: when may freed memory leave its address?
//!
//! Note [Event-ordered unmapping]
//! Rationale: a freed block is reusable at once *on its stream*, because the
//! stream runs in order. Unmapping its pages is different: `cuMemUnmap`
//! takes effect on the host at once, so a kernel still queued that touches
//! the old address would fault. PyTorch and the first version of gpualloc
//! therefore synchronized the device before every unmap, stalling training
//! whenever pages moved.
//! Approach: every free stamps the block with the current *epoch*, a
//! device-wide counter. A fence is an event recorded on a stream, tagged
//! with the epoch at its recording, after which the epoch advances; once it
//! has completed, every block freed on that stream before it is idle. A
//! free block may be unmapped when its stream's newest completed fence is at
//! least its stamp. Fences are recorded on the slow path, after every
//! sixteenth free of 2 MiB or more and when a stitch is freed (its pages
//! are wanted one step later; a fence recorded only then would cover all
//! the work queued since), never on the other frees; they are polled
//! without blocking on the slow path, and waited for
//! (`cuEventSynchronize`, one stream) mostly when the address of pages not
//! yet known idle is needed now: pages themselves move at once and leave
//! their address later, a request of another stream being made to wait for
//! the fence on the GPU (Note [Unmapping behind the work] in `drain.rs`).
//! The host still waits for moves where the driver refuses that, with
//! `defer_unmap:false`, while captures are followed through the driver,
//! and on some stitch paths (a punch that leaves a stitch no part, a
//! repair of busy parts, spare handles given back).
//! Which pages are unmapped never depends on whether
//! a fence happened to be complete: that decides only whether the host
//! waits, so a replay on the simulator makes the same choices as the GPU.
//! The out-of-memory path waits for everything, as before.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::backend::{Backend, BackendError, EventId, StreamId};

#[derive(Default)]
struct StreamFences {
    /// Recorded, not yet known complete: `(event, epoch)`, oldest first.
    queued: VecDeque<(EventId, u64)>,
    /// The epoch of the newest fence known complete (0: none).
    done: u64,
    /// The driver's answer when it refused an event on this stream: no
    /// event is asked for again until the stream allocates (Note [Streams
    /// that refuse events]).
    refused: Option<BackendError>,
}

/// Frees of at least this many bytes count towards a fence ([`Fences::after_free`]).
const LARGE_FREE: u64 = 2 << 20;
/// A fence every this many large frees.
const FREES_PER_FENCE: u32 = 16;
/// Fences a stream may have queued, not yet known complete, before a free
/// looks at the oldest instead of recording another: in steady state the
/// slow path, which polls them all, may never run again, and the queue
/// (one CUDA event each) must not grow for the whole run.
const MAX_QUEUED: usize = 4;

/// See Note [Event-ordered unmapping].
pub(crate) struct Fences {
    epoch: u64,
    /// The highest stamp handed out.
    last_stamp: u64,
    /// Large frees since a fence was last recorded on a free.
    large_frees: u32,
    streams: FxHashMap<StreamId, StreamFences>,
    /// Streams whose `refused` is set: allocations look them up only
    /// while there are any ([`revive`](Self::revive)).
    refused: usize,
}

impl Default for Fences {
    fn default() -> Self {
        Fences {
            epoch: 1,
            last_stamp: 0,
            large_frees: 0,
            streams: FxHashMap::default(),
            refused: 0,
        }
    }
}

impl Fences {
    /// The stamp for a block freed now. 0 is never returned: it marks pages
    /// that no work ever touched.
    #[inline]
    pub fn stamp(&mut self) -> u64 {
        self.last_stamp = self.epoch;
        self.epoch
    }

    /// Called after a free of `size` bytes on `stream` was stamped: every
    /// [`FREES_PER_FENCE`]th free of at least [`LARGE_FREE`] bytes records a
    /// fence, so that most freed memory is known idle before it is needed,
    /// at a cost of one `cuEventRecord` per many frees. When the stream's
    /// queue is full, its fences are queried first, only if `may_query`
    /// says a capture allows it (asked then only: it may ask the driver).
    /// A driver error only means no fence now.
    #[inline]
    pub fn after_free<B: Backend>(
        &mut self,
        backend: &mut B,
        stream: StreamId,
        size: u64,
        may_query: impl FnOnce(&mut B) -> bool,
    ) {
        if size < LARGE_FREE {
            return;
        }
        self.large_frees += 1;
        if self.large_frees >= FREES_PER_FENCE {
            self.large_frees = 0;
            if let Some(s) = self.streams.get_mut(&stream)
                && s.queued.len() >= MAX_QUEUED
            {
                // Learns which are done (without blocking); a driver error
                // only means none is known done now.
                if may_query(backend) {
                    let _ = Self::poll_queue(backend, s);
                }
                if s.queued.len() >= MAX_QUEUED {
                    return;
                }
            }
            let _ = self.cover(backend, stream, self.last_stamp);
        }
    }

    fn poll_queue<B: Backend>(backend: &mut B, s: &mut StreamFences) -> Result<(), BackendError> {
        while let Some(&(ev, epoch)) = s.queued.front() {
            if !backend.event_done(ev)? {
                break;
            }
            s.queued.pop_front();
            backend.destroy_event(ev);
            s.done = s.done.max(epoch);
        }
        Ok(())
    }

    /// Records a fence on each of `streams` if anything was freed since the
    /// last one, so that by the time pages are needed their work is likely
    /// known to be done (no host wait). A stream that refuses the event (one
    /// destroyed since its segment was made) gets no fence now: a wait for
    /// it synchronizes the device instead ([`wait`](Self::wait)).
    pub fn cover_all<B: Backend>(
        &mut self,
        backend: &mut B,
        streams: impl IntoIterator<Item = StreamId>,
    ) {
        let stamp = self.last_stamp;
        for s in streams {
            let _ = self.cover(backend, s, stamp);
        }
    }

    /// Whether a block of `stream` stamped `stamp` is known idle.
    #[inline]
    pub fn is_idle(&self, stream: StreamId, stamp: u64) -> bool {
        stamp == 0 || self.streams.get(&stream).is_some_and(|s| s.done >= stamp)
    }

    /// Fences recorded and not yet known complete, over all streams.
    #[cfg(test)]
    pub fn outstanding(&self) -> usize {
        self.streams.values().map(|s| s.queued.len()).sum()
    }

    /// Learns which fences completed, without blocking.
    pub fn poll<B: Backend>(&mut self, backend: &mut B) -> Result<(), BackendError> {
        for s in self.streams.values_mut() {
            Self::poll_queue(backend, s)?;
        }
        Ok(())
    }

    /// Makes sure a fence covering blocks of `stream` stamped up to `stamp`
    /// is recorded (records one unless one is queued or done already).
    /// A stream that refused an event is not asked again until it
    /// allocates ([`revive`](Self::revive)).
    ///
    /// Note [Streams that refuse events]
    /// Rationale: a segment outlives the stream it was made on when that
    /// stream is one the program destroys (`torch.cuda.ExternalStream` over
    /// a CuPy or TensorRT stream), and the driver then refuses events on
    /// its handle, if it answers at all: a destroyed handle is undefined
    /// behaviour. Growth covers every segment's stream ([`cover_all`](Self::cover_all)),
    /// so such a handle would be handed to the driver at every growth for
    /// the rest of the run, where PyTorch's allocator touches it only in
    /// `empty_cache`.
    /// Approach: the first refusal that names a dead handle is remembered;
    /// later covers fail at once with it, so [`wait`](Self::wait)
    /// synchronizes the device as for the refusal itself, which also marks
    /// every other refusing stream idle (`empty_cache` with several
    /// destroyed streams synchronizes once). A stream that
    /// allocates again is alive (a new stream may get a destroyed one's
    /// handle), and its next cover asks the driver again: every allocation
    /// looks, one branch while no stream is refused. (An event on the new
    /// stream then stands for blocks the old one freed; it does not order
    /// the old stream's queued work, as it did not before this note: work
    /// left on a stream the program destroyed is the program's to finish.)
    pub fn cover<B: Backend>(
        &mut self,
        backend: &mut B,
        stream: StreamId,
        stamp: u64,
    ) -> Result<(), BackendError> {
        let s = self.streams.entry(stream).or_default();
        let newest = s.queued.back().map_or(s.done, |f| f.1);
        if stamp == 0 || newest >= stamp {
            return Ok(());
        }
        if let Some(e) = &s.refused {
            return Err(e.clone());
        }
        let refused = &mut self.refused;
        let ev = backend.record_event(stream).inspect_err(|e| {
            if names_a_dead_stream(e) {
                s.refused = Some(e.clone());
                *refused += 1;
            }
        })?;
        s.queued.push_back((ev, self.epoch));
        self.epoch += 1;
        Ok(())
    }

    /// `stream` allocates: it is alive, and events on it are asked for
    /// again (Note [Streams that refuse events]).
    #[inline]
    pub fn revive(&mut self, stream: StreamId) {
        if self.refused > 0
            && let Some(s) = self.streams.get_mut(&stream)
            && s.refused.take().is_some()
        {
            self.refused -= 1;
        }
    }

    /// Blocks until blocks of `stream` stamped up to `stamp` are idle:
    /// records a fence if needed and waits for it (one stream, not the device).
    pub fn wait<B: Backend>(
        &mut self,
        backend: &mut B,
        stream: StreamId,
        stamp: u64,
    ) -> Result<(), BackendError> {
        if self.is_idle(stream, stamp) {
            return Ok(());
        }
        if self.cover(backend, stream, stamp).is_err() {
            // The stream refuses events (destroyed, as an external stream
            // can be, with its segments still cached): the device's
            // synchronization covers whatever it ran, and every block freed
            // so far on it is idle afterwards. So is every other stream
            // that refused, whose own wait would be this same
            // synchronization: several destroyed together cost one.
            backend.synchronize()?;
            self.streams.entry(stream).or_default();
            for (&id, s) in &mut self.streams {
                if id == stream || s.refused.is_some() {
                    for (ev, _) in s.queued.drain(..) {
                        backend.destroy_event(ev);
                    }
                    s.done = self.epoch;
                }
            }
            self.epoch += 1;
            return Ok(());
        }
        let at = self.covering(stream, stamp);
        let s = self.streams.get_mut(&stream).expect("covered above");
        // The ones before it are done once it is (a stream runs in order).
        backend.wait_event(s.queued[at].0)?;
        for (ev, epoch) in s.queued.drain(..=at) {
            backend.destroy_event(ev);
            s.done = s.done.max(epoch);
        }
        Ok(())
    }

    /// Orders all later work of `waiter` after the blocks of `stream`
    /// stamped up to `stamp` are idle, without blocking the host: records a
    /// fence if needed and makes `waiter` wait for it on the GPU
    /// (`cuStreamWaitEvent`). Never during a capture (the event was
    /// recorded outside it). On an error nothing is ordered: the caller
    /// waits instead ([`wait`](Self::wait)).
    pub fn order_after<B: Backend>(
        &mut self,
        backend: &mut B,
        waiter: StreamId,
        stream: StreamId,
        stamp: u64,
    ) -> Result<(), BackendError> {
        if waiter == stream || self.is_idle(stream, stamp) {
            return Ok(());
        }
        self.cover(backend, stream, stamp)?;
        let at = self.covering(stream, stamp);
        backend.stream_wait_event(waiter, self.streams[&stream].queued[at].0)
    }

    /// Where in `stream`'s queue the oldest fence covering `stamp` stands,
    /// once [`cover`](Self::cover) made sure one is queued.
    fn covering(&self, stream: StreamId, stamp: u64) -> usize {
        self.streams[&stream]
            .queued
            .iter()
            .position(|f| f.1 >= stamp)
            .expect("cover queued a fence at or after the stamp")
    }

    /// Blocks until every fence queued so far is complete, and destroys
    /// them, recording none: what `empty_cache` does for streams that no
    /// segment of the default pools belongs to (a stream only a graph's
    /// pool used), whose work may be gone, or whose stream may be (its
    /// events stay valid; a new one could not be recorded).
    pub fn wait_queued<B: Backend>(&mut self, backend: &mut B) -> Result<(), BackendError> {
        for s in self.streams.values_mut() {
            let Some(&(newest, _)) = s.queued.back() else {
                continue;
            };
            backend.wait_event(newest)?;
            for (ev, epoch) in s.queued.drain(..) {
                backend.destroy_event(ev);
                s.done = s.done.max(epoch);
            }
        }
        Ok(())
    }

    /// Blocks until every block freed so far is idle, on every stream in
    /// `streams`. Every stream is asked for its fence before any is waited
    /// for, so that the streams that refuse share one device
    /// synchronization ([`wait`](Self::wait)).
    pub fn wait_all<B: Backend>(
        &mut self,
        backend: &mut B,
        streams: impl IntoIterator<Item = StreamId>,
    ) -> Result<(), BackendError> {
        let stamp = self.epoch;
        let streams: Vec<StreamId> = streams.into_iter().collect();
        for &s in &streams {
            if !self.is_idle(s, stamp) {
                let _ = self.cover(backend, s, stamp);
            }
        }
        for s in streams {
            self.wait(backend, s, stamp)?;
        }
        Ok(())
    }
}

/// Whether the driver's answer to an event record says the stream's handle
/// is not one of a live stream of this context (destroyed, or of another
/// context): `CUDA_ERROR_INVALID_CONTEXT`, `CUDA_ERROR_INVALID_HANDLE`,
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED`. Other errors (out of memory, a
/// capture's) may pass; those streams are asked again.
fn names_a_dead_stream(e: &BackendError) -> bool {
    matches!(
        e,
        BackendError::Driver {
            code: 201 | 400 | 709,
            ..
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimBackend;

    #[test]
    fn a_fence_covers_what_was_freed_before_it() {
        let mut b = SimBackend::new(1 << 30);
        let mut f = Fences::default();
        assert!(f.is_idle(7, 0), "untouched pages are idle");
        let early = f.stamp();
        assert!(!f.is_idle(7, early));
        f.cover(&mut b, 7, early).unwrap();
        f.cover(&mut b, 7, early).unwrap();
        assert_eq!(f.outstanding(), 1, "one fence covers both");
        let late = f.stamp();
        assert!(late > early);
        f.poll(&mut b).unwrap();
        assert!(!f.is_idle(7, early), "not complete yet");
        b.complete(7);
        f.poll(&mut b).unwrap();
        assert!(f.is_idle(7, early));
        assert!(!f.is_idle(7, late), "freed after the fence");
        assert!(!f.is_idle(8, early), "other streams have their own fences");
        f.wait(&mut b, 7, late).unwrap();
        assert!(f.is_idle(7, late));
        assert_eq!(b.counters.wait_event, 1);
        assert_eq!(f.outstanding(), 0);
        assert_eq!(b.live_events(), 0);
        f.cover_all(&mut b, [7]);
        assert_eq!(f.outstanding(), 0, "stream 7 is covered already");
        f.cover_all(&mut b, [8]);
        f.cover_all(&mut b, [7, 8]);
        assert_eq!(f.outstanding(), 1, "nothing freed since the last call");
        b.complete(8);
        f.poll(&mut b).unwrap();
        f.stamp();
        f.cover_all(&mut b, [7, 8]);
        assert_eq!(f.outstanding(), 2);
    }

    /// Note [Streams that refuse events]: a stream whose handle the driver
    /// refused is not handed to it again at every cover, its waits
    /// synchronize the device, and once it allocates again it is asked
    /// again. A refusal for another cause is not remembered.
    #[test]
    fn a_stream_that_refused_an_event_is_not_asked_again_until_it_allocates() {
        use crate::backend::SimCall;
        let mut b = SimBackend::new(1 << 30);
        let mut f = Fences::default();
        b.refuse_events_on(9);
        for _ in 0..10 {
            f.stamp();
            f.cover_all(&mut b, [0, 9]);
        }
        assert_eq!(
            b.calls(SimCall::RecordEvent),
            10 + 1,
            "stream 0 every time, the refusing stream once"
        );
        let stamp = f.stamp();
        let syncs = b.calls(SimCall::Synchronize);
        f.wait(&mut b, 9, stamp).unwrap();
        assert_eq!(b.calls(SimCall::Synchronize), syncs + 1);
        assert!(f.is_idle(9, stamp));
        b.accept_events_on(9);
        f.revive(9);
        let (stamp, before) = (f.stamp(), f.outstanding());
        f.cover(&mut b, 9, stamp).unwrap();
        assert_eq!(f.outstanding(), before + 1, "a fence on stream 9 again");
        // Another error (here CUDA_ERROR_UNKNOWN) is not remembered.
        b.fail_call(SimCall::RecordEvent, 1);
        let stamp = f.stamp();
        assert!(f.cover(&mut b, 0, stamp).is_err());
        f.cover(&mut b, 0, stamp).unwrap();
    }

    /// Ordering another stream after freed blocks waits on the GPU for the
    /// oldest fence that covers them (recording one if none does), never on
    /// the host; nothing is asked for blocks known idle or of the waiter's
    /// own stream; a stream that refuses events gives an error (the caller
    /// waits on the host instead).
    #[test]
    fn order_after_makes_the_waiter_wait_on_the_gpu_for_the_covering_fence() {
        let mut b = SimBackend::new(1 << 30);
        let mut f = Fences::default();
        let work = b.launch(7);
        let freed = f.stamp();
        f.order_after(&mut b, 3, 3, freed).unwrap();
        assert_eq!(b.counters.stream_wait_event, 0, "own stream: nothing");
        f.order_after(&mut b, 3, 7, freed).unwrap();
        assert_eq!(f.outstanding(), 1, "a fence recorded on stream 7");
        assert_eq!(b.counters.stream_wait_event, 1);
        assert!(b.is_ordered_after(3, 7, work), "stream 3 after the work");
        assert_eq!(b.counters.wait_event, 0, "the host never waited");
        // Work queued later on 7 is not waited for by the covering fence.
        let later = b.launch(7);
        f.order_after(&mut b, 4, 7, freed).unwrap();
        assert_eq!(f.outstanding(), 1, "the same fence serves stream 4");
        assert!(b.is_ordered_after(4, 7, work));
        assert!(!b.is_ordered_after(4, 7, later));
        // Known idle: nothing asked.
        b.complete(7);
        f.poll(&mut b).unwrap();
        f.order_after(&mut b, 5, 7, freed).unwrap();
        assert_eq!(b.counters.stream_wait_event, 2);
        // A stream that refuses events: an error, no wait made.
        b.refuse_events_on(9);
        b.launch(9);
        let stamp = f.stamp();
        assert!(f.order_after(&mut b, 3, 9, stamp).is_err());
        assert_eq!(b.counters.stream_wait_event, 2);
    }

    #[test]
    fn frees_alone_never_queue_more_than_a_few_fences() {
        // Steady state: every request served from the cache, no slow path
        // polls; the frees' fences must not pile up (one CUDA event each).
        let mut b = SimBackend::new(1 << 30);
        let mut f = Fences::default();
        let first = f.stamp();
        for i in 0..20_000 {
            f.stamp();
            f.after_free(&mut b, 7, 4 << 20, |_| true);
            assert!(
                f.outstanding() <= MAX_QUEUED,
                "free {i}: {}",
                f.outstanding()
            );
            assert!(b.live_events() <= MAX_QUEUED);
            if i % 1000 == 999 {
                // The GPU catches up: the next fence learns it, so blocks
                // freed before it are known idle without a slow path.
                b.complete(7);
            }
        }
        b.complete(7);
        for _ in 0..FREES_PER_FENCE {
            f.after_free(&mut b, 7, 4 << 20, |_| true);
        }
        assert!(f.outstanding() <= 1, "the done ones were let go");
        assert!(f.is_idle(7, first), "known without a slow path");
    }
}
