//! The promise of `promise`, against everything else the allocator does: a
//! request fails only when the pages pinned by live blocks, plus every
//! mapped page of a private pool still held or open, plus the pages the
//! request needs, exceed the device or the memory limit (Note
//! [Defragmentation], Note [Stitching], Note [Stitch tails]). Requests made
//! while a scope is open are exempt: a capture may not take memory from the
//! default pools. Every failure is also the right one: `TooLarge` exactly
//! when the page-rounded request exceeds the smaller of capacity and limit,
//! `OutOfMemory` otherwise, each with the request's numbers.
//!
//! The operations: allocations from 1 B to the whole device on three
//! streams, frees in any order, `record_stream` and work launched on every
//! stream that may use a block (so freed pages are often still in use),
//! streams completed in any order (events left incomplete), `empty_cache`,
//! byte limits and memory fractions set and cleared, and CUDA-graph private
//! pools: nested scopes with and without a stream filter, pools reopened,
//! held with `create_or_incref_pool`, emptied with `empty_pool_cache` and
//! released with `release_pool`. Probes ask for exactly the memory the bound
//! says is free (give or take part of a page) and must get it.
//!
//! As in `promise`, the bound is exact with 2 MiB handles
//! (`expandable_handle_mb:2`, under several policies) and counts each live
//! block with a handle on either side with the default handles.

use std::collections::{BTreeMap, BTreeSet};

use gpualloc::size_class::{PoolKind, round_size};
use gpualloc::{AllocError, PoolKey, StreamId};
use gpualloc_tests::{Checked, MIB, cases};
use proptest::prelude::*;
use proptest::sample::Index;

const PAGE: u64 = 2 * MIB;
const STREAMS: [StreamId; 3] = [0, 7, 9];
/// The largest device of the runs; requests go up to it.
const LARGEST: u64 = 512 * MIB;
/// Scopes open at once, at most.
const NESTING: usize = 3;

/// One step of a run; `Index` operands pick among what exists then.
#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: u64,
        stream: usize,
    },
    Free(Index),
    RecordStream(Index, usize),
    /// Work on a live block, on its stream or one recorded for it.
    Use(Index, Index),
    Complete(usize),
    EmptyCache,
    Limit(Option<u64>),
    Fraction(f64),
    /// Opens a scope of a new pool, on one stream or on all.
    Begin {
        stream: usize,
        all: bool,
    },
    /// Closes one of the open scopes, not necessarily the innermost.
    End(Index),
    /// Opens a scope again on a held pool that has none open.
    Reopen {
        pool: Index,
        stream: usize,
        all: bool,
    },
    Incref(Index),
    /// `empty_pool_cache` on any pool ever made, held or not.
    EmptyPool(Index),
    /// Drops a hold that is not an open scope's only one.
    ReleasePool(Index),
    /// Asks for the pages the bound leaves free, less `back` pages and
    /// `offset` bytes; frees the block again unless `keep`.
    Probe {
        stream: usize,
        back: u64,
        offset: u64,
        keep: bool,
    },
}

/// Request sizes: small blocks, sizes on both sides of page and size-class
/// edges, one byte past whole pages, large blocks and half the device or more.
fn size() -> impl Strategy<Value = u64> {
    let edges = vec![
        MIB - 511,
        MIB,
        MIB + 1,
        2 * MIB - 512,
        2 * MIB,
        2 * MIB + 1,
        4 * MIB + 1,
        10 * MIB,
        10 * MIB + 1,
        20 * MIB + 1,
        32 * MIB - 1,
        32 * MIB,
    ];
    prop_oneof![
        3 => 1u64..=MIB,
        1 => prop::sample::select(edges),
        3 => (MIB + 1)..(20 * MIB),
        2 => (1u64..40).prop_map(|k| k * PAGE + 1),
        2 => (20 * MIB)..(90 * MIB),
        1 => (LARGEST / 2)..LARGEST,
    ]
}

