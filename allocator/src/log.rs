//! Diagnostic logging through `tracing`: the allocator's decisions as they
//! happen, for `GPUALLOC_LOG=info|debug` (the C library and the `gpualloc`
//! command install a stderr logger when it is set).
//!
//! | level | events |
//! | --- | --- |
//! | `warn` | out of memory after the retries (`oom.rs`); a freed block's event refused twice, its streams and the device synchronized instead, a stream that cannot be synchronized either passed over (`stream_events.rs`); a free called back from another allocator's call that failed when run later (`allocator.rs`) |
//! | `info` | out-of-memory retries: oversize blocks released, whole cache freed (`device.rs`); defragmentation passes (`expandable.rs`); `empty_cache` (`release.rs`); trace start and stop, allocator start (C library) |
//! | `debug` | new segments (`device.rs`), expandable segments growing and defragmentation results (`expandable.rs`), stitches made and dropped (`stitch.rs`), garbage collection (`release.rs`) |
//!
//! None sits on the cached path of `malloc`/`free`: they mark the slow
//! paths. Without a logger each is one relaxed atomic load (`tracing`'s
//! global max level) and a branch not taken; nothing is formatted.

use tracing::Level;

/// The variable naming the level.
pub const LOG_ENV: &str = "GPUALLOC_LOG";

/// A `GPUALLOC_LOG` value as a level: `off`, `error`, `warn`, `info`,
/// `debug`, `trace` (any case); unset or blank is off (None). Anything else
/// is an error naming the value and the choices.
///
/// # Errors
/// A value that is not one of these words.
pub fn parse_level(value: Option<&str>) -> Result<Option<Level>, String> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    match v.to_ascii_lowercase().as_str() {
        "off" => Ok(None),
        "error" => Ok(Some(Level::ERROR)),
        "warn" => Ok(Some(Level::WARN)),
        "info" => Ok(Some(Level::INFO)),
        "debug" => Ok(Some(Level::DEBUG)),
        "trace" => Ok(Some(Level::TRACE)),
        _ => {
            let shown: String = v.chars().take(40).collect();
            Err(format!(
                "{LOG_ENV}=`{shown}` is not a level: off, error, warn, info or debug"
            ))
        }
    }
}

