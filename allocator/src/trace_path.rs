//! The placeholders of a trace path, so that every process of a job writes
//! its own file: `GPUALLOC_TRACE=/scratch/run-{rank}.gtrace` under `torchrun`.
//!
//! | placeholder | becomes |
//! | --- | --- |
//! | `{pid}` | the process id |
//! | `{rank}` | `RANK` (set by `torchrun` and `torch.distributed.launch`), else `0` |
//! | `{local_rank}` | `LOCAL_RANK` (the rank within the node), else `0` |
//! | `{restart}` | `TORCHELASTIC_RESTART_COUNT` (how often `torchrun` restarted the job's workers), else `0` |
//!
//! A process started without a launcher is rank 0 of a job of one, hence the
//! `0`. A launcher that sets neither variable (plain `mpirun`, `srun`) gives
//! every process rank 0: add `{pid}` there. A set value is used as it is.
//! A worker `torchrun` restarts after a failure has the same rank, so
//! `run-{rank}.gtrace` would be written again from the start, losing the
//! failed attempt's trace, usually the one wanted: `run-{rank}-{restart}`
//! keeps one file per attempt.
//! Anything else between braces is kept, and so is every byte that is not a
//! placeholder, UTF-8 or not; a word between braces that is not a
//! placeholder (`{RANK}`, `{rnak}`) is said on stderr when the trace
//! starts, since it is most likely a typo that would give every process
//! the same file.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;

/// The variable `{rank}` reads.
pub const RANK_ENV: &str = "RANK";
/// The variable `{local_rank}` reads.
pub const LOCAL_RANK_ENV: &str = "LOCAL_RANK";
/// The variable `{restart}` reads.
pub const RESTART_ENV: &str = "TORCHELASTIC_RESTART_COUNT";

/// What the placeholders become.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathVars {
    /// The process id.
    pub pid: u32,
    /// `RANK`'s value; None when unset.
    pub rank: Option<OsString>,
    /// `LOCAL_RANK`'s value; None when unset.
    pub local_rank: Option<OsString>,
    /// `TORCHELASTIC_RESTART_COUNT`'s value; None when unset.
    pub restart: Option<OsString>,
}

impl PathVars {
    /// This process's id and the launcher's variables.
    pub fn from_env() -> Self {
        Self {
            pid: std::process::id(),
            rank: std::env::var_os(RANK_ENV).filter(|v| !v.is_empty()),
            local_rank: std::env::var_os(LOCAL_RANK_ENV).filter(|v| !v.is_empty()),
            restart: std::env::var_os(RESTART_ENV).filter(|v| !v.is_empty()),
        }
    }
}

/// The placeholders, as written in a path.
pub const PLACEHOLDERS: [&str; 4] = ["{pid}", "{rank}", "{local_rank}", "{restart}"];

/// `path` with its placeholders replaced from this process's environment;
/// a word between braces that is no placeholder is said on stderr
/// ([`unknown_placeholders`]).
pub fn expand(path: &OsStr) -> PathBuf {
    for word in unknown_placeholders(path) {
        let lower = word.to_ascii_lowercase();
        let hint = PLACEHOLDERS
            .iter()
            .find(|p| **p == lower)
            .map_or(String::new(), |p| format!(" (did you mean {p}?)"));
        crate::log::say(format_args!(
            "gpualloc: {word} in the trace path {} is not a placeholder and is kept as written{hint}; \
             the placeholders are {}",
            path.to_string_lossy(),
            PLACEHOLDERS.join(", ")
        ));
    }
    expand_with(path, &PathVars::from_env())
}

/// The words between braces in `path` (letters, digits, `_` and `-`, at
/// least one) that are not [`PLACEHOLDERS`], each once, in order.
pub fn unknown_placeholders(path: &OsStr) -> Vec<String> {
    let text = path.to_string_lossy();
    let mut out: Vec<String> = Vec::new();
    let mut rest = &*text;
    while let Some(open) = rest.find('{') {
        rest = &rest[open..];
        let Some(close) = rest.find('}') else { break };
        let word = &rest[..=close];
        let inner = &word[1..word.len() - 1];
        let wordlike = !inner.is_empty()
            && inner
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if wordlike && !PLACEHOLDERS.contains(&word) && !out.iter().any(|w| w == word) {
            out.push(word.to_string());
        }
        // A `{` inside (`{{rank}`) starts the next candidate.
        rest = if wordlike {
            &rest[close + 1..]
        } else {
            &rest[1..]
        };
    }
    out
}

