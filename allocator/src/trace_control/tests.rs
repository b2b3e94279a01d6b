use std::path::PathBuf;

use super::*;
use crate::backend::SimBackend;
use crate::config::Config;
use crate::trace::{EventKind, TRACE_ENV, TraceEvent, TraceReader};

fn temp_path(name: &str) -> PathBuf {
    crate::trace::control_tests_path(name)
}

fn sim(devices: usize) -> Allocator<SimBackend> {
    Allocator::new(
        Config::parse("policy:pytorch,max_split_size_mb:40").unwrap(),
        devices,
        Box::new(|_| Ok(SimBackend::new(1 << 30).with_wall_clock())),
    )
}

/// Note [One writer per trace file]: a second writer given the path of
/// a trace being written (a spawned worker that installs gpualloc with
/// the parent's `GPUALLOC_TRACE`) writes beside it; both traces read.
#[test]
fn a_second_writer_of_one_path_leaves_the_first_trace_whole() {
    let (parent, worker) = (sim(1), sim(1));
    let path = temp_path("two-writers");
    parent.trace_start(&path).unwrap();
    let p = parent.malloc(0, 1000, 0).unwrap();
    worker.trace_start(&path).unwrap();
    let beside = worker.trace_path().unwrap();
    assert_ne!(beside, path);
    assert_eq!(parent.trace_path().unwrap(), path);
    let q = worker.malloc(0, 2000, 0).unwrap();
    worker.free(0, q).unwrap();
    worker.trace_stop().unwrap();
    parent.free(0, p).unwrap();
    parent.trace_stop().unwrap();
    let (_, evs) = read(&path);
    let allocs: Vec<u64> = evs
        .iter()
        .filter(|e| e.action == Action::Alloc)
        .map(|e| e.size)
        .collect();
    assert_eq!(allocs, [1000], "the parent's events, all of them");
    let (_, evs) = read(&beside);
    assert!(
        evs.iter()
            .any(|e| e.action == Action::Alloc && e.size == 2000)
    );
    std::fs::remove_file(&path).unwrap();
    std::fs::remove_file(&beside).unwrap();
}

/// Note [One clock for decisions and traces]: every event of one locked
/// call carries the one clock reading the call made (the reading the
/// budget would decide by); the next call reads the clock again.
#[test]
fn the_events_of_one_call_share_one_stamp() {
    let a = sim(1);
    let path = temp_path("one-stamp");
    let before = crate::clock::now_ns();
    a.trace_start(&path).unwrap();
    let after = crate::clock::now_ns();
    let p = a.malloc(0, 1000, 0).unwrap(); // segment_alloc, then alloc
    std::thread::sleep(std::time::Duration::from_millis(2));
    let stamp = {
        let mut d = a.lock(0).unwrap();
        let t = d.call_time();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(d.call_time(), t, "one reading per call");
        d.free(p).unwrap();
        t
    };
    std::thread::sleep(std::time::Duration::from_millis(2));
    a.mark("after").unwrap();
    a.trace_stop().unwrap();
    let (_, evs) = read(&path);
    let at = |action| evs.iter().find(|e| e.action == action).unwrap().time_ns;
    assert_eq!(at(Action::SegmentAlloc), at(Action::Alloc));
    let freed = at(Action::FreeRequested);
    assert_eq!(freed, at(Action::FreeCompleted));
    assert!(freed >= at(Action::Alloc) + 2_000_000, "{evs:?}");
    assert!(at(Action::Mark) >= freed + 2_000_000, "{evs:?}");
    // The stamps are the device's clock less the trace's start.
    let start = stamp - freed;
    assert!(
        (before..=after).contains(&start),
        "{before} {start} {after}"
    );
    std::fs::remove_file(&path).unwrap();
}

/// `action:name` for an event that names a phase or mark, else `action`.
fn label<R: std::io::Read>(r: &TraceReader<R>, e: &TraceEvent) -> String {
    match e.name_id() {
        Some(id) => format!("{}:{}", e.action.name(), r.string(id).unwrap()),
        None => e.action.name().to_string(),
    }
}

fn read(
    path: &Path,
) -> (
    TraceReader<std::io::BufReader<std::fs::File>>,
    Vec<TraceEvent>,
) {
    let mut r = TraceReader::open(path).unwrap();
    let evs: Vec<TraceEvent> = r.events().collect();
    assert!(r.error().is_none(), "{:?}", r.error());
    (r, evs)
}

