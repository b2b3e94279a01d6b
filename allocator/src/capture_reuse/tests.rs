//! Tests of `capture_reuse.rs`: PyTorch's `test_graph_capture_reclaim_2_streams`
//! and `_4_streams` on the simulator, and what waits for the capture's end
//! (a recording's replay: `replay/tests.rs`).

use crate::backend::{SimBackend, StreamId};
use crate::config::Config;
use crate::device::DeviceAllocator;
use crate::pool::PoolKey;

const S1: StreamId = 0x10;
const S2: StreamId = 0x20;
const S3: StreamId = 0x30;
const S4: StreamId = 0x40;
const POOL: PoolKey = (1, 0);

pub(crate) fn device(conf: &str) -> DeviceAllocator<SimBackend> {
    DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::parse(conf).unwrap())
}

/// Opens a capture's scope and starts capturing on `s1` (`capture_begin`).
fn begin(d: &mut DeviceAllocator<SimBackend>) -> u64 {
    d.begin_allocate_to_pool(POOL, None).unwrap();
    d.backend_mut().begin_graph_capture(S1)
}

fn alloc(d: &mut DeviceAllocator<SimBackend>, stream: StreamId) -> u64 {
    alloc_of(d, 32, stream)
}

fn alloc_of(d: &mut DeviceAllocator<SimBackend>, size: u64, stream: StreamId) -> u64 {
    let p = d.malloc(size, stream).unwrap();
    d.check_invariants().unwrap();
    p
}

/// Begins a capture on S1, allocates a block on S1 and frees it after
/// work on S1 and on S2 (joined to S1's capture) used it: the capture and
/// the block.
fn freed_after_s2_used_it(d: &mut DeviceAllocator<SimBackend>) -> (u64, u64) {
    let capture = begin(d);
    let data1 = alloc(d, S1);
    d.backend_mut().capture_launch(S1);
    d.backend_mut().capture_wait(S2, S1);
    d.backend_mut().capture_launch(S2);
    d.record_stream(data1, S2).unwrap();
    d.free(data1).unwrap();
    (capture, data1)
}

/// PyTorch's two-stream test: the ptrs of data1, data2 (allocated before
/// the join) and data3 (after it).
fn two_streams(d: &mut DeviceAllocator<SimBackend>) -> (u64, u64, u64) {
    two_streams_of(d, 32)
}

/// [`two_streams`] with tensors of `size` bytes.
pub(crate) fn two_streams_of(d: &mut DeviceAllocator<SimBackend>, size: u64) -> (u64, u64, u64) {
    let capture = begin(d);
    let _sink1 = alloc_of(d, size, S1);
    let data1 = alloc_of(d, size, S1);
    // s2.wait_stream(s1); on s2: buf2 = empty_like(data1); add(data1, out=buf2).
    d.backend_mut().capture_wait(S2, S1);
    let _buf2 = alloc_of(d, size, S2);
    d.backend_mut().capture_launch(S2);
    d.record_stream(data1, S2).unwrap();
    d.free(data1).unwrap();
    d.check_invariants().unwrap();
    // Before the join: s2's add may still read data1.
    let data2 = alloc_of(d, size, S1);
    // s1.wait_stream(s2); sink1.fill_(1.0).
    d.backend_mut().capture_wait(S1, S2);
    d.backend_mut().capture_launch(S1);
    let data3 = alloc_of(d, size, S1);
    d.backend_mut().end_stream_capture(capture);
    d.end_allocate_to_pool(POOL).unwrap();
    (data1, data2, data3)
}

#[test]
fn a_block_is_reused_once_the_stream_that_used_it_joined() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    let (data1, data2, data3) = two_streams(&mut d);
    assert_ne!(data1, data2, "no reuse before the join");
    assert_eq!(data1, data3, "reuse after it");
    assert!(d.pending.is_idle());
    d.check_invariants().unwrap();
}

