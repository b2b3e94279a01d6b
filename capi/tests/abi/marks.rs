//! Marks and phases.

use crate::support::{build_inline, run_sim, run_sim_with};

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
