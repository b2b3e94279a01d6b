//! What every topic's tests share: compiling the C and C++ programs
//! against the generated header, finding the libgpualloc.so under test,
//! running the programs on the simulated backend and checking what they
//! printed.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The directory cargo put this profile's artifacts in (`target/debug`).
fn artifact_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/abi-<hash>
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

/// A command that runs one of the compiled C programs, under
/// `GPUALLOC_TEST_WRAPPER` when set: a program and its arguments, split on
/// spaces, such as `valgrind --error-exitcode=99 -q` (README, Memory
/// errors). An error the wrapper finds then fails the test through the
/// program's exit status. The configuration variables of the test run's
/// own environment are removed (a test sets those it wants): gpualloc's,
/// and PyTorch's, whose fraction caps devices too.
pub(crate) fn program(exe: &Path) -> Command {
    let wrapper = std::env::var("GPUALLOC_TEST_WRAPPER").unwrap_or_default();
    let mut words = wrapper.split_whitespace();
    let mut cmd = match words.next() {
        Some(tool) => {
            let mut cmd = Command::new(tool);
            cmd.args(words).arg(exe);
            cmd
        }
        None => Command::new(exe),
    };
    for name in [
        "GPUALLOC_CONF",
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
    ] {
        cmd.env_remove(name);
    }
    cmd
}

/// [`gcc`] for C++ (C++17, as the bridge is built).
pub(crate) fn gxx(src: &Path, out: &Path, extra: &[&std::ffi::OsStr]) {
    compiler("g++", &["-std=c++17"], src, out, extra);
}

/// Compiles one C file against the header and links it with libgpualloc.
pub(crate) fn compile(src: &Path, exe: &Path) {
    let lib = library();
    gcc(
        src,
        exe,
        &[
            "-L".as_ref(),
            lib.parent().unwrap().as_os_str(),
            "-lgpualloc".as_ref(),
            "-lm".as_ref(),
        ],
    );
}

/// Compiles one C file against the header into `out`, with `extra`
/// arguments after the source (libraries, `-shared`).
pub(crate) fn gcc(src: &Path, out: &Path, extra: &[&std::ffi::OsStr]) {
    compiler("gcc", &["-std=c11", "-pedantic"], src, out, extra);
}

/// Runs `tool` with `flags`, warnings as errors, on `src` against the
/// header into `out`, with `extra` arguments after the source.
fn compiler(tool: &str, flags: &[&str], src: &Path, out: &Path, extra: &[&std::ffi::OsStr]) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let run = Command::new(tool)
        .args(flags)
        .args(["-Wall", "-Wextra", "-Werror", "-O1", "-pthread", "-I"])
        .arg(manifest.join("include"))
        .arg(src)
        .arg("-o")
        .arg(out)
        .args(extra)
        .output()
        .unwrap_or_else(|e| panic!("{tool} is installed: {e}"));
    assert!(
        run.status.success(),
        "{tool} failed on {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The libgpualloc.so under test: `GPUALLOC_TEST_LIBRARY` when set (the
/// release build `tools/test.sh` has just made), else one built with the
/// profile of this test run (`cargo test` compiles the crate only as a
/// test harness, not as the cdylib).
pub(crate) fn library() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            if let Some(lib) = std::env::var_os("GPUALLOC_TEST_LIBRARY") {
                let lib = PathBuf::from(lib);
                assert!(
                    lib.is_file() && lib.file_name().is_some_and(|n| n == "libgpualloc.so"),
                    "GPUALLOC_TEST_LIBRARY={}: no such libgpualloc.so (an absolute path is needed: \
                     the tests run in their package's folder)",
                    lib.display()
                );
                return lib;
            }
            let dir = artifact_dir();
            let target_dir = dir.parent().expect("target dir");
            let mut cmd = Command::new(env!("CARGO"));
            cmd.args(["build", "-p", "gpualloc-capi", "--target-dir"])
                .arg(target_dir);
            if dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            let status = cmd.status().expect("run cargo build");
            assert!(status.success(), "cargo build -p gpualloc-capi failed");
            let lib = dir.join("libgpualloc.so");
            assert!(lib.exists(), "{} not found", lib.display());
            lib
        })
        .clone()
}

/// Runs `exe` on the simulated backend with `vars` set.
pub(crate) fn run_sim(exe: &Path, vars: &[(&str, &std::ffi::OsStr)]) -> std::process::Output {
    run_sim_with(exe, &[], vars)
}

/// Checks that a program that ends by printing `done` exited 0 having
/// printed only that; returns its stderr.
pub(crate) fn ran_to_done(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{}: {err}", out.status);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "done\n");
    err
}

/// [`run_sim`] with arguments for the program.
pub(crate) fn run_sim_with(
    exe: &Path,
    args: &[&Path],
    vars: &[(&str, &std::ffi::OsStr)],
) -> std::process::Output {
    let lib = library();
    let mut cmd = program(exe);
    cmd.args(args)
        .env("LD_LIBRARY_PATH", lib.parent().unwrap())
        .env("GPUALLOC_BACKEND", "sim")
        .env_remove("GPUALLOC_TRACE")
        .env_remove("GPUALLOC_CRASH_REPORT");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// Compiles `tests/c/<name>.c` into a fresh directory.
pub(crate) fn build_c(name: &str) -> (PathBuf, PathBuf) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    build(name, &manifest.join(format!("tests/c/{name}.c")))
}

/// Writes `source` to `<name>.c` in a fresh directory and compiles it.
pub(crate) fn build_inline(name: &str, source: &str) -> (PathBuf, PathBuf) {
    let out = fresh_dir(name);
    let src = out.join(format!("{name}.c"));
    std::fs::write(&src, source).unwrap();
    build(name, &src)
}

pub(crate) fn fresh_dir(name: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("gpualloc-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    out
}

fn build(name: &str, src: &Path) -> (PathBuf, PathBuf) {
    let out = fresh_dir(name);
    let exe = out.join(name);
    compile(src, &exe);
    (out, exe)
}

/// Asserts that a C test program ended well, its output last saying
/// `ALL OK`; returns its stderr.
pub(crate) fn all_ok(run: &std::process::Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(
        run.status.success() && stdout.trim_end().ends_with("ALL OK"),
        "{what}: {}\n{stdout}\n{stderr}",
        run.status
    );
    stderr
}
