//! Long runs from short recordings.
//!
//! Note [Longer runs]
//! Rationale: a trace of 60 training steps replays to the GPU's peaks, but
//! users train for thousands, and the multi-scale detector reserved 1.030x
//! its peak allocated over 60 steps and 1.044–1.074x over 200 on the H200
//! (`docs/policy-experiments.md`, seventeenth and twenty-second studies): a
//! policy judged on short traces alone misses the creep users watch.
//! Approach: [`longer`] keeps a recording's warm-up (its first sixth of
//! steps) as recorded, then appends steps drawn with replacement from the
//! rest. A step runs from one opening of the last phase opened at
//! top level at least seven times (the optimizer's, with automatic phases,
//! whatever evaluation or checkpoint ends the run) to the next. Each drawn step gets
//! addresses of its own. A block a step frees without having allocated it
//! (the previous step's loss, its gradients) stands for a leftover of the
//! step before, so it frees the previous drawn step's leftover of the
//! nearest size, on its stream if one is left there, else on its device;
//! leftovers no step claims are freed as
//! the following step ends, so nothing leaks that the recording did not
//! leak. The clock advances as recorded within a step, so time budgets see
//! the recorded pace.

use std::collections::HashMap;

use super::Rng;
use crate::trace::{Action, EventKind, TraceEvent};

/// The most steps [`longer`] draws, plus one.
pub const MAX_STEPS: usize = 1 << 16;

/// `events` (one recorded run) with its steps after the warm-up replaced
/// by `steps` steps drawn from them with `seed`; `None` when the trace has
/// fewer than seven steps (no phases, or too short to draw from), uses
/// private pools (a CUDA graph's replays read memory its capture left
/// allocated; drawn out of order, they would not), or holds several
/// devices (each records every phase, and their blocks of events
/// interleave in the file: windows between openings would cut steps
/// apart and run each device in half of them), or when `steps` reaches
/// [`MAX_STEPS`] (each drawn step's addresses carry its number above bit 48).
pub fn longer(events: &[TraceEvent], steps: usize, seed: u64) -> Option<Vec<TraceEvent>> {
    if steps >= MAX_STEPS {
        return None;
    }
    let device = events.first().map(|e| e.device);
    if events
        .iter()
        .any(|e| e.action == Action::PrivatePool || Some(e.device) != device)
    {
        return None;
    }
    let starts = step_starts(events)?;
    let warm = starts.len() / 6;
    let drawn: Vec<(usize, usize)> = starts[warm..].windows(2).map(|w| (w[0], w[1])).collect();
    let mut out = events[..starts[warm]].to_vec();
    let end = *starts.last()?;
    let (mut left, pending) = leftovers(events, starts[warm - 1], starts[warm], end);
    // Frees the recording completed after the warm-up complete as it ends.
    let t = out.last().map_or(0, |e| e.time_ns);
    out.extend(pending.into_iter().map(|p| TraceEvent {
        action: Action::FreeCompleted,
        time_ns: t,
        ..p
    }));
    // One seed's state is 0, which xorshift refuses: it runs as seed 0.
    let state = seed.wrapping_mul(0x9e37_79b9).wrapping_add(1);
    let mut rng = Rng::xorshift64_star(state.max(1));
    let mut now = out.last().map_or(0, |e| e.time_ns);
    for instance in 1..=steps as u64 {
        let (a, b) = *rng.pick(&drawn);
        let step = Step::new(instance, std::mem::take(&mut left));
        let (events_of_step, mine, unclaimed) = step.run(&events[a..b], now);
        out.extend(events_of_step);
        now = out.last().map_or(now, |e| e.time_ns) + 1_000;
        for l in unclaimed {
            for action in [Action::FreeRequested, Action::FreeCompleted] {
                out.push(TraceEvent {
                    action,
                    time_ns: now,
                    ..l
                });
            }
        }
        left = mine;
    }
    Some(out)
}

