//! Export to PyTorch's memory snapshot pickle, which memory_viz opens.
//!
//! MemoryViz replays `device_traces` backwards from the final `segments`, so
//! the two must agree exactly: every freed block must have been allocated in
//! the trace, and every block must lie in a segment. Events of blocks and
//! segments that predate the trace (it started mid-run) are left out; an
//! allocation in memory the trace never saw reserved (an imported log
//! without segments) gets a segment of its own, allocated just before it and
//! freed just after it. The final state is rebuilt from the kept events, and
//! each segment's blocks tile it exactly, gaps marked `inactive`.
//!
//! A stitched range (Note \[Stitching\]) maps pages already counted in other
//! segments. Its blocks still need a segment, so it is written as an
//! expandable one, with the extra key `gpualloc_stitch` (true), which
//! MemoryViz ignores and the import reads back as a stitch. Traces of
//! minor version 4 and later say which pages at home a stitch in use holds
//! (Note \[Listed ranges\]): they are written as the live snapshot lists
//! them, each byte once. A stitch is a segment while it is in use and its
//! home runs are unmapped from their segment meanwhile; these entries carry
//! `gpualloc_listing` (true), which the import reads back as a change of
//! what is listed, not of what is mapped; its build and teardown go to a
//! top-level key of their own (`torch_stitches.rs`). Older traces do not say, so a
//! stitch is a segment over its whole life (`segment_map` /
//! `segment_unmap`) and MemoryViz shows its pages twice.
//!
//! The trace's configuration and start go to the top-level keys
//! `gpualloc_config` and `gpualloc_start_us` (µs since the Unix epoch),
//! which MemoryViz ignores and the import reads back, so that a trace
//! keeps its configuration (replays, the report's advice) and its time
//! origin through a snapshot.
//!
//! Phases and marks go to `external_annotations`, where PyTorch puts
//! `record_function`'s ranges: a phase as a `START` and an `END`, a mark as
//! both at one time, with where each falls among the device's entries
//! (`torch_annotations.rs`, which reads them back).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use gpualloc::trace::{Action, EventKind, Pool, TraceEvent};

use crate::analyses::budget::Budget;
use crate::analyses::range_set::RangeSet;
use crate::analyses::state::{DeviceState, Region, range_end};
use crate::formats::pickle::Pickler;
use crate::formats::torch_stitches::{self, StitchRange};
use crate::input::{self, CliError};

type P = Pickler<BufWriter<File>>;

/// The key that marks a stitched range's entries and segments.
pub const STITCH_KEY: &str = "gpualloc_stitch";
/// The key that marks an entry that changes only what a snapshot lists,
/// not what is mapped (Note \[Listed ranges\]).
pub const LISTING_KEY: &str = "gpualloc_listing";
/// The key of a segment entry's pool (gpualloc's pool code: 0 small, 1
/// large, then each private pool's two), which PyTorch's entries lack; a
/// stitch's entries carry [`STITCH_KEY`] instead.
pub const POOL_KEY: &str = "gpualloc_pool";
/// The top-level key of the trace's configuration (gpualloc's syntax).
pub const CONFIG_KEY: &str = "gpualloc_config";
/// The top-level key of the trace's start (µs since the Unix epoch).
pub const START_KEY: &str = "gpualloc_start_us";

/// At most this many phase starts, phase ends and marks are written, so
/// that a trace of millions of marks cannot exhaust memory; the note says
/// how many were left out.
const MAX_ANNOTATIONS: usize = 4_000_000;

/// A phase's start or end, or a mark, as `external_annotations` entries.
#[derive(Clone, Copy)]
struct Annotation {
    device: u32,
    /// String id of the name.
    name: u64,
    /// `Some(true)` a phase began, `Some(false)` it ended, `None` a mark.
    start: Option<bool>,
    /// Since the trace's start.
    time_ns: u64,
    /// The device's `device_traces` entries written before it.
    position: u64,
}

