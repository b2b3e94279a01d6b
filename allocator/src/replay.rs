//! What-if replay: a recorded allocation sequence through this allocator's
//! policy on a simulated device of any capacity and configuration.
//!
//! # The key decision: mirror the recording's stream progress, not its layout
//!
//! Only the caller's actions are replayed: `alloc` (with the requested
//! size), `free_requested`, `record_stream`, `empty_cache`, calls on
//! private (CUDA graph) pools, caps set on reserved memory, each
//! allocation going to the pool that served it in the recording
//! (`replay_pools.rs`), and requests that failed (`oom`: tried again, and
//! given back at once if they fit now). Segments, splits and reuse are
//! decided afresh by the replayed policy. Each recorded address is
//! mapped to the address the replay handed out; frees go through that map, and
//! frees of addresses the trace never allocated (a trace started mid-run, or
//! an allocation that failed in the replay) are skipped and counted.
//!
//! Blocks used on other streams stay pending until their events complete; the
//! recording's `free_completed` of such a block says when the device got
//! there. The replay then completes exactly that block's events on the
//! simulator and polls, as the recorded allocator did at the start of its next
//! call, so reuse happens at the same point. When the recorded completions
//! came from the allocator's own out-of-memory path or `empty_cache` (a
//! `segment_free`, `segment_unmap`, `oom` or `empty_cache` follows them in the
//! same call), the
//! replay leaves them to its own identical path instead. A trace recorded by
//! gpualloc on the simulator therefore reproduces its peak reserved exactly
//! under the same configuration and capacity. For that the simulator's
//! waits complete only the event waited for
//! ([`SimBackend::set_waits_complete_one`]): a replay may wait for a fence
//! the recording had already seen done, and a wait that completed its
//! stream up to it also completed pending frees recorded before it, which
//! then became reusable earlier than in the recording (7 of 480 recordings
//! with defragmentation replayed to another peak before this).
//!
//! Caps on reserved memory set while the program ran
//! (`set_per_process_memory_fraction`, a byte limit) are in the trace
//! (`memory_limit` records, format minor 3), and the replay sets each at
//! the same point, so decisions that read the limit (out-of-memory
//! retries, stitches built because growing would pass it, Note [Stitch
//! budget]) are made as in the recording. A fraction is taken of the
//! replay's capacity. A cap the program never set stays as `--config` says,
//! which is how to ask what a cap would have done. Traces of older builds
//! hold no such records: replay them with the cap in `--config`.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::backend::{DevicePtr, SimBackend, StreamId};
use crate::config::Config;
use crate::cost::{CostModel, DriverCalls};
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::held::Held;
use crate::replay_pools::PoolRouting;
use crate::trace::{Action, EventKind, MemoryCap, PoolOp, TraceEvent};

/// The first allocation that failed in a replay.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayOom {
    /// Device.
    pub device: u32,
    /// Index of the failing `alloc` event in the trace (0-based, over all devices).
    pub event_index: u64,
    /// Its time, nanoseconds since the trace start.
    pub time_ns: u64,
    /// Bytes requested.
    pub requested: u64,
    /// Allocated bytes at the failure.
    pub allocated: u64,
    /// Reserved bytes at the failure.
    pub reserved: u64,
    /// Largest cached free block at the failure.
    pub largest_free_block: u64,
    /// String id of the innermost open phase, if any.
    pub phase: Option<u64>,
    /// The allocator's error message.
    pub message: String,
}

/// The first allocation the recording served after which the replay had
/// obtained other device memory than the recording, as the two traces
/// count it (bytes of `segment_map` and `segment_alloc` records:
/// expandable segments and stitches built, plain segments; a stitch's
/// repairs make none), or which the replay failed. None under the
/// recorded configuration is a necessary sign that the replay made the
/// recording's choices, not proof: placement, streams, releases and
/// repairs are not compared. Under another configuration it says where
/// that one first obtains otherwise. A trace started mid-run, or one
/// whose recorder dropped events, departs where it lacks what happened
/// before or in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Departure {
    /// Index of the `alloc` event in the trace (0-based, over all devices).
    pub event_index: u64,
    /// Its time, nanoseconds since the trace start.
    pub time_ns: u64,
    /// Bytes the replay had obtained by then.
    pub replayed: u64,
    /// Bytes the recording had obtained by then.
    pub recorded: u64,
}

