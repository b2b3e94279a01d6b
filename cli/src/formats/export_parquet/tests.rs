//! `export --parquet`: cap rows, output names, and the bounds on ranges
//! and open phases, with the peaks of nested phases.

use super::*;

#[test]
fn a_cap_row_says_which_cap_and_its_value() {
    assert_eq!(
        cap_row(MemoryCap::fraction(0.25)),
        (0, "per_process_memory_fraction:0.25".into())
    );
    assert_eq!(
        cap_row(MemoryCap::Bytes(Some(6 << 30))),
        (6 << 30, "memory_limit:6442450944".into())
    );
    assert_eq!(
        cap_row(MemoryCap::Bytes(None)),
        (0, "memory_limit:none".into())
    );
    assert_eq!(cap_row(MemoryCap::DeviceSize), (0, "device_size".into()));
    assert_eq!(cap_row(MemoryCap::Other(7, 3)), (0, "#7:3".into()));
}

/// Writes a trace of `devices` devices, each doing `each(device)`.
fn trace(dir: &Path, devices: u32, each: impl Fn(u32) -> Vec<EventKind>) -> PathBuf {
    use gpualloc::trace::{TraceHeader, TraceWriter};
    let header = TraceHeader {
        start_unix_ns: 0,
        device_count: devices,
        pid: 1,
        config: String::new(),
        producer: "test".into(),
    };
    let p = dir.join("t.gtrace");
    let mut w = TraceWriter::new(std::fs::File::create(&p).unwrap(), &header).unwrap();
    w.write_strings(&["a", "b", "c"]).unwrap();
    for d in 0..devices {
        let at = |(t, k)| TraceEvent::from_kind(t as u64, d, 0, 0, k);
        let events: Vec<TraceEvent> = each(d).into_iter().enumerate().map(at).collect();
        w.write_events(d, &events).unwrap();
    }
    w.finish(None).unwrap();
    p
}

/// Exports `t` under small bounds of `held` ranges and `open` phases;
/// returns the budget and the `kind` column of the segments and phases
/// tables.
fn export_within(t: &Path, held: usize, open: usize) -> (Budget, Vec<String>) {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let out = outputs(t.parent().unwrap(), t);
    let (held, open) = (Bound::new(held), Bound::new(open));
    let b = Budget {
        held,
        open,
        ..Budget::default()
    };
    let b = write_tables(t, &out, false, None, b).unwrap();
    let mut kinds = Vec::new();
    for f in &out[1..] {
        let r = SerializedFileReader::new(std::fs::File::open(f).unwrap()).unwrap();
        for row in r.get_row_iter(None).unwrap() {
            let row = row.unwrap();
            let (_, kind) = row.get_column_iter().find(|(k, _)| *k == "kind").unwrap();
            kinds.push(kind.to_string().trim_matches('"').to_string());
        }
    }
    (b, kinds)
}

fn count(kinds: &[String], kind: &str) -> usize {
    kinds.iter().filter(|k| *k == kind).count()
}

/// Segments, mappings and the parts an unmap leaves, spread over four
/// devices, are held up to one bound for all of them: the rest have no
/// row, and are counted.
#[test]
fn ranges_are_held_up_to_one_bound_for_all_devices() {
    let dir = tempfile::tempdir().unwrap();
    let (m, pool) = (1u64 << 20, Pool::Code(1));
    let t = trace(dir.path(), 4, |d| {
        let a = u64::from(d + 1) << 32;
        vec![
            EventKind::SegmentAlloc {
                addr: a,
                size: m,
                pool,
            },
            EventKind::SegmentMap {
                addr: a + 8 * m,
                size: 4 * m,
                pool,
            },
            // Splits the mapping in two.
            EventKind::SegmentUnmap {
                addr: a + 9 * m,
                size: m,
                pool,
            },
            EventKind::SegmentFree {
                addr: a,
                size: m,
                pool,
            },
        ]
    });
    let (b, kinds) = export_within(&t, 4, 100);
    // Device 0 keeps its two pieces of mapping, device 1 the lower
    // one (no room for the upper), devices 2 and 3 no mapping.
    assert_eq!(b.held.refused, 1 + 2, "{kinds:?}");
    assert_eq!(count(&kinds, "segment"), 4, "every segment freed");
    assert_eq!(count(&kinds, "mapped"), 2 + 2 + 1, "{kinds:?}");
}

/// Phases nested on four devices are followed up to one bound for all
/// of them; the rest have no row, and are counted.
#[test]
fn phases_are_followed_up_to_one_bound_for_all_devices() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace(dir.path(), 4, |_| {
        let push = |name| EventKind::PhasePush { name };
        vec![push(0), push(1), push(2), EventKind::PhasePop { name: 1 }]
    });
    let (b, kinds) = export_within(&t, 100, 4);
    // Devices 0 and 1 follow their three phases, and keep one open;
    // device 2 the first two, device 3 the first.
    assert_eq!(b.open.refused, 1 + 2, "{kinds:?}");
    assert_eq!(count(&kinds, "phase"), 4 * 3 - b.open.refused as usize);
    assert_eq!(count(&kinds, "step"), 4);
}

/// A phase's peak counts the phases inside it, closed before it or
/// still open at the end (events update only the innermost phase).
#[test]
fn an_outer_phase_peaks_with_the_phases_inside_it() {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let dir = tempfile::tempdir().unwrap();
    let m = 1u64 << 20;
    let alloc = |addr, size| EventKind::Alloc {
        addr,
        requested: size,
        block_size: size,
    };
    let t = trace(dir.path(), 1, |_| {
        let push = |name| EventKind::PhasePush { name };
        vec![
            push(0),
            alloc(0x1000_0000, 4 * m),
            push(1),
            alloc(0x2000_0000, 8 * m),
            EventKind::Free {
                addr: 0x2000_0000,
                requested: 8 * m,
                block_size: 8 * m,
            },
            EventKind::PhasePop { name: 1 },
            push(2),
            alloc(0x3000_0000, 16 * m),
        ]
    });
    let out = outputs(dir.path(), &t);
    write_tables(&t, &out, false, None, Budget::default()).unwrap();
    let r = SerializedFileReader::new(std::fs::File::open(&out[2]).unwrap()).unwrap();
    let mut peaks = BTreeMap::new();
    for row in r.get_row_iter(None).unwrap() {
        let row = row.unwrap();
        let col = |k: &str| {
            row.get_column_iter()
                .find(|(c, _)| *c == k)
                .unwrap()
                .1
                .to_string()
        };
        if col("kind") == "\"phase\"" {
            peaks.insert(col("name"), col("peak_allocated"));
        }
    }
    let mib = |n: u64| (n * m).to_string();
    assert_eq!(peaks["\"b\""], mib(12), "{peaks:?}");
    assert_eq!(peaks["\"c\""], mib(20), "{peaks:?}");
    assert_eq!(peaks["\"a\""], mib(20), "the open c inside it: {peaks:?}");
}

#[test]
fn outputs_follow_a_prefix_or_a_folder() {
    let dir = tempfile::tempdir().unwrap();
    let t = Path::new("/x/trace-3.gtrace");
    let [e, s, p] = outputs(dir.path(), t);
    assert_eq!(e, dir.path().join("trace-3.events.parquet"));
    assert_eq!(s, dir.path().join("trace-3.segments.parquet"));
    assert_eq!(p, dir.path().join("trace-3.phases.parquet"));
    let [e, ..] = outputs(Path::new("out/run.v2"), t);
    assert_eq!(e, Path::new("out/run.v2.events.parquet"));
}
