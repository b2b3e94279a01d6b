//! Tests of `expandable.rs` (a sibling file: the module's own file stays short).

use crate::free_runs::RunOrder;
use crate::rng::Rng;
use crate::{Backend, Config, DeviceAllocator, SimBackend};

fn dev(conf: &str) -> DeviceAllocator<SimBackend> {
    DeviceAllocator::new(0, SimBackend::new(8 << 30), Config::parse(conf).unwrap())
}

/// Allocates blocks of these many MiB on `stream`, in order.
fn mallocs(d: &mut DeviceAllocator<SimBackend>, mib: &[u64], stream: u64) -> Vec<u64> {
    mib.iter()
        .map(|&m| d.malloc(m * MIB, stream).unwrap())
        .collect()
}

fn ok(d: &DeviceAllocator<SimBackend>) {
    d.check_invariants()
        .unwrap_or_else(|e| panic!("invariant broken: {e}"));
}

#[test]
fn grows_by_pages_and_reuses_contiguous_space() {
    let mut d = dev("expandable_segments:true,defragment:false,expandable_page_mb:20");
    let a = d.malloc(30 << 20, 0).unwrap();
    ok(&d);
    assert_eq!(
        d.stats().reserved_bytes.all.current,
        40 << 20,
        "two 20 MiB pages"
    );
    assert_eq!(
        d.stats().segment.all.current,
        0,
        "expandable segments are not counted as segments"
    );
    let b = d.malloc(5 << 20, 0).unwrap();
    ok(&d);
    assert_eq!(b, a + (30 << 20), "carved from the mapped tail");
    d.free(a).unwrap();
    ok(&d);
    // 40 MiB wanted: the free 30 MiB at the front cannot grow (b follows),
    // so pages are mapped after b; b's tail and new pages join.
    let c = d.malloc(40 << 20, 0).unwrap();
    ok(&d);
    assert_eq!(c, b + (5 << 20));
    d.free(b).unwrap();
    d.free(c).unwrap();
    ok(&d);
    // Everything free is one block: a 75 MiB request fits without growing.
    let before = d.stats().reserved_bytes.all.current;
    let e = d.malloc(75 << 20, 0).unwrap();
    assert_eq!(e, a);
    assert_eq!(d.stats().reserved_bytes.all.current, before);
    d.free(e).unwrap();
    d.empty_cache().unwrap();
    ok(&d);
    assert_eq!(d.stats().reserved_bytes.all.current, 0);
    assert_eq!(d.backend().used(), 0);
    assert_eq!(d.backend().mappings(), 0);
}

#[test]
fn empty_cache_unmaps_only_whole_free_pages() {
    let mut d = dev("expandable_segments:true,expandable_page_mb:20");
    let a = d.malloc(10 << 20, 0).unwrap();
    let b = d.malloc(25 << 20, 0).unwrap();
    let c = d.malloc(2 << 20, 0).unwrap();
    ok(&d);
    d.free(b).unwrap();
    d.empty_cache().unwrap();
    ok(&d);
    // a: [0,10) c: [35,37) with 20 MiB pages [0,20) [20,40): both pages hold live memory.
    assert_eq!(d.stats().reserved_bytes.all.current, 40 << 20);
    d.free(c).unwrap();
    d.empty_cache().unwrap();
    ok(&d);
    assert_eq!(d.stats().reserved_bytes.all.current, 20 << 20);
    d.free(a).unwrap();
    d.empty_cache().unwrap();
    ok(&d);
    assert_eq!(d.backend().used(), 0);
}

/// Handles created (count, bytes) while running `f`.
fn creates(
    d: &mut DeviceAllocator<SimBackend>,
    f: impl FnOnce(&mut DeviceAllocator<SimBackend>),
) -> (u64, u64) {
    use crate::cost::DriverCall::Create;
    let before = d.backend().driver_calls();
    f(d);
    let c = d.backend().driver_calls().since(&before);
    (c.handles(Create), c.bytes(Create))
}

