//! Why each OOM happened, and which configuration would have avoided it,
//! backed by replaying the trace under that configuration.
//!
//! A failed request of `r` bytes is one of these kinds:
//! - *fragmentation*: the cache held at least `r` free bytes, but no free
//!   range of `r` (the largest free range was smaller);
//! - *unusable*: the trace shows a free range of `r` or more, yet the
//!   request failed: that memory was not the allocator's to take (a range
//!   reserved for another stream, which PyTorch's rules never lend; free
//!   pages that a stitched range maps a second time look free at home in
//!   the trace, which does not record which; blocks waiting for another
//!   stream's work); the replay under the recorded configuration, when it
//!   reproduces the failure, tells what the allocator found;
//! - *device room*: the device (within the cap in force) had `r` free
//!   bytes on its own, yet the request failed: the allocator asks the
//!   driver for more than `r` (a whole segment or page), or the free
//!   figure was more than the process could have;
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
use gpualloc::replay::{Departure, ReplayResult, replay};

use crate::analyses::ooms::Oom;
use crate::input::{self, CliError};
use crate::units::{bytes, duration};

/// Configurations tried against an OOM, besides the recorded one:
/// PyTorch's expandable segments (gpualloc's without defragmentation or
/// stitching,
/// [`PYTORCH_EXPANDABLE`](crate::formats::torch_config::PYTORCH_EXPANDABLE)),
/// PyTorch's fragmentation knobs, gpualloc's policy, and gpualloc's policy
/// with 5% of headroom over the live peak before pages move: on runs whose
/// shapes keep changing (multi-scale detectors), moving pages to stay
/// within 0.5% scatters the layout, and the peak creeps over a long run
/// past what 5% held from the start reserves (the fifty-first study of
/// `docs/policy-experiments.md`: 1.054 against 1.027 times the live peak
/// over 1,000 steps on the GPU).
pub const CANDIDATES: [&str; 4] = [
    concat!(
        "policy:pytorch,",
        "expandable_segments:true,defragment:false,stitch_min_mb:0,expandable_page_mb:20"
    ),
    "policy:pytorch,max_split_size_mb:64,garbage_collection_threshold:0.8",
    "policy:gpualloc",
    "policy:gpualloc,defragment_headroom:0.05",
];

/// Why a replay may obtain other memory than its recording: another build
/// recorded it (when the trace names one), or else the trace started
/// mid-run or dropped events.
fn departure_cause(recorded_by: &str) -> String {
    let this = gpualloc::trace::producer();
    if other_build(recorded_by) {
        format!("the trace was recorded by {recorded_by}, this is {this}")
    } else {
        "a trace recorded by another version, started mid-run or with events dropped".to_string()
    }
}

/// Whether `recorded_by` (a trace's producer) is a gpualloc build other
/// than this one.
fn other_build(recorded_by: &str) -> bool {
    recorded_by.starts_with("gpualloc ") && recorded_by != gpualloc::trace::producer()
}

/// What made an OOM fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// Enough cached free bytes, no range large enough.
    Fragmentation,
    /// A free range large enough in the trace, which the allocator could
    /// not take.
    Unusable,
    /// The device had the request's bytes free on its own.
    DeviceRoom,
    /// Free bytes existed, split between the cache and the device.
    Cache,
    /// Live allocations leave too little.
    Tensors,
    /// The trace records no reserved memory (an RMM log): what was free
    /// in the cache and on the device is unknown.
    Unknown,
}

/// The cause of `o`.
pub fn cause(o: &Oom) -> Cause {
    if !o.reserves {
        Cause::Unknown
    } else if o.cached_free >= o.requested && o.largest_free < o.requested {
        Cause::Fragmentation
    } else if o.largest_free >= o.requested {
        Cause::Unusable
    } else if o.free() >= o.requested {
        Cause::DeviceRoom
    } else if o.cached_free.saturating_add(o.free()) >= o.requested {
        Cause::Cache
    } else {
        Cause::Tensors
    }
}

