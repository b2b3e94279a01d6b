//! Structural fuzzing of every command on the stable toolchain: real traces
//! (the shipped examples and a generated one) have their blocks deleted,
//! duplicated, reordered and spliced, payload bytes changed with the
//! checksums forged, lengths, counts, kinds and device numbers made huge;
//! exported CSV and snapshot files are damaged and imported. Every command
//! must exit with 0 or 1, within a time limit and a memory limit, and never
//! panic or abort.
//!
//! CI runs a few dozen cases. For hours:
//!
//! ```sh
//! GPUALLOC_FUZZ_CASES=100000 cargo test --release -p gpualloc-cli --test fuzz -- --nocapture
//! ```
//!
//! `GPUALLOC_FUZZ_SEED` picks another sequence of cases. A failing case is
//! kept in the printed directory with the command that failed.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpualloc::trace::{TraceEvent, TraceReader, TraceWriter, frame};
use gpualloc::workload::Rng;

/// Cases when `GPUALLOC_FUZZ_CASES` is unset (about 20 s in a debug build).
const CI_CASES: u64 = 40;
/// Longest a command may run on a small input.
const TIME_LIMIT: Duration = Duration::from_secs(60);
/// Virtual memory limit of each command, KiB (`ulimit -v`).
const MEMORY_LIMIT_KIB: u64 = 4 << 20;

/// A number from a mix of small, boundary and random values.
fn number(rng: &mut Rng) -> u64 {
    match rng.index(6) {
        0 => rng.next_u64() % 16,
        1 => u64::MAX - rng.next_u64() % 16,
        2 => 1 << rng.index(64),
        3 => u64::from(u32::MAX) - rng.next_u64() % 4,
        4 => 1023 + rng.next_u64() % 3,
        _ => rng.next_u64(),
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn gpualloc() -> &'static str {
    env!("CARGO_BIN_EXE_gpualloc")
}

/// Runs `gpualloc args` under the memory limit; `Err` says what went wrong.
fn run(args: &[String]) -> Result<(), String> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {MEMORY_LIMIT_KIB}; exec \"$0\" \"$@\""))
        .arg(gpualloc())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run: {e}"))?;
    let stderr = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut std::io::BufReader::new(stderr), &mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if started.elapsed() > TIME_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("still running after {TIME_LIMIT:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let err = reader.join().unwrap_or_default();
    match status.code() {
        Some(0 | 1) if !err.contains("panicked") => Ok(()),
        code => Err(format!("exit {code:?} ({status}): {err}")),
    }
}

/// The seed traces: the examples' first events written anew (format 1.1,
/// in blocks of at most 500 events), a small generated trace, and when
/// fuzzing for long the examples themselves (format 1.0, large blocks).
fn seeds(dir: &Path, long: bool) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    for name in ["gpt2-varlen.gtrace", "detector-multiscale.gtrace"] {
        let path = examples.join(name);
        let mut r = TraceReader::open(&path).expect("example trace");
        let events: Vec<TraceEvent> = r.events().take(6000).collect();
        let mut w = TraceWriter::new(Vec::new(), r.header()).unwrap();
        w.write_strings(r.strings()).unwrap();
        for chunk in events.chunk_by(|a, b| a.device == b.device) {
            for part in chunk.chunks(500) {
                w.write_events(part[0].device, part).unwrap();
            }
        }
        out.push(w.finish(None).unwrap().0);
        if long {
            out.push(std::fs::read(&path).unwrap());
        }
    }
    let g = dir.join("seed.gtrace");
    let st = Command::new(gpualloc())
        .args(["generate", "-o", g.to_str().unwrap(), "--events", "3000"])
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    out.push(std::fs::read(&g).unwrap());
    out
}

