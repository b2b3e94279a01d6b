//! PyTorch's `expandable_segments` switched off: requests served from plain
//! segments while it is.
//!
//! Note [PyTorch's expandable_segments switch]
//! Rationale: memory mapped with `cuMemMap` cannot be shared through
//! `cudaIpcGetMemHandle`, which programs call directly on tensors (custom
//! all-reduce kernels register CUDA graphs' buffers that way), nor be sent
//! as CUDA IPC's legacy handle to a process that cannot fetch descriptors
//! (`pidfd_getfd`, refused in unprivileged containers). PyTorch's answer
//! is its own switch: "it is possible to temporarily disable
//! (expandable_segments:False) the behavior for allocator tensors that need
//! to be used cross-process" (`torch.cuda.memory._set_allocator_settings`,
//! or `PYTORCH_CUDA_ALLOC_CONF` from the start); while off, its allocator
//! puts no new allocation in an expandable segment. Libraries flip it
//! around what they share, and a gpualloc that ignored it handed them
//! mapped memory anyway.
//! Approach: the caller (the torch bridge) tells the device when PyTorch's
//! setting says off and when it says on again ([`set_plain_requests`]).
//! While off, a request that no private pool takes goes to one more
//! private pool kept for this (`PLAIN_REQUESTS_POOL`): unheld, so that
//! `empty_cache` and the out-of-memory retries give its free segments
//! back as they give the default pools'; plain, with PyTorch's segment
//! sizes and splitting; and reported as the default pools in snapshots,
//! segment events and traces, as PyTorch's own plain segments are. Its
//! cached blocks are the only ones such a request sees (PyTorch skips
//! expandable blocks meanwhile), and its blocks go back to it when freed,
//! whatever the switch says by then; after the switch is on again, its
//! cached blocks serve a request the default pools' cache cannot, before
//! anything grows, as PyTorch's one pool would. A private pool created while off,
//! or first used while off (a MemPool or graph pool handle made earlier,
//! with no segment yet), grows by plain segments for its life (a CUDA
//! graph captured meanwhile). One that holds expandable segments already
//! keeps growing them: unlike PyTorch, which checks the setting at every
//! growth, a pool here is plain or expandable as a whole. Garbage
//! collection and the `use_on_oom` pools' lending treat the plain-request
//! pool as the default large pool (lending only plain blocks).
//! Nothing already mapped moves. A trace records each change (a
//! `private_pool` record, [`PoolOp::PlainRequests`]), and a replay makes
//! it at the same point.
//!
//! [`set_plain_requests`]: DeviceAllocator::set_plain_requests

use crate::backend::Backend;
use crate::block::PoolId;
use crate::device::DeviceAllocator;
use crate::size_class::PoolKind;
use crate::trace::{EventKind, PoolOp};

impl<B: Backend> DeviceAllocator<B> {
    /// PyTorch's `expandable_segments` says off (`true`) or on again
    /// (Note [PyTorch's expandable_segments switch]). On a device whose
    /// every pool is plain already (`expandable_segments:false`, or a
    /// driver without virtual memory management) it changes nothing.
    pub fn set_plain_requests(&mut self, on: bool) {
        if self.plain_requests == on {
            return;
        }
        self.plain_requests = on;
        self.record_plain_requests();
    }

    /// Records the switch's state (at each change, and as a trace starts
    /// while it is off).
    pub(crate) fn record_plain_requests(&mut self) {
        if self.trace.is_none() {
            return;
        }
        let (action, addr, size, aux) = EventKind::PrivatePool {
            op: PoolOp::PlainRequests,
            pool: u64::MAX,
            checkpoint: u64::from(self.plain_requests),
        }
        .fields();
        self.record(action, 0, addr, size, aux);
    }

