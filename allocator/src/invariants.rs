//! The whole-structure check every test runs (talc's `scan_for_errors`).
//!
//! It verifies, from scratch: blocks tile each segment exactly; no two
//! adjacent blocks of a segment are both free with the same stream (they
//! would have been merged); the free index holds exactly the free blocks,
//! under their current keys; the address map holds exactly the allocated
//! and pending blocks; pending events match their blocks; the page pool's
//! mapped handles tile exactly the mapped blocks of expandable segments; and
//! every stat gauge equals a recount (reserved = mapped + pooled); each
//! handle is mapped at one place or pooled, once; the parts of stitches in
//! use cover exactly the claimed blocks at home, without overlap; old
//! ranges still to be unmapped lie in unmapped blocks.

use crate::backend::Backend;
use crate::block::BlockState;
use crate::device::DeviceAllocator;
use crate::heap::STITCH;
use crate::size_class::PoolKind;
use crate::stats::{DeviceStats, STATS, StatValue};
use crate::stitch_cache::Slot;

impl<B: Backend> DeviceAllocator<B> {
    /// Checks every invariant; returns a description of the first violation.
    ///
    /// # Errors
    /// A message naming the broken invariant and the numbers involved.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen_blocks = 0usize;
        let mut free_blocks = 0usize;
        let mut unmapped_blocks = 0usize;
        let mut claimed_blocks = 0usize;
        let mut claimed_bytes = 0u64;
        // Claimed blocks at home, `(start, end)`.
        let mut claimed: Vec<(u64, u64)> = Vec::new();
        // The gauges rebuilt from the blocks; every array stat of the table
        // must equal its recount, so a new one needs a recount here.
        let mut recount = DeviceStats::default();
        let mut mapped_ranges: Vec<(u64, u64)> = Vec::new();
        for (seg_id, seg) in self.heap.segments.iter() {
            if !seg.expandable {
                recount.segment.update(seg.kind, 1);
            }
            let mut mapped = 0u64;
            let mut cur = Some(seg.first);
            let mut addr = seg.ptr;
            let mut prev: Option<u32> = None;
            let split = !seg.expandable && self.heap.blocks[seg.first].next.is_some();
            while let Some(id) = cur {
                let b = &self.heap.blocks[id];
                seen_blocks += 1;
                if b.segment != seg_id || b.prev != prev {
                    return Err(format!(
                        "block {id} at {:#x} has broken links in segment {seg_id}",
                        b.ptr
                    ));
                }
                if b.ptr != addr {
                    return Err(format!(
                        "segment {seg_id}: gap or overlap at {addr:#x} (block starts at {:#x})",
                        b.ptr
                    ));
                }
                if b.size == 0 || !b.size.is_multiple_of(512) {
                    return Err(format!("block {id} has size {}", b.size));
                }
                if b.pool != seg.pool {
                    return Err(format!(
                        "block {id} is in pool {} but its segment in pool {}",
                        b.pool, seg.pool
                    ));
                }
                if let Some(p) = prev {
                    let pb = &self.heap.blocks[p];
                    if pb.state == BlockState::Unmapped && b.state == BlockState::Unmapped {
                        return Err(format!(
                            "adjacent unmapped blocks {p} and {id} were not merged"
                        ));
                    }
                    if pb.state == BlockState::Free
                        && b.state == BlockState::Free
                        && pb.stream == b.stream
                    {
                        return Err(format!(
                            "adjacent free blocks {p} and {id} of stream {} were not merged",
                            b.stream
                        ));
                    }
                }
                let kind = seg.kind;
                if b.state != BlockState::Unmapped {
                    mapped += b.size;
                    if seg.expandable && seg.pool != STITCH {
                        match mapped_ranges.last_mut() {
                            Some(r) if r.1 == b.ptr => r.1 += b.size,
                            _ => mapped_ranges.push((b.ptr, b.ptr + b.size)),
                        }
                    }
                }
                match b.state {
                    BlockState::Claimed => {
                        claimed_blocks += 1;
                        if !seg.expandable {
                            return Err(format!("claimed block {id} in plain segment {seg_id}"));
                        }
                        if seg.pool != STITCH {
                            claimed_bytes += b.size;
                            claimed.push((b.ptr, b.ptr + b.size));
                        }
                    }
                    BlockState::Unmapped => {
                        unmapped_blocks += 1;
                        if !seg.expandable {
                            return Err(format!("unmapped block {id} in plain segment {seg_id}"));
                        }
                        if self.live.contains_key(&b.ptr) && self.live[&b.ptr] == id {
                            return Err(format!("unmapped block {id} is in the address map"));
                        }
                    }
                    BlockState::Free => {
                        free_blocks += 1;
                        if !self.heap.pools[b.pool as usize].contains((b.stream, b.size, b.ptr, id))
                        {
                            return Err(format!(
                                "free block {id} at {:#x} is missing from its pool's index",
                                b.ptr
                            ));
                        }
                        if split {
                            recount.inactive_split.update(kind, 1);
                            recount.inactive_split_bytes.update(kind, b.size as i64);
                        }
                    }
                    BlockState::Allocated | BlockState::PendingFree => {
                        if self.live.get(&b.ptr) != Some(&id) {
                            return Err(format!(
                                "live block {id} at {:#x} is missing from the address map",
                                b.ptr
                            ));
                        }
                        recount.active.update(kind, 1);
                        recount.active_bytes.update(kind, b.size as i64);
                        recount.requested_bytes.update(kind, b.requested as i64);
                        if b.state == BlockState::Allocated {
                            recount.allocation.update(kind, 1);
                            recount.allocated_bytes.update(kind, b.size as i64);
                            if b.size >= self.config.max_split_size {
                                recount.oversize_allocations.current += 1;
                            }
                        } else if b.event_count == 0 && !self.pending.is_deferred(id) {
                            return Err(format!("pending block {id} waits on no event"));
                        }
                    }
                }
                addr += b.size;
                prev = Some(id);
                cur = b.next;
            }
            if mapped != seg.mapped {
                return Err(format!(
                    "segment {seg_id} records {} bytes mapped, its blocks {mapped}",
                    seg.mapped
                ));
            }
            if seg.pool != STITCH {
                // A stitch aliases claimed memory counted at home.
                recount.reserved_bytes.update(seg.kind, mapped as i64);
            }
            if addr != seg.ptr + seg.size {
                return Err(format!(
                    "segment {seg_id} blocks end at {addr:#x}, segment at {:#x}",
                    seg.ptr + seg.size
                ));
            }
        }
        let lent: u64 = self
            .stitches
            .list
            .iter()
            .filter(|s| s.in_use.is_some())
            .flat_map(|s| s.parts())
            .map(|p| p.size)
            .sum();
        if lent != claimed_bytes {
            return Err(format!(
                "stitches in use hold {lent} bytes, claimed blocks at home {claimed_bytes}"
            ));
        }
        claimed.sort_unstable();
        self.check_lent_parts(&claimed)?;
        self.check_stitches()?;
        for kind in [PoolKind::Small, PoolKind::Large] {
            recount
                .reserved_bytes
                .update(kind, self.pages.pooled_bytes(kind) as i64);
        }
        mapped_ranges.sort_unstable();
        self.pages
            .check(&mapped_ranges)
            .map_err(|e| format!("page pool: {e}"))?;
        if seen_blocks != self.heap.blocks.len() {
            return Err(format!(
                "{} blocks in the arena, {seen_blocks} reachable from segments",
                self.heap.blocks.len()
            ));
        }
        let indexed: usize = self.heap.pools.iter().map(|p| p.len()).sum();
        if indexed != free_blocks {
            return Err(format!(
                "free index holds {indexed} entries for {free_blocks} free blocks"
            ));
        }
        if self.live.len() + free_blocks + unmapped_blocks + claimed_blocks != seen_blocks {
            return Err(format!(
                "address map holds {} blocks, expected {}",
                self.live.len(),
                seen_blocks - free_blocks - unmapped_blocks - claimed_blocks
            ));
        }
        let expected: u32 = self
            .live
            .values()
            .map(|&id| self.heap.blocks[id].event_count)
            .sum();
        self.pending.check(expected)?;
        self.capture_reuse.check(
            |id| {
                self.pending.is_deferred(id)
                    && self.heap.blocks[id].state == BlockState::PendingFree
            },
            |id| {
                let b = &self.heap.blocks[id];
                b.state == BlockState::Allocated && !b.stream_uses.is_empty()
            },
        )?;
        if let Some(p) = self.shares.blocks().find(|p| !self.live.contains_key(p)) {
            return Err(format!("shared block {p:#x} is not live"));
        }
        let s = &self.stats;
        for (i, def) in STATS.iter().enumerate() {
            let (Some(StatValue::Array(got)), Some(StatValue::Array(want))) =
                (s.get(i), recount.get(i))
            else {
                continue;
            };
            let name = def.name;
            for ((pool, g), (_, w)) in got.named().into_iter().zip(want.named()) {
                if g.current != w.current {
                    return Err(format!(
                        "{name}.{pool}.current is {} but a recount gives {}",
                        g.current, w.current
                    ));
                }
                if g.peak < g.current {
                    return Err(format!(
                        "{name}.{pool}: peak {} below current {}",
                        g.peak, g.current
                    ));
                }
            }
        }
        if s.oversize_allocations.current != recount.oversize_allocations.current {
            return Err(format!(
                "oversize_allocations.current is {} but a recount gives {}",
                s.oversize_allocations.current, recount.oversize_allocations.current
            ));
        }
        Ok(())
    }

    /// Every stitch's slots tile its range; one in use has holes only past
    /// its block, a cached one maps at least one part; every part aliases the handle
    /// still mapped at its home, and no two parts of a stitch the same one.
    fn check_stitches(&self) -> Result<(), String> {
        for (k, s) in self.stitches.list.iter().enumerate() {
            let va = s.va;
            let total: u64 = s.slots.iter().map(Slot::size).sum();
            if total != s.size {
                return Err(format!(
                    "stitch {k} at {va:#x}: slots add up to {total} bytes, its range to {}",
                    s.size
                ));
            }
            if let Some(seg) = s.in_use {
                // Holes only past its block's end (Note [Stitch tails]).
                let b = &self.heap.blocks[self.heap.segments.get(seg).first];
                let mut at = va;
                for slot in &s.slots {
                    if slot.part().is_none() && at < b.ptr + b.size {
                        return Err(format!(
                            "stitch {k} at {va:#x} is in use with a hole at {at:#x}, inside its block"
                        ));
                    }
                    at += slot.size();
                }
            }
            if s.parts().next().is_none() {
                return Err(format!("cached stitch {k} at {va:#x} maps nothing"));
            }
            let mut homes: Vec<u64> = Vec::new();
            for p in s.parts() {
                if self.pages.handle_at(p.addr) != Some((p.handle, p.size)) {
                    return Err(format!(
                        "stitch {k} at {va:#x} aliases handle {} ({} bytes) at {:#x}, which is not mapped there",
                        p.handle, p.size, p.addr
                    ));
                }
                homes.push(p.addr);
            }
            homes.sort_unstable();
            if let Some(w) = homes.windows(2).find(|w| w[0] == w[1]) {
                return Err(format!(
                    "stitch {k} at {va:#x} maps the handle at {:#x} twice",
                    w[0]
                ));
            }
        }
        self.check_drains()
    }

    /// Each part of a stitch in use lies in a claimed block at home, and no
    /// two parts overlap: with the byte totals equal, the parts cover the
    /// claimed blocks exactly, so no home page of a stitch in use can be
    /// free (and handed out) while the stitch's block is live. `claimed`
    /// lists the claimed blocks, sorted.
    fn check_lent_parts(&self, claimed: &[(u64, u64)]) -> Result<(), String> {
        let mut parts: Vec<(u64, u64)> = Vec::new();
        for (k, s) in self.stitches.list.iter().enumerate() {
            if s.in_use.is_none() {
                continue;
            }
            for p in s.parts() {
                let (lo, hi) = (p.addr, p.addr + p.size);
                // The last claimed block starting at or before the part.
                let at = claimed.partition_point(|&(start, _)| start <= lo);
                if at == 0 || claimed[at - 1].1 < hi {
                    return Err(format!(
                        "stitch {k} at {:#x} is in use, but its part {lo:#x}..{hi:#x} at home is not in a claimed block",
                        s.va
                    ));
                }
                parts.push((lo, hi));
            }
        }
        parts.sort_unstable();
        if let Some(w) = parts.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(format!(
                "stitches in use lend {:#x}..{:#x} and {:#x}..{:#x}, which overlap",
                w[0].0, w[0].1, w[1].0, w[1].1
            ));
        }
        Ok(())
    }

    /// Every old range still to be unmapped lies in one unmapped block of an
    /// expandable segment, or in holes of a stitch: nothing was mapped there
    /// again before it left (Note [Unmapping behind the work], Note
    /// [Punching behind the work]).
    fn check_drains(&self) -> Result<(), String> {
        for (lo, hi) in self.drains.ranges() {
            // Or holes of a cached stitch (Note [Punching behind the work]).
            if let Some(st) = self.stitches.list.iter().find(|st| st.holds(lo, hi)) {
                if st.in_use.is_some() {
                    return Err(format!(
                        "{lo:#x}..{hi:#x}, still to be unmapped, is in the stitch at {:#x}, which is in use",
                        st.va
                    ));
                }
                let mut at = st.va;
                for slot in &st.slots {
                    if at < hi && lo < at + slot.size() && slot.part().is_some() {
                        return Err(format!(
                            "{lo:#x}..{hi:#x}, still to be unmapped, overlaps a part of the stitch at {:#x} mapped at {at:#x}",
                            st.va
                        ));
                    }
                    at += slot.size();
                }
                continue;
            }
            let inside = self
                .heap
                .segments
                .iter()
                .find(|(_, g)| g.expandable && g.ptr <= lo && hi <= g.ptr + g.size);
            let Some((seg, _)) = inside else {
                return Err(format!(
                    "{lo:#x}..{hi:#x}, still to be unmapped, is in no expandable segment"
                ));
            };
            let b = &self.heap.blocks[self.heap.block_at(seg, lo)];
            if b.state != BlockState::Unmapped || hi > b.ptr + b.size {
                return Err(format!(
                    "{lo:#x}..{hi:#x}, still to be unmapped, overlaps a {:?} block at {:#x}+{}",
                    b.state, b.ptr, b.size
                ));
            }
        }
        Ok(())
    }
}

