//! Compiles `tests/c/abi_test.c` with `gcc -Wall -Wextra -Werror` against
//! the generated header, links it to libgpualloc.so (built for this test
//! run, or `GPUALLOC_TEST_LIBRARY`), and runs it on the simulated
//! backend. The C program exercises the whole ABI and prints `ALL OK` when
//! every check passed.

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
fn program(exe: &Path) -> Command {
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
fn gxx(src: &Path, out: &Path, extra: &[&std::ffi::OsStr]) {
    compiler("g++", &["-std=c++17"], src, out, extra);
}

/// Compiles one C file against the header and links it with libgpualloc.
fn compile(src: &Path, exe: &Path) {
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
fn gcc(src: &Path, out: &Path, extra: &[&std::ffi::OsStr]) {
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
fn library() -> PathBuf {
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

/// A bad GPUALLOC_CONF is an error value on every call, never an abort.
#[test]
fn bad_environment_is_an_error_not_an_abort() {
    let lib = library();
    let out = std::env::temp_dir().join(format!("gpualloc-abi-env-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let src = out.join("env_test.c");
    std::fs::write(
        &src,
        r#"#include "gpualloc.h"
#include <stdio.h>
int main(void) {
  void *p = gpualloc_malloc(1024, 0, 0);
  const char *e = gpualloc_last_error();
  printf("ptr=%p err=%s\n", p, e ? e : "none");
  printf("name=%s\n", gpualloc_backend_name() ? "yes" : "null");
  return p == NULL ? 0 : 1;
}
"#,
    )
    .unwrap();
    let exe = out.join("env_test");
    compile(&src, &exe);
    for (vars, expect) in [
        (
            vec![
                ("GPUALLOC_BACKEND", "sim"),
                ("GPUALLOC_CONF", "no_such_key:1"),
            ],
            "no_such_key",
        ),
        (vec![("GPUALLOC_BACKEND", "tpu")], "GPUALLOC_BACKEND"),
        (
            vec![
                ("GPUALLOC_BACKEND", "sim"),
                ("GPUALLOC_SIM_CAPACITY", "lots"),
            ],
            "GPUALLOC_SIM_CAPACITY",
        ),
    ] {
        let mut cmd = program(&exe);
        cmd.env("LD_LIBRARY_PATH", lib.parent().unwrap());
        for (k, v) in &vars {
            cmd.env(k, v);
        }
        let run = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(run.status.success(), "{vars:?}: {}\n{stdout}", run.status);
        assert!(
            stdout.contains("name=null") && stdout.contains(expect),
            "{vars:?}: {stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// The fallback entry point never hands PyTorch a silent NULL: it aborts
/// with the diagnosis.
#[test]
fn malloc_or_abort_aborts_loudly() {
    let (out, exe) = build_inline(
        "abort_test",
        r#"#include "gpualloc.h"
#include <stdio.h>
int main(void) {
  void *p = gpualloc_malloc_or_abort(4096, 0, 0);
  if (p == NULL) return 2;
  gpualloc_free(p, 4096, 0, 0);
  printf("small ok\n");
  fflush(stdout);
  gpualloc_malloc_or_abort((size_t)1 << 40, 0, 0);
  printf("not reached\n");
  return 3;
}
"#,
    );
    let run = run_sim(&exe, &[("GPUALLOC_SIM_CAPACITY", "1GiB".as_ref())]);
    use std::os::unix::process::ExitStatusExt;
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(
        run.status.signal(),
        Some(6),
        "expected SIGABRT: {}\n{stdout}\n{stderr}",
        run.status
    );
    assert!(
        stdout.contains("small ok") && !stdout.contains("not reached"),
        "{stdout}"
    );
    assert!(
        stderr.contains("out of memory") && stderr.contains("aborting"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// A C program traced through `GPUALLOC_TRACE` that never stops the trace
/// still gets a complete file: the library stops it at exit.
#[test]
fn a_trace_started_by_the_environment_is_completed_at_exit() {
    let (out, exe) = build_inline(
        "exit_env_test",
        r#"#include "gpualloc.h"
int main(void) {
  for (int i = 0; i < 100; i++) {
    void *p = gpualloc_malloc(4096, 0, 0);
    gpualloc_free(p, 4096, 0, 0);
  }
  return 0;
}
"#,
    );
    let trace = out.join("exit.gtrace");
    let run = run_sim(&exe, &[("GPUALLOC_TRACE", trace.as_os_str())]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let kinds = block_kinds(&std::fs::read(&trace).unwrap());
    assert_eq!(kinds.last(), Some(&4), "the last block is END: {kinds:?}");
    assert!(kinds.contains(&1), "events were written: {kinds:?}");
    // A word in braces that is no placeholder is said once, and kept.
    let odd = out.join("{RANK}.gtrace");
    let run = run_sim(&exe, &[("GPUALLOC_TRACE", odd.as_os_str())]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{err}");
    assert_eq!(err.matches("is not a placeholder").count(), 1, "{err}");
    assert!(err.contains("did you mean {rank}?"), "{err}");
    assert!(odd.exists(), "the path is kept as written");
    let _ = std::fs::remove_dir_all(&out);
}

/// The kinds of the blocks of a trace file, in order (16-byte block
/// headers: `BK`, kind, flags, device, length, crc).
fn block_kinds(data: &[u8]) -> Vec<u8> {
    // The file header: 14 bytes, its body, its crc32.
    let body = u32::from_le_bytes(data[10..14].try_into().unwrap()) as usize;
    let mut pos = 14 + body + 4;
    let mut kinds = Vec::new();
    while pos + 16 <= data.len() {
        assert_eq!(&data[pos..pos + 2], b"BK");
        kinds.push(data[pos + 2]);
        let len = u32::from_le_bytes(data[pos + 8..pos + 12].try_into().unwrap()) as usize;
        pos += 16 + len;
    }
    kinds
}

/// A C program that starts its trace with `gpualloc_trace_start` (or
/// keeps one with `gpualloc_configure`) and exits normally without
/// stopping it: the library completes it at exit, as it does a trace
/// started by `GPUALLOC_TRACE` (docs/trace-format.md: "a normal exit
/// completes the trace"), and as it already does for the same trace on
/// SIGTERM.
#[test]
fn a_trace_started_by_the_api_is_completed_at_exit() {
    for (name, start) in [
        ("exit_api_start", "gpualloc_trace_start(argv[1])"),
        ("exit_api_configure", "gpualloc_configure(NULL, argv[1])"),
    ] {
        let (out, exe) = build_inline(
            name,
            &format!(
                r#"#include "gpualloc.h"
int main(int argc, char **argv) {{
  (void)argc;
  if ({start} != 0) return 2;
  for (int i = 0; i < 100; i++) {{
    void *p = gpualloc_malloc(4096, 0, 0);
    gpualloc_free(p, 4096, 0, 0);
  }}
  return 0;
}}
"#
            ),
        );
        let trace = out.join("exit.gtrace");
        let run = run_sim_with(&exe, &[trace.as_path()], &[]);
        assert!(
            run.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let kinds = block_kinds(&std::fs::read(&trace).unwrap());
        let _ = std::fs::remove_dir_all(&out);
        assert!(kinds.contains(&1), "{name}: events were written: {kinds:?}");
        assert_eq!(
            kinds.last(),
            Some(&4),
            "{name}: the last block is END: {kinds:?}"
        );
    }
}

/// A trace started through `GPUALLOC_TRACE` whose writes fail (the file
/// size limit, SIGXFSZ ignored) says so on stderr at exit, with the file.
#[test]
fn a_trace_that_fails_to_write_is_reported_at_exit() {
    let lib = library();
    let out = std::env::temp_dir().join(format!("gpualloc-abi-full-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let src = out.join("full_test.c");
    std::fs::write(
        &src,
        r#"#include "gpualloc.h"
int main(void) {
  for (int i = 0; i < 20000; i++) {
    void *p = gpualloc_malloc(4096, 0, 0);
    gpualloc_free(p, 4096, 0, 0);
  }
  return 0;
}
"#,
    )
    .unwrap();
    let exe = out.join("full_test");
    compile(&src, &exe);
    let trace = out.join("full.gtrace");
    let run = Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 8; exec \"$0\"")
        .arg(&exe)
        .env("LD_LIBRARY_PATH", lib.parent().unwrap())
        .env("GPUALLOC_BACKEND", "sim")
        .env("GPUALLOC_TRACE", &trace)
        .env_remove("GPUALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stderr.contains("the trace is incomplete (at exit)")
            && stderr.contains("full.gtrace")
            && stderr.contains("could not be written"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Runs `exe` on the simulated backend with `vars` set.
fn run_sim(exe: &Path, vars: &[(&str, &std::ffi::OsStr)]) -> std::process::Output {
    run_sim_with(exe, &[], vars)
}

/// Checks that a program that ends by printing `done` exited 0 having
/// printed only that; returns its stderr.
fn ran_to_done(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{}: {err}", out.status);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "done\n");
    err
}

/// [`run_sim`] with arguments for the program.
fn run_sim_with(
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
fn build_c(name: &str) -> (PathBuf, PathBuf) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    build(name, &manifest.join(format!("tests/c/{name}.c")))
}

/// Writes `source` to `<name>.c` in a fresh directory and compiles it.
fn build_inline(name: &str, source: &str) -> (PathBuf, PathBuf) {
    let out = fresh_dir(name);
    let src = out.join(format!("{name}.c"));
    std::fs::write(&src, source).unwrap();
    build(name, &src)
}

fn fresh_dir(name: &str) -> PathBuf {
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

/// `gpualloc_free` reads PyTorch's current stream where libc10_cuda.so is
/// loaded (a stand-in built with g++ from `tests/c/c10_stand_in.cpp`, so
/// the compiler mangles the names and returns the values as c10 does): a
/// block freed while another stream is current is not reused at once; the
/// same program without the stand-in reuses it, until it loads the
/// stand-in itself and the lookup is tried again; c10 is never asked of a
/// device it does not count (Note [The current stream without the
/// bridge]).
#[test]
fn free_reads_pytorchs_current_stream_where_c10_is_loaded() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = fresh_dir("current_stream");
    let c10 = dir.join("libc10_cuda.so");
    gxx(
        &manifest.join("tests/c/c10_stand_in.cpp"),
        &c10,
        &[
            "-shared".as_ref(),
            "-fPIC".as_ref(),
            "-Wl,-soname,libc10_cuda.so".as_ref(),
        ],
    );
    let lib = library();
    let path = std::env::join_paths([dir.as_path(), lib.parent().unwrap()]).unwrap();
    let src = manifest.join("tests/c/current_stream_test.c");
    for with_c10 in [true, false] {
        let exe = dir.join(format!("current_stream_test_{with_c10}"));
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "-L".as_ref(),
            lib.parent().unwrap().as_os_str(),
            "-lgpualloc".as_ref(),
        ];
        if with_c10 {
            args.extend(["-L".as_ref(), dir.as_os_str(), "-lc10_cuda".as_ref()]);
        } else {
            args.extend::<[&std::ffi::OsStr; 2]>(["-DWITHOUT_C10".as_ref(), "-ldl".as_ref()]);
        }
        gcc(&src, &exe, &args);
        let run = run_sim(
            &exe,
            &[
                ("LD_LIBRARY_PATH", path.as_os_str()),
                ("GPUALLOC_SIM_DEVICES", "2".as_ref()),
                ("C10_STAND_IN", c10.as_os_str()),
            ],
        );
        let stderr = ran_to_done(&run);
        assert_eq!(stderr, "", "with c10: {with_c10}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fallback's raising entry point throws a C++ `std::runtime_error`
/// with the diagnosis to a C++ caller (PyTorch raises it in Python), which
/// catches it and goes on allocating; in a program without libstdc++ it
/// aborts as `gpualloc_malloc_or_abort`. Needs g++ (as the bridge does).
#[test]
fn malloc_or_raise_throws_to_a_cxx_caller() {
    let out = fresh_dir("raise_test");
    let src = out.join("raise_test.cpp");
    std::fs::write(
        &src,
        r#"#include "gpualloc.h"
#include <cstdio>
#include <cstring>
#include <stdexcept>
int main() {
  void *p = gpualloc_malloc_or_raise(4096, 0, nullptr);
  if (p == nullptr) return 2;
  for (int i = 0; i < 3; ++i) {
    try {
      gpualloc_malloc_or_raise(size_t{1} << 40, 0, nullptr);
      std::printf("not reached\n");
      return 3;
    } catch (const std::runtime_error &e) {
      if (std::strncmp(e.what(), "CUDA out of memory. Tried to allocate ", 38) != 0) {
        std::printf("message: %s\n", e.what());
        return 4;
      }
    }
  }
  // The allocator is usable after the errors: nothing was left locked.
  void *q = gpualloc_malloc_or_raise(1 << 20, 0, nullptr);
  if (q == nullptr) return 5;
  gpualloc_free(q, 1 << 20, 0, nullptr);
  gpualloc_free(p, 4096, 0, nullptr);
  std::printf("done\n");
  return 0;
}
"#,
    )
    .unwrap();
    let exe = out.join("raise_test");
    let lib = library();
    gxx(
        &src,
        &exe,
        &[
            "-L".as_ref(),
            lib.parent().unwrap().as_os_str(),
            "-lgpualloc".as_ref(),
        ],
    );
    ran_to_done(&run_sim(
        &exe,
        &[("GPUALLOC_SIM_CAPACITY", "1GiB".as_ref())],
    ));

    // A C program has no libstdc++ loaded: nothing to throw with, so it
    // aborts with the diagnosis, as the other entry point.
    let (cout, cexe) = build_inline(
        "raise_without_cxx_test",
        r#"#include "gpualloc.h"
#include <stdio.h>
int main(void) {
  gpualloc_malloc_or_raise((size_t)1 << 40, 0, 0);
  printf("not reached\n");
  return 3;
}
"#,
    );
    let run = run_sim(&cexe, &[("GPUALLOC_SIM_CAPACITY", "1GiB".as_ref())]);
    use std::os::unix::process::ExitStatusExt;
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(
        run.status.signal(),
        Some(6),
        "expected SIGABRT: {}\n{stderr}",
        run.status
    );
    assert!(
        stderr.contains("CUDA out of memory") && stderr.contains("aborting"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&cout);
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

/// The CUDA backend's own code, its unmapping helper thread included, on
/// the checking stand-in driver of `tests/c/fake_cuda.c` (built here as a
/// `libcuda.so` and found first through `LD_LIBRARY_PATH`): the churn loop
/// of the GPU suite's `churn_wide`, threads on their own streams of two
/// devices with blocks used on others, CUDA graph captures in each capture mode with
/// another thread allocating meanwhile (announced through
/// `gpualloc_begin_allocate_to_pool`, and followed through the driver for
/// `gpualloc_malloc_or_abort`), and `empty_cache`, under the default
/// configuration and PyTorch's rules; and, on a device of 1 GiB, the
/// churn loop with larger sizes, where every request refused must be
/// beyond the promise's page bound. The driver sees no misuse and no two
/// memory-mapping calls for one device at once (the second fails without
/// Note [One VMM call at a time]: tried), holds no memory at the end, and
/// gets no call after its teardown at exit. First, the stand-in catches
/// each misuse it looks for (`fake_cuda_selftest.c`).
#[test]
fn the_cuda_backend_on_a_checking_stand_in_driver() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = fresh_dir("fake_cuda");
    let fake = dir.join("libcuda.so");
    stand_in_driver(&fake, None);
    let selftest = dir.join("fake_cuda_selftest");
    gcc(
        &manifest.join("tests/c/fake_cuda_selftest.c"),
        &selftest,
        &["-L".as_ref(), dir.as_os_str(), "-lcuda".as_ref()],
    );
    let run = program(&selftest)
        .env("LD_LIBRARY_PATH", &dir)
        .env("FAKE_CUDA_DEVICES", "2")
        .env("FAKE_CUDA_VMM_US", "1000")
        .output();
    all_ok(&run.unwrap(), "the stand-in's own test");

    let exe = dir.join("fake_cuda_test");
    compile(&manifest.join("tests/c/fake_cuda_test.c"), &exe);
    let path = std::env::join_paths([dir.as_path(), library().parent().unwrap()]).unwrap();
    // `promise`: on a device of 1 GiB, every request refused is beyond the
    // page bound of docs/configuration.md (exact with 2 MiB handles).
    for (conf, mode, mib) in [
        ("", "vmm", "4096"),
        ("policy:pytorch", "plain", "4096"),
        ("expandable_handle_mb:2", "promise", "1024"),
    ] {
        let run = program(&exe)
            .args(["20000", "4", mode])
            .env("LD_LIBRARY_PATH", &path)
            .env("GPUALLOC_CONF", conf)
            .env("FAKE_CUDA_CAPACITY", mib)
            .env("FAKE_CUDA_DEVICES", "2")
            .env_remove("GPUALLOC_BACKEND")
            .env_remove("GPUALLOC_TRACE")
            .output();
        let stderr = all_ok(&run.unwrap(), &format!("{mode}, GPUALLOC_CONF={conf:?}"));
        assert!(!stderr.contains("misuse"), "{mode}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Asserts that a C test program ended well, its output last saying
/// `ALL OK`; returns its stderr.
fn all_ok(run: &std::process::Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(
        run.status.success() && stdout.trim_end().ends_with("ALL OK"),
        "{what}: {}\n{stdout}\n{stderr}",
        run.status
    );
    stderr
}

/// Read-only calls before the first allocation create nothing, so a later
/// `gpualloc_init` still takes effect; a successful call clears the last
/// error; a bad `GPUALLOC_CONF` is reported once, briefly; a non-UTF-8
/// `GPUALLOC_CONF` is an error, not ignored.
#[test]
fn read_only_calls_and_errors() {
    let (out, exe) = build_c("errors_test");
    let run = run_sim(&exe, &[]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}\n{stdout}\n{stderr}", run.status);
    assert!(stdout.trim_end().ends_with("ALL OK"), "{stdout}\n{stderr}");

    // A bad configuration of 100 KB, and many frees: one short message.
    let bad = format!("max_split_size_mb:{}", "9".repeat(100_000));
    let run = run_sim(
        &exe,
        &[("GPUALLOC_CONF", bad.as_ref()), ("BAD_CONF", "1".as_ref())],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}\n{stderr}", run.status);
    assert_eq!(stderr.matches("max_split_size_mb").count(), 1, "{stderr}");
    assert!(stderr.len() < 1000, "{} bytes of stderr", stderr.len());

    use std::os::unix::ffi::OsStrExt;
    let not_utf8 = std::ffi::OsStr::from_bytes(b"max_split_size_mb:\xff64");
    let run = run_sim(
        &exe,
        &[("GPUALLOC_CONF", not_utf8), ("BAD_CONF", "1".as_ref())],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}\n{stderr}", run.status);
    assert!(
        stderr.contains("GPUALLOC_CONF") && stderr.contains("UTF-8"),
        "{stderr}"
    );
    let not_utf8 = std::ffi::OsStr::from_bytes(b"si\xffm");
    let run = run_sim(
        &exe,
        &[("GPUALLOC_BACKEND", not_utf8), ("BAD_CONF", "1".as_ref())],
    );
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}\n{stderr}", run.status);
    assert!(
        stderr.contains("GPUALLOC_BACKEND is not valid UTF-8"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

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

/// `gpualloc_configure` checks and keeps a configuration and a trace
/// without starting the allocator (Note [Starting on first use]); the
/// first allocation starts it with both; afterwards it is `gpualloc_init`
/// and `gpualloc_trace_start`.
#[test]
fn configure_keeps_the_configuration_and_trace_for_the_first_use() {
    let (out, exe) = build_inline(
        "configure_test",
        r#"#include "gpualloc.h"
#include <stdio.h>
#include <string.h>
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s\n", __LINE__, #c); return 1; } } while (0)
int main(int argc, char **argv) {
  (void)argc;
  GpuallocTraceSummary s;
  CHECK(gpualloc_configure("no_such_key:1", NULL) == GPUALLOC_ERR_CONFIG);
  CHECK(gpualloc_configure("max_split_size_mb:128", argv[1]) == GPUALLOC_OK);
  CHECK(gpualloc_is_initialized() == 0);
  CHECK(gpualloc_is_tracing() == 1);
  CHECK(gpualloc_trace_flush() == GPUALLOC_OK);  /* nothing recorded yet, nothing to write */
  CHECK(gpualloc_is_initialized() == 0);
  CHECK(gpualloc_configure("max_split_size_mb:128", NULL) == GPUALLOC_OK);
  CHECK(gpualloc_configure("max_split_size_mb:256", NULL) == GPUALLOC_ERR_ALREADY_INITIALIZED);
  /* An installer whose set-up failed forgets what it kept: another may follow. */
  CHECK(gpualloc_forget_config("max_split_size_mb:256") == 0);
  CHECK(gpualloc_forget_config("max_split_size_mb:128") == 1);
  CHECK(gpualloc_forget_config("max_split_size_mb:128") == 0);
  CHECK(gpualloc_configure("max_split_size_mb:256", NULL) == GPUALLOC_OK);
  CHECK(gpualloc_forget_config("max_split_size_mb:256") == 1);
  CHECK(gpualloc_configure("max_split_size_mb:128", NULL) == GPUALLOC_OK);
  CHECK(gpualloc_init("max_split_size_mb:256") == GPUALLOC_ERR_ALREADY_INITIALIZED);
  CHECK(gpualloc_configure(NULL, argv[2]) == GPUALLOC_ERR_IO);
  CHECK(gpualloc_is_initialized() == 0);
  CHECK(gpualloc_config_string() == NULL);
  GpuallocStats st;
  memset(&st, 0, sizeof st);
  st.size = sizeof st;
  CHECK(gpualloc_get_stats(0, &st) == GPUALLOC_OK);
  CHECK(st.max_split_size == 128LL << 20);  /* the kept configuration's, before the start */
  CHECK(gpualloc_is_initialized() == 0);
  void *p = gpualloc_malloc(4096, 0, 0);
  CHECK(p != NULL);
  CHECK(gpualloc_is_initialized() == 1);
  CHECK(strcmp(gpualloc_config_string(), "max_split_size_mb:128") == 0);
  CHECK(gpualloc_forget_config("max_split_size_mb:128") == GPUALLOC_ERR_ALREADY_INITIALIZED);
  CHECK(gpualloc_init("max_split_size_mb:256") == GPUALLOC_ERR_ALREADY_INITIALIZED);
  CHECK(gpualloc_init("max_split_size_mb:128") == GPUALLOC_OK);
  gpualloc_free(p, 4096, 0, 0);
  CHECK(gpualloc_trace_stop(&s) == GPUALLOC_OK);
  CHECK(s.events >= 2);
  CHECK(gpualloc_configure(NULL, argv[2]) == GPUALLOC_OK);
  CHECK(gpualloc_is_tracing() == 1);
  CHECK(gpualloc_trace_stop(&s) == GPUALLOC_OK);
  printf("done\n");
  return 0;
}
"#,
    );
    let (a, b) = (out.join("a.gtrace"), out.join("b.gtrace"));
    let run = run_sim_with(&exe, &[&a, &b], &[]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success() && run.stdout.starts_with(b"done"),
        "{err}"
    );
    assert!(a.exists() && b.exists(), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

/// A trace kept for the start is forgotten by a stop before it (no file);
/// one in `GPUALLOC_TRACE` counts as kept, so a second is refused.
#[test]
fn a_kept_trace_is_forgotten_by_a_stop_and_the_environments_counts() {
    let (out, exe) = build_inline(
        "configure_stop_test",
        r#"#include "gpualloc.h"
#include <stdio.h>
#include <stdlib.h>
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s\n", __LINE__, #c); return 1; } } while (0)
int main(int argc, char **argv) {
  (void)argc;
  GpuallocTraceSummary s = {1, 1, 1};
  if (getenv("GPUALLOC_TRACE") != NULL) {
    CHECK(gpualloc_is_tracing() == 1);
    CHECK(gpualloc_configure(NULL, argv[1]) == GPUALLOC_ERR_IO);
    CHECK(gpualloc_trace_stop(&s) == GPUALLOC_OK);  /* calls GPUALLOC_TRACE's off */
    CHECK(gpualloc_is_tracing() == 0);
    void *q = gpualloc_malloc(4096, 0, 0);
    CHECK(q != NULL && gpualloc_is_tracing() == 0);
    gpualloc_free(q, 4096, 0, 0);
    printf("done\n");
    return 0;
  }
  CHECK(gpualloc_trace_stop(&s) == GPUALLOC_ERR_IO);
  CHECK(gpualloc_configure(NULL, argv[1]) == GPUALLOC_OK);
  CHECK(gpualloc_trace_stop(&s) == GPUALLOC_OK);
  CHECK(s.events == 0 && s.bytes == 0);
  CHECK(gpualloc_is_tracing() == 0);
  void *p = gpualloc_malloc(4096, 0, 0);
  CHECK(p != NULL && gpualloc_is_tracing() == 0);
  gpualloc_free(p, 4096, 0, 0);
  printf("done\n");
  return 0;
}
"#,
    );
    let a = out.join("a.gtrace");
    let env_trace = out.join("env.gtrace");
    for vars in [vec![], vec![("GPUALLOC_TRACE", env_trace.as_os_str())]] {
        let run = run_sim_with(&exe, &[&a], &vars);
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(
            run.status.success() && run.stdout.starts_with(b"done"),
            "{err}"
        );
    }
    assert!(!a.exists() && !env_trace.exists());
    let _ = std::fs::remove_dir_all(&out);
}

/// A kept trace's `{pid}` is the process that starts it: a child forked
/// before the start writes its own file, the parent (which never
/// allocates, as a launcher) none.
#[test]
fn a_kept_traces_placeholders_are_the_starting_process() {
    let (out, exe) = build_inline(
        "configure_fork_test",
        r#"#define _POSIX_C_SOURCE 200809L
#include "gpualloc.h"
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
int main(int argc, char **argv) {
  (void)argc;
  if (gpualloc_configure(NULL, argv[1]) != GPUALLOC_OK) return 1;
  pid_t child = fork();
  if (child == 0) {
    void *p = gpualloc_malloc(4096, 0, 0);
    gpualloc_free(p, 4096, 0, 0);
    return gpualloc_trace_stop(NULL) == GPUALLOC_OK ? 0 : 2;
  }
  int status = 0;
  waitpid(child, &status, 0);
  printf("child %d status %d\n", (int)child, status);
  return 0;
}
"#,
    );
    let pattern = out.join("t-{pid}.gtrace");
    let run = run_sim_with(&exe, &[&pattern], &[]);
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let child: u32 = stdout
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(stdout.contains("status 0"), "{stdout}");
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".gtrace"))
        .collect();
    files.sort();
    assert_eq!(files, vec![format!("t-{child}.gtrace")]);
    let _ = std::fs::remove_dir_all(&out);
}

/// What the library says on a stderr whose reader is gone (a job piped
/// through a `tee` that was killed; Python ignores SIGPIPE) goes unsaid,
/// not as a panic: a failed free (in the error handler, where the C
/// boundary would turn it into an abort), and what is said when the
/// allocator starts, from inside a `Once` that a panic would poison (the
/// first allocation, and every later one, would fail): an unknown
/// variable, a bad `GPUALLOC_LOG` and the logger's own lines, a trace path
/// word that is no placeholder, a bad `GPUALLOC_CRASH_REPORT`.
#[test]
fn what_is_said_on_a_closed_stderr_fails_nothing() {
    let (dir, exe) = build_inline(
        "closed_stderr",
        r#"#define _POSIX_C_SOURCE 200809L
#include "gpualloc.h"
#include <errno.h>
#include <signal.h>
#include <time.h>
#include <stdio.h>
#include <unistd.h>
int main(void) {
  signal(SIGPIPE, SIG_IGN);
  int gone = 0;
  for (int i = 0; i < 200000 && !gone; i++) {  /* until the reader has closed the pipe */
    gone = write(2, "x", 1) < 0 && errno == EPIPE;
    struct timespec t = {0, 50000};
    if (!gone) nanosleep(&t, NULL);
  }
  if (!gone) return 2;
  void *p = gpualloc_malloc(4096, 0, 0);
  if (p == NULL) return 3;
  gpualloc_free(p, 4096, 0, 0);
  gpualloc_free(p, 4096, 0, 0);  /* not allocated any more: reported */
  gpualloc_free((void *)0x1000, 16, 0, 0);
  printf("went on\n");
  return 0;
}
"#,
    );
    let lib = library();
    let trace = dir.join("t-{nope}.gtrace");
    for (key, value) in [
        ("", "".as_ref()),
        // Spelled so that `tests/tests/all/docs.rs` takes it for no variable.
        (concat!("GPUALLOC", "_NO_SUCH_VARIABLE"), "1".as_ref()),
        ("GPUALLOC_LOG", "debug".as_ref()),
        ("GPUALLOC_LOG", "loud".as_ref()),
        ("GPUALLOC_TRACE", trace.as_os_str()),
        ("GPUALLOC_CRASH_REPORT", "maybe".as_ref()),
    ] {
        let mut cmd = program(&exe);
        cmd.env("LD_LIBRARY_PATH", lib.parent().unwrap())
            .env("GPUALLOC_BACKEND", "sim")
            .env_remove("GPUALLOC_TRACE")
            .env_remove("GPUALLOC_LOG")
            .env_remove("GPUALLOC_CRASH_REPORT")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if !key.is_empty() {
            cmd.env(key, value);
        }
        let mut child = cmd.spawn().unwrap();
        drop(child.stderr.take());
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{key}={value:?}: {}", out.status);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "went on\n",
            "{key}={value:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Note [A trace read through a pipe]: a program whose trace goes to a
/// named pipe runs on when the reader leaves early, with SIGPIPE at its
/// default action (a C program's, which killed it with status 141).
#[test]
fn a_trace_reader_that_leaves_does_not_kill_the_program() {
    let (dir, exe) = build_inline(
        "trace_pipe",
        r#"#include "gpualloc.h"
#include <signal.h>
#include <stdio.h>
int main(void) {
  signal(SIGPIPE, SIG_DFL);
  for (int i = 0; i < 200000; i++) {
    void *p = gpualloc_malloc(4096, 0, 0);
    if (p == NULL) return 2;
    gpualloc_free(p, 4096, 0, 0);
    if (i % 10000 == 0) gpualloc_trace_flush();
  }
  printf("done\n");
  return 0;
}
"#,
    );
    let fifo = dir.join("trace.fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", fifo.display());
    // Reads the header's first bytes, then leaves.
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut head = [0u8; 100];
            std::io::Read::read_exact(&mut std::fs::File::open(&fifo).unwrap(), &mut head).unwrap();
            head
        })
    };
    let out = run_sim_with(&exe, &[], &[("GPUALLOC_TRACE", fifo.as_os_str())]);
    let head = reader.join().unwrap();
    assert_eq!(
        &head[..8],
        b"\x89GATRACE",
        "the reader got the trace's header"
    );
    let err = ran_to_done(&out);
    assert!(
        err.contains(&fifo.display().to_string()),
        "the failed trace is named: {err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Note [Locks held at a fork]: a child forked while one thread of its
/// parent held device 0's lock and another was parked waiting for it
/// asks for the device from a thread of its own, which glibc gives the
/// parked thread's stack and thread-local memory. The call fails (the lock
/// is held for good there) without parking, which crashed the child.
#[test]
fn a_forked_child_does_not_park_where_its_parents_threads_were_parked() {
    let (_out, exe) = build_inline(
        "fork_parked",
        r#"#define _GNU_SOURCE
#include "gpualloc.h"
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
static int inside = 0, forked = 0;
static void observer(void *ctx, int d, int a, uint64_t x, uint64_t s, uint64_t st) {
  (void)ctx; (void)d; (void)a; (void)x; (void)s; (void)st;
  pthread_mutex_lock(&m); inside = 1; pthread_cond_broadcast(&c);
  while (!forked) pthread_cond_wait(&c, &m);
  pthread_mutex_unlock(&m);
}
static void *grow(void *arg) { (void)arg; void *q = gpualloc_malloc(64 << 20, 0, 0); gpualloc_free(q, 0, 0, 0); return NULL; }
static void *waiter(void *arg) { (void)arg; void *q = gpualloc_malloc(4096, 0, 0); gpualloc_free(q, 0, 0, 0); return NULL; }
static void *ask(void *arg) { (void)arg; struct GpuallocHeld h; for (int i = 0; i < 3; i++) (void)gpualloc_held(0, &h); return NULL; }
static pthread_t spawn_sized(void *(*f)(void *), size_t sz) {
  pthread_attr_t a; pthread_attr_init(&a); pthread_attr_setstacksize(&a, sz);
  pthread_t t; pthread_create(&t, &a, f, NULL); pthread_attr_destroy(&a); return t;
}
static pthread_t spawn(void *(*f)(void *)) { return spawn_sized(f, 2 << 20); }
int main(void) {
  void *p = gpualloc_malloc(4096, 0, 0);
  if (!p) return 2;
  gpualloc_set_segment_observer(observer, NULL);
  pthread_t t = spawn_sized(grow, 4 << 20);
  pthread_mutex_lock(&m); while (!inside) pthread_cond_wait(&c, &m); pthread_mutex_unlock(&m);
  pthread_t w[1];
  for (int i = 0; i < 1; i++) w[i] = spawn(waiter);
  struct timespec ts = {0, 200000000}; nanosleep(&ts, NULL);  /* they park */
  pid_t pid = fork();
  if (pid == 0) {
    alarm(60);
    pthread_t k = spawn(ask);  /* gets the parked thread's stack, and its TLS */
    pthread_join(k, NULL);
    _exit(0);
  }
  pthread_mutex_lock(&m); forked = 1; pthread_cond_broadcast(&c); pthread_mutex_unlock(&m);
  pthread_join(t, NULL);
  for (int i = 0; i < 1; i++) pthread_join(w[i], NULL);
  int st = 0; waitpid(pid, &st, 0);
  if (WIFSIGNALED(st)) printf("child killed by signal %d\n", WTERMSIG(st));
  else printf("child exit %d\n", WEXITSTATUS(st));
  return 0;
}
"#,
    );
    for _ in 0..2 {
        let out = run_sim_with(&exe, &[], &[]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), "child exit 0\n");
    }
}

/// Note [Freeing in a forked child]: a child forked while another thread
/// holds a device lock (here: a segment observer, which runs under it,
/// waits until the fork happened) frees what it inherited without waiting
/// for that lock, which no thread of the child will ever release; it frees
/// nothing, the memory being its parent's. So do the calls that drop an
/// inherited graph's or MemPool's pool and an IPC tensor. The calls that
/// need the lock fail, naming the cause, instead of waiting for good, and
/// the inherited trace's mark, flush and exit handler pass over the device
/// (Note [Locks held at a fork]).
#[test]
fn a_forked_child_frees_without_the_locks_other_threads_held() {
    let (_out, exe) = build_inline(
        "fork_free",
        r#"#define _POSIX_C_SOURCE 200809L
#include "gpualloc.h"
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
static pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t c = PTHREAD_COND_INITIALIZER;
static int inside = 0, forked = 0;
static void observer(void *ctx, int device, int action, uint64_t address, uint64_t size, uint64_t stream) {
  (void)ctx; (void)device; (void)action; (void)address; (void)size; (void)stream;
  pthread_mutex_lock(&m);
  inside = 1;
  pthread_cond_broadcast(&c);
  while (!forked) pthread_cond_wait(&c, &m);
  pthread_mutex_unlock(&m);
}
static void *grow(void *arg) {
  (void)arg;
  void *q = gpualloc_malloc(64 << 20, 0, 0);  /* a new segment: the observer runs under the lock */
  gpualloc_free(q, 64 << 20, 0, 0);
  return NULL;
}
int main(void) {
  char trace[64];
  snprintf(trace, sizeof trace, "/tmp/gpualloc-fork-lock-%d.gtrace", (int)getpid());
  if (gpualloc_trace_start(trace) != GPUALLOC_OK) return 3;
  void *p = gpualloc_malloc(4096, 0, 0);
  if (p == NULL) return 2;
  gpualloc_set_segment_observer(observer, NULL);
  pthread_t t;
  pthread_create(&t, NULL, grow, NULL);
  pthread_mutex_lock(&m);
  while (!inside) pthread_cond_wait(&c, &m);
  pthread_mutex_unlock(&m);
  pid_t pid = fork();
  if (pid == 0) {
    alarm(30);  /* a child stuck on the lock is killed, and the test fails */
    gpualloc_free(p, 4096, 0, 0);
    uint64_t size = 1;
    int owner = 0;
    if (gpualloc_free_sized(p, &size, &owner) != GPUALLOC_OK || owner != -1 || size != 0) _exit(3);
    /* An inherited graph, MemPool or IPC tensor dropped: nothing either. */
    if (gpualloc_release_pool(0, 9, 9) != GPUALLOC_OK) _exit(4);
    if (gpualloc_empty_pool_cache(0, 9, 9) != GPUALLOC_OK) _exit(5);
    if (gpualloc_ipc_close(p) != GPUALLOC_OK) _exit(6);
    /* An inherited MemPool's destructor and a scope left open. */
    if (gpualloc_set_pool_use_on_oom(0, 9, 9, 0) != GPUALLOC_OK) _exit(10);
    if (gpualloc_end_allocate_to_pool(0, 9, 9) != GPUALLOC_OK) _exit(11);
    if (gpualloc_set_pool_no_split(0, 9, 9) != GPUALLOC_OK) _exit(12);
    /* What waits for the device's lock fails, naming the cause, rather
     * than wait for good (Note [Locks held at a fork]). */
    struct GpuallocHeld held;
    if (gpualloc_held(0, &held) != GPUALLOC_ERR_UNAVAILABLE || !strstr(gpualloc_last_error(), "forked")) _exit(7);
    size_t needed = 0;
    if (gpualloc_snapshot_json(0, NULL, 0, &needed) != GPUALLOC_ERR_UNAVAILABLE) _exit(8);
    if (gpualloc_malloc(4096, 0, 0) != NULL || gpualloc_last_error_code() != GPUALLOC_ERR_UNAVAILABLE) _exit(9);
    gpualloc_record_stream(p, (cudaStream_t)5);  /* returns */
    /* The parent's trace, inherited: a mark, a stop and the exit handler
     * that completes a trace pass over the device. */
    (void)gpualloc_mark("in the child");
    (void)gpualloc_trace_flush();
    (void)gpualloc_trace_stop(NULL);
    exit(0);
  }
  pthread_mutex_lock(&m);
  forked = 1;
  pthread_cond_broadcast(&c);
  pthread_mutex_unlock(&m);
  pthread_join(t, NULL);
  int status = 0;
  waitpid(pid, &status, 0);
  gpualloc_free(p, 4096, 0, 0);
  gpualloc_trace_stop(NULL);
  unlink(trace);
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0) printf("child exit %d\n", WEXITSTATUS(status));
  printf("child %s\n", WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "freed" : "stuck");
  return 0;
}
"#,
    );
    let out = run_sim(&exe, &[]);
    assert!(
        out.status.success(),
        "{}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "child freed\n");
}

/// `gpualloc_allocation_size` and `gpualloc_free_sized` (what the bridge
/// tells torch's memory profiler): the block size of a live allocation,
/// then the same size and its device when it is freed; an unknown pointer
/// is an error, not a message.
#[test]
fn sizes_of_allocations_and_frees() {
    let (_out, exe) = build_inline(
        "free_sized",
        r#"#include "gpualloc.h"
#include <stdio.h>
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s\n", __LINE__, #c); return 1; } } while (0)
int main(void) {
  void *p = gpualloc_malloc(1000, 0, 0);
  CHECK(p != NULL);
  uint64_t size = 0, freed = 0;
  int device = -1;
  CHECK(gpualloc_allocation_size(p, &size) == GPUALLOC_OK);
  CHECK(size == 1024);  /* 512-byte rounding */
  CHECK(gpualloc_free_sized(p, &freed, &device) == GPUALLOC_OK);
  CHECK(freed == size && device == 0);
  CHECK(gpualloc_allocation_size(p, &size) == GPUALLOC_ERR_INVALID_POINTER);
  CHECK(gpualloc_free_sized(p, NULL, NULL) == GPUALLOC_ERR_INVALID_POINTER);
  CHECK(gpualloc_free_sized(NULL, NULL, NULL) == GPUALLOC_ERR_INVALID_POINTER);
  printf("done\n");
  return 0;
}
"#,
    );
    let err = ran_to_done(&run_sim(&exe, &[]));
    assert!(err.is_empty(), "nothing is printed: {err}");
}

/// Before the start, with no trace to record them in, marks and phases
/// start nothing (a spawned worker running a script's phases again starts
/// no CUDA); a name above the limit is still refused. With a trace kept for
/// the start, a mark starts the allocator, as before.
#[test]
fn marks_and_phases_without_a_trace_start_nothing() {
    let (out, exe) = build_inline(
        "marks_idle",
        r#"#include "gpualloc.h"
#include <stdio.h>
#include <string.h>
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s\n", __LINE__, #c); return 1; } } while (0)
int main(int argc, char **argv) {
  (void)argc;
  char long_name[5000];
  memset(long_name, 'x', sizeof long_name - 1);
  long_name[sizeof long_name - 1] = 0;
  CHECK(gpualloc_is_tracing() == 0);
  CHECK(gpualloc_phase_push("forward") == GPUALLOC_OK);
  CHECK(gpualloc_mark("step") == GPUALLOC_OK);
  CHECK(gpualloc_phase_pop() == GPUALLOC_OK);
  CHECK(gpualloc_mark(long_name) != GPUALLOC_OK);
  CHECK(gpualloc_is_initialized() == 0);
  CHECK(gpualloc_configure(NULL, argv[1]) == GPUALLOC_OK);
  CHECK(gpualloc_mark("step") == GPUALLOC_OK);
  CHECK(gpualloc_is_initialized() == 1);
  printf("done\n");
  return 0;
}
"#,
    );
    let trace = out.join("m.gtrace");
    let run = run_sim_with(&exe, &[&trace], &[]);
    assert!(
        run.status.success(),
        "{}: {}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&run.stdout), "done\n");
}

/// PyTorch's `per_process_memory_fraction` (Note [PyTorch's settings
/// under gpualloc]): read from the variable torch reads first, capping
/// every device from its first request (also one not started yet), gpualloc's own key
/// winning, `set_per_process_memory_fraction` replacing it; a value
/// PyTorch refuses is an error naming the variable.
#[test]
fn pytorchs_memory_fraction_caps_each_device_from_the_start() {
    let (out, exe) = build_inline(
        "torch_fraction",
        r#"#include "gpualloc.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define MiB ((size_t)1 << 20)
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s (%s)\n", __LINE__, #c, gpualloc_last_error() ? gpualloc_last_error() : ""); return 1; } } while (0)
int main(int argc, char **argv) {
  (void)argc;
  double want = atof(argv[1]), f = -1;
  if (want < 0) { /* a refused value: every call says why, an installer's first */
    CHECK(gpualloc_configure("", NULL) == GPUALLOC_ERR_CONFIG);
    fprintf(stderr, "%s\n", gpualloc_last_error());
    CHECK(gpualloc_get_memory_fraction(0, &f) != GPUALLOC_OK);
    fprintf(stderr, "%s\n", gpualloc_last_error());
    CHECK(gpualloc_malloc(MiB, 0, NULL) == NULL);
    fprintf(stderr, "%s\n", gpualloc_last_error());
    printf("done\n");
    return 0;
  }
  CHECK(gpualloc_get_memory_fraction(0, &f) == GPUALLOC_OK && f == want); /* before the start */
  void *a = gpualloc_malloc(200 * MiB, 0, NULL);
  CHECK(a != NULL);
  CHECK(gpualloc_get_memory_fraction(0, &f) == GPUALLOC_OK && f == want);
  CHECK(gpualloc_get_memory_fraction(1, &f) == GPUALLOC_OK && f == want); /* not started */
  void *b = gpualloc_malloc(200 * MiB, 0, NULL);
  CHECK((b == NULL) == (want < 0.375)); /* 400 MiB of 1 GiB */
  gpualloc_set_memory_fraction(1.0, 0);
  if (b == NULL) b = gpualloc_malloc(200 * MiB, 0, NULL);
  CHECK(b != NULL);
  void *c = gpualloc_malloc(300 * MiB, 1, NULL); /* device 1 starts capped */
  CHECK((c == NULL) == (want < 0.3));
  gpualloc_free(a, 200 * MiB, 0, NULL);
  gpualloc_free(b, 200 * MiB, 0, NULL);
  if (c != NULL) gpualloc_free(c, 300 * MiB, 1, NULL);
  printf("done\n");
  return 0;
}
"#,
    );
    let cuda = "PYTORCH_CUDA_ALLOC_CONF";
    let generic = "PYTORCH_ALLOC_CONF";
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[], "1"),
        (
            &[(
                cuda,
                "expandable_segments:True, per_process_memory_fraction:0.25",
            )],
            "0.25",
        ),
        (&[(generic, "per_process_memory_fraction:0.25")], "0.25"),
        // torch reads the first variable set, whole.
        (
            &[
                (cuda, "max_split_size_mb:100"),
                (generic, "per_process_memory_fraction:0.25"),
            ],
            "1",
        ),
        (
            &[
                (cuda, "per_process_memory_fraction:0.25"),
                ("GPUALLOC_CONF", "per_process_memory_fraction:0.5"),
            ],
            "0.5",
        ),
        // gpualloc's byte cap leaves PyTorch's fraction in force beside it.
        (
            &[
                (cuda, "per_process_memory_fraction:0.25"),
                ("GPUALLOC_CONF", "memory_limit:900MiB"),
            ],
            "0.25",
        ),
        (&[(cuda, "per_process_memory_fraction:1.5")], "-1"),
        // gpualloc's own key needs no word of PyTorch's.
        (
            &[
                (cuda, "per_process_memory_fraction:1.5"),
                ("GPUALLOC_CONF", "per_process_memory_fraction:0.5"),
            ],
            "0.5",
        ),
        // Bytes that are not UTF-8 elsewhere in the value, as torch reads bytes.
        (
            &[(cuda, "per_process_memory_fraction:0.25,x:\u{1}")],
            "0.25",
        ),
    ];
    for (vars, want) in cases {
        let mut env: Vec<(&str, std::ffi::OsString)> = vars
            .iter()
            .map(|(k, v)| {
                // `\u{1}` stands for a byte that is not UTF-8.
                let bytes: Vec<u8> = v.bytes().map(|b| if b == 1 { 0xff } else { b }).collect();
                (*k, std::os::unix::ffi::OsStringExt::from_vec(bytes))
            })
            .collect();
        env.push(("GPUALLOC_SIM_CAPACITY", "1GiB".into()));
        env.push(("GPUALLOC_SIM_DEVICES", "2".into()));
        let env: Vec<(&str, &std::ffi::OsStr)> =
            env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
        let run = run_sim_with(&exe, &[Path::new(want)], &env);
        let err = ran_to_done(&run);
        if *want == "-1" {
            let said = format!("{cuda}: per_process_memory_fraction");
            assert_eq!(err.matches(&said).count(), 3, "{err}");
            assert!(
                err.contains("gpualloc's own per_process_memory_fraction"),
                "{err}"
            );
            assert!(err.contains("`1.5` is not a number in [0, 1]"), "{err}");
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// An error names the call and what was wrong: `gpualloc_allocation_size`
/// of an unknown pointer is not reported as a free, and a NULL array with
/// room claimed for entries is named as such, not as an array too small
/// ("needs 16 bytes, 100 given").
#[test]
fn errors_name_the_call_and_the_null_array() {
    let (_out, exe) = build_inline(
        "error_names",
        r#"#include "gpualloc.h"
#include <stdio.h>
#include <string.h>
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s (last error: %s)\n", __LINE__, #c, gpualloc_last_error() ? gpualloc_last_error() : "none"); return 1; } } while (0)
#define SAYS(s) (gpualloc_last_error() != NULL && strstr(gpualloc_last_error(), s) != NULL)
int main(void) {
  uint64_t size = 0;
  void *p = gpualloc_malloc(1000, 0, 0);
  CHECK(p != NULL);
  CHECK(gpualloc_allocation_size((char *)p + 8, &size) == GPUALLOC_ERR_INVALID_POINTER);
  CHECK(SAYS("allocation_size") && !SAYS("free"));
  size_t needed = 0;
  CHECK(gpualloc_snapshot_json(0, NULL, 100000, &needed) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(SAYS("NULL") && SAYS("100000"));
  CHECK(needed > 0);
  CHECK(gpualloc_snapshot_json(0, NULL, 0, &needed) == GPUALLOC_ERR_BUFFER_TOO_SMALL);
  size_t ns = 0, nb = 0;
  GpuallocBlockInfo blocks[16];
  CHECK(gpualloc_snapshot_segments(0, 0, 0, 0, NULL, 16, &ns, blocks, 16, &nb) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(SAYS("segments") && SAYS("NULL"));
  CHECK(ns == 1 && nb >= 1);
  GpuallocSegmentInfo segs[16];
  CHECK(gpualloc_snapshot_segments(0, 0, 0, 0, segs, 16, &ns, NULL, 16, &nb) == GPUALLOC_ERR_INVALID_ARGUMENT);
  CHECK(SAYS("blocks") && SAYS("NULL"));
  CHECK(gpualloc_snapshot_segments(0, 0, 0, 0, segs, 16, &ns, blocks, 16, &nb) == GPUALLOC_OK);
  gpualloc_free(p, 0, 0, 0);
  printf("done\n");
  return 0;
}
"#,
    );
    ran_to_done(&run_sim(&exe, &[]));
}

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

/// The stand-in driver of `tests/c/fake_cuda.c`, built as `out` (with
/// `-soname` when given).
fn stand_in_driver(out: &Path, soname: Option<&str>) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let flag = soname.map(|n| format!("-Wl,-soname,{n}"));
    let mut args: Vec<&std::ffi::OsStr> = vec!["-shared".as_ref(), "-fPIC".as_ref()];
    args.extend(flag.as_deref().map(std::ffi::OsStr::new));
    gcc(&manifest.join("tests/c/fake_cuda.c"), out, &args);
}

/// A C program whose `main` runs `first` (statements; returning 2 for a
/// setup that failed), then allocates and frees one MiB through gpualloc
/// and prints `ALL OK`.
fn one_allocation(name: &str, includes: &str, first: &str) -> PathBuf {
    let source = format!(
        r#"
#include <stdio.h>
{includes}
#include "gpualloc.h"
int main(void) {{
  {first}
  void *p = gpualloc_malloc(1 << 20, 0, 0);
  printf("gpualloc_malloc -> %p (%s)\n", p, p ? "ok" : gpualloc_last_error());
  if (!p) return 1;
  gpualloc_free(p, 1 << 20, 0, 0);
  printf("ALL OK\n");
  return 0;
}}
"#
    );
    build_inline(name, &source).1
}

/// gpualloc drives the driver the process already loaded (`libcuda.so.1`,
/// the SONAME the CUDA runtime opens), not the first file named
/// `libcuda.so` on the search path: a toolkit stub there (CUDA's
/// `lib64/stubs/libcuda.so`, every call CUDA_ERROR_STUB_LIBRARY) left
/// PyTorch working and gpualloc without a driver (Note [The process's
/// driver]).
#[test]
fn the_driver_is_the_one_the_process_loaded() {
    let dir = fresh_dir("driver_load_order");
    let (real, stub) = (dir.join("real"), dir.join("stub"));
    std::fs::create_dir_all(&real).unwrap();
    std::fs::create_dir_all(&stub).unwrap();
    stand_in_driver(&real.join("libcuda.so.1"), Some("libcuda.so.1"));
    let stub_src = dir.join("stub.c");
    std::fs::write(
        &stub_src,
        "int cuInit(unsigned f);\nint cuInit(unsigned f) { (void)f; return 34; }\n",
    )
    .unwrap();
    gcc(
        &stub_src,
        &stub.join("libcuda.so"),
        &["-shared".as_ref(), "-fPIC".as_ref()],
    );
    // As the CUDA runtime does before gpualloc's first call.
    let exe = one_allocation(
        "driver_load_order",
        "#include <dlfcn.h>",
        r#"void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!drv) { printf("no libcuda.so.1\n"); return 2; }
  int (*init)(unsigned);
  *(void **)&init = dlsym(drv, "cuInit");
  if (init(0) != 0) { printf("the process's driver refused cuInit\n"); return 2; }"#,
    );
    let path = std::env::join_paths([stub.as_path(), real.as_path(), library().parent().unwrap()])
        .unwrap();
    let run = program(&exe)
        .env("LD_LIBRARY_PATH", &path)
        .env_remove("GPUALLOC_BACKEND")
        .output()
        .unwrap();
    all_ok(
        &run,
        "a stub libcuda.so on the path before the process's libcuda.so.1",
    );
}

/// A device that says no to virtual memory management
/// (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0) gets plain
/// segments under the default configuration, as it does under
/// `expandable_segments:false`, even where the granularity query answers.
#[test]
fn a_device_without_vmm_gets_plain_segments() {
    let dir = fresh_dir("device_without_vmm");
    stand_in_driver(&dir.join("libcuda.so"), None);
    let exe = one_allocation("device_without_vmm", "", "");
    let path = std::env::join_paths([dir.as_path(), library().parent().unwrap()]).unwrap();
    for conf in ["expandable_segments:false", ""] {
        let run = program(&exe)
            .env("LD_LIBRARY_PATH", &path)
            .env("FAKE_CUDA_NO_VMM", "1")
            .env("GPUALLOC_CONF", conf)
            .env_remove("GPUALLOC_BACKEND")
            .output()
            .unwrap();
        all_ok(&run, &format!("no VMM, GPUALLOC_CONF={conf:?}"));
    }
}

/// A process whose trace cannot complete (a thread holds the allocator,
/// stuck in a driver call behind a hung kernel) still ends: the stop for
/// a process's end and the exit handler each give the trace at most 5 s,
/// and say so.
#[test]
fn a_trace_stuck_behind_a_hung_driver_call_does_not_keep_the_process() {
    let dir = fresh_dir("hung_driver_at_exit");
    stand_in_driver(&dir.join("libcuda.so"), None);
    let (out, exe) = build_inline(
        "hung_driver_at_exit",
        r#"#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "gpualloc.h"
static void *stuck(void *a) {
  (void)a;
  gpualloc_malloc((size_t)64 << 20, 0, 0); /* a new handle: 60 s in the driver */
  return NULL;
}
static void *behind(void *a) {
  (void)a;
  gpualloc_phase_push("behind"); /* holds the trace control lock, waits for the device */
  return NULL;
}
int main(int argc, char **argv) {
  (void)argv;
  void *p = gpualloc_malloc(1 << 20, 0, 0);
  if (!p) return 1;
  setenv("FAKE_CUDA_HANG", "1", 1);
  pthread_t t, u;
  pthread_create(&t, NULL, stuck, NULL);
  usleep(300 * 1000);
  pthread_create(&u, NULL, behind, NULL);
  usleep(100 * 1000);
  if (argc > 1) { /* as the Python package's exit handler */
    struct GpuallocTraceSummary s;
    printf("stop_at_end %d\n", gpualloc_trace_stop_at_end(&s));
  }
  printf("end\n");
  fflush(stdout);
  return 0; /* else the library's exit handler completes the trace */
}
"#,
    );
    let path = std::env::join_paths([dir.as_path(), library().parent().unwrap()]).unwrap();
    for (args, said) in [
        (vec![], "end\n"),
        (vec!["stop"], "stop_at_end -11\nend\n"), // GPUALLOC_ERR_IO
    ] {
        let started = std::time::Instant::now();
        let run = program(&exe)
            .args(&args)
            .env("LD_LIBRARY_PATH", &path)
            .env("GPUALLOC_TRACE", out.join("t.gtrace"))
            .env_remove("GPUALLOC_BACKEND")
            .output()
            .unwrap();
        let took = started.elapsed();
        let stdout = String::from_utf8_lossy(&run.stdout);
        let stderr = String::from_utf8_lossy(&run.stderr);
        // 60 s when the trace waits for the stuck thread; 5 s when not,
        // however many attempts to complete it the end makes (10 s when
        // the exit handler waited again behind the stop's thread).
        assert!(
            took < std::time::Duration::from_secs(9),
            "{args:?}: ended after {took:?}\n{stdout}\n{stderr}"
        );
        assert!(run.status.success(), "{args:?}: {run:?}");
        assert_eq!(stdout, said, "{args:?}: {stderr}");
        assert!(
            stderr.contains("the trace is incomplete (at exit): not completed within 5 s"),
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// The fallback entry point aborts on out of memory; the trace recorded up
/// to then, the out-of-memory event included (what the trace is for), is
/// completed first.
#[test]
fn malloc_or_abort_completes_the_trace_before_aborting() {
    let (out, exe) = build_inline(
        "abort_trace",
        r#"#include "gpualloc.h"
int main(void) {
  for (int i = 0; i < 100; i++) {
    void *p = gpualloc_malloc_or_abort(4096, 0, 0);
    gpualloc_free(p, 4096, 0, 0);
  }
  gpualloc_mark("before the oom");
  gpualloc_malloc_or_abort((size_t)1 << 40, 0, 0);
  return 3;
}
"#,
    );
    let trace = out.join("abort.gtrace");
    let run = run_sim(
        &exe,
        &[
            ("GPUALLOC_SIM_CAPACITY", "1GiB".as_ref()),
            ("GPUALLOC_TRACE", trace.as_os_str()),
        ],
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(run.status.signal(), Some(6), "aborts as before: {run:?}");
    let kinds = block_kinds(&std::fs::read(&trace).unwrap());
    let _ = std::fs::remove_dir_all(&out);
    assert_eq!(kinds.last(), Some(&4), "the trace is complete: {kinds:?}");
}

/// A phase or mark name too long for a trace is a bad argument
/// (`GPUALLOC_ERR_INVALID_ARGUMENT`), not an I/O error, tracing or not.
#[test]
fn an_overlong_phase_or_mark_name_is_an_invalid_argument() {
    let (out, exe) = build_inline(
        "long_name",
        r#"#include "gpualloc.h"
#include <stdio.h>
#include <string.h>
int main(void) {
  static char name[5001];
  memset(name, 'x', 5000);
  printf("%d %d\n", gpualloc_mark(name), gpualloc_phase_push(name));
  return 0;
}
"#,
    );
    let trace = out.join("t.gtrace");
    for vars in [vec![], vec![("GPUALLOC_TRACE", trace.as_os_str())]] {
        let run = run_sim(&exe, &vars);
        assert_eq!(String::from_utf8_lossy(&run.stdout), "-2 -2\n", "{run:?}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// A child forked from a tracing process may start a trace of its own
/// (Note [Traces across fork]); a SIGTERM then completes that trace, as
/// it does the parent's (Note [Completing a trace on SIGTERM]): the child
/// gets a handler and a thread of its own.
#[test]
fn a_forked_childs_own_trace_is_completed_on_sigterm() {
    let (out, exe) = build_inline(
        "child_sigterm",
        r#"#include "gpualloc.h"
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
int main(int argc, char **argv) {
  (void)argc;
  if (gpualloc_trace_start(argv[1]) != 0) return 2;
  void *p = gpualloc_malloc(4096, 0, 0);
  gpualloc_free(p, 4096, 0, 0);
  pid_t c = fork();
  if (c == 0) {
    if (gpualloc_trace_start(argv[2]) != 0) _exit(5);
    for (int i = 0; i < 100; i++) {
      void *q = gpualloc_malloc(4096, 0, 0);
      gpualloc_free(q, 4096, 0, 0);
    }
    kill(getpid(), SIGTERM);
    for (;;) pause();
  }
  int st = 0;
  waitpid(c, &st, 0);
  printf("%d\n", WIFSIGNALED(st) ? WTERMSIG(st) : -1);
  return 0;
}
"#,
    );
    let (parent, child) = (out.join("parent.gtrace"), out.join("child.gtrace"));
    let run = run_sim_with(&exe, &[parent.as_path(), child.as_path()], &[]);
    assert_eq!(String::from_utf8_lossy(&run.stdout), "15\n", "{run:?}");
    let kinds = block_kinds(&std::fs::read(&child).unwrap());
    let _ = std::fs::remove_dir_all(&out);
    assert_eq!(
        kinds.last(),
        Some(&4),
        "the child's trace is complete: {kinds:?}"
    );
}

/// Note [Free-memory callbacks]: with a miss callback set, a request that
/// finds no cached block runs it before growing, with the device let go,
/// so that memory it frees serves the request; a hit does not run it, nor
/// does an allocation made inside it, and NULL takes it away.
#[test]
fn a_cache_miss_runs_the_callback_before_growing() {
    let (_out, exe) = build_inline(
        "miss_callback",
        r#"#include "gpualloc.h"
#include <stdio.h>
#include <string.h>
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s\n", __LINE__, #c); return 1; } } while (0)
#define MiB (1024u * 1024u)
static int calls = 0, last_device = -1;
static void *to_free = NULL;
static int on_miss(void *ctx, int device) {
  (void)ctx;
  calls++;
  last_device = device;
  if (calls == 1) { /* a miss inside: it runs nothing */
    void *inner = gpualloc_malloc(3 * MiB, device, 0);
    if (inner != NULL) gpualloc_free(inner, 3 * MiB, device, 0);
  }
  if (to_free != NULL) {
    gpualloc_free(to_free, 32 * MiB, device, 0); /* needs the device */
    to_free = NULL;
    return 1;
  }
  return 0;
}
static int64_t reserved(void) {
  GpuallocStats s;
  memset(&s, 0, sizeof s);
  s.size = (uint32_t)sizeof s;
  if (gpualloc_get_stats(0, &s) != GPUALLOC_OK) return -1;
  return s.reserved_bytes.all.current;
}
int main(void) {
  CHECK(gpualloc_set_miss_callback(on_miss, NULL) == GPUALLOC_OK);
  void *p = gpualloc_malloc(8 * MiB, 0, 0);
  CHECK(p != NULL && calls == 1 && last_device == 0);
  gpualloc_free(p, 8 * MiB, 0, 0);
  void *q = gpualloc_malloc(8 * MiB, 0, 0); /* cached: a hit */
  CHECK(q != NULL && calls == 1);
  void *held = gpualloc_malloc(32 * MiB, 0, 0);
  CHECK(held != NULL && calls == 2);
  int64_t before = reserved();
  to_free = held; /* a tensor let go of by the process it was sent to */
  void *r = gpualloc_malloc(32 * MiB, 0, 0);
  CHECK(r != NULL && calls == 3 && to_free == NULL);
  CHECK(r == held);            /* the memory the callback freed */
  CHECK(reserved() == before); /* nothing grew */
  CHECK(gpualloc_set_miss_callback(NULL, NULL) == GPUALLOC_OK);
  void *s = gpualloc_malloc(64 * MiB, 0, 0);
  CHECK(s != NULL && calls == 3);
  gpualloc_free(s, 64 * MiB, 0, 0);
  gpualloc_free(r, 32 * MiB, 0, 0);
  gpualloc_free(q, 8 * MiB, 0, 0);
  printf("done\n");
  return 0;
}
"#,
    );
    done_quietly_under_both_policies(&exe);
}

/// A free that waits for other streams' work is told to the segment
/// observer (deferred, then completed, with the block's address and size)
/// only once asked for with `gpualloc_observe_block_frees`: an observer
/// written before these events never sees an action it does not know.
#[test]
fn deferred_frees_are_told_only_when_asked_for() {
    let (_out, exe) = build_inline(
        "block_frees",
        r#"#include "gpualloc.h"
#include <stdio.h>
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "line %d: %s\n", __LINE__, #c); return 1; } } while (0)
#define MiB (1024u * 1024u)
static long seen[32];
static uint64_t block_addr, block_size;
static void observer(void *ctx, int device, int action, uint64_t address, uint64_t size, uint64_t stream) {
  (void)ctx; (void)device; (void)stream;
  if (action >= 0 && action < 32) seen[action]++;
  if (action == GPUALLOC_BLOCK_FREE_DEFERRED || action == GPUALLOC_BLOCK_FREE_COMPLETED) {
    block_addr = address;
    block_size = size;
  }
}
static int freed_on_another_stream(void) {
  void *p = gpualloc_malloc(6 * MiB, 0, 0);
  if (p == NULL) return 0;
  gpualloc_record_stream(p, (cudaStream_t)7);
  gpualloc_free(p, 6 * MiB, 0, 0);
  gpualloc_empty_cache(); /* waits for the other stream */
  return 1;
}
int main(void) {
  CHECK(gpualloc_set_segment_observer(observer, NULL) == GPUALLOC_OK);
  CHECK(freed_on_another_stream());
  CHECK(seen[GPUALLOC_BLOCK_FREE_DEFERRED] == 0 && seen[GPUALLOC_BLOCK_FREE_COMPLETED] == 0);
  CHECK(gpualloc_observe_block_frees(1) == GPUALLOC_OK);
  CHECK(freed_on_another_stream());
  CHECK(seen[GPUALLOC_BLOCK_FREE_DEFERRED] == 1 && seen[GPUALLOC_BLOCK_FREE_COMPLETED] == 1);
  CHECK(block_addr != 0 && block_size == 6 * MiB);
  void *q = gpualloc_malloc(6 * MiB, 0, 0); /* freed at once: told nothing */
  CHECK(q != NULL);
  gpualloc_free(q, 6 * MiB, 0, 0);
  CHECK(seen[GPUALLOC_BLOCK_FREE_DEFERRED] == 1 && seen[GPUALLOC_BLOCK_FREE_COMPLETED] == 1);
  CHECK(gpualloc_observe_block_frees(0) == GPUALLOC_OK);
  CHECK(freed_on_another_stream());
  CHECK(seen[GPUALLOC_BLOCK_FREE_DEFERRED] == 1);
  printf("done\n");
  return 0;
}
"#,
    );
    done_quietly_under_both_policies(&exe);
}

/// Runs `exe` under gpualloc's default policy and under `policy:pytorch`;
/// each run must print only `done`.
fn done_quietly_under_both_policies(exe: &Path) {
    for conf in ["", "policy:pytorch"] {
        let err = ran_to_done(&run_sim(exe, &[("GPUALLOC_CONF", conf.as_ref())]));
        assert!(err.is_empty(), "{conf}: nothing is printed: {err}");
    }
}