/// Steps, allocations and frees the most frequent.
fn op() -> impl Strategy<Value = Op> {
    let s = 0..STREAMS.len();
    let offset = prop_oneof![Just(0), 0..PAGE, Just(PAGE - 512), Just(PAGE - 1)];
    let limit = prop_oneof![Just(None), (60u64..250).prop_map(|m| Some(m * MIB + 12345))];
    prop_oneof![
        10 => (size(), s.clone()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        7 => any::<Index>().prop_map(Op::Free),
        3 => (any::<Index>(), s.clone()).prop_map(|(i, s)| Op::RecordStream(i, s)),
        4 => (any::<Index>(), any::<Index>()).prop_map(|(i, s)| Op::Use(i, s)),
        2 => s.clone().prop_map(Op::Complete),
        1 => Just(Op::EmptyCache),
        1 => limit.prop_map(Op::Limit),
        1 => prop::sample::select(vec![0.3, 0.55, 0.77, 1.0]).prop_map(Op::Fraction),
        1 => (s.clone(), any::<bool>()).prop_map(|(stream, all)| Op::Begin { stream, all }),
        1 => any::<Index>().prop_map(Op::End),
        1 => (any::<Index>(), s.clone(), any::<bool>())
            .prop_map(|(pool, stream, all)| Op::Reopen { pool, stream, all }),
        1 => any::<Index>().prop_map(Op::Incref),
        1 => any::<Index>().prop_map(Op::EmptyPool),
        1 => any::<Index>().prop_map(Op::ReleasePool),
        4 => (s, 0u64..3, offset, any::<bool>())
            .prop_map(|(stream, back, offset, keep)| Op::Probe { stream, back, offset, keep }),
    ]
}

/// The private pools of a run as the test sees them.
#[derive(Default)]
struct Pools {
    made: u64,
    /// Pools with an open scope, innermost last.
    open: Vec<PoolKey>,
    /// Holds on every pool ever made (scopes opened count one each).
    holds: BTreeMap<PoolKey, u32>,
}

impl Pools {
    /// Pools with a hold: their mapped pages are theirs.
    fn held(&self) -> Vec<PoolKey> {
        self.holds
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(k, _)| *k)
            .collect()
    }

    /// Opens a scope of `key` (all streams or `stream` alone), unless it
    /// has one open or `NESTING` are open already.
    fn begin(&mut self, c: &mut Checked, key: PoolKey, stream: usize, all: bool) {
        if self.open.len() < NESTING && !self.open.contains(&key) {
            c.begin_pool(key, (!all).then_some(STREAMS[stream]));
            self.open.push(key);
            *self.holds.entry(key).or_default() += 1;
        }
    }
}

/// One run: the allocator, its pools, and what the bound counts with.
struct Run {
    c: Checked,
    pools: Pools,
    capacity: u64,
    granule: u64,
    /// The largest handle that may hold a live block's neighbour.
    handle: u64,
}

impl Run {
    /// A device of `capacity` bytes whose handles are `granule` bytes.
    fn new(config: &str, granule: u64, capacity: u64) -> Run {
        Run {
            c: Checked::with(capacity, config),
            pools: Pools::default(),
            capacity,
            granule,
            handle: granule,
        }
    }

    /// The device as far as the limit lets requests use it.
    fn room(&self) -> u64 {
        self.c
            .limit()
            .map_or(self.capacity, |l| l.min(self.capacity))
    }

    /// The bytes a request of `size` takes from the device: rounded, then
    /// in whole pages of its pool.
    fn need(&self, size: u64) -> u64 {
        let config = self.c.dev.config();
        let rounded = round_size(size, config);
        let page = match PoolKind::of(rounded) {
            PoolKind::Small => PAGE,
            PoolKind::Large => config.expandable_page,
        };
        rounded.div_ceil(page) * page
    }

    /// Bytes kept from other use: with page-sized handles, the pages that
    /// hold a byte of a live block or belong to a segment of a held pool;
    /// with larger handles (not aligned to any grid), each live block plus
    /// at most a handle on each side, and the held pools' segments.
    fn pinned(&self) -> u64 {
        let held = self.pools.held();
        let snapshot = self.c.snapshot();
        let of_pools = snapshot.iter().filter(|s| held.contains(&s.pool_id));
        if self.handle == PAGE {
            let live = self.c.live.iter().map(|(&p, l)| (p, l.block));
            let pooled = of_pools.map(|s| (s.address, s.total_size));
            let mut pages = BTreeSet::new();
            for (start, bytes) in live.chain(pooled) {
                pages.extend(start / PAGE..(start + bytes).div_ceil(PAGE));
            }
            return pages.len() as u64 * PAGE;
        }
        let live: u64 = self
            .c
            .live
            .values()
            .map(|l| l.block + 2 * self.handle)
            .sum();
        live + of_pools.map(|s| s.total_size).sum::<u64>()
    }

