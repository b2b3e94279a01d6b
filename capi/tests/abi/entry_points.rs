//! The fallback entry points that abort or raise, and the sizes of
//! allocations and frees.

use crate::support::{build_inline, fresh_dir, gxx, library, ran_to_done, run_sim};

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
