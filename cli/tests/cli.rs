//! The `gpualloc` command end to end, on traces it generates itself.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{gpualloc, s};

/// Runs a command that must succeed; returns its stdout.
fn ok(args: &[&str]) -> String {
    common::ok(args).0
}

/// Runs a failing command; returns stderr after checking it failed cleanly.
fn fails(args: &[&str]) -> String {
    let err = common::fails(args);
    assert!(err.starts_with("gpualloc: "), "{err}");
    err
}

fn generated(dir: &Path, events: u64) -> PathBuf {
    common::generated(dir, events, 3)
}

#[test]
fn summary_reports_peaks_phases_and_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 50_000);
    let out = ok(&["summary", s(&t)]);
    for want in [
        "peak allocated",
        "peak reserved",
        "peak active",
        "fragmentation at peak allocated",
        "forward",
        "backward",
        "optimizer",
        "most frequent",
        "OOMs",
    ] {
        assert!(out.contains(want), "summary lacks {want}:\n{out}");
    }
    let bytes_per_event: f64 = out
        .split("B, ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(bytes_per_event <= 32.0, "{bytes_per_event} bytes per event");
}

#[test]
fn bad_inputs_fail_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let err = fails(&["summary", s(&dir.path().join("missing.gtrace"))]);
    assert!(err.contains("missing.gtrace: cannot open"), "{err}");
    let t = generated(dir.path(), 30_000);
    let bytes = std::fs::read(&t).unwrap();
    let cut = dir.path().join("cut.gtrace");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails(&["summary", s(&cut)]);
    assert!(
        err.contains("truncated") && err.contains("--allow-truncated"),
        "{err}"
    );
    let out = ok(&["summary", s(&cut), "--allow-truncated"]);
    assert!(out.contains("peak allocated"));
    let mut bad = bytes.clone();
    let mid = bad.len() / 3;
    bad[mid] ^= 0x55;
    let corrupt = dir.path().join("corrupt.gtrace");
    std::fs::write(&corrupt, &bad).unwrap();
    let err = fails(&["leaks", s(&corrupt)]);
    assert!(
        err.contains("corrupt") || err.contains("malformed"),
        "{err}"
    );
    let csv = dir.path().join("log.csv");
    std::fs::write(&csv, "Thread,Time,Action,Pointer,Size,Stream\n").unwrap();
    let err = fails(&["summary", s(&csv)]);
    assert!(
        err.contains("not a gpualloc trace") && err.contains("gpualloc import"),
        "{err}"
    );
    let header_only = dir.path().join("header.gtrace");
    std::fs::write(&header_only, &bytes[..10]).unwrap();
    let err = fails(&[
        "report",
        s(&header_only),
        "-o",
        s(&dir.path().join("x.html")),
    ]);
    assert!(err.contains("truncated"), "{err}");
    let err = fails(&["replay", s(&t), "--capacity", "lots"]);
    assert!(err.contains("--capacity"), "{err}");
    let err = fails(&["replay", s(&t), "--capacity", "1GiB", "--config", "bogus:1"]);
    assert!(err.contains("bogus"), "{err}");
}

/// A trace without events has no size per event: the header's bytes are
/// not divided by one event that does not exist.
#[test]
fn summary_of_an_empty_trace_gives_no_bytes_per_event() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 0);
    let out = ok(&["summary", s(&t)]);
    let first = out.lines().next().unwrap();
    assert!(first.starts_with("trace      0 events over "), "{first}");
    assert!(!first.contains("bytes/event"), "{first}");
}

#[test]
fn report_is_one_self_contained_page() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 50_000);
    let page = common::report(&t);
    assert!(page.starts_with("<!DOCTYPE html>") && page.trim_end().ends_with("</html>"));
    for banned in [
        "http://",
        "https://",
        "src=",
        "<link",
        "@import",
        "fetch(",
        "XMLHttpRequest",
    ] {
        assert!(
            !page.contains(banned),
            "the page must not fetch anything: found {banned}"
        );
    }
    for want in [
        "id=\"timeline-0\"",
        "id=\"frag-0\"",
        "id=\"layout-0\"",
        "id=\"steps-0\"",
        "Per-phase peaks",
        "Request sizes",
        "Leak candidates",
        "Out-of-memory forensics",
        "Tensors or cache?",
    ] {
        assert!(page.contains(want), "report lacks {want}");
    }
    // The chart data: inline JSON with a layout at the peak and per-step peaks.
    let start = page.find("id=\"gpualloc-data\">").unwrap() + "id=\"gpualloc-data\">".len();
    let end = start + page[start..].find("</script>").unwrap();
    let data: serde_json::Value = serde_json::from_str(&page[start..end]).unwrap();
    let dev = &data["devices"][0];
    assert!(
        dev["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["kind"] == "peak allocated")
    );
    assert!(
        dev["steps"].as_array().unwrap().len() > 5,
        "marks every tenth step"
    );
    assert_eq!(
        data["names"].as_array().unwrap().len(),
        4,
        "three phases and the mark"
    );
}

#[test]
fn leaks_finds_the_growing_group() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 60_000);
    let out = ok(&["leaks", s(&t)]);
    let line = out
        .lines()
        .find(|l| l.contains("4.00 KiB") && l.contains("optimizer"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(line.trim_end().ends_with("yes"), "{out}");
}

#[test]
fn replay_compares_configurations_deterministically() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 40_000);
    let args = [
        "replay",
        s(&t),
        "--capacity",
        "2GiB",
        "--config",
        "",
        "--config",
        "policy:pytorch",
    ];
    let a = ok(&args);
    assert_eq!(a, ok(&args), "same trace and configuration, same numbers");
    assert!(
        a.contains("(defaults)") && a.contains("policy:pytorch"),
        "{a}"
    );
    let summary = ok(&["summary", s(&t)]);
    let peak = |text: &str, key: &str| -> String {
        text.lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap()
            .split_whitespace()
            .skip(2)
            .take(2)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(
        peak(&a, "peak reserved"),
        peak(&summary, "peak reserved"),
        "replaying the recording config reproduces its peak"
    );
    let tiny = ok(&["replay", s(&t), "--capacity", "64MiB"]);
    assert!(
        tiny.lines()
            .any(|l| l.starts_with("first OOM") && !l.contains("none")),
        "{tiny}"
    );
}

/// Without `--capacity`, a replay runs on a device of the memory the
/// recording's device had (traces tell it from minor 5 on); a trace that
/// does not tell it fails naming the option to pass.
#[test]
fn replay_takes_the_recorded_devices_memory_unless_told_another() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 20_000);
    let own = ok(&["replay", s(&t)]);
    let first = own.lines().next().unwrap();
    assert!(
        first.ends_with("on a simulated device of 80.00 GiB (the recorded device's memory)"),
        "{own}"
    );
    let told = ok(&["replay", s(&t), "--capacity", "80GiB"]);
    assert!(
        told.lines().next().unwrap().ends_with("of 80.00 GiB"),
        "{told}"
    );
    assert_eq!(
        own.lines().skip(1).collect::<Vec<_>>(),
        told.lines().skip(1).collect::<Vec<_>>(),
        "the same device, the same figures"
    );
    let json: serde_json::Value = serde_json::from_str(&ok(&["replay", s(&t), "--json"])).unwrap();
    assert_eq!(json[0]["capacity"], 80u64 << 30);
    let old = common::write_trace(
        dir.path(),
        "untold.gtrace",
        "",
        &[common::ev(0, common::alloc(1 << 21, 4096))],
        0,
        true,
    );
    let e = fails(&["replay", s(&old)]);
    assert!(
        e.contains("does not tell its device's memory") && e.contains("pass --capacity"),
        "{e}"
    );
    assert!(ok(&["replay", s(&old), "--capacity", "1GiB"]).contains("of 1.00 GiB"));
}