/// Figures of one device's replay.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceReplay {
    /// Device index.
    pub device: u32,
    /// Highest reserved bytes.
    pub peak_reserved: u64,
    /// Highest allocated bytes.
    pub peak_allocated: u64,
    /// Highest active bytes (allocated plus pending frees).
    pub peak_active: u64,
    /// Allocated bytes when reserved peaked.
    pub allocated_at_peak_reserved: u64,
    /// `1 - largest free block / cached free bytes` when reserved peaked.
    pub external_fragmentation_at_peak: f64,
    /// What reserved memory was made of when it peaked (Note [Held memory
    /// by unit] in `held.rs`).
    pub held_at_peak_reserved: Held,
    /// `1 - allocated / reserved` when reserved peaked.
    pub unallocated_fraction_at_peak: f64,
    /// Mean of `1 - allocated / reserved` after each allocation.
    pub mean_unallocated_fraction: f64,
    /// Reserved bytes at the end.
    pub final_reserved: u64,
    /// Allocated bytes at the end.
    pub final_allocated: u64,
    /// Allocations replayed successfully.
    pub allocs: u64,
    /// Allocations that failed.
    pub ooms: u64,
    /// Segments obtained from the simulated device.
    pub device_allocs: u64,
    /// Segments released to it.
    pub device_frees: u64,
    /// Allocations that needed the release-and-retry path.
    pub alloc_retries: u64,
    /// Driver calls the simulated device received, by kind.
    pub driver: DriverCalls,
    /// Of those, the ones the CUDA backend would leave to its unmapping
    /// thread (Note [Unmapping off the allocating thread]).
    pub helper: DriverCalls,
    /// Predicted milliseconds of the memory calls of the requests that
    /// defragmented or stitched: their moves and stitches, and the mapping
    /// of their whole window, pages that growth would have mapped too
    /// included (what Note [Defragmentation budget] charges, at the H200's
    /// price; the unmapping among them is the helper thread's too). Not the
    /// stitches torn down by `empty_cache` or the out-of-memory path.
    pub defragment_ms: f64,
    /// The device's memory that a fraction the program set while it ran
    /// was taken of in the recording (the first `memory_limit` record of a
    /// fraction below 1 that carries it): a replay on another capacity caps
    /// at other bytes.
    pub recorded_device_total: Option<u64>,
    /// The first failed allocation.
    pub first_oom: Option<ReplayOom>,
    /// Where the replay first obtained other memory than the recording.
    pub departure: Option<Departure>,
    /// The driver calls made from the device's split time on, where
    /// [`replay_split`] was given one (the steps after warm-up): `driver`
    /// less what the events before it made.
    pub driver_from_split: Option<DriverCalls>,
}

/// What a replay measured: per device, and totals over devices.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplayResult {
    /// Capacity of each simulated device.
    pub capacity: u64,
    /// Events read.
    pub events: u64,
    /// Sum over devices of each device's peak reserved.
    pub peak_reserved: u64,
    /// Sum over devices of each device's peak allocated.
    pub peak_allocated: u64,
    /// Failed allocations, all devices.
    pub ooms: u64,
    /// The earliest failed allocation over all devices.
    pub first_oom: Option<ReplayOom>,
    /// The earliest departure from the recording over all devices.
    pub departure: Option<Departure>,
    /// Frees (and `record_stream`s) of addresses the trace never allocated:
    /// the trace started after they were allocated.
    pub unknown_frees: u64,
    /// Frees of allocations that had failed in the replay.
    pub frees_of_failed: u64,
    /// Driver calls over all devices, by kind.
    pub driver: DriverCalls,
    /// Of those, the ones the CUDA backend would leave to its unmapping
    /// thread, over all devices.
    pub helper: DriverCalls,
    /// Predicted milliseconds of defragmenting and stitching, all devices
    /// ([`DeviceReplay::defragment_ms`]).
    pub defragment_ms: f64,
    /// Per-device figures, by device index.
    pub devices: Vec<DeviceReplay>,
}