/// Writes `out`; returns a note on what was left out, if anything.
pub fn export(path: &Path, out: &Path, allow_truncated: bool) -> Result<Option<String>, CliError> {
    let werr = |e: std::io::Error| CliError(format!("{}: cannot write: {e}", out.display()));
    let first = input::open(path)?;
    let (start_ns, config, device_count) = (
        first.header().start_unix_ns,
        first.header().config.clone(),
        first.header().device_count,
    );
    drop(first);
    // Which devices have events (and how many device lists to write).
    // And which of them record what a snapshot lists (Note [Listed ranges]).
    let mut seen: BTreeMap<u32, bool> = BTreeMap::new();
    let info = input::scan(path, allow_truncated, |e| {
        let listing = matches!(e.action, Action::SegmentList | Action::SegmentUnlist);
        *seen.entry(e.device).or_default() |= listing;
    })?;
    let mut annotations: Vec<Annotation> = Vec::new();
    let mut annotations_left_out = 0u64;
    let mut stitch_ranges: Vec<StitchRange> = Vec::new();
    let mut stitch_ranges_left_out = 0u64;
    // The reader bounds device numbers (below MAX_DEVICES), so this cannot
    // wrap; devices without events get an empty list without a pass.
    let n_devices = seen
        .keys()
        .next_back()
        .map_or(0, |&d| u64::from(d) + 1)
        .max(u64::from(device_count.min(64))) as u32;
    let file = File::create(out).map_err(werr)?;
    let mut p = Pickler::new(BufWriter::with_capacity(1 << 20, file)).map_err(werr)?;
    let mut finals: Vec<(DeviceState, BTreeMap<u64, u64>, bool)> = Vec::new();
    let mut skipped = 0u64;
    // Final states are kept for every device: one budget for them all.
    let mut budget = Budget::default();
    p.dict().map_err(werr)?;
    p.str("device_traces").map_err(werr)?;
    p.list().map_err(werr)?;
    for device in 0..n_devices {
        p.list().map_err(werr)?;
        let Some(&listing) = seen.get(&device) else {
            p.end().map_err(werr)?;
            finals.push((DeviceState::default(), BTreeMap::new(), false));
            continue;
        };
        let mut ex = Exporter {
            listing,
            state: DeviceState::default(),
            budget,
            stitch_streams: BTreeMap::new(),
            start_ns,
            skipped: 0,
            err: None,
            written: 0,
            annotations: std::mem::take(&mut annotations),
            annotations_left_out: 0,
            stitch_ranges: std::mem::take(&mut stitch_ranges),
            stitch_ranges_left_out: 0,
        };
        input::scan(path, allow_truncated, |e| {
            if e.device == device && ex.err.is_none() {
                ex.err = ex.event(&mut p, e).err();
            }
        })?;
        if let Some(e) = ex.err {
            return Err(werr(e));
        }
        p.end().map_err(werr)?;
        skipped += ex.skipped;
        annotations = ex.annotations;
        stitch_ranges = ex.stitch_ranges;
        stitch_ranges_left_out += ex.stitch_ranges_left_out;
        budget = ex.budget;
        annotations_left_out += ex.annotations_left_out;
        finals.push((ex.state, ex.stitch_streams, ex.listing));
    }
    p.end().map_err(werr)?;
    p.str("segments").map_err(werr)?;
    p.list().map_err(werr)?;
    for (device, (s, stitches, listing)) in finals.iter().enumerate() {
        segments(&mut p, device as u64, s, stitches, *listing).map_err(werr)?;
    }
    p.end().map_err(werr)?;
    p.str("allocator_settings").map_err(werr)?;
    p.dict().map_err(werr)?;
    p.kv_str("PYTORCH_CUDA_ALLOC_CONF", &config).map_err(werr)?;
    p.end().map_err(werr)?;
    p.kv_str(CONFIG_KEY, &config).map_err(werr)?;
    p.kv_int(START_KEY, start_ns / 1000).map_err(werr)?;
    p.str("external_annotations").map_err(werr)?;
    p.list().map_err(werr)?;
    for a in &annotations {
        let name = info.name(a.name);
        let stages: &[&str] = match a.start {
            Some(true) => &["START"],
            Some(false) => &["END"],
            None => &["START", "END"],
        };
        for stage in stages {
            annotation(&mut p, a, &name, stage).map_err(werr)?;
        }
    }
    p.end().map_err(werr)?;
    if seen.values().any(|&listing| listing) {
        torch_stitches::write(&mut p, &stitch_ranges).map_err(werr)?;
    }
    p.end().map_err(werr)?;
    p.finish().map_err(werr)?;
    let mut notes = Vec::new();
    if skipped > 0 {
        notes.push(format!(
            "{skipped} events about blocks or segments older than the trace were left out"
        ));
    }
    if stitch_ranges_left_out > 0 {
        notes.push(format!(
            "{stitch_ranges_left_out} stitch builds and teardowns past the first {} were left out",
            torch_stitches::MAX
        ));
    }
    if annotations_left_out > 0 {
        notes.push(format!(
            "{annotations_left_out} phases and marks past the first {MAX_ANNOTATIONS} were left out"
        ));
    }
    Ok((!notes.is_empty()).then(|| notes.join("; ")))
}

