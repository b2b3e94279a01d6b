//! Giving back the unused tail of stitches in use, when memory runs out.
//!
//! Note [Stitch tails]
//! Rationale: a cached stitch serves any request up to a sixteenth (at
//! least a page) smaller than itself, and is claimed whole: the handles
//! past the end of its block stay claimed at home while the block lives
//! (Note [Stitching]). That saves a build whenever sizes vary a little, but
//! those handles hold no live byte, and the promise (a request fails only
//! when the pages of live blocks and the request's pages exceed the device)
//! counts them as free: a 290 MiB block in a 300 MiB stitch kept 10 MiB
//! from a request that fitted.
//! Approach: `empty_cache` and the out-of-memory path, after waiting for the
//! device's work, unmap from every stitch in use the handles that start at
//! or past the end of its block, leaving holes at its end (the stitch's
//! range keeps its size; its segment shows them unmapped), and give their
//! home runs back, free, so that the same pass unmaps them and returns them
//! to the driver. Nothing changes in steady state, so replays of recorded
//! traces make the same decisions. Once freed, the stitch is cached with
//! those holes and is repaired or torn down like any other.

use crate::backend::Backend;
use crate::block::BlockState;
use crate::device::DeviceAllocator;
use crate::error::AllocError;
use crate::stitch_cache::{Part, Slot};

impl<B: Backend> DeviceAllocator<B> {
    /// Unmaps the handles of every stitch in use that lie past the end of
    /// its block and frees their home runs (Note [Stitch tails]). The
    /// caller has waited for the device's work.
    pub(crate) fn trim_stitch_tails(&mut self) -> Result<(), AllocError> {
        for i in 0..self.stitches.list.len() {
            self.trim_stitch_tail(i)?;
        }
        Ok(())
    }

    fn trim_stitch_tail(&mut self, i: usize) -> Result<(), AllocError> {
        let Some(seg) = self.stitches.list[i].in_use else {
            return Ok(());
        };
        let block = self.heap.segments.get(seg).first;
        let used_end = self.heap.blocks[block].ptr + self.heap.blocks[block].size;
        let s = &self.stitches.list[i];
        // The first slot that starts at or past the block's end.
        let mut at = s.va;
        let mut first = s.slots.len();
        for (k, slot) in s.slots.iter().enumerate() {
            if at >= used_end {
                first = k;
                break;
            }
            at += slot.size();
        }
        let tail: Vec<Part> = s.slots[first..]
            .iter()
            .filter_map(Slot::part)
            .copied()
            .collect();
        if tail.is_empty() {
            return Ok(());
        }
        let (stream, freed, va, size) = (s.stream, s.freed, s.va, s.size);
        // The tail's addresses are touched by no live block; what earlier
        // users of the stitch queued there is covered by its last free.
        self.fences.wait(&mut self.backend, stream, freed)?;
        let cut = at;
        // Parts of a stitch alias distinct handles: their homes name them.
        // A stitch in use has no hole before this, so the tail is one run:
        // one call, which unmaps all of it or nothing.
        let homes: Vec<_> = tail.iter().map(|p| p.addr).collect();
        self.unmap_slots(
            i,
            |slot| slot.part().is_some_and(|p| homes.contains(&p.addr)),
            false,
        )?;
        let homes = tail.iter().map(|p| (p.addr, p.size)).collect();
        self.tell_home_runs(stream, homes, true);
        for p in &tail {
            self.set_home(p, BlockState::Free);
        }
        // The segment: the block, the claimed rest of its last handle, and
        // the tail unmapped.
        let rest = self.heap.blocks[block]
            .next
            .expect("a stitch larger than its block has a rest block");
        let claimed = cut - self.heap.blocks[rest].ptr;
        if claimed > 0 {
            self.heap.carve_front(rest, claimed, BlockState::Claimed);
        }
        self.heap.blocks[rest].state = BlockState::Unmapped;
        if let Some(n) = self.heap.blocks[rest].next {
            debug_assert_eq!(self.heap.blocks[n].state, BlockState::Unmapped);
            self.heap.absorb_next(rest);
        }
        debug_assert_eq!(
            self.heap.blocks[rest].ptr + self.heap.blocks[rest].size,
            va + size
        );
        self.heap.segments.get_mut(seg).mapped = cut - va;
        Ok(())
    }
}
