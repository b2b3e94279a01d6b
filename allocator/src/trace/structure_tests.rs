//! Structural damage with intact checksums: blocks deleted, duplicated or
//! reordered are rejected (format minor 1: sequence numbers; every minor:
//! the END block's totals), or read with a warning (reordered blocks of a
//! minor 0 file, by their times).

use crate::trace::format::{self, TraceHeader, kind};
use crate::trace::frame;
use crate::trace::{Action, TraceEvent, TraceReader, TraceWriter};

fn header() -> TraceHeader {
    TraceHeader {
        start_unix_ns: 1_700_000_000_000_000_000,
        device_count: 2,
        pid: 7,
        config: String::new(),
        producer: "test".into(),
    }
}

/// Six EVENTS blocks over two devices (times increasing by 10 ms per
/// block), a STRINGS and a DROPPED block, and the END block.
fn trace() -> Vec<u8> {
    let mut w = TraceWriter::new(Vec::new(), &header()).unwrap();
    w.write_strings(&["step"]).unwrap();
    for b in 0..6u64 {
        let device = (b % 2) as u32;
        let evs: Vec<TraceEvent> = (0..5)
            .map(|i| TraceEvent {
                time_ns: b * 10_000_000 + i,
                action: Action::Alloc,
                device,
                stream: 0,
                addr: (b * 5 + i) << 12,
                size: 100,
                aux: 512,
                thread: 1,
            })
            .collect();
        w.write_events(device, &evs).unwrap();
        if b == 2 {
            w.write_dropped(device, 3, b * 10_000_000).unwrap();
        }
    }
    w.finish(None).unwrap().0
}

/// What reading `bytes` gives: events, the error's text, the warnings.
fn read(bytes: &[u8]) -> (usize, Option<String>, Vec<String>) {
    let mut r = TraceReader::new(bytes).unwrap();
    let n = r.events().count();
    let err = r.take_error().map(|e| e.to_string());
    (n, err, r.warnings().to_vec())
}

/// The same trace as a minor 0 file (no minor version, no sequence
/// numbers, an END block with three totals).
fn as_minor_0(file: &[u8]) -> Vec<u8> {
    let (h, blocks) = frame::split(file).unwrap();
    let mut head = file[h.start..h.end - 5].to_vec(); // minor 1 is one byte
    head.extend_from_slice(&[0; 4]);
    frame::reseal_header(&mut head);
    let mut out = head;
    for b in blocks {
        let mut block = file[b].to_vec();
        block[3] = 0;
        if block[2] == kind::END {
            let (mut pos, mut payload) = (16, Vec::new());
            for _ in 0..3 {
                let v = format::get_varint(&block, &mut pos).unwrap();
                format::put_varint(&mut payload, v);
            }
            block.truncate(16);
            block.extend_from_slice(&payload);
        }
        frame::reseal_block(&mut block);
        out.extend_from_slice(&block);
    }
    out
}

#[test]
fn intact_traces_read_without_complaint_in_both_minors() {
    let file = trace();
    assert_eq!(read(&file), (30, None, Vec::new()));
    let old = as_minor_0(&file);
    assert_eq!(TraceReader::new(&old[..]).unwrap().minor_version(), 0);
    assert_eq!(read(&old), (30, None, Vec::new()));
}

#[test]
fn deleted_duplicated_or_reordered_blocks_are_rejected() {
    let file = trace();
    let (h, blocks) = frame::split(&file).unwrap();
    let n = blocks.len();
    assert_eq!(n, 9);
    let mut cases: Vec<(String, Vec<std::ops::Range<usize>>)> = Vec::new();
    for i in 0..n - 1 {
        let mut v = blocks.clone();
        v.remove(i);
        cases.push((format!("block {i} deleted"), v));
    }
    for i in 0..n {
        let mut v = blocks.clone();
        v.insert(i, blocks[i].clone());
        cases.push((format!("block {i} duplicated"), v));
        if i + 1 < n {
            let mut v = blocks.clone();
            v.swap(i, i + 1);
            cases.push((format!("blocks {i} and {} swapped", i + 1), v));
        }
    }
    for (what, v) in cases {
        let (_, err, _) = read(&frame::join(&file, &h, &v));
        let err = err.unwrap_or_else(|| panic!("{what}: accepted"));
        assert!(
            err.contains("sequence number") || err.contains("END block"),
            "{what}: {err}"
        );
    }
}

#[test]
fn minor_0_files_are_checked_by_the_end_totals_and_times() {
    let file = as_minor_0(&trace());
    let (h, blocks) = frame::split(&file).unwrap();
    // Blocks: 0 STRINGS, 1-3 EVENTS, 4 DROPPED, 5-7 EVENTS, 8 END.
    let mut v = blocks.clone();
    v.remove(2);
    let (_, err, _) = read(&frame::join(&file, &h, &v));
    let err = err.expect("a deleted block is noticed");
    assert!(err.contains("END block counts 30 events"), "{err}");
    assert!(err.contains("hold 25"), "{err}");
    let mut v = blocks.clone();
    v.insert(4, blocks[4].clone());
    let (_, err, _) = read(&frame::join(&file, &h, &v));
    assert!(err.unwrap().contains("3 dropped"));
    // Blocks 1 and 3 are both device 0's: swapped, its time goes back.
    let mut v = blocks.clone();
    v.swap(1, 3);
    let (n, err, warnings) = read(&frame::join(&file, &h, &v));
    assert_eq!((n, err), (30, None));
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("device 0's events go back in time from 20000004 ns to 0 ns"),
        "{warnings:?}"
    );
}