#[test]
fn the_setting_pytorch_passes_turns_it_on_and_off() {
    let mut d = device("");
    assert!(!d.graph_capture_record_stream_reuse());
    d.set_graph_capture_record_stream_reuse(true);
    let (data1, _, data3) = two_streams(&mut d);
    assert_eq!(data1, data3);
    d.set_graph_capture_record_stream_reuse(false);
    let (data1, _, data3) = two_streams(&mut d);
    assert_ne!(
        data1, data3,
        "off again: the block waits for the capture's end"
    );
}

#[test]
fn off_the_block_waits_for_the_capture_to_end() {
    let mut d = device("");
    let (data1, data2, data3) = two_streams(&mut d);
    assert!(data1 != data2 && data1 != data3);
    assert!(d.pending.is_deferred(d.live[&data1]));
    // After the capture, its events are recorded and, once done, it is free.
    let _ = alloc(&mut d, S1);
    assert!(!d.pending.is_idle() && !d.pending.is_deferred(d.live[&data1]));
    d.backend_mut().complete_all();
    let _ = alloc(&mut d, S1);
    assert!(d.pending.is_idle());
}

#[test]
fn four_streams_reuse_only_after_the_last_join() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    let capture = begin(&mut d);
    let data1 = alloc(&mut d, S1);
    d.backend_mut().capture_launch(S1); // torch.ones
    let _sink1 = alloc(&mut d, S1);
    let sink3 = alloc(&mut d, S1);
    for s in [S2, S3, S4] {
        d.backend_mut().capture_wait(s, S1);
        let _buf = alloc(&mut d, s);
        d.backend_mut().capture_launch(s);
        d.record_stream(data1, s).unwrap();
    }
    d.free(data1).unwrap();
    // Partial joins: s2 into s1, s4 into s3.
    d.backend_mut().capture_wait(S1, S2);
    d.backend_mut().capture_launch(S1);
    d.backend_mut().capture_wait(S3, S4);
    d.backend_mut().capture_launch(S3);
    d.record_stream(sink3, S3).unwrap();
    let data2 = alloc(&mut d, S1);
    assert_ne!(data1, data2, "s3 and s4 are not joined into s1 yet");
    // The final join.
    d.backend_mut().capture_wait(S1, S3);
    d.backend_mut().capture_launch(S1);
    let data3 = alloc(&mut d, S1);
    assert_eq!(data1, data3);
    d.backend_mut().end_stream_capture(capture);
    d.end_allocate_to_pool(POOL).unwrap();
    d.check_invariants().unwrap();
}

#[test]
fn a_block_used_by_a_stream_outside_the_capture_waits_for_its_end() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    let capture = begin(&mut d);
    let data1 = alloc(&mut d, S1);
    d.backend_mut().capture_launch(S1);
    // S2 does not take part in the capture.
    d.record_stream(data1, S2).unwrap();
    d.free(data1).unwrap();
    assert!(
        d.capture_reuse.is_empty(),
        "no markers: S2 captures nothing"
    );
    d.backend_mut().capture_launch(S1);
    assert_ne!(alloc(&mut d, S1), data1);
    d.backend_mut().end_stream_capture(capture);
    d.end_allocate_to_pool(POOL).unwrap();
}

#[test]
fn a_free_before_any_captured_work_waits_for_the_capture_to_end() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    let capture = begin(&mut d);
    let data1 = alloc(&mut d, S1);
    d.backend_mut().capture_wait(S2, S1);
    d.record_stream(data1, S2).unwrap();
    d.free(data1).unwrap();
    assert!(
        d.capture_reuse.is_empty(),
        "no terminal node yet: PyTorch's empty list"
    );
    d.backend_mut().capture_launch(S1);
    assert_ne!(alloc(&mut d, S1), data1);
    d.backend_mut().end_stream_capture(capture);
    d.end_allocate_to_pool(POOL).unwrap();
}

