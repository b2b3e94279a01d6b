//! [`TraceWriter`]: encodes events into checksummed blocks on any `Write`.
//!
//! Each block is written with one `write_all`, so a process killed between
//! blocks leaves a file that reads completely up to its last block. Records
//! inside a block are delta-encoded against the previous record of the same
//! block (see `docs/trace-format.md`), which keeps the average near 10 bytes.

use std::io::{self, Write};

use crate::trace::format::{
    self, BLOCK_HEADER_LEN, BLOCK_MAGIC, MAGIC, MAX_BLOCK_LEN, MAX_DEVICES, MAX_HEADER_LEN,
    MINOR_VERSION, TraceEnd, TraceHeader, VERSION, kind, tag,
};
use crate::trace::{Action, TraceEvent};

/// Most events encoded into one block (larger batches are split).
pub use crate::trace::format::MAX_BLOCK_EVENTS;

/// Writes a trace file: the header at creation, then blocks.
pub struct TraceWriter<W: Write> {
    out: W,
    block: Vec<u8>,
    strings: u64,
    events: u64,
    dropped: u64,
    bytes: u64,
    last_ns: u64,
    blocks: u64,
}

impl<W: Write> TraceWriter<W> {
    /// Writes the header and returns a writer positioned at the first block.
    ///
    /// # Errors
    /// `InvalidInput`, before anything is written, when a reader would
    /// refuse the header (a device count above [`MAX_DEVICES`], or a
    /// configuration string and producer longer than [`MAX_HEADER_LEN`]);
    /// the output's error.
    pub fn new(mut out: W, header: &TraceHeader) -> io::Result<TraceWriter<W>> {
        if header.device_count > MAX_DEVICES {
            return Err(invalid(format!(
                "a device count of {} is above the limit of {MAX_DEVICES} a trace holds",
                header.device_count
            )));
        }
        let mut body = Vec::with_capacity(64 + header.config.len());
        body.extend_from_slice(&header.start_unix_ns.to_le_bytes());
        body.extend_from_slice(&header.device_count.to_le_bytes());
        body.extend_from_slice(&header.pid.to_le_bytes());
        put_str(&mut body, &header.config);
        put_str(&mut body, &header.producer);
        format::put_varint(&mut body, MINOR_VERSION);
        if body.len() > MAX_HEADER_LEN as usize {
            return Err(invalid(format!(
                "the trace header of {} bytes (a configuration string of {} bytes, a producer of {}) is above the limit of {MAX_HEADER_LEN} bytes",
                body.len(),
                header.config.len(),
                header.producer.len()
            )));
        }
        let mut head = Vec::with_capacity(18 + body.len() + 4);
        head.extend_from_slice(&MAGIC);
        head.extend_from_slice(&VERSION.to_le_bytes());
        head.extend_from_slice(&(body.len() as u32).to_le_bytes());
        head.extend_from_slice(&body);
        head.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        out.write_all(&head)?;
        Ok(TraceWriter {
            out,
            block: Vec::with_capacity(1 << 16),
            strings: 0,
            events: 0,
            dropped: 0,
            bytes: head.len() as u64,
            last_ns: 0,
            blocks: 0,
        })
    }

    /// Events written so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Dropped events reported so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The output.
    pub fn get_ref(&self) -> &W {
        &self.out
    }

    /// Bytes written so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Strings in the table so far; the next one gets this id.
    pub fn string_count(&self) -> u64 {
        self.strings
    }

    /// Appends strings to the table; they get the next ids in order, in
    /// as many blocks as [`MAX_BLOCK_LEN`] needs.
    ///
    /// # Errors
    /// `InvalidInput`, before anything is written, for a string that
    /// cannot fit in a block; the output's error.
    pub fn write_strings<S: AsRef<str>>(&mut self, strings: &[S]) -> io::Result<()> {
        // Room for the count, the id and the length varints (10 bytes each).
        const ROOM: usize = MAX_BLOCK_LEN as usize - 30;
        if self.strings.saturating_add(strings.len() as u64) > format::MAX_STRINGS {
            return Err(invalid(format!(
                "{} more strings after {} are above the limit of {} in a trace",
                strings.len(),
                self.strings,
                format::MAX_STRINGS
            )));
        }
        if let Some(s) = strings.iter().find(|s| s.as_ref().len() > ROOM) {
            return Err(invalid(format!(
                "a string of {} bytes is above the limit of {ROOM} bytes a block holds",
                s.as_ref().len()
            )));
        }
        let mut rest = strings;
        while !rest.is_empty() {
            let (mut n, mut bytes) = (0, 0);
            while n < rest.len() && bytes + rest[n].as_ref().len() + 20 <= ROOM {
                bytes += rest[n].as_ref().len() + 20;
                n += 1;
            }
            self.begin(kind::STRINGS, 0);
            format::put_varint(&mut self.block, n as u64);
            for s in &rest[..n] {
                format::put_varint(&mut self.block, self.strings);
                put_str(&mut self.block, s.as_ref());
                self.strings += 1;
            }
            self.end_block()?;
            rest = &rest[n..];
        }
        Ok(())
    }