#[test]
fn exported_snapshot_reads_like_memory_viz_reads_it() {
    let python = Command::new("python3").arg("--version").output();
    assert!(
        python.is_ok_and(|o| o.status.success()),
        "python3 is required for this test (CI has Python 3.11)"
    );
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 20_000);
    let pickle = dir.path().join("s.pickle");
    ok(&["export", s(&t), "--torch-snapshot", s(&pickle)]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/check_snapshot.py");
    let run = |p: &Path| {
        let out = Command::new("python3")
            .args([script, s(p)])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&pickle);
    // A trace that starts mid-run and one without segments (an RMM log) export consistently too.
    let csv = dir.path().join("t.csv");
    ok(&["export", s(&t), "--csv", s(&csv)]);
    let text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let tail = dir.path().join("tail.csv");
    std::fs::write(
        &tail,
        format!("{}\n{}\n", lines[0], lines[lines.len() / 2..].join("\n")),
    )
    .unwrap();
    let imported = dir.path().join("tail.gtrace");
    ok(&["import", s(&tail), "-o", s(&imported)]);
    let pickle2 = dir.path().join("tail.pickle");
    ok(&["export", s(&imported), "--torch-snapshot", s(&pickle2)]);
    run(&pickle2);
    // Traces recorded on a GPU with expandable segments (segment_map/unmap),
    // and with stitched ranges, whose blocks need a segment too.
    for name in ["gpt2-varlen", "yolo-style-oom", "resnet50", "four-streams"] {
        let example = format!("{}/../examples/{name}.gtrace", env!("CARGO_MANIFEST_DIR"));
        let pickle3 = dir.path().join(format!("{name}.pickle"));
        ok(&["export", &example, "--torch-snapshot", s(&pickle3)]);
        run(&pickle3);
    }
}

/// A snapshot gpualloc exported imports back with the pool of each
/// segment (PyTorch's trace entries name none: every mapped range read as
/// the large pool's, and a CUDA graph's private pool vanished).
#[test]
fn an_exported_snapshot_imports_back_with_its_pools() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["reduce-overhead-graphs", "yolo-style-oom"] {
        let example = format!("{}/../examples/{name}.gtrace", env!("CARGO_MANIFEST_DIR"));
        let pickle = dir.path().join(format!("{name}.pickle"));
        let back = dir.path().join(format!("{name}.gtrace"));
        ok(&["export", &example, "--torch-snapshot", s(&pickle)]);
        ok(&["import", s(&pickle), "-o", s(&back)]);
        let pools = |t: &str| {
            let v: serde_json::Value =
                serde_json::from_str(&ok(&["summary", t, "--json"])).unwrap();
            v["devices"][0]["pools_at_peak_reserved"].clone()
        };
        let (before, after) = (pools(&example), pools(s(&back)));
        assert_eq!(before, after, "{name}");
        assert_ne!(before["small"]["reserved"], 0, "{name}");
    }
}

#[test]
fn the_shipped_gpu_trace_summarises_and_reports() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/gpt2-varlen.gtrace"
    );
    let out = ok(&["summary", example]);
    assert!(
        out.contains("config \"\""),
        "recorded with the default policy: {out}"
    );
    // Reserved counts the page pool (pages_create): 8,105,492,480 B on the
    // GPU for 8,050,975,232 B allocated.
    assert!(
        out.contains("reserved/allocated at the peaks 1.007"),
        "{out}"
    );
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("r.html");
    ok(&["report", example, "-o", s(&html)]);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("<svg") && !page.contains("http://") && !page.contains("https://"));
}

#[test]
fn csv_and_chrome_exports_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 20_000);
    let csv = dir.path().join("t.csv");
    let json = dir.path().join("t.json");
    ok(&["export", s(&t), "--csv", s(&csv), "--chrome", s(&json)]);
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(text.starts_with("Thread,Time,Action,Pointer,Size,Stream"));
    let allocs = text.lines().filter(|l| l.contains(",allocate,")).count();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let evs = v["traceEvents"].as_array().unwrap();
    assert!(
        evs.iter()
            .any(|e| e["ph"] == "C" && e["args"]["reserved"].as_u64().is_some())
    );
    assert!(evs.iter().any(|e| e["ph"] == "B" && e["name"] == "forward"));
    let back = dir.path().join("back.gtrace");
    ok(&["import", s(&csv), "-o", s(&back)]);
    let out = ok(&["summary", s(&back)]);
    assert!(out.contains(&format!("{allocs} allocations")), "{out}");
    let diff = ok(&["diff", s(&t), s(&back)]);
    assert!(
        diff.contains("peak allocated") && diff.contains("gen-20000.gtrace"),
        "{diff}"
    );
    // The log's clock survives the round trip: exported again, every row
    // has the time it had.
    let again = dir.path().join("again.csv");
    ok(&["export", s(&back), "--csv", s(&again)]);
    let times = |text: &str| -> Vec<String> {
        text.lines()
            .skip(1)
            .map(|l| l.split(',').nth(1).unwrap().to_string())
            .collect()
    };
    let again = std::fs::read_to_string(&again).unwrap();
    assert_eq!(times(&again), times(&text));
}

