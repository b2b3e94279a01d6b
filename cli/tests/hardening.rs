//! The CLI on hostile input: it never destroys its input, range-checks its
//! numeric options, bounds device numbers read from files, and warns
//! whenever it uses a damaged file's readable prefix.

use std::path::{Path, PathBuf};
use std::process::Command;

use gpualloc::trace::{Action, TraceEvent, TraceHeader, TraceWriter, frame};

mod common;
use common::{gpualloc, s};

/// Runs a command that must fail cleanly; returns its stderr.
fn fails(args: &[&str]) -> String {
    let out = gpualloc(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "gpualloc {args:?} should fail: {err}"
    );
    assert!(out.status.code().is_some(), "gpualloc {args:?} was killed");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// Runs a command that must succeed; returns its stderr.
fn succeeds(args: &[&str]) -> String {
    let out = gpualloc(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "gpualloc {args:?} failed: {err}");
    err
}

fn generated(dir: &Path) -> PathBuf {
    let p = dir.join("t.gtrace");
    succeeds(&["generate", "-o", s(&p), "--events", "20000", "--seed", "5"]);
    p
}

/// A small valid trace whose events are on `device`.
fn trace_on_device(dir: &Path, device: u32) -> PathBuf {
    let header = TraceHeader {
        start_unix_ns: 1_700_000_000_000_000_000,
        device_count: 1,
        pid: 1,
        config: String::new(),
        producer: "test".into(),
    };
    let e = |action, t| TraceEvent {
        time_ns: t,
        action,
        device,
        stream: 0,
        addr: 0x7f00_0000_0000,
        size: 4096,
        aux: 4096,
        thread: 1,
    };
    let mut w = TraceWriter::new(Vec::new(), &header).unwrap();
    w.write_events(
        0,
        &[
            e(Action::SegmentAlloc, 1),
            e(Action::Alloc, 2),
            e(Action::FreeRequested, 3),
            e(Action::FreeCompleted, 3),
        ],
    )
    .unwrap();
    let (mut bytes, _) = w.finish(Some(10)).unwrap();
    // The writer refuses device numbers a reader would refuse: the events
    // block is moved to `device` with its checksum forged.
    let (_, blocks) = frame::split(&bytes).unwrap();
    let events = &mut bytes[blocks[0].clone()];
    events[4..8].copy_from_slice(&device.to_le_bytes());
    frame::reseal_block(events);
    let p = dir.join(format!("dev-{device}.gtrace"));
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn output_paths_equal_to_the_input_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path());
    let before = std::fs::read(&t).unwrap();
    let link = dir.path().join("link.gtrace");
    std::os::unix::fs::symlink(&t, &link).unwrap();
    let hard = dir.path().join("hard.gtrace");
    std::fs::hard_link(&t, &hard).unwrap();
    let dotted = dir.path().join(".").join("t.gtrace");
    for out in [&t, &link, &hard, &dotted] {
        for args in [
            vec!["report", s(&t), "-o", s(out)],
            vec!["export", s(&t), "--csv", s(out)],
            vec!["export", s(&t), "--chrome", s(out)],
            vec!["export", s(&t), "--torch-snapshot", s(out)],
            vec!["import", s(&t), "-o", s(out), "--from", "rmm"],
        ] {
            let err = fails(&args);
            assert!(
                err.contains("refusing to overwrite the input"),
                "{args:?}: {err}"
            );
        }
    }
    assert_eq!(std::fs::read(&t).unwrap(), before, "the input is intact");
    // Another output is fine.
    succeeds(&["export", s(&t), "--csv", s(&dir.path().join("t.csv"))]);
}

