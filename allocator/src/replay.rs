//! What-if replay: a recorded allocation sequence through this allocator's
//! policy on a simulated device of any capacity and configuration.
//!
//! # The key decision: mirror the recording's stream progress, not its layout
//!
//! Only the caller's actions are replayed: `alloc` (with the requested size),
//! `free_requested`, `record_stream`, `empty_cache`, calls on private (CUDA
//! graph) pools, caps set on reserved memory, each allocation going to the pool that served it in the
//! recording (`replay_pools.rs`), and requests that failed
//! (`oom`: tried again, and given back at once if they fit now). Segments, splits and
//! reuse are decided afresh by the replayed policy. Each recorded address is
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

use crate::backend::{Backend, DevicePtr, SimBackend, StreamId};
use crate::config::Config;
use crate::cost::{CostModel, DriverCalls};
use crate::device::DeviceAllocator;
use crate::error::AllocError;
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
    /// The first failed allocation.
    pub first_oom: Option<ReplayOom>,
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
    replay_observed(events, capacity, config, &mut |_, _| {})
}

/// [`replay`], calling `observe` with the event index and the device after
/// every event the replay applies (layout probes look at the heap there).
pub(crate) fn replay_observed(
    events: impl Iterator<Item = TraceEvent>,
    capacity: u64,
    config: &Config,
    observe: &mut dyn FnMut(u64, &DeviceAllocator<SimBackend>),
) -> ReplayResult {
    replay_with(events, capacity, config, false, observe)
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
    replay_with(events, capacity, config, true, &mut |_, _| {})
}

