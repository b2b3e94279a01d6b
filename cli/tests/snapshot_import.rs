//! Importing a PyTorch snapshot: the memory in use before recording began
//! is rebuilt from the final `segments`, and the trace's configuration is
//! PyTorch's allocator with the recorded settings.

mod common;

use common::{GIB, MIB, alloc, ev, ok, s, write_trace};
use std::path::Path;
use std::process::Command;

/// Writes the snapshot that `body` (Python, defining `snap`) builds to
/// `dir/name.pickle`, imports it; returns the trace and import's stderr.
fn import(dir: &Path, name: &str, body: &str) -> (String, String) {
    let pickle = dir.join(format!("{name}.pickle"));
    let script = format!(
        "import pickle, sys\nM = 1 << 20\nT = 1_700_000_000_000_000\n{body}\npickle.dump(snap, open(sys.argv[1], 'wb'), protocol=4)\n"
    );
    let out = Command::new("python3")
        .arg("-c")
        .arg(&script)
        .arg(&pickle)
        .output()
        .expect("python3 is required");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let g = dir.join(format!("{name}.gtrace"));
    let (_, err) = ok(&["import", s(&pickle), "-o", s(&g)]);
    (g.to_str().unwrap().to_string(), err)
}

fn summary(g: &str) -> serde_json::Value {
    serde_json::from_str(&ok(&["summary", "--json", g]).0).unwrap()
}

/// 4 GiB of weights allocated before `_record_memory_history` (only in the
/// final `segments`), a 64 MiB block and its 80 MiB segment freed in the
/// trace without their allocations, 200 MiB of traced activity, then an
/// OOM of 2 GiB with 1 GiB free on the device.
const WEIGHTS: &str = r#"
W, B, O = 0x7f0000000000, 0x7f1000000000, 0x7f2000000000
tr = []
def ev(a, addr, size, **k):
    d = {'action': a, 'addr': addr, 'size': size, 'stream': 0, 'time_us': T + 10 * len(tr), 'frames': []}
    d.update(k); tr.append(d)
ev('free_requested', O, 64 * M); ev('free_completed', O, 64 * M)
ev('segment_free', O, 80 * M)
ev('segment_alloc', B, 200 * M)
for i in range(5):
    ev('alloc', B, 100 * M); ev('alloc', B + 100 * M, 100 * M)
    for a in (B, B + 100 * M):
        ev('free_requested', a, 100 * M); ev('free_completed', a, 100 * M)
ev('oom', 0, 2048 * M, device_free=1024 * M)
seg = lambda addr, size, blocks: {'device': 0, 'address': addr, 'total_size': size, 'stream': 0,
    'segment_type': 'large', 'segment_pool_id': (0, 0), 'is_expandable': False, 'frames': [], 'blocks': blocks}
blk = lambda addr, size, state: {'address': addr, 'size': size, 'requested_size': size, 'state': state, 'frames': []}
snap = {'segments': [seg(W, 4096 * M, [blk(W, 4096 * M, 'active_allocated')]),
                     seg(B, 200 * M, [blk(B, 200 * M, 'inactive')])],
        'device_traces': [tr], 'allocator_settings': {'PYTORCH_CUDA_ALLOC_CONF': ''}}
"#;

/// Memory allocated before recording began counts in every command.
#[test]
fn memory_in_use_before_recording_began_is_rebuilt_from_the_final_segments() {
    let dir = tempfile::tempdir().unwrap();
    let (g, err) = import(dir.path(), "weights", WEIGHTS);
    assert!(
        err.contains("written at the trace's start: 2 blocks (4.06 GiB), 4.08 GiB reserved"),
        "{err}"
    );
    assert!(!err.contains("warning"), "{err}");
    let d = &summary(&g)["devices"][0];
    // 4 GiB and 64 MiB at the start; then the 64 MiB go, 200 MiB come.
    assert_eq!(d["peak_allocated"], 4 * GIB + 200 * MIB, "{d}");
    assert_eq!(d["peak_reserved"], 4 * GIB + 200 * MIB);
    assert_eq!(d["end_allocated"], 4 * GIB);
    assert_eq!(d["end_reserved"], 4 * GIB + 200 * MIB);
    assert_eq!(d["unknown_frees"], 0);
    assert_eq!(d["oom_details"][0]["allocated"], 4 * GIB);
    // The report's cause counts the weights.
    let html = dir.path().join("w.html");
    ok(&["report", &g, "-o", s(&html)]);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("live tensors hold 4.00 GiB"), "no cause");
    assert!(!page.contains("live tensors hold 0 B"));
    // The replay allocates them too.
    let r: serde_json::Value =
        serde_json::from_str(&ok(&["replay", "--json", "--capacity", "8GiB", &g]).0).unwrap();
    assert!(r[0]["peak_allocated"].as_u64().unwrap() >= 4 * GIB, "{r}");
}