    /// The pool of `kind` that serves a request outside private pools while
    /// the switch is off; created (unheld, plain) on first use and kept.
    pub(crate) fn plain_request_pool(&mut self, kind: PoolKind) -> PoolId {
        let heap = &mut self.heap;
        let (small, large, created) = self.private.plain_requests_pools(|v| heap.pool_slot(v));
        if created {
            // No private key: reported as the default pools are.
            heap.reset_pools((small, large), None);
        }
        match kind {
            PoolKind::Small => small,
            PoolKind::Large => large,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{Config, DeviceAllocator, SimBackend};

    const MIB: u64 = 1 << 20;

    fn dev() -> DeviceAllocator<SimBackend> {
        DeviceAllocator::new(0, SimBackend::new(8 << 30), Config::parse("").unwrap())
    }

    fn expandable_at(d: &DeviceAllocator<SimBackend>, p: u64) -> bool {
        d.snapshot()
            .iter()
            .find(|s| s.address <= p && p < s.address + s.total_size)
            .expect("in a segment")
            .expandable
    }

    #[test]
    fn requests_take_plain_segments_while_the_switch_is_off_and_expandable_ones_after() {
        let mut d = dev();
        let a = d.malloc(30 * MIB, 7).unwrap();
        let small = d.malloc(4096, 7).unwrap();
        assert!(expandable_at(&d, a) && expandable_at(&d, small));
        d.free(a).unwrap();
        d.set_plain_requests(true);
        // The cached expandable block fits but is not handed out.
        let b = d.malloc(30 * MIB, 7).unwrap();
        let s2 = d.malloc(4096, 7).unwrap();
        assert!(!expandable_at(&d, b) && !expandable_at(&d, s2));
        for seg in d.snapshot() {
            assert_eq!(seg.pool_id, (0, 0), "reported as the default pools");
        }
        d.check_invariants().unwrap();
        d.set_plain_requests(false);
        let c = d.malloc(30 * MIB, 7).unwrap();
        assert!(expandable_at(&d, c));
        for p in [b, s2, c, small] {
            d.free(p).unwrap();
        }
        d.check_invariants().unwrap();
    }

    #[test]
    fn a_freed_plain_block_serves_the_next_plain_request_and_empty_cache_gives_it_back() {
        let mut d = dev();
        d.set_plain_requests(true);
        let a = d.malloc(30 * MIB, 7).unwrap();
        d.free(a).unwrap();
        let segments = d.stats().segment.all.current;
        let b = d.malloc(30 * MIB, 7).unwrap();
        assert_eq!(b, a, "the cached plain block is reused");
        assert_eq!(d.stats().segment.all.current, segments);
        d.free(b).unwrap();
        d.set_plain_requests(false);
        d.empty_cache().unwrap();
        assert_eq!(d.stats().reserved_bytes.all.current, 0);
        assert_eq!(d.stats().segment.all.current, 0);
        d.check_invariants().unwrap();
        // Served again on the next request while off.
        d.set_plain_requests(true);
        let c = d.malloc(MIB, 7).unwrap();
        assert!(!expandable_at(&d, c));
        d.free(c).unwrap();
        d.check_invariants().unwrap();
    }

    #[test]
    fn blocks_cached_while_off_serve_requests_after_it_before_anything_grows() {
        let mut d = dev();
        d.set_plain_requests(true);
        let a = d.malloc(30 * MIB, 7).unwrap();
        let s = d.malloc(4096, 7).unwrap();
        d.free(a).unwrap();
        d.free(s).unwrap();
        d.set_plain_requests(false);
        let reserved = d.stats().reserved_bytes.all.current;
        let b = d.malloc(30 * MIB, 7).unwrap();
        let t = d.malloc(4096, 7).unwrap();
        assert_eq!((b, t), (a, s), "the cached plain blocks are reused");
        assert_eq!(d.stats().reserved_bytes.all.current, reserved);
        d.check_invariants().unwrap();
        // Another stream's request does not take them (no cross-stream reuse).
        let c = d.malloc(30 * MIB, 8).unwrap();
        assert!(expandable_at(&d, c));
        for p in [b, t, c] {
            d.free(p).unwrap();
        }
        d.check_invariants().unwrap();
    }

    #[test]
    fn a_private_pool_created_while_off_stays_plain_and_one_created_before_does_not() {
        let mut d = dev();
        d.create_or_incref_pool((1, 0));
        d.set_plain_requests(true);
        d.create_or_incref_pool((2, 0));
        d.set_plain_requests(false);
        for (key, plain) in [((1, 0), false), ((2, 0), true)] {
            d.begin_allocate_to_pool(key, None).unwrap();
            let p = d.malloc(30 * MIB, 7).unwrap();
            d.end_allocate_to_pool(key).unwrap();
            assert_eq!(expandable_at(&d, p), !plain, "pool {key:?}");
            let seg = d
                .snapshot()
                .into_iter()
                .find(|s| s.address <= p && p < s.address + s.total_size)
                .unwrap();
            assert_eq!(seg.pool_id, key);
            d.free(p).unwrap();
        }
        d.check_invariants().unwrap();
    }

    #[test]
    fn a_device_without_expandable_segments_is_unchanged() {
        let mut d = DeviceAllocator::new(
            0,
            SimBackend::new(8 << 30),
            Config::parse("expandable_segments:false").unwrap(),
        );
        d.set_plain_requests(true);
        let a = d.malloc(30 * MIB, 7).unwrap();
        assert!(!expandable_at(&d, a));
        d.free(a).unwrap();
        d.set_plain_requests(false);
        let b = d.malloc(30 * MIB, 7).unwrap();
        assert_eq!(a, b, "one pool throughout");
        d.free(b).unwrap();
        d.check_invariants().unwrap();
    }

    fn dev_with(conf: &str) -> DeviceAllocator<SimBackend> {
        DeviceAllocator::new(0, SimBackend::new(8 << 30), Config::parse(conf).unwrap())
    }

    /// Garbage collection frees old cached plain large segments once
    /// reserved passes the threshold, as PyTorch's does with its
    /// expandable_segments off: those of the plain-request pool too.
    fn gc_run(conf: &str, switch: bool) -> i64 {
        let mut d = dev_with(conf);
        d.set_memory_fraction(0.125).unwrap(); // 1 GiB limit; GC above 512 MiB
        d.set_plain_requests(switch);
        let ps: Vec<_> = (0..20).map(|_| d.malloc(30 * MIB, 7).unwrap()).collect();
        for p in ps {
            d.free(p).unwrap();
        }
        // Lookups age the cached blocks.
        for _ in 0..50 {
            let p = d.malloc(30 * MIB, 7).unwrap();
            d.free(p).unwrap();
        }
        let _q = d.malloc(50 * MIB, 7).unwrap(); // misses: GC runs
        d.check_invariants().unwrap();
        d.stats().reserved_bytes.all.current
    }

    #[test]
    fn garbage_collection_reclaims_plain_segments_while_the_switch_is_off() {
        let pytorch_plain = gc_run(
            "expandable_segments:false,garbage_collection_threshold:0.5",
            false,
        );
        let switched = gc_run("garbage_collection_threshold:0.5", true);
        assert!(
            pytorch_plain < (600 * MIB) as i64,
            "plain device collects: {pytorch_plain}"
        );
        assert!(
            switched < (600 * MIB) as i64,
            "switch off: GC collected nothing, reserved {} MiB (plain device: {} MiB)",
            switched >> 20,
            pytorch_plain >> 20
        );
    }

    /// `use_on_oom` pools lend their free blocks to a request outside any
    /// pool that would fail, the switch off or on (off, plain blocks only).
    fn borrow_run(switch: bool) -> bool {
        let mut d = dev_with("");
        let key = (0, 42);
        // Switched off first: the pool is plain, as PyTorch's blocks made
        // meanwhile are (PyTorch lends none of its expandable blocks then).
        d.set_plain_requests(switch);
        d.create_or_incref_pool(key);
        d.set_pool_use_on_oom(key, true).unwrap();
        d.begin_allocate_to_pool(key, None).unwrap();
        let a = d.malloc(200 * MIB, 7).unwrap();
        d.end_allocate_to_pool(key).unwrap();
        d.free(a).unwrap();
        let reserved = d.stats().reserved_bytes.all.current as u64;
        d.set_memory_limit(Some(reserved + 50 * MIB));
        d.set_plain_requests(switch);
        let r = d.malloc(150 * MIB, 7);
        d.check_invariants().unwrap();
        r.is_ok()
    }

    #[test]
    fn a_request_outside_pools_borrows_from_use_on_oom_pools_while_the_switch_is_off() {
        assert!(borrow_run(false), "switch on: borrows");
        assert!(
            borrow_run(true),
            "switch off: the plain request borrows too"
        );
    }

    /// A pool held before the switch (a MemPool, a graph pool handle) but
    /// with no segment yet, captured into while off, gets plain segments
    /// (cudaIpcGetMemHandle on its outputs works); one that holds
    /// expandable segments already keeps growing so (PyTorch would give
    /// it plain segments too: the divergence the Note states).
    #[test]
    fn a_capture_while_off_into_a_pool_made_before_gets_plain_memory_until_it_has_segments() {
        let mut d = dev_with("");
        let (empty, used) = ((1, 0), (2, 0));
        d.create_or_incref_pool(empty);
        d.create_or_incref_pool(used);
        d.begin_allocate_to_pool(used, None).unwrap();
        let first = d.malloc(30 * MIB, 7).unwrap();
        d.end_allocate_to_pool(used).unwrap();
        d.set_plain_requests(true);
        for (key, plain) in [(empty, true), (used, false)] {
            d.begin_allocate_to_pool(key, None).unwrap();
            let p = d.malloc(30 * MIB, 7).unwrap();
            d.end_allocate_to_pool(key).unwrap();
            assert_eq!(expandable_at(&d, p), !plain, "pool {key:?}");
            d.check_invariants().unwrap();
        }
        assert!(expandable_at(&d, first));
    }
}
