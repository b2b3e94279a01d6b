//! What `gpualloc` prints: `--json` on `summary`, `leaks` and `diff` (stable
//! field names, numbers that agree with the text), sizes for people in the
//! tables, the `leaks` iteration count, and the messages for empty traces
//! and files that are not traces.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

mod common;
use common::{fails, s};

/// Runs a command that must succeed; returns its stdout.
fn ok(args: &[&str]) -> String {
    common::ok(args).0
}

fn json(args: &[&str]) -> Value {
    let text = ok(args);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn generated(dir: &Path, events: u64) -> PathBuf {
    common::generated(dir, events, 5)
}

const EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/gpt2-varlen.gtrace"
);

/// The text line that starts with `key`, after the key.
fn line<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix(key))
        .unwrap_or_else(|| panic!("no line {key}:\n{text}"))
        .trim()
}

#[test]
fn summary_json_has_stable_fields_that_agree_with_the_text() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 30_000);
    let v = json(&["summary", s(&t), "--json"]);
    let text = ok(&["summary", s(&t)]);
    for key in [
        "file",
        "events",
        "duration_ns",
        "file_bytes",
        "dropped",
        "warning",
        "producer",
        "pid",
        "device_count",
        "config",
        "devices",
    ] {
        assert!(v.get(key).is_some(), "summary --json lacks {key}: {v}");
    }
    assert_eq!(v["file"], s(&t));
    let d = &v["devices"][0];
    assert_eq!(d["device"], 0);
    let peak = d["peak_allocated"].as_u64().unwrap();
    assert!(peak > 0);
    assert!(d["peak_reserved"].as_u64().unwrap() >= peak);
    assert!(d["fragmentation_at_peak"]["external"].as_f64().is_some());
    let names: Vec<&str> = d["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"forward") && names.contains(&"optimizer"));
    assert_eq!(d["ooms"], 0);
    assert!(d["most_frequent_sizes"][0]["size"].as_u64().is_some());
    assert!(
        line(&text, "device 0:").contains(&format!("{} events", d["events"])),
        "{text}"
    );
    // The text prints the same peak, for people.
    let mib = format!("{:.2} MiB", peak as f64 / (1u64 << 20) as f64);
    assert!(line(&text, "peak allocated").starts_with(&mib), "{text}");
}

#[test]
fn summary_tables_print_sizes_for_people() {
    let text = ok(&["summary", EXAMPLE]);
    // 1,196,231 bytes, and sizes such as 9437184 B, for people.
    assert!(
        line(&text, "trace").contains("(1.14 MiB, 8.0 bytes/event)"),
        "{text}"
    );
    let frequent = line(&text, "most frequent");
    assert!(
        frequent.starts_with("3.00 KiB x4588, 9.00 MiB x1512, 24 B x1272"),
        "{text}"
    );
    let largest = line(&text, "largest");
    assert!(largest.starts_with("780.66 MiB x4"), "{text}");
    // Sizes that two decimals would print alike get four.
    let trainer = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/hf-trainer-gpt2.gtrace"
    );
    let largest = line(&ok(&["summary", trainer]), "largest").to_string();
    assert!(
        largest
            .starts_with("2.30 GiB x5, 2.29 GiB x5, 2.2796 GiB x10, 2.2766 GiB x5, 2.27 GiB x15"),
        "{largest}"
    );
    for l in text.lines() {
        let raw = l
            .split(|c: char| !c.is_ascii_digit())
            .any(|w| w.len() >= 5 && l.contains(&format!("{w} B")));
        assert!(!raw, "a raw byte count: {l}");
    }
}

