//! The `replay` command: one pass of the trace per configuration, the
//! results side by side, or as JSON (`--json`) for scripts and CI. Besides
//! the peaks it reports the driver calls each configuration makes and the
//! driver time they would take on an H200 ([`CostModel::h200`]), in all
//! and in the steps after warm-up (whether a configuration keeps moving
//! memory once the program runs steadily), the host waits among them
//! (priced as on an idle device: on the GPU each blocks for the work
//! queued before it, so the time is a lower bound there), and what
//! reserved memory was made of at its peak (Note [Held memory by unit] in
//! `allocator/src/held.rs`): which part lies beside live blocks in the
//! handles or segments they keep (given back only as those blocks are
//! freed, or by smaller units), which is cache, which private pools keep.
//! Events the recorder dropped are not replayed: a warning on stderr says
//! how many, and each JSON object's `dropped`.
//!
//! JSON, one object per configuration: `config`, `capacity`, `events`,
//! `dropped`, `peak_reserved`, `peak_allocated`, `ratio`, `ooms`,
//! `alloc_retries` (requests retried after the cache was freed, PyTorch's
//! `num_alloc_retries`: how often a run met its limit or the device),
//! `driver_calls`, `driver_memory_calls`, `driver_ms`,
//! `driver_calls_by_kind` (per kind: `calls`, `handles`, `bytes`, `ms`),
//! `helper_driver_ms`, `defragment_driver_ms`, `cost_model`, with
//! `--min-limit` `min_limit` (the smallest memory limit per device under
//! which the replay has no OOM, in bytes, or null when it fails even
//! uncapped or under every limit up to the device; `min_limit.rs`),
//! `after_warmup` (the steps after the first fifth of the trace's steps,
//! told by its step marks or else its most often opened top-level phase,
//! or null under 5 steps: `steps`, `driver_calls`, `driver_memory_calls`,
//! `memory_calls_per_100_steps`, `driver_ms`; over several devices the
//! calls are summed, `steps` is the most any device has, and the rate is
//! the sum of each device's own),
//! `held_at_peak_reserved` (`used_units`, `used_units_unallocated`,
//! `free_units`, `free_private_units`, `pooled`: bytes at each device's
//! peak, summed; the parts but `used_units_unallocated` add up to
//! `peak_reserved`), and `devices` (per device: `device`, `peak_reserved`,
//! `peak_allocated`, `ooms`, `alloc_retries`, `held_at_peak_reserved`,
//! `after_warmup`, `departure`), and `departure`: the first allocation the
//! recording served after which the replay had obtained other device
//! memory than the recording, as both traces count it (bytes of
//! `segment_map` and `segment_alloc` records), or which the replay failed;
//! null when none:
//! `event_index`, `time_ns`, `replayed_bytes`, `recorded_bytes`. Under
//! the recorded configuration, null is a necessary sign that the replay
//! made the recording's choices, not proof (placement, streams, releases
//! and a stitch's repairs are not compared); a trace started mid-run or
//! with dropped events departs where it lacks what came before or between.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use gpualloc::replay::{Departure, DeviceReplay, ReplayResult, replay_split};
use gpualloc::{Config, CostModel, DriverCall, DriverCalls, Held};
use serde_json::json;

use crate::analyses::analysis::{Analysis, analyze};
use crate::commands::min_limit::{MinLimit, search};
use crate::input::{self, CliError};
use crate::units::{bytes, duration, percent};

/// Fewer steps than this, and a trace has no warm-up to leave out.
const MIN_STEPS: usize = 5;

/// Where each device's steps after warm-up begin: `(time, steps from
/// there)`, the first fifth of its steps left out, as `tests/gpu/bench.py`
/// leaves them out. A step is what lies between the boundaries that
/// `summary` finds (its analysis's first pass): the step marks, which
/// `install()` records as each optimizer step ends, else the openings of
/// the most often opened top-level phase. Devices with fewer than
/// [`MIN_STEPS`] boundaries have none.
fn warmup_ends(a: &Analysis) -> BTreeMap<u32, (u64, u64)> {
    a.devices
        .iter()
        .filter_map(|(&d, x)| {
            let b = x.state.iterations();
            if b.len() < MIN_STEPS {
                return None;
            }
            // Step `w` (`w` ≥ 1) begins where step `w - 1` ended, or where
            // it opens its phase.
            let w = b.len() / 5;
            let start = if x.state.iterations_end_steps() {
                b[w - 1]
            } else {
                b[w]
            };
            Some((d, (start, (b.len() - w) as u64)))
        })
        .collect()
}

