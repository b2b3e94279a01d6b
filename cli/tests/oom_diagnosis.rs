//! What the CLI says about an OOM: its cause under a memory fraction and
//! without reserved memory, the report's candidates (replayed on the device
//! that failed alone), and `replay` on a trace without an END block.

mod common;

use std::path::{Path, PathBuf};

use common::{GIB, MIB, alloc, ev, ok, report, s, write_trace};
use gpualloc::trace::{EventKind, MemoryCap, Pool, TraceEvent, TraceOptions};
use gpualloc::{Allocator, Config, SimBackend};

fn segment(addr: u64, size: u64) -> EventKind {
    EventKind::SegmentAlloc {
        addr,
        size,
        pool: Pool::Code(1),
    }
}

fn oom(requested: u64, device_free: u64) -> EventKind {
    EventKind::Oom {
        requested,
        device_free,
    }
}

/// Writes a one-device trace of `events`, with an END block when `end`.
fn trace(dir: &Path, name: &str, config: &str, events: &[TraceEvent], end: bool) -> PathBuf {
    write_trace(dir, name, config, events, 0, end)
}

/// 6 GiB allocated and reserved, then a request of 1 GiB fails with 2 GiB
/// free on the device.
fn six_gib_live_then_an_oom() -> Vec<TraceEvent> {
    vec![
        ev(1_000, segment(0x7f00_0000_0000, 6 * GIB)),
        ev(1_000, alloc(0x7f00_0000_0000, 6 * GIB)),
        ev(2_000, oom(GIB, 2 * GIB)),
    ]
}

/// 6 GiB allocated and reserved, 2 GiB free on the device (an 8 GiB
/// device), a request of 1 GiB under `per_process_memory_fraction:0.8`: the
/// cap (6.4 GiB) left 409.6 MiB, not the device's 2 GiB.
#[test]
fn a_memory_fraction_caps_what_an_oom_had_left() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(
        dir.path(),
        "frac.gtrace",
        "per_process_memory_fraction:0.8",
        &six_gib_live_then_an_oom(),
        true,
    );
    let (text, _) = ok(&["summary", s(&t)]);
    assert!(
        text.contains("device free 2.00 GiB (the memory limit left 409.60 MiB)"),
        "{text}"
    );
    let page = report(&t);
    assert!(
        page.contains("live tensors hold 6.00 GiB and the memory limit left 409.60 MiB"),
        "the cause does not name the cap"
    );
    assert!(!page.contains("neither alone"), "called a split cache");
    // Replayed on the whole device, the cap applied once, in every row.
    assert!(page.contains("simulated device of 8.00 GiB"));
    assert!(page.contains("policy:gpualloc,per_process_memory_fraction:0.8"));
}

/// A trace of [`six_gib_live_then_an_oom`] under `config`, after the
/// program set a fraction of 0.8 (a `memory_limit` record carrying
/// `device_total`, 0 for not known).
fn fraction_set_while_running(dir: &Path, name: &str, config: &str, device_total: u64) -> PathBuf {
    let cap = EventKind::MemoryLimit {
        cap: MemoryCap::fraction(0.8),
        device_total,
    };
    let events = [vec![ev(500, cap)], six_gib_live_then_an_oom()].concat();
    trace(dir, name, config, &events, true)
}

/// The same OOM with the fraction set while the program ran (a
/// `memory_limit` record; the configuration has none): the summary names
/// the cap and what it left, and the report's cause names it too.
#[test]
fn a_fraction_set_while_running_caps_what_an_oom_had_left() {
    let dir = tempfile::tempdir().unwrap();
    let t = fraction_set_while_running(dir.path(), "frac-run.gtrace", "", 0);
    let (text, _) = ok(&["summary", s(&t)]);
    assert!(
        text.contains("caps set        fraction 0.800 of the device"),
        "{text}"
    );
    assert!(
        text.contains("device free 2.00 GiB (the memory limit left 409.60 MiB)"),
        "{text}"
    );
    let (json, _) = ok(&["summary", "--json", s(&t)]);
    assert!(json.contains("\"caps_set\""), "{json}");
    let page = report(&t);
    assert!(
        page.contains("live tensors hold 6.00 GiB and the memory limit left 409.60 MiB"),
        "the cause does not name the cap"
    );
}

