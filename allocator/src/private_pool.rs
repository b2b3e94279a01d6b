//! The private pools of one device and the open allocation scopes: which
//! pool an allocation goes to while a CUDA graph is captured, and how many
//! holds keep each pool (Note [Private pools] in `capture.rs`).

use crate::backend::StreamId;
use crate::block::PoolId;
use crate::error::AllocError;
use crate::heap::STITCH;
use crate::pool::PoolKey;
use crate::segment_source::SegmentSource;
use crate::size_class::PoolKind;

/// Decides whether an allocation on a stream belongs to a scope's pool.
pub type StreamFilter = Box<dyn Fn(StreamId) -> bool + Send>;

struct PrivatePool {
    key: PoolKey,
    /// Creation order on this device (trace pool codes use it).
    index: u32,
    small: PoolId,
    large: PoolId,
    /// Open captures and graphs holding the pool; freeable at 0.
    use_count: u32,
    segments: usize,
    allocated: usize,
    /// Grows by plain segments whatever the device's mode (Note [Pools
    /// served by another allocator] in `segment_source.rs`).
    plain: bool,
    /// Where those segments come from; `None`: the backend (a replay).
    source: Option<Box<dyn SegmentSource>>,
    /// `MemPool(use_on_oom=True)`: its free blocks serve a default-pool
    /// request that would fail otherwise (Note [MemPool options]).
    use_on_oom: bool,
    /// `MemPool(no_split=True)`: its blocks are never split.
    no_split: bool,
}

/// How a new private pool gets its segments.
pub enum Serving {
    /// As the device's mode says.
    Own,
    /// Plain segments from the backend (a replay of a pool served by
    /// another allocator).
    Plain,
    /// Plain segments from another allocator.
    From(Box<dyn SegmentSource>),
}

struct Scope {
    key: PoolKey,
    filter: Option<StreamFilter>,
}

/// The private pools of one device and the open allocation scopes.
#[derive(Default)]
pub(crate) struct PrivatePools {
    pools: Vec<PrivatePool>,
    scopes: Vec<Scope>,
    next_index: u32,
    vacant_ids: Vec<PoolId>,
    /// While tracing: the numbers trace records give checkpoints, by a
    /// 64-bit hash of their content, so a restore names the checkpoint it
    /// puts back (Note [Pool checkpoints]; a collision, about one in 2^64
    /// per pair, would name another checkpoint).
    checkpoints: rustc_hash::FxHashMap<u64, u64>,
    next_checkpoint: u64,
    /// The capture followed through the driver, if one is open (Note
    /// [Capture without a pool]).
    followed: Option<Followed>,
    /// Captures followed so far (the next one's pool key).
    followed_count: u64,
    /// Set once a caller that cannot announce captures allocated: frees
    /// and `empty_cache` then ask the driver too.
    following: bool,
    /// The `(small, large)` ids of [`PLAIN_REQUESTS_POOL`] once created
    /// (never erased): asked at every request while the switch is off.
    plain_requests: Option<(PoolId, PoolId)>,
}

/// The first half of the pool keys of captures followed through the
/// driver; PyTorch's graph and MemPool ids never reach it.
pub const FOLLOWED_POOL: u64 = u64::MAX;

/// The key of the pool that serves requests outside private pools while
/// PyTorch's `expandable_segments` is off (Note [PyTorch's
/// expandable_segments switch] in `plain_requests.rs`); neither PyTorch's
/// ids nor followed captures reach it.
pub const PLAIN_REQUESTS_POOL: PoolKey = (u64::MAX - 1, u64::MAX - 1);

/// A capture followed through the driver.
struct Followed {
    key: PoolKey,
    /// The stream it was first seen on, and the driver's id of the capture.
    stream: StreamId,
    id: u64,
}

/// Checkpoints numbered at most, while tracing; older numbers are
/// forgotten past it (a restore of one then replays approximately).
const NUMBERED_CHECKPOINTS: usize = 4096;

