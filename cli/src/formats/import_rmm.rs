//! Import of an RMM `logging_resource_adaptor` CSV log
//! (`Thread,Time,Action,Pointer,Size,Stream`, columns found by name).
//!
//! `allocate` becomes an allocation (block size = size: RMM does not round),
//! `free` a free requested and completed at once, `allocate failure` an OOM.
//! Times are wall-clock `HH:MM:SS.us` without a date: a time that goes back
//! by more than an hour from the previous row of its device (or, for a
//! device's first row, from the log's first row) is taken as the next day,
//! and the earliest time of day is the trace's start (on 1970-01-01), so an
//! export writes the same clock again. Each device has a clock of its own
//! because a trace's export of several devices goes back in time between
//! them: a trace stores each device's events in blocks of its own. OS
//! thread ids become small integers in order of appearance; the header
//! counts the devices the Device column names. A line above 64 KiB
//! ([`MAX_LINE`](crate::formats::lines::MAX_LINE)) is refused with its
//! number, having read no more of it.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::path::Path;

use gpualloc::trace::{EventKind, MAX_DEVICES, TraceEvent, TraceHeader, TraceWriter};
use rustc_hash::FxHashMap;

use crate::formats::lines::Lines;
use crate::input::{self, CliError};

/// Converts `path` into `out`; returns the number of events written.
///
/// A log with a Device column is read twice (the header, written first,
/// counts the devices). A pipe can be read only once, so one is first
/// copied to a file beside `out`, removed when done, line by line so that
/// a line above the limit stops the copy; messages still name `path`.
pub fn import(path: &Path, out: &Path) -> Result<u64, CliError> {
    if std::fs::metadata(path).is_ok_and(|m| m.is_file() || m.is_dir()) {
        return import_named(path, path, out);
    }
    let mut name = out
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".input");
    let spool = out.with_file_name(name);
    let done = copy_lines(path, &spool).and_then(|()| import_named(&spool, path, out));
    let _ = std::fs::remove_file(&spool);
    done
}

/// Copies the lines of `path` to `spool`, each ended by `\n`.
fn copy_lines(path: &Path, spool: &Path) -> Result<(), CliError> {
    let r =
        File::open(path).map_err(|e| CliError(format!("{}: cannot open: {e}", path.display())))?;
    let werr = |e: std::io::Error| {
        CliError(format!(
            "{}: cannot write a copy of {}: {e}",
            spool.display(),
            path.display()
        ))
    };
    let mut w = BufWriter::new(File::create(spool).map_err(werr)?);
    let mut lines = Lines::new(BufReader::new(r));
    while let Some(line) = lines.next_bytes() {
        let (_, line) = line.map_err(|e| CliError(format!("{}: {e}", path.display())))?;
        w.write_all(line)
            .and_then(|()| w.write_all(b"\n"))
            .map_err(werr)?;
    }
    w.flush().map_err(werr)
}

/// The lines of `file`, whose messages name `path`.
fn lines_of(file: &Path, path: &Path) -> Result<Lines<BufReader<File>>, CliError> {
    let f =
        File::open(file).map_err(|e| CliError(format!("{}: cannot open: {e}", path.display())))?;
    Ok(Lines::new(BufReader::new(f)))
}