#[test]
fn allow_truncated_always_warns() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path());
    let bytes = std::fs::read(&t).unwrap();
    let cut = dir.path().join("cut.gtrace");
    std::fs::write(&cut, &bytes[..bytes.len() * 2 / 3]).unwrap();
    let out = |name: &str| dir.path().join(name);
    for args in [
        vec!["summary", s(&cut)],
        vec!["leaks", s(&cut)],
        vec!["report", s(&cut), "-o", s(&out("r.html"))],
        vec!["replay", s(&cut), "--capacity", "80GiB"],
        vec!["export", s(&cut), "--csv", s(&out("c.csv"))],
        vec!["export", s(&cut), "--chrome", s(&out("c.json"))],
        vec!["export", s(&cut), "--torch-snapshot", s(&out("c.pickle"))],
        vec!["diff", s(&cut), s(&t)],
    ] {
        let mut args = args.clone();
        args.push("--allow-truncated");
        let err = succeeds(&args);
        assert_eq!(
            err.matches("warning").count(),
            1,
            "{args:?} should warn once: {err}"
        );
        assert!(err.contains("cut.gtrace"), "{args:?}: {err}");
    }
}

#[test]
fn numeric_options_are_range_checked() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path());
    for (args, option) in [
        (vec!["replay", s(&t), "--capacity", "0"], "--capacity"),
        (vec!["replay", s(&t), "--capacity", "100"], "--capacity"),
        (vec!["replay", s(&t), "--capacity", "2PiB"], "--capacity"),
        (vec!["replay", s(&t), "--capacity", "1e30"], "--capacity"),
        (vec!["replay", s(&t), "--capacity", "-5G"], "--capacity"),
        (vec!["leaks", s(&t), "--limit", "0"], "--limit"),
        (
            vec![
                "generate",
                "-o",
                s(&dir.path().join("g")),
                "--events",
                "99999999999999",
            ],
            "--events",
        ),
    ] {
        let err = fails(&args);
        assert!(err.contains(option), "{args:?}: {err}");
    }
    succeeds(&["replay", s(&t), "--capacity", "1MiB"]);
}

/// A negative value is a bad value of its option, not an unknown flag:
/// clap took `-1GiB` for the flags `-1...` and suggested `-- -1`, which
/// does not work either.
#[test]
fn negative_values_are_named_as_bad_values() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path());
    let g = dir.path().join("g");
    for (args, named) in [
        (vec!["replay", s(&t), "--capacity", "-1GiB"], "-1GiB"),
        (vec!["replay", s(&t), "--capacity", "-5G"], "-5G"),
        (vec!["leaks", s(&t), "--limit", "-1"], "--limit"),
        (vec!["generate", "-o", s(&g), "--events", "-1"], "--events"),
        (vec!["generate", "-o", s(&g), "--seed", "-1"], "--seed"),
    ] {
        let err = fails(&args);
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
        let first = err.lines().next().unwrap_or("");
        assert!(first.contains(named), "{args:?}: {err}");
    }
    // An option where the size should be is still called that.
    let err = fails(&["replay", s(&t), "--capacity", "--json"]);
    assert!(err.contains("--capacity needs a size"), "{err}");
}

#[test]
fn device_numbers_from_files_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    for device in [u32::MAX, 100_000, 1024] {
        let t = trace_on_device(dir.path(), device);
        let out = |name: &str| dir.path().join(name);
        for args in [
            vec!["summary", s(&t)],
            vec!["export", s(&t), "--chrome", s(&out("c.json"))],
            vec!["export", s(&t), "--torch-snapshot", s(&out("c.pickle"))],
            vec!["export", s(&t), "--csv", s(&out("c.csv"))],
            vec!["replay", s(&t), "--capacity", "1GiB"],
        ] {
            let err = fails(&args);
            assert!(
                err.contains(&format!("device {device}")) && err.contains(s(&t)),
                "{args:?}: {err}"
            );
        }
    }
    // The largest device number allowed is handled sparsely and quickly.
    let t = trace_on_device(dir.path(), 1023);
    let started = std::time::Instant::now();
    succeeds(&["export", s(&t), "--chrome", s(&dir.path().join("c.json"))]);
    succeeds(&[
        "export",
        s(&t),
        "--torch-snapshot",
        s(&dir.path().join("c.pickle")),
    ]);
    assert!(started.elapsed().as_secs() < 20);

    let csv = dir.path().join("log.csv");
    std::fs::write(
        &csv,
        "Thread,Time,Action,Pointer,Size,Stream,Device\n1,10:00:00.000001,allocate,0x7f0000000000,4096,0x0,4294967295\n",
    )
    .unwrap();
    let err = fails(&["import", s(&csv), "-o", s(&dir.path().join("i.gtrace"))]);
    assert!(
        err.contains("4294967295") && err.contains("log.csv") && err.contains("below 1024"),
        "{err}"
    );
}

