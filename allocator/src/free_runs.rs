//! Free runs: the whole free handles that defragmentation may move.
//!
//! Note [Reclaim order]
//! Rationale: defragmentation (Note [Defragmentation] in `expandable.rs`)
//! moves whole free handles into the page pool to map them where a request
//! fits. Handles a cached stitch aliases cost more to take (the stitch is
//! unmapped there too and repaired when next claimed), and taking runs in
//! pieces scatters what is left free. Until round 14 a run of free handles
//! that a stitch aliased anywhere was skipped as a whole (or, when the
//! budget allowed, taken whole, tearing the stitch down): on four streams
//! of training (`sweep.py`'s `multi_stream`), requests of 300–400 MiB
//! created new memory while 7.5 GB of unaliased free handles lay in such
//! runs, and reserved memory rose from 1.003x to 1.05x peak allocated.
//! Approach: three tiers, largest runs first within each (the fewest runs
//! cut, and the handles that free runs between live blocks keep stay where
//! the next small requests fit without a move), smallest first while the
//! stitch budget has no credit (below):
//! 0. whole runs no stitch aliases;
//! 1. only when tier 0 falls short of the request: the handles of runs a
//!    stitch aliases in part that it does not alias, in pieces;
//! 2. only when tiers 0 and 1 fall short and the budget allows (`pinned`,
//!    Note [Defragmentation budget]): the handles stitches alias.
//!
//! Tier 1 used always (not only when tier 0 falls short) costs ResNet-50
//! 1.0195 to 1.054 R/A (1.1045 on the library of the second study in
//! `docs/policy-experiments.md`); as a fallback, over 55 replayed
//! workloads, mean R/A 1.0265 to 1.0254 for 2.3 ms more driver time, the
//! four-stream runs 1.056 and 1.072 to 1.014 (twelfth study).
//!
//! Largest first replaced smallest first in round 40 (thirty-first study):
//! over 95 replayed workloads (`placement_bench --seeds 4 --long 300
//! --churn-ops 200000`, eleven recorded traces and the synthetic loops)
//! mean R/A 1.0304 to 1.0292 and mean driver time 282.8 to 274.7 ms.
//! Single-stream training gains (Ultralytics YOLO 1.0172 to 1.0083 as
//! recorded and 1.021–1.033 to 1.010–1.015 over long runs, the MoE on all
//! nine of its workloads, ResNet-50 1.0171 to 1.0151); the multi-stream
//! traces lose a little (four streams 1.006–1.011 to 1.005–1.014, FSDP2
//! 1.013–1.031 to 1.017–1.031), and the detector's nine workloads move both
//! ways (mean 1.0389 to 1.0371). Taking runs of the requesting stream first
//! does not win the multi-stream traces back (1.0293); the fewest handles
//! per byte first costs the least driver time (261.6 ms) but ResNet-50
//! reserves more (1.0185).
//!
//! Smallest first again while the stitch budget has no credit (round 41,
//! thirty-second study): a device that spends more than `stitch_budget` of
//! its time moving and stitching pages (Note [Stitch budget] in
//! `budget.rs`) is an allocation loop that reshapes its memory every few
//! microseconds, and there the small runs a large move leaves behind cannot
//! hold its next large requests, which move pages again. On the H200 the
//! C++ churn loop made 6,729 moves and spent 1,155–1,187 ms in the driver
//! over 2,000,000 operations with largest first always, 5,068–5,154 and
//! 831–914 ms with this rule (1,231–1,261 → 981–1,128 ns an alloc+free),
//! at the same R/A (1.034); the Python loops 714 → 614–645 moves (256 B–24
//! MiB, R/A 1.022 → 1.026–1.030). Training traces keep credit and are
//! served as before; over 95 replayed workloads mean R/A 1.0300 → 1.0298
//! and driver time 274.2 → 272.2 ms, only the four-stream CNN (mixed,
//! 1.0049 → 1.0063 as recorded) and the churn loops changing. The budget
//! is asked as a stitch asks it (`DefragBudget::allows`): the first
//! question starts its clock, so a loop whose requests never ask about a
//! stitch still earns its share of the time from its first move, and
//! credit banked past the burst is forgotten, so a device that was quiet
//! for an hour does not move pages largest first for minutes afterwards.
//! With `stitch_budget:0` the smallest runs always go first, with 1 never.

use crate::backend::{Backend, StreamId};
use crate::block::{BlockState, SegmentId};
use crate::device::DeviceAllocator;

/// Which whole free runs defragmentation takes first within a tier (Note
/// [Reclaim order]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RunOrder {
    /// The largest first: fewest runs cut, the small ones left where small
    /// requests fit.
    LargestFirst,
    /// The smallest first: the fragments between live blocks are used up,
    /// the large runs left for the next large requests.
    SmallestFirst,
}

