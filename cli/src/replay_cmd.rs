//! The `replay` command: one pass of the trace per configuration, the
//! results side by side.

use std::fmt::Write;
use std::path::Path;

use gpualloc::Config;
use gpualloc::replay::{ReplayResult, replay};

use crate::input::{self, CliError};
use crate::units::{bytes, duration, percent};

/// Replays `path` under each configuration (the trace's own when none).
pub fn run(
    path: &Path,
    capacity: u64,
    configs: &[String],
    allow_truncated: bool,
) -> Result<String, CliError> {
    let recorded = input::open(path)?.header().config.clone();
    let configs: Vec<String> = if configs.is_empty() {
        vec![recorded]
    } else {
        configs.to_vec()
    };
    let mut results = Vec::new();
    let mut strings = Vec::new();
    for c in &configs {
        let config = Config::parse(c).map_err(|e| CliError(format!("--config {c:?}: {e}")))?;
        let mut reader = input::open(path)?;
        let r = replay(reader.events(), capacity, &config);
        if let Some(e) = reader.take_error()
            && !allow_truncated
        {
            return Err(CliError(format!(
                "{}: {e} (after {} events); pass --allow-truncated to replay the readable prefix",
                path.display(),
                r.events
            )));
        }
        strings = reader.strings().to_vec();
        results.push(r);
    }
    Ok(render(path, capacity, &configs, &results, &strings))
}

fn render(
    path: &Path,
    capacity: u64,
    configs: &[String],
    rs: &[ReplayResult],
    strings: &[String],
) -> String {
    let mut s = String::new();
    let events = rs.first().map_or(0, |r| r.events);
    let _ = writeln!(
        s,
        "replay of {} ({events} events) on a simulated device of {}",
        path.display(),
        bytes(capacity)
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
    row("peak reserved / peak allocated", &|_, r| {
        format!(
            "{:.3}",
            r.peak_reserved as f64 / r.peak_allocated.max(1) as f64
        )
    });
    row("unallocated at peak reserved", &|_, r| {
        percent(dev(r, &|d| d.unallocated_fraction_at_peak))
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
    row("release-and-retry allocations", &|_, r| {
        r.devices
            .iter()
            .map(|d| d.alloc_retries)
            .sum::<u64>()
            .to_string()
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
    s
}
