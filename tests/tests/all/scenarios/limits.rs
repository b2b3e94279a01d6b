//! Memory limits (reference 1.8 `alloc_block`): a byte limit or a fraction
//! of the device is honoured before the backend is asked.

use gpualloc::AllocError;
use gpualloc_tests::{Checked, MIB};

#[test]
fn byte_limit_refuses_before_calling_the_backend() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,memory_limit:64MiB",
    );
    c.alloc(40 * MIB, 0);
    let calls = (c.sim().counters.allocate, c.sim().counters.allocate_failed);
    match c.malloc(40 * MIB, 0) {
        Err(AllocError::OutOfMemory(r)) => {
            assert_eq!(r.limit, Some(64 * MIB));
            assert_eq!(r.reserved, 40 * MIB);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(
        (c.sim().counters.allocate, c.sim().counters.allocate_failed),
        calls,
        "no backend call"
    );
    assert!(c.reserved() <= 64 * MIB);
}

#[test]
fn request_over_the_limit_is_too_large() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,memory_limit:64MiB",
    );
    match c.malloc(100 * MIB, 0) {
        Err(AllocError::TooLarge {
            requested,
            needed,
            max,
            device,
            limit,
            ..
        }) => {
            assert_eq!((requested, needed, max), (100 * MIB, 100 * MIB, 64 * MIB));
            // What PyTorch's out-of-memory observers are told as allowed.
            assert_eq!((device, limit), (0, Some(64 * MIB)));
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(
        c.sim().counters.allocate + c.sim().counters.allocate_failed,
        0
    );
}

#[test]
fn fraction_limits_reserved_memory() {
    let mut c = Checked::with(256 * MIB, "policy:pytorch,cross_stream_reuse:true");
    c.set_memory_fraction(0.25).unwrap();
    assert_eq!(c.dev.memory_fraction(), 0.25);
    c.alloc(40 * MIB, 0);
    assert!(c.malloc(30 * MIB, 0).is_err(), "40 + 30 > 64 MiB");
    assert_eq!(
        c.sim().counters.allocate_failed,
        0,
        "refused before the backend"
    );
    c.alloc(20 * MIB, 0); // 40 + 20 <= 64
    c.set_memory_fraction(1.0).unwrap();
    c.alloc(30 * MIB, 0);
    // 0, as PyTorch takes it: no new memory, an out-of-memory error
    // (never fits under this limit).
    c.set_memory_fraction(0.0).unwrap();
    assert!(matches!(
        c.malloc(30 * MIB, 0),
        Err(gpualloc::AllocError::TooLarge { .. })
    ));
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(c.set_memory_fraction(bad).is_err(), "{bad}");
    }
    assert_eq!(c.dev.memory_fraction(), 0.0);
}

#[test]
fn fraction_from_the_config() {
    let mut c = Checked::with(
        100 * MIB,
        "policy:pytorch,cross_stream_reuse:true,per_process_memory_fraction:0.5",
    );
    c.alloc(40 * MIB, 0);
    assert!(c.malloc(12 * MIB, 0).is_err());
    assert_eq!(c.sim().counters.allocate_failed, 0);
}

#[test]
fn invalid_fractions_are_refused() {
    let mut c = Checked::with(100 * MIB, "policy:pytorch,cross_stream_reuse:true");
    for f in [-0.5, 1.5, f64::NAN, f64::INFINITY] {
        assert!(c.set_memory_fraction(f).is_err(), "{f}");
    }
    assert_eq!(c.dev.memory_fraction(), 1.0);
}

#[test]
fn lowered_limit_is_met_by_releasing_the_cache() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(30 * MIB, 0);
    c.release(a);
    c.set_memory_limit(Some(50 * MIB));
    // 40 MiB does not fit the cached 30 MiB block, and 30 + 40 > 50: the
    // OOM path releases the cache and the retry fits.
    let failed = c.sim().counters.allocate_failed;
    let p = c.alloc(40 * MIB, 0);
    assert_ne!(p, 0);
    assert_eq!(
        c.sim().counters.allocate_failed,
        failed,
        "the limit refused, not the backend"
    );
    assert_eq!(c.stats().num_alloc_retries, 1);
    assert_eq!(c.reserved(), 40 * MIB);
    c.set_memory_limit(None);
    c.alloc(200 * MIB, 0);
}

/// Under expandable segments (the default) a request needs only its pages:
/// a 5 MiB request under a 16 MiB limit is not "too large" because a plain
/// segment for it would be 20 MiB. Here a freed block still used by stream
/// 7 holds 12 MiB; the request is served once that work is done.
#[test]
fn an_expandable_request_is_judged_by_its_pages_not_a_segment_size() {
    for conf in ["memory_limit:16MiB", "memory_limit:16MiB,defragment:false"] {
        let mut c = Checked::with(1 << 30, conf);
        let a = c.alloc(12 * MIB, 0);
        c.record_stream(a, 7);
        c.use_on(a, 7);
        c.release(a);
        match c.malloc(5 * MIB, 0) {
            Ok(p) => c.release(p),
            Err(AllocError::TooLarge { .. }) => panic!("{conf}: 5 MiB fits a 16 MiB limit"),
            Err(_) => {} // not now: stream 7 still uses the 12 MiB
        }
        c.complete(7);
        let p = c.alloc(5 * MIB, 0);
        c.release(p);
    }
}
