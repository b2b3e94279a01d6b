//! Stream events: what orders a block's reuse after the work of the other
//! streams that used it (`record_stream`).
//!
//! A block freed while other streams used it is not reusable at once: one
//! event is recorded on each of those streams (`insert_events`), and the
//! block goes back to its pool when the last has completed, found by
//! polling each stream's queue in order (`process_events`, on every
//! allocation while events are pending) or by waiting for all of them
//! (`synchronize_and_free_events`, on the out-of-memory path and
//! `empty_cache`). The queue itself, and the frees a capture or a driver
//! error deferred, are `pending.rs`'s; this file holds the operations that
//! also touch the blocks and the backend. PyTorch's `insert_events`,
//! `process_events` and `synchronize_and_free_events`.
//!
//! Note [Frees on another stream]
//! Rationale: PyTorch's rules let a program use a block on a stream other
//! than its own without `record_stream`, as long as the program orders the
//! block's reuse itself: ColossalAI's Gemini gathers chunks on a prefetch
//! stream, reads them on the compute stream and frees them right after
//! queuing the reads; the prefetch stream waits for the compute stream
//! before it gathers again. Under PyTorch's allocator that is safe, since
//! a freed block stays where it is and is reused only on its own stream.
//! gpualloc also moves free pages (defragmentation, stitching), unmaps them
//! once the block's own stream is past the free (Note [Event-ordered
//! unmapping]), and may hand a free block to another stream
//! (`cross_stream_reuse`): each of these could let the other stream's
//! queued reads fault (`CUDA_ERROR_ILLEGAL_ADDRESS`) or read pages that now
//! hold something else. Ordering only the moves was tried first; the
//! stream-safety properties (`Checked::use_elsewhere`) found the unmaps of
//! `empty_cache` and the reuse on a third stream unprotected.
//! Approach: the bridge passes the stream current where a block is freed
//! (`gpualloc_free_on`). A free made while another stream than the block's
//! is current counts as `record_stream` on that stream first (traced as
//! one, so a replay does the same): the block comes back once that
//! stream's work queued so far is done, and every path that moves, unmaps
//! or reuses pages sees it as any recorded block. The cost is PyTorch's
//! for `record_stream`: an event per such free, and the block held until
//! that work is done. Frees on the block's own stream, frees of blocks of
//! private pools (whose pages never move, and whose blocks cudagraph trees
//! free on the default stream before restoring a checkpoint that refuses
//! pending ones), and frees where the current stream is unknown (frees
//! deferred while a pool's other allocator calls back, a process without
//! PyTorch's libc10_cuda.so) are as before. Without the bridge, the C
//! library reads PyTorch's current stream from c10 itself (Note [The
//! current stream without the bridge] in the C library's
//! `torch_stream.rs`).
//! A program that orders the block's stream after the other *before* the
//! free (FSDP2 holds its all-gather output until the all-gather stream has
//! waited for the copy-out) was safe without this and now pays the hold
//! too: up to what the host runs ahead of that stream. Keeping same-stream
//! reuse immediate, with only moves, unmaps and reuse on other streams
//! behind an event on the current stream, would spare it; not built.

use crate::backend::{Backend, BackendError, DevicePtr, EventId, StreamId};
use crate::block::{BlockId, BlockState};
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::trace::Action;

impl<B: Backend> DeviceAllocator<B> {
    /// Records one event on each stream that used the block, and frees it
    /// once none is left to record and none is outstanding. If the driver
    /// refuses, the streams not yet covered stay on the block: the caller
    /// defers it (it is never reused unprotected).
    pub(crate) fn insert_events(&mut self, id: BlockId) -> Result<(), BackendError> {
        while let Some(&s) = self.heap.blocks[id].stream_uses.last() {
            let ev = self.backend.record_event(s)?;
            self.heap.blocks[id].stream_uses.pop();
            self.heap.blocks[id].event_count += 1;
            self.pending.push(s, ev, id);
        }
        if self.heap.blocks[id].event_count == 0 {
            self.free_block(id);
        }
        Ok(())
    }

    /// Records the events of blocks whose free was deferred (by a capture or
    /// a driver error). One whose event the driver refuses again (a stream
    /// of another device, or one destroyed since its `record_stream`) must
    /// not make every later allocation fail: each stream the block is still
    /// recorded on is synchronized instead, in its own device's context
    /// (`sync_refused_stream`), then this device, after which none of those
    /// streams uses the block, and the block is freed (PyTorch would fail
    /// the free itself).
    /// Only when that fails too, or during a capture, do the rest stay
    /// deferred.
    fn flush_deferred(&mut self) -> Result<(), AllocError> {
        let ids = self.pending.take_deferred();
        // Their markers go with them (a block deferred again waits for
        // the capture's end).
        if !ids.is_empty() {
            self.capture_reuse.forget();
        }
        for (k, &id) in ids.iter().enumerate() {
            let Err(e) = self.insert_events(id) else {
                continue;
            };
            let stream = self.heap.blocks[id]
                .stream_uses
                .last()
                .copied()
                .unwrap_or(0);
            let failed = if self.private.capturing() {
                Some(e)
            } else {
                let uses = self.heap.blocks[id].stream_uses.clone();
                let synced = uses
                    .into_iter()
                    .try_for_each(|s| self.sync_refused_stream(s))
                    .and_then(|()| self.backend.synchronize());
                match synced {
                    Ok(()) => {
                        crate::log::event_refused(self.device, stream, &e);
                        None
                    }
                    Err(sync) => Some(sync),
                }
            };
            if let Some(e) = failed {
                for &rest in &ids[k..] {
                    self.pending.defer(rest);
                }
                return Err(e.into());
            }
            self.heap.blocks[id].stream_uses.clear();
            if self.heap.blocks[id].event_count == 0 {
                self.free_block(id);
            }
        }
        Ok(())
    }

