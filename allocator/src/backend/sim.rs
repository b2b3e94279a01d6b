//! A simulated device: a capacity, an address space with realistic reuse,
//! virtual-memory ranges mapped in pages, events completed by hand, fault
//! injection and call counters.
//!
//! Stream progress is manual. Every stream has a count of work items
//! *submitted* ([`SimBackend::launch`] and every recorded event add one) and
//! of items *completed* ([`SimBackend::complete`]). An event is done once its
//! stream has completed past it. `stream_wait_event` records that a stream's
//! later work is ordered after another stream's work, which is what
//! [`SimBackend::is_ordered_after`] answers; tests use it to prove that no
//! block reached a second stream before the first one was done with it.
//!
//! Waiting for an event completes its stream up to it, as a real wait
//! observes. A replay wants less ([`SimBackend::set_waits_complete_one`]):
//! there a wait completes only the event waited for, so that what the
//! allocator waits for (a fence the recording had already seen done) does
//! not complete other events early, such as a block's pending free, which
//! the replay completes where the recording says (`replay.rs`).
//!
//! The simulator panics on any contract violation: releasing an unknown
//! pointer or with the wrong size, using a destroyed event, unmapping what is
//! not mapped or part of a mapping, releasing a mapped handle, or (while [`SimBackend::set_capturing`] is on) any call that a
//! CUDA graph capture forbids or that the allocator holds back during one
//! (unmapping and releasing handles, which the driver allows:
//! `benches/gpu/capture_probe.cu`).

use std::collections::BTreeMap;

use rustc_hash::{FxHashMap, FxHashSet};

use super::{
    Backend, BackendError, CaptureNodes, DevicePtr, EventId, GraphNode, HandleId, MemInfo, StreamId,
};
use crate::cost::{DriverCall, DriverCalls};

mod faults;
mod graph;
mod later;
mod streams;

use faults::Faults;
pub use faults::SimCall;
use streams::SimStream;

/// Where simulated allocations start (looks like a CUDA address, never 0).
const BASE: u64 = 0x7f00_0000_0000;
/// Where simulated virtual reservations start, far from allocations.
const VMM_BASE: u64 = 0x9f00_0000_0000;

/// How many times each backend entry point was called.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimCounters {
    /// Successful `allocate` calls.
    pub allocate: u64,
    /// `allocate` calls that failed (capacity or injected fault).
    pub allocate_failed: u64,
    /// `allocate` calls made with `capturing = true`.
    pub allocate_capturing: u64,
    /// Calls of another allocator serving a pool made with `capturing = true`
    /// (`call_other_allocator`).
    pub other_allocator_capturing: u64,
    /// `release` calls.
    pub release: u64,
    /// Physical handles created.
    pub create: u64,
    /// Physical handles released.
    pub release_handle: u64,
    /// Handles mapped.
    pub map: u64,
    /// Unmap calls (each over a run of whole mappings).
    pub unmap: u64,
    /// Events recorded.
    pub record_event: u64,
    /// Non-blocking event queries.
    pub event_query: u64,
    /// Blocking event waits.
    pub wait_event: u64,
    /// Stream-wait-event calls.
    pub stream_wait_event: u64,
    /// Events destroyed.
    pub destroy_event: u64,
}

struct Reservation {
    size: u64,
    /// Mappings by offset within the reservation: `(handle, bytes)`.
    mapped: BTreeMap<u64, (HandleId, u64)>,
}

/// The first pretend descriptor [`SimBackend`] exports (`SIM_FD_BASE + handle`).
pub const SIM_FD_BASE: u64 = 1 << 20;