/// Runs a Python script that must succeed.
fn python(script: &str, args: &[&str]) {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 is required");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What an import cannot carry over as it was (an action it does not know,
/// a negative size, an entry without a numeric time) is said, not dropped
/// in silence.
#[test]
fn a_snapshot_import_says_what_it_could_not_carry_over() {
    let dir = tempfile::tempdir().unwrap();
    let pickle = dir.path().join("odd.pickle");
    let script = r#"
import pickle, sys
A = 0x7f0000000000
t = [
  {"action": "segment_alloc", "addr": A, "size": 20 << 20, "stream": 0, "time_us": 1000},
  {"action": "alloc", "addr": A, "size": 4096, "stream": 0, "time_us": 1001},
  {"action": "teleport", "addr": A, "size": 4096, "stream": 0, "time_us": 1002},
  {"action": "alloc", "addr": A + 4096, "size": -5, "stream": 0, "time_us": "late"},
  {"action": "alloc", "addr": A + 8192, "size": "12", "stream": 0, "time_us": 1003},
]
pickle.dump({"segments": [], "device_traces": [t]}, open(sys.argv[1], "wb"))
"#;
    python(script, &[s(&pickle)]);
    let g = dir.path().join("odd.gtrace");
    let out = gpualloc(&["import", s(&pickle), "-o", s(&g)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    for want in [
        "skipped: `teleport` x1",
        "1 entries with a negative `size` were taken as 0 bytes",
        "1 entries whose `size` is not an integer were taken as 0 bytes",
        "1 entries without a numeric `time_us` were timed by their position",
    ] {
        assert!(err.contains(want), "{want:?} not in {err}");
    }
}

/// A snapshot whose `device_traces` (or `segments`) is not a list of lists
/// is refused with the field's name, not imported as an empty trace.
#[test]
fn a_snapshot_of_the_wrong_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import pickle, sys
e = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1}
shapes = {
  "dict": {"device_traces": {0: [e]}},
  "flat": {"device_traces": [e]},
  "str": {"device_traces": "abc"},
  "segments": {"device_traces": [[e]], "segments": 5},
}
pickle.dump(shapes[sys.argv[2]], open(sys.argv[1], "wb"))
"#;
    for (shape, want) in [
        ("dict", "`device_traces` is a Python dict, not a list"),
        ("flat", "`device_traces[0]` is a Python dict, not a list"),
        ("str", "`device_traces` is a Python str, not a list"),
        ("segments", "`segments` is a Python int, not a list"),
    ] {
        let pickle = dir.path().join(format!("{shape}.pickle"));
        python(script, &[s(&pickle), shape]);
        let g = dir.path().join(format!("{shape}.gtrace"));
        let err = fails(&["import", s(&pickle), "-o", s(&g)]);
        assert!(err.contains(want), "{want:?} not in {err}");
        assert!(!g.exists(), "{shape}: no trace is written");
    }
}

/// `import` without `--from` tells a protocol 1 pickle (its first bytes
/// are ASCII: `}q\0(`) from a CSV log, and reads a CSV log that starts with
/// a UTF-8 byte order mark.
#[test]
fn import_detects_protocol_1_pickles_and_csv_with_a_byte_order_mark() {
    let dir = tempfile::tempdir().unwrap();
    let pickle = dir.path().join("p1.pickle");
    let script = r#"
import pickle, sys
e = {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1}
pickle.dump({"segments": [], "device_traces": [[e]]}, open(sys.argv[1], "wb"), protocol=1)
"#;
    python(script, &[s(&pickle)]);
    let g = dir.path().join("p1.gtrace");
    ok(&["import", s(&pickle), "-o", s(&g)]);
    assert!(ok(&["summary", s(&g)]).contains("1 allocations"));
    let bom = "\u{feff}Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x1000,100,0x0\n";
    assert!(imported_csv(dir.path(), "bom", bom).contains("1 allocations"));
    // The header counts the devices the Device column names.
    let devices = "Thread,Time,Action,Pointer,Size,Stream,Device\n\
                   1,10:00:00.000001,allocate,0x1000,100,0x0,0\n\
                   1,10:00:00.000002,allocate,0x2000,100,0x0,3\n";
    let out = imported_csv(dir.path(), "devices", devices);
    assert!(
        out.contains(", 4 device(s),") && out.contains("device 3:"),
        "{out}"
    );
}

/// `import --from rmm` reads a pipe once: a log with a Device column, which
/// needs two passes, given on stdin imports every row, as from a file
/// (the second pass over the pipe used to take the rows the first had not
/// read yet, and the import failed in the middle of a line).
#[test]
fn import_reads_an_rmm_log_from_a_pipe_once() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::from("Thread,Time,Action,Pointer,Size,Stream,Device\n");
    for i in 0..3000u64 {
        let (p, d) = (0x7f00_0000_0000 + i * 4096, i % 2);
        text += &format!(
            "7,10:00:{:02}.{:06},allocate,{p:#x},4096,0x0,{d}\n",
            i / 1000,
            i % 1000 * 1000
        );
        text += &format!(
            "7,10:00:{:02}.{:06},free,{p:#x},4096,0x0,{d}\n",
            i / 1000,
            i % 1000 * 1000 + 500
        );
    }
    let from_file = imported_csv(dir.path(), "file", &text);
    let g = dir.path().join("pipe.gtrace");
    let mut child = common::import_rmm_from_stdin(&g);
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("(9000 events)"), "{err}");
    assert_eq!(
        ok(&["summary", s(&g)]).replace("pipe.gtrace", "file.gtrace"),
        from_file
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left.len(),
        3,
        "only the CSV and the two traces are left: {left:?}"
    );
}

/// `summary` of an RMM CSV log of this text, imported in `dir` as NAME.
fn imported_csv(dir: &Path, name: &str, text: &str) -> String {
    let csv = dir.join(format!("{name}.csv"));
    std::fs::write(&csv, text).unwrap();
    let g = dir.join(format!("{name}.gtrace"));
    ok(&["import", s(&csv), "-o", s(&g)]);
    ok(&["summary", s(&g)])
}

#[test]
fn imports_a_pytorch_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let pickle = dir.path().join("torch.pickle");
    // Shaped like torch.cuda.memory._snapshot(): shared frames (memo), a
    // segment, pending frees, an OOM, protocol 4 and 5.
    let script = r#"
import pickle, sys
frames = [{"filename": "train.py", "line": 3, "name": "step"}]
A = 0x7f0000000000
t = [
  {"action": "segment_alloc", "addr": A, "size": 20 << 20, "stream": 0, "time_us": 1000, "frames": frames},
  {"action": "alloc", "addr": A, "size": 1000, "stream": 0, "time_us": 1001, "frames": frames},
  {"action": "alloc", "addr": A + 1024, "size": 5 << 20, "stream": 0, "time_us": 1002, "frames": frames},
  {"action": "free_requested", "addr": A, "size": 1000, "stream": 0, "time_us": 1003, "frames": frames},
  {"action": "free_completed", "addr": A, "size": 1000, "stream": 0, "time_us": 1004, "frames": frames},
  {"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": 1005, "frames": []},
  {"action": "oom", "addr": 0, "device_free": 123, "size": 1 << 40, "stream": 0, "time_us": 1006, "frames": frames},
  {"action": "free_requested", "addr": 0xdead00, "size": 512, "stream": 0, "time_us": 1007, "frames": frames},
]
snap = {"segments": [], "device_traces": [t], "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
pickle.dump(snap, open(sys.argv[1], "wb"), protocol=int(sys.argv[2]))
"#;
    for proto in ["4", "5"] {
        python(script, &[s(&pickle), proto]);
        let g = dir.path().join("torch.gtrace");
        let imported = gpualloc(&["import", s(&pickle), "-o", s(&g)]);
        let err = String::from_utf8_lossy(&imported.stderr);
        assert!(imported.status.success(), "{err}");
        // The block freed without an alloc was live at the start; the
        // empty final `segments` contradict what the trace leaves live.
        for want in [
            "written at the trace's start: 1 blocks (512 B), 0 B reserved",
            "the trace leaves 25.00 MiB live or reserved at the end that the final `segments` do not show",
        ] {
            assert!(err.contains(want), "{want:?} not in {err}");
        }
        let out = ok(&["summary", s(&g)]);
        assert!(out.contains("OOMs            1"), "{out}");
        assert!(
            out.contains("peak allocated      5.00 MiB") || out.contains("5.00 MiB"),
            "{out}"
        );
        assert!(!out.contains("frees of blocks allocated before"), "{out}");
        let r = ok(&["replay", s(&g), "--capacity", "1GiB"]);
        assert!(
            r.contains("frees of unknown blocks (skipped)")
                && r.contains("failed allocations (OOM)"),
            "{r}"
        );
    }
    std::fs::write(&pickle, b"\x80\x04cos\nsystem\n.").unwrap();
    let err = fails(&["import", s(&pickle), "-o", s(&dir.path().join("x.gtrace"))]);
    assert!(err.contains("not plain data"), "{err}");
}

/// Every row of a Parquet file, as (column, value) pairs.
fn parquet_rows(path: &Path) -> Vec<Vec<(String, parquet::record::Field)>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let r = SerializedFileReader::new(f).unwrap();
    r.get_row_iter(None)
        .unwrap()
        .map(|row| {
            row.unwrap()
                .get_column_iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .collect()
}

fn field<'a>(
    row: &'a [(String, parquet::record::Field)],
    name: &str,
) -> &'a parquet::record::Field {
    &row.iter()
        .find(|(k, _)| k == name)
        .unwrap_or_else(|| panic!("no column {name}"))
        .1
}

fn ulong(row: &[(String, parquet::record::Field)], name: &str) -> u64 {
    use parquet::record::Field;
    match field(row, name) {
        Field::ULong(v) => *v,
        Field::UInt(v) => u64::from(*v),
        Field::Long(v) => u64::try_from(*v).unwrap(),
        other => panic!("{name}: {other:?} is not an integer"),
    }
}

