//! Import of a PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`).
//!
//! Uses `device_traces` (recorded with `_record_memory_history`): each entry
//! becomes one event of its device, times from `time_us`. Block sizes are
//! PyTorch's rounding of the request (512 B steps, and
//! `roundup_power2_divisions` when set); `annotate` entries become marks,
//! and `external_annotations` phases and marks (`torch_annotations.rs`).
//! Recording usually starts once the model is loaded, or keeps only the
//! last entries: the memory in use before the first entry is rebuilt from
//! the final `segments` (`torch_start.rs`) and written as segment and
//! alloc events at the trace's start, so that every command counts it.
//!
//! The trace's configuration is the allocator that recorded it:
//! `policy:pytorch` with the snapshot's `PYTORCH_CUDA_ALLOC_CONF` settings
//! translated (`torch_config.rs`). From a snapshot that gpualloc exported
//! (`export_torch.rs`): ranges marked `gpualloc_stitch` come back as
//! stitches, and `gpualloc_config` and `gpualloc_start_us` as the trace's
//! configuration and start. Without a start the earliest entry is.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use gpualloc::Config;
use gpualloc::size_class::round_size;
use gpualloc::trace::{Action, EventKind, MAX_DEVICES, Pool, TraceEvent, TraceHeader, TraceWriter};

use crate::formats::export_torch::{CONFIG_KEY, LISTING_KEY, POOL_KEY, START_KEY, STITCH_KEY};
use crate::formats::torch_annotations::{self, Annotation};
use crate::formats::torch_start::{self, Start};
use crate::formats::torch_stitches;
use crate::formats::{torch_config, unpickle};
use crate::input::CliError;