impl PrivatePools {
    /// The number of a checkpoint whose content hashes to `hash`, given
    /// now if it has none.
    pub fn number_checkpoint(&mut self, hash: u64) -> u64 {
        if self.checkpoints.len() >= NUMBERED_CHECKPOINTS && !self.checkpoints.contains_key(&hash) {
            self.checkpoints.clear();
        }
        let next = &mut self.next_checkpoint;
        *self.checkpoints.entry(hash).or_insert_with(|| {
            *next += 1;
            *next - 1
        })
    }

    /// Forgets every number (a new trace knows none of them).
    pub fn forget_checkpoint_numbers(&mut self) {
        self.checkpoints.clear();
    }

    /// The number of the checkpoint whose content hashes to `hash`, if one
    /// was numbered.
    pub fn checkpoint_number(&self, hash: u64) -> Option<u64> {
        self.checkpoints.get(&hash).copied()
    }

    /// Whether captures are followed through the driver on this device.
    pub fn following(&self) -> bool {
        self.following
    }

    /// From now on, captures are followed through the driver.
    pub fn start_following(&mut self) {
        self.following = true;
    }

    /// The capture followed through the driver, if open: its pool, the
    /// stream it was first seen on and the driver's id of it.
    pub fn followed(&self) -> Option<(PoolKey, StreamId, u64)> {
        self.followed.as_ref().map(|f| (f.key, f.stream, f.id))
    }

    /// Starts following capture `id`, first seen on `stream`; returns its
    /// pool's key.
    pub fn follow(&mut self, stream: StreamId, id: u64) -> PoolKey {
        let key = (FOLLOWED_POOL, self.followed_count);
        self.followed_count += 1;
        self.followed = Some(Followed { key, stream, id });
        key
    }

    /// The followed capture ended.
    pub fn unfollow(&mut self) {
        self.followed = None;
    }

    /// Opens a scope for pool `key` (the caller also takes a hold on the
    /// pool with [`incref`](Self::incref)).
    pub fn push_scope(&mut self, key: PoolKey, filter: Option<StreamFilter>) {
        self.scopes.push(Scope { key, filter });
    }

    /// Takes a hold on pool `key`, creating it if absent; a new pool gets its
    /// `(small, large)` ids from `ids` (called only then). Returns the new
    /// pool's ids, or `None` when the pool existed.
    /// `serving` says how a new pool gets its segments; an existing pool
    /// keeps its own (the caller refuses another allocator for it first),
    /// but for one asked plain before it has a segment.
    pub fn incref(
        &mut self,
        key: PoolKey,
        serving: Serving,
        ids: impl FnMut(Option<PoolId>) -> PoolId,
    ) -> Option<(PoolId, PoolId)> {
        if let Some(p) = self.pools.iter_mut().find(|p| p.key == key) {
            p.use_count += 1;
            // Asked plain (PyTorch's expandable_segments off) before its
            // first segment: plain from now on, as `set_no_split` makes it.
            if matches!(serving, Serving::Plain) && p.segments == 0 {
                p.plain = true;
            }
            return None;
        }
        let (plain, source) = match serving {
            Serving::Own => (false, None),
            Serving::Plain => (true, None),
            Serving::From(s) => (true, Some(s)),
        };
        let created = self.create(key, self.next_index, 1, plain, source, ids);
        self.next_index += 1;
        Some(created)
    }

    /// A new pool `key`, its `(small, large)` ids from `ids`.
    fn create(
        &mut self,
        key: PoolKey,
        index: u32,
        use_count: u32,
        plain: bool,
        source: Option<Box<dyn SegmentSource>>,
        mut ids: impl FnMut(Option<PoolId>) -> PoolId,
    ) -> (PoolId, PoolId) {
        let small = ids(self.vacant_ids.pop());
        let large = ids(self.vacant_ids.pop());
        self.pools.push(PrivatePool {
            key,
            index,
            small,
            large,
            use_count,
            segments: 0,
            allocated: 0,
            plain,
            source,
            use_on_oom: false,
            no_split: false,
        });
        (small, large)
    }

