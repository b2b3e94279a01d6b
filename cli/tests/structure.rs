//! Traces whose checksums are intact but whose content contradicts itself:
//! blocks deleted, duplicated or reordered, ranges past the end of the
//! address space, more allocated than reserved. The CLI rejects them or
//! warns, and never panics or wraps.

use std::path::{Path, PathBuf};

use gpualloc::trace::{Action, TraceEvent, TraceHeader, TraceWriter, frame};

mod common;
use common::{gpualloc, s};

/// A trace of one device whose events are `(action, addr, size, aux)`.
fn write(dir: &Path, name: &str, events: &[(Action, u64, u64, u64)]) -> PathBuf {
    let header = TraceHeader {
        start_unix_ns: 1_700_000_000_000_000_000,
        device_count: 1,
        pid: 1,
        config: String::new(),
        producer: "test".into(),
    };
    let mut w = TraceWriter::new(Vec::new(), &header).unwrap();
    for (i, &(action, addr, size, aux)) in events.iter().enumerate() {
        let e = TraceEvent {
            time_ns: 1000 * i as u64,
            action,
            device: 0,
            stream: 0,
            addr,
            size,
            aux,
            thread: 1,
        };
        w.write_events(0, &[e]).unwrap();
    }
    let (bytes, _) = w.finish(None).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Every reading command on `t`: exit status and stderr of each.
fn every_command(dir: &Path, t: &Path) -> Vec<(Vec<String>, Option<i32>, String)> {
    let out = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let t = s(t).to_string();
    let runs: Vec<Vec<String>> = vec![
        vec!["summary".into(), t.clone()],
        vec!["summary".into(), t.clone(), "--json".into()],
        vec!["report".into(), t.clone(), "-o".into(), out("r.html")],
        vec!["leaks".into(), t.clone()],
        vec![
            "replay".into(),
            t.clone(),
            "--capacity".into(),
            "1GiB".into(),
        ],
        vec!["export".into(), t.clone(), "--chrome".into(), out("c.json")],
        vec![
            "export".into(),
            t.clone(),
            "--torch-snapshot".into(),
            out("c.pickle"),
        ],
        vec!["export".into(), t.clone(), "--csv".into(), out("c.csv")],
        vec!["diff".into(), t.clone(), t.clone()],
    ];
    runs.into_iter()
        .map(|args| {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            let o = gpualloc(&a);
            let err = String::from_utf8_lossy(&o.stderr).into_owned();
            (args, o.status.code(), err)
        })
        .collect()
}

#[test]
fn ranges_past_the_address_space_are_reported_not_wrapped() {
    let dir = tempfile::tempdir().unwrap();
    let top = u64::MAX - 4095;
    let t = write(
        dir.path(),
        "wrap.gtrace",
        &[
            (Action::SegmentAlloc, top, 1 << 20, 1),
            (Action::SegmentMap, top, 1 << 20, 1),
            (Action::Alloc, top, 100, 1 << 20),
            (Action::SegmentUnmap, top, 1 << 20, 1),
            (Action::SegmentAlloc, 1 << 40, u64::MAX, 1),
            (Action::SegmentAlloc, 1 << 41, u64::MAX, 1),
            (Action::FreeRequested, top, 100, 1 << 20),
            (Action::FreeCompleted, top, 100, 1 << 20),
        ],
    );
    for (args, code, err) in every_command(dir.path(), &t) {
        assert!(matches!(code, Some(0 | 1)), "{args:?}: {code:?} {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        // Replay reruns the calls, and a CSV export copies the events.
        if args[0] != "replay" && !args.contains(&"--csv".to_string()) {
            assert!(err.contains("inconsistent"), "{args:?}: {err}");
        }
    }
}

#[test]
fn allocated_above_reserved_is_warned_of() {
    let dir = tempfile::tempdir().unwrap();
    let t = write(
        dir.path(),
        "over.gtrace",
        &[
            (Action::SegmentAlloc, 1 << 30, 4096, 1),
            (Action::Alloc, 1 << 30, 8192, 8192),
        ],
    );
    let o = gpualloc(&["summary", s(&t)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("allocated bytes above reserved bytes"),
        "{err}"
    );
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(!text.contains("(-"), "no negative figure: {text}");
}

#[test]
fn each_inconsistent_trace_of_several_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let over = [
        (Action::SegmentAlloc, 1 << 30, 4096, 1),
        (Action::Alloc, 1 << 30, 8192, 8192),
    ];
    let a = write(dir.path(), "rank-0.gtrace", &over);
    let b = write(dir.path(), "rank-1.gtrace", &over);
    let o = gpualloc(&["summary", s(&a), s(&b)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    for t in [&a, &b] {
        let lines: Vec<_> = err
            .lines()
            .filter(|l| l.contains(s(t)) && l.contains("inconsistent"))
            .collect();
        // Once per file, though `summary` reads each file twice.
        assert_eq!(lines.len(), 1, "{}: {err}", t.display());
    }
}

#[test]
fn blocks_deleted_or_duplicated_are_rejected_by_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let evs: Vec<_> = (0..6)
        .map(|i| (Action::Alloc, (i + 1) << 20, 100, 512))
        .collect();
    let t = write(dir.path(), "whole.gtrace", &evs);
    let file = std::fs::read(&t).unwrap();
    let (h, blocks) = frame::split(&file).unwrap();
    let mut deleted = blocks.clone();
    deleted.remove(2);
    let mut duplicated = blocks.clone();
    duplicated.insert(3, blocks[3].clone());
    for (name, v) in [("deleted", deleted), ("duplicated", duplicated)] {
        let p = dir.path().join(format!("{name}.gtrace"));
        std::fs::write(&p, frame::join(&file, &h, &v)).unwrap();
        for (args, code, err) in every_command(dir.path(), &p) {
            assert_eq!(code, Some(1), "{name}: {args:?} accepted: {err}");
            assert!(
                err.contains("blocks were deleted, duplicated or reordered"),
                "{name}: {args:?}: {err}"
            );
        }
    }
}