/// Converts `path` into `out`; returns the number of events written.
pub fn import(path: &Path, out: &Path) -> Result<u64, CliError> {
    let bytes = std::fs::read(path)
        .map_err(|e| CliError(format!("{}: cannot read: {e}", path.display())))?;
    let root = unpickle::loads(&bytes)
        .map_err(|e| CliError(format!("{}: not a readable pickle: {e}", path.display())))?;
    let traces = root.get("device_traces").ok_or_else(|| {
        CliError(format!(
            "{}: no `device_traces` in the snapshot: record it with torch.cuda.memory._record_memory_history(enabled=\"all\") before _dump_snapshot",
            path.display()
        ))
    })?;
    // A list of lists: anything else would read as no entries at all, and
    // the trace would lose them in silence.
    let not_list = |what: String, v: &unpickle::Value| {
        CliError(format!(
            "{}: {what} is a Python {}, not a list{}",
            path.display(),
            v.type_name(),
            if what == "`device_traces`" {
                " (one list of entries per device)"
            } else {
                ""
            }
        ))
    };
    if !matches!(traces, unpickle::Value::List(_)) {
        return Err(not_list("`device_traces`".into(), &traces));
    }
    if let Some((d, v)) = traces
        .items()
        .iter()
        .enumerate()
        .find(|(_, v)| !matches!(v, unpickle::Value::List(_)))
    {
        return Err(not_list(format!("`device_traces[{d}]`"), v));
    }
    // The final state, from which each device's start is rebuilt; a device
    // with segments and no trace gets an empty one.
    let finals = match root.get("segments") {
        Some(s @ unpickle::Value::List(_)) => Some(s.items()),
        Some(s) => return Err(not_list("`segments`".into(), &s)),
        None => None,
    };
    let mut rebuilt = Rebuilt::default();
    let mut devices = traces.items();
    for seg in finals.iter().flatten() {
        match seg.get("device").and_then(|d| d.as_int()).unwrap_or(0) {
            d if (0..i64::from(MAX_DEVICES)).contains(&d) => {
                devices.resize_with(devices.len().max(d as usize + 1), || {
                    unpickle::Value::List(Default::default())
                });
            }
            _ => {
                let size = torch_start::total_size(seg);
                rebuilt.left_out = rebuilt.left_out.saturating_add(size);
            }
        }
    }
    if devices.len() > MAX_DEVICES as usize {
        return Err(CliError(format!(
            "{}: `device_traces` lists {} devices, more than the limit of {MAX_DEVICES}",
            path.display(),
            devices.len()
        )));
    }
    // The earliest time of either list: PyTorch keeps annotations in a
    // buffer of their own, which may reach further back.
    let t0 = devices
        .iter()
        .flat_map(|d| d.items())
        .filter_map(|e| e.get("time_us").and_then(|t| t.as_int()))
        .chain(torch_annotations::earliest_us(&root))
        .chain(root.get(START_KEY).and_then(|t| t.as_int()))
        .min()
        .unwrap_or(0)
        .max(0) as u64;
    let conf = root
        .get("allocator_settings")
        .and_then(|s| s.get("PYTORCH_CUDA_ALLOC_CONF"))
        .and_then(|s| s.as_str().map(String::from));
    // gpualloc's own configuration when gpualloc exported the snapshot,
    // else PyTorch's allocator with the recorded settings.
    let config_text = match root
        .get(CONFIG_KEY)
        .and_then(|s| s.as_str().map(String::from))
    {
        Some(c) => c,
        None => {
            let t = torch_config::translate(conf.as_deref());
            if !t.left_out.is_empty() {
                crate::input::warn_once(
                    "import settings",
                    &format!(
                        "{}: PyTorch allocator settings without a gpualloc equivalent were left out of the trace's configuration `{}`: {}",
                        path.display(),
                        t.config,
                        t.left_out.join(", ")
                    ),
                );
            }
            t.config
        }
    };
    // Sizes are rounded as the recording allocator rounded them.
    let config = Config::parse(&config_text).unwrap_or_else(|_| Config::pytorch());
    let header = TraceHeader {
        start_unix_ns: t0.saturating_mul(1000),
        device_count: devices.len() as u32,
        pid: 0,
        config: config_text,
        producer: format!(
            "import pytorch-snapshot (PYTORCH_CUDA_ALLOC_CONF={})",
            conf.unwrap_or_default()
        ),
    };
    let werr = |e: std::io::Error| CliError(format!("{}: cannot write: {e}", out.display()));
    let file = File::create(out).map_err(werr)?;
    let mut w = TraceWriter::new(BufWriter::new(file), &header).map_err(werr)?;
    // Annotation names, each written once (the string table is bounded).
    let mut strings: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    // What could not be carried over as it was, said at the end.
    let mut unknown: std::collections::BTreeMap<String, u64> = Default::default();
    let (mut negative, mut untimed, mut not_int) = (0u64, 0u64, 0u64);
    let mut annotations_left_out = torch_annotations::outside(&root, devices.len());
    let mut names_left_out = 0u64;
    for (d, list) in devices.iter().enumerate() {
        let entries = list.items();
        let start = torch_start::rebuild(
            &entries,
            finals.as_deref().unwrap_or_default(),
            d as i64,
            &config,
        );
        rebuilt.add(&start);
        let mut events = start.events(d as u32);
        // Stitches' builds and teardowns, where the export kept them
        // (`torch_stitches.rs`): their listing entries change only what
        // is listed (Note [Listed ranges]).
        let mut lives = torch_stitches::for_device(&root, d as i64, t0)
            .unwrap_or_default()
            .into_iter()
            .peekable();
        // This device's phases and marks, placed among its entries below.
        let (anns, left_out) = torch_annotations::for_device(&root, d as i64);
        annotations_left_out += left_out;
        let mut anns = anns.into_iter().peekable();
        for (i, entry) in entries.iter().enumerate() {
            let entry_us = entry.get("time_us").and_then(|t| t.as_int());
            while let Some((_, e)) = lives.next_if(|(position, _)| *position <= i as u64) {
                events.push(e);
            }
            while let Some(a) = anns.next_if(|(place, a)| place.before(a, i as u64, entry_us)) {
                match annotation(&mut w, &mut strings, a, d as u32, t0).map_err(werr)? {
                    Some(e) => events.push(e),
                    None => names_left_out += 1,
                }
            }
            let at = |what: &str| {
                CliError(format!(
                    "{}: device_traces[{d}][{i}]: {what}",
                    path.display()
                ))
            };
            let action = entry
                .get("action")
                .and_then(|a| a.as_str().map(String::from))
                .ok_or_else(|| at("no `action` string"))?;
            let int = |k: &str| {
                entry
                    .get(k)
                    .and_then(|v| v.as_int())
                    .map(|v| v.max(0) as u64)
            };
            let raw = |k: &str| entry.get(k).and_then(|v| v.as_int());
            if raw("size").is_some_and(|v| v < 0) {
                negative += 1;
            }
            if entry.get("size").is_some() && raw("size").is_none() {
                not_int += 1;
            }
            if raw("time_us").is_none() {
                untimed += 1;
            }
            let time_us = int("time_us").map_or(i as u64, |t| t.saturating_sub(t0));
            let (size, stream) = (int("size").unwrap_or(0), int("stream").unwrap_or(0));
            let block = if size == 0 {
                0
            } else {
                round_size(size, &config)
            };
            let addr =
                |a: Action| int("addr").ok_or_else(|| at(&format!("`{a:?}` without an `addr`")));
            // The pool gpualloc's export wrote; else segments of 2 MiB come
            // from the small pool, others from the large, and mapped ranges
            // are the default large pool's, or stitches the export marked.
            let written = int(POOL_KEY).map(Pool::from_code);
            let pool = written.unwrap_or(Pool::Code(u64::from(size != 2 << 20)));
            let mapped = if int(STITCH_KEY).is_some_and(|v| v != 0) {
                Pool::Stitch
            } else {
                written.unwrap_or(Pool::Code(1))
            };
            let (requested, block_size) = (size, block);
            let time_ns = time_us.saturating_mul(1000);
            let ev = |kind| TraceEvent::from_kind(time_ns, d as u32, stream, 0, kind);
            if int(LISTING_KEY).is_some_and(|v| v != 0) {
                // A change of what is listed, not of what is mapped.
                let addr = int("addr").ok_or_else(|| at("a listing entry without an `addr`"))?;
                let pool = mapped;
                match action.as_str() {
                    "segment_map" => events.push(ev(EventKind::SegmentList { addr, size, pool })),
                    "segment_unmap" => {
                        events.push(ev(EventKind::SegmentUnlist { addr, size, pool }))
                    }
                    other => {
                        *unknown
                            .entry(format!("{other} ({LISTING_KEY})"))
                            .or_default() += 1
                    }
                }
                continue;
            }
            let kind = match action.as_str() {
                "alloc" => EventKind::Alloc {
                    addr: addr(Action::Alloc)?,
                    requested,
                    block_size,
                },
                "free_requested" => EventKind::FreeRequested {
                    addr: addr(Action::FreeRequested)?,
                    requested,
                    block_size,
                },
                "free_completed" => EventKind::FreeCompleted {
                    addr: addr(Action::FreeCompleted)?,
                    requested,
                    block_size,
                },
                "segment_alloc" => EventKind::SegmentAlloc {
                    addr: addr(Action::SegmentAlloc)?,
                    size,
                    pool,
                },
                "segment_free" => EventKind::SegmentFree {
                    addr: addr(Action::SegmentFree)?,
                    size,
                    pool,
                },
                "segment_map" => EventKind::SegmentMap {
                    addr: addr(Action::SegmentMap)?,
                    size,
                    pool: mapped,
                },
                "segment_unmap" => EventKind::SegmentUnmap {
                    addr: addr(Action::SegmentUnmap)?,
                    size,
                    pool: mapped,
                },
                "oom" => EventKind::Oom {
                    requested,
                    device_free: int("device_free").unwrap_or(0),
                },
                "annotate" => {
                    let name = entry
                        .get("user_metadata")
                        .and_then(|m| m.as_str().map(String::from))
                        .unwrap_or_else(|| "annotate".into());
                    match intern(&mut w, &mut strings, name).map_err(werr)? {
                        Some(name) => EventKind::Mark { name },
                        None => {
                            names_left_out += 1;
                            continue;
                        }
                    }
                }
                "snapshot" => continue, // a marker of the dump, no allocation
                other => {
                    *unknown.entry(other.to_string()).or_default() += 1;
                    continue;
                }
            };
            events.push(ev(kind));
        }
        events.extend(lives.map(|(_, e)| e));
        for a in anns {
            match annotation(&mut w, &mut strings, a, d as u32, t0).map_err(werr)? {
                Some(e) => events.push(e),
                None => names_left_out += 1,
            }
        }
        w.write_events(d as u32, &events).map_err(werr)?;
    }
    let n = w.events();
    w.finish(None).map_err(werr)?;
    let name = path.display();
    let recorded = devices.iter().any(|d| !d.items().is_empty());
    rebuilt.say(&name.to_string(), finals.is_some() || !recorded);
    if !unknown.is_empty() {
        let list: Vec<String> = unknown.iter().map(|(a, n)| format!("`{a}` x{n}")).collect();
        crate::input::warn_once(
            "import unknown actions",
            &format!(
                "{name}: entries of actions this import does not know were skipped: {}",
                list.join(", ")
            ),
        );
    }
    if negative > 0 {
        crate::input::warn_once(
            "import negative sizes",
            &format!("{name}: {negative} entries with a negative `size` were taken as 0 bytes"),
        );
    }
    if not_int > 0 {
        crate::input::warn_once(
            "import non-integer sizes",
            &format!(
                "{name}: {not_int} entries whose `size` is not an integer were taken as 0 bytes"
            ),
        );
    }
    if untimed > 0 {
        crate::input::warn_once(
            "import untimed",
            &format!(
                "{name}: {untimed} entries without a numeric `time_us` were timed by their position"
            ),
        );
    }
    if names_left_out > 0 {
        crate::input::warn_once(
            "import names",
            &format!(
                "{name}: {names_left_out} annotations were left out: the trace's table of names is full ({} names)",
                gpualloc::trace::format::MAX_STRINGS
            ),
        );
    }
    if annotations_left_out > 0 {
        crate::input::warn_once(
            "import annotations",
            &format!(
                "{name}: {annotations_left_out} `external_annotations` entries were left out (no name, stage or time, or an END that closes no open range)"
            ),
        );
    }
    Ok(n)
}