/// Why `o` failed, with what the replay under the recorded configuration
/// found when it failed at the same request (`advice`'s first trial).
/// Times are on the trace's clock; `recorded_by` is the trace's producer.
pub fn explain_replayed(o: &Oom, advice: Option<&Advice>, recorded_by: &str) -> String {
    let mut text = explain(o);
    let Some(t) = advice.and_then(|a| a.recorded.as_ref()) else {
        return text;
    };
    let same = t.result.first_oom.as_ref();
    if let Some(r) = same.filter(|r| r.time_ns == o.time_ns && r.requested == o.requested) {
        text.push_str(&format!(
            " Replayed under the recorded configuration, the same request fails with {} allocated and {} reserved, the largest free range {} once the cache gave back what it could.",
            bytes(r.allocated),
            bytes(r.reserved),
            bytes(r.largest_free_block)
        ));
        // Whether the replay got there the recording's way (`Departure`).
        match t.result.departure {
            Some(d) if d.time_ns < o.time_ns => text.push_str(&format!(
                " The replay obtained the memory the recording did until {}, and this build's policy chose otherwise from there ({}).",
                duration(d.time_ns),
                departure_cause(recorded_by)
            )),
            _ => text.push_str(
                " Until then it obtained the memory the recording did, allocation by allocation.",
            ),
        }
    } else if let Some(d) = advice.and_then(|a| a.avoided_by_this_build(o.time_ns, recorded_by)) {
        text.push_str(&format!(
            " Replayed under the recorded configuration, the run does not fail: the replay obtained the memory the recording did until {}, and this build's policy chose otherwise from there ({}) and avoids the OOM.",
            duration(d.time_ns),
            departure_cause(recorded_by)
        ));
    }
    text
}

/// One sentence saying why `o` failed.
pub fn explain(o: &Oom) -> String {
    match cause(o) {
        Cause::Unusable => {
            let why = if o.largest_free_on_stream < o.requested {
                format!(
                    "the free ranges large enough were reserved for other streams, and this stream's own memory had no free range over {} (PyTorch's rules never lend one stream's cache to another; gpualloc's `cross_stream_reuse`, on by default and off under `policy:pytorch`, lets a stream take another stream's cached block, ordered after that stream's work)",
                    bytes(o.largest_free_on_stream)
                )
            } else {
                "that memory was not the allocator's to take (with expandable segments, in traces recorded before trace minor version 4, free pages that a stitched range maps a second time look free at their home; blocks waiting for another stream's work)".to_string()
            };
            format!(
                "{} free in the cache, in pieces of up to {}, yet the request of {} failed: {why}; live tensors hold {} and {} left {}.",
                bytes(o.cached_free),
                bytes(o.largest_free),
                bytes(o.requested),
                bytes(o.gauges.allocated),
                what_left(o),
                bytes(o.free()),
            )
        }
        Cause::Fragmentation => format!(
            "{} cached but the largest free range is {}, for a request of {}: fragmentation.",
            bytes(o.cached_free),
            bytes(o.largest_free),
            bytes(o.requested)
        ),
        Cause::DeviceRoom => format!(
            "{} {}, at least the request of {}, yet it failed: the allocator asks the driver for more than the request (a whole segment or page: 20 MiB segments for requests of 1 to 10 MiB under PyTorch's rules, 2 MiB pages or larger handles with expandable segments), or that memory was not the process's to take (the CUDA context, other processes); live tensors hold {} and the cache {} free.",
            bytes(o.free()),
            if o.limited() {
                "left under the memory limit"
            } else {
                "free on the device"
            },
            bytes(o.requested),
            bytes(o.gauges.allocated),
            bytes(o.cached_free)
        ),
        Cause::Cache => format!(
            "{} free in the cache and {} {}: together enough for {}, but neither alone; the cache held memory it could have given back.",
            bytes(o.cached_free),
            bytes(o.free()),
            where_free(o),
            bytes(o.requested)
        ),
        Cause::Tensors => format!(
            "live tensors hold {} and {} left {} (plus {} cached) for a request of {}: the tensors themselves, not the cache.",
            bytes(o.gauges.allocated),
            what_left(o),
            bytes(o.free()),
            bytes(o.cached_free),
            bytes(o.requested)
        ),
        Cause::Unknown => format!(
            "live tensors hold {} when the request of {} failed; the trace records no reserved memory (no segment events), so what was free in the cache and on the device is unknown.",
            bytes(o.gauges.allocated),
            bytes(o.requested)
        ),
    }
}

/// What had the bytes `device_free` counts: the limit or the device.
fn what_left(o: &Oom) -> &'static str {
    if o.limited() {
        "the memory limit"
    } else {
        "the device"
    }
}

fn where_free(o: &Oom) -> &'static str {
    if o.limited() {
        "left under the memory limit"
    } else {
        "on the device"
    }
}