/// Expandable segments: mapped ranges undone from the final state, and
/// what the final state and the trace disagree on named in a warning.
#[test]
fn mapped_ranges_are_undone_and_disagreements_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let body = r#"
E = 0x7f3000000000
tr = [
  {'action': 'segment_map', 'addr': E + 40 * M, 'size': 20 * M, 'stream': 0, 'time_us': T},
  {'action': 'alloc', 'addr': E + 40 * M, 'size': 20 * M, 'stream': 0, 'time_us': T + 1},
  {'action': 'segment_unmap', 'addr': E + 60 * M, 'size': 20 * M, 'stream': 0, 'time_us': T + 2},
  {'action': 'alloc', 'addr': 0x1000, 'size': 3 * M, 'stream': 0, 'time_us': T + 3},
]
blocks = [{'address': E, 'size': 10 * M, 'requested_size': 10 * M, 'state': 'active_allocated'},
          {'address': E + 10 * M, 'size': 30 * M, 'requested_size': 0, 'state': 'inactive'},
          {'address': E + 40 * M, 'size': 20 * M, 'requested_size': 20 * M, 'state': 'active_allocated'}]
snap = {'segments': [{'device': 0, 'address': E, 'total_size': 60 * M, 'stream': 0, 'segment_type': 'large',
                      'is_expandable': True, 'blocks': blocks}],
        'device_traces': [tr]}
"#;
    let (g, err) = import(dir.path(), "expandable", body);
    // At the start: 40 MiB mapped below the trace's map, 20 MiB above it
    // that the trace unmaps; the 10 MiB block.
    assert!(
        err.contains("1 blocks (10.00 MiB), 60.00 MiB reserved"),
        "{err}"
    );
    assert!(
        err.contains("the trace leaves 3.00 MiB live or reserved at the end that the final `segments` do not show"),
        "{err}"
    );
    let d = &summary(&g)["devices"][0];
    assert_eq!(d["peak_reserved"], 80 * MIB);
    assert_eq!(d["end_reserved"], 60 * MIB);
    assert_eq!(d["end_allocated"], 33 * MIB);
    // A snapshot without history: its segments are the whole state, on
    // every device they name.
    let (g, _) = import(
        dir.path(),
        "still",
        "seg = lambda d: {'device': d, 'address': 1 << 40, 'total_size': 20 * M, 'stream': 0, 'blocks': [\n\
           {'address': 1 << 40, 'size': 20 * M, 'requested_size': 20 * M, 'state': 'active_allocated'}]}\n\
         snap = {'segments': [seg(0), seg(1)], 'device_traces': [[]]}",
    );
    let v = summary(&g);
    for d in 0..2 {
        assert_eq!(v["devices"][d]["device"], d, "{v}");
        assert_eq!(v["devices"][d]["end_allocated"], 20 * MIB, "{v}");
    }
    // Without `segments`, what the trace never frees cannot be known.
    let (_, err) = import(
        dir.path(),
        "bare",
        "snap = {'device_traces': [[{'action': 'alloc', 'addr': 4096, 'size': 512, 'stream': 0, 'time_us': T}]]}",
    );
    assert!(
        err.contains("no `segments` in the snapshot: memory allocated before recording began is not accounted for"),
        "{err}"
    );
}

