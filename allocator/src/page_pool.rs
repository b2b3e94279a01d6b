//! The physical page pool: memory handles that outlive their mappings.
//!
//! Note [Page pool]
//! Rationale: creating and releasing physical memory (`cuMemCreate`,
//! `cuMemRelease`) costs tens to hundreds of microseconds per handle, while
//! mapping an existing handle costs about one (`docs/driver-costs.md`). An
//! expandable segment that returns its memory to the driver whenever it
//! moves pages pays the expensive pair again and again.
//! Approach: unmapping a range keeps its handles here; mapping takes handles
//! from here first and creates only the shortfall. Handles go back to the
//! driver only on `empty_cache`, on the out-of-memory path, or when a
//! handle of the wrong size blocks a creation (memory pressure). Reserved
//! memory therefore counts mapped *and* pooled handles: it is the physical
//! memory the allocator holds. A mapping is one `cuMemMap` per handle and
//! one `cuMemSetAccess` for the whole range; an unmapping is one
//! `cuMemUnmap` over a run of whole handles. A handle can only be unmapped
//! as a whole, so the pool answers which runs of whole handles lie inside a
//! free range ([`PagePool::whole_runs`]).
//!
//! Handles are `page` bytes, or up to `max_handle` bytes when a long range
//! is mapped from nothing (fewer calls; coarser unmapping), twice that
//! when re-creating what `empty_cache` gave back (Note [Regrowth]).
//! Kernels run as fast over small handles as over large ones, but
//! `cudaMemcpyAsync` does not: over 2 MiB handles it moves 18% less per
//! second than over 16 MiB ones (`docs/driver-costs.md`, section 7).
//! Each pooled handle remembers the pool kind (small or large) whose
//! `reserved_bytes` it is counted in, so stats stay exact when it moves.
//!
//! Note [Regrowth]
//! Rationale: a training loop that calls `empty_cache()` every step gives
//! its activations back to the driver and creates them again in the next
//! step; every handle costs about 90 µs over that round trip (create, set
//! access, unmap, release), so small handles, which keep later moves fine,
//! made such a loop of ResNet-50 1.9x slower than PyTorch's allocator on the
//! H200 (`tests/gpu/sweep.sh`, `empty_cache`).
//! Approach: `empty_cache` adds the bytes it gave back to a credit; while
//! the credit covers all that a mapping creates, handles are up to twice
//! `max_handle`, whatever the range's size, and every creation spends it.
//! A creation larger than the credit follows the 1/8 rule, as memory the
//! workload never held does. The out-of-memory path (which releases the
//! same way) ends the credit: under pressure, fine handles keep stitching
//! able to use the last free pages. Coarser handles also mean that sharing
//! a block with another process (Note [Sharing expandable memory]) more
//! often finds other blocks in its handles. Replayed with an
//! `empty_cache` at every step, five recorded traces need 39–65% less
//! driver time; their ratio of reserved to allocated memory rises by 0.001
//! to 0.010 (ResNet-50: 1.0096 to 1.0195, its ratio without `empty_cache`).

use std::collections::BTreeMap;

use crate::backend::{Backend, BackendError, DevicePtr, HandleId, unmap_maybe_later};
use crate::size_class::PoolKind;

/// New handles are at most 1/this of the range they are created for, so a
/// handle is small next to the block it backs (Note [Page pool]).
const HANDLES_PER_MAPPING: u64 = 8;

/// Memory created again after `empty_cache` comes in handles of up to this
/// many times the largest handle, whatever the range (Note [Regrowth]).
const REGROWTH_HANDLE_FACTOR: u64 = 2;

/// Reserved-bytes changes per pool kind, `[small, large]`.
pub(crate) type KindDeltas = [i64; 2];

fn slot(kind: PoolKind) -> usize {
    match kind {
        PoolKind::Small => 0,
        PoolKind::Large => 1,
    }
}

/// See Note [Page pool].
#[derive(Default)]
pub(crate) struct PagePool {
    /// Unmapped handles by size, with the kind they are counted in.
    free: BTreeMap<u64, Vec<(HandleId, PoolKind)>>,
    /// Mapped handles by address: `(handle, bytes)`.
    mapped: BTreeMap<DevicePtr, (HandleId, u64)>,
    /// Pooled bytes per kind, `[small, large]`.
    free_bytes: [u64; 2],
    /// Bytes `empty_cache` gave back to the driver and not yet created
    /// again (Note [Regrowth]).
    regrow: u64,
}

