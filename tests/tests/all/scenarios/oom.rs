//! The out-of-memory path in PyTorch's order (reference 1.8): free blocks
//! whose events are done; release oversize cached blocks (with
//! `max_split_size`) and retry; wait for every event, release every unsplit
//! cached segment and retry; then fail with the numbers.

use gpualloc::{AllocError, BackendError};
use gpualloc_tests::{Checked, MIB};

#[test]
fn completed_events_are_processed_before_growing() {
    let mut c = Checked::with(40 * MIB, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(30 * MIB, 0);
    c.record_stream(a, 5);
    c.use_on(a, 5);
    c.release(a);
    c.complete(5);
    // The event is done: the first poll of the malloc frees the block.
    assert_eq!(c.alloc(30 * MIB, 0), a);
    assert_eq!(c.stats().num_sync_all_streams, 0);
    assert_eq!(c.stats().num_alloc_retries, 0);
}

#[test]
fn retry_after_syncing_and_releasing_every_cached_segment() {
    let mut c = Checked::with(80 * MIB, "policy:pytorch,cross_stream_reuse:true");
    let cached = c.alloc(4 * MIB, 0); // a 20 MiB segment
    c.release(cached);
    let _live = c.alloc(30 * MIB, 0);
    let pending = c.alloc(22 * MIB, 0);
    c.record_stream(pending, 5);
    c.use_on(pending, 5);
    c.release(pending); // waits on an event of stream 5, not completed
    assert_eq!(c.reserved(), 72 * MIB);
    // 24 MiB: no fit, the device is full. No max_split_size: straight to
    // the full release, which first waits for the pending event.
    let p = c.alloc(24 * MIB, 0);
    assert_ne!(p, 0);
    let s = c.stats();
    assert_eq!(s.num_sync_all_streams, 1);
    assert_eq!(s.num_alloc_retries, 1);
    assert_eq!(s.num_device_free, 2, "the 20 MiB and the 22 MiB segments");
    assert_eq!(s.num_ooms, 0);
    assert_eq!(c.sim().counters.wait_event, 1);
    assert_eq!(c.sim().counters.allocate_failed, 1);
    assert_eq!(c.reserved(), 54 * MIB);
}

#[test]
fn oversize_cached_block_is_released_before_the_full_release() {
    let mut c = Checked::with(
        100 * MIB,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:32",
    );
    let over = c.alloc(40 * MIB, 0);
    let normal = c.alloc(4 * MIB, 0); // 20 MiB segment, not oversize (20 < 32)
    let _live = c.alloc(36 * MIB, 0);
    c.release(over);
    c.release(normal);
    // 30 MiB: the 20 MiB block is too small, the 40 MiB one oversize.
    // 96 + 30 > 100: release the oversize block, retry.
    c.alloc(30 * MIB, 0);
    let s = c.stats();
    assert_eq!(s.num_device_free, 1, "only the oversize block");
    assert_eq!(s.num_alloc_retries, 0, "the full release was not needed");
    assert_eq!(s.num_sync_all_streams, 0);
    assert_eq!(c.reserved(), 86 * MIB, "the 20 MiB segment is still cached");
}

#[test]
fn oversize_blocks_released_largest_first_until_enough() {
    let mut c = Checked::with(
        100 * MIB,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:20",
    );
    let a = c.alloc(22 * MIB, 0);
    let b = c.alloc(24 * MIB, 0);
    let d = c.alloc(26 * MIB, 0);
    let _live = c.alloc(26 * MIB, 0);
    for p in [a, b, d] {
        c.release(p);
    }
    // 48 MiB: no single cached block is big enough; 26 + 24 >= 48 is.
    c.alloc(48 * MIB, 0);
    assert_eq!(c.stats().num_device_free, 2);
    assert_eq!(c.stats().num_alloc_retries, 0);
    assert_eq!(c.reserved(), (22 + 26 + 48) * MIB, "the 22 MiB block stays");
}

#[test]
fn failure_reports_the_numbers() {
    let mut c = Checked::with(64 * MIB, "policy:pytorch,cross_stream_reuse:true");
    let _a = c.alloc(30 * MIB, 0);
    let b = c.alloc(12 * MIB, 0);
    let _d = c.alloc(14 * MIB, 0);
    c.release(b); // 12 MiB cached, reserved 56 MiB, 8 MiB free on the device
    // 22 MiB: even with the cache released, 44 + 22 > 64.
    let err = c.malloc(22 * MIB, 0).unwrap_err();
    let AllocError::OutOfMemory(r) = &err else {
        panic!("expected OutOfMemory, got {err:?}")
    };
    assert_eq!(r.requested, 22 * MIB);
    assert_eq!(r.needed, 22 * MIB);
    assert_eq!(
        r.cause,
        Some(BackendError::OutOfMemory {
            requested: 22 * MIB
        })
    );
    assert_eq!(r.allocated, 44 * MIB);
    assert_eq!(
        r.reserved,
        44 * MIB,
        "the retry released the cached 12 MiB segment"
    );
    assert_eq!(r.device_free, 20 * MIB);
    assert_eq!(r.device_total, 64 * MIB);
    assert_eq!(r.largest_free_block, 0);
    assert_eq!(r.external_fragmentation, 0.0);
    assert_eq!(r.limit, None);
    let s = c.stats();
    assert_eq!(
        (s.num_ooms, s.num_alloc_retries, s.num_sync_all_streams),
        (1, 1, 1)
    );
}

#[test]
fn report_shows_fragmentation_of_split_cached_blocks() {
    let mut c = Checked::with(40 * MIB, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(2 * MIB, 0);
    let b = c.alloc(8 * MIB, 0);
    let _keep = c.alloc(4 * MIB, 0); // [a 2][b 8][keep 4][6 free] in 20 MiB
    c.release(a);
    c.release(b); // [10 free][keep][6 free]: split, cannot be released
    let err = c.malloc(24 * MIB, 0).unwrap_err();
    let AllocError::OutOfMemory(r) = &err else {
        panic!("expected OutOfMemory, got {err:?}")
    };
    assert_eq!(r.largest_free_block, 10 * MIB);
    assert!((r.external_fragmentation - 6.0 / 16.0).abs() < 1e-9);
    assert!((r.unallocated_fraction - 16.0 / 20.0).abs() < 1e-9);
    assert_eq!(r.reserved, 20 * MIB);
    assert_eq!(r.device_free, 20 * MIB);
}

#[test]
fn request_larger_than_the_device_is_too_large() {
    let mut c = Checked::with(64 * MIB, "policy:pytorch,cross_stream_reuse:true");
    match c.malloc(65 * MIB, 0) {
        Err(AllocError::TooLarge {
            requested,
            needed,
            max,
            ..
        }) => {
            assert_eq!((requested, needed, max), (65 * MIB, 66 * MIB, 64 * MIB));
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(c.stats().num_ooms, 1);
    // Never fits, even on an empty device; a fitting request still works.
    c.alloc(60 * MIB, 0);
}

#[test]
fn a_request_that_never_fits_does_not_flush_the_cache() {
    let mut c = Checked::with(64 * MIB, "policy:pytorch,cross_stream_reuse:true");
    let p = c.alloc(4 * MIB, 0);
    c.release(p);
    let before = c.stats().reserved_bytes.all.current;
    assert!(matches!(
        c.malloc(65 * MIB, 0),
        Err(AllocError::TooLarge { .. })
    ));
    assert_eq!(
        c.stats().reserved_bytes.all.current,
        before,
        "the cached segment stays"
    );
    assert_eq!(c.stats().num_alloc_retries, 0);
    assert_eq!(c.stats().num_sync_all_streams, 0);
}

#[test]
fn injected_backend_failure_takes_the_retry_path() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    c.sim_mut().fail_allocate_at(1);
    let p = c.alloc(4 * MIB, 0);
    assert_ne!(p, 0);
    let s = c.stats();
    assert_eq!(
        (s.num_alloc_retries, s.num_sync_all_streams, s.num_ooms),
        (1, 1, 0)
    );
    assert_eq!(c.sim().counters.allocate_failed, 1);
}

/// A request that a cached block of another stream would fit, where that
/// block cannot be given back (its segment holds a live block): the report
/// says the larger cached blocks are other streams' or other pools', not
/// that the cache is fragmented.
#[test]
fn report_tells_cached_blocks_of_other_streams_from_fragmentation() {
    let mut c = Checked::with(100 * MIB, "policy:pytorch");
    let _a = c.alloc(4 * MIB, 1); // a 20 MiB segment on stream 1: [a 4][16 free]
    let _b = c.alloc(70 * MIB, 2); // 10 MiB left on the device
    let err = c.malloc(12 * MIB, 2).unwrap_err();
    let AllocError::OutOfMemory(r) = &err else {
        panic!("expected OutOfMemory, got {err:?}")
    };
    assert_eq!(r.largest_free_block, 16 * MIB);
    assert_eq!(r.largest_free_usable, 0);
    assert!(!r.capture_underway);
    let msg = err.to_string();
    assert!(
        msg.contains(
            "this request could use is 0 bytes: the larger ones are cached for other streams"
        ),
        "{msg}"
    );
    assert!(!msg.contains("fragmented"), "{msg}");
    assert!(!msg.contains("captured"), "{msg}");

    // The same request on stream 1 could use the 16 MiB block; 12 MiB fits.
    assert!(c.malloc(12 * MIB, 1).is_ok());
}

/// During a capture nothing cached goes back to the device, and the report
/// says so.
#[test]
fn report_tells_a_capture_kept_the_cache() {
    let mut c = Checked::with(64 * MIB, "policy:pytorch");
    let a = c.alloc(40 * MIB, 0);
    c.release(a); // 40 MiB cached on stream 0
    c.begin_pool((1, 1), Some(7));
    let err = c.malloc(30 * MIB, 7).unwrap_err();
    let AllocError::OutOfMemory(r) = &err else {
        panic!("expected OutOfMemory, got {err:?}")
    };
    assert!(r.capture_underway);
    assert_eq!(r.largest_free_block, 40 * MIB);
    let msg = err.to_string();
    assert!(msg.contains("A CUDA graph was being captured"), "{msg}");
    assert!(msg.contains("could use is 0 bytes"), "{msg}");
    c.end_pool((1, 1));
    // After the capture the cached 40 MiB go back and 30 MiB fit.
    assert!(c.malloc(30 * MIB, 7).is_ok());
}