/// The device memory to replay on: `capacity` when given, else the
/// largest memory a device of the recording told (trace minor 5 records
/// it as each device starts; older traces only with a cap).
fn capacity_of(path: &Path, a: &Analysis, capacity: Option<u64>) -> Result<Capacity, CliError> {
    if let Some(bytes) = capacity {
        return Ok(Capacity {
            bytes,
            recorded: false,
        });
    }
    a.devices
        .values()
        .filter_map(|d| d.state.caps.device_total)
        .max()
        .map(|bytes| Capacity {
            bytes: input::plausible_device_bytes(path, bytes),
            recorded: true,
        })
        .ok_or_else(|| {
            CliError(format!(
                "{}: the trace does not tell its device's memory (written before trace minor 5, or imported); pass --capacity, such as --capacity 80GiB",
                path.display()
            ))
        })
}

/// The simulated device's memory, and whether it is the recording's.
#[derive(Clone, Copy)]
struct Capacity {
    bytes: u64,
    recorded: bool,
}

/// Replays `path` under each configuration (the trace's own when none).
pub fn run(
    path: &Path,
    capacity: Option<u64>,
    configs: &[String],
    as_json: bool,
    allow_truncated: bool,
    min_limit: bool,
) -> Result<String, CliError> {
    let recorded = input::open(path)?.header().config.clone();
    let own = configs.is_empty();
    let configs: Vec<String> = if own {
        vec![recorded]
    } else {
        configs.to_vec()
    };
    // The parser's message quotes the bad part; where it came from is named.
    // All are checked before the trace is read.
    let parsed = configs
        .iter()
        .map(|c| {
            Config::parse(c).map_err(|e| {
                CliError(if own {
                    format!(
                        "{}: the configuration it was recorded with does not parse here ({e}); replay it under another with --config (--config \"\" for the defaults)",
                        path.display()
                    )
                } else {
                    format!("--config: {e}")
                })
            })
        })
        .collect::<Result<Vec<Config>, CliError>>()?;
    let a = analyze(path, allow_truncated)?;
    let warm = warmup_ends(&a);
    let cap = capacity_of(path, &a, capacity)?;
    let capacity = cap.bytes;
    let split: BTreeMap<u32, u64> = warm.iter().map(|(&d, &(t, _))| (d, t)).collect();
    let mut results = Vec::new();
    let mut strings = Vec::new();
    let mut dropped = 0u64;
    for config in &parsed {
        let mut reader = input::open(path)?;
        let r = replay_split(reader.events(), capacity, config, &split);
        if let Some(e) = reader.take_error() {
            let msg = format!("{}: {e} (after {} events)", path.display(), r.events);
            if !allow_truncated {
                return Err(CliError(format!(
                    "{msg}; pass --allow-truncated to replay the readable prefix"
                )));
            }
            // Under the key of the first pass's warning (`warmup_ends`),
            // which said it already.
            input::warn_once(
                &format!("{}: {e}", path.display()),
                &format!("{msg}; the readable prefix was replayed"),
            );
        } else if reader.end().is_none() {
            // As every command that reads the trace says it.
            input::warn_no_end(path, r.events);
        }
        input::reader_warnings(path, &reader);
        dropped = reader.dropped().values().sum();
        input::warn_dropped(path, dropped);
        strings = input::shortened_names(reader.strings());
        warn_other_device(path, capacity, &r);
        results.push(r);
    }
    // `--min-limit`: the smallest cap under which each configuration's
    // replay has no OOM (`min_limit.rs`).
    let limits = if min_limit {
        configs
            .iter()
            .map(|c| search(path, capacity, c).map(Some))
            .collect::<Result<Vec<_>, _>>()?
    } else {
        vec![None; configs.len()]
    };
    if as_json {
        return Ok(render_json(
            capacity, &configs, &results, &limits, dropped, &warm,
        ));
    }
    Ok(render(
        path, cap, &configs, &results, &limits, &strings, &warm,
    ))
}

/// The driver calls of the steps after warm-up, summed over the devices
/// that have them, with memory calls per 100 steps (each device's over its
/// own steps, summed); `None` when no device has steps enough.
fn after_warmup(
    devices: &[DeviceReplay],
    warm: &BTreeMap<u32, (u64, u64)>,
) -> Option<(DriverCalls, f64)> {
    let mut calls = DriverCalls::default();
    let mut per_100 = 0.0;
    let mut any = false;
    for d in devices {
        if let (Some(c), Some(&(_, steps))) = (&d.driver_from_split, warm.get(&d.device)) {
            calls.merge(c);
            per_100 += c.memory_calls() as f64 * 100.0 / steps as f64;
            any = true;
        }
    }
    any.then_some((calls, per_100))
}