/// The simulated device. See the module docs.
pub struct SimBackend {
    /// With [`set_waits_complete_one`](Self::set_waits_complete_one): the
    /// events waited for (each done, whatever its stream).
    waited: Option<FxHashSet<EventId>>,
    capacity: u64,
    alignment: u64,
    page: u64,
    used: u64,
    next_addr: u64,
    /// Released address ranges, by start: reused first-fit like a driver would.
    holes: BTreeMap<u64, u64>,
    live: BTreeMap<DevicePtr, u64>,
    next_va: u64,
    reservations: BTreeMap<DevicePtr, Reservation>,
    /// Device-to-device copies made.
    copies: u64,
    /// Physical handles: bytes, and at how many addresses they are mapped.
    handles: FxHashMap<HandleId, (u64, u32)>,
    next_handle: HandleId,
    /// Unmapped ranges, logged while `log_unmaps` is on (tests check them).
    unmap_log: Option<Vec<(DevicePtr, u64)>>,
    driver: DriverCalls,
    /// The virtual clock [`Backend::now_ns`] reads (see [`SimBackend::set_clock`]).
    clock_ns: u64,
    /// Whether [`Backend::now_ns`] reads the process clock instead.
    wall_clock: bool,
    streams: FxHashMap<StreamId, SimStream>,
    events: FxHashMap<EventId, (StreamId, u64)>,
    next_event: EventId,
    fail_allocate_at: Option<u64>,
    fail_map_at: Option<u64>,
    fail_event_at: Option<u64>,
    /// Streams on which every event record fails (a stream of another
    /// device's context, or one destroyed).
    refused_streams: Vec<StreamId>,
    faults: Faults,
    allocate_calls: u64,
    map_calls: u64,
    capturing: bool,
    /// Streams capturing a graph that no hook announced, with the id of
    /// their capture ([`begin_stream_capture`](Self::begin_stream_capture)).
    stream_captures: FxHashMap<StreamId, u64>,
    next_capture: u64,
    /// The graphs of captures begun by [`begin_graph_capture`](Self::begin_graph_capture).
    graphs: FxHashMap<u64, graph::SimGraph>,
    /// The capture whose graph node queries read (the last asked about).
    walked_graph: u64,
    /// Call counters.
    pub counters: SimCounters,
    /// Devices granted access to this one's memory (`add_peer`), in order.
    pub peers: Vec<u32>,
    /// Streams given to `synchronize_stream`, in order.
    pub synchronized_streams: Vec<StreamId>,
    /// Work given to `unmap_later` and held back (`later.rs`).
    later: later::LaterWork,
}

impl SimBackend {
    /// A device of `capacity` bytes whose allocations are aligned to 512 B.
    pub fn new(capacity: u64) -> SimBackend {
        SimBackend::with_alignment(capacity, 512)
    }

    /// A device with a chosen allocation alignment (a power of two).
    pub fn with_alignment(capacity: u64, alignment: u64) -> SimBackend {
        assert!(
            alignment.is_power_of_two(),
            "alignment {alignment} is not a power of two"
        );
        SimBackend {
            capacity,
            alignment,
            page: 2 << 20,
            used: 0,
            next_addr: BASE,
            holes: BTreeMap::new(),
            live: BTreeMap::new(),
            next_va: VMM_BASE,
            reservations: BTreeMap::new(),
            copies: 0,
            handles: FxHashMap::default(),
            next_handle: 1,
            unmap_log: None,
            driver: DriverCalls::default(),
            clock_ns: 0,
            wall_clock: false,
            streams: FxHashMap::default(),
            events: FxHashMap::default(),
            next_event: 1,
            fail_allocate_at: None,
            fail_map_at: None,
            fail_event_at: None,
            refused_streams: Vec::new(),
            faults: Faults::default(),
            allocate_calls: 0,
            map_calls: 0,
            capturing: false,
            stream_captures: FxHashMap::default(),
            next_capture: 1,
            graphs: FxHashMap::default(),
            walked_graph: 0,
            counters: SimCounters::default(),
            peers: Vec::new(),
            synchronized_streams: Vec::new(),
            later: later::LaterWork::default(),
            waited: None,
        }
    }

    /// Moves this device's address ranges apart from other simulated
    /// devices' (256 GiB of allocations and 2 TiB of reservations per
    /// device, up to 64 devices), so that devices hand out distinct addresses.
    pub fn for_device(mut self, device: u32) -> SimBackend {
        let d = u64::from(device.min(63));
        self.next_addr = BASE + (d << 38);
        self.next_va = VMM_BASE + (d << 41);
        self
    }

    /// Device capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Sets the virtual clock (nanoseconds) that time budgets and trace
    /// stamps read; it never moves on its own. Replay sets it from the trace.
    pub fn set_clock(&mut self, ns: u64) {
        self.clock_ns = ns;
        self.wall_clock = false;
    }