/// A record that carries the device's memory as the allocator read it
/// (8.5 GiB: more than reserved plus free, 8 GiB, as when the CUDA
/// context holds some): the fraction is taken of it, as the allocator took
/// it, and the report replays on a device of that size.
#[test]
fn a_recorded_device_total_is_what_a_fraction_is_taken_of() {
    let dir = tempfile::tempdir().unwrap();
    let t = fraction_set_while_running(dir.path(), "frac-total.gtrace", "", 8 * GIB + GIB / 2);
    let (text, _) = ok(&["summary", s(&t)]);
    assert!(
        text.contains("device free 2.00 GiB (the memory limit left 819.20 MiB)"),
        "{text}"
    );
    assert!(
        text.contains("caps set        fraction 0.800 of the device (6.80 GiB of 8.50 GiB)"),
        "{text}"
    );
    assert!(report(&t).contains("simulated device of 8.50 GiB"));
    // A replay on another device says that the fraction caps other bytes.
    let (_, err) = ok(&["replay", "--capacity", "8GiB", s(&t)]);
    assert!(
        err.contains("the program set a fraction of a device of 9126805504 bytes; this replay takes it of 8589934592"),
        "{err}"
    );
    let (_, err) = ok(&["replay", "--capacity", "9126805504", s(&t)]);
    assert!(!err.contains("fraction of a device"), "{err}");
}

/// A trace recorded with a configuration key this build does not know
/// (another version's): the caps still count, the one the program set
/// while it ran and the recorded configuration's own.
#[test]
fn caps_count_when_the_recorded_configuration_does_not_parse_here() {
    let dir = tempfile::tempdir().unwrap();
    let t = fraction_set_while_running(
        dir.path(),
        "later-key.gtrace",
        "a_key_of_a_later_version:1",
        0,
    );
    let (text, _) = ok(&["summary", s(&t)]);
    assert!(
        text.contains("device free 2.00 GiB (the memory limit left 409.60 MiB)"),
        "{text}"
    );
    let t = trace(
        dir.path(),
        "later-key-conf.gtrace",
        "a_key_of_a_later_version:1,per_process_memory_fraction:0.8",
        &six_gib_live_then_an_oom(),
        true,
    );
    let (text, _) = ok(&["summary", s(&t)]);
    assert!(
        text.contains("(the memory limit left 409.60 MiB)"),
        "{text}"
    );
    assert!(
        report(&t).contains("live tensors hold 6.00 GiB and the memory limit left 409.60 MiB"),
        "the report's cause does not name the cap"
    );
}

