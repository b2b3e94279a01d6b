//! What CUDA graphs held: private pools, their captures, and the memory
//! mapped for them.
//!
//! A captured graph replays at fixed addresses, so its memory comes from a
//! pool private to it and stays there until PyTorch releases the graph
//! (Note [Private pools]). That memory is neither the program's live
//! tensors nor the shared cache, and `torch.compile(mode="reduce-overhead")`
//! makes such pools without the program asking: the summary says how many
//! captures and pools a trace saw (`private_pool` records, format minor 2)
//! and the most memory mapped for private pools at once (their segment
//! events, in every trace), and which pools took their memory from another
//! allocator (`MemPool(allocator=...)`) or lent it on out-of-memory
//! (`MemPool(use_on_oom=True)`).

use std::collections::BTreeSet;

use gpualloc::trace::{EventKind, Pool, PoolOp};

use crate::units::bytes;

/// Private pools of one device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphPools {
    /// Scopes opened (`begin_allocate_to_pool`: one per capture).
    pub captures: u64,
    /// Holds dropped (`release_pool`: a graph or pool released).
    pub releases: u64,
    /// Pools put back to a checkpoint (`set_checkpoint_pool_state`, by
    /// cudagraph trees before a capture that branches off).
    pub restores: u64,
    /// Most bytes mapped or held in segments of private pools at once.
    pub peak_held: u64,
    /// Bytes so held now.
    held: u64,
    /// Pool indexes the calls named (at most [`MAX_POOLS`]: a damaged
    /// trace's indexes do not grow it without bound).
    seen: BTreeSet<u64>,
    /// Pools served by another allocator (`MemPool(allocator=...)`).
    served: BTreeSet<u64>,
    /// Pools that lent their free blocks on out-of-memory at some point
    /// (`MemPool(use_on_oom=True)`).
    lending: BTreeSet<u64>,
}

/// Distinct private pools counted at most.
const MAX_POOLS: usize = 1 << 16;

/// Whether a segment event's pool is a private one (`trace::pool_code`).
fn private(pool: Pool) -> bool {
    matches!(pool, Pool::Code(c) if c >= 2)
}

impl GraphPools {
    /// Counts one event.
    #[inline]
    pub fn apply(&mut self, kind: &EventKind) {
        match *kind {
            EventKind::PrivatePool {
                op,
                pool,
                checkpoint,
            } => {
                // PyTorch's expandable_segments switch names no pool.
                if op == PoolOp::PlainRequests {
                    return;
                }
                if self.seen.len() < MAX_POOLS {
                    self.seen.insert(pool);
                }
                match op {
                    PoolOp::BeginAllocate => self.captures += 1,
                    PoolOp::Release => self.releases += 1,
                    PoolOp::Restore => self.restores += 1,
                    PoolOp::IncrefServed if self.served.len() < MAX_POOLS => {
                        self.served.insert(pool);
                    }
                    PoolOp::UseOnOom if checkpoint != 0 && self.lending.len() < MAX_POOLS => {
                        self.lending.insert(pool);
                    }
                    _ => {}
                }
            }
            EventKind::SegmentAlloc { size, pool, .. }
            | EventKind::SegmentMap { size, pool, .. }
                if private(pool) =>
            {
                // Saturating: a damaged file's sizes must not wrap it.
                self.held = self.held.saturating_add(size);
                self.peak_held = self.peak_held.max(self.held);
            }
            EventKind::SegmentFree { size, pool, .. }
            | EventKind::SegmentUnmap { size, pool, .. }
                if private(pool) =>
            {
                self.held = self.held.saturating_sub(size);
            }
            _ => {}
        }
    }

    /// Distinct pools the calls named.
    pub fn pools(&self) -> u64 {
        self.seen.len() as u64
    }

    /// Pools served by another allocator.
    pub fn served(&self) -> u64 {
        self.served.len() as u64
    }

    /// Pools that lent on out-of-memory.
    pub fn lending(&self) -> u64 {
        self.lending.len() as u64
    }