#[test]
fn parquet_export_reads_back_with_the_summarys_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 20_000);
    let prefix = dir.path().join("out");
    let err = fails(&[
        "export",
        s(&t),
        "--parquet",
        s(&dir.path().join("no/such/x")),
    ]);
    // Refused before anything is written (the folder is checked first).
    assert!(err.contains("no/such is not a folder"), "{err}");
    ok(&["export", s(&t), "--parquet", s(&prefix)]);
    let sum: serde_json::Value = serde_json::from_str(&ok(&["summary", s(&t), "--json"])).unwrap();
    let dev = &sum["devices"][0];
    let events = parquet_rows(&dir.path().join("out.events.parquet"));
    assert_eq!(events.len() as u64, sum["events"].as_u64().unwrap());
    let action = |r: &[(String, parquet::record::Field)]| field(r, "action").to_string();
    let allocs = events.iter().filter(|r| action(r) == "\"alloc\"").count();
    assert_eq!(allocs as u64, dev["allocations"].as_u64().unwrap());
    let max = |k| events.iter().map(|r| ulong(r, k)).max().unwrap();
    assert_eq!(max("allocated"), dev["peak_allocated"].as_u64().unwrap());
    assert_eq!(max("reserved"), dev["peak_reserved"].as_u64().unwrap());
    let phases = parquet_rows(&dir.path().join("out.phases.parquet"));
    for p in dev["phases"].as_array().unwrap() {
        let name = p["name"].to_string();
        let mine: Vec<_> = phases
            .iter()
            .filter(|r| field(r, "kind").to_string() == "\"phase\"")
            .filter(|r| field(r, "name").to_string() == name)
            .collect();
        assert_eq!(mine.len() as u64, p["count"].as_u64().unwrap(), "{name}");
        let peak = mine.iter().map(|r| ulong(r, "peak_allocated")).max();
        assert_eq!(peak, p["peak_allocated"].as_u64(), "{name}");
    }
    let segments = parquet_rows(&dir.path().join("out.segments.parquet"));
    assert!(segments.iter().any(|r| ulong(r, "size") > 0));
    // A step row for every mark and one for what came before the first:
    // the export numbers steps itself (its budget keeps no iteration
    // boundaries of the states).
    let marks = events.iter().filter(|r| action(r) == "\"mark\"").count();
    let steps = phases
        .iter()
        .filter(|r| field(r, "kind").to_string() == "\"step\"")
        .count();
    assert!(marks > 1, "the generated trace has steps");
    assert_eq!(steps, marks + 1);
}

/// `private_pool` rows name the call and carry the pool's code.
#[test]
fn parquet_export_names_the_calls_on_private_pools() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/reduce-overhead-graphs.gtrace"
    );
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("g");
    ok(&["export", example, "--parquet", s(&prefix)]);
    let events = parquet_rows(&dir.path().join("g.events.parquet"));
    let calls: Vec<_> = events
        .iter()
        .filter(|r| field(r, "action").to_string() == "\"private_pool\"")
        .collect();
    assert_eq!(calls.len(), 21 + 21 + 14 + 11);
    let named = |n: &str| {
        calls
            .iter()
            .filter(|r| field(r, "name").to_string() == format!("\"{n}\""))
            .count()
    };
    assert_eq!(
        (
            named("begin_allocate_to_pool"),
            named("end_allocate_to_pool"),
            named("release_pool"),
            named("get_checkpoint_state")
        ),
        (21, 21, 14, 11)
    );
    assert!(
        calls
            .iter()
            .all(|r| ulong(r, "pool") == 2 && ulong(r, "size") == 0)
    );
}

/// `memory_limit` rows carry the cap they set: its byte count in `size`
/// and the cap in the configuration's syntax in `name` (the record's own
/// `size` is only which cap it is, 0 for a fraction).
#[test]
fn parquet_export_names_the_caps_set_while_running() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/promise-budget.gtrace"
    );
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("caps");
    ok(&["export", example, "--parquet", s(&prefix)]);
    let events = parquet_rows(&dir.path().join("caps.events.parquet"));
    let caps: Vec<_> = events
        .iter()
        .filter(|r| field(r, "action").to_string() == "\"memory_limit\"")
        .collect();
    assert_eq!(caps.len(), 1);
    // The check asked for 6 GiB and half a page of the H200's total.
    let fraction = ((6u64 << 30) + (1 << 20)) as f64 / 150_109_880_320_f64;
    assert_eq!(
        field(caps[0], "name").to_string(),
        format!("\"per_process_memory_fraction:{fraction}\"")
    );
    assert_eq!(ulong(caps[0], "size"), 0);
}

/// The promise check's trace names the device's total with the cap it set:
/// replayed on a round capacity it warns with the `--capacity` that
/// reproduces the GPU's 87 refused requests, and does so on that capacity.
#[test]
fn a_capped_example_tells_the_capacity_that_reproduces_it() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/promise-budget.gtrace"
    );
    let (out, err) = common::ok(&["replay", "--capacity", "140GiB", "--json", example]);
    assert!(
        err.contains("--capacity 150109880320 reproduces the recording's cap"),
        "{err}"
    );
    let replayed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(replayed[0]["ooms"], 72, "{out}");
    let (out, err) = common::ok(&["replay", "--capacity", "150109880320", "--json", example]);
    assert!(!err.contains("fraction of a device"), "{err}");
    let replayed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(replayed[0]["ooms"], 87, "{out}");
    // Each failure was retried after the cache was freed, and so were
    // eight requests the retry served; the table says the same.
    assert_eq!(replayed[0]["alloc_retries"], 95, "{out}");
    assert_eq!(replayed[0]["devices"][0]["alloc_retries"], 95, "{out}");
    let (table, _) = common::ok(&["replay", "--capacity", "150109880320", example]);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("release-and-retry allocations") && l.ends_with(" 95")),
        "{table}"
    );
}

/// `replay` says where reserved memory that no allocation holds lay at
/// the peak (Note [Held memory by unit]): in the text, beside live blocks,
/// in free units, in private pools' free units and pooled; in the JSON, the
/// parts, which add up to the peak, for each configuration and each device.
#[test]
fn replay_says_what_reserved_memory_was_made_of_at_its_peak() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/graph-branches-restores.gtrace"
    );
    let args = ["replay", "--capacity", "140GiB", "--config", "", "--config"];
    let text = ok(&[&args[..], &["policy:pytorch", example]].concat());
    let row = |name: &str| -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no row {name:?} in {text}"));
        let cells = line.trim_start()[name.len()..].split_whitespace();
        let cells: Vec<&str> = cells.collect();
        // Two values with their units, one per configuration.
        cells.chunks(2).map(|c| c.join(" ")).collect()
    };
    assert_eq!(
        row("beside live blocks in their units"),
        ["4.32 MiB", "3.57 MiB"]
    );
    assert_eq!(row("in free units (cache)"), ["0 B", "128.00 MiB"]);
    assert_eq!(
        row("in free units of private pools"),
        ["540.00 MiB", "640.00 MiB"]
    );
    assert_eq!(row("in pooled handles (unmapped)"), ["0 B", "0 B"]);
    let (out, _) = common::ok(&[&args[..], &["policy:pytorch", "--json", example]].concat());
    let replayed: serde_json::Value = serde_json::from_str(&out).unwrap();
    for r in replayed.as_array().unwrap() {
        let parts = |h: &serde_json::Value| -> u64 {
            ["used_units", "free_units", "free_private_units", "pooled"]
                .iter()
                .map(|k| h[k].as_u64().unwrap())
                .sum()
        };
        assert_eq!(
            parts(&r["held_at_peak_reserved"]),
            r["peak_reserved"],
            "{r}"
        );
        let d = &r["devices"][0];
        assert_eq!(
            parts(&d["held_at_peak_reserved"]),
            d["peak_reserved"],
            "{r}"
        );
    }
    assert_eq!(
        replayed[0]["held_at_peak_reserved"]["free_private_units"], 566_231_040,
        "{out}"
    );
}

