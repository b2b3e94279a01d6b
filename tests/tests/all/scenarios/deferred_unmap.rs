//! Pages that defragmentation moves while work queued on their old address
//! may still run (Note [Unmapping behind the work] in `allocator/src/drain.rs`):
//! mapped at the new place at once, their old address unmapped once the
//! work is done; a request of another stream is first made to wait for
//! that work on the GPU (`cuStreamWaitEvent`), not on the host. The
//! checker holds every step to the stream-safety rules, for the old address
//! and for the memory wherever it is mapped.

use gpualloc_tests::{Checked, MIB};

/// 2 MiB handles, no headroom, no stitching: a request that does not fit
/// takes the pages of free blocks.
const CONF: &str =
    "expandable_handle_mb:2,defragment_headroom:0,defragment_pressure:1,stitch_min_mb:0";

/// `[a 16 MiB, freed on stream 0 with its work queued][b 2 MiB live]`:
/// the checker, a's and b's addresses.
fn busy_free_block(conf: &str) -> (Checked, u64, u64) {
    let mut c = Checked::with(1 << 30, conf);
    let a = c.alloc(16 * MIB, 0);
    let b = c.alloc(2 * MIB, 0);
    c.use_on(a, 0);
    c.release(a);
    (c, a, b)
}

/// [`busy_free_block`], and
/// then a 20 MiB request on `stream`: it fits nowhere, and the only pages
/// to take are a's. Returns the checker, a's address, and the new block.
fn move_busy_pages(conf: &str, stream: u64) -> (Checked, u64, u64) {
    move_busy_pages_past(conf, stream).0
}

/// [`move_busy_pages`], with b's address.
fn move_busy_pages_past(conf: &str, stream: u64) -> ((Checked, u64, u64), u64) {
    let (mut c, a, b) = busy_free_block(conf);
    let waits = c.sim().counters.wait_event;
    let p = c.alloc(20 * MIB, stream);
    assert_eq!(c.reserved(), 22 * MIB, "a's pages moved");
    assert_eq!(c.sim().counters.wait_event, waits, "no host wait");
    ((c, a, p), b)
}

#[test]
fn the_same_stream_takes_busy_pages_without_waiting_and_unmaps_them_later() {
    let (mut c, a, _p) = move_busy_pages(CONF, 0);
    assert!(
        !c.sim().handles_over(a, 16 * MIB).is_empty(),
        "still mapped where the queued work reads it"
    );
    // The work ends; the next call that maps pages gives the old range up
    // (to the helper thread, which unmaps it when it comes to it).
    c.complete(0);
    let _q = c.alloc(40 * MIB, 0);
    assert!(c.sim().unmapping_later(a), "given up");
    c.sim_mut().finish_later_work();
    assert!(
        c.sim().handles_over(a, 16 * MIB).is_empty(),
        "unmapped once done"
    );
}

#[test]
fn empty_cache_unmaps_old_ranges_first() {
    let (mut c, a, p) = move_busy_pages(CONF, 0);
    c.release(p);
    c.empty_cache();
    assert!(c.sim().handles_over(a, 16 * MIB).is_empty());
}

#[test]
fn without_defer_unmap_the_host_waits() {
    let (mut c, a, _b) = busy_free_block(&format!("{CONF},defer_unmap:false"));
    let waits = c.sim().counters.wait_event;
    let _p = c.alloc(20 * MIB, 0);
    assert_eq!(c.sim().counters.wait_event, waits + 1);
    c.sim_mut().finish_later_work();
    assert!(c.sim().handles_over(a, 16 * MIB).is_empty());
}

/// Another stream's request takes the busy pages too, without a host
/// wait: the stream waits for their work on the GPU, and their old address
/// is unmapped once it is done. The checker holds the new block (and the
/// rest of its pages, which a third stream then takes) to the order.
#[test]
fn another_stream_waits_for_the_work_on_the_gpu() {
    let (mut c, a, p) = move_busy_pages(CONF, 1);
    assert!(
        !c.sim().handles_over(a, 16 * MIB).is_empty(),
        "still mapped where the queued work reads it"
    );
    assert_eq!(c.sim().counters.stream_wait_event, 1, "stream 1 ordered");
    assert!(c.ordered(1, 0, 1), "after the work on a");
    c.use_on(p, 1);
    c.release(p);
    // A third stream taking those pages waits for both streams' work.
    let _q = c.alloc(20 * MIB, 2);
    c.complete_all();
    c.empty_cache();
    assert!(c.sim().handles_over(a, 16 * MIB).is_empty());
}

#[test]
fn without_defer_unmap_another_stream_waits_on_the_host() {
    let (mut c, _, _b) = busy_free_block(&format!("{CONF},defer_unmap:false"));
    let waits = c.sim().counters.wait_event;
    let _p = c.alloc(20 * MIB, 1);
    assert_eq!(c.sim().counters.wait_event, waits + 1, "stream 1 waited");
}

#[test]
fn mapping_over_an_old_range_waits_for_its_work_first() {
    let ((mut c, a, p), b) = move_busy_pages_past(CONF, 0);
    // Everything freed: a request as large as all that was mapped goes
    // where a was, behind work still queued there.
    c.release(p);
    c.release(b);
    let waits = c.sim().counters.wait_event;
    let q = c.alloc(38 * MIB, 0);
    assert_eq!(q, a, "placed over the old range");
    assert_eq!(c.sim().counters.wait_event, waits + 1);
}