    /// The `(small, large)` ids of [`PLAIN_REQUESTS_POOL`], and whether it
    /// was created now (unheld, plain, with no index: the trace and the
    /// observer tell its segments as the default pools'; never erased); a
    /// new pool gets its ids from `ids`.
    pub fn plain_requests_pools(
        &mut self,
        ids: impl FnMut(Option<PoolId>) -> PoolId,
    ) -> (PoolId, PoolId, bool) {
        if let Some((small, large)) = self.plain_requests {
            return (small, large, false);
        }
        let (small, large) = self.create(PLAIN_REQUESTS_POOL, u32::MAX, 0, true, None, ids);
        self.plain_requests = Some((small, large));
        (small, large, true)
    }

    /// The `(small, large)` ids of [`PLAIN_REQUESTS_POOL`], if created.
    pub fn plain_requests_ids(&self) -> Option<(PoolId, PoolId)> {
        self.plain_requests
    }

    /// Pool `key`'s `(small, large)` ids and use count, if it exists.
    pub fn find(&self, key: PoolKey) -> Option<(PoolId, PoolId, u32)> {
        self.pools
            .iter()
            .find(|p| p.key == key)
            .map(|p| (p.small, p.large, p.use_count))
    }

    /// Whether `pool` grows by plain segments whatever the device's mode.
    #[inline]
    pub fn plain(&self, pool: PoolId) -> bool {
        pool > STITCH && self.owner(pool).is_some_and(|p| p.plain)
    }

    /// Sets `MemPool(use_on_oom=...)` of pool `key`.
    pub fn set_use_on_oom(&mut self, key: PoolKey, on: bool) -> Result<(), AllocError> {
        let p = self.find_mut(key)?;
        p.use_on_oom = on;
        Ok(())
    }

    /// Sets `MemPool(no_split=True)` of pool `key`; one with no segment yet
    /// grows by plain segments from now on, whose blocks are whole. One
    /// that already holds expandable segments (torch sets the option as it
    /// creates the pool, so only a direct caller of the C ABI gets here)
    /// keeps them, and a request then takes a whole free run, all of it, as
    /// PyTorch's `no_split` takes a whole segment.
    pub fn set_no_split(&mut self, key: PoolKey) -> Result<(), AllocError> {
        let p = self.find_mut(key)?;
        p.no_split = true;
        p.plain |= p.segments == 0;
        Ok(())
    }

    fn find_mut(&mut self, key: PoolKey) -> Result<&mut PrivatePool, AllocError> {
        self.pools
            .iter_mut()
            .find(|p| p.key == key)
            .ok_or(AllocError::UnknownPool { pool: key })
    }

    /// Whether `pool`'s blocks are never split.
    #[inline]
    pub fn no_split(&self, pool: PoolId) -> bool {
        pool > STITCH && self.owner(pool).is_some_and(|p| p.no_split)
    }

    /// The held pools of `MemPool(use_on_oom=True)`, in creation order: the
    /// ids of their sub-pools of `kind`.
    pub fn use_on_oom(&self, kind: PoolKind) -> Vec<PoolId> {
        self.pools
            .iter()
            .filter(|p| p.use_on_oom && p.use_count > 0)
            .map(|p| match kind {
                PoolKind::Small => p.small,
                PoolKind::Large => p.large,
            })
            .collect()
    }

    /// The other allocator serving `pool`, if one does.
    pub fn source_mut(&mut self, pool: PoolId) -> Option<&mut (dyn SegmentSource + 'static)> {
        self.owner_mut(pool)?.source.as_deref_mut()
    }

    /// Whether a scope of pool `key` is open.
    pub fn scope_open(&self, key: PoolKey) -> bool {
        self.scopes.iter().any(|s| s.key == key)
    }

    /// Closes the innermost scope of pool `key`.
    pub fn close(&mut self, key: PoolKey) -> Result<(), AllocError> {
        let pos = self
            .scopes
            .iter()
            .rposition(|s| s.key == key)
            .ok_or(AllocError::UnknownPool { pool: key })?;
        self.scopes.remove(pos);
        Ok(())
    }

