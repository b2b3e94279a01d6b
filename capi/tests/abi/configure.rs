//! `gpualloc_configure`: a configuration and a trace kept for the first
//! use.

use crate::support::{build_inline, run_sim_with};

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