/// The memory calls of the steps after warm-up (the first fifth of the
/// steps left out): none where the layout repeats, many where pages move
/// to follow a changing one, few when they never move; none to count in a
/// trace without steps.
#[test]
fn replay_counts_the_memory_calls_after_warm_up() {
    fn line<'a>(text: &'a str, name: &str) -> &'a str {
        let found = text.lines().find(|l| l.starts_with(name));
        found.unwrap_or_else(|| panic!("no row {name:?} in {text}"))
    }
    let trace = |name: &str| format!("{}/../examples/{name}.gtrace", env!("CARGO_MANIFEST_DIR"));
    let replayed = |name: &str| -> serde_json::Value {
        let args = ["replay", "--capacity", "140GiB", "--json", "--config", ""];
        let (out, _) =
            common::ok(&[&args[..], &["--config", "defragment:false", &trace(name)]].concat());
        serde_json::from_str(&out).unwrap()
    };
    let later = |r: &serde_json::Value| -> (u64, u64) {
        let a = &r["after_warmup"];
        assert_eq!(a, &r["devices"][0]["after_warmup"], "one device: {r}");
        (
            a["steps"].as_u64().unwrap(),
            a["driver_memory_calls"].as_u64().unwrap(),
        )
    };
    let resnet = replayed("resnet50");
    assert_eq!(later(&resnet[0]), (48, 0));
    let detector = replayed("detector-multiscale");
    assert_eq!(later(&detector[0]), (48, 2949));
    assert_eq!(later(&detector[1]), (48, 60));
    let d = &detector[0]["after_warmup"];
    assert_eq!(
        d["memory_calls_per_100_steps"].as_f64().unwrap(),
        2949.0 * 100.0 / 48.0
    );
    assert!(d["driver_memory_calls"].as_u64() < detector[0]["driver_memory_calls"].as_u64());
    let varlen = replayed("gpt2-varlen");
    assert!(
        varlen[0]["after_warmup"].is_null(),
        "no steps recorded: {}",
        varlen[0]
    );
    // The text: the rate, and over how many steps.
    for (name, rate, steps) in [
        ("detector-multiscale", "6143.8", "48"),
        ("gpt2-varlen", "-", "none"),
    ] {
        let args = ["replay", "--capacity", "140GiB", "--config", ""];
        let text = ok(&[&args[..], &[&trace(name)]].concat());
        let rows = [
            ("memory calls per 100 later steps", rate),
            ("  over the steps after the first 1/5", steps),
        ];
        for (row, value) in rows {
            let found = line(&text, row);
            assert!(
                found.ends_with(&format!(" {value}")),
                "{name}, {row}: {text}"
            );
        }
    }
}

/// The host waits a replay made, in the table: the JSON's
/// `cuEventSynchronize` and `cuCtxSynchronize` calls (ResNet-50's replay
/// waits once; 21 times before round 75, when every repair of a busy
/// stitch part waited for the stitch's last work: forty-eighth study), and
/// none where nothing waited.
#[test]
fn replay_counts_the_host_waits() {
    let trace = |name: &str| format!("{}/../examples/{name}.gtrace", env!("CARGO_MANIFEST_DIR"));
    let waits_of = |name: &str| -> (u64, String) {
        let args = ["replay", "--capacity", "140GiB", "--config", ""];
        let json: serde_json::Value =
            serde_json::from_str(&common::ok(&[&args[..], &["--json", &trace(name)]].concat()).0)
                .unwrap();
        let kinds = &json[0]["driver_calls_by_kind"];
        let n = |k: &str| kinds[k]["calls"].as_u64().unwrap_or(0);
        let text = ok(&[&args[..], &[&trace(name)]].concat());
        let row = text
            .lines()
            .find(|l| l.starts_with("host waits"))
            .unwrap_or_else(|| panic!("no host waits row in {text}"))
            .to_string();
        (n("cuEventSynchronize") + n("cuCtxSynchronize"), row)
    };
    let (resnet, row) = waits_of("resnet50");
    assert!(resnet > 0, "{row}");
    assert!(row.ends_with(&format!(" {resnet}")), "{row}");
    let (none, row) = waits_of("bert-checkpoint-amp");
    assert!(row.ends_with(&format!(" {none}")), "{row}");
}

/// The steps after warm-up begin with step `n / 5`, whether marks end the
/// steps or a phase opens each: a request that grows reserved memory in
/// step 2 of 10 counts, one in step 1 does not.
#[test]
fn replay_leaves_out_the_first_fifth_of_the_steps() {
    use gpualloc::trace::EventKind;
    let dir = tempfile::tempdir().unwrap();
    let calls_after = |grows_in: u64, marks: bool| -> (u64, u64) {
        let mut events = Vec::new();
        for step in 0..10u64 {
            let (t, addr) = (1_000 * (step + 1), 0x7f00_0000_0000 + (step << 30));
            let size: u64 = if step == grows_in {
                128 << 20
            } else {
                64 << 20
            };
            let (requested, block_size) = (size, size);
            events.push(common::ev(t, EventKind::PhasePush { name: 0 }));
            let alloc = EventKind::Alloc {
                addr,
                requested,
                block_size,
            };
            events.push(common::ev(t + 1, alloc));
            let freed = EventKind::FreeRequested {
                addr,
                requested,
                block_size,
            };
            events.push(common::ev(t + 2, freed));
            let done = EventKind::FreeCompleted {
                addr,
                requested,
                block_size,
            };
            events.push(common::ev(t + 2, done));
            events.push(common::ev(t + 3, EventKind::PhasePop { name: 0 }));
            if marks {
                events.push(common::ev(t + 4, EventKind::Mark { name: 1 }));
            }
        }
        let name = format!("t-{grows_in}-{marks}.gtrace");
        let t = common::write_blocks(dir.path(), &name, 1, &["step", "end"], [events]);
        let (out, _) = common::ok(&[
            "replay",
            "--capacity",
            "8GiB",
            "--json",
            "--config",
            "",
            s(&t),
        ]);
        let r: serde_json::Value = serde_json::from_str(&out).unwrap();
        let a = &r[0]["after_warmup"];
        (
            a["steps"].as_u64().unwrap(),
            a["driver_memory_calls"].as_u64().unwrap(),
        )
    };
    for marks in [true, false] {
        let (steps, grown) = calls_after(2, marks);
        assert_eq!(steps, 8, "marks: {marks}");
        assert!(
            grown > 0,
            "marks: {marks}: the growth of step 2 is after warm-up"
        );
        assert_eq!(
            calls_after(1, marks),
            (8, 0),
            "marks: {marks}: step 1 is warm-up"
        );
    }
}

