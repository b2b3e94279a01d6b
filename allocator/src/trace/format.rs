//! The `.gtrace` file layout, defined once: magic, header, block framing,
//! the varint record encoding, and the error every reader returns.
//!
//! `docs/trace-format.md` is the prose specification of the same bytes.

use std::fmt;
use std::io;

/// First eight bytes of every trace. The high first byte catches files
/// mangled by text-mode transfers, as PNG's does.
pub const MAGIC: [u8; 8] = *b"\x89GATRACE";
/// The format version this code writes and reads.
pub const VERSION: u16 = 1;
/// The minor version this code writes, a varint after the header's
/// producer (absent, so 0, in older files). Minor 1 numbers the blocks: the
/// flags byte of every block header holds the block's index modulo 256, and
/// the END block adds the number of blocks before it. Readers of minor 0
/// ignore both, and this reader still reads minor 0 files. Minor 2 adds the
/// `private_pool` action (code 18), written only by programs that use
/// private pools; a reader of minor 1 stops at the first block holding one.
/// Minor 3 adds the `memory_limit` action (code 19), written only when a
/// program changes the caps on reserved memory while it runs; a reader of
/// minor 2 stops at the first block holding one. Minor 4 adds
/// `segment_unlist` and `segment_list` (codes 20 and 21, Note [Listed
/// ranges]), written when a stitch is taken into use or given back; a
/// reader of minor 3 stops at the first block holding one. Minor 5 writes
/// a `memory_limit` record of no cap (which cap 2) first thing on each
/// device, telling the device's memory; a reader of minor 3 or 4 sees a
/// cap it does not know and skips it. Minor 6 adds call 10 of
/// `private_pool` (PyTorch's `expandable_segments` switched off or on,
/// Note [PyTorch's expandable_segments switch]), written only by programs
/// that switch it; a reader of minor 2 to 5 sees a call it does not know
/// and skips it.
pub const MINOR_VERSION: u64 = 6;
/// Two bytes that open every block.
pub const BLOCK_MAGIC: [u8; 2] = *b"BK";
/// Bytes of a block header: magic, kind, flags, device, length, crc32.
pub const BLOCK_HEADER_LEN: usize = 16;
/// Largest payload a reader accepts (a corrupt length must not make it
/// allocate gigabytes).
pub const MAX_BLOCK_LEN: u32 = 64 << 20;

/// Most records in one EVENTS block: writers split larger batches, and
/// readers refuse more, so a block decodes to at most twice this many
/// events (a `free` record is two) whatever its payload length.
pub const MAX_BLOCK_EVENTS: usize = 1 << 16;

/// Most entries of a trace's string table: readers refuse more (a crafted
/// file of empty strings must not fill memory), writers refuse to write more.
pub const MAX_STRINGS: u64 = 1 << 20;

/// Device numbers (in block headers) and the header's device count are
/// below this; anything larger is a damaged or foreign file, and readers
/// may size per-device tables by it.
pub const MAX_DEVICES: u32 = 1024;
/// Largest header body a reader accepts (and a writer writes: the
/// configuration string and the producer must fit in it).
pub const MAX_HEADER_LEN: u32 = 1 << 20;

/// Longest phase or mark name, in bytes. The allocator refuses longer
/// names, tracing or not, so that a program behaves the same traced; the
/// recorder's string table then stays below `MAX_NAME_LEN` times its
/// entry limit.
pub const MAX_NAME_LEN: usize = 4096;

/// `Ok` when `name` (a phase or mark name, `what` says which) is no longer
/// than [`MAX_NAME_LEN`]; otherwise an `InvalidInput` error with both lengths.
pub fn check_name(name: &str, what: &str) -> io::Result<()> {
    if name.len() > MAX_NAME_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{what} name of {} bytes is above the limit of {MAX_NAME_LEN} bytes",
                name.len()
            ),
        ));
    }
    Ok(())
}

/// Block kinds.
pub mod kind {
    /// Event records of one device.
    pub const EVENTS: u8 = 1;
    /// New entries of the string table (phase names, marks).
    pub const STRINGS: u8 = 2;
    /// Events of one device that were recorded but could not be written.
    pub const DROPPED: u8 = 3;
    /// The last block: totals written by a clean stop.
    pub const END: u8 = 4;
}

/// Record tag bits above the 5-bit action code.
pub mod tag {
    /// Action code mask.
    pub const ACTION: u8 = 0x1f;
    /// The stream is the previous record's.
    pub const SAME_STREAM: u8 = 0x20;
    /// The thread is the previous record's.
    pub const SAME_THREAD: u8 = 0x40;
    /// Address, size and aux are the previous record's.
    pub const REPEAT: u8 = 0x80;
}

/// What the header says about the run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceHeader {
    /// Wall-clock time of the trace start, nanoseconds since the Unix epoch.
    pub start_unix_ns: u64,
    /// Devices the process could use.
    pub device_count: u32,
    /// Process id of the recording process (0 when unknown).
    pub pid: u32,
    /// The allocator configuration string (`GPUALLOC_CONF` syntax).
    pub config: String,
    /// What wrote the trace (`gpualloc 0.1.0`, `import pytorch-snapshot`, ...).
    pub producer: String,
}

