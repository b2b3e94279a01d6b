//! Sharing an allocation with another process (Note [Sharing expandable
//! memory] in `ipc.rs`): a plain segment shares whole with the block's
//! offset; expandable memory shares exactly the physical handles the
//! simulator has mapped under the block, in address order, exported once,
//! and of one size: a handle at either end that another block lives in
//! stays and the handles between take its size; several sizes remain only
//! when both end handles stay with different sizes, the moved length is no
//! multiple of the kept size, or the block was shared already.

use gpualloc::{AllocError, Sharing};
use gpualloc_tests::{Checked, MIB};

/// `Checked::share` of a block of expandable memory.
fn shares_exactly_its_handles(c: &mut Checked, p: u64, size: u64) -> Sharing {
    assert!(c.live[&p].block >= size);
    let sharing = c.share(p);
    assert!(
        matches!(sharing, Sharing::Handles { .. }),
        "expandable memory shared as {sharing:?}"
    );
    sharing
}

#[test]
fn a_plain_segment_shares_whole_with_the_offset() {
    let mut c = Checked::with(1 << 30, "policy:pytorch");
    let a = c.alloc(4 * MIB, 0);
    let b = c.alloc(4 * MIB, 0);
    for p in [a, b] {
        let base = c
            .snapshot()
            .iter()
            .find(|s| s.address <= p && p < s.address + s.total_size)
            .unwrap()
            .address;
        assert_eq!(
            c.dev.share(p).unwrap(),
            Sharing::Segment {
                base,
                offset: p - base
            }
        );
    }
    c.check();
}

#[test]
fn expandable_blocks_share_the_handles_under_them() {
    let mut c = Checked::with(1 << 30, "policy:gpualloc");
    // Small blocks inside one page, blocks across pages, a large block.
    let sizes = [512, 100_000, 3 * MIB, 5 * MIB + 512, 64 * MIB, 700 * 1024];
    let ptrs: Vec<(u64, u64)> = sizes.iter().map(|&s| (c.alloc(s, 0), s)).collect();
    for &(p, s) in &ptrs {
        shares_exactly_its_handles(&mut c, p, s);
    }
    // After frees and reuse at other places, still exact.
    c.release(ptrs[1].0);
    c.release(ptrs[3].0);
    let q = c.alloc(7 * MIB, 0);
    shares_exactly_its_handles(&mut c, q, 7 * MIB);
}

/// A full device whose free pages are scattered (every other 16 MiB block
/// freed), and a 40 MiB block stitched from them.
fn stitched_40_mib() -> (Checked, u64) {
    let mut c = Checked::with(128 * MIB, "policy:gpualloc");
    let blocks: Vec<u64> = (0..8).map(|_| c.alloc(16 * MIB, 0)).collect();
    for &p in blocks.iter().skip(1).step_by(2) {
        c.release(p);
    }
    c.complete_all();
    let big = c.alloc(40 * MIB, 0);
    (c, big)
}

#[test]
fn a_stitched_block_shares_the_handles_it_aliases() {
    // A full device whose free pages are scattered: a large request is
    // stitched from them, and shares the handles of the runs it aliases.
    let (mut c, big) = stitched_40_mib();
    let sharing = shares_exactly_its_handles(&mut c, big, 40 * MIB);
    assert_eq!(c.stat("num_stitch"), 1, "the request was stitched");
    let Sharing::Handles { parts, .. } = sharing else {
        unreachable!()
    };
    assert!(parts.len() > 1, "a stitch aliases several runs");
}

#[test]
fn a_block_shorter_than_its_stitch_shares_only_the_handles_under_it() {
    // A cached stitch of 40 MiB taken again by a 38 MiB request: the
    // handles past the block (its stitch's tail) are not shared.
    let (mut c, big) = stitched_40_mib();
    c.release(big);
    c.complete_all();
    let shorter = c.alloc(38 * MIB, 0);
    assert_eq!(c.stat("num_stitch"), 1, "the cached stitch was taken again");
    let sharing = shares_exactly_its_handles(&mut c, shorter, 38 * MIB);
    let Sharing::Handles { offset, parts } = sharing else {
        unreachable!()
    };
    let shared: u64 = parts.iter().map(|p| p.1).sum();
    assert!(
        shared - offset < 40 * MIB,
        "{shared} bytes shared from offset {offset}: the stitch's tail went too"
    );
}

