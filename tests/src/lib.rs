//! Shared helpers of the integration tests.
//!
//! [`Checked`] wraps a [`DeviceAllocator`] over a [`SimBackend`]. Every
//! method does one operation and then checks, from scratch:
//! - `check_invariants()` is `Ok`;
//! - the stats match a recount from the test's own model (live allocations,
//!   their block sizes, the snapshot, `sim.used()`);
//! - no two live allocations overlap;
//! - nothing is handed to a stream before every earlier user of its bytes is
//!   ordered before that stream (see [`Checked::ordered`]);
//! - no range is unmapped while work that used it may still run (unmapping
//!   does not synchronize: Note [Event-ordered unmapping]);
//! - `held()` splits reserved memory exactly (Note [Held memory by unit]).

use std::collections::{BTreeMap, BTreeSet};

pub mod foreign;
use foreign::Foreign;

use gpualloc::backend::Backend;
use gpualloc::backend::sim::SIM_FD_BASE;
use gpualloc::{
    AllocError, BlockState, CheckpointBlock, Config, DeviceAllocator, DevicePtr, PoolKey,
    RestoreDelta, SegmentSnapshot, Sharing, SimBackend, StreamId,
    size_class::{PoolKind, round_size},
};

/// One KiB.
pub const KIB: u64 = 1 << 10;
/// One MiB.
pub const MIB: u64 = 1 << 20;
/// One GiB.
pub const GIB: u64 = 1 << 30;

/// A stream the tests never touch: the simulator reports only completions for it.
const PROBE: StreamId = u64::MAX - 17;

/// Parses a configuration string, panicking with the error.
pub fn cfg(s: &str) -> Config {
    Config::parse(s).unwrap_or_else(|e| panic!("config {s:?}: {e}"))
}

/// Cases per property: `PROPTEST_CASES` when set (for longer runs), else
/// `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A live allocation as the test sees it.
#[derive(Clone, Debug)]
pub struct Live {
    /// Bytes asked for.
    pub size: u64,
    /// Bytes of the block handed out (from the snapshot).
    pub block: u64,
    /// The allocation stream.
    pub stream: StreamId,
    /// Streams added with `record_stream`.
    pub recorded: BTreeSet<StreamId>,
    /// Per stream, the sequence number of the last work that used it.
    pub users: BTreeMap<StreamId, u64>,
    /// A stream that used it without `record_stream` ([`Checked::use_elsewhere`]):
    /// the program frees it while that stream is current, having ordered
    /// the allocation stream after it (Note [Frees on another stream]).
    pub elsewhere: Option<StreamId>,
    /// Small or large pool.
    pub kind: PoolKind,
}

/// A freed byte range and the work that last used it.
#[derive(Clone, Debug)]
struct Freed {
    start: u64,
    end: u64,
    users: Vec<(StreamId, u64)>,
    /// The physical memory behind it when freed: `(handle, start, end)`
    /// offsets into mapped handles (empty for plain segments). Pages may be
    /// mapped elsewhere before their old address is unmapped (Note
    /// [Unmapping behind the work]); the work must be ordered there too.
    physical: Vec<(u64, u64, u64)>,
}

/// The parts of mapped handles behind `[p, p + size)`: `(handle, start, end)`.
fn physical(sim: &SimBackend, p: DevicePtr, size: u64) -> Vec<(u64, u64, u64)> {
    sim.handles_over(p, size)
        .into_iter()
        .map(|(at, h, bytes)| (h, p.max(at) - at, (p + size).min(at + bytes) - at))
        .collect()
}

/// Whether two lists of handle parts share memory.
fn shares(a: &[(u64, u64, u64)], b: &[(u64, u64, u64)]) -> bool {
    a.iter()
        .any(|x| b.iter().any(|y| x.0 == y.0 && x.1 < y.2 && y.1 < x.2))
}

/// A device allocator on a simulated device, checked after every operation.
pub struct Checked {
    /// The allocator under test.
    pub dev: DeviceAllocator<SimBackend>,
    /// Live allocations by address.
    pub live: BTreeMap<DevicePtr, Live>,
    freed: Vec<Freed>,
    streams: BTreeSet<StreamId>,
    /// Stream-wait-event values last read from the simulator: `(later, earlier) -> seq`.
    waits: BTreeMap<(StreamId, StreamId), u64>,
    /// Transitive ordering: `(later, earlier) -> seq` such that every future
    /// work item of `later` runs after `earlier`'s items up to `seq`.
    clock: BTreeMap<(StreamId, StreamId), u64>,
    open_scopes: Vec<PoolKey>,
    /// `(own stream, other stream)` of blocks freed from another stream
    /// ([`use_elsewhere`](Self::use_elsewhere)) before the program ordered
    /// their own stream after the other's work ([`pay_owed`](Self::pay_owed)).
    owed: Vec<(StreamId, StreamId)>,
    byte_limit: Option<u64>,
    fraction: Option<f64>,
    /// Other allocators serving private pools: their bytes are reserved
    /// but not the simulator's.
    foreign: Vec<Foreign>,
}

