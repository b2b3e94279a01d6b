//! Repairing cached stitches in part: a handle that defragmentation takes
//! leaves a hole in the cached stitches that alias it, and the next claim
//! maps other free handles into the holes (Note [Stitching] in `stitch.rs`).
//!
//! Note [Punching behind the work]
//! Rationale: a handle that defragmentation moves is unmapped from every
//! cached stitch that aliases it, and the stitch's address may still be in
//! use by the work its last block queued. The host used to wait for that
//! work (`cuEventSynchronize`) even when the request that moves the handle
//! is on the stitch's own stream, where a move of the pages themselves does
//! not wait (Note [Unmapping behind the work] in `drain.rs`): 9 of the 38
//! host waits of the multi-scale detector's replay were such punches.
//! Approach: when `defer_unmap` is on and captures are not followed
//! through the driver, the slots become holes at once and their ranges
//! join the drains, unmapped once a fence shows the stitch's work done: the
//! request's work at the handle's new address is queued behind the
//! stitch's, on the same stream, or on the request's stream made to wait
//! for a fence on the stitch's (`DeviceAllocator::may_leave_later`). Every
//! decision, and so a replay, is the same as with the wait; only when the
//! host waits and when `cuMemUnmap` runs differ. A hole still draining is
//! finished (waiting if need be) before anything is mapped into it (a
//! repair) and, when the stitch is freed, before its last parts are
//! unmapped: a failed unmapping of the hole then leaves the stitch cached
//! as it was, not mapping nothing. A stitch that would be left with no
//! part is punched and freed as before.
//! Measured: the detector's replay (whose fences are never found done by
//! polling, so a wait comes back at the repair) counts 35 host waits
//! instead of 38; on an H100 the detector waited 3 and 5 times against 3
//! and 3 without it (`docs/results/h100-round63/`): no gain two runs show.

use crate::backend::{Backend, DevicePtr, HandleId, StreamId, unmap_maybe_later};
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::heap::{LARGE, STITCH};
use crate::observer::SegmentAction;
use crate::stitch_cache::{Part, Slot};
use crate::trace::{Action, STITCH_CODE};

impl<B: Backend> DeviceAllocator<B> {
    /// Unmaps from cached stitches the parts that alias a handle mapped in
    /// `[lo, hi)`, after each stitch's last work, leaving holes; a stitch
    /// left with no part is freed. When the pages move for a request of
    /// `requester`, its parts leave their addresses once that work is done
    /// instead, the requester's stream ordered after it (Note [Punching
    /// behind the work]).
    pub(crate) fn punch_stitches_over(
        &mut self,
        lo: DevicePtr,
        hi: DevicePtr,
        requester: Option<StreamId>,
    ) -> Result<(), AllocError> {
        let over = |s: &Slot| {
            s.part()
                .is_some_and(|p| p.addr < hi && lo < p.addr + p.size)
        };
        while let Some(i) = self.stitches.cached_over(lo, hi) {
            let (stream, freed) = (self.stitches.list[i].stream, self.stitches.list[i].freed);
            // The stitch keeps a part: a stitch left with none is freed now.
            let keeps = |st: &crate::stitch_cache::Stitch| {
                st.slots.iter().any(|s| s.part().is_some() && !over(s))
            };
            if keeps(&self.stitches.list[i])
                && requester.is_some_and(|r| self.may_leave_later(r, stream, freed))
            {
                self.leave_slots_later(i, over);
                continue;
            }
            self.fences.wait(&mut self.backend, stream, freed)?;
            if !keeps(&self.stitches.list[i]) {
                // Freed below: its holes still mapped leave before its last
                // parts, so that a failure leaves it as it was.
                self.finish_stitch_holes(i)?;
            }
            // Holes are mapped again only after the helper is done there.
            let later = self.config.unmap_thread;
            self.unmap_slots(i, over, later)?;
            if self.stitches.list[i].parts().next().is_none() {
                self.free_stitch(i, later)?;
            }
        }
        Ok(())
    }

    /// Makes the mapped slots of cached stitch `i` that `pick` selects
    /// holes now, and leaves their addresses to be unmapped once the
    /// stitch's last work is done, one range per run (Note [Punching
    /// behind the work]).
    fn leave_slots_later(&mut self, i: usize, pick: impl Fn(&Slot) -> bool) {
        let (stream, freed) = (self.stitches.list[i].stream, self.stitches.list[i].freed);
        let key = self.pool_key(STITCH);
        let runs = self.stitches.list[i].runs(|s| s.part().is_some() && pick(s));
        for (first, end, at, bytes) in runs {
            let slots = &mut self.stitches.list[i].slots[first..end];
            let handles = slots
                .iter()
                .filter_map(Slot::part)
                .map(|p| (p.handle, p.size))
                .collect();
            for slot in slots {
                *slot = Slot::Hole(slot.size());
            }
            // A cached stitch is not listed: its `UnmapUnlisted` comes when
            // the range leaves its address (`drain.rs`).
            self.drains.push(at, bytes, stream, freed, handles, key);
        }
    }

