//! Private pools for CUDA graph capture.
//!
//! While a graph is captured, every allocation made on a capturing stream
//! must come from a pool private to that graph: replays reuse the exact
//! addresses, so nothing else may receive them until PyTorch releases the
//! pool. PyTorch brackets a capture with `begin_allocate_to_pool(id, filter)`
//! and `end_allocate_to_pool(id)`, and calls `release_pool(id)` when the graph
//! is destroyed. Scopes nest; the innermost one whose filter accepts the
//! stream decides the pool.
//!
//! While any scope is open the allocator is "capturing": it queries no event
//! (illegal during capture), releases nothing to the backend, and asks the
//! backend for new segments only with the `capturing` flag (relaxed capture
//! mode on CUDA). Frees of blocks used on other streams are deferred until the
//! capture ends.
//!
//! Note [Private pools]
//! With expandable segments (the default policy) a private pool maps pages
//! into reservations of its own, per stream, like the default pools, and
//! takes handles from the page pool first: memory another pool gave back
//! serves the graph without `cuMemCreate`. Its pages never move while the
//! pool is held: a graph's replays reuse its addresses, including those of
//! blocks freed during the capture, so defragmentation and stitching take
//! pages of the default pools only, and a pool's requests (made while a
//! scope is open, when no event may be queried) never defragment. Once
//! released, a graph may still be running on any stream, and no stream's
//! event orders it, so unmapping its free pages waits for the whole device
//! (`cuCtxSynchronize`, the one device-wide wait outside the out-of-memory
//! path; PyTorch's `cudaFree` of the pool's segments waits the same way).
//! The pages go to the page pool; blocks still alive return at the next
//! `empty_cache`. Fences are not recorded during a capture (the event
//! would belong to the graph).

use crate::backend::{Backend, StreamId};
use crate::block::PoolId;
use crate::device::{DeviceAllocator, STITCH};
use crate::error::AllocError;
use crate::pool::{Pool, PoolKey};
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
}

impl PrivatePools {
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

    fn owner_mut(&mut self, pool: PoolId) -> Option<&mut PrivatePool> {
        self.pools
            .iter_mut()
            .find(|p| p.small == pool || p.large == pool)
    }

    pub fn index_of(&self, pool: PoolId) -> Option<u32> {
        if pool <= STITCH {
            return None;
        }
        self.pools
            .iter()
            .find(|p| p.small == pool || p.large == pool)
            .map(|p| p.index)
    }

    #[inline]
    pub fn segment_added(&mut self, pool: PoolId) {
        if pool > STITCH
            && let Some(p) = self.owner_mut(pool)
        {
            p.segments += 1;
        }
    }

    #[inline]
    pub fn segment_removed(&mut self, pool: PoolId) {
        if pool > STITCH
            && let Some(p) = self.owner_mut(pool)
        {
            p.segments -= 1;
        }
    }

    #[inline]
    pub fn block_allocated(&mut self, pool: PoolId) {
        if pool > STITCH
            && let Some(p) = self.owner_mut(pool)
        {
            p.allocated += 1;
        }
    }

    #[inline]
    pub fn block_freed(&mut self, pool: PoolId) {
        if pool > STITCH
            && let Some(p) = self.owner_mut(pool)
        {
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
    pub fn erase_empty(&mut self) {
        let vacant = &mut self.vacant_ids;
        self.pools.retain(|p| {
            let keep = p.use_count > 0 || p.segments > 0;
            if !keep {
                vacant.extend([p.small, p.large]);
            }
            keep
        });
    }

    /// Private pools alive: `(id, use count, segments, live allocations)`.
    pub fn list(&self) -> Vec<(PoolKey, u32, usize, usize)> {
        self.pools
            .iter()
            .map(|p| (p.key, p.use_count, p.segments, p.allocated))
            .collect()
    }
}

impl<B: Backend> DeviceAllocator<B> {
    /// Opens an allocation scope: until [`end_allocate_to_pool`](Self::end_allocate_to_pool),
    /// allocations on streams that `filter` accepts (every stream when `None`)
    /// come from private pool `key`, created on first use.
    pub fn begin_allocate_to_pool(&mut self, key: PoolKey, filter: Option<StreamFilter>) {
        if let Some(p) = self.private.pools.iter_mut().find(|p| p.key == key) {
            p.use_count += 1;
        } else {
            let mut id = || {
                self.private.vacant_ids.pop().unwrap_or_else(|| {
                    self.pools.push(Pool::new(PoolKind::Small, None));
                    (self.pools.len() - 1) as PoolId
                })
            };
            let (small, large) = (id(), id());
            self.pools[small as usize] = Pool::new(PoolKind::Small, Some(key));
            self.pools[large as usize] = Pool::new(PoolKind::Large, Some(key));
            let index = self.private.next_index;
            self.private.next_index += 1;
            self.private.pools.push(PrivatePool {
                key,
                index,
                small,
                large,
                use_count: 1,
                segments: 0,
                allocated: 0,
            });
        }
        self.private.scopes.push(Scope { key, filter });
    }

    /// Closes the innermost scope of pool `key`.
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`] when no scope of that pool is open.
    pub fn end_allocate_to_pool(&mut self, key: PoolKey) -> Result<(), AllocError> {
        let pos = self
            .private
            .scopes
            .iter()
            .rposition(|s| s.key == key)
            .ok_or(AllocError::UnknownPool { pool: key })?;
        self.private.scopes.remove(pos);
        Ok(())
    }

    /// Drops one hold on pool `key` (a graph was destroyed). At zero holds its
    /// cached segments go back to the backend (now when no capture is open,
    /// else at the next `empty_cache`), and blocks still allocated return
    /// there when freed.
    ///
    /// # Errors
    /// [`AllocError::UnknownPool`] for a pool that does not exist.
    pub fn release_pool(&mut self, key: PoolKey) -> Result<(), AllocError> {
        let p = self
            .private
            .pools
            .iter_mut()
            .find(|p| p.key == key && p.use_count > 0)
            .ok_or(AllocError::UnknownPool { pool: key })?;
        p.use_count -= 1;
        let (freeable, small, large) = (p.use_count == 0, p.small, p.large);
        if freeable && !self.private.capturing() {
            for pool in [small, large] {
                let whole: Vec<_> = self.pools[pool as usize]
                    .iter()
                    .filter(|k| self.is_whole_segment(k.3))
                    .map(|k| k.3)
                    .collect();
                for id in whole {
                    self.release_segment(id)?;
                }
            }
            if self.expandable {
                self.unmap_released_pools(&[small, large])?;
            }
            self.private.erase_empty();
        }
        Ok(())
    }

    /// Private pools alive: `(id, use count, segments, live allocations)`.
    pub fn private_pools(&self) -> Vec<(PoolKey, u32, usize, usize)> {
        self.private.list()
    }
}