#[test]
fn several_traces_export_to_one_parquet_folder() {
    let dir = tempfile::tempdir().unwrap();
    let r = three_ranks(dir.path());
    let out = dir.path().join("pq");
    let traces: Vec<&str> = r.iter().map(|p| s(p)).collect();
    let args = [&["export", "--parquet", s(&out)][..], &traces].concat();
    let err = fails(&args);
    assert!(err.contains("not a folder"), "{err}");
    std::fs::create_dir(&out).unwrap();
    ok(&args);
    for i in 0..r.len() {
        let rows = parquet_rows(&out.join(format!("trace-{i}.phases.parquet")));
        assert!(!rows.is_empty(), "rank {i}");
        assert!(
            rows.iter().all(|row| ulong(row, "rank") == i as u64),
            "rank {i}"
        );
    }
    let csv = dir.path().join("x.csv");
    let err = fails(&[&["export", "--csv", s(&csv)][..], &traces].concat());
    assert!(err.contains("take one trace"), "{err}");
    let twin = dir.path().join("twin");
    std::fs::create_dir(&twin).unwrap();
    std::fs::copy(&r[0], twin.join("trace-0.gtrace")).unwrap();
    let err = fails(&[
        "export",
        "--parquet",
        s(&out),
        s(&r[0]),
        s(&twin.join("trace-0.gtrace")),
    ]);
    assert!(err.contains("have the same name"), "{err}");
    // Names that give two traces one rank (gpt2-a, gpt2-b): the rank
    // column is left null rather than merge them, and that is said.
    let clash = dir.path().join("clash");
    let pq = dir.path().join("pq-clash");
    std::fs::create_dir_all(&clash).unwrap();
    std::fs::create_dir(&pq).unwrap();
    let (a, b) = (clash.join("gpt2-a.gtrace"), clash.join("gpt2-b.gtrace"));
    std::fs::copy(&r[0], &a).unwrap();
    std::fs::copy(&r[1], &b).unwrap();
    let out = gpualloc(&["export", "--parquet", s(&pq), s(&a), s(&b)]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("the rank column is null"));
    for name in ["gpt2-a", "gpt2-b"] {
        let rows = parquet_rows(&pq.join(format!("{name}.phases.parquet")));
        assert!(!rows.is_empty());
        assert!(
            rows.iter().all(|row| row
                .iter()
                .any(|(k, v)| k == "rank" && *v == parquet::record::Field::Null)),
            "{name}"
        );
    }
}

#[test]
fn parquet_export_reads_back_in_pyarrow() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/python/test_parquet.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .env("GPUALLOC_CLI", env!("CARGO_BIN_EXE_gpualloc"))
        .output()
        .expect("run python3");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script} failed:\n{text}");
    eprintln!("{text}");
}

/// Three ranks: two generated workloads and the shipped trace that ends in
/// an OOM, named as `GPUALLOC_TRACE=trace-{rank}.gtrace` names them.
fn three_ranks(dir: &Path) -> Vec<PathBuf> {
    let a = generated(dir, 20_000);
    let b = dir.join("gen-b.gtrace");
    ok(&["generate", "-o", s(&b), "--events", "40000", "--seed", "9"]);
    let oom = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/yolo-style-oom.gtrace"
    );
    let ranks: Vec<PathBuf> = (0..3)
        .map(|r| dir.join(format!("trace-{r}.gtrace")))
        .collect();
    std::fs::rename(a, &ranks[1]).unwrap();
    std::fs::rename(b, &ranks[0]).unwrap();
    std::fs::copy(oom, &ranks[2]).unwrap();
    ranks
}

#[test]
fn several_traces_summarise_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let r = three_ranks(dir.path());
    // Given out of order: shown by rank.
    let args = ["summary", s(&r[2]), s(&r[0]), s(&r[1])];
    let text = ok(&args);
    assert!(text.starts_with("3 ranks\n"), "{text}");
    // The example's OOM: 30.25 MiB asked for on device 0 (its time is the
    // example's own, which a re-recording changes).
    assert!(
        text.contains("rank 2 ran out of memory at ")
            && text.contains(" s on device 0: 30.25 MiB requested"),
        "{text}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&ok(&[&args[..], &["--json"]].concat())).unwrap();
    let ranks = v["ranks"].as_array().unwrap();
    let labels: Vec<_> = ranks.iter().map(|x| x["rank"].as_str().unwrap()).collect();
    assert_eq!(labels, ["0", "1", "2"]);
    assert_eq!(v["oom_ranks"], serde_json::json!(["2"]));
    let peaks: Vec<u64> = ranks
        .iter()
        .map(|x| x["peak_allocated"].as_u64().unwrap())
        .collect();
    let top = peaks.iter().enumerate().max_by_key(|p| p.1).unwrap().0;
    assert_eq!(v["highest_peak_allocated"], labels[top]);
    assert_ne!(peaks[0], peaks[1], "two different workloads");
    for (x, path) in ranks.iter().zip(&r) {
        let alone: serde_json::Value =
            serde_json::from_str(&ok(&["summary", s(path), "--json"])).unwrap();
        assert_eq!(x["summary"], alone, "rank {}", x["rank"]);
        assert_eq!(x["peak_allocated"], alone["devices"][0]["peak_allocated"]);
    }
    assert!(ranks[2]["steps"].as_u64().unwrap() > 0 && ranks[2]["step_median_ns"].is_u64());
    // The timed steps lie between boundaries; `leaks` counts the stretches
    // before the first and after the last as iterations too.
    let leaks: serde_json::Value =
        serde_json::from_str(&ok(&["leaks", s(&r[2]), "--json"])).unwrap();
    assert_eq!(
        ranks[2]["steps"].as_u64().unwrap() + 2,
        leaks["devices"][0]["iterations"].as_u64().unwrap()
    );
    assert_eq!(ranks[2]["first_oom"]["requested"], 31_719_424);
    // A bad file among them is named.
    let bad = dir.path().join("trace-3.gtrace");
    std::fs::write(&bad, b"not a trace").unwrap();
    let err = fails(&["summary", s(&r[0]), s(&bad)]);
    assert!(
        err.contains("trace-3.gtrace: not a gpualloc trace"),
        "{err}"
    );
    // Names without rank numbers label by name; equal names by position.
    let (x, y) = (dir.path().join("x"), dir.path().join("y"));
    for d in [&x, &y] {
        std::fs::create_dir(d).unwrap();
        std::fs::copy(&r[0], d.join("run.gtrace")).unwrap();
    }
    let same = ok(&[
        "summary",
        s(&x.join("run.gtrace")),
        s(&y.join("run.gtrace")),
    ]);
    assert!(same.contains("== rank #1 ("), "{same}");
    // Equal peaks: the first rank is named, not the last.
    assert!(
        same.contains("highest peak allocated: rank #0,")
            && same.contains("highest peak reserved: rank #0\n"),
        "{same}"
    );
    let named = ok(&["summary", s(&x.join("run.gtrace")), s(&r[1])]);
    assert!(named.contains("== rank run.gtrace ("), "{named}");
}

#[test]
fn several_traces_report_in_one_page() {
    let dir = tempfile::tempdir().unwrap();
    let r = three_ranks(dir.path());
    let html = dir.path().join("ranks.html");
    let mut args = vec!["report"];
    args.extend(r.iter().map(|p| s(p)));
    args.extend(["-o", s(&html)]);
    ok(&args);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("<h2>Ranks</h2>") && page.contains("ran out of memory"));
    assert_eq!(page.matches("class=\"gpualloc-data\"").count(), 3);
    for i in 0..3 {
        assert!(
            page.contains(&format!("id=\"r{i}-timeline-0\"")),
            "rank {i}"
        );
        assert!(
            page.contains(&format!("<a href=\"#r{i}-\">{i}</a>")),
            "rank {i}"
        );
    }
    assert!(!page.contains("http://") && !page.contains("https://"));
    // The output may not be one of the inputs.
    let err = fails(&["report", s(&r[0]), s(&r[1]), "-o", s(&r[1])]);
    assert!(err.contains("refusing to overwrite the input"), "{err}");
}

#[test]
fn stitches_are_not_exported_as_memory_pytorch_would_count_twice() {
    // The example was recorded with stitching (second mappings of pages
    // counted in their home segments). Through PyTorch's format and back,
    // reserved memory must stay what it was: a stitch exported as a plain
    // segment_map (or its blocks given made-up segments) would add it twice;
    // the export marks its range (`gpualloc_stitch`) and the import reads
    // it back as a stitch.
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/yolo-style-oom.gtrace"
    );
    let dir = tempfile::tempdir().unwrap();
    let pickle = dir.path().join("y.pickle");
    ok(&["export", example, "--torch-snapshot", s(&pickle)]);
    let back = dir.path().join("y.gtrace");
    ok(&["import", s(&pickle), "-o", s(&back)]);
    let peak = |p: &str| -> u64 {
        let v: serde_json::Value = serde_json::from_str(&ok(&["summary", "--json", p])).unwrap();
        v["devices"][0]["peak_reserved"].as_u64().unwrap()
    };
    assert_eq!(peak(s(&back)), peak(example));
}

