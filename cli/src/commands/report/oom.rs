//! Why each OOM happened, and which configuration would have avoided it,
//! backed by replaying the trace under that configuration.
//!
//! A failed request of `r` bytes is one of three kinds:
//! - *fragmentation*: the cache held at least `r` free bytes, but no free
//!   range of `r` (the largest free range was smaller);
//! - *unusable*: the trace shows a free range of `r` or more, yet the
//!   request failed: that memory was not the allocator's to take (free
//!   pages that a stitched range maps a second time look free at home in
//!   the trace, which does not record which; blocks waiting for another
//!   stream's work); the replay under the recorded configuration, when it
//!   reproduces the failure, tells what the allocator found;
//! - *cache*: the cache's free bytes plus the device's free bytes would
//!   have held `r`, but neither alone did (cached memory of the wrong size
//!   or stream was not given back in time);
//! - *tensors*: live allocations plus the request exceed what the device
//!   had; no allocator setting helps.
//!
//! The remedies are replayed on a simulated device of the capacity the
//! trace implies at the first OOM (reserved plus the device's free bytes),
//! starting with the recorded configuration, so that the page can show
//! whether the replay reproduces the OOM and what each candidate saves.

use std::path::Path;

use gpualloc::Config;
use gpualloc::replay::{ReplayResult, replay};

use crate::analyses::ooms::Oom;
use crate::input::{self, CliError};
use crate::units::bytes;

/// Configurations tried against an OOM, besides the recorded one.
pub const CANDIDATES: [&str; 3] = [
    "policy:pytorch,expandable_segments:true",
    "policy:pytorch,max_split_size_mb:64,garbage_collection_threshold:0.8",
    "policy:gpualloc",
];

/// What made an OOM fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// Enough cached free bytes, no range large enough.
    Fragmentation,
    /// A free range large enough in the trace, which the allocator could
    /// not take.
    Unusable,
    /// Free bytes existed, split between the cache and the device.
    Cache,
    /// Live allocations leave too little.
    Tensors,
}

/// The cause of `o`.
pub fn cause(o: &Oom) -> Cause {
    if o.cached_free >= o.requested && o.largest_free < o.requested {
        Cause::Fragmentation
    } else if o.largest_free >= o.requested {
        Cause::Unusable
    } else if o.cached_free.saturating_add(o.device_free) >= o.requested {
        Cause::Cache
    } else {
        Cause::Tensors
    }
}

/// Why `o` failed, with what the replay under the recorded configuration
/// found when it failed at the same request (`advice`'s first trial).
pub fn explain_replayed(o: &Oom, advice: Option<&Advice>) -> String {
    let mut text = explain(o);
    let same = advice
        .and_then(|a| a.trials.first())
        .and_then(|t| t.result.first_oom.as_ref())
        .filter(|r| r.time_ns == o.time_ns && r.requested == o.requested);
    if let Some(r) = same {
        text.push_str(&format!(
            " Replayed under the recorded configuration, the same request fails with {} allocated and {} reserved, the largest free range {} once the cache gave back what it could.",
            bytes(r.allocated),
            bytes(r.reserved),
            bytes(r.largest_free_block)
        ));
    }
    text
}

/// One sentence saying why `o` failed.
pub fn explain(o: &Oom) -> String {
    match cause(o) {
        Cause::Unusable => format!(
            "{} free in the cache, in pieces of up to {}, yet the request of {} failed: that memory was not the allocator's to take (with expandable segments, free pages that a stitched range maps a second time look free at their home in the trace; blocks waiting for another stream's work); live tensors hold {} and {} left {}.",
            bytes(o.cached_free),
            bytes(o.largest_free),
            bytes(o.requested),
            bytes(o.gauges.allocated),
            what_left(o),
            bytes(o.device_free),
        ),
        Cause::Fragmentation => format!(
            "{} cached but the largest free range is {}, for a request of {}: fragmentation.",
            bytes(o.cached_free),
            bytes(o.largest_free),
            bytes(o.requested)
        ),
        Cause::Cache => format!(
            "{} free in the cache and {} {}: together enough for {}, but neither alone; the cache held memory it could have given back.",
            bytes(o.cached_free),
            bytes(o.device_free),
            where_free(o),
            bytes(o.requested)
        ),
        Cause::Tensors => format!(
            "live tensors hold {} and {} left {} (plus {} cached) for a request of {}: the tensors themselves, not the cache.",
            bytes(o.gauges.allocated),
            what_left(o),
            bytes(o.device_free),
            bytes(o.cached_free),
            bytes(o.requested)
        ),
    }
}

/// What had the bytes `device_free` counts: the limit or the device.
fn what_left(o: &Oom) -> &'static str {
    if o.limited {
        "the memory limit"
    } else {
        "the device"
    }
}

fn where_free(o: &Oom) -> &'static str {
    if o.limited {
        "left under the memory limit"
    } else {
        "on the device"
    }
}

