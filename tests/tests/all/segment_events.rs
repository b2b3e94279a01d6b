//! Segment events (Note [Segment events] in `observer.rs`): a consumer that
//! registers a range on `Alloc`/`Map` and deregisters it on `Free`/`Unmap`
//! (and their unlisted forms), as ProcessGroupNCCL does with NCCL, holds
//! exactly the memory the device backs, after every operation; one that
//! keeps the listed ranges, as memory history does, holds exactly the
//! snapshot's segments.
//!
//! Random sequences on a small simulated device drive growth, moving pages
//! (defragmentation), stitching, the out-of-memory retries, `empty_cache`,
//! work on several streams and graph pools captured and released. After
//! each operation the registered ranges must equal the simulator's live
//! allocations and mappings, byte for byte, and the listed ones the
//! snapshot's segments; a `Map` must not overlap what is registered, an
//! `Unmap` must lie inside it, a `Free` must match an `Alloc`. Each event
//! names its pool: kept per pool, the listed ranges must be the snapshot's
//! segments of that pool, and a range must leave the pool it entered.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use gpualloc::{SegmentAction, SegmentEvent, StreamId};
use gpualloc_tests::{Checked, MIB};
use proptest::prelude::RngCore;
use proptest::test_runner::{RngAlgorithm, TestRng};

const CAPACITY: u64 = 512 * MIB;
const STREAMS: [StreamId; 3] = [0, 7, 9];

/// Disjoint coalesced ranges (start -> end), as a consumer keeps them.
#[derive(Default)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    fn add(&mut self, lo: u64, hi: u64, errors: &mut Vec<String>) {
        let ranges = &mut self.0;
        let before = ranges.range(..hi).next_back().map(|(&a, &b)| (a, b));
        if let Some((a, b)) = before
            && b > lo
        {
            errors.push(format!("{lo:#x}..{hi:#x} overlaps {a:#x}..{b:#x}"));
            return;
        }
        let (mut lo, mut hi) = (lo, hi);
        if let Some((a, b)) = before
            && b == lo
        {
            ranges.remove(&a);
            lo = a;
        }
        if let Some(b) = ranges.remove(&hi) {
            hi = b;
        }
        ranges.insert(lo, hi);
    }

    /// Adds (`Some(true)`) or removes (`Some(false)`) `lo..hi`, or nothing.
    fn apply(&mut self, add: Option<bool>, lo: u64, hi: u64, errors: &mut Vec<String>) {
        match add {
            Some(true) => self.add(lo, hi, errors),
            Some(false) => self.remove(lo, hi, errors),
            None => {}
        }
    }

    fn remove(&mut self, lo: u64, hi: u64, errors: &mut Vec<String>) {
        let ranges = &mut self.0;
        let Some((a, b)) = ranges.range(..=lo).next_back().map(|(&a, &b)| (a, b)) else {
            errors.push(format!("{lo:#x}..{hi:#x} was never added"));
            return;
        };
        if hi > b {
            errors.push(format!("{lo:#x}..{hi:#x} is not inside {a:#x}..{b:#x}"));
            return;
        }
        ranges.remove(&a);
        if a < lo {
            ranges.insert(a, lo);
        }
        if hi < b {
            ranges.insert(hi, b);
        }
    }
}

/// What the consumers of the events hold: NCCL's registrations (the
/// backed ranges) and memory history's segments (the listed ones).
#[derive(Default)]
struct Registry {
    /// Registered bytes: what `Alloc`, `Map` and `MapUnlisted` add and
    /// their opposites remove.
    backed: Ranges,
    /// What the snapshot lists: `Alloc`, `Map` and `Listed` add, their
    /// opposites remove.
    listed: Ranges,
    /// `backed` and `listed` per pool named by the events.
    backed_by_pool: BTreeMap<(u64, u64), Ranges>,
    listed_by_pool: BTreeMap<(u64, u64), Ranges>,
    /// Plain segments announced by `Alloc`: start -> bytes.
    plain: BTreeMap<u64, u64>,
    /// Blocks whose free waits for other streams: start -> bytes, from
    /// `BlockFreeDeferred` to `BlockFreeCompleted`.
    deferred: BTreeMap<u64, u64>,
    /// Events seen, per action.
    counts: BTreeMap<&'static str, u64>,
    /// Contract violations seen.
    errors: Vec<String>,
}

