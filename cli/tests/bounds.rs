//! What the analyses keep of a trace is bounded for the whole trace, not
//! per device: a crafted trace that spreads its events over many devices
//! (up to 1024) cannot multiply the memory a command takes. The bounds are
//! tested small in `analyses::state`; here one is reached end to end.

mod common;

use common::{gpualloc, s, write_blocks};
use gpualloc::trace::{EventKind, TraceEvent};

/// Iteration boundaries kept for a whole trace (`budget::MAX_BOUNDARIES`).
const BOUNDARIES: u64 = 1 << 22;

/// Marks on two devices, fewer than the bound on each but more together:
/// the iterations stop at the bound for the trace, and the command says
/// how many marks it left out.
#[test]
fn marks_spread_over_devices_keep_at_most_the_traces_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let per_device = BOUNDARIES / 2 + 50_000;
    let blocks = (0..per_device).step_by(4096).flat_map(|t0| {
        (0..2).map(move |d| {
            (t0..per_device.min(t0 + 4096))
                .map(|t| TraceEvent::from_kind(t, d, 0, 0, EventKind::Mark { name: 0 }))
                .collect()
        })
    });
    let t = write_blocks(dir.path(), "marks.gtrace", 2, &["step"], blocks);
    let out = gpualloc(&["leaks", s(&t), "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let kept: Vec<u64> = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["iterations"].as_u64().unwrap() - 1)
        .collect();
    assert_eq!(kept.iter().sum::<u64>(), BOUNDARIES, "{kept:?}");
    assert!(
        err.contains(&format!(
            "100000 marks and top-level phase openings past the first {BOUNDARIES} (all devices together) were not kept"
        )),
        "{err}"
    );
}
