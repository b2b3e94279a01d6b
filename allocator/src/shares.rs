//! The live blocks shared with other processes and the physical handles
//! each was shared through (Note [Sharing expandable memory] in `ipc.rs`).
//!
//! A handle exported once stays exported (its descriptor open) until it is
//! released, but only the live blocks shared through it pin its memory to
//! its address: a receiver maps the handle and uses that block's bytes.
//! Once such a block is freed, its receivers let go of it (PyTorch keeps a
//! shared storage alive until every receiver did), and its handles may get
//! new memory for the next block shared over them.

use rustc_hash::FxHashMap;

use crate::backend::{DevicePtr, HandleId};

/// The handles each live shared block was shared through.
#[derive(Default)]
pub(crate) struct Shares {
    /// Live shared block -> the handles under it when it was shared.
    by_block: FxHashMap<DevicePtr, Vec<HandleId>>,
    /// Handle -> how many live shared blocks it is under.
    holders: FxHashMap<HandleId, u32>,
}

impl Shares {
    /// Block `ptr` was shared through `handles` (again: the latest share's
    /// handles count).
    pub fn shared(&mut self, ptr: DevicePtr, handles: Vec<HandleId>) {
        self.freed(ptr);
        for &h in &handles {
            *self.holders.entry(h).or_default() += 1;
        }
        self.by_block.insert(ptr, handles);
    }

    /// Block `ptr` was freed: its handles no longer pin it.
    #[inline]
    pub fn freed(&mut self, ptr: DevicePtr) {
        if self.by_block.is_empty() {
            return;
        }
        for h in self.by_block.remove(&ptr).into_iter().flatten() {
            if let Some(n) = self.holders.get_mut(&h) {
                *n -= 1;
                if *n == 0 {
                    self.holders.remove(&h);
                }
            }
        }
    }

    /// Whether a live shared block was shared through `handle`.
    pub fn pins(&self, handle: HandleId) -> bool {
        self.holders.contains_key(&handle)
    }

    /// The live shared blocks (for the invariant check).
    pub fn blocks(&self) -> impl Iterator<Item = DevicePtr> + '_ {
        self.by_block.keys().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::Shares;

    #[test]
    fn a_handle_is_pinned_while_a_block_shared_through_it_lives() {
        let mut s = Shares::default();
        s.shared(0x1000, vec![1, 2]);
        s.shared(0x9000, vec![2, 3]);
        assert!(s.pins(1) && s.pins(2) && s.pins(3));
        s.freed(0x1000);
        assert!(!s.pins(1) && s.pins(2) && s.pins(3));
        // Shared again through other handles: only those count.
        s.shared(0x9000, vec![4]);
        assert!(!s.pins(2) && !s.pins(3) && s.pins(4));
        s.freed(0x9000);
        s.freed(0x5555);
        assert!(!s.pins(4) && s.blocks().next().is_none());
    }
}
