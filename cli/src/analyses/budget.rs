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
//! trace. Blocks and ranges a bound refuses are counted as contradictions
//! of the state (warned of).
//!
//! [`DeviceState`]: crate::analyses::state::DeviceState

/// Iteration boundaries kept (the times of marks and of top-level phase
/// openings), and phases followed open, each for all devices together.
pub const MAX_BOUNDARIES: usize = 1 << 22;

/// Live blocks tracked, and reserved ranges tracked, each for all devices
/// together: far above any real program's, and a bound on memory when a
/// crafted file allocates at millions of addresses (about 240 MB of live
/// blocks in a pass).
pub const MAX_TRACKED: usize = 1 << 21;

/// One bound: the items held against it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    held: usize,
    max: usize,
}

impl Bound {
    fn new(max: usize) -> Bound {
        Bound { held: 0, max }
    }

    /// Whether one more item fits.
    #[inline]
    pub fn room(&self) -> bool {
        self.held < self.max
    }

    /// Takes room for one item, if there is any.
    #[inline]
    pub fn take(&mut self) -> bool {
        let room = self.room();
        self.held += usize::from(room);
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
}

impl Budget {
    /// `tracked` live blocks and as many ranges; `boundaries` iteration
    /// boundaries and as many open phases.
    pub fn new(tracked: usize, boundaries: usize) -> Budget {
        Budget {
            live: Bound::new(tracked),
            ranges: Bound::new(tracked),
            boundaries: Bound::new(boundaries),
            open: Bound::new(boundaries),
        }
    }
}

impl Default for Budget {
    fn default() -> Budget {
        Budget::new(MAX_TRACKED, MAX_BOUNDARIES)
    }
}
