//! Segment events (Note [Segment events] in `observer.rs`): a consumer that
//! registers a range on `Alloc`/`Map` and deregisters it on `Free`/`Unmap`,
//! as ProcessGroupNCCL does with NCCL, holds exactly the memory the device
//! backs, after every operation.
//!
//! Random sequences on a small simulated device drive growth, moving pages
//! (defragmentation), stitching, the out-of-memory retries, `empty_cache`,
//! work on several streams and graph pools captured and released. After
//! each operation the registered ranges must equal the simulator's live
//! allocations and mappings, byte for byte, and hold every segment of the
//! snapshot; a `Map` must not overlap what is registered, an `Unmap` must lie
//! inside it, a `Free` must match an `Alloc`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use gpualloc::{SegmentAction, SegmentEvent, StreamId};
use gpualloc_tests::{Checked, MIB};
use proptest::prelude::RngCore;
use proptest::test_runner::{RngAlgorithm, TestRng};

const CAPACITY: u64 = 512 * MIB;
const STREAMS: [StreamId; 3] = [0, 7, 9];

/// What a consumer of the events holds.
#[derive(Default)]
struct Registry {
    /// Registered bytes, as disjoint coalesced ranges: start -> end.
    ranges: BTreeMap<u64, u64>,
    /// Plain segments announced by `Alloc`: start -> bytes.
    plain: BTreeMap<u64, u64>,
    /// Events seen, per action.
    counts: BTreeMap<&'static str, u64>,
    /// Contract violations seen.
    errors: Vec<String>,
}

impl Registry {
    fn add(&mut self, lo: u64, hi: u64) {
        let before = self.ranges.range(..hi).next_back().map(|(&a, &b)| (a, b));
        if let Some((a, b)) = before
            && b > lo
        {
            self.errors.push(format!(
                "{lo:#x}..{hi:#x} overlaps registered {a:#x}..{b:#x}"
            ));
            return;
        }
        let (mut lo, mut hi) = (lo, hi);
        if let Some((a, b)) = before
            && b == lo
        {
            self.ranges.remove(&a);
            lo = a;
        }
        if let Some(b) = self.ranges.remove(&hi) {
            hi = b;
        }
        self.ranges.insert(lo, hi);
    }

    fn remove(&mut self, lo: u64, hi: u64) {
        let Some((a, b)) = self.ranges.range(..=lo).next_back().map(|(&a, &b)| (a, b)) else {
            self.errors
                .push(format!("{lo:#x}..{hi:#x} was never registered"));
            return;
        };
        if hi > b {
            self.errors.push(format!(
                "{lo:#x}..{hi:#x} is not inside registered {a:#x}..{b:#x}"
            ));
            return;
        }
        self.ranges.remove(&a);
        if a < lo {
            self.ranges.insert(a, lo);
        }
        if hi < b {
            self.ranges.insert(hi, b);
        }
    }

    fn on(&mut self, e: &SegmentEvent) {
        let (lo, hi) = (e.address, e.address + e.size);
        let name = match e.action {
            SegmentAction::Alloc => "alloc",
            SegmentAction::Free => "free",
            SegmentAction::Map => "map",
            SegmentAction::Unmap => "unmap",
        };
        *self.counts.entry(name).or_default() += 1;
        if e.device != 0 || e.size == 0 {
            self.errors.push(format!("bad event {e:?}"));
        }
        match e.action {
            SegmentAction::Alloc => {
                self.plain.insert(lo, e.size);
                self.add(lo, hi);
            }
            SegmentAction::Map => self.add(lo, hi),
            SegmentAction::Free => {
                if self.plain.remove(&lo) != Some(e.size) {
                    self.errors
                        .push(format!("free of {lo:#x}+{} never allocated", e.size));
                }
                self.remove(lo, hi);
            }
            SegmentAction::Unmap => {
                if self
                    .plain
                    .range(..hi)
                    .next_back()
                    .is_some_and(|(&p, &s)| p + s > lo)
                {
                    self.errors
                        .push(format!("unmap of {lo:#x}..{hi:#x} inside a plain segment"));
                }
                self.remove(lo, hi);
            }
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
        reg.ranges == backed,
        "after {what}: registered {:x?}\nbut the device backs {:x?}",
        reg.ranges,
        backed
    );
    for s in c.snapshot() {
        let inside = reg
            .ranges
            .range(..=s.address)
            .next_back()
            .is_some_and(|(_, &end)| s.address + s.total_size <= end);
        assert!(
            inside,
            "after {what}: snapshot segment {:#x}+{} is not registered",
            s.address, s.total_size
        );
    }
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
    assert!(reg.lock().unwrap().ranges.is_empty(), "all memory returned");
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
        "expandable_handle_mb:2,stitch_min_mb:4,defragment_headroom:0",
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
    for k in ["map", "unmap", "stitches", "defragmentations"] {
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
        }
    }
}
