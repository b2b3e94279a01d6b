//! Trace control through the Rust API: names longer than a trace holds,
//! failed writes, and `trace_start`/`trace_stop` racing each other.

use std::path::PathBuf;

use gpualloc::trace::{Action, TraceReader};
use gpualloc::{Allocator, Config, SimBackend};

fn sim(devices: usize) -> Allocator<SimBackend> {
    Allocator::new(
        Config::default(),
        devices,
        Box::new(|_| Ok(SimBackend::new(1 << 30))),
    )
}

fn temp(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

/// Names longer than `MAX_NAME_LEN` are refused, tracing or not, with both
/// lengths; the trace stays readable and holds the names that were taken.
#[test]
fn names_longer_than_a_trace_holds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = sim(1);
    let long = "n".repeat(70 << 20);
    let e = a.mark(&long).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(
        e.to_string()
            .contains("mark name of 73400320 bytes is above the limit of 4096 bytes"),
        "{e}"
    );
    let path = temp(&dir, "t.gtrace");
    a.trace_start(&path).unwrap();
    a.free(0, a.malloc(0, 4096, 0).unwrap()).unwrap();
    assert!(a.phase_push(&long[..4097]).is_err());
    assert!(a.mark(&long).is_err());
    a.phase_push(&long[..4096]).unwrap();
    a.phase_pop();
    a.trace_stop().unwrap();
    let mut r = TraceReader::open(&path).unwrap();
    let actions: Vec<Action> = r.events().map(|e| e.action).collect();
    assert!(!actions.contains(&Action::Mark), "{actions:?}");
    assert_eq!(
        actions.iter().filter(|&&x| x == Action::PhasePush).count(),
        1
    );
    assert!(r.error().is_none(), "{:?}", r.error());
    assert_eq!(r.strings(), [&long[..4096]]);
}

/// A configuration string longer than a trace header holds is refused at
/// `trace_start`, before the file is created.
#[test]
fn a_configuration_too_long_for_the_header_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let source = "max_split_size_mb:64";
    let mut config = Config::parse(source).unwrap();
    config.source = format!("{source}{}", " ".repeat(2 << 20));
    let a = Allocator::new(config, 1, Box::new(|_| Ok(SimBackend::new(1 << 30))));
    let path = temp(&dir, "long.gtrace");
    let e = a.trace_start(&path).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(
        e.to_string()
            .contains("configuration string of 2097172 bytes")
            && e.to_string().contains("long.gtrace"),
        "{e}"
    );
    assert!(!path.exists());
    assert!(!a.is_tracing());
}

/// A trace whose directory is removed while it is written reports the
/// loss at flush and at stop instead of success.
#[test]
fn a_trace_whose_directory_disappears_does_not_report_success() {
    let dir = tempfile::tempdir().unwrap();
    let sub = temp(&dir, "run");
    std::fs::create_dir(&sub).unwrap();
    let a = sim(1);
    a.trace_start(&sub.join("t.gtrace")).unwrap();
    a.free(0, a.malloc(0, 4096, 0).unwrap()).unwrap();
    a.trace_flush().unwrap();
    std::fs::remove_dir_all(&sub).unwrap();
    a.free(0, a.malloc(0, 4096, 0).unwrap()).unwrap();
    let e = a.trace_flush().unwrap_err().to_string();
    assert!(
        e.contains("removed or replaced") && e.contains("t.gtrace"),
        "{e}"
    );
    let e = a.trace_stop().unwrap_err().to_string();
    assert!(e.contains("removed or replaced"), "{e}");
    assert!(!a.is_tracing());
}