impl DeviceAllocator<crate::SimBackend> {
    /// On the simulator, also checks the mappings the device really holds:
    /// exactly the page pool's mapped handles, the old ranges still to be
    /// unmapped (Note [Unmapping behind the work]) and the cached or used
    /// stitches' parts, nothing more or less.
    ///
    /// # Errors
    /// A message naming the mappings on one side only.
    pub fn check_backend_mappings(&self) -> Result<(), String> {
        let mut want: Vec<(u64, u64, u64)> = Vec::new();
        for (_, seg) in self.heap.segments.iter() {
            if seg.expandable && seg.pool != STITCH {
                want.extend(self.pages.handles_in(seg.ptr, seg.ptr + seg.size));
            }
        }
        for (lo, handles) in self.drains.mappings() {
            let mut at = lo;
            for &(h, size) in handles {
                want.push((at, h, size));
                at += size;
            }
        }
        for st in &self.stitches.list {
            let mut at = st.va;
            for slot in &st.slots {
                if let Some(p) = slot.part() {
                    want.push((at, p.handle, p.size));
                }
                at += slot.size();
            }
        }
        want.sort_unstable();
        // Ranges given up and left to the helper thread are gone already.
        let mut got = self.backend.handles_over(0, u64::MAX);
        got.retain(|m| !self.backend.unmapping_later(m.0));
        if want == got {
            return Ok(());
        }
        let only_here: Vec<_> = want.iter().filter(|m| !got.contains(m)).take(4).collect();
        let only_there: Vec<_> = got.iter().filter(|m| !want.contains(m)).take(4).collect();
        Err(format!(
            "mappings (address, handle, bytes) known here only: {only_here:x?}; on the device only: {only_there:x?}"
        ))
    }
}