/// The trace's configuration is PyTorch's allocator with the recorded
/// settings, and sizes are rounded under them.
#[test]
fn an_imported_snapshot_keeps_pytorchs_allocator_and_settings() {
    let dir = tempfile::tempdir().unwrap();
    let settings = |conf: &str| {
        format!(
            r#"
tr = [{{'action': 'segment_alloc', 'addr': 0x7f0000000000, 'size': 1280 * M, 'stream': 0, 'time_us': T}},
      {{'action': 'alloc', 'addr': 0x7f0000000000, 'size': 1100 * M, 'stream': 0, 'time_us': T + 1}},
      {{'action': 'oom', 'addr': 0, 'size': 8192 * M, 'stream': 0, 'time_us': T + 2, 'device_free': M}}]
snap = {{'segments': [], 'device_traces': [tr], 'allocator_settings': {{'PYTORCH_CUDA_ALLOC_CONF': '{conf}'}}}}
"#
        )
    };
    let (g, err) = import(
        dir.path(),
        "conf",
        &settings("expandable_segments:True,roundup_power2_divisions:4,future_key:1"),
    );
    assert!(
        err.contains("left out of the trace's configuration") && err.contains("`future_key:1`"),
        "{err}"
    );
    let v = summary(&g);
    assert_eq!(
        v["config"],
        "policy:pytorch,expandable_segments:true,defragment:false,stitch_min_mb:0,expandable_page_mb:20,roundup_power2_divisions:4"
    );
    // 1100 MiB in quarters of [1 GiB, 2 GiB): a 1280 MiB block.
    assert_eq!(v["devices"][0]["peak_allocated"], 1280 * MIB);
    let (g, _) = import(dir.path(), "plain", &settings(""));
    let v = summary(&g);
    assert_eq!(v["config"], "policy:pytorch");
    assert_eq!(v["devices"][0]["peak_allocated"], 1100 * MIB);
    let (text, _) = ok(&["replay", "--capacity", "8GiB", &g]);
    assert!(text.contains("policy:pytorch"), "{text}");
    // The report replays PyTorch's expandable segments once, as the
    // trace's configuration.
    let (g, _) = import(
        dir.path(),
        "expandable",
        &settings("expandable_segments:True"),
    );
    let html = dir.path().join("e.html");
    ok(&["report", &g, "-o", s(&html)]);
    let page = std::fs::read_to_string(&html).unwrap();
    let row = "<td><code>policy:pytorch,expandable_segments:true,defragment:false,stitch_min_mb:0,expandable_page_mb:20";
    assert_eq!(page.matches(row).count(), 1, "one row");
    assert!(page.contains("expandable_page_mb:20 (the trace's configuration)</code>"));
}

/// Exports trace `t` as a snapshot beside it and checks it as MemoryViz
/// reads it (`check_snapshot.py`): `Err` with the check's words, or the
/// most bytes device 0 shows in segments at once.
fn exported_and_checked(t: &Path) -> Result<u64, String> {
    let pickle = t.with_extension("pickle");
    ok(&["export", s(t), "--torch-snapshot", s(&pickle)]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/check_snapshot.py");
    let out = Command::new("python3")
        .args([script, s(&pickle)])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(format!("{text}{}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("device 0: at most "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}")))
}

/// Imports the snapshot exported beside trace `t` (`exported_and_checked`)
/// as a trace beside it, whose summary must give `before`'s peaks,
/// fragmentation and end state; returns its path.
fn imported_back(t: &Path, before: &serde_json::Value, what: &str) -> std::path::PathBuf {
    let back = t.with_extension("back.gtrace");
    ok(&["import", s(&t.with_extension("pickle")), "-o", s(&back)]);
    let after = summary(s(&back));
    for key in [
        "peak_allocated",
        "peak_reserved",
        "fragmentation_at_peak",
        "pools_at_peak_reserved",
        "end_reserved",
        "end_allocated",
    ] {
        assert_eq!(
            before["devices"][0][key], after["devices"][0][key],
            "{what}: {key}"
        );
    }
    back
}

/// A trace of the simulated allocator in which a large request is served
/// by a stitch twice (built, then taken from the cache): eight 16 MiB
/// blocks between 2 MiB ones, the large ones freed, 64 MiB asked for.
fn stitched_trace(dir: &Path) -> std::path::PathBuf {
    use gpualloc::{Allocator, Config, SimBackend};
    let path = dir.join("stitched.gtrace");
    let a = Allocator::new(
        Config::parse("expandable_handle_mb:2").unwrap(),
        1,
        Box::new(|_| Ok(SimBackend::new(1 << 30))),
    );
    a.trace_start(&path).unwrap();
    let (mut large, mut small) = (Vec::new(), Vec::new());
    for _ in 0..8 {
        large.push(a.malloc(0, 16 * MIB, 0).unwrap());
        small.push(a.malloc(0, 2 * MIB, 0).unwrap());
    }
    for p in large {
        a.free(0, p).unwrap();
    }
    for _ in 0..2 {
        let p = a.malloc(0, 64 * MIB, 0).unwrap();
        let q = a.malloc(0, 16 * MIB, 0).unwrap();
        a.free(0, q).unwrap();
        a.free(0, p).unwrap();
    }
    assert_eq!(a.stats(0).unwrap().num_stitch, 1, "one stitch, used twice");
    a.trace_stop().unwrap();
    path
}

