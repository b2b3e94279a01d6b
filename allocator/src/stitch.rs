//! Stitching: a large request served by free pages that are not contiguous,
//! mapped a second time into a fresh address range (GMLake's idea).
//!
//! Note [Stitching]
//! Rationale: a large transient buffer (a convolution workspace in the
//! middle of backward, say) needs contiguous address space when the free
//! memory of the expandable segment is scattered between live blocks.
//! Moving pages (Note [Defragmentation]) costs about 65 µs per handle every
//! time, and in a periodic workload it happens every step.
//! Approach: a physical handle may be mapped at several addresses at once.
//! A stitch maps the handles of free runs of the stream's expandable
//! segments, largest runs first, into a fresh reservation; while the stitch
//! is allocated those runs are `Claimed` (neither free nor reusable) and
//! nothing is unmapped or copied. When the stitch is freed its runs become
//! free again and the stitch stays mapped, cached: the next request of
//! about its size whose runs are all free again (the same layout one step
//! later) takes it with no driver call at all.
//! Each part of a stitch is a mapping of its own, so a cached stitch is
//! repaired rather than rebuilt (`stitch_repair.rs`). When defragmentation
//! takes a handle a cached stitch aliases (only when the unaliased ones
//! fall short, Note [Defragmentation]), only that part is unmapped from
//! the stitch's range, after the stitch's last work (Note [Event-ordered
//! unmapping]; without a wait when the request is on the stitch's stream,
//! Note [Punching behind the work]), leaving a hole; a stitch that loses
//! every part is freed.
//! When no cached stitch of the size is whole with all its runs free, the
//! one with the fewest handles to change (its holes and the parts whose
//! home is in use), if that is at most a quarter of its handles, gets free
//! handles of the stream in their place (smallest free runs first, handles
//! adding up to each hole's size) and only those are unmapped and mapped:
//! the driver time is that of the handles changed, not of the stitch.
//! Repairs rent and a new stitch buys: once the parts a stitch's repairs
//! have replaced (holes and busy parts, each counted once) add up to as
//! many as it has, the next request that would repair it gets a stitch of
//! its own instead and the old one is kept as it is. A workload
//! whose layouts repeat (ResNet-50's steps alternate between two) would
//! otherwise repair one stitch back and forth every step, unmapping and
//! waiting for its work each time; so it ends with a stitch per layout and
//! no driver call, at most twice what the best choice in hindsight costs.
//! A repair that would replace a busy part which the last repair put in
//! (the stitch not taken whole since) builds a new stitch too, when the
//! free runs can make one: the layouts swing between two there, and each
//! repair would wait for the stitch's work to swap the part back. That
//! gives up the bound of twice the best choice's calls for the waits.
//! Measured on an H100 (round 75, before a whole take reset the rule):
//! ResNet-50 went from 14 host waits to 1 (206 to 26 ms of
//! `cuEventSynchronize` a run, its mean step unchanged), the detector's
//! R/A from 1.0337 to 1.0289 (median of three runs; 1.0289–1.0369 over
//! four) for 14% more memory calls after warm-up. Over 133 replayed
//! workloads, with the reset, the mean R/A goes from 1.0259 to 1.0256 for
//! 3% more predicted driver time (a model that prices a wait as on an
//! idle device); without it, 1.0258 for 5% more.
//! A stitch whose holes cannot be filled is torn down and a new one built,
//! as before. A cached stitch is torn down whole (after its last work) on
//! `empty_cache` and on the out-of-memory path, when the cache is full, or
//! when its handles are replaced for sharing (`ipc.rs`); a stitch in use
//! gives back there the handles past its block (Note [Stitch tails] in
//! `stitch_trim.rs`). The trace records
//! a stitch's life (its range mapped when built, unmapped when torn down),
//! not its holes; segment observers see every part unmapped and every hole
//! mapped (Note [Segment events]). Stitched ranges alias memory already
//! counted as reserved, so they add nothing to it, holes or not.

use crate::backend::{Backend, DevicePtr, HandleId, StreamId};
use crate::block::{Block, BlockId, BlockState, PoolId};
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::heap::{LARGE, STITCH};
use crate::observer::SegmentAction;
use crate::segment::Segment;
use crate::size_class::PoolKind;
use crate::stitch_cache::{MAX_CACHED, Part, Slot, Stitch};
use crate::trace::{Action, STITCH_CODE, pool_code};

