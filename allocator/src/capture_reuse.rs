//! Reuse inside a capture: a block freed during a CUDA graph capture while
//! other streams used it (`record_stream`) is reused before the capture
//! ends once the graph orders all later work after its last uses.
//!
//! Note [Reuse inside a capture]
//! Rationale: outside a capture such a block waits for an event on each
//! stream that used it (`stream_events.rs`). During a capture no event may
//! be queried, so by default the block waits for the capture's end, and a
//! capture that frees many cross-stream blocks holds them all: PyTorch's
//! own behaviour, and what its `graph_capture_record_stream_reuse` setting
//! (torch 2.9 on, opt-in; NVIDIA's Megatron recipes turn it on) improves.
//! Approach, PyTorch's: at the free, the terminal nodes of the block's
//! stream and of every stream that used it (`capture_terminals`) are its
//! "free markers": the last work on those streams when it was freed. At
//! each later allocation on the block's stream during the capture, the
//! nodes that the stream's terminals depend on, directly or not, are
//! walked (`node_dependencies`; each node once per capture and stream, as
//! the set only grows while work is added behind it). When every marker is
//! among them, everything the stream queues next runs after the block's
//! last use on every stream: the block is free, without an event. A block
//! whose streams were not all capturing at the free keeps no markers and
//! waits for the capture's end as before. One with markers that is still
//! deferred when a scope of its pool closes after its capture ended is
//! freed then, without an event: the capture could end only once all its
//! streams had joined again, so its uses are all in the graph, as those
//! of a block freed during the capture without other streams (a second
//! capture into the same pool reuses it; PyTorch frees every deferred
//! block of the pool there since pytorch#175817, those without markers
//! too, which gpualloc leaves to events). Markers carry their capture's
//! id (unique in the process), so a marker of a graph since destroyed,
//! whose node handle the driver may give again, is never compared with
//! another capture's nodes. (The walks assume that what a stream's work
//! depends on only grows during a capture, as PyTorch's do:
//! `cudaStreamUpdateCaptureDependencies` setting fewer is not followed.)
//!
//! Note [Uses outside the capture]
//! Markers order only captured work. A block used on another stream
//! outside the capture (eager work queued before the capture began, or
//! during it on a stream that was not capturing, or in an earlier capture)
//! may still be read by that work when a graph's replay, or an eager
//! allocation in the pool after the capture, reuses it. So a block gets
//! markers only if every `record_stream` on another stream was made
//! during the capture it is freed in, on a stream taking part in it
//! (`captured_uses`, noted as they are recorded); any other waits for
//! events after the capture. Stricter than PyTorch, which marks any block
//! whose streams all capture when it is freed. The moment of the
//! `record_stream` call stands for that of the work: eager work queued on
//! a stream before the capture, whose `record_stream` comes only during
//! it, is not seen (nor is it by PyTorch).
//!
//! On when gpualloc's key `graph_capture_record_stream_reuse` is, or
//! PyTorch's setting of the same name (its `PYTORCH_CUDA_ALLOC_CONF` or
//! `_set_allocator_settings`), which the bridge reads when a capture's
//! scope opens ([`set_graph_capture_record_stream_reuse`]).
//! A trace records the completion of such a free before the allocation,
//! or the scope's end, that made it, as any completion; a replay frees the
//! block the same way there (`replay.rs`).
//!
//! [`set_graph_capture_record_stream_reuse`]: DeviceAllocator::set_graph_capture_record_stream_reuse

use crate::backend::{Backend, DevicePtr, GraphNode, StreamId};
use crate::block::BlockId;
use crate::device::DeviceAllocator;
use crate::pool::PoolKey;

impl<B: Backend> DeviceAllocator<B> {
    /// PyTorch's `graph_capture_record_stream_reuse` (the bridge passes
    /// its value when a capture's scope opens): on, or gpualloc's key of
    /// the same name, blocks a capture defers are reused inside it once
    /// safe (Note [Reuse inside a capture]).
    pub fn set_graph_capture_record_stream_reuse(&mut self, on: bool) {
        self.capture_reuse.set_torch_setting(on);
    }

    /// Whether reuse inside a capture is on.
    pub fn graph_capture_record_stream_reuse(&self) -> bool {
        self.config.graph_capture_record_stream_reuse || self.capture_reuse.torch_setting()
    }

    /// Notes where a use of block `id` on `stream` is recorded: during a
    /// capture that `stream` takes part in, or not (Note [Uses outside the
    /// capture]). Asks the driver only while a scope is open and reuse
    /// inside a capture is on.
    pub(crate) fn note_stream_use(&mut self, id: BlockId, stream: StreamId) {
        let first = self.heap.blocks[id].stream_uses.is_empty();
        // A block already used outside a capture stays so: nothing to ask.
        let open = first || self.capture_reuse.has_captured_uses(id);
        let capture =
            if open && self.private.capturing() && self.graph_capture_record_stream_reuse() {
                match self.backend.stream_capture(stream) {
                    Ok(Some(c)) if c != 0 => Some(c),
                    _ => None,
                }
            } else {
                None
            };
        self.capture_reuse.note_use(id, capture, first);
    }

    /// Defers the free of `id`, used on other streams, during a capture;
    /// with reuse inside a capture on, with its free markers, if every use
    /// on another stream was recorded in the capture it is freed in (Note
    /// [Uses outside the capture]).
    pub(crate) fn defer_in_capture(&mut self, id: BlockId, captured_uses: Option<u64>) {
        self.pending.defer(id);
        if self.graph_capture_record_stream_reuse()
            && let Some(marked) = self.free_markers(id)
            && captured_uses == Some(marked.0)
        {
            self.capture_reuse.insert(id, marked);
        }
    }