/// A trace no device joined (every allocation bypassed the allocator,
/// as under `PYTORCH_NO_CUDA_MEMORY_CACHING=1`) still holds its marks,
/// on device 0 at the times they were made; a device that joins takes
/// them instead.
#[test]
fn marks_of_a_trace_no_device_joined_are_kept() {
    let a = sim(2);
    let path = temp_path("held-marks");
    a.trace_start(&path).unwrap();
    a.mark("caching off").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2));
    a.mark("later").unwrap();
    let summary = a.trace_stop().unwrap();
    let (r, evs) = read(&path);
    assert_eq!(summary.events, 2);
    let marks: Vec<(u32, String)> = evs
        .iter()
        .map(|e| {
            (
                e.device,
                r.string(e.name_id().expect("a mark")).unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        marks,
        [(0, "caching off".to_string()), (0, "later".to_string())]
    );
    assert!(evs[1].time_ns > evs[0].time_ns, "each at its own time");
    std::fs::remove_file(&path).unwrap();
    // With a device, nothing is added at the stop.
    a.trace_start(&path).unwrap();
    a.mark("early").unwrap();
    let p = a.malloc(1, 1000, 0).unwrap();
    a.free(1, p).unwrap();
    a.trace_stop().unwrap();
    let (_, evs) = read(&path);
    assert_eq!(evs.iter().filter(|e| e.action == Action::Mark).count(), 1);
    assert!(evs.iter().all(|e| e.device == 1));
    std::fs::remove_file(&path).unwrap();
}

/// Marks and phases made before any device joined keep their order on
/// the first device to join: a mark made before a phase opened is not
/// recorded inside it, and one made inside it is.
#[test]
fn early_marks_keep_their_place_around_open_phases() {
    let a = sim(1);
    let path = temp_path("early-mark-phase");
    a.trace_start(&path).unwrap();
    a.mark("before").unwrap();
    a.phase_push("outer").unwrap();
    a.mark("inside").unwrap();
    a.phase_push("inner").unwrap();
    a.free(0, a.malloc(0, 1000, 0).unwrap()).unwrap();
    a.phase_pop();
    a.phase_pop();
    a.trace_stop().unwrap();
    let (r, evs) = read(&path);
    let names: Vec<String> = evs
        .iter()
        .filter(|e| e.name_id().is_some())
        .map(|e| label(&r, e))
        .collect();
    assert_eq!(
        names,
        [
            "mark:before",
            "phase_push:outer",
            "mark:inside",
            "phase_push:inner",
            "phase_pop:inner",
            "phase_pop:outer",
        ]
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn records_calls_phases_and_marks_in_order() {
    let a = sim(2);
    let path = temp_path("order");
    a.phase_push("ignored: not tracing").unwrap();
    a.trace_start(&path).unwrap();
    assert!(a.is_tracing());
    assert_eq!(
        a.trace_start(&path).unwrap_err().kind(),
        io::ErrorKind::AlreadyExists
    );
    a.phase_push("forward").unwrap();
    let p = a.malloc(0, 1000, 0).unwrap();
    a.mark("step 1").unwrap();
    a.free(0, p).unwrap();
    a.phase_pop();
    a.phase_push("late").unwrap();
    let q = a.malloc(1, 3 << 20, 0).unwrap(); // device 1 joins with the open phase
    a.free(1, q).unwrap();
    a.phase_pop();
    let summary = a.trace_stop().unwrap();
    assert!(!a.is_tracing());
    assert_eq!(a.trace_stop().unwrap_err().kind(), io::ErrorKind::NotFound);
    let (r, evs) = read(&path);
    assert_eq!(r.header().config, "policy:pytorch,max_split_size_mb:40");
    assert_eq!(r.header().device_count, 2);
    assert_eq!(summary.events, evs.len() as u64);
    assert_eq!(summary.bytes, std::fs::metadata(&path).unwrap().len());
    assert_eq!(summary.dropped, 0);
    let dev0: Vec<String> = evs
        .iter()
        .filter(|e| e.device == 0)
        .map(|e| label(&r, e))
        .collect();
    assert_eq!(
        dev0,
        [
            "phase_push:forward",
            "memory_limit",
            "segment_alloc",
            "alloc",
            "mark:step 1",
            "free_requested",
            "free_completed",
            "phase_pop:forward",
            "phase_push:late",
            "phase_pop:late"
        ]
    );
    let alloc = evs.iter().find(|e| e.action == Action::Alloc).unwrap();
    assert_eq!(
        alloc.kind(),
        EventKind::Alloc {
            addr: p,
            requested: 1000,
            block_size: 1024
        }
    );
    assert_eq!(alloc.thread, crate::trace::thread_id());
    let dev1: Vec<Action> = evs
        .iter()
        .filter(|e| e.device == 1)
        .map(|e| e.action)
        .collect();
    assert_eq!(
        dev1.first(),
        Some(&Action::PhasePush),
        "a late device starts inside the open phase"
    );
    let sizes: Vec<EventKind> = evs
        .iter()
        .filter(|e| e.action == Action::MemoryLimit)
        .map(|e| e.kind())
        .collect();
    let device_size = EventKind::MemoryLimit {
        cap: crate::trace::MemoryCap::DeviceSize,
        device_total: 1 << 30,
    };
    assert_eq!(
        sizes, [device_size; 2],
        "each device tells its memory once, as it starts"
    );
    assert!(
        evs.windows(2)
            .all(|w| w[0].device != w[1].device || w[0].time_ns <= w[1].time_ns)
    );
    std::fs::remove_file(&path).unwrap();
}

/// A relative path is the file in the folder current at the start, so
/// a later change of folder does not make it another (a flush or stop
/// then reported a whole file as lost).
#[test]
fn a_relative_path_is_made_absolute_at_the_start() {
    let a = sim(1);
    let name = format!("gpualloc-{}-relative.gtrace", std::process::id());
    a.trace_start(Path::new(&name)).unwrap();
    let path = a.trace_path().unwrap();
    assert!(path.is_absolute(), "{}", path.display());
    assert_eq!(path, std::env::current_dir().unwrap().join(&name));
    a.free(0, a.malloc(0, 1000, 0).unwrap()).unwrap();
    a.trace_flush().unwrap();
    a.trace_stop().unwrap();
    std::fs::remove_file(&path).unwrap();
}

/// A trace that cannot be written names its file.
#[test]
fn errors_name_the_file() {
    let a = sim(1);
    let path = std::env::temp_dir().join("gpualloc-no-such-dir/x.gtrace");
    let e = a.trace_start(&path).unwrap_err().to_string();
    assert!(e.contains("gpualloc-no-such-dir/x.gtrace"), "{e}");
}

#[test]
fn flush_writes_everything_recorded_so_far() {
    let a = sim(1);
    let path = temp_path("flush");
    a.trace_start(&path).unwrap();
    for _ in 0..10 {
        let p = a.malloc(0, 4096, 0).unwrap();
        a.free(0, p).unwrap();
    }
    a.trace_flush().unwrap();
    let (r, evs) = read(&path);
    assert!(r.end().is_none(), "still running: no END block yet");
    assert_eq!(evs.iter().filter(|e| e.action == Action::Alloc).count(), 10);
    a.trace_stop().unwrap();
    let (r, _) = read(&path);
    assert!(r.end().is_some());
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn dropped_events_are_counted_in_the_trace_and_the_stats() {
    let a = sim(1);
    let path = temp_path("drops");
    // One-event buffers and a one-slot channel: with the writer parked on a
    // flush acknowledgement nobody reads, every later buffer is refused.
    a.trace_start_with(
        &path,
        TraceOptions {
            buffer_events: 1,
            channel_blocks: 1,
            lossless: false,
        },
    )
    .unwrap();
    let rec = a.current_recorder().unwrap();
    let (ack_tx, ack_rx) = crossbeam_channel::bounded(0);
    rec.send(crate::trace::recorder::Msg::Flush(ack_tx));
    for _ in 0..50 {
        let p = a.malloc(0, 4096, 0).unwrap();
        a.free(0, p).unwrap();
    }
    ack_rx.recv().unwrap().unwrap();
    let summary = a.trace_stop().unwrap();
    let dropped = a.stats(0).unwrap().num_trace_dropped;
    assert!(dropped > 0, "the writer could not keep up");
    assert_eq!(summary.dropped, dropped as u64);
    let (r, evs) = read(&path);
    assert_eq!(r.dropped().values().sum::<u64>(), dropped as u64);
    assert_eq!(r.end().unwrap().dropped, dropped as u64);
    assert_eq!(
        evs.len() as u64 + dropped as u64,
        50 * 3 + 2,
        "written + dropped = recorded"
    );
    std::fs::remove_file(&path).unwrap();
}

/// Run in a child process with `GPUALLOC_TRACE` set (setting variables
/// in this process would need `unsafe`): starts, records, stops.
#[test]
fn env_child() {
    let a = sim(1);
    let Some(want) = std::env::var_os(TRACE_ENV) else {
        return;
    };
    assert!(a.trace_from_env().unwrap());
    assert!(
        !a.trace_from_env().unwrap(),
        "already tracing: no second start"
    );
    let p = a.malloc(0, 512, 0).unwrap();
    a.free(0, p).unwrap();
    let s = a.trace_stop().unwrap();
    assert_eq!(
        s.events, 5,
        "the device's size, then a segment, the alloc and its free"
    );
    assert!(
        Path::new(
            &want
                .to_string_lossy()
                .replace("{pid}", &std::process::id().to_string())
        )
        .exists()
    );
}

/// `{pid}` is replaced; the rest of the path is kept, UTF-8 or not.
#[cfg(unix)]
#[test]
fn trace_paths_keep_their_bytes() {
    use std::os::unix::ffi::OsStrExt;
    let pid = std::process::id().to_string();
    let v = std::ffi::OsStr::from_bytes(b"/tmp/r\xff-{pid}.gtrace");
    let p = with_pid(v);
    let want = [&b"/tmp/r\xff-"[..], pid.as_bytes(), b".gtrace"].concat();
    assert_eq!(p.as_os_str().as_bytes(), &want[..]);
}

/// Note [Locks held at a fork]: in a forked child, a recorder slot
/// that a thread of the parent held at the fork (here: a thread that
/// holds it for good, in a process marked as forked) fails the trace
/// calls after a bounded wait, once, instead of hanging them.
#[test]
fn a_recorder_slot_held_at_a_fork_fails_trace_calls_instead_of_hanging() {
    let mut out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "trace_control::tests::recorder_held_child",
            "--ignored",
            "--nocapture",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while out.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            let _ = out.kill();
            panic!("the child hung on the recorder's slot");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = out.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("CHILD RAN"), "{text}");
}

/// Run in a child process by the test above (it marks its process as
/// a forked child, which every later test there would see).
#[test]
#[ignore = "run in a child process by a_recorder_slot_held_at_a_fork_fails_trace_calls_instead_of_hanging"]
fn recorder_held_child() {
    let a = Arc::new(sim(1));
    let path = temp_path("held-at-fork");
    a.trace_start(&path).unwrap();
    crate::allocator::note_forked_child();
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let holder = a.clone();
    std::thread::spawn(move || {
        let _slot = holder.recorder.lock();
        held_tx.send(()).unwrap();
        std::thread::park(); // for good, as a thread the child lacks
    });
    held_rx.recv().unwrap();
    let start = std::time::Instant::now();
    assert!(!a.is_tracing(), "the slot could not be read");
    assert!(start.elapsed() >= LOCK_WAIT_AFTER_FORK);
    let again = std::time::Instant::now();
    let e = a.trace_stop().unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    assert!(e.to_string().contains("forked"), "{e}");
    assert!(a.trace_start(&path).is_err());
    assert!(
        again.elapsed() < LOCK_WAIT_AFTER_FORK,
        "later calls fail at once"
    );
    let _ = std::fs::remove_file(&path);
    println!("CHILD RAN");
}

#[test]
fn starts_from_the_environment() {
    assert!(!sim(1).trace_from_env().unwrap() || std::env::var_os(TRACE_ENV).is_some());
    let dir = temp_path("env");
    std::fs::create_dir_all(&dir).unwrap();
    let pattern = dir.join("run-{pid}.gtrace");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "trace_control::tests::env_child", "--nocapture"])
        .env(TRACE_ENV, &pattern)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{{pid}} was replaced: {files:?}");
    let (_, evs) = read(&files[0]);
    assert_eq!(evs.len(), 5);
    std::fs::remove_dir_all(&dir).unwrap();
}
