//! Python's `random.Random`, for the synthetic loops that mirror GPU checks
//! written in Python (`tests/gpu/checks.py`): the same seed draws the same
//! sizes, so a replay of [`churn`](super::churn) or
//! [`churn_wide`](super::churn_wide) with the check's seed is the check's
//! own loop, not one like it.
//!
//! CPython's generator is MT19937 ([`rand_mt`]) seeded with the 32-bit
//! words of the seed (`init_by_array`); `random()` takes 53 bits from two
//! outputs, `uniform(a, b)` is `a + (b - a) * random()`, and `choice`
//! draws an index with `getrandbits` and rejection (`_randbelow`). These
//! are CPython's algorithms since 3.2 and unchanged through 3.13.

use rand_mt::Mt;

/// `random.Random(seed)` of CPython, for the calls the churn checks make.
pub struct PythonRandom(Mt);

impl PythonRandom {
    /// `random.Random(seed)`.
    pub fn new(seed: u32) -> PythonRandom {
        PythonRandom(Mt::new_with_key([seed]))
    }

    /// `random()`: uniform in `[0, 1)`, 53 bits.
    pub fn random(&mut self) -> f64 {
        let a = f64::from(self.0.next_u32() >> 5);
        let b = f64::from(self.0.next_u32() >> 6);
        (a * 67_108_864.0 + b) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `uniform(a, b)`.
    pub fn uniform(&mut self, a: f64, b: f64) -> f64 {
        a + (b - a) * self.random()
    }

    /// `choice(seq)`; `seq` must not be empty.
    pub fn choice<T: Copy>(&mut self, seq: &[T]) -> T {
        seq[self.below(seq.len() as u32)]
    }

    /// `_randbelow(n)`: `getrandbits(n.bit_length())` until below `n`.
    fn below(&mut self, n: u32) -> usize {
        assert!(n > 0, "a choice from an empty sequence");
        let k = u32::BITS - n.leading_zeros();
        loop {
            let r = self.0.next_u32() >> (32 - k);
            if r < n {
                return r as usize;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PythonRandom;

    // The values are CPython 3.11's.

    #[test]
    fn uniform_draws_python_values() {
        // [int(math.exp(r.uniform(math.log(512), math.log(64 << 20))))
        //  for _ in range(5)], r = random.Random(5)
        let mut r = PythonRandom::new(5);
        let (lo, hi) = ((512f64).ln(), ((64u64 << 20) as f64).ln());
        let got: Vec<u64> = (0..5).map(|_| r.uniform(lo, hi).exp() as u64).collect();
        assert_eq!(got, [788_815, 3_201_638, 6_007_322, 34_061_882, 3_131_181]);
        // random.Random(0).random()
        assert_eq!(PythonRandom::new(0).random(), 0.844_421_851_525_048_1);
    }

    #[test]
    fn choice_draws_python_values() {
        // [r.choice([256, 4096, 65536, 1 << 20, 5 << 20, 24 << 20])
        //  for _ in range(8)], r = random.Random(4)
        let mut r = PythonRandom::new(4);
        let sizes = [256, 4096, 65536, 1 << 20, 5 << 20, 24 << 20];
        let got: Vec<u64> = (0..8).map(|_| r.choice(&sizes)).collect();
        assert_eq!(
            got,
            [4096, 65536, 256, 24 << 20, 1 << 20, 1 << 20, 4096, 256]
        );
    }
}