impl PagePool {
    /// Pooled (unmapped) bytes counted in `kind`.
    pub fn pooled_bytes(&self, kind: PoolKind) -> u64 {
        self.free_bytes[slot(kind)]
    }

    /// Bytes of pooled handles that mapping `size` bytes of `page`-byte
    /// pages would use, taking the largest handle that still fits each time
    /// (only whole pages: a large pool's pages may be larger than a handle
    /// the small pool gave back).
    pub fn usable(&self, size: u64, page: u64) -> u64 {
        self.usable_in(&[(0, size)], page)
    }

    /// Bytes of pooled handles that mapping `ranges` (in order, each
    /// `(start, end)`) would use, taking the largest handle that still fits
    /// each time, range by range, as [`map`](Self::map) fills them. A handle
    /// is mapped whole, so it never spans two ranges.
    pub fn usable_in(&self, ranges: &[(DevicePtr, DevicePtr)], page: u64) -> u64 {
        self.fit(ranges, page).0
    }

    /// [`usable_in`](Self::usable_in)'s bytes, and per usable size (largest
    /// first) how many pooled handles of it the mapping would leave.
    fn fit(&self, ranges: &[(DevicePtr, DevicePtr)], page: u64) -> (u64, Vec<(u64, usize)>) {
        let mut left: Vec<(u64, usize)> = self
            .free
            .iter()
            .rev()
            .filter(|(s, _)| *s % page == 0)
            .map(|(&s, hs)| (s, hs.len()))
            .collect();
        let mut used = 0;
        for &(lo, hi) in ranges {
            let mut room = hi - lo;
            for (s, n) in left.iter_mut() {
                let k = (room / *s).min(*n as u64);
                room -= k * *s;
                *n -= k as usize;
                used += k * *s;
            }
        }
        (used, left)
    }

    /// Note [Spare handles at the high-water mark]
    /// Rationale: defragmentation moves whole handles (up to 16 MiB) to
    /// where a request is mapped, but the holes of its window need not be
    /// multiples of them: FSDP2's long runs moved 128 MiB for a 124 MiB
    /// hole between mapped pages, created 12 MiB and kept the unused 16 MiB
    /// handle pooled, raising the peak of reserved memory by 2–18 MiB at a
    /// time for as long as they ran (twenty-second study).
    /// Approach: when a mapping would create memory past the device's
    /// high-water mark of reserved memory, pooled handles it cannot use
    /// are released first, as much as it would pass the mark by. Which
    /// handles it uses is what `usable_in` counts (per size, the handles
    /// beyond that count are spare, the longest pooled first); one still
    /// mapped at its old place (Note [Unmapping behind the work]) is
    /// released once that place's work is waited for and unmapped. Which
    /// handles go back never depends on that (on the GPU's progress), so a
    /// replay releases the same. Over 104 simulated workloads: 13 better, none worse,
    /// mean R/A 1.0326 → 1.0319 for 263.8 → 269.7 ms of driver time;
    /// FSDP2's long runs 1.029–1.042 → 1.019–1.031. Waiting for spare
    /// handles still mapped (round 32): 8 better, 2 worse, mean 1.0319 →
    /// 1.0317 for 269.4 → 269.8 ms; the 512 B–64 MiB churn loop 1.0505 / 1.0547 /
    /// 1.0591 → 1.0480 / 1.0488 / 1.0530 (seeds 1, 2, 4), 1.0397 → 1.0422
    /// (seed 3).
    ///
    /// The pooled handles a mapping of `ranges` would leave unused that go
    /// back to the driver for `want` bytes (per size, those beyond what
    /// [`usable_in`](Self::usable_in) takes; largest first; of one size the
    /// longest pooled, as the mapping takes the latest). The choice never
    /// depends on whether a handle is still mapped at its old place, which
    /// depends on the GPU's progress: a replay chooses the same.
    pub fn spare(
        &self,
        ranges: &[(DevicePtr, DevicePtr)],
        page: u64,
        want: u64,
    ) -> Vec<(HandleId, u64)> {
        let spare: BTreeMap<u64, usize> = self.fit(ranges, page).1.into_iter().collect();
        let mut out = Vec::new();
        let mut chosen = 0u64;
        for (&s, list) in self.free.iter().rev() {
            let n = spare.get(&s).copied().unwrap_or(usize::MAX);
            for &(h, _) in list.iter().take(n) {
                if chosen >= want {
                    return out;
                }
                out.push((h, s));
                chosen += s;
            }
        }
        out
    }