fn replay_with(
    events: impl Iterator<Item = TraceEvent>,
    capacity: u64,
    config: &Config,
    defer: bool,
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
        }
    }

    fn event(&mut self, i: u64, e: TraceEvent, r: &mut ReplayResult) {
        // Time budgets follow the recorded run (Note [Defragmentation budget]).
        self.dev.backend.set_clock(e.time_ns);
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
                if let Some(ptr) = self.pending.remove(&addr) {
                    self.complete_events_of(ptr);
                }
            }
            let _ = self.dev.process_events();
        }
        for (i, e) in window {
            self.apply(i, e, r);
        }
    }

    /// Makes every event the block at `ptr` waits on complete in the simulator.
    fn complete_events_of(&mut self, ptr: DevicePtr) {
        let Some(&id) = self.dev.live.get(&ptr) else {
            return;
        };
        for ev in self.dev.pending.events_of(id) {
            let _ = self.dev.backend.wait_event(ev);
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
                EventKind::MemoryLimit { cap } => match cap {
                    MemoryCap::Fraction(bits) => {
                        let _ = self.dev.set_memory_fraction(f64::from_bits(bits));
                    }
                    MemoryCap::Bytes(bytes) => self.dev.set_memory_limit(bytes),
                    MemoryCap::Other(..) => {}
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::Allocator;
    use crate::trace::TraceReader;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Drives an allocator on the simulator with tracing on: mixed sizes,
    /// three streams, `record_stream` with completions at random points,
    /// `empty_cache`, and a capacity small enough to hit the release paths.
    fn record(
        seed: u64,
        capacity: u64,
        conf: &str,
        steps: usize,
    ) -> (Vec<TraceEvent>, u64, u64, u64) {
        record_ticking(seed, capacity, conf, steps, 0)
    }

    /// Replays a recording of [`record_ticking`] under `conf` on `capacity`
    /// bytes and asserts that it reaches the recording's peaks and failed
    /// requests; returns the recording's peak reserved and failures.
    fn replays_exactly(
        (evs, pr, pa, ooms): (Vec<TraceEvent>, u64, u64, u64),
        capacity: u64,
        conf: &str,
        seed: u64,
    ) -> (u64, u64) {
        let r = replay(evs.into_iter(), capacity, &Config::parse(conf).unwrap());
        assert_eq!(
            (r.peak_reserved, r.peak_allocated, r.ooms),
            (pr, pa, ooms),
            "seed {seed}, {capacity} bytes, {conf}: replay against recording"
        );
        (pr, ooms)
    }

    /// [`record`] on a virtual clock that advances before every step by up
    /// to 20 µs, or (one step in 50) by up to `max_gap_ns`; 0 keeps it still.
    fn record_ticking(
        seed: u64,
        capacity: u64,
        conf: &str,
        steps: usize,
        max_gap_ns: u64,
    ) -> (Vec<TraceEvent>, u64, u64, u64) {
        record_driven(seed, capacity, conf, steps, max_gap_ns, false)
    }

    /// [`record_ticking`], and with `caps` the program sets a cap on
    /// reserved memory every 250 steps (a fraction, a byte cap, or none).
    fn record_driven(
        seed: u64,
        capacity: u64,
        conf: &str,
        steps: usize,
        max_gap_ns: u64,
        caps: bool,
    ) -> (Vec<TraceEvent>, u64, u64, u64) {
        let config = Config::parse(conf).unwrap();
        // The simulator's virtual clock, set before each step (or standing
        // still): the budget's decisions depend on the calls and these
        // readings alone, and the stamps carry the clock the decisions read
        // (Note [One clock for decisions and traces], which also records
        // how recordings on real time under load were checked).
        let a = Allocator::new(config, 1, Box::new(move |_| Ok(SimBackend::new(capacity))));
        let path = crate::trace::control_tests_path(&format!("replay-{seed}"));
        a.trace_start(&path).unwrap();
        let mut rng = Rng(2 * seed + 1);
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut clock = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut now = crate::clock::now_ns() + 1_000_000_000;
        for step in 0..steps {
            if max_gap_ns > 0 {
                // Mostly microseconds between calls, now and then a pause.
                now += if clock.below(50) == 0 {
                    clock.below(max_gap_ns)
                } else {
                    clock.below(20_000)
                };
                a.lock(0).unwrap().backend_mut().set_clock(now);
            }
            if step % 97 == 0 {
                a.phase_push("step").unwrap();
            }
            if caps && step % 250 == 125 {
                match rng.below(3) {
                    0 => a
                        .set_memory_fraction(0, 0.2 + rng.below(80) as f64 / 100.0)
                        .unwrap(),
                    1 => {
                        let cap = capacity / 5 + rng.below(capacity);
                        a.lock(0).unwrap().set_memory_limit(Some(cap));
                    }
                    _ => a.lock(0).unwrap().set_memory_limit(None),
                }
            }
            match rng.below(100) {
                0..=47 => {
                    let size = match rng.below(4) {
                        0 => 1 + rng.below(4096),
                        1 => 1 + rng.below(1 << 20),
                        2 => (1 << 20) + rng.below(9 << 20),
                        _ => (10 << 20) + rng.below(60 << 20),
                    };
                    let stream = rng.below(3);
                    if let Ok(p) = a.malloc(0, size, stream) {
                        live.push((p, stream));
                        if rng.below(5) == 0 {
                            a.record_stream(0, p, (stream + 1) % 3).unwrap();
                        }
                    }
                }
                48..=92 if !live.is_empty() => {
                    let (p, _) = live.swap_remove(rng.below(live.len() as u64) as usize);
                    a.free(0, p).unwrap();
                }
                93..=97 => a.lock(0).unwrap().backend_mut().complete(rng.below(3)),
                98 => a.empty_cache().unwrap(),
                _ => a.mark("tick").unwrap(),
            }
            if step % 97 == 96 {
                a.phase_pop();
            }
        }
        a.trace_stop().unwrap();
        let s = a.stats(0).unwrap();
        let mut r = TraceReader::open(&path).unwrap();
        let evs: Vec<TraceEvent> = r.events().collect();
        assert!(r.error().is_none());
        std::fs::remove_file(&path).unwrap();
        (
            evs,
            s.reserved_bytes.all.peak as u64,
            s.allocated_bytes.all.peak as u64,
            s.num_ooms as u64,
        )
    }

    #[test]
    fn a_recorded_trace_reproduces_its_peaks_exactly() {
        let mut recorded_ooms = 0;
        for (seed, capacity, conf) in [
            (1, 4u64 << 30, ""),
            (2, 600 << 20, ""),
            (3, 400 << 20, "max_split_size_mb:40"),
            (
                4,
                300 << 20,
                "roundup_power2_divisions:4,cross_stream_reuse:false",
            ),
            (
                5,
                250 << 20,
                "garbage_collection_threshold:0.5,memory_limit:200MiB",
            ),
            (6, 300 << 20, "expandable_segments:true"),
            (7, 2 << 30, "expandable_segments:true"),
            (
                8,
                200 << 20,
                "expandable_segments:true,max_split_size_mb:40",
            ),
        ] {
            let (evs, peak_reserved, peak_allocated, ooms) = record(seed, capacity, conf, 4000);
            assert!(evs.iter().any(|e| e.action == Action::RecordStream));
            let r = replay(evs.into_iter(), capacity, &Config::parse(conf).unwrap());
            assert_eq!(
                r.peak_reserved, peak_reserved,
                "seed {seed} ({conf}): peak reserved"
            );
            assert_eq!(
                r.peak_allocated, peak_allocated,
                "seed {seed}: peak allocated"
            );
            assert_eq!(r.ooms, ooms, "seed {seed}: out-of-memory count");
            assert_eq!(r.unknown_frees, 0);
            recorded_ooms += ooms;
        }
        assert!(
            recorded_ooms > 0,
            "the small capacities exercise the out-of-memory paths"
        );
    }

    /// The budget's decisions by time, replayed: recordings on a virtual
    /// clock that advances between calls (mostly by microseconds, one call
    /// in 50 after a pause of up to 50 ms, so that the budget earns and
    /// spends) replay to the same peaks and out-of-memory count.
    #[test]
    fn a_recording_on_an_advancing_clock_replays_exactly() {
        let mut time_mattered = 0;
        for seed in 1..=12u64 {
            for (capacity, conf) in [
                (300u64 << 20, "expandable_segments:true"),
                (2 << 30, "expandable_segments:true"),
                (200 << 20, "expandable_segments:true,max_split_size_mb:40"),
            ] {
                let recorded = record_ticking(seed, capacity, conf, 3000, 50_000_000);
                let (pr, ooms) = replays_exactly(recorded, capacity, conf, seed);
                let (_, still_pr, _, still_ooms) = record(seed, capacity, conf, 3000);
                time_mattered += usize::from((still_pr, still_ooms) != (pr, ooms));
            }
        }
        assert!(
            time_mattered > 0,
            "the advancing clock changes some decisions (else this test proves nothing)"
        );
    }

    /// Stitches refused by a small stitch budget (Note [Stitch budget]):
    /// the budget reads the clock the trace stamps, so the replay refuses
    /// the same ones.
    #[test]
    fn a_recording_whose_stitches_the_budget_refuses_replays_exactly() {
        let mut budget_mattered = 0;
        for seed in 1..=6u64 {
            for (capacity, base, budget) in [
                (300u64 << 20, "expandable_segments:true", 0.002),
                (2 << 30, "expandable_segments:true,stitch_min_mb:2", 0.002),
                (
                    400 << 20,
                    "expandable_segments:true,stitch_min_mb:4,expandable_handle_mb:2",
                    0.001,
                ),
            ] {
                let conf = format!("{base},stitch_budget:{budget}");
                let recorded = record_ticking(seed, capacity, &conf, 3000, 50_000_000);
                let (pr, ooms) = replays_exactly(recorded, capacity, &conf, seed);
                let unlimited = format!("{base},stitch_budget:1");
                let (_, u_pr, _, u_ooms) =
                    record_ticking(seed, capacity, &unlimited, 3000, 50_000_000);
                budget_mattered += usize::from((u_pr, u_ooms) != (pr, ooms));
            }
        }
        assert!(
            budget_mattered > 0,
            "the stitch budget changes some recordings (else this test proves nothing)"
        );
    }

    /// Caps set while the program runs are in the trace, and a replay sets
    /// them at the same points: it reaches the recording's peaks and fails
    /// the same requests. Without them (a trace of older builds) some
    /// replays differ, which shows what the records carry.
    #[test]
    fn a_recording_whose_caps_change_at_run_time_replays_exactly() {
        let mut caps_mattered = 0;
        for seed in 1..=6u64 {
            for (capacity, conf) in [
                (600u64 << 20, ""),
                (1 << 30, "expandable_segments:true"),
                (400 << 20, "expandable_segments:true,expandable_handle_mb:2"),
            ] {
                let (evs, pr, pa, ooms) = record_driven(seed, capacity, conf, 3000, 0, true);
                assert!(evs.iter().any(|e| e.action == Action::MemoryLimit));
                let without: Vec<TraceEvent> = evs
                    .iter()
                    .filter(|e| e.action != Action::MemoryLimit)
                    .copied()
                    .collect();
                replays_exactly((evs, pr, pa, ooms), capacity, conf, seed);
                let r = replay(without.into_iter(), capacity, &Config::parse(conf).unwrap());
                caps_mattered += usize::from((r.peak_reserved, r.ooms) != (pr, ooms));
            }
        }
        assert!(
            caps_mattered > 0,
            "the recorded caps change some replays (else this test proves nothing)"
        );
    }

    /// A cap set before the trace started is recorded first (it is not in
    /// the header's configuration); a replay configured with another cap of
    /// the other kind keeps it (the program set only the byte cap).
    #[test]
    fn caps_set_before_the_trace_starts_are_recorded_first() {
        let capacity = 1u64 << 30;
        let a = Allocator::new(
            Config::default(),
            1,
            Box::new(move |_| Ok(SimBackend::new(capacity))),
        );
        a.lock(0).unwrap().set_memory_limit(Some(300 << 20));
        let path = crate::trace::control_tests_path("replay-caps-first");
        a.trace_start(&path).unwrap();
        let mut ooms = 0;
        for _ in 0..8 {
            ooms += u64::from(a.malloc(0, 60 << 20, 0).is_err());
        }
        a.trace_stop().unwrap();
        let evs: Vec<TraceEvent> = TraceReader::open(&path).unwrap().events().collect();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            evs.first().map(|e| e.kind()),
            Some(EventKind::MemoryLimit {
                cap: MemoryCap::Bytes(Some(300 << 20))
            })
        );
        let count = |a: Action| evs.iter().filter(|e| e.action == a).count() as u64;
        assert_eq!((count(Action::Alloc), count(Action::Oom)), (8 - ooms, ooms));
        assert_eq!(ooms, 3, "five 60 MiB requests fit under 300 MiB");
        let r = replay(evs.clone().into_iter(), capacity, &Config::default());
        assert_eq!((r.ooms, r.peak_reserved), (3, 300 << 20));
        let uncapped = replay(evs[1..].iter().copied(), capacity, &Config::default());
        assert_eq!(uncapped.ooms, 0, "without the record nothing fails");
        // A what-if fraction of a quarter (256 MiB) fails one more request.
        let quarter = Config::parse("per_process_memory_fraction:0.25").unwrap();
        assert_eq!(replay(evs.into_iter(), capacity, &quarter).ooms, 4);
    }

    /// Recordings whose streams the simulator completes at arbitrary points
    /// while blocks wait on them (`record_stream`), among them the four
    /// that replayed to another peak while a replay's own fence waits
    /// completed pending frees early.
    #[test]
    fn a_recording_whose_events_complete_at_arbitrary_points_replays_exactly() {
        for (seed, capacity, conf) in [
            (7u64, 400u64 << 20, "expandable_segments:true"),
            (21, 2 << 30, "expandable_segments:true"),
            (
                24,
                2 << 30,
                "expandable_segments:true,stitch_min_mb:0,defer_unmap:false,unmap_thread:false",
            ),
            (32, 2 << 30, "expandable_segments:true"),
        ] {
            replays_exactly(record(seed, capacity, conf, 3000), capacity, conf, seed);
        }
    }

    #[test]
    fn replay_is_deterministic_and_capacity_matters() {
        let (evs, ..) = record(9, 4 << 30, "", 3000);
        let c = Config::default();
        let a = replay(evs.iter().copied(), 4 << 30, &c);
        let b = replay(evs.iter().copied(), 4 << 30, &c);
        assert_eq!(a, b);
        assert!(a.first_oom.is_none());
        let small = replay(evs.iter().copied(), a.peak_allocated / 2, &c);
        let oom = small.first_oom.expect("half the peak cannot fit");
        assert!(small.ooms > 0 && oom.requested > 0 && oom.message.contains("out of memory"));
        assert!(
            small.peak_reserved <= a.peak_allocated / 2,
            "{} > {}",
            small.peak_reserved,
            a.peak_allocated / 2
        );
    }

    #[test]
    fn a_trace_that_starts_mid_run_skips_unknown_frees() {
        let (evs, ..) = record(11, 1 << 30, "", 2000);
        let first_free = evs
            .iter()
            .position(|e| e.action == Action::FreeRequested)
            .unwrap();
        let tail: Vec<TraceEvent> = evs[first_free..].to_vec();
        let r = replay(tail.into_iter(), 1 << 30, &Config::default());
        assert!(r.unknown_frees > 0);
        assert!(r.devices[0].allocs > 0);
    }
}