/// Where steps begin: the openings of the last phase opened at top level
/// (no other phase open on its device) at least seven times, so that an
/// evaluation or checkpoint ending the run, or a phase opened inside
/// another (a layer), is no step; `None` when no phase opens so often.
fn step_starts(events: &[TraceEvent]) -> Option<Vec<usize>> {
    let mut depth: HashMap<u32, usize> = HashMap::new();
    let mut top: Vec<(usize, u64)> = Vec::new();
    let mut opened: HashMap<u64, usize> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        let d = depth.entry(e.device).or_default();
        match e.kind() {
            EventKind::PhasePush { name } => {
                if *d == 0 {
                    top.push((i, name));
                    *opened.entry(name).or_default() += 1;
                }
                *d += 1;
            }
            EventKind::PhasePop { .. } => *d = d.saturating_sub(1),
            _ => {}
        }
    }
    let &(_, step) = top.iter().rev().find(|t| opened[&t.1] >= 7)?;
    Some(top.iter().filter(|t| t.1 == step).map(|t| t.0).collect())
}

/// The warm-up's leftovers: the blocks allocated at or after event `from`,
/// live at event `to` and freed by the recording before event `end` (not
/// those it keeps for good, such as an optimizer's state created in the
/// first step); then the blocks whose free was requested before `to` and
/// completed after it. Both in allocation order.
fn leftovers(
    events: &[TraceEvent],
    from: usize,
    to: usize,
    end: usize,
) -> (Vec<TraceEvent>, Vec<TraceEvent>) {
    // Block, where it was allocated, whether its free was requested.
    let mut live: HashMap<(u32, u64), (usize, TraceEvent, bool)> = HashMap::new();
    for (i, e) in events[..to].iter().enumerate() {
        let key = (e.device, e.addr);
        match e.action {
            Action::Alloc => {
                live.insert(key, (i, *e, false));
            }
            Action::FreeRequested => {
                if let Some(l) = live.get_mut(&key) {
                    l.2 = true;
                }
            }
            Action::FreeCompleted | Action::Free => {
                live.remove(&key);
            }
            _ => {}
        }
    }
    let freed_later: std::collections::HashSet<(u32, u64)> = events[to..end]
        .iter()
        .filter(|e| matches!(e.action, Action::FreeRequested | Action::Free))
        .map(|e| (e.device, e.addr))
        .collect();
    let mut live: Vec<(usize, TraceEvent, bool)> = live.into_values().collect();
    live.sort_unstable_by_key(|v| v.0);
    let (pending, kept): (Vec<_>, Vec<_>) = live.into_iter().partition(|v| v.2);
    let left = kept
        .into_iter()
        .filter(|v| v.0 >= from && freed_later.contains(&(v.1.device, v.1.addr)))
        .map(|v| v.1);
    (left.collect(), pending.into_iter().map(|v| v.1).collect())
}

/// One drawn step: its own addresses, and the previous step's leftovers
/// it may free.
struct Step {
    instance: u64,
    left: Vec<TraceEvent>,
    /// Blocks this step allocated and has not freed, by recorded address.
    mine: HashMap<(u32, u64), TraceEvent>,
    /// Recorded addresses of blocks from before the step, and the leftover
    /// each stands for.
    claimed: HashMap<(u32, u64), TraceEvent>,
    /// This step's addresses of blocks whose free was requested and not
    /// yet completed.
    requested: std::collections::HashSet<u64>,
}

impl Step {
    fn new(instance: u64, left: Vec<TraceEvent>) -> Step {
        Step {
            instance,
            left,
            mine: HashMap::new(),
            claimed: HashMap::new(),
            requested: Default::default(),
        }
    }