/// The `after_warmup` JSON object of one device's replay, or null.
fn after_warmup_json(
    devices: &[DeviceReplay],
    warm: &BTreeMap<u32, (u64, u64)>,
    model: &CostModel,
) -> serde_json::Value {
    let steps: u64 = devices
        .iter()
        .filter_map(|d| warm.get(&d.device))
        .map(|w| w.1)
        .max()
        .unwrap_or(0);
    match after_warmup(devices, warm) {
        None => serde_json::Value::Null,
        Some((calls, per_100)) => json!({
            "steps": steps,
            "driver_calls": calls.total_calls(),
            "driver_memory_calls": calls.memory_calls(),
            "memory_calls_per_100_steps": per_100,
            "driver_ms": model.predict_ms(&calls),
        }),
    }
}

/// Warns when the program set a fraction of a device of another size than
/// `capacity` (as the replay `r` read it from the trace): the replay takes
/// the fraction of its own device, so it caps reserved memory at other
/// bytes than the recording did.
fn warn_other_device(path: &Path, capacity: u64, r: &ReplayResult) {
    let recorded = r.devices.iter().find_map(|d| d.recorded_device_total);
    if let Some(total) = recorded.filter(|&t| t != capacity) {
        input::warn_once(
            &format!("{}: fraction of another device", path.display()),
            &format!(
                "{}: the program set a fraction of a device of {total} bytes; this replay takes it of {capacity} (--capacity {total} reproduces the recording's cap)",
                path.display()
            ),
        );
    }
}

/// One object per configuration: peaks, ratio, driver calls and time.
fn render_json(
    capacity: u64,
    configs: &[String],
    rs: &[ReplayResult],
    limits: &[Option<MinLimit>],
    dropped: u64,
    warm: &BTreeMap<u32, (u64, u64)>,
) -> String {
    let model = CostModel::h200();
    let rows: Vec<serde_json::Value> = configs
        .iter()
        .zip(rs)
        .zip(limits)
        .map(|((c, r), limit)| {
            let by_kind: serde_json::Map<String, serde_json::Value> = r
                .driver
                .rows()
                .map(|(k, calls, handles, bytes, _)| {
                    let v = json!({
                        "calls": calls,
                        "handles": handles,
                        "bytes": bytes,
                        "ms": model.predict_kind(&r.driver, k) / 1000.0,
                    });
                    (k.name().to_string(), v)
                })
                .collect();
            let mut row = json!({
                "config": c,
                "capacity": capacity,
                "events": r.events,
                "dropped": dropped,
                "peak_reserved": r.peak_reserved,
                "peak_allocated": r.peak_allocated,
                "ratio": r.peak_reserved as f64 / r.peak_allocated.max(1) as f64,
                "ooms": r.ooms,
                "alloc_retries": r.alloc_retries(),
                "driver_calls": r.driver.total_calls(),
                "driver_memory_calls": r.driver.memory_calls(),
                "driver_ms": r.driver_ms(&model),
                "driver_calls_by_kind": by_kind,
                "helper_driver_ms": r.helper_ms(&model),
                "defragment_driver_ms": r.defragment_ms,
                "cost_model": model.source,
                "held_at_peak_reserved": held_json(r.devices.iter().map(|d| {
                    (d.held_at_peak_reserved, d.allocated_at_peak_reserved)
                })),
                "after_warmup": after_warmup_json(&r.devices, warm, &model),
                "departure": departure_json(r.departure),
                // The peaks and parts above add up the devices' own.
                "devices": r.devices.iter().map(|d| json!({
                    "device": d.device,
                    "peak_reserved": d.peak_reserved,
                    "peak_allocated": d.peak_allocated,
                    "ooms": d.ooms,
                    "alloc_retries": d.alloc_retries,
                    "held_at_peak_reserved": held_json(std::iter::once(
                        (d.held_at_peak_reserved, d.allocated_at_peak_reserved),
                    )),
                    "after_warmup": after_warmup_json(std::slice::from_ref(d), warm, &model),
                    "departure": departure_json(d.departure),
                })).collect::<Vec<_>>(),
            });
            // Only with `--min-limit`: bytes per device, null when no
            // limit serves the replay.
            if let Some(l) = limit {
                row["min_limit"] = match l {
                    MinLimit::Bytes { limit, .. } => json!(limit),
                    MinLimit::FailsUnlimited | MinLimit::NoneBelowTheDevice => {
                        serde_json::Value::Null
                    }
                };
            }
            row
        })
        .collect();
    let mut out = serde_json::to_string_pretty(&rows).expect("plain values serialize");
    out.push('\n');
    out
}