#[test]
fn memory_empty_cache_gave_back_is_created_again_in_coarse_handles() {
    let mut d = dev("");
    let mut a = 0;
    // 128 MiB from nothing: handles of 128/8 = 16 MiB.
    assert_eq!(
        creates(&mut d, |d| a = d.malloc(128 << 20, 0).unwrap()),
        (8, 128 << 20)
    );
    d.free(a).unwrap();
    d.empty_cache().unwrap();
    // A second call gives nothing back and keeps the credit.
    d.empty_cache().unwrap();
    ok(&d);
    assert_eq!(d.stats().reserved_bytes.all.current, 0);
    // The same again: handles of twice the largest, 32 MiB.
    assert_eq!(
        creates(&mut d, |d| a = d.malloc(128 << 20, 0).unwrap()),
        (4, 128 << 20)
    );
    ok(&d);
    // The 128 MiB given back are spent: new memory follows the rule again.
    let mut b = 0;
    assert_eq!(
        creates(&mut d, |d| b = d.malloc(64 << 20, 0).unwrap()),
        (8, 64 << 20)
    );
    ok(&d);
    // A range larger than what is owed is not coarse at all.
    d.free(a).unwrap();
    d.free(b).unwrap();
    d.empty_cache().unwrap();
    assert_eq!(
        creates(&mut d, |d| a = d.malloc(256 << 20, 0).unwrap()),
        (16, 256 << 20)
    );
    ok(&d);
}

#[test]
fn the_out_of_memory_path_ends_regrowth() {
    // Two 300 MiB holes between live blocks; a 320 MiB request fits in
    // neither, and growing for it passes the limit: the out-of-memory
    // path releases the holes and creates 320 MiB afresh.
    let mut d = dev("defragment:false,memory_limit:640MiB");
    let a = d.malloc(300 << 20, 0).unwrap();
    d.malloc(4 << 20, 0).unwrap();
    let c = d.malloc(300 << 20, 0).unwrap();
    d.malloc(4 << 20, 0).unwrap();
    d.free(a).unwrap();
    d.free(c).unwrap();
    // Credit left over from an earlier `empty_cache`.
    d.pages.set_regrowth(1 << 30);
    let made = creates(&mut d, |d| {
        d.malloc(320 << 20, 0).unwrap();
    });
    ok(&d);
    assert_eq!(d.stats().num_alloc_retries, 1, "the out-of-memory path ran");
    assert_eq!(made, (20, 320 << 20), "handles of 320/8 -> 16 MiB, not 32");
}

/// Reserved memory and memory calls after a request that fits in the
/// defragmentation headroom of the all-time peak, but not in that of
/// the peak since `reset_peak_memory_stats`.
fn after_headroom_request(reset_peaks: bool) -> (i64, u64) {
    let mut d = dev("defragment_headroom:0.2,stitch_min_mb:0");
    let a = d.malloc(100 << 20, 0).unwrap();
    let _b = d.malloc(100 << 20, 0).unwrap();
    let c = d.malloc(100 << 20, 0).unwrap();
    d.free(a).unwrap();
    d.free(c).unwrap();
    if reset_peaks {
        d.reset_peak_stats();
    }
    d.malloc(150 << 20, 0).unwrap();
    ok(&d);
    let calls = d.backend().driver_calls().memory_calls();
    (d.stats().reserved_bytes.all.current, calls)
}

#[test]
fn resetting_peak_stats_changes_no_decision() {
    let (reserved, calls) = after_headroom_request(false);
    // 150 MiB go where c was, 50 MiB of them mapped: 350 MiB is within
    // 1.2 x the 300 MiB peak, not within 1.2 x the 250 MiB since the reset.
    assert_eq!(reserved, 350 << 20);
    assert_eq!(after_headroom_request(true), (reserved, calls));
}

