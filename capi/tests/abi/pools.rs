//! Private pools beyond capture scopes (`tests/c/pools_test.c`).

use crate::support::{build_c, run_sim};

/// The private-pool calls beyond capture scopes (`tests/c/pools_test.c`):
/// holds, use counts, `emptyCache(mempool_id)`, live allocations,
/// checkpoints and restores, with their buffer and validation errors, a
/// pool served by another allocator, and PyTorch's `expandable_segments`
/// switched off and on.
#[test]
fn pool_holds_checkpoints_and_restores() {
    let (out, exe) = build_c("pools_test");
    let run = run_sim(&exe, &[("GPUALLOC_SIM_CAPACITY", "1GiB".as_ref())]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}\n{stdout}\n{stderr}", run.status);
    for section in [
        "plain requests",
        "holds",
        "served pool",
        "live_allocations",
        "checkpoint_restore",
    ] {
        assert!(
            stdout.lines().any(|l| l == format!("ok {section}")),
            "section {section} did not pass:\n{stdout}"
        );
    }
    assert!(stdout.trim_end().ends_with("ALL OK"), "{stdout}\n{stderr}");
    let _ = std::fs::remove_dir_all(&out);
}