/// `GPUALLOC_LOG`'s level ([`parse_level`]; a value that is not UTF-8 is an error).
///
/// # Errors
/// As [`parse_level`].
pub fn level_from_env() -> Result<Option<Level>, String> {
    match std::env::var(LOG_ENV) {
        Ok(v) => parse_level(Some(&v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(format!("{LOG_ENV} is not valid UTF-8")),
    }
}

/// Writes one line to stderr, passing over a stderr that cannot be written
/// (its reader gone: a training job piped through a `tee` that was killed,
/// under Python, which ignores SIGPIPE). `eprintln!` would panic there, and
/// the library says things from inside `Once`s and C calls: a panic would
/// fail the allocation that set it off, and a poisoned `Once` every later
/// one. The library's crates deny `clippy::print_stderr` for this.
pub fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Installs a stderr logger once, when `GPUALLOC_LOG` asks for one (the C
/// library at start, the `gpualloc` command for `replay` and `generate`). A
/// bad value is reported on stderr and logging stays off: it must not stop
/// the program. A global `tracing` subscriber set before wins.
pub fn install_from_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| match level_from_env() {
        Ok(Some(level)) => {
            let _ = tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_max_level(level)
                .with_ansi(false)
                .with_target(false)
                // Its own report of a failed write is an `eprintln!` ([`say`]).
                .log_internal_errors(false)
                .try_init();
        }
        Ok(None) => {}
        Err(e) => say(format_args!("gpualloc: {e}; logging stays off")),
    });
}

// The events, one function each, so that a decision point in the policy
// files is one line. `#[inline]`: with no logger each is the atomic load.

/// A new plain segment (`device.rs`).
#[inline]
pub(crate) fn new_segment(device: u32, bytes: u64, pool: u32, reserved: u64) {
    tracing::debug!(device, bytes, pool, reserved, "new segment");
}

/// A free called back from another allocator's call and run later
/// failed (`allocator.rs`, Note [Frees called back from a source]).
#[inline]
pub(crate) fn deferred_free_failed(ptr: u64, error: &dyn std::fmt::Display) {
    tracing::warn!(
        ptr,
        "a free deferred while another allocator was called failed: {error}"
    );
}

/// The driver refused, again, the event that guards a freed block on
/// `stream` (a stream of another device, or one destroyed since its
/// `record_stream`); the device was synchronized instead (`stream_events.rs`).
#[inline]
pub(crate) fn event_refused(device: u32, stream: u64, error: &dyn std::fmt::Display) {
    tracing::warn!(
        device,
        stream,
        "could not record an event on the stream ({error}): synchronized the device instead"
    );
}

/// Walking a capture's graph for reuse inside it failed: the blocks it
/// would have freed wait (`capture_reuse.rs`).
#[inline]
pub(crate) fn capture_walk_failed(device: u32, stream: u64, error: &dyn std::fmt::Display) {
    tracing::warn!(
        device,
        stream,
        "could not read the captured graph ({error}): freed blocks wait for the capture's end"
    );
}

/// A stream whose event was refused could not be synchronized either
/// (destroyed since its `record_stream`): passed over (`stream_events.rs`).
#[inline]
pub(crate) fn stream_gone(device: u32, stream: u64, error: &dyn std::fmt::Display) {
    tracing::warn!(
        device,
        stream,
        "could not synchronize the stream either ({error}): passed over"
    );
}

/// An out-of-memory retry step: `what` is about to be released (`device.rs`).
#[inline]
pub(crate) fn oom_retry(device: u32, bytes: u64, what: &'static str) {
    tracing::info!(device, bytes, "device full: {what}, then retrying");
}

/// `empty_cache` gave `released` bytes back (`release.rs`).
#[inline]
pub(crate) fn cache_flushed(device: u32, released: u64) {
    tracing::info!(
        device,
        released_bytes = released,
        "cache flushed (empty_cache)"
    );
}

/// A garbage-collection pass (`release.rs`).
#[inline]
pub(crate) fn garbage_collected(device: u32, reserved: i64, threshold: i64, released: u64) {
    tracing::debug!(
        device,
        reserved,
        threshold,
        released_bytes = released,
        "garbage collection"
    );
}

/// A defragmentation pass starts: `short` bytes of the request need new
/// pages, `excess` of them would exceed the headroom (`expandable.rs`).
#[inline]
pub(crate) fn defragment(device: u32, request: u64, short: u64, excess: u64) {
    tracing::info!(
        device,
        request,
        short,
        excess,
        "defragmentation: unmapping free pages elsewhere to map the request"
    );
}

/// A defragmentation pass moved `moved` bytes of pages (`expandable.rs`).
#[inline]
pub(crate) fn defragmented(device: u32, wanted: u64, moved: u64) {
    tracing::debug!(device, wanted, moved, "defragmentation pass done");
}

/// Old ranges of moved pages could not be waited for and unmapped
/// (`drain.rs`); the next request, `empty_cache` or scope tries again.
#[inline]
pub(crate) fn drains_left(device: u32, error: &dyn std::fmt::Display) {
    tracing::warn!(device, %error, "could not unmap old ranges of moved pages; tried again later");
}

/// Pooled handles a mapping could not use could not go back to the driver
/// (Note [Spare handles at the high-water mark]): they stay pooled and the
/// mapping creates memory as it would have.
#[inline]
pub(crate) fn spare_release_failed(device: u32, error: &dyn std::fmt::Display) {
    tracing::warn!(device, %error, "could not release spare pooled handles; creating anyway");
}

/// A job of the unmapping helper thread failed (`backend/unmapper.rs`):
/// its range stays mapped.
#[inline]
pub(crate) fn unmap_failed(job: &dyn std::fmt::Debug, error: &dyn std::fmt::Display) {
    tracing::warn!(?job, %error, "the unmapping thread's job failed; its range stays mapped");
}

/// An expandable segment maps `mapped` bytes, `new` of them new memory (`expandable.rs`).
#[inline]
pub(crate) fn expandable_grows(
    device: u32,
    stream: u64,
    request: u64,
    mapped: u64,
    new: u64,
    reserved: u64,
) {
    tracing::debug!(
        device,
        stream,
        request,
        mapped,
        new_memory = new,
        reserved,
        "expandable segment grows"
    );
}

/// A request served by a stitch, new or `reused` (`stitch.rs`).
#[inline]
pub(crate) fn stitched(device: u32, stream: u64, request: u64, reused: bool) {
    tracing::debug!(
        device,
        stream,
        request,
        reused,
        "stitched free pages into one range"
    );
}

/// A stitch could not be built or repaired (`stitch.rs`; out of address
/// space, say): the request moves pages or grows instead.
#[inline]
pub(crate) fn stitch_failed(device: u32, request: u64, error: &dyn std::fmt::Display) {
    tracing::warn!(device, request, %error, "could not stitch free pages; moving or growing instead");
}

/// A cached stitch torn down (`stitch.rs`).
#[inline]
pub(crate) fn stitch_dropped(device: u32, stream: u64, bytes: u64) {
    tracing::debug!(device, stream, bytes, "stitch dropped");
}

/// A cached stitch's holes filled with `handles` handles (`stitch_repair.rs`).
#[inline]
pub(crate) fn stitch_repaired(device: u32, stream: u64, bytes: u64, handles: usize) {
    tracing::debug!(device, stream, bytes, handles, "stitch repaired");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_in_any_case_and_blank_is_off() {
        assert_eq!(parse_level(None), Ok(None));
        assert_eq!(parse_level(Some("  ")), Ok(None));
        assert_eq!(parse_level(Some("off")), Ok(None));
        assert_eq!(parse_level(Some("INFO")), Ok(Some(Level::INFO)));
        assert_eq!(parse_level(Some(" debug ")), Ok(Some(Level::DEBUG)));
    }

    #[test]
    fn a_bad_level_names_the_value_and_the_choices() {
        let e = parse_level(Some("verbose")).unwrap_err();
        assert!(e.contains("GPUALLOC_LOG=`verbose`"), "{e}");
        assert!(e.contains("info or debug"), "{e}");
    }

    /// Without a logger the events are disabled: the hot-path promise.
    #[test]
    fn without_a_logger_no_level_is_enabled() {
        assert!(!tracing::enabled!(Level::ERROR));
        assert!(!tracing::event_enabled!(Level::DEBUG));
    }
}
