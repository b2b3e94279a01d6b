//! Random operations with injected driver faults, every step checked by
//! `Checked` (invariants, accounting, and that no block is handed out
//! while a stream may still use its bytes). `scenarios/faults.rs` fails
//! the k-th call of each kind on one fixed workload and checks the
//! invariants; this mixes faults of every simulated kind into random
//! sequences with record_stream, another device's streams, capture scopes,
//! pool releases and the unmapping helper's three modes, under
//! configurations that move pages and stitch. A failed call may only be
//! an error (out of memory or not), never a panic or a block in use
//! handed out again.

use gpualloc::backend::SimCall;
use gpualloc_tests::{Checked, MIB, cases};
use proptest::prelude::*;

use crate::properties::{
    FRAGMENTING_CAPS_MIB, STITCH_EAGERLY, STREAMS, draw, fragmenting_size, size,
};

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: usize },
    Free(usize),
    RecordStream(usize, usize),
    Use(usize, usize),
    Complete(usize),
    EmptyCache,
    Fault(usize, u64),
    FinishLater,
    Begin(usize, bool),
    End,
    ReleasePool(usize),
    OtherDevice(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let s = 0..STREAMS.len();
    prop_oneof![
        10 => (size(), s.clone()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        7 => any::<prop::sample::Index>().prop_map(|i| Op::Free(i.index(usize::MAX))),
        2 => (any::<prop::sample::Index>(), s.clone()).prop_map(|(i, st)| Op::RecordStream(i.index(usize::MAX), st)),
        5 => (any::<prop::sample::Index>(), 0usize..4).prop_map(|(i, k)| Op::Use(i.index(usize::MAX), k)),
        3 => s.clone().prop_map(Op::Complete),
        1 => Just(Op::EmptyCache),
        2 => (0usize..SimCall::ALL.len(), 1u64..4).prop_map(|(c, n)| Op::Fault(c, n)),
        1 => Just(Op::FinishLater),
        1 => (0usize..3, any::<bool>()).prop_map(|(s, a)| Op::Begin(s, a)),
        1 => Just(Op::End),
        1 => (0usize..4).prop_map(Op::ReleasePool),
        1 => (any::<prop::sample::Index>(), 0usize..3).prop_map(|(i, st)| Op::OtherDevice(i.index(usize::MAX), st)),
    ]
}

/// Operations of programs that fragment the pages, as
/// `properties::fragmenting_op` has them (no `empty_cache`, short
/// captures, most allocations on one stream, work waited for often), with
/// faults: so that faults land in stitch builds and page moves.
fn fragmenting_op() -> impl Strategy<Value = Op> {
    let s = 0..STREAMS.len();
    prop_oneof![
        10 => (fragmenting_size(), prop::sample::select(vec![0, 0, 0, 0, 1, 2])).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        7 => any::<prop::sample::Index>().prop_map(|i| Op::Free(i.index(usize::MAX))),
        2 => (any::<prop::sample::Index>(), s.clone()).prop_map(|(i, st)| Op::RecordStream(i.index(usize::MAX), st)),
        1 => (any::<prop::sample::Index>(), 0usize..4).prop_map(|(i, k)| Op::Use(i.index(usize::MAX), k)),
        6 => s.clone().prop_map(Op::Complete),
        2 => (0usize..SimCall::ALL.len(), 1u64..4).prop_map(|(c, n)| Op::Fault(c, n)),
        1 => Just(Op::FinishLater),
        1 => (s, any::<bool>()).prop_map(|(s, a)| Op::Begin(s, a)),
        5 => Just(Op::End),
        1 => (0usize..4).prop_map(Op::ReleasePool),
        1 => (any::<prop::sample::Index>(), 0usize..3).prop_map(|(i, st)| Op::OtherDevice(i.index(usize::MAX), st)),
    ]
}

/// Runs `ops`; returns the stitches built and the defragmentation passes.
fn run(config: &str, capacity: u64, mode: u8, ops: Vec<Op>) -> (i64, i64) {
    let mut c = Checked::with(capacity, config);
    match mode {
        0 => c.sim_mut().defer_later_work(true),
        1 => c.sim_mut().eager_later_work(true),
        _ => c.sim_mut().defer_later_work(false),
    }
    let mut next = 0u64;
    let mut open: Option<(u64, u64)> = None;
    let mut held: Vec<(u64, u64)> = Vec::new();
    for op in ops {
        let ptrs: Vec<u64> = c.live.keys().copied().collect();
        let pick = |i: usize| (!ptrs.is_empty()).then(|| ptrs[i % ptrs.len()]);
        match op {
            Op::Alloc { size, stream } => {
                let _ = c.try_malloc(size, STREAMS[stream]);
            }
            Op::Free(i) => {
                if let Some(p) = pick(i) {
                    let _ = c.free(p);
                }
            }
            Op::RecordStream(i, s) => {
                if let Some(p) = pick(i) {
                    c.record_stream(p, STREAMS[s]);
                }
            }
            Op::Use(i, k) => {
                if let Some(p) = pick(i) {
                    c.use_on_kth(p, k);
                }
            }
            Op::Complete(s) => c.complete(STREAMS[s]),
            Op::EmptyCache => {
                let _ = c.try_empty_cache();
            }
            Op::Fault(k, n) => c.sim_mut().fail_call(SimCall::ALL[k], n),
            Op::Begin(st, all) => {
                if open.is_none() {
                    next += 1;
                    let key = (next, 0);
                    c.begin_pool(key, (!all).then_some(STREAMS[st]));
                    open = Some(key);
                }
            }
            Op::End => {
                if let Some(key) = open.take() {
                    c.end_pool(key);
                    held.push(key);
                }
            }
            Op::ReleasePool(i) => {
                if !held.is_empty() {
                    let key = held.remove(i % held.len());
                    let _ = c.release_pool(key);
                }
            }
            Op::OtherDevice(i, st) => {
                if let Some(p) = pick(i) {
                    let _ = c.record_stream_of_device(p, STREAMS[st] % 3, 1);
                }
            }
            Op::FinishLater => {
                c.sim_mut().finish_later_work();
                c.check();
            }
        }
    }
    (c.stats().num_stitch, c.stats().num_defragment)
}

macro_rules! property {
    ($name:ident, $config:expr, $cases:expr) => {
        property!($name, $config, $cases, op(), 1..120, [256, 512]);
    };
    ($name:ident, $config:expr, $cases:expr, $op:expr, $len:expr, $caps_mib:expr) => {
        proptest! {
            #![proptest_config(ProptestConfig {
                cases: cases($cases),
                failure_persistence: None,
                ..ProptestConfig::default()
            })]
            #[test]
            fn $name(cap in prop::sample::select($caps_mib.map(|m: u64| m * MIB).to_vec()), mode in 0u8..3, ops in prop::collection::vec($op, $len)) {
                run($config, cap, mode, ops);
            }
        }
    };
}

