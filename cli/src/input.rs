//! Reading a trace for a command: clear errors, a progress bar on long
//! inputs, and decoding on a second thread so analysis runs beside it.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpualloc::trace::format::{MAGIC, MAX_NAME_LEN};
use gpualloc::trace::{TraceEnd, TraceErrorKind, TraceEvent, TraceHeader, TraceReader};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

mod header;

/// Inputs above this size get a progress bar (on a terminal).
const PROGRESS_MIN_BYTES: u64 = 32 << 20;

/// A failure to report to the user: one line, then exit status 1.
#[derive(Debug)]
pub struct CliError(pub String);

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for CliError {
    fn from(s: String) -> Self {
        CliError(s)
    }
}

/// What a scan learned besides the events.
pub struct ScanInfo {
    /// The header.
    pub header: TraceHeader,
    /// The string table, each name shortened ([`shorten_name`]).
    pub strings: Vec<String>,
    /// Events read.
    pub events: u64,
    /// Events the recorder could not write, per the DROPPED blocks.
    pub dropped: u64,
    /// The END block, absent when the process stopped without `trace_stop`.
    pub end: Option<TraceEnd>,
    /// A problem that did not stop the scan (printed by the caller).
    pub warning: Option<String>,
    /// Bytes in the file.
    pub file_bytes: u64,
}

impl ScanInfo {
    /// The name of string `id`, or a placeholder.
    pub fn name(&self, id: u64) -> String {
        match self.strings.get(id as usize) {
            Some(s) => s.clone(),
            None if id == crate::analyses::state::NO_PHASE => "(no phase)".to_string(),
            None => format!("#{id}"),
        }
    }
}

/// At most 64 characters of `s`, for a message that quotes a file's contents.
pub fn clip(s: &str) -> String {
    match s.char_indices().nth(64) {
        None => s.to_string(),
        Some((i, _)) => format!("{}... ({} bytes)", &s[..i], s.len()),
    }
}

/// A phase or mark name as the commands write it: at most
/// [`MAX_NAME_LEN`] bytes (cut at a character's start) and then
/// `…(N bytes)`, N its whole length. The allocator refuses longer names,
/// but a hand-made or imported trace may hold one of megabytes, which
/// every export and table would otherwise repeat in full.
pub fn shorten_name(name: &str) -> String {
    if name.len() <= MAX_NAME_LEN {
        return name.to_string();
    }
    let cut = (0..=MAX_NAME_LEN)
        .rev()
        .find(|&i| name.is_char_boundary(i))
        .unwrap_or(0);
    format!("{}…({} bytes)", &name[..cut], name.len())
}

/// The string table `strings` with each name shortened ([`shorten_name`]).
pub fn shortened_names(strings: &[String]) -> Vec<String> {
    strings.iter().map(|s| shorten_name(s)).collect()
}

/// Prints `gpualloc: warning: {msg}` to stderr unless this message, or
/// another with the same `key`, was printed already: a command may read its
/// input several times, and see the same damage each time.
pub fn warn_once(key: &str, msg: &str) {
    static SHOWN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let mut shown = SHOWN.lock().unwrap_or_else(|p| p.into_inner());
    if !shown.contains(key) && !shown.contains(msg) {
        shown.insert(key.to_string());
        shown.insert(msg.to_string());
        eprintln!("gpualloc: warning: {msg}");
    }
}

/// The most device memory a trace is believed to tell (4 TiB, over ten
/// times today's largest GPU). The simulated device keeps a record per
/// page it maps, so a damaged or hand-made trace telling petabytes (and
/// allocating them) would have a replay take gigabytes of host memory and
/// minutes; `--capacity` replays on more where meant.
pub const PLAUSIBLE_DEVICE_BYTES: u64 = 4 << 40;

/// `bytes`, device memory that `path` tells, at most
/// [`PLAUSIBLE_DEVICE_BYTES`]; says so once when it was more.
pub fn plausible_device_bytes(path: &Path, bytes: u64) -> u64 {
    if bytes <= PLAUSIBLE_DEVICE_BYTES {
        return bytes;
    }
    warn_once(
        "implausible device memory",
        &format!(
            "{}: the trace tells a device of {bytes} bytes, more than any GPU has: replayed on {} bytes (4 TiB); pass --capacity to replay on more",
            path.display(),
            PLAUSIBLE_DEVICE_BYTES
        ),
    );
    PLAUSIBLE_DEVICE_BYTES
}

