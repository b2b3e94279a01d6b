//! Fixes from the review of the CLI, each on a small trace written here or
//! on a shipped example.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{MIB, alloc, ev, ok, report, s, write_trace};
use gpualloc::trace::{EventKind, Pool, TraceEvent};

fn example(name: &str) -> String {
    format!("{}/../examples/{name}.gtrace", env!("CARGO_MANIFEST_DIR"))
}

fn segment(addr: u64, size: u64, alloc: bool) -> EventKind {
    let pool = Pool::Code(1);
    if alloc {
        EventKind::SegmentAlloc { addr, size, pool }
    } else {
        EventKind::SegmentFree { addr, size, pool }
    }
}

fn free(addr: u64, size: u64) -> [EventKind; 2] {
    [
        EventKind::FreeRequested {
            addr,
            requested: size,
            block_size: size,
        },
        EventKind::FreeCompleted {
            addr,
            requested: size,
            block_size: size,
        },
    ]
}

/// Writes a one-device trace of `events`, with `dropped` events lost
/// before the last of them when not 0.
fn trace(dir: &Path, name: &str, config: &str, events: &[TraceEvent], dropped: u64) -> PathBuf {
    write_trace(dir, name, config, events, dropped, true)
}

/// The Chrome counter keeps the last state of each microsecond, and the
/// state at the end of the trace.
#[test]
fn chrome_counter_keeps_each_microseconds_last_state() {
    let dir = tempfile::tempdir().unwrap();
    let [fr, fc] = free(0, 20 * MIB);
    let t = trace(
        dir.path(),
        "t.gtrace",
        "",
        &[
            ev(1_000, segment(0, 20 * MIB, true)),
            ev(1_000, alloc(0, 20 * MIB)),
            ev(2_500, fr),
            ev(2_500, fc),
            ev(2_600, segment(0, 20 * MIB, false)),
        ],
        0,
    );
    let json = dir.path().join("t.json");
    ok(&["export", s(&t), "--chrome", s(&json)]);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let counter: Vec<(f64, u64, u64)> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "C")
        .map(|e| {
            (
                e["ts"].as_f64().unwrap(),
                e["args"]["allocated"].as_u64().unwrap(),
                e["args"]["reserved"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        counter,
        vec![(1.0, 20 * MIB, 20 * MIB), (2.6, 0, 0)],
        "the allocation shows, and the trace ends with nothing reserved"
    );
}

fn summary_json(path: &str) -> serde_json::Value {
    serde_json::from_str(&ok(&["summary", "--json", path]).0).unwrap()
}

/// In gpualloc's page pool one call creates pages, maps them and then
/// allocates: "at peak reserved" is after that allocation.
#[test]
fn allocated_at_peak_reserved_counts_the_allocation_of_the_call() {
    let dir = tempfile::tempdir().unwrap();
    let map = EventKind::SegmentMap {
        addr: 0x1000_0000,
        size: 20 * MIB,
        pool: Pool::Code(1),
    };
    let t = trace(
        dir.path(),
        "pool.gtrace",
        "",
        &[
            ev(10, EventKind::PagesCreate { bytes: 20 * MIB }),
            ev(10, map),
            ev(10, alloc(0x1000_0000, 20 * MIB)),
        ],
        0,
    );
    let d = &summary_json(s(&t))["devices"][0];
    assert_eq!(d["allocated_at_peak_reserved"], 20 * MIB);
    // The ResNet-50 example peaks in both at one call.
    let d = &summary_json(&example("resnet50"))["devices"][0];
    assert_eq!(d["peak_reserved_ns"], d["peak_allocated_ns"]);
    assert_eq!(d["allocated_at_peak_reserved"], d["peak_allocated"]);
    // The streams' shares are taken there too.
    let d = &summary_json(&example("four-streams"))["devices"][0];
    let x = &d["streams_at_peak_reserved"];
    assert_eq!(x["unmapped"], 0, "the call's pages are mapped: {x}");
}

/// A trace exported to a snapshot and imported back keeps its
/// configuration (the memory limit the OOM ran into) and its time origin.
#[test]
fn a_snapshot_round_trip_keeps_the_configuration_and_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let original = example("yolo-style-oom");
    let pickle = dir.path().join("y.pickle");
    ok(&["export", &original, "--torch-snapshot", s(&pickle)]);
    let back = dir.path().join("y.gtrace");
    ok(&["import", s(&pickle), "-o", s(&back)]);
    let (a, b) = (summary_json(&original), summary_json(s(&back)));
    assert_eq!(a["config"], "memory_limit:1700MiB");
    assert_eq!(b["config"], a["config"]);
    let (da, db) = (&a["devices"][0], &b["devices"][0]);
    for key in ["peak_allocated_ns", "peak_active_ns"] {
        let (x, y) = (da[key].as_u64().unwrap(), db[key].as_u64().unwrap());
        assert!(x.abs_diff(y) < 1_000, "{key}: {x} became {y}");
    }
    let oom = |v: &serde_json::Value| v["oom_details"][0]["time_ns"].as_u64().unwrap();
    assert!(
        oom(da).abs_diff(oom(db)) < 1_000,
        "{} became {}",
        oom(da),
        oom(db)
    );
    let text = ok(&["summary", s(&back)]).0;
    assert!(text.contains("the memory limit left 14.00 MiB"), "{text}");
}

/// Every command says that the recorder dropped events: on stderr, and in
/// a `dropped` field of the JSON.
#[test]
fn every_command_says_events_were_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(
        dir.path(),
        "dropped.gtrace",
        "",
        &[
            ev(1_000, segment(0, 40 * MIB, true)),
            ev(1_000, alloc(0, 20 * MIB)),
            ev(3_000, alloc(20 * MIB, MIB)),
        ],
        4096,
    );
    let t = s(&t);
    let said = "4096 events were dropped";
    let out = |name: &str| s(&dir.path().join(name)).to_string();
    let text: [Vec<String>; 6] = [
        vec!["leaks".into(), t.into()],
        vec!["diff".into(), t.into(), t.into()],
        vec![
            "replay".into(),
            "--capacity".into(),
            "1GiB".into(),
            t.into(),
        ],
        vec!["export".into(), t.into(), "--chrome".into(), out("x.json")],
        vec![
            "export".into(),
            t.into(),
            "--torch-snapshot".into(),
            out("x.pickle"),
        ],
        vec!["export".into(), t.into(), "--csv".into(), out("x.csv")],
    ];
    for args in &text {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (_, err) = ok(&args);
        assert!(err.contains(said), "{args:?}: {err}");
    }
    let json = |args: &[&str]| -> serde_json::Value { serde_json::from_str(&ok(args).0).unwrap() };
    assert_eq!(json(&["leaks", "--json", t])["dropped"], 4096);
    assert_eq!(json(&["diff", "--json", t, t])["a"]["dropped"], 4096);
    assert_eq!(
        json(&["replay", "--json", "--capacity", "1GiB", t])[0]["dropped"],
        4096
    );
}