/// A loop of the default policy that empties the cache after every step.
fn emptying_loop(path: &Path, steps: u64) {
    use gpualloc::{Allocator, Config, SimBackend};
    let a = Allocator::new(
        Config::default(),
        1,
        Box::new(|_| Ok(SimBackend::new(8 << 30))),
    );
    a.trace_start(path).unwrap();
    let weights = a.malloc(0, 40 << 20, 0).unwrap();
    for step in 0..steps {
        let acts: Vec<_> = (0..6)
            .map(|i| a.malloc(0, (64 + 16 * i + step % 2) << 20, 0).unwrap())
            .collect();
        for p in acts {
            a.free(0, p).unwrap();
        }
        a.empty_cache().unwrap();
    }
    a.free(0, weights).unwrap();
    a.trace_stop().unwrap();
}

/// The CUDA-graph trace recorded on the H200: cudagraph trees capture 21
/// graphs into one shared private pool and release 14 holds; 1.66 GiB of
/// the 1.99 GiB reserved is mapped for that pool at once.
#[test]
fn summary_and_report_show_what_cuda_graphs_held() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/reduce-overhead-graphs.gtrace"
    );
    let out = ok(&["summary", example]);
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("private pools"))
        .unwrap_or_else(|| panic!("no private pools line:\n{out}"));
    assert!(
        line.contains("21 captures into 1 private pool (14 releases); up to 1.66 GiB"),
        "{line}"
    );
    let v: serde_json::Value = serde_json::from_str(&ok(&["summary", example, "--json"])).unwrap();
    let p = &v["devices"][0]["private_pools"];
    assert_eq!(
        (
            p["captures"].as_u64(),
            p["pools"].as_u64(),
            p["restores"].as_u64()
        ),
        (Some(21), Some(1), Some(0))
    );
    let held = p["peak_held"].as_u64().unwrap();
    let reserved = v["devices"][0]["peak_reserved"].as_u64().unwrap();
    assert!(
        held > reserved / 2 && held < reserved,
        "{held} of {reserved}"
    );
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("graphs.html");
    ok(&["report", example, "-o", s(&html)]);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains("Private pools: 21 captures"),
        "the first answer says it"
    );
    // A trace without private pools says nothing of them.
    let plain = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/resnet50.gtrace");
    assert!(!ok(&["summary", plain]).contains("private pools"));
}

#[test]
fn summary_shows_what_empty_cache_made_the_driver_create_again() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("empty.gtrace");
    emptying_loop(&t, 5);
    let out = ok(&["summary", s(&t)]);
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("empty_cache"))
        .unwrap_or_else(|| panic!("no empty_cache line:\n{out}"));
    assert!(line.contains("5 calls"), "{line}");
    assert!(
        line.contains("call it only when another process needs the memory"),
        "{line}"
    );
    let v: serde_json::Value = serde_json::from_str(&ok(&["summary", s(&t), "--json"])).unwrap();
    let e = &v["devices"][0]["empty_cache"];
    assert_eq!(e["calls"], 5);
    let (released, recreated) = (
        e["released"].as_u64().unwrap(),
        e["recreated"].as_u64().unwrap(),
    );
    // Each step's activations (at least 6 x 64 MiB) come back after each of
    // the first four calls; what the last one gave back never does.
    assert!(recreated >= 4 * 6 * (64 << 20), "{e}");
    assert!(recreated < released, "{e}");
    // The report says it among its answers.
    let page = common::report(&t);
    assert!(
        page.contains("<code>empty_cache</code>: 5 calls gave back"),
        "no empty_cache answer"
    );
    // A trace without calls has no such line.
    let plain = generated(dir.path(), 2_000);
    assert!(!ok(&["summary", s(&plain)]).contains("empty_cache "));
}

#[test]
fn summary_shows_each_streams_share_at_peak_reserved() {
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/four-streams.gtrace"
    );
    let out = ok(&["summary", example]);
    let line = out
        .lines()
        .find(|l| l.contains("streams at peak reserved"))
        .unwrap_or_else(|| panic!("no streams line:\n{out}"));
    assert!(
        line.trim_start()
            .starts_with("5 streams at peak reserved: "),
        "{line}"
    );
    assert!(
        line.contains("default") && line.contains("1 more"),
        "{line}"
    );
    let v: serde_json::Value = serde_json::from_str(&ok(&["summary", example, "--json"])).unwrap();
    let d = &v["devices"][0];
    let x = &d["streams_at_peak_reserved"];
    let streams = x["streams"].as_array().unwrap();
    assert_eq!(streams.len(), 5);
    let sum = |k: &str| streams.iter().map(|s| s[k].as_u64().unwrap()).sum::<u64>();
    // Every reserved byte is some stream's or unmapped; every allocated
    // byte is on some stream.
    assert_eq!(
        sum("reserved") + x["unmapped"].as_u64().unwrap(),
        d["peak_reserved"].as_u64().unwrap()
    );
    assert_eq!(
        sum("allocated"),
        d["allocated_at_peak_reserved"].as_u64().unwrap()
    );
    let reserved: Vec<u64> = streams
        .iter()
        .map(|s| s["reserved"].as_u64().unwrap())
        .collect();
    assert!(
        reserved.windows(2).all(|w| w[0] >= w[1]),
        "most reserved first"
    );
    // The report's first answer says it too.
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("streams.html");
    ok(&["report", example, "-o", s(&html)]);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains("5 streams at peak reserved: "),
        "in the report"
    );
    // One stream: no line.
    let plain = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/resnet50.gtrace");
    assert!(!ok(&["summary", plain]).contains("streams at peak reserved"));
}

/// Phases and marks go into a snapshot's `external_annotations` (a phase
/// as START and END, a mark as both at one time) and come back from it as
/// they were, in the same order and within the microsecond.
#[test]
fn phases_and_marks_survive_a_snapshot_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/detector-multiscale.gtrace"
    );
    let pickle = dir.path().join("d.pickle");
    ok(&["export", example, "--torch-snapshot", s(&pickle)]);
    let back = dir.path().join("back.gtrace");
    ok(&["import", s(&pickle), "-o", s(&back)]);
    let script = r#"
import pickle, sys
sys.path.insert(0, sys.argv[4])
from gpualloc.tracefile import annotations
snap = pickle.load(open(sys.argv[1], "rb"))
ext = snap["external_annotations"]
before, after = annotations(sys.argv[2]), annotations(sys.argv[3])
marks = sum(a["kind"] == "mark" for a in before)
assert marks > 0 and len(before) > marks, before[:5]
assert len(ext) == len(before) + marks, (len(ext), len(before), marks)
assert {e["stage"] for e in ext} == {"START", "END"}, ext[:4]
assert [(a["kind"], a["name"]) for a in after] == [(a["kind"], a["name"]) for a in before]
t0, t1 = before[0]["time_ns"], after[0]["time_ns"]
for a, b in zip(before, after):
    assert abs((a["time_ns"] - t0) - (b["time_ns"] - t1)) <= 1000, (a, b)
"#;
    let shim = concat!(env!("CARGO_MANIFEST_DIR"), "/../python-shim");
    python(script, &[s(&pickle), example, s(&back), shim]);
}

