//! Where reserved memory sat, pool by pool, when it peaked.
//!
//! Requests of up to 1 MiB are served from a small pool of 2 MiB pages
//! (PyTorch's rule, and gpualloc's), the rest from the large pool, and a
//! CUDA graph's requests from private pools. A page of the small pool goes
//! back only once every block on it is free, so a few long-lived small
//! blocks (optimizer state of biases and norms, a step counter) can keep
//! the pages an earlier high of small requests mapped: at the peak of
//! reserved memory the small pool then holds several times its live bytes,
//! which defragmentation, moving only whole free pages, cannot take back
//! (`docs/policy-experiments.md`, thirty-fifth study). The summary shows,
//! at the peak of reserved memory, each pool's reserved bytes (the ranges
//! reserved or mapped for it) and the bytes allocated in it, and the
//! physical memory held unmapped (gpualloc's page pool).

use crate::analyses::state::DeviceState;
use crate::units::bytes;
use gpualloc::trace::STITCH_CODE;

/// Requests up to this size go to the small pool (PyTorch's `kSmallSize`):
/// where a live block lies in no range the trace showed, its size decides.
const SMALL_SIZE: u64 = 1 << 20;

/// One pool's share: reserved (mapped) bytes of its ranges and bytes of
/// its live blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolShare {
    /// Reserved bytes of the ranges held for the pool.
    pub reserved: u64,
    /// Bytes of live blocks in the pool.
    pub allocated: u64,
}

/// The default small and large pools' shares, the private pools' together,
/// and the reserved bytes no range holds (pooled physical memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolShares {
    /// The default small pool.
    pub small: PoolShare,
    /// The default large pool (blocks in stitched ranges included).
    pub large: PoolShare,
    /// Every private (CUDA graph) pool.
    pub private: PoolShare,
    /// Reserved bytes outside every range.
    pub unmapped: u64,
}

/// Which share a pool code (`trace::pool_code`) counts in.
fn slot(shares: &mut PoolShares, code: u64) -> &mut PoolShare {
    match code {
        0 => &mut shares.small,
        1 | STITCH_CODE => &mut shares.large,
        _ => &mut shares.private,
    }
}

/// The shares of `s`. A live block counts in the pool of the range that
/// holds it (a stitched range's blocks in the large pool); blocks freed
/// but waiting on events count as free, as in the allocated gauge.
pub fn shares(s: &DeviceState) -> PoolShares {
    let mut out = PoolShares::default();
    let mut in_ranges = 0u64;
    for r in s.regions.values() {
        slot(&mut out, r.pool).reserved += r.size;
        in_ranges = in_ranges.saturating_add(r.size);
    }
    for (&addr, l) in s.live.iter().filter(|(_, l)| !l.pending) {
        let code = if let Some((&start, r)) = s.regions.range(..=addr).next_back()
            && addr - start < r.size
        {
            r.pool
        } else if let Some((&start, &size)) = s.aliases.range(..=addr).next_back()
            && addr - start < size
        {
            STITCH_CODE
        } else if l.size <= SMALL_SIZE {
            0
        } else {
            1
        };
        slot(&mut out, code).allocated += l.size;
    }
    out.unmapped = s.g.reserved.saturating_sub(in_ranges);
    out
}

impl PoolShares {
    /// One line for the summary.
    pub fn describe(&self) -> String {
        let part = |name: &str, x: &PoolShare| {
            format!(
                "{name} {} ({} allocated)",
                bytes(x.reserved),
                bytes(x.allocated)
            )
        };
        let mut parts = vec![part("small", &self.small), part("large", &self.large)];
        if self.private != PoolShare::default() {
            parts.push(part("private", &self.private));
        }
        if self.unmapped > 0 {
            parts.push(format!("unmapped {}", bytes(self.unmapped)));
        }
        format!("pools at peak reserved: {}", parts.join(", "))
    }
}
