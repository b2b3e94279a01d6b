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
//! placeholder, UTF-8 or not.

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

/// `path` with its placeholders replaced from this process's environment.
pub fn expand(path: &OsStr) -> PathBuf {
    expand_with(path, &PathVars::from_env())
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