/// A trace without segment events (an RMM log): free and reserved memory
/// are unknown, never 0 B, in the summary, the report and `diff`.
#[test]
fn a_trace_without_reserved_memory_says_what_is_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(
        dir.path(),
        "rmm.gtrace",
        "",
        &[
            ev(1_000, alloc(0x7f00_0000_0000, MIB)),
            ev(2_000, oom(GIB, 0)),
        ],
        true,
    );
    let (text, _) = ok(&["summary", s(&t)]);
    assert!(
        text.contains("allocated 1.00 MiB; free and reserved memory unknown"),
        "{text}"
    );
    let v: serde_json::Value = serde_json::from_str(&ok(&["summary", "--json", s(&t)]).0).unwrap();
    let o = &v["devices"][0]["oom_details"][0];
    assert!(o["device_free"].is_null() && o["reserved"].is_null(), "{o}");
    let page = report(&t);
    assert!(page.contains("what was free in the cache and on the device is unknown"));
    assert!(!page.contains("the device left 0 B"));
    let (diff, _) = ok(&["diff", s(&t), s(&t)]);
    for row in [
        "peak reserved",
        "reserved unallocated",
        "peak reserved / peak",
    ] {
        let line = diff
            .lines()
            .find(|l| l.trim_start().starts_with(row))
            .unwrap();
        assert!(line.contains("not recorded"), "{line}");
        assert!(!line.contains("0 B") && !line.contains("0.000"), "{line}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["diff", "--json", s(&t), s(&t)]).0).unwrap();
    let a = &v["devices"][0]["a"];
    for key in [
        "peak_reserved",
        "reserved_unallocated_at_peak",
        "external_fragmentation_at_peak",
        "reserved_per_allocated",
    ] {
        assert!(a[key].is_null(), "{key}: {a}");
    }
    assert_eq!(a["peak_allocated"], MIB);
}

/// `replay` warns of a missing END block, as every other command does.
#[test]
fn replay_warns_of_a_missing_end_block() {
    let dir = tempfile::tempdir().unwrap();
    let events = [
        ev(100, segment(0x100_0000, 20 * MIB)),
        ev(110, alloc(0x100_0000, 10 * MIB)),
    ];
    let t = trace(dir.path(), "noend.gtrace", "", &events, false);
    let (_, err) = ok(&["replay", "--capacity", "1GiB", s(&t)]);
    assert!(
        err.contains("no END block: the recording process stopped without trace_stop; the 2 events written before it are used"),
        "{err}"
    );
    let t = trace(dir.path(), "end.gtrace", "", &events, true);
    let (_, err) = ok(&["replay", "--capacity", "1GiB", s(&t)]);
    assert!(!err.contains("no END block"), "{err}");
}

/// Records, with the simulated allocator under `policy:pytorch`, a run on
/// two devices: device 0 (2010 MiB, shared with another tenant) fragments
/// and fails a 16 MiB request with 800 MiB live; device 1 (8 GiB) holds
/// 3 GiB of tensors and never fails.
fn two_devices(dir: &Path) -> PathBuf {
    let out = dir.join("two.gtrace");
    let config = Config::parse("policy:pytorch").unwrap();
    let a = Allocator::new(
        config,
        2,
        Box::new(|d| {
            Ok(SimBackend::new(if d == 0 { 2010 * MIB } else { 8192 * MIB }).with_wall_clock())
        }),
    );
    a.trace_start_with(
        &out,
        TraceOptions {
            lossless: true,
            ..TraceOptions::default()
        },
    )
    .unwrap();
    // Device 1: 3 GiB of tensors, kept.
    let mut keep1 = Vec::new();
    for _ in 0..30 {
        keep1.push(a.malloc(1, 100 * MIB, 0).unwrap());
    }
    // Device 0: two 8 MiB blocks per 20 MiB segment until the device is
    // full, then the second of each pair freed: 12 MiB free per segment.
    let mut pairs = Vec::new();
    for _ in 0..100 {
        let x = a.malloc(0, 8 * MIB, 0).unwrap();
        let y = a.malloc(0, 8 * MIB, 0).unwrap();
        pairs.push((x, y));
    }
    for (_, y) in &pairs {
        a.free(0, *y).unwrap();
    }
    let failed = a.malloc(0, 16 * MIB, 0);
    assert!(failed.is_err(), "the request fails on device 0");
    a.trace_stop().unwrap();
    drop(keep1);
    out
}

/// The report's advice for an OOM replays the device that failed: under
/// `policy:gpualloc` (and PyTorch's expandable segments) device 0 no longer
/// fails, as `replay --json` shows per device; device 1's tensors, which
/// never failed on their own 8 GiB device, must not be replayed on device
/// 0's 1.96 GiB and counted against every candidate.
#[test]
fn report_advice_replays_only_the_device_that_failed() {
    let dir = tempfile::tempdir().unwrap();
    let t = two_devices(dir.path());
    // Device 0 alone fits under policy:gpualloc in replay.
    let (json, _) = ok(&[
        "replay",
        s(&t),
        "--capacity",
        "2010MiB",
        "--json",
        "--config",
        "policy:gpualloc",
    ]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v[0]["devices"][0]["device"], 0);
    assert_eq!(
        v[0]["devices"][0]["ooms"], 0,
        "device 0 fits under policy:gpualloc"
    );
    let page = report(&t);
    let dev0 =
        &page[page.find("data-device=\"0\"").unwrap()..page.find("data-device=\"1\"").unwrap()];
    assert!(
        !dev0.contains("No configuration tried avoids"),
        "device 0's advice counts device 1's replayed OOMs"
    );
    assert!(
        dev0.contains("the run fits"),
        "no remedy named for device 0"
    );
}

/// A trace recorded with a configuration this build does not parse (a key
/// of a later version) cannot be replayed under it: the report must not
/// take the first candidate for the recorded configuration, neither in the
/// table, nor in the cause ("Replayed under the recorded configuration"),
/// nor by leaving that candidate out of the advice.
#[test]
fn report_advice_does_not_pass_a_candidate_off_as_an_unparsed_recorded_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(
        dir.path(),
        "later-key-advice.gtrace",
        "a_key_of_a_later_version:1",
        &six_gib_live_then_an_oom(),
        true,
    );
    let page = report(&t);
    assert!(
        !page.contains("(the trace&#39;s configuration)")
            && !page.contains("(the trace's configuration)"),
        "a candidate labelled as the recorded configuration"
    );
    assert!(
        !page.contains("Replayed under the recorded configuration"),
        "a candidate's replay told as the recorded configuration's"
    );
    assert!(
        page.contains("does not parse in this build"),
        "the page does not say why the recorded configuration was not replayed"
    );
    // Every candidate is in the table, none of them taken as the base.
    for c in gpualloc_candidates() {
        assert!(page.contains(&format!("<code>{c}</code>")), "{c} missing");
    }
}

