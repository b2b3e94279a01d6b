//! The process clock: monotonic nanoseconds that the allocator's time
//! budgets and its trace share.
//!
//! Note [One clock for decisions and traces]
//! Rationale: a replay reproduces the GPU's peaks to the byte only if every
//! decision sees what the trace recorded. The defragmentation budget
//! (Note [Defragmentation budget]) decides by the clock; if it read one
//! clock mid-call while the trace stamped the call with another, later,
//! a replay (whose clock is the trace's stamps) would credit the budget
//! with different time, and on a slow or busy machine choose differently.
//! Approach: one counter for the process (`quanta`, the TSC where it is
//! invariant), read as nanoseconds since the first reading; the CUDA
//! backend's [`Backend::now_ns`](crate::Backend::now_ns) is this clock, and
//! while a trace records, a device reads it once per locked call and
//! stamps every event of the call, and answers the budget, with that one
//! reading (`DeviceAllocator::call_time`). A trace stores stamps less its
//! start, so differences between stamps are the budget's, exactly.
//! Checked: on real time under heavy load (two cores, the whole test suite
//! or six busy loops alongside), recordings on the simulator and their
//! replays once parted twice in about 300 runs, at budget decisions; that
//! was before a locked call always started with a fresh reading and the
//! clock calibrated in `Allocator::new` (7b61ef9). Since then 1,690 such
//! recordings (six of them on the decision path that load causes, 168
//! failures instead of 171) all replayed exactly. On the simulator's
//! virtual clock advanced between calls, a sweep of 1,200 recordings
//! (pauses of up to 200 ms) replayed exactly, while a replay that ignores
//! the stamps parted from 326 of them; the test
//! `a_recording_on_an_advancing_clock_replays_exactly` keeps 36 of that
//! kind (pauses of up to 50 ms).

use std::sync::OnceLock;

struct ProcessClock {
    clock: quanta::Clock,
    base: u64,
}

static CLOCK: OnceLock<ProcessClock> = OnceLock::new();

/// Nanoseconds since the process first read this clock; never decreases.
#[inline]
pub fn now_ns() -> u64 {
    let c = CLOCK.get_or_init(|| {
        let clock = quanta::Clock::new();
        let base = clock.raw();
        ProcessClock { clock, base }
    });
    c.clock.delta_as_nanos(c.base, c.clock.raw())
}

#[cfg(test)]
mod tests {
    #[test]
    fn never_decreases_and_follows_real_time() {
        let t0 = super::now_ns();
        let mut last = t0;
        for _ in 0..1000 {
            let t = super::now_ns();
            assert!(t >= last);
            last = t;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
        let slept = super::now_ns() - t0;
        assert!(slept >= 4_000_000, "5 ms of sleep read as {slept} ns");
    }
}