/// Messages that quote an option or a file's contents stay short.
#[test]
fn messages_quoting_input_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path());
    let long = format!("max_split_size_mb:{}", "9".repeat(100_000));
    let err = fails(&["replay", s(&t), "--capacity", "1GiB", "--config", &long]);
    assert!(
        err.contains("max_split_size_mb") && err.len() < 600,
        "{} bytes",
        err.len()
    );
    let csv = dir.path().join("log.csv");
    std::fs::write(
        &csv,
        format!(
            "Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x7f0000000000,{},0x0\n",
            "x".repeat(60_000) // under the limit of a line (64 KiB)
        ),
    )
    .unwrap();
    let err = fails(&["import", s(&csv), "-o", s(&dir.path().join("i.gtrace"))]);
    assert!(
        err.contains("Size") && err.len() < 600,
        "{} bytes",
        err.len()
    );
}

/// A trace on a pipe: a one-pass command reads it; one that reads its
/// input twice says so instead of calling the second reading an empty file.
#[test]
fn a_trace_on_a_pipe_is_read_once_or_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path());
    let bytes = std::fs::read(&t).unwrap();
    let piped = |cmd: &str| on_stdin(&[cmd, "/dev/stdin"], &bytes);
    let leaks = piped("leaks");
    assert!(
        leaks.status.success(),
        "{}",
        String::from_utf8_lossy(&leaks.stderr)
    );
    let summary = piped("summary");
    let err = String::from_utf8_lossy(&summary.stderr);
    assert!(!summary.status.success());
    assert!(err.contains("not a regular file"), "{err}");
    assert!(!err.contains("empty file"), "{err}");
}

/// A trace on a named pipe: a command that reads its input twice refuses
/// the second reading before it opens the pipe again. That opening, the
/// writer gone, used to wait for another writer for ever.
#[test]
fn a_trace_on_a_named_pipe_is_refused_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let t = generated(dir.path());
    let bytes = std::fs::read(&t).unwrap();
    let fifo = dir.path().join("fifo.gtrace");
    for args in [
        vec!["summary"],
        vec!["replay", "--capacity", "1GiB"],
        vec!["diff", s(&t)],
    ] {
        mkfifo(&fifo);
        // One writer: its opening waits for the command's first reading.
        let (path, data) = (fifo.clone(), bytes.clone());
        std::thread::spawn(move || {
            let _ = std::fs::write(path, data);
        });
        let args: Vec<&str> = args.into_iter().chain([s(&fifo)]).collect();
        let (code, err) = within_a_minute(&args);
        assert_eq!(code, Some(1), "gpualloc {args:?}: {err}");
        assert!(
            err.contains("fifo.gtrace") && err.contains("not a regular file"),
            "{err}"
        );
        std::fs::remove_file(&fifo).unwrap();
    }
}

/// `import` (format from the first bytes) of a named pipe that no program
/// writes: refused at once, as any pipe is, where it used to wait for a
/// writer before refusing.
#[test]
fn import_of_a_named_pipe_is_refused_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("log.csv");
    mkfifo(&fifo);
    let out = dir.path().join("i.gtrace");
    let (code, err) = within_a_minute(&["import", s(&fifo), "-o", s(&out)]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("log.csv") && err.contains("--from"), "{err}");
}

fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo").arg(path).status().unwrap();
    assert!(made.success(), "mkfifo {}", path.display());
}

/// Runs `gpualloc args`, killed (and the test failed) after a minute;
/// returns its exit status and stderr.
fn within_a_minute(args: &[&str]) -> (Option<i32>, String) {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpualloc"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("gpualloc {args:?} still running after a minute");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    (status.code(), err)
}

