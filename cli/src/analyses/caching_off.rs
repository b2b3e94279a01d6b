//! When the caching allocator was switched off, so that allocations went
//! to `cudaMalloc` and are missing from the trace.
//!
//! Programs switch PyTorch's caching allocator off for a while
//! (`torch.cuda.memory.caching_allocator_enable(False)`, or the
//! `caching_allocator_disabled()` context) or for the whole process
//! (`PYTORCH_NO_CUDA_MEMORY_CACHING`, for compute-sanitizer runs). gpualloc
//! then hands every allocation to `cudaMalloc`, as PyTorch does, outside
//! its cache, its stats and its trace; its torch bridge records a mark at
//! each switch (Note [The caching allocator switched off] in
//! `python-shim/gpualloc/bridge/uncached.h`). Without this analysis a
//! trace recorded that way would look as if the program allocated less, or
//! nothing. The marks are told apart by name after the scan, so the scan
//! keeps the first times of every mark name of every device, a few per
//! name, up to a number of names for the whole trace.

use std::collections::{BTreeMap, BTreeSet};

use crate::input::ScanInfo;

/// The mark of `caching_allocator_enable(False)`.
pub const SWITCHED_OFF: &str = "caching_allocator_enable(False)";
/// The mark of `caching_allocator_enable(True)`.
pub const SWITCHED_ON: &str = "caching_allocator_enable(True)";
/// The mark made when CUDA starts with `PYTORCH_NO_CUDA_MEMORY_CACHING` set.
pub const FORCED_OFF: &str = "PYTORCH_NO_CUDA_MEMORY_CACHING: caching allocator off";

/// Times kept per mark name and device; a program that switches more often
/// than this gets a count instead of the time spent switched off.
const TIMES_PER_NAME: usize = 64;
/// Distinct mark names followed, counted once per device that has them,
/// on all devices together (names made per step or per epoch are many;
/// the switches' are made first or early). A bound for the whole trace,
/// not per device: `summary` took 2.2 GB with a bound per device, on a
/// crafted trace of 108 MiB (256 devices, 65,536 names each, marked once).
const NAMES: usize = 1 << 16;

/// A mark's time and its place among the trace's marks.
type Stamp = (u64, u64);

/// The marks of a trace: for each device and name, how often and the first
/// times, each with the mark's place in the file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MarkTimes {
    by_name: BTreeMap<(u32, u64), (u64, Vec<Stamp>)>,
    /// Marks counted so far: the place of the next.
    seen: u64,
    /// Devices with marks of names left out (past [`NAMES`]): a switch on
    /// among them would be missing, and the time off longer than it was.
    left_out: BTreeSet<u32>,
}

impl MarkTimes {
    /// Counts a mark of string `name` on `device` at `time_ns`.
    #[inline]
    pub fn add(&mut self, device: u32, name: u64, time_ns: u64) {
        let key = (device, name);
        if self.by_name.len() >= NAMES && !self.by_name.contains_key(&key) {
            self.left_out.insert(device);
            return;
        }
        let (count, times) = self.by_name.entry(key).or_default();
        *count += 1;
        if times.len() < TIMES_PER_NAME {
            times.push((time_ns, self.seen));
        }
        self.seen += 1;
    }

    /// What the switch marks of `device` say, once the strings are known;
    /// `None` when the caching allocator was never switched off there.
    pub fn caching_off(&self, device: u32, info: &ScanInfo, end_ns: u64) -> Option<CachingOff> {
        let find = |wanted: &str| {
            self.by_name
                .range((device, 0)..=(device, u64::MAX))
                .find(|((_, id), _)| info.strings.get(*id as usize).is_some_and(|s| s == wanted))
                .map(|(_, v)| v)
        };
        let forced_at_ns = find(FORCED_OFF).and_then(|(_, t)| t.first().map(|&(t, _)| t));
        let (offs, off_times) = find(SWITCHED_OFF).map_or((0, &[][..]), |(n, t)| (*n, &t[..]));
        let (ons, on_times) = find(SWITCHED_ON).map_or((0, &[][..]), |(n, t)| (*n, &t[..]));
        if forced_at_ns.is_none() && offs == 0 {
            return None;
        }
        let complete = offs as usize == off_times.len()
            && ons as usize == on_times.len()
            && !self.left_out.contains(&device);
        Some(CachingOff {
            forced_at_ns,
            switched_off: offs,
            off_ns: complete.then(|| time_off(off_times, on_times, end_ns)),
        })
    }
}

/// Nanoseconds between each switch off and the next switch on (or
/// `end_ns`); a switch off while off, or on while on, changes nothing.
/// Switches at one time stamp (a simulated device's clock, which stands
/// still until driven; marks held for a device that joins) are taken in
/// the order they were recorded: by time alone, an off, on, off at one
/// stamp sorted as off, off, on, and the time off to the end was lost.
fn time_off(offs: &[Stamp], ons: &[Stamp], end_ns: u64) -> u64 {
    let mut switches: Vec<(u64, u64, bool)> = offs
        .iter()
        .map(|&(t, at)| (t, at, false))
        .chain(ons.iter().map(|&(t, at)| (t, at, true)))
        .collect();
    switches.sort_unstable();
    let (mut total, mut since) = (0u64, None);
    for (t, _, on) in switches {
        match (on, since) {
            (false, None) => since = Some(t),
            (true, Some(s)) => {
                total += t.saturating_sub(s);
                since = None;
            }
            _ => {}
        }
    }
    total + since.map_or(0, |s| end_ns.saturating_sub(s))
}