    /// The terminal nodes of the block's stream and of every stream that
    /// used it, and their capture; `None` when one of them captures
    /// nothing, or another graph, or the driver does not tell, or no work
    /// was captured on them yet (the block then waits for the capture's end).
    fn free_markers(&mut self, id: BlockId) -> Option<(u64, Vec<GraphNode>)> {
        let mut capture = None;
        let mut markers: Vec<GraphNode> = Vec::new();
        for s in self.heap.blocks[id].streams() {
            let c = self.backend.capture_terminals(s).ok()??;
            if *capture.get_or_insert(c.capture) != c.capture {
                return None;
            }
            markers.extend(c.nodes);
        }
        markers.sort_unstable();
        markers.dedup();
        // None at all (no work captured yet): waits, as PyTorch's empty list.
        (!markers.is_empty()).then_some((capture?, markers))
    }

    /// Frees the deferred blocks of `stream` whose markers all precede the
    /// stream's terminals now (PyTorch's `free_safe_blocks_in_capture`).
    /// A driver error leaves them deferred.
    pub(crate) fn free_safe_blocks_in_capture(&mut self, stream: StreamId) {
        let blocks = &self.heap.blocks;
        if !self
            .capture_reuse
            .markers
            .keys()
            .any(|&id| blocks[id].stream == stream)
        {
            return;
        }
        let Ok(Some(c)) = self.backend.capture_terminals(stream) else {
            return;
        };
        if c.nodes.is_empty() {
            return;
        }
        let visited = self
            .capture_reuse
            .visited
            .entry((c.capture, stream))
            .or_default();
        let mut stack = c.nodes;
        while let Some(v) = stack.pop() {
            if !visited.insert(v) {
                continue;
            }
            match self.backend.node_dependencies(v) {
                Ok(deps) => stack.extend(deps),
                Err(e) => {
                    // Walked again from the start at the next allocation:
                    // a node kept here would hide the ones behind `v`.
                    self.capture_reuse.visited.remove(&(c.capture, stream));
                    crate::log::capture_walk_failed(self.device, stream, &e);
                    return;
                }
            }
        }
        let safe: Vec<BlockId> = self
            .capture_reuse
            .markers
            .iter()
            .filter(|&(&id, (capture, markers))| {
                blocks[id].stream == stream
                    && *capture == c.capture
                    && markers.iter().all(|m| visited.contains(m))
            })
            .map(|(&id, _)| id)
            .collect();
        self.reuse_deferred_in_order(safe);
    }

    /// When a scope of pool `key` closes: its deferred blocks with markers
    /// whose capture has ended (or was invalidated: no graph then) are
    /// freed without events. A capture ends only once every stream that
    /// took part has joined the stream that began it, and markers are
    /// only given to blocks whose every use on another stream was made in
    /// that capture (Note [Uses outside the capture]), so all their uses
    /// are in the graph, as those of a block freed during the capture
    /// without other streams (PyTorch frees the pool's deferred blocks
    /// there since pytorch#175817). A block whose stream the driver still
    /// reports in that capture (a scope closed inside a capture) keeps
    /// waiting; so does one the driver cannot tell of.
    pub(crate) fn free_deferred_at_capture_end(&mut self, key: PoolKey) {
        let Some((small, large, _)) = self.private.find(key) else {
            return;
        };
        let blocks = &self.heap.blocks;
        let candidates: Vec<(BlockId, u64)> = self
            .capture_reuse
            .markers
            .iter()
            .filter(|&(&id, _)| blocks[id].pool == small || blocks[id].pool == large)
            .map(|(&id, &(capture, _))| (id, capture))
            .collect();
        let mut ended: Vec<BlockId> = Vec::new();
        for (id, capture) in candidates {
            match self.backend.capture_terminals(self.heap.blocks[id].stream) {
                Ok(Some(c)) if c.capture == capture => {}
                Ok(_) => ended.push(id),
                Err(_) => {}
            }
        }
        self.reuse_deferred_in_order(ended);
    }

    /// [`reuse_deferred`](Self::reuse_deferred) for each of `ids`, in the
    /// order they were freed, so a trace and its replay agree.
    fn reuse_deferred_in_order(&mut self, mut ids: Vec<BlockId>) {
        ids.sort_unstable_by_key(|&id| self.pending.deferred_rank(id));
        for id in ids {
            self.reuse_deferred(id);
        }
    }

    /// A replay's [`reuse_deferred`](Self::reuse_deferred): the block at
    /// `ptr`, if a capture under way deferred it, is freed where the
    /// recorded run freed it. False for any other block.
    pub(crate) fn reuse_deferred_in_capture(&mut self, ptr: DevicePtr) -> bool {
        match self.live.get(&ptr) {
            Some(&id) if self.private.capturing() && self.pending.is_deferred(id) => {
                self.reuse_deferred(id);
                true
            }
            _ => false,
        }
    }

    /// Frees a block a capture deferred, without an event: the graph
    /// orders its reuse after its last uses (or, in a replay, the recorded
    /// run found so).
    pub(crate) fn reuse_deferred(&mut self, id: BlockId) {
        self.capture_reuse.markers.remove(&id);
        self.pending.remove_deferred(id);
        self.heap.blocks[id].stream_uses.clear();
        if self.heap.blocks[id].event_count == 0 {
            self.free_block(id);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