/// [`import`] of the file `file`, whose messages name `path`.
fn import_named(file: &Path, path: &Path, out: &Path) -> Result<u64, CliError> {
    let named = |e: String| CliError(format!("{}: {e}", path.display()));
    let mut lines = lines_of(file, path)?;
    let (_, head) = lines
        .next_str()
        .ok_or_else(|| {
            CliError(format!(
                "{}: empty file: expected the header Thread,Time,Action,Pointer,Size,Stream",
                path.display()
            ))
        })?
        .map_err(named)?;
    // Tools that write UTF-8 with a byte order mark put it before `Thread`.
    let head = head.strip_prefix('\u{feff}').unwrap_or(head).to_string();
    let cols: Vec<&str> = head.split(',').map(str::trim).collect();
    let col = |name: &str| cols.iter().position(|c| c.eq_ignore_ascii_case(name));
    let need = |name: &str| {
        col(name).ok_or_else(|| {
            CliError(format!(
                "{}: line 1: no `{name}` column (found {:?}); not an RMM log?",
                path.display(),
                cols
            ))
        })
    };
    let (ct, ctime, ca, cp, cs) = (
        need("Thread")?,
        need("Time")?,
        need("Action")?,
        need("Pointer")?,
        need("Size")?,
    );
    let (cstream, cdev) = (col("Stream"), col("Device"));
    let werr = |e: std::io::Error| CliError(format!("{}: cannot write: {e}", out.display()));
    // The rows after the header, read again from the start.
    let rows = || -> Result<Lines<BufReader<File>>, CliError> {
        let mut rows = lines_of(file, path)?;
        rows.next_bytes();
        Ok(rows)
    };
    // The first row's time of day starts the trace (the date is unknown),
    // so that an export writes the log's own clock again; a bad first time
    // is reported with its line below.
    let first_tod = match rows()?.next_str() {
        Some(Ok((_, l))) => l.split(',').nth(ctime).and_then(|t| parse_time(t.trim())),
        _ => None,
    };
    // The devices the log names, and the earliest first time of a device
    // (a first pass over the Device column; a bad value is reported with
    // its line below).
    let (device_count, earliest) = match cdev {
        Some(c) => {
            let mut firsts: FxHashMap<u32, Option<u64>> = FxHashMap::default();
            let mut rows = rows()?;
            while let Some(Ok((_, l))) = rows.next_str() {
                let cells: Vec<&str> = l.split(',').collect();
                let Some(d) = cells.get(c).and_then(|d| d.trim().parse::<u32>().ok()) else {
                    continue;
                };
                if d < MAX_DEVICES {
                    firsts
                        .entry(d)
                        .or_insert_with(|| cells.get(ctime).and_then(|t| parse_time(t.trim())));
                }
            }
            let earliest = first_tod.and_then(|r| {
                firsts
                    .values()
                    .flatten()
                    .map(|&t| if t + HOUR_US < r { t + DAY_US } else { t })
                    .min()
            });
            (firsts.keys().max().map_or(1, |d| d + 1), earliest)
        }
        None => (1, first_tod),
    };
    let header = TraceHeader {
        producer: "import rmm-csv".into(),
        device_count,
        start_unix_ns: earliest.unwrap_or(0).saturating_mul(1000),
        ..TraceHeader::default()
    };
    let mut w = TraceWriter::new(BufWriter::new(File::create(out).map_err(werr)?), &header)
        .map_err(werr)?;
    let mut threads: FxHashMap<String, u32> = FxHashMap::default();
    let mut batches: std::collections::BTreeMap<u32, Vec<TraceEvent>> = Default::default();
    let mut first_us = earliest;
    // Per device: the day, and the time of its previous row.
    let mut clocks: FxHashMap<u32, (u64, u64)> = FxHashMap::default();
    while let Some(line) = lines.next_str() {
        let (lineno, line) = line.map_err(named)?;
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let bad = |c: usize, what: &str| {
            CliError(format!(
                "{}: line {lineno}, column {}: {what}, found {:?}",
                path.display(),
                cols.get(c).unwrap_or(&"?"),
                input::clip(f.get(c).unwrap_or(&""))
            ))
        };
        let field = |c: usize| f.get(c).copied().ok_or_else(|| bad(c, "missing field"));
        let tod = parse_time(field(ctime)?)
            .ok_or_else(|| bad(ctime, "expected HH:MM:SS.microseconds"))?;
        let device = match cdev {
            Some(c) => field(c)?
                .parse()
                .ok()
                .filter(|&d| d < MAX_DEVICES)
                .ok_or_else(|| bad(c, &format!("expected a device index below {MAX_DEVICES}")))?,
            None => 0,
        };
        let (day, last_us) = clocks
            .entry(device)
            .or_insert((0, first_tod.unwrap_or(tod)));
        if tod.saturating_add(HOUR_US) < *last_us % DAY_US {
            *day += 1;
        }
        let us = day.saturating_mul(DAY_US).saturating_add(tod);
        *last_us = us;
        let t0 = *first_us.get_or_insert(us);
        let next = threads.len() as u32 + 1;
        let thread = *threads.entry(field(ct)?.to_string()).or_insert(next);
        let ptr = parse_hex(field(cp)?)
            .ok_or_else(|| bad(cp, "expected a pointer like 0x7f12ab000000 or (nil)"))?;
        let size: u64 = field(cs)?
            .parse()
            .map_err(|_| bad(cs, "expected a byte count"))?;
        let stream = match cstream {
            Some(c) => parse_hex(field(c)?).ok_or_else(|| bad(c, "expected a stream like 0x0"))?,
            None => 0,
        };
        // RMM logs no rounding: the block is the bytes requested.
        let (addr, requested, block_size) = (ptr, size, size);
        let event = |kind| {
            let time_ns = us.saturating_sub(t0).saturating_mul(1000);
            TraceEvent::from_kind(time_ns, device, stream, thread, kind)
        };
        let out = batches.entry(device).or_default();
        match field(ca)? {
            "allocate" => out.push(event(EventKind::Alloc {
                addr,
                requested,
                block_size,
            })),
            "free" => {
                out.push(event(EventKind::FreeRequested {
                    addr,
                    requested,
                    block_size,
                }));
                out.push(event(EventKind::FreeCompleted {
                    addr,
                    requested,
                    block_size,
                }));
            }
            "allocate failure" => out.push(event(EventKind::Oom {
                requested,
                device_free: 0,
            })),
            _ => return Err(bad(ca, "expected allocate, free or allocate failure")),
        }
        if out.len() >= 4096 {
            w.write_events(device, out).map_err(werr)?;
            out.clear();
        }
    }
    for (d, evs) in batches {
        w.write_events(d, &evs).map_err(werr)?;
    }
    let n = w.events();
    w.finish(None).map_err(werr)?;
    Ok(n)
}

