//! The framing of a trace file as byte ranges, for tests and fuzzers that
//! damage files structurally: split a file into its header and blocks, put
//! blocks back in another order, and recompute the checksums so that only
//! the structure is wrong.

use std::ops::Range;

use crate::trace::format::{BLOCK_HEADER_LEN, MAGIC};

/// The byte ranges of a trace: the header (magic to header crc32), then
/// every whole block in file order. `None` when the file does not start
/// with a well-formed header; bytes after the last whole block are left out.
pub fn split(file: &[u8]) -> Option<(Range<usize>, Vec<Range<usize>>)> {
    if file.get(..8)? != MAGIC {
        return None;
    }
    let body = u32::from_le_bytes(file.get(10..14)?.try_into().ok()?) as usize;
    let header = 0..14usize.checked_add(body)?.checked_add(4)?;
    if header.end > file.len() {
        return None;
    }
    let mut blocks = Vec::new();
    let mut at = header.end;
    while let Some(head) = file.get(at..at + BLOCK_HEADER_LEN) {
        let len = u32::from_le_bytes(head[8..12].try_into().ok()?) as usize;
        let end = at + BLOCK_HEADER_LEN + len;
        if end > file.len() {
            break;
        }
        blocks.push(at..end);
        at = end;
    }
    Some((header, blocks))
}

/// Recomputes the crc32 of a whole block (header and payload) in place,
/// after its payload length field has been made to match.
pub fn reseal_block(block: &mut [u8]) {
    if block.len() < BLOCK_HEADER_LEN {
        return;
    }
    let len = (block.len() - BLOCK_HEADER_LEN) as u32;
    block[8..12].copy_from_slice(&len.to_le_bytes());
    let mut h = crc32fast::Hasher::new();
    h.update(&block[..12]);
    h.update(&block[BLOCK_HEADER_LEN..]);
    let crc = h.finalize();
    block[12..16].copy_from_slice(&crc.to_le_bytes());
}

/// Recomputes the header's length and crc32 in place, for a header range
/// (as [`split`] returns it) whose body was edited.
pub fn reseal_header(header: &mut [u8]) {
    if header.len() < 18 {
        return;
    }
    let body_len = header.len() - 18;
    header[10..14].copy_from_slice(&(body_len as u32).to_le_bytes());
    let crc = crc32fast::hash(&header[14..14 + body_len]);
    let n = header.len();
    header[n - 4..].copy_from_slice(&crc.to_le_bytes());
}

/// A trace made of `header` and the given blocks, in that order.
pub fn join(file: &[u8], header: &Range<usize>, blocks: &[Range<usize>]) -> Vec<u8> {
    let mut out = file[header.clone()].to_vec();
    for b in blocks {
        out.extend_from_slice(&file[b.clone()]);
    }
    out
}