/// Writes that fail (here: the file size limit, in a child process with
/// `ulimit -f` and SIGXFSZ ignored) are counted in `num_trace_dropped`,
/// as many as `trace_stop`'s error says could not be written.
#[test]
fn failed_writes_are_counted_as_dropped() {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 8; exec \"$0\" --exact scenarios::tracing::write_failure_child --nocapture")
        .arg(std::env::current_exe().unwrap())
        .env("GPUALLOC_WRITE_FAILURE_CHILD", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("child ok"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The child of [`failed_writes_are_counted_as_dropped`] (does nothing
/// unless started by it).
#[test]
fn write_failure_child() {
    if std::env::var_os("GPUALLOC_WRITE_FAILURE_CHILD").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let a = sim(1);
    let opts = gpualloc::trace::TraceOptions {
        buffer_events: 256,
        lossless: true,
        ..Default::default()
    };
    a.trace_start_with(&temp(&dir, "t.gtrace"), opts).unwrap();
    for _ in 0..5000 {
        a.free(0, a.malloc(0, 4096, 0).unwrap()).unwrap();
    }
    let e = a.trace_stop().unwrap_err().to_string();
    let lost: i64 = e
        .split(" trace events could not be written")
        .next()
        .and_then(|s| s.rsplit('(').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {e}"));
    assert!(lost > 1000, "{e}");
    assert_eq!(a.stats(0).unwrap().num_trace_dropped, lost, "{e}");
    // An accumulated counter like PyTorch's `num_*` (docs/stats.md); the
    // error above keeps the trace's own total.
    a.reset_accumulated_stats(0).unwrap();
    assert_eq!(a.stats(0).unwrap().num_trace_dropped, 0);
    println!("child ok");
}

/// `trace_start` and `trace_stop` racing from two threads (while a third
/// allocates) never leave a device attached to a stopped recorder: after
/// each round, a fresh trace records both devices' events.
#[test]
fn racing_start_and_stop_never_lose_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let a = std::sync::Arc::new(sim(2));
    for d in 0..2 {
        a.free(d, a.malloc(d, 4096, 0).unwrap()).unwrap();
    }
    for round in 0..500 {
        let barrier = std::sync::Barrier::new(3);
        let path = temp(&dir, &format!("race-{round}.gtrace"));
        std::thread::scope(|s| {
            s.spawn(|| {
                barrier.wait();
                let _ = a.trace_start(&path);
            });
            s.spawn(|| {
                barrier.wait();
                let _ = a.trace_stop();
            });
            s.spawn(|| {
                barrier.wait();
                for i in 0..20 {
                    let d = i % 2;
                    a.free(d, a.malloc(d, 4096, 0).unwrap()).unwrap();
                }
            });
        });
        let _ = a.trace_stop();
        let check = temp(&dir, "check.gtrace");
        a.trace_start(&check).unwrap();
        for d in 0..2 {
            a.free(d, a.malloc(d, 4096, 0).unwrap()).unwrap();
        }
        a.trace_stop().unwrap();
        let mut r = TraceReader::open(&check).unwrap();
        let allocs: Vec<u32> = r
            .events()
            .filter(|e| e.action == Action::Alloc)
            .map(|e| e.device)
            .collect();
        assert_eq!(allocs, [0, 1], "round {round}: a device's events were lost");
        assert_eq!(a.stats(0).unwrap().num_trace_dropped, 0);
    }
}

/// A mark made while tracing but before any device started is kept for the
/// first device, in order before its first allocation (it was lost).
#[test]
fn a_mark_before_the_first_allocation_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let a = sim(2);
    let path = temp(&dir, "early.gtrace");
    a.trace_start(&path).unwrap();
    a.mark("before anything").unwrap();
    a.free(1, a.malloc(1, 4096, 0).unwrap()).unwrap();
    a.mark("after").unwrap();
    a.trace_stop().unwrap();
    let mut r = TraceReader::open(&path).unwrap();
    let events: Vec<_> = r.events().collect();
    assert!(r.error().is_none(), "{:?}", r.error());
    let marks: Vec<_> = events
        .iter()
        .filter(|e| e.action == Action::Mark)
        .map(|e| (e.device, r.strings()[e.name_id().unwrap() as usize].clone()))
        .collect();
    assert_eq!(
        marks,
        [(1, "before anything".to_string()), (1, "after".to_string())]
    );
    let first_alloc = events
        .iter()
        .position(|e| e.action == Action::Alloc)
        .unwrap();
    let first_mark = events
        .iter()
        .position(|e| e.action == Action::Mark)
        .unwrap();
    assert!(first_mark < first_alloc);
}