const HOUR_US: u64 = 3_600_000_000;
const DAY_US: u64 = 24 * HOUR_US;

/// Microseconds since midnight of `HH:MM:SS[.ffffff]`; `None` (reported by
/// the caller as a bad time with the line number) for anything else: a
/// sign, a field out of range (`25:99:99`), a fourth field.
fn parse_time(s: &str) -> Option<u64> {
    let digits_only = |x: &str| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit());
    let (hms, frac) = s.split_once('.').unwrap_or((s, "0"));
    let mut it = hms.split(':');
    let mut field = |limit: u64| {
        it.next()
            .filter(|x| digits_only(x) && x.len() <= 2)
            .and_then(|x| x.parse::<u64>().ok())
            .filter(|&v| v < limit)
    };
    let (h, m, sec) = (field(24)?, field(60)?, field(60)?);
    if it.next().is_some() || !digits_only(frac) {
        return None;
    }
    let digits = frac.len().min(6);
    let f: u64 = frac.get(..digits)?.parse().ok()?;
    Some(((h * 60 + m) * 60 + sec) * 1_000_000 + f * 10u64.pow(6 - digits as u32))
}

fn parse_hex(s: &str) -> Option<u64> {
    match s {
        "(nil)" | "0" | "" => Some(0),
        _ => u64::from_str_radix(s.trim_start_matches("0x").trim_start_matches("0X"), 16).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fields() {
        assert_eq!(parse_time("01:02:03.000004"), Some(3_723_000_004));
        assert_eq!(parse_time("01:02:03.5"), Some(3_723_500_000));
        assert_eq!(parse_time("1:2"), None);
        assert_eq!(parse_time("99999999999999999:00:00.0"), None, "no wrap");
        assert_eq!(parse_time("0:0:18446744073709.551616"), None);
        assert_eq!(parse_time("23:59:59.999999"), Some(86_399_999_999));
        assert_eq!(parse_time("10:00:00.1234567"), Some(36_000_123_456));
        for bad in [
            "25:00:00.000001",
            "10:99:00.000001",
            "10:00:99.000001",
            "+10:00:00.000001",
            "10:00:00.+5",
            "10:00:00.",
            "10:00:00:00.000001",
            "10::00.000001",
        ] {
            assert_eq!(parse_time(bad), None, "{bad}");
        }
        assert_eq!(parse_hex("(nil)"), Some(0));
        assert_eq!(parse_hex("0x7f00"), Some(0x7f00));
        assert_eq!(parse_hex("zz"), None);
    }
}