impl Registry {
    fn on(&mut self, e: &SegmentEvent) {
        let (lo, hi) = (e.address, e.address + e.size);
        let name = match e.action {
            SegmentAction::Alloc => "alloc",
            SegmentAction::Free => "free",
            SegmentAction::Map => "map",
            SegmentAction::Unmap => "unmap",
            SegmentAction::MapUnlisted => "map_unlisted",
            SegmentAction::UnmapUnlisted => "unmap_unlisted",
            SegmentAction::Listed => "listed",
            SegmentAction::Unlisted => "unlisted",
            SegmentAction::BlockFreeDeferred => "block_free_deferred",
            SegmentAction::BlockFreeCompleted => "block_free_completed",
        };
        *self.counts.entry(name).or_default() += 1;
        if e.device != 0 || e.size == 0 {
            self.errors.push(format!("bad event {e:?}"));
        }
        let inside_plain = self
            .plain
            .range(..hi)
            .next_back()
            .is_some_and(|(&p, &s)| p + s > lo);
        match e.action {
            SegmentAction::Alloc => {
                self.plain.insert(lo, e.size);
            }
            SegmentAction::Free if self.plain.remove(&lo) != Some(e.size) => {
                self.errors
                    .push(format!("free of {lo:#x}+{} never allocated", e.size));
            }
            SegmentAction::Unmap | SegmentAction::UnmapUnlisted if inside_plain => {
                self.errors
                    .push(format!("unmap of {lo:#x}..{hi:#x} inside a plain segment"));
            }
            SegmentAction::BlockFreeDeferred if self.deferred.insert(lo, e.size).is_some() => {
                self.errors.push(format!("{lo:#x} deferred twice"));
            }
            SegmentAction::BlockFreeCompleted if self.deferred.remove(&lo) != Some(e.size) => {
                self.errors
                    .push(format!("{lo:#x}+{} completed, never deferred", e.size));
            }
            _ => {}
        }
        let errors = &mut self.errors;
        let backed_here = self.backed_by_pool.entry(e.pool).or_default();
        for r in [&mut self.backed, backed_here] {
            r.apply(e.action.backed(), lo, hi, errors);
        }
        let listed_here = self.listed_by_pool.entry(e.pool).or_default();
        for r in [&mut self.listed, listed_here] {
            r.apply(e.action.listed(), lo, hi, errors);
        }
    }
}

/// Coalesces `(start, bytes)` ranges sorted by start.
fn coalesce(v: &[(u64, u64)]) -> BTreeMap<u64, u64> {
    let mut out: BTreeMap<u64, u64> = BTreeMap::new();
    let mut last: Option<(u64, u64)> = None;
    for &(p, s) in v {
        match &mut last {
            Some((_, end)) if *end == p => *end = p + s,
            _ => {
                if let Some((a, b)) = last {
                    out.insert(a, b);
                }
                last = Some((p, p + s));
            }
        }
    }
    if let Some((a, b)) = last {
        out.insert(a, b);
    }
    out
}

fn check(c: &Checked, reg: &Mutex<Registry>, what: &str) {
    let reg = reg.lock().unwrap();
    assert!(reg.errors.is_empty(), "after {what}: {:?}", reg.errors);
    let backed = coalesce(&c.sim().backed_ranges());
    assert!(
        reg.backed.0 == backed,
        "after {what}: registered {:x?}\nbut the device backs {:x?}",
        reg.backed.0,
        backed
    );
    // Memory history replays backwards from the snapshot: what its events
    // list must be what the snapshot lists.
    let snap: Vec<(u64, u64)> = c
        .snapshot()
        .iter()
        .map(|s| (s.address, s.total_size))
        .collect();
    let listed = coalesce(&snap);
    assert!(
        reg.listed.0 == listed,
        "after {what}: the events list {:x?}\nbut the snapshot {:x?}",
        reg.listed.0,
        listed
    );
    // Each pool's segments, as the events name them.
    let mut by_pool: BTreeMap<(u64, u64), Vec<(u64, u64)>> = BTreeMap::new();
    for s in c.snapshot() {
        by_pool
            .entry(s.pool_id)
            .or_default()
            .push((s.address, s.total_size));
    }
    for (pool, ranges) in &reg.listed_by_pool {
        let snap = by_pool
            .remove(pool)
            .map(|v| coalesce(&v))
            .unwrap_or_default();
        assert!(
            ranges.0 == snap,
            "after {what}: the events list {:x?} in pool {pool:?}\nbut the snapshot {snap:x?}",
            ranges.0
        );
    }
    assert!(
        by_pool.is_empty(),
        "after {what}: pools no event named: {by_pool:x?}"
    );
}

/// A number below `n`, from a reproducible sequence.
fn below(rng: &mut TestRng, n: u64) -> u64 {
    rng.next_u64() % n
}