    /// Waits for the work on a stream whose event the driver refused
    /// twice, in the context of the stream's device: a side stream of
    /// another GPU is not covered by this device's synchronization. A side
    /// stream that cannot be synchronized either (destroyed since its
    /// `record_stream`: its handle is no longer valid) is passed over, as
    /// nothing can wait for it any more; another GPU's default stream must
    /// be (its device's error is returned).
    fn sync_refused_stream(&mut self, stream: StreamId) -> Result<(), BackendError> {
        match self.backend.synchronize_stream(stream) {
            Err(e) if crate::backend::other_device_stream(stream).is_none() => {
                crate::log::stream_gone(self.device, stream, &e);
                Ok(())
            }
            r => r,
        }
    }

    /// Marks a block as also used on `stream` (`Tensor.record_stream`).
    ///
    /// # Errors
    /// [`AllocError::InvalidPointer`] for a pointer not allocated here.
    pub fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<(), AllocError> {
        let Some(&id) = self.live.get(&ptr) else {
            return Err(AllocError::InvalidPointer {
                ptr,
                device: self.device,
            });
        };
        let b = &self.heap.blocks[id];
        if b.state != BlockState::Allocated || b.stream == stream {
            return Ok(());
        }
        self.add_stream_use(id, ptr, stream);
        Ok(())
    }

    /// [`record_stream`](Self::record_stream) of allocated block `id` (at
    /// `ptr`) on `stream`, another than its own.
    pub(crate) fn add_stream_use(&mut self, id: BlockId, ptr: DevicePtr, stream: StreamId) {
        self.note_stream_use(id, stream);
        let b = &mut self.heap.blocks[id];
        if !b.stream_uses.contains(&stream) {
            b.stream_uses.push(stream);
            self.record(Action::RecordStream, stream, ptr, 0, 0);
        }
    }

    /// [`record_stream`](Self::record_stream) with a stream of device
    /// `stream_device`, which may be another than this one: its shared
    /// handles (the default streams) are then keyed apart from this
    /// device's (Note [Streams of other devices] in `backend/stream.rs`).
    ///
    /// # Errors
    /// As [`record_stream`](Self::record_stream).
    pub fn record_stream_of_device(
        &mut self,
        ptr: DevicePtr,
        stream: StreamId,
        stream_device: u32,
    ) -> Result<(), AllocError> {
        let key = crate::backend::stream_on_device(stream, stream_device, self.device);
        self.record_stream(ptr, key)
    }

    /// Polls each stream's events in order up to the first one not done and
    /// frees the blocks whose last event completed. Also finishes blocks
    /// whose free was deferred by a capture.
    pub(crate) fn process_events(&mut self) -> Result<(), AllocError> {
        self.flush_deferred()?;
        if self.pending.count() == 0 {
            return Ok(());
        }
        for s in self.pending.streams() {
            while let Some((ev, id)) = self.next_completed(s, false)? {
                self.complete_event(ev, id);
            }
        }
        Ok(())
    }

    /// Dequeues `stream`'s oldest event if it has completed; with `wait`,
    /// once it has (the host blocks).
    fn next_completed(
        &mut self,
        stream: StreamId,
        wait: bool,
    ) -> Result<Option<(EventId, BlockId)>, BackendError> {
        let backend = &mut self.backend;
        self.pending.pop_if(stream, |ev| {
            if wait {
                backend.wait_event(ev).map(|()| true)
            } else {
                backend.event_done(ev)
            }
        })
    }

    /// A dequeued event has completed: the block is freed with its last.
    fn complete_event(&mut self, ev: EventId, id: BlockId) {
        self.backend.destroy_event(ev);
        let b = &mut self.heap.blocks[id];
        b.event_count -= 1;
        if b.event_count == 0 {
            self.free_block(id);
        }
    }

    /// Waits for every outstanding event and frees the blocks
    /// (`synchronize_and_free_events`).
    pub(crate) fn synchronize_and_free_events(&mut self) -> Result<(), AllocError> {
        self.flush_deferred()?;
        self.stats.num_sync_all_streams += 1;
        self.record(Action::SyncAllStreams, 0, 0, self.pending.count() as u64, 0);
        // In stream order, so a trace and its replay list completions alike.
        for s in self.pending.streams() {
            // On a driver error the event stays queued for a later wait.
            while let Some((ev, id)) = self.next_completed(s, true)? {
                self.complete_event(ev, id);
            }
        }
        Ok(())
    }
}