/// The id of annotation name `name`, written to the string table the first
/// time it is seen; `None` once the table is full.
fn intern(
    w: &mut TraceWriter<BufWriter<File>>,
    strings: &mut std::collections::HashMap<String, u64>,
    name: String,
) -> std::io::Result<Option<u64>> {
    if let Some(&id) = strings.get(&name) {
        return Ok(Some(id));
    }
    if strings.len() as u64 >= gpualloc::trace::format::MAX_STRINGS {
        return Ok(None);
    }
    w.write_strings(std::slice::from_ref(&name))?;
    let id = strings.len() as u64;
    strings.insert(name, id);
    Ok(Some(id))
}

/// The event of a phase or mark of device `device` at `time_us` (since the
/// epoch); `None` when its name no longer fits the string table.
fn annotation(
    w: &mut TraceWriter<BufWriter<File>>,
    strings: &mut std::collections::HashMap<String, u64>,
    (place, a): (torch_annotations::Place, Annotation),
    device: u32,
    t0: u64,
) -> std::io::Result<Option<TraceEvent>> {
    let (name, kind): (String, fn(u64) -> EventKind) = match a {
        Annotation::Push(n) => (n, |name| EventKind::PhasePush { name }),
        Annotation::Pop(n) => (n, |name| EventKind::PhasePop { name }),
        Annotation::Mark(n) => (n, |name| EventKind::Mark { name }),
    };
    let at_ns = (place.time_us.max(0) as u64)
        .saturating_sub(t0)
        .saturating_mul(1000);
    Ok(intern(w, strings, name)?.map(|id| TraceEvent::from_kind(at_ns, device, 0, 0, kind(id))))
}

