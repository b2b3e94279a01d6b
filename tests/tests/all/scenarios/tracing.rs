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
