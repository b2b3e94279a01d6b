use proptest::prelude::*;

use super::*;
use crate::trace::writer::TraceWriter;

fn header() -> TraceHeader {
    TraceHeader {
        start_unix_ns: 1_700_000_000_000_000_000,
        device_count: 2,
        pid: 42,
        config: "max_split_size_mb:64".into(),
        producer: "test".into(),
    }
}

fn event_strategy() -> impl Strategy<Value = TraceEvent> {
    (
        0u8..14,
        0u32..3,
        prop_oneof![Just(0u64), Just(7), any::<u64>()],
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        0u32..4,
        0u64..10_000,
    )
        .prop_map(
            |(a, device, stream, addr, size, aux, thread, dt)| TraceEvent {
                time_ns: dt,
                action: Action::from_code(a).unwrap(),
                device,
                stream,
                addr,
                size,
                aux,
                thread,
            },
        )
}

/// Writes `batches` (each one device's block) and returns the bytes and
/// the events in file order.
fn write(batches: &[Vec<TraceEvent>]) -> (Vec<u8>, Vec<TraceEvent>) {
    let mut w = TraceWriter::new(Vec::new(), &header()).unwrap();
    w.write_strings(&["forward", "backward"]).unwrap();
    let mut all = Vec::new();
    let mut t = 0u64;
    for (k, b) in batches.iter().enumerate() {
        let device = k as u32 % 3;
        let evs: Vec<TraceEvent> = b
            .iter()
            .map(|e| {
                t += e.time_ns;
                TraceEvent {
                    time_ns: t,
                    device,
                    ..*e
                }
            })
            .collect();
        w.write_dropped(device, k as u64, t).unwrap();
        w.write_events(device, &evs).unwrap();
        all.extend(evs);
    }
    let (bytes, end) = w.finish(None).unwrap();
    assert_eq!(end.events, all.len() as u64);
    (bytes, all)
}

fn read_all(bytes: &[u8]) -> (Vec<TraceEvent>, Option<TraceError>, bool) {
    match TraceReader::new(bytes) {
        Ok(mut r) => {
            let evs: Vec<TraceEvent> = r.events().collect();
            let ended = r.end().is_some();
            (evs, r.take_error(), ended)
        }
        Err(e) => (Vec::new(), Some(e), false),
    }
}

#[test]
fn round_trip_keeps_everything() {
    let e = |action, addr, size, aux| TraceEvent {
        time_ns: 0,
        action,
        device: 0,
        stream: 0,
        addr,
        size,
        aux,
        thread: 1,
    };
    let batch = vec![
        e(Action::SegmentAlloc, 0x7f00_0000_0000, 20 << 20, 1),
        e(Action::Alloc, 0x7f00_0000_0000, 1000, 1024),
        e(Action::FreeRequested, 0x7f00_0000_0000, 1000, 1024),
        e(Action::FreeCompleted, 0x7f00_0000_0000, 1000, 1024),
        e(Action::PhasePush, 0, 0, 1),
    ];
    let (bytes, all) = write(&[batch.clone(), batch]);
    let mut r = TraceReader::new(&bytes[..]).unwrap();
    assert_eq!(r.header(), &header());
    let got: Vec<TraceEvent> = r.events().collect();
    assert_eq!(got, all);
    assert!(r.error().is_none());
    assert_eq!(r.strings(), ["forward", "backward"]);
    assert_eq!(r.string(1), Some("backward"));
    assert_eq!(r.dropped().values().sum::<u64>(), 1);
    assert_eq!(r.end().unwrap().events, 10);
    assert_eq!(r.end().unwrap().dropped, 1);
    assert_eq!(r.offset(), bytes.len() as u64);
}

/// A 100-byte allocation at 512 on device 0, at `time_ns`.
fn alloc_at(time_ns: u64) -> TraceEvent {
    TraceEvent {
        time_ns,
        action: Action::Alloc,
        device: 0,
        stream: 0,
        addr: 512,
        size: 100,
        aux: 512,
        thread: 1,
    }
}

/// A complete trace with a few bytes appended (`echo >> t.gtrace`) is
/// named as such, not as a truncated one; every event still reads.
#[test]
fn bytes_appended_after_the_end_are_named_as_such() {
    let (mut bytes, all) = write(&[vec![alloc_at(1), alloc_at(2)]]);
    bytes.extend_from_slice(b"\n\n");
    let (got, err, ended) = read_all(&bytes);
    assert_eq!(got, all);
    assert!(ended);
    let err = err.expect("an error for the stray bytes");
    assert!(!err.is_truncation(), "{err}");
    assert!(
        err.to_string()
            .contains("2 stray bytes follow the END block"),
        "{err}"
    );
}