#[test]
fn only_allocated_block_starts_can_be_shared() {
    let mut c = Checked::with(1 << 30, "policy:gpualloc");
    let p = c.alloc(4 * MIB, 0);
    for bad in [p + 512, p + 4 * MIB + (1 << 40), 0] {
        assert!(matches!(
            c.dev.share(bad),
            Err(AllocError::InvalidPointer { ptr, .. }) if ptr == bad
        ));
    }
    c.release(p);
    assert!(matches!(
        c.dev.share(p),
        Err(AllocError::InvalidPointer { .. })
    ));
    c.check();
}

fn sizes(s: &Sharing) -> Vec<u64> {
    match s {
        Sharing::Handles { parts, .. } => parts.iter().map(|p| p.1).collect(),
        Sharing::Segment { .. } => vec![],
    }
}

#[test]
fn handles_of_several_sizes_become_one_size_with_the_same_reserved_bytes() {
    let mut c = Checked::with(1 << 30, "policy:gpualloc");
    let p = c.alloc(100 * MIB, 0);
    let before = c.sim().handles_over(p, 100 * MIB);
    assert!(
        before.windows(2).any(|w| w[0].2 != w[1].2),
        "a fresh 100 MiB mapping has handles of several sizes: {before:?}"
    );
    let (reserved, used) = (c.reserved(), c.sim().used());
    let s = shares_exactly_its_handles(&mut c, p, 100 * MIB);
    let sz = sizes(&s);
    assert!(sz.windows(2).all(|w| w[0] == w[1]), "one size: {sz:?}");
    assert_eq!(sz.iter().sum::<u64>(), 100 * MIB);
    assert_eq!(c.sim().copies(), 1, "the contents were copied once");
    assert_eq!((c.reserved(), c.sim().used()), (reserved, used));
    // Sharing again exports the same handle and copies nothing.
    shares_exactly_its_handles(&mut c, p, 100 * MIB);
    assert_eq!(c.sim().copies(), 1);
    c.release(p);
    c.empty_cache();
    assert_eq!(c.sim().used(), 0);
}

/// A large block and a small one sharing the large one's last handle.
fn neighbours(c: &mut Checked) -> (u64, u64, u64, u64) {
    // 98.5 MiB maps 100 MiB of handles, the last of 4 MiB; a 1.25 MiB
    // block takes part of what the large one leaves of it.
    let (bs, ds) = (98 * MIB + MIB / 2, MIB + MIB / 4);
    let b = c.alloc(bs, 0);
    let d = c.alloc(ds, 0);
    let last = *c.sim().handles_over(b, bs).last().unwrap();
    assert!(
        last.0 <= d && d < last.0 + last.2,
        "the small block shares a handle with the large one"
    );
    (b, bs, d, ds)
}

fn mixed(s: &Sharing) -> bool {
    sizes(s).windows(2).any(|w| w[0] != w[1])
}

/// The last handle under the large block of [`neighbours`]: `(address, handle, bytes)`.
fn last_handle(c: &Checked, b: u64, bs: u64) -> (u64, u64, u64) {
    *c.sim().handles_over(b, bs).last().unwrap()
}