    /// Allocates and checks a failure: only beyond the bound (or in a
    /// scope), `TooLarge` exactly when the request could never fit, and the
    /// request's numbers in the error. (A success may exceed a limit set
    /// later than the cached memory it comes from.)
    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<(), TestCaseError> {
        let (before, need, room) = (self.pinned(), self.need(size), self.room());
        let capturing = self.c.capturing();
        match self.c.malloc(size, stream) {
            Ok(_) => {}
            Err(AllocError::OutOfMemory(r)) => {
                prop_assert!(
                    need <= room,
                    "{size} B ({need} B) never fits {room} B: {r:?}"
                );
                prop_assert_eq!(r.needed, need);
                prop_assert_eq!(r.limit, self.c.limit());
                prop_assert!(
                    capturing || before + need > room,
                    "{size} B ({need} B) failed with {before} B pinned in {room} B: {r:?}"
                );
            }
            Err(AllocError::TooLarge {
                requested,
                needed,
                max,
                ..
            }) => {
                prop_assert!(need > room, "{size} B ({need} B) fits {room} B: TooLarge");
                prop_assert_eq!((requested, needed, max), (size, need, room));
            }
            Err(e) => prop_assert!(false, "{size} B: {e:?}"),
        }
        Ok(())
    }

    /// Asks for the pages the bound leaves free, less `back` pages and
    /// `offset` bytes, and checks that it gets them; frees the block again
    /// unless `keep`. Nothing is asked in a scope, or when the request
    /// would be under two pages.
    fn probe(
        &mut self,
        stream: StreamId,
        back: u64,
        offset: u64,
        keep: bool,
    ) -> Result<(), TestCaseError> {
        let (before, room) = (self.pinned(), self.room());
        let free = room.saturating_sub(before) / PAGE;
        if self.c.capturing() || free <= back + 1 {
            return Ok(());
        }
        let size = (free - back) * PAGE - offset;
        let need = self.need(size);
        if before + need > room {
            return Ok(());
        }
        match self.c.malloc(size, stream) {
            Ok(p) if !keep => self.c.release(p),
            Ok(_) => {}
            Err(e) => prop_assert!(
                false,
                "{size} B ({need} B) failed with {before} B pinned in {room} B: {e}"
            ),
        }
        Ok(())
    }

    /// One operation; index operands that find nothing to pick do nothing.
    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let c = &mut self.c;
        let pools = &mut self.pools;
        let live: Vec<u64> = c.live.keys().copied().collect();
        let pick = |i: &Index| (!live.is_empty()).then(|| *i.get(&live));
        match op {
            Op::Alloc { size, stream } => return self.alloc(*size, STREAMS[*stream]),
            Op::Probe {
                stream,
                back,
                offset,
                keep,
            } => return self.probe(STREAMS[*stream], *back, *offset, *keep),
            Op::Free(i) => {
                if let Some(p) = pick(i) {
                    c.release(p);
                }
            }
            Op::RecordStream(i, s) => {
                if let Some(p) = pick(i) {
                    c.record_stream(p, STREAMS[*s]);
                }
            }
            Op::Use(i, s) => {
                if let Some(p) = pick(i) {
                    let l = &c.live[&p];
                    let streams: Vec<StreamId> = [l.stream]
                        .into_iter()
                        .chain(l.recorded.iter().copied())
                        .collect();
                    c.use_on(p, *s.get(&streams));
                }
            }
            Op::Complete(s) => c.complete(STREAMS[*s]),
            Op::EmptyCache => {
                // Memory created again comes in handles of up to twice the
                // largest (Note [Regrowth]); pages stay pages.
                if !c.capturing() && self.granule > PAGE {
                    self.handle = 2 * self.granule;
                }
                c.empty_cache();
            }
            Op::Limit(l) => c.set_memory_limit(*l),
            Op::Fraction(f) => c.set_memory_fraction(*f).expect("a valid fraction"),
            Op::Begin { stream, all } => {
                pools.made += 1;
                let key = (pools.made, 0);
                pools.begin(c, key, *stream, *all);
            }
            Op::Reopen { pool, stream, all } => {
                let held = pools.held();
                if !held.is_empty() {
                    pools.begin(c, *pool.get(&held), *stream, *all);
                }
            }
            Op::End(i) => {
                if !pools.open.is_empty() {
                    let key = pools.open.remove(i.index(pools.open.len()));
                    c.end_pool(key);
                }
            }
            Op::Incref(i) => {
                let held = pools.held();
                if !held.is_empty() {
                    let key = *i.get(&held);
                    c.create_or_incref_pool(key);
                    *pools.holds.entry(key).or_default() += 1;
                }
            }
            Op::EmptyPool(i) => {
                let made: Vec<PoolKey> = pools.holds.keys().copied().collect();
                if !made.is_empty() {
                    c.empty_pool_cache(*i.get(&made)).expect("empty_pool_cache");
                }
            }
            Op::ReleasePool(i) => {
                let droppable: Vec<PoolKey> = pools
                    .held()
                    .into_iter()
                    .filter(|k| !pools.open.contains(k) || pools.holds[k] > 1)
                    .collect();
                if !droppable.is_empty() {
                    let key = *i.get(&droppable);
                    c.release_pool(key).expect("release of a held pool");
                    *pools.holds.get_mut(&key).expect("held") -= 1;
                }
            }
        }
        Ok(())
    }

    /// Ends every scope, frees every block and drops every hold: after
    /// `empty_cache` nothing stays on the device.
    fn finish(mut self) -> Result<(), TestCaseError> {
        let c = &mut self.c;
        while let Some(key) = self.pools.open.pop() {
            c.end_pool(key);
        }
        for p in c.live.keys().copied().collect::<Vec<_>>() {
            c.release(p);
        }
        for (key, holds) in std::mem::take(&mut self.pools.holds) {
            for _ in 0..holds {
                c.release_pool(key).expect("release of a held pool");
            }
        }
        c.empty_cache();
        prop_assert_eq!(c.sim().used(), 0, "empty_cache gives everything back");
        Ok(())
    }
}

