//! Export to Parquet, for querying many ranks' traces at once (DuckDB,
//! Polars, Spark, pandas): three files per trace, `<prefix>.events.parquet`,
//! `<prefix>.segments.parquet` and `<prefix>.phases.parquet`. Every row
//! carries `rank` (from the file name, see [`crate::analyses::ranks`]; null when the
//! name has none), `pid` (the header's) and `device`, so the files of a
//! job's ranks can be read as one table. Times are nanoseconds since the
//! trace began; bytes, addresses and streams are unsigned 64-bit integers.
//!
//! Events (one row per event; `alloc`'s and frees' `size` is the block's,
//! `requested` what was asked for): `time_ns`, `rank`, `pid`, `device`,
//! `action` (PyTorch's names: `alloc`, `free_requested`, `free_completed`,
//! `segment_alloc`, `oom`, ...), `address` (for `private_pool`, the
//! checkpoint's number of the checkpoint calls), `size`, `requested` (block
//! actions and `oom`), `stream`, `thread`, `pool` (segment events' pool
//! code; for `private_pool`, the code of the pool's small pool, `2 + 2k`),
//! `device_free` (`oom`), `step` (marks seen on the device before
//! the event, the mark itself included), `phase` (innermost open phase
//! after the event), `name` (the string of `phase_push`, `phase_pop` and
//! `mark`; the call's name, `begin_allocate_to_pool`, ..., for
//! `private_pool`; for `memory_limit`, the cap set in the configuration's
//! syntax, `per_process_memory_fraction:0.5`, `memory_limit:<bytes>` or
//! `memory_limit:none`, its `size` the byte cap, else 0), `allocated` and
//! `reserved` (the device's gauges after the event, as `summary` counts
//! them).
//!
//! Segments (one row per reserved range's lifetime): `rank`, `pid`,
//! `device`, `kind` (`segment` for `segment_alloc`, `mapped` for the pages
//! of an expandable segment, `stitch` for a stitched range), `address`,
//! `size`, `pool`, `stream`, `start_ns`, `end_ns` (null: held at the end).
//! A partial unmap ends the unmapped part and keeps the rest open.
//!
//! Phases (one row per opening of a phase and per step): `rank`, `pid`,
//! `device`, `kind` (`phase` or `step`), `name` (the phase, or the mark
//! that began the step), `step`, `depth` (phases nested around it),
//! `start_ns`, `end_ns` (null: still open at the end; a step ends at the
//! next mark or the device's last event), `peak_allocated`, `peak_reserved`
//! (the gauges' highest values inside, the values at the start included).
//!
//! The trace is read twice (the string table first, as for `--chrome`);
//! rows go out in row groups of [`ROWS_PER_GROUP`](crate::formats::parquet_table::ROWS_PER_GROUP),
//! so memory follows the live blocks, not the trace's length: a generated
//! trace of 3 million events (24 MiB) exports in 3.4 s with a release
//! build, in 42 MB resident (35 MB for 140 thousand events); its events
//! file takes about 16 bytes per event.
//!
//! What is held between rows is bounded for all the trace's devices
//! together, by the [`Budget`] of the pass: the state's bounds, ranges
//! held ([`MAX_TRACKED`](crate::analyses::budget::MAX_TRACKED)) and phases followed open
//! ([`MAX_OPEN`]). A range or phase past them has no row, and the export
//! warns once of how many it left out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpualloc::trace::{Action, EventKind, MemoryCap, Pool, TraceEvent, pool_code};
use parquet::data_type::ByteArray;

use crate::analyses::budget::{Bound, Budget};
use crate::analyses::state::{self, DeviceState, Gauges};
use crate::formats::parquet_ranges::{Held, Kind, Ranges};
use crate::formats::parquet_table::{ColumnSpec, Table, Ty, V};
use crate::input::{self, CliError};

const EVENTS: &[ColumnSpec] = &[
    ("time_ns", Ty::I64, false),
    ("rank", Ty::U32, true),
    ("pid", Ty::U32, false),
    ("device", Ty::U32, false),
    ("action", Ty::Str, false),
    ("address", Ty::U64, false),
    ("size", Ty::U64, false),
    ("requested", Ty::U64, true),
    ("stream", Ty::U64, false),
    ("thread", Ty::U32, false),
    ("pool", Ty::U64, true),
    ("device_free", Ty::U64, true),
    ("step", Ty::I64, false),
    ("phase", Ty::Str, true),
    ("name", Ty::Str, true),
    ("allocated", Ty::U64, false),
    ("reserved", Ty::U64, false),
];

