//! Every [`EventKind`] survives the recorder, the writer and the reader,
//! and decodes to what was recorded (Note [Typed trace events]).

use super::format::TraceHeader;
use super::{
    Action, DeviceTrace, EventKind, MemoryCap, Pool, PoolOp, STITCH_CODE, TraceEvent, TraceReader,
};
use super::{TraceWriter, pool_code};

/// One kind of every action, with operands that exercise the encoding: a
/// block size below the requested size (a negative difference), a stitch,
/// a private pool, values near 2^64.
fn every_kind() -> Vec<EventKind> {
    use EventKind as K;
    let big = u64::MAX - 5;
    vec![
        K::Alloc {
            addr: 0x7f00_0000_0000,
            requested: 1000,
            block_size: 1024,
        },
        K::FreeRequested {
            addr: 0x7f00_0000_0000,
            requested: 1000,
            block_size: 1024,
        },
        K::FreeCompleted {
            addr: 0x7f00_0000_0000,
            requested: 1000,
            block_size: 1024,
        },
        K::SegmentAlloc {
            addr: 0x7f00_0000_0000,
            size: 20 << 20,
            pool: Pool::Code(pool_code(None, true)),
        },
        K::SegmentFree {
            addr: 0x7f00_0000_0000,
            size: 2 << 20,
            pool: Pool::Code(pool_code(Some(3), false)),
        },
        K::SegmentMap {
            addr: 0x7e00_0000_0000,
            size: 64 << 20,
            pool: Pool::Stitch,
        },
        K::SegmentUnmap {
            addr: 0x7e00_0000_0000,
            size: 64 << 20,
            pool: Pool::Stitch,
        },
        K::Oom {
            requested: 31_719_424,
            device_free: 147_665_846_272,
        },
        K::EmptyCache { released: 1 << 30 },
        K::PhasePush { name: 1 },
        K::PhasePop { name: 1 },
        K::Mark { name: 0 },
        K::RecordStream {
            addr: 0x7f00_0000_0400,
            other_stream: 0x5555_0000,
        },
        K::StreamReuse {
            addr: 0x7f00_0000_0800,
            block_size: 4096,
            from_stream: 0x6666_0000,
        },
        K::SyncAllStreams { outstanding: 17 },
        K::Free {
            addr: 0x7f00_0000_0c00,
            requested: big,
            block_size: 512,
        },
        K::PagesCreate { bytes: 2 << 20 },
        K::PagesRelease { bytes: big },
        K::PrivatePool {
            op: PoolOp::Restore,
            pool: 3,
            checkpoint: 12,
        },
        K::MemoryLimit {
            cap: MemoryCap::fraction(0.35),
            device_total: 80 << 30,
        },
        K::SegmentUnlist {
            addr: 0x7f00_0040_0000,
            size: 6 << 20,
            pool: Pool::Code(pool_code(None, true)),
        },
        K::SegmentList {
            addr: 0x7e00_0000_0000,
            size: 64 << 20,
            pool: Pool::Stitch,
        },
    ]
}

/// What a reader yields for `kind`: a `free` record is its two events.
fn as_read(kind: EventKind) -> Vec<EventKind> {
    match kind {
        EventKind::Free {
            addr,
            requested,
            block_size,
        } => vec![
            EventKind::FreeRequested {
                addr,
                requested,
                block_size,
            },
            EventKind::FreeCompleted {
                addr,
                requested,
                block_size,
            },
        ],
        k => vec![k],
    }
}

#[test]
fn every_action_has_one_kind_and_back() {
    let kinds = every_kind();
    let actions: Vec<Action> = kinds.iter().map(EventKind::action).collect();
    assert_eq!(actions, Action::ALL, "one kind per action, in code order");
    for k in kinds {
        let e = TraceEvent::from_kind(7, 2, 0x1234, 3, k);
        assert_eq!(e.action, k.action());
        assert_eq!(e.kind(), k, "{e:?}");
        assert_eq!(e.with_kind(k), e);
        let (_, addr, size, aux) = k.fields();
        assert_eq!((e.addr, e.size, e.aux), (addr, size, aux));
    }
}

#[test]
fn special_values_decode_by_name() {
    let raw = |action, aux| TraceEvent {
        time_ns: 0,
        action,
        device: 0,
        stream: 0,
        addr: 0x1000,
        size: 4096,
        aux,
        thread: 0,
    };
    let map = |aux| raw(Action::SegmentMap, aux);
    assert!(matches!(
        map(STITCH_CODE).kind(),
        EventKind::SegmentMap {
            pool: Pool::Stitch,
            ..
        }
    ));
    assert!(matches!(
        map(1).kind(),
        EventKind::SegmentMap {
            pool: Pool::Code(1),
            ..
        }
    ));
    assert_eq!(Pool::Stitch.code(), STITCH_CODE);
    assert_eq!(Pool::from_code(3), Pool::Code(3));
    let oom = raw(Action::Oom, 99);
    assert_eq!(
        oom.kind(),
        EventKind::Oom {
            requested: 4096,
            device_free: 99
        }
    );
    assert_eq!(oom.name_id(), None);
    assert_eq!(oom.block_size(), None);
    let mark = TraceEvent::from_kind(0, 0, 0, 0, EventKind::Mark { name: 4 });
    assert_eq!(mark.name_id(), Some(4));
    let alloc = TraceEvent::from_kind(
        0,
        0,
        0,
        0,
        EventKind::Alloc {
            addr: 512,
            requested: 100,
            block_size: 512,
        },
    );
    assert_eq!(alloc.block_size(), Some(512));
}