/// `path` with its placeholders replaced from `vars`.
#[cfg(unix)]
pub fn expand_with(path: &OsStr, vars: &PathVars) -> PathBuf {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let pid = vars.pid.to_string();
    let subs: [(&[u8], &[u8]); 4] = [
        (b"{pid}", pid.as_bytes()),
        (
            b"{rank}",
            vars.rank.as_deref().map_or(b"0", OsStr::as_bytes),
        ),
        (
            b"{local_rank}",
            vars.local_rank.as_deref().map_or(b"0", OsStr::as_bytes),
        ),
        (
            b"{restart}",
            vars.restart.as_deref().map_or(b"0", OsStr::as_bytes),
        ),
    ];
    let b = path.as_bytes();
    let mut out = Vec::with_capacity(b.len() + 16);
    let mut i = 0;
    while i < b.len() {
        match subs.iter().find(|(p, _)| b[i..].starts_with(p)) {
            Some((p, value)) => {
                out.extend_from_slice(value);
                i += p.len();
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    OsString::from_vec(out).into()
}

/// `path` with its placeholders replaced from `vars` (a path that is not
/// Unicode loses its other characters here).
#[cfg(not(unix))]
pub fn expand_with(path: &OsStr, vars: &PathVars) -> PathBuf {
    let value = |v: &Option<OsString>| v.as_deref().map_or("0".into(), OsStr::to_string_lossy);
    path.to_string_lossy()
        .replace("{pid}", &vars.pid.to_string())
        .replace("{rank}", &value(&vars.rank))
        .replace("{local_rank}", &value(&vars.local_rank))
        .replace("{restart}", &value(&vars.restart))
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(rank: Option<&str>, local: Option<&str>) -> PathVars {
        PathVars {
            pid: 4242,
            rank: rank.map(OsString::from),
            local_rank: local.map(OsString::from),
            restart: None,
        }
    }

    fn ex(p: &str, v: &PathVars) -> String {
        expand_with(OsStr::new(p), v).to_string_lossy().into_owned()
    }

    #[test]
    fn words_between_braces_that_are_no_placeholder_are_found() {
        let u = |p: &str| unknown_placeholders(OsStr::new(p));
        assert_eq!(
            u("/t/run-{RANK}-{rnak}-{RANK}.gtrace"),
            ["{RANK}", "{rnak}"]
        );
        assert!(u("/t/{rank}/{local_rank}-{pid}-{restart}.gtrace").is_empty());
        assert!(u("/t/{}/{a b}/{.gtrace").is_empty(), "not words");
        assert_eq!(u("/t/{{rank}/{x}"), ["{x}"]);
        // Kept as written all the same.
        assert_eq!(
            ex("/t/{RANK}.gtrace", &vars(Some("3"), None)),
            "/t/{RANK}.gtrace"
        );
    }

    #[test]
    fn every_placeholder_is_replaced_each_time_it_appears() {
        let v = vars(Some("17"), Some("1"));
        assert_eq!(
            ex("/t/{rank}/run-{rank}-{local_rank}-{pid}.gtrace", &v),
            "/t/17/run-17-1-4242.gtrace"
        );
    }

    #[test]
    fn each_restart_of_a_worker_gets_its_own_file() {
        let mut v = vars(Some("3"), None);
        assert_eq!(ex("run-{rank}-{restart}", &v), "run-3-0");
        v.restart = Some(OsString::from("2"));
        assert_eq!(ex("run-{rank}-{restart}", &v), "run-3-2");
    }

    #[test]
    fn unset_ranks_are_zero() {
        assert_eq!(ex("r{rank}l{local_rank}", &vars(None, None)), "r0l0");
    }

    #[test]
    fn other_braces_and_plain_paths_are_kept() {
        let v = vars(Some("3"), None);
        assert_eq!(ex("a/{ranks}/{}{rank", &v), "a/{ranks}/{}{rank");
        assert_eq!(ex("{{rank}}", &v), "{3}");
        assert_eq!(ex("", &v), "");
        assert_eq!(ex("plain.gtrace", &v), "plain.gtrace");
    }

    #[cfg(unix)]
    #[test]
    fn bytes_that_are_not_utf8_are_kept() {
        use std::os::unix::ffi::OsStrExt;
        let v = vars(Some("2"), None);
        let p = expand_with(OsStr::from_bytes(b"/t/\xff{rank}\xfe"), &v);
        assert_eq!(p.as_os_str().as_bytes(), b"/t/\xff2\xfe");
    }
}
