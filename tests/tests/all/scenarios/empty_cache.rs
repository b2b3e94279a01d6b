//! `empty_cache` (reference 1.8 `release_cached_blocks`): wait for every
//! outstanding event, then release every unsplit free segment; split
//! segments and live blocks stay.

use gpualloc_tests::{Checked, MIB};

#[test]
fn releases_only_whole_free_segments() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let whole = c.alloc(12 * MIB, 0);
    let a = c.alloc(2 * MIB, 0); // 20 MiB segment
    let b = c.alloc(2 * MIB, 0);
    let small = c.alloc(4096, 0); // 2 MiB small segment
    c.release(whole);
    c.release(a); // the 20 MiB segment stays split: b is live
    c.empty_cache();
    assert_eq!(
        c.stats().num_device_free,
        1,
        "only the whole 12 MiB segment"
    );
    assert_eq!(c.reserved(), 22 * MIB);
    c.release(b);
    c.release(small);
    c.empty_cache();
    assert_eq!(c.reserved(), 0);
    assert_eq!(c.stats().num_device_free, 3);
}

#[test]
fn waits_for_pending_events_first() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let p = c.alloc(12 * MIB, 0);
    c.record_stream(p, 3);
    c.use_on(p, 3);
    c.release(p);
    c.empty_cache();
    assert_eq!(c.stats().num_sync_all_streams, 1);
    assert_eq!(c.sim().counters.wait_event, 1);
    assert_eq!(
        c.reserved(),
        0,
        "the block was freed by the wait, then released"
    );
    assert_eq!(c.sim().live_events(), 0);
}

#[test]
fn empty_cache_on_an_empty_allocator_is_harmless() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    c.empty_cache();
    c.empty_cache();
    assert_eq!(c.stats().num_device_free, 0);
    let p = c.alloc(512, 0);
    c.empty_cache();
    assert_eq!(c.segments(), 1, "a live block keeps its segment");
    c.release(p);
}
