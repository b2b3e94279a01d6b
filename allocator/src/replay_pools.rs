//! Private (CUDA graph) pools in a replay: the recorded calls made again,
//! and each allocation sent to the pool the recording served it from.
//!
//! A recording holds the calls on private pools (`private_pool` records:
//! scopes opened and closed, holds taken and dropped, Note [Private
//! pools]) but not the filter a scope was opened with, which is code in
//! the program (PyTorch's: "is this stream capturing this graph?"). What
//! the recording does hold is where each block went: every range a pool
//! mapped or obtained names the pool (`segment_map` / `segment_alloc` pool
//! codes), so the pool of a recorded allocation is the owner of its
//! address. The replay opens each scope with a filter that accepts exactly
//! the allocations the recording served from that pool; captures then
//! stop defragmentation, event queries and releases at the same moments as
//! in the recording, and graph memory stays out of the default pools. A
//! private pool's allocation outside any scope of it comes from a
//! checkpoint restore (PyTorch's `setCheckpointPoolState`, used by
//! cudagraph trees between captures; Note [Pool checkpoints]). The trace
//! numbers checkpoints and names the one each restore puts back, so the
//! replay takes its own checkpoint where the recording took one and
//! restores it where the recording did; the records right after the
//! restore, its frees and then its allocs, are matched with the replayed
//! restore's instead of being made again (allocs by recorded address: the
//! replay notes, with each checkpoint, which recorded block each of its
//! blocks stands for, so the pairing holds under any configuration). A restore of a checkpoint the
//! replay does not have (taken before the trace began) allocates its
//! blocks from their pool wherever the pool's free memory fits them. A
//! request that failed (`oom`) has no address and is retried in the
//! default pools. An allocation in a pool lending its free blocks
//! (`MemPool(use_on_oom=True)`, Note [MemPool options]) outside any scope
//! of it was a default-pool request that borrowed: the replay makes it in
//! the default pools, where its own out-of-memory path borrows, or not,
//! as the replayed device decides (a restore of a checkpoint the replay
//! did not take into such a pool is made so too; one of a scope's
//! allocations while a scope of the pool is open is not told apart from
//! a borrow and goes to the pool).
//! Traces without `private_pool` records (older ones, or programs without
//! CUDA graphs) replay as before: every allocation in the default pools.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::{Backend, DevicePtr};
use crate::checkpoint::CheckpointBlock;
use crate::device::DeviceAllocator;
use crate::pool::PoolKey;
use crate::trace::{Pool, PoolOp};

/// No private pool: the next allocation goes where the open scopes' other
/// rules send it (the default pools).
const NO_POOL: u64 = u64::MAX;

/// The first half of the keys the replay gives private pools (the second
/// is the recorded pool's index); the recording's own keys are not stored.
const REPLAY_KEY: u64 = 0x7265_706c_6179;

/// See the module documentation.
pub(crate) struct PoolRouting {
    /// Recorded ranges that private pools mapped or obtained: first byte →
    /// (end, pool index). Disjoint.
    ranges: BTreeMap<DevicePtr, (DevicePtr, u64)>,
    /// The pool index the next allocation belongs to, read by the filters
    /// of the replayed scopes.
    next: Arc<AtomicU64>,
    /// Scopes open in the replay, by pool index.
    open: HashMap<u64, u32>,
    /// The replay's own checkpoints, by the recording's numbers, each
    /// with the recorded address of every allocated block in it.
    checkpoints: HashMap<u64, Checkpoint>,
    /// The restore under way: what it freed and allocated, matched with
    /// the recorded frees and allocs of its call.
    restoring: Option<Restoring>,
    /// Pools lending their free blocks (`set_use_on_oom` on), by index.
    lending: HashSet<u64>,
}

/// A checkpoint the replay took: its blocks, and the recorded address of
/// each replayed block allocated in it.
struct Checkpoint {
    blocks: Vec<CheckpointBlock>,
    recorded: HashMap<DevicePtr, DevicePtr>,
}

/// A replayed checkpoint restore (Note [Pool checkpoints]): the records
/// right after the recorded restore, its frees and then its allocs, are
/// matched with the replayed restore's (frees by replayed block, allocs by
/// recorded address: the checkpoint's), until one does not match.
struct Restoring {
    freed: HashSet<DevicePtr>,
    allocated: HashMap<DevicePtr, DevicePtr>,
}

