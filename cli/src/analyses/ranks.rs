//! Several traces side by side, one per rank of a distributed job
//! (`GPUALLOC_TRACE=/path/trace-{rank}.gtrace` under torchrun): the
//! figures that tell ranks apart, for `summary` and `report`.
//!
//! A trace's header names no rank, so a rank is labelled from its file
//! name: the last run of digits in the name without its extension
//! (`trace-3.gtrace` is rank 3), unless that number is the header's process
//! id (`trace-{pid}`). When the names give no distinct ranks, the label is
//! the file name, and when those repeat too, the position on the command
//! line (`#0`, `#1`, ...).
//!
//! `summary --json` with several traces prints one object: `ranks`, one
//! object per trace in rank order with `rank` (the label), `rank_number`
//! (null when the label is not a number), `file`, `device` (the device of
//! the highest peak), `peak_allocated`, `peak_reserved` (bytes, the
//! highest over the trace's devices), `peak_allocated_ns`,
//! `peak_reserved_ns`, `steps` (the timed steps: the stretches between two
//! iteration boundaries, so one fewer than the boundaries, where `leaks`
//! also counts the stretch before the first and after the last as
//! iterations: two more), `step_median_ns`, `step_max_ns` (over those
//! steps; null without any), `ooms`,
//! `first_oom` (null, or `time_ns`, `device`, `requested`, `allocated`,
//! `reserved`) and `summary` (the object `summary --json` prints for that
//! trace alone); then `highest_peak_allocated`, `highest_peak_reserved`
//! (the labels of those ranks) and `oom_ranks` (the labels of the ranks that
//! ran out of memory, the first to fail first).

use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::input::CliError;

use serde_json::{Value, json};

use crate::analyses::analysis::{Analysis, DeviceAnalysis, Peak};
use crate::units::{bytes, duration};

/// The rank in a file name (`trace-3.gtrace`: 3); `None` when the name
/// holds no number or holds the process id `pid`.
pub fn rank_from_name(path: &Path, pid: u32) -> Option<u32> {
    let stem = path.file_stem()?.to_str()?;
    let end = stem.rfind(|c: char| c.is_ascii_digit())? + 1;
    let start = stem[..end]
        .rfind(|c: char| !c.is_ascii_digit())
        .map_or(0, |i| i + 1);
    let n: u32 = stem[start..end].parse().ok()?;
    (pid == 0 || n != pid).then_some(n)
}

/// `f` over `items` (with their index) on several threads, each reading
/// one trace at a time (two threads a trace: the decoder and `f`); the
/// results in `items`' order, or the first item's error.
pub fn par_map<T: Send, R: Send>(
    items: Vec<T>,
    f: impl Fn(usize, T) -> Result<R, CliError> + Sync,
) -> Result<Vec<R>, CliError> {
    let n = items.len();
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|x| Mutex::new(Some(x))).collect();
    let done: Vec<Mutex<Option<Result<R, CliError>>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism()
        .map_or(1, |p| p.get() / 2)
        .clamp(1, n.max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let x = slots[i].lock().unwrap_or_else(|p| p.into_inner()).take();
                    let r = f(i, x.expect("each item is taken once"));
                    *done[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
                }
            });
        }
    });
    done.into_iter()
        .map(|m| {
            m.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .expect("every item ran")
        })
        .collect()
}

/// One trace of a job, analysed.
pub struct Rank {
    /// Its label.
    pub label: String,
    /// Its number, when the label is one.
    pub number: Option<u32>,
    /// The file.
    pub path: PathBuf,
    /// Its analysis.
    pub a: Analysis,
}

