//! Stats (reference §2): PyTorch's keys, and the semantics of
//! `reset_peak_memory_stats` and `reset_accumulated_memory_stats`.

use gpualloc::{InTorch, STATS};
use gpualloc_tests::{Checked, MIB};

const ARRAYS: [&str; 9] = [
    "allocation",
    "allocated_bytes",
    "requested_bytes",
    "active",
    "active_bytes",
    "segment",
    "reserved_bytes",
    "inactive_split",
    "inactive_split_bytes",
];
const FIELDS: [&str; 4] = ["current", "peak", "allocated", "freed"];

fn pytorch_keys() -> Vec<String> {
    let mut keys = Vec::new();
    for a in ARRAYS {
        for pool in ["all", "small_pool", "large_pool"] {
            for f in FIELDS {
                keys.push(format!("{a}.{pool}.{f}"));
            }
        }
    }
    for s in ["oversize_allocations", "oversize_segments"] {
        for f in FIELDS {
            keys.push(format!("{s}.{f}"));
        }
    }
    for k in [
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "max_split_size",
    ] {
        keys.push(k.to_string());
    }
    keys
}

#[test]
fn every_pytorch_key_is_present_and_sorted() {
    let c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let flat = c.stats().flat();
    let names: Vec<&str> = flat.iter().map(|(k, _)| k.as_str()).collect();
    for k in pytorch_keys() {
        assert!(names.contains(&k.as_str()), "missing {k}");
    }
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted, "sorted, as memory_stats() returns them");
    sorted.dedup();
    assert_eq!(sorted.len(), names.len(), "no duplicate key");
}

/// Regression (fixed in cfa8ee0): torch 2.1x's `memory_stats()` also has `num_oom_rejections`
/// (reference §2); code that indexes it raised KeyError on gpualloc's dict.
#[test]
fn newer_pytorch_key_num_oom_rejections_is_present() {
    let c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    assert!(
        c.stats()
            .flat()
            .iter()
            .any(|(k, v)| k == "num_oom_rejections" && *v == 0)
    );
}

/// The table's torch column against PyTorch's keys above: the stats it
/// marks as torch's (every supported version, or newer ones) flatten to
/// exactly those keys, so the bridge check in python-shim/tests, which
/// trusts the column, checks the right fields.
#[test]
fn table_torch_column_is_pytorchs_keys() {
    let mut from_table: Vec<String> = Vec::new();
    for k in gpualloc::DeviceStats::flat_keys() {
        let def = STATS
            .iter()
            .find(|s| k == s.name || k.starts_with(&format!("{}.", s.name)))
            .expect("every key comes from a row");
        if def.torch != InTorch::No {
            from_table.push(k);
        }
    }
    let mut want = pytorch_keys();
    want.push("num_oom_rejections".to_string());
    want.sort();
    assert_eq!(from_table, want);
    let newer: Vec<&str> = STATS
        .iter()
        .filter(|s| s.torch == InTorch::Newer)
        .map(|s| s.name)
        .collect();
    assert_eq!(newer, ["num_oom_rejections"]);
}

#[test]
fn cumulative_fields_and_pools() {
    let mut c = Checked::with(1 << 30, "policy:pytorch,cross_stream_reuse:true");
    let a = c.alloc(1000, 0);
    let b = c.alloc(12 * MIB, 0);
    c.release(a);
    c.release(b);
    assert_eq!(c.stat("allocation.all.allocated"), 2);
    assert_eq!(c.stat("allocation.all.freed"), 2);
    assert_eq!(c.stat("allocation.small_pool.allocated"), 1);
    assert_eq!(c.stat("allocated_bytes.small_pool.allocated"), 1024);
    assert_eq!(c.stat("requested_bytes.small_pool.allocated"), 1000);
    assert_eq!(c.stat("allocated_bytes.large_pool.peak"), 12 * MIB as i64);
    assert_eq!(c.stat("allocated_bytes.all.peak"), 12 * MIB as i64 + 1024);
    assert_eq!(c.stat("reserved_bytes.all.current"), 14 * MIB as i64);
    assert_eq!(c.stat("segment.all.allocated"), 2);
    assert_eq!(c.stat("num_device_alloc"), 2);
    assert_eq!(c.stat("max_split_size"), -1);
}

#[test]
fn reset_peak_sets_every_peak_to_current() {
    let mut c = Checked::with(
        1 << 30,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:20",
    );
    let a = c.alloc(30 * MIB, 0);
    let b = c.alloc(4096, 0);
    c.release(a);
    let before = c.stats().clone();
    c.dev.reset_peak_stats();
    c.check();
    let s = c.stats();
    for (name, arr) in s.arrays() {
        for (pool, st) in arr.named() {
            assert_eq!(st.peak, st.current, "{name}.{pool}");
        }
    }
    assert_eq!(s.oversize_allocations.peak, 0);
    assert_eq!(
        s.allocated_bytes.all.allocated, before.allocated_bytes.all.allocated,
        "totals kept"
    );
    assert_eq!(s.num_device_alloc, before.num_device_alloc);
    c.release(b);
    assert_eq!(c.stat("allocated_bytes.all.peak"), 4096);
}

#[test]
fn reset_accumulated_zeroes_totals_and_counters() {
    let mut c = Checked::with(
        64 * MIB,
        "policy:pytorch,cross_stream_reuse:true,max_split_size_mb:20",
    );
    let a = c.alloc(30 * MIB, 0);
    c.release(a);
    let _ = c.malloc(100 * MIB, 0);
    let b = c.alloc(4096, 0);
    let before = c.stats().clone();
    c.dev.reset_accumulated_stats();
    c.check();
    let s = c.stats();
    for (name, arr) in s.arrays() {
        for (pool, st) in arr.named() {
            assert_eq!((st.allocated, st.freed), (0, 0), "{name}.{pool}");
        }
    }
    assert_eq!(
        (s.num_ooms, s.num_alloc_retries, s.num_sync_all_streams),
        (0, 0, 0)
    );
    assert_eq!((s.num_device_alloc, s.num_device_free), (0, 0));
    assert_eq!(s.oversize_segments.allocated, 0);
    assert_eq!(
        s.allocated_bytes.all.current, before.allocated_bytes.all.current,
        "current kept"
    );
    assert_eq!(
        s.allocated_bytes.all.peak, before.allocated_bytes.all.peak,
        "peak kept"
    );
    assert_eq!(
        s.max_split_size,
        20 * MIB as i64,
        "a setting, not a counter"
    );
    c.release(b);
    assert_eq!(c.stat("allocation.all.freed"), 1);
}
