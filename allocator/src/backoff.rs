//! Waiting for a lock without a queue: try, spin a little, yield, then
//! sleep in doubling steps, until a deadline.
//!
//! For the locks that must never park a thread: the trace control lock,
//! released by a plain store in a forked child (Note [Trace control across
//! fork] in `trace/control_lock.rs`), and the allocator's locks in a forked
//! child (Note [Locks held at a fork] in `allocator.rs`). Both are rare and
//! short, so the waiter's latency matters little and its CPU time not at all.

use std::time::{Duration, Instant};

/// Calls `attempt` until it gives a value or `deadline` passes (`None`:
/// never); the value, or `None` past the deadline.
pub(crate) fn poll_until<T>(
    deadline: Option<Instant>,
    mut attempt: impl FnMut() -> Option<T>,
) -> Option<T> {
    let mut sleep = Duration::from_micros(20);
    let mut spins = 0u32;
    loop {
        if let Some(v) = attempt() {
            return Some(v);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        if spins < 64 {
            std::hint::spin_loop();
        } else if spins < 80 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(sleep);
            sleep = (sleep * 2).min(Duration::from_millis(1));
        }
        spins = spins.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gives_the_first_value_or_none_past_the_deadline() {
        let mut n = 0;
        assert_eq!(
            poll_until(None, || {
                n += 1;
                (n == 200).then_some(n)
            }),
            Some(200),
            "past the spins and yields into the sleeps"
        );
        let start = Instant::now();
        let wait = Duration::from_millis(30);
        assert_eq!(poll_until(Some(start + wait), || None::<()>), None);
        assert!(start.elapsed() >= wait);
    }
}