impl<B: Backend> DeviceAllocator<B> {
    /// Serves `rounded` bytes for `stream` from a stitch: a cached one whose
    /// runs are free again, or, when `spend` allows driver calls (Note
    /// [Stitch budget] in `budget.rs`), a cached one repaired or a new one
    /// over free runs of the stream's expandable segments. `None` when the
    /// free runs do not suffice, or only calls would serve and `spend` is
    /// false.
    pub(crate) fn stitch_for(
        &mut self,
        stream: StreamId,
        rounded: u64,
        spend: bool,
    ) -> Result<Option<BlockId>, AllocError> {
        let slack = (rounded / 16).max(2 << 20);
        // A whole stitch whose parts are all free is taken first (no driver
        // call), else the one with the fewest handles to change (holes, and
        // parts whose home is in use), repaired when that is at most a
        // quarter of its handles (Note [Stitching]).
        // `repairable`: (stitch, handles to change, its busy parts' addresses).
        let mut best: Option<usize> = None;
        let mut repairable: Option<(usize, usize, Vec<DevicePtr>)> = None;
        let list = &self.stitches.list;
        for (i, s) in list.iter().enumerate() {
            if s.in_use.is_some()
                || s.stream != stream
                || s.size < rounded
                || s.size > rounded + slack
            {
                continue;
            }
            let busy = self.busy_parts(s);
            let change = s.holes() + busy.len();
            if change == 0 {
                if best.is_none_or(|b| s.size < list[b].size) {
                    best = Some(i);
                }
            } else if change * 4 <= s.slots.len()
                && repairable
                    .as_ref()
                    .is_none_or(|(r, c, _)| (change, s.size) < (*c, list[*r].size))
            {
                repairable = Some((i, change, busy));
            }
        }
        if best.is_none() && !spend {
            return Ok(None);
        }
        if let Some(b) = best {
            // Claimed below, with no driver call (Note [When a stitch pays]).
            // Its layout came back whole: a part busy later is a new layout,
            // not a swing back (Note [Stitching]).
            self.stitches.taken_whole += 1;
            self.stitches.list[b].fresh.clear();
        }
        let mut built = None;
        if best.is_none()
            && let Some((r, _, busy)) = repairable
        {
            // Repairs that have replaced as many parts as the stitch has
            // cost what a new stitch does, and a busy part the last repair
            // put in means the layouts swing: one is built for this layout
            // instead, and the old one kept for its own (Note [Stitching]).
            // When the free runs cannot make one (nothing has changed
            // then), it is repaired after all; a build that fails goes to
            // the caller, which moves pages or grows instead.
            let s = &self.stitches.list[r];
            let bounce = busy.iter().any(|a| s.fresh.contains(a));
            if bounce || s.repaired >= s.slots.len() as u64 {
                built = self.build_stitch(stream, rounded)?;
            }
            if built.is_none() {
                if self.repair_stitch(r, &busy)? {
                    best = Some(r);
                } else if self.stitches.list[r].holes() > 0 {
                    // Holes that cannot be filled: torn down, as before repair.
                    self.drop_stitch(r, self.config.unmap_thread)?;
                }
            }
        }
        let i = match (best, built) {
            (Some(i), _) | (None, Some(i)) => i,
            (None, None) => match self.build_stitch(stream, rounded)? {
                Some(i) => i,
                None => return Ok(None),
            },
        };
        crate::log::stitched(self.device, stream, rounded, best.is_some());
        Ok(Some(self.claim_stitch(i, rounded)))
    }

    /// The home addresses of cached stitch `s`'s parts that no longer lie,
    /// with the same handle, in a free block of its stream.
    pub(crate) fn busy_parts(&self, s: &Stitch) -> Vec<DevicePtr> {
        s.parts()
            .filter(|p| !self.part_free(p, s.stream))
            .map(|p| p.addr)
            .collect()
    }

    /// Whether a part lies, with the same handle, in a free block of `stream`.
    fn part_free(&self, p: &Part, stream: StreamId) -> bool {
        self.pages.handle_at(p.addr) == Some((p.handle, p.size))
            && self.heap.find_block(p.seg, p.addr).is_some_and(|b| {
                let b = &self.heap.blocks[b];
                b.state == BlockState::Free
                    && b.stream == stream
                    && p.addr + p.size <= b.ptr + b.size
            })
    }