thread_local! {
    /// The file whose events [`scan_until`] is handing to its callback on
    /// this thread, for [`warn_once_in_file`].
    static READING: RefCell<Option<PathBuf>> = const { RefCell::new(None) };
}

/// Sets [`READING`] for one scan and puts the previous value back when
/// dropped (also when the callback panics).
struct Reading(Option<PathBuf>);

impl Reading {
    fn start(path: &Path) -> Reading {
        Reading(READING.with(|r| r.replace(Some(path.to_path_buf()))))
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        READING.with(|r| *r.borrow_mut() = self.0.take());
    }
}

/// [`warn_once`] for a problem found in the events of the file being
/// scanned: the message names that file, and each file warns once per
/// `key` (a command given several ranks' traces warns of each that has
/// the problem). Outside a scan, as [`warn_once`].
pub fn warn_once_in_file(key: &str, msg: &str) {
    match READING.with(|r| r.borrow().clone()) {
        Some(p) => {
            let file = p.display();
            warn_once(&format!("{file}: {key}"), &format!("{file}: {msg}"));
        }
        None => warn_once(key, msg),
    }
}

/// Warns (once per file) that the recorder dropped `dropped` events of
/// `path`: every figure drawn from the trace misses them (a block whose
/// free was dropped looks alive). `summary` says it in its output too.
pub fn warn_dropped(path: &Path, dropped: u64) {
    if dropped > 0 {
        warn_once(
            &format!("{}: dropped", path.display()),
            &format!(
                "{}: {dropped} events were dropped (they could not be written while recording): the figures miss them",
                path.display()
            ),
        );
    }
}

/// Refuses to write `out` (given as `option`) when it is the same file as
/// one of `inputs`: the same path, a link to it, or another path to it.
pub fn refuse_overwrite(option: &str, out: &Path, inputs: &[&Path]) -> Result<(), CliError> {
    let Ok(o) = std::fs::metadata(out) else {
        return Ok(()); // `out` does not exist yet: it cannot be an input.
    };
    for input in inputs {
        let same = match std::fs::metadata(input) {
            Ok(i) => same_file(&o, &i),
            Err(_) => false,
        } || matches!(
            (out.canonicalize(), input.canonicalize()),
            (Ok(a), Ok(b)) if a == b
        );
        if same {
            return Err(CliError(format!(
                "{option} {} is the input {}: refusing to overwrite the input; name another output file",
                out.display(),
                input.display()
            )));
        }
    }
    Ok(())
}

#[cfg(unix)]
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
fn same_file(_: &std::fs::Metadata, _: &std::fs::Metadata) -> bool {
    false
}