    /// Makes the clock follow real time (the process clock, as on a GPU),
    /// for recordings whose timelines should mean something; the virtual
    /// clock stands still otherwise, which keeps tests of time budgets
    /// deterministic.
    pub fn with_wall_clock(mut self) -> SimBackend {
        self.wall_clock = true;
        self
    }

    /// Bytes currently allocated or mapped.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Number of live allocations.
    pub fn live_allocations(&self) -> usize {
        self.live.len()
    }

    fn take_address(&mut self, size: u64) -> u64 {
        let hole = self
            .holes
            .iter()
            .find(|&(_, &len)| len >= size)
            .map(|(&s, &l)| (s, l));
        match hole {
            Some((start, len)) => {
                self.holes.remove(&start);
                if len > size {
                    self.holes.insert(start + size, len - size);
                }
                start
            }
            None => {
                let p = self.next_addr;
                self.next_addr += size.div_ceil(self.alignment) * self.alignment;
                p
            }
        }
    }

    fn give_back_address(&mut self, ptr: u64, size: u64) {
        let mut start = ptr;
        let mut len = size.div_ceil(self.alignment) * self.alignment;
        if let Some((&s, &l)) = self.holes.range(..ptr).next_back()
            && s + l == ptr
        {
            self.holes.remove(&s);
            start = s;
            len += l;
        }
        let end = ptr + size.div_ceil(self.alignment) * self.alignment;
        if let Some(l) = self.holes.remove(&end) {
            len += l;
        }
        self.holes.insert(start, len);
    }

    fn reservation_of(&mut self, ptr: DevicePtr, size: u64) -> (&mut Reservation, u64) {
        let (&va, r) = self
            .reservations
            .range_mut(..=ptr)
            .next_back()
            .unwrap_or_else(|| panic!("SimBackend: {ptr:#x} is in no reservation"));
        assert!(
            ptr + size <= va + r.size,
            "SimBackend: range {ptr:#x}+{size} leaves its reservation"
        );
        (r, ptr - va)
    }

    /// Mappings currently in place, over all reservations.
    pub fn mappings(&self) -> usize {
        self.reservations.values().map(|r| r.mapped.len()).sum()
    }

    /// Every address range backed by memory: live allocations and mappings
    /// (one entry per mapped handle), sorted by address.
    pub fn backed_ranges(&self) -> Vec<(DevicePtr, u64)> {
        let mut v: Vec<(DevicePtr, u64)> = self.live.iter().map(|(&p, &s)| (p, s)).collect();
        for (&va, r) in &self.reservations {
            v.extend(
                r.mapped
                    .iter()
                    .map(|(&off, m)| (va + off, m.1))
                    .filter(|&(a, _)| !self.unmapping_later(a)),
            );
        }
        v.sort_unstable();
        v
    }

    /// The handles mapped over any part of `[ptr, ptr + size)`, in address
    /// order: `(address, handle, bytes)`.
    pub fn handles_over(&self, ptr: DevicePtr, size: u64) -> Vec<(DevicePtr, HandleId, u64)> {
        let mut v = Vec::new();
        for (&va, r) in &self.reservations {
            for (&off, &(h, bytes)) in &r.mapped {
                if va + off < ptr + size && va + off + bytes > ptr {
                    v.push((va + off, h, bytes));
                }
            }
        }
        v.sort_unstable();
        v
    }

    /// Device-to-device copies made ([`Backend::copy`]).
    pub fn copies(&self) -> u64 {
        self.copies
    }

    /// Physical handles alive (mapped or not).
    pub fn handles(&self) -> usize {
        self.handles.len()
    }

    /// Starts (or stops) logging every unmapped range, for
    /// [`take_unmaps`](Self::take_unmaps).
    pub fn log_unmaps(&mut self, on: bool) {
        self.unmap_log = on.then(Vec::new);
    }