    /// Maps free runs of `stream` (largest first) into a new reservation.
    fn build_stitch(
        &mut self,
        stream: StreamId,
        rounded: u64,
    ) -> Result<Option<usize>, AllocError> {
        let mut runs: Vec<_> = self
            .free_runs(None)
            .into_iter()
            .filter(|r| r.3 == stream && self.heap.segments.get(r.2).pool == LARGE)
            .collect();
        runs.sort_unstable_by_key(|r| (std::cmp::Reverse(r.0), r.1));
        let mut parts = Vec::new();
        let mut total = 0;
        for (bytes, lo, seg, ..) in runs {
            for (addr, handle, size) in self.pages.handles_in(lo, lo + bytes) {
                if total >= rounded {
                    break;
                }
                parts.push(Part {
                    seg,
                    addr,
                    handle,
                    size,
                });
                total += size;
            }
        }
        if total < rounded {
            return Ok(None);
        }
        if self.stitches.list.len() >= MAX_CACHED {
            self.evict_stitch()?;
        }
        let va = self.backend.reserve(total)?;
        let handles: Vec<(HandleId, u64)> = parts.iter().map(|p| (p.handle, p.size)).collect();
        if let Err(e) = self.backend.map_handles(va, &handles, false) {
            self.backend.free_reservation(va, total)?;
            return Err(e.into());
        }
        self.stats.num_stitch += 1;
        self.stitches.built += 1;
        // Listed when claimed (Note [Segment events]).
        self.notify(SegmentAction::MapUnlisted, STITCH, stream, va, total);
        self.count_obtained(total);
        self.record(Action::SegmentMap, stream, va, total, STITCH_CODE);
        self.stitches.list.push(Stitch {
            va,
            size: total,
            stream,
            slots: parts.into_iter().map(Slot::Mapped).collect(),
            in_use: None,
            freed: 0,
            used_at: 0,
            repaired: 0,
            fresh: Vec::new(),
        });
        Ok(Some(self.stitches.list.len() - 1))
    }

    /// Claims a stitch's home runs and returns a free, unindexed block of
    /// `rounded` bytes at its start; the rest of the range (less than a
    /// handle, or the reuse slack) is a claimed block nothing else uses.
    fn claim_stitch(&mut self, i: usize, rounded: u64) -> BlockId {
        let slots = std::mem::take(&mut self.stitches.list[i].slots);
        debug_assert!(slots.iter().all(|s| s.part().is_some()), "no holes");
        for p in slots.iter().filter_map(Slot::part) {
            self.set_home(p, BlockState::Claimed);
        }
        self.stitches.uses += 1;
        let s = &mut self.stitches.list[i];
        s.slots = slots;
        s.used_at = self.stitches.uses;
        let (va, size, stream) = (s.va, s.size, s.stream);
        // The snapshot lists the stitch instead of its home runs.
        self.tell_homes(i, false);
        self.tell_listed(true, STITCH, stream, va, size);
        let block =
            self.heap
                .blocks
                .insert(Block::new(va, size, stream, 0, STITCH, BlockState::Free));
        let seg = self.heap.segments.insert(Segment {
            ptr: va,
            size,
            kind: PoolKind::Large,
            pool: STITCH,
            stream,
            first: block,
            expandable: true,
            mapped: size,
        });
        self.heap.blocks[block].segment = seg;
        if size > rounded {
            let rest = Block {
                prev: Some(block),
                ..Block::new(
                    va + rounded,
                    size - rounded,
                    stream,
                    seg,
                    STITCH,
                    BlockState::Claimed,
                )
            };
            let r = self.heap.blocks.insert(rest);
            self.heap.blocks[block].next = Some(r);
            self.heap.blocks[block].size = rounded;
        }
        self.stitches.list[i].in_use = Some(seg);
        block
    }

