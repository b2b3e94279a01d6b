//! The file a trace is written to, one writer per path.
//!
//! Note [One writer per trace file]
//! Rationale: `GPUALLOC_TRACE` is inherited. A worker that re-runs the
//! program's start (multiprocessing's `spawn` and `forkserver`, a
//! DataLoader under them) installs gpualloc again with the same variables
//! and would start a trace on the same path, emptying the file the parent
//! is writing: the parent's trace was lost (a test of the Python package
//! found it). Two jobs given one path collide the same way.
//! Approach: the writer holds an advisory lock on its file (`flock`, the
//! standard library's `File::try_lock`) for as long as it writes. A second
//! process that finds the path locked writes `<stem>-pid<N>.<ext>` beside
//! it and says so; the file is emptied only once its lock is held. A file
//! system without locks is written as before, unlocked. The lock belongs
//! to the open file, which a forked child inherits: while such a child
//! lives, even after its parent stopped the trace, the path stays locked
//! and a new trace there goes beside it too (nothing is lost; the message
//! says the path is locked, not that it is being written). Only a regular
//! file is locked and emptied: `/dev/null` (measuring what tracing costs)
//! and a named pipe (a compressor reading the trace as it comes) cannot be
//! emptied, and a second writer has no file to go beside.
//! The lock lasts as long as its writer: a process that started after an
//! earlier one had finished emptied its trace. Under `python -m gpualloc
//! run`, whose processes share the path (a sweep running its trials one
//! after another, a restarted rank), that lost all but the last trace, so
//! there a trace started from `GPUALLOC_TRACE` goes beside a path that
//! holds a finished trace ([`past_finished`]); `run` empties the path as
//! it starts, so its first writer takes the path itself. Elsewhere the path
//! is overwritten, as a program run again expects.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};

/// Creates (or empties) the trace file at `path`, locked for this writer;
/// `<stem>-pid<N>.<ext>` beside it when another process is writing `path`.
/// Returns the file and the path it has.
///
/// # Errors
/// The file cannot be created, or both paths are being written.
pub fn create(path: &Path) -> io::Result<(File, PathBuf)> {
    if let Some(f) = create_locked(path)? {
        return Ok((f, path.to_path_buf()));
    }
    let other = beside(path, std::process::id());
    match create_locked(&other)? {
        Some(f) => Ok((f, other)),
        None => Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!(
                "{} and {} are being written by other processes",
                path.display(),
                other.display()
            ),
        )),
    }
}

/// `path`, or `<stem>-pid<N>.<ext>` beside it when `path` holds a trace
/// that another process finished: a regular file, not empty, that no
/// process writes (Note [One writer per trace file]).
pub fn past_finished(path: &Path) -> PathBuf {
    let finished = File::open(path).is_ok_and(|f| {
        f.metadata().is_ok_and(|m| m.is_file() && m.len() > 0) && f.try_lock().is_ok()
    });
    if finished {
        beside(path, std::process::id())
    } else {
        path.to_path_buf()
    }
}

/// `path` opened for writing and emptied once this process holds its
/// lock; None while another process holds it.
fn create_locked(path: &Path) -> io::Result<Option<File>> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Ok(Some(f));
    }
    match f.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => return Ok(None),
        // No locks on this file system (some network mounts): as before.
        Err(TryLockError::Error(_)) => {}
    }
    f.set_len(0)?;
    Ok(Some(f))
}

/// `dir/stem-pid<pid>.ext` for `dir/stem.ext`.
fn beside(path: &Path, pid: u32) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_os_string())
        .unwrap_or_default();
    let mut name = stem;
    name.push(format!("-pid{pid}"));
    if let Some(ext) = path.extension() {
        name.push(".");
        name.push(ext);
    }
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_null_is_written_neither_locked_nor_emptied() {
        // ftruncate on a device is EINVAL: tracing to /dev/null failed.
        let null = Path::new("/dev/null");
        let (_a, pa) = create(null).unwrap();
        let (_b, pb) = create(null).unwrap();
        assert_eq!(
            (pa.as_path(), pb.as_path()),
            (null, null),
            "no second writer goes beside it"
        );
    }

    #[test]
    fn only_a_finished_trace_is_passed_by() {
        let path = crate::trace::control_tests_path("finished");
        let _ = std::fs::remove_file(&path);
        assert_eq!(past_finished(&path), path, "no file");
        std::fs::write(&path, b"").unwrap();
        assert_eq!(past_finished(&path), path, "an empty file");
        let (mut writing, _) = create(&path).unwrap();
        io::Write::write_all(&mut writing, b"events").unwrap();
        assert_eq!(
            past_finished(&path),
            path,
            "being written: create goes beside"
        );
        drop(writing);
        assert_eq!(past_finished(&path), beside(&path, std::process::id()));
        assert_eq!(
            past_finished(Path::new("/dev/null")),
            Path::new("/dev/null")
        );
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_path_being_written_sends_the_next_writer_beside_it() {
        let path = crate::trace::control_tests_path("one-writer");
        std::fs::write(&path, b"an old run").unwrap();
        let (mut first, p1) = create(&path).unwrap();
        assert_eq!(p1, path);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            0,
            "emptied once locked"
        );
        io::Write::write_all(&mut first, b"the parent's events").unwrap();
        let (_second, p2) = create(&path).unwrap();
        assert_eq!(p2, beside(&path, std::process::id()));
        assert_ne!(p2, path);
        assert_eq!(std::fs::read(&path).unwrap(), b"the parent's events");
        let err = create(&path).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        drop(first);
        let (third, p3) = create(&path).unwrap();
        assert_eq!(p3, path, "free again once the first writer closed it");
        drop((third, _second));
        std::fs::remove_file(&path).unwrap();
        std::fs::remove_file(&p2).unwrap();
    }

    #[test]
    fn names_beside_keep_the_extension() {
        assert_eq!(
            beside(Path::new("/t/run.gtrace"), 7),
            PathBuf::from("/t/run-pid7.gtrace")
        );
        assert_eq!(beside(Path::new("run"), 7), PathBuf::from("run-pid7"));
    }
}