/// The configuration keys that set a limit, from the recorded configuration:
/// they belong to the device the run had, so every candidate keeps them.
fn limit_keys(recorded: &str) -> String {
    crate::commands::min_limit::cap_entries(recorded, true)
}

/// Sets each OOM's `limit_left`: what the cap on reserved memory in force
/// ([`cap`], under the recorded configuration `recorded`) left, so that
/// the causes name the limit rather than a device that had room.
pub fn apply_limit(ooms: &mut [Oom], recorded: &str) {
    let config = recorded_caps(recorded);
    for o in ooms {
        o.limit_left = cap(&config, o).map(|c| c.saturating_sub(o.gauges.reserved));
    }
}

/// The caps of the recorded configuration `recorded`, read from its cap
/// keys alone: a configuration this build does not read (a key of another
/// version) still gives them, and the caps the program set while it ran
/// (`memory_limit` records) count over them. None when even those keys do
/// not parse.
pub fn recorded_caps(recorded: &str) -> Config {
    Config::parse(&limit_keys(recorded)).unwrap_or_default()
}

/// The cap on reserved memory in force at `o`, as the allocator computes
/// it (`allocator/src/limits.rs`): `memory_limit`, and
/// `per_process_memory_fraction` (below 1) of the device's memory (the
/// driver's total when a `memory_limit` record carries it, else reserved
/// plus free at the OOM); the smaller when both are set. Each is the one
/// the program last set while it ran, if any (`memory_limit` records),
/// else `config`'s.
pub fn cap(config: &Config, o: &Oom) -> Option<u64> {
    let total = o.caps.device_total.unwrap_or_else(|| available(o));
    let by_fraction = o
        .caps
        .fraction
        .or(config.memory_fraction)
        .filter(|&f| f < 1.0)
        .map(|f| fraction_of(total, f));
    match (by_fraction, o.caps.bytes.unwrap_or(config.memory_limit)) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The bytes `fraction` of `total` caps reserved memory at, rounded as
/// the allocator rounds them (`Limits::limit` in `allocator/src/limits.rs`).
pub fn fraction_of(total: u64, fraction: f64) -> u64 {
    (total as f64 * fraction) as u64
}

/// What the process could have reserved at `o`: reserved plus what the
/// device had left. It leaves out what others held (the CUDA context,
/// other processes), which the process could not have had either.
fn available(o: &Oom) -> u64 {
    o.gauges.reserved.saturating_add(o.device_free)
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
    /// The replay under the recorded configuration; `None` when that
    /// configuration does not parse in this build (a key of another
    /// version), so that no candidate is taken for it.
    pub recorded: Option<Trial>,
    /// The [`CANDIDATES`] that differ from the recorded configuration.
    pub candidates: Vec<Trial>,
}

impl Advice {
    /// Whether the replay under the recorded configuration fails too (or
    /// that configuration could not be replayed): otherwise a candidate
    /// that does not fail is no evidence that it avoids the OOM.
    pub fn reproduced(&self) -> bool {
        self.recorded.as_ref().is_none_or(|t| t.result.ooms > 0)
    }

    /// Where the replay under the recorded configuration left the
    /// recording's choices, when it did so before `time_ns` (the OOM's
    /// time) and then failed nothing, on a trace another gpualloc build
    /// recorded (`recorded_by`, the trace's producer) from its start (no
    /// frees of blocks it never saw allocated): this build's policy, not
    /// memory the trace does not show, is why the OOM is not reproduced.
    pub fn avoided_by_this_build(&self, time_ns: u64, recorded_by: &str) -> Option<Departure> {
        let t = self.recorded.as_ref()?;
        if t.result.ooms > 0 || t.result.unknown_frees > 0 || !other_build(recorded_by) {
            return None;
        }
        t.result.departure.filter(|d| d.time_ns < time_ns)
    }

    /// The candidate without OOMs and with the lowest peak reserved, if
    /// any, when the replay [`reproduced`](Self::reproduced) the OOM.
    pub fn best(&self) -> Option<&Trial> {
        if !self.reproduced() {
            return None;
        }
        self.candidates
            .iter()
            .filter(|t| t.result.ooms == 0)
            .min_by_key(|t| t.result.peak_reserved)
    }
}

/// The device to replay `first` on: what the process could have reserved
/// ([`available`]; 0 when the trace records neither, as an RMM log), but
/// the driver's total when the program had set a fraction below 1 and a
/// `memory_limit` record carries that total, so that the replay's
/// fraction is the cap the allocator had. A recorded cap is not taken off:
/// every replay keeps the keys and records that set it.
pub fn capacity(first: &Oom) -> u64 {
    match (first.caps.fraction, first.caps.device_total) {
        (Some(f), Some(total)) if f < 1.0 => total,
        _ => available(first),
    }
}

/// Replays the events of `device` under the recorded configuration and the
/// candidates, on a device of the capacity implied by `first` (an OOM of
/// that device): other devices had capacities of their own.
pub fn advise(path: &Path, recorded: &str, device: u32, first: &Oom) -> Result<Advice, CliError> {
    let capacity = crate::input::plausible_device_bytes(path, capacity(first));
    let limits = limit_keys(recorded);
    let trial = |c: String| -> Result<Option<Trial>, CliError> {
        let Ok(config) = Config::parse(&c) else {
            return Ok(None);
        };
        let mut reader = input::open(path)?;
        let result = replay(
            reader.events().filter(|e| e.device == device),
            capacity,
            &config,
        );
        Ok(Some(Trial { config: c, result }))
    };
    let recorded_trial = trial(recorded.to_string())?;
    // A candidate that is the recorded configuration (an imported
    // snapshot's expandable segments) is not replayed twice.
    let mut candidates = Vec::new();
    for c in CANDIDATES
        .iter()
        .map(|c| match limits.as_str() {
            "" => c.to_string(),
            l => format!("{c},{l}"),
        })
        .filter(|c| c != recorded)
    {
        candidates.extend(trial(c)?);
    }
    Ok(Advice {
        capacity,
        recorded: recorded_trial,
        candidates,
    })
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
            limit_left: None,
            caps: Default::default(),
            reserves: true,
            gauges: Gauges::default(),
            largest_free,
            largest_free_on_stream: largest_free,
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
        assert!(!explain(&unusable).contains("other streams"));
        // The range that fits is another stream's: said so, with this
        // stream's own largest.
        let elsewhere = Oom {
            largest_free_on_stream: 6 << 20,
            ..unusable
        };
        assert_eq!(cause(&elsewhere), Cause::Unusable);
        assert!(
            explain(&elsewhere).contains("reserved for other streams, and this stream's own memory had no free range over 6.00 MiB"),
            "{}",
            explain(&elsewhere)
        );
    }

    #[test]
    fn a_recorded_memory_limit_bounds_the_free_bytes_and_stays_in_every_candidate() {
        let mut o = oom(100 << 20, 60 << 20, 60 << 20, 100 << 30);
        o.gauges.reserved = 1600 << 20;
        let mut ooms = vec![o];
        apply_limit(&mut ooms, "memory_limit:1700MiB");
        assert_eq!(ooms[0].free(), 100 << 20);
        assert!(
            explain(&ooms[0]).contains("left under the memory limit"),
            "{}",
            explain(&ooms[0])
        );
        apply_limit(&mut ooms, "");
        assert_eq!(ooms[0].free(), 100 << 30, "no limit recorded");
        assert_eq!(
            limit_keys("policy:pytorch,memory_limit:1700MiB"),
            "memory_limit:1700MiB"
        );
        assert_eq!(limit_keys("expandable_segments:true"), "");
    }

    /// `per_process_memory_fraction` caps reserved memory at that share of
    /// the device (reserved plus free at the OOM), the smaller cap winning.
    #[test]
    fn a_recorded_memory_fraction_bounds_the_free_bytes_too() {
        // 6 GiB reserved, 2 GiB free: an 8 GiB device, half of it 4 GiB.
        let mut o = oom(1 << 30, 0, 0, 2 << 30);
        o.gauges.reserved = 6 << 30;
        o.gauges.allocated = 6 << 30;
        assert_eq!(cause(&o), Cause::DeviceRoom, "the device alone had room");
        assert!(!explain(&o).contains("neither alone"), "{}", explain(&o));
        let mut ooms = vec![o.clone()];
        apply_limit(&mut ooms, "per_process_memory_fraction:0.8");
        let four_fifths = ((8u64 << 30) as f64 * 0.8) as u64;
        assert_eq!(ooms[0].limit_left, Some(four_fifths - (6 << 30)));
        assert!(ooms[0].limited());
        assert_eq!(cause(&ooms[0]), Cause::Tensors);
        assert!(explain(&ooms[0]).contains("the memory limit left"));
        let both = Config::parse("per_process_memory_fraction:0.9,memory_limit:7GiB").unwrap();
        assert_eq!(cap(&both, &o), Some(7 << 30), "the smaller cap");
        let both = Config::parse("per_process_memory_fraction:0.5,memory_limit:7GiB").unwrap();
        assert_eq!(cap(&both, &o), Some(4 << 30));
        // A cap below what is reserved leaves nothing.
        let mut ooms = vec![o];
        apply_limit(&mut ooms, "per_process_memory_fraction:0.5");
        assert_eq!(ooms[0].free(), 0);
    }

    /// Caps the program set while it ran (`memory_limit` records) stand
    /// over the recorded configuration's, each kind on its own.
    #[test]
    fn caps_set_at_run_time_stand_over_the_configurations() {
        let mut o = oom(1 << 30, 0, 0, 2 << 30);
        o.gauges.reserved = 6 << 30;
        let conf = Config::parse("per_process_memory_fraction:0.9,memory_limit:7GiB").unwrap();
        o.caps.fraction = Some(0.5);
        assert_eq!(
            cap(&conf, &o),
            Some(4 << 30),
            "the fraction set wins over 0.9"
        );
        o.caps.fraction = Some(1.0);
        assert_eq!(cap(&conf, &o), Some(7 << 30), "a fraction of 1 is none");
        o.caps.bytes = Some(None);
        assert_eq!(cap(&conf, &o), None, "the byte cap was cleared");
        o.caps.bytes = Some(Some(5 << 30));
        let mut ooms = vec![o];
        apply_limit(&mut ooms, "");
        assert_eq!(ooms[0].limit_left, Some(0), "5 GiB cap, 6 GiB reserved");
    }

    /// A recorded configuration with a key this build does not know still
    /// gives its caps, and those the program set while it ran count.
    #[test]
    fn caps_count_when_the_recorded_configuration_has_unknown_keys() {
        let mut o = oom(1 << 30, 0, 0, 2 << 30);
        o.gauges.reserved = 6 << 30;
        let mut ooms = vec![o.clone()];
        apply_limit(&mut ooms, "a_later_key:1,memory_limit:7GiB");
        assert_eq!(ooms[0].limit_left, Some(1 << 30));
        o.caps.bytes = Some(Some(6656 << 20));
        let mut ooms = vec![o];
        apply_limit(&mut ooms, "a_later_key:1");
        assert_eq!(
            ooms[0].limit_left,
            Some(512 << 20),
            "the cap set while running"
        );
    }

    /// An OOM replays on what the process could have had, unless a
    /// fraction set while running is taken of the driver's total, which
    /// then is the device replayed.
    #[test]
    fn the_device_replayed_is_the_driver_total_only_under_a_fraction() {
        let mut o = oom(1 << 30, 0, 0, 2 << 30);
        o.gauges.reserved = 6 << 30;
        assert_eq!(capacity(&o), 8 << 30);
        o.caps.device_total = Some(9 << 30);
        o.caps.bytes = Some(Some(7 << 30));
        assert_eq!(capacity(&o), 8 << 30, "a byte cap needs no total");
        o.caps.fraction = Some(1.0);
        assert_eq!(capacity(&o), 8 << 30, "a fraction of 1 is none");
        o.caps.fraction = Some(0.5);
        assert_eq!(capacity(&o), 9 << 30);
        assert_eq!(
            cap(&Config::default(), &o),
            Some(4608 << 20),
            "half of 9 GiB"
        );
    }

    /// A trace without reserved memory (an RMM log) gives no cause built
    /// on zeros.
    #[test]
    fn without_reserved_memory_the_cause_is_unknown() {
        let mut o = oom(100 << 20, 0, 0, 0);
        o.reserves = false;
        o.gauges.allocated = 1 << 30;
        assert_eq!(cause(&o), Cause::Unknown);
        let text = explain(&o);
        assert!(text.contains("is unknown"), "{text}");
        assert!(!text.contains("0 B"), "{text}");
    }

    #[test]
    fn the_expandable_candidate_is_pytorchs_expandable_segments() {
        let c = Config::parse(CANDIDATES[0]).unwrap();
        assert!(c.expandable_segments && !c.defragment && !c.cross_stream_reuse);
        assert_eq!(c.stitch_min, u64::MAX, "no stitching");
        assert_eq!(
            CANDIDATES[0],
            format!(
                "policy:pytorch,{}",
                crate::formats::torch_config::PYTORCH_EXPANDABLE
            )
        );
    }
}