impl ReplayResult {
    /// Driver time the calls would take on a GPU, in milliseconds.
    pub fn driver_ms(&self, model: &CostModel) -> f64 {
        model.predict_ms(&self.driver)
    }

    /// Of that, the time of the calls the unmapping thread would make.
    pub fn helper_ms(&self, model: &CostModel) -> f64 {
        model.predict_ms(&self.helper)
    }

    /// Requests retried after the out-of-memory path freed the cache, over
    /// every device (PyTorch's `num_alloc_retries`).
    pub fn alloc_retries(&self) -> u64 {
        self.devices.iter().map(|d| d.alloc_retries).sum()
    }
}

struct Live {
    ptr: Option<DevicePtr>,
    used_on_other_streams: bool,
}

struct DeviceRun {
    dev: DeviceAllocator<SimBackend>,
    out: DeviceReplay,
    /// Recorded address → replayed allocation (`None`: failed in the replay).
    live: FxHashMap<DevicePtr, Live>,
    /// Recorded address → replayed address of blocks freed with stream uses.
    pending: FxHashMap<DevicePtr, DevicePtr>,
    /// Internal events of one recorded call, held back to see how it ends.
    window: Vec<(u64, TraceEvent)>,
    phases: Vec<u64>,
    unalloc_sum: f64,
    /// Which private pool each allocation goes to (`replay_pools.rs`).
    pools: PoolRouting,
    /// The driver calls when the split time passed ([`replay_split`]).
    at_split: Option<DriverCalls>,
    /// Device memory the recording had obtained so far ([`Departure`]).
    recorded_obtained: u64,
}

/// Replays `events` on simulated devices of `capacity` bytes with `config`.
///
/// A capacity above [`crate::config::MAX_BYTES`] (1 PiB, more than any
/// device has and more than any trace can allocate) is replayed as 1 PiB,
/// which keeps the simulator's address arithmetic in range; `capacity` in
/// the result says which was used.
pub fn replay(
    events: impl Iterator<Item = TraceEvent>,
    capacity: u64,
    config: &Config,
) -> ReplayResult {
    replay_split(events, capacity, config, &BTreeMap::new())
}

/// [`replay`], also counting the driver calls each device in `split` makes
/// from its time there on (ns since the trace began, as events carry it),
/// in [`DeviceReplay::driver_from_split`]: what the steps after warm-up
/// cost, for the `replay` command. A device whose events end before its
/// time made none then.
pub fn replay_split(
    events: impl Iterator<Item = TraceEvent>,
    capacity: u64,
    config: &Config,
    split: &BTreeMap<u32, u64>,
) -> ReplayResult {
    replay_with(events, capacity, config, false, split, &mut |_, _| {})
}

/// [`replay`], calling `observe` with the event index and the device after
/// every event the replay applies (layout probes look at the heap there).
#[cfg(test)]
pub(crate) fn replay_observed(
    events: impl Iterator<Item = TraceEvent>,
    capacity: u64,
    config: &Config,
    observe: &mut dyn FnMut(u64, &DeviceAllocator<SimBackend>),
) -> ReplayResult {
    replay_with(events, capacity, config, false, &BTreeMap::new(), observe)
}

/// [`replay`] with the simulator holding back the unmapping given to the
/// helper thread as the CUDA backend does (Note [Unmapping off the
/// allocating thread]): tests check that every decision is the same.
#[cfg(test)]
pub(crate) fn replay_deferring(
    events: impl Iterator<Item = TraceEvent>,
    capacity: u64,
    config: &Config,
) -> ReplayResult {
    replay_with(
        events,
        capacity,
        config,
        true,
        &BTreeMap::new(),
        &mut |_, _| {},
    )
}