// 6,000 cases of each ran clean in review (`PROPTEST_CASES=6000`).
property!(fault_default, "", 256);
// The default under a limit it passes half of, where the headroom is 5%
// (Note [Headroom under pressure]): runs grow in place and meet the limit.
property!(fault_under_a_limit, "per_process_memory_fraction:0.75", 256);
property!(
    fault_moves,
    "defragment_headroom:0,defragment_pressure:1,expandable_handle_mb:2",
    256
);
property!(
    fault_moves_stitch,
    "defragment_headroom:0,defragment_pressure:1,expandable_handle_mb:2,stitch_min_mb:4",
    256
);
property!(
    fault_big_handles,
    "defragment_headroom:0,defragment_pressure:1,expandable_handle_mb:64,stitch_min_mb:8",
    256
);
// Programs that fragment the pages (`fragmenting_op`), so
// that faults also land in stitch builds, repairs and page moves.
property!(
    fault_fragmenting_default,
    "",
    64,
    fragmenting_op(),
    40..300,
    FRAGMENTING_CAPS_MIB
);
property!(
    fault_fragmenting_stitch_eagerly,
    STITCH_EAGERLY,
    96,
    fragmenting_op(),
    40..300,
    FRAGMENTING_CAPS_MIB
);

/// The fragmenting programs with faults build stitches and move pages
/// (over 16 drawn with a fixed seed: 8 stitches and 16 passes at least), so
/// faults land there too.
#[test]
fn fragmenting_programs_with_faults_stitch_and_move_pages() {
    let programs = draw(prop::collection::vec(fragmenting_op(), 200..300), 16);
    let (stitches, moves) = programs
        .into_iter()
        .enumerate()
        .map(|(k, ops)| {
            run(
                STITCH_EAGERLY,
                FRAGMENTING_CAPS_MIB[k % 2] * MIB,
                (k % 3) as u8,
                ops,
            )
        })
        .fold((0, 0), |(s, m), (a, b)| (s + a, m + b));
    assert!(
        stitches >= 8 && moves >= 16,
        "{stitches} stitches and {moves} defragmentation passes over 16 programs"
    );
}

