//! Traces completed at exit, on an abort and on SIGTERM, and traces whose
//! writes fail or whose reader leaves.

use crate::support::{build_inline, compile, library, ran_to_done, run_sim, run_sim_with};
use std::process::Command;

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