fn replay_with(
    events: impl Iterator<Item = TraceEvent>,
    capacity: u64,
    config: &Config,
    defer: bool,
    split: &BTreeMap<u32, u64>,
    observe: &mut dyn FnMut(u64, &DeviceAllocator<SimBackend>),
) -> ReplayResult {
    let capacity = capacity.min(crate::config::MAX_BYTES);
    let mut runs: BTreeMap<u32, DeviceRun> = BTreeMap::new();
    let mut r = ReplayResult {
        capacity,
        ..ReplayResult::default()
    };
    for (i, e) in events.enumerate() {
        r.events += 1;
        let run = runs.entry(e.device).or_insert_with(|| {
            let mut run = DeviceRun::new(e.device, capacity, config);
            run.dev.backend.defer_later_work(defer);
            run.dev.backend.set_waits_complete_one(true);
            run
        });
        if run.at_split.is_none() && split.get(&e.device).is_some_and(|&t| e.time_ns >= t) {
            run.at_split = Some(run.dev.driver_calls());
        }
        run.event(i as u64, e, &mut r);
        observe(i as u64, &run.dev);
    }
    for (_, mut run) in runs {
        run.close_window(&mut r);
        // Old mappings of pages that moved without waiting leave once their
        // work is done (Note [Unmapping behind the work]); a replay has no
        // clock for the GPU and takes it to be done by the end.
        run.dev.backend.complete_all();
        let _ = run.dev.retire_drains();
        let s = run.dev.stats().clone();
        let o = &mut run.out;
        o.final_reserved = s.reserved_bytes.all.current as u64;
        o.final_allocated = s.allocated_bytes.all.current as u64;
        o.peak_reserved = o.peak_reserved.max(s.reserved_bytes.all.peak as u64);
        o.peak_allocated = s.allocated_bytes.all.peak as u64;
        o.peak_active = s.active_bytes.all.peak as u64;
        o.device_allocs = s.num_device_alloc as u64;
        o.device_frees = s.num_device_free as u64;
        o.alloc_retries = s.num_alloc_retries as u64;
        o.driver = run.dev.driver_calls();
        r.driver.merge(&o.driver);
        if split.contains_key(&o.device) {
            o.driver_from_split = Some(o.driver.since(run.at_split.as_ref().unwrap_or(&o.driver)));
        }
        o.helper = run.dev.helper_driver_calls();
        r.helper.merge(&o.helper);
        o.defragment_ms = run.dev.defrag_budget.charged_ns() / 1e6;
        r.defragment_ms += o.defragment_ms;
        o.mean_unallocated_fraction = if o.allocs == 0 {
            0.0
        } else {
            run.unalloc_sum / o.allocs as f64
        };
        r.peak_reserved += o.peak_reserved;
        r.peak_allocated += o.peak_allocated;
        r.ooms += o.ooms;
        if let Some(f) = &o.first_oom
            && r.first_oom
                .as_ref()
                .is_none_or(|g| f.event_index < g.event_index)
        {
            r.first_oom = Some(f.clone());
        }
        if let Some(f) = o.departure
            && r.departure.is_none_or(|g| f.event_index < g.event_index)
        {
            r.departure = Some(f);
        }
        r.devices.push(run.out);
    }
    r
}

/// Whether an action is a call made by the allocator's user (it starts a new recorded call).
fn is_call(a: Action) -> bool {
    matches!(
        a,
        Action::Alloc
            | Action::FreeRequested
            | Action::RecordStream
            | Action::EmptyCache
            | Action::PhasePush
            | Action::PhasePop
            | Action::Mark
            | Action::PrivatePool
            | Action::MemoryLimit
    )
}

impl DeviceRun {
    fn new(device: u32, capacity: u64, config: &Config) -> DeviceRun {
        DeviceRun {
            dev: DeviceAllocator::new(device, SimBackend::new(capacity), config.clone()),
            out: DeviceReplay {
                device,
                ..DeviceReplay::default()
            },
            live: FxHashMap::default(),
            pending: FxHashMap::default(),
            window: Vec::new(),
            phases: Vec::new(),
            unalloc_sum: 0.0,
            pools: PoolRouting::default(),
            at_split: None,
            recorded_obtained: 0,
        }
    }