    /// A freed stitch block: its runs become free at home, the stitch is
    /// cached. Called instead of indexing the block (`free_block`).
    pub(crate) fn unclaim_stitch(&mut self, id: BlockId, stamp: u64) {
        let seg = self.heap.blocks[id].segment;
        let i = self
            .stitches
            .list
            .iter()
            .position(|s| s.in_use == Some(seg))
            .expect("a stitch block belongs to a stitch");
        self.heap.segments.remove(seg);
        let stream = self.stitches.list[i].stream;
        // What is mapped of it: a tail trimmed while it was in use
        // (`stitch_trim.rs`) left the snapshot then.
        for (_, _, at, bytes) in self.stitches.list[i].runs(|s| s.part().is_some()) {
            self.tell_listed(false, STITCH, stream, at, bytes);
        }
        self.tell_homes(i, true);
        let mut rest = self.heap.blocks[id].next;
        while let Some(r) = rest {
            rest = self.heap.blocks[r].next;
            self.heap.blocks.remove(r);
        }
        self.heap.blocks.remove(id);
        let slots = std::mem::take(&mut self.stitches.list[i].slots);
        for p in slots.iter().filter_map(Slot::part) {
            self.set_home(p, BlockState::Free);
        }
        let s = &mut self.stitches.list[i];
        s.slots = slots;
        s.in_use = None;
        s.freed = stamp;
        // A fence right after the stitch's last work: a repair or teardown
        // that needs that work done finds the fence passed, or waits only
        // until it is, instead of recording one behind all the work queued
        // by then (Note [Event-ordered unmapping]). Not during a capture,
        // where an event would belong to the graph; a driver error only
        // means no fence now.
        let stream = s.stream;
        if !self.private.capturing() {
            let _ = self.fences.cover(&mut self.backend, stream, stamp);
        }
    }

    /// Tells the observer and the trace that the home runs of stitch `i`'s
    /// parts left (`listed` false) or came back into (true) the snapshot's
    /// view, adjacent parts as one range (Note [Listed ranges]).
    fn tell_homes(&mut self, i: usize, listed: bool) {
        if self.observer.is_none() && self.trace.is_none() {
            return; // nothing to tell: no list to build on the request's path
        }
        let s = &self.stitches.list[i];
        let (stream, homes) = (s.stream, s.parts().map(|p| (p.addr, p.size)).collect());
        self.tell_home_runs(stream, homes, listed);
    }

    /// [`tell_homes`](Self::tell_homes) for the homes (address, bytes) of
    /// some parts.
    pub(crate) fn tell_home_runs(
        &mut self,
        stream: StreamId,
        mut homes: Vec<(DevicePtr, u64)>,
        listed: bool,
    ) {
        if self.observer.is_none() && self.trace.is_none() {
            return;
        }
        homes.sort_unstable();
        let mut run: Option<(DevicePtr, u64)> = None;
        for (addr, size) in homes {
            match run {
                Some((lo, len)) if lo + len == addr => run = Some((lo, len + size)),
                _ => {
                    if let Some((lo, len)) = run {
                        self.tell_listed(listed, LARGE, stream, lo, len);
                    }
                    run = Some((addr, size));
                }
            }
        }
        if let Some((lo, len)) = run {
            self.tell_listed(listed, LARGE, stream, lo, len);
        }
    }

    /// Tells the observer and the trace that `[addr, addr + size)` of
    /// `pool` (a home run, or a stitch's range) came into (`listed`) or
    /// left the snapshot's view (Note [Listed ranges]).
    pub(crate) fn tell_listed(
        &mut self,
        listed: bool,
        pool: PoolId,
        stream: StreamId,
        addr: DevicePtr,
        size: u64,
    ) {
        let (action, record) = if listed {
            (SegmentAction::Listed, Action::SegmentList)
        } else {
            (SegmentAction::Unlisted, Action::SegmentUnlist)
        };
        self.notify(action, pool, stream, addr, size);
        if self.trace.is_some() {
            let code = if pool == STITCH {
                STITCH_CODE
            } else {
                pool_code(self.private.index_of(pool), true)
            };
            self.record(record, stream, addr, size, code);
        }
    }

