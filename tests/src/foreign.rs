//! Another allocator for the tests of pools it serves
//! (`torch.cuda.MemPool(allocator=...)`; Note [Pools served by another
//! allocator]): it hands out addresses of its own, far from the simulated
//! device's, within a capacity, and keeps a ledger the tests read.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use gpualloc::{BackendError, DevicePtr, SegmentSource, StreamId};

/// Where the other allocator's addresses start: clear of the simulated
/// device's plain (`0x7f00_…`) and virtual (`0x9f00_…`) ranges.
const BASE: DevicePtr = 0x5f00_0000_0000;

/// What the other allocator did.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Its segments still out: address -> (bytes, stream asked on).
    pub live: BTreeMap<DevicePtr, (u64, StreamId)>,
    /// Segments handed out, and given back.
    pub allocated: u64,
    /// Segments given back.
    pub released: u64,
    /// Requests refused for want of room.
    pub refused: u64,
    /// The most it hands out at once.
    pub capacity: u64,
    /// The source was dropped (the pool went).
    pub dropped: bool,
    next: DevicePtr,
}

impl Ledger {
    /// Bytes out.
    pub fn bytes(&self) -> u64 {
        self.live.values().map(|v| v.0).sum()
    }
}

/// A handle on the ledger; [`source`](Self::source) makes the
/// [`SegmentSource`] a pool is given.
#[derive(Clone, Debug)]
pub struct Foreign(Arc<Mutex<Ledger>>);

impl Foreign {
    /// Another allocator that hands out at most `capacity` bytes at once.
    pub fn new(capacity: u64) -> Foreign {
        Foreign(Arc::new(Mutex::new(Ledger {
            capacity,
            next: BASE,
            ..Ledger::default()
        })))
    }

    /// Its ledger.
    pub fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A source over this ledger, for one pool.
    pub fn source(&self) -> Box<dyn SegmentSource> {
        Box::new(Source(self.clone()))
    }
}

struct Source(Foreign);

impl SegmentSource for Source {
    fn name(&self) -> &str {
        "test allocator"
    }

    fn allocate(&mut self, size: u64, stream: StreamId) -> Result<DevicePtr, BackendError> {
        let mut l = self.0.ledger();
        if l.bytes() + size > l.capacity {
            l.refused += 1;
            return Err(BackendError::OutOfMemory { requested: size });
        }
        let ptr = l.next;
        l.next += size.next_multiple_of(2 << 20);
        l.live.insert(ptr, (size, stream));
        l.allocated += 1;
        Ok(ptr)
    }

    fn release(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        _stream: StreamId,
    ) -> Result<(), BackendError> {
        let mut l = self.0.ledger();
        match l.live.remove(&ptr) {
            Some((s, _)) if s == size => {
                l.released += 1;
                Ok(())
            }
            other => panic!("release of {ptr:#x} ({size} bytes), handed out as {other:?}"),
        }
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        self.0.ledger().dropped = true;
    }
}