#[test]
fn falls_back_to_plain_segments_without_virtual_memory() {
    struct NoVmm(SimBackend);
    impl Backend for NoVmm {
        fn alignment(&self) -> u64 {
            self.0.alignment()
        }
        fn mem_info(&mut self) -> Result<crate::MemInfo, crate::BackendError> {
            self.0.mem_info()
        }
        fn allocate(&mut self, size: u64, c: bool) -> Result<u64, crate::BackendError> {
            self.0.allocate(size, c)
        }
        fn release(&mut self, ptr: u64, size: u64) -> Result<(), crate::BackendError> {
            self.0.release(ptr, size)
        }
        fn record_event(&mut self, s: u64) -> Result<u64, crate::BackendError> {
            self.0.record_event(s)
        }
        fn event_done(&mut self, e: u64) -> Result<bool, crate::BackendError> {
            self.0.event_done(e)
        }
        fn wait_event(&mut self, e: u64) -> Result<(), crate::BackendError> {
            self.0.wait_event(e)
        }
        fn stream_wait_event(&mut self, s: u64, e: u64) -> Result<(), crate::BackendError> {
            self.0.stream_wait_event(s, e)
        }
        fn destroy_event(&mut self, e: u64) {
            self.0.destroy_event(e)
        }
    }
    let mut d = DeviceAllocator::new(
        0,
        NoVmm(SimBackend::new(1 << 30)),
        Config::parse("expandable_segments:true").unwrap(),
    );
    d.malloc(30 << 20, 0).unwrap();
    assert_eq!(d.stats().segment.all.current, 1);
    d.check_invariants().unwrap();
}

const MIB: u64 = 1 << 20;

/// Frees `ptrs` and empties the cache: nothing is left with the driver.
fn drained(mut d: DeviceAllocator<SimBackend>, ptrs: impl IntoIterator<Item = u64>) {
    for p in ptrs {
        d.free(p).unwrap();
    }
    d.empty_cache().unwrap();
    ok(&d);
    assert_eq!(d.backend().used(), 0);
}

/// An allocator whose only free memory is eight 16 MiB handles on
/// stream 0 (128 MiB allocated and freed), with its reserved bytes and
/// handle creations so far.
fn freed_16_mib_handles() -> (DeviceAllocator<SimBackend>, i64, u64) {
    let mut d = dev("");
    let big = d.malloc(128 * MIB, 0).unwrap();
    d.free(big).unwrap();
    ok(&d);
    let reserved = d.stats().reserved_bytes.all.current;
    let creates = d.backend().counters.create;
    (d, reserved, creates)
}

#[test]
fn a_small_page_takes_a_pooled_large_handle_instead_of_creating_one() {
    let (mut d, reserved, creates) = freed_16_mib_handles();
    // Holding a new 2 MiB small page would pass the bound: one 16 MiB
    // handle is unmapped, and the small pool maps it whole.
    let small = d.malloc(MIB, 0).unwrap();
    ok(&d);
    assert_eq!(d.stats().reserved_bytes.all.current, reserved, "no growth");
    assert_eq!(d.backend().counters.create, creates, "no handle created");
    assert_eq!(d.pooled_bytes(), 0, "no handle left unused in the pool");
    // The other 15 MiB of that handle serve small requests too.
    let more: Vec<u64> = (0..14).map(|_| d.malloc(MIB, 0).unwrap()).collect();
    ok(&d);
    assert_eq!(d.stats().reserved_bytes.all.current, reserved);
    drained(d, more.into_iter().chain([small]));
}

#[test]
fn another_streams_mapping_uses_whole_pooled_handles_instead_of_creating() {
    let (mut d, reserved, creates) = freed_16_mib_handles();
    // 27 MiB on stream 1 needs a 28 MiB window, over the bound: two
    // 16 MiB handles move, and the window widens to 32 MiB to map both
    // rather than creating 12 MiB beside the first.
    let p = d.malloc(27 * MIB, 1).unwrap();
    ok(&d);
    assert_eq!(d.stats().reserved_bytes.all.current, reserved, "no growth");
    assert_eq!(d.backend().counters.create, creates, "no handle created");
    assert_eq!(d.pooled_bytes(), 0, "no moved handle left unused");
    // The widened window's last 5 MiB serve the stream's next request.
    let q = d.malloc(4 * MIB, 1).unwrap();
    ok(&d);
    assert_eq!(q, p + 27 * MIB);
    assert_eq!(d.stats().reserved_bytes.all.current, reserved);
    drained(d, [p, q]);
}