/// Runs `write` on a file beside `out` and renames it to `out` once it
/// succeeds, so that a failure (a bad line of the input, a full disk)
/// leaves no partial output nor destroys an earlier one. An `out` that
/// exists and is not a regular file (`/dev/stdout`) is written directly.
pub fn write_atomically<T>(
    out: &Path,
    write: impl FnOnce(&Path) -> Result<T, CliError>,
) -> Result<T, CliError> {
    if std::fs::metadata(out).is_ok_and(|m| !m.is_file()) {
        return write(out);
    }
    let mut name = out
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(format!(".partial-{}", std::process::id()));
    let tmp = out.with_file_name(name);
    // Messages name `out`, not the file beside it.
    let named = |CliError(m): CliError| {
        CliError(m.replace(&tmp.display().to_string(), &out.display().to_string()))
    };
    let done = write(&tmp).map_err(named).and_then(|v| {
        std::fs::rename(&tmp, out)
            .map(|()| v)
            .map_err(|e| CliError(format!("{}: cannot write: {e}", out.display())))
    });
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// Refuses two options that name one output file (the second would
/// overwrite the first): the same path, two paths to one folder and name
/// (`x.json`, `./x.json`), or two links to one existing file.
pub fn refuse_shared_outputs(outs: &[(&str, &Path)]) -> Result<(), CliError> {
    for (i, (a, pa)) in outs.iter().enumerate() {
        for (b, pb) in &outs[i + 1..] {
            let same = pa == pb
                || matches!((output_place(pa), output_place(pb)), (Some(x), Some(y)) if x == y)
                || matches!((std::fs::metadata(pa), std::fs::metadata(pb)), (Ok(x), Ok(y)) if same_file(&x, &y));
            if same {
                return Err(CliError(format!(
                    "{a} and {b} both name {}: give each output its own file",
                    pa.display()
                )));
            }
        }
    }
    Ok(())
}

/// Where `out` will be written: its folder, resolved, and its name; `None`
/// when the folder cannot be resolved (it does not exist, and the write
/// will say so).
fn output_place(out: &Path) -> Option<(std::path::PathBuf, std::ffi::OsString)> {
    let name = out.file_name()?.to_os_string();
    let folder = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Some((folder.canonicalize().ok()?, name))
}

/// Opens a trace, explaining what is wrong with a file that is not one,
/// or with a header field that does not parse.
pub fn open(path: &Path) -> Result<TraceReader<BufReader<File>>, CliError> {
    refuse_second_read_of_a_stream(path)?;
    let f =
        File::open(path).map_err(|e| CliError(format!("{}: cannot open: {e}", path.display())))?;
    let mut src = BufReader::with_capacity(1 << 20, f);
    // The header's body as the buffer holds it (a pipe may give less), for
    // a message on a field the reader finds malformed.
    let body = src.fill_buf().ok().and_then(header_body);
    TraceReader::new(src).map_err(|e| {
        let explained = match &e.kind {
            TraceErrorKind::NotATrace { found } => Some(not_a_trace(found)),
            TraceErrorKind::Malformed(_) if e.offset == 14 => {
                body.and_then(|b| header::explain(&b))
            }
            _ => None,
        };
        CliError(format!(
            "{}: {}",
            path.display(),
            explained.unwrap_or_else(|| e.to_string())
        ))
    })
}

/// The header's body within the first bytes of a trace, `start`; `None`
/// when `start` does not hold all of it.
fn header_body(start: &[u8]) -> Option<Vec<u8>> {
    let len = u32::from_le_bytes(start.get(10..14)?.try_into().ok()?);
    Some(
        start
            .get(14..14usize.saturating_add(len as usize))?
            .to_vec(),
    )
}

/// A pipe or device (`<(cat t.gtrace)`, `/dev/stdin`) can be read once;
/// commands that read a trace twice would find it empty the second time.
/// The second opening is refused with what to do instead, before the file
/// is opened: opening a named pipe whose writer has gone waits for another
/// writer, for ever.
fn refuse_second_read_of_a_stream(path: &Path) -> Result<(), CliError> {
    static STREAMS: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());
    // A regular file, or a path the opening will say is missing or a folder.
    if !is_stream(path) {
        return Ok(());
    }
    let mut seen = STREAMS.lock().unwrap_or_else(|e| e.into_inner());
    if seen.iter().any(|p| p == path) {
        return Err(CliError(format!(
            "{}: not a regular file (a pipe or a device), and this command reads its trace twice: save it to a file first",
            path.display()
        )));
    }
    seen.push(path.to_path_buf());
    Ok(())
}