impl Checked {
    /// A checked allocator on a simulated device of `capacity` bytes.
    pub fn new(capacity: u64, config: Config) -> Checked {
        let (byte_limit, fraction) = (config.memory_limit, config.memory_fraction);
        let mut sim = SimBackend::new(capacity);
        sim.log_unmaps(true);
        // Unmapping given to the helper thread waits as it would on the GPU.
        sim.defer_later_work(true);
        let c = Checked {
            dev: DeviceAllocator::new(0, sim, config),
            live: BTreeMap::new(),
            freed: Vec::new(),
            streams: BTreeSet::new(),
            waits: BTreeMap::new(),
            clock: BTreeMap::new(),
            open_scopes: Vec::new(),
            owed: Vec::new(),
            byte_limit,
            fraction,
            foreign: Vec::new(),
        };
        c.check();
        c
    }

    /// Same, with a configuration string.
    pub fn with(capacity: u64, config: &str) -> Checked {
        Checked::new(capacity, cfg(config))
    }

    /// The simulator.
    pub fn sim(&self) -> &SimBackend {
        self.dev.backend()
    }

    /// The simulator, mutably. Changes made through it are not checked until the next operation.
    pub fn sim_mut(&mut self) -> &mut SimBackend {
        self.dev.backend_mut()
    }

    /// The stats.
    pub fn stats(&self) -> &gpualloc::DeviceStats {
        self.dev.stats()
    }

    /// One stat by its PyTorch key.
    pub fn stat(&self, key: &str) -> i64 {
        self.stats()
            .flat()
            .into_iter()
            .find(|(k, _)| k == key)
            .unwrap_or_else(|| panic!("no stat {key}"))
            .1
    }