/// The first allocation after which the replay had obtained other device
/// memory than the recording, or null.
fn departure_json(d: Option<Departure>) -> serde_json::Value {
    d.map_or(serde_json::Value::Null, |d| {
        json!({
            "event_index": d.event_index,
            "time_ns": d.time_ns,
            "replayed_bytes": d.replayed,
            "recorded_bytes": d.recorded,
        })
    })
}

/// Reserved memory at each device's peak by unit (Note [Held memory by
/// unit]), summed over `devices` (`(held, allocated then)`): the used
/// units, what of them no allocation holds, the free units of the default
/// pools and of private pools, and the pool of unmapped handles.
fn held_json(devices: impl Iterator<Item = (Held, u64)>) -> serde_json::Value {
    let (mut used, mut beside, mut free, mut private, mut pooled) = (0, 0, 0, 0, 0);
    for (h, allocated) in devices {
        used += h.used_units;
        beside += h.used_unallocated(allocated);
        free += h.free_units;
        private += h.free_private_units;
        pooled += h.pooled;
    }
    json!({
        "used_units": used,
        "used_units_unallocated": beside,
        "free_units": free,
        "free_private_units": private,
        "pooled": pooled,
    })
}

fn render(
    path: &Path,
    capacity: Capacity,
    configs: &[String],
    rs: &[ReplayResult],
    limits: &[Option<MinLimit>],
    strings: &[String],
    warm: &BTreeMap<u32, (u64, u64)>,
) -> String {
    let mut s = String::new();
    let events = rs.first().map_or(0, |r| r.events);
    let devices = rs.first().map_or(0, |r| r.devices.len());
    let mine = if capacity.recorded {
        " (the recorded device's memory)"
    } else {
        ""
    };
    let _ = writeln!(
        s,
        "replay of {} ({events} events) on {}",
        path.display(),
        match devices {
            0 | 1 => format!("a simulated device of {}{mine}", bytes(capacity.bytes)),
            n => format!(
                "{n} simulated devices of {}{mine} each; peaks, calls and OOMs are their sums",
                bytes(capacity.bytes)
            ),
        }
    );
    let width = configs
        .iter()
        .map(|c| c.len())
        .max()
        .unwrap_or(0)
        .clamp(14, 48);
    let dev = |r: &ReplayResult, f: &dyn Fn(&gpualloc::replay::DeviceReplay) -> f64| {
        r.devices.iter().map(f).fold(0.0, f64::max)
    };
    let mut row = |name: &str, f: &dyn Fn(usize, &ReplayResult) -> String| {
        let _ = write!(s, "{name:<34}");
        for (i, r) in rs.iter().enumerate() {
            let _ = write!(s, " {:>width$}", f(i, r));
        }
        s.push('\n');
    };
    row("config", &|i, _| {
        if configs[i].is_empty() {
            "(defaults)".into()
        } else {
            configs[i].clone()
        }
    });
    row("peak reserved", &|_, r| bytes(r.peak_reserved));
    row("peak allocated", &|_, r| bytes(r.peak_allocated));
    if devices > 1 {
        for k in 0..devices {
            let name = format!(
                "  device {} (reserved / allocated)",
                rs[0].devices[k].device
            );
            row(&name, &|_, r| {
                r.devices.get(k).map_or("-".into(), |d| {
                    format!("{} / {}", bytes(d.peak_reserved), bytes(d.peak_allocated))
                })
            });
        }
    }
    row("peak reserved / peak allocated", &|_, r| {
        format!(
            "{:.3}",
            r.peak_reserved as f64 / r.peak_allocated.max(1) as f64
        )
    });
    if limits.iter().any(Option::is_some) {
        // Against the largest live peak of a device, uncapped: the limit
        // is each device's.
        row("smallest limit without an OOM", &|i, _| match limits[i] {
            Some(MinLimit::Bytes { limit, live }) => {
                format!(
                    "{} ({:.3}x)",
                    bytes(limit),
                    limit as f64 / live.max(1) as f64
                )
            }
            Some(MinLimit::FailsUnlimited) => "fails uncapped".into(),
            Some(MinLimit::NoneBelowTheDevice) => "none below the device".into(),
            None => "-".into(),
        });
    }
    row("unallocated at peak reserved", &|_, r| {
        percent(dev(r, &|d| d.unallocated_fraction_at_peak))
    });
    // Note [Held memory by unit]: where the reserved bytes that no
    // allocation holds lie, summed over devices.
    let held = |r: &ReplayResult, f: &dyn Fn(Held, u64) -> u64| {
        bytes(
            r.devices
                .iter()
                .map(|d| f(d.held_at_peak_reserved, d.allocated_at_peak_reserved))
                .sum(),
        )
    };
    // Beside live blocks: with blocks that wait for events and the claimed
    // rest of stitches in use (Note [Held memory by unit]).
    row("  beside live blocks in their units", &|_, r| {
        held(r, &|h, a| h.used_unallocated(a))
    });
    row("  in free units (cache)", &|_, r| {
        held(r, &|h, _| h.free_units)
    });
    row("  in free units of private pools", &|_, r| {
        held(r, &|h, _| h.free_private_units)
    });
    row("  in pooled handles (unmapped)", &|_, r| {
        held(r, &|h, _| h.pooled)
    });
    row("external frag. at peak reserved", &|_, r| {
        percent(dev(r, &|d| d.external_fragmentation_at_peak))
    });
    row("mean unallocated (per alloc)", &|_, r| {
        percent(dev(r, &|d| d.mean_unallocated_fraction))
    });
    row("segments / maps from the device", &|_, r| {
        r.devices
            .iter()
            .map(|d| d.device_allocs)
            .sum::<u64>()
            .to_string()
    });
    let model = CostModel::h200();
    row("driver calls (memory calls)", &|_, r| {
        format!("{} ({})", r.driver.total_calls(), r.driver.memory_calls())
    });
    row("predicted driver time (H200)", &|_, r| {
        format!("{:.1} ms", r.driver_ms(&model))
    });
    row("  of it on the unmapping thread", &|_, r| {
        format!("{:.1} ms", r.helper_ms(&model))
    });
    row("  of it requests that defragmented", &|_, r| {
        format!("{:.1} ms", r.defragment_ms)
    });
    // Priced as on an idle device: on the GPU each blocks for the work
    // queued before it, which no trace records (`docs/driver-costs.md`).
    row("host waits (each priced idle)", &|_, r| {
        (r.driver.calls(DriverCall::EventSync) + r.driver.calls(DriverCall::CtxSync)).to_string()
    });
    // The steps after the first fifth (`warmup_ends`); none in a trace of
    // fewer than five.
    row("memory calls per 100 later steps", &|_, r| {
        after_warmup(&r.devices, warm).map_or("-".into(), |(_, per_100)| format!("{per_100:.1}"))
    });
    row("  over the steps after the first 1/5", &|_, _| {
        warm.values()
            .map(|w| w.1)
            .max()
            .map_or("none".into(), |n| n.to_string())
    });
    row("release-and-retry allocations", &|_, r| {
        r.alloc_retries().to_string()
    });
    row("failed allocations (OOM)", &|_, r| r.ooms.to_string());
    row("first OOM", &|_, r| match &r.first_oom {
        None => "none".into(),
        Some(o) => format!("{} at {}", bytes(o.requested), duration(o.time_ns)),
    });
    row(
        "  in phase",
        &|_, r| match r.first_oom.as_ref().and_then(|o| o.phase) {
            Some(id) => strings
                .get(id as usize)
                .cloned()
                .unwrap_or_else(|| format!("#{id}")),
            None => "-".into(),
        },
    );
    row("  allocated / reserved then", &|_, r| match &r.first_oom {
        Some(o) => format!("{} / {}", bytes(o.allocated), bytes(o.reserved)),
        None => "-".into(),
    });
    row("  largest free block then", &|_, r| {
        r.first_oom
            .as_ref()
            .map_or("-".into(), |o| bytes(o.largest_free_block))
    });
    row("frees of unknown blocks (skipped)", &|_, r| {
        r.unknown_frees.to_string()
    });
    // Under the recorded configuration: whether the replay made the
    // recording's choices all along; under another, where it first chose
    // otherwise (`Departure`).
    row("memory obtained as recorded", &|_, r| match r.departure {
        None => "to the end".into(),
        Some(d) => format!("until event {} ({})", d.event_index, duration(d.time_ns)),
    });
    s
}