    /// The step's events from `now` on, the blocks it leaves live, and the
    /// previous step's leftovers it did not free.
    fn run(
        mut self,
        recorded: &[TraceEvent],
        now: u64,
    ) -> (Vec<TraceEvent>, Vec<TraceEvent>, Vec<TraceEvent>) {
        let t0 = recorded.first().map_or(0, |e| e.time_ns);
        let mut out = Vec::with_capacity(recorded.len());
        for e in recorded {
            let mut e = *e;
            e.time_ns = now + e.time_ns.saturating_sub(t0);
            let keep = match e.action {
                Action::Alloc
                | Action::FreeRequested
                | Action::FreeCompleted
                | Action::Free
                | Action::RecordStream
                | Action::StreamReuse => self.block_event(&mut e),
                // The program's own calls: a loop that empties the cache
                // or caps memory every step does so in every drawn step.
                Action::PhasePush
                | Action::PhasePop
                | Action::Mark
                | Action::EmptyCache
                | Action::MemoryLimit => true,
                // What the recording allocator did (segments, pages, its
                // syncs) is the replaying allocator's to decide.
                _ => false,
            };
            if keep {
                out.push(e);
            }
        }
        // A free requested here whose completion the recording made in the
        // next step (another stream's work) completes as this step ends.
        let end = out.last().map_or(now, |e| e.time_ns);
        let mut requested: Vec<TraceEvent> = self
            .claimed
            .into_values()
            .chain(
                self.mine
                    .values()
                    .filter(|m| self.requested.contains(&m.addr))
                    .copied(),
            )
            .collect();
        requested.sort_unstable_by_key(|e| (e.time_ns, e.addr));
        for r in requested {
            out.push(TraceEvent {
                action: Action::FreeCompleted,
                time_ns: end,
                ..r
            });
        }
        // In allocation order, so that one seed makes one run.
        let mut mine: Vec<TraceEvent> = self
            .mine
            .into_values()
            .filter(|m| !self.requested.contains(&m.addr))
            .collect();
        mine.sort_unstable_by_key(|e| (e.time_ns, e.addr));
        (out, mine, self.left)
    }