    /// The ranges unmapped since the last call (while logging).
    pub fn take_unmaps(&mut self) -> Vec<(DevicePtr, u64)> {
        self.unmap_log
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Whether all work submitted on `stream` up to `seq` has completed.
    pub fn is_completed(&self, stream: StreamId, seq: u64) -> bool {
        self.streams.get(&stream).is_none_or(|s| s.completed >= seq)
    }

    /// The offsets of the mappings that make up `[ptr, ptr + size)`, which
    /// must be whole mappings one after another.
    fn whole_mappings(&mut self, ptr: DevicePtr, size: u64) -> Vec<u64> {
        let (r, off) = self.reservation_of(ptr, size);
        let mut at = off;
        let mut offsets = Vec::new();
        for (&o, m) in r.mapped.range(off..off + size) {
            assert_eq!(
                o, at,
                "SimBackend: unmap of {ptr:#x}+{size} has a hole at offset {at:#x}"
            );
            at += m.1;
            offsets.push(o);
        }
        assert_eq!(
            at,
            off + size,
            "SimBackend: unmap of {ptr:#x}+{size} does not end at a mapping's end"
        );
        offsets
    }

    /// The reservation at `va`, which must be `size` bytes.
    fn reservation_sized(&self, va: DevicePtr, size: u64) -> &Reservation {
        let r = self
            .reservations
            .get(&va)
            .unwrap_or_else(|| panic!("SimBackend: unknown reservation {va:#x}"));
        assert_eq!(
            r.size, size,
            "SimBackend: reservation {va:#x} freed with the wrong size"
        );
        r
    }

    /// Frees the reservation at `va` (checked, not counted).
    fn free_now(&mut self, va: DevicePtr, size: u64) {
        assert!(
            self.reservation_sized(va, size).mapped.is_empty(),
            "SimBackend: reservation {va:#x} freed with pages still mapped"
        );
        self.reservations.remove(&va);
    }

    /// Unmaps `[ptr, ptr + size)` (checked, not counted) and logs it.
    fn unmap_now(&mut self, ptr: DevicePtr, size: u64) {
        let offsets = self.whole_mappings(ptr, size);
        let (r, _) = self.reservation_of(ptr, size);
        let freed: Vec<HandleId> = offsets
            .into_iter()
            .map(|o| r.mapped.remove(&o).expect("listed").0)
            .collect();
        for h in freed {
            self.handles.get_mut(&h).expect("mapped handle").1 -= 1;
        }
        if let Some(log) = &mut self.unmap_log {
            log.push((ptr, size));
        }
    }
}

impl Backend for SimBackend {
    fn alignment(&self) -> u64 {
        self.alignment
    }

    fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
        Ok(MemInfo {
            free: self.capacity - self.used,
            total: self.capacity,
        })
    }

    fn call_other_allocator(
        &mut self,
        capturing: bool,
        call: &mut dyn FnMut(),
    ) -> Result<(), BackendError> {
        if !capturing {
            self.forbid_in_capture("another allocator's call without the capturing flag");
        }
        self.counters.other_allocator_capturing += u64::from(capturing);
        call();
        Ok(())
    }

    fn allocate(&mut self, size: u64, capturing: bool) -> Result<DevicePtr, BackendError> {
        self.fault(SimCall::Allocate)?;
        assert!(size > 0, "SimBackend: allocate of 0 bytes");
        if !capturing {
            self.forbid_in_capture("allocate without the capturing flag");
        }
        self.allocate_calls += 1;
        if self.fail_allocate_at == Some(self.allocate_calls) || size > self.capacity - self.used {
            self.counters.allocate_failed += 1;
            return Err(BackendError::OutOfMemory { requested: size });
        }
        let ptr = self.take_address(size);
        self.live.insert(ptr, size);
        self.used += size;
        self.counters.allocate += 1;
        self.counters.allocate_capturing += u64::from(capturing);
        self.driver.add(DriverCall::MemAlloc, 0, size, 0);
        Ok(ptr)
    }