/// A run of whole free handles: `(bytes, start, segment, stream, freed stamp)`.
pub(crate) type FreeRun = (u64, u64, SegmentId, StreamId, u64);

impl<B: Backend> DeviceAllocator<B> {
    /// Runs of whole handles inside free blocks of the default pools'
    /// expandable segments, outside `[keep_lo, keep_hi)` of `keep`:
    /// `(bytes, start, segment, stream, freed stamp)`.
    pub(crate) fn free_runs(&self, keep: Option<(SegmentId, u64, u64)>) -> Vec<FreeRun> {
        self.free_runs_in(&self.expandable_segments(), keep)
    }

    /// As [`free_runs`](Self::free_runs), in the segments `segs`.
    pub(crate) fn free_runs_in(
        &self,
        segs: &[SegmentId],
        keep: Option<(SegmentId, u64, u64)>,
    ) -> Vec<FreeRun> {
        let mut out = Vec::new();
        for &seg in segs {
            let mut cur = Some(self.heap.segments.get(seg).first);
            while let Some(id) = cur {
                let b = &self.heap.blocks[id];
                cur = b.next;
                if b.state != BlockState::Free {
                    continue;
                }
                let (lo, hi) = (b.ptr, b.ptr + b.size);
                let parts = match keep {
                    Some((k, kl, kh)) if k == seg && lo < kh && kl < hi => {
                        vec![(lo, kl.max(lo)), (kh.min(hi), hi)]
                    }
                    _ => vec![(lo, hi)],
                };
                for (plo, phi) in parts {
                    if plo < phi {
                        for (rlo, rhi) in self.pages.whole_runs(plo, phi) {
                            out.push((rhi - rlo, rlo, seg, b.stream, b.freed));
                        }
                    }
                }
            }
        }
        out
    }

    /// The runs `reclaim` may take for `want` bytes outside `keep`'s
    /// window, in the order to take them (Note [Reclaim order]).
    pub(crate) fn reclaim_candidates(
        &self,
        keep: (SegmentId, u64, u64),
        want: u64,
        pinned: bool,
        order: RunOrder,
    ) -> Vec<FreeRun> {
        let runs = self.free_runs(Some(keep));
        let mut tiered: Vec<(u8, FreeRun)> = Vec::with_capacity(runs.len());
        let mut partly = Vec::new();
        for r in runs {
            if self.aliased(r.1, r.1 + r.0) {
                partly.push(r);
            } else {
                tiered.push((0, r));
            }
        }
        let mut enough: u64 = tiered.iter().map(|r| r.1.0).sum();
        if enough < want {
            for r in partly {
                for (aliased, lo, hi) in self.alias_pieces(r.1, r.1 + r.0) {
                    tiered.push((if aliased { 2 } else { 1 }, (hi - lo, lo, r.2, r.3, r.4)));
                    enough += if aliased { 0 } else { hi - lo };
                }
            }
            if enough >= want || !pinned {
                tiered.retain(|r| r.0 < 2);
            }
        }
        match order {
            RunOrder::LargestFirst => {
                tiered.sort_unstable_by_key(|&(tier, r)| (tier, std::cmp::Reverse(r.0), r.1));
            }
            RunOrder::SmallestFirst => tiered.sort_unstable_by_key(|&(tier, r)| (tier, r.0, r.1)),
        }
        tiered.into_iter().map(|r| r.1).collect()
    }