    /// Gives a block event this step's address; false when it names a
    /// block this step cannot stand for (then it is left out).
    fn block_event(&mut self, e: &mut TraceEvent) -> bool {
        let key = (e.device, e.addr);
        let done = matches!(e.action, Action::FreeCompleted | Action::Free);
        if e.action == Action::Alloc {
            e.addr ^= self.instance << 48;
            self.mine.insert(key, *e);
            return true;
        }
        if let Some(m) = self.mine.get(&key) {
            e.addr = m.addr;
            if done {
                self.requested.remove(&m.addr);
                self.mine.remove(&key);
            } else if e.action == Action::FreeRequested {
                self.requested.insert(m.addr);
            }
            return true;
        }
        if let Some(c) = self.claimed.get(&key).copied() {
            let stream = if e.action == Action::RecordStream {
                e.stream
            } else {
                c.stream
            };
            *e = TraceEvent {
                action: e.action,
                time_ns: e.time_ns,
                stream,
                ..c
            };
            if done {
                self.claimed.remove(&key);
            }
            return true;
        }
        if !matches!(e.action, Action::FreeRequested | Action::Free) {
            return false;
        }
        // The nearest size on the block's own stream, else on its device.
        let nearest = |same_stream: bool| {
            (0..self.left.len())
                .filter(|&k| {
                    let l = &self.left[k];
                    l.device == e.device && (!same_stream || l.stream == e.stream)
                })
                .min_by_key(|&k| self.left[k].size.abs_diff(e.size))
        };
        let nearest = nearest(true).or_else(|| nearest(false));
        let Some(k) = nearest else { return false };
        let l = self.left.swap_remove(k);
        *e = TraceEvent {
            action: e.action,
            time_ns: e.time_ns,
            ..l
        };
        if !done {
            self.claimed.insert(key, l);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;
    use crate::replay::replay;
    use crate::workload::later_tests::example;

    #[test]
    fn a_longer_run_frees_what_it_allocates_and_peaks_as_its_steps() {
        for name in ["detector-multiscale", "four-streams"] {
            let evs = example(name);
            let base = replay(evs.iter().copied(), 140 << 30, &Config::default());
            let long = longer(&evs, 120, 1).expect("the trace has steps");
            assert!(long == longer(&evs, 120, 1).unwrap(), "one seed, one run");
            assert!(long != longer(&evs, 120, 2).unwrap());
            let r = replay(long.iter().copied(), 140 << 30, &Config::default());
            assert_eq!((r.unknown_frees, r.ooms), (0, 0), "{name}");
            // Steps are drawn from the recording: no live high above its
            // own, and nothing piles up over 120 steps.
            let (a, b) = (r.peak_allocated, base.peak_allocated);
            assert!(a <= b && a * 10 >= b * 9, "{name}: {a} against {b}");
            let allocs = long.iter().filter(|e| e.action == Action::Alloc).count();
            assert!(
                allocs > 120 * 200,
                "{name}: {allocs} allocations in 120 steps"
            );
            assert!(
                long.windows(2).all(|w| w[0].time_ns <= w[1].time_ns),
                "{name}: time runs forward"
            );
        }
    }

    #[test]
    fn a_trace_without_steps_or_with_graphs_has_no_longer_run() {
        assert_eq!(longer(&super::super::churn(1, 2000), 10, 1), None);
        let detector = example("detector-multiscale");
        assert_eq!(
            longer(&detector, MAX_STEPS, 1),
            None,
            "addresses would repeat"
        );
        assert_eq!(longer(&example("reduce-overhead-graphs"), 10, 1), None);
    }

    /// Builds traces: events 1 µs apart.
    #[derive(Default)]
    struct Trace {
        evs: Vec<TraceEvent>,
    }

    const MIB: u64 = 1 << 20;

    impl Trace {
        fn push(&mut self, device: u32, stream: u64, kind: EventKind) {
            let t = self.evs.len() as u64 * 1_000;
            self.evs
                .push(TraceEvent::from_kind(t, device, stream, 0, kind));
        }

        fn alloc(&mut self, device: u32, addr: u64, size: u64) {
            let (requested, block_size) = (size, size);
            let kind = EventKind::Alloc {
                addr,
                requested,
                block_size,
            };
            self.push(device, 0, kind);
        }

        /// The free's request and, when `completed`, its completion.
        fn free(&mut self, device: u32, addr: u64, size: u64, completed: bool) {
            let (requested, block_size) = (size, size);
            self.push(
                device,
                0,
                EventKind::FreeRequested {
                    addr,
                    requested,
                    block_size,
                },
            );
            if completed {
                self.complete(device, addr, size);
            }
        }

        fn complete(&mut self, device: u32, addr: u64, size: u64) {
            let (requested, block_size) = (size, size);
            let kind = EventKind::FreeCompleted {
                addr,
                requested,
                block_size,
            };
            self.push(device, 0, kind);
        }

        fn open(&mut self, device: u32, name: u64) {
            self.push(device, 0, EventKind::PhasePush { name });
        }

        fn close(&mut self, device: u32, name: u64) {
            self.push(device, 0, EventKind::PhasePop { name });
        }

        /// A training step on `device`: the phase `step` (id 1) around an
        /// activation allocated and freed.
        fn step(&mut self, device: u32, i: u64) {
            self.open(device, 1);
            let addr = 0x7f00_0000_0000 + (i % 2) * (1 << 30);
            self.alloc(device, addr, 8 * MIB);
            self.free(device, addr, 8 * MIB, true);
            self.close(device, 1);
        }
    }

    fn count(evs: &[TraceEvent], action: Action, device: u32) -> usize {
        evs.iter()
            .filter(|e| e.action == action && e.device == device)
            .count()
    }

    #[test]
    fn a_loop_that_empties_the_cache_every_step_still_does() {
        let mut t = Trace::default();
        for i in 0..12 {
            t.step(0, i);
            t.push(0, 0, EventKind::EmptyCache { released: 8 * MIB });
        }
        let long = longer(&t.evs, 20, 1).unwrap();
        assert!(count(&long, Action::EmptyCache, 0) >= 20, "{long:?}");
    }

    #[test]
    fn every_seed_makes_a_run() {
        let mut t = Trace::default();
        for i in 0..12 {
            t.step(0, i);
        }
        // The seed whose generator state would be 0.
        assert!(longer(&t.evs, 5, 1_702_666_872_793_809_783).is_some());
    }

    #[test]
    fn steps_are_found_when_the_run_ends_with_an_evaluation_or_a_nested_phase() {
        // The recorded YOLO run ends with an evaluation, checkpoints and an
        // evaluation nested in one; its 30 optimizer steps are still steps.
        let evs = example("ultralytics-yolo");
        let long = longer(&evs, 40, 1).expect("the trace has steps");
        let r = replay(long.iter().copied(), 140 << 30, &Config::default());
        assert_eq!((r.unknown_frees, r.ooms), (0, 0));
        // A phase opened inside the step's last opening (a layer) is no step.
        let mut t = Trace::default();
        for i in 0..12 {
            t.step(0, i);
        }
        t.open(0, 1);
        for _ in 0..8 {
            t.open(0, 2);
            t.close(0, 2);
        }
        let long = longer(&t.evs, 30, 1).expect("twelve steps");
        assert_eq!(count(&long, Action::Alloc, 0), 30 + 2, "{long:?}");
    }

    #[test]
    fn a_free_pending_as_the_warm_up_ends_is_not_freed_again() {
        // Each step's activation is used on another stream: its free
        // completes as the next step begins, after the step's phase opens.
        let mut t = Trace::default();
        for i in 0..12u64 {
            t.open(0, 1);
            let addr = 0x7f00_0000_0000 + (i % 2) * (1 << 30);
            if i > 0 {
                t.complete(0, addr ^ (1 << 30), 8 * MIB);
            }
            t.alloc(0, addr, 8 * MIB);
            t.push(
                0,
                0,
                EventKind::RecordStream {
                    addr,
                    other_stream: 7,
                },
            );
            t.free(0, addr, 8 * MIB, false);
            t.close(0, 1);
        }
        let long = longer(&t.evs, 20, 1).unwrap();
        let r = replay(long.iter().copied(), 140 << 30, &Config::default());
        assert_eq!(r.unknown_frees, 0, "{long:?}");
    }

    #[test]
    fn what_the_warm_ups_last_step_keeps_for_good_is_never_freed() {
        // Eight steps: a warm-up of one, whose optimizer allocates its
        // state (kept for the whole run) as the first step does.
        let mut t = Trace::default();
        let state = 0x7e00_0000_0000;
        for i in 0..8 {
            t.step(0, i);
            if i == 0 {
                t.alloc(0, state, 64 * MIB);
            }
        }
        let long = longer(&t.evs, 20, 1).unwrap();
        let freed = long
            .iter()
            .any(|e| e.action == Action::FreeRequested && e.addr == state);
        assert!(!freed, "{long:?}");
        let r = replay(long.iter().copied(), 140 << 30, &Config::default());
        let base = replay(t.evs.iter().copied(), 140 << 30, &Config::default());
        assert_eq!(
            r.devices[0].final_allocated,
            base.devices[0].final_allocated
        );
    }

    #[test]
    fn a_trace_of_several_devices_has_no_longer_run() {
        // Two GPUs of one process: phases are recorded on both, as the
        // recorder does, one after the other. Windows between openings
        // ran each device in half the drawn steps (31 allocations of 62).
        let mut t = Trace::default();
        for i in 0..14 {
            t.step(0, i);
            t.step(1, i);
        }
        assert_eq!(longer(&t.evs, 60, 1), None);
    }
}
