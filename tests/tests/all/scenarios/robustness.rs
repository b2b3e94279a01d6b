//! Inputs and failures a user can cause: absurd sizes, odd configurations,
//! driver errors on the event path, and threads racing trace annotations.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use gpualloc::backend::SimCall;
use gpualloc::{AllocError, Allocator, Config, DeviceAllocator, SimBackend};
use gpualloc_tests::Checked;

const MIB: u64 = 1 << 20;

#[test]
fn absurd_sizes_never_fit_and_never_corrupt_the_cache() {
    for conf in [
        "policy:pytorch,cross_stream_reuse:true",
        "policy:pytorch,cross_stream_reuse:true,roundup_power2_divisions:4",
        "expandable_segments:true",
        "",
    ] {
        let mut c = Checked::with(8 << 30, conf);
        let a = c.alloc(64 * MIB, 7);
        c.release(a);
        for size in [u64::MAX, u64::MAX - 100, 1 << 49, (1 << 48) + 1] {
            assert!(
                matches!(c.malloc(size, 7), Err(AllocError::TooLarge { .. })),
                "{conf}: {size} must never fit"
            );
        }
        // The cached block is still there and still whole.
        let b = c.alloc(64 * MIB, 7);
        c.release(b);
    }
}

#[test]
fn a_small_large_segment_size_still_holds_the_request() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,large_segment_size_mb:2",
    );
    let a = c.alloc(5 * MIB, 0);
    let b = c.alloc(5 * MIB, 0);
    assert!(b >= a + 5 * MIB || a >= b + 5 * MIB);
    assert!(c.stats().reserved_bytes.all.current as u64 >= 10 * MIB);
    c.release(a);
    c.release(b);
}

#[test]
fn a_failed_event_record_keeps_the_block_protected() {
    for conf in ["policy:pytorch,cross_stream_reuse:true", ""] {
        a_failed_event_record_keeps_the_block_protected_under(conf);
    }
}

fn a_failed_event_record_keeps_the_block_protected_under(conf: &str) {
    let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::parse(conf).unwrap());
    let p = d.malloc(MIB, 1).unwrap();
    d.record_stream(p, 2).unwrap();
    d.backend_mut().fail_event_at(1);
    assert!(matches!(d.free(p), Err(AllocError::Backend(_))));
    d.check_invariants().unwrap();
    // Not reusable yet: stream 2 may still use it. The next allocation
    // retries the event, and the block comes back once stream 2 is done.
    let q = d.malloc(MIB, 1).unwrap();
    assert_ne!(q, p);
    d.check_invariants().unwrap();
    assert_eq!(d.backend().live_events(), 1);
    d.backend_mut().complete(2);
    d.free(q).unwrap();
    let r = d.malloc(MIB, 1).unwrap();
    d.check_invariants().unwrap();
    assert!(r == p || r == q);
    assert_eq!(d.backend().live_events(), 0);
}

/// `t.record_stream(s)` with a stream of another device (or one destroyed
/// since): the driver refuses every event on it. The free reports it once;
/// the next allocation retries, is refused again, synchronizes the device
/// and frees the block, so allocation goes on and nothing leaks.
#[test]
fn a_stream_whose_events_are_always_refused_does_not_stop_allocation() {
    for conf in ["policy:pytorch", ""] {
        let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::parse(conf).unwrap());
        let p = d.malloc(4 * MIB, 0).unwrap();
        d.record_stream(p, 0xdead).unwrap();
        d.backend_mut().refuse_events_on(0xdead);
        assert!(matches!(d.free(p), Err(AllocError::Backend(_))), "{conf}");
        d.check_invariants().unwrap();
        let syncs = d.backend().calls(SimCall::Synchronize);
        for _ in 0..100 {
            let q = d.malloc(MIB, 0).unwrap_or_else(|e| panic!("{conf}: {e}"));
            d.free(q).unwrap();
            d.check_invariants().unwrap();
        }
        assert_eq!(
            d.backend().calls(SimCall::Synchronize),
            syncs + 2,
            "{conf}: the stream and the device once, then nothing"
        );
        assert_eq!(d.backend().synchronized_streams, [0xdead], "{conf}");
        assert_eq!(d.stats().allocated_bytes.all.current, 0, "{conf}");
        assert_eq!(
            d.stats().active_bytes.all.current,
            0,
            "{conf}: the block was freed"
        );
    }
}