struct Exporter {
    /// The trace says what a snapshot lists (Note [Listed ranges]).
    listing: bool,
    state: DeviceState,
    /// What the states of the devices exported so far hold.
    budget: Budget,
    /// Stream of each mapped stitch, by address.
    stitch_streams: BTreeMap<u64, u64>,
    start_ns: u64,
    skipped: u64,
    err: Option<std::io::Error>,
    /// Entries written to this device's `device_traces` so far.
    written: u64,
    /// Phases and marks of every device so far.
    annotations: Vec<Annotation>,
    annotations_left_out: u64,
    /// With `listing`, stitches built and torn down on every device so far
    /// (`torch_stitches.rs`).
    stitch_ranges: Vec<StitchRange>,
    stitch_ranges_left_out: u64,
}

/// One `external_annotations` entry of `a`, with gpualloc's own keys.
fn annotation(p: &mut P, a: &Annotation, name: &str, stage: &str) -> std::io::Result<()> {
    p.dict()?;
    p.kv_str("name", name)?;
    p.kv_str("stage", stage)?;
    p.kv_int("device", u64::from(a.device))?;
    p.kv_int("time_us", a.time_ns / 1000)?;
    p.kv_int("gpualloc_position", a.position)?;
    if a.start.is_none() {
        p.str("gpualloc_mark")?;
        p.bool(true)?;
    }
    p.end()
}