impl Default for PoolRouting {
    fn default() -> PoolRouting {
        PoolRouting {
            ranges: BTreeMap::new(),
            next: Arc::new(AtomicU64::new(NO_POOL)),
            open: HashMap::new(),
            checkpoints: HashMap::new(),
            restoring: None,
            lending: HashSet::new(),
        }
    }
}

impl PoolRouting {
    /// Notes the owner of a recorded range a pool mapped or obtained.
    /// Default-pool ranges and stitches (second mappings of default-pool
    /// pages) end any private ownership they overlap: that address space
    /// was given back and reserved again.
    pub fn owner(&mut self, addr: DevicePtr, size: u64, pool: Pool) {
        let end = addr.saturating_add(size);
        let overlapping: Vec<DevicePtr> = self
            .ranges
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > addr)
            .map(|(&a, _)| a)
            .collect();
        for a in overlapping {
            self.ranges.remove(&a);
        }
        let Pool::Code(code @ 2..) = pool else { return };
        let k = (code - 2) / 2;
        // A range that continues the previous one of the same pool joins it.
        let start = match self.ranges.range(..addr).next_back() {
            Some((&a, &(e, j))) if e == addr && j == k => a,
            _ => addr,
        };
        self.ranges.insert(start, (end, k));
    }

    /// Sends the next allocation to the pool that served recorded address
    /// `addr`, if a private one did: through that pool's open scope, or,
    /// when none is open (a checkpoint restore), by returning the pool to
    /// allocate from directly. Outside any scope of a lending pool, to the
    /// default pools (a borrow; see the module documentation).
    pub fn route(&self, addr: DevicePtr) -> Option<PoolKey> {
        let mut pool = self
            .ranges
            .range(..=addr)
            .next_back()
            .filter(|(_, (end, _))| addr < *end)
            .map_or(NO_POOL, |(_, &(_, k))| k);
        let scoped = self.open.get(&pool).is_some_and(|&n| n > 0);
        if !scoped && self.lending.contains(&pool) {
            pool = NO_POOL;
        }
        self.next.store(pool, Ordering::Relaxed);
        (pool != NO_POOL && !scoped).then_some((REPLAY_KEY, pool))
    }

    /// Whether the recorded free of the block replayed at `ptr` is one the
    /// replayed restore made already; the first that is not ends the
    /// restore's frees.
    pub fn restored_free(&mut self, ptr: DevicePtr) -> bool {
        let hit = self
            .restoring
            .as_mut()
            .is_some_and(|r| r.freed.remove(&ptr));
        if !hit {
            self.end_restore();
        }
        hit
    }

    /// The replayed block of the recorded alloc at `addr`, when the
    /// replayed restore made it; the first alloc it did not make ends the
    /// restore.
    pub fn restored_alloc(&mut self, addr: DevicePtr) -> Option<DevicePtr> {
        let r = self.restoring.as_mut()?;
        r.freed.clear();
        let p = r.allocated.remove(&addr);
        if p.is_none() {
            self.end_restore();
        }
        p
    }

    /// Ends matching records with a replayed restore: the replay calls it
    /// for every record that is not a free or an alloc (the next call on a
    /// pool included).
    pub fn end_restore(&mut self) {
        self.restoring = None;
    }

    /// Ends the routing [`route`](Self::route) set.
    pub fn clear(&self) {
        self.next.store(NO_POOL, Ordering::Relaxed);
    }

    /// Makes the recorded call `op` on the `pool`-th private pool of `dev`
    /// (`checkpoint`: the checkpoint's number, for the checkpoint calls;
    /// `recorded_of`: the recorded address of a replayed live block). Errors
    /// are the recording's too (a call on a pool the trace never saw
    /// created, in a trace started mid-run) and are ignored; a restore that
    /// fails, or of a checkpoint the replay did not take, leaves its blocks
    /// to [`route`](Self::route).
    pub fn call<B: Backend>(
        &mut self,
        dev: &mut DeviceAllocator<B>,
        op: PoolOp,
        pool: u64,
        checkpoint: u64,
        recorded_of: &dyn Fn(DevicePtr) -> Option<DevicePtr>,
    ) {
        let key: PoolKey = (REPLAY_KEY, pool);
        let _ = match op {
            PoolOp::Checkpoint => dev.pool_checkpoint(key).map(|blocks| {
                let recorded = blocks
                    .iter()
                    .filter(|b| b.allocated)
                    .filter_map(|b| Some((b.address, recorded_of(b.address)?)))
                    .collect();
                self.checkpoints
                    .insert(checkpoint, Checkpoint { blocks, recorded });
            }),
            PoolOp::Restore => match self.checkpoints.get(&checkpoint) {
                Some(c) => dev.restore_pool(key, &c.blocks).map(|delta| {
                    let allocated = delta
                        .allocated
                        .iter()
                        .filter_map(|p| Some((*c.recorded.get(p)?, *p)))
                        .collect();
                    self.restoring = Some(Restoring {
                        freed: delta.freed.into_iter().collect(),
                        allocated,
                    });
                }),
                None => Ok(()),
            },
            PoolOp::BeginAllocate => {
                let next = Arc::clone(&self.next);
                let filter = Box::new(move |_| next.load(Ordering::Relaxed) == pool);
                dev.begin_allocate_to_pool(key, Some(filter))
                    .map(|()| *self.open.entry(pool).or_default() += 1)
            }
            PoolOp::EndAllocate => dev.end_allocate_to_pool(key).map(|()| {
                self.open
                    .entry(pool)
                    .and_modify(|n| *n = n.saturating_sub(1));
            }),
            PoolOp::Incref => {
                dev.create_or_incref_pool(key);
                Ok(())
            }
            PoolOp::IncrefServed => {
                dev.create_or_incref_plain_pool(key);
                Ok(())
            }
            PoolOp::UseOnOom => dev.set_pool_use_on_oom(key, checkpoint != 0).map(|()| {
                if checkpoint != 0 {
                    self.lending.insert(pool);
                } else {
                    self.lending.remove(&pool);
                }
            }),
            PoolOp::NoSplit => dev.set_pool_no_split(key),
            PoolOp::PlainRequests => {
                dev.set_plain_requests(checkpoint != 0);
                Ok(())
            }
            PoolOp::Release => dev.release_pool(key),
            PoolOp::EmptyCache => dev.empty_pool_cache(key),
            PoolOp::Other(_) => Ok(()),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_belongs_to_the_last_range_that_covered_it() {
        let mut r = PoolRouting::default();
        let at = |r: &PoolRouting, a| {
            r.route(a);
            r.next.load(Ordering::Relaxed)
        };
        assert_eq!(r.route(5), None);
        assert_eq!(at(&r, 5), NO_POOL, "no ranges: nothing routed");
        r.owner(100, 50, Pool::Code(3));
        r.owner(200, 10, Pool::Code(4));
        assert_eq!(at(&r, 120), 0, "large pool of private pool 0");
        assert_eq!(at(&r, 205), 1, "small pool of private pool 1");
        assert_eq!(at(&r, 150), NO_POOL, "the end is outside");
        assert_eq!(
            r.route(120),
            Some((REPLAY_KEY, 0)),
            "no scope open: directly"
        );
        r.open.insert(0, 1);
        assert_eq!(r.route(120), None, "through the open scope's filter");
        r.owner(150, 10, Pool::Code(3));
        assert_eq!(r.ranges.len(), 2, "a continuation joins its range");
        assert_eq!(at(&r, 155), 0);
        r.owner(300, 10, Pool::Code(2));
        r.owner(300, 4, Pool::Stitch);
        assert_eq!(at(&r, 305), NO_POOL, "a stitch reuses the address space");
        r.owner(140, 65, Pool::Code(1));
        assert_eq!(at(&r, 120), NO_POOL, "reserved again by the default pool");
        assert_eq!(at(&r, 205), NO_POOL);
        r.clear();
        assert_eq!(r.next.load(Ordering::Relaxed), NO_POOL);
    }

    #[test]
    fn a_restore_matches_its_own_records_and_ends_at_the_first_other() {
        let mut r = PoolRouting::default();
        let restoring = |r: &mut PoolRouting| {
            r.restoring = Some(Restoring {
                freed: [10, 11].into_iter().collect(),
                allocated: [(100, 20), (101, 21)].into_iter().collect(),
            })
        };
        restoring(&mut r);
        assert!(r.restored_free(10));
        assert_eq!(r.restored_alloc(101), Some(21), "by recorded address");
        assert_eq!(r.restored_alloc(100), Some(20));
        restoring(&mut r);
        assert_eq!(r.restored_alloc(100), Some(20));
        assert!(!r.restored_free(11), "frees come before allocs");
        assert_eq!(r.restored_alloc(101), None, "a free ended the restore");
        restoring(&mut r);
        assert_eq!(r.restored_alloc(555), None, "an alloc it did not make");
        assert_eq!(r.restored_alloc(100), None, "ends the restore");
        assert!(!r.restored_free(10));
        restoring(&mut r);
        assert!(!r.restored_free(12), "a free it did not make");
        assert!(!r.restored_free(10), "ends the restore");
    }
}