    /// Marks the home range of a part claimed (from free) or free (from
    /// claimed), merging free blocks as `free_block` does.
    pub(crate) fn set_home(&mut self, p: &Part, state: BlockState) {
        let id = self
            .heap
            .find_block(p.seg, p.addr)
            .expect("part inside its segment");
        let (ptr, size) = (self.heap.blocks[id].ptr, self.heap.blocks[id].size);
        let end = p.addr + p.size;
        if state == BlockState::Claimed {
            self.heap.unindex(id);
        }
        let mut mid = id;
        if p.addr > ptr {
            let head = self
                .heap
                .carve_front(mid, p.addr - ptr, self.heap.blocks[id].state);
            if state == BlockState::Claimed {
                self.heap.reindex(head);
            }
        }
        if end < ptr + size {
            let m = self.heap.carve_front(mid, p.size, state);
            if state == BlockState::Claimed {
                self.heap.reindex(mid);
            }
            mid = m;
        } else {
            self.heap.blocks[mid].state = state;
        }
        if state == BlockState::Free {
            self.heap.merge_free(mid);
        }
    }

    /// Whether a cached stitch aliases a handle mapped in `[lo, hi)`.
    pub(crate) fn aliased(&self, lo: DevicePtr, hi: DevicePtr) -> bool {
        self.stitches.aliased(lo, hi)
    }

    /// Tears down cached stitches that alias a handle mapped in `[lo, hi)`.
    pub(crate) fn drop_stitches_over(
        &mut self,
        lo: DevicePtr,
        hi: DevicePtr,
    ) -> Result<(), AllocError> {
        while let Some(i) = self.stitches.cached_over(lo, hi) {
            self.drop_stitch(i, false)?;
        }
        Ok(())
    }

    /// Tears down every cached stitch.
    pub(crate) fn drop_cached_stitches(&mut self) -> Result<(), AllocError> {
        while let Some(i) = self.stitches.any_cached() {
            self.drop_stitch(i, false)?;
        }
        Ok(())
    }

    fn evict_stitch(&mut self) -> Result<(), AllocError> {
        match self.stitches.least_recent() {
            Some(i) => self.drop_stitch(i, self.config.unmap_thread),
            None => Ok(()),
        }
    }

    /// Unmaps a cached stitch (what is mapped of it) once its last work is
    /// done and frees its range; with `later`, both on the helper thread
    /// (Note [Unmapping off the allocating thread]). Tearing all of them
    /// down (`empty_cache`, out of memory) and for sharing does it here: the
    /// handles go back to the driver or are exported next.
    pub(crate) fn drop_stitch(&mut self, i: usize, later: bool) -> Result<(), AllocError> {
        let (stream, freed) = (self.stitches.list[i].stream, self.stitches.list[i].freed);
        self.fences.wait(&mut self.backend, stream, freed)?;
        self.finish_stitch_holes(i)?;
        self.unmap_slots(i, |s| s.part().is_some(), later)?;
        self.free_stitch(i, later)
    }

    /// Unmaps the holes of cached stitch `i` still mapped until its work is
    /// done (Note [Punching behind the work]). Called before the last of its
    /// parts are unmapped to free it: should this fail, the stitch still
    /// maps them, cached as it was, instead of mapping nothing (no claim,
    /// repair or punch would touch it again) with its range not freed.
    pub(crate) fn finish_stitch_holes(&mut self, i: usize) -> Result<(), AllocError> {
        let (va, size) = (self.stitches.list[i].va, self.stitches.list[i].size);
        Ok(self.finish_drains_over(va, va + size)?)
    }

    /// Frees the range of cached stitch `i`, which maps nothing any more
    /// (or, with `later`, will not once the helper thread is done) and has
    /// no hole still mapped ([`finish_stitch_holes`](Self::finish_stitch_holes)).
    pub(crate) fn free_stitch(&mut self, i: usize, later: bool) -> Result<(), AllocError> {
        let (va, size) = (self.stitches.list[i].va, self.stitches.list[i].size);
        debug_assert!(
            !self.drains.overlaps(va, va + size),
            "a stitch freed with a hole still mapped"
        );
        let s = self.stitches.list.swap_remove(i);
        crate::log::stitch_dropped(self.device, s.stream, s.size);
        if later {
            self.backend.free_reservation_later(s.va, s.size)?;
        } else {
            self.backend.free_reservation(s.va, s.size)?;
        }
        // The trace shows the stitched range's life, not its holes.
        self.record(Action::SegmentUnmap, s.stream, s.va, s.size, STITCH_CODE);
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests;