/// A block of 2-byte `free` records (each decodes to two events) past the
/// per-block limit is refused before it is decoded: the decoded buffer
/// stays within one block's bound.
#[test]
fn a_block_of_tiny_records_cannot_inflate_the_decoded_buffer() {
    let n = 3 * format::MAX_BLOCK_EVENTS;
    let mut block = Vec::new();
    block.extend_from_slice(&format::BLOCK_MAGIC);
    block.extend_from_slice(&[kind::EVENTS, 0, 0, 0, 0, 0]);
    block.extend_from_slice(&[0; 8]);
    format::put_varint(&mut block, n as u64);
    format::put_varint(&mut block, 0);
    for _ in 0..n {
        block.extend_from_slice(&[Action::Free as u8 | 0xe0, 0]);
    }
    frame::reseal_block(&mut block);
    let empty = TraceWriter::new(Vec::new(), &header())
        .unwrap()
        .finish(None)
        .unwrap()
        .0;
    let (h, _) = frame::split(&empty).unwrap();
    let mut file = empty[h].to_vec();
    file.extend_from_slice(&block);
    let mut r = TraceReader::new(&file[..]).unwrap();
    let mut out = Vec::new();
    let err = r.next_events(&mut out).unwrap_err().to_string();
    assert!(
        err.contains(&format!("event count {n} is above the limit of 65536")),
        "{err}"
    );
    assert!(
        out.capacity() <= 2 * format::MAX_BLOCK_EVENTS,
        "{}",
        out.capacity()
    );
}

/// The writer refuses, before writing, what the reader would refuse: a
/// header too long or with too many devices, a device number out of
/// range, a string no block holds. What it accepts reads back.
#[test]
fn the_writer_refuses_what_the_reader_would_refuse() {
    let refused = |r: std::io::Result<()>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{what}: {e}");
        e.to_string()
    };
    let long = TraceHeader {
        config: "x".repeat(2 << 20),
        ..header()
    };
    let e = refused(TraceWriter::new(Vec::new(), &long).map(drop), "config");
    assert!(e.contains("configuration string of 2097152 bytes"), "{e}");
    let many = TraceHeader {
        device_count: format::MAX_DEVICES + 1,
        ..header()
    };
    let e = refused(TraceWriter::new(Vec::new(), &many).map(drop), "devices");
    assert!(e.contains("device count of 1025"), "{e}");
    let mut w = TraceWriter::new(Vec::new(), &header()).unwrap();
    let e = refused(w.write_events(format::MAX_DEVICES, &[]), "device");
    assert!(e.contains("device 1024"), "{e}");
    refused(w.write_dropped(u32::MAX, 1, 0), "device");
    let many = vec![""; format::MAX_STRINGS as usize + 1];
    let e = refused(w.write_strings(&many), "strings");
    assert!(e.contains("1048577 more strings after 0"), "{e}");
    let e = refused(w.write_strings(&["x".repeat(70 << 20)]), "string");
    assert!(e.contains("string of 73400320 bytes"), "{e}");
    // Many names that fill more than a block go into several blocks.
    let names: Vec<String> = (0..20)
        .map(|i| format!("{i}{}", "x".repeat(4_000_000)))
        .collect();
    w.write_strings(&names).unwrap();
    let (bytes, _) = w.finish(None).unwrap();
    let mut r = TraceReader::new(&bytes[..]).unwrap();
    assert_eq!(r.events().count(), 0);
    assert!(r.error().is_none(), "{:?}", r.error());
    assert_eq!(r.strings().len(), 20);
}

/// A string table of more entries than a trace holds (empty strings, a
/// few bytes each) is refused before it fills memory.
#[test]
fn a_string_table_past_the_limit_is_refused() {
    let n = format::MAX_STRINGS + 1;
    let mut block = Vec::new();
    block.extend_from_slice(&format::BLOCK_MAGIC);
    block.extend_from_slice(&[kind::STRINGS, 0, 0, 0, 0, 0]);
    block.extend_from_slice(&[0; 8]);
    format::put_varint(&mut block, n);
    for id in 0..n {
        format::put_varint(&mut block, id);
        block.push(0);
    }
    frame::reseal_block(&mut block);
    let empty = TraceWriter::new(Vec::new(), &header())
        .unwrap()
        .finish(None)
        .unwrap()
        .0;
    let (h, _) = frame::split(&empty).unwrap();
    let mut file = empty[h].to_vec();
    file.extend_from_slice(&block);
    let mut r = TraceReader::new(&file[..]).unwrap();
    let err = r.next_events(&mut Vec::new()).unwrap_err().to_string();
    assert!(err.contains("1048577 more strings after 0"), "{err}");
    assert!(r.strings().is_empty());
}