const SEGMENTS: &[ColumnSpec] = &[
    ("rank", Ty::U32, true),
    ("pid", Ty::U32, false),
    ("device", Ty::U32, false),
    ("kind", Ty::Str, false),
    ("address", Ty::U64, false),
    ("size", Ty::U64, false),
    ("pool", Ty::U64, false),
    ("stream", Ty::U64, false),
    ("start_ns", Ty::I64, false),
    ("end_ns", Ty::I64, true),
];

const PHASES: &[ColumnSpec] = &[
    ("rank", Ty::U32, true),
    ("pid", Ty::U32, false),
    ("device", Ty::U32, false),
    ("kind", Ty::Str, false),
    ("name", Ty::Str, true),
    ("step", Ty::I64, false),
    ("depth", Ty::I64, true),
    ("start_ns", Ty::I64, false),
    ("end_ns", Ty::I64, true),
    ("peak_allocated", Ty::U64, false),
    ("peak_reserved", Ty::U64, false),
];

/// Phases followed open, for all devices together (the state's phases
/// too, in an export): fewer than the analyses', as a phase opening holds
/// a row under way.
pub const MAX_OPEN: usize = 1 << 16;

/// What one export of a trace holds, for all its devices together. No
/// iteration boundaries: the export numbers steps itself and never asks
/// the states for their iterations, whose mark times would otherwise be
/// kept for nothing (up to 32 MiB of them).
fn export_budget() -> Budget {
    Budget {
        open: Bound::new(MAX_OPEN),
        boundaries: Bound::new(0),
        ..Budget::default()
    }
}

/// The three files written for `--parquet ARG` and trace `trace`: ARG is a
/// prefix, or, when it is a folder (or ends with `/`), the folder where
/// `<trace's name>.events.parquet` and the others go.
pub fn outputs(arg: &Path, trace: &Path) -> [PathBuf; 3] {
    let folder = arg.is_dir() || arg.as_os_str().to_string_lossy().ends_with('/');
    let base = if folder {
        let stem = trace.file_stem().unwrap_or(trace.as_os_str());
        arg.join(stem)
    } else {
        arg.to_path_buf()
    };
    ["events", "segments", "phases"].map(|k| {
        let mut p = base.clone().into_os_string();
        p.push(format!(".{k}.parquet"));
        PathBuf::from(p)
    })
}

/// Exports each of `traces` into `folder` (in parallel); returns the files
/// written. Refuses a `folder` that is not one, and two traces of the same
/// name, whose files would overwrite each other.
pub fn export_all(
    folder: &Path,
    traces: &[PathBuf],
    allow_truncated: bool,
) -> Result<Vec<[PathBuf; 3]>, CliError> {
    if !folder.is_dir() {
        return Err(CliError(format!(
            "--parquet {}: not a folder: several traces need a folder to write their files in",
            folder.display()
        )));
    }
    let mut seen = std::collections::BTreeMap::new();
    let mut jobs = Vec::with_capacity(traces.len());
    let inputs: Vec<&Path> = traces.iter().map(PathBuf::as_path).collect();
    for t in traces {
        let outs = outputs(folder, t);
        if let Some(other) = seen.insert(outs[0].clone(), t) {
            return Err(CliError(format!(
                "--parquet: {} and {} have the same name: their files would overwrite each other",
                other.display(),
                t.display()
            )));
        }
        for out in &outs {
            input::refuse_overwrite("--parquet", out, &inputs)?;
        }
        jobs.push((t.clone(), outs));
    }
    // The rank column joins the files' rows: it is filled only when the
    // file names give every trace a rank of its own (as `summary` labels
    // ranks), else left null rather than merge different traces.
    let ranks: Vec<Option<u32>> = traces
        .iter()
        .map(|t| {
            let pid = input::open(t).map_or(0, |r| r.header().pid);
            crate::analyses::ranks::rank_from_name(t, pid)
        })
        .collect();
    let mut distinct = ranks.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let numbered = ranks.iter().all(Option::is_some) && distinct.len() == ranks.len();
    if !numbered {
        input::warn_once(
            "parquet ranks",
            "--parquet: the file names do not give each trace a rank of its own: the rank column is null (each file's metadata names its trace)",
        );
    }
    let jobs: Vec<_> = jobs
        .into_iter()
        .zip(ranks)
        .map(|((t, outs), r)| (t, outs, if numbered { r } else { None }))
        .collect();
    crate::analyses::ranks::par_map(jobs, |_, (t, outs, rank)| {
        export_ranked(&t, &outs, allow_truncated, Some(rank))?;
        Ok(outs)
    })
}

