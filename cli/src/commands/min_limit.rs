//! The smallest memory limit under which a trace replays without an OOM
//! (`replay --min-limit`): the question a user near an out-of-memory error
//! asks of each configuration, "how much memory does my run need under
//! it?", which the peaks of an unlimited replay do not answer.
//!
//! Key decision: bisect on real replays rather than derive the answer
//! from the unlimited replay's peak reserved. Under a limit the allocator
//! chooses otherwise (it moves pages, flushes its cache and retries
//! instead of growing), so a configuration that reserves more when memory
//! is plentiful may need less when it is not: replayed, `examples/
//! yolo-style-oom.gtrace` reserves 1.039x its live peak with the headroom
//! held at 0.5% (`defragment_pressure:1`) and 1.048x with
//! `defragment_headroom:0.05`, yet needs a limit of 1.039x the live peak
//! under the first and 1.012x under the second (the fifty-first study of
//! `docs/policy-experiments.md`, which led to `defragment_pressure`).
//!
//! The search runs between the live peak (no limit below it can serve
//! the run) and the uncapped replay's peak reserved (usually the first
//! limit that passes; when a limit that close changes the run's choices,
//! as the headroom under pressure does, the search widens upward), in
//! whole 2 MiB pages, about a dozen replays a configuration. OOMs need not
//! be monotone in the limit (another limit, other moves), so the answer
//! is a limit that was replayed without an OOM while one page less
//! failed, not a proof that every larger limit passes. The limit applies
//! to each device of the trace alike, as `memory_limit` does. Byte caps
//! the program set while it ran (`memory_limit` records) are left out of
//! the search's replays, since each would replace the limit searched; a
//! fraction it set still applies where it is lower.

use std::path::Path;

use gpualloc::Config;
use gpualloc::replay::replay;
use gpualloc::trace::{EventKind, MemoryCap};

use crate::input::{self, CliError};

/// Granularity of the search: one page of expandable segments.
const STEP: u64 = 2 << 20;

/// The keys that cap reserved memory, which the search replaces.
const CAP_KEYS: [&str; 2] = ["memory_limit", "per_process_memory_fraction"];

/// What the search found for one configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MinLimit {
    /// The smallest limit found without an OOM, in bytes per device, and
    /// the largest live peak of a device in the uncapped replay.
    Bytes { limit: u64, live: u64 },
    /// The replay fails even without a limit (the simulated device is too
    /// small, or the trace fails a request no limit can serve).
    FailsUnlimited,
    /// The replay passes uncapped, but fails under every whole-page limit
    /// up to the device.
    NoneBelowTheDevice,
}

/// The entries of `config` that are caps on reserved memory (`caps`
/// true) or all the others, joined again; keys are compared as the
/// parser reads them, spaces around them ignored.
pub(crate) fn cap_entries(config: &str, caps: bool) -> String {
    config
        .split(',')
        .map(str::trim)
        .filter(|kv| {
            let key = kv.split_once(':').map_or(*kv, |(k, _)| k).trim();
            !kv.is_empty() && CAP_KEYS.contains(&key) == caps
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `config` without its caps on reserved memory.
fn uncapped(config: &str) -> String {
    cap_entries(config, false)
}

/// Replays the events of `path` under `config` with every device capped at
/// `limit` bytes (none: uncapped): `(OOMs, the largest peak allocated and
/// the largest peak reserved of any device)`.
fn trial(
    path: &Path,
    capacity: u64,
    config: &str,
    limit: Option<u64>,
) -> Result<(u64, u64, u64), CliError> {
    let text = match limit {
        Some(l) if config.is_empty() => format!("memory_limit:{l}"),
        Some(l) => format!("{config},memory_limit:{l}"),
        None => config.to_string(),
    };
    let parsed = Config::parse(&text).map_err(|e| CliError(format!("--config: {e}")))?;
    let mut reader = input::open(path)?;
    let own_caps = |e: &gpualloc::trace::TraceEvent| {
        limit.is_some()
            && matches!(
                e.kind(),
                EventKind::MemoryLimit {
                    cap: MemoryCap::Bytes(_),
                    ..
                }
            )
    };
    let r = replay(reader.events().filter(|e| !own_caps(e)), capacity, &parsed);
    let most =
        |f: fn(&gpualloc::replay::DeviceReplay) -> u64| r.devices.iter().map(f).max().unwrap_or(0);
    Ok((
        r.ooms,
        most(|d| d.peak_allocated),
        most(|d| d.peak_reserved),
    ))
}

/// The smallest memory limit, in whole pages, under which `path` replays
/// under `config` on devices of `capacity` without an OOM.
pub fn search(path: &Path, capacity: u64, config: &str) -> Result<MinLimit, CliError> {
    let base = uncapped(config);
    let (ooms, allocated, reserved) = trial(path, capacity, &base, None)?;
    if ooms > 0 {
        return Ok(MinLimit::FailsUnlimited);
    }
    if allocated == 0 {
        // Nothing allocated: no limit is needed (and 0 is no limit).
        return Ok(MinLimit::Bytes { limit: 0, live: 0 });
    }
    // In pages: `fail` pages are known to fail (a limit under the live
    // peak cannot serve it), `pass` pages to pass.
    let pages = |bytes: u64| bytes.div_ceil(STEP);
    let top = pages(capacity);
    // A limit of whole pages, or the device where it ends mid-page.
    let bytes = |pages: u64| (pages * STEP).min(capacity);
    let mut fail = pages(allocated).saturating_sub(1);
    let mut pass = pages(reserved).min(top);
    if trial(path, capacity, &base, Some(bytes(pass)))?.0 > 0 {
        // Not monotone: a limit at the unlimited peak changed the run.
        // Widen by doubling steps, up to the device.
        let mut step = 1;
        loop {
            if pass >= top {
                return Ok(MinLimit::NoneBelowTheDevice);
            }
            fail = pass;
            pass = (pass + step).min(top);
            if trial(path, capacity, &base, Some(bytes(pass)))?.0 == 0 {
                break;
            }
            step *= 2;
        }
    }
    while pass - fail > 1 {
        let mid = fail + (pass - fail) / 2;
        if trial(path, capacity, &base, Some(bytes(mid)))?.0 > 0 {
            fail = mid;
        } else {
            pass = mid;
        }
    }
    Ok(MinLimit::Bytes {
        limit: bytes(pass),
        live: allocated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_caps_are_taken_out_and_the_rest_kept() {
        assert_eq!(
            uncapped("memory_limit:1700MiB, defragment_headroom:0.05"),
            "defragment_headroom:0.05"
        );
        assert_eq!(uncapped("per_process_memory_fraction:0.5"), "");
        assert_eq!(
            uncapped("memory_limit : 1700MiB,  stitch_min_mb:0"),
            "stitch_min_mb:0",
            "spaces around a key, as the parser allows"
        );
        assert_eq!(uncapped(""), "");
        assert_eq!(
            uncapped("policy:pytorch,max_split_size_mb:64"),
            "policy:pytorch,max_split_size_mb:64"
        );
    }
}