    fn release(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.fault(SimCall::Release)?;
        self.forbid_in_capture("release");
        let got = self
            .live
            .remove(&ptr)
            .unwrap_or_else(|| panic!("SimBackend: release of unknown pointer {ptr:#x}"));
        assert_eq!(
            got, size,
            "SimBackend: {ptr:#x} allocated with {got} bytes, released with the wrong size {size}"
        );
        self.used -= size;
        self.give_back_address(ptr, size);
        self.counters.release += 1;
        self.driver.add(DriverCall::MemFree, 0, size, 0);
        Ok(())
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        self.fault(SimCall::RecordEvent)?;
        if self.refused_streams.contains(&stream) {
            return Err(BackendError::Driver {
                call: "cuEventRecord",
                code: 400,
                name: "CUDA_ERROR_INVALID_HANDLE".into(),
            });
        }
        if self.fail_event_at == Some(self.counters.record_event + 1) {
            self.fail_event_at = None;
            return Err(BackendError::Driver {
                call: "cuEventRecord",
                code: 400,
                name: "CUDA_ERROR_INVALID_HANDLE".into(),
            });
        }
        assert!(
            !self.stream_captures.contains_key(&stream),
            "SimBackend: event recorded on stream {stream:#x} while it captures a graph"
        );
        let seq = self.launch(stream);
        let id = self.next_event;
        self.next_event += 1;
        self.events.insert(id, (stream, seq));
        self.counters.record_event += 1;
        self.driver.add(DriverCall::EventRecord, 0, 0, 0);
        Ok(id)
    }

    fn event_done(&mut self, event: EventId) -> Result<bool, BackendError> {
        self.fault(SimCall::EventDone)?;
        self.forbid_in_capture("event query");
        let (stream, seq) = self.event(event);
        self.counters.event_query += 1;
        self.driver.add(DriverCall::EventQuery, 0, 0, 0);
        let s = &self.streams[&stream];
        Ok(match &self.waited {
            Some(waited) => s.settled >= seq || waited.contains(&event),
            None => s.completed >= seq,
        })
    }

    fn wait_event(&mut self, event: EventId) -> Result<(), BackendError> {
        self.fault(SimCall::WaitEvent)?;
        self.forbid_in_capture("event wait");
        self.complete_event(event);
        self.counters.wait_event += 1;
        self.driver.add(DriverCall::EventSync, 0, 0, 0);
        Ok(())
    }

    fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<(), BackendError> {
        self.fault(SimCall::StreamWaitEvent)?;
        let (from, seq) = self.event(event);
        let replaying = self.waited.is_some();
        let s = self.streams.entry(stream).or_default();
        if !replaying {
            // A replay's completions never follow waits (`complete_event`).
            s.wait_log.push((s.submitted, from, seq));
        }
        let w = s.waits.entry(from).or_insert(0);
        *w = (*w).max(seq);
        self.counters.stream_wait_event += 1;
        self.driver.add(DriverCall::StreamWait, 0, 0, 0);
        Ok(())
    }

    fn destroy_event(&mut self, event: EventId) {
        assert!(
            self.events.remove(&event).is_some(),
            "SimBackend: destroy of unknown event {event}"
        );
        if let Some(waited) = &mut self.waited {
            waited.remove(&event);
        }
        self.counters.destroy_event += 1;
    }

    fn vmm_granularity(&mut self) -> Option<u64> {
        Some(self.page)
    }

    fn reserve(&mut self, size: u64) -> Result<DevicePtr, BackendError> {
        self.fault(SimCall::Reserve)?;
        assert!(
            size > 0 && size.is_multiple_of(self.page),
            "SimBackend: reserve of {size} is not whole pages"
        );
        let va = self.next_va;
        self.next_va += size + self.page;
        self.reservations.insert(
            va,
            Reservation {
                size,
                mapped: BTreeMap::new(),
            },
        );
        self.driver.add(DriverCall::Reserve, 0, size, 0);
        Ok(va)
    }

    fn free_reservation(&mut self, va: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.fault(SimCall::FreeReservation)?;
        self.forbid_in_capture("free_reservation");
        self.wait_later(Some((va, va + size)))?;
        self.free_now(va, size);
        self.driver.add(DriverCall::AddressFree, 0, size, 0);
        Ok(())
    }

    fn free_reservation_later(&mut self, va: DevicePtr, size: u64) -> Result<(), BackendError> {
        if self.defers() {
            self.queue_free(va, size)?;
        } else {
            self.free_reservation(va, size)?;
        }
        self.later.given.add(DriverCall::AddressFree, 0, size, 0);
        Ok(())
    }