/// A phase opening or a step under way.
struct Span {
    name: Option<ByteArray>,
    step: u64,
    depth: Option<u64>,
    start: u64,
    peak: Gauges,
    /// The phase's string id (steps: none).
    id: Option<u64>,
}

impl Span {
    fn observe(&mut self, g: &Gauges) {
        self.peak.allocated = self.peak.allocated.max(g.allocated);
        self.peak.reserved = self.peak.reserved.max(g.reserved);
    }
}

#[derive(Default)]
struct Dev {
    s: DeviceState,
    step: u64,
    current: Option<Span>,
    /// The phases the state follows open, outermost first.
    open: Vec<Span>,
    ranges: Ranges,
    last_ns: u64,
}

/// The values every row starts with.
#[derive(Clone, Copy)]
struct Who {
    rank: Option<u32>,
    pid: u32,
}

impl Who {
    fn cols(self, device: u32) -> [V; 3] {
        [
            V::opt(self.rank.map(u64::from)),
            V::u(u64::from(self.pid)),
            V::u(u64::from(device)),
        ]
    }
}

struct Writer {
    who: Who,
    /// What the states of all the devices hold.
    budget: Budget,
    events: Table,
    segments: Table,
    phases: Table,
    names: Vec<ByteArray>,
    actions: Vec<ByteArray>,
    kinds: [ByteArray; 5],
}

const KINDS: [&str; 5] = ["segment", "mapped", "stitch", "phase", "step"];

impl Writer {
    fn name(&self, id: u64) -> ByteArray {
        match self.names.get(id as usize) {
            Some(n) => n.clone(),
            None => ByteArray::from(format!("#{id}").into_bytes()),
        }
    }

    fn phase_name(&self, id: u64) -> V {
        if id == state::NO_PHASE {
            V::Null
        } else {
            V::Str(self.name(id))
        }
    }

    fn held(
        &mut self,
        kind: Kind,
        dev: u32,
        addr: u64,
        h: Held,
        end: Option<u64>,
    ) -> Result<(), CliError> {
        let row = self.who.cols(dev).into_iter().chain([
            V::Str(self.kinds[kind as usize].clone()),
            V::u(addr),
            V::u(h.size),
            V::u(h.pool),
            V::u(h.stream),
            V::u(h.start),
            V::opt(end),
        ]);
        self.segments.push(row)
    }

    fn span(&mut self, dev: u32, sp: Span, end: Option<u64>) -> Result<(), CliError> {
        let kind = if sp.id.is_some() { 3 } else { 4 };
        let row = self.who.cols(dev).into_iter().chain([
            V::Str(self.kinds[kind].clone()),
            sp.name.map_or(V::Null, V::Str),
            V::u(sp.step),
            V::opt(sp.depth),
            V::u(sp.start),
            V::opt(end),
            V::u(sp.peak.allocated),
            V::u(sp.peak.reserved),
        ]);
        self.phases.push(row)
    }