    /// Returns the pooled `handles` (of [`spare`](Self::spare)) to the
    /// driver, in order, with the reserved-bytes changes per kind; on a
    /// driver error the rest stay pooled.
    pub fn release_these<B: Backend>(
        &mut self,
        backend: &mut B,
        handles: &[(HandleId, u64)],
    ) -> (Result<(), BackendError>, KindDeltas) {
        let mut deltas = [0i64; 2];
        for &(h, s) in handles {
            let list = self.free.get_mut(&s).expect("a pooled size");
            let i = list
                .iter()
                .position(|&(x, _)| x == h)
                .expect("a pooled handle");
            if let Err(e) = backend.release_handle(h, s) {
                return (Err(e), deltas);
            }
            let (_, k) = list.remove(i);
            if list.is_empty() {
                self.free.remove(&s);
            }
            self.forget(s, k, &mut deltas);
        }
        (Ok(()), deltas)
    }

    /// Takes a handle of `size` bytes the driver released off the pool's
    /// counts.
    fn forget(&mut self, size: u64, kind: PoolKind, deltas: &mut KindDeltas) {
        self.free_bytes[slot(kind)] -= size;
        deltas[slot(kind)] -= size as i64;
    }

    /// Bytes still to be created again in coarse handles (Note [Regrowth]).
    pub fn regrowth(&self) -> u64 {
        self.regrow
    }

    /// Sets how many bytes, given back to the driver at the workload's
    /// request, are created again in coarse handles (Note [Regrowth]); 0
    /// ends regrowth.
    pub fn set_regrowth(&mut self, bytes: u64) {
        self.regrow = bytes;
    }

    /// The smallest pooled handle size that is a multiple of `page` and at
    /// least `at_least` bytes.
    pub fn smallest_pooled(&self, page: u64, at_least: u64) -> Option<u64> {
        self.free
            .range(at_least..)
            .map(|(&s, _)| s)
            .find(|s| s % page == 0)
    }

    /// Maps `[ptr, ptr + size)`, counted in `kind`: pooled handles first
    /// (largest that fits first), new handles for the rest. Returns the
    /// reserved-bytes changes per kind and the bytes created. On failure the
    /// pooled handles go back to the pool and the new ones to the driver, so
    /// a request that cannot fit leaves no memory behind.
    pub fn map<B: Backend>(
        &mut self,
        backend: &mut B,
        ptr: DevicePtr,
        size: u64,
        kind: PoolKind,
        sizes: (u64, u64),
        capturing: bool,
    ) -> (Result<(), BackendError>, KindDeltas, u64) {
        let (page, max_handle) = sizes;
        let mut created = 0;
        let mut deltas = [0i64; 2];
        let mut chosen: Vec<(HandleId, u64, PoolKind)> = Vec::new();
        let mut left = size;
        let sizes: Vec<u64> = self
            .free
            .keys()
            .rev()
            .filter(|&&s| s % page == 0)
            .copied()
            .collect();
        for s in sizes {
            let hs = self.free.get_mut(&s).expect("listed key");
            while left >= s
                && let Some((h, k)) = hs.pop()
            {
                chosen.push((h, s, k));
                self.free_bytes[slot(k)] -= s;
                left -= s;
            }
            if hs.is_empty() {
                self.free.remove(&s);
            }
        }
        let taken = chosen.len();
        let mut result = Ok(());
        let cap = if self.regrow >= left && max_handle > page {
            max_handle * REGROWTH_HANDLE_FACTOR
        } else {
            max_handle.min(size / HANDLES_PER_MAPPING).max(page)
        };
        while left > 0 {
            let mut chunk = page;
            while chunk * 2 <= left.min(cap) {
                chunk *= 2;
            }
            match backend.create_handle(chunk, capturing) {
                Ok(h) => {
                    deltas[slot(kind)] += chunk as i64;
                    created += chunk;
                    chosen.push((h, chunk, kind));
                    left -= chunk;
                }
                Err(e) => {
                    result = Err(match e {
                        BackendError::OutOfMemory { .. } => {
                            BackendError::OutOfMemory { requested: size }
                        }
                        e => e,
                    });
                    break;
                }
            }
        }
        if result.is_ok() {
            let list: Vec<(HandleId, u64)> = chosen.iter().map(|c| (c.0, c.1)).collect();
            result = backend.map_handles(ptr, &list, capturing);
        }
        if result.is_err() {
            // Handles created here go back to the driver, except during a
            // capture, when nothing is released (they stay pooled, counted,
            // until the next `empty_cache`).
            for (i, (h, s, k)) in chosen.into_iter().enumerate() {
                if i < taken || capturing || backend.release_handle(h, s).is_err() {
                    self.pool(h, s, k);
                } else {
                    deltas[slot(k)] -= s as i64;
                    created -= s;
                }
            }
            return (result, deltas, created);
        }
        self.regrow = self.regrow.saturating_sub(created);
        let mut at = ptr;
        for (h, s, k) in chosen {
            if k != kind {
                deltas[slot(k)] -= s as i64;
                deltas[slot(kind)] += s as i64;
            }
            self.mapped.insert(at, (h, s));
            at += s;
        }
        (Ok(()), deltas, created)
    }

