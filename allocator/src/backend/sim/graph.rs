//! The graph a simulated capture builds: nodes and the nodes each depends
//! on, and each capturing stream's terminal nodes (what its next work will
//! depend on), as CUDA builds them from the work and the waits between
//! streams queued during a capture. What reuse inside a capture reads
//! (Note [Reuse inside a capture] in `capture_reuse.rs`).

use rustc_hash::FxHashMap;

use super::SimBackend;
use crate::backend::{CaptureNodes, GraphNode, StreamId};

/// One capture's graph.
#[derive(Default)]
pub(super) struct SimGraph {
    /// Each node's dependencies.
    deps: FxHashMap<GraphNode, Vec<GraphNode>>,
    /// Each capturing stream's terminal nodes.
    terminals: FxHashMap<StreamId, Vec<GraphNode>>,
    /// Nodes made so far.
    made: GraphNode,
}

impl SimBackend {
    /// Starts a capture on `stream` that builds a graph (`cudaStreamBeginCapture`):
    /// as [`begin_stream_capture`](Self::begin_stream_capture), and
    /// [`capture_terminals`](crate::backend::Backend::capture_terminals)
    /// tells the stream's terminal nodes, none yet. Returns its id; ends
    /// with [`end_stream_capture`](Self::end_stream_capture).
    pub fn begin_graph_capture(&mut self, stream: StreamId) -> u64 {
        let id = self.begin_stream_capture(&[stream]);
        let mut g = SimGraph::default();
        g.terminals.insert(stream, Vec::new());
        self.graphs.insert(id, g);
        id
    }

    /// Work queued on capturing `stream` (a kernel): a node that depends
    /// on the stream's terminals and becomes its only terminal. Returns it.
    ///
    /// # Panics
    /// When `stream` captures no graph.
    pub fn capture_launch(&mut self, stream: StreamId) -> GraphNode {
        let g = self.graph_of(stream);
        g.made += 1;
        let node = g.made;
        let deps = g.terminals.insert(stream, vec![node]).unwrap_or_default();
        g.deps.insert(node, deps);
        node
    }

    /// `waiter.wait_stream(waited)` during a capture: `waiter` joins
    /// `waited`'s capture if it was not in it, and its next work depends
    /// on `waited`'s terminals too.
    ///
    /// # Panics
    /// When `waited` captures no graph, or `waiter` captures another.
    pub fn capture_wait(&mut self, waiter: StreamId, waited: StreamId) {
        let id = self.stream_captures[&waited];
        let joined = *self.stream_captures.entry(waiter).or_insert(id);
        assert_eq!(
            joined, id,
            "SimBackend: stream {waiter:#x} captures another graph"
        );
        let g = self.graph_of(waited);
        let from = g.terminals[&waited].clone();
        let t = g.terminals.entry(waiter).or_default();
        for n in from {
            if !t.contains(&n) {
                t.push(n);
            }
        }
    }

    pub(super) fn graph_terminals(&mut self, stream: StreamId) -> Option<CaptureNodes> {
        let &capture = self.stream_captures.get(&stream)?;
        let g = self.graphs.get(&capture)?;
        self.walked_graph = capture;
        Some(CaptureNodes {
            capture,
            graph: capture,
            nodes: g.terminals.get(&stream).cloned().unwrap_or_default(),
        })
    }

    pub(super) fn graph_node_deps(&self, node: GraphNode) -> Vec<GraphNode> {
        self.graphs
            .get(&self.walked_graph)
            .and_then(|g| g.deps.get(&node))
            .cloned()
            .unwrap_or_else(|| {
                panic!(
                    "SimBackend: no node {node} in graph {} (the last asked about)",
                    self.walked_graph
                )
            })
    }

    fn graph_of(&mut self, stream: StreamId) -> &mut SimGraph {
        let id = self.stream_captures[&stream];
        self.graphs
            .get_mut(&id)
            .unwrap_or_else(|| panic!("SimBackend: capture {id} builds no graph"))
    }
}