/// Two output options that name one file through different paths are
/// refused, naming both options, before anything is written.
#[test]
fn two_options_naming_one_output_file_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(
        dir.path(),
        "t.gtrace",
        "",
        &[ev(0, segment(0, MIB, true)), ev(0, alloc(0, MIB))],
        0,
    );
    // Relative to the working folder: `x.json` and `./x.json`.
    let out = Command::new(env!("CARGO_BIN_EXE_gpualloc"))
        .current_dir(dir.path())
        .args(["export", s(&t), "--chrome", "x.json", "--csv", "./x.json"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let x = dir.path().join("x.json");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--chrome") && err.contains("--csv") && err.contains("both name"),
        "{err}"
    );
    assert!(!x.exists(), "nothing written");
}

/// A trace without segments (an RMM log) records no capacity: the report
/// gives no advice replayed on a device of 0 B, and says reserved memory
/// was not recorded, as the summary does.
#[test]
fn report_without_segments_gives_no_advice_from_a_0_byte_device() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(
        dir.path(),
        "rmm.gtrace",
        "",
        &[
            ev(1_000, alloc(0x7f00_0000_0000, MIB)),
            ev(
                1_000_000,
                EventKind::Oom {
                    requested: 1 << 36,
                    device_free: 0,
                },
            ),
        ],
        0,
    );
    let page = report(&t);
    for wrong in [
        "simulated device of 0 B",
        "Reduce the batch",
        "cache held 0 B",
    ] {
        assert!(!page.contains(wrong), "the page says {wrong:?}");
    }
    assert!(page.contains("not recorded (the trace has no segment events)"));
    assert!(page.contains("Not replayed"));
}

