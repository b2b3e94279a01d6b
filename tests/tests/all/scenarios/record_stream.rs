//! `record_stream` (reference 1.9): a block used on other streams is not
//! reusable until an event recorded on each at free time completes; events
//! are polled lazily, at the next malloc.
//!
//! The same under both policies: every test runs under both.

use gpualloc_tests::{Checked, MIB};

const ALLOC: u64 = 1;
const SIDE: u64 = 2;

fn block_waits_for_the_other_streams_event(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let p = c.alloc(4 * MIB, ALLOC);
    c.record_stream(p, SIDE);
    c.use_on(p, ALLOC);
    c.use_on(p, SIDE);
    c.release(p);
    assert_eq!(
        c.sim().counters.record_event,
        1,
        "one event, on the recorded stream"
    );
    assert_eq!(
        c.stats().allocated_bytes.all.current,
        0,
        "allocated drops at the free request"
    );
    assert_eq!(
        c.stats().active_bytes.all.current,
        4 * MIB as i64,
        "still active"
    );
    assert_eq!(
        c.stats().requested_bytes.all.current,
        4 * MIB as i64,
        "requested drops at completion"
    );
    assert_eq!(
        c.snapshot()[0].blocks[0].state,
        gpualloc::BlockState::PendingFree
    );
    let q = c.alloc(4 * MIB, ALLOC);
    assert_ne!(q, p, "the event is not done: the block is not reused");
    c.complete(SIDE);
    assert_eq!(
        c.sim().counters.event_query,
        1,
        "completion alone polls nothing"
    );
    let r = c.alloc(4 * MIB, ALLOC);
    assert_eq!(r, p, "polled at this malloc, freed and reused");
    assert_eq!(c.sim().live_events(), 0);
    assert_eq!(c.stats().requested_bytes.all.current, 8 * MIB as i64);
}

fn each_streams_queue_is_polled_up_to_its_first_pending_event(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let a = c.alloc(4096, ALLOC);
    let b = c.alloc(4096, ALLOC);
    let d = c.alloc(4096, ALLOC);
    c.record_stream(a, SIDE);
    c.record_stream(b, 3);
    c.record_stream(d, 3);
    c.use_on(a, SIDE);
    c.use_on(b, 3);
    c.use_on(d, 3);
    c.release(a); // SIDE: [e1]
    c.release(b); // 3: [e2]
    c.release(d); // 3: [e2, e3]
    c.complete(SIDE);
    let queries = c.sim().counters.event_query;
    c.alloc(512, ALLOC);
    assert_eq!(
        c.sim().counters.event_query,
        queries + 2,
        "e1 (done), e2 (not done); e3 is not polled"
    );
    assert_eq!(
        c.stats().active.all.current,
        3,
        "b and d pending, one new block"
    );
    c.complete(3);
    c.alloc(512, ALLOC);
    assert_eq!(c.stats().active.all.current, 2);
    assert_eq!(c.sim().live_events(), 0);
}

fn recording_the_allocation_stream_is_ignored(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let p = c.alloc(4096, ALLOC);
    c.record_stream(p, ALLOC);
    c.release(p);
    assert_eq!(c.sim().counters.record_event, 0);
    assert_eq!(c.alloc(4096, ALLOC), p, "reusable at once");
}

fn several_streams_each_get_an_event(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let p = c.alloc(12 * MIB, ALLOC);
    for s in [SIDE, 3, 4] {
        c.record_stream(p, s);
        c.use_on(p, s);
    }
    c.record_stream(p, SIDE); // a repeat adds nothing
    c.release(p);
    assert_eq!(c.sim().counters.record_event, 3);
    c.complete(SIDE);
    c.complete(3);
    assert_ne!(c.alloc(12 * MIB, ALLOC), p, "stream 4 is still running");
    c.complete(4);
    assert_eq!(c.alloc(12 * MIB, ALLOC), p);
}

/// Note [Streams of other devices]: another GPU's default stream has the
/// same handle as this device's, but is another stream.
fn another_devices_default_stream_is_not_this_ones(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let p = c.alloc(4 * MIB, 0);
    c.use_on(p, 0);
    let own = c.record_stream_of_device(p, 0, 0);
    assert_eq!(
        own, 0,
        "this device's own default stream: the allocation stream"
    );
    let other = c.record_stream_of_device(p, 0, 1);
    assert_ne!(other, 0);
    let per_thread = c.record_stream_of_device(p, 2, 1);
    assert_ne!(per_thread, other);
    c.use_on(p, other);
    c.use_on(p, per_thread);
    c.release(p);
    assert_eq!(
        c.sim().counters.record_event,
        2,
        "an event on each of device 1's streams"
    );
    c.complete(0);
    assert_ne!(c.alloc(4 * MIB, 0), p, "device 1 still reads it");
    c.complete(other);
    c.complete(per_thread);
    assert_eq!(c.alloc(4 * MIB, 0), p);
}

/// Note [Frees on another stream]: a block read on another stream without
/// `record_stream` and freed while that stream is current (ColossalAI's
/// Gemini) waits for that stream's work as a recorded block does; freed
/// on its own stream, it is reused at once.
fn a_block_freed_while_another_stream_is_current_waits_for_its_work(policy: &str) {
    let mut c = Checked::with(1 << 30, policy);
    let p = c.alloc(4 * MIB, ALLOC);
    c.use_elsewhere(p, SIDE).expect("a stream of its own");
    c.release(p); // from SIDE, as `use_elsewhere` asks
    assert_eq!(
        c.sim().counters.record_event,
        1,
        "one event, on the current stream"
    );
    assert_eq!(
        c.snapshot()[0].blocks[0].state,
        gpualloc::BlockState::PendingFree
    );
    assert_ne!(c.alloc(4 * MIB, SIDE), p, "its read is queued: not reused");
    c.complete(SIDE);
    assert_eq!(c.alloc(4 * MIB, ALLOC), p, "the read done: reused");
    assert_eq!(c.sim().live_events(), 0);

    let q = c.alloc(4 * MIB, ALLOC);
    let events = c.sim().counters.record_event;
    c.dev
        .free_from(q, Some(ALLOC))
        .expect("free on its own stream");
    c.live.remove(&q);
    assert_eq!(
        c.sim().counters.record_event,
        events,
        "no event on its own stream"
    );
    assert_eq!(c.alloc(4 * MIB, ALLOC), q, "reused at once");
    c.check();
}

under_both_policies!(
    a_block_freed_while_another_stream_is_current_waits_for_its_work,
    another_devices_default_stream_is_not_this_ones,
    block_waits_for_the_other_streams_event,
    each_streams_queue_is_polled_up_to_its_first_pending_event,
    recording_the_allocation_stream_is_ignored,
    several_streams_each_get_an_event,
);
