//! `garbage_collection_threshold` (reference 1.8 GC): with a memory limit,
//! once reserved memory passes threshold x limit, a malloc that misses the
//! cache first releases old whole cached large segments, without syncing.

use gpualloc_tests::{Checked, MIB};

/// 200 MiB device at fraction 0.5: a 100 MiB limit, GC above 50 MiB.
const CONF: &str = "policy:pytorch,cross_stream_reuse:true,garbage_collection_threshold:0.5,per_process_memory_fraction:0.5";

#[test]
fn old_cached_segments_are_released_past_the_threshold() {
    let mut c = Checked::with(200 * MIB, CONF);
    let keep = c.alloc(40 * MIB, 0);
    let old = c.alloc(20 * MIB, 0);
    c.release(old); // reserved 60 MiB > 50 MiB, 20 MiB cached
    let frees = c.stats().num_device_free;
    c.alloc(24 * MIB, 0); // misses the cache (20 < 24)
    assert_eq!(
        c.stats().num_device_free,
        frees + 1,
        "GC released the cached segment"
    );
    assert_eq!(c.reserved(), 64 * MIB);
    assert_eq!(c.stats().num_sync_all_streams, 0, "GC does not synchronize");
    assert_eq!(c.stats().num_alloc_retries, 0, "no OOM path was needed");
    c.release(keep);
}

#[test]
fn no_collection_below_the_threshold() {
    let mut c = Checked::with(200 * MIB, CONF);
    let a = c.alloc(20 * MIB, 0);
    c.release(a);
    c.alloc(24 * MIB, 0); // reserved 20 MiB <= 50 MiB before the miss
    assert_eq!(c.stats().num_device_free, 0);
    assert_eq!(c.reserved(), 44 * MIB);
}

#[test]
fn no_collection_without_a_limit() {
    let mut c = Checked::with(
        200 * MIB,
        "policy:pytorch,cross_stream_reuse:true,garbage_collection_threshold:0.5",
    );
    c.alloc(80 * MIB, 0);
    let a = c.alloc(20 * MIB, 0);
    c.release(a);
    c.alloc(24 * MIB, 0);
    assert_eq!(
        c.stats().num_device_free,
        0,
        "no fraction or limit: GC is off"
    );
}

#[test]
fn split_segments_and_the_small_pool_are_not_collected() {
    let mut c = Checked::with(200 * MIB, CONF);
    c.alloc(40 * MIB, 0);
    let small = c.alloc(4096, 0);
    let split = c.alloc(2 * MIB, 0); // a 20 MiB segment, split
    c.alloc(4 * MIB, 0); // keeps the segment split
    c.release(split);
    c.release(small);
    c.alloc(30 * MIB, 0); // reserved 62 MiB > 50 MiB; nothing whole is cached
    assert_eq!(c.stats().num_device_free, 0);
}

/// Regression (fixed in cfa8ee0): GC releases blocks whose age is at or above the *average* age.
/// With ages 2 (14 MiB) and 1 (12 MiB) the average is 1.5, so only the
/// older block qualifies, and releasing it (14 MiB) reaches the 12 MiB
/// target. gpualloc used to truncate the average to 1 and release the
/// younger, smaller block first (it walks blocks by size).
#[test]
fn only_blocks_at_least_as_old_as_the_average_are_collected() {
    let mut c = Checked::with(200 * MIB, CONF);
    c.alloc(20 * MIB, 0);
    let older = c.alloc(14 * MIB, 0);
    let younger = c.alloc(12 * MIB, 0);
    c.release(older); // cached at lookup 3
    c.alloc(16 * MIB, 0); // lookup 4 misses; reserved 46 MiB: no GC yet
    c.release(younger); // cached at lookup 4
    // Lookup 5 misses with reserved 62 MiB: ages 2 and 1, target 12 MiB.
    c.alloc(18 * MIB, 0);
    let cached: Vec<u64> = c
        .snapshot()
        .iter()
        .filter(|s| s.blocks.len() == 1 && s.blocks[0].state == gpualloc::BlockState::Free)
        .map(|s| s.total_size)
        .collect();
    assert_eq!(
        cached,
        vec![12 * MIB],
        "the older 14 MiB block goes, the younger stays"
    );
}

/// PyTorch's average age counts only cached blocks that are not split
/// pieces: young pieces of a split segment must not pull the average down
/// and make an older whole segment (here B, 32 MiB) look old enough to free.
#[test]
fn the_average_age_leaves_split_pieces_out() {
    let mut c = Checked::with(
        280 * MIB,
        "policy:pytorch,garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
    );
    let _z1 = c.alloc(3 * MIB, 0);
    let a = c.alloc(30 * MIB, 0);
    let b = c.alloc(32 * MIB, 0);
    c.release(a);
    let z2 = c.alloc(3 * MIB, 0);
    c.release(b);
    let _z3 = c.alloc(3 * MIB, 0);
    c.release(z2);
    c.alloc(40 * MIB, 0);
    assert_eq!(c.reserved(), 92 * MIB, "B stays cached, as under PyTorch");
}

/// The cache-only lookup the C ABI makes before a miss callback (Note
/// [Free-memory callbacks]) ages cached segments as one `malloc` does: a
/// miss followed by `malloc` counts one lookup, so garbage collection
/// releases what it would have (from review, with this test).
#[test]
fn the_miss_path_ages_cached_segments_as_one_malloc() {
    fn run(miss_path: bool) -> i64 {
        let mut c = Checked::with(200 * MIB, CONF);
        let alloc = |c: &mut Checked, size: u64| -> u64 {
            if miss_path && let Some(p) = c.malloc_cached(size, 0) {
                return p;
            }
            c.alloc(size, 0)
        };
        let a1 = alloc(&mut c, 20 * MIB);
        let a2 = alloc(&mut c, 12 * MIB);
        let a3 = alloc(&mut c, 14 * MIB);
        c.release(a1);
        let m = alloc(&mut c, 22 * MIB); // a miss
        c.release(a2);
        c.release(m);
        let _m = alloc(&mut c, 22 * MIB); // a hit
        c.release(a3);
        let f = c.stats().num_device_free;
        alloc(&mut c, 30 * MIB); // a miss past the threshold: GC
        c.stats().num_device_free - f
    }
    assert_eq!(run(true), run(false));
}