/// One structural or field mutation of `file` (a trace), using `other`
/// for splices.
fn mutate(rng: &mut Rng, file: &[u8], other: &[u8]) -> Vec<u8> {
    let Some((h, mut blocks)) = frame::split(file) else {
        return file.to_vec();
    };
    let n = blocks.len();
    let pick = |rng: &mut Rng| rng.index(n);
    match rng.index(12) {
        0 if n > 0 => {
            blocks.remove(pick(rng));
        }
        1 if n > 0 => {
            let b = blocks[pick(rng)].clone();
            blocks.insert(rng.index(n + 1), b);
        }
        2 if n > 1 => {
            let (i, j) = (pick(rng), pick(rng));
            blocks.swap(i, j);
        }
        3 => {
            // Splice: the blocks of another trace after some of these.
            let mut out = frame::join(file, &h, &blocks[..rng.index(n + 1)]);
            if let Some((_, ob)) = frame::split(other) {
                let from = rng.index(ob.len() + 1);
                for b in &ob[from..] {
                    out.extend_from_slice(&other[b.clone()]);
                }
            }
            return out;
        }
        4 => {
            let mut out = file.to_vec();
            out.truncate(rng.index(file.len() + 1));
            return out;
        }
        5 => return reheader(rng, file, &h, &blocks),
        _ if n > 0 => return reseal_one(rng, file, &h, &blocks),
        _ => {}
    }
    frame::join(file, &h, &blocks)
}

/// A header field changed (device count, configuration, producer, minor
/// version) with the checksum forged.
fn reheader(
    rng: &mut Rng,
    file: &[u8],
    h: &std::ops::Range<usize>,
    blocks: &[std::ops::Range<usize>],
) -> Vec<u8> {
    let mut head = file[h.clone()].to_vec();
    match rng.index(3) {
        0 if head.len() >= 30 => {
            let v = number(rng) as u32;
            head[22..26].copy_from_slice(&v.to_le_bytes());
        }
        1 if head.len() > 18 => {
            let at = 14 + rng.index(head.len() - 18);
            head[at] = rng.next_u64() as u8;
        }
        _ => {
            let body_end = head.len() - 4;
            let mut extra = Vec::new();
            gpualloc::trace::format::put_varint(&mut extra, number(rng));
            head.splice(body_end..body_end, extra);
        }
    }
    frame::reseal_header(&mut head);
    let mut out = head;
    for b in blocks {
        out.extend_from_slice(&file[b.clone()]);
    }
    out
}

/// One block with a field or payload byte changed and its checksum forged.
fn reseal_one(
    rng: &mut Rng,
    file: &[u8],
    h: &std::ops::Range<usize>,
    blocks: &[std::ops::Range<usize>],
) -> Vec<u8> {
    let i = rng.index(blocks.len());
    let mut block = file[blocks[i].clone()].to_vec();
    let mut reseal = true;
    match rng.index(7) {
        0 => {
            let d = number(rng) as u32;
            block[4..8].copy_from_slice(&d.to_le_bytes());
        }
        1 => block[2] = rng.index(8) as u8,
        2 => block[3] = rng.next_u64() as u8,
        3 => {
            // A huge length, left as it is (the checksum cannot be forged).
            let len = number(rng) as u32;
            block[8..12].copy_from_slice(&len.to_le_bytes());
            reseal = false;
        }
        4 => {
            // The payload's first varint (event or string count, totals).
            let mut v = Vec::new();
            gpualloc::trace::format::put_varint(&mut v, number(rng));
            let mut pos = 16;
            let _ = gpualloc::trace::format::get_varint(&block, &mut pos);
            block.splice(16..pos.min(block.len()), v);
        }
        5 => {
            // A varint somewhere in the payload replaced by a boundary value.
            if block.len() > 16 {
                let at = 16 + rng.index(block.len() - 16);
                let mut v = Vec::new();
                gpualloc::trace::format::put_varint(&mut v, number(rng));
                let end = (at + v.len()).min(block.len());
                block.splice(at..end, v);
            }
        }
        _ => {
            if block.len() > 16 {
                let at = 16 + rng.index(block.len() - 16);
                block[at] ^= 1 << rng.index(8);
            }
        }
    }
    if reseal {
        frame::reseal_block(&mut block);
    }
    let mut out = file[h.clone()].to_vec();
    for (k, b) in blocks.iter().enumerate() {
        if k == i {
            out.extend_from_slice(&block);
        } else {
            out.extend_from_slice(&file[b.clone()]);
        }
    }
    out
}