/// Totals of a cleanly finished trace (the END block).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceEnd {
    /// Events written.
    pub events: u64,
    /// Events recorded but not written.
    pub dropped: u64,
    /// Nanoseconds since start at the stop.
    pub end_ns: u64,
    /// Blocks before the END block (minor version 1 and later).
    pub blocks: Option<u64>,
}

/// Appends `v` as LEB128.
#[inline]
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads a LEB128 value at `*pos`; `None` when the bytes end or it overflows.
#[inline]
pub fn get_varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    let mut shift = 0u32;
    loop {
        let b = *buf.get(*pos)?;
        *pos += 1;
        if shift == 63 && b > 1 {
            return None;
        }
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return Some(v);
        }
        shift += 7;
        if shift > 63 {
            return None;
        }
    }
}

/// Zigzag: small negative and positive differences both encode short.
#[inline]
pub fn zigzag(d: i64) -> u64 {
    ((d << 1) ^ (d >> 63)) as u64
}

/// Inverse of [`zigzag`].
#[inline]
pub fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Whether `aux` of this action is a block size close to `size` (encoded as a difference).
#[inline]
pub fn aux_is_block_size(action_code: u8) -> bool {
    action_code <= 2 || action_code == crate::trace::Action::Free as u8
}

/// What went wrong reading a trace, and where.
#[derive(Debug)]
pub struct TraceError {
    /// Byte offset in the file where the faulty item starts.
    pub offset: u64,
    /// What was wrong.
    pub kind: TraceErrorKind,
}

/// The kinds of [`TraceError`].
#[derive(Debug)]
#[non_exhaustive]
pub enum TraceErrorKind {
    /// The operating system failed to read.
    Io(io::Error),
    /// The file does not start with the trace magic.
    NotATrace {
        /// The first bytes found.
        found: Vec<u8>,
    },
    /// A version this reader does not understand.
    UnsupportedVersion {
        /// Version in the file.
        found: u16,
    },
    /// The file ends inside an item.
    Truncated {
        /// The item (`header`, `block header`, `block payload`).
        what: &'static str,
        /// Bytes the item needs.
        needed: u64,
        /// Bytes that were there.
        available: u64,
    },
    /// A checksum does not match: the bytes were damaged.
    Checksum {
        /// The item.
        what: &'static str,
        /// Checksum stored in the file.
        stored: u32,
        /// Checksum of the bytes read.
        computed: u32,
    },
    /// Bytes that cannot be what the format says is there.
    Malformed(String),
}

impl TraceError {
    /// An error at `offset`.
    pub fn new(offset: u64, kind: TraceErrorKind) -> TraceError {
        TraceError { offset, kind }
    }

    /// A malformed-content error at `offset`.
    pub fn malformed(offset: u64, why: impl Into<String>) -> TraceError {
        TraceError::new(offset, TraceErrorKind::Malformed(why.into()))
    }

    /// Whether the file simply ends early (as when a process died mid-write).
    pub fn is_truncation(&self) -> bool {
        matches!(self.kind, TraceErrorKind::Truncated { .. })
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "at byte {}: ", self.offset)?;
        match &self.kind {
            TraceErrorKind::Io(e) => write!(f, "read failed: {e}"),
            TraceErrorKind::NotATrace { found } => write!(
                f,
                "not a gpualloc trace: expected magic {:02x?}, found {:02x?}",
                MAGIC, found
            ),
            TraceErrorKind::UnsupportedVersion { found } => {
                write!(
                    f,
                    "trace format version {found} is not supported (this build reads version {VERSION})"
                )
            }
            TraceErrorKind::Truncated {
                what,
                needed,
                available,
            } => write!(
                f,
                "file truncated inside the {what}: expected {needed} bytes, found {available}"
            ),
            TraceErrorKind::Checksum {
                what,
                stored,
                computed,
            } => write!(
                f,
                "corrupt {what}: stored crc32 {stored:#010x}, computed {computed:#010x}"
            ),
            TraceErrorKind::Malformed(why) => write!(f, "malformed trace: {why}"),
        }
    }
}

impl std::error::Error for TraceError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip() {
        let mut buf = Vec::new();
        let values = [
            0u64,
            1,
            127,
            128,
            300,
            u32::MAX as u64,
            u64::MAX - 1,
            u64::MAX,
        ];
        for v in values {
            put_varint(&mut buf, v);
        }
        let mut pos = 0;
        for v in values {
            assert_eq!(get_varint(&buf, &mut pos), Some(v));
        }
        assert_eq!(pos, buf.len());
        assert_eq!(get_varint(&buf, &mut pos), None, "past the end");
        assert_eq!(get_varint(&[0xff; 11], &mut 0), None, "overlong");
        for d in [0i64, 1, -1, 1 << 40, -(1 << 40), i64::MAX, i64::MIN] {
            assert_eq!(unzigzag(zigzag(d)), d);
        }
        assert_eq!(zigzag(-1), 1);
    }
}
