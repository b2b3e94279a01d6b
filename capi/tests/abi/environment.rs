//! The configuration read from the environment: a bad `GPUALLOC_CONF` and
//! PyTorch's `per_process_memory_fraction`.

use crate::support::{build_inline, compile, library, program, ran_to_done, run_sim_with};
use std::path::Path;

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
