//! gpualloc's cross-stream reuse (Note [Cross-stream reuse] in device.rs)
//! must keep every invariant of PyTorch's allocator: coalesced free
//! neighbours, and segments that `empty_cache` can give back once free.

use gpualloc_tests::{Checked, MIB};

const A: u64 = 7;
const B: u64 = 9;

/// Regression (fixed in cfa8ee0): the remainder split off a block taken
/// from another stream was not merged with a free neighbour of the taking
/// stream, and `check_invariants` reported unmerged adjacent free blocks.
#[test]
fn split_remainder_of_a_taken_block_merges_with_its_free_neighbour() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    // One 20 MiB segment of stream A: [a1 2][a2 12][6 free A].
    let a1 = c.alloc(2 * MIB, A);
    let a2 = c.alloc(12 * MIB, A);
    // B has no cache: it takes A's 6 MiB remainder: [a1][a2][b1 2 B][4 free B].
    let b1 = c.alloc(2 * MIB, B);
    assert_eq!(c.segments(), 1);
    c.release(b1); // [a1][a2][6 free B]
    c.release(a2); // [a1][12 free A][6 free B]
    // B needs 8 MiB: its own 6 MiB block is too small, so it takes A's 12 MiB
    // block and splits it: [a1][8 B][4 free B][6 free B] must merge the last two.
    let b2 = c.alloc(8 * MIB, B);
    c.release(b2);
    c.release(a1);
}

/// Regression (fixed in cfa8ee0): a segment whose blocks were handed to two
/// streams was never released, even with every block free and `empty_cache`
/// run. PyTorch's `empty_cache` returns every fully free segment.
#[test]
fn empty_cache_releases_a_segment_shared_by_two_streams_once_all_is_free() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(1000, A); // 2 MiB small segment of stream A
    let b = c.alloc(1000, B); // B takes A's cached remainder
    assert_eq!(c.segments(), 1);
    c.release(a);
    c.release(b);
    c.complete_all();
    c.empty_cache();
    assert_eq!(
        c.reserved(),
        0,
        "a fully free segment stays reserved: {:?}",
        c.snapshot()
    );
}

/// Regression (fixed in cfa8ee0): the same leak made a spurious
/// out-of-memory error, since the OOM path could not release it either.
#[test]
fn out_of_memory_path_can_release_a_segment_shared_by_two_streams() {
    let mut c = Checked::with(24 * MIB, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(2 * MIB, A); // 20 MiB segment of A
    let b = c.alloc(2 * MIB, B); // B takes A's remainder
    c.release(a);
    c.release(b);
    // Nothing is allocated. 19 MiB fits in neither cached piece (2 and 18
    // MiB) and needs a 20 MiB segment, which fits once the old one goes.
    let r = c.malloc(19 * MIB, A);
    assert!(r.is_ok(), "nothing allocated, yet: {}", r.unwrap_err());
}

/// Regression: `empty_cache` fuses a free segment split among streams
/// before releasing it (the release waits for the device). When the release
/// failed, the fused block stayed cached under the first stream while the
/// other stream's work on it might still run; the harness then saw it
/// handed to the first stream unordered. Now a failed release synchronizes
/// the device first.
#[test]
fn a_segment_fused_for_a_release_that_fails_is_not_handed_over_unordered() {
    use gpualloc::backend::SimCall;
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(4 * MIB, A); // a 20 MiB segment: a, then 16 MiB free of A
    let b = c.alloc(16 * MIB, B); // B takes A's remainder
    c.use_on(b, B); // B's work on it still queued
    c.release(b);
    c.release(a);
    c.sim_mut().fail_call(SimCall::Release, 1);
    assert!(c.dev.empty_cache().is_err(), "cuMemFree failed once");
    c.check();
    // The whole segment for A: only once B's work is known done.
    let p = c.alloc(20 * MIB, A);
    c.release(p);
    c.check();
}