/// Each page once (Note [Listed ranges]): while a stitch is in use the
/// snapshot shows it instead of the home pages it holds, so MemoryViz's
/// segments never add up to more than the memory reserved (before, the
/// stitch's 64 MiB were counted twice), and the import reads the listing
/// back as such: the same peaks and fragmentation.
#[test]
fn a_stitch_in_use_is_a_segment_instead_of_its_home_pages() {
    let dir = tempfile::tempdir().unwrap();
    let t = stitched_trace(dir.path());
    let before = summary(s(&t));
    let dev = &before["devices"][0];
    let peak = dev["peak_reserved"].as_u64().unwrap();
    // 8 x 16 + 8 x 2 MiB; then the stitch holds four of the 16 MiB runs
    // at home, and the 16 MiB request takes a fifth.
    assert_eq!(peak, 144 * MIB, "{dev}");
    // No stitch is in use at the peak.
    assert_eq!(dev["fragmentation_at_peak"]["stitch_tails"], 0, "{dev}");
    let most = exported_and_checked(&t).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(most, peak, "each page once");
    imported_back(&t, &before, "one stitch");
}

/// A random program on the simulated allocator, traced: sizes that stitch,
/// take cached stitches with a tail (sizes within a sixteenth) and, with
/// `empty_cache`, trim tails (a stitch in use) and tear stitches down.
fn random_stitched_trace(dir: &Path, seed: u64, empty_cache: bool) -> std::path::PathBuf {
    use gpualloc::{Allocator, Config, SimBackend};
    let path = dir.join(format!("random-{seed}-{empty_cache}.gtrace"));
    let a = Allocator::new(
        Config::parse("expandable_handle_mb:2,stitch_min_mb:4,defragment_headroom:0").unwrap(),
        1,
        Box::new(|_| Ok(SimBackend::new(512 * MIB))),
    );
    a.trace_start(&path).unwrap();
    let mut rng = gpualloc::workload::Rng::xorshift64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut below = |n| rng.below(n);
    let mut live = Vec::new();
    for _ in 0..300 {
        gpualloc::workload::stitching_step(&a, &mut below, &mut live, empty_cache).unwrap();
    }
    a.trace_stop().unwrap();
    path
}

/// Random programs that stitch: each export reads as MemoryViz reads it,
/// lists each byte once, and imports back to the same figures; without
/// `empty_cache` (which a snapshot does not record), to the same replay too
/// (a stitch built once and taken again is built once in the imported
/// trace: its life travels in `gpualloc_stitch_ranges`).
#[test]
fn random_stitching_programs_export_and_import_back_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let replay = |t: &Path| -> serde_json::Value {
        let (out, _) = ok(&["replay", s(t), "--capacity", "512MiB", "--json"]);
        serde_json::from_str(&out).unwrap()
    };
    let mut stitches = 0;
    for (seed, empty_cache) in (1..=8).flat_map(|seed| [(seed, true), (seed, false)]) {
        let t = random_stitched_trace(dir.path(), seed, empty_cache);
        let before = summary(s(&t));
        let peak = before["devices"][0]["peak_reserved"].as_u64().unwrap();
        let pickle = t.with_extension("pickle");
        let most = exported_and_checked(&t).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert!(
            most <= peak,
            "seed {seed}: {most} bytes listed, {peak} reserved"
        );
        let back = imported_back(&t, &before, &format!("seed {seed}"));
        // Each stitch built and torn down as often, in the same order.
        let lives = |t: &Path| {
            let mut r = gpualloc::trace::TraceReader::open(t).unwrap();
            let v: Vec<(bool, u64, u64)> = r
                .events()
                .filter_map(|e| match e.kind() {
                    gpualloc::trace::EventKind::SegmentMap {
                        addr,
                        size,
                        pool: gpualloc::trace::Pool::Stitch,
                    } => Some((true, addr, size)),
                    gpualloc::trace::EventKind::SegmentUnmap {
                        addr,
                        size,
                        pool: gpualloc::trace::Pool::Stitch,
                    } => Some((false, addr, size)),
                    _ => None,
                })
                .collect();
            v
        };
        assert_eq!(lives(&t), lives(&back), "seed {seed}: the stitches' lives");
        if !empty_cache {
            let (r0, r1) = (replay(&t), replay(&back));
            for key in ["departure", "peak_reserved", "peak_allocated"] {
                assert_eq!(r0[0][key], r1[0][key], "seed {seed}: replay's {key}");
            }
        }
        let pickled = std::fs::read(&pickle).unwrap();
        stitches += pickled
            .windows(b"gpualloc_listing".len())
            .filter(|w| *w == b"gpualloc_listing")
            .count();
    }
    assert!(
        stitches > 20,
        "{stitches} listing entries: the programs stitched"
    );
}

