//! Where reserved memory sat, stream by stream, when it peaked.
//!
//! PyTorch's caching allocator, and gpualloc's, keep freed memory for the
//! stream that used it: a block freed on an all-gather or prefetch stream
//! serves that stream's next requests, not the default stream's. A program
//! with side streams can therefore reserve far more than it allocates at
//! any moment while each stream's cache looks tidy. The summary shows, at
//! the peak of reserved memory, each stream's reserved bytes (the ranges
//! reserved or mapped for it) and the bytes allocated on it, and the
//! physical memory held unmapped (gpualloc's page pool).

use crate::analyses::state::DeviceState;
use crate::units::bytes;

/// Streams listed by name in the text; the rest are summed.
const SHOWN: usize = 4;

/// One stream's share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamShare {
    /// The stream as recorded (0: the default stream).
    pub stream: u64,
    /// Reserved (mapped) bytes of ranges held for the stream.
    pub reserved: u64,
    /// Bytes of live blocks allocated on the stream.
    pub allocated: u64,
}

/// Every stream's share at one moment, most reserved first, and the
/// reserved bytes no range holds (pooled physical memory).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamShares {
    /// Per stream, most reserved first (ties: lower stream first).
    pub streams: Vec<StreamShare>,
    /// Reserved bytes outside every range.
    pub unmapped: u64,
}

/// The shares of `s`. Stitched ranges map pages counted in their home
/// ranges and are left out; blocks freed but waiting on events count as
/// free.
pub fn shares(s: &DeviceState) -> StreamShares {
    let mut by: std::collections::BTreeMap<u64, (u64, u64)> = Default::default();
    for r in s.regions.values() {
        by.entry(r.stream).or_default().0 += r.size;
    }
    for l in s.live.values().filter(|l| !l.pending) {
        by.entry(l.stream).or_default().1 += l.size;
    }
    let mut streams: Vec<StreamShare> = by
        .into_iter()
        .map(|(stream, (reserved, allocated))| StreamShare {
            stream,
            reserved,
            allocated,
        })
        .collect();
    streams.sort_by_key(|x| (std::cmp::Reverse(x.reserved), x.stream));
    StreamShares {
        streams,
        unmapped: s.outside_ranges(),
    }
}

impl StreamShares {
    /// One line for the summary, or `None` with fewer than two streams.
    pub fn describe(&self) -> Option<String> {
        if self.streams.len() < 2 {
            return None;
        }
        let name = |x: &StreamShare| {
            if x.stream == 0 {
                "default".to_string()
            } else {
                format!("{:#x}", x.stream)
            }
        };
        let mut parts: Vec<String> = self
            .streams
            .iter()
            .take(SHOWN)
            .map(|x| {
                format!(
                    "{} {} ({} allocated)",
                    name(x),
                    bytes(x.reserved),
                    bytes(x.allocated)
                )
            })
            .collect();
        let rest = &self.streams[self.streams.len().min(SHOWN)..];
        if !rest.is_empty() {
            let (r, a) = rest
                .iter()
                .fold((0, 0), |acc, x| (acc.0 + x.reserved, acc.1 + x.allocated));
            parts.push(format!(
                "{} more {} ({} allocated)",
                rest.len(),
                bytes(r),
                bytes(a)
            ));
        }
        if self.unmapped > 0 {
            parts.push(format!("unmapped {}", bytes(self.unmapped)));
        }
        Some(format!(
            "{} streams at peak reserved: {}",
            self.streams.len(),
            parts.join(", ")
        ))
    }
}