    fn event(&mut self, i: u64, e: TraceEvent, r: &mut ReplayResult) {
        // Time budgets follow the recorded run (Note [Defragmentation budget]).
        self.dev.backend.set_clock(e.time_ns);
        // A call's own segment events come before its record.
        if matches!(e.action, Action::SegmentMap | Action::SegmentAlloc) {
            self.recorded_obtained = self.recorded_obtained.saturating_add(e.size);
        }
        if !self.window.is_empty() {
            if is_call(e.action) || e.action == Action::Oom {
                self.close_window(r);
            } else {
                self.window.push((i, e));
                return;
            }
        }
        if (e.action == Action::FreeCompleted && self.pending.contains_key(&e.addr))
            || e.action == Action::SyncAllStreams
        {
            self.window.push((i, e));
            return;
        }
        self.apply(i, e, r);
    }

    /// Ends a held-back call: completes, in the simulator, the blocks whose
    /// `free_completed` came from polling (those before a `sync_all_streams`
    /// record; the ones after it come from the wait, which the replayed
    /// call performs itself), then applies the call's events.
    fn close_window(&mut self, r: &mut ReplayResult) {
        let window = std::mem::take(&mut self.window);
        let polled: Vec<DevicePtr> = window
            .iter()
            .take_while(|(_, e)| e.action != Action::SyncAllStreams)
            .filter(|(_, e)| e.action == Action::FreeCompleted)
            .map(|(_, e)| e.addr)
            .collect();
        if !polled.is_empty() {
            for addr in polled {
                if let Some(ptr) = self.pending.remove(&addr)
                    && !self.dev.reuse_deferred_in_capture(ptr)
                {
                    self.complete_events_of(ptr);
                }
            }
            // During a capture no event is polled: those were reused inside it.
            if !self.dev.in_capture_scope() {
                let _ = self.dev.process_events();
            }
        }
        for (i, e) in window {
            self.apply(i, e, r);
        }
    }

    /// Makes every event the block at `ptr` waits on complete in the
    /// simulator. The recorded allocator learned this by polling, not by
    /// waiting: no driver call is counted here, and its own poll
    /// (`process_events`) counts the queries.
    fn complete_events_of(&mut self, ptr: DevicePtr) {
        let Some(&id) = self.dev.live.get(&ptr) else {
            return;
        };
        for ev in self.dev.pending.events_of(id) {
            self.dev.backend.complete_event(ev);
        }
    }

    fn apply(&mut self, i: u64, e: TraceEvent, r: &mut ReplayResult) {
        if !matches!(
            e.action,
            Action::Alloc | Action::FreeRequested | Action::FreeCompleted
        ) {
            self.pools.end_restore();
        }
        match e.action {
            Action::Alloc => self.alloc(i, e),
            Action::FreeRequested => match self.live.remove(&e.addr) {
                Some(Live { ptr: Some(p), .. }) if self.pools.restored_free(p) => {}
                Some(Live {
                    ptr: Some(p),
                    used_on_other_streams,
                }) => {
                    if self.dev.free(p).is_ok()
                        && used_on_other_streams
                        && self.dev.live.contains_key(&p)
                    {
                        self.pending.insert(e.addr, p);
                    }
                }
                Some(Live { ptr: None, .. }) => r.frees_of_failed += 1,
                None => r.unknown_frees += 1,
            },
            Action::FreeCompleted => {
                self.pending.remove(&e.addr);
            }
            Action::RecordStream => match self.live.get_mut(&e.addr) {
                Some(l) => {
                    if let Some(p) = l.ptr {
                        l.used_on_other_streams = true;
                        let _ = self.dev.record_stream(p, e.stream);
                    }
                }
                None => r.unknown_frees += 1,
            },
            Action::EmptyCache => {
                let _ = self.dev.empty_cache();
            }
            Action::Oom => self.failed_alloc(i, e),
            Action::PhasePush => self.phases.extend(e.name_id()),
            Action::PhasePop => {
                self.phases.pop();
            }
            _ => match e.kind() {
                EventKind::SegmentAlloc { addr, size, pool }
                | EventKind::SegmentMap { addr, size, pool } => self.pools.owner(addr, size, pool),
                EventKind::PrivatePool {
                    op,
                    pool,
                    checkpoint,
                } => {
                    // A checkpoint notes which recorded block each of its
                    // blocks stands for.
                    let recorded: FxHashMap<DevicePtr, DevicePtr> = match op {
                        PoolOp::Checkpoint => self
                            .live
                            .iter()
                            .filter_map(|(&a, l)| Some((l.ptr?, a)))
                            .collect(),
                        _ => FxHashMap::default(),
                    };
                    let recorded_of = |p: DevicePtr| recorded.get(&p).copied();
                    self.pools
                        .call(&mut self.dev, op, pool, checkpoint, &recorded_of)
                }
                // The program's caps (not in the recorded configuration); a
                // fraction the simulator refuses (a damaged file) is skipped.
                EventKind::MemoryLimit { cap, device_total } => match cap {
                    MemoryCap::Fraction(bits) => {
                        let fraction = f64::from_bits(bits);
                        if fraction < 1.0 && device_total > 0 {
                            self.out.recorded_device_total.get_or_insert(device_total);
                        }
                        let _ = self.dev.set_memory_fraction(fraction);
                    }
                    MemoryCap::Bytes(bytes) => self.dev.set_memory_limit(bytes),
                    MemoryCap::DeviceSize | MemoryCap::Other(..) => {}
                },
                _ => {}
            },
        }
        self.observe_reserved();
    }

