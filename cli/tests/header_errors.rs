//! A trace whose header fields do not parse (damaged, or written by hand
//! with a forged checksum): the error names the field, what was found in
//! it and what the format expects there.

mod common;

use common::{fails, s};
use gpualloc::trace::frame;

/// A one-event trace whose header body (the bytes after the first 14) is
/// replaced by `edit` of it, its length and checksum forged to match.
fn with_header_body(dir: &std::path::Path, edit: impl Fn(&mut Vec<u8>)) -> std::path::PathBuf {
    let events = [common::ev(0, common::alloc(1 << 20, 512))];
    let t = common::write_trace(dir, "t.gtrace", "roundup:4", &events, 0, true);
    let bytes = std::fs::read(&t).unwrap();
    let (head, _) = frame::split(&bytes).unwrap();
    let mut body = bytes[14..head.end - 4].to_vec();
    edit(&mut body);
    let mut new_head = [&bytes[..14], &body[..], &[0; 4]].concat();
    frame::reseal_header(&mut new_head);
    let out = dir.join("bad.gtrace");
    std::fs::write(&out, [&new_head[..], &bytes[head.end..]].concat()).unwrap();
    out
}

/// A change to a header's body.
type Edit = fn(&mut Vec<u8>);

#[test]
fn a_header_field_that_does_not_parse_is_named_with_what_was_found() {
    let dir = tempfile::tempdir().unwrap();
    // The body: start (8 bytes), device count (4), pid (4), then the
    // configuration `roundup:4` (a length byte, 9 bytes), the producer.
    let cases: [(&str, Edit); 4] = [
        (
            "at byte 22: malformed trace header: field `device count`: found 2 bytes (0x0100) where the header ends; expected 4 (a little-endian u32, the devices of the process)",
            |b| b.truncate(10),
        ),
        (
            "at byte 30: malformed trace header: field `configuration string`: found bytes that are not UTF-8, \"round\u{fffd}p:4\" (0xff at byte 36); expected UTF-8 text (the GPUALLOC_CONF in force)",
            |b| b[22] = 0xff,
        ),
        (
            "at byte 30: malformed trace header: field `configuration string`: found a length of 100 bytes, with 15 bytes left in the header; expected a length of at most 15",
            |b| b[16] = 100,
        ),
        (
            "at byte 45: malformed trace header: field `minor version`: found 0xff, a varint that does not end within the header; expected a varint (LEB128)",
            |b| *b.last_mut().unwrap() = 0xff,
        ),
    ];
    for (want, edit) in cases {
        let t = with_header_body(dir.path(), edit);
        let err = fails(&["summary", s(&t)]);
        assert!(err.contains(want), "{want}\nnot in: {err}");
        assert!(!err.contains("do not parse"), "{err}");
    }
}