    fn event(&mut self, d: &mut Dev, e: &TraceEvent) -> Result<(), CliError> {
        let dev = e.device;
        if d.current.is_none() {
            d.current = Some(Span {
                name: None,
                step: 0,
                depth: None,
                start: e.time_ns,
                peak: Gauges::default(),
                id: None,
            });
        }
        d.s.apply(e, &mut self.budget);
        d.last_ns = e.time_ns;
        let g = d.s.g;
        use EventKind as K;
        let kind = e.kind();
        match kind {
            K::Mark { name } => {
                d.step += 1;
                let next = Span {
                    name: Some(self.name(name)),
                    step: d.step,
                    depth: None,
                    start: e.time_ns,
                    peak: g,
                    id: None,
                };
                if let Some(done) = d.current.replace(next) {
                    self.span(dev, done, Some(e.time_ns))?;
                }
            }
            // A phase has a row when the state, bounded by the budget,
            // follows it: the two stacks stay alike.
            K::PhasePush { name } if d.s.phases.len() > d.open.len() => d.open.push(Span {
                name: Some(self.name(name)),
                step: d.step,
                depth: Some(d.open.len() as u64),
                start: e.time_ns,
                peak: g,
                id: Some(name),
            }),
            K::PhasePop { .. } => {
                while d.open.len() > d.s.phases.len() {
                    let sp = d.open.pop().expect("longer than the state's");
                    if let Some(outer) = d.open.last_mut() {
                        outer.observe(&sp.peak);
                    }
                    self.span(dev, sp, Some(e.time_ns))?;
                }
            }
            K::SegmentAlloc { addr, size, pool } => {
                let h = held(e, size, pool);
                d.ranges.hold(Kind::Segment, addr, h, &mut self.budget.held);
            }
            K::SegmentFree { addr, .. } => {
                if let Some(h) = d.ranges.free(addr, &mut self.budget.held) {
                    self.held(Kind::Segment, dev, addr, h, Some(e.time_ns))?;
                }
            }
            K::SegmentMap { addr, size, pool } => {
                let h = held(e, size, pool);
                d.ranges.hold(mapping(pool), addr, h, &mut self.budget.held);
            }
            K::SegmentUnmap { addr, size, pool } => {
                let kind = mapping(pool);
                for (addr, h) in d.ranges.unmap(kind, addr, size, &mut self.budget.held) {
                    self.held(kind, dev, addr, h, Some(e.time_ns))?;
                }
            }
            _ => {}
        }
        // Only the innermost open phase sees the event; a phase's peak
        // folds into the phase around it when it closes (and at the end),
        // so an event costs one update however many phases are open.
        for sp in d.open.last_mut().into_iter().chain(d.current.as_mut()) {
            sp.observe(&g);
        }
        // The size column: block bytes for block events, the event's bytes
        // otherwise; requested bytes, pool and free bytes where they apply.
        let (size, requested, pool, device_free) = match kind {
            K::Alloc {
                requested,
                block_size,
                ..
            }
            | K::FreeRequested {
                requested,
                block_size,
                ..
            }
            | K::FreeCompleted {
                requested,
                block_size,
                ..
            }
            | K::Free {
                requested,
                block_size,
                ..
            } => (block_size, Some(requested), None, None),
            K::SegmentAlloc { size, pool, .. }
            | K::SegmentFree { size, pool, .. }
            | K::SegmentMap { size, pool, .. }
            | K::SegmentUnmap { size, pool, .. }
            | K::SegmentList { size, pool, .. }
            | K::SegmentUnlist { size, pool, .. } => (size, None, Some(pool.code()), None),
            K::Oom {
                requested,
                device_free,
            } => (requested, Some(requested), None, Some(device_free)),
            K::PrivatePool { pool, .. } => {
                let k = u32::try_from(pool).ok();
                (0, None, k.map(|k| pool_code(Some(k), false)), None)
            }
            K::MemoryLimit { cap, .. } => (cap_row(cap).0, None, None, None),
            _ => (e.size, None, None, None),
        };
        let phase = d.s.phases.last().copied().unwrap_or(state::NO_PHASE);
        let row = [
            V::u(e.time_ns),
            V::opt(self.who.rank.map(u64::from)),
            V::u(u64::from(self.who.pid)),
            V::u(u64::from(dev)),
            V::Str(self.actions[e.action as usize].clone()),
            V::u(e.addr),
            V::u(size),
            V::opt(requested),
            V::u(e.stream),
            V::u(u64::from(e.thread)),
            V::opt(pool),
            V::opt(device_free),
            V::u(d.step),
            self.phase_name(phase),
            match (e.name_id(), e.kind()) {
                (Some(id), _) => V::Str(self.name(id)),
                (None, K::PrivatePool { op, .. }) => V::Str(ByteArray::from(op.name())),
                (None, K::MemoryLimit { cap, .. }) => {
                    V::Str(ByteArray::from(cap_row(cap).1.as_str()))
                }
                (None, _) => V::Null,
            },
            V::u(g.allocated),
            V::u(g.reserved),
        ];
        self.events.push(row)
    }

    /// Rows for what is still open at the end.
    fn finish(mut self, devs: BTreeMap<u32, Dev>) -> Result<(), CliError> {
        for (dev, mut d) in devs {
            for i in (1..d.open.len()).rev() {
                let inner = d.open[i].peak;
                d.open[i - 1].observe(&inner);
            }
            for sp in std::mem::take(&mut d.open) {
                self.span(dev, sp, None)?;
            }
            if let Some(sp) = d.current.take() {
                self.span(dev, sp, Some(d.last_ns))?;
            }
            for (kind, addr, h) in d.ranges.held() {
                self.held(kind, dev, addr, h, None)?;
            }
        }
        self.events.finish()?;
        self.segments.finish()?;
        self.phases.finish()
    }
}

fn held(e: &TraceEvent, size: u64, pool: Pool) -> Held {
    Held {
        size,
        pool: pool.code(),
        stream: e.stream,
        start: e.time_ns,
    }
}

/// The kind of the ranges a mapping event holds.
fn mapping(pool: Pool) -> Kind {
    if pool == Pool::Stitch {
        Kind::Stitch
    } else {
        Kind::Mapped
    }
}

