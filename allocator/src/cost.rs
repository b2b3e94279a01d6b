//! Driver calls by kind, and a cost model that predicts their time.
//!
//! Every backend counts the driver calls it makes ([`DriverCalls`]): the CUDA
//! backend also times them, the simulator cannot. [`CostModel`] turns counts
//! into predicted time, `per call + per handle + per GiB` for each kind,
//! calibrated from `benches/gpu/vmm_costs.sh` on an H200 (table in
//! `docs/driver-costs.md`). The handle term matters: `cuMemSetAccess` and
//! `cuMemUnmap` cost about the same *per handle* whether a range is covered
//! in one call or in one call per handle, so 1 GiB of 2 MiB handles takes
//! 21 ms to make accessible and one 1 GiB handle 0.09 ms.
//! Replay reports both, so a policy is tuned offline on recorded traces for
//! time as well as for memory, and the prediction is checked against the
//! time the CUDA backend measured when the trace was recorded.

use std::fmt;

/// One kind of driver call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum DriverCall {
    /// `cuMemAlloc` (plain segment).
    MemAlloc,
    /// `cuMemFree`.
    MemFree,
    /// `cuMemCreate` (physical handle).
    Create,
    /// `cuMemRelease`.
    Release,
    /// `cuMemMap`, one handle.
    Map,
    /// `cuMemSetAccess`, one range.
    SetAccess,
    /// `cuMemUnmap`, one range.
    Unmap,
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemAddressFree`.
    AddressFree,
    /// `cuEventRecord`.
    EventRecord,
    /// `cuEventQuery`.
    EventQuery,
    /// `cuEventSynchronize`: the host waits for a stream's work.
    EventSync,
    /// `cuStreamWaitEvent` (no host blocking).
    StreamWait,
    /// `cuCtxSynchronize`: the host waits for all of the device's work
    /// (only when a released graph pool's pages are unmapped).
    CtxSync,
}

impl DriverCall {
    /// Every kind, in index order.
    pub const ALL: [DriverCall; 14] = [
        DriverCall::MemAlloc,
        DriverCall::MemFree,
        DriverCall::Create,
        DriverCall::Release,
        DriverCall::Map,
        DriverCall::SetAccess,
        DriverCall::Unmap,
        DriverCall::Reserve,
        DriverCall::AddressFree,
        DriverCall::EventRecord,
        DriverCall::EventQuery,
        DriverCall::EventSync,
        DriverCall::StreamWait,
        DriverCall::CtxSync,
    ];

    /// The driver function's name.
    pub fn name(self) -> &'static str {
        match self {
            DriverCall::MemAlloc => "cuMemAlloc",
            DriverCall::MemFree => "cuMemFree",
            DriverCall::Create => "cuMemCreate",
            DriverCall::Release => "cuMemRelease",
            DriverCall::Map => "cuMemMap",
            DriverCall::SetAccess => "cuMemSetAccess",
            DriverCall::Unmap => "cuMemUnmap",
            DriverCall::Reserve => "cuMemAddressReserve",
            DriverCall::AddressFree => "cuMemAddressFree",
            DriverCall::EventRecord => "cuEventRecord",
            DriverCall::EventQuery => "cuEventQuery",
            DriverCall::EventSync => "cuEventSynchronize",
            DriverCall::StreamWait => "cuStreamWaitEvent",
            DriverCall::CtxSync => "cuCtxSynchronize",
        }
    }

    /// Whether this is a call of the driver's virtual memory management
    /// (reserve, create, map, set access, unmap, release, free an address
    /// range): those the CUDA backend makes one at a time across its
    /// threads (Note [One VMM call at a time] in `backend/unmapper.rs`).
    pub fn is_vmm(self) -> bool {
        matches!(
            self,
            DriverCall::Create
                | DriverCall::Release
                | DriverCall::Map
                | DriverCall::SetAccess
                | DriverCall::Unmap
                | DriverCall::Reserve
                | DriverCall::AddressFree
        )
    }
}

const KINDS: usize = DriverCall::ALL.len();

/// Driver calls made, by kind: how many, over how many physical handles
/// and bytes, and how long they took where measured (0 where not).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCalls {
    calls: [u64; KINDS],
    handles: [u64; KINDS],
    bytes: [u64; KINDS],
    nanos: [u64; KINDS],
}

impl DriverCalls {
    /// Counts one call over `handles` handles (0 for calls on no handle)
    /// and `bytes` that took `nanos` (0 when not measured).
    #[inline]
    pub fn add(&mut self, call: DriverCall, handles: u64, bytes: u64, nanos: u64) {
        let i = call as usize;
        self.calls[i] += 1;
        self.handles[i] += handles;
        self.bytes[i] += bytes;
        self.nanos[i] += nanos;
    }

    /// Adds `nanos` to one kind without counting a call: time the caller
    /// spent waiting for calls of that kind made on another thread (Note
    /// [Unmapping off the allocating thread] in `backend/unmapper.rs`).
    #[inline]
    pub fn add_time(&mut self, call: DriverCall, nanos: u64) {
        self.nanos[call as usize] += nanos;
    }

    /// Adds another count (another device's, say).
    pub fn merge(&mut self, other: &DriverCalls) {
        for i in 0..KINDS {
            self.calls[i] += other.calls[i];
            self.handles[i] += other.handles[i];
            self.bytes[i] += other.bytes[i];
            self.nanos[i] += other.nanos[i];
        }
    }

    /// Calls of one kind.
    pub fn calls(&self, call: DriverCall) -> u64 {
        self.calls[call as usize]
    }

    /// Handles covered by calls of one kind.
    pub fn handles(&self, call: DriverCall) -> u64 {
        self.handles[call as usize]
    }

    /// Bytes covered by calls of one kind.
    pub fn bytes(&self, call: DriverCall) -> u64 {
        self.bytes[call as usize]
    }

    /// Measured nanoseconds in calls of one kind.
    pub fn nanos(&self, call: DriverCall) -> u64 {
        self.nanos[call as usize]
    }

    /// All calls.
    pub fn total_calls(&self) -> u64 {
        self.calls.iter().sum()
    }

    /// All measured nanoseconds.
    pub fn total_nanos(&self) -> u64 {
        self.nanos.iter().sum()
    }

    /// Calls that obtain, map, unmap or return device memory: what
    /// PyTorch's `num_device_alloc` + `num_device_free` count, and more.
    pub fn memory_calls(&self) -> u64 {
        [
            DriverCall::MemAlloc,
            DriverCall::MemFree,
            DriverCall::Create,
            DriverCall::Release,
            DriverCall::Map,
            DriverCall::Unmap,
        ]
        .iter()
        .map(|&c| self.calls(c))
        .sum()
    }

    /// These calls less the event calls (`cuEventRecord`, `cuEventQuery`,
    /// `cuEventSynchronize`, `cuStreamWaitEvent`): whether a wait is needed
    /// depends on how far the GPU had come, which a replay cannot know.
    pub fn without_events(&self) -> DriverCalls {
        let mut d = *self;
        for c in [
            DriverCall::EventRecord,
            DriverCall::EventQuery,
            DriverCall::EventSync,
            DriverCall::StreamWait,
        ] {
            let i = c as usize;
            (d.calls[i], d.handles[i], d.bytes[i], d.nanos[i]) = (0, 0, 0, 0);
        }
        d
    }

    /// The calls made since `earlier` (a reading of the same counters).
    pub fn since(&self, earlier: &DriverCalls) -> DriverCalls {
        let mut d = *self;
        for i in 0..KINDS {
            d.calls[i] -= earlier.calls[i].min(d.calls[i]);
            d.handles[i] -= earlier.handles[i].min(d.handles[i]);
            d.bytes[i] -= earlier.bytes[i].min(d.bytes[i]);
            d.nanos[i] -= earlier.nanos[i].min(d.nanos[i]);
        }
        d
    }

    /// `(kind, calls, handles, bytes, nanos)` for every kind with at least one call.
    pub fn rows(&self) -> impl Iterator<Item = (DriverCall, u64, u64, u64, u64)> + '_ {
        DriverCall::ALL
            .into_iter()
            .map(|c| {
                let n = (self.handles(c), self.bytes(c), self.nanos(c));
                (c, self.calls(c), n.0, n.1, n.2)
            })
            .filter(|r| r.1 > 0)
    }
}

impl fmt::Display for DriverCalls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (c, n, ..) in self.rows() {
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{} {n}", c.name())?;
        }
        if first {
            f.write_str("none")?;
        }
        Ok(())
    }
}

/// Predicted cost of one kind of call:
/// `per_call_us + per_handle_us * handles + per_gib_us * GiB`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CallCost {
    /// Microseconds per call.
    pub per_call_us: f64,
    /// Microseconds per physical handle the call covers.
    pub per_handle_us: f64,
    /// Microseconds per GiB the call covers.
    pub per_gib_us: f64,
}

const fn cost(per_call_us: f64, per_handle_us: f64, per_gib_us: f64) -> CallCost {
    CallCost {
        per_call_us,
        per_handle_us,
        per_gib_us,
    }
}

/// Predicted driver time per call kind. See the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    costs: [CallCost; KINDS],
    /// Where the figures come from.
    pub source: &'static str,
}

impl CostModel {
    /// Calibrated on one H200 (CUDA 13 driver API), from the p50 times of
    /// `benches/gpu/vmm_costs.sh` with the GPU idle; `docs/driver-costs.md`
    /// has the measured table. The same calls took 3 to 4 times longer
    /// while kernels ran, so this is a lower bound. A host wait
    /// (`cuEventSynchronize`) is costed as on an idle device: what it
    /// blocks for depends on the work queued, which no trace records.
    pub fn h200() -> CostModel {
        let mut costs = [cost(0.0, 0.0, 0.0); KINDS];
        for (c, v) in [
            (DriverCall::MemAlloc, cost(50.0, 0.0, 150.0)),
            (DriverCall::MemFree, cost(40.0, 0.0, 550.0)),
            (DriverCall::Create, cost(0.0, 11.0, 48.0)),
            (DriverCall::Release, cost(0.0, 13.0, 540.0)),
            (DriverCall::Map, cost(0.0, 1.0, 1.5)),
            (DriverCall::SetAccess, cost(0.0, 38.0, 55.0)),
            (DriverCall::Unmap, cost(0.0, 25.0, 17.0)),
            (DriverCall::Reserve, cost(3.0, 0.0, 0.0)),
            (DriverCall::AddressFree, cost(3.5, 0.0, 0.0)),
            (DriverCall::EventRecord, cost(0.5, 0.0, 0.0)),
            (DriverCall::EventQuery, cost(1.7, 0.0, 0.0)),
            (DriverCall::EventSync, cost(2.1, 0.0, 0.0)),
            (DriverCall::StreamWait, cost(1.0, 0.0, 0.0)),
            (DriverCall::CtxSync, cost(1.7, 0.0, 0.0)),
        ] {
            costs[c as usize] = v;
        }
        CostModel {
            costs,
            source: "H200, docs/driver-costs.md",
        }
    }

    /// The cost of one kind.
    pub fn cost(&self, call: DriverCall) -> CallCost {
        self.costs[call as usize]
    }

    /// Predicted microseconds for the calls of one kind.
    pub fn predict_kind(&self, calls: &DriverCalls, call: DriverCall) -> f64 {
        let c = self.cost(call);
        c.per_call_us * calls.calls(call) as f64
            + c.per_handle_us * calls.handles(call) as f64
            + c.per_gib_us * calls.bytes(call) as f64 / (1u64 << 30) as f64
    }

    /// Predicted milliseconds for all calls.
    pub fn predict_ms(&self, calls: &DriverCalls) -> f64 {
        DriverCall::ALL
            .into_iter()
            .map(|c| self.predict_kind(calls, c))
            .sum::<f64>()
            / 1000.0
    }
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel::h200()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defragmentation budget is charged without the calls whose need
    /// depends on the GPU's progress: a stream wait is made only when a
    /// fence is not yet known done, which a replay never knows (round 70:
    /// counted, it made a recorded trace's replay decide differently).
    #[test]
    fn without_events_leaves_only_the_memory_calls() {
        let mut d = DriverCalls::default();
        d.add(DriverCall::Map, 2, 4 << 20, 0);
        for c in [
            DriverCall::EventRecord,
            DriverCall::EventQuery,
            DriverCall::EventSync,
            DriverCall::StreamWait,
        ] {
            d.add(c, 0, 0, 0);
        }
        let kept: Vec<DriverCall> = d.without_events().rows().map(|r| r.0).collect();
        assert_eq!(kept, [DriverCall::Map]);
    }

    #[test]
    fn vmm_calls_are_the_cumem_calls_of_virtual_memory() {
        let vmm: Vec<&str> = DriverCall::ALL
            .iter()
            .filter(|c| c.is_vmm())
            .map(|c| c.name())
            .collect();
        assert_eq!(
            vmm,
            [
                "cuMemCreate",
                "cuMemRelease",
                "cuMemMap",
                "cuMemSetAccess",
                "cuMemUnmap",
                "cuMemAddressReserve",
                "cuMemAddressFree"
            ]
        );
    }

    #[test]
    fn counts_and_predicts() {
        let mut d = DriverCalls::default();
        assert_eq!(d.to_string(), "none");
        d.add(DriverCall::Create, 1, 1 << 30, 0);
        d.add(DriverCall::Map, 1, 2 << 20, 0);
        d.add(DriverCall::Map, 1, 2 << 20, 0);
        assert_eq!(d.calls(DriverCall::Map), 2);
        assert_eq!(d.total_calls(), 3);
        assert_eq!(d.memory_calls(), 3);
        assert_eq!(d.to_string(), "cuMemCreate 1, cuMemMap 2");
        let m = CostModel::h200();
        let create = m.cost(DriverCall::Create);
        let map = m.cost(DriverCall::Map);
        let want = create.per_handle_us
            + create.per_gib_us
            + 2.0 * (map.per_handle_us + map.per_gib_us / 512.0);
        assert!((m.predict_ms(&d) * 1000.0 - want).abs() < 1e-6);
        let mut later = d;
        later.add(DriverCall::Unmap, 2, 4 << 20, 7);
        let delta = later.since(&d);
        assert_eq!(delta.total_calls(), 1);
        assert_eq!(delta.nanos(DriverCall::Unmap), 7);
    }
}
