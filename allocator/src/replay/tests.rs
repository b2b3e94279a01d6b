//! Tests of `replay.rs` (a sibling file: the module's own file stays short).

use super::*;
use crate::allocator::Allocator;
use crate::rng::Rng;
use crate::trace::TraceReader;

/// Drives an allocator on the simulator with tracing on: mixed sizes,
/// three streams, `record_stream` with completions at random points,
/// `empty_cache`, and a capacity small enough to hit the release paths.
fn record(seed: u64, capacity: u64, conf: &str, steps: usize) -> (Vec<TraceEvent>, u64, u64, u64) {
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
    assert_eq!(
        r.departure, None,
        "seed {seed}, {capacity} bytes, {conf}: memory obtained after every allocation"
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
    let mut rng = Rng::xorshift64(2 * seed + 1);
    let mut live: Vec<(u64, u64)> = Vec::new();
    let mut clock = Rng::xorshift64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
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
        assert_eq!(r.departure, None, "seed {seed} ({conf}): memory obtained");
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
            let (_, u_pr, _, u_ooms) = record_ticking(seed, capacity, &unlimited, 3000, 50_000_000);
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
    let first: Vec<EventKind> = evs[..2].iter().map(|e| e.kind()).collect();
    assert_eq!(
        first,
        [
            EventKind::MemoryLimit {
                cap: MemoryCap::DeviceSize,
                device_total: capacity,
            },
            EventKind::MemoryLimit {
                cap: MemoryCap::Bytes(Some(300 << 20)),
                device_total: capacity,
            }
        ],
        "the device's size, then its cap"
    );
    let count = |a: Action| evs.iter().filter(|e| e.action == a).count() as u64;
    assert_eq!((count(Action::Alloc), count(Action::Oom)), (8 - ooms, ooms));
    assert_eq!(ooms, 3, "five 60 MiB requests fit under 300 MiB");
    let r = replay(evs.clone().into_iter(), capacity, &Config::default());
    assert_eq!((r.ooms, r.peak_reserved), (3, 300 << 20));
    let uncapped = replay(evs[2..].iter().copied(), capacity, &Config::default());
    assert_eq!(uncapped.ooms, 0, "without the record nothing fails");
    // A what-if fraction of a quarter (256 MiB) fails one more request.
    let quarter = Config::parse("per_process_memory_fraction:0.25").unwrap();
    assert_eq!(replay(evs.into_iter(), capacity, &quarter).ooms, 4);
}

/// A device's start cap (PyTorch's `per_process_memory_fraction`, Note
/// [PyTorch's settings under gpualloc]) binds from its first request and
/// is recorded in the trace, whether the device starts before the trace
/// or during it, so a replay under the header's configuration fails the
/// same requests; `set_per_process_memory_fraction` replaces it.
#[test]
fn a_start_fraction_binds_from_the_first_request_and_is_recorded() {
    let capacity = 1u64 << 30;
    for device_first in [false, true] {
        let a = Allocator::new(
            Config::default(),
            1,
            Box::new(move |_| Ok(SimBackend::new(capacity))),
        )
        .with_start_fraction(Some(0.25))
        .unwrap();
        assert_eq!(a.start_fraction(), 0.25);
        if device_first {
            assert_eq!(a.lock(0).unwrap().memory_fraction(), 0.25);
        }
        let path = crate::trace::control_tests_path(&format!("start-fraction-{device_first}"));
        a.trace_start(&path).unwrap();
        let mut ooms = 0;
        for _ in 0..6 {
            ooms += u64::from(a.malloc(0, 60 << 20, 0).is_err());
        }
        assert_eq!(ooms, 2, "four 60 MiB requests fit under 256 MiB");
        a.set_memory_fraction(0, 1.0).unwrap();
        assert!(
            a.malloc(0, 60 << 20, 0).is_ok(),
            "the fraction set replaces it"
        );
        a.trace_stop().unwrap();
        let evs: Vec<TraceEvent> = TraceReader::open(&path).unwrap().events().collect();
        std::fs::remove_file(&path).unwrap();
        let quarter = EventKind::MemoryLimit {
            cap: MemoryCap::fraction(0.25),
            device_total: capacity,
        };
        let caps: Vec<EventKind> = evs
            .iter()
            .filter(|e| e.action == Action::MemoryLimit)
            .map(|e| e.kind())
            .filter(|k| {
                !matches!(
                    k,
                    EventKind::MemoryLimit {
                        cap: MemoryCap::DeviceSize,
                        ..
                    }
                )
            })
            .collect();
        assert_eq!(caps.len(), 2, "the start cap and the one set");
        assert_eq!(caps[0], quarter);
        let r = replay(evs.clone().into_iter(), capacity, &Config::default());
        assert_eq!(r.ooms, 2, "device started first: {device_first}");
    }
    let bad = Allocator::new(
        Config::default(),
        1,
        Box::new(move |_| Ok(SimBackend::new(capacity))),
    )
    .with_start_fraction(Some(1.5));
    assert!(bad.is_err());
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

#[test]
fn the_calls_after_a_split_are_those_its_later_events_make() {
    let (evs, ..) = record_ticking(12, 1 << 30, "", 3000, 2_000_000);
    let c = Config::default();
    let plain = replay(evs.iter().copied(), 1 << 30, &c);
    assert_eq!(plain.devices[0].driver_from_split, None, "no split asked");
    let at = |t: u64| replay_split(evs.iter().copied(), 1 << 30, &c, &BTreeMap::from([(0, t)]));
    let all = at(0);
    assert_eq!(
        all.devices[0].driver_from_split,
        Some(all.devices[0].driver)
    );
    let end = evs.last().unwrap().time_ns;
    assert_eq!(
        at(end + 1).devices[0].driver_from_split,
        Some(DriverCalls::default())
    );
    let mid = evs[evs.len() / 2].time_ns;
    let half = at(mid);
    // The same replay otherwise.
    let mut same = half.clone();
    same.devices[0].driver_from_split = None;
    assert_eq!(same, plain);
    // What the events before `mid` made, observed as they were applied.
    let mut before = None;
    replay_observed(evs.iter().copied(), 1 << 30, &c, &mut |i, d| {
        if evs.get(i as usize + 1).is_some_and(|e| e.time_ns >= mid) && before.is_none() {
            before = Some(d.driver_calls());
        }
    });
    let later = half.devices[0].driver_from_split.unwrap();
    assert_eq!(later, plain.devices[0].driver.since(&before.unwrap()));
    assert!(later.memory_calls() > 0 && later.memory_calls() < plain.driver.memory_calls());
    // A device the split does not name gets none.
    let other = replay_split(evs.iter().copied(), 1 << 30, &c, &BTreeMap::from([(1, 0)]));
    assert_eq!(other.devices[0].driver_from_split, None);
}

/// Blocks used on another stream complete when the device gets there; the
/// recorded allocator learned that by polling their events, so the replay
/// counts the polls and no host wait (it had counted a wait per event).
#[test]
fn completions_the_recording_polled_are_no_waits_in_the_replay() {
    use crate::backend::Backend;
    use crate::cost::DriverCall;
    let a = Allocator::new(
        Config::default(),
        1,
        Box::new(|_| Ok(SimBackend::new(1 << 30))),
    );
    let path = crate::trace::control_tests_path("replay-polled");
    a.trace_start(&path).unwrap();
    for _ in 0..8 {
        let p = a.malloc(0, 4 << 20, 0).unwrap();
        a.record_stream(0, p, 1).unwrap();
        a.free(0, p).unwrap();
        a.lock(0).unwrap().backend_mut().complete(1);
        // Polls the events: the block above becomes free here, and
        // serves this request.
        let q = a.malloc(0, 4 << 20, 0).unwrap();
        a.free(0, q).unwrap();
    }
    a.trace_stop().unwrap();
    let recorded = a.lock(0).unwrap().backend().driver_calls();
    let mut r = TraceReader::open(&path).unwrap();
    let evs: Vec<TraceEvent> = r.events().collect();
    std::fs::remove_file(&path).unwrap();
    // Each plain free completes at once; the 8 shared blocks' later.
    assert_eq!(
        evs.iter()
            .filter(|e| e.action == Action::FreeCompleted)
            .count(),
        16
    );
    let replayed = replay(evs.into_iter(), 1 << 30, &Config::default()).driver;
    assert_eq!(recorded.calls(DriverCall::EventSync), 0);
    for call in [
        DriverCall::EventSync,
        DriverCall::EventQuery,
        DriverCall::EventRecord,
    ] {
        assert_eq!(replayed.calls(call), recorded.calls(call), "{call:?}");
    }
}

/// A replay that fails an allocation the recording served has departed,
/// whatever it had obtained by then.
#[test]
fn a_replay_that_fails_what_the_recording_served_departs() {
    let (evs, ..) = record(1, 4 << 30, "", 1000);
    let r = replay(evs.iter().copied(), 1 << 20, &Config::default());
    assert!(r.ooms > 0);
    let d = r.departure.expect("the first failed allocation departs");
    assert!(d.event_index <= r.first_oom.as_ref().unwrap().event_index);
}

/// Runs `scenario` (one of `capture_reuse/tests.rs`'s, with 8 MiB
/// tensors; it returns the block freed and the allocation that should
/// reuse it) with reuse inside a capture on, through an [`Allocator`] that
/// records a trace, and without it on a device of its own: asserts that
/// the block was reused only with it on, saving 8 MiB of reserved memory,
/// that the trace frees it before the reuse, and that the trace replays
/// to the recording's peaks under either setting (the trace tells where
/// the block was freed).
fn replays_capture_reuse(
    name: &str,
    scenario: impl Fn(&mut crate::device::DeviceAllocator<SimBackend>) -> (u64, u64),
) {
    let conf = Config::parse("graph_capture_record_stream_reuse:true").unwrap();
    let a = Allocator::new(conf.clone(), 1, Box::new(|_| Ok(SimBackend::new(1 << 30))));
    let path = crate::trace::control_tests_path(name);
    a.trace_start(&path).unwrap();
    let (freed, reuse) = scenario(&mut a.lock(0).unwrap());
    assert_eq!(freed, reuse, "{name}: reused");
    a.trace_stop().unwrap();
    let s = a.stats(0).unwrap();
    let mut r = TraceReader::open(&path).unwrap();
    let evs: Vec<TraceEvent> = r.events().collect();
    std::fs::remove_file(&path).unwrap();
    let completed = evs
        .iter()
        .rposition(|e| e.action == Action::FreeCompleted && e.addr == freed)
        .unwrap();
    let reused = evs
        .iter()
        .rposition(|e| e.action == Action::Alloc && e.addr == reuse)
        .unwrap();
    assert!(completed < reused, "{name}: freed before the reuse");
    let mut off = crate::capture_reuse::tests::device("");
    let (freed, reuse) = scenario(&mut off);
    assert_ne!(freed, reuse, "{name}: reused with the setting off");
    assert_eq!(
        off.stats.reserved_bytes.all.peak,
        s.reserved_bytes.all.peak + (8 << 20),
        "{name}: without the reuse, the pool grows by a block"
    );
    for config in [conf, Config::default()] {
        let r = replay(evs.clone().into_iter(), 1 << 30, &config);
        assert_eq!(
            (r.peak_reserved, r.peak_allocated),
            (
                s.reserved_bytes.all.peak as u64,
                s.allocated_bytes.all.peak as u64
            ),
            "{name}: replay against recording"
        );
        assert_eq!(r.departure, None);
    }
}

/// PyTorch's two-stream test of reuse inside a capture (Note [Reuse
/// inside a capture]).
#[test]
fn a_recording_replays_the_reuse_inside_the_capture() {
    use crate::capture_reuse::tests::two_streams_of;
    replays_capture_reuse("capture-reuse", |d| {
        let (data1, _, data3) = two_streams_of(d, 8 << 20);
        (data1, data3)
    });
}

/// A block freed when its capture's scope closes, and reused by the next
/// capture into the same pool.
#[test]
fn a_recording_replays_the_free_at_a_captures_end() {
    use crate::capture_reuse::tests::shared_pool;
    replays_capture_reuse("capture-end-free", |d| shared_pool(d, 8 << 20));
}
