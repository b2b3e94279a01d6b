//! Segment snapshots and observers (`tests/c/segments_test.c`) and IPC
//! shares (`tests/c/ipc_test.c`), under both policies.

use crate::support::{all_ok, build_c, run_sim};

/// Runs the C program `name` on the simulated backend with `vars`, under
/// gpualloc's default policy (expandable segments) and under
/// `policy:pytorch` (plain segments); each run must end with "ALL OK".
fn run_under_both_policies(name: &str, vars: &[(&str, &std::ffi::OsStr)]) {
    let (out, exe) = build_c(name);
    for conf in [None, Some("policy:pytorch")] {
        let mut vars = vars.to_vec();
        if let Some(c) = conf {
            vars.push(("GPUALLOC_CONF", c.as_ref()));
        }
        let run = run_sim(&exe, &vars);
        all_ok(&run, &format!("{name} {conf:?}"));
        eprintln!("{name} {conf:?}: {}", String::from_utf8_lossy(&run.stdout));
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// `gpualloc_snapshot_segments` agrees with `gpualloc_snapshot_json`, and an
/// observer installed with `gpualloc_set_segment_observer` sees every
/// segment come and go (`tests/c/segments_test.c`), with expandable
/// segments (the default) and with plain ones.
#[test]
fn segment_structs_and_events() {
    run_under_both_policies(
        "segments_test",
        &[
            ("GPUALLOC_SIM_DEVICES", "2".as_ref()),
            ("GPUALLOC_SIM_CAPACITY", "1GiB".as_ref()),
        ],
    );
}

/// Sharing allocations with other processes (`tests/c/ipc_test.c`): the
/// bytes of a share of expandable memory, the offset of a plain segment's
/// block, and clean refusals (opening needs the CUDA backend).
#[test]
fn ipc_shares_and_refusals() {
    run_under_both_policies("ipc_test", &[]);
}
