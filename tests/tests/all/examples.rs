//! `examples/c/basic.c` compiles with the system C compiler (`cc`, or `$CC`)
//! against `capi/include/gpualloc.h`, links to the libgpualloc.so of this
//! build (or `GPUALLOC_TEST_LIBRARY`), and runs on the simulated device; its trace reads back. Skipped,
//! with a message, only where no C compiler exists.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpualloc::trace::TraceReader;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The folder of the libgpualloc.so under test: that of
/// `GPUALLOC_TEST_LIBRARY` when set (the release build `tools/test.sh` has
/// just made), else `target/debug` or `target/release` after building it
/// with this test run's profile.
fn library_dir() -> PathBuf {
    if let Some(lib) = std::env::var_os("GPUALLOC_TEST_LIBRARY") {
        let lib = PathBuf::from(lib);
        assert!(
            lib.is_file() && lib.file_name().is_some_and(|n| n == "libgpualloc.so"),
            "GPUALLOC_TEST_LIBRARY={}: no such libgpualloc.so (an absolute path is needed: \
             the tests run in their package's folder)",
            lib.display()
        );
        return lib.parent().unwrap().to_path_buf();
    }
    // target/<profile>/deps/all-<hash>
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .args(["build", "-p", "gpualloc-capi", "--target-dir"])
        .arg(dir.parent().unwrap());
    if dir.ends_with("release") {
        cargo.arg("--release");
    }
    assert!(
        cargo.status().unwrap().success(),
        "cargo build -p gpualloc-capi"
    );
    assert!(dir.join("libgpualloc.so").exists());
    dir
}

#[test]
fn c_example_compiles_and_runs_on_the_simulated_device() {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    if Command::new(&cc).arg("--version").output().is_err() {
        eprintln!("SKIPPED: no C compiler ({cc}) to build examples/c/basic.c");
        return;
    }
    let lib = library_dir();
    let out = tempdir();
    let exe = out.join("basic");
    let built = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(root().join("capi/include"))
        .arg(root().join("examples/c/basic.c"))
        .arg("-L")
        .arg(&lib)
        .args(["-lgpualloc", "-o"])
        .arg(&exe)
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "{cc} failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let trace = out.join("basic.gtrace");
    let run = Command::new(&exe)
        .arg(&trace)
        .env("LD_LIBRARY_PATH", &lib)
        .env("GPUALLOC_BACKEND", "sim")
        .env_remove("GPUALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .env_remove("GPUALLOC_TRACE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    for want in [
        "on the sim backend, 1 device(s)",
        "allocated:   allocated 70255616 B in 3 blocks",
        "freed:       allocated 0 B in 0 blocks",
        "out of memory: 2147483648 B can never fit (at most 1073741824 B)",
        "emptied:     allocated 0 B in 0 blocks, reserved 0 B",
    ] {
        assert!(stdout.contains(want), "no {want:?} in:\n{stdout}");
    }
    let mut reader = TraceReader::open(&trace).unwrap();
    let events = reader.events().count();
    assert!(reader.take_error().is_none());
    assert_eq!(reader.header().config, "memory_limit:1GiB");
    assert!(
        stdout.contains(&format!("{events} events")),
        "{events} events read back:\n{stdout}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpualloc-example-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