/// Traces that lost some listing records (a dropped batch, a damaged
/// file) still export consistently: a block in a stitch that was never
/// listed, or in one whose listing the export left out, gets a segment of
/// its own, and the final segments agree with the entries.
#[test]
fn a_trace_missing_listing_records_still_exports_consistently() {
    use gpualloc::trace::{EventKind as K, Pool};
    let dir = tempfile::tempdir().unwrap();
    let (home, stitch) = (0x1000_0000u64, 0x9000_0000u64);
    let home_map = K::SegmentMap {
        addr: home,
        size: 64 * MIB,
        pool: Pool::Code(1),
    };
    let stitch_map = K::SegmentMap {
        addr: stitch,
        size: 32 * MIB,
        pool: Pool::Stitch,
    };
    let unlist_home = K::SegmentUnlist {
        addr: home,
        size: 32 * MIB,
        pool: Pool::Code(1),
    };
    let free = K::FreeCompleted {
        addr: stitch,
        requested: 32 * MIB,
        block_size: 32 * MIB,
    };
    let list_stitch = |addr, size| K::SegmentList {
        addr,
        size,
        pool: Pool::Stitch,
    };
    let stitch_b = K::SegmentMap {
        addr: stitch + 32 * MIB,
        size: 16 * MIB,
        pool: Pool::Stitch,
    };
    let unmap_b = K::SegmentUnmap {
        addr: stitch + 32 * MIB,
        size: 16 * MIB,
        pool: Pool::Stitch,
    };
    let cases: [(&str, Vec<K>); 6] = [
        // Two stitches side by side, both listed; one torn down while
        // listed: only its own range leaves the list.
        (
            "adjacent",
            vec![
                home_map,
                stitch_map,
                stitch_b,
                list_stitch(stitch, 32 * MIB),
                list_stitch(stitch + 32 * MIB, 16 * MIB),
                unmap_b,
            ],
        ),
        // A stitch given back without its home runs listed again: a block
        // allocated there, at the start of the mapped range, lists them.
        (
            "held-block",
            vec![
                home_map,
                stitch_map,
                unlist_home,
                list_stitch(stitch, 32 * MIB),
                K::SegmentUnlist {
                    addr: stitch,
                    size: 32 * MIB,
                    pool: Pool::Stitch,
                },
                K::SegmentUnmap {
                    addr: stitch,
                    size: 32 * MIB,
                    pool: Pool::Stitch,
                },
                alloc(home, 8 * MIB),
            ],
        ),
        // Pages unmapped while a stitch holds them: listed first.
        (
            "held-unmap",
            vec![
                home_map,
                unlist_home,
                K::SegmentUnmap {
                    addr: home,
                    size: 64 * MIB,
                    pool: Pool::Code(1),
                },
            ],
        ),
        // The stitch's own listing lost: its block lies in nothing listed.
        (
            "stitch-unlisted",
            vec![home_map, stitch_map, unlist_home, alloc(stitch, 32 * MIB)],
        ),
        // Every listing record lost but one that the export refuses (an
        // unlist of memory never mapped): the device still lists, so its
        // cached stitch is no segment.
        (
            "refused",
            vec![
                home_map,
                stitch_map,
                K::SegmentUnlist {
                    addr: 0x5000_0000,
                    size: 2 * MIB,
                    pool: Pool::Code(1),
                },
            ],
        ),
        // The block freed, the stitch never given back.
        (
            "freed",
            vec![
                home_map,
                stitch_map,
                unlist_home,
                alloc(stitch, 32 * MIB),
                free,
            ],
        ),
    ];
    for (name, kinds) in cases {
        let events: Vec<_> = kinds.into_iter().map(|k| ev(10, k)).collect();
        let t = write_trace(dir.path(), &format!("{name}.gtrace"), "", &events, 0, true);
        if let Err(e) = exported_and_checked(&t) {
            panic!("{name}: {e}");
        }
    }
}

