//! Cross frees: blocks freed while another stream than theirs was current.
//!
//! Note [Other streams' work on moved pages]
//! Rationale: PyTorch's rules let a program use a block on a stream other
//! than the one it was allocated on without `record_stream`, as long as the
//! program orders the block's reuse itself: ColossalAI's Gemini gathers
//! chunks on a prefetch stream, reads them on the compute stream and frees
//! them right after queuing the reads; the prefetch stream waits for the
//! compute stream before it gathers again. Under PyTorch's allocator that
//! is safe, because a freed block stays mapped and is only reused on its
//! own stream, after that wait. gpualloc also moves free pages away from
//! their address (defragmentation), and the old address leaves once the
//! block's own stream is known past the free (Note [Event-ordered
//! unmapping]): the compute stream's reads, still queued, would then fault
//! (`CUDA_ERROR_ILLEGAL_ADDRESS`), or read pages mapped there again.
//! Approach: the bridge passes the stream current where a block is freed
//! (`gpualloc_free_on`'s `current`). A free made while another stream than the
//! block's was current names that stream here, for the rest of the device's
//! life. While any is named, pages that move for a request order the
//! request's stream after the work queued so far on each named stream
//! (`cuStreamWaitEvent`: on the GPU, no host wait), and their old address
//! leaves only behind a fence recorded on the request's stream after that
//! (a drain, Note [Unmapping behind the work]); where nothing may be
//! deferred, the host waits for those streams instead. A program that
//! frees every block on its own stream, or uses `record_stream`, names
//! none and pays nothing; one that names some pays an event and a wait on
//! the GPU per move. Which pages move never depends on it, so a replay,
//! which does not know the current streams, makes the same decisions.
//! Work on a stream that allocates nothing through gpualloc and frees
//! nothing (a library's own stream) is not seen, as under PyTorch's
//! `record_stream`.

use crate::backend::{Backend, BackendError, StreamId};
use crate::fence::Fences;

/// See Note [Other streams' work on moved pages].
#[derive(Default)]
pub(crate) struct CrossFrees {
    /// Streams that were current where a block of another stream was freed.
    streams: Vec<StreamId>,
}

impl CrossFrees {
    /// A block of `stream` was freed where `current` was the current stream.
    #[inline]
    pub fn freed(&mut self, stream: StreamId, current: StreamId) {
        if current != stream && !self.streams.contains(&current) {
            self.streams.push(current);
        }
    }

    /// Whether any block was freed while another stream than its own was
    /// current.
    #[inline]
    pub fn any(&self) -> bool {
        !self.streams.is_empty()
    }

    /// Orders `stream`'s later work after the work queued so far on every
    /// named stream but itself, on the GPU. A stream whose events the
    /// driver refuses (destroyed, with its blocks freed) is forgotten: work
    /// left on a stream the program destroyed is the program's.
    pub fn order_after<B: Backend>(
        &mut self,
        backend: &mut B,
        stream: StreamId,
    ) -> Result<(), BackendError> {
        let mut dead = Vec::new();
        for &s in self.streams.iter().filter(|&&s| s != stream) {
            let ev = match backend.record_event(s) {
                Ok(ev) => ev,
                Err(e) if crate::fence::names_a_dead_stream(&e) => {
                    dead.push(s);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let waited = backend.stream_wait_event(stream, ev);
            backend.destroy_event(ev);
            waited?;
        }
        self.streams.retain(|s| !dead.contains(s));
        Ok(())
    }

    /// Blocks until the work queued so far on every named stream but
    /// `stream` is done: the host's wait, where nothing may be deferred.
    pub fn wait<B: Backend>(
        &self,
        fences: &mut Fences,
        backend: &mut B,
        stream: StreamId,
    ) -> Result<(), BackendError> {
        let now = fences.stamp();
        for &s in self.streams.iter().filter(|&&s| s != stream) {
            fences.wait(backend, s, now)?;
        }
        Ok(())
    }
}
