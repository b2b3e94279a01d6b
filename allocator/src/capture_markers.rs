//! The free markers of the blocks a capture deferred, and what is known of
//! the graph under capture: the state of reuse inside a capture (Note
//! [Reuse inside a capture] in `capture_reuse.rs`, which holds the device's
//! operations on it).

use rustc_hash::{FxHashMap, FxHashSet};

use crate::backend::{GraphNode, StreamId};
use crate::block::BlockId;

/// Free markers of the blocks a capture deferred, and the graph nodes
/// known to precede each capturing stream's work.
#[derive(Default)]
pub(crate) struct CaptureMarkers {
    /// PyTorch's `graph_capture_record_stream_reuse`, as the bridge read it.
    torch_setting: bool,
    /// Deferred blocks with markers: their capture's id and the markers.
    pub(crate) markers: FxHashMap<BlockId, (u64, Vec<GraphNode>)>,
    /// Per capture and stream, the nodes its terminals depend on (walked).
    pub(crate) visited: FxHashMap<(u64, StreamId), FxHashSet<GraphNode>>,
    /// Live blocks whose every use on another stream was recorded during
    /// one capture, while that stream took part in it: the capture's id.
    /// A block with such uses and no entry was used outside a capture too
    /// (or before reuse was on), and its markers would not order that work.
    captured_uses: FxHashMap<BlockId, u64>,
}

impl CaptureMarkers {
    /// PyTorch's setting, as the bridge last passed it.
    pub fn torch_setting(&self) -> bool {
        self.torch_setting
    }

    pub fn set_torch_setting(&mut self, on: bool) {
        self.torch_setting = on;
    }

    /// Keeps `block`'s markers: `(capture id, nodes)`.
    pub fn insert(&mut self, block: BlockId, marked: (u64, Vec<GraphNode>)) {
        self.markers.insert(block, marked);
    }

    /// A use of `block` on another stream was recorded: during capture
    /// `capture` (`Some`), or outside any (`None`). `first` says whether
    /// it is the block's first such use.
    pub fn note_use(&mut self, block: BlockId, capture: Option<u64>, first: bool) {
        match capture {
            Some(c) if first || self.captured_uses.get(&block) == Some(&c) => {
                self.captured_uses.insert(block, c);
            }
            _ => {
                if !self.captured_uses.is_empty() {
                    self.captured_uses.remove(&block);
                }
            }
        }
    }

    /// Whether `block`'s uses so far were all recorded during one capture.
    pub fn has_captured_uses(&self, block: BlockId) -> bool {
        self.captured_uses.contains_key(&block)
    }

    /// Whether every use of `block` on another stream was recorded during
    /// one capture; that capture. Forgets the block (it is being freed).
    pub fn take_captured_uses(&mut self, block: BlockId) -> Option<u64> {
        if self.captured_uses.is_empty() {
            return None;
        }
        self.captured_uses.remove(&block)
    }

    /// Whether no deferred block has markers (one branch on the allocation
    /// path of a capture).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.markers.is_empty()
    }

    /// No capture is open any more: the walks of their graphs go (the
    /// markers left never match another capture's, and go with their
    /// blocks at the next flush).
    pub fn end_captures(&mut self) {
        if !self.visited.is_empty() {
            self.visited.clear();
        }
    }

    /// A whole-structure check: every block with markers is a deferred
    /// free (`deferred` says so) and has some; every block with captured
    /// uses is allocated and used on other streams (`used_elsewhere`).
    pub fn check(
        &self,
        deferred: impl Fn(BlockId) -> bool,
        used_elsewhere: impl Fn(BlockId) -> bool,
    ) -> Result<(), String> {
        if let Some(id) = self.captured_uses.keys().find(|&&id| !used_elsewhere(id)) {
            return Err(format!(
                "block {id} has uses recorded in a capture but is no live block used on other streams"
            ));
        }
        match self
            .markers
            .iter()
            .find(|&(&id, (_, m))| !deferred(id) || m.is_empty())
        {
            Some((id, _)) => Err(format!(
                "block {id} has free markers but is no deferred free, or has none"
            )),
            None => Ok(()),
        }
    }

    /// Forgets the markers (the deferred blocks were taken: they wait for
    /// events now, or for the capture's end) and the walks.
    pub fn forget(&mut self) {
        if !self.markers.is_empty() {
            self.markers.clear();
        }
        if !self.visited.is_empty() {
            self.visited.clear();
        }
    }
}