/// Note [Streams that refuse events]: a segment outlives its stream (an
/// external stream the program destroyed). Growth covers every segment's
/// stream, but the dead handle is handed to the driver once, not at every
/// growth; the allocator goes on, and once a stream with that handle
/// allocates again, from the cache or not, events on it are recorded
/// again. Without defragmentation the dead stream's segment stays, and the
/// new stream's request is served from it without a growth.
#[test]
fn a_destroyed_streams_handle_is_not_handed_to_the_driver_at_every_growth() {
    for conf in ["", "defragment:false"] {
        let mut d = DeviceAllocator::new(0, SimBackend::new(8 << 30), Config::parse(conf).unwrap());
        let p = d.malloc(64 * MIB, 0xdead).unwrap();
        d.free(p).unwrap();
        d.backend_mut().refuse_events_on(0xdead);
        let refused = |d: &DeviceAllocator<SimBackend>| {
            d.backend().calls(SimCall::RecordEvent) - d.backend().counters.record_event
        };
        let mut kept = Vec::new();
        for _ in 0..20 {
            let r = d.malloc(3 * MIB, 0).unwrap();
            d.free(r).unwrap();
            kept.push(d.malloc(32 * MIB, 0).unwrap());
            d.check_invariants().unwrap();
        }
        assert_eq!(refused(&d), 1, "{conf}: asked once, at the first growth");
        // A new stream gets the handle and allocates.
        d.backend_mut().accept_events_on(0xdead);
        let (reserved, recorded) = (
            d.stats().reserved_bytes.all.current,
            d.backend().counters.record_event,
        );
        let q = d.malloc(8 * MIB, 0xdead).unwrap();
        if conf == "defragment:false" {
            assert_eq!(
                d.stats().reserved_bytes.all.current,
                reserved,
                "from the cache"
            );
        }
        d.free(q).unwrap();
        let r = d.malloc(3 * MIB, 0).unwrap();
        d.free(r).unwrap();
        kept.push(d.malloc(32 * MIB, 0).unwrap());
        assert_eq!(refused(&d), 1, "{conf}");
        assert!(d.backend().counters.record_event > recorded, "{conf}");
        // Its pages leave after an event on it, not a device synchronization.
        let syncs = d.backend().calls(SimCall::Synchronize);
        d.empty_cache().unwrap();
        assert_eq!(d.backend().calls(SimCall::Synchronize), syncs, "{conf}");
        for k in kept {
            d.free(k).unwrap();
        }
        d.check_invariants().unwrap();
        assert_eq!(d.stats().allocated_bytes.all.current, 0, "{conf}");
    }
}

/// Several streams destroyed with their segments cached: `empty_cache`
/// synchronizes the device once for all of them, not once for each, since
/// each one's wait is that same synchronization (Note [Streams that refuse
/// events]).
#[test]
fn streams_destroyed_together_cost_one_device_synchronization() {
    let dead = [0xd1, 0xd2, 0xd3];
    let mut d = DeviceAllocator::new(0, SimBackend::new(8 << 30), Config::default());
    let kept: Vec<_> = dead
        .iter()
        .map(|&s| {
            let p = d.malloc(64 * MIB, s).unwrap();
            let q = d.malloc(32 * MIB, s).unwrap();
            d.free(p).unwrap();
            q
        })
        .collect();
    for &s in &dead {
        d.backend_mut().refuse_events_on(s);
    }
    let syncs = d.backend().calls(SimCall::Synchronize);
    d.empty_cache().unwrap();
    assert_eq!(d.backend().calls(SimCall::Synchronize), syncs + 1);
    assert_eq!(
        d.stats().reserved_bytes.all.current,
        3 * 32 * MIB as i64,
        "every dead stream's free pages went back"
    );
    d.check_invariants().unwrap();
    // Blocks freed after that synchronization need one of their own.
    for k in kept {
        d.free(k).unwrap();
    }
    d.empty_cache().unwrap();
    assert_eq!(d.backend().calls(SimCall::Synchronize), syncs + 2);
    assert_eq!(d.stats().reserved_bytes.all.current, 0);
    d.check_invariants().unwrap();
}

/// The same for another GPU's default stream (Note [Streams of other
/// devices]): that GPU is synchronized too before the block is freed.
#[test]
fn a_refused_event_on_another_gpus_default_stream_synchronizes_that_gpu() {
    let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::default());
    let p = d.malloc(4 * MIB, 0).unwrap();
    d.record_stream_of_device(p, 0, 1).unwrap();
    let other = gpualloc::backend::stream_on_device(0, 1, 0);
    d.backend_mut().refuse_events_on(other);
    assert!(matches!(d.free(p), Err(AllocError::Backend(_))));
    let syncs = d.backend().calls(SimCall::Synchronize);
    let q = d.malloc(MIB, 0).unwrap();
    assert_eq!(
        d.backend().calls(SimCall::Synchronize),
        syncs + 2,
        "device 1 (its default stream), then this device"
    );
    assert_eq!(
        d.stats().active_bytes.all.current,
        MIB as i64,
        "p was freed"
    );
    d.free(q).unwrap();
    d.check_invariants().unwrap();
}

