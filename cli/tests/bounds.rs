//! What the analyses keep of a trace is bounded for the whole trace, not
//! per device: a crafted trace that spreads its events over many devices
//! (up to 1024) cannot multiply the memory a command takes. The bounds are
//! tested small in `analyses::state`; here one is reached end to end.
//! So are the bounds on what is read or written of one item of an input:
//! a name, a line of an RMM log.

mod common;

use common::{gpualloc, s, write_blocks};
use gpualloc::trace::{EventKind, TraceEvent};

/// Iteration boundaries kept for a whole trace (`budget::MAX_BOUNDARIES`).
const BOUNDARIES: u64 = 1 << 22;

/// Marks on two devices, fewer than the bound on each but more together:
/// the iterations stop at the bound for the trace, and the command says
/// how many marks it left out.
#[test]
fn marks_spread_over_devices_keep_at_most_the_traces_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let per_device = BOUNDARIES / 2 + 50_000;
    let blocks = (0..per_device).step_by(4096).flat_map(|t0| {
        (0..2).map(move |d| {
            (t0..per_device.min(t0 + 4096))
                .map(|t| TraceEvent::from_kind(t, d, 0, 0, EventKind::Mark { name: 0 }))
                .collect()
        })
    });
    let t = write_blocks(dir.path(), "marks.gtrace", 2, &["step"], blocks);
    let out = gpualloc(&["leaks", s(&t), "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let kept: Vec<u64> = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["iterations"].as_u64().unwrap() - 1)
        .collect();
    assert_eq!(kept.iter().sum::<u64>(), BOUNDARIES, "{kept:?}");
    assert!(
        err.contains(&format!(
            "100000 marks and top-level phase openings past the first {BOUNDARIES} (all devices together) were not kept"
        )),
        "{err}"
    );
}

/// A trace that tells a device of a petabyte and allocates hundreds of
/// terabytes on it (damaged, or made by hand): the replay takes a device
/// of at most 4 TiB, says so, and ends at once, instead of keeping a
/// record per simulated page of 250 TiB (gigabytes and minutes).
#[test]
fn a_trace_telling_an_implausible_device_is_replayed_on_a_plausible_one() {
    use gpualloc::trace::MemoryCap;
    let dir = tempfile::tempdir().unwrap();
    let events = [
        common::ev(
            0,
            EventKind::MemoryLimit {
                cap: MemoryCap::DeviceSize,
                device_total: 1 << 50,
            },
        ),
        common::ev(1, common::alloc(1 << 40, 250 << 40)),
    ];
    let t = common::write_trace(dir.path(), "huge.gtrace", "", &events, 0, true);
    let started = std::time::Instant::now();
    let out = gpualloc(&["replay", s(&t), "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("more than any GPU has: replayed on 4398046511104 bytes (4 TiB)"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v.to_string().contains("4398046511104"), "{v}");
    // Not a timed assertion of speed: a bound far above the fix's
    // milliseconds and far below the seconds of the fault.
    assert!(started.elapsed().as_secs() < 60);
}

/// A phase and a mark named by 5,000 bytes (a hand-made or imported trace:
/// the allocator refuses names above 4,096 bytes): every export writes the
/// first 4,096 bytes and the name's length, never the whole name.
#[test]
fn exports_shorten_names_above_the_name_limit() {
    use gpualloc::trace::format::MAX_NAME_LEN;
    let dir = tempfile::tempdir().unwrap();
    let long = format!("{}TAIL", "x".repeat(4996));
    let short = format!("{}…(5000 bytes)", "x".repeat(MAX_NAME_LEN));
    let events = vec![
        common::ev(0, EventKind::PhasePush { name: 0 }),
        common::ev(1, common::alloc(1 << 20, 512)),
        common::ev(2, EventKind::Mark { name: 0 }),
        common::ev(3, EventKind::PhasePop { name: 0 }),
    ];
    let t = write_blocks(dir.path(), "long.gtrace", 1, &[&long], [events]);
    let (json, pickle) = (dir.path().join("c.json"), dir.path().join("t.pickle"));
    let prefix = dir.path().join("p");
    let args = ["export", s(&t), "--chrome", s(&json), "--torch-snapshot"];
    common::ok(&[&args[..], &[s(&pickle), "--parquet", s(&prefix)]].concat());
    let chrome: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let named = chrome["traceEvents"].as_array().unwrap().iter();
    let named: Vec<&str> = named
        .filter(|e| e["ph"] != "C")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    let lens = |names: &[&str]| names.iter().map(|n| n.len()).collect::<Vec<_>>();
    assert!(named == [short.as_str(); 3], "lengths {:?}", lens(&named));
    let table = chrome["otherData"]["strings"]["0"].as_str().unwrap();
    assert!(table == short, "{} bytes", table.len());
    let pickle = std::fs::read(&pickle).unwrap();
    let has = |b: &[u8], s: &str| b.windows(s.len()).any(|w| w == s.as_bytes());
    assert!(has(&pickle, &short) && !has(&pickle, "TAIL"));
    for table in ["events", "phases"] {
        let names = parquet_names(&dir.path().join(format!("p.{table}.parquet")));
        assert!(names.contains(&short), "{table}");
        assert!(names.iter().all(|n| n.len() <= short.len()), "{table}");
    }
}

/// The non-null values of a Parquet file's `name` column.
fn parquet_names(path: &std::path::Path) -> Vec<String> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let r = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
    let rows = r.get_row_iter(None).unwrap().map(|row| row.unwrap());
    let names = rows.flat_map(|row| {
        let name = row.get_column_iter().find(|(k, _)| k.as_str() == "name");
        match name.map(|(_, v)| v) {
            Some(Field::Str(s)) => Some(s.clone()),
            _ => None,
        }
    });
    names.collect()
}

/// An RMM log whose third line is 70,000 bytes (spaces after its last
/// field): refused with the line's number and the limit, not read whole.
#[test]
fn an_rmm_line_above_64_kib_is_refused_with_its_number() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("log.csv");
    let rows = [
        "Thread,Time,Action,Pointer,Size,Stream,Device",
        "7,10:00:00.000000,allocate,0x7f0000000000,512,0x0,0",
        "7,10:00:00.000001,free,0x7f0000000000,512,0x0,0",
    ];
    std::fs::write(&csv, format!("{}{}\n", rows.join("\n"), " ".repeat(70_000))).unwrap();
    let out = dir.path().join("log.gtrace");
    let err = common::fails(&["import", "--from", "rmm", s(&csv), "-o", s(&out)]);
    assert!(
        err.contains("log.csv: line 3: longer than 65536 bytes, the limit of a line"),
        "{err}"
    );
}

/// An RMM log on a pipe whose second line never ends (64 MiB without a
/// newline): the import stops reading at the limit of a line and says so,
/// instead of copying it all and reading it into memory.
#[test]
fn an_rmm_log_on_a_pipe_is_read_no_further_than_the_limit_of_a_line() {
    use std::io::Write;
    const TOTAL: usize = 64 << 20;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("piped.gtrace");
    let mut child = common::import_rmm_from_stdin(&out);
    let mut stdin = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        let head = b"Thread,Time,Action,Pointer,Size\n";
        stdin.write_all(head).unwrap();
        let (chunk, mut sent) = (vec![b'x'; 1 << 20], head.len());
        while sent < TOTAL {
            match stdin.write(&chunk) {
                Ok(n) => sent += n,
                Err(_) => break, // the command stopped reading
            }
        }
        sent
    });
    let done = child.wait_with_output().unwrap();
    let sent = feeder.join().unwrap();
    let err = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(1), "{err}");
    assert!(
        err.contains("/dev/stdin: line 2: longer than 65536 bytes"),
        "{err}"
    );
    assert!(sent < TOTAL, "all {sent} bytes were read");
}