/// Every command that reads `t` (and `seed`, for diff), with outputs in `dir`.
fn commands(rng: &mut Rng, dir: &Path, t: &Path, seed: &Path) -> Vec<Vec<String>> {
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let o = |n: &str| p(&dir.join(n));
    let t = p(t);
    let mut all = vec![
        vec!["summary".into(), t.clone()],
        vec!["summary".into(), t.clone(), "--json".into()],
        vec!["report".into(), t.clone(), "-o".into(), o("r.html")],
        vec!["leaks".into(), t.clone()],
        vec!["leaks".into(), t.clone(), "--json".into()],
        vec![
            "replay".into(),
            t.clone(),
            "--capacity".into(),
            "4GiB".into(),
        ],
        vec!["export".into(), t.clone(), "--chrome".into(), o("c.json")],
        vec![
            "export".into(),
            t.clone(),
            "--torch-snapshot".into(),
            o("s.pickle"),
        ],
        vec!["export".into(), t.clone(), "--csv".into(), o("c.csv")],
        vec!["export".into(), t.clone(), "--parquet".into(), o("pq")],
        vec!["summary".into(), t.clone(), p(seed), "--json".into()],
        vec!["diff".into(), t.clone(), p(seed)],
        vec!["diff".into(), p(seed), t.clone(), "--json".into()],
    ];
    // Half the time, also use whatever prefix is readable.
    if rng.index(2) == 0 {
        for c in &mut all {
            c.push("--allow-truncated".into());
        }
    }
    all
}

/// A damaged copy of an exported CSV or snapshot, for `import`.
fn damaged(rng: &mut Rng, data: &[u8]) -> Vec<u8> {
    let mut d = data.to_vec();
    for _ in 0..1 + rng.index(4) {
        if d.is_empty() {
            break;
        }
        let at = rng.index(d.len());
        match rng.index(4) {
            0 => d.truncate(at),
            1 => d[at] = rng.next_u64() as u8,
            2 => {
                let digits = number(rng).to_string();
                d.splice(at..at, digits.into_bytes());
            }
            _ => {
                let (a, b) = (rng.index(d.len()), rng.index(d.len()));
                let (a, b) = (a.min(b), a.max(b));
                let chunk = d[a..b].to_vec();
                d.splice(at..at, chunk);
            }
        }
    }
    d
}

#[test]
fn every_command_survives_structurally_damaged_traces() {
    let cases = env_u64("GPUALLOC_FUZZ_CASES").unwrap_or(CI_CASES);
    let seed0 = env_u64("GPUALLOC_FUZZ_SEED").unwrap_or(0x5eed);
    let keep = tempfile::Builder::new()
        .prefix("gpualloc-fuzz-")
        .tempdir()
        .unwrap();
    let dir = keep.path();
    let seeds = seeds(dir, cases > CI_CASES);
    let seed_path = dir.join("seed-0.gtrace");
    std::fs::write(&seed_path, &seeds[0]).unwrap();
    // Exports of a seed, to damage for `import`.
    let csv = dir.join("seed.csv");
    let pickle = dir.join("seed.pickle");
    for (flag, out) in [("--csv", &csv), ("--torch-snapshot", &pickle)] {
        let st = Command::new(gpualloc())
            .args(["export", seed_path.to_str().unwrap(), flag])
            .arg(out)
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "{}",
            String::from_utf8_lossy(&st.stderr)
        );
    }
    let exports = [
        std::fs::read(&csv).unwrap(),
        std::fs::read(&pickle).unwrap(),
    ];
    let started = Instant::now();
    for case in 0..cases {
        let mut rng = Rng::xorshift64_star((seed0 ^ case.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1);
        let base = &seeds[rng.index(seeds.len())];
        let other = &seeds[rng.index(seeds.len())];
        let mut t = base.clone();
        for _ in 0..1 + rng.index(3) {
            t = mutate(&mut rng, &t, other);
        }
        let input = dir.join("case.gtrace");
        std::fs::write(&input, &t).unwrap();
        let imported = dir.join("case-import");
        let which = rng.index(exports.len());
        std::fs::write(&imported, damaged(&mut rng, &exports[which])).unwrap();
        let mut runs = commands(&mut rng, dir, &input, &seed_path);
        let p = |x: &Path| x.to_str().unwrap().to_string();
        runs.push(vec![
            "import".into(),
            p(&imported),
            "-o".into(),
            p(&dir.join("i.gtrace")),
        ]);
        for args in runs {
            if let Err(why) = run(&args) {
                let kept = keep.keep();
                panic!(
                    "case {case} (GPUALLOC_FUZZ_SEED={seed0}): gpualloc {} failed: {why}\ninputs kept in {}",
                    args.join(" "),
                    kept.display()
                );
            }
        }
        if cases > CI_CASES && case % 100 == 99 {
            eprintln!("{} cases in {:?}", case + 1, started.elapsed());
        }
    }
}