/// A side stream of another GPU (its handle is unique, so it is keyed as
/// is) whose events are refused: device 0's synchronization does not cover
/// it, so it is synchronized itself before the block is freed; a stream
/// that cannot be synchronized either (destroyed) is passed over.
#[test]
fn a_refused_event_on_another_gpus_side_stream_synchronizes_that_stream() {
    for gone in [false, true] {
        let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::default());
        let p = d.malloc(4 * MIB, 0).unwrap();
        d.record_stream_of_device(p, 0xbeef, 1).unwrap();
        d.backend_mut().refuse_events_on(0xbeef);
        assert!(matches!(d.free(p), Err(AllocError::Backend(_))));
        if gone {
            // The stream's sync, then the device's, fail once each time
            // asked: the first is passed over, the second succeeds.
            d.backend_mut().fail_call(SimCall::Synchronize, 1);
        }
        let q = d.malloc(MIB, 0).unwrap();
        assert_eq!(d.backend().synchronized_streams, [0xbeef], "gone {gone}");
        assert_eq!(
            d.stats().active_bytes.all.current,
            MIB as i64,
            "gone {gone}: p was freed"
        );
        d.free(q).unwrap();
        d.check_invariants().unwrap();
    }
}

/// A backend whose creation is slow, like retaining a CUDA context.
fn slow(device: u32) -> Result<SimBackend, gpualloc::BackendError> {
    std::thread::sleep(Duration::from_millis(2));
    let _ = device;
    Ok(SimBackend::new(1 << 30))
}

