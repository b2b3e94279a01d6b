//! The memory a snapshot's trace began with, rebuilt as PyTorch's
//! MemoryViz rebuilds it: recording usually starts after the model is
//! loaded (or keeps only the last `max_entries` events), so what was
//! allocated before shows only in the final `segments`. Undoing the
//! device's trace, last entry first, from that final state leaves the
//! state at the trace's start: a block live at the end that no entry
//! allocated was live from the start, a block freed without an `alloc` was
//! live at the start; segments and mapped ranges likewise. The import
//! writes that state as segment and alloc events at the trace's start.
//!
//! What cannot be placed is counted, for the import to warn of: bytes the
//! trace leaves live or reserved at the end that the final segments do not
//! show, and blocks of the start that lie in no segment of the start.

use std::collections::BTreeMap;

use gpualloc::Config;
use gpualloc::size_class::round_size;
use gpualloc::trace::{EventKind, Pool, TraceEvent};

use crate::formats::export_torch::{LISTING_KEY, STITCH_KEY};
use crate::formats::unpickle::Value;

/// A live block: block bytes, requested bytes, stream.
type Block = (u64, u64, u64);
/// A range: bytes, stream, pool code.
type Range = (u64, u64, u64);

/// One device's state at the start of its trace.
#[derive(Default)]
pub struct Start {
    blocks: BTreeMap<u64, Block>,
    /// Plain segments.
    segments: BTreeMap<u64, Range>,
    /// Mapped pages of expandable segments, without overlaps.
    mapped: BTreeMap<u64, Range>,
    /// Stitched ranges (second mappings, not reserved memory).
    stitches: BTreeMap<u64, Range>,
    /// Home runs that stitches in use held (mapped, not listed; Note
    /// [Listed ranges]).
    held: BTreeMap<u64, Range>,
    /// The snapshot says what is listed: its stitches are listed ones.
    listing: bool,
    /// Bytes the trace leaves live or reserved at the end that the final
    /// segments do not show.
    pub disagree: u64,
}

/// The state of device `device` before the first of its `entries`, undone
/// from the snapshot's final `segments` (all devices'). Block sizes of
/// entries are rounded under `config`, as the import rounds them.
pub fn rebuild(entries: &[Value], segments: &[Value], device: i64, config: &Config) -> Start {
    let mut s = Start::default();
    for seg in segments {
        if seg.get("device").and_then(|d| d.as_int()).unwrap_or(0) == device {
            s.final_segment(seg);
        }
    }
    let round = |n: u64| if n == 0 { 0 } else { round_size(n, config) };
    for e in entries.iter().rev() {
        let int = |k: &str| e.get(k).and_then(|v| v.as_int()).map(|v| v.max(0) as u64);
        let (Some(addr), Some(action)) = (int("addr"), e.get("action")) else {
            continue;
        };
        let (size, stream) = (int("size").unwrap_or(0), int("stream").unwrap_or(0));
        let stitch = int(STITCH_KEY).is_some_and(|v| v != 0);
        // A change of what is listed, not of what is mapped (Note [Listed
        // ranges]): a stitch's range whole when taken into use, less a
        // tail trimmed later; its home runs the other way.
        let listed = int(LISTING_KEY).is_some_and(|v| v != 0);
        s.listing |= listed;
        let (listing, home) = (stitch && listed, !stitch && listed);
        // Bytes an undone allocation or mapping finds missing at the end.
        let missing = |found: bool, bytes: u64| if found { 0 } else { bytes };
        let missed = match action.as_str().unwrap_or("") {
            "alloc" => missing(s.blocks.remove(&addr).is_some(), round(size)),
            "free_requested" | "free_completed" => {
                s.blocks.entry(addr).or_insert((round(size), size, stream));
                0
            }
            "segment_alloc" => missing(s.segments.remove(&addr).is_some(), size),
            "segment_free" => {
                let pool = u64::from(size != 2 << 20);
                s.segments.entry(addr).or_insert((size, stream, pool));
                0
            }
            // Home runs are mapped before and after either change; before
            // a listing they were held, before an unlisting listed.
            "segment_map" if home => {
                s.ensure_mapped(addr, size, stream);
                cut(&mut s.held, addr, size);
                s.held.insert(addr, (size, stream, 1));
                0
            }
            "segment_unmap" if home => {
                s.ensure_mapped(addr, size, stream);
                cut(&mut s.held, addr, size);
                0
            }
            "segment_map" if listing => size - cut(&mut s.stitches, addr, size),
            "segment_unmap" if listing => {
                s.relist_stitch(addr, size, stream);
                0
            }
            "segment_map" if stitch => missing(s.stitches.remove(&addr).is_some(), size),
            "segment_map" => size - cut(&mut s.mapped, addr, size),
            "segment_unmap" if stitch => {
                s.stitches.insert(addr, (size, stream, 1));
                0
            }
            "segment_unmap" => {
                s.ensure_mapped(addr, size, stream);
                0
            }
            _ => 0,
        };
        s.disagree = s.disagree.saturating_add(missed);
    }
    s.mapped = merged(&s.mapped);
    s.held = merged(&s.held);
    s
}