    /// Takes pooled `handles` (with their sizes) out of reach of
    /// [`map`](Self::map) and [`usable_in`](Self::usable_in) until
    /// [`put_back`](Self::put_back), still counted as pooled; those not
    /// pooled are passed over.
    pub fn set_aside(&mut self, handles: &[(HandleId, u64)]) -> Vec<(HandleId, u64, PoolKind)> {
        let mut aside = Vec::new();
        for &(h, size) in handles {
            let Some(list) = self.free.get_mut(&size) else {
                continue;
            };
            if let Some(i) = list.iter().position(|&(x, _)| x == h) {
                let (_, k) = list.remove(i);
                aside.push((h, size, k));
                if list.is_empty() {
                    self.free.remove(&size);
                }
            }
        }
        aside
    }

    /// Returns handles [`set_aside`](Self::set_aside) took to the pool.
    pub fn put_back(&mut self, aside: Vec<(HandleId, u64, PoolKind)>) {
        for (h, size, k) in aside {
            self.free.entry(size).or_default().push((h, k));
        }
    }

    pub fn pool(&mut self, h: HandleId, size: u64, kind: PoolKind) {
        self.free.entry(size).or_default().push((h, kind));
        self.free_bytes[slot(kind)] += size;
    }

    /// The runs of whole mapped handles inside `[lo, hi)`, as `(start, end)`.
    pub fn whole_runs(&self, lo: DevicePtr, hi: DevicePtr) -> Vec<(DevicePtr, DevicePtr)> {
        let mut runs: Vec<(DevicePtr, DevicePtr)> = Vec::new();
        for (&a, &(_, s)) in self.mapped.range(lo..hi) {
            if a + s > hi {
                break;
            }
            match runs.last_mut() {
                Some(r) if r.1 == a => r.1 = a + s,
                _ => runs.push((a, a + s)),
            }
        }
        runs
    }

    /// The handle mapped at `addr`, with its size.
    pub fn handle_at(&self, addr: DevicePtr) -> Option<(HandleId, u64)> {
        self.mapped.get(&addr).copied()
    }

    /// The handles mapped inside `[lo, hi)`: `(address, handle, bytes)`.
    pub fn handles_in(&self, lo: DevicePtr, hi: DevicePtr) -> Vec<(DevicePtr, HandleId, u64)> {
        self.mapped
            .range(lo..hi)
            .map(|(&a, &(h, s))| (a, h, s))
            .collect()
    }