impl Exporter {
    fn event(&mut self, p: &mut P, e: &TraceEvent) -> std::io::Result<()> {
        let keep = match e.kind() {
            // A stitch maps pages that are already mapped (and counted)
            // elsewhere a second time: PyTorch's format has no such thing,
            // so its range is marked (see the module docs).
            EventKind::SegmentMap {
                pool: Pool::Stitch,
                addr,
                size,
            } => {
                self.state.apply(e, &mut self.budget);
                // The state refuses a range past the end of the address space.
                if self.state.aliases.get(&addr) != Some(&size) {
                    self.skipped += 1;
                    return Ok(());
                }
                self.stitch_streams.insert(addr, e.stream);
                if self.listing {
                    // Listed while in use, below; its life goes apart.
                    self.stitch_range(e, true, addr, size);
                    return Ok(());
                }
                return self.stitch_entry(p, "segment_map", e, size);
            }
            EventKind::SegmentUnmap {
                pool: Pool::Stitch,
                addr,
                ..
            } => {
                let Some(size) = self.state.aliases.get(&addr).copied() else {
                    self.skipped += 1;
                    return Ok(());
                };
                let listed = overlap(&self.state.listed_stitches, addr, size);
                self.state.apply(e, &mut self.budget);
                self.stitch_streams.remove(&addr);
                if !self.listing {
                    return self.stitch_entry(p, "segment_unmap", e, size);
                }
                // A stitch still listed (a damaged file) leaves the list now.
                for (a, n) in listed {
                    let unlist = e.with_kind(EventKind::SegmentUnlist {
                        addr: a,
                        size: n,
                        pool: Pool::Stitch,
                    });
                    self.listing_entry(p, "segment_unmap", &unlist)?;
                }
                self.stitch_range(e, false, addr, size);
                return Ok(());
            }
            EventKind::SegmentList { addr, size, pool } => {
                if !self.listable(addr, size, pool, true) {
                    self.skipped += 1;
                    return Ok(());
                }
                self.state.apply(e, &mut self.budget);
                return self.listing_entry(p, "segment_map", e);
            }
            EventKind::SegmentUnlist { addr, size, pool } => {
                if !self.listable(addr, size, pool, false) {
                    self.skipped += 1;
                    return Ok(());
                }
                self.state.apply(e, &mut self.budget);
                return self.listing_entry(p, "segment_unmap", e);
            }
            // A range past the end of the address space (a corrupt file):
            // the state warns of it and leaves it out.
            EventKind::Alloc {
                addr, block_size, ..
            } if range_end(addr, block_size.max(1)).is_none() => false,
            EventKind::Alloc {
                addr, block_size, ..
            } => {
                // Pages a stitch held, with the record giving them back
                // lost (a damaged trace): listed again for the block.
                self.relist_held(p, e, addr, block_size.max(1))?;
                if !covered(&self.state, addr, block_size.max(1), self.listing) {
                    let synth = e.with_kind(EventKind::SegmentAlloc {
                        addr,
                        size: block_size.max(1),
                        pool: Pool::Code(1),
                    });
                    self.state.apply(&synth, &mut self.budget);
                    if let Some(r) = self.state.regions.get_mut(&addr) {
                        r.synthetic = true;
                    }
                    self.entry(p, "segment_alloc", &synth, synth.size)?;
                }
                true
            }
            EventKind::FreeRequested { addr, .. } => {
                self.state.live.get(&addr).is_some_and(|l| !l.pending)
            }
            EventKind::FreeCompleted { addr, .. } => self.state.live.contains_key(&addr),
            EventKind::SegmentFree { addr, .. } => self.state.regions.contains_key(&addr),
            EventKind::SegmentUnmap { addr, size, pool } => {
                let inside = in_mapped(&self.state, addr, size);
                // What is unmapped must be listed (held pages: a damaged trace).
                if inside {
                    self.relist_held(p, e, addr, size)?;
                } else {
                    // Pages mapped before the trace began unmapped with
                    // pages it saw mapped: those leave, the rest is left out.
                    for (a, n) in self.mapped_parts(addr, size) {
                        self.relist_held(p, e, a, n)?;
                        let part = e.with_kind(EventKind::SegmentUnmap {
                            addr: a,
                            size: n,
                            pool,
                        });
                        self.state.apply(&part, &mut self.budget);
                        self.entry(p, "segment_unmap", &part, n)?;
                    }
                }
                inside
            }
            EventKind::SegmentAlloc { .. }
            | EventKind::SegmentMap { .. }
            | EventKind::Oom { .. } => true,
            EventKind::PhasePush { name } => {
                self.annotate(e, name, Some(true));
                return Ok(());
            }
            EventKind::PhasePop { name } => {
                self.annotate(e, name, Some(false));
                return Ok(());
            }
            EventKind::Mark { name } => {
                self.annotate(e, name, None);
                return Ok(());
            }
            _ => return Ok(()),
        };
        if !keep {
            self.skipped += 1;
            return Ok(());
        }
        let requested = self.state.live.get(&e.addr).map_or(e.size, |l| l.requested);
        self.state.apply(e, &mut self.budget);
        match e.kind() {
            EventKind::Oom {
                requested,
                device_free,
            } => {
                p.dict()?;
                p.kv_str("action", "oom")?;
                p.kv_int("size", requested)?;
                p.kv_int("device_free", device_free)?;
                p.kv_int("stream", e.stream)?;
                p.kv_int("time_us", self.start_ns.saturating_add(e.time_ns) / 1000)?;
                self.written += 1;
                p.end()
            }
            EventKind::FreeRequested { .. } => self.entry(p, "free_requested", e, requested),
            EventKind::FreeCompleted { .. } => {
                self.entry(p, "free_completed", e, requested)?;
                self.free_synthetic(p, e)
            }
            _ => self.entry(p, e.action.name(), e, e.size),
        }
    }

