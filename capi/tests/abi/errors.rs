//! Errors: read-only calls, what an error names, and what is said on a
//! closed stderr.

use crate::support::{build_c, build_inline, library, program, ran_to_done, run_sim};

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