/// The start states rebuilt, over the devices.
#[derive(Default)]
struct Rebuilt {
    blocks: u64,
    block_bytes: u64,
    reserved: u64,
    uncovered: u64,
    disagree: u64,
    /// Bytes of final segments of devices out of range.
    left_out: u64,
}

impl Rebuilt {
    fn add(&mut self, s: &Start) {
        let (n, b) = s.live();
        let add = |x: &mut u64, y: u64| *x = x.saturating_add(y);
        add(&mut self.blocks, n);
        add(&mut self.block_bytes, b);
        add(&mut self.reserved, s.reserved());
        add(&mut self.uncovered, s.uncovered());
        add(&mut self.disagree, s.disagree);
    }

    /// Says what was rebuilt, and warns of what could not be.
    fn say(&self, name: &str, has_segments: bool) {
        use crate::units::bytes;
        if self.blocks > 0 || self.reserved > 0 {
            eprintln!(
                "{name}: memory in use before recording began, rebuilt from the final `segments`, written at the trace's start: {} blocks ({}), {} reserved",
                self.blocks,
                bytes(self.block_bytes),
                bytes(self.reserved)
            );
        }
        if !has_segments {
            crate::input::warn_once(
                "import no segments",
                &format!(
                    "{name}: no `segments` in the snapshot: memory allocated before recording began is not accounted for, except blocks and segments the trace frees (an unknown number of bytes)"
                ),
            );
        }
        if self.uncovered > 0 {
            crate::input::warn_once(
                "import uncovered",
                &format!(
                    "{name}: {} of blocks in use before recording began lie in no segment the snapshot shows: the reserved memory under them is not accounted for",
                    bytes(self.uncovered)
                ),
            );
        }
        if self.left_out > 0 {
            crate::input::warn_once(
                "import devices",
                &format!(
                    "{name}: {} of final segments on devices out of range (not 0 to {}) were left out: not accounted for",
                    bytes(self.left_out),
                    MAX_DEVICES - 1
                ),
            );
        }
        if self.disagree > 0 && has_segments {
            crate::input::warn_once(
                "import disagree",
                &format!(
                    "{name}: the trace leaves {} live or reserved at the end that the final `segments` do not show: those bytes are not accounted for in the rebuilt start (the figures follow the trace)",
                    bytes(self.disagree)
                ),
            );
        }
    }
}