    /// Records that `count` events of `device` were lost before `at_ns`.
    ///
    /// # Errors
    /// `InvalidInput` for a device not below [`MAX_DEVICES`]; the output's error.
    pub fn write_dropped(&mut self, device: u32, count: u64, at_ns: u64) -> io::Result<()> {
        check_device(device)?;
        self.begin(kind::DROPPED, device);
        format::put_varint(&mut self.block, count);
        format::put_varint(&mut self.block, at_ns);
        self.dropped += count;
        self.end_block()
    }

    /// Writes events of one device (`time_ns` in nanoseconds since start,
    /// in order). Each event's `device` field is ignored: `device` is used.
    ///
    /// # Errors
    /// `InvalidInput` for a device not below [`MAX_DEVICES`]; the output's error.
    pub fn write_events(&mut self, device: u32, events: &[TraceEvent]) -> io::Result<()> {
        check_device(device)?;
        for chunk in events.chunks(MAX_BLOCK_EVENTS) {
            self.begin(kind::EVENTS, device);
            encode_events(&mut self.block, chunk);
            self.events += crate::trace::reader::event_count(chunk);
            if let Some(last) = chunk.last() {
                self.last_ns = self.last_ns.max(last.time_ns);
            }
            self.end_block()?;
        }
        Ok(())
    }

    /// Flushes the underlying writer.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// Writes the END block with the totals and flushes.
    pub fn finish(mut self, end_ns: Option<u64>) -> io::Result<(W, TraceEnd)> {
        let end = TraceEnd {
            events: self.events,
            dropped: self.dropped,
            end_ns: end_ns.unwrap_or(self.last_ns),
            blocks: Some(self.blocks),
        };
        self.begin(kind::END, 0);
        format::put_varint(&mut self.block, end.events);
        format::put_varint(&mut self.block, end.dropped);
        format::put_varint(&mut self.block, end.end_ns);
        format::put_varint(&mut self.block, self.blocks);
        self.end_block()?;
        self.out.flush()?;
        Ok((self.out, end))
    }

    fn begin(&mut self, kind: u8, device: u32) {
        self.block.clear();
        self.block.extend_from_slice(&BLOCK_MAGIC);
        self.block.push(kind);
        // The block's sequence number modulo 256 (format minor 1).
        self.block.push(self.blocks as u8);
        self.block.extend_from_slice(&device.to_le_bytes());
        self.block.extend_from_slice(&[0; 8]);
    }

    fn end_block(&mut self) -> io::Result<()> {
        let len = (self.block.len() - BLOCK_HEADER_LEN) as u32;
        self.block[8..12].copy_from_slice(&len.to_le_bytes());
        let mut h = crc32fast::Hasher::new();
        h.update(&self.block[..12]);
        h.update(&self.block[BLOCK_HEADER_LEN..]);
        let crc = h.finalize();
        self.block[12..16].copy_from_slice(&crc.to_le_bytes());
        self.out.write_all(&self.block)?;
        self.bytes += self.block.len() as u64;
        self.blocks += 1;
        Ok(())
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

fn check_device(device: u32) -> io::Result<()> {
    if device >= MAX_DEVICES {
        return Err(invalid(format!(
            "device {device} is not below the limit of {MAX_DEVICES} devices a trace holds"
        )));
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    format::put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// Encodes a block payload: count, base time, then one record per event.
pub(crate) fn encode_events(out: &mut Vec<u8>, events: &[TraceEvent]) {
    let base = events.first().map_or(0, |e| e.time_ns);
    format::put_varint(out, events.len() as u64);
    format::put_varint(out, base);
    let (mut time, mut stream, mut thread, mut addr, mut size, mut aux) =
        (base, 0u64, 0u32, 0u64, 0u64, 0u64);
    for e in events {
        let code = e.action as u8;
        let mut t = code;
        if e.stream == stream {
            t |= tag::SAME_STREAM;
        }
        if e.thread == thread {
            t |= tag::SAME_THREAD;
        }
        let repeat = e.addr == addr && e.size == size && e.aux == aux;
        if repeat {
            t |= tag::REPEAT;
        }
        out.push(t);
        format::put_varint(out, format::zigzag(e.time_ns.wrapping_sub(time) as i64));
        time = e.time_ns;
        if e.stream != stream {
            format::put_varint(out, e.stream);
            stream = e.stream;
        }
        if e.thread != thread {
            format::put_varint(out, u64::from(e.thread));
            thread = e.thread;
        }
        if !repeat {
            format::put_varint(out, format::zigzag(e.addr.wrapping_sub(addr) as i64));
            format::put_varint(out, e.size);
            if format::aux_is_block_size(code) {
                format::put_varint(out, format::zigzag(e.aux.wrapping_sub(e.size) as i64));
            } else {
                format::put_varint(out, e.aux);
            }
            (addr, size, aux) = (e.addr, e.size, e.aux);
        }
    }
    debug_assert!(Action::ALL.len() <= usize::from(tag::ACTION) + 1);
}