    /// The handles mapped over any part of `[lo, hi)`, including one that
    /// starts below `lo`: `(address, handle, bytes)`.
    pub fn covering(&self, lo: DevicePtr, hi: DevicePtr) -> Vec<(DevicePtr, HandleId, u64)> {
        let below = self
            .mapped
            .range(..lo)
            .next_back()
            .filter(|(a, (_, s))| *a + s > lo)
            .map(|(&a, &(h, s))| (a, h, s));
        below.into_iter().chain(self.handles_in(lo, hi)).collect()
    }

    /// Books `handles` (already mapped one after another from `lo` by the
    /// caller) in place of the handles mapped over the same bytes, which the
    /// caller unmapped; returns those, for the caller to release.
    pub fn swap_in(&mut self, lo: DevicePtr, handles: &[(HandleId, u64)]) -> Vec<(HandleId, u64)> {
        let len: u64 = handles.iter().map(|h| h.1).sum();
        let old: Vec<(DevicePtr, HandleId, u64)> = self.handles_in(lo, lo + len);
        for (a, _, _) in &old {
            self.mapped.remove(a);
        }
        let mut at = lo;
        for &(h, s) in handles {
            self.mapped.insert(at, (h, s));
            at += s;
        }
        old.into_iter().map(|(_, h, s)| (h, s)).collect()
    }

    /// The end of the shortest prefix of whole handles of the run
    /// `[lo, hi)` that holds at least `want` bytes (`hi` when none shorter does).
    pub fn prefix_end(&self, lo: DevicePtr, hi: DevicePtr, want: u64) -> DevicePtr {
        let mut end = lo;
        for (&a, &(_, s)) in self.mapped.range(lo..hi) {
            if end - lo >= want {
                break;
            }
            end = a + s;
        }
        end.min(hi)
    }

    /// Unmaps a run of whole handles (from [`whole_runs`](Self::whole_runs))
    /// with one call and pools its handles, counted in `kind`; with
    /// `later`, through [`Backend::unmap_later`] (the handles may be mapped
    /// elsewhere at once: Note [Unmapping off the allocating thread]).
    pub fn unmap<B: Backend>(
        &mut self,
        backend: &mut B,
        lo: DevicePtr,
        hi: DevicePtr,
        kind: PoolKind,
        later: bool,
    ) -> Result<(), BackendError> {
        unmap_maybe_later(backend, lo, hi - lo, later)?;
        self.detach(lo, hi, kind);
        Ok(())
    }

    /// Pools the handles of a run of whole handles, counted in `kind`, as
    /// [`unmap`](Self::unmap) does, but leaves them mapped there: the
    /// caller unmaps the run later (Note [Unmapping behind the work]).
    /// Returns them with their sizes.
    pub fn detach(&mut self, lo: DevicePtr, hi: DevicePtr, kind: PoolKind) -> Vec<(HandleId, u64)> {
        let addrs: Vec<DevicePtr> = self.mapped.range(lo..hi).map(|(&a, _)| a).collect();
        let mut out = Vec::with_capacity(addrs.len());
        for a in addrs {
            let (h, s) = self.mapped.remove(&a).expect("listed address");
            self.pool(h, s, kind);
            out.push((h, s));
        }
        out
    }

    /// Whether `handle`, of `size` bytes, is in the pool (not mapped).
    pub fn is_pooled(&self, handle: HandleId, size: u64) -> bool {
        self.free
            .get(&size)
            .is_some_and(|hs| hs.iter().any(|&(h, _)| h == handle))
    }

    /// Returns pooled handles to the driver, largest first, until at least
    /// `want` bytes went back (`u64::MAX`: all). Returns the reserved-bytes
    /// changes per kind; on a driver error the rest stay pooled.
    pub fn release<B: Backend>(
        &mut self,
        backend: &mut B,
        want: u64,
    ) -> (Result<(), BackendError>, KindDeltas) {
        let mut deltas = [0i64; 2];
        let mut released = 0u64;
        while released < want
            && let Some(mut entry) = self.free.last_entry()
        {
            let s = *entry.key();
            let (h, k) = entry.get_mut().pop().expect("no empty size lists");
            if entry.get().is_empty() {
                entry.remove();
            }
            if let Err(e) = backend.release_handle(h, s) {
                // Still pooled: its bytes were never taken off the count.
                self.free.entry(s).or_default().push((h, k));
                return (Err(e), deltas);
            }
            self.forget(s, k, &mut deltas);
            released += s;
        }
        (Ok(()), deltas)
    }