#[test]
fn leaks_header_counts_the_iterations_the_rows_count() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 60_000);
    let text = ok(&["leaks", s(&t)]);
    let header = line(&text, "device 0:");
    let n: u32 = header
        .split(", ")
        .find_map(|p| p.strip_suffix(" iteration(s); 1 leak candidate group(s)"))
        .unwrap_or_else(|| panic!("{text}"))
        .parse()
        .unwrap();
    let row = text
        .lines()
        .find(|l| l.contains("optimizer") && l.trim_end().ends_with("yes"))
        .unwrap_or_else(|| panic!("{text}"));
    // The leak starts in the first iteration, so its count spans them all.
    assert!(row.contains(&format!("/{n} ")), "header {n}, row {row}");
    let v = json(&["leaks", s(&t), "--json"]);
    let d = &v["devices"][0];
    assert_eq!(d["iterations"], n);
    assert_eq!(d["candidates"], 1);
    let g = &d["groups"][0];
    assert_eq!(g["candidate"], true);
    assert_eq!(g["size"], 4096);
    assert_eq!(g["phase"], "optimizer");
    assert_eq!(g["iterations_since_first"], n);
    assert!(g["iterations_with_survivors"].as_u64().unwrap() >= 3);
    assert_eq!(
        d["alive_allocations"].as_u64().unwrap(),
        d["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["count"].as_u64().unwrap())
            .sum::<u64>()
    );
    // No marks and no phases: the whole trace is one iteration.
    let text = ok(&["leaks", EXAMPLE]);
    assert!(text.contains(", 1 iteration(s); 0 leak"), "{text}");
    assert!(text.contains(" 1/1 "), "{text}");
    let v = json(&["leaks", EXAMPLE, "--json", "--limit", "1"]);
    assert_eq!(v["devices"][0]["iterations"], 1);
    assert_eq!(v["devices"][0]["groups"].as_array().unwrap().len(), 1);
    assert_eq!(v["devices"][0]["groups_total"], 2);
}

#[test]
fn diff_json_puts_both_traces_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 20_000);
    let v = json(&["diff", s(&t), EXAMPLE, "--json"]);
    assert_eq!(v["a"]["file"], s(&t));
    assert_eq!(v["b"]["file"], EXAMPLE);
    assert_eq!(v["b"]["events"], 149_522);
    let d = &v["devices"][0];
    assert_eq!(d["device"], 0);
    for side in ["a", "b"] {
        for key in [
            "peak_allocated",
            "peak_reserved",
            "peak_active",
            "allocated_at_end",
            "reserved_unallocated_at_peak",
            "external_fragmentation_at_peak",
            "reserved_per_allocated",
            "ooms",
        ] {
            assert!(d[side].get(key).is_some(), "diff --json lacks {side}.{key}");
        }
    }
    let summary = json(&["summary", EXAMPLE, "--json"]);
    assert_eq!(
        d["b"]["peak_allocated"],
        summary["devices"][0]["peak_allocated"]
    );
    let ratio = d["b"]["reserved_per_allocated"].as_f64().unwrap();
    assert!((ratio - 1.007).abs() < 5e-4, "{ratio}");
}

#[test]
fn empty_traces_and_bad_magic_are_explained() {
    let dir = tempfile::tempdir().unwrap();
    let empty = generated(dir.path(), 0);
    let none = "no events: the trace holds its header only";
    assert!(ok(&["summary", s(&empty)]).contains(none));
    assert!(ok(&["leaks", s(&empty)]).contains(none));
    assert!(ok(&["diff", s(&empty), EXAMPLE]).contains(&format!("gen-0.gtrace: {none}")));
    let v = json(&["summary", s(&empty), "--json"]);
    assert_eq!(v["events"], 0);
    assert_eq!(v["devices"], serde_json::json!([]));

    let file = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let zero = file("zero.gtrace", b"");
    let err = fails(&["summary", s(&zero)]);
    assert!(err.contains("zero.gtrace: empty file (0 bytes)"), "{err}");
    let text = file("notes.gtrace", b"hello, world\n");
    let err = fails(&["leaks", s(&text)]);
    assert!(
        err.contains("not a gpualloc trace: it starts with \"hello, w\"")
            && err.contains("0x8947415452414345"),
        "{err}"
    );
    let binary = file("bin.gtrace", &[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0]);
    let err = fails(&["diff", s(&binary), EXAMPLE]);
    assert!(err.contains("it starts with 0x7f454c4602010100,"), "{err}");
    let cut = file("cut.gtrace", b"\x89GAT");
    let err = fails(&["summary", s(&cut)]);
    assert!(
        err.contains("truncated inside the magic (4 of its 8 bytes)"),
        "{err}"
    );
    let pickle = file("snap.pickle", b"\x80\x04\x95\x00\x00\x00\x00\x00");
    let err = fails(&["summary", s(&pickle)]);
    assert!(
        err.contains("0x8004950000000000") && err.contains("gpualloc import"),
        "{err}"
    );
}

