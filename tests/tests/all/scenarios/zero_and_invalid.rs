//! Size 0 gives the null pointer and `free(0)` is a no-op (reference 4.4);
//! unknown pointers and double frees are errors, not corruption.
//!
//! The same under both policies: every test runs under both.

use gpualloc::AllocError;
use gpualloc_tests::Checked;

fn size_zero_is_the_null_pointer(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let before = c.stats().clone();
    assert_eq!(c.malloc(0, 0).unwrap(), 0);
    assert_eq!(c.malloc(0, 9).unwrap(), 0);
    c.release(0);
    assert_eq!(c.stats(), &before, "no stat moves");
    assert_eq!(c.sim().counters.allocate, 0);
}

fn unknown_pointer_and_double_free_are_refused(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let p = c.alloc(4096, 0);
    assert!(matches!(
        c.free(p + 512),
        Err(AllocError::InvalidPointer { .. })
    ));
    assert!(matches!(
        c.free(0xdead_0000),
        Err(AllocError::InvalidPointer { .. })
    ));
    c.release(p);
    assert!(
        matches!(c.free(p), Err(AllocError::InvalidPointer { .. })),
        "double free"
    );
    assert!(matches!(
        c.dev.record_stream(p, 3),
        Err(AllocError::InvalidPointer { .. })
    ));
}

fn double_free_of_a_pending_block_is_refused(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let p = c.alloc(4096, 0);
    c.record_stream(p, 3);
    c.use_on(p, 3);
    c.release(p);
    assert!(matches!(c.free(p), Err(AllocError::InvalidPointer { .. })));
    assert_eq!(c.stats().allocation.all.current, 0);
    assert_eq!(c.stats().active.all.current, 1);
}

under_both_policies!(
    size_zero_is_the_null_pointer,
    unknown_pointer_and_double_free_are_refused,
    double_free_of_a_pending_block_is_refused,
);