    fn alloc(&mut self, i: u64, e: TraceEvent) {
        if let Some(p) = self.pools.restored_alloc(e.addr) {
            self.out.allocs += 1;
            let live = Live {
                ptr: Some(p),
                used_on_other_streams: false,
            };
            self.live.insert(e.addr, live);
            return;
        }
        let into = self.pools.route(e.addr);
        let result = self.dev.malloc_into(e.size, e.stream as StreamId, into);
        self.pools.clear();
        if self.out.departure.is_none() {
            let replayed = self.dev.obtained_as_traced;
            if result.is_err() || replayed != self.recorded_obtained {
                self.out.departure = Some(Departure {
                    event_index: i,
                    time_ns: e.time_ns,
                    replayed,
                    recorded: self.recorded_obtained,
                });
            }
        }
        let ptr = match result {
            Ok(p) => {
                self.out.allocs += 1;
                let s = self.dev.stats();
                let reserved = s.reserved_bytes.all.current;
                if reserved > 0 {
                    self.unalloc_sum +=
                        1.0 - s.allocated_bytes.all.current as f64 / reserved as f64;
                }
                Some(p)
            }
            Err(err) => {
                self.out.ooms += 1;
                if self.out.first_oom.is_none() {
                    self.out.first_oom = Some(self.oom(i, e, &err));
                }
                None
            }
        };
        self.live.insert(
            e.addr,
            Live {
                ptr,
                used_on_other_streams: false,
            },
        );
    }

    /// A request that failed in the recording is tried again: it fails again
    /// (counted), or fits and is given back at once, as the program never
    /// got it.
    fn failed_alloc(&mut self, i: u64, e: TraceEvent) {
        match self.dev.malloc(e.size, e.stream as StreamId) {
            Ok(p) => {
                let _ = self.dev.free(p);
            }
            Err(err) => {
                self.out.ooms += 1;
                if self.out.first_oom.is_none() {
                    self.out.first_oom = Some(self.oom(i, e, &err));
                }
            }
        }
    }

    fn oom(&self, i: u64, e: TraceEvent, err: &AllocError) -> ReplayOom {
        let s = self.dev.stats();
        ReplayOom {
            device: e.device,
            event_index: i,
            time_ns: e.time_ns,
            requested: e.size,
            allocated: s.allocated_bytes.all.current as u64,
            reserved: s.reserved_bytes.all.current as u64,
            largest_free_block: self.dev.largest_free_block(),
            phase: self.phases.last().copied(),
            message: err.to_string(),
        }
    }

    fn observe_reserved(&mut self) {
        let s = self.dev.stats();
        let reserved = s.reserved_bytes.all.current as u64;
        if reserved > self.out.peak_reserved {
            let allocated = s.allocated_bytes.all.current as u64;
            self.out.peak_reserved = reserved;
            self.out.allocated_at_peak_reserved = allocated;
            self.out.unallocated_fraction_at_peak = self.dev.unallocated_fraction();
            self.out.external_fragmentation_at_peak = self.dev.external_fragmentation();
            self.out.held_at_peak_reserved = self.dev.held();
        }
    }
}

#[cfg(test)]
mod tests;
