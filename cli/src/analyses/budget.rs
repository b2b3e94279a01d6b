//! The bounds on what the states rebuilt from one trace hold: one budget
//! for all the trace's devices together, not one per device.
//!
//! Each device of a trace gets a [`DeviceState`] of its own, and a trace
//! may name up to 1024 devices (`trace::MAX_DEVICES`). With bounds per
//! device, a crafted trace multiplied them by the devices it spread its
//! events over: `summary` took 533 MB on a 135 MiB trace of repeated marks
//! on 16 devices (42 MB with one budget), and 7.6 GB on 2.2 million
//! allocations on each of 16 devices (504 MB). So one [`Budget`] serves
//! all the devices of a pass over a trace, and a state charges it where it
//! grows, as `caching_off` bounds the mark names it follows for the whole
//! trace. What a bound refuses is counted: blocks and ranges as
//! contradictions of the state (warned of), iteration boundaries and open
//! phases in [`Bound::refused`] (warned of by [`Budget::warn_refused`]).
//! `export --parquet` follows ranges of its own, to write a row for each
//! when it ends: they count against [`Budget::held`], and the export warns
//! of what it refused.
//!
//! [`DeviceState`]: crate::analyses::state::DeviceState

use std::path::Path;

use crate::input::warn_once;

/// Iteration boundaries kept (the times of marks and of top-level phase
/// openings), and phases followed open, each for all devices together.
pub const MAX_BOUNDARIES: usize = 1 << 22;

/// Live blocks tracked, and reserved ranges tracked, each for all devices
/// together: far above any real program's, and a bound on memory when a
/// crafted file allocates at millions of addresses (about 240 MB of live
/// blocks in a pass).
pub const MAX_TRACKED: usize = 1 << 21;

/// One bound: the items held against it, and those it refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    held: usize,
    max: usize,
    /// Items [`take`](Self::take) refused.
    pub refused: u64,
}

impl Bound {
    /// Room for `max` items.
    pub fn new(max: usize) -> Bound {
        Bound {
            held: 0,
            max,
            refused: 0,
        }
    }

    /// Whether one more item fits.
    #[inline]
    pub fn room(&self) -> bool {
        self.held < self.max
    }

    /// Takes room for one item, or counts it refused when there is none.
    #[inline]
    pub fn take(&mut self) -> bool {
        let room = self.room();
        if room {
            self.held += 1;
        } else {
            self.refused += 1;
        }
        room
    }

    /// A state's count of items went from `before` to `after`.
    #[inline]
    pub fn moved(&mut self, before: usize, after: usize) {
        self.held = (self.held + after).saturating_sub(before);
    }

    /// The most items held at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Warns, once per file and `key`, of the items refused in a pass over
    /// `path`, if any: `what(refused, max)` says what they were.
    pub fn warn_refused(&self, path: &Path, key: &str, what: impl Fn(u64, usize) -> String) {
        if self.refused > 0 {
            let file = path.display();
            let msg = what(self.refused, self.max);
            warn_once(&format!("{file}: {key}"), &format!("{file}: {msg}"));
        }
    }
}

/// What the device states of one pass over a trace may hold together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Live blocks.
    pub live: Bound,
    /// Reserved ranges and stitched ranges.
    pub ranges: Bound,
    /// Iteration boundaries.
    pub boundaries: Bound,
    /// Open phases.
    pub open: Bound,
    /// Ranges followed to their end for a row each (`export --parquet`:
    /// segments, mapped pages and stitched ranges, not merged).
    pub held: Bound,
}

impl Budget {
    /// `tracked` live blocks and as many ranges of each kind; `boundaries`
    /// iteration boundaries and as many open phases.
    pub fn new(tracked: usize, boundaries: usize) -> Budget {
        Budget {
            live: Bound::new(tracked),
            ranges: Bound::new(tracked),
            held: Bound::new(tracked),
            boundaries: Bound::new(boundaries),
            open: Bound::new(boundaries),
        }
    }

    /// Warns, once per file, of what was refused in a pass over `path`
    /// (blocks and ranges are warned of by the states).
    pub fn warn_refused(&self, path: &Path) {
        self.boundaries.warn_refused(path, "boundaries", |n, max| {
            format!(
                "{n} marks and top-level phase openings past the first {max} (all devices together) were not kept as iteration boundaries: the last iteration kept runs on to the end"
            )
        });
        self.open.warn_refused(path, "open phases", |n, max| {
            format!(
                "{n} phases opened while {max} were open (all devices together) were not followed: what was allocated in them counts in the phase around them"
            )
        });
    }
}

impl Default for Budget {
    fn default() -> Budget {
        Budget::new(MAX_TRACKED, MAX_BOUNDARIES)
    }
}