/// `replay --json`: one object per configuration, with the peaks, their
/// ratio, the driver calls (by kind adding up to the totals) and their
/// predicted time, of which what the unmapping thread would take and what
/// defragmenting and stitching cost; leaving that thread out changes where
/// the time goes, not what is decided.
#[test]
fn replay_json_has_the_peaks_and_the_driver_time_by_thread() {
    let detector = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/detector-multiscale.gtrace"
    );
    let v = json(&[
        "replay",
        detector,
        "--capacity",
        "140GiB",
        "--json",
        "--config",
        "",
        "--config",
        "unmap_thread:false",
    ]);
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        let (reserved, allocated) = (
            r["peak_reserved"].as_f64().unwrap(),
            r["peak_allocated"].as_f64().unwrap(),
        );
        assert!((r["ratio"].as_f64().unwrap() - reserved / allocated).abs() < 1e-12);
        let kinds = r["driver_calls_by_kind"].as_object().unwrap();
        let calls: u64 = kinds.values().map(|k| k["calls"].as_u64().unwrap()).sum();
        assert_eq!(calls, r["driver_calls"].as_u64().unwrap());
        let ms: f64 = kinds.values().map(|k| k["ms"].as_f64().unwrap()).sum();
        assert!((ms - r["driver_ms"].as_f64().unwrap()).abs() < 1e-6, "{r}");
    }
    let (with, without) = (&rows[0], &rows[1]);
    let helper = with["helper_driver_ms"].as_f64().unwrap();
    assert!(
        helper > 0.0 && helper < with["driver_ms"].as_f64().unwrap(),
        "stitches torn down and moved pages go to the thread: {with}"
    );
    assert_eq!(without["helper_driver_ms"].as_f64(), Some(0.0));
    for key in [
        "peak_reserved",
        "peak_allocated",
        "ooms",
        "driver_calls",
        "driver_ms",
        "defragment_driver_ms",
    ] {
        assert_eq!(with[key], without[key], "{key}");
    }
    // Defragmenting and stitching: a part of the time, none without them.
    let defrag = with["defragment_driver_ms"].as_f64().unwrap();
    assert!(
        defrag > 0.0 && defrag < with["driver_ms"].as_f64().unwrap(),
        "{with}"
    );
    let v = json(&[
        "replay",
        detector,
        "--capacity",
        "140GiB",
        "--json",
        "--config",
        "defragment:false",
    ]);
    assert_eq!(v[0]["defragment_driver_ms"].as_f64(), Some(0.0), "{v}");
}

/// A reader that stops reading (`| head`) ends a command quietly, and a
/// stdout that cannot be written (a full disk behind a redirection) is an
/// error with a message; neither panics.
#[test]
fn a_closed_or_full_stdout_is_no_panic() {
    use std::process::Stdio;
    for cmd in [
        &["summary", EXAMPLE][..],
        &["summary", "--json", EXAMPLE],
        &["leaks", EXAMPLE],
        &["replay", "--capacity", "80GiB", EXAMPLE],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpualloc"))
            .args(cmd)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run gpualloc");
        drop(child.stdout.take()); // the reader is gone before anything is written
        let out = child.wait_with_output().expect("wait");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{cmd:?}: {err}");
        assert!(!err.contains("panicked"), "{cmd:?}: {err}");
        if Path::new("/dev/full").exists() {
            let full = std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/full")
                .unwrap();
            let out = Command::new(env!("CARGO_BIN_EXE_gpualloc"))
                .args(cmd)
                .stdout(full)
                .output()
                .expect("run gpualloc");
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{cmd:?}: {err}");
            assert!(err.contains("cannot write the output"), "{cmd:?}: {err}");
        }
    }
}

/// `replay` of a trace of two devices says that its peaks are the devices'
/// sums, and shows each device's beside them (in `--json` too).
#[test]
fn replay_of_several_devices_shows_each_and_says_the_peaks_add_up() {
    use gpualloc::trace::TraceOptions;
    use gpualloc::{Allocator, Config, SimBackend};
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("two.gtrace");
    let a = Allocator::new(
        Config::default(),
        2,
        Box::new(|d| Ok(SimBackend::new(1 << 30).for_device(d).with_wall_clock())),
    );
    a.trace_start_with(
        &trace,
        TraceOptions {
            lossless: true,
            ..TraceOptions::default()
        },
    )
    .unwrap();
    let p = a.malloc(0, 10 << 20, 0).unwrap();
    let q = a.malloc(1, 30 << 20, 0).unwrap();
    a.free(0, p).unwrap();
    a.free(1, q).unwrap();
    a.trace_stop().unwrap();
    let text = ok(&["replay", "--capacity", "1GiB", s(&trace)]);
    assert!(
        text.contains("2 simulated devices of 1.00 GiB each; peaks, calls and OOMs are their sums"),
        "{text}"
    );
    assert!(
        line(&text, "device 0 (reserved / allocated)").ends_with("/ 10.00 MiB"),
        "{text}"
    );
    assert!(
        line(&text, "device 1 (reserved / allocated)").ends_with("/ 30.00 MiB"),
        "{text}"
    );
    let v = json(&["replay", "--json", "--capacity", "1GiB", s(&trace)]);
    let devices = v[0]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    let sum: u64 = devices
        .iter()
        .map(|d| d["peak_allocated"].as_u64().unwrap())
        .sum();
    assert_eq!(v[0]["peak_allocated"].as_u64(), Some(sum));
    assert_eq!(sum, 40 << 20);
}

