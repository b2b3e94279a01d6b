//! The promise of gpualloc's default policy: fragmentation never causes an
//! out-of-memory error. A request fails only when the pages that hold live
//! blocks plus the pages the request needs exceed the device
//! (Note [Defragmentation], Note [Stitching]).
//!
//! Adversarial sequences on a small simulated device: random sizes from
//! 512 B to 90 MiB on three streams, frees in random order, work launched on
//! the blocks (so freed pages are often still in use when they are needed),
//! long-lived small blocks scattered among large ones, `empty_cache` now
//! and then. After each step the
//! whole structure is checked ([`Checked`]); every failed request is checked
//! against the bound, with 2 MiB handles (the granularity the promise is
//! made at) and with the default handles (where a handle shared by a live
//! block and free space counts as pinned, the "less page rounding" of the
//! promise).

use std::collections::BTreeSet;

use gpualloc::size_class::round_size;
use gpualloc::{AllocError, StreamId};
use gpualloc_tests::{Checked, MIB};
use proptest::prelude::*;

const CAPACITY: u64 = 512 * MIB;
const PAGE: u64 = 2 * MIB;
const STREAMS: [StreamId; 3] = [0, 7, 9];

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: usize },
    Free(prop::sample::Index),
    Use(prop::sample::Index),
    Complete(usize),
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![
        3 => 1u64..=MIB,
        3 => (MIB + 1)..(20 * MIB),
        2 => (20 * MIB)..(90 * MIB),
    ];
    prop_oneof![
        6 => (size, 0..STREAMS.len()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        5 => any::<prop::sample::Index>().prop_map(Op::Free),
        3 => any::<prop::sample::Index>().prop_map(Op::Use),
        1 => (0..STREAMS.len()).prop_map(Op::Complete),
        1 => Just(Op::EmptyCache),
    ]
}

/// Bytes that live blocks keep from other use: with `handle` equal to the
/// page, the pages that hold a byte of a live block; with larger handles
/// (not aligned to any grid), each live block plus at most a handle on each
/// side.
fn pinned(c: &Checked, handle: u64) -> u64 {
    if handle == PAGE {
        let mut pages = BTreeSet::new();
        for (&p, l) in &c.live {
            for g in p / PAGE..(p + l.block).div_ceil(PAGE) {
                pages.insert(g);
            }
        }
        return pages.len() as u64 * PAGE;
    }
    c.live.values().map(|l| l.block + 2 * handle).sum()
}

fn run(config: &str, granule: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut c = Checked::with(CAPACITY, config);
    let mut order: Vec<u64> = Vec::new();
    // Memory created again after `empty_cache` comes in handles of up to
    // twice the largest (Note [Regrowth]); pages stay pages.
    let mut handle = granule;
    for op in ops {
        match op {
            Op::Alloc { size, stream } => {
                let before = pinned(&c, handle);
                let rounded = round_size(*size, c.dev.config());
                let need = rounded.div_ceil(PAGE) * PAGE;
                match c.malloc(*size, STREAMS[*stream]) {
                    Ok(p) => order.push(p),
                    Err(AllocError::OutOfMemory(r)) => prop_assert!(
                        before + need > CAPACITY,
                        "{size} B failed with {before} B of pages pinned by live blocks on a \
                         {CAPACITY} B device: {r:?}"
                    ),
                    Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                }
            }
            Op::Free(i) if !order.is_empty() => {
                let p = order.remove(i.index(order.len()));
                c.release(p);
            }
            Op::Use(i) if !order.is_empty() => {
                let p = order[i.index(order.len())];
                let stream = c.live[&p].stream;
                c.use_on(p, stream);
            }
            Op::Complete(s) => c.complete(STREAMS[*s]),
            Op::EmptyCache => {
                c.dev.empty_cache().unwrap();
                if granule > PAGE {
                    handle = 2 * granule;
                }
            }
            _ => {}
        }
    }
    for p in order {
        c.release(p);
    }
    c.dev.empty_cache().unwrap();
    prop_assert_eq!(c.sim().used(), 0, "empty_cache gives everything back");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: gpualloc_tests::cases(48), ..ProptestConfig::default() })]

    #[test]
    fn fragmentation_never_fails_a_request_with_pages(ops in prop::collection::vec(op(), 1..160)) {
        run("expandable_handle_mb:2", PAGE, &ops)?;
    }

    #[test]
    fn fragmentation_never_fails_a_request_default_handles(ops in prop::collection::vec(op(), 1..160)) {
        run("", 16 * MIB, &ops)?;
    }
}

/// A cached stitch serves a request a little smaller than itself whole;
/// the handles past the block's end hold no live byte, so a request that
/// fits with them gets them back (Note [Stitch tails]).
#[test]
fn a_stitch_reused_for_a_smaller_request_gives_its_tail_back_when_memory_runs_out() {
    for config in ["expandable_handle_mb:2", ""] {
        let mut c = Checked::with(512 * MIB, config);
        let mut runs = Vec::new();
        for _ in 0..15 {
            runs.push(c.alloc(30 * MIB, 0));
            c.alloc(2 * MIB, 0); // 15 x 2 MiB stay live between the runs
        }
        for p in runs {
            c.release(p);
        }
        let s = c.alloc(300 * MIB, 0); // stitched over ten free runs
        assert_eq!(c.stats().num_stitch, 1, "{config}");
        c.release(s); // cached
        let t = c.alloc(290 * MIB, 0); // takes the cached stitch whole
        assert_eq!(c.stats().num_stitch, 1, "{config}: reused, not built");
        // Live: 30 + 290 MiB in whole pages; 190 MiB more fit in 512.
        let u = c.malloc(190 * MIB, 0);
        assert!(u.is_ok(), "{config}: {}", u.unwrap_err());
        // The stitch, freed with holes at its end, serves again.
        c.release(t);
        c.release(u.unwrap());
        let again = c.alloc(290 * MIB, 0);
        c.release(again);
        c.empty_cache();
        assert!(c.sim().used() <= 30 * MIB, "{config}: {}", c.sim().used());
    }
}

/// The same at its smallest (a case the property test found): one page
/// of tail, and a one-byte request. The headroom stays 0.5% as the device
/// fills (no limit is set, and `defragment_pressure:1` would keep it so
/// under one), so that pages move and the request is stitched as the case
/// was found.
#[test]
fn the_last_page_of_a_stitch_tail_serves_a_request() {
    let mut c = Checked::with(512 * MIB, "expandable_handle_mb:2,defragment_pressure:1");
    let p = c.alloc(510 * MIB, 0);
    c.release(p); // 510 MiB mapped and free on stream 0
    let q = c.alloc(4 * MIB + 1, 0);
    for size in [1, 1, 1, 1, 34817, 34817, 1048065, 34817, 1, 1, 1048065] {
        c.alloc(size, 7); // stream 7's two small pages; the second moves a handle
    }
    c.release(q);
    let r = c.alloc(508 * MIB, 0); // stitched
    assert_eq!(c.stats().num_stitch, 1);
    c.release(r); // cached
    let _t = c.alloc(506 * MIB, 0); // the cached stitch, whole
    // Pages of live blocks: 4 MiB (stream 7) + 506 MiB: one page is free.
    let u = c.malloc(1, 0);
    assert!(u.is_ok(), "{}", u.unwrap_err());
}