/// Each device's events reach the file in blocks of their own, so a CSV
/// export of several devices goes back in time where one device's block
/// follows another's (a quiet device's block is written at the end). The
/// import reads each device's clock on its own: a step back between
/// devices is not a new day (the trace lasted 26 hours instead of 2), and
/// a device whose first row is earlier than the file's first row keeps
/// its time (it was moved to the trace's start).
#[test]
fn a_csv_of_several_devices_imports_with_its_own_times() {
    let dir = tempfile::tempdir().unwrap();
    let hour = 3_600_000_000_000;
    let on = |device, t, kind| TraceEvent::from_kind(t, device, 0, 1, kind);
    let [r0, c0] = free(0x1000, MIB);
    let [r1, c1] = free(0x9000_0000, MIB);
    let t = common::write_blocks(
        dir.path(),
        "two.gtrace",
        2,
        &[],
        [
            vec![
                on(0, 60_000_000_000, alloc(0x1000, MIB)),
                on(0, 2 * hour, r0),
                on(0, 2 * hour, c0),
            ],
            vec![
                on(1, 1_000_000_000, alloc(0x9000_0000, MIB)),
                on(1, 2 * hour + 1_000_000_000, r1),
                on(1, 2 * hour + 1_000_000_000, c1),
            ],
        ],
    );
    let csv = dir.path().join("two.csv");
    ok(&["export", s(&t), "--csv", s(&csv)]);
    let back = dir.path().join("back.gtrace");
    ok(&["import", s(&csv), "-o", s(&back)]);
    let summary = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&ok(&["summary", "--json", s(p)]).0).unwrap()
    };
    let (a, b) = (summary(&t), summary(&back));
    assert_eq!(b["duration_ns"], serde_json::json!(2 * hour));
    for d in 0..2 {
        assert_eq!(
            b["devices"][d]["peak_allocated_ns"].as_u64().unwrap(),
            a["devices"][d]["peak_allocated_ns"].as_u64().unwrap() - 1_000_000_000,
            "device {d}"
        );
    }
}

/// A device that reserved memory and never allocated (a trace cut short
/// after its first segment) has no ratio of reserved to allocated: `diff`
/// and the report must not divide by a made-up byte (20 MiB / 1 B).
#[test]
fn no_reserved_per_allocated_ratio_without_allocations() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(
        dir.path(),
        "reserved-only.gtrace",
        "",
        &[ev(1_000, segment(0x1000_0000, 20 * MIB, true))],
        0,
    );
    let (text, _) = ok(&["diff", s(&t), s(&t)]);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("peak reserved / peak"))
        .unwrap();
    assert!(line.contains("no allocations"), "{line}");
    assert!(!line.contains("20971520"), "{line}");
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["diff", "--json", s(&t), s(&t)]).0).unwrap();
    assert!(v["devices"][0]["a"]["reserved_per_allocated"].is_null());
    let page = report(&t);
    assert!(!page.contains("20971520.000"), "the report's ratio");
}

/// A trace of its header only: the report gives no size per event (61 B
/// "per event" of none) and says, as the summary does, that it holds no
/// events.
#[test]
fn the_report_of_a_trace_without_events_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(dir.path(), "empty.gtrace", "", &[], 0);
    let page = report(&t);
    assert!(
        !page.contains("bytes per event"),
        "a size per event of none"
    );
    assert!(
        page.contains("no events: the trace holds its header only"),
        "the page does not say that the trace is empty"
    );
}

/// Very large figures (a damaged or crafted file) saturate, as the other
/// byte counts do, rather than wrap: two `empty_cache` calls of 2^63 bytes
/// each gave back at least 2^63, never 0, and two private-pool segments of
/// 2^63 bytes held at least that much.
#[test]
fn empty_cache_and_private_pool_totals_saturate_instead_of_wrapping() {
    let dir = tempfile::tempdir().unwrap();
    let half = 1u64 << 63;
    let private = |addr| EventKind::SegmentAlloc {
        addr,
        size: half,
        pool: Pool::Code(2),
    };
    let t = trace(
        dir.path(),
        "huge.gtrace",
        "",
        &[
            ev(1, EventKind::EmptyCache { released: half }),
            ev(2, EventKind::EmptyCache { released: half }),
            ev(3, private(0)),
            ev(4, private(0)),
        ],
        0,
    );
    let v = summary_json(s(&t));
    let d = &v["devices"][0];
    assert_eq!(d["empty_cache"]["calls"], 2);
    assert_eq!(d["empty_cache"]["released"], u64::MAX, "{d}");
    assert_eq!(d["private_pools"]["peak_held"], u64::MAX, "{d}");
}