/// A truncated trace read with `--allow-truncated`: the text says so next
/// to the figures it qualifies, not only on stderr.
#[test]
fn a_truncated_trace_is_said_in_the_summary_itself() {
    let dir = tempfile::tempdir().unwrap();
    let full = std::fs::read(EXAMPLE).unwrap();
    let cut = dir.path().join("cut.gtrace");
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    let text = ok(&["summary", "--allow-truncated", s(&cut)]);
    assert!(line(&text, "warning").contains("truncated"), "{text}");
}

/// An OOM under a recorded memory limit: summary says what the limit left,
/// besides the device's free bytes (which the limit made irrelevant).
#[test]
fn an_oom_under_a_memory_limit_says_what_the_limit_left() {
    let yolo = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/yolo-style-oom.gtrace"
    );
    let text = ok(&["summary", yolo]);
    assert!(text.contains("(the memory limit left 14.00 MiB)"), "{text}");
    // The free block of 38.88 MiB beside the failed 30.25 MiB is explained,
    // as the report explains it.
    assert!(
        text.contains(
            "yet the request of 30.25 MiB failed: that memory was not the allocator's to take"
        ),
        "{text}"
    );
}

/// An allocation log without segments (RMM's CSV): summary says reserved
/// memory was not recorded rather than print 0 B and a ratio of 0.
#[test]
fn a_log_without_segments_has_no_reserved_figures() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("rmm.csv");
    std::fs::write(
        &csv,
        "Thread,Time,Action,Pointer,Size,Stream\n\
         1,10:00:00.000001,allocate,0x7f0000000000,4096,0x0\n\
         1,10:00:00.000002,allocate,0x7f0000001000,8192,0x0\n\
         1,10:00:00.000003,free,0x7f0000000000,4096,0x0\n",
    )
    .unwrap();
    let g = dir.path().join("rmm.gtrace");
    ok(&["import", s(&csv), "-o", s(&g)]);
    let text = ok(&["summary", s(&g)]);
    assert!(
        line(&text, "peak reserved").starts_with("not recorded"),
        "{text}"
    );
    assert!(
        !text.contains("reserved/allocated at the peaks 0.000"),
        "{text}"
    );
}

/// Whether a replay obtained the memory its recording did after every
/// allocation: a trace recorded by today's policy does, under its own
/// configuration; the detector's, recorded before round 40's reclaim
/// order, departs 2,567 events in; another configuration departs at once
/// where it chooses otherwise.
#[test]
fn replay_says_where_it_first_obtains_other_memory_than_the_recording() {
    let trace = |name: &str| format!("{}/../examples/{name}.gtrace", env!("CARGO_MANIFEST_DIR"));
    let small = trace("detector-batch1");
    let text = ok(&["replay", &small, "--capacity", "140GiB"]);
    assert_eq!(line(&text, "memory obtained as recorded"), "to the end");
    let v = json(&["replay", &small, "--capacity", "140GiB", "--json"]);
    assert!(v[0]["departure"].is_null(), "{v}");
    assert!(v[0]["devices"][0]["departure"].is_null(), "{v}");
    let v = json(&[
        "replay",
        &trace("detector-multiscale"),
        "--capacity",
        "140GiB",
        "--json",
    ]);
    let d = &v[0]["departure"];
    assert_eq!(d["event_index"], 2567, "{v}");
    assert_eq!(d["replayed_bytes"], 931_135_488u64, "{v}");
    assert_eq!(d["recorded_bytes"], 918_552_576u64, "{v}");
    let text = ok(&[
        "replay",
        &small,
        "--capacity",
        "140GiB",
        "--config",
        "defragment:false",
    ]);
    assert!(
        line(&text, "memory obtained as recorded").starts_with("until "),
        "{text}"
    );
}
