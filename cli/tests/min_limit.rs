//! `replay --min-limit`: the smallest memory limit under which a
//! configuration's replay has no OOM, checked against replays at that
//! limit and one page under it.

use serde_json::Value;

mod common;

const OOM_EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../examples/yolo-style-oom.gtrace"
);

const PAGE: u64 = 2 << 20;

/// `replay` of the example on a device of `capacity` under `configs`,
/// with `flags` (`--json`, `--min-limit`); its stdout.
fn replay(capacity: &str, flags: &[&str], configs: &[&str]) -> String {
    let mut args = vec!["replay", OOM_EXAMPLE, "--capacity", capacity];
    args.extend(flags);
    for c in configs {
        args.extend(["--config", c]);
    }
    common::ok(&args).0
}

/// The JSON objects of [`replay`] with `--json`.
fn rows(capacity: &str, flags: &[&str], configs: &[&str]) -> Vec<Value> {
    let mut flags = flags.to_vec();
    flags.push("--json");
    let text = replay(capacity, &flags, configs);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    v.as_array().expect("one object per configuration").clone()
}

/// Replay figures of the example under `config` on 140 GiB.
fn one(config: &str) -> Value {
    rows("140GiB", &[], &[config]).remove(0)
}

/// The limit found passes, one page less fails, and it lies between the
/// live peak and the uncapped peak reserved; a 1700 MiB cap in the
/// configuration is replaced, not added to (the policy the trace was
/// recorded with fails under it, and needs more).
#[test]
fn the_limit_found_passes_and_a_page_less_fails() {
    let recorded = "memory_limit:1700MiB,defragment_pressure:1";
    let configs = [recorded, "memory_limit:1700MiB", "defragment_headroom:0.05"];
    let found = rows("140GiB", &["--min-limit"], &configs);
    assert!(one(recorded)["ooms"].as_u64().unwrap() > 0);
    assert!(found[0]["min_limit"].as_u64().unwrap() > 1700 << 20);
    for (row, config) in found.iter().zip(configs) {
        let limit = row["min_limit"].as_u64().expect("a limit");
        assert_eq!(limit % PAGE, 0, "{config}: whole pages");
        let uncapped = config
            .split(',')
            .filter(|kv| !kv.starts_with("memory_limit:"))
            .collect::<Vec<_>>()
            .join(",");
        let free = one(&uncapped);
        let live = free["peak_allocated"].as_u64().unwrap();
        let reserved = free["peak_reserved"].as_u64().unwrap();
        assert!(
            live <= limit && limit <= reserved.div_ceil(PAGE) * PAGE,
            "{config}: {limit} outside [{live}, {reserved}]"
        );
        let ooms = |l: u64| {
            let capped = if uncapped.is_empty() {
                format!("memory_limit:{l}")
            } else {
                format!("{uncapped},memory_limit:{l}")
            };
            one(&capped)["ooms"].as_u64().unwrap()
        };
        assert_eq!(ooms(limit), 0, "{config}: fails at {limit}");
        assert!(
            ooms(limit - PAGE) > 0,
            "{config}: passes a page under {limit}"
        );
    }
}

/// A device too small for the live peak: no limit serves the run, said as
/// such (null in JSON, words in the table), not a number.
#[test]
fn a_run_that_fails_uncapped_has_no_limit() {
    let r = rows("1GiB", &["--min-limit"], &[""]);
    assert!(r[0]["min_limit"].is_null(), "{}", r[0]["min_limit"]);
    let table = replay("1GiB", &["--min-limit"], &[""]);
    assert!(table.contains("fails uncapped"), "{table}");
}

/// Without the flag, neither the row nor the field appears (the JSON's
/// fields stay those the command documents).
#[test]
fn without_the_flag_nothing_is_searched() {
    assert!(one("").get("min_limit").is_none());
    let table = replay("140GiB", &[], &[""]);
    assert!(!table.contains("smallest limit"), "{table}");
}