#[test]
fn markers_of_an_ended_capture_are_never_compared_with_the_next() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    let first = begin(&mut d);
    let data1 = alloc(&mut d, S1);
    d.backend_mut().capture_wait(S2, S1);
    d.backend_mut().capture_launch(S2);
    d.record_stream(data1, S2).unwrap();
    d.free(data1).unwrap();
    assert!(!d.capture_reuse.is_empty());
    // The scope closes while the driver still reports the capture (which
    // PyTorch's hooks do for a `use_mem_pool` scope nested in a capture,
    // not for the capture's own): the block keeps waiting.
    d.end_allocate_to_pool(POOL).unwrap();
    d.backend_mut().end_stream_capture(first);
    assert!(d.pending.is_deferred(d.live[&data1]));
    // The next capture starts before any allocation outside one: the
    // block still has the first capture's markers.
    let second = begin(&mut d);
    d.backend_mut().capture_wait(S2, S1);
    d.backend_mut().capture_launch(S2);
    d.backend_mut().capture_wait(S1, S2);
    d.backend_mut().capture_launch(S1);
    assert_ne!(
        alloc(&mut d, S1),
        data1,
        "another capture's graph orders nothing of it"
    );
    d.backend_mut().end_stream_capture(second);
    d.end_allocate_to_pool(POOL).unwrap();
    d.check_invariants().unwrap();
}

#[test]
fn the_walks_go_when_the_last_capture_ends() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    for _ in 0..3 {
        let (data1, _, data3) = two_streams(&mut d);
        assert_eq!(data1, data3);
        assert!(d.capture_reuse.visited.is_empty(), "kept after the capture");
        let p = alloc(&mut d, S1);
        d.free(p).unwrap();
    }
}

#[test]
fn an_allocation_on_the_stream_that_used_the_block_frees_nothing_of_another() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    let (capture, data1) = freed_after_s2_used_it(&mut d);
    // S2's walk reaches every marker, but the block is S1's, and S1 has
    // not joined S2.
    d.backend_mut().capture_launch(S2);
    let _on_s2 = alloc(&mut d, S2);
    assert_ne!(alloc(&mut d, S1), data1, "S1 never joined S2");
    d.backend_mut().end_stream_capture(capture);
    d.end_allocate_to_pool(POOL).unwrap();
    d.check_invariants().unwrap();
}

/// PyTorch's `test_graph_capture_reclaim_shared_pool`: a block freed
/// during a capture, used by a stream that joined back only at its end,
/// is freed when the capture's scope closes, and a second capture into
/// the same pool reuses it.
pub(crate) fn shared_pool(d: &mut DeviceAllocator<SimBackend>, size: u64) -> (u64, u64) {
    let first = begin(d);
    let data1 = alloc_of(d, size, S1);
    d.backend_mut().capture_launch(S1);
    d.backend_mut().capture_wait(S2, S1);
    d.backend_mut().capture_launch(S2);
    d.record_stream(data1, S2).unwrap();
    d.free(data1).unwrap();
    d.backend_mut().capture_wait(S1, S2);
    d.backend_mut().end_stream_capture(first);
    d.end_allocate_to_pool(POOL).unwrap();
    let second = begin(d);
    let data2 = alloc_of(d, size, S1);
    d.backend_mut().end_stream_capture(second);
    d.end_allocate_to_pool(POOL).unwrap();
    (data1, data2)
}

#[test]
fn a_block_still_deferred_when_its_capture_ends_serves_the_next_capture_into_the_pool() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    let (data1, data2) = shared_pool(&mut d, 32);
    assert_eq!(data1, data2);
    assert!(d.pending.is_idle() && d.capture_reuse.is_empty());
    d.check_invariants().unwrap();
    let mut off = device("");
    let (data1, data2) = shared_pool(&mut off, 32);
    assert_ne!(data1, data2, "off: it waits for an event after the capture");
}

