//! Frees that wait for other streams: PyTorch's per-stream event queues
//! (`cuda_events`) plus the frees deferred by a graph capture or a driver
//! error.
//!
//! A block used on other streams (`record_stream`) is freed only after an
//! event recorded on each of them has completed. Events are queued per
//! stream in the order they were recorded, so a stream's queue is polled
//! from the front up to the first event not yet done. While a capture runs,
//! or when recording an event failed, the block waits in the deferred list
//! and its events are recorded at the next chance (`flush_deferred` in
//! `stream_events.rs`). The device keeps the policy (what a completed
//! event frees); this file keeps the queues and their count consistent.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::backend::{BackendError, EventId, StreamId};
use crate::block::BlockId;

/// The device's outstanding stream events and deferred frees.
#[derive(Default)]
pub(crate) struct PendingFrees {
    /// Per stream, events in recording order with the block each frees.
    queues: FxHashMap<StreamId, VecDeque<(EventId, BlockId)>>,
    /// Events queued over all streams (0 keeps the hot path short).
    count: usize,
    /// Blocks whose events are still to be recorded (capture, driver error).
    deferred: Vec<BlockId>,
}

impl PendingFrees {
    /// Whether nothing waits: no event queued and nothing deferred.
    #[inline]
    pub fn is_idle(&self) -> bool {
        self.count == 0 && self.deferred.is_empty()
    }

    /// Events queued over all streams.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Queues `ev`, recorded on `stream`, as one of the events `block` waits for.
    pub fn push(&mut self, stream: StreamId, ev: EventId, block: BlockId) {
        self.queues
            .entry(stream)
            .or_default()
            .push_back((ev, block));
        self.count += 1;
    }

    /// Defers `block`'s events to the next [`take_deferred`](Self::take_deferred).
    pub fn defer(&mut self, block: BlockId) {
        self.deferred.push(block);
    }

    /// The deferred blocks, in the order they were deferred; the list is
    /// left empty (defer again what still cannot be recorded).
    pub fn take_deferred(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.deferred)
    }

    /// Whether `block` waits in the deferred list.
    pub fn is_deferred(&self, block: BlockId) -> bool {
        self.deferred.contains(&block)
    }

    /// Takes `block` out of the deferred list (reused inside a capture,
    /// Note [Reuse inside a capture]); false when it was not there.
    pub fn remove_deferred(&mut self, block: BlockId) -> bool {
        let before = self.deferred.len();
        self.deferred.retain(|&b| b != block);
        self.deferred.len() != before
    }

    /// Where `block` stands in the deferred list (the order of the frees).
    pub fn deferred_rank(&self, block: BlockId) -> usize {
        self.deferred
            .iter()
            .position(|&b| b == block)
            .unwrap_or(usize::MAX)
    }

    /// The events `block` waits for, in every queue.
    pub fn events_of(&self, block: BlockId) -> Vec<EventId> {
        self.queues
            .values()
            .flat_map(|q| q.iter().filter(|(_, b)| *b == block).map(|(ev, _)| *ev))
            .collect()
    }

    /// The streams with queued events, in ascending order (a trace and its
    /// replay then list completions alike).
    pub fn streams(&self) -> Vec<StreamId> {
        let mut s: Vec<StreamId> = self.queues.keys().copied().collect();
        s.sort_unstable();
        s
    }

    /// Pops `stream`'s oldest event if `done` says it has completed; `None`
    /// when the queue is empty or its front is not done. A `done` error
    /// leaves the event queued.
    pub fn pop_if(
        &mut self,
        stream: StreamId,
        done: impl FnOnce(EventId) -> Result<bool, BackendError>,
    ) -> Result<Option<(EventId, BlockId)>, BackendError> {
        let Some(q) = self.queues.get_mut(&stream) else {
            return Ok(None);
        };
        let Some(&(ev, block)) = q.front() else {
            return Ok(None);
        };
        if !done(ev)? {
            return Ok(None);
        }
        q.pop_front();
        if q.is_empty() {
            self.queues.remove(&stream);
        }
        self.count -= 1;
        Ok(Some((ev, block)))
    }

    /// A whole-structure check: the count matches the queues, and the
    /// queues hold `expected` events in all (the blocks' event counts).
    pub fn check(&self, expected: u32) -> Result<(), String> {
        let queued: usize = self.queues.values().map(VecDeque::len).sum();
        if queued != self.count || queued as u32 != expected {
            return Err(format!(
                "{queued} queued events, count says {}, blocks expect {expected}",
                self.count
            ));
        }
        if self.queues.values().any(VecDeque::is_empty) {
            return Err("an empty event queue is kept".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queues_pop_in_order_up_to_the_first_event_not_done() {
        let mut p = PendingFrees::default();
        assert!(p.is_idle());
        p.push(1, 10, 100);
        p.push(1, 11, 101);
        p.push(2, 20, 200);
        assert_eq!((p.count(), p.streams()), (3, vec![1, 2]));
        assert_eq!(p.events_of(101), vec![11]);
        p.check(3).unwrap();
        assert_eq!(p.pop_if(1, |ev| Ok(ev == 10)).unwrap(), Some((10, 100)));
        assert_eq!(p.pop_if(1, |ev| Ok(ev == 10)).unwrap(), None, "11 not done");
        let err = p.pop_if(1, |_| Err(BackendError::Unavailable("x".into())));
        assert!(err.is_err());
        assert_eq!(p.count(), 2, "an error leaves the event queued");
        assert_eq!(p.pop_if(1, |_| Ok(true)).unwrap(), Some((11, 101)));
        assert_eq!(p.streams(), vec![2], "an empty queue goes");
        assert_eq!(p.pop_if(3, |_| Ok(true)).unwrap(), None);
        p.check(1).unwrap();
        assert!(p.check(2).is_err());
        p.defer(7);
        p.defer(9);
        assert!(p.is_deferred(7) && !p.is_deferred(8));
        assert_eq!((p.deferred_rank(9), p.deferred_rank(8)), (1, usize::MAX));
        assert!(p.remove_deferred(9) && !p.remove_deferred(9));
        assert_eq!(p.take_deferred(), vec![7]);
        assert_eq!(p.pop_if(2, |_| Ok(true)).unwrap(), Some((20, 200)));
        assert!(p.is_idle());
    }
}
