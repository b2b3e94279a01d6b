//! Request sizes: power-of-two histogram, most frequent and largest sizes.

use rustc_hash::FxHashMap;

/// Distinct sizes counted exactly before the table stops growing.
const MAX_DISTINCT: usize = 1 << 20;

/// Request-size statistics.
pub struct Sizes {
    counts: FxHashMap<u64, u64>,
    /// Requests whose size was not counted exactly (table full).
    pub overflow: u64,
    /// `log2` buckets: `hist[k]` counts sizes in `[2^k, 2^(k+1))` (`hist[0]` also 0).
    pub hist: [u64; 64],
    /// Bytes requested per bucket.
    pub hist_bytes: [u64; 64],
    largest: Vec<u64>,
}

impl Default for Sizes {
    fn default() -> Self {
        Sizes {
            counts: FxHashMap::default(),
            overflow: 0,
            hist: [0; 64],
            hist_bytes: [0; 64],
            largest: Vec::new(),
        }
    }
}

impl Sizes {
    /// Counts one request.
    #[inline]
    pub fn add(&mut self, size: u64) {
        let k = 63 - (size | 1).leading_zeros() as usize;
        self.hist[k] += 1;
        self.hist_bytes[k] = self.hist_bytes[k].saturating_add(size);
        if let Some(c) = self.counts.get_mut(&size) {
            *c += 1;
            return;
        }
        if self.counts.len() < MAX_DISTINCT {
            self.counts.insert(size, 1);
        } else {
            self.overflow += 1;
        }
        if self.largest.len() < 10 || size > self.largest[self.largest.len() - 1] {
            self.largest.push(size);
            self.largest.sort_unstable_by(|a, b| b.cmp(a));
            self.largest.dedup();
            self.largest.truncate(10);
        }
    }

    /// The `n` most frequent sizes with their counts.
    pub fn most_frequent(&self, n: usize) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self.counts.iter().map(|(&s, &c)| (s, c)).collect();
        v.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(b.0.cmp(&a.0)));
        v.truncate(n);
        v
    }

    /// The largest distinct sizes (up to 10) with their counts.
    pub fn largest(&self) -> Vec<(u64, u64)> {
        self.largest
            .iter()
            .map(|s| (*s, self.counts.get(s).copied().unwrap_or(0)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sizes() {
        let mut s = Sizes::default();
        for x in [512, 512, 512, 4096, 1 << 30, 7] {
            s.add(x);
        }
        assert_eq!(s.most_frequent(1), vec![(512, 3)]);
        assert_eq!(s.largest()[0], (1 << 30, 1));
        assert_eq!(s.hist[9], 3);
        assert_eq!(s.hist[2], 1);
    }
}
