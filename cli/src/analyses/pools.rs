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
//!
//! Limits: a trace imported from a PyTorch snapshot records every page
//! mapped during it in the large pool (the snapshot's events name no
//! pool), so small pages mapped then count there; and where the ranges
//! add up to more than the reserved gauge (events dropped, or a trace
//! begun while memory was already mapped), `unmapped` is 0 and the pools
//! add up to more than reserved memory.

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
/// holds it (a stitched range's blocks in the large pool, as stitches
/// serve only it), or, in no range the trace showed, in the pool its size
/// goes to; blocks freed but waiting on events count as free, as in the
/// allocated gauge. `None` for a trace without reserved memory (an RMM
/// log), where no pool holds anything that could be told.
pub fn shares(s: &DeviceState) -> Option<PoolShares> {
    if !s.reserves {
        return None;
    }
    let mut out = PoolShares::default();
    for r in s.regions.values() {
        slot(&mut out, r.pool).reserved += r.size;
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
    out.unmapped = s.outside_ranges();
    Some(out)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyses::state::{Live, Region};

    const MIB: u64 = 1 << 20;

    fn live(size: u64, pending: bool) -> Live {
        Live {
            size,
            requested: size,
            stream: 0,
            phase: 0,
            time_ns: 0,
            pending,
        }
    }

    fn region(size: u64, pool: u64) -> Region {
        Region {
            size,
            stream: 0,
            pool,
            expandable: true,
            synthetic: false,
        }
    }

    /// Each block counts in the pool of the range holding it, a stitched
    /// range's in the large pool, one outside every range by its size; a
    /// pending free counts nowhere; pooled bytes are what no range holds.
    #[test]
    fn blocks_count_in_the_pool_of_their_range() {
        let mut s = DeviceState::default();
        let (small, large, private, stitch) = (1 << 30, 2 << 30, 3 << 30, 4 << 30);
        s.regions.insert(small, region(4 * MIB, 0));
        s.regions.insert(large, region(64 * MIB, 1));
        s.regions.insert(private, region(8 * MIB, 3));
        s.aliases.insert(stitch, 32 * MIB);
        s.g.reserved = 80 * MIB;
        s.reserves = true;
        for (addr, size, pending) in [
            (small, 512 << 10, false),
            (small + MIB, 512 << 10, true),
            // A large block in a small range counts in the small pool.
            (small + 2 * MIB, 2 * MIB, false),
            (large, 16 * MIB, false),
            (private, 4 * MIB, false),
            (stitch + MIB, 24 * MIB, false),
            // Outside every range: by size.
            (5 << 30, 256 << 10, false),
            (6 << 30, 3 * MIB, false),
            // Just past the small range's end: by size too.
            (small + 4 * MIB, 2 * MIB, false),
        ] {
            s.live.insert(addr, live(size, pending));
        }
        let x = shares(&s).expect("reserved memory");
        let share = |reserved, allocated| PoolShare {
            reserved,
            allocated,
        };
        assert_eq!(x.small, share(4 * MIB, (512 << 10) + 2 * MIB + (256 << 10)));
        assert_eq!(
            x.large,
            share(64 * MIB, 16 * MIB + 24 * MIB + 3 * MIB + 2 * MIB)
        );
        assert_eq!(x.private, share(8 * MIB, 4 * MIB));
        assert_eq!(x.unmapped, 4 * MIB);
        assert_eq!(
            x.describe(),
            "pools at peak reserved: small 4.00 MiB (2.75 MiB allocated), \
             large 64.00 MiB (45.00 MiB allocated), private 8.00 MiB (4.00 MiB allocated), \
             unmapped 4.00 MiB"
        );
        // Ranges over the gauge: nothing unmapped.
        s.g.reserved = 60 * MIB;
        assert_eq!(shares(&s).unwrap().unmapped, 0);
        // No reserved memory in the trace: no shares.
        s.reserves = false;
        assert_eq!(shares(&s), None);
    }
}