    /// Unmaps the mapped slots of stitch `i` that `pick` selects, one call
    /// per run of them, and makes them holes; with `later`, through
    /// [`Backend::unmap_later`]. The caller waited for the stitch's work
    /// (Note [Event-ordered unmapping]).
    pub(crate) fn unmap_slots(
        &mut self,
        i: usize,
        pick: impl Fn(&Slot) -> bool,
        later: bool,
    ) -> Result<(), AllocError> {
        let stream = self.stitches.list[i].stream;
        let runs = self.stitches.list[i].runs(|s| s.part().is_some() && pick(s));
        // The snapshot lists a stitch in use, not a cached one.
        let in_use = self.stitches.list[i].in_use.is_some();
        let (unmap, again) = if in_use {
            (SegmentAction::Unmap, SegmentAction::Map)
        } else {
            (SegmentAction::UnmapUnlisted, SegmentAction::MapUnlisted)
        };
        for (first, end, at, bytes) in runs {
            self.notify(unmap, STITCH, stream, at, bytes);
            if let Err(e) = unmap_maybe_later(&mut self.backend, at, bytes, later) {
                // Still mapped: say so again (Note [Segment events]).
                self.notify(again, STITCH, stream, at, bytes);
                return Err(e.into());
            }
            if in_use {
                // A stitch in use is listed; the trace shows only its life
                // and its listing (Note [Listed ranges]).
                self.record(Action::SegmentUnlist, stream, at, bytes, STITCH_CODE);
            }
            for slot in &mut self.stitches.list[i].slots[first..end] {
                *slot = Slot::Hole(slot.size());
            }
        }
        Ok(())
    }

    /// Repairs cached stitch `i`: its holes, and its `busy` parts (those
    /// whose home is no longer free, as `stitch_for` found them), get free handles of its stream (smallest free runs
    /// first, the fragments other requests can least use; none that the
    /// stitch keeps), each handles that add up to its size. Only those are
    /// unmapped (after the stitch's last work) and mapped, one call per
    /// run. `false`, with nothing changed, when some cannot be replaced.
    pub(crate) fn repair_stitch(
        &mut self,
        i: usize,
        busy: &[DevicePtr],
    ) -> Result<bool, AllocError> {
        let s = &self.stitches.list[i];
        let stream = s.stream;
        // What the repair replaces: its holes and busy parts, each once
        // (Note [Stitching]: repairs rent).
        let replaced = (s.holes() + busy.len()) as u64;
        let own: Vec<DevicePtr> = s.parts().map(|p| p.addr).collect();
        let mut runs: Vec<_> = self
            .free_runs(None)
            .into_iter()
            .filter(|r| r.3 == stream && self.heap.segments.get(r.2).pool == LARGE)
            .collect();
        runs.sort_unstable_by_key(|r| (r.0, r.1));
        let mut spare: Vec<Part> = Vec::new();
        for (bytes, lo, seg, ..) in runs {
            for (addr, handle, size) in self.pages.handles_in(lo, lo + bytes) {
                if !own.contains(&addr) {
                    spare.push(Part {
                        seg,
                        addr,
                        handle,
                        size,
                    });
                }
            }
        }
        // Largest handles first (stable: among equal sizes, smaller runs first),
        // so a hole takes one handle of its size when there is one.
        spare.sort_by_key(|p| std::cmp::Reverse(p.size));
        let mut used = vec![false; spare.len()];
        // The spare handles taken, in slot order.
        let mut taken: Vec<usize> = Vec::new();
        let mut slots: Vec<Slot> = Vec::with_capacity(s.slots.len());
        for slot in &s.slots {
            let size = match slot {
                Slot::Mapped(p) if !busy.contains(&p.addr) => {
                    slots.push(*slot);
                    continue;
                }
                slot => slot.size(),
            };
            let mut left = size;
            for (k, p) in spare.iter().enumerate() {
                if !used[k] && p.size <= left {
                    used[k] = true;
                    taken.push(k);
                    left -= p.size;
                    slots.push(Slot::Hole(p.size));
                    if left == 0 {
                        break;
                    }
                }
            }
            if left > 0 {
                return Ok(false);
            }
        }
        if !busy.is_empty() {
            let freed = self.stitches.list[i].freed;
            self.fences.wait(&mut self.backend, stream, freed)?;
            // Mapped again at once: nothing to gain from the helper.
            self.unmap_slots(
                i,
                |s| s.part().is_some_and(|p| busy.contains(&p.addr)),
                false,
            )?;
        }
        // `slots` has the new holes, one per handle; map them run by run.
        let mut fill = taken.into_iter().map(|k| spare[k]);
        let mut plan: Vec<Option<Part>> = slots
            .iter()
            .map(|s| match s {
                Slot::Mapped(_) => None,
                Slot::Hole(_) => fill.next(),
            })
            .collect();
        self.stitches.list[i].slots = slots;
        // Holes still mapped until the stitch's last work is done leave
        // first (Note [Punching behind the work]).
        let (va, size) = (self.stitches.list[i].va, self.stitches.list[i].size);
        self.finish_drains_over(va, va + size)?;
        let runs = self.stitches.list[i].runs(|s| s.part().is_none());
        let mut handles = 0;
        let mut fresh = Vec::new();
        for (first, end, at, bytes) in runs {
            let filled: Vec<Part> = plan[first..end]
                .iter_mut()
                .map(|p| p.take().expect("a handle per hole"))
                .collect();
            let list: Vec<(HandleId, u64)> = filled.iter().map(|p| (p.handle, p.size)).collect();
            self.backend.map_handles(at, &list, false)?;
            let slots = &mut self.stitches.list[i].slots[first..end];
            for (slot, p) in slots.iter_mut().zip(filled) {
                fresh.push(p.addr);
                *slot = Slot::Mapped(p);
            }
            handles += list.len();
            self.notify(SegmentAction::MapUnlisted, STITCH, stream, at, bytes);
        }
        self.stitches.list[i].repaired += replaced;
        self.stitches.list[i].fresh = fresh;
        crate::log::stitch_repaired(self.device, stream, self.stitches.list[i].size, handles);
        Ok(true)
    }
}

#[cfg(test)]
mod tests;
