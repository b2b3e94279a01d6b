//! [`TraceReader`]: streams a `.gtrace` file block by block.
//!
//! Memory is bounded by one block. Every length is checked against what is
//! left before anything is allocated, every block against its crc32, so a
//! truncated or damaged file yields the events of its intact prefix followed
//! by one [`TraceError`] that says where and what; the reader never panics.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::Path;

use crate::trace::format::{
    self, BLOCK_HEADER_LEN, BLOCK_MAGIC, MAGIC, MAX_BLOCK_LEN, MAX_DEVICES, MAX_HEADER_LEN,
    TraceEnd, TraceError, TraceErrorKind, TraceHeader, VERSION, kind, tag,
};
use crate::trace::{Action, TraceEvent};

/// Reads a trace: the header at creation, then blocks on demand.
pub struct TraceReader<R: Read> {
    src: R,
    offset: u64,
    header: TraceHeader,
    strings: Vec<String>,
    dropped: BTreeMap<u32, u64>,
    end: Option<TraceEnd>,
    payload: Vec<u8>,
    error: Option<TraceError>,
    finished: bool,
    events_read: u64,
    minor: u64,
    blocks: u64,
    last_time: BTreeMap<u32, u64>,
    warnings: Vec<String>,
}

/// Most warnings a reader keeps (the first ones).
const MAX_WARNINGS: usize = 8;

/// How far (ns) a device's events may go back in time across blocks before
/// the reader warns: threads read the clock a few nanoseconds apart.
const TIME_SLACK_NS: u64 = 1_000_000;

impl TraceReader<BufReader<File>> {
    /// Opens a trace file and reads its header.
    pub fn open(path: &Path) -> Result<Self, TraceError> {
        let f = File::open(path).map_err(|e| TraceError::new(0, TraceErrorKind::Io(e)))?;
        TraceReader::new(BufReader::with_capacity(1 << 20, f))
    }
}

impl<R: Read> TraceReader<R> {
    /// Reads the header from `src`.
    pub fn new(mut src: R) -> Result<Self, TraceError> {
        let mut fixed = [0u8; 14];
        let got = read_full(&mut src, &mut fixed)
            .map_err(|e| TraceError::new(0, TraceErrorKind::Io(e)))?;
        if got < 8 || fixed[..8] != MAGIC {
            return Err(TraceError::new(
                0,
                TraceErrorKind::NotATrace {
                    found: fixed[..got.min(8)].to_vec(),
                },
            ));
        }
        if got < 14 {
            return Err(TraceError::new(
                0,
                TraceErrorKind::Truncated {
                    what: "header",
                    needed: 14,
                    available: got as u64,
                },
            ));
        }
        let version = u16::from_le_bytes([fixed[8], fixed[9]]);
        if version != VERSION {
            return Err(TraceError::new(
                8,
                TraceErrorKind::UnsupportedVersion { found: version },
            ));
        }
        let len = u32::from_le_bytes(fixed[10..14].try_into().expect("4 bytes"));
        if len > MAX_HEADER_LEN {
            return Err(TraceError::malformed(
                10,
                format!("header length {len} exceeds the limit {MAX_HEADER_LEN}"),
            ));
        }
        let mut body = vec![0u8; len as usize + 4];
        let got = read_full(&mut src, &mut body)
            .map_err(|e| TraceError::new(14, TraceErrorKind::Io(e)))?;
        if got < body.len() {
            return Err(TraceError::new(
                14,
                TraceErrorKind::Truncated {
                    what: "header",
                    needed: body.len() as u64,
                    available: got as u64,
                },
            ));
        }
        let stored = u32::from_le_bytes(body[len as usize..].try_into().expect("4 bytes"));
        body.truncate(len as usize);
        let computed = crc32fast::hash(&body);
        if stored != computed {
            return Err(TraceError::new(
                14,
                TraceErrorKind::Checksum {
                    what: "header",
                    stored,
                    computed,
                },
            ));
        }
        let (header, minor) = parse_header(&body)
            .ok_or_else(|| TraceError::malformed(14, "header fields do not parse"))?;
        if header.device_count > MAX_DEVICES {
            return Err(TraceError::malformed(
                14,
                format!(
                    "the header's device count {} is above the limit of {}",
                    header.device_count, MAX_DEVICES
                ),
            ));
        }
        Ok(TraceReader {
            src,
            offset: 14 + u64::from(len) + 4,
            header,
            strings: Vec::new(),
            dropped: BTreeMap::new(),
            end: None,
            payload: Vec::with_capacity(1 << 16),
            error: None,
            finished: false,
            events_read: 0,
            minor,
            blocks: 0,
            last_time: BTreeMap::new(),
            warnings: Vec::new(),
        })
    }