    /// The snapshot.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        self.dev.snapshot()
    }

    /// Reserved bytes.
    pub fn reserved(&self) -> u64 {
        self.stats().reserved_bytes.all.current as u64
    }

    /// The largest cached free block.
    pub fn largest(&self) -> u64 {
        self.dev.largest_free_block()
    }

    /// Number of segments.
    pub fn segments(&self) -> usize {
        self.snapshot().len()
    }

    /// The memory limit the test believes is in force.
    pub fn limit(&self) -> Option<u64> {
        let cap = self.sim().capacity();
        let by_fraction = self
            .fraction
            .filter(|f| *f < 1.0)
            .map(|f| (cap as f64 * f) as u64);
        match (by_fraction, self.byte_limit) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs one operation on the allocator, then updates the ordering model.
    fn op<R>(&mut self, f: impl FnOnce(&mut DeviceAllocator<SimBackend>) -> R) -> R {
        let released = self.sim().counters.release;
        let waited = self.sim().counters.stream_wait_event;
        let allocated = self.sim().counters.allocate;
        let created = self.sim().counters.create;
        let lent: Vec<BTreeMap<DevicePtr, (u64, StreamId)>> = self
            .foreign
            .iter()
            .map(|f| f.ledger().live.clone())
            .collect();
        let r = f(&mut self.dev);
        // Another allocator's free may not wait for queued work: nothing
        // may still run on a segment given back to it.
        for (f, before) in self.foreign.iter().zip(&lent) {
            let now = f.ledger().live.clone();
            for (&lo, &(size, _)) in before.iter().filter(|(p, _)| !now.contains_key(p)) {
                self.assert_done(lo, size, "given back to the other allocator");
            }
        }
        for (lo, size) in self.sim_mut().take_unmaps() {
            self.assert_done(lo, size, "unmapped");
            self.freed.retain(|f| f.end <= lo || lo + size <= f.start);
        }
        if self.sim().counters.release > released {
            // cudaFree synchronizes the device: all earlier work is done.
            self.freed.clear();
        }
        if self.sim().counters.stream_wait_event > waited {
            self.update_clock();
        }
        // Segments (cudaMalloc) and physical handles (cuMemCreate) alike.
        let grew = self.sim().counters.allocate > allocated || self.sim().counters.create > created;
        if grew && let Some(limit) = self.limit() {
            assert!(
                self.sim().used() <= limit,
                "backend asked beyond the limit: used {} > limit {limit}",
                self.sim().used()
            );
        }
        r
    }

    /// Panics unless every work that used freed bytes in `lo..lo + size`
    /// is done (`what` happened to the range).
    fn assert_done(&self, lo: DevicePtr, size: u64, what: &str) {
        let hi = lo + size;
        for f in self.freed.iter().filter(|f| f.start < hi && lo < f.end) {
            for &(u, seq) in &f.users {
                assert!(
                    self.sim().is_completed(u, seq),
                    "{lo:#x}+{size} {what} while work {seq} of stream {u} on {:#x}..{:#x} may still run",
                    f.start,
                    f.end
                );
            }
        }
    }

    /// The largest `seq` with `is_ordered_after(later, earlier, seq)`.
    fn ordered_upto(&self, later: StreamId, earlier: StreamId) -> u64 {
        let sim = self.sim();
        if sim.is_ordered_after(later, earlier, u64::MAX) {
            return u64::MAX;
        }
        let (mut lo, mut hi) = (0u64, u64::MAX);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if sim.is_ordered_after(later, earlier, mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Reads new stream-wait-event dependencies from the simulator and
    /// closes them transitively: a stream that waits on an event of `y`
    /// recorded now is ordered after everything `y` was ordered after.
    fn update_clock(&mut self) {
        let before = self.clock.clone();
        let streams: Vec<StreamId> = self.streams.iter().copied().collect();
        for &x in &streams {
            for &y in &streams {
                if x == y {
                    continue;
                }
                let done = self.ordered_upto(PROBE, y);
                let upto = self.ordered_upto(x, y);
                if upto == u64::MAX || upto <= done {
                    continue;
                }
                let old = self.waits.get(&(x, y)).copied().unwrap_or(0);
                if upto > old {
                    self.waits.insert((x, y), upto);
                    let e = self.clock.entry((x, y)).or_insert(0);
                    *e = (*e).max(upto);
                    for (&(l, z), &s) in &before {
                        if l == y && z != x {
                            let e = self.clock.entry((x, z)).or_insert(0);
                            *e = (*e).max(s);
                        }
                    }
                }
            }
        }
    }

    /// Whether all future work on `later` runs after work on `earlier` up to `seq`.
    pub fn ordered(&self, later: StreamId, earlier: StreamId, seq: u64) -> bool {
        self.sim().is_ordered_after(later, earlier, seq)
            || self.clock.get(&(later, earlier)).is_some_and(|&s| s >= seq)
    }

    /// [`DeviceAllocator::malloc_cached`]: a hit is registered and checked
    /// as an allocation; a miss must leave the device as it was.
    pub fn malloc_cached(&mut self, size: u64, stream: StreamId) -> Option<DevicePtr> {
        self.pay_owed(stream);
        self.streams.insert(stream);
        let before = format!(
            "{:?}",
            (self.stats(), self.reserved(), &self.sim().counters)
        );
        let r = self
            .op(|d| d.malloc_cached(size, stream))
            .unwrap_or_else(|e| panic!("malloc_cached({size}) failed with {e:?}"));
        match r {
            Some(0) => assert_eq!(size, 0, "null pointer for {size} bytes"),
            Some(p) => self.register(p, size, stream),
            None => {
                let after = format!(
                    "{:?}",
                    (self.stats(), self.reserved(), &self.sim().counters)
                );
                assert_eq!(
                    before, after,
                    "a miss of malloc_cached({size}) changed the device"
                );
            }
        }
        self.check();
        r
    }

    /// Allocates; on success registers and checks the new allocation.
    pub fn malloc(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        self.pay_owed(stream);
        self.streams.insert(stream);
        let ooms = self.stats().num_ooms;
        let r = self.op(|d| d.malloc(size, stream));
        match &r {
            Ok(0) => assert_eq!(size, 0, "null pointer for {size} bytes"),
            Ok(p) => self.register(*p, size, stream),
            Err(e) => {
                assert!(e.is_out_of_memory(), "malloc({size}) failed with {e:?}");
                assert_eq!(
                    self.stats().num_ooms,
                    ooms + 1,
                    "num_ooms counts every out-of-memory error"
                );
                if let AllocError::OutOfMemory(r) = e {
                    assert_eq!(r.requested, size);
                    assert_eq!(r.allocated, self.stats().allocated_bytes.all.current as u64);
                    assert_eq!(r.reserved, self.reserved());
                    assert_eq!(r.device_free, self.sim().capacity() - self.sim().used());
                    assert_eq!(r.device_total, self.sim().capacity());
                }
            }
        }
        self.check();
        r
    }

    /// Launches work on `p` on its own stream or one it was recorded on:
    /// the `k`-th of them, counting round.
    pub fn use_on_kth(&mut self, p: DevicePtr, k: usize) {
        let l = &self.live[&p];
        let mut streams = vec![l.stream];
        streams.extend(l.recorded.iter().copied());
        let s = streams[k % streams.len()];
        self.use_on(p, s);
    }

    /// Allocates; any error is tolerated (fault injection), but the
    /// checks run as after every operation.
    pub fn try_malloc(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, AllocError> {
        self.pay_owed(stream);
        self.streams.insert(stream);
        let r = self.op(|d| d.malloc(size, stream));
        if let Ok(p) = &r
            && *p != 0
        {
            self.register(*p, size, stream);
        }
        self.check();
        r
    }

    /// `empty_cache`, any error tolerated.
    pub fn try_empty_cache(&mut self) -> Result<(), AllocError> {
        let r = self.op(|d| d.empty_cache());
        self.check();
        r
    }

    /// Allocates, panicking on failure.
    #[track_caller]
    pub fn alloc(&mut self, size: u64, stream: StreamId) -> DevicePtr {
        self.malloc(size, stream)
            .unwrap_or_else(|e| panic!("malloc({size}, {stream}): {e}"))
    }

    fn register(&mut self, p: DevicePtr, size: u64, stream: StreamId) {
        let (block, kind, state, requested) = self
            .find_block(p)
            .unwrap_or_else(|| panic!("{p:#x} handed out but not in the snapshot"));
        assert_eq!(state, BlockState::Allocated);
        assert_eq!(requested, size);
        let config = self.dev.config();
        let rounded = round_size(size, config);
        assert!(
            block >= rounded,
            "block of {block} for a request rounded to {rounded}"
        );
        assert_eq!(
            kind,
            PoolKind::of(rounded),
            "{size} B served from the {kind:?} pool"
        );
        let slack = block - rounded;
        match kind {
            PoolKind::Small => assert_eq!(slack, 0, "small blocks are split to the rounded size"),
            PoolKind::Large if rounded < config.max_split_size => {
                assert!(
                    slack <= MIB,
                    "a remainder of {slack} B > 1 MiB was not split off"
                )
            }
            PoolKind::Large => assert!(
                slack < config.max_non_split_rounding.max(2 * MIB),
                "oversize block of {block} B for {rounded} B"
            ),
        }
        let end = p + block;
        if let Some((&q, l)) = self.live.range(..end).next_back() {
            assert!(
                q + l.block <= p,
                "{p:#x}+{block} overlaps live {q:#x}+{}",
                l.block
            );
        }
        // Safety: every earlier user of these bytes, at this address or at
        // another that maps the same memory, is ordered before `stream`.
        let here = physical(self.sim(), p, block);
        let mut kept = Vec::with_capacity(self.freed.len());
        for f in std::mem::take(&mut self.freed) {
            if f.end <= p || f.start >= end {
                if shares(&f.physical, &here) {
                    for &(u, seq) in &f.users {
                        assert!(
                            self.ordered(stream, u, seq),
                            "{p:#x}+{block} handed to stream {stream} while work {seq} of stream {u} on the same memory at {:#x}..{:#x} may still run",
                            f.start,
                            f.end
                        );
                    }
                }
                kept.push(f);
                continue;
            }
            for &(u, seq) in &f.users {
                assert!(
                    self.ordered(stream, u, seq),
                    "{p:#x}+{block} handed to stream {stream} while work {seq} of stream {u} on {:#x}..{:#x} may still run",
                    f.start,
                    f.end
                );
            }
            if f.start < p {
                kept.push(Freed {
                    start: f.start,
                    end: p,
                    users: f.users.clone(),
                    physical: f.physical.clone(),
                });
            }
            if f.end > end {
                kept.push(Freed {
                    start: end,
                    end: f.end,
                    users: f.users,
                    physical: f.physical,
                });
            }
        }
        self.freed = kept;
        self.live.insert(
            p,
            Live {
                size,
                block,
                stream,
                recorded: BTreeSet::new(),
                users: BTreeMap::new(),
                elsewhere: None,
                kind,
            },
        );
    }

    /// The block at `p`: size, pool kind, state, requested size.
    pub fn find_block(&self, p: DevicePtr) -> Option<(u64, PoolKind, BlockState, u64)> {
        self.snapshot().into_iter().find_map(|s| {
            let kind = s.kind;
            s.blocks
                .into_iter()
                .find(|b| b.address == p)
                .map(|b| (b.size, kind, b.state, b.requested_size))
        })
    }

    /// Frees a live allocation (or 0). A free that returns an error but
    /// took the block anyway (an event record failed after the block was
    /// queued behind its streams' work) forgets it too.
    pub fn free(&mut self, p: DevicePtr) -> Result<(), AllocError> {
        let elsewhere = self
            .live
            .get(&p)
            .and_then(|l| l.elsewhere.map(|t| (l.stream, t)));
        let r = match elsewhere {
            Some((own, current)) => {
                // The program's part, as PyTorch's rules ask: its next
                // allocation on the block's own stream comes after the
                // other stream's work (`pay_owed`), not before.
                self.owed.push((own, current));
                self.op(|d| d.free_from(p, Some(current)))
            }
            None => self.op(|d| d.free(p)),
        };
        if r.is_ok() || self.dev.allocation_size(p).is_none() {
            self.forget(p);
        }
        self.check();
        r
    }

    /// The model's side of a free: `p` is no longer live.
    fn forget(&mut self, p: DevicePtr) {
        if let Some(l) = self.live.remove(&p) {
            let physical = physical(self.sim(), p, l.block);
            self.freed.push(Freed {
                start: p,
                end: p + l.block,
                users: l.users.into_iter().collect(),
                physical,
            });
        }
    }

    /// Frees, panicking on failure.
    #[track_caller]
    pub fn release(&mut self, p: DevicePtr) {
        self.free(p).unwrap_or_else(|e| panic!("free({p:#x}): {e}"));
    }

    /// Shares live allocation `p` with another process (Note [Sharing
    /// expandable memory]), panicking on failure. Expandable memory must
    /// export exactly the handles the simulator has mapped under the
    /// allocation's block, in address order, and sharing again the same
    /// descriptors; then everything is checked.
    #[track_caller]
    pub fn share(&mut self, p: DevicePtr) -> Sharing {
        let size = self.live[&p].block;
        let sharing = self
            .dev
            .share(p)
            .unwrap_or_else(|e| panic!("share({p:#x}): {e}"));
        if let Sharing::Handles { offset, parts } = &sharing {
            let backing = self.sim().handles_over(p, size.max(1));
            assert_eq!(*offset, p - backing[0].0, "offset from the first handle");
            // A stitched block's handles live elsewhere: compared by identity and size.
            let exported: Vec<(u64, u64)> = parts
                .iter()
                .map(|&(fd, bytes)| (fd as u64 - SIM_FD_BASE, bytes))
                .collect();
            let mapped: Vec<(u64, u64)> = backing.iter().map(|&(_, h, b)| (h, b)).collect();
            assert_eq!(exported, mapped, "the handles under {p:#x}+{size}");
            assert!(parts.iter().map(|x| x.1).sum::<u64>() >= offset + size);
        }
        // Exported once: sharing again gives the same descriptors.
        assert_eq!(self.dev.share(p).expect("share again"), sharing);
        self.check();
        sharing
    }

    /// `record_stream`.
    pub fn record_stream(&mut self, p: DevicePtr, stream: StreamId) {
        self.record_stream_of_device(p, stream, 0);
    }

    /// `record_stream` with a stream of device `device` (this allocator is
    /// device 0's); returns the key the allocator knows that stream by,
    /// for [`use_on`](Self::use_on) and [`complete`](Self::complete).
    pub fn record_stream_of_device(
        &mut self,
        p: DevicePtr,
        stream: StreamId,
        device: u32,
    ) -> StreamId {
        let key = gpualloc::backend::stream_on_device(stream, device, 0);
        self.note_recorded(p, key);
        self.op(|d| d.record_stream_of_device(p, stream, device))
            .unwrap_or_else(|e| panic!("record_stream({p:#x}): {e}"));
        self.check();
        key
    }

    fn note_recorded(&mut self, p: DevicePtr, stream: StreamId) {
        self.streams.insert(stream);
        if let Some(l) = self.live.get_mut(&p)
            && l.stream != stream
        {
            l.recorded.insert(stream);
        }
    }

    /// Launches work that uses allocation `p` on `stream` (its allocation
    /// stream or one recorded with `record_stream`); returns the sequence number.
    #[track_caller]
    pub fn use_on(&mut self, p: DevicePtr, stream: StreamId) -> u64 {
        let l = self.live.get(&p).expect("use of a live allocation");
        assert!(
            l.stream == stream || l.recorded.contains(&stream),
            "test bug: use on an unrecorded stream"
        );
        let seq = self.launch(stream);
        let l = self.live.get_mut(&p).expect("live");
        l.users.insert(stream, seq);
        seq
    }

    /// Launches work that uses allocation `p` on `stream`, another than its
    /// own and not recorded with `record_stream` (ColossalAI's Gemini reads
    /// chunks so); [`free`](Self::free) then frees it from that stream.
    /// Returns the sequence number, or `None` where the block already has
    /// such a stream (one per block here) or `stream` is its own or recorded.
    pub fn use_elsewhere(&mut self, p: DevicePtr, stream: StreamId) -> Option<u64> {
        let l = self.live.get(&p).expect("use of a live allocation");
        if l.stream == stream
            || l.recorded.contains(&stream)
            || l.elsewhere.is_some_and(|t| t != stream)
        {
            return None;
        }
        let seq = self.launch(stream);
        let l = self.live.get_mut(&p).expect("live");
        l.users.insert(stream, seq);
        l.elsewhere = Some(stream);
        Some(seq)
    }

    /// The program's side of [`use_elsewhere`](Self::use_elsewhere): before
    /// it allocates on a stream whose blocks it freed from another, it
    /// orders that stream after the other's work (Gemini's prefetch stream
    /// waits for the compute stream before it gathers again).
    fn pay_owed(&mut self, stream: StreamId) {
        let (due, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.owed)
            .into_iter()
            .partition(|&(own, _)| own == stream);
        self.owed = kept;
        for (own, current) in due {
            let sim = self.sim_mut();
            let e = sim
                .record_event(current)
                .expect("event on the other stream");
            sim.stream_wait_event(own, e).expect("wait");
            sim.destroy_event(e);
            self.update_clock();
        }
    }

    /// Launches unrelated work on a stream.
    pub fn launch(&mut self, stream: StreamId) -> u64 {
        self.streams.insert(stream);
        self.sim_mut().launch(stream)
    }

    /// Completes all work submitted on a stream.
    pub fn complete(&mut self, stream: StreamId) {
        self.streams.insert(stream);
        self.sim_mut().complete(stream);
        self.check();
    }

    /// Completes all work.
    pub fn complete_all(&mut self) {
        self.sim_mut().complete_all();
        self.check();
    }

    /// `empty_cache`.
    pub fn empty_cache(&mut self) {
        self.op(|d| d.empty_cache())
            .unwrap_or_else(|e| panic!("empty_cache: {e}"));
        self.check();
    }

    /// Sets or clears the byte limit.
    pub fn set_memory_limit(&mut self, bytes: Option<u64>) {
        self.byte_limit = bytes;
        self.op(|d| d.set_memory_limit(bytes));
        self.check();
    }

    /// Sets the memory fraction.
    pub fn set_memory_fraction(&mut self, f: f64) -> Result<(), AllocError> {
        let r = self.op(|d| d.set_memory_fraction(f));
        if r.is_ok() {
            self.fraction = Some(f);
        }
        self.check();
        r
    }

    /// Opens an allocation scope for pool `key` (all streams when `stream`
    /// is `None`) and turns the simulator's capture checks on.
    pub fn begin_pool(&mut self, key: PoolKey, stream: Option<StreamId>) {
        let filter: Option<gpualloc::StreamFilter> = stream.map(|s| Box::new(move |x| x == s) as _);
        self.op(|d| d.begin_allocate_to_pool(key, filter))
            .unwrap_or_else(|e| panic!("begin_allocate_to_pool: {e}"));
        self.open_scopes.push(key);
        self.sim_mut().set_capturing(true);
        self.check();
    }

    /// Closes the innermost scope of `key`; capture checks go off with the last scope.
    pub fn end_pool(&mut self, key: PoolKey) {
        self.op(|d| d.end_allocate_to_pool(key))
            .unwrap_or_else(|e| panic!("end_allocate_to_pool: {e}"));
        let pos = self
            .open_scopes
            .iter()
            .rposition(|k| *k == key)
            .expect("test bug: scope not open");
        self.open_scopes.remove(pos);
        if self.open_scopes.is_empty() {
            self.sim_mut().set_capturing(false);
        }
        self.check();
    }

    /// `release_pool`.
    pub fn release_pool(&mut self, key: PoolKey) -> Result<(), AllocError> {
        let r = self.op(|d| d.release_pool(key));
        self.check();
        r
    }

    /// `create_or_incref_pool`.
    pub fn create_or_incref_pool(&mut self, key: PoolKey) {
        self.op(|d| d.create_or_incref_pool(key));
        self.check();
    }

    /// `create_or_incref_pool` with another allocator serving the pool.
    pub fn create_or_incref_pool_from(&mut self, key: PoolKey, other: &Foreign) {
        self.foreign.push(other.clone());
        self.op(|d| d.create_or_incref_pool_from(key, other.source()));
        self.check();
    }

    /// Bytes and segments the other allocators have handed out.
    fn foreign_out(&self) -> (u64, usize) {
        self.foreign.iter().fold((0, 0), |(b, n), f| {
            let l = f.ledger();
            (b + l.bytes(), n + l.live.len())
        })
    }

    /// `follow_driver_capture`.
    pub fn follow_driver_capture(&mut self, stream: StreamId) {
        self.op(|d| d.follow_driver_capture(stream)).unwrap();
        self.check();
    }

    /// An allocation as `gpualloc_malloc_or_abort` makes it: following
    /// captures through the driver first.
    #[track_caller]
    pub fn alloc_following(&mut self, size: u64, stream: StreamId) -> DevicePtr {
        self.follow_driver_capture(stream);
        self.alloc(size, stream)
    }

    /// Whether the allocator has an allocation scope open (the hooks', or a
    /// capture it follows), as it says, not as the model tracks it.
    pub fn in_capture_scope(&self) -> bool {
        self.dev.in_capture_scope()
    }

    /// `empty_pool_cache`.
    pub fn empty_pool_cache(&mut self, key: PoolKey) -> Result<(), AllocError> {
        let r = self.op(|d| d.empty_pool_cache(key));
        self.check();
        r
    }

    /// `restore_pool`: on success the model frees what it freed and takes
    /// the checkpoint's allocated blocks as live allocations of their size.
    pub fn restore_pool(
        &mut self,
        key: PoolKey,
        blocks: &[CheckpointBlock],
    ) -> Result<RestoreDelta, AllocError> {
        let r = self.op(|d| d.restore_pool(key, blocks));
        if let Ok(delta) = &r {
            for &p in &delta.freed {
                self.forget(p);
            }
            for c in blocks.iter().filter(|c| c.allocated) {
                self.streams.insert(c.stream);
                self.register(c.address, c.size, c.stream);
            }
        }
        self.check();
        r
    }

    /// Whether a scope is open.
    pub fn capturing(&self) -> bool {
        !self.open_scopes.is_empty()
    }

    /// Checks the invariants and the stats against the test's model.
    #[track_caller]
    pub fn check(&self) {
        self.check_now();
    }

    /// No two live allocations share physical memory, whatever addresses
    /// map it (a stitch maps handles that stay mapped at home too).
    fn check_no_shared_memory(&self) {
        // Every mapping, in address order (reservations do not overlap).
        let maps = self.sim().handles_over(0, u64::MAX);
        let mut parts: Vec<(u64, u64, u64, DevicePtr)> = Vec::new();
        for (&p, l) in &self.live {
            let end = p + l.block;
            let first = maps.partition_point(|&(at, _, bytes)| at + bytes <= p);
            for &(at, h, bytes) in maps[first..].iter().take_while(|m| m.0 < end) {
                parts.push((h, p.max(at) - at, end.min(at + bytes) - at, p));
            }
        }
        parts.sort_unstable();
        if let Some(w) = parts
            .windows(2)
            .find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
        {
            panic!(
                "live {:#x} and live {:#x} share bytes {}..{} of handle {}",
                w[0].3,
                w[1].3,
                w[1].1,
                w[0].2.min(w[1].2),
                w[0].0
            );
        }
    }

    fn check_now(&self) {
        if let Err(e) = self.dev.check_invariants() {
            panic!("check_invariants: {e}");
        }
        if let Err(e) = self.dev.check_backend_mappings() {
            panic!("check_backend_mappings: {e}");
        }
        self.check_no_shared_memory();
        let snap = self.snapshot();
        let s = self.stats();
        let mut allocated = BTreeMap::new();
        let (mut pending, mut pending_requested, mut pending_bytes) = (0i64, 0i64, 0i64);
        for seg in &snap {
            let mut at = seg.address;
            for b in &seg.blocks {
                assert_eq!(b.address, at, "snapshot blocks tile the segment");
                at += b.size;
                match b.state {
                    BlockState::Allocated => {
                        allocated.insert(b.address, (b.size, b.requested_size, seg.kind));
                    }
                    BlockState::PendingFree => {
                        pending += 1;
                        pending_requested += b.requested_size as i64;
                        pending_bytes += b.size as i64;
                    }
                    BlockState::Free | BlockState::Unmapped | BlockState::Claimed => {}
                }
            }
            assert_eq!(at, seg.address + seg.total_size);
        }
        assert_eq!(
            allocated.len(),
            self.live.len(),
            "allocated blocks vs live allocations"
        );
        let (mut bytes, mut requested, mut small_bytes) = (0i64, 0i64, 0i64);
        for (p, l) in &self.live {
            let &(size, req, kind) = allocated
                .get(p)
                .unwrap_or_else(|| panic!("live {p:#x} not allocated in the snapshot"));
            assert_eq!(
                (size, req, kind),
                (l.block, l.size, l.kind),
                "block of live {p:#x}"
            );
            bytes += size as i64;
            requested += req as i64;
            if kind == PoolKind::Small {
                small_bytes += size as i64;
            }
        }
        assert_eq!(
            s.allocation.all.current,
            self.live.len() as i64,
            "allocation.all.current"
        );
        assert_eq!(
            s.allocated_bytes.all.current, bytes,
            "allocated_bytes.all.current"
        );
        assert_eq!(
            s.allocated_bytes.small_pool.current, small_bytes,
            "allocated_bytes.small_pool.current"
        );
        assert_eq!(
            s.requested_bytes.all.current,
            requested + pending_requested,
            "requested_bytes.all.current"
        );
        assert_eq!(
            s.active.all.current,
            self.live.len() as i64 + pending,
            "active.all.current"
        );
        assert_eq!(
            s.active_bytes.all.current,
            bytes + pending_bytes,
            "active_bytes.all.current"
        );
        let (foreign_bytes, foreign_segments) = self.foreign_out();
        assert_eq!(
            s.reserved_bytes.all.current as u64,
            self.sim().used() + foreign_bytes,
            "reserved_bytes vs sim.used() and the other allocators' bytes"
        );
        // The segment stat counts plain segments only, as PyTorch's does;
        // an expandable segment shows as one snapshot entry per mapped run.
        let plain = snap.iter().filter(|x| !x.expandable).count();
        assert_eq!(
            s.segment.all.current, plain as i64,
            "segment.all.current vs snapshot"
        );
        assert_eq!(
            self.sim().live_allocations() + foreign_segments,
            plain,
            "backend and other allocators' allocations vs segments"
        );
        // Note [Held memory by unit]: the units and the pool make up
        // reserved memory, and the used units hold every allocated byte.
        let held = self.dev.held();
        assert_eq!(
            held.total(),
            s.reserved_bytes.all.current as u64,
            "held() vs reserved_bytes: {held:?}"
        );
        assert!(
            held.used_units >= bytes as u64,
            "held() used units under allocated bytes {bytes}: {held:?}"
        );
        let mapped: u64 = snap.iter().map(|x| x.total_size).sum();
        assert_eq!(
            mapped + self.dev.pooled_bytes(),
            self.sim().used() + foreign_bytes,
            "snapshot plus page pool vs sim.used() and the other allocators' bytes"
        );
        for st in [
            &s.allocated_bytes,
            &s.reserved_bytes,
            &s.allocation,
            &s.segment,
        ] {
            assert_eq!(
                st.all.current,
                st.small_pool.current + st.large_pool.current
            );
            assert!(st.all.peak >= st.all.current);
        }
        let private = snap.iter().filter(|x| x.pool_id != (0, 0)).count();
        if !self.capturing() && self.dev.private_pools().is_empty() {
            assert_eq!(private, 0, "segments of private pools that no longer exist");
        }
    }
}

/// At the end of a test, what was left to the unmapping thread is done
/// (it would be, eventually) and everything is checked once more: a job
/// given up wrongly shows there even when no later call waited for it.
impl Drop for Checked {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        self.dev.backend_mut().finish_later_work();
        self.check_now();
    }
}