    /// `[lo, hi)`, a run of whole handles, cut where whether a cached
    /// stitch aliases the handle changes: `(aliased, start, end)`.
    fn alias_pieces(&self, lo: u64, hi: u64) -> Vec<(bool, u64, u64)> {
        let mut out: Vec<(bool, u64, u64)> = Vec::new();
        for (a, _, size) in self.pages.handles_in(lo, hi) {
            let aliased = self.aliased(a, a + size);
            match out.last_mut() {
                Some(p) if p.0 == aliased && p.2 == a => p.2 = a + size,
                _ => out.push((aliased, a, a + size)),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    const MIB: u64 = 1 << 20;

    /// Free runs of 4, 16 and 8 MiB between live 2 MiB blocks, under
    /// `conf` (2 MiB handles); returns the allocator and the live blocks.
    fn three_runs(conf: &str) -> (crate::DeviceAllocator<crate::SimBackend>, Vec<u64>) {
        use crate::{Config, DeviceAllocator, SimBackend};
        let conf = Config::parse(&format!("expandable_handle_mb:2,{conf}")).unwrap();
        let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), conf);
        let (mut free, mut live) = (Vec::new(), Vec::new());
        for mib in [4, 16, 8] {
            free.push(d.malloc(mib * MIB, 0).unwrap());
            live.push(d.malloc(2 * MIB, 0).unwrap());
        }
        for p in free {
            d.free(p).unwrap();
        }
        d.check_invariants().unwrap();
        (d, live)
    }

    /// The free runs left after a request of 20 MiB that no free block
    /// holds, which moves 20 MiB of pages, sorted by size in MiB.
    fn left_after_a_move(conf: &str) -> Vec<u64> {
        let (d, live) = three_runs(conf);
        left_after_a_move_in(d, live)
    }

    /// [`left_after_a_move`] on `d`, whose live blocks are `live`.
    fn left_after_a_move_in(
        mut d: crate::DeviceAllocator<crate::SimBackend>,
        live: Vec<u64>,
    ) -> Vec<u64> {
        let big = d.malloc(20 * MIB, 0).unwrap();
        d.check_invariants().unwrap();
        let mut left: Vec<u64> = d.free_runs(None).iter().map(|r| r.0 / MIB).collect();
        left.sort_unstable();
        for p in live.into_iter().chain([big]) {
            d.free(p).unwrap();
        }
        d.check_invariants().unwrap();
        left
    }

    #[test]
    fn the_largest_runs_go_first() {
        let (d, _) = three_runs("");
        let keep = (d.free_runs(None)[0].2, 0, 0);
        for (order, want) in [
            (super::RunOrder::LargestFirst, [16, 8, 4]),
            (super::RunOrder::SmallestFirst, [4, 8, 16]),
        ] {
            let got: Vec<u64> = d
                .reclaim_candidates(keep, 6 * MIB, false, order)
                .iter()
                .map(|r| r.0 / MIB)
                .collect();
            assert_eq!(got, want, "{order:?}: one run covers the request");
        }
        // With stitch credit (the burst, at start): the whole 16 MiB run
        // first, then 4 of the 8.
        assert_eq!(left_after_a_move(""), [4, 4]);
    }

    #[test]
    fn without_stitch_credit_the_smallest_runs_go_first() {
        // No credit ever: the 4 MiB run, the 8, then 8 of the 16.
        assert_eq!(left_after_a_move("stitch_budget:0"), [8]);
        // The burst spent on moves at 0 s (the first question starts the
        // clock): smallest first at 1 ms; at 10 s, 5% of it (500 ms) is
        // earned again and the largest go first.
        for (at, left) in [(1_000_000, vec![8]), (10_000_000_000, vec![4, 4])] {
            let (mut d, live) = three_runs("");
            d.backend.set_clock(0);
            assert!(d.stitch_budget.allows(0, d.config.stitch_budget));
            d.stitch_budget.charge(crate::budget::BURST_NS + 1e6);
            d.backend.set_clock(at);
            assert_eq!(left_after_a_move_in(d, live), left, "at {at} ns");
        }
    }

    #[test]
    fn pieces_of_partly_aliased_runs_come_only_when_whole_runs_fall_short() {
        let conf = "expandable_handle_mb:2,defragment_budget:0";
        let (mut d, small) = crate::stitch::tests::fragmented_with(conf);
        // A 40 MiB stitch over two whole 16 MiB free runs and half of a
        // third, cached once freed: five runs stay unaliased (80 MiB).
        let s = d.malloc(40 * MIB, 0).unwrap();
        d.free(s).unwrap();
        d.check_invariants().unwrap();
        let runs = d.free_runs(None);
        let partly = runs
            .iter()
            .find(|r| d.alias_pieces(r.1, r.1 + r.0).len() == 2)
            .expect("a run the stitch aliases in part");
        let free_half = (8 * MIB, partly.1 + 8 * MIB);
        let keep = (partly.2, 0, 0);
        let bytes = |c: &[super::FreeRun]| c.iter().map(|r| r.0).sum::<u64>();
        // Enough in whole unaliased runs: only those.
        let c = d.reclaim_candidates(keep, 80 * MIB, false, super::RunOrder::LargestFirst);
        assert_eq!((c.len(), bytes(&c)), (5, 80 * MIB));
        assert!(c.iter().all(|r| !d.aliased(r.1, r.1 + r.0)));
        // Short of them: the unaliased half of the partly aliased run comes
        // after them, and nothing aliased without the budget.
        let c = d.reclaim_candidates(keep, 88 * MIB, false, super::RunOrder::LargestFirst);
        assert_eq!(bytes(&c), 88 * MIB);
        assert_eq!((c[5].0, c[5].1), free_half);
        // With the budget, the aliased handles come last.
        let c = d.reclaim_candidates(keep, 128 * MIB, true, super::RunOrder::LargestFirst);
        assert_eq!(bytes(&c), 128 * MIB);
        assert_eq!((c[5].0, c[5].1), free_half);
        assert!(c[6..].iter().all(|r| d.aliased(r.1, r.1 + r.0)));
        for p in small {
            d.free(p).unwrap();
        }
        d.empty_cache().unwrap();
        d.check_invariants().unwrap();
        assert_eq!(d.backend().used(), 0);
    }
}