    /// The header.
    pub fn header(&self) -> &TraceHeader {
        &self.header
    }

    /// The format's minor version in the file (0 for files older than
    /// minor versions; see [`format::MINOR_VERSION`]).
    pub fn minor_version(&self) -> u64 {
        self.minor
    }

    /// Problems that did not stop reading (a device's events going back in
    /// time across blocks, as when blocks of an older file were reordered),
    /// the first eight.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Bytes consumed so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The string table read so far (index = string id).
    pub fn strings(&self) -> &[String] {
        &self.strings
    }

    /// A string by id, if it has been read.
    pub fn string(&self, id: u64) -> Option<&str> {
        self.strings
            .get(usize::try_from(id).ok()?)
            .map(String::as_str)
    }

    /// Dropped-event counts read so far, per device.
    pub fn dropped(&self) -> &BTreeMap<u32, u64> {
        &self.dropped
    }

    /// The END block's totals, once read (absent from traces whose process
    /// stopped without `trace_stop`).
    pub fn end(&self) -> Option<&TraceEnd> {
        self.end.as_ref()
    }

    /// Events decoded so far.
    pub fn events_read(&self) -> u64 {
        self.events_read
    }

    /// The error that stopped [`events`](Self::events), if any.
    pub fn error(&self) -> Option<&TraceError> {
        self.error.as_ref()
    }

    /// Takes the error that stopped [`events`](Self::events).
    pub fn take_error(&mut self) -> Option<TraceError> {
        self.error.take()
    }

