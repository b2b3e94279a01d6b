//! Fault injection of the simulated device: every kind of driver call
//! ([`SimCall`]) can be made to fail at its `n`-th call from now, once or
//! several times in a row, before it changes anything.

use super::SimBackend;
use crate::backend::{BackendError, StreamId};

/// The driver calls [`SimBackend::fail_call`] can make fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimCall {
    /// `allocate` (`cudaMalloc`).
    Allocate,
    /// `release` (`cudaFree`).
    Release,
    /// `record_event`.
    RecordEvent,
    /// `event_done` (event query).
    EventDone,
    /// `wait_event` (event synchronize).
    WaitEvent,
    /// `stream_wait_event`.
    StreamWaitEvent,
    /// `reserve` (virtual address range).
    Reserve,
    /// `free_reservation`.
    FreeReservation,
    /// `create_handle` (physical memory).
    CreateHandle,
    /// `release_handle`.
    ReleaseHandle,
    /// `map_handles`.
    Map,
    /// `unmap`.
    Unmap,
    /// `synchronize`.
    Synchronize,
    /// `capture_terminals` (a capturing stream's terminal nodes).
    CaptureTerminals,
    /// `node_dependencies` (a captured node's dependencies).
    NodeDependencies,
}

impl SimCall {
    /// Every kind, in declaration order.
    pub const ALL: [SimCall; 15] = [
        SimCall::Allocate,
        SimCall::Release,
        SimCall::RecordEvent,
        SimCall::EventDone,
        SimCall::WaitEvent,
        SimCall::StreamWaitEvent,
        SimCall::Reserve,
        SimCall::FreeReservation,
        SimCall::CreateHandle,
        SimCall::ReleaseHandle,
        SimCall::Map,
        SimCall::Unmap,
        SimCall::Synchronize,
        SimCall::CaptureTerminals,
        SimCall::NodeDependencies,
    ];

    /// The CUDA driver function the call stands for.
    pub fn driver_name(self) -> &'static str {
        match self {
            SimCall::Allocate => "cuMemAlloc",
            SimCall::Release => "cuMemFree",
            SimCall::RecordEvent => "cuEventRecord",
            SimCall::EventDone => "cuEventQuery",
            SimCall::WaitEvent => "cuEventSynchronize",
            SimCall::StreamWaitEvent => "cuStreamWaitEvent",
            SimCall::Reserve => "cuMemAddressReserve",
            SimCall::FreeReservation => "cuMemAddressFree",
            SimCall::CreateHandle => "cuMemCreate",
            SimCall::ReleaseHandle => "cuMemRelease",
            SimCall::Map => "cuMemMap",
            SimCall::Unmap => "cuMemUnmap",
            SimCall::Synchronize => "cuCtxSynchronize",
            SimCall::CaptureTerminals => "cuStreamGetCaptureInfo",
            SimCall::NodeDependencies => "cuGraphNodeGetDependencies",
        }
    }
}

/// Injected failures: per [`SimCall`], calls so far and the call to fail.
#[derive(Clone, Debug, Default)]
pub(super) struct Faults {
    pub(super) calls: [u64; 15],
    pub(super) fail_at: [Option<u64>; 15],
    /// Calls after the first that fail too (`fail_calls`).
    pub(super) more: [u64; 15],
}

impl SimBackend {
    /// Makes the `n`th `allocate` call from now (1-based) fail with out-of-memory.
    pub fn fail_allocate_at(&mut self, n: u64) {
        self.fail_allocate_at = Some(self.allocate_calls + n);
    }

    /// Makes the `n`th handle creation from now (1-based) fail with out-of-memory.
    pub fn fail_map_at(&mut self, n: u64) {
        self.fail_map_at = Some(self.map_calls + n);
    }

    /// Makes the `n`th `record_event` call from now (1-based) fail with a driver error.
    pub fn fail_event_at(&mut self, n: u64) {
        self.fail_event_at = Some(self.counters.record_event + n);
    }

    /// Makes every later event record on `stream` fail, as the driver's
    /// does for a stream of another device's context or a destroyed one.
    pub fn refuse_events_on(&mut self, stream: StreamId) {
        self.refused_streams.push(stream);
    }

    /// Takes events on `stream` again, as a new stream that got a
    /// destroyed one's handle does.
    pub fn accept_events_on(&mut self, stream: StreamId) {
        self.refused_streams.retain(|&s| s != stream);
    }

    /// Makes the `n`-th call of `call` from now (1 = the next) fail with a
    /// driver error (`CUDA_ERROR_UNKNOWN`), before it changes anything:
    /// fault injection for every kind of driver call.
    pub fn fail_call(&mut self, call: SimCall, n: u64) {
        self.fail_calls(call, n, 1);
    }

    /// Makes `times` calls of `call` in a row fail, from the `n`-th from now.
    pub fn fail_calls(&mut self, call: SimCall, n: u64, times: u64) {
        let i = call as usize;
        self.faults.fail_at[i] = Some(self.faults.calls[i] + n);
        self.faults.more[i] = times.saturating_sub(1);
    }

    /// Calls of `call` so far (failed ones included).
    pub fn calls(&self, call: SimCall) -> u64 {
        self.faults.calls[call as usize]
    }

    /// Counts a call of `call`; the injected error when it is the one to fail.
    pub(super) fn fault(&mut self, call: SimCall) -> Result<(), BackendError> {
        let i = call as usize;
        self.faults.calls[i] += 1;
        if self.faults.fail_at[i] == Some(self.faults.calls[i]) {
            self.faults.fail_at[i] = None;
            if self.faults.more[i] > 0 {
                self.faults.more[i] -= 1;
                self.faults.fail_at[i] = Some(self.faults.calls[i] + 1);
            }
            return Err(BackendError::Driver {
                call: call.driver_name(),
                code: 999,
                name: "CUDA_ERROR_UNKNOWN".into(),
            });
        }
        Ok(())
    }
}
