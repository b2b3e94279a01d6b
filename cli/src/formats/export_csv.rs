//! Export to CSV with RMM's logging columns first
//! (`Thread,Time,Action,Pointer,Size,Stream`), then `Device`.
//! Time is the wall clock (UTC) as `HH:MM:SS.microseconds`, like spdlog's
//! `%H:%M:%S.%f`; Action is `allocate`, `free` or `allocate failure`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use gpualloc::trace::EventKind;

use crate::input::{self, CliError};

/// Writes `out`.
pub fn export(path: &Path, out: &Path, allow_truncated: bool) -> Result<(), CliError> {
    let werr = |e: std::io::Error| CliError(format!("{}: cannot write: {e}", out.display()));
    let start = input::open(path)?.header().start_unix_ns;
    let file = File::create(out).map_err(werr)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    writeln!(w, "Thread,Time,Action,Pointer,Size,Stream,Device").map_err(werr)?;
    let mut err = None;
    input::scan(path, allow_truncated, |e| {
        let (action, ptr, size) = match e.kind() {
            EventKind::Alloc {
                addr, requested, ..
            } => ("allocate", addr, requested),
            EventKind::FreeRequested {
                addr, requested, ..
            } => ("free", addr, requested),
            EventKind::Oom { requested, .. } => ("allocate failure", 0, requested),
            _ => return,
        };
        if err.is_none() {
            let ptr = if ptr == 0 {
                "(nil)".to_string()
            } else {
                format!("{ptr:#x}")
            };
            let r = writeln!(
                w,
                "{},{},{action},{ptr},{size},{:#x},{}",
                e.thread,
                clock(start.saturating_add(e.time_ns)),
                e.stream,
                e.device
            );
            err = r.err();
        }
    })?;
    if let Some(e) = err {
        return Err(werr(e));
    }
    w.flush().map_err(werr)
}

/// `HH:MM:SS.ffffff` of a Unix time in nanoseconds (UTC).
pub fn clock(unix_ns: u64) -> String {
    let us = unix_ns / 1000;
    let day_us = us % 86_400_000_000;
    let (h, m, s, f) = (
        day_us / 3_600_000_000,
        day_us / 60_000_000 % 60,
        day_us / 1_000_000 % 60,
        day_us % 1_000_000,
    );
    format!("{h:02}:{m:02}:{s:02}.{f:06}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn clock_is_time_of_day() {
        assert_eq!(
            super::clock(((13 * 3600 + 5 * 60 + 7) * 1_000_000 + 42) * 1000 + 86_400_000_000_000),
            "13:05:07.000042"
        );
    }
}