/// Pooled handles a mapping cannot use go back to the driver only as a
/// saving (Note [Spare handles at the high-water mark]): a driver that
/// refuses that release must not fail a request that fits without it.
#[test]
fn a_refused_release_of_spare_handles_fails_no_request() {
    let mut c = Checked::with(
        8 << 30,
        "defragment_headroom:0,defragment_pressure:1,expandable_handle_mb:16,stitch_min_mb:1024",
    );
    c.sim_mut().fail_calls(SimCall::ReleaseHandle, 1, u64::MAX);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let mut live: Vec<u64> = Vec::new();
    for step in 0..4000 {
        if live.len() > 3 && (rnd(10) < 4 || live.len() > 40) {
            let p = live.swap_remove(rnd(live.len() as u64) as usize);
            c.free(p).unwrap();
        } else {
            let size = (1 + rnd(48)) * MIB + rnd(MIB);
            let stream = STREAMS[rnd(2) as usize];
            match c.try_malloc(size, stream) {
                Ok(p) => live.push(p),
                Err(e) => panic!("step {step}: {size} bytes refused: {e}"),
            }
        }
        if rnd(8) == 0 {
            c.complete_all();
        }
    }
}

/// The shortest program `fault_fragmenting_default` found that left a
/// cached stitch mapping nothing: the last request moves every page the
/// stitch still maps while one of its holes waits to be unmapped (Note
/// [Punching behind the work]), and that unmapping (`Fault(11, 1)`) fails.
#[test]
fn a_failed_unmap_leaves_no_cached_stitch_mapping_nothing() {
    use Op::*;
    let a = |size| Alloc { size, stream: 0 };
    let ops = vec![
        a(69206017),
        Free(0),
        a(1),
        a(1),
        Free(0),
        Free(0),
        a(47395329),
        a(1),
        Alloc { size: 1, stream: 1 },
        a(59687425),
        a(59508737),
        Fault(8, 2),
        a(2098177),
        End,
        Free(6715709322208352440),
        a(16777216),
        a(2097152),
        Free(6775815307827027996),
        Free(9998212333208237700),
        a(2097152),
        Free(17415728934147182862),
        Fault(8, 1),
        Free(1022963167627904167),
        a(2097152),
        a(67108864),
        Free(14370425589737682990),
        a(35651584),
        a(68285953),
        a(35651584),
        a(35651584),
        Free(8822532959397732011),
        Begin(0, false),
        a(1),
        End,
        a(1),
        Free(8928222056613334742),
        a(35651584),
        Fault(11, 1),
        a(88080385),
        a(1),
    ];
    run("", 1024 * MIB, 0, ops);
}
