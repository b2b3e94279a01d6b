//! Out-of-memory forensics: what was asked, what was free, what held memory.

use std::collections::BTreeMap;

use gpualloc::trace::TraceEvent;

use crate::analyses::state::{DeviceState, Gauges, NO_PHASE, SetCaps};

/// OOMs examined in detail per device (later ones are only counted).
pub const MAX_DETAILED: usize = 20;

/// One failed allocation.
#[derive(Clone, Debug)]
pub struct Oom {
    /// Time (ns since start).
    pub time_ns: u64,
    /// Stream.
    pub stream: u64,
    /// Bytes requested.
    pub requested: u64,
    /// Free bytes the device reported.
    pub device_free: u64,
    /// What the recorded cap on reserved memory left, when it set one
    /// (`report::oom::apply_limit`).
    pub limit_left: Option<u64>,
    /// Caps on reserved memory the program had set by then, over the
    /// recorded configuration's (`report::oom::cap`).
    pub caps: SetCaps,
    /// Whether the trace records reserved memory (segments): without, the
    /// free figures below are unknown, not 0.
    pub reserves: bool,
    /// Gauges at the failure.
    pub gauges: Gauges,
    /// Largest free piece of reserved memory.
    pub largest_free: u64,
    /// Largest free piece of the memory reserved for the request's stream.
    pub largest_free_on_stream: u64,
    /// Free reserved bytes in all.
    pub cached_free: u64,
    /// Innermost open phase (string id) or `NO_PHASE`.
    pub phase: u64,
    /// The largest live blocks: (address, block bytes, requested, phase id, age ns).
    pub largest_live: Vec<(u64, u64, u64, u64, u64)>,
    /// Live bytes by the phase that allocated them (string id).
    pub by_phase: Vec<(u64, u64)>,
}

impl Oom {
    /// Free bytes the request could have had from the device: what it
    /// reported, within what the cap left.
    pub fn free(&self) -> u64 {
        self.limit_left
            .map_or(self.device_free, |l| l.min(self.device_free))
    }

    /// Whether the cap, not the device, left less.
    pub fn limited(&self) -> bool {
        self.limit_left.is_some_and(|l| l < self.device_free)
    }
}

/// Examines the state at an `oom` event `e`, whose
/// [`EventKind::Oom`](gpualloc::trace::EventKind::Oom) holds `requested`
/// and `device_free`.
pub fn examine(e: &TraceEvent, requested: u64, device_free: u64, s: &DeviceState) -> Oom {
    let (largest_free, cached_free) = s.free_space();
    let mut live: Vec<(u64, u64, u64, u64, u64)> = s
        .live
        .iter()
        .filter(|(_, l)| !l.pending)
        .map(|(&a, l)| {
            (
                a,
                l.size,
                l.requested,
                l.phase,
                e.time_ns.saturating_sub(l.time_ns),
            )
        })
        .collect();
    live.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut by_phase: BTreeMap<u64, u64> = BTreeMap::new();
    for l in &live {
        *by_phase.entry(l.3).or_default() += l.1;
    }
    let mut by_phase: Vec<(u64, u64)> = by_phase.into_iter().collect();
    by_phase.sort_unstable_by_key(|x| std::cmp::Reverse(x.1));
    live.truncate(10);
    Oom {
        time_ns: e.time_ns,
        stream: e.stream,
        requested,
        device_free,
        limit_left: None,
        caps: s.caps,
        reserves: s.reserves,
        gauges: s.g,
        largest_free,
        largest_free_on_stream: s.largest_free_on_stream(e.stream).min(largest_free),
        cached_free,
        phase: s.phases.last().copied().unwrap_or(NO_PHASE),
        largest_live: live,
        by_phase,
    }
}