impl Start {
    /// Marks `size` bytes at `addr` mapped (an unmap undone).
    fn ensure_mapped(&mut self, addr: u64, size: u64, stream: u64) {
        cut(&mut self.mapped, addr, size);
        self.mapped.insert(addr, (size, stream, 1));
    }

    /// Undoes the unlisting of `size` bytes at `addr` of a stitch: a tail
    /// trimmed from a stitch in use joins the part of it still listed,
    /// which ends there, so that the stitch is one range.
    fn relist_stitch(&mut self, addr: u64, size: u64, stream: u64) {
        let before = self
            .stitches
            .range(..addr)
            .next_back()
            .filter(|(a, r)| a.saturating_add(r.0) == addr)
            .map(|(&a, _)| a);
        match before {
            Some(a) => self.stitches.get_mut(&a).expect("found above").0 += size,
            None => {
                self.stitches.insert(addr, (size, stream, 1));
            }
        }
    }

    /// Adds a final segment and its live blocks.
    fn final_segment(&mut self, seg: &Value) {
        let int = |v: &Value, k: &str| v.get(k).and_then(|x| x.as_int()).map(|x| x.max(0) as u64);
        let flag = |k: &str| int(seg, k).is_some_and(|v| v != 0);
        let Some(addr) = int(seg, "address") else {
            return;
        };
        let stream = int(seg, "stream").unwrap_or(0);
        let range = (total_size(seg), stream, pool_code(seg));
        if flag(STITCH_KEY) {
            self.stitches.insert(addr, range);
        } else if flag("is_expandable") {
            cut(&mut self.mapped, addr, range.0);
            self.mapped.insert(addr, range);
        } else {
            self.segments.insert(addr, range);
        }
        let mut at = addr;
        for b in seg.get("blocks").map(|b| b.items()).unwrap_or_default() {
            let a = int(&b, "address").unwrap_or(at);
            let size = int(&b, "size").unwrap_or(0);
            at = a.saturating_add(size);
            let state = b.get("state");
            if state
                .as_ref()
                .and_then(|x| x.as_str())
                .is_some_and(|x| x.starts_with("active"))
            {
                let requested = int(&b, "requested_size").unwrap_or(size);
                self.blocks.insert(a, (size, requested, stream));
            }
        }
    }

    /// Blocks live at the start: how many, and their bytes.
    pub fn live(&self) -> (u64, u64) {
        (
            self.blocks.len() as u64,
            total(self.blocks.values().map(|b| b.0)),
        )
    }

    /// Reserved bytes at the start (segments and mapped pages).
    pub fn reserved(&self) -> u64 {
        total(
            self.segments
                .values()
                .chain(self.mapped.values())
                .map(|r| r.0),
        )
    }

    /// Bytes of blocks at the start that lie in no range of the start.
    pub fn uncovered(&self) -> u64 {
        let inside = |m: &BTreeMap<u64, Range>, a: u64, size: u64| {
            m.range(..=a)
                .next_back()
                .is_some_and(|(&s, r)| a.saturating_add(size) <= s.saturating_add(r.0))
        };
        total(
            self.blocks
                .iter()
                .filter(|&(&a, b)| {
                    ![&self.segments, &self.mapped, &self.stitches]
                        .iter()
                        .any(|m| inside(m, a, b.0))
                })
                .map(|(_, b)| b.0),
        )
    }