/// Runs `steps` random operations under `config` on `streams`; returns the
/// event counts and how often pages were stitched and moved.
fn run(config: &str, streams: &[StreamId], seed: u64, steps: usize) -> BTreeMap<&'static str, u64> {
    let mut c = Checked::with(CAPACITY, config);
    let reg = Arc::new(Mutex::new(Registry::default()));
    let r = Arc::clone(&reg);
    c.dev
        .set_segment_observer(Some(Arc::new(move |e| r.lock().unwrap().on(e))));
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed as u8; 32]);
    // Live blocks: (pointer, in a graph pool).
    let mut live: Vec<(u64, Option<(u64, u64)>)> = Vec::new();
    // Graph pools captured and not yet released.
    let mut graphs: Vec<(u64, u64)> = Vec::new();
    let mut next_graph = 1;
    for step in 0..steps {
        let what = match below(&mut rng, 100) {
            0..=44 => {
                let size = match below(&mut rng, 3) {
                    0 => 1 + below(&mut rng, MIB),
                    1 => MIB + below(&mut rng, 19 * MIB),
                    _ => 20 * MIB + below(&mut rng, 70 * MIB),
                };
                let stream = streams[below(&mut rng, streams.len() as u64) as usize];
                if let Ok(p) = c.malloc(size, stream) {
                    live.push((p, None));
                }
                "malloc"
            }
            45..=79 if !live.is_empty() => {
                let i = below(&mut rng, live.len() as u64) as usize;
                let (p, _) = live.swap_remove(i);
                c.free(p).unwrap();
                "free"
            }
            80..=86 if !live.is_empty() => {
                let (p, _) = live[below(&mut rng, live.len() as u64) as usize];
                let stream = streams[below(&mut rng, streams.len() as u64) as usize];
                c.record_stream(p, stream);
                c.use_on(p, stream);
                "use"
            }
            87..=90 => {
                c.complete(streams[below(&mut rng, streams.len() as u64) as usize]);
                "complete"
            }
            91..=93 => {
                c.empty_cache();
                "empty_cache"
            }
            94..=96 => {
                // A captured graph: a few allocations in its own pool, some
                // freed during the capture.
                let key = (next_graph, 0);
                next_graph += 1;
                c.begin_pool(key, None);
                for _ in 0..1 + below(&mut rng, 4) {
                    let size = 1 + below(&mut rng, 40 * MIB);
                    if let Ok(p) = c.malloc(size, streams[0]) {
                        if below(&mut rng, 3) == 0 {
                            c.free(p).unwrap();
                        } else {
                            live.push((p, Some(key)));
                        }
                    }
                }
                c.end_pool(key);
                graphs.push(key);
                "capture"
            }
            _ if !graphs.is_empty() => {
                let key = graphs.swap_remove(below(&mut rng, graphs.len() as u64) as usize);
                if below(&mut rng, 2) == 0 {
                    // The graph's outputs die first.
                    let (mine, rest): (Vec<_>, Vec<_>) =
                        live.iter().partition(|l| l.1 == Some(key));
                    live = rest;
                    for (p, _) in mine {
                        c.free(p).unwrap();
                    }
                }
                c.release_pool(key).unwrap();
                "release_pool"
            }
            _ => "nothing",
        };
        check(
            &c,
            &reg,
            &format!("step {step} ({what}), {config:?} seed {seed}"),
        );
    }
    for (p, _) in live {
        c.free(p).unwrap();
    }
    for key in graphs {
        c.release_pool(key).unwrap();
    }
    c.complete_all();
    c.empty_cache();
    check(&c, &reg, &format!("the end, {config:?} seed {seed}"));
    assert!(
        reg.lock().unwrap().backed.0.is_empty(),
        "all memory returned"
    );
    assert!(reg.lock().unwrap().listed.0.is_empty(), "nothing listed");
    assert!(
        reg.lock().unwrap().deferred.is_empty(),
        "every deferred free completed"
    );
    let mut counts = reg.lock().unwrap().counts.clone();
    counts.insert("stitches", c.stats().num_stitch as u64);
    counts.insert("defragmentations", c.stats().num_defragment as u64);
    counts
}

