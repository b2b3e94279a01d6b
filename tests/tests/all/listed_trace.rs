//! A trace's listed ranges (Note [Listed ranges] in
//! `allocator/src/trace/event.rs`) are the snapshot's segments: random
//! programs that stitch, give stitches back, trim their tails
//! (`empty_cache` with a stitch in use) and move pages, traced, with a
//! mark after each operation. Read back, the ranges the trace lists at
//! each mark (segments and mapped pages, less the home runs a stitch in
//! use holds, plus the stitches in use) must equal the snapshot taken
//! there, byte for byte, and no range may be listed twice.

use std::collections::BTreeMap;

use gpualloc::trace::{EventKind, Pool, TraceReader};
use gpualloc::workload::stitching_step;
use gpualloc::{Allocator, Config, SimBackend};
use gpualloc_tests::MIB;
use proptest::prelude::RngCore;
use proptest::test_runner::{RngAlgorithm, TestRng};

/// Disjoint ranges (start -> end), adjacent ones merged.
#[derive(Default, PartialEq, Debug)]
struct Ranges(BTreeMap<u64, u64>);

impl Ranges {
    fn add(&mut self, lo: u64, hi: u64) -> Result<(), String> {
        if let Some((&a, &b)) = self.0.range(..hi).next_back()
            && b > lo
        {
            return Err(format!(
                "{lo:#x}..{hi:#x} listed twice (over {a:#x}..{b:#x})"
            ));
        }
        let (mut lo, mut hi) = (lo, hi);
        if let Some((&a, &b)) = self.0.range(..lo).next_back()
            && b == lo
        {
            self.0.remove(&a);
            lo = a;
        }
        if let Some(b) = self.0.remove(&hi) {
            hi = b;
        }
        self.0.insert(lo, hi);
        Ok(())
    }

    fn remove(&mut self, lo: u64, hi: u64) -> Result<(), String> {
        let Some((&a, &b)) = self.0.range(..=lo).next_back() else {
            return Err(format!("{lo:#x}..{hi:#x} is not listed"));
        };
        if hi > b {
            return Err(format!("{lo:#x}..{hi:#x} is not inside {a:#x}..{b:#x}"));
        }
        self.0.remove(&a);
        if a < lo {
            self.0.insert(a, lo);
        }
        if hi < b {
            self.0.insert(hi, b);
        }
        Ok(())
    }
}

/// Runs `steps` random operations traced; returns, per operation, the
/// snapshot's segments coalesced, and the trace's path.
fn run(
    config: &str,
    seed: u64,
    steps: usize,
    dir: &std::path::Path,
) -> (Vec<Ranges>, std::path::PathBuf) {
    let a = Allocator::new(
        Config::parse(config).unwrap(),
        1,
        Box::new(|_| Ok(SimBackend::new(512 * MIB))),
    );
    let path = dir.join(format!("listed-{seed}.gtrace"));
    a.trace_start(&path).unwrap();
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed as u8; 32]);
    let mut below = |n: u64| rng.next_u64() % n;
    let mut live = Vec::new();
    let mut snapshots = Vec::new();
    for _ in 0..steps {
        stitching_step(&a, &mut below, &mut live, true).unwrap();
        let mut segs = Ranges::default();
        let mut snap: Vec<(u64, u64)> = a
            .snapshot(0)
            .unwrap()
            .iter()
            .map(|s| (s.address, s.total_size))
            .collect();
        snap.sort_unstable();
        for (addr, size) in snap {
            segs.add(addr, addr + size).unwrap();
        }
        snapshots.push(segs);
        a.mark("op").unwrap();
    }
    a.trace_stop().unwrap();
    (snapshots, path)
}

/// The trace's listed ranges at each mark, how many list and unlist
/// records it held, and how many of them unlisted a stitch's tail.
fn listed_at_marks(path: &std::path::Path) -> (Vec<Ranges>, u64, u64) {
    let mut r = TraceReader::open(path).unwrap();
    let (mut listed, mut at_marks, mut listings) = (Ranges::default(), Vec::new(), 0);
    // Stitches listed now: start -> bytes listed; a tail unlisted leaves
    // some listed.
    let mut stitches: BTreeMap<u64, u64> = BTreeMap::new();
    let mut tails = 0;
    for e in r.events() {
        let change = match e.kind() {
            EventKind::SegmentAlloc { addr, size, .. } => Some((true, addr, size)),
            EventKind::SegmentFree { addr, size, .. } => Some((false, addr, size)),
            EventKind::SegmentMap { pool, addr, size } if pool != Pool::Stitch => {
                Some((true, addr, size))
            }
            EventKind::SegmentUnmap { pool, addr, size } if pool != Pool::Stitch => {
                Some((false, addr, size))
            }
            EventKind::SegmentList { addr, size, pool } => {
                listings += 1;
                if pool == Pool::Stitch {
                    stitches.insert(addr, size);
                }
                Some((true, addr, size))
            }
            EventKind::SegmentUnlist { addr, size, pool } => {
                listings += 1;
                if pool == Pool::Stitch {
                    match stitches.remove(&addr) {
                        Some(n) if n == size => {}
                        Some(n) => panic!("{addr:#x}: {size} of {n} listed bytes unlisted"),
                        None => {
                            // A tail: the stitch it ends stays listed, shorter.
                            let (&start, n) = stitches
                                .range_mut(..addr)
                                .next_back()
                                .expect("a tail of a listed stitch");
                            assert_eq!(start + *n, addr + size, "a tail ends its stitch");
                            *n -= size;
                            tails += 1;
                        }
                    }
                }
                Some((false, addr, size))
            }
            EventKind::Mark { .. } => {
                at_marks.push(std::mem::take(&mut listed));
                listed = Ranges(at_marks.last().unwrap().0.clone());
                None
            }
            _ => None,
        };
        if let Some((add, addr, size)) = change {
            let done = if add {
                listed.add(addr, addr + size)
            } else {
                listed.remove(addr, addr + size)
            };
            done.unwrap_or_else(|why| panic!("{:?} at {} ns: {why}", e.kind(), e.time_ns));
        }
    }
    assert!(r.error().is_none(), "{:?}", r.error());
    (at_marks, listings, tails)
}

#[test]
fn the_ranges_a_trace_lists_are_the_snapshots_segments() {
    let dir = tempfile::tempdir().unwrap();
    let (mut listings, mut tails) = (0, 0);
    // The headroom stays as set (no limit; `defragment_pressure:1` would
    // keep it so under one), so that pages move and stitches form.
    for config in [
        "expandable_handle_mb:2,defragment_pressure:1",
        "expandable_handle_mb:2,stitch_min_mb:4,defragment_headroom:0,defragment_pressure:1",
    ] {
        for seed in 1..=6 {
            let (snapshots, path) = run(config, seed, 300, dir.path());
            let (listed, n, t) = listed_at_marks(&path);
            assert_eq!(listed.len(), snapshots.len());
            for (i, (l, s)) in listed.iter().zip(&snapshots).enumerate() {
                assert_eq!(
                    l, s,
                    "{config:?} seed {seed}, after operation {i}: the trace lists {l:x?}, the snapshot {s:x?}"
                );
            }
            listings += n;
            tails += t;
        }
    }
    // Stitches were taken into use and given back, and tails trimmed.
    assert!(listings >= 40, "{listings} list and unlist records");
    assert!(tails >= 3, "{tails} tails trimmed");
}