/// The round trip the issue asks for: record every kind with the recorder's
/// buffer, write it with the writer, read it back, decode it.
#[test]
fn every_kind_round_trips_through_recorder_writer_and_reader() {
    let (device, stream) = (1, 0x1234);
    let mut t = DeviceTrace::in_memory(device);
    for (i, k) in every_kind().into_iter().enumerate() {
        let (action, addr, size, aux) = k.fields();
        let s = match k {
            EventKind::RecordStream { other_stream, .. } => other_stream,
            _ => stream,
        };
        t.record(i as u64 * 10, action, s, addr, size, aux);
    }
    let recorded = t.take_events();
    let want: Vec<EventKind> = every_kind().into_iter().flat_map(as_read).collect();
    let got: Vec<EventKind> = recorded.iter().map(TraceEvent::kind).collect();
    assert_eq!(got, want, "the recorder's buffer");

    let header = TraceHeader {
        start_unix_ns: 1,
        device_count: 2,
        pid: 7,
        config: String::new(),
        producer: "event_tests".into(),
    };
    let mut w = TraceWriter::new(Vec::new(), &header).unwrap();
    w.write_strings(&["step", "forward"]).unwrap();
    // The writer takes `free` records too (the recorder's buffer holds
    // them before `take_events` expands them): write both forms.
    let raw: Vec<TraceEvent> = every_kind()
        .into_iter()
        .enumerate()
        .map(|(i, k)| TraceEvent::from_kind(i as u64 * 10, device, stream, 1, k))
        .collect();
    w.write_events(device, &recorded).unwrap();
    w.write_events(device, &raw).unwrap();
    let (bytes, _) = w.finish(Some(1000)).unwrap();

    let mut r = TraceReader::new(&bytes[..]).unwrap();
    let read: Vec<TraceEvent> = r.events().collect();
    assert!(r.error().is_none(), "{:?}", r.error());
    let kinds: Vec<EventKind> = read.iter().map(TraceEvent::kind).collect();
    assert_eq!(kinds, [want.clone(), want].concat());
    assert!(read.iter().all(|e| e.device == device));
    let streams: Vec<u64> = read[..recorded.len()].iter().map(|e| e.stream).collect();
    let want_streams: Vec<u64> = recorded.iter().map(|e| e.stream).collect();
    assert_eq!(streams, want_streams);
    let names: Vec<&str> = read
        .iter()
        .filter_map(TraceEvent::name_id)
        .map(|id| r.string(id).unwrap())
        .collect();
    assert_eq!(
        names,
        ["forward", "forward", "step", "forward", "forward", "step"]
    );
}

#[test]
fn pool_calls_keep_their_codes_and_unknown_ones_decode() {
    for code in 0..11 {
        assert_eq!(PoolOp::from_code(code).code(), code);
    }
    assert_eq!(PoolOp::from_code(0).name(), "begin_allocate_to_pool");
    assert_eq!(PoolOp::from_code(4).name(), "empty_pool_cache");
    assert_eq!(
        PoolOp::from_code(7).name(),
        "create_or_incref_pool_with_allocator"
    );
    assert_eq!(PoolOp::from_code(9).name(), "set_no_split");
    assert_eq!(PoolOp::from_code(10).name(), "set_allocator_settings");
    assert_eq!(PoolOp::from_code(11), PoolOp::Other(11));
    let e = TraceEvent::from_kind(
        1,
        0,
        0,
        1,
        EventKind::PrivatePool {
            op: PoolOp::Other(77),
            pool: 2,
            checkpoint: 5,
        },
    );
    assert_eq!((e.size, e.aux, e.addr), (77, 2, 5));
}

#[test]
fn memory_caps_keep_their_values_and_unknown_ones_decode() {
    let half = MemoryCap::fraction(0.5);
    assert_eq!(half.fields(), (0, 0.5f64.to_bits()));
    assert_eq!(MemoryCap::from_fields(0, 0.5f64.to_bits()), half);
    assert_eq!(MemoryCap::Bytes(None).fields(), (1, u64::MAX));
    assert_eq!(
        MemoryCap::from_fields(1, 4096),
        MemoryCap::Bytes(Some(4096))
    );
    assert_eq!(MemoryCap::from_fields(7, 3), MemoryCap::Other(7, 3));
    let k = EventKind::MemoryLimit {
        cap: half,
        device_total: 7 << 30,
    };
    let e = TraceEvent::from_kind(1, 0, 0, 1, k);
    assert_eq!(
        (e.action.name(), e.size, e.addr),
        ("memory_limit", 0, 7 << 30)
    );
    assert_eq!(e.kind(), k);
    for cap in [MemoryCap::Bytes(Some(5 << 40)), MemoryCap::Bytes(None)] {
        let k = EventKind::MemoryLimit {
            cap,
            device_total: 0,
        };
        assert_eq!(TraceEvent::from_kind(1, 0, 0, 1, k).kind(), k);
    }
}
