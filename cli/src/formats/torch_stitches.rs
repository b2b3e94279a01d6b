//! A stitch's life in a snapshot: where its range was built and torn down.
//!
//! In a trace that says what is listed (Note [Listed ranges] in
//! `allocator/src/trace/event.rs`), `export --torch-snapshot` writes a
//! stitch into `device_traces` only while it is in use, as the live
//! snapshot lists it. Its build and teardown, which replays count (a build
//! maps memory, a cached stitch taken again does not), go to the top-level
//! key `gpualloc_stitch_ranges`, which PyTorch's tools ignore: one entry
//! each, `{action: "segment_map" | "segment_unmap", device, addr, size,
//! stream, time_us, gpualloc_position}`, the position being the number of
//! the device's `device_traces` entries before it, as for phases and marks
//! (`torch_annotations.rs`). The import puts each back at its position.

use gpualloc::trace::{EventKind, Pool, TraceEvent};

use crate::formats::pickle::Pickler;
use crate::formats::unpickle::Value;

/// The top-level key of the stitches' builds and teardowns.
pub const KEY: &str = "gpualloc_stitch_ranges";

/// At most this many are written, so that a trace of millions of stitch
/// builds cannot exhaust memory; the export says how many were left out.
pub const MAX: usize = 4_000_000;

/// A stitch's range built (`mapped`) or torn down, on `device`, after
/// `position` of its entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StitchRange {
    pub device: u32,
    pub mapped: bool,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    pub position: u64,
}

/// Writes `ranges` under [`KEY`].
pub fn write<W: std::io::Write>(p: &mut Pickler<W>, ranges: &[StitchRange]) -> std::io::Result<()> {
    p.str(KEY)?;
    p.list()?;
    for r in ranges {
        p.dict()?;
        p.kv_str(
            "action",
            if r.mapped {
                "segment_map"
            } else {
                "segment_unmap"
            },
        )?;
        p.kv_int("device", u64::from(r.device))?;
        p.kv_int("addr", r.addr)?;
        p.kv_int("size", r.size)?;
        p.kv_int("stream", r.stream)?;
        p.kv_int("time_us", r.time_us)?;
        p.kv_int("gpualloc_position", r.position)?;
        p.end()?;
    }
    p.end()
}

/// The builds and teardowns of `device`'s stitches, as trace events (times
/// since `t0_us`) with the number of entries each goes after, in order;
/// `None` when the snapshot has no [`KEY`] (PyTorch wrote it, or an export
/// of a trace that does not list). Entries without an address, a size or
/// a position are left out.
pub fn for_device(root: &Value, device: i64, t0_us: u64) -> Option<Vec<(u64, TraceEvent)>> {
    let list = root.get(KEY)?.items();
    let mut out = Vec::new();
    for r in list {
        let int = |k: &str| r.get(k).and_then(|v| v.as_int());
        if int("device").unwrap_or(0) != device {
            continue;
        }
        let (Some(addr), Some(size), Some(position)) =
            (int("addr"), int("size"), int("gpualloc_position"))
        else {
            continue;
        };
        let (addr, size, position) = (
            addr.max(0) as u64,
            size.max(0) as u64,
            position.max(0) as u64,
        );
        let kind = match r
            .get("action")
            .and_then(|a| a.as_str().map(String::from))
            .as_deref()
        {
            Some("segment_map") => EventKind::SegmentMap {
                addr,
                size,
                pool: Pool::Stitch,
            },
            Some("segment_unmap") => EventKind::SegmentUnmap {
                addr,
                size,
                pool: Pool::Stitch,
            },
            _ => continue,
        };
        let time_ns = (int("time_us").unwrap_or(0).max(0) as u64)
            .saturating_sub(t0_us)
            .saturating_mul(1000);
        let stream = int("stream").unwrap_or(0).max(0) as u64;
        out.push((
            position,
            TraceEvent::from_kind(time_ns, device as u32, stream, 0, kind),
        ));
    }
    out.sort_by_key(|&(position, _)| position);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::unpickle;

    #[test]
    fn builds_and_teardowns_come_back_in_order_per_device() {
        let ranges = [
            StitchRange {
                device: 0,
                mapped: true,
                addr: 1 << 40,
                size: 64 << 20,
                stream: 7,
                time_us: 1_000_010,
                position: 5,
            },
            StitchRange {
                device: 1,
                mapped: true,
                addr: 2 << 40,
                size: 2 << 20,
                stream: 0,
                time_us: 1_000_020,
                position: 0,
            },
            StitchRange {
                device: 0,
                mapped: false,
                addr: 1 << 40,
                size: 64 << 20,
                stream: 7,
                time_us: 1_000_030,
                position: 9,
            },
        ];
        let mut buf = Vec::new();
        let mut p = Pickler::new(&mut buf).unwrap();
        p.dict().unwrap();
        write(&mut p, &ranges).unwrap();
        p.end().unwrap();
        p.finish().unwrap();
        let root = unpickle::loads(&buf).unwrap();
        let got = for_device(&root, 0, 1_000_000).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0, 5);
        assert_eq!(
            got[0].1.kind(),
            EventKind::SegmentMap {
                addr: 1 << 40,
                size: 64 << 20,
                pool: Pool::Stitch
            }
        );
        assert_eq!((got[0].1.stream, got[0].1.time_ns), (7, 10_000));
        assert_eq!(got[1].0, 9);
        assert!(matches!(got[1].1.kind(), EventKind::SegmentUnmap { .. }));
        assert_eq!(for_device(&root, 1, 0).unwrap().len(), 1);
        let empty = unpickle::loads(&{
            let mut b = Vec::new();
            let mut p = Pickler::new(&mut b).unwrap();
            p.dict().unwrap();
            p.end().unwrap();
            p.finish().unwrap();
            b
        })
        .unwrap();
        assert_eq!(for_device(&empty, 0, 0), None, "no key: PyTorch's snapshot");
    }
}