#[test]
fn a_block_used_outside_the_capture_gets_no_markers() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    // Used on S2 before the capture began: that work may still run.
    let eager = alloc(&mut d, S1);
    d.record_stream(eager, S2).unwrap();
    let capture = begin(&mut d);
    let early = alloc(&mut d, S1);
    d.backend_mut().capture_launch(S1);
    // Used on S2 while S2 takes no part in the capture yet.
    d.record_stream(early, S2).unwrap();
    d.backend_mut().capture_wait(S2, S1);
    d.backend_mut().capture_launch(S2);
    let mixed = alloc(&mut d, S1);
    d.record_stream(mixed, S2).unwrap();
    d.record_stream(eager, S2).unwrap();
    let captured = alloc(&mut d, S1);
    d.record_stream(captured, S2).unwrap();
    // Used on S3 before S3 takes part; it joins before the free.
    d.record_stream(mixed, S3).unwrap();
    d.backend_mut().capture_wait(S3, S1);
    d.backend_mut().capture_launch(S3);
    for p in [eager, early, mixed, captured] {
        d.free(p).unwrap();
        d.check_invariants().unwrap();
    }
    let marked: Vec<_> = d
        .capture_reuse
        .markers
        .keys()
        .map(|id| d.heap.blocks[*id].ptr)
        .collect();
    assert_eq!(
        marked,
        vec![captured],
        "only the block used in this capture alone"
    );
    d.backend_mut().capture_wait(S1, S2);
    d.backend_mut().capture_launch(S1);
    assert_eq!(alloc(&mut d, S1), captured);
    d.backend_mut().end_stream_capture(capture);
    d.end_allocate_to_pool(POOL).unwrap();
    d.check_invariants().unwrap();
}

#[test]
fn a_block_used_in_an_earlier_capture_gets_no_markers_in_the_next() {
    let mut d = device("graph_capture_record_stream_reuse:true");
    let first = begin(&mut d);
    d.backend_mut().capture_wait(S2, S1);
    let data1 = alloc(&mut d, S1);
    d.record_stream(data1, S2).unwrap();
    d.backend_mut().capture_wait(S1, S2);
    d.backend_mut().end_stream_capture(first);
    d.end_allocate_to_pool(POOL).unwrap();
    let second = begin(&mut d);
    d.backend_mut().capture_wait(S2, S1);
    d.backend_mut().capture_launch(S2);
    d.free(data1).unwrap();
    assert!(
        d.capture_reuse.is_empty(),
        "the first graph's use is not ordered by the second"
    );
    d.backend_mut().end_stream_capture(second);
    d.end_allocate_to_pool(POOL).unwrap();
    d.check_invariants().unwrap();
}

#[test]
fn a_walk_the_driver_refuses_is_made_again_whole_at_the_next_allocation() {
    use crate::backend::SimCall;
    let mut d = device("graph_capture_record_stream_reuse:true");
    let (capture, data1) = freed_after_s2_used_it(&mut d);
    d.backend_mut().capture_wait(S1, S2);
    d.backend_mut().capture_launch(S1);
    // The walk from S1's terminal reaches its parent, then the driver
    // refuses that parent's dependencies: nothing is freed, and what was
    // walked is dropped (it would hide the nodes behind the parent).
    d.backend_mut().fail_call(SimCall::NodeDependencies, 2);
    assert_ne!(alloc(&mut d, S1), data1);
    assert!(d.capture_reuse.visited.is_empty());
    assert_eq!(alloc(&mut d, S1), data1, "walked whole again");
    d.backend_mut().end_stream_capture(capture);
    d.end_allocate_to_pool(POOL).unwrap();
    d.check_invariants().unwrap();
}

#[test]
fn a_block_the_driver_cannot_tell_of_at_the_captures_end_waits_for_events() {
    use crate::backend::SimCall;
    let mut d = device("graph_capture_record_stream_reuse:true");
    let (capture, data1) = freed_after_s2_used_it(&mut d);
    d.backend_mut().capture_wait(S1, S2);
    d.backend_mut().end_stream_capture(capture);
    d.backend_mut().fail_call(SimCall::CaptureTerminals, 1);
    d.end_allocate_to_pool(POOL).unwrap();
    assert!(d.pending.is_deferred(d.live[&data1]), "kept, not freed");
    d.check_invariants().unwrap();
}
