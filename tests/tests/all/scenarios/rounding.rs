//! Rounding (reference 1.3): 512 B granularity, and `roundup_power2_divisions`
//! with one value or a list of size buckets. Checked on the block sizes the
//! allocator hands out (`allocated_bytes`), not only on `round_size`.
//!
//! Rounding does not depend on the policy: every test runs under both.

use gpualloc_tests::{Checked, KIB, MIB};

const S: u64 = 0;

/// Allocates `size` and returns the block size the allocator charged for it.
fn charged(c: &mut Checked, size: u64) -> u64 {
    let before = c.stats().allocated_bytes.all.current;
    let p = c.alloc(size, S);
    let got = (c.stats().allocated_bytes.all.current - before) as u64;
    c.release(p);
    got
}

fn sizes_round_up_to_512(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    for (size, want) in [
        (1, 512),
        (511, 512),
        (512, 512),
        (513, 1024),
        (1000, 1024),
        (4097, 4608),
    ] {
        assert_eq!(charged(&mut c, size), want, "{size} B");
    }
    assert_eq!(
        c.stats().requested_bytes.all.allocated,
        1 + 511 + 512 + 513 + 1000 + 4097
    );
}

fn single_division_value_applies_to_every_bucket(policy: &str) {
    let mut c = Checked::with(1 << 30, &format!("{policy},roundup_power2_divisions:4"));
    // At most 512 * 4 = 2 KiB: plain 512 B rounding.
    assert_eq!(charged(&mut c, 1200), 1536);
    assert_eq!(charged(&mut c, 2048), 2048);
    // Above: the power-of-two interval is cut in 4 steps.
    assert_eq!(charged(&mut c, 3000), 3 * KIB); // [2K, 4K) in 512 B steps
    assert_eq!(charged(&mut c, 5 * KIB), 5 * KIB); // [4K, 8K) in 1 KiB steps
    assert_eq!(charged(&mut c, 5 * KIB + 1), 6 * KIB);
    assert_eq!(charged(&mut c, MIB + 1), MIB + 256 * KIB);
    assert_eq!(charged(&mut c, 5 * MIB + 1), 6 * MIB);
    assert_eq!(charged(&mut c, 40 * MIB), 40 * MIB); // a step boundary
    assert_eq!(charged(&mut c, 33 * MIB), 40 * MIB);
    // Powers of two are unchanged.
    assert_eq!(charged(&mut c, 4 * MIB), 4 * MIB);
    assert_eq!(charged(&mut c, 64 * MIB), 64 * MIB);
}

fn division_list_applies_per_bucket(policy: &str) {
    // Buckets: 1 MB (and below) -> 2, 8 MB -> 4, 64 MB and up -> 8.
    let mut c = Checked::with(
        1 << 30,
        &format!("{policy},roundup_power2_divisions:[1:2,8:4,64:8]"),
    );
    assert_eq!(charged(&mut c, MIB + KIB), 3 * MIB / 2); // [1M, 2M) in 2 steps
    assert_eq!(
        charged(&mut c, 3 * MIB + 1),
        3 * MIB + 512,
        "bucket 2 MB: not set, 512 B rounding"
    );
    assert_eq!(charged(&mut c, 9 * MIB), 10 * MIB); // [8M, 16M) in 4 steps
    assert_eq!(charged(&mut c, 65 * MIB), 72 * MIB); // [64M, 128M) in 8 steps
    // 130 MiB + 512 is split off its 132 MiB segment (or its mapped pages): the block is exact.
    assert_eq!(
        charged(&mut c, 130 * MIB + 512),
        130 * MIB + 512,
        "bucket 128 MB: not set"
    );
}

fn division_list_with_catch_all(policy: &str) {
    let mut c = Checked::with(
        1 << 30,
        &format!("{policy},roundup_power2_divisions:[1:2,>:4]"),
    );
    assert_eq!(charged(&mut c, MIB + KIB), 3 * MIB / 2);
    assert_eq!(
        charged(&mut c, 17 * MIB),
        20 * MIB,
        "'>' covers every later bucket"
    );
    assert_eq!(charged(&mut c, 129 * MIB), 160 * MIB);
}

/// Regression (fixed in cfa8ee0): PyTorch's parser fills every bucket below the first listed size with
/// that first divisor (`AcceleratorAllocatorConfig::parseRoundUpPower2Divisions`,
/// `if (first_value) std::fill(begin, begin + index, value)`), so with
/// `[64:4,>:8]` a 3 MiB request uses 4 divisions and becomes 3.5 MiB.
/// gpualloc used to leave those buckets at 0 (512 B rounding).
fn first_list_entry_also_covers_the_smaller_buckets(policy: &str) {
    let mut c = Checked::with(
        1 << 30,
        &format!("{policy},roundup_power2_divisions:[64:4,>:8]"),
    );
    assert_eq!(charged(&mut c, 3 * MIB + 1), 7 * MIB / 2);
    assert_eq!(charged(&mut c, 65 * MIB), 80 * MIB);
    assert_eq!(charged(&mut c, 129 * MIB), 144 * MIB);
}

under_both_policies!(
    sizes_round_up_to_512,
    single_division_value_applies_to_every_bucket,
    division_list_applies_per_bucket,
    division_list_with_catch_all,
    first_list_entry_also_covers_the_smaller_buckets,
);