    /// Keeps phase event or mark `e` for `external_annotations`, where
    /// this device's entries stand now (see [`Annotation`]).
    fn annotate(&mut self, e: &TraceEvent, name: u64, start: Option<bool>) {
        self.state.apply(e, &mut self.budget);
        if self.annotations.len() >= MAX_ANNOTATIONS {
            self.annotations_left_out += 1;
            return;
        }
        self.annotations.push(Annotation {
            device: e.device,
            name,
            start,
            time_ns: self.start_ns.saturating_add(e.time_ns),
            position: self.written,
        });
    }

    /// Releases the segment made up for a block once the block is gone.
    fn free_synthetic(&mut self, p: &mut P, e: &TraceEvent) -> std::io::Result<()> {
        if let Some(r) = self
            .state
            .regions
            .get(&e.addr)
            .copied()
            .filter(|r| r.synthetic)
        {
            let synth = TraceEvent {
                stream: r.stream,
                ..e.with_kind(EventKind::SegmentFree {
                    addr: e.addr,
                    size: r.size,
                    pool: Pool::from_code(r.pool),
                })
            };
            self.state.apply(&synth, &mut self.budget);
            self.entry(p, "segment_free", &synth, r.size)?;
        }
        Ok(())
    }

    fn entry(&mut self, p: &mut P, action: &str, e: &TraceEvent, size: u64) -> std::io::Result<()> {
        self.fields(p, action, e, size)?;
        if let EventKind::SegmentAlloc {
            pool: Pool::Code(c),
            ..
        }
        | EventKind::SegmentFree {
            pool: Pool::Code(c),
            ..
        }
        | EventKind::SegmentMap {
            pool: Pool::Code(c),
            ..
        }
        | EventKind::SegmentUnmap {
            pool: Pool::Code(c),
            ..
        } = e.kind()
        {
            p.kv_int(POOL_KEY, c)?;
        }
        p.end()
    }

    /// The parts of `[addr, addr + size)` that mapped ranges (pages of
    /// expandable segments) of the state hold, in order.
    fn mapped_parts(&self, addr: u64, size: u64) -> Vec<(u64, u64)> {
        let end = addr.saturating_add(size);
        let first = self
            .state
            .regions
            .range(..=addr)
            .next_back()
            .map_or(addr, |(&a, _)| a);
        self.state
            .regions
            .range(first..end)
            .filter(|(_, r)| r.expandable)
            .filter_map(|(&a, r)| {
                let (lo, hi) = (a.max(addr), a.saturating_add(r.size).min(end));
                if lo < hi { Some((lo, hi - lo)) } else { None }
            })
            .collect()
    }

    /// Lists again, for MemoryViz and the state, the parts of
    /// `[addr, addr + size)` that stitches hold at home.
    fn relist_held(
        &mut self,
        p: &mut P,
        e: &TraceEvent,
        addr: u64,
        size: u64,
    ) -> std::io::Result<()> {
        if !self.listing {
            return Ok(());
        }
        for (a, n) in overlap(&self.state.held_home, addr, size) {
            let relist = e.with_kind(EventKind::SegmentList {
                addr: a,
                size: n,
                pool: Pool::Code(1),
            });
            self.state.apply(&relist, &mut self.budget);
            self.listing_entry(p, "segment_map", &relist)?;
        }
        Ok(())
    }

    /// Keeps a stitch's build (`mapped`) or teardown for
    /// `gpualloc_stitch_ranges`, after this device's entries so far.
    fn stitch_range(&mut self, e: &TraceEvent, mapped: bool, addr: u64, size: u64) {
        if self.stitch_ranges.len() >= torch_stitches::MAX {
            self.stitch_ranges_left_out += 1;
            return;
        }
        self.stitch_ranges.push(StitchRange {
            device: e.device,
            mapped,
            addr,
            size,
            stream: e.stream,
            time_us: self.start_ns.saturating_add(e.time_ns) / 1000,
            position: self.written,
        });
    }

