//! Configuration strings from a grammar of every key with boundary,
//! malformed and huge values: `Config::parse` never panics, and an
//! allocator under any accepted configuration serves a random workload on
//! the simulated device with every invariant checked after each call.
//!
//! `GPUALLOC_FUZZ_CASES` raises the number of cases (see README, Fuzzing).

use std::panic::{AssertUnwindSafe, catch_unwind};

use gpualloc::Config;
use gpualloc::config::KEYS;
use gpualloc::workload::Rng;
use gpualloc_tests::Checked;

/// Cases when `GPUALLOC_FUZZ_CASES` is unset.
const CI_CASES: u64 = 10_000;

fn value(rng: &mut Rng) -> String {
    let tokens = [
        "0",
        "1",
        "-1",
        "-0",
        "19",
        "20",
        "64",
        "4096",
        "0.5",
        "1e309",
        "nan",
        "inf",
        "-inf",
        "true",
        "false",
        "",
        " ",
        "1.0",
        ".",
        "0x10",
        "18446744073709551615",
        "18446744073709551616",
        "17592186044416",
        "9999999999999999999999",
        "64MB",
        "1.5g",
        "2TiB",
        "8 kb",
        "1e3",
        "gpualloc",
        "pytorch",
        "[256:1,512:2,>:8]",
        "[>:8,>:4]",
        "[1:1]",
        "[",
        "]",
        "[[",
        "[>:]",
        "[:4]",
        "[0:1]",
        "[18446744073709551615:2]",
        "é",
        "\u{202e}",
        "1,2",
        "a:b",
    ];
    match rng.index(4) {
        0 => rng.next_u64().to_string(),
        1 => format!("{}", (rng.next_u64() % 100_000) as f64 / 1000.0),
        _ => rng.pick(&tokens).to_string(),
    }
}

fn config_string(rng: &mut Rng) -> String {
    let keys: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
    let mut parts = Vec::new();
    for _ in 0..rng.index(5) {
        let key = match rng.index(10) {
            0 => "policy",
            1 => *rng.pick(&["", " ", "unknown_key", "MAX_SPLIT_SIZE_MB", ":", "["]),
            _ => *rng.pick(&keys),
        };
        let sep = *rng.pick(&[":", ":", ":", " : ", "", "::"]);
        parts.push(format!("{key}{sep}{}", value(rng)));
    }
    let join = *rng.pick(&[",", ",", ", ", ",,", ";"]);
    parts.join(join)
}

#[test]
fn any_configuration_string_parses_or_fails_cleanly_and_runs() {
    let cases = std::env::var("GPUALLOC_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CI_CASES);
    let seed: u64 = std::env::var("GPUALLOC_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut accepted = 0;
    for case in 0..cases {
        let mut rng = Rng::xorshift64_star((seed ^ case.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1);
        let s = config_string(&mut rng);
        let parsed = catch_unwind(|| Config::parse(&s)).unwrap_or_else(|_| {
            panic!("case {case} (GPUALLOC_FUZZ_SEED={seed}): Config::parse({s:?}) panicked")
        });
        let Ok(config) = parsed else { continue };
        accepted += 1;
        // A workload under every tenth accepted configuration.
        if accepted % 10 != 1 {
            continue;
        }
        let capacity = 1 << (20 + rng.index(16));
        let run = catch_unwind(AssertUnwindSafe(|| {
            let mut c = Checked::new(capacity, config);
            let mut live = Vec::new();
            for _ in 0..40 {
                if live.is_empty() || rng.index(3) != 0 {
                    let size = 1 + rng.next_u64() % (1 << (4 + rng.index(24)));
                    if let Ok(p) = c.malloc(size, rng.index(3) as u64) {
                        live.push(p);
                    }
                } else {
                    let p = live.swap_remove(rng.index(live.len()));
                    c.free(p).expect("free of a live block");
                }
            }
        }));
        assert!(
            run.is_ok(),
            "case {case} (GPUALLOC_FUZZ_SEED={seed}): the workload under {s:?} panicked"
        );
    }
    assert!(accepted > cases / 20, "only {accepted} of {cases} accepted");
}