    /// Reads blocks until one holds events; fills `out` (cleared first) with
    /// them. `Ok(false)` at the end of the file.
    pub fn next_events(&mut self, out: &mut Vec<TraceEvent>) -> Result<bool, TraceError> {
        out.clear();
        while !self.finished {
            let start = self.offset;
            let mut head = [0u8; BLOCK_HEADER_LEN];
            let got = read_full(&mut self.src, &mut head).map_err(|e| self.io(e))?;
            if got == 0 {
                self.finished = true;
                break;
            }
            if got < BLOCK_HEADER_LEN && self.end.is_some() {
                // A complete trace with bytes appended (`echo >> t.gtrace`):
                // not a truncation.
                self.finished = true;
                return Err(TraceError::malformed(
                    start,
                    format!(
                        "{got} stray bytes follow the END block: something was appended to a complete trace"
                    ),
                ));
            }
            if got < BLOCK_HEADER_LEN {
                self.finished = true;
                return Err(TraceError::new(
                    start,
                    TraceErrorKind::Truncated {
                        what: "block header",
                        needed: BLOCK_HEADER_LEN as u64,
                        available: got as u64,
                    },
                ));
            }
            if head[..2] != BLOCK_MAGIC {
                self.finished = true;
                return Err(TraceError::malformed(
                    start,
                    format!(
                        "expected block magic {:02x?}, found {:02x?}",
                        BLOCK_MAGIC,
                        &head[..2]
                    ),
                ));
            }
            let block_kind = head[2];
            let device = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
            let len = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
            let stored = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
            if len > MAX_BLOCK_LEN {
                self.finished = true;
                return Err(TraceError::malformed(
                    start,
                    format!("block length {len} exceeds the limit {MAX_BLOCK_LEN}"),
                ));
            }
            if device >= MAX_DEVICES {
                self.finished = true;
                return Err(TraceError::malformed(
                    start,
                    format!(
                        "device {device} in a block header is not below the limit of {} devices",
                        MAX_DEVICES
                    ),
                ));
            }
            self.payload.resize(len as usize, 0);
            let got = read_full(&mut self.src, &mut self.payload).map_err(|e| self.io(e))?;
            if got < len as usize {
                self.finished = true;
                return Err(TraceError::new(
                    start,
                    TraceErrorKind::Truncated {
                        what: "block payload",
                        needed: u64::from(len),
                        available: got as u64,
                    },
                ));
            }
            let mut h = crc32fast::Hasher::new();
            h.update(&head[..12]);
            h.update(&self.payload);
            let computed = h.finalize();
            if computed != stored {
                self.finished = true;
                return Err(TraceError::new(
                    start,
                    TraceErrorKind::Checksum {
                        what: "block",
                        stored,
                        computed,
                    },
                ));
            }
            self.offset += (BLOCK_HEADER_LEN + len as usize) as u64;
            if let Err(why) = self.check_sequence(block_kind, head[3]) {
                self.finished = true;
                return Err(TraceError::malformed(start, why));
            }
            if let Err(why) = self.apply_block(block_kind, device, out) {
                out.clear();
                self.finished = true;
                return Err(TraceError::malformed(
                    start,
                    format!("{why} in a block of kind {block_kind}"),
                ));
            }
            self.blocks += 1;
            if !out.is_empty() {
                self.check_time(start, device, out);
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn apply_block(
        &mut self,
        block_kind: u8,
        device: u32,
        out: &mut Vec<TraceEvent>,
    ) -> Result<(), String> {
        let mut p = 0;
        match block_kind {
            kind::EVENTS => {
                decode_events(&self.payload, device, out)?;
                self.events_read += out.len() as u64;
            }
            kind::STRINGS => self.read_strings()?,
            kind::DROPPED => {
                let n = format::get_varint(&self.payload, &mut p).ok_or("bad dropped count")?;
                // A damaged count must not wrap around to look like few.
                let d = self.dropped.entry(device).or_default();
                *d = d.saturating_add(n);
            }
            kind::END => {
                let mut next = || format::get_varint(&self.payload, &mut p).ok_or("bad totals");
                let (events, dropped, end_ns) = (next()?, next()?, next()?);
                let blocks = if self.minor >= 1 { Some(next()?) } else { None };
                let end = TraceEnd {
                    events,
                    dropped,
                    end_ns,
                    blocks,
                };
                self.check_end(&end)?;
                self.end = Some(end);
            }
            _ => {} // Unknown kinds are skipped: later minor additions stay readable.
        }
        Ok(())
    }

    /// An iterator over every event; on error it stops and keeps the error
    /// for [`error`](Self::error).
    pub fn events(&mut self) -> Events<'_, R> {
        Events {
            reader: self,
            buf: Vec::new(),
            pos: 0,
        }
    }

    /// Blocks deleted, duplicated or reordered: a block after the END
    /// block, or (minor 1) a sequence number that is not the block's index.
    fn check_sequence(&self, block_kind: u8, seq: u8) -> Result<(), String> {
        if self.end.is_some() {
            return Err(format!(
                "a block of kind {block_kind} follows the END block: blocks were duplicated or appended"
            ));
        }
        if self.minor >= 1 && seq != self.blocks as u8 {
            return Err(format!(
                "block {} (kind {block_kind}) carries sequence number {seq}, expected {} (the index modulo 256): blocks were deleted, duplicated or reordered",
                self.blocks, self.blocks as u8
            ));
        }
        Ok(())
    }

    /// The END block's totals against what the blocks before it held.
    fn check_end(&self, end: &TraceEnd) -> Result<(), String> {
        let dropped = self
            .dropped
            .values()
            .fold(0u64, |a, &n| a.saturating_add(n));
        let damage = "blocks were deleted or duplicated";
        if end.events != self.events_read {
            return Err(format!(
                "the END block counts {} events, the blocks before it hold {}: {damage}",
                end.events, self.events_read
            ));
        }
        if end.dropped != dropped {
            return Err(format!(
                "the END block counts {} dropped events, the DROPPED blocks before it {dropped}: {damage}",
                end.dropped
            ));
        }
        if let Some(b) = end.blocks
            && b != self.blocks
        {
            return Err(format!(
                "the END block counts {b} blocks before it, the file holds {}: {damage}",
                self.blocks
            ));
        }
        Ok(())
    }

    /// Warns when a device's events go back in time from one block to the
    /// next (reordered blocks of a file without sequence numbers).
    fn check_time(&mut self, start: u64, device: u32, out: &[TraceEvent]) {
        let first = out.first().map_or(0, |e| e.time_ns);
        let last = out.iter().map(|e| e.time_ns).max().unwrap_or(0);
        let prev = self.last_time.get(&device).copied();
        self.last_time
            .insert(device, prev.map_or(last, |p| p.max(last)));
        if let Some(prev) = prev
            && first.saturating_add(TIME_SLACK_NS) < prev
            && self.warnings.len() < MAX_WARNINGS
        {
            self.warnings.push(format!(
                "at byte {start}: device {device}'s events go back in time from {prev} ns to {first} ns: blocks are out of order"
            ));
        }
    }

    fn io(&mut self, e: io::Error) -> TraceError {
        self.finished = true;
        TraceError::new(self.offset, TraceErrorKind::Io(e))
    }

    fn read_strings(&mut self) -> Result<(), String> {
        let p = &self.payload;
        let mut pos = 0;
        let n = format::get_varint(p, &mut pos).ok_or("bad string count")?;
        if (self.strings.len() as u64).saturating_add(n) > format::MAX_STRINGS {
            return Err(format!(
                "{n} more strings after {} are above the limit of {} in a trace",
                self.strings.len(),
                format::MAX_STRINGS
            ));
        }
        for _ in 0..n {
            let id = format::get_varint(p, &mut pos).ok_or("bad string id")?;
            if id != self.strings.len() as u64 {
                return Err(format!(
                    "string id {id} out of order (expected {})",
                    self.strings.len()
                ));
            }
            let len = format::get_varint(p, &mut pos).ok_or("bad string length")?;
            let end = pos
                .checked_add(usize::try_from(len).map_err(|_| "string too long")?)
                .filter(|&e| e <= p.len());
            let end = end.ok_or("string runs past the block")?;
            let s = std::str::from_utf8(&p[pos..end]).map_err(|_| "string is not UTF-8")?;
            self.strings.push(s.to_string());
            pos = end;
        }
        Ok(())
    }
}

/// Iterator returned by [`TraceReader::events`].
pub struct Events<'a, R: Read> {
    reader: &'a mut TraceReader<R>,
    buf: Vec<TraceEvent>,
    pos: usize,
}

impl<R: Read> Events<'_, R> {
    /// The reader (string table, offset, errors).
    pub fn reader(&self) -> &TraceReader<R> {
        self.reader
    }
}