    fn create_handle(&mut self, size: u64, capturing: bool) -> Result<HandleId, BackendError> {
        self.fault(SimCall::CreateHandle)?;
        assert!(
            size > 0 && size.is_multiple_of(self.page),
            "SimBackend: handle of {size} bytes is not whole pages"
        );
        if !capturing {
            self.forbid_in_capture("create_handle without the capturing flag");
        }
        self.map_calls += 1;
        if self.fail_map_at == Some(self.map_calls) || size > self.capacity - self.used {
            return Err(BackendError::OutOfMemory { requested: size });
        }
        let h = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(h, (size, 0));
        self.used += size;
        self.counters.create += 1;
        self.driver.add(DriverCall::Create, 1, size, 0);
        Ok(h)
    }

    fn release_handle(&mut self, handle: HandleId, size: u64) -> Result<(), BackendError> {
        self.fault(SimCall::ReleaseHandle)?;
        self.forbid_in_capture("release_handle");
        // As the CUDA backend: a failure there fails no release, unless
        // this very handle is still mapped in a range that failed to unmap
        // (which the driver would release later; the simulator refuses).
        if let Err(e) = self.wait_later(None)
            && self.later_mappings_of(handle) > 0
        {
            return Err(e);
        }
        let (got, mapped) = self
            .handles
            .remove(&handle)
            .unwrap_or_else(|| panic!("SimBackend: release of unknown handle {handle}"));
        assert!(
            mapped == 0,
            "SimBackend: handle {handle} released while mapped"
        );
        assert_eq!(
            got, size,
            "SimBackend: handle {handle} released with the wrong size"
        );
        self.used -= size;
        self.counters.release_handle += 1;
        self.driver.add(DriverCall::Release, 1, size, 0);
        Ok(())
    }

    fn map_handles(
        &mut self,
        ptr: DevicePtr,
        handles: &[(HandleId, u64)],
        capturing: bool,
    ) -> Result<(), BackendError> {
        assert!(
            ptr.is_multiple_of(self.page),
            "SimBackend: map at a partial page"
        );
        self.fault(SimCall::Map)?;
        if !capturing {
            self.forbid_in_capture("map without the capturing flag");
        }
        let total: u64 = handles.iter().map(|h| h.1).sum();
        self.wait_later(Some((ptr, ptr + total)))?;
        let (r, mut off) = self.reservation_of(ptr, total);
        for &(h, size) in handles {
            assert!(
                r.mapped
                    .range(..off + size)
                    .next_back()
                    .is_none_or(|(&o, m)| o + m.1 <= off),
                "SimBackend: mapping at offset {off:#x} overlaps another"
            );
            r.mapped.insert(off, (h, size));
            off += size;
        }
        for &(h, size) in handles {
            let e = self
                .handles
                .get_mut(&h)
                .unwrap_or_else(|| panic!("SimBackend: map of unknown handle {h}"));
            assert_eq!(
                e.0, size,
                "SimBackend: handle {h} mapped with the wrong size"
            );
            e.1 += 1;
            self.counters.map += 1;
            self.driver.add(DriverCall::Map, 1, size, 0);
        }
        self.driver
            .add(DriverCall::SetAccess, handles.len() as u64, total, 0);
        Ok(())
    }