    /// Drops one hold on pool `key`; returns its `(small, large)` ids when
    /// nothing holds it any more.
    pub fn release(&mut self, key: PoolKey) -> Result<Option<(PoolId, PoolId)>, AllocError> {
        let p = self
            .pools
            .iter_mut()
            .find(|p| p.key == key && p.use_count > 0)
            .ok_or(AllocError::UnknownPool { pool: key })?;
        p.use_count -= 1;
        Ok((p.use_count == 0).then_some((p.small, p.large)))
    }

    /// Whether any allocation scope (a capture) is open.
    #[inline]
    pub fn capturing(&self) -> bool {
        !self.scopes.is_empty()
    }

    #[inline]
    pub fn pool_for(&self, stream: StreamId, kind: PoolKind) -> Option<PoolId> {
        if self.scopes.is_empty() {
            return None;
        }
        let scope = self
            .scopes
            .iter()
            .rev()
            .find(|s| s.filter.as_ref().is_none_or(|f| f(stream)))?;
        let p = self.pools.iter().find(|p| p.key == scope.key)?;
        Some(match kind {
            PoolKind::Small => p.small,
            PoolKind::Large => p.large,
        })
    }

    /// The private pool that owns `pool` (never a default pool).
    #[inline]
    fn owner_mut(&mut self, pool: PoolId) -> Option<&mut PrivatePool> {
        if pool <= STITCH {
            return None;
        }
        self.pools
            .iter_mut()
            .find(|p| p.small == pool || p.large == pool)
    }

    /// The private pool that owns `pool` (never a default pool).
    #[inline]
    fn owner(&self, pool: PoolId) -> Option<&PrivatePool> {
        if pool <= STITCH {
            return None;
        }
        self.pools
            .iter()
            .find(|p| p.small == pool || p.large == pool)
    }

    /// The creation order of the private pool that owns `pool` (none for
    /// the default pools and [`PLAIN_REQUESTS_POOL`]).
    pub fn index_of(&self, pool: PoolId) -> Option<u32> {
        self.owner(pool)
            .filter(|p| p.key != PLAIN_REQUESTS_POOL)
            .map(|p| p.index)
    }

    #[inline]
    pub fn segment_added(&mut self, pool: PoolId) {
        if let Some(p) = self.owner_mut(pool) {
            p.segments += 1;
        }
    }

    #[inline]
    pub fn segment_removed(&mut self, pool: PoolId) {
        if let Some(p) = self.owner_mut(pool) {
            p.segments -= 1;
        }
    }

    #[inline]
    pub fn block_allocated(&mut self, pool: PoolId) {
        if let Some(p) = self.owner_mut(pool) {
            p.allocated += 1;
        }
    }

    #[inline]
    pub fn block_freed(&mut self, pool: PoolId) {
        if let Some(p) = self.owner_mut(pool) {
            p.allocated -= 1;
        }
    }

    /// Pools of private pools that nothing holds any more.
    pub fn freeable_pools(&self) -> Vec<PoolId> {
        self.pools
            .iter()
            .filter(|p| p.use_count == 0)
            .flat_map(|p| [p.small, p.large])
            .collect()
    }

    /// Forgets released private pools that hold no segment.
    /// A source goes with its pool (its drop may call the other allocator).
    pub fn erase_empty(&mut self) {
        let vacant = &mut self.vacant_ids;
        let pools = &mut self.pools;
        crate::segment_source::calling_source(|| {
            pools.retain(|p| {
                // The plain-request pool stays: a request that made the
                // cache go may still grow it.
                let keep = p.use_count > 0 || p.segments > 0 || p.key == PLAIN_REQUESTS_POOL;
                if !keep {
                    vacant.extend([p.small, p.large]);
                }
                keep
            });
        });
    }

    /// Private pools alive: `(id, use count, segments, live allocations)`.
    pub fn list(&self) -> Vec<(PoolKey, u32, usize, usize)> {
        self.pools
            .iter()
            .filter(|p| p.key != PLAIN_REQUESTS_POOL)
            .map(|p| (p.key, p.use_count, p.segments, p.allocated))
            .collect()
    }
}