/// Writes the three files of `out` (see [`outputs`]), the rank read from
/// the file name.
pub fn export(path: &Path, out: &[PathBuf; 3], allow_truncated: bool) -> Result<(), CliError> {
    export_ranked(path, out, allow_truncated, None)
}

/// [`export`] with the rank given (`Some`), or read from the file name.
/// The three files are written beside their names and renamed once all are
/// complete (`write_atomically`, one inside the other), so that a failure
/// (a full disk) leaves no partial file nor destroys earlier ones.
fn export_ranked(
    path: &Path,
    out: &[PathBuf; 3],
    allow_truncated: bool,
    rank: Option<Option<u32>>,
) -> Result<(), CliError> {
    let [a, b, c] = out;
    input::write_atomically(a, |ta| {
        input::write_atomically(b, |tb| {
            input::write_atomically(c, |tc| {
                let tmp = [ta.to_path_buf(), tb.to_path_buf(), tc.to_path_buf()];
                write_tables(path, &tmp, allow_truncated, rank, export_budget())?;
                Ok(())
            })
        })
    })
}

/// The three tables of `path`, written to `out`, holding what `budget`
/// allows between rows; returns the budget, with what it refused.
fn write_tables(
    path: &Path,
    out: &[PathBuf; 3],
    allow_truncated: bool,
    rank: Option<Option<u32>>,
    budget: Budget,
) -> Result<Budget, CliError> {
    // The string table streams in with the events: read it first.
    let first = input::scan(path, allow_truncated, |_| {})?;
    let h = &first.header;
    let meta = [
        ("gpualloc.trace", path.display().to_string()),
        ("gpualloc.producer", h.producer.clone()),
        ("gpualloc.config", h.config.clone()),
        ("gpualloc.start_unix_ns", h.start_unix_ns.to_string()),
    ];
    let who = Who {
        rank: rank.unwrap_or_else(|| crate::analyses::ranks::rank_from_name(path, h.pid)),
        pid: h.pid,
    };
    let mut w = Writer {
        who,
        budget,
        events: Table::create(&out[0], "events", EVENTS, &meta)?,
        segments: Table::create(&out[1], "segments", SEGMENTS, &meta)?,
        phases: Table::create(&out[2], "phases", PHASES, &meta)?,
        names: first
            .strings
            .iter()
            .map(|s| ByteArray::from(s.as_bytes().to_vec()))
            .collect(),
        actions: Action::ALL
            .iter()
            .map(|a| ByteArray::from(a.name().as_bytes().to_vec()))
            .collect(),
        kinds: KINDS.map(|k| ByteArray::from(k.as_bytes().to_vec())),
    };
    let mut devs: BTreeMap<u32, Dev> = BTreeMap::new();
    let mut err = None;
    input::scan(path, allow_truncated, |e| {
        if err.is_none() {
            let d = devs.entry(e.device).or_default();
            err = w.event(d, e).err();
        }
    })?;
    if let Some(e) = err {
        return Err(e);
    }
    let budget = w.budget;
    warn_refused(path, &budget);
    w.finish(devs)?;
    Ok(budget)
}

/// Warns, once per file, of the ranges and phases an export of `path` left
/// out (the state's blocks and ranges are warned of by the states).
fn warn_refused(path: &Path, budget: &Budget) {
    budget.held.warn_refused(path, "parquet ranges", |n, max| {
        format!(
            "{n} ranges reserved or mapped, or parts of ranges left by an unmap, past the first {max} held at once (all devices together) have no row in the segments table"
        )
    });
    budget.open.warn_refused(path, "parquet phases", |n, max| {
        format!(
            "{n} phases opened while {max} were open (all devices together) have no row in the phases table: the events in them name the phase around them"
        )
    });
}

/// A `memory_limit` row's `size` (the byte cap, 0 for none and for a
/// fraction) and `name` (the cap in the configuration's syntax; the
/// fraction printed so that it reads back to the same bits; `device_size`
/// for the record of the device's memory alone, whose bytes are its `addr`).
fn cap_row(cap: MemoryCap) -> (u64, String) {
    match cap {
        MemoryCap::Fraction(bits) => (
            0,
            format!("per_process_memory_fraction:{}", f64::from_bits(bits)),
        ),
        MemoryCap::Bytes(Some(b)) => (b, format!("memory_limit:{b}")),
        MemoryCap::Bytes(None) => (0, "memory_limit:none".into()),
        MemoryCap::DeviceSize => (0, "device_size".into()),
        MemoryCap::Other(which, value) => (0, format!("#{which}:{value}")),
    }
}

#[cfg(test)]
mod tests;