/// Whether `path` names a pipe or a device (neither a regular file nor a
/// folder): told without opening it, since opening a named pipe waits for
/// a writer.
pub fn is_stream(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Why a file whose first bytes are `found` is not a trace, with a hint at
/// what it may be instead.
fn not_a_trace(found: &[u8]) -> String {
    if found.is_empty() {
        return "empty file (0 bytes): not a gpualloc trace".into();
    }
    if MAGIC.starts_with(found) {
        return format!(
            "file truncated inside the magic ({} of its 8 bytes)",
            found.len()
        );
    }
    let hint = if found[0] == 0x80 {
        " (it looks like a Python pickle, perhaps a PyTorch memory snapshot: convert it with `gpualloc import`)"
    } else if found.starts_with(b"Thread") {
        " (it looks like an RMM log: convert it with `gpualloc import`)"
    } else {
        ""
    };
    format!(
        "not a gpualloc trace: it starts with {}, a trace with {}{hint}",
        show_magic(found),
        show_magic(&MAGIC)
    )
}

/// `"GATRACE"` when every byte is printable ASCII, else `0x89474154`.
fn show_magic(b: &[u8]) -> String {
    if b.iter().all(|c| c.is_ascii_graphic() || *c == b' ') {
        format!("{:?}", String::from_utf8_lossy(b))
    } else {
        let hex: String = b.iter().map(|c| format!("{c:02x}")).collect();
        format!("0x{hex}")
    }
}

/// Streams every event of `path` through `f`. A truncated or corrupt file
/// is an error unless `allow_truncated`, in which case the readable prefix
/// is used and a warning returned.
pub fn scan(
    path: &Path,
    allow_truncated: bool,
    mut f: impl FnMut(&TraceEvent),
) -> Result<ScanInfo, CliError> {
    scan_until(path, allow_truncated, |e| {
        f(e);
        true
    })
}

/// Like [`scan`], stopping early once `f` returns false.
pub fn scan_until(
    path: &Path,
    allow_truncated: bool,
    mut f: impl FnMut(&TraceEvent) -> bool,
) -> Result<ScanInfo, CliError> {
    let mut reader = open(path)?;
    let _reading = Reading::start(path);
    let file_bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    let bar = progress(file_bytes);
    let (tx, rx) = crossbeam_channel::bounded::<Vec<TraceEvent>>(4);
    let (back_tx, back_rx) = crossbeam_channel::bounded::<Vec<TraceEvent>>(6);
    let pb = bar.clone();
    let decoder = std::thread::spawn(move || {
        let mut result = Ok(());
        loop {
            let mut buf = back_rx.try_recv().unwrap_or_default();
            match reader.next_events(&mut buf) {
                Ok(true) => {
                    pb.set_position(reader.offset());
                    if tx.send(buf).is_err() {
                        break;
                    }
                }
                Ok(false) => break,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        (reader, result)
    });
    let mut events = 0u64;
    let mut stopped = false;
    'outer: for batch in rx.iter() {
        for e in &batch {
            events += 1;
            if !f(e) {
                stopped = true;
                break 'outer;
            }
        }
        let _ = back_tx.try_send(batch);
    }
    drop(rx);
    let (reader, result) = decoder
        .join()
        .map_err(|_| CliError("the trace decoder panicked".into()))?;
    bar.finish_and_clear();
    let mut warning = reader_warnings(path, &reader);
    if let Err(e) = result {
        let what = if e.is_truncation() {
            "truncated"
        } else {
            "corrupt"
        };
        let msg = format!(
            "{}: {e} ({what}; the {events} events before it were read)",
            path.display()
        );
        if !allow_truncated {
            return Err(CliError(format!(
                "{msg}; pass --allow-truncated to use them"
            )));
        }
        // Every command that accepts --allow-truncated says what it skipped.
        warn_once(&format!("{}: {e}", path.display()), &msg);
        warning = Some(msg);
    } else if reader.end().is_none() && !stopped {
        warning = Some(warn_no_end(path, events));
    }
    let dropped = reader
        .dropped()
        .values()
        .fold(0u64, |a, &n| a.saturating_add(n));
    if !stopped {
        warn_dropped(path, dropped);
    }
    Ok(ScanInfo {
        header: reader.header().clone(),
        strings: shortened_names(reader.strings()),
        events,
        dropped,
        end: reader.end().copied(),
        warning,
        file_bytes,
    })
}

/// Warns (once per file) that `path` has no END block, after `events`
/// events; returns the message.
pub fn warn_no_end(path: &Path, events: u64) -> String {
    let msg = format!(
        "{}: no END block: the recording process stopped without trace_stop; the {events} events written before it are used",
        path.display()
    );
    warn_once(&format!("{}: no END block", path.display()), &msg);
    msg
}

/// Prints the reader's warnings (damage that did not stop it) once each;
/// returns the first.
pub fn reader_warnings<R: std::io::Read>(path: &Path, reader: &TraceReader<R>) -> Option<String> {
    let mut first = None;
    for w in reader.warnings() {
        let msg = format!("{}: {w}; the figures may be wrong", path.display());
        warn_once(&msg, &msg);
        first.get_or_insert(msg);
    }
    first
}

fn progress(len: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
    if len >= PROGRESS_MIN_BYTES && std::io::stderr().is_terminal() {
        bar.set_draw_target(ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
        {
            bar.set_style(style);
        }
    }
    bar
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_long_name_is_cut_at_a_characters_start() {
        let euros = "€".repeat(1366); // 4,098 bytes, 3 a character
        let short = super::shorten_name(&euros);
        assert_eq!(short, format!("{}…(4098 bytes)", "€".repeat(1365)));
        let limit = "x".repeat(super::MAX_NAME_LEN);
        assert_eq!(super::shorten_name(&limit), limit);
    }
}