    /// Whether listing (`list`) or unlisting `[addr, addr + size)` of
    /// `pool` agrees with the state: a stitch's part inside a stitch,
    /// listed once; a home run inside a mapped range, held once.
    fn listable(&self, addr: u64, size: u64, pool: Pool, list: bool) -> bool {
        let s = &self.state;
        if size == 0 || range_end(addr, size).is_none() {
            return false;
        }
        if pool == Pool::Stitch {
            let in_stitch = s
                .aliases
                .range(..=addr)
                .next_back()
                .is_some_and(|(&a, &n)| within(addr, size, a, n));
            let listed = &s.listed_stitches;
            return in_stitch
                && if list {
                    !listed.overlaps(addr, size)
                } else {
                    listed.covers(addr, size)
                };
        }
        in_mapped(s, addr, size)
            && if list {
                s.held_home.covers(addr, size)
            } else {
                !s.held_home.overlaps(addr, size)
            }
    }

    /// An entry that changes only what is listed, marked as one.
    fn listing_entry(&mut self, p: &mut P, action: &str, e: &TraceEvent) -> std::io::Result<()> {
        self.fields(p, action, e, e.size)?;
        p.str(LISTING_KEY)?;
        p.bool(true)?;
        match e.kind() {
            EventKind::SegmentList {
                pool: Pool::Code(c),
                ..
            }
            | EventKind::SegmentUnlist {
                pool: Pool::Code(c),
                ..
            } => p.kv_int(POOL_KEY, c)?,
            _ => {
                p.str(STITCH_KEY)?;
                p.bool(true)?;
            }
        }
        p.end()
    }

    /// An entry of a stitched range, marked as one.
    fn stitch_entry(
        &mut self,
        p: &mut P,
        action: &str,
        e: &TraceEvent,
        size: u64,
    ) -> std::io::Result<()> {
        self.fields(p, action, e, size)?;
        p.str(STITCH_KEY)?;
        p.bool(true)?;
        p.end()
    }

    /// Opens an entry and writes its common fields.
    fn fields(
        &mut self,
        p: &mut P,
        action: &str,
        e: &TraceEvent,
        size: u64,
    ) -> std::io::Result<()> {
        self.written += 1;
        p.dict()?;
        p.kv_str("action", action)?;
        p.kv_int("addr", e.addr)?;
        p.kv_int("size", size)?;
        p.kv_int("stream", e.stream)?;
        p.kv_int("time_us", self.start_ns.saturating_add(e.time_ns) / 1000)
    }
}

/// Whether a block lies in a segment, or in a stitch (whose pages are
/// counted in the segments they are mapped from); with `listing`, in what
/// is listed: not in home pages a stitch holds, and only in the listed
/// part of a stitch (Note [Listed ranges]).
fn covered(s: &DeviceState, addr: u64, size: u64, listing: bool) -> bool {
    let at_home = s
        .regions
        .range(..=addr)
        .next_back()
        .is_some_and(|(&a, r)| within(addr, size, a, r.size))
        && !(listing && s.held_home.overlaps(addr, size));
    at_home
        || if listing {
            s.listed_stitches.covers(addr, size)
        } else {
            s.aliases
                .range(..=addr)
                .next_back()
                .is_some_and(|(&a, &len)| within(addr, size, a, len))
        }
}

/// Whether `[addr, addr + size)` lies inside one mapped range of `s`
/// (pages of an expandable segment).
fn in_mapped(s: &DeviceState, addr: u64, size: u64) -> bool {
    s.regions
        .range(..=addr)
        .next_back()
        .is_some_and(|(&a, r)| r.expandable && within(addr, size, a, r.size))
}

/// The parts of `[addr, addr + size)` that `set` holds, in order.
fn overlap(set: &RangeSet, addr: u64, size: u64) -> Vec<(u64, u64)> {
    let end = addr.saturating_add(size);
    set.iter()
        .filter_map(|(a, n)| {
            let (lo, hi) = (a.max(addr), a.saturating_add(n).min(end));
            if lo < hi { Some((lo, hi - lo)) } else { None }
        })
        .collect()
}

/// Whether `[addr, addr + size)` lies inside `[start, start + len)`, both
/// ends inside the address space.
fn within(addr: u64, size: u64, start: u64, len: u64) -> bool {
    match (range_end(addr, size), range_end(start, len)) {
        (Some(end), Some(limit)) => end <= limit,
        _ => false,
    }
}