#[test]
fn rejects_other_files_and_versions_with_the_reason() {
    let e = TraceReader::new(&b"Thread,Time,Action"[..]).err().unwrap();
    assert!(matches!(e.kind, TraceErrorKind::NotATrace { .. }), "{e}");
    assert!(e.to_string().contains("not a gpualloc trace"));
    let (mut bytes, _) = write(&[]);
    bytes[8] = 9;
    let e = TraceReader::new(&bytes[..]).err().unwrap();
    assert!(e.to_string().contains("version 9"), "{e}");
    let e = TraceReader::new(&MAGIC[..]).err().unwrap();
    assert!(e.is_truncation(), "{e}");
}

/// A device number or device count no allocator could have is an error
/// (readers size per-device tables by it), never a huge loop.
#[test]
fn huge_device_numbers_are_rejected() {
    let ev = alloc_at(5);
    // The writer refuses such numbers: the files are made by patching
    // a valid one and resealing its checksums.
    for device in [MAX_DEVICES, u32::MAX] {
        let mut w = TraceWriter::new(Vec::new(), &header()).unwrap();
        w.write_events(MAX_DEVICES - 1, &[ev]).unwrap();
        w.write_events(0, &[ev]).unwrap();
        let (mut bytes, _) = w.finish(None).unwrap();
        let (_, blocks) = crate::trace::frame::split(&bytes).unwrap();
        let second = &mut bytes[blocks[1].clone()];
        second[4..8].copy_from_slice(&device.to_le_bytes());
        crate::trace::frame::reseal_block(second);
        let (evs, err, _) = read_all(&bytes);
        assert_eq!(evs.len(), 1);
        let err = err.expect("rejected").to_string();
        assert!(err.contains(&format!("device {device}")), "{err}");
    }
    let (mut bytes, _) = TraceWriter::new(Vec::new(), &header())
        .unwrap()
        .finish(None)
        .unwrap();
    let (h, _) = crate::trace::frame::split(&bytes).unwrap();
    bytes[22..26].copy_from_slice(&u32::MAX.to_le_bytes());
    crate::trace::frame::reseal_header(&mut bytes[h]);
    let err = TraceReader::new(&bytes[..]).err().unwrap().to_string();
    assert!(err.contains("device count 4294967295"), "{err}");
}

#[test]
fn a_file_cut_between_blocks_reads_whole_without_an_end() {
    let batch: Vec<TraceEvent> = (0..10)
        .map(|i| TraceEvent {
            time_ns: 5,
            action: Action::Alloc,
            device: 0,
            stream: 0,
            addr: i * 512,
            size: 100,
            aux: 512,
            thread: 1,
        })
        .collect();
    let mut w = TraceWriter::new(Vec::new(), &header()).unwrap();
    w.write_events(0, &batch).unwrap();
    let cut = w.bytes() as usize;
    w.write_events(0, &batch).unwrap();
    let (bytes, _) = w.finish(None).unwrap();
    let (evs, err, ended) = read_all(&bytes[..cut]);
    assert_eq!(evs.len(), 10);
    assert!(err.is_none() && !ended);
    let (evs, err, _) = read_all(&bytes[..cut + 20]);
    assert_eq!(evs.len(), 10, "the partial block is not read");
    let err = err.unwrap();
    assert!(err.is_truncation() && err.offset == cut as u64, "{err}");
}

proptest! {
    #[test]
    fn any_events_round_trip(batches in prop::collection::vec(prop::collection::vec(event_strategy(), 0..50), 0..6)) {
        let (bytes, all) = write(&batches);
        let (got, err, ended) = read_all(&bytes);
        prop_assert!(err.is_none());
        prop_assert!(ended);
        prop_assert_eq!(got, all);
    }

    #[test]
    fn truncation_never_panics_and_reads_a_prefix(
        batches in prop::collection::vec(prop::collection::vec(event_strategy(), 1..30), 1..5),
        cut in any::<prop::sample::Index>(),
    ) {
        let (bytes, all) = write(&batches);
        let cut = cut.index(bytes.len());
        let (got, _, ended) = read_all(&bytes[..cut]);
        prop_assert!(!ended);
        prop_assert_eq!(&got[..], &all[..got.len()]);
    }

    #[test]
    fn corruption_never_panics_and_reads_a_prefix(
        batches in prop::collection::vec(prop::collection::vec(event_strategy(), 1..30), 1..5),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let (mut bytes, all) = write(&batches);
        let at = at.index(bytes.len());
        bytes[at] ^= flip;
        let (got, err, _) = read_all(&bytes);
        prop_assert!(got.len() <= all.len());
        prop_assert_eq!(&got[..], &all[..got.len()]);
        prop_assert!(err.is_some() || got.len() == all.len(), "a flipped byte is noticed or harmless");
    }

    #[test]
    fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let mut with_magic = MAGIC.to_vec();
        with_magic.extend_from_slice(&bytes);
        let _ = read_all(&bytes);
        let _ = read_all(&with_magic);
    }
}