/// Drops the first `k` entries of device 0's `device_traces` in the
/// snapshot `pickle` (as PyTorch's `max_entries` drops the oldest), with
/// the positions of gpualloc's keys shifted to match; writes `out`.
fn trimmed(pickle: &Path, k: usize, out: &Path) {
    let script = format!(
        r#"
import pickle, sys
snap = pickle.load(open({src:?}, "rb"))
snap["device_traces"][0] = snap["device_traces"][0][{k}:]
for key in ("gpualloc_stitch_ranges", "external_annotations"):
    kept = []
    for e in snap.get(key, []):
        if "gpualloc_position" in e:
            if e["gpualloc_position"] < {k}:
                continue
            e["gpualloc_position"] -= {k}
        kept.append(e)
    if key in snap:
        snap[key] = kept
pickle.dump(snap, open({dst:?}, "wb"), protocol=4)
"#,
        src = s(pickle),
        dst = s(out),
    );
    let run = Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// A snapshot whose oldest entries were dropped imports back to the memory
/// the trace ended with: the home pages stitches held at its start are
/// mapped, held, and the stitches in use listed (Note [Listed ranges]).
#[test]
fn a_listing_snapshot_without_its_oldest_entries_imports_back_to_the_same_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut trims = 0;
    for (seed, empty_cache) in (1..=4).flat_map(|seed| [(seed, true), (seed, false)]) {
        let t = random_stitched_trace(dir.path(), seed, empty_cache);
        exported_and_checked(&t).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let pickle = t.with_extension("pickle");
        let before = summary(s(&t));
        let entries = {
            let (out, _) = ok(&["summary", s(&t), "--json"]);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            v["devices"][0]["events"].as_u64().unwrap() as usize
        };
        for k in [entries / 5, entries / 3, entries / 2] {
            let cut = dir
                .path()
                .join(format!("cut-{seed}-{empty_cache}-{k}.pickle"));
            trimmed(&pickle, k, &cut);
            let back = cut.with_extension("gtrace");
            let (_, err) = ok(&["import", s(&cut), "-o", s(&back)]);
            assert!(
                !err.contains("above reserved"),
                "seed {seed}, {k} dropped: {err}"
            );
            let after = summary(s(&back));
            for key in ["end_reserved", "end_allocated", "end_live_blocks"] {
                assert_eq!(
                    before["devices"][0][key], after["devices"][0][key],
                    "seed {seed}, {k} entries dropped: {key}"
                );
            }
            trims += 1;
        }
    }
    assert_eq!(trims, 24);
}

/// A trace that began mid-run: pages mapped before it began are unmapped
/// together with pages it saw mapped, which are mapped again later. The
/// export unmaps the part it knows (it was left out whole, and the second
/// map then fell on memory MemoryViz still had mapped).
#[test]
fn an_unmap_reaching_back_before_the_trace_unmaps_the_part_it_saw() {
    use gpualloc::trace::{EventKind as K, Pool};
    let dir = tempfile::tempdir().unwrap();
    let home = 0x1000_0000u64;
    let map = K::SegmentMap {
        addr: home + 32 * MIB,
        size: 32 * MIB,
        pool: Pool::Code(1),
    };
    let kinds = [
        map,
        alloc(home + 32 * MIB, 4 * MIB),
        K::FreeCompleted {
            addr: home + 32 * MIB,
            requested: 4 * MIB,
            block_size: 4 * MIB,
        },
        K::SegmentUnmap {
            addr: home,
            size: 64 * MIB,
            pool: Pool::Code(1),
        },
        map,
    ];
    let events: Vec<_> = kinds.into_iter().map(|k| ev(10, k)).collect();
    let t = write_trace(dir.path(), "mid-run.gtrace", "", &events, 0, true);
    let most = exported_and_checked(&t).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(most, 32 * MIB);
}
