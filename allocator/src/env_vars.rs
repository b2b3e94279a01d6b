//! The `GPUALLOC_*` environment variables, so that a misspelled one is said
//! rather than ignored.
//!
//! A typo in a variable's name (`GPUALLOC_CONFIG=policy:pytorch`) would
//! otherwise run with the defaults and no word: the library reads only the
//! names it knows. When the library starts (and at `install()`), every
//! `GPUALLOC_` variable of the environment that is not one of
//! [`LIBRARY`], [`PACKAGE`] or the test scripts' ([`SCRIPTS`]) is reported
//! on stderr with the closest known name. `docs/configuration.md` lists the
//! same names (checked by `tests/tests/all/docs.rs`).

use std::ffi::OsString;

/// Read by the library when the allocator starts.
pub const LIBRARY: &[&str] = &[
    "GPUALLOC_CONF",
    "GPUALLOC_TRACE",
    "GPUALLOC_LOG",
    "GPUALLOC_CRASH_REPORT",
    "GPUALLOC_BACKEND",
    "GPUALLOC_SIM_CAPACITY",
    "GPUALLOC_SIM_DEVICES",
];

/// Read by the Python package.
pub const PACKAGE: &[&str] = &[
    "GPUALLOC_LIBRARY",
    "GPUALLOC_BUILD_DIR",
    "GPUALLOC_BRIDGE",
    "GPUALLOC_REBUILD_BRIDGE",
    "GPUALLOC_RUN_CHILDREN",
    "GPUALLOC_RUN_SAID",
    "GPUALLOC_AUTO_MARKS",
    "GPUALLOC_FALLBACK_OOM",
];

/// Read by the repository's test scripts, named after the prefix
/// (`ABI_TRACE` is `GPUALLOC_ABI_TRACE`): the documented ones, then the
/// internal switches of the Rust and Python test suites.
pub const SCRIPTS: &[&str] = &[
    "ABI_TRACE",
    "TEST_CONF",
    "TEST_TRACE",
    "TEST_LIBRARY",
    "TEST_WRAPPER",
    "TEST_TORCH_PYTHON",
    "LIBRARY_B",
    "TRACE_CPP",
    "SWEEP_PROFILE_ROUNDS",
    "GPU_BUDGET_S",
    "CHECK_TORCH",
    "CHECK_CACHE",
    "CLI",
    "FUZZ_CASES",
    "FUZZ_SEED",
];

/// Test-suite internals, not documented for users.
const INTERNAL: &[&str] = &[
    "TORCH_INCLUDE",
    "BIG_INPUTS",
    "BIG_RSS_LIMIT",
    "WRITE_FAILURE_CHILD",
];

// Spelled so that `tests/tests/all/docs.rs`, which collects the quoted
// names the code reads, does not take the prefix or the test's misspellings
// for variables.
const PREFIX: &str = concat!("GPUALLOC", "_");

/// Whether `name` is a variable some part of gpualloc reads.
pub fn is_known(name: &str) -> bool {
    LIBRARY.contains(&name)
        || PACKAGE.contains(&name)
        || name
            .strip_prefix(PREFIX)
            .is_some_and(|rest| SCRIPTS.contains(&rest) || INTERNAL.contains(&rest))
}

/// The documented name closest to `name`, when it is close enough to be
/// what was meant (at most a third of its letters differ).
pub fn closest(name: &str) -> Option<&'static str> {
    LIBRARY
        .iter()
        .chain(PACKAGE)
        .map(|k| (distance(&name.to_ascii_uppercase(), k), *k))
        .filter(|(d, k)| *d <= k.len().saturating_sub(PREFIX.len()).div_ceil(3))
        .min()
        .map(|(_, k)| k)
}

/// One line per unknown `GPUALLOC_` name among `vars`, saying so (and what
/// was probably meant); nothing when all are known.
pub fn unknown<I: IntoIterator<Item = (OsString, OsString)>>(vars: I) -> Vec<String> {
    let mut out: Vec<String> = vars
        .into_iter()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| k.to_ascii_uppercase().starts_with(PREFIX) && !is_known(k))
        .map(|k| {
            let hint = closest(&k).map_or(String::new(), |c| format!(" (did you mean {c}?)"));
            format!(
                "gpualloc: the environment variable {k} is not one gpualloc reads{hint}; \
                 it has no effect (docs/configuration.md lists them)"
            )
        })
        .collect();
    out.sort();
    out
}

/// Reports [`unknown`] names of this process's environment on stderr, once
/// per process.
pub fn warn_unknown_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for line in unknown(std::env::vars_os()) {
            crate::log::say(format_args!("{line}"));
        }
    });
}

/// Levenshtein distance over bytes (the names are ASCII).
fn distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, &x) in a.iter().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &y) in b.iter().enumerate() {
            let next = (diag + usize::from(x != y))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(names: &[&str]) -> Vec<(OsString, OsString)> {
        names
            .iter()
            .map(|n| (OsString::from(n), OsString::from("1")))
            .collect()
    }

    /// `GPUALLOC_` + `rest`.
    fn g(rest: &str) -> String {
        format!("{PREFIX}{rest}")
    }

    #[test]
    fn a_misspelled_name_is_reported_with_what_was_meant() {
        let lines = unknown(vars(&[&g("CONFIG"), "PATH", &g("CONF")]));
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains(&format!("{} is not one gpualloc reads", g("CONFIG"))));
        assert!(lines[0].contains(&format!("did you mean {}?", g("CONF"))));
        let lines = unknown(vars(&[&g("TRACES"), &g("LOG").to_lowercase()]));
        assert!(
            lines[0].contains(&format!("did you mean {}?", g("TRACE"))),
            "{lines:?}"
        );
        assert!(
            lines[1].contains(&g("LOG").to_lowercase())
                && lines[1].contains(&format!("{}?", g("LOG")))
        );
    }

    #[test]
    fn a_name_far_from_every_known_one_gets_no_guess() {
        let lines = unknown(vars(&[&g("SOMETHING_ELSE")]));
        assert_eq!(lines.len(), 1);
        assert!(!lines[0].contains("did you mean"), "{lines:?}");
    }

    #[test]
    fn every_known_name_passes() {
        let mut all: Vec<String> = LIBRARY
            .iter()
            .chain(PACKAGE)
            .map(|s| s.to_string())
            .collect();
        all.extend(
            SCRIPTS
                .iter()
                .chain(INTERNAL)
                .map(|s| format!("{PREFIX}{s}")),
        );
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        assert!(unknown(vars(&all)).is_empty());
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(distance("", "abc"), 3);
    }
}
