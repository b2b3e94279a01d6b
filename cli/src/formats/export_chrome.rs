//! Export to the Chrome trace event format (chrome://tracing, Perfetto):
//! a counter track of allocated / reserved / active per device, phases as
//! duration slices, marks and OOMs as instants.
//!
//! The counter has at most one sample per microsecond: the state after the
//! last event of that microsecond, at that event's time (so the state at
//! the end of the trace is always there). A value held for less than a
//! microsecond (a block allocated and freed within it) does not show.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use gpualloc::trace::{Action, EventKind, TraceEvent};
use serde_json::json;

use crate::analyses::budget::Budget;
use crate::analyses::state::{DeviceState, Gauges};
use crate::input::{self, CliError};

/// Writes `out`.
pub fn export(path: &Path, out: &Path, allow_truncated: bool) -> Result<(), CliError> {
    let werr = |e: std::io::Error| CliError(format!("{}: cannot write: {e}", out.display()));
    let file = File::create(out).map_err(werr)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(b"{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n")
        .map_err(werr)?;
    // The string table streams in with the events: read it first.
    let strings = input::scan(path, allow_truncated, |_| {})?.strings;
    let name = |id: u64| {
        strings
            .get(id as usize)
            .cloned()
            .unwrap_or_else(|| format!("#{id}"))
    };
    // Sparse: device numbers come from the file. Each device's counter
    // sample waits until its microsecond is over.
    let mut states: BTreeMap<u32, (DeviceState, Option<Sample>)> = BTreeMap::new();
    let mut budget = Budget::default();
    let mut first = true;
    let mut err = None;
    let info = input::scan(path, allow_truncated, |e| {
        let (s, pending) = states
            .entry(e.device)
            .or_insert_with(|| (DeviceState::default(), None));
        s.apply(e, &mut budget);
        let ts = e.time_ns as f64 / 1000.0;
        let mut lines: Vec<serde_json::Value> = Vec::new();
        let sample = Sample {
            us: e.time_ns / 1000,
            time_ns: e.time_ns,
            device: e.device,
            g: s.g,
        };
        if let Some(done) = pending.replace(sample).filter(|p| p.us != sample.us) {
            lines.push(done.line());
        }
        match e.kind() {
            EventKind::Oom { requested, device_free } => lines.push(json!({"name": "OOM", "ph": "i", "s": "p", "ts": ts, "pid": e.device, "tid": e.thread,
                "args": {"requested": requested, "device_free": device_free, "allocated": s.g.allocated, "reserved": s.g.reserved}})),
            EventKind::EmptyCache { released } => lines.push(json!({"name": "empty_cache", "ph": "i", "s": "p", "ts": ts, "pid": e.device, "tid": e.thread,
                "args": {"released": released}})),
            _ => {}
        }
        if let Some(id) = e.name_id() {
            lines.push(json!({"name": name(id), "ph": ph(e), "s": "p", "ts": ts, "pid": e.device, "tid": 0}));
        }
        for l in lines {
            if err.is_some() {
                return;
            }
            err = put(&mut w, &mut first, &l).err();
        }
    })?;
    if let Some(e) = err {
        return Err(werr(e));
    }
    for p in states.values().filter_map(|(_, p)| p.as_ref()) {
        put(&mut w, &mut first, &p.line()).map_err(werr)?;
    }
    w.write_all(b"\n],\"otherData\":").map_err(werr)?;
    let strings: serde_json::Value = info
        .strings
        .iter()
        .enumerate()
        .map(|(i, s)| (i.to_string(), json!(s)))
        .collect::<serde_json::Map<_, _>>()
        .into();
    serde_json::to_writer(&mut w, &json!({"producer": info.header.producer, "config": info.header.config, "strings": strings}))
        .map_err(std::io::Error::other)
        .map_err(werr)?;
    w.write_all(b"}\n").map_err(werr)?;
    w.flush().map_err(werr)?;
    Ok(())
}

/// Writes one element of the event array.
fn put(w: &mut impl Write, first: &mut bool, v: &serde_json::Value) -> std::io::Result<()> {
    w.write_all(if *first { b"" } else { b",\n" })?;
    *first = false;
    serde_json::to_writer(w, v).map_err(std::io::Error::other)
}

/// A device's gauges after the last event seen in microsecond `us`.
#[derive(Clone, Copy)]
struct Sample {
    us: u64,
    time_ns: u64,
    device: u32,
    g: Gauges,
}

impl Sample {
    fn line(&self) -> serde_json::Value {
        let g = self.g;
        json!({"name": "memory", "ph": "C", "ts": self.time_ns as f64 / 1000.0, "pid": self.device,
            "args": {"allocated": g.allocated, "reserved": g.reserved, "active": g.active}})
    }
}

fn ph(e: &TraceEvent) -> &'static str {
    match e.action {
        Action::PhasePush => "B",
        Action::PhasePop => "E",
        _ => "i",
    }
}
