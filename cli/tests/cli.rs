//! The `gpualloc` command end to end, on traces it generates itself.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn gpualloc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpualloc"))
        .args(args)
        .output()
        .expect("run gpualloc")
}

fn ok(args: &[&str]) -> String {
    let out = gpualloc(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "gpualloc {args:?} failed: {err}");
    assert!(!err.contains("panicked"), "{err}");
    String::from_utf8(out.stdout).unwrap()
}

/// Runs a failing command; returns stderr after checking it failed cleanly.
fn fails(args: &[&str]) -> String {
    let out = gpualloc(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "gpualloc {args:?} should fail with status 1: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.starts_with("gpualloc: "), "{err}");
    err
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn generated(dir: &Path, events: u64) -> PathBuf {
    let p = dir.join(format!("gen-{events}.gtrace"));
    ok(&[
        "generate",
        "-o",
        s(&p),
        "--events",
        &events.to_string(),
        "--seed",
        "3",
    ]);
    p
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

#[test]
fn report_is_one_self_contained_page() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path(), 50_000);
    let html = dir.path().join("r.html");
    ok(&["report", s(&t), "-o", s(&html)]);
    let page = std::fs::read_to_string(&html).unwrap();
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
    // The trace recorded on a GPU with expandable segments (segment_map/unmap).
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/gpt2-varlen.gtrace"
    );
    let pickle3 = dir.path().join("gpt2.pickle");
    ok(&["export", example, "--torch-snapshot", s(&pickle3)]);
    run(&pickle3);
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
        let out = Command::new("python3")
            .args(["-c", script, s(&pickle), proto])
            .output()
            .expect("python3 is required");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let g = dir.path().join("torch.gtrace");
        ok(&["import", s(&pickle), "-o", s(&g)]);
        let out = ok(&["summary", s(&g)]);
        assert!(out.contains("OOMs            1"), "{out}");
        assert!(
            out.contains("peak allocated      5.00 MiB") || out.contains("5.00 MiB"),
            "{out}"
        );
        assert!(
            out.contains("1 frees of blocks allocated before the trace began were skipped"),
            "{out}"
        );
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