/// A handle is mapped whole: pooled handles that fit the sum of a
/// window's ranges but no single range must count as created, or the
/// limit check lets the mapping pass the limit.
#[test]
fn pooled_handles_count_range_by_range_against_the_limit() {
    let mut d = dev("memory_limit:145MiB");
    // Stream 1: 8, 4, 8 and 2 MiB; the 8s freed and given back, so its
    // window for 18 MiB is two 8 MiB holes around the 4 MiB block.
    let held = mallocs(&mut d, &[8, 4, 8, 2], 1);
    d.free(held[0]).unwrap();
    d.free(held[2]).unwrap();
    d.empty_cache().unwrap();
    // Stream 0's 128 MiB, freed: eight 16 MiB handles to move.
    let big = d.malloc(128 * MIB, 0).unwrap();
    d.free(big).unwrap();
    d.free(held[1]).unwrap();
    ok(&d);
    let limit = 145 * MIB as i64;
    let r = d.malloc(18 * MIB, 1);
    ok(&d);
    assert!(
        d.stats().reserved_bytes.all.current <= limit,
        "reserved {} over the limit {limit} ({r:?})",
        d.stats().reserved_bytes.all.current
    );
    assert!(d.backend().used() as i64 <= limit);
}

#[test]
fn defragmentation_takes_pages_a_cached_stitch_pins_rather_than_growing() {
    for budget in ["1", "0.05", "0"] {
        let conf = format!("expandable_handle_mb:2,defragment_budget:{budget}");
        let grew = stitch_pinned_growth(&conf);
        // Without budget, the stitch is kept and the pool grows.
        assert_eq!(grew, budget == "0", "{conf}: grew {grew}");
    }
}

#[test]
fn a_spent_budget_takes_pinned_pages_only_rather_than_raise_the_reserved_peak() {
    // Out of credit, pages a cached stitch pins are left alone while the
    // pool can grow within the most it ever reserved; past that they are
    // taken (Note [Defragmentation budget]). A share of 0 never takes them.
    for (budget, high, grows) in [
        ("0.01", false, false),
        ("0.01", true, true),
        ("0", false, true),
    ] {
        let conf = format!("expandable_handle_mb:2,defragment_budget:{budget}");
        let grew = stitch_pinned_growth_after(&conf, |d| {
            d.defrag_budget.charge(1e15);
            if high {
                d.reserved_high_before_reset = 1 << 40;
            }
        });
        assert_eq!(grew, grows, "{conf}, high water raised: {high}");
    }
}

/// Whether a request whose only free pages are pinned by a cached stitch
/// grows the pool.
fn stitch_pinned_growth(conf: &str) -> bool {
    stitch_pinned_growth_after(conf, |_| {})
}

/// [`stitch_pinned_growth`], with `prepare` run on the device just before
/// the request.
fn stitch_pinned_growth_after(
    conf: &str,
    prepare: impl FnOnce(&mut DeviceAllocator<SimBackend>),
) -> bool {
    let (mut d, small) = crate::stitch::tests::fragmented_with(conf);
    // A 64 MiB stitch over four pieces; the other four hold 16 MiB blocks.
    let stitched = d.malloc(64 * MIB, 0).unwrap();
    assert_eq!(d.stats().num_stitch, 1);
    let held: Vec<u64> = (0..4).map(|_| d.malloc(16 * MIB, 0).unwrap()).collect();
    d.free(stitched).unwrap();
    ok(&d);
    let reserved = d.stats().reserved_bytes.all.current;
    prepare(&mut d);
    // 24 MiB fits in no piece; the only free pages are those the cached
    // stitch aliases. They are moved (and unmapped from the stitch,
    // leaving holes) rather than the pool growing past the bound.
    let p = d.malloc(24 * MIB, 0).unwrap();
    ok(&d);
    let grew = d.stats().reserved_bytes.all.current > reserved;
    assert_eq!(d.stats().num_stitch, 1);
    for q in held.into_iter().chain(small).chain([p]) {
        d.free(q).unwrap();
    }
    d.empty_cache().unwrap();
    ok(&d);
    assert_eq!(d.backend().used(), 0);
    assert_eq!(d.backend().mappings(), 0);
    grew
}