    /// The state as events of `device` at time 0: segments, mapped ranges
    /// and stitches, then the blocks, by address.
    pub fn events(&self, device: u32) -> Vec<TraceEvent> {
        let ev = |stream, kind| TraceEvent::from_kind(0, device, stream, 0, kind);
        let ranges = |m: &BTreeMap<u64, Range>, kind: fn(u64, u64, u64) -> EventKind| {
            m.iter()
                .map(|(&a, &(size, stream, pool))| ev(stream, kind(a, size, pool)))
                .collect::<Vec<_>>()
        };
        let mut out = ranges(&self.segments, |addr, size, p| EventKind::SegmentAlloc {
            addr,
            size,
            pool: Pool::Code(p),
        });
        out.extend(ranges(&self.mapped, |addr, size, p| {
            EventKind::SegmentMap {
                addr,
                size,
                pool: Pool::Code(p),
            }
        }));
        out.extend(ranges(&self.held, |addr, size, p| {
            EventKind::SegmentUnlist {
                addr,
                size,
                pool: Pool::Code(p),
            }
        }));
        out.extend(ranges(&self.stitches, |addr, size, _| {
            EventKind::SegmentMap {
                addr,
                size,
                pool: Pool::Stitch,
            }
        }));
        if self.listing {
            out.extend(ranges(&self.stitches, |addr, size, _| {
                EventKind::SegmentList {
                    addr,
                    size,
                    pool: Pool::Stitch,
                }
            }));
        }
        out.extend(
            self.blocks
                .iter()
                .map(|(&addr, &(block_size, requested, stream))| {
                    ev(
                        stream,
                        EventKind::Alloc {
                            addr,
                            requested,
                            block_size,
                        },
                    )
                }),
        );
        out
    }
}

/// The sum of `bytes`, saturating (sizes come from the file).
pub fn total(bytes: impl Iterator<Item = u64>) -> u64 {
    bytes.fold(0, u64::saturating_add)
}

/// A final segment's bytes.
pub fn total_size(seg: &Value) -> u64 {
    let size = seg.get("total_size").and_then(|x| x.as_int());
    size.map_or(0, |x| x.max(0) as u64)
}

/// A final segment's pool code: 0 / 1 the default small / large pool,
/// `2 + 2k` / `3 + 2k` those of private pool k (as the export numbers them).
fn pool_code(seg: &Value) -> u64 {
    let large = u64::from(
        seg.get("segment_type")
            .and_then(|t| t.as_str().map(|t| t != "small"))
            .unwrap_or(true),
    );
    let id: Vec<i64> = seg
        .get("segment_pool_id")
        .map(|p| p.items().iter().filter_map(Value::as_int).collect())
        .unwrap_or_default();
    match id.iter().rev().find(|&&k| k > 0) {
        Some(&k) => (2 + 2 * (k as u64 - 1)).saturating_add(large),
        None => large,
    }
}

/// Removes `[addr, addr + size)` from the ranges of `m`; returns the bytes
/// of it that they held.
fn cut(m: &mut BTreeMap<u64, Range>, addr: u64, size: u64) -> u64 {
    let end = addr.saturating_add(size);
    let before = m.range(..addr).next_back().map(|(&a, _)| a);
    let keys: Vec<u64> = before
        .into_iter()
        .chain(m.range(addr..end).map(|(&a, _)| a))
        .collect();
    let mut held = 0;
    for a in keys {
        let (len, stream, pool) = m[&a];
        let r_end = a.saturating_add(len);
        let (lo, hi) = (a.max(addr), r_end.min(end));
        if lo >= hi {
            continue;
        }
        held += hi - lo;
        m.remove(&a);
        if a < lo {
            m.insert(a, (lo - a, stream, pool));
        }
        if hi < r_end {
            m.insert(hi, (r_end - hi, stream, pool));
        }
    }
    held
}

