//! Streams of the simulated device, advanced by hand: work submitted and
//! completed, the order one stream's later work takes after another's,
//! and graph captures, which forbid some calls (see the module docs of
//! `sim.rs`).

use rustc_hash::{FxHashMap, FxHashSet};

use super::SimBackend;
use crate::backend::{EventId, StreamId};

/// One stream's progress.
#[derive(Default, Clone)]
pub(super) struct SimStream {
    /// Work items submitted (kernels and recorded events).
    pub(super) submitted: u64,
    /// Work items completed.
    pub(super) completed: u64,
    /// Completed by [`SimBackend::complete`] or a synchronization, not by
    /// waiting for one event: what events are done by when waits complete
    /// only the event waited for.
    pub(super) settled: u64,
    /// For each other stream: the sequence number this stream's future work waits for.
    pub(super) waits: FxHashMap<StreamId, u64>,
    /// Each wait as made: `(submitted here then, other stream, its sequence
    /// number)`. Work here after the first cannot finish before the other
    /// stream's work up to the last (what [`SimBackend::complete`] follows).
    pub(super) wait_log: Vec<(u64, StreamId, u64)>,
}

impl SimStream {
    /// Completes (and settles) everything submitted so far.
    pub(super) fn finish(&mut self) {
        self.completed = self.submitted;
        self.settled = self.submitted;
        self.wait_log.clear();
    }
}

impl SimBackend {
    /// While on, any call a CUDA graph capture forbids panics: event queries
    /// and waits, `release`, and `allocate` without the `capturing` flag.
    pub fn set_capturing(&mut self, on: bool) {
        self.capturing = on;
    }

    /// Starts a capture on `streams` that no hook announces (PyTorch's plain
    /// `CUDAPluggableAllocator`): `stream_capture` reports it, and until
    /// [`end_stream_capture`](Self::end_stream_capture) the calls a capture
    /// forbids panic, as with [`set_capturing`](Self::set_capturing), and so
    /// does recording an event on one of these streams (the event would
    /// belong to the graph, and querying it later fails). Returns its id.
    pub fn begin_stream_capture(&mut self, streams: &[StreamId]) -> u64 {
        let id = self.next_capture;
        self.next_capture += 1;
        for &s in streams {
            self.stream_captures.insert(s, id);
        }
        id
    }

    /// Starts a global-mode capture on `stream`, as another thread's
    /// `cudaStreamBeginCapture` does: the legacy stream (0) reports it too,
    /// without an id (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`). Ends with
    /// [`end_stream_capture`](Self::end_stream_capture).
    pub fn begin_global_capture(&mut self, stream: StreamId) -> u64 {
        let id = self.begin_stream_capture(&[stream]);
        self.stream_captures.insert(0, 0);
        id
    }

    /// Ends capture `id` on every stream that took part.
    pub fn end_stream_capture(&mut self, id: u64) {
        self.stream_captures.retain(|_, c| *c != id);
        self.graphs.remove(&id);
        // The legacy stream's answer for a global capture goes with the
        // last capture.
        if self.stream_captures.values().all(|&c| c == 0) {
            self.stream_captures.clear();
        }
    }

    /// Submits one work item on `stream` (a kernel); returns its sequence number.
    pub fn launch(&mut self, stream: StreamId) -> u64 {
        let s = self.streams.entry(stream).or_default();
        s.submitted += 1;
        s.submitted
    }

    /// Completes everything submitted on `stream` so far, and first the
    /// work on other streams that it waits for (`stream_wait_event`,
    /// transitively), as the GPU would: a stream cannot pass a wait before
    /// the work waited for is done.
    pub fn complete(&mut self, stream: StreamId) {
        let upto = self.streams.entry(stream).or_default().submitted;
        self.complete_through(stream, upto);
    }

    /// Completes `stream` up to `upto` and the work it waits for there.
    fn complete_through(&mut self, stream: StreamId, upto: u64) {
        let mut todo = vec![(stream, upto)];
        // Each push raises a stream's `settled`: this ends, cycles included.
        while let Some((at, upto)) = todo.pop() {
            let s = self.streams.entry(at).or_default();
            s.completed = s.completed.max(upto);
            s.settled = s.settled.max(upto);
            let waited: Vec<(StreamId, u64)> = s
                .wait_log
                .iter()
                .filter(|w| w.0 < upto)
                .map(|w| (w.1, w.2))
                .collect();
            s.wait_log.retain(|w| w.0 >= upto);
            for (other, seq) in waited {
                if self.streams.entry(other).or_default().settled < seq {
                    todo.push((other, seq));
                }
            }
        }
    }

    /// Completes `event` as a wait for it would (the stream up to it, or
    /// the event alone under [`set_waits_complete_one`](Self::set_waits_complete_one)),
    /// without a driver call: the device got there on its own. A replay
    /// does this where the recording found an event done by polling it.
    pub fn complete_event(&mut self, event: EventId) {
        let (stream, seq) = self.event(event);
        if let Some(waited) = &mut self.waited {
            // A replay's: the event alone, its stream's waits not followed.
            let s = self
                .streams
                .get_mut(&stream)
                .expect("stream of a recorded event");
            s.completed = s.completed.max(seq);
            waited.insert(event);
        } else {
            self.complete_through(stream, seq);
        }
    }

    /// Completes all work on every stream.
    pub fn complete_all(&mut self) {
        self.streams.values_mut().for_each(SimStream::finish);
    }

    /// With `true`, waiting for an event completes that event alone, not
    /// its stream up to it (see the module docs; a replay's setting).
    pub fn set_waits_complete_one(&mut self, on: bool) {
        self.waited = on.then(FxHashSet::default);
    }

    /// Whether work submitted on `earlier` up to `seq` is complete, or is
    /// ordered before all future work on `later` (same stream, or a
    /// stream-wait-event on an event at or after `seq`).
    pub fn is_ordered_after(&self, later: StreamId, earlier: StreamId, seq: u64) -> bool {
        if later == earlier {
            return true;
        }
        let Some(e) = self.streams.get(&earlier) else {
            return true;
        };
        e.completed >= seq
            || self
                .streams
                .get(&later)
                .and_then(|l| l.waits.get(&earlier))
                .is_some_and(|&w| w >= seq)
    }

    /// Events recorded and not yet destroyed.
    pub fn live_events(&self) -> usize {
        self.events.len()
    }

    pub(super) fn forbid_in_capture(&self, what: &str) {
        assert!(
            !self.capturing && self.stream_captures.is_empty(),
            "SimBackend: {what} called during CUDA graph capture"
        );
    }

    pub(super) fn event(&self, event: EventId) -> (StreamId, u64) {
        *self
            .events
            .get(&event)
            .unwrap_or_else(|| panic!("SimBackend: unknown or destroyed event {event}"))
    }
}