/// Runs `ops` under `config` on a device of `capacity` bytes whose handles
/// are `granule` bytes.
fn run(config: &str, granule: u64, capacity: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut run = Run::new(config, granule, capacity);
    for op in ops {
        run.step(op)?;
    }
    run.finish()
}

/// Device sizes: half a page-aligned device, one not a whole number of
/// pages, and the largest.
fn capacity() -> impl Strategy<Value = u64> {
    prop::sample::select(vec![256 * MIB, 257 * MIB + 4096, LARGEST])
}

/// A run of up to 160 steps.
fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..160)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(64),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn pages(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2", PAGE, capacity, &ops)?;
    }

    #[test]
    fn pages_without_defragment_headroom(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2,defragment_headroom:0,defragment_pressure:1", PAGE, capacity, &ops)?;
    }

    #[test]
    fn pages_stitching_from_2_mib(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2,stitch_min_mb:2", PAGE, capacity, &ops)?;
    }

    #[test]
    fn pages_without_stitching(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2,stitch_min_mb:0", PAGE, capacity, &ops)?;
    }

    #[test]
    fn pages_without_defragment(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2,defragment:false", PAGE, capacity, &ops)?;
    }

    #[test]
    fn pages_unmapped_at_once(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2,defer_unmap:false,unmap_thread:false", PAGE, capacity, &ops)?;
    }

    #[test]
    fn pages_without_defragment_budget(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2,defragment_budget:0", PAGE, capacity, &ops)?;
    }

    #[test]
    fn pages_without_cross_stream_reuse(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2,cross_stream_reuse:false", PAGE, capacity, &ops)?;
    }

    #[test]
    fn pages_without_stitch_budget(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2,stitch_min_mb:2,stitch_budget:0", PAGE, capacity, &ops)?;
    }

    #[test]
    fn pages_with_stitches_only_where_they_pay(capacity in capacity(), ops in ops()) {
        run("expandable_handle_mb:2,stitch_min_mb:2,stitch_short_share:8", PAGE, capacity, &ops)?;
    }

    #[test]
    fn default_handles_with_stitches_only_where_they_pay(capacity in capacity(), ops in ops()) {
        // Requests are at most `LARGEST`; a share of 2 holds back those
        // that lack less than half their size.
        run("stitch_min_mb:2,stitch_short_share:2", 16 * MIB, capacity, &ops)?;
    }

    #[test]
    fn default_handles_without_stitch_budget(capacity in capacity(), ops in ops()) {
        run("stitch_budget:0,stitch_min_mb:2", 16 * MIB, capacity, &ops)?;
    }

    #[test]
    fn default_handles(capacity in capacity(), ops in ops()) {
        run("", 16 * MIB, capacity, &ops)?;
    }
}