/// A request that can never fit, after its pages moved: the moved pages
/// go back to the pool and must not reach another stream before their work
/// is done.
#[test]
fn a_request_that_fails_after_moving_pages_leaves_none_to_other_streams() {
    let (mut c, _, _b) = busy_free_block(CONF);
    assert!(c.malloc(2048 * MIB, 0).is_err());
    let _q = c.alloc(16 * MIB, 1);
}

/// A widened mapping puts a moved handle in the part of the new block the
/// request does not use: another stream that takes it waits for its work.
#[test]
fn moved_pages_left_unused_carry_their_works_stamp() {
    let mut c = Checked::with(
        1 << 30,
        "defragment_headroom:0,defragment_pressure:1,stitch_min_mb:0",
    );
    let big = c.alloc(64 * MIB, 0);
    c.release(big); // 8 MiB handles
    let p: Vec<u64> = (0..8).map(|_| c.alloc(8 * MIB, 0)).collect();
    let t = c.alloc(2 * MIB, 0);
    let _u = c.alloc(2 * MIB, 0);
    for &x in &[t, p[0], p[2], p[4]] {
        c.use_on(x, 0);
        c.release(x);
    }
    let _r = c.alloc(20 * MIB, 0);
    let _s = c.alloc(2 * MIB, 1);
}

/// Opening a pool scope (before a capture begins) unmaps old ranges, so
/// where the capture's requests land does not depend on the GPU's progress.
#[test]
fn a_capture_places_memory_alike_however_far_the_gpu_got() {
    let place = |done: bool| {
        let ((mut c, _a, p), b) = move_busy_pages_past(CONF, 0);
        if done {
            c.complete(0);
        }
        let _small = c.alloc(1000, 0);
        c.release(p);
        c.release(b);
        c.begin_pool((7, 7), Some(5));
        c.alloc(38 * MIB, 0)
    };
    assert_eq!(place(true), place(false));
}

/// A capture found running through the driver (no hooks) while a drain
/// is pending: nothing may wait then, and nothing does.
#[test]
fn a_followed_capture_never_waits_for_drains() {
    let ((mut c, _a, _p), _b) = move_busy_pages_past(CONF, 0);
    c.follow_driver_capture(0);
    let _id = c.sim_mut().begin_stream_capture(&[0]);
    let _x = c.alloc_following(4096, 0);
}

/// While captures are followed through the driver, pages wait for their
/// work before they move: one could begin at any moment.
#[test]
fn following_captures_turns_moving_without_waiting_off() {
    let mut c = Checked::with(1 << 30, CONF);
    c.follow_driver_capture(0);
    let a = c.alloc_following(16 * MIB, 0);
    let _b = c.alloc_following(2 * MIB, 0);
    c.use_on(a, 0);
    c.release(a);
    let waits = c.sim().counters.wait_event;
    let _p = c.alloc_following(20 * MIB, 0);
    assert_eq!(c.sim().counters.wait_event, waits + 1);
}

/// The wait that finishes moved pages fails: they must still not reach
/// another stream before their work is done.
#[test]
fn a_failed_finish_leaves_no_busy_pages_to_another_stream() {
    use gpualloc::backend::SimCall;
    let (mut c, _, _b) = busy_free_block(CONF);
    c.sim_mut().fail_call(SimCall::WaitEvent, 1);
    assert!(c.dev.malloc(2048 * MIB, 0).is_err());
    let _q = c.alloc(16 * MIB, 1);
}

/// The waits that finish moved pages fail (after the failed request, and
/// when the pool scope opens): a capture, which can wait for nothing, maps
/// new pages rather than take those (the checker holds it to the order).
#[test]
fn a_capture_never_takes_pages_whose_old_range_is_still_mapped() {
    use gpualloc::backend::SimCall;
    let (mut c, _, _b) = busy_free_block(CONF);
    c.sim_mut().fail_call(SimCall::WaitEvent, 1);
    assert!(c.dev.malloc(2048 * MIB, 0).is_err());
    c.sim_mut().fail_call(SimCall::WaitEvent, 1);
    c.begin_pool((3, 3), None);
    let created = c.sim().counters.create;
    let _q = c.alloc(16 * MIB, 7);
    assert!(
        c.sim().counters.create > created,
        "new pages for the capture"
    );
}

/// Captures begin to be followed through the driver while moved pages are
/// pooled with their old range still mapped, and the first such call comes
/// from a stream already capturing: its request maps new pages (found by a
/// review: it was refused).
#[test]
fn following_captures_with_pages_still_draining_maps_new_ones() {
    let (mut c, _, _b) = busy_free_block(CONF);
    assert!(c.dev.malloc(2048 * MIB, 0).is_err());
    let _id = c.sim_mut().begin_stream_capture(&[7]);
    c.follow_driver_capture(7);
    let r = c.try_malloc(16 * MIB, 7);
    assert!(r.is_ok(), "{r:?}");
}

/// Unmapping an old range whose work is done fails: a request that needs
/// no unmapping still succeeds, and the range is unmapped later.
#[test]
fn a_failed_tidy_up_fails_no_request() {
    use gpualloc::backend::SimCall;
    let (mut c, a, _p) = move_busy_pages(CONF, 0);
    c.complete(0);
    c.sim_mut().fail_call(SimCall::Unmap, 1);
    let _q = c.alloc(40 * MIB, 1);
    assert!(
        !c.sim().handles_over(a, 16 * MIB).is_empty(),
        "still mapped"
    );
    let _r = c.alloc(40 * MIB, 0);
    c.sim_mut().finish_later_work();
    assert!(
        c.sim().handles_over(a, 16 * MIB).is_empty(),
        "unmapped after the next call"
    );
}