    /// "N captures into M private pools (K releases); up to X mapped for
    /// them at once", or `None` when the trace shows no private pool.
    pub fn describe(&self) -> Option<String> {
        if self.seen.is_empty() && self.peak_held == 0 {
            return None;
        }
        let calls = if !self.seen.is_empty() {
            let n =
                |k: u64, one: &str, many: &str| format!("{k} {}", if k == 1 { one } else { many });
            let restores = match self.restores {
                0 => String::new(),
                r => format!(", {}", n(r, "checkpoint restore", "checkpoint restores")),
            };
            format!(
                "{} into {} ({}{restores}); ",
                n(self.captures, "capture", "captures"),
                n(self.pools(), "private pool", "private pools"),
                n(self.releases, "release", "releases")
            )
        } else {
            String::new()
        };
        let mut kinds = Vec::new();
        if !self.served.is_empty() {
            kinds.push(format!("{} served by another allocator", self.served()));
        }
        if !self.lending.is_empty() {
            kinds.push(format!("{} lending on out-of-memory", self.lending()));
        }
        let kinds = if kinds.is_empty() {
            String::new()
        } else {
            format!(" (of the pools: {})", kinds.join(", "))
        };
        Some(format!(
            "{calls}up to {} mapped for private pools at once (memory of CUDA graphs and MemPools, apart from the cache){kinds}",
            bytes(self.peak_held)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(size: u64, code: u64) -> EventKind {
        EventKind::SegmentMap {
            addr: 0,
            size,
            pool: Pool::from_code(code),
        }
    }

    #[test]
    fn counts_captures_pools_and_the_most_held_at_once() {
        let mut g = GraphPools::default();
        assert_eq!(g.describe(), None);
        let call = |op, pool| EventKind::PrivatePool {
            op,
            pool,
            checkpoint: 0,
        };
        g.apply(&call(PoolOp::BeginAllocate, 0));
        g.apply(&map(100, 3));
        g.apply(&map(50, 1)); // the default large pool
        g.apply(&map(20, gpualloc::trace::STITCH_CODE));
        g.apply(&call(PoolOp::EndAllocate, 0));
        g.apply(&call(PoolOp::BeginAllocate, 1));
        g.apply(&map(30, 4));
        g.apply(&EventKind::SegmentUnmap {
            addr: 0,
            size: 100,
            pool: Pool::Code(3),
        });
        g.apply(&map(10, 5));
        g.apply(&call(PoolOp::Release, 0));
        g.apply(&call(PoolOp::Restore, 1));
        assert_eq!(
            (g.captures, g.pools(), g.releases, g.peak_held),
            (2, 2, 1, 130)
        );
        let text = g.describe().unwrap();
        assert!(
            text.starts_with(
                "2 captures into 2 private pools (1 release, 1 checkpoint restore); up to 130 B"
            ),
            "{text}"
        );
    }

    #[test]
    fn names_pools_of_another_allocator_and_lending_pools() {
        let mut g = GraphPools::default();
        let call = |op, pool, checkpoint| EventKind::PrivatePool {
            op,
            pool,
            checkpoint,
        };
        g.apply(&call(PoolOp::IncrefServed, 0, 0));
        g.apply(&call(PoolOp::Incref, 1, 0));
        g.apply(&call(PoolOp::UseOnOom, 1, 1));
        g.apply(&call(PoolOp::UseOnOom, 2, 0));
        g.apply(&map(1 << 20, 2));
        assert_eq!((g.pools(), g.served(), g.lending()), (3, 1, 1));
        let text = g.describe().unwrap();
        assert!(
            text.ends_with(
                "(of the pools: 1 served by another allocator, 1 lending on out-of-memory)"
            ),
            "{text}"
        );
    }

    #[test]
    fn older_traces_show_the_memory_without_the_calls() {
        let mut g = GraphPools::default();
        g.apply(&map(1 << 20, 2));
        assert!(g.describe().unwrap().starts_with("up to 1.00 MiB mapped"));
    }

    #[test]
    fn the_expandable_segments_switch_is_no_private_pool() {
        let mut g = GraphPools::default();
        // What `DeviceAllocator::set_plain_requests` records: pool u64::MAX.
        for on in [1, 0] {
            g.apply(&EventKind::PrivatePool {
                op: PoolOp::PlainRequests,
                pool: u64::MAX,
                checkpoint: on,
            });
        }
        g.apply(&map(30 << 20, 1)); // its plain segments: default pool code
        assert_eq!(g.pools(), 0, "{:?}", g.describe());
        assert_eq!(g.describe(), None);
    }
}
