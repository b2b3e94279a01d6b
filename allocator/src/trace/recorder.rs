//! Recording: per-device buffers filled under the device lock.
//! (First cut: buffers only; the writer thread and file format follow.)

use crate::backend::{DevicePtr, StreamId};
use crate::trace::{Action, TraceEvent};

/// One device's trace buffer.
pub struct DeviceTrace {
    device: u32,
    start: std::time::Instant,
    /// Buffered events.
    pub events: Vec<TraceEvent>,
}

impl DeviceTrace {
    /// An in-memory buffer for `device`.
    pub fn in_memory(device: u32) -> DeviceTrace {
        DeviceTrace { device, start: std::time::Instant::now(), events: Vec::new() }
    }

    /// Appends one event.
    #[inline]
    pub fn record(&mut self, action: Action, stream: StreamId, addr: DevicePtr, size: u64, aux: u64) {
        self.events.push(TraceEvent {
            time_ns: self.start.elapsed().as_nanos() as u64,
            action,
            device: self.device,
            stream,
            addr,
            size,
            aux,
            thread: 0,
        });
    }
}

/// The process-wide recorder (first cut: hands out in-memory buffers).
pub struct Recorder {}

impl Recorder {
    /// The buffer a newly created device records into.
    pub fn device_trace(&self, device: u32) -> DeviceTrace {
        DeviceTrace::in_memory(device)
    }
}
