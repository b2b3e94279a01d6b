//! The CUDA backend on the checking stand-in driver of `tests/c/fake_cuda.c`:
//! which driver is loaded, devices without VMM, hung driver calls.

use crate::support::{all_ok, build_inline, compile, fresh_dir, gcc, library, program};
use std::path::{Path, PathBuf};

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