#[test]
fn a_live_neighbours_handle_stays_and_the_rest_takes_its_size() {
    let mut c = Checked::with(1 << 30, "policy:gpualloc");
    let (b, bs, _, _) = neighbours(&mut c);
    let shared_with_d = last_handle(&c, b, bs);
    // Another tensor lives in the last handle: its memory never moves, and
    // the handles before it get its size.
    let s = shares_exactly_its_handles(&mut c, b, bs);
    assert!(!mixed(&s), "{:?}", sizes(&s));
    assert_eq!(sizes(&s)[0], shared_with_d.2);
    assert_eq!(last_handle(&c, b, bs), shared_with_d);
    assert_eq!(c.sim().copies(), 1);
    // The same layout with the small block freed: the whole run moves.
    let mut c = Checked::with(1 << 30, "policy:gpualloc");
    let (b, bs, d, _) = neighbours(&mut c);
    c.release(d);
    let s = shares_exactly_its_handles(&mut c, b, bs);
    assert!(!mixed(&s), "{:?}", sizes(&s));
    assert_eq!(c.sim().copies(), 1);
}

#[test]
fn a_block_shared_already_keeps_its_handles() {
    let mut c = Checked::with(1 << 30, "policy:gpualloc");
    let (b, bs, d, _) = neighbours(&mut c);
    let first = sizes(&shares_exactly_its_handles(&mut c, b, bs));
    // A receiver maps those handles now: with the neighbour freed, the
    // next share of the block names them again and moves nothing.
    c.release(d);
    let s = shares_exactly_its_handles(&mut c, b, bs);
    assert_eq!(sizes(&s), first);
    assert_eq!(c.sim().copies(), 1);
}

#[test]
fn a_block_beside_blocks_still_shared_shares_in_one_size() {
    // A sender's tensors wait in torch's limbo (shared, live) while the
    // next one is made beside them and shared with a receiver under
    // PyTorch's allocator, which opens one handle size only.
    let mut c = Checked::with(80 << 30, "");
    let mut limbo = Vec::new();
    for _ in 0..2 {
        for s in [4000, 4 * MIB, 100 * MIB, 12 * MIB + 49380] {
            let p = c.alloc(s, 0);
            c.share(p);
            limbo.push(p);
        }
    }
    c.empty_cache();
    let x = c.alloc(64 * MIB, 0);
    let s = shares_exactly_its_handles(&mut c, x, 64 * MIB);
    assert!(!mixed(&s), "{:?}", sizes(&s));
    for p in limbo {
        c.release(p);
    }
    c.release(x);
    c.empty_cache();
    assert_eq!(c.sim().used(), 0);
}

#[test]
fn the_handles_of_a_block_freed_since_its_share_get_new_memory() {
    // The small block was shared and freed (its receivers let go of it
    // first, as PyTorch keeps a shared storage alive until they do): the
    // handle it was shared through no longer pins the large block's run,
    // which a receiver under PyTorch's allocator opens only in one size.
    let mut c = Checked::with(1 << 30, "policy:gpualloc");
    let (b, bs, d, ds) = neighbours(&mut c);
    shares_exactly_its_handles(&mut c, d, ds);
    c.release(d);
    let s = shares_exactly_its_handles(&mut c, b, bs);
    assert!(!mixed(&s), "{:?}", sizes(&s));
    assert_eq!(c.sim().copies(), 1);
    c.release(b);
    c.empty_cache();
    assert_eq!(c.sim().used(), 0);
}

#[test]
fn a_graphs_free_memory_stays_where_it_is() {
    // The same layout in a captured graph's pool, the small block freed
    // during the capture: the graph's replays write that memory, so its
    // handle stays; the large block's other handles take its size.
    let mut c = Checked::with(1 << 30, "policy:gpualloc");
    c.begin_pool((1, 0), Some(0));
    let (b, bs, d, _) = neighbours(&mut c);
    let shared_with_d = last_handle(&c, b, bs);
    c.release(d);
    c.end_pool((1, 0));
    let s = shares_exactly_its_handles(&mut c, b, bs);
    assert!(!mixed(&s), "{:?}", sizes(&s));
    assert_eq!(last_handle(&c, b, bs), shared_with_d);
    c.release(b);
    c.release_pool((1, 0)).unwrap();
    c.empty_cache();
    assert_eq!(c.sim().used(), 0);
}