/// The configuration keys that set a limit, from the recorded configuration:
/// they belong to the device the run had, so every candidate keeps them.
fn limit_keys(recorded: &str) -> String {
    recorded
        .split(',')
        .map(str::trim)
        .filter(|kv| {
            kv.starts_with("memory_limit:") || kv.starts_with("per_process_memory_fraction:")
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Cuts each OOM's free device bytes to what the recorded memory limit
/// left (`memory_limit` in the trace's configuration), so that the causes
/// name the limit rather than a device that had room.
pub fn apply_limit(ooms: &mut [Oom], recorded: &str) {
    let Some(limit) = Config::parse(recorded).ok().and_then(|c| c.memory_limit) else {
        return;
    };
    for o in ooms {
        let left = limit.saturating_sub(o.gauges.reserved);
        if left < o.device_free {
            o.device_free = left;
            o.limited = true;
        }
    }
}

/// A configuration replayed.
pub struct Trial {
    /// GPUALLOC_CONF text.
    pub config: String,
    /// The replay's figures.
    pub result: ReplayResult,
}

/// The replays behind the advice.
pub struct Advice {
    /// Simulated capacity.
    pub capacity: u64,
    /// The recorded configuration first, then [`CANDIDATES`].
    pub trials: Vec<Trial>,
}

impl Advice {
    /// The trial without OOMs and with the lowest peak reserved, if any.
    pub fn best(&self) -> Option<&Trial> {
        self.trials
            .iter()
            .skip(1)
            .filter(|t| t.result.ooms == 0)
            .min_by_key(|t| t.result.peak_reserved)
    }
}

/// The device capacity `first` implies: what was reserved plus what the
/// device had left (0 when the trace records neither, as an RMM log).
pub fn capacity(first: &Oom) -> u64 {
    first.gauges.reserved.saturating_add(first.device_free)
}

/// Replays the trace under the recorded configuration and the candidates,
/// on a device of the capacity implied by `first`.
pub fn advise(path: &Path, recorded: &str, first: &Oom) -> Result<Advice, CliError> {
    let capacity = capacity(first);
    let limits = limit_keys(recorded);
    let mut trials = Vec::new();
    let candidates = CANDIDATES.iter().map(|c| match limits.as_str() {
        "" => c.to_string(),
        l => format!("{c},{l}"),
    });
    for c in std::iter::once(recorded.to_string()).chain(candidates) {
        let Ok(config) = Config::parse(&c) else {
            continue;
        };
        let mut reader = input::open(path)?;
        let result = replay(reader.events(), capacity, &config);
        trials.push(Trial { config: c, result });
    }
    Ok(Advice { capacity, trials })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyses::state::Gauges;

    fn oom(requested: u64, cached_free: u64, largest_free: u64, device_free: u64) -> Oom {
        Oom {
            time_ns: 0,
            stream: 0,
            requested,
            device_free,
            limited: false,
            gauges: Gauges::default(),
            largest_free,
            cached_free,
            phase: 0,
            largest_live: Vec::new(),
            by_phase: Vec::new(),
        }
    }

    #[test]
    fn causes_follow_the_numbers() {
        let frag = oom(400 << 20, 10 << 30, 300 << 20, 0);
        assert_eq!(cause(&frag), Cause::Fragmentation);
        assert!(
            explain(&frag).starts_with("10.00 GiB cached but the largest free range is 300.00 MiB")
        );
        assert_eq!(cause(&oom(100, 60, 60, 50)), Cause::Cache);
        assert_eq!(cause(&oom(100, 30, 30, 50)), Cause::Tensors);
        // A free range that fits, yet the request failed: never "neither
        // alone" when the cache alone held enough.
        let unusable = oom(30 << 20, 58 << 20, 39 << 20, 14 << 20);
        assert_eq!(cause(&unusable), Cause::Unusable);
        assert!(!explain(&unusable).contains("neither alone"));
    }

    #[test]
    fn a_recorded_memory_limit_bounds_the_free_bytes_and_stays_in_every_candidate() {
        let mut o = oom(100 << 20, 60 << 20, 60 << 20, 100 << 30);
        o.gauges.reserved = 1600 << 20;
        let mut ooms = vec![o];
        apply_limit(&mut ooms, "memory_limit:1700MiB");
        assert_eq!(ooms[0].device_free, 100 << 20);
        assert!(
            explain(&ooms[0]).contains("left under the memory limit"),
            "{}",
            explain(&ooms[0])
        );
        apply_limit(&mut ooms, "");
        assert_eq!(ooms[0].device_free, 100 << 20);
        assert_eq!(
            limit_keys("policy:pytorch,memory_limit:1700MiB"),
            "memory_limit:1700MiB"
        );
        assert_eq!(limit_keys("expandable_segments:true"), "");
    }
}