#[test]
fn registered_ranges_are_exactly_the_backed_memory() {
    // Every kind of event and both ways of reclaiming pages happen.
    let mut total: BTreeMap<&'static str, u64> = BTreeMap::new();
    for config in [
        "",
        "expandable_handle_mb:2",
        "expandable_handle_mb:2,stitch_min_mb:4,defragment_headroom:0,defragment_pressure:1",
    ] {
        for seed in 1..=6 {
            // One stream: its free pages are the ones a stitch may use.
            let streams = if seed % 2 == 0 {
                &STREAMS[..1]
            } else {
                &STREAMS
            };
            for (k, v) in run(config, streams, seed, 400) {
                *total.entry(k).or_default() += v;
            }
        }
    }
    eprintln!("expandable: {total:?}");
    for k in [
        "map",
        "unmap",
        "stitches",
        "defragmentations",
        "map_unlisted",
        "unmap_unlisted",
        "listed",
        "unlisted",
        "block_free_deferred",
        "block_free_completed",
    ] {
        assert!(total.get(k) >= Some(&10), "{k}: {total:?}");
    }
    for config in [
        "policy:pytorch",
        "policy:pytorch,max_split_size_mb:40",
        "expandable_segments:false,garbage_collection_threshold:0.5,memory_limit:400MiB",
    ] {
        for seed in 1..=4 {
            let counts = run(config, &STREAMS, seed, 400);
            eprintln!("{config}: {counts:?}");
            assert!(counts.get("alloc") > Some(&10), "{config}: {counts:?}");
            assert!(counts.get("free") > Some(&10), "{config}: {counts:?}");
            assert!(!counts.contains_key("map"), "{config}: {counts:?}");
            assert_eq!(
                counts.get("block_free_deferred"),
                counts.get("block_free_completed"),
                "{config}: {counts:?}"
            );
        }
    }
}

/// Fifteen free 30 MiB runs between live 2 MiB blocks: a 300 MiB request
/// is stitched from them.
fn scatter_free_pages(c: &mut Checked) {
    let mut runs = Vec::new();
    for _ in 0..15 {
        runs.push(c.alloc(30 * MIB, 0));
        c.alloc(2 * MIB, 0);
    }
    for p in runs {
        c.release(p);
    }
}

/// A stitch in use whose tail the out-of-memory path gives back (Note
/// [Stitch tails]): the tail leaves both views, its home runs enter the
/// snapshot, and the stitch freed with holes leaves the snapshot by what
/// is still mapped of it.
#[test]
fn a_trimmed_stitch_tail_leaves_both_views() {
    let mut c = Checked::with(CAPACITY, "expandable_handle_mb:2");
    let reg = Arc::new(Mutex::new(Registry::default()));
    let r = Arc::clone(&reg);
    c.dev
        .set_segment_observer(Some(Arc::new(move |e| r.lock().unwrap().on(e))));
    scatter_free_pages(&mut c);
    let s = c.alloc(300 * MIB, 0);
    c.release(s);
    let t = c.alloc(290 * MIB, 0);
    check(&c, &reg, "the cached stitch taken for a smaller request");
    let u = c.malloc(190 * MIB, 0).expect("the tail comes back");
    check(&c, &reg, "the tail trimmed on the out-of-memory path");
    c.release(t);
    check(&c, &reg, "the trimmed stitch freed");
    c.release(u);
    let again = c.alloc(290 * MIB, 0);
    check(&c, &reg, "the trimmed stitch repaired and taken again");
    c.release(again);
    c.empty_cache();
    check(&c, &reg, "empty_cache");
}

/// A stitched block freed with uses on another stream: when its free
/// completes, the completion is told before the stitch leaves the
/// snapshot, so that memory history records them in that order (MemoryViz
/// undoes the completion with the stitch still there).
#[test]
fn a_deferred_free_completes_before_its_stitch_goes() {
    let mut c = Checked::with(CAPACITY, "expandable_handle_mb:2");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = Arc::clone(&seen);
    c.dev
        .set_segment_observer(Some(Arc::new(move |e| s.lock().unwrap().push(*e))));
    scatter_free_pages(&mut c);
    let stitched = c.alloc(300 * MIB, 0);
    assert!(c.stats().num_stitch > 0, "the request was not stitched");
    c.record_stream(stitched, 7);
    c.use_on(stitched, 7);
    seen.lock().unwrap().clear();
    c.free(stitched).unwrap();
    c.complete(7);
    c.malloc(4096, 0).unwrap(); // the events are polled on the next request
    let seen = seen.lock().unwrap();
    let at =
        |a: SegmentAction, addr: u64| seen.iter().position(|e| e.action == a && e.address == addr);
    let done = at(SegmentAction::BlockFreeCompleted, stitched).expect("the free completed");
    let gone = at(SegmentAction::Unlisted, stitched).expect("the stitch left the snapshot");
    assert!(
        done < gone,
        "completion at {done}, the stitch gone at {gone}: {seen:?}"
    );
}