    /// Checks the pool against the blocks' view: `mapped` lists the mapped
    /// ranges of every expandable segment, in address order.
    pub fn check(&self, mapped: &[(DevicePtr, DevicePtr)]) -> Result<(), String> {
        let mut handles = self.mapped.iter().peekable();
        for &(lo, hi) in mapped {
            let mut at = lo;
            while at < hi {
                match handles.next() {
                    Some((&a, &(_, s))) if a == at && a + s <= hi => at += s,
                    Some((&a, &(_, s))) => {
                        return Err(format!(
                            "mapped range {lo:#x}..{hi:#x}: handle at {a:#x}+{s} where {at:#x} was expected"
                        ));
                    }
                    None => {
                        return Err(format!(
                            "mapped range {lo:#x}..{hi:#x} has no handle at {at:#x}"
                        ));
                    }
                }
            }
        }
        if let Some((&a, _)) = handles.next() {
            return Err(format!("handle mapped at {a:#x} lies in no mapped block"));
        }
        let pooled: [u64; 2] = self.free.iter().fold([0, 0], |mut acc, (&s, hs)| {
            for &(_, k) in hs {
                acc[slot(k)] += s;
            }
            acc
        });
        if pooled != self.free_bytes {
            return Err(format!(
                "pooled bytes {:?}, handles sum to {pooled:?}",
                self.free_bytes
            ));
        }
        // Each handle is in one place once: mapped at one address, or pooled.
        let mut ids: Vec<(HandleId, &str)> = self
            .mapped
            .values()
            .map(|&(h, _)| (h, "mapped"))
            .chain(self.free.values().flatten().map(|&(h, _)| (h, "pooled")))
            .collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(format!(
                "handle {} is both {} and {}",
                w[0].0, w[0].1, w[1].1
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SimBackend;

    const MIB: u64 = 1 << 20;

    #[test]
    fn only_handles_a_mapping_cannot_use_are_released_the_longest_pooled_first() {
        let mut b = SimBackend::new(1 << 30);
        let mut p = PagePool::default();
        let mut made = Vec::new();
        for size in [16, 16, 16, 4, 2] {
            let h = b.create_handle(size * MIB, false).unwrap();
            p.pool(h, size * MIB, PoolKind::Large);
            made.push((h, size * MIB));
        }
        // A 36 MiB hole takes two 16 MiB handles and the 4 MiB one.
        let ranges = [(64 * MIB, 100 * MIB)];
        let usable = p.usable_in(&ranges, 2 * MIB);
        assert_eq!(usable, 36 * MIB);
        // One 16 MiB handle is spare (the first pooled), then the 2 MiB one.
        let chosen = p.spare(&ranges, 2 * MIB, u64::MAX);
        assert_eq!(chosen, vec![made[0], made[4]]);
        let (r, deltas) = p.release_these(&mut b, &chosen);
        r.unwrap();
        assert_eq!(deltas, [0, -18 * (MIB as i64)]);
        assert_eq!(
            p.usable_in(&ranges, 2 * MIB),
            usable,
            "the mapping takes what it would have"
        );
        assert!(!p.is_pooled(made[0].0, 16 * MIB) && p.is_pooled(made[2].0, 16 * MIB));
        assert_eq!(b.used(), 36 * MIB);
        p.check(&[]).unwrap();
        // Asked for less, it stops once that much is chosen.
        let mut b = SimBackend::new(1 << 30);
        let mut p = PagePool::default();
        for _ in 0..4 {
            let h = b.create_handle(16 * MIB, false).unwrap();
            p.pool(h, 16 * MIB, PoolKind::Large);
        }
        let chosen = p.spare(&[(0, 16 * MIB)], 2 * MIB, MIB);
        let (r, deltas) = p.release_these(&mut b, &chosen);
        r.unwrap();
        assert_eq!(deltas, [0, -16 * (MIB as i64)]);
        assert_eq!(
            p.usable_in(&[(0, 64 * MIB)], 2 * MIB),
            48 * MIB,
            "three left"
        );
    }
}
