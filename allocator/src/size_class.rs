//! Size rounding and size classes, exactly as PyTorch's caching allocator has them.
//!
//! Requirements (talc-style, checked by the tests below):
//! - `round_size(n) >= n`, and it is a multiple of [`MIN_BLOCK_SIZE`];
//! - `round_size` is monotone: `a <= b` implies `round_size(a) <= round_size(b)`;
//! - `allocation_size(n) >= n` for every rounded `n`.

use crate::config::Config;
pub use crate::config::{POWER2_INTERVALS, power2_bucket};

/// Every size is rounded up to a multiple of this (PyTorch's `kMinBlockSize`).
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Requests of at most this size use the small pool (`kSmallSize`).
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool (`kSmallBuffer`).
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Requests below this (and above [`SMALL_SIZE`]) get one large-buffer segment (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Larger requests get a segment rounded up to this (`kRoundLarge`).
pub const ROUND_LARGE: u64 = 2 << 20;
/// The largest request the allocator considers (256 TiB): anything larger
/// can never fit a device and is refused before any size arithmetic.
pub const MAX_REQUEST: u64 = 1 << 48;

/// Which of the two block pools a size belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    /// Requests of at most 1 MiB, carved from 2 MiB segments.
    Small,
    /// Everything else.
    Large,
}

impl PoolKind {
    /// The pool a rounded request goes to.
    pub fn of(rounded: u64) -> PoolKind {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// PyTorch's name for the pool in stats keys and snapshots.
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small_pool",
            PoolKind::Large => "large_pool",
        }
    }
}

/// Rounds a request up to the block size the allocator hands out.
///
/// Below 512 B the result is 512. With `roundup_power2_divisions` set for the
/// size's bucket (`d > 1`) and `size > 512 * d`, the power-of-two interval
/// holding `size` is cut into `d` steps and `size` goes up to the next step;
/// otherwise the size is rounded up to a multiple of 512.
pub fn round_size(size: u64, config: &Config) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let d = config.power2_divisions_for(size);
    if d > 1 && size > MIN_BLOCK_SIZE * d {
        roundup_power2_next_division(size, d)
    } else {
        size.div_ceil(MIN_BLOCK_SIZE).saturating_mul(MIN_BLOCK_SIZE)
    }
}

/// `roundup_power2_next_division`: a power of two is returned unchanged;
/// otherwise `[2^k, 2^(k+1))` is split into `divisions` steps.
pub fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let step = (floor / divisions).max(1);
    let n = (size - floor).div_ceil(step);
    let out = floor + n * step;
    // Keep the 512 B granularity for tiny steps.
    out.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
}

/// The segment size requested from the backend for a rounded request
/// (`get_allocation_size`): 2 MiB for the small pool, the large-segment size
/// (20 MiB) below 10 MiB, otherwise the request rounded up to 2 MiB.
pub fn allocation_size(rounded: u64, config: &Config) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        // Never smaller than the request, whatever large_segment_size_mb says.
        config
            .large_segment_size
            .max(rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE)
    } else {
        rounded.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pytorch_examples() {
        let c = Config::default();
        assert_eq!(round_size(0, &c), 512);
        assert_eq!(round_size(1, &c), 512);
        assert_eq!(round_size(513, &c), 1024);
        assert_eq!(allocation_size(512, &c), 2 << 20);
        assert_eq!(allocation_size(5 << 20, &c), 20 << 20);
        assert_eq!(allocation_size((10 << 20) + 1, &c), 12 << 20);
        assert_eq!(roundup_power2_next_division(1200, 4), 1536); // 1280, then the 512 B grain
        assert_eq!(roundup_power2_next_division(1 << 21, 4), 1 << 21);
        assert_eq!(
            roundup_power2_next_division((1 << 21) + 1, 4),
            (1 << 21) + (1 << 19)
        );
        let c = Config::parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(round_size((1 << 21) + 1, &c), (1 << 21) + (1 << 19));
        assert_eq!(round_size(1000, &c), 1024);
    }

    #[test]
    fn buckets() {
        assert_eq!(power2_bucket(1), 0);
        assert_eq!(power2_bucket(1 << 20), 0);
        assert_eq!(power2_bucket(1 << 21), 1);
        assert_eq!(power2_bucket(1 << 40), 15);
    }

    proptest! {
        #[test]
        fn rounding_laws(a in 0u64..(1 << 40), b in 0u64..(1 << 40), div in prop::sample::select(vec![0u64, 1, 2, 4, 8, 16])) {
            let c = Config::parse(&format!("roundup_power2_divisions:{div}")).unwrap();
            let (lo, hi) = (a.min(b), a.max(b));
            let (rl, rh) = (round_size(lo, &c), round_size(hi, &c));
            prop_assert!(rl >= lo && rl % MIN_BLOCK_SIZE == 0);
            prop_assert!(rl <= rh);
            prop_assert!(allocation_size(rh, &c) >= rh);
        }

        #[test]
        fn segments_hold_their_request_for_any_large_segment_size(n in 1u64..(64 << 20), mb in 1u64..16) {
            let c = Config::parse(&format!("large_segment_size_mb:{}", mb * 2)).unwrap();
            let r = round_size(n, &c);
            prop_assert!(allocation_size(r, &c) >= r);
        }
    }
}