/// Times in a snapshot are whole microseconds: phases that start and end
/// in the microsecond of their allocations, and marks there, come back
/// around the same allocations (the summary's phase table is the same).
#[test]
fn phases_within_one_microsecond_keep_their_allocations_through_a_snapshot() {
    use gpualloc::trace::{EventKind, Pool, TraceEvent, TraceHeader, TraceWriter};
    let dir = tempfile::tempdir().unwrap();
    let header = TraceHeader {
        start_unix_ns: 1_700_000_000_000_000_000,
        device_count: 1,
        pid: 1,
        config: String::new(),
        producer: "test".into(),
    };
    let base = 0x7f00_0000_0000u64;
    let ev = |t: u64, kind| TraceEvent::from_kind(t, 0, 0, 0, kind);
    let mut events = vec![ev(
        0,
        EventKind::SegmentAlloc {
            addr: base,
            size: 64 << 20,
            pool: Pool::Code(1),
        },
    )];
    for step in 0..50u64 {
        // One microsecond a step: every event of the step shares it.
        let t = 1_000 + step * 1_000;
        let a = |i: u64| base + i * (1 << 20);
        let block = |addr| (addr, 1u64 << 20, 1u64 << 20);
        events.push(ev(t, EventKind::PhasePush { name: 0 }));
        for i in 0..5 {
            let (addr, requested, block_size) = block(a(i));
            events.push(ev(
                t + 10 * i + 1,
                EventKind::Alloc {
                    addr,
                    requested,
                    block_size,
                },
            ));
        }
        events.push(ev(t + 100, EventKind::PhasePop { name: 0 }));
        events.push(ev(t + 110, EventKind::PhasePush { name: 1 }));
        for i in 0..5 {
            let (addr, requested, block_size) = block(a(i));
            events.push(ev(
                t + 120 + i,
                EventKind::FreeRequested {
                    addr,
                    requested,
                    block_size,
                },
            ));
            events.push(ev(
                t + 120 + i,
                EventKind::FreeCompleted {
                    addr,
                    requested,
                    block_size,
                },
            ));
        }
        events.push(ev(t + 200, EventKind::PhasePop { name: 1 }));
        events.push(ev(t + 210, EventKind::Mark { name: 2 }));
    }
    let t = dir.path().join("t.gtrace");
    let mut w = TraceWriter::new(std::fs::File::create(&t).unwrap(), &header).unwrap();
    w.write_strings(&["fwd", "bwd", "step"]).unwrap();
    w.write_events(0, &events).unwrap();
    w.finish(Some(60_000)).unwrap();
    let pickle = dir.path().join("t.pickle");
    ok(&["export", s(&t), "--torch-snapshot", s(&pickle)]);
    let back = dir.path().join("back.gtrace");
    ok(&["import", s(&pickle), "-o", s(&back)]);
    let phases = |p: &Path| {
        let out = ok(&["summary", "--json", s(p)]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["devices"][0]["phases"].clone()
    };
    let before = phases(&t);
    assert_eq!(before[0]["allocations"], 250, "{before}");
    assert_eq!(phases(&back), before);
}

/// The marks the torch bridge records when the caching allocator is
/// switched off and on (bridge.cpp, `enable` and `init`): the summary says
/// when allocations bypassed the trace.
#[test]
fn summary_says_when_the_caching_allocator_was_switched_off() {
    use gpualloc::{Allocator, Config, SimBackend};
    let dir = tempfile::tempdir().unwrap();
    let record = |name: &str, marks: &[&str]| {
        let path = dir.path().join(name);
        let a = Allocator::new(
            Config::default(),
            1,
            Box::new(|_| Ok(SimBackend::new(1 << 30))),
        );
        a.trace_start(&path).unwrap();
        let p = a.malloc(0, 4 << 20, 0).unwrap();
        for m in marks {
            a.mark(m).unwrap();
        }
        a.free(0, p).unwrap();
        a.trace_stop().unwrap();
        path
    };
    let line = |path: &Path| {
        ok(&["summary", s(path)])
            .lines()
            .find(|l| l.trim_start().starts_with("caching off"))
            .map(str::to_string)
    };
    let t = record(
        "switched.gtrace",
        &[
            "step",
            "caching_allocator_enable(False)",
            "caching_allocator_enable(True)",
            "caching_allocator_enable(False)",
        ],
    );
    let l = line(&t).expect("a caching off line");
    assert!(
        l.contains("2 time(s) by caching_allocator_enable(False)")
            && l.contains("outside gpualloc and this trace"),
        "{l}"
    );
    let v: serde_json::Value = serde_json::from_str(&ok(&["summary", s(&t), "--json"])).unwrap();
    assert_eq!(v["devices"][0]["caching_off"]["switched_off"], 2);
    assert!(v["devices"][0]["caching_off"]["forced_at_ns"].is_null());
    // The simulator's clock stands still: every mark is at 0, and the
    // second switch off lasts to the end.
    assert!(v["duration_ns"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["devices"][0]["caching_off"]["off_ns"], v["duration_ns"]);
    let t = record(
        "forced.gtrace",
        &["PYTORCH_NO_CUDA_MEMORY_CACHING: caching allocator off"],
    );
    let l = line(&t).expect("a caching off line");
    assert!(
        l.contains("to the end (PYTORCH_NO_CUDA_MEMORY_CACHING was set)"),
        "{l}"
    );
    // The report's first answer says it too.
    let page = common::report(&t);
    assert!(
        page.contains("The caching allocator was off from "),
        "the report does not say it"
    );
    let t = record("plain.gtrace", &["step"]);
    assert_eq!(line(&t), None);
    let v: serde_json::Value = serde_json::from_str(&ok(&["summary", s(&t), "--json"])).unwrap();
    assert!(v["devices"][0]["caching_off"].is_null());
}

#[test]
fn summary_shows_each_pools_share_at_peak_reserved() {
    let example = |name: &str| format!("{}/../examples/{name}", env!("CARGO_MANIFEST_DIR"));
    // BERT's small pool holds 20 MiB for under 4 MiB of live blocks at the
    // peak: pages a few long-lived small blocks keep (thirty-fifth study).
    let bert = example("bert-checkpoint-amp.gtrace");
    let out = ok(&["summary", &bert]);
    let line = out
        .lines()
        .find(|l| l.contains("pools at peak reserved"))
        .unwrap_or_else(|| panic!("no pools line:\n{out}"));
    assert!(
        line.trim_start()
            .starts_with("pools at peak reserved: small 20.00 MiB (3.98 MiB allocated), large "),
        "{line}"
    );
    assert!(!line.contains("private"), "{line}");
    // Every reserved byte is some pool's or unmapped, and every allocated
    // byte is in some pool, in a trace with private pools too.
    for name in [
        "bert-checkpoint-amp.gtrace",
        "reduce-overhead-graphs.gtrace",
    ] {
        let path = example(name);
        let v: serde_json::Value =
            serde_json::from_str(&ok(&["summary", &path, "--json"])).unwrap();
        let d = &v["devices"][0];
        let x = &d["pools_at_peak_reserved"];
        let sum = |k: &str| {
            ["small", "large", "private"]
                .iter()
                .map(|p| x[p][k].as_u64().unwrap())
                .sum::<u64>()
        };
        assert_eq!(
            sum("reserved") + x["unmapped"].as_u64().unwrap(),
            d["peak_reserved"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            sum("allocated"),
            d["allocated_at_peak_reserved"].as_u64().unwrap(),
            "{name}"
        );
        let private = x["private"]["reserved"].as_u64().unwrap();
        assert_eq!(private > 0, name.starts_with("reduce"), "{name}: {x}");
    }
    // The report's first answer says it too.
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("pools.html");
    ok(&["report", &bert, "-o", s(&html)]);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains("pools at peak reserved: small 20.00 MiB"),
        "in the report"
    );
}
