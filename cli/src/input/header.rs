//! Which field of a trace's header does not parse, what it holds and what
//! the format expects there (docs/trace-format.md, "Header"), where the
//! library's reader says only that the header's fields do not parse.

use gpualloc::trace::format::get_varint;

/// Where the body starts in the file: after the magic, version and length.
const BODY_AT: usize = 14;

/// The fields of fixed size: name, offset in the body, size, what they hold.
const FIXED: [(&str, usize, usize, &str); 3] = [
    ("start time", 0, 8, "ns since the Unix epoch"),
    ("device count", 8, 4, "the devices of the process"),
    ("process id", 12, 4, "0 when unknown"),
];

/// The first field of the header body `body` (bytes from offset 14 of the
/// file) that does not parse, as `at byte N: malformed trace header:
/// field F: found ...; expected ...`; `None` when every field parses.
pub fn explain(body: &[u8]) -> Option<String> {
    let say = |at: usize, field: &str, found: String, expected: String| {
        Some(format!(
            "at byte {}: malformed trace header: field `{field}`: found {found}; expected {expected}",
            BODY_AT + at
        ))
    };
    for (field, at, size, holds) in FIXED {
        let got = body.get(at..).unwrap_or_default();
        if got.len() < size {
            let found = match got.len() {
                0 => "the header's end".to_string(),
                n => format!("{n} bytes ({}) where the header ends", hex(got)),
            };
            let kind = if size == 8 { "u64" } else { "u32" };
            return say(
                at,
                field,
                found,
                format!("{size} (a little-endian {kind}, {holds})"),
            );
        }
    }
    let mut pos = 16;
    for (field, holds) in [
        ("configuration string", "the GPUALLOC_CONF in force"),
        ("producer", "the program that wrote the trace"),
    ] {
        let at = pos;
        let Some(len) = get_varint(body, &mut pos) else {
            let found = format!("{} as its length", bad_varint(&body[at..]));
            return say(at, field, found, "a varint (LEB128)".into());
        };
        let left = body.len() - pos;
        if len > left as u64 {
            let found = format!("a length of {len} bytes, with {left} bytes left in the header");
            return say(at, field, found, format!("a length of at most {left}"));
        }
        let text = &body[pos..pos + len as usize];
        if let Err(e) = std::str::from_utf8(text) {
            let bad = pos + e.valid_up_to();
            let found = format!(
                "bytes that are not UTF-8, {:?} ({:#04x} at byte {})",
                super::clip(&String::from_utf8_lossy(text)),
                body[bad],
                BODY_AT + bad
            );
            return say(at, field, found, format!("UTF-8 text ({holds})"));
        }
        pos += len as usize;
    }
    let at = pos;
    if at < body.len() && get_varint(body, &mut pos).is_none() {
        let found = bad_varint(&body[at..]);
        return say(at, "minor version", found, "a varint (LEB128)".into());
    }
    None
}

/// What stands where a varint does not parse: the rest of the header `b`.
fn bad_varint(b: &[u8]) -> String {
    if b.is_empty() {
        "the header's end".into()
    } else if b.len() < 10 && b.iter().all(|&x| x >= 0x80) {
        format!("{}, a varint that does not end within the header", hex(b))
    } else {
        format!("{}, a varint above 2^64", hex(b))
    }
}

/// `0x0a0b…`: at most the first 10 bytes of `b` in hex.
fn hex(b: &[u8]) -> String {
    let shown: String = b.iter().take(10).map(|x| format!("{x:02x}")).collect();
    let more = if b.len() > 10 { "…" } else { "" };
    format!("0x{shown}{more}")
}

#[cfg(test)]
mod tests {
    use super::explain;

    #[test]
    fn a_header_that_parses_is_not_explained() {
        let mut body = vec![0u8; 16];
        body.extend_from_slice(b"\x03a:1\x04test\x06");
        assert_eq!(explain(&body), None);
        body.truncate(body.len() - 1); // minor 0: no minor version
        assert_eq!(explain(&body), None);
        body[16] = 0x80 | 3; // a length that goes on to `a`, 0x61: 12,419 bytes
        let e = explain(&body).unwrap();
        assert!(e.contains("a length of 12419 bytes"), "{e}");
        let e = explain(&[0u8; 16]).unwrap();
        assert!(e.ends_with("found the header's end as its length; expected a varint (LEB128)"));
        let e = explain(&[0xff; 40]).unwrap();
        assert!(
            e.contains("0xffffffffffffffffffff…, a varint above 2^64 as its"),
            "{e}"
        );
    }
}