impl<R: Read> Iterator for Events<'_, R> {
    type Item = TraceEvent;

    #[inline]
    fn next(&mut self) -> Option<TraceEvent> {
        if self.pos == self.buf.len() {
            self.pos = 0;
            match self.reader.next_events(&mut self.buf) {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => {
                    self.buf.clear();
                    self.reader.error = Some(e);
                    return None;
                }
            }
        }
        let e = self.buf[self.pos];
        self.pos += 1;
        Some(e)
    }
}

fn read_full(src: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match src.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The header and the format's minor version (0 when absent).
fn parse_header(b: &[u8]) -> Option<(TraceHeader, u64)> {
    let start_unix_ns = u64::from_le_bytes(b.get(0..8)?.try_into().ok()?);
    let device_count = u32::from_le_bytes(b.get(8..12)?.try_into().ok()?);
    let pid = u32::from_le_bytes(b.get(12..16)?.try_into().ok()?);
    let mut pos = 16;
    let config = get_str(b, &mut pos)?;
    let producer = get_str(b, &mut pos)?;
    let minor = if pos < b.len() {
        format::get_varint(b, &mut pos)?
    } else {
        0
    };
    let header = TraceHeader {
        start_unix_ns,
        device_count,
        pid,
        config,
        producer,
    };
    Some((header, minor))
}

fn get_str(b: &[u8], pos: &mut usize) -> Option<String> {
    let len = usize::try_from(format::get_varint(b, pos)?).ok()?;
    let end = pos.checked_add(len)?;
    let s = std::str::from_utf8(b.get(*pos..end)?).ok()?.to_string();
    *pos = end;
    Some(s)
}

/// Decodes one events payload into `out`.
/// How many events a buffer or block holds as readers see them (an
/// [`Action::Free`] record is two).
pub(crate) fn event_count(records: &[TraceEvent]) -> u64 {
    records.len() as u64 + records.iter().filter(|e| e.action == Action::Free).count() as u64
}

/// Appends an event as readers see it: an [`Action::Free`] record becomes
/// its `free_requested` and `free_completed`.
#[inline]
pub(crate) fn expand(e: TraceEvent, out: &mut Vec<TraceEvent>) {
    if e.action == Action::Free {
        out.push(TraceEvent {
            action: Action::FreeRequested,
            ..e
        });
        out.push(TraceEvent {
            action: Action::FreeCompleted,
            ..e
        });
    } else {
        out.push(e);
    }
}

pub(crate) fn decode_events(
    p: &[u8],
    device: u32,
    out: &mut Vec<TraceEvent>,
) -> Result<(), String> {
    let mut pos = 0;
    let n = format::get_varint(p, &mut pos).ok_or("bad event count")?;
    if n > format::MAX_BLOCK_EVENTS as u64 {
        return Err(format!(
            "event count {n} is above the limit of {} records per block",
            format::MAX_BLOCK_EVENTS
        ));
    }
    // Every record takes at least two bytes: a bound before reserving.
    if n > (p.len() as u64) / 2 + 1 {
        return Err(format!(
            "event count {n} does not fit a payload of {} bytes",
            p.len()
        ));
    }
    let mut time = format::get_varint(p, &mut pos).ok_or("bad base time")?;
    out.reserve(n as usize);
    let (mut stream, mut thread, mut addr, mut size, mut aux) = (0u64, 0u32, 0u64, 0u64, 0u64);
    for i in 0..n {
        let t = *p
            .get(pos)
            .ok_or_else(|| format!("record {i} of {n} missing"))?;
        pos += 1;
        let action = Action::from_code(t & tag::ACTION)
            .ok_or_else(|| format!("unknown action code {}", t & tag::ACTION))?;
        let field = |pos: &mut usize, what: &str| {
            format::get_varint(p, pos).ok_or_else(|| format!("record {i}: bad {what}"))
        };
        time = time.wrapping_add(format::unzigzag(field(&mut pos, "time")?) as u64);
        if t & tag::SAME_STREAM == 0 {
            stream = field(&mut pos, "stream")?;
        }
        if t & tag::SAME_THREAD == 0 {
            thread = u32::try_from(field(&mut pos, "thread")?)
                .map_err(|_| format!("record {i}: thread id too large"))?;
        }
        if t & tag::REPEAT == 0 {
            addr = addr.wrapping_add(format::unzigzag(field(&mut pos, "address")?) as u64);
            size = field(&mut pos, "size")?;
            let a = field(&mut pos, "aux")?;
            aux = if format::aux_is_block_size(action as u8) {
                size.wrapping_add(format::unzigzag(a) as u64)
            } else {
                a
            };
        }
        expand(
            TraceEvent {
                time_ns: time,
                action,
                device,
                stream,
                addr,
                size,
                aux,
                thread,
            },
            out,
        );
    }
    if pos != p.len() {
        return Err(format!("{} stray bytes after {n} records", p.len() - pos));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
