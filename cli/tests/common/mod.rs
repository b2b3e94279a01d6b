//! What the CLI's integration tests share: running the command, and
//! building the events of small traces.
#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpualloc::trace::{EventKind, TraceEvent, TraceHeader, TraceWriter};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Runs the `gpualloc` command built for these tests.
pub fn gpualloc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpualloc"))
        .args(args)
        .output()
        .expect("run gpualloc")
}

/// Starts `gpualloc import --from rmm /dev/stdin -o out`, its stdin and
/// stderr piped: the caller feeds the log and waits for the output.
pub fn import_rmm_from_stdin(out: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_gpualloc"))
        .args(["import", "--from", "rmm", "/dev/stdin", "-o", s(out)])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run gpualloc")
}

/// Runs a command that must succeed; returns stdout and stderr.
pub fn ok(args: &[&str]) -> (String, String) {
    let out = gpualloc(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "gpualloc {args:?} failed: {err}");
    assert!(!err.contains("panicked"), "{err}");
    (String::from_utf8(out.stdout).unwrap(), err)
}

/// Runs a command that must fail with status 1 (gpualloc's own errors,
/// not the argument parser's) and no panic; returns its stderr.
pub fn fails(args: &[&str]) -> String {
    let out = gpualloc(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "gpualloc {args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// The HTML page `gpualloc report` writes for the trace `t` (beside it,
/// as `t` with the extension `html`).
pub fn report(t: &Path) -> String {
    let html = t.with_extension("html");
    ok(&["report", s(t), "-o", s(&html)]);
    std::fs::read_to_string(&html).unwrap()
}

/// `gpualloc generate` of `events` events drawn from `seed`, written as
/// `dir/gen-EVENTS.gtrace`.
pub fn generated(dir: &Path, events: u64, seed: u64) -> PathBuf {
    let p = dir.join(format!("gen-{events}.gtrace"));
    let (n, seed) = (events.to_string(), seed.to_string());
    ok(&["generate", "-o", s(&p), "--events", &n, "--seed", &seed]);
    p
}

/// A path as the command's argument.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// An event of device 0 at `time_ns`.
pub fn ev(time_ns: u64, kind: EventKind) -> TraceEvent {
    TraceEvent::from_kind(time_ns, 0, 0, 0, kind)
}

/// An allocation of exactly `size` bytes at `addr`.
pub fn alloc(addr: u64, size: u64) -> EventKind {
    EventKind::Alloc {
        addr,
        requested: size,
        block_size: size,
    }
}

/// Writes a one-device trace of `events` as `dir/name` under `config`:
/// with `dropped` events lost before the last of them when not 0, and an
/// END block (at the last event's time) when `end`.
pub fn write_trace(
    dir: &Path,
    name: &str,
    config: &str,
    events: &[TraceEvent],
    dropped: u64,
    end: bool,
) -> PathBuf {
    let header = TraceHeader {
        start_unix_ns: 1_700_000_000_000_000_000,
        device_count: 1,
        pid: 1,
        config: config.into(),
        producer: "test".into(),
    };
    let p = dir.join(name);
    let mut w = TraceWriter::new(std::fs::File::create(&p).unwrap(), &header).unwrap();
    let (head, tail) = events.split_at(events.len() - usize::from(dropped > 0));
    w.write_events(0, head).unwrap();
    if dropped > 0 {
        w.write_dropped(0, dropped, tail[0].time_ns).unwrap();
        w.write_events(0, tail).unwrap();
    }
    if end {
        w.finish(Some(events.last().map_or(0, |e| e.time_ns)))
            .unwrap();
    } else {
        w.flush().unwrap();
    }
    p
}

/// Writes a trace of `devices` devices, its string table `strings` and its
/// EVENTS blocks `blocks` in order (each on the device of its first
/// event), as `dir/name`, with an END block.
pub fn write_blocks(
    dir: &Path,
    name: &str,
    devices: u32,
    strings: &[&str],
    blocks: impl IntoIterator<Item = Vec<TraceEvent>>,
) -> PathBuf {
    let header = TraceHeader {
        start_unix_ns: 1_700_000_000_000_000_000,
        device_count: devices,
        pid: 1,
        config: String::new(),
        producer: "test".into(),
    };
    let p = dir.join(name);
    let file = std::io::BufWriter::new(std::fs::File::create(&p).unwrap());
    let mut w = TraceWriter::new(file, &header).unwrap();
    w.write_strings(strings).unwrap();
    for b in blocks.into_iter().filter(|b| !b.is_empty()) {
        w.write_events(b[0].device, &b).unwrap();
    }
    w.finish(None).unwrap();
    p
}