    fn unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        self.fault(SimCall::Unmap)?;
        self.forbid_in_capture("unmap");
        let (r, off) = self.reservation_of(ptr, size);
        let handles = r.mapped.range(off..off + size).count() as u64;
        self.unmap_now(ptr, size);
        self.counters.unmap += 1;
        self.driver.add(DriverCall::Unmap, handles, size, 0);
        Ok(())
    }

    fn unmap_later(&mut self, ptr: DevicePtr, size: u64) -> Result<(), BackendError> {
        let handles = self.handles_over(ptr, size).len() as u64;
        if self.defers() {
            self.queue_unmap(ptr, size)?;
        } else {
            self.unmap(ptr, size)?;
        }
        self.later.given.add(DriverCall::Unmap, handles, size, 0);
        Ok(())
    }

    fn add_peer(&mut self, peer: u32) -> Result<(), BackendError> {
        if !self.peers.contains(&peer) {
            self.peers.push(peer);
        }
        Ok(())
    }

    fn stream_capture(&mut self, stream: StreamId) -> Result<Option<u64>, BackendError> {
        Ok(self.stream_captures.get(&stream).copied())
    }

    fn capture_terminals(
        &mut self,
        stream: StreamId,
    ) -> Result<Option<CaptureNodes>, BackendError> {
        self.fault(SimCall::CaptureTerminals)?;
        Ok(self.graph_terminals(stream))
    }

    fn node_dependencies(&mut self, node: GraphNode) -> Result<Vec<GraphNode>, BackendError> {
        self.fault(SimCall::NodeDependencies)?;
        Ok(self.graph_node_deps(node))
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.fault(SimCall::Synchronize)?;
        self.forbid_in_capture("synchronize");
        self.complete_all();
        self.driver.add(DriverCall::CtxSync, 0, 0, 0);
        Ok(())
    }

    /// As the device's synchronization (one simulated device holds every
    /// stream), remembering the stream.
    fn synchronize_stream(&mut self, stream: StreamId) -> Result<(), BackendError> {
        self.synchronized_streams.push(stream);
        self.synchronize()
    }

    /// Checks that both ranges are backed; the simulator holds no data.
    fn copy(&mut self, dst: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), BackendError> {
        for (what, p) in [("destination", dst), ("source", src)] {
            // Ranges given up count as gone (`later.rs`).
            let covered: u64 = self
                .handles_over(p, bytes)
                .iter()
                .filter(|m| !self.unmapping_later(m.0))
                .map(|&(a, _, b)| (a + b).min(p + bytes) - a.max(p))
                .sum();
            assert_eq!(
                covered, bytes,
                "SimBackend: copy {what} {p:#x}+{bytes} is not all mapped"
            );
        }
        self.copies += 1;
        Ok(())
    }

    /// A pretend descriptor, `SIM_FD_BASE + handle`: it names no open file,
    /// so only the encoding of a share can be tested on the simulator.
    fn export_handle(&mut self, handle: HandleId) -> Result<i32, BackendError> {
        let (_, mapped) = self
            .handles
            .get(&handle)
            .unwrap_or_else(|| panic!("SimBackend: export of unknown handle {handle}"));
        // Mappings in ranges given up count as gone (`later.rs`).
        assert!(
            *mapped > self.later_mappings_of(handle),
            "SimBackend: export of unmapped handle {handle}"
        );
        i32::try_from(SIM_FD_BASE + handle).map_err(|_| BackendError::Driver {
            call: "export_handle",
            code: 0,
            name: format!("handle {handle} has no descriptor number"),
        })
    }

    /// The calls given to `unmap_later` and `free_reservation_later`: what
    /// the CUDA backend's helper thread would make (a call a range here).
    fn helper_calls(&self) -> DriverCalls {
        self.later.given
    }

    fn driver_calls(&self) -> DriverCalls {
        self.driver
    }

    fn now_ns(&mut self) -> u64 {
        if self.wall_clock {
            crate::clock::now_ns()
        } else {
            self.clock_ns
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fail_call` fails exactly the n-th later call of its kind, before
    /// it changes anything, and only once.
    #[test]
    fn injected_faults_fail_the_nth_call_once() {
        let mut s = SimBackend::new(100 << 20);
        s.fail_call(SimCall::RecordEvent, 2);
        s.fail_call(SimCall::Allocate, 1);
        assert!(s.allocate(4096, false).is_err());
        assert_eq!(s.used(), 0);
        s.allocate(4096, false).unwrap();
        s.record_event(1).unwrap();
        let e = s.record_event(1).unwrap_err();
        assert!(e.to_string().contains("cuEventRecord"), "{e}");
        s.record_event(1).unwrap();
        assert_eq!(s.calls(SimCall::RecordEvent), 3);
        assert_eq!(s.calls(SimCall::Allocate), 2);
    }

    /// A request near `u64::MAX` is out of memory, not an overflow.
    #[test]
    fn huge_requests_are_out_of_memory() {
        let mut s = SimBackend::new(100 << 20);
        s.allocate(4 << 20, false).unwrap();
        let huge = u64::MAX - (1 << 20);
        assert!(matches!(
            s.allocate(huge, false),
            Err(BackendError::OutOfMemory { .. })
        ));
        let huge_pages = u64::MAX / (2 << 20) * (2 << 20);
        assert!(s.create_handle(huge_pages, false).is_err());
    }

    #[test]
    fn reuses_released_ranges_first_fit() {
        let mut s = SimBackend::new(100 << 20);
        let a = s.allocate(4 << 20, false).unwrap();
        let b = s.allocate(4 << 20, false).unwrap();
        s.release(a, 4 << 20).unwrap();
        let c = s.allocate(2 << 20, false).unwrap();
        assert_eq!(c, a, "a hole is reused");
        assert!(b > a);
        assert_eq!(
            s.allocate(200 << 20, false),
            Err(BackendError::OutOfMemory {
                requested: 200 << 20
            })
        );
        s.fail_allocate_at(1);
        assert!(s.allocate(512, false).is_err());
        assert!(s.allocate(512, false).is_ok());
    }

    #[test]
    fn events_complete_by_hand() {
        let mut s = SimBackend::new(1 << 30);
        let e = s.record_event(7).unwrap();
        assert!(!s.event_done(e).unwrap());
        assert!(!s.is_ordered_after(8, 7, 1));
        s.stream_wait_event(8, e).unwrap();
        assert!(s.is_ordered_after(8, 7, 1));
        s.complete(7);
        assert!(s.event_done(e).unwrap());
        s.destroy_event(e);
        assert_eq!(s.live_events(), 0);
    }

    #[test]
    fn virtual_memory_handles() {
        let mut s = SimBackend::new(8 << 20);
        let va = s.reserve(64 << 20).unwrap();
        let a = s.create_handle(4 << 20, false).unwrap();
        let b = s.create_handle(2 << 20, false).unwrap();
        let c = s.create_handle(2 << 20, false).unwrap();
        assert!(
            s.create_handle(2 << 20, false).is_err(),
            "capacity is honoured"
        );
        s.map_handles(va, &[(a, 4 << 20), (b, 2 << 20)], false)
            .unwrap();
        s.map_handles(va + (6 << 20), &[(c, 2 << 20)], false)
            .unwrap();
        assert_eq!(s.mappings(), 3);
        s.log_unmaps(true);
        s.unmap(va, 8 << 20).unwrap();
        assert_eq!(s.take_unmaps(), vec![(va, 8 << 20)]);
        // Handles outlive their mappings and map again elsewhere.
        s.map_handles(va + (32 << 20), &[(c, 2 << 20)], false)
            .unwrap();
        s.unmap(va + (32 << 20), 2 << 20).unwrap();
        for (h, size) in [(a, 4 << 20), (b, 2 << 20), (c, 2 << 20)] {
            s.release_handle(h, size).unwrap();
        }
        s.free_reservation(va, 64 << 20).unwrap();
        assert_eq!(s.used(), 0);
        let d = s.driver_calls();
        assert_eq!(d.calls(DriverCall::Create), 3);
        assert_eq!(d.calls(DriverCall::Map), 4);
        assert_eq!(d.calls(DriverCall::SetAccess), 3);
        assert_eq!(d.calls(DriverCall::Unmap), 2);
    }

    #[test]
    #[should_panic(expected = "does not end at a mapping")]
    fn unmapping_part_of_a_handle_panics() {
        let mut s = SimBackend::new(8 << 20);
        let va = s.reserve(64 << 20).unwrap();
        let a = s.create_handle(4 << 20, false).unwrap();
        s.map_handles(va, &[(a, 4 << 20)], false).unwrap();
        let _ = s.unmap(va, 2 << 20);
    }

    #[test]
    #[should_panic(expected = "wrong")]
    fn wrong_size_release_panics() {
        let mut s = SimBackend::new(1 << 30);
        let a = s.allocate(1024, false).unwrap();
        let _ = s.release(a, 512);
    }

    #[test]
    #[should_panic(expected = "during CUDA graph capture")]
    fn capture_forbids_queries() {
        let mut s = SimBackend::new(1 << 30);
        let e = s.record_event(1).unwrap();
        s.set_capturing(true);
        let _ = s.event_done(e);
    }
}