/// When allocations bypassed the cache (and the trace).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachingOff {
    /// `PYTORCH_NO_CUDA_MEMORY_CACHING` switched it off for good at this time.
    pub forced_at_ns: Option<u64>,
    /// `caching_allocator_enable(False)` calls.
    pub switched_off: u64,
    /// Time spent switched off by those calls, up to the trace's end;
    /// `None` when there were too many switches, or mark names, to follow.
    pub off_ns: Option<u64>,
}

impl CachingOff {
    /// One line for the summary.
    pub fn describe(&self) -> String {
        let outside = "allocations went to cudaMalloc, outside gpualloc and this trace";
        if let Some(t) = self.forced_at_ns {
            return format!(
                "from {} to the end (PYTORCH_NO_CUDA_MEMORY_CACHING was set): {outside}",
                crate::units::duration(t)
            );
        }
        let spent = self.off_ns.map_or(String::new(), |ns| {
            format!(", {} in all", crate::units::duration(ns))
        });
        format!(
            "{} time(s) by caching_allocator_enable(False){spent}: meanwhile {outside}",
            self.switched_off
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpualloc::trace::TraceHeader;

    fn info(strings: &[&str]) -> ScanInfo {
        ScanInfo {
            header: TraceHeader::default(),
            strings: strings.iter().map(|s| s.to_string()).collect(),
            events: 0,
            dropped: 0,
            end: None,
            warning: None,
            file_bytes: 0,
        }
    }

    #[test]
    fn spans_between_the_switches_up_to_the_end() {
        let i = info(&["step", SWITCHED_OFF, SWITCHED_ON]);
        let mut m = MarkTimes::default();
        assert_eq!(m.caching_off(0, &i, 100), None, "no marks: never off");
        m.add(0, 0, 5);
        assert_eq!(m.caching_off(0, &i, 100), None, "other marks: never off");
        for (name, t) in [(1, 10), (1, 12), (2, 20), (2, 25), (1, 90)] {
            m.add(0, name, t);
        }
        assert_eq!(m.caching_off(1, &i, 100), None, "another device's marks");
        let c = m.caching_off(0, &i, 100).expect("switched off");
        assert_eq!(
            c,
            CachingOff {
                forced_at_ns: None,
                switched_off: 3,
                off_ns: Some(10 + 10)
            }
        );
        assert!(
            c.describe()
                .starts_with("3 time(s) by caching_allocator_enable(False), 20 ns in all:")
        );
    }

    /// Switches at one time stamp count in the order they were recorded.
    #[test]
    fn switches_at_one_stamp_keep_their_order() {
        let i = info(&["step", SWITCHED_OFF, SWITCHED_ON]);
        let mut m = MarkTimes::default();
        // Off at 10; on, then off again, at 20: off from 20 to the end.
        for (name, t) in [(1, 10), (2, 20), (1, 20)] {
            m.add(0, name, t);
        }
        // Off, then on, at 50: no time off.
        for (name, t) in [(1, 50), (2, 50)] {
            m.add(1, name, t);
        }
        let off = |d| m.caching_off(d, &i, 100).and_then(|c| c.off_ns);
        assert_eq!(off(0), Some(10 + 80));
        assert_eq!(off(1), Some(0));
    }

    #[test]
    fn the_variable_is_off_for_good_and_too_many_switches_are_only_counted() {
        let i = info(&[FORCED_OFF, SWITCHED_OFF, SWITCHED_ON]);
        let mut m = MarkTimes::default();
        m.add(0, 0, 7);
        let c = m.caching_off(0, &i, 100).expect("forced off");
        assert_eq!(c.forced_at_ns, Some(7));
        assert!(
            c.describe()
                .contains("from 7 ns to the end (PYTORCH_NO_CUDA_MEMORY_CACHING was set)")
        );
        let mut m = MarkTimes::default();
        for t in 0..(TIMES_PER_NAME as u64 + 1) {
            m.add(0, 1, 2 * t);
            m.add(0, 2, 2 * t + 1);
        }
        let c = m.caching_off(0, &i, 1000).expect("switched off");
        assert_eq!(
            (c.switched_off, c.off_ns),
            (TIMES_PER_NAME as u64 + 1, None)
        );
    }

    /// The names followed are bounded for the whole trace, whatever the
    /// number of devices; a device whose names were left out has no time
    /// off (its switch on may be among them).
    #[test]
    fn names_are_followed_up_to_a_bound_for_all_devices_together() {
        let i = info(&["step", SWITCHED_OFF, SWITCHED_ON]);
        let mut m = MarkTimes::default();
        for d in 0..4 {
            m.add(d, 1, 10);
            for name in 3..NAMES as u64 / 2 {
                m.add(d, name, 20);
            }
            m.add(d, 2, 30);
        }
        assert_eq!(m.by_name.len(), NAMES);
        assert_eq!(m.left_out, BTreeSet::from([2, 3]));
        let c = |d| {
            m.caching_off(d, &i, 100)
                .map(|c| (c.switched_off, c.off_ns))
        };
        assert_eq!(c(0), Some((1, Some(20))));
        assert_eq!(c(1), Some((1, Some(20))));
        assert_eq!(c(2), Some((1, None)), "its switch on was left out");
        assert_eq!(c(3), None, "every switch left out");
    }

    #[test]
    fn the_names_are_the_ones_the_bridge_marks() {
        let bridge = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../python-shim/gpualloc/bridge.cpp");
        let text = std::fs::read_to_string(&bridge).expect("the torch bridge's source");
        for name in [SWITCHED_OFF, SWITCHED_ON, FORCED_OFF] {
            assert!(
                text.contains(&format!("\"{name}\"")),
                "bridge.cpp no longer marks {name:?}"
            );
        }
    }
}
