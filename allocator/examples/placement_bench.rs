//! Judges configurations on many workloads: each trace given, as recorded
//! and with `--seeds` perturbations (`gpualloc::workload::perturbed`), plus
//! the synthetic churn and multi-scale loops with as many seeds (seed 1 of
//! each churn loop is its GPU check's own, `tests/gpu/checks.py`). Prints,
//! per configuration, peak reserved / peak allocated (R/A), predicted
//! driver time and the memory calls made in the last quarter of the events
//! per workload, then the mean and worst R/A, the mean driver time, the
//! worst R/A change against the first configuration, and how many
//! workloads made no memory call in their last quarter.
//!
//! ```text
//! cargo run --release -p gpualloc --example placement_bench -- \
//!     --seeds 6 --trace a.gtrace --trace b.gtrace --config "" --config "key:val"
//! ```
//!
//! `--churn-ops N` sets the two churn loops' length (default 30,000 events; the
//! GPU check runs 200,000), `--long N` adds, per trace with steps and per
//! seed, a run of N steps drawn from its own (`gpualloc::workload::longer`),
//! `--quiet` prints only the summary, `--fixed N` adds N fixed-shape training
//! loops of 120 steps (`gpualloc::workload::fixed_shape`, seeds 1 to N).

use gpualloc::replay::replay_split;
use gpualloc::trace::{TraceEvent, TraceReader};
use gpualloc::workload::{churn, churn_wide, fixed_shape, longer, multiscale, perturbed};
use gpualloc::{Config, CostModel};
use std::collections::BTreeMap;

fn main() {
    // GPUALLOC_LOG=info|debug: the allocator's decisions on stderr.
    gpualloc::log::install_from_env();
    let mut args = std::env::args().skip(1);
    let (mut seeds, mut traces, mut configs, mut quiet) = (4u64, Vec::new(), Vec::new(), false);
    let (mut churn_ops, mut long, mut fixed) = (30_000, 0usize, 0u64);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seeds" => seeds = args.next().and_then(|s| s.parse().ok()).expect("--seeds N"),
            "--trace" => traces.push(args.next().expect("--trace FILE")),
            "--config" => configs.push(args.next().expect("--config CONF")),
            "--quiet" => quiet = true,
            "--fixed" => fixed = args.next().and_then(|s| s.parse().ok()).expect("--fixed N"),
            "--long" => long = args.next().and_then(|s| s.parse().ok()).expect("--long N"),
            "--churn-ops" => {
                churn_ops = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--churn-ops N")
            }
            other => panic!("unknown argument {other}"),
        }
    }
    if configs.is_empty() {
        configs.push(String::new());
    }
    let mut work: Vec<(String, Vec<TraceEvent>)> = Vec::new();
    for t in &traces {
        let mut r = TraceReader::open(std::path::Path::new(t)).expect("a readable trace");
        let evs: Vec<TraceEvent> = r.events().collect();
        let name = std::path::Path::new(t)
            .file_stem()
            .map_or(t.clone(), |s| s.to_string_lossy().into_owned());
        for s in 0..=seeds {
            work.push((
                format!("{name}/{s}"),
                perturbed(evs.iter().copied(), s).collect(),
            ));
        }
        for s in (1..=seeds.max(1)).filter(|_| long > 0) {
            if let Some(l) = longer(&evs, long, s) {
                work.push((format!("{name}/long{s}"), l));
            }
        }
    }
    for s in 1..=seeds {
        // Python's seeds 5.. and 4.. : seed 1 is each GPU check's own loop.
        let py = u32::try_from(s).expect("a seed below 2^32");
        work.push((format!("churn_wide/{s}"), churn_wide(4 + py, churn_ops)));
        work.push((format!("churn/{s}"), churn(3 + py, churn_ops)));
        work.push((format!("multiscale/{s}"), multiscale(s, 60)));
    }
    for s in 1..=fixed {
        work.push((format!("fixed_shape/{s}"), fixed_shape(s, 120)));
    }
    let model = CostModel::h200();
    // results[config][workload] = (ratio, ms, memory calls in the last quarter)
    let mut results: Vec<Vec<(f64, f64, u64)>> = Vec::new();
    for c in &configs {
        let config = Config::parse(c).expect("a valid configuration");
        let row = work
            .iter()
            .map(|(_, evs)| {
                // The last quarter of the events: what a run still pays
                // once its layout should have settled.
                let split = evs.get(evs.len() * 3 / 4).map_or(u64::MAX, |e| e.time_ns);
                let r = replay_split(
                    evs.iter().copied(),
                    140 << 30,
                    &config,
                    &BTreeMap::from([(0, split)]),
                );
                assert_eq!(r.ooms, 0, "{c}: out of memory");
                let late = r
                    .devices
                    .iter()
                    .filter_map(|d| d.driver_from_split.as_ref())
                    .map(|d| d.memory_calls())
                    .sum::<u64>();
                (
                    r.peak_reserved as f64 / r.peak_allocated.max(1) as f64,
                    r.driver_ms(&model),
                    late,
                )
            })
            .collect();
        results.push(row);
    }
    if !quiet {
        print!("{:<24}", "workload");
        for i in 0..configs.len() {
            print!(" {:>23}", format!("config {i}"));
        }
        println!();
        for (w, (name, _)) in work.iter().enumerate() {
            print!("{name:<24}");
            for r in &results {
                print!(" {:>8.4} {:>7.1} {:>6}", r[w].0, r[w].1, r[w].2);
            }
            println!();
        }
    }
    for (i, c) in configs.iter().enumerate() {
        let r = &results[i];
        let n = r.len() as f64;
        let mean = r.iter().map(|x| x.0).sum::<f64>() / n;
        let worst = r.iter().map(|x| x.0).fold(0.0, f64::max);
        let ms = r.iter().map(|x| x.1).sum::<f64>() / n;
        let delta = r
            .iter()
            .zip(&results[0])
            .map(|(a, b)| a.0 - b.0)
            .fold(f64::MIN, f64::max);
        let wins = r.iter().zip(&results[0]).filter(|(a, b)| a.0 < b.0).count();
        let losses = r.iter().zip(&results[0]).filter(|(a, b)| a.0 > b.0).count();
        let settled = r.iter().filter(|x| x.2 == 0).count();
        println!(
            "config {i} {c:?}: mean R/A {mean:.4}, worst {worst:.4}, mean driver {ms:.1} ms, worst change {delta:+.4}, better/worse on {wins}/{losses} of {}, no memory call in the last quarter on {settled}",
            r.len()
        );
    }
}