/// `import` from a pipe: `--from auto` looked at the first bytes and the
/// importer then read on from the ninth, so a good snapshot or CSV log was
/// refused as a bad one (`opcode 0x76`, `no Thread column`). It says to
/// name the format instead, and with the format named it reads the pipe.
#[test]
fn import_from_a_pipe_names_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("r.csv");
    std::fs::write(
        &csv,
        "Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x10,100,0\n",
    )
    .unwrap();
    let bytes = std::fs::read(&csv).unwrap();
    let piped = |from: &[&str], out: &Path| {
        let args: Vec<&str> = ["import", "/dev/stdin", "-o", s(out)]
            .into_iter()
            .chain(from.iter().copied())
            .collect();
        on_stdin(&args, &bytes)
    };
    let out = piped(&[], &dir.path().join("a.gtrace"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--from"), "{err}");
    assert!(!err.contains("column"), "{err}");
    let out = piped(&["--from", "rmm"], &dir.path().join("b.gtrace"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("(1 events)"), "{err}");
}

/// Outputs are whole or absent: a bad input line leaves no half-written
/// trace, two options naming one file are refused before anything is
/// written, and so is a `--parquet` folder that does not exist.
#[test]
fn outputs_are_whole_or_absent() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("r.csv");
    std::fs::write(
        &csv,
        "Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.000001,allocate,0x10,100,0\nbad line\n",
    )
    .unwrap();
    let out = dir.path().join("r.gtrace");
    let err = fails(&["import", s(&csv), "-o", s(&out)]);
    assert!(err.contains("line 3"), "{err}");
    assert!(!out.exists(), "no partial trace is left");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "nor a temporary file"
    );

    let t = generated(dir.path());
    let a = dir.path().join("a.csv");
    let err = fails(&["export", "--csv", s(&a), "--chrome", s(&a), s(&t)]);
    assert!(err.contains("both name"), "{err}");
    assert!(!a.exists());
    let missing = dir.path().join("missing/");
    let err = fails(&[
        "export",
        "--csv",
        s(&a),
        "--parquet",
        &format!("{}/", s(&missing)),
        s(&t),
    ]);
    assert!(err.contains("not a folder"), "{err}");
    assert!(!a.exists(), "nothing written before the refusal");
    succeeds(&["export", "--csv", s(&a), s(&t)]);
    assert!(std::fs::metadata(&a).unwrap().len() > 0);
}

/// A trace recorded under a configuration this version cannot parse: the
/// error says it is the recorded one, not `--config`, and how to go on.
#[test]
fn replay_names_the_recorded_configuration_when_it_does_not_parse() {
    let dir = tempfile::tempdir().unwrap();
    let t = trace_on_device(dir.path(), 0);
    let mut bytes = std::fs::read(&t).unwrap();
    let header = TraceHeader {
        start_unix_ns: 1_700_000_000_000_000_000,
        device_count: 1,
        pid: 1,
        config: "future_key:1".into(),
        producer: "test".into(),
    };
    let (new_head, _) = TraceWriter::new(Vec::new(), &header)
        .unwrap()
        .finish(Some(10))
        .unwrap();
    let (old_head, _) = frame::split(&bytes).unwrap();
    let (new_head_range, _) = frame::split(&new_head).unwrap();
    bytes.splice(old_head, new_head[new_head_range].iter().copied());
    let odd = dir.path().join("odd.gtrace");
    std::fs::write(&odd, bytes).unwrap();
    let err = fails(&["replay", "--capacity", "1GiB", s(&odd)]);
    assert!(err.contains("recorded with"), "{err}");
    assert!(!err.starts_with("gpualloc: --config"), "{err}");
    succeeds(&["replay", "--capacity", "1GiB", "--config", "", s(&odd)]);
}

/// Runs `gpualloc ARGS` with `bytes` on its standard input (a pipe).
fn on_stdin(args: &[&str], bytes: &[u8]) -> std::process::Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpualloc"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run gpualloc");
    let mut stdin = child.stdin.take().unwrap();
    let data = bytes.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&data); // a refusing command may stop reading
    });
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    out
}