/// The candidates the report replays (`report::oom::CANDIDATES`).
fn gpualloc_candidates() -> [&'static str; 4] {
    [
        "policy:pytorch,expandable_segments:true,defragment:false,stitch_min_mb:0,expandable_page_mb:20",
        "policy:pytorch,max_split_size_mb:64,garbage_collection_threshold:0.8",
        "policy:gpualloc",
        "policy:gpualloc,defragment_headroom:0.05",
    ]
}

/// The device reported 2 GiB free, enough for the 1 GiB request on its
/// own, and the cache nothing: the cause must not say that the cache and
/// the device were "together enough, but neither alone", nor blame the
/// cache for memory it did not hold.
#[test]
fn an_oom_with_room_on_the_device_is_not_blamed_on_a_split_cache() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(
        dir.path(),
        "device-room.gtrace",
        "",
        &six_gib_live_then_an_oom(),
        true,
    );
    let page = report(&t);
    assert!(!page.contains("neither alone"), "called a split cache");
    assert!(
        !page.contains("the cache held memory it could have given back"),
        "the cache, empty, blamed"
    );
    assert!(
        page.contains("2.00 GiB free on the device, at least the request of 1.00 GiB"),
        "the cause does not say that the device had room"
    );
}

/// When the replay under the recorded configuration does not fail, every
/// candidate that does not fail either proves nothing: the report must not
/// say that one of them makes the run fit, nor advise it, as if the
/// recorded configuration had failed in the replay.
#[test]
fn no_configuration_is_advised_when_the_recorded_one_does_not_fail_in_replay() {
    let dir = tempfile::tempdir().unwrap();
    // 6 GiB live, 2 GiB free: the 1 GiB request fits on replay.
    let t = trace(
        dir.path(),
        "not-reproduced.gtrace",
        "",
        &six_gib_live_then_an_oom(),
        true,
    );
    let page = report(&t);
    assert!(
        page.contains("does not reproduce the OOM"),
        "the replay's miss is not said"
    );
    assert!(!page.contains("the run fits"), "a candidate credited");
    assert!(
        !page.contains("Use <code>GPUALLOC_CONF="),
        "a candidate advised"
    );
    assert!(
        !page.contains("No configuration tried avoids the OOM in replay"),
        "the recorded configuration does not fail in replay either"
    );
}