#[test]
fn marks_and_phases_race_first_use_of_a_device_without_deadlock() {
    let dir = std::env::temp_dir().join(format!("gpualloc-race-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("race.gtrace");
    let a = Arc::new(Allocator::new(Config::default(), 64, Box::new(slow)));
    a.trace_start(&path).unwrap();
    let (done, wait) = mpsc::channel();
    let marker = {
        let a = a.clone();
        std::thread::spawn(move || {
            for i in 0..2000 {
                a.phase_push("p").unwrap();
                a.mark(if i % 2 == 0 { "even" } else { "odd" }).unwrap();
                a.phase_pop();
            }
        })
    };
    let user = {
        let a = a.clone();
        std::thread::spawn(move || {
            for device in 1..64 {
                let p = a.malloc(device, 4096, 0).unwrap();
                a.free(device, p).unwrap();
            }
            done.send(()).unwrap();
        })
    };
    assert!(
        wait.recv_timeout(Duration::from_secs(60)).is_ok(),
        "deadlock: first use of a device vs. trace annotations"
    );
    user.join().unwrap();
    marker.join().unwrap();
    let s = a.trace_stop().unwrap();
    assert!(s.events > 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn reading_stats_of_an_unused_device_does_not_start_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static STARTED: AtomicUsize = AtomicUsize::new(0);
    let a = Allocator::new(
        Config::parse("max_split_size_mb:64").unwrap(),
        4,
        Box::new(|_| {
            STARTED.fetch_add(1, Ordering::SeqCst);
            Ok(SimBackend::new(1 << 30))
        }),
    );
    let s = a.stats(3).unwrap();
    // Nor do resets (`torch.cuda.reset_peak_memory_stats()` before
    // `set_device` would otherwise hold a context on GPU 0 in every rank).
    a.reset_peak_stats(2).unwrap();
    a.reset_accumulated_stats(2).unwrap();
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(s.max_split_size, 64 << 20);
    assert_eq!(
        STARTED.load(Ordering::SeqCst),
        0,
        "stats must not create a device (a CUDA context)"
    );
    assert!(a.stats(4).is_err(), "device 4 does not exist");
    a.malloc(3, 4096, 0).unwrap();
    assert_eq!(STARTED.load(Ordering::SeqCst), 1);
    assert_eq!(a.stats(3).unwrap().allocation.all.current, 1);
}

/// `enablePeerAccess`: the device whose memory is accessed grants the
/// peer access once, through its backend; bad indices are named errors.
#[test]
fn peer_access_reaches_the_accessed_devices_backend() {
    let a = Allocator::new(
        Config::default(),
        2,
        Box::new(|d| Ok(SimBackend::new(1 << 30).for_device(d))),
    );
    a.add_peer_access(1, 0).unwrap();
    a.add_peer_access(1, 0).unwrap();
    assert_eq!(a.lock(1).unwrap().backend().peers, vec![0]);
    assert!(
        a.peek(0).unwrap().is_none(),
        "the peer itself is not started"
    );
    for (device, peer) in [(1, 2), (5, 0), (-1, 0)] {
        assert!(
            matches!(
                a.add_peer_access(device, peer),
                Err(AllocError::InvalidDevice { .. })
            ),
            "{device} {peer}"
        );
    }
}

#[test]
fn simulated_devices_hand_out_distinct_addresses() {
    let a = Allocator::new(
        Config::default(),
        3,
        Box::new(|d| Ok(SimBackend::new(1 << 30).for_device(d))),
    );
    let p0 = a.malloc(0, 1 << 20, 0).unwrap();
    let p1 = a.malloc(1, 1 << 20, 0).unwrap();
    assert_ne!(p0, p1);
    // A free naming another device finds the owner (PyTorch frees by the
    // pointer alone), and a device never used is not started for it.
    a.free(1, p0).unwrap();
    a.free(2, p1).unwrap();
    assert!(a.peek(2).unwrap().is_none(), "device 2 was not started");
    for device in [0, 2] {
        assert!(
            matches!(
                a.free(device, p0),
                Err(AllocError::InvalidPointer { device: d, .. }) if i64::from(d) == device
            ),
            "a pointer no device holds, named on device {device}"
        );
    }
    assert!(a.peek(2).unwrap().is_none());
    for d in 0..2 {
        a.peek(d).unwrap().unwrap().check_invariants().unwrap();
    }
}

#[test]
fn marks_with_ever_new_names_keep_the_trace_bounded() {
    use gpualloc::trace::Action;
    use gpualloc::trace::reader::TraceReader;
    let dir = std::env::temp_dir().join(format!("gpualloc-marks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("marks.gtrace");
    let a = Allocator::new(
        Config::default(),
        1,
        Box::new(|_| Ok(SimBackend::new(1 << 30))),
    );
    a.free(0, a.malloc(0, 4096, 0).unwrap()).unwrap();
    a.trace_start(&path).unwrap();
    for i in 0..70_000 {
        a.mark(&format!("step {i}")).unwrap();
    }
    a.trace_stop().unwrap();
    let mut r = TraceReader::open(&path).unwrap();
    let marks: Vec<_> = r.events().filter(|e| e.action == Action::Mark).collect();
    assert!(r.error().is_none());
    assert_eq!(marks.len(), 70_000, "every mark is recorded");
    assert!(
        r.strings().len() <= (1 << 16) + 1,
        "{} strings kept",
        r.strings().len()
    );
    assert_eq!(r.string(marks[0].name_id().unwrap()), Some("step 0"));
    assert_eq!(
        r.string(marks[69_999].name_id().unwrap()),
        Some("(more names than the trace keeps)")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_panic_while_a_device_is_locked_poisons_only_that_device() {
    let a = Allocator::new(
        Config::default(),
        2,
        Box::new(|d| Ok(SimBackend::new(1 << 30).for_device(d))),
    );
    let p = a.malloc(0, 4096, 0).unwrap();
    let q = a.malloc(1, 4096, 0).unwrap();
    // A contract violation inside the lock (the simulator panics on it).
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut d = a.lock(0).unwrap();
        let _ = gpualloc::Backend::release(d.backend_mut(), 0xdead_0000, 512);
    }));
    assert!(caught.is_err());
    assert!(matches!(
        a.malloc(0, 4096, 0),
        Err(AllocError::Poisoned { device: 0 })
    ));
    assert!(matches!(
        a.free(0, p),
        Err(AllocError::Poisoned { device: 0 })
    ));
    assert!(
        matches!(a.free(-1, p), Err(AllocError::Poisoned { device: 0 })),
        "a free without its device finds the owner poisoned too"
    );
    assert!(matches!(
        a.snapshot(0),
        Err(AllocError::Poisoned { device: 0 })
    ));
    let msg = AllocError::Poisoned { device: 0 }.to_string();
    assert!(msg.contains("device 0") && msg.contains("restart"), "{msg}");
    // The other device is untouched; stats of the poisoned one remain readable.
    a.free(1, q).unwrap();
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 1);
    a.empty_cache().unwrap();
}

#[test]
fn a_free_without_its_device_finds_the_owner() {
    let a = Allocator::new(
        Config::default(),
        3,
        Box::new(|d| Ok(SimBackend::new(1 << 30).for_device(d))),
    );
    let p0 = a.malloc(0, 4096, 0).unwrap();
    let p2 = a.malloc(2, 8 << 20, 0).unwrap();
    a.free(-1, p2).unwrap();
    assert_eq!(a.stats(2).unwrap().allocation.all.current, 0);
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 1);
    let e = a.free(-1, p2).unwrap_err();
    assert!(matches!(e, AllocError::InvalidPointer { .. }), "{e}");
    assert!(e.to_string().contains("on any device"), "{e}");
    a.free(-1, p0).unwrap();
    assert_eq!(a.stats(0).unwrap().allocation.all.current, 0);
}

/// `free_if_unlocked` (a free in a forked child, Note [Freeing in a forked
/// child] in the C library): frees as `free` does, but leaves the pointer
/// alone rather than wait when its device's lock is held.
#[test]
fn a_free_that_must_not_wait_passes_over_a_held_device() {
    let a = Allocator::new(
        Config::default(),
        2,
        Box::new(|d| Ok(SimBackend::new(1 << 30).for_device(d))),
    );
    let p = a.malloc(1, 1 << 20, 0).unwrap();
    let q = a.malloc(1, 1 << 20, 0).unwrap();
    {
        let _held = a.peek(1).unwrap().unwrap();
        assert!(!a.free_if_unlocked(p).unwrap(), "device 1 is held");
    }
    assert!(a.free_if_unlocked(p).unwrap());
    assert!(
        !a.free_if_unlocked(p).unwrap(),
        "no device holds it any more"
    );
    a.free(1, q).unwrap();
    let d = a.peek(1).unwrap().unwrap();
    assert_eq!(d.stats().allocated_bytes.all.current, 0);
    d.check_invariants().unwrap();
}

/// A stream that only a graph's pool used gets fences like any other (a
/// large free after the capture); `empty_cache` waits for them without
/// recording new ones, so it neither leaks their events nor fails once the
/// stream refuses events (destroyed since).
#[test]
fn empty_cache_waits_for_a_graph_only_streams_fences_without_recording() {
    let mut c = Checked::with(1 << 30, "");
    let key = (1, 0);
    c.begin_pool(key, Some(9));
    let blocks: Vec<u64> = (0..16).map(|_| c.alloc(4 * MIB, 9)).collect();
    c.end_pool(key);
    for p in blocks {
        c.release(p);
    }
    assert!(
        c.sim().live_events() > 0,
        "the sixteenth large free records a fence"
    );
    c.release_pool(key).unwrap();
    c.sim_mut().refuse_events_on(9);
    c.dev.empty_cache().unwrap();
    c.dev.empty_cache().unwrap();
    c.check();
    assert_eq!(c.sim().live_events(), 0, "every fence destroyed");
    assert_eq!(c.reserved(), 0);
}

/// A stream that made expandable segments and was then destroyed (an
/// external stream; the simulator refuses its events): other streams'
/// growth, which would record a fence on it, and pages taken from it,
/// which would wait for one, synchronize the device instead, and
/// `empty_cache` still gives its memory back.
#[test]
fn a_destroyed_stream_with_cached_pages_does_not_stop_growth_or_empty_cache() {
    for conf in [
        "",
        "expandable_handle_mb:2,defragment_headroom:0,defragment_pressure:1",
    ] {
        let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::parse(conf).unwrap());
        let keep = d.malloc(8 * MIB, 7).unwrap();
        let gone = d.malloc(64 * MIB, 7).unwrap();
        d.free(gone).unwrap();
        d.free(keep).unwrap();
        d.backend_mut().refuse_events_on(7);
        let syncs = d.backend().calls(SimCall::Synchronize);
        let p = d.malloc(64 * MIB, 0).unwrap();
        d.check_invariants().unwrap();
        let q = d.malloc(900 * MIB, 0).unwrap(); // needs stream 7's pages
        d.check_invariants().unwrap();
        assert!(
            d.backend().calls(SimCall::Synchronize) > syncs,
            "{conf}: the device, for the stream that refuses events"
        );
        d.free(p).unwrap();
        d.free(q).unwrap();
        d.empty_cache().unwrap();
        d.check_invariants().unwrap();
        assert_eq!(d.stats().reserved_bytes.all.current, 0, "{conf}");
        assert_eq!(d.backend().live_events(), 0, "{conf}");
    }
}