/// Multi-scale pattern: each step allocates a batch of activations whose
/// sizes depend on a random input scale, then frees them.
fn multiscale_peak(conf: &str) -> (i64, i64, i64) {
    let mut d = dev(conf);
    let mut rng = Rng::xorshift64(0x2545_f491_4f6c_dd1d);
    let mut keep = Vec::new();
    for _ in 0..200 {
        let x = rng.next_u64();
        let scale = 320 + (x % 10) * 32;
        let mut step = Vec::new();
        for layer in 0..12u64 {
            let bytes = scale * scale * (16 << (layer % 4)) + (x % 4096);
            step.push(d.malloc(bytes, 0).unwrap());
        }
        if x.is_multiple_of(7) {
            keep.push(d.malloc(scale * 4096, 0).unwrap());
        }
        for p in step {
            d.free(p).unwrap();
        }
    }
    d.check_invariants().unwrap();
    let s = d.stats();
    (
        s.reserved_bytes.all.peak,
        s.allocated_bytes.all.peak,
        s.requested_bytes.all.peak,
    )
}

#[test]
fn a_small_request_is_never_stitched_whatever_stitch_min() {
    let mut d = dev("expandable_handle_mb:2,stitch_min_mb:1");
    let mut big = Vec::new();
    for _ in 0..4 {
        big.push(d.malloc(4 << 20, 0).unwrap());
        d.malloc(2 << 20, 0).unwrap();
    }
    for p in big {
        d.free(p).unwrap();
    }
    ok(&d);
    let p = d.malloc(1 << 20, 0).unwrap();
    ok(&d);
    let s = d.stats();
    assert_eq!(s.num_stitch, 0, "1 MiB is a small-pool request");
    assert_eq!(s.allocated_bytes.small_pool.current, 1 << 20);
    assert_eq!(s.allocated_bytes.large_pool.current, 4 * (2 << 20));
    d.free(p).unwrap();
    ok(&d);
}

