//! Judges configurations on many workloads: each trace given, as recorded
//! and with `--seeds` perturbations (`gpualloc::workload::perturbed`), plus
//! the synthetic churn and multi-scale loops with as many seeds (seed 1 of
//! each churn loop is its GPU check's own, `tests/gpu/checks.py`). Prints,
//! per configuration, peak reserved / peak allocated (R/A) and predicted
//! driver time per workload, then the mean and worst R/A, the mean driver
//! time, and the worst R/A change against the first configuration.
//!
//! ```text
//! cargo run --release -p gpualloc --example placement_bench -- \
//!     --seeds 6 --trace a.gtrace --trace b.gtrace --config "" --config "key:val"
//! ```
//!
//! `--churn-ops N` sets the two churn loops' length (default 30,000 events; the
//! GPU check runs 200,000), `--long N` adds, per trace with steps and per
//! seed, a run of N steps drawn from its own (`gpualloc::workload::longer`),
//! `--quiet` prints only the summary.

use gpualloc::replay::replay;
use gpualloc::trace::{TraceEvent, TraceReader};
use gpualloc::workload::{churn, churn_wide, longer, multiscale, perturbed};
use gpualloc::{Config, CostModel};

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut seeds, mut traces, mut configs, mut quiet) = (4u64, Vec::new(), Vec::new(), false);
    let (mut churn_ops, mut long) = (30_000, 0usize);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seeds" => seeds = args.next().and_then(|s| s.parse().ok()).expect("--seeds N"),
            "--trace" => traces.push(args.next().expect("--trace FILE")),
            "--config" => configs.push(args.next().expect("--config CONF")),
            "--quiet" => quiet = true,
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
    let model = CostModel::h200();
    // results[config][workload] = (ratio, ms)
    let mut results: Vec<Vec<(f64, f64)>> = Vec::new();
    for c in &configs {
        let config = Config::parse(c).expect("a valid configuration");
        let row = work
            .iter()
            .map(|(_, evs)| {
                let r = replay(evs.iter().copied(), 140 << 30, &config);
                assert_eq!(r.ooms, 0, "{c}: out of memory");
                (
                    r.peak_reserved as f64 / r.peak_allocated.max(1) as f64,
                    r.driver_ms(&model),
                )
            })
            .collect();
        results.push(row);
    }
    if !quiet {
        print!("{:<24}", "workload");
        for i in 0..configs.len() {
            print!(" {:>16}", format!("config {i}"));
        }
        println!();
        for (w, (name, _)) in work.iter().enumerate() {
            print!("{name:<24}");
            for r in &results {
                print!(" {:>8.4} {:>7.1}", r[w].0, r[w].1);
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
        println!(
            "config {i} {c:?}: mean R/A {mean:.4}, worst {worst:.4}, mean driver {ms:.1} ms, worst change {delta:+.4}, better/worse on {wins}/{losses} of {}",
            r.len()
        );
    }
}
