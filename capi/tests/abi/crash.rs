//! Crash reports (`GPUALLOC_CRASH_REPORT`).

use crate::support::{build_c, run_sim_with};
use std::path::Path;

/// With `GPUALLOC_CRASH_REPORT=1`, a crash is reported on stderr (signal,
/// thread name, native stack) before the handler there before ends the
/// process by the same signal, for a fault and for a signal sent; without
/// it, nothing is printed. Note [Crash reports].
#[test]
fn a_crash_is_reported_and_still_ends_the_process() {
    use std::os::unix::process::ExitStatusExt;
    let (out, exe) = build_c("crash_test");
    // Runs the program, checks it died of `signal`, returns its stderr.
    let crash = |how: &str, signal: i32, report: Option<&str>| {
        let vars: Vec<(&str, &std::ffi::OsStr)> = report
            .map(|v| ("GPUALLOC_CRASH_REPORT", v.as_ref()))
            .into_iter()
            .collect();
        let run = run_sim_with(&exe, &[Path::new(how)], &vars);
        let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
        assert_eq!(
            run.status.signal(),
            Some(signal),
            "{how}: {}\n{stderr}",
            run.status
        );
        stderr
    };
    for (how, signal, name, cause) in [
        ("segv", 11, "SIGSEGV", "at address 0x0,"),
        ("abort", 6, "SIGABRT", "sent by process "),
    ] {
        let stderr = crash(how, signal, Some("1"));
        let report = stderr
            .split_once("gpualloc: crash report: ")
            .unwrap_or_else(|| panic!("{how}: no report:\n{stderr}"))
            .1;
        assert!(report.starts_with(name), "{how}: {report}");
        assert!(
            report.lines().next().unwrap().contains(cause),
            "{how}: {report}"
        );
        assert!(report.contains("\"crasher\""), "{how}: {report}");
        assert!(report.contains("libgpualloc.so("), "{how}: {report}");
        assert!(
            report.contains("gpualloc: end of crash report"),
            "{how}: {report}"
        );
        assert_eq!(
            stderr.matches("crash report:").count(),
            1,
            "{how}: {stderr}"
        );

        let stderr = crash(how, signal, None);
        assert!(!stderr.contains("crash report"), "{how}: {stderr}");
    }
    // Two threads at once: one report, written to its end, then the
    // process ends by the signal.
    let stderr = crash("two", 11, Some("1"));
    assert_eq!(stderr.matches("crash report:").count(), 1, "{stderr}");
    assert!(stderr.contains("gpualloc: end of crash report"), "{stderr}");
    let stderr = crash("segv", 11, Some("maybe"));
    assert!(
        stderr.contains("GPUALLOC_CRASH_REPORT=maybe is neither"),
        "{stderr}"
    );
    assert!(!stderr.contains("crash report:"), "{stderr}");
    let _ = std::fs::remove_dir_all(&out);
}