/// `m` with adjacent ranges of one stream and pool joined.
fn merged(m: &BTreeMap<u64, Range>) -> BTreeMap<u64, Range> {
    let mut out: BTreeMap<u64, Range> = BTreeMap::new();
    for (&a, &r) in m {
        if let Some((&s, last)) = out.iter_mut().next_back()
            && s.saturating_add(last.0) == a
            && (last.1, last.2) == (r.1, r.2)
        {
            last.0 += r.0;
            continue;
        }
        out.insert(a, r);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::*;

    const M: i64 = 1 << 20;

    fn dict(kv: Vec<(&str, Value)>) -> Value {
        let kv = kv.into_iter().map(|(k, v)| (Value::Str(k.into()), v));
        Value::Dict(Rc::new(RefCell::new(kv.collect())))
    }

    fn list(v: Vec<Value>) -> Value {
        Value::List(Rc::new(RefCell::new(v)))
    }

    fn entry(action: &str, addr: i64, size: i64) -> Value {
        let a = Value::Str(action.into());
        dict(vec![
            ("action", a),
            ("addr", Value::Int(addr)),
            ("size", Value::Int(size)),
        ])
    }

    fn block(addr: i64, size: i64, state: &str) -> Value {
        let st = Value::Str(state.into());
        dict(vec![
            ("address", Value::Int(addr)),
            ("size", Value::Int(size)),
            ("state", st),
        ])
    }

    #[test]
    fn cut_takes_a_range_out_of_several_and_merged_joins_neighbours() {
        let mut m: BTreeMap<u64, Range> = BTreeMap::new();
        m.insert(0, (10, 0, 1));
        m.insert(10, (10, 0, 1));
        m.insert(30, (10, 0, 1));
        assert_eq!(cut(&mut m, 5, 30), 5 + 10 + 5, "what the ranges held");
        assert_eq!(
            m.into_iter().collect::<Vec<_>>(),
            [(0, (5, 0, 1)), (35, (5, 0, 1))]
        );
        let mut m: BTreeMap<u64, Range> = BTreeMap::new();
        m.insert(0, (10, 0, 1));
        m.insert(10, (10, 0, 1));
        m.insert(20, (10, 7, 1));
        let j = merged(&m);
        assert_eq!(
            j.into_iter().collect::<Vec<_>>(),
            [(0, (20, 0, 1)), (20, (10, 7, 1))]
        );
    }

    /// Final: a 40 MiB segment at 0 with a 4 MiB block at 0 (never
    /// allocated in the trace) and one at 8 MiB (allocated in it). The
    /// trace also frees a 1000 B block at 20 MiB and a 2 MiB segment at
    /// 64 MiB without their allocations.
    #[test]
    fn the_start_is_the_final_state_with_the_trace_undone() {
        let seg = dict(vec![
            ("address", Value::Int(0)),
            ("total_size", Value::Int(40 * M)),
            (
                "blocks",
                list(vec![
                    block(0, 4 * M, "active_allocated"),
                    block(4 * M, 4 * M, "inactive"),
                    block(8 * M, 2 * M, "active_pending_free"),
                    block(10 * M, 30 * M, "inactive"),
                ]),
            ),
        ]);
        let entries = [
            entry("free_completed", 20 * M, 1000),
            entry("segment_free", 64 * M, 2 * M),
            entry("alloc", 8 * M, 2 * M),
            entry("free_requested", 8 * M, 2 * M),
        ];
        let segs = [seg];
        let s = rebuild(&entries, &segs, 0, &Config::pytorch());
        assert_eq!(s.live(), (2, 4 * (1 << 20) + 1024), "the 1000 B rounded");
        assert_eq!(s.reserved(), 42 << 20);
        assert_eq!((s.uncovered(), s.disagree), (0, 0));
        let kinds: Vec<_> = s
            .events(3)
            .iter()
            .map(|e| (e.time_ns, e.device, e.kind()))
            .collect();
        assert!(
            matches!(
                kinds[..],
                [
                    (0, 3, EventKind::SegmentAlloc { addr: 0, .. }),
                    (
                        0,
                        3,
                        EventKind::SegmentAlloc {
                            addr: 0x400_0000,
                            size: 0x20_0000,
                            pool: Pool::Code(0)
                        }
                    ),
                    (
                        0,
                        3,
                        EventKind::Alloc {
                            addr: 0,
                            block_size: 0x40_0000,
                            ..
                        }
                    ),
                    (
                        0,
                        3,
                        EventKind::Alloc {
                            addr: 0x140_0000,
                            requested: 1000,
                            block_size: 1024
                        }
                    ),
                ]
            ),
            "{kinds:?}"
        );
        // Device 0's segments (no `device` key: 0) are not device 1's.
        let s = rebuild(&entries[..1], &segs, 1, &Config::pytorch());
        assert_eq!(s.uncovered(), 1024, "a block in no segment");
    }
}