#[test]
fn expandable_segments_cut_fragmentation_on_multiscale_shapes() {
    let ratio = |conf: &str| {
        let (r, a, q) = multiscale_peak(conf);
        (r as f64 / a as f64, q)
    };
    let (plain, plain_q) = ratio("policy:pytorch");
    let (default, default_q) = ratio("");
    let (fine, _) = ratio("expandable_handle_mb:2");
    let (pytorch_like, _) = ratio("defragment:false,expandable_page_mb:20");
    assert_eq!(plain_q, default_q, "the same requests");
    for (name, r) in [("default", default), ("2 MiB handles", fine)] {
        assert!(r < plain, "{name} {r:.3} vs plain {plain:.3}");
        assert!(
            r < pytorch_like,
            "{name} {r:.3} vs PyTorch-like expandable {pytorch_like:.3}"
        );
    }
    // Long-lived small blocks among transient large ones pin the pages
    // under them; the finer the handles, the less they pin.
    assert!(fine < 1.08, "2 MiB handles: reserved/allocated {fine:.3}");
    assert!(fine <= default, "{fine:.3} vs {default:.3}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(crate::proptest_cases(64)))]
    #[test]
    fn random_ops_keep_invariants(
        ops in proptest::collection::vec((0u8..10, 1u64..(48 << 20), 0u64..3), 1..120),
        defrag in proptest::bool::ANY,
    ) {
        let conf = format!("expandable_segments:true,defragment:{defrag}");
        let mut d = DeviceAllocator::new(0, SimBackend::new(1 << 30), Config::parse(&conf).unwrap());
        let mut live: Vec<(u64, u64)> = Vec::new();
        for (op, size, stream) in ops {
            match op {
                0..=5 => {
                    if let Ok(p) = d.malloc(size, stream) {
                        for &(q, qs) in &live {
                            proptest::prop_assert!(p + size <= q || q + qs <= p, "overlap");
                        }
                        live.push((p, size));
                    }
                }
                6..=8 if !live.is_empty() => {
                    let (p, _) = live.swap_remove((size as usize) % live.len());
                    d.free(p).unwrap();
                }
                _ => d.empty_cache().unwrap(),
            }
            ok(&d);
            proptest::prop_assert_eq!(d.stats().reserved_bytes.all.current as u64, d.backend().used());
        }
        for (p, _) in live {
            d.free(p).unwrap();
        }
        d.empty_cache().unwrap();
        ok(&d);
        proptest::prop_assert_eq!(d.backend().used(), 0);
        proptest::prop_assert_eq!(d.backend().mappings(), 0);
    }
}

/// Note [Spare handles at the high-water mark]: pooled handles a mapping
/// cannot use that still back their old place, where queued work reads
/// them, are waited for and then given back, rather than kept pooled
/// while the mapping creates memory past the high-water mark.
#[test]
fn spare_handles_still_mapped_at_their_old_place_are_waited_for_and_released() {
    let mut d = dev("defragment_headroom:0,defragment_pressure:1,stitch_min_mb:0");
    let a = d.malloc(128 * MIB, 0).unwrap();
    let b = d.malloc(2 * MIB, 0).unwrap();
    d.backend_mut().launch(0);
    d.free(a).unwrap();
    // Defragmentation moves a's eight 16 MiB handles without waiting.
    let seg = d.heap.pools[crate::heap::LARGE as usize].expandable[0].1;
    assert_eq!(
        d.reclaim(128 * MIB, 0, (seg, 0, 0), false, RunOrder::LargestFirst)
            .unwrap(),
        128 * MIB
    );
    ok(&d);
    assert!(!d.drains.is_empty(), "old range still mapped");
    let (reserved, waits) = (
        d.stats().reserved_bytes.all.current,
        d.backend().counters.wait_event,
    );
    // A mapping of 10 MiB can use none of them: one goes back, after its
    // old range's work is waited for.
    let hole = 1 << 40;
    d.release_spare(&[(hole, hole + 10 * MIB)], 2 * MIB, 10 * MIB);
    ok(&d);
    assert_eq!(d.backend().counters.wait_event, waits + 1);
    assert_eq!(
        d.stats().reserved_bytes.all.current,
        reserved - 16 * (MIB as i64)
    );
    assert_eq!(d.pooled_bytes(), 112 * MIB);
    assert!(d.drains.is_empty(), "waited for and unmapped");
    drained(d, [b]);
}

/// Two 2 MiB holes 2 MiB apart, pages moved from a 128 MiB block freed on
/// stream 0 (its work done or not, `done`), and a 40 MiB request that
/// passes the high-water mark by 4 MiB: the reserved bytes it leaves.
fn spare_release_after(done: bool) -> i64 {
    let mut d = dev("defragment_headroom:0,defragment_pressure:1,stitch_min_mb:0");
    let p: Vec<u64> = (0..21).map(|_| d.malloc(2 * MIB, 0).unwrap()).collect();
    p.iter()
        .skip(1)
        .step_by(2)
        .for_each(|&v| d.free(v).unwrap());
    d.empty_cache().unwrap();
    let (x, c) = (
        d.malloc(128 * MIB, 0).unwrap(),
        d.malloc(32 * MIB, 0).unwrap(),
    );
    let _b = d.malloc(6 * MIB, 0).unwrap();
    let t = d.malloc(16 * MIB, 0).unwrap(); // the peak: 204 MiB
    d.free(t).unwrap();
    d.empty_cache().unwrap();
    let seg = d.heap.pools[crate::heap::LARGE as usize].expandable[0].1;
    d.free(c).unwrap(); // c's eight 4 MiB handles pooled, idle
    d.reclaim(32 * MIB, 0, (seg, 0, 0), false, RunOrder::LargestFirst)
        .unwrap();
    d.finish_drains().unwrap();
    d.backend_mut().launch(0);
    d.free(x).unwrap();
    d.fences.cover_all(&mut d.backend, [0]);
    assert_eq!(d.malloc(112 * MIB, 0).unwrap(), x); // one 16 MiB handle free
    p.iter()
        .take(20)
        .step_by(2)
        .for_each(|&v| d.free(v).unwrap());
    if done {
        d.backend_mut().complete(0);
    }
    // Ten 2 MiB holes: moves x's last handle, passes the mark by 4 MiB.
    assert_eq!(d.malloc(40 * MIB, 0).unwrap(), p[0]);
    ok(&d);
    d.stats().reserved_bytes.all.current >> 20
}

/// Which spare handles go back never depends on whether moved pages are
/// still mapped at their old place, which depends on the GPU's progress:
/// a replay makes the same decisions as the run it replays.
#[test]
fn spare_handles_released_are_alike_however_far_the_gpu_got() {
    assert_eq!(spare_release_after(true), spare_release_after(false));
}

/// Two 16 MiB handles moved from blocks freed behind two fences on stream
/// 0, one spare for a 24 MiB request over holes of 16 and 2 MiB: the
/// allocator, the hole's address and the later fence's stamp.
fn two_drains() -> (DeviceAllocator<SimBackend>, u64, u64) {
    let mut d = dev("defragment_headroom:0,defragment_pressure:1,stitch_min_mb:0");
    let w = mallocs(&mut d, &[2, 16, 2, 2, 2, 2], 0);
    d.free(w[1]).unwrap();
    d.free(w[3]).unwrap();
    d.empty_cache().unwrap();
    let x = d.malloc(128 * MIB, 0).unwrap();
    d.free(x).unwrap();
    let (u1, _v) = (
        d.malloc(16 * MIB, 0).unwrap(),
        d.malloc(16 * MIB, 0).unwrap(),
    );
    let (u2, _r) = (
        d.malloc(16 * MIB, 0).unwrap(),
        d.malloc(80 * MIB, 0).unwrap(),
    );
    d.backend_mut().launch(0);
    d.free(u1).unwrap();
    d.fences.cover_all(&mut d.backend, [0]);
    d.backend_mut().launch(0);
    d.free(u2).unwrap();
    let seg = d.heap.pools[crate::heap::LARGE as usize].expandable[0].1;
    let late = d.heap.blocks[d.heap.block_at(seg, u2)].freed;
    d.fences.cover_all(&mut d.backend, [0]);
    [0, 2, 4].iter().for_each(|&i| d.free(w[i]).unwrap());
    (d, w[0], late)
}

/// Only the spare handle's old place is waited for, as the request would
/// wait for it after mapping anyway; the one the mapping takes is not.
#[test]
fn releasing_a_spare_handle_waits_for_its_own_old_place_only() {
    let (mut d, at, late) = two_drains();
    let waits = d.backend().counters.wait_event;
    assert_eq!(d.malloc(24 * MIB, 0).unwrap(), at);
    let waits = d.backend().counters.wait_event - waits;
    assert_eq!((waits, d.fences.is_idle(0, late)), (1, false));
    ok(&d);
}

/// A wait, unmap or release that fails while spare handles go back fails
/// no request and leaves nothing behind.
#[test]
fn faults_while_spare_handles_go_back_fail_no_request() {
    use crate::backend::sim::SimCall::*;
    for (call, n, k) in [
        (WaitEvent, 1, 1),
        (WaitEvent, 2, 1),
        (WaitEvent, 1, 4),
        (Unmap, 1, 1),
        (Unmap, 2, 1),
        (ReleaseHandle, 1, 1),
        (ReleaseHandle, 1, 3),
    ] {
        let (mut d, _, _) = two_drains();
        d.backend_mut().fail_calls(call, n, k);
        let r = d.malloc(24 * MIB, 0).unwrap();
        ok(&d);
        d.backend_mut().fail_calls(call, 1 << 60, 1);
        let q = d.malloc(16 * MIB, 1).unwrap();
        d.free(q).unwrap();
        d.free(r).unwrap();
        d.backend_mut().complete_all();
        d.empty_cache().unwrap();
        ok(&d);
        assert_eq!(d.pooled_bytes(), 0);
    }
}

/// Reserved memory after a 150 MiB request that fits neither of two free
/// 100 MiB runs, beside 100 MiB live, the peak of allocated memory 300
/// MiB, on a device of `capacity` bytes.
fn after_request_near_the_cap(capacity: u64, conf: &str) -> i64 {
    after_request_near_the_cap_with(capacity, conf, None)
}

/// The same, with `fraction` set at run time first, as PyTorch's
/// `set_per_process_memory_fraction` sets it.
fn after_request_near_the_cap_with(capacity: u64, conf: &str, fraction: Option<f64>) -> i64 {
    let mut d = DeviceAllocator::new(0, SimBackend::new(capacity), Config::parse(conf).unwrap());
    if let Some(f) = fraction {
        d.set_memory_fraction(f).unwrap();
    }
    let a = d.malloc(100 << 20, 0).unwrap();
    let _b = d.malloc(100 << 20, 0).unwrap();
    let c = d.malloc(100 << 20, 0).unwrap();
    d.free(a).unwrap();
    d.free(c).unwrap();
    d.malloc(150 << 20, 0).unwrap();
    ok(&d);
    d.stats().reserved_bytes.all.current
}

/// Note [Headroom under pressure]: past half a 512 MiB limit, the request
/// grows by what 5% over the 300 MiB peak allows and moves only the rest;
/// far from the limit, with `defragment_pressure:1`, or past half of a
/// device without a limit (a fraction of 1 is none, and a limit above the
/// device is read as set), it moves all it lacks.
#[test]
fn near_a_limit_the_headroom_is_five_percent() {
    let moved_all = 300 << 20;
    for (capacity, conf) in [
        (8 << 30, "stitch_min_mb:0,memory_limit:7GiB"),
        (
            8 << 30,
            "stitch_min_mb:0,memory_limit:512MiB,defragment_pressure:1",
        ),
        (512 << 20, "stitch_min_mb:0"),
        (512 << 20, "stitch_min_mb:0,per_process_memory_fraction:1"),
        (512 << 20, "stitch_min_mb:0,memory_limit:1GiB"),
    ] {
        assert_eq!(
            after_request_near_the_cap(capacity, conf),
            moved_all,
            "{conf}"
        );
    }
    // It lacks 50 MiB: 350 MiB would pass 1.05 x 300 by 35, which move
    // in whole handles (40 MiB); the other 10 MiB grow.
    let grew = after_request_near_the_cap(8 << 30, "stitch_min_mb:0,memory_limit:512MiB");
    assert_eq!(grew, 310 << 20);
    // A fraction is a limit as bytes are; a share of 0 applies the 5%
    // from the first request on under any limit.
    for conf in [
        "per_process_memory_fraction:0.0625",
        "memory_limit:7GiB,defragment_pressure:0",
    ] {
        let on_8_gib = after_request_near_the_cap(8 << 30, &format!("stitch_min_mb:0,{conf}"));
        assert_eq!(on_8_gib, grew, "{conf}");
    }
    let set_at_run_time = after_request_near_the_cap_with(8 << 30, "stitch_min_mb:0", Some(0.0625));
    assert_eq!(set_at_run_time, grew);
}