/// The final segments of `s`: its ranges, and its stitches (streams in
/// `stitches`) as expandable segments of the default large pool; with
/// `listing` (the trace says what is listed), its listed ranges (Note
/// [Listed ranges]).
fn segments(
    p: &mut P,
    device: u64,
    s: &DeviceState,
    stitches: &BTreeMap<u64, u64>,
    listing: bool,
) -> std::io::Result<()> {
    let mut ranges: BTreeMap<u64, (Region, bool)> = BTreeMap::new();
    for (&addr, &r) in &s.regions {
        if !listing || !r.expandable {
            ranges.insert(addr, (r, false));
            continue;
        }
        for (a, size) in s.held_home.gaps(addr, r.size) {
            ranges.insert(a, (Region { size, ..r }, false));
        }
    }
    let stitch = |addr: u64, size: u64| Region {
        size,
        stream: stitches.get(&addr).copied().unwrap_or(0),
        pool: 1,
        expandable: true,
        synthetic: false,
    };
    if listing {
        for (addr, size) in s.listed_stitches.iter() {
            let home = s
                .aliases
                .range(..=addr)
                .next_back()
                .map_or(addr, |(&a, _)| a);
            let r = Region {
                size,
                ..stitch(home, size)
            };
            ranges.entry(addr).or_insert((r, true));
        }
    } else {
        for (&addr, &size) in &s.aliases {
            ranges.entry(addr).or_insert((stitch(addr, size), true));
        }
    }
    let live = s.sorted_live();
    let mut i = 0;
    for (&addr, (r, stitch)) in &ranges {
        while i < live.len() && live[i].0 < addr {
            i += 1;
        }
        let mut blocks: Vec<(u64, u64, u64, &str)> = Vec::new();
        // The state keeps no range that passes the end of the address space.
        let (mut cur, end) = (addr, addr.saturating_add(r.size));
        let (mut allocated, mut active, mut requested) = (0, 0, 0);
        while i < live.len() && live[i].0.saturating_add(live[i].1.size) <= end {
            let (a, l) = live[i];
            if a > cur {
                blocks.push((cur, a - cur, 0, "inactive"));
            }
            let state = if l.pending {
                "active_pending_free"
            } else {
                "active_allocated"
            };
            blocks.push((a, l.size, l.requested, state));
            active += l.size;
            requested += l.requested;
            if !l.pending {
                allocated += l.size;
            }
            cur = a.saturating_add(l.size);
            i += 1;
        }
        if cur < end {
            blocks.push((cur, end - cur, 0, "inactive"));
        }
        segment(
            p,
            device,
            addr,
            r,
            *stitch,
            &blocks,
            (allocated, active, requested),
        )?;
    }
    Ok(())
}

fn segment(
    p: &mut P,
    device: u64,
    addr: u64,
    r: &Region,
    stitch: bool,
    blocks: &[(u64, u64, u64, &str)],
    sums: (u64, u64, u64),
) -> std::io::Result<()> {
    p.dict()?;
    p.kv_int("device", device)?;
    p.kv_int("address", addr)?;
    p.kv_int("total_size", r.size)?;
    p.kv_int("allocated_size", sums.0)?;
    p.kv_int("active_size", sums.1)?;
    p.kv_int("requested_size", sums.2)?;
    p.kv_int("stream", r.stream)?;
    p.kv_str(
        "segment_type",
        if r.pool.is_multiple_of(2) {
            "small"
        } else {
            "large"
        },
    )?;
    p.str("segment_pool_id")?;
    p.int_pair(0, if r.pool >= 2 { (r.pool - 2) / 2 + 1 } else { 0 })?;
    p.str("is_expandable")?;
    p.bool(r.expandable)?;
    if stitch {
        p.str(STITCH_KEY)?;
        p.bool(true)?;
    }
    p.str("frames")?;
    p.list()?;
    p.end()?;
    p.str("blocks")?;
    p.list()?;
    for &(a, size, req, state) in blocks {
        p.dict()?;
        p.kv_int("address", a)?;
        p.kv_int("size", size)?;
        p.kv_int("requested_size", req)?;
        p.kv_str("state", state)?;
        p.str("frames")?;
        p.list()?;
        p.end()?;
        p.end()?;
    }
    p.end()?;
    p.end()?;
    Ok(())
}
