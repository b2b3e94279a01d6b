//! A small deterministic pseudo-random generator for reproducible inputs.

/// A pseudo-random generator for reproducible test and benchmark inputs
/// (the fuzzers, the replay tests, `gpualloc generate`): the same state
/// always gives the same sequence, on every platform. Not for
/// cryptography, nor for anything an adversary may predict.
///
/// Two algorithms, each kept because sequences drawn from it are pinned
/// (recorded seeds, benchmark inputs, generated traces):
/// [`xorshift64`](Rng::xorshift64) returns Marsaglia's xorshift state
/// (shifts 13, 7, 17) itself, and [`xorshift64_star`](Rng::xorshift64_star)
/// the state (shifts 12, 25, 27) times a constant, whose low bits are
/// better mixed. Changing either changes every input drawn from it.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
    star: bool,
}

impl Rng {
    /// xorshift64 from `state`, which must not be 0 (a zero state stays 0).
    pub fn xorshift64(state: u64) -> Rng {
        assert_ne!(state, 0, "an xorshift state of 0 gives only zeros");
        Rng { state, star: false }
    }

    /// xorshift64* from `state`, which must not be 0 (a zero state stays 0).
    pub fn xorshift64_star(state: u64) -> Rng {
        assert_ne!(state, 0, "an xorshift state of 0 gives only zeros");
        Rng { state, star: true }
    }

    /// The next value.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let x = &mut self.state;
        if self.star {
            *x ^= *x >> 12;
            *x ^= *x << 25;
            *x ^= *x >> 27;
            x.wrapping_mul(0x2545_f491_4f6c_dd1d)
        } else {
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            *x
        }
    }

    /// A value in `0..n` (the next value modulo `n`, so very slightly
    /// biased for a large `n`); 0 for `n` = 0, drawing nothing.
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// [`below`](Rng::below) for a length or position: a value in `0..n`,
    /// 0 for `n` = 0.
    #[inline]
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// An element of `xs`, which must not be empty.
    #[inline]
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.index(xs.len())]
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    /// The first values from state 1, computed apart from this code.
    #[test]
    fn the_sequences_are_pinned() {
        let mut a = Rng::xorshift64(1);
        let first: Vec<u64> = (0..3).map(|_| a.next_u64()).collect();
        assert_eq!(
            first,
            [
                1_082_269_761,
                1_152_992_998_833_853_505,
                11_177_516_664_432_764_457
            ]
        );
        let mut b = Rng::xorshift64_star(1);
        let first: Vec<u64> = (0..3).map(|_| b.next_u64()).collect();
        assert_eq!(
            first,
            [
                5_180_492_295_206_395_165,
                12_380_297_144_915_551_517,
                13_389_498_078_930_870_103
            ]
        );
    }

    #[test]
    fn below_zero_draws_nothing() {
        let (mut a, mut b) = (Rng::xorshift64_star(7), Rng::xorshift64_star(7));
        assert_eq!(a.below(0), 0);
        assert_eq!(a.index(0), 0);
        assert_eq!(a.next_u64(), b.next_u64());
        assert!((0..1000).all(|_| a.below(10) < 10));
    }
}
