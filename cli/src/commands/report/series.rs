//! Detail windows of the report's memory chart: the gauges at a finer
//! resolution over a short stretch around a moment that matters (a peak, an
//! OOM), which the page switches to when zoomed in there. Like the main
//! series, each bucket holds the minimum and maximum of allocated, active
//! and reserved bytes, including the value carried into it.

use serde_json::{Value, json};

use crate::analyses::state::Gauges;

/// Buckets per window.
pub const WINDOW_BUCKETS: usize = 1000;
/// A window spans this fraction of the device's events' time span.
pub const WINDOW_FRACTION: u64 = 40;

/// One window, fed every event of its device.
pub struct Window {
    start: u64,
    width: u64,
    min: Vec<Gauges>,
    max: Vec<Gauges>,
    /// Buckets filled so far (the value before the window carries in).
    filled: usize,
    last: Gauges,
}

fn fold(lo: &mut Gauges, hi: &mut Gauges, g: &Gauges) {
    lo.allocated = lo.allocated.min(g.allocated);
    lo.active = lo.active.min(g.active);
    lo.reserved = lo.reserved.min(g.reserved);
    hi.allocated = hi.allocated.max(g.allocated);
    hi.active = hi.active.max(g.active);
    hi.reserved = hi.reserved.max(g.reserved);
}

impl Window {
    /// A window centred on `at` (ns from the device's first event) for a
    /// device whose events span `span` ns.
    pub fn around(at: u64, span: u64) -> Window {
        let len = (span / WINDOW_FRACTION).max(WINDOW_BUCKETS as u64);
        let width = len.div_ceil(WINDOW_BUCKETS as u64);
        let start = at
            .saturating_sub(len / 2)
            .min(span.saturating_sub(width * WINDOW_BUCKETS as u64));
        Window {
            start,
            width,
            min: Vec::with_capacity(WINDOW_BUCKETS),
            max: Vec::with_capacity(WINDOW_BUCKETS),
            filled: 0,
            last: Gauges::default(),
        }
    }

    fn fill_to(&mut self, b: usize) {
        while self.filled <= b.min(WINDOW_BUCKETS - 1) {
            self.min.push(self.last);
            self.max.push(self.last);
            self.filled += 1;
        }
    }

    /// The gauges `g` after an event at `t` (ns from the first event).
    #[inline]
    pub fn observe(&mut self, t: u64, g: &Gauges) {
        if t >= self.start {
            let b = ((t - self.start) / self.width) as usize;
            if b < WINDOW_BUCKETS {
                self.fill_to(b);
                let k = self.filled - 1;
                fold(&mut self.min[k], &mut self.max[k], g);
            } else if self.filled < WINDOW_BUCKETS {
                self.fill_to(WINDOW_BUCKETS - 1);
            }
        }
        self.last = *g;
    }

    /// `{start, width, series}` with the series named as the main one's.
    pub fn into_json(mut self) -> Value {
        self.fill_to(WINDOW_BUCKETS - 1);
        let col = |v: &[Gauges], f: fn(&Gauges) -> u64| v.iter().map(f).collect::<Vec<u64>>();
        json!({
            "start": self.start,
            "width": self.width,
            "series": {
                "alloc_min": col(&self.min, |g| g.allocated),
                "alloc_max": col(&self.max, |g| g.allocated),
                "active_min": col(&self.min, |g| g.active),
                "active_max": col(&self.max, |g| g.active),
                "res_min": col(&self.min, |g| g.reserved),
                "res_max": col(&self.max, |g| g.reserved),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(allocated: u64) -> Gauges {
        Gauges {
            allocated,
            active: allocated,
            reserved: 100,
            requested: 0,
        }
    }

    #[test]
    fn carries_the_value_in_and_keeps_both_extremes() {
        // Span 40_000 ns: a window of 1000 ns, 1 ns per bucket, from 19_500.
        let mut w = Window::around(20_000, 40_000);
        w.observe(10, &g(7));
        w.observe(20_000, &g(9));
        w.observe(20_000, &g(3));
        w.observe(30_000, &g(1));
        let v = w.into_json();
        assert_eq!(
            (v["start"].as_u64(), v["width"].as_u64()),
            (Some(19_500), Some(1))
        );
        let (lo, hi) = (&v["series"]["alloc_min"], &v["series"]["alloc_max"]);
        assert_eq!(
            (lo[0].as_u64(), hi[0].as_u64()),
            (Some(7), Some(7)),
            "carried in"
        );
        assert_eq!((lo[500].as_u64(), hi[500].as_u64()), (Some(3), Some(9)));
        assert_eq!(
            (lo[999].as_u64(), hi[999].as_u64()),
            (Some(3), Some(3)),
            "flat after"
        );
        assert_eq!(lo.as_array().unwrap().len(), WINDOW_BUCKETS);
    }
}