/// Labels `traces` (see the module docs) and sorts them by rank when every
/// one has a distinct number (else keeps the command line's order).
pub fn label(traces: Vec<(PathBuf, Analysis)>) -> Vec<Rank> {
    let numbers: Vec<Option<u32>> = traces
        .iter()
        .map(|(p, a)| rank_from_name(p, a.info.header.pid))
        .collect();
    let distinct = |v: &[String]| {
        let mut s = v.to_vec();
        s.sort();
        s.dedup();
        s.len() == v.len()
    };
    let names: Vec<String> = traces
        .iter()
        .map(|(p, _)| {
            p.file_name()
                .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into())
        })
        .collect();
    let by_number: Option<Vec<String>> = numbers
        .iter()
        .map(|n| n.map(|n| n.to_string()))
        .collect::<Option<Vec<_>>>()
        .filter(|v| distinct(v));
    let numbered = by_number.is_some();
    let labels = by_number.unwrap_or_else(|| {
        if distinct(&names) {
            names
        } else {
            (0..traces.len()).map(|i| format!("#{i}")).collect()
        }
    });
    let mut ranks: Vec<Rank> = traces
        .into_iter()
        .zip(labels)
        .zip(numbers)
        .map(|(((path, a), label), n)| Rank {
            label,
            number: if numbered { n } else { None },
            path,
            a,
        })
        .collect();
    if numbered {
        ranks.sort_by_key(|r| r.number);
    }
    ranks
}

/// The device whose allocated peak is the trace's highest.
fn top(a: &Analysis) -> Option<&DeviceAnalysis> {
    a.devices.values().max_by_key(|d| d.peak_allocated.value)
}

fn highest(a: &Analysis, f: impl Fn(&DeviceAnalysis) -> Peak) -> Peak {
    a.devices
        .values()
        .map(f)
        .max_by_key(|p| p.value)
        .unwrap_or_default()
}

/// Step durations of the trace's top device: (count, median, max).
pub fn steps(a: &Analysis) -> Option<(usize, u64, u64)> {
    let b = top(a)?.state.iterations();
    let mut d: Vec<u64> = b.windows(2).map(|w| w[1].saturating_sub(w[0])).collect();
    if d.is_empty() {
        return None;
    }
    d.sort_unstable();
    Some((d.len(), d[d.len() / 2], d[d.len() - 1]))
}

/// The first failed allocation of a trace: (device, the OOM).
fn first_oom(a: &Analysis) -> Option<(u32, &crate::analyses::ooms::Oom)> {
    a.devices
        .values()
        .filter_map(|d| d.ooms.first().map(|o| (d.device, o)))
        .min_by_key(|(_, o)| o.time_ns)
}

fn ooms(a: &Analysis) -> u64 {
    a.devices.values().map(|d| d.oom_count).sum()
}

/// The rank with the highest `f`, the first of those that tie.
fn first_max(ranks: &[Rank], f: impl Fn(&Analysis) -> u64) -> Option<&Rank> {
    ranks.iter().rev().max_by_key(|r| f(&r.a))
}

/// The label of [`first_max`].
fn argmax(ranks: &[Rank], f: impl Fn(&Analysis) -> u64) -> Option<&str> {
    first_max(ranks, f).map(|r| r.label.as_str())
}

/// Ranks that ran out of memory, the first to fail first (by wall clock:
/// each trace's start time plus the failure's time in it).
fn oom_ranks(ranks: &[Rank]) -> Vec<&Rank> {
    let mut v: Vec<&Rank> = ranks.iter().filter(|r| ooms(&r.a) > 0).collect();
    v.sort_by_key(|r| {
        first_oom(&r.a).map(|(_, o)| r.a.info.header.start_unix_ns.saturating_add(o.time_ns))
    });
    v
}

/// One line per rank for a table: label, peak allocated, peak reserved,
/// steps, median step, OOMs (first at).
pub fn rows(ranks: &[Rank]) -> Vec<[String; 6]> {
    ranks
        .iter()
        .map(|r| {
            let a = &r.a;
            let (n, med) = steps(a).map_or(("-".into(), "-".into()), |(n, m, _)| {
                (n.to_string(), duration(m))
            });
            let oom = match first_oom(a) {
                Some((d, o)) => format!(
                    "{} (first at {} on device {d}, {} requested)",
                    ooms(a),
                    duration(o.time_ns),
                    bytes(o.requested)
                ),
                None => "0".into(),
            };
            [
                r.label.clone(),
                bytes(highest(a, |d| d.peak_allocated).value),
                bytes(highest(a, |d| d.peak_reserved).value),
                n,
                med,
                oom,
            ]
        })
        .collect()
}

/// Column titles of [`rows`].
pub const COLUMNS: [&str; 6] = [
    "rank",
    "peak allocated",
    "peak reserved",
    "steps",
    "median step",
    "OOMs",
];

