//! The C programs that exercise the whole ABI (`tests/c/abi_test.c`), and
//! its calls at thread exit and at exit (`tests/c/exit_test.c`).

use crate::support::{build_c, library, program, run_sim};

#[test]
fn c_program_exercises_the_whole_abi() {
    let lib = library();
    let (out, exe) = build_c("abi_test");

    let trace = out.join("abi.gtrace");
    let run = program(&exe)
        .env("LD_LIBRARY_PATH", lib.parent().unwrap())
        .env("GPUALLOC_BACKEND", "sim")
        .env("GPUALLOC_SIM_DEVICES", "2")
        .env("GPUALLOC_SIM_CAPACITY", "1GiB")
        .env("GPUALLOC_ABI_TRACE", &trace)
        .env_remove("GPUALLOC_TRACE")
        .output()
        .expect("run the C program");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "abi_test failed ({}):\n{stdout}\n{stderr}",
        run.status
    );
    for section in [
        "init",
        "malloc_free",
        "stats",
        "record_stream_empty_cache",
        "limits_oom",
        "snapshot",
        "pools",
        "trace",
        "threads",
    ] {
        assert!(
            stdout.lines().any(|l| l == format!("ok {section}")),
            "section {section} did not pass:\n{stdout}"
        );
    }
    assert!(stdout.trim_end().ends_with("ALL OK"), "{stdout}");
    // The bad free was reported, not fatal.
    assert!(stderr.contains("not allocated by gpualloc"), "{stderr}");
    let _ = std::fs::remove_dir_all(&out);
}

/// Calls from a pthread key destructor and an atexit handler, where the
/// thread-local last error is already destroyed, return status codes and
/// never abort.
#[test]
fn thread_exit_and_atexit_calls_do_not_abort() {
    let (out, exe) = build_c("exit_test");
    let run = run_sim(&exe, &[]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}\n{stdout}\n{stderr}", run.status);
    assert!(stdout.contains("key destructor: stats=0"), "{stdout}");
    assert!(stdout.contains("atexit: stats=0"), "{stdout}");
    assert!(stdout.trim_end().ends_with("exit ok"), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}
