//! The allocation trace: vocabulary, recorder, file format, reader and writer.
//!
//! The key decision: a trace is a stream of self-contained, checksummed
//! blocks of delta-encoded records. Blocks make a killed process's file
//! readable up to its last block and let the reader stream with memory
//! bounded by one block; deltas keep an event near 10 bytes on disk.

pub mod control_lock;
mod event;
pub mod format;
pub mod frame;
pub mod reader;
pub mod recorder;
pub mod trace_file;
pub mod writer;

/// The environment variable that starts a trace at initialization
/// (`trace_control.rs`); `{pid}`, `{rank}` and `{local_rank}` in its value
/// are replaced by the process id and torchrun's ranks (`trace_path.rs`).
pub const TRACE_ENV: &str = "GPUALLOC_TRACE";

/// What this build writes as a trace's producer: `gpualloc`, the version,
/// and the commit it was built from when known (`gpualloc 0.1.0+1efb512c4a3d`,
/// semver build metadata).
pub fn producer() -> String {
    match env!("BUILD_GIT_COMMIT") {
        "" => format!("gpualloc {}", env!("CARGO_PKG_VERSION")),
        commit => format!("gpualloc {}+{commit}", env!("CARGO_PKG_VERSION")),
    }
}

/// [`TRACE_ENV`]'s value; `None` when unset or blank (white space only),
/// which asks for no trace, here as in the C ABI and the Python package.
pub fn trace_env() -> Option<std::ffi::OsString> {
    std::env::var_os(TRACE_ENV).filter(|v| !v.to_string_lossy().trim().is_empty())
}

pub use event::{
    Action, EventKind, MemoryCap, Pool, PoolOp, STITCH_CODE, StringId, TraceEvent, pool_code,
};
pub use format::{MAX_DEVICES, TraceEnd, TraceError, TraceErrorKind, TraceHeader};
pub use reader::TraceReader;
pub use recorder::{DeviceTrace, Recorder, TraceOptions, TraceSummary, thread_id};
pub use writer::TraceWriter;

#[cfg(test)]
mod event_tests;
#[cfg(test)]
mod structure_tests;

/// A fresh temporary file path for tests in this crate.
#[cfg(test)]
pub(crate) fn control_tests_path(name: &str) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("gpualloc-{}-{n}-{name}.gtrace", std::process::id()))
}

#[cfg(test)]
mod producer_tests {
    /// The producer names the version and, built from a checkout, the
    /// commit as semver build metadata.
    #[test]
    fn the_producer_names_the_build() {
        let p = super::producer();
        let rest = p
            .strip_prefix(concat!("gpualloc ", env!("CARGO_PKG_VERSION")))
            .unwrap_or_else(|| panic!("{p}"));
        let commit = env!("BUILD_GIT_COMMIT");
        if commit.is_empty() {
            assert_eq!(rest, "");
        } else {
            assert_eq!(rest, format!("+{commit}"));
            assert!(commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit()));
        }
    }
}