/// Sentences under the table: the highest peaks, who ran out of memory.
pub fn highlights(ranks: &[Rank]) -> Vec<String> {
    let mut v = Vec::new();
    if let Some(r) = first_max(ranks, |a| highest(a, |d| d.peak_allocated).value) {
        let p = highest(&r.a, |d| d.peak_allocated);
        v.push(format!(
            "highest peak allocated: rank {}, {} at {}",
            r.label,
            bytes(p.value),
            duration(p.time_ns)
        ));
    }
    if let Some(l) = argmax(ranks, |a| highest(a, |d| d.peak_reserved).value) {
        v.push(format!("highest peak reserved: rank {l}"));
    }
    let failed = oom_ranks(ranks);
    if failed.is_empty() {
        v.push("no rank ran out of memory".into());
    }
    for r in failed {
        if let Some((d, o)) = first_oom(&r.a) {
            v.push(format!(
                "rank {} ran out of memory at {} on device {d}: {} requested with {} allocated, {} reserved ({} failure(s))",
                r.label,
                duration(o.time_ns),
                bytes(o.requested),
                bytes(o.gauges.allocated),
                bytes(o.gauges.reserved),
                ooms(&r.a)
            ));
        }
    }
    v
}

/// The text of `summary` with several traces: the ranks table, the
/// highlights, then each trace's own summary.
pub fn render(ranks: &[Rank]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{} ranks", ranks.len());
    let rows = rows(ranks);
    let mut width = COLUMNS.map(str::len);
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    for r in std::iter::once(COLUMNS.map(String::from)).chain(rows) {
        let mut line = String::new();
        for (i, (c, w)) in r.iter().zip(width).enumerate() {
            if i == 0 || i == 5 {
                let _ = write!(line, "{c:<w$}  ");
            } else {
                let _ = write!(line, "{c:>w$}  ");
            }
        }
        let _ = writeln!(s, "{}", line.trim_end());
    }
    s.push('\n');
    for h in highlights(ranks) {
        let _ = writeln!(s, "{h}");
    }
    for r in ranks {
        let _ = writeln!(s, "\n== rank {} ({}) ==", r.label, r.path.display());
        s.push_str(&crate::commands::summary::render(&r.a));
    }
    s
}

/// `summary --json` with several traces (fields in the module docs).
pub fn render_json(ranks: &[Rank]) -> String {
    let per: Vec<Value> = ranks
        .iter()
        .map(|r| {
            let a = &r.a;
            let pa = highest(a, |d| d.peak_allocated);
            let pr = highest(a, |d| d.peak_reserved);
            let st = steps(a);
            json!({
                "rank": r.label,
                "rank_number": r.number,
                "file": r.path.display().to_string(),
                "device": top(a).map(|d| d.device),
                "peak_allocated": pa.value,
                "peak_allocated_ns": pa.time_ns,
                "peak_reserved": pr.value,
                "peak_reserved_ns": pr.time_ns,
                "steps": st.map_or(0, |s| s.0),
                "step_median_ns": st.map(|s| s.1),
                "step_max_ns": st.map(|s| s.2),
                "ooms": ooms(a),
                "first_oom": first_oom(a).map(|(d, o)| json!({
                    "time_ns": o.time_ns,
                    "device": d,
                    "requested": o.requested,
                    "allocated": o.gauges.allocated,
                    "reserved": o.gauges.reserved,
                })),
                "summary": crate::commands::summary::json_value(a, &r.path),
            })
        })
        .collect();
    let v = json!({
        "ranks": per,
        "highest_peak_allocated": argmax(ranks, |a| highest(a, |d| d.peak_allocated).value),
        "highest_peak_reserved": argmax(ranks, |a| highest(a, |d| d.peak_reserved).value),
        "oom_ranks": oom_ranks(ranks).iter().map(|r| r.label.as_str()).collect::<Vec<_>>(),
    });
    crate::commands::summary::pretty(&v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_come_from_the_last_number_of_the_name() {
        let r = |p: &str, pid| rank_from_name(Path::new(p), pid);
        assert_eq!(r("/tmp/run7/trace-12.gtrace", 999), Some(12));
        assert_eq!(r("rank3.gtrace", 0), Some(3));
        assert_eq!(r("trace-4242.gtrace", 4242), None);
        assert_eq!(r("trace.gtrace", 1), None);
        assert_eq!(r("trace-99999999999.gtrace", 1), None);
    }
}
