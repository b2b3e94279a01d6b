//! The CUDA backend's view of a graph under capture, for reuse inside a
//! capture (Note [Reuse inside a capture] in `capture_reuse.rs`): a
//! capturing stream's terminal nodes and a node's dependencies, PyTorch's
//! `stream_get_capture_info` and `update_visited`. Both calls are allowed
//! during a capture; neither makes or waits for work.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::{CudaBackend, check, driver};
use crate::backend::{BackendError, CaptureNodes, GraphNode, StreamId};

/// `CUgraphEdgeData`: 8 bytes (ports, type, reserved), read and ignored.
type EdgeData = u64;
const _: () =
    assert!(std::mem::size_of::<sys::CUgraphEdgeData>() == std::mem::size_of::<EdgeData>());

impl CudaBackend {
    pub(super) fn graph_capture_terminals(
        &mut self,
        stream: StreamId,
    ) -> Result<Option<CaptureNodes>, BackendError> {
        let (_bound, s) = self.bind_stream(stream)?;
        let none = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as u32;
        let active = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE as u32;
        let (mut status, mut id, mut count) = (none, 0u64, 0usize);
        let mut graph: *mut c_void = std::ptr::null_mut();
        let mut nodes: *const *mut c_void = std::ptr::null();
        let mut edges: *const EdgeData = std::ptr::null();
        // SAFETY: `s` is a stream handle the caller passed (0 = the bound
        // context's legacy stream), alive for the call; every output is a
        // valid pointer to a local of the driver's type (the graph, a
        // pointer to the driver's array of terminal nodes and one to their
        // edge data, passed so that edges with data are no lossy query).
        // The CUDA 12.3 signature; NOT_FOUND without a call on an older
        // driver, which the 11.3 call below answers.
        let mut r = unsafe {
            driver::cuStreamGetCaptureInfo_v3(
                s,
                &mut status,
                &mut id,
                (&raw mut graph).cast(),
                (&raw mut nodes).cast(),
                (&raw mut edges).cast(),
                &mut count,
            )
        };
        if r == driver::NOT_FOUND {
            // SAFETY: as above, with the 11.3 signature (no edge data).
            r = unsafe {
                driver::cuStreamGetCaptureInfo_v2(
                    s,
                    &mut status,
                    &mut id,
                    (&raw mut graph).cast(),
                    (&raw mut nodes).cast(),
                    &mut count,
                )
            };
        }
        match r {
            // The legacy stream while another stream captures globally.
            driver::STREAM_CAPTURE_IMPLICIT => return Ok(None),
            other => check("cuStreamGetCaptureInfo", other)?,
        }
        if status != active {
            return Ok(None);
        }
        let nodes = if nodes.is_null() || count == 0 {
            Vec::new()
        } else {
            // SAFETY: on success the driver's array holds `count` nodes and
            // stays valid until the next call on this stream; copied now.
            unsafe { std::slice::from_raw_parts(nodes, count) }
                .iter()
                .map(|&n| n as GraphNode)
                .collect()
        };
        Ok(Some(CaptureNodes {
            capture: id,
            graph: graph as u64,
            nodes,
        }))
    }

    pub(super) fn graph_node_dependencies(
        &mut self,
        node: GraphNode,
    ) -> Result<Vec<GraphNode>, BackendError> {
        let n = node as *mut c_void;
        let null = std::ptr::null_mut();
        let mut count = 0usize;
        // SAFETY: `n` is a node of the graph under capture, as the driver
        // gave it (`graph_capture_terminals` or this function); with null
        // arrays the call only writes the count. The 12.3 signature first,
        // the older one where the driver lacks it (NOT_FOUND, no call).
        let mut r = unsafe { driver::cuGraphNodeGetDependencies_v2(n, null, null, &mut count) };
        let v2 = r != driver::NOT_FOUND;
        if !v2 {
            // SAFETY: as above, with the pre-12.3 signature.
            r = unsafe { driver::cuGraphNodeGetDependencies(n, null, &mut count) };
        }
        check("cuGraphNodeGetDependencies", r)?;
        if count == 0 {
            return Ok(Vec::new());
        }
        let mut deps: Vec<*mut c_void> = vec![std::ptr::null_mut(); count];
        let mut edges: Vec<EdgeData> = vec![0; count];
        // SAFETY: `deps` and `edges` hold `count` elements each, of the
        // sizes of `CUgraphNode` and `CUgraphEdgeData`; the driver writes
        // at most `count` and sets `count` to what it wrote.
        r = unsafe {
            if v2 {
                driver::cuGraphNodeGetDependencies_v2(
                    n,
                    deps.as_mut_ptr().cast(),
                    edges.as_mut_ptr().cast(),
                    &mut count,
                )
            } else {
                driver::cuGraphNodeGetDependencies(n, deps.as_mut_ptr().cast(), &mut count)
            }
        };
        check("cuGraphNodeGetDependencies", r)?;
        deps.truncate(count);
        Ok(deps.into_iter().map(|d| d as GraphNode).collect())
    }
}
