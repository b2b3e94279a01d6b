//! Random sequences of C ABI calls (`tests/c/fuzz_abi.c`).

use crate::support::{build_c, library, program};

/// Random sequences of C ABI calls (`tests/c/fuzz_abi.c`) on two simulated
/// devices never crash, and every device's invariants hold after every
/// call. `GPUALLOC_FUZZ_CASES` sets the number of sequences (README,
/// Fuzzing); `GPUALLOC_FUZZ_SEED` the first seed.
#[test]
fn random_call_sequences_never_crash() {
    let cases: u64 = std::env::var("GPUALLOC_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let seed0: u64 = std::env::var("GPUALLOC_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let (out, exe) = build_c("fuzz_abi");
    let traces = out.join("traces");
    std::fs::create_dir_all(&traces).unwrap();
    for seed in seed0..seed0 + cases {
        let run = program(&exe)
            .args([&seed.to_string(), "3000"])
            .arg(&traces)
            .env("LD_LIBRARY_PATH", library().parent().unwrap())
            .env("GPUALLOC_BACKEND", "sim")
            .env("GPUALLOC_SIM_DEVICES", "2")
            .env("GPUALLOC_SIM_CAPACITY", "8GiB")
            .env_remove("GPUALLOC_TRACE")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(
            run.status.success() && stdout.ends_with("FUZZ OK\n"),
            "seed {seed}: {}\n{stdout}\n{}",
            run.status,
            String::from_utf8_lossy(&run.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}
