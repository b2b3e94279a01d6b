//! The stats table (Note [One table for stats]) against the struct, PyTorch's
//! reset rules and docs/stats.md.

use super::*;

#[test]
fn stat_tracks_peak_and_totals() {
    let mut s = Stat::default();
    s.update(10);
    s.update(-4);
    s.update(2);
    assert_eq!(
        s,
        Stat {
            current: 8,
            peak: 10,
            allocated: 12,
            freed: 4
        }
    );
}

#[test]
fn flat_keys_are_pytorchs() {
    let mut d = DeviceStats::default();
    d.allocated_bytes.update(PoolKind::Small, 512);
    let flat = d.flat();
    let get = |k: &str| flat.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    assert_eq!(get("allocated_bytes.all.current"), Some(512));
    assert_eq!(get("allocated_bytes.small_pool.peak"), Some(512));
    assert_eq!(get("allocated_bytes.large_pool.current"), Some(0));
    assert!(get("inactive_split_bytes.all.freed").is_some());
    assert!(get("num_alloc_retries").is_some());
    assert_eq!(flat.len(), 9 * 3 * 4 + 2 * 4 + 14);
    d.reset_accumulated();
    d.update_noop();
}

#[test]
fn table_and_struct_agree() {
    let d = DeviceStats::default();
    let mut names: Vec<&str> = STATS.iter().map(|s| s.name).collect();
    for (i, def) in STATS.iter().enumerate() {
        let kind = match d.get(i).unwrap() {
            StatValue::Array(_) => StatKind::Array,
            StatValue::Gauge(_) => StatKind::Gauge,
            StatValue::Value(_) => def.kind,
        };
        assert_eq!(kind, def.kind, "{}", def.name);
        assert!(!def.doc.trim().is_empty(), "{} has no doc", def.name);
    }
    assert!(d.get(STATS.len()).is_none());
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), STATS.len(), "a name twice");
    assert_eq!(DeviceStats::flat_keys().len(), 9 * 3 * 4 + 2 * 4 + 14);
    // Every field is reachable through the table: a field the macro
    // missed would keep its value here.
    let mut zeroed = DeviceStats::numbered();
    for n in 0..STATS.len() {
        match zeroed.get_mut(n).unwrap() {
            StatMut::Array(a) => *a = StatArray::default(),
            StatMut::Gauge(s) => *s = Stat::default(),
            StatMut::Value(v) => *v = 0,
        }
    }
    assert_eq!(zeroed, DeviceStats::default());
}

/// PyTorch's rules (`resetPeakStats` / `resetAccumulatedStats` in
/// CUDACachingAllocator.cpp): gauges lose their peaks and totals,
/// counters restart, the configured `max_split_size` stays.
#[test]
fn table_resets_follow_pytorch() {
    for def in STATS {
        let expected = match def.kind {
            StatKind::Array | StatKind::Gauge => (true, true),
            StatKind::Counter => (false, true),
            StatKind::Setting => (false, false),
        };
        assert_eq!(
            (def.reset_peak, def.reset_accumulated),
            expected,
            "{}",
            def.name
        );
    }
}

#[test]
fn resets_touch_exactly_what_the_table_says() {
    let before = DeviceStats::numbered();
    let (mut peak, mut acc) = (before.clone(), before.clone());
    peak.reset_peak();
    acc.reset_accumulated();
    let (b, p, a) = (before.flat(), peak.flat(), acc.flat());
    for ((key, was), ((_, after_peak), (_, after_acc))) in b.iter().zip(p.iter().zip(&a)) {
        let def = STATS
            .iter()
            .find(|d| key == d.name || key.starts_with(&format!("{}.", d.name)))
            .unwrap();
        let field = key.rsplit('.').next().unwrap();
        let current = b
            .iter()
            .find(|(k, _)| *k == format!("{}current", key.strip_suffix(field).unwrap()))
            .map(|(_, v)| *v);
        let want_peak = if def.reset_peak && field == "peak" {
            current.unwrap()
        } else {
            *was
        };
        let totals = def.kind == StatKind::Counter || matches!(field, "allocated" | "freed");
        let want_acc = if def.reset_accumulated && totals {
            0
        } else {
            *was
        };
        assert_eq!(*after_peak, want_peak, "reset_peak, {key}");
        assert_eq!(*after_acc, want_acc, "reset_accumulated, {key}");
    }
}

/// Regression: `reset_accumulated` left `num_trace_dropped` (and
/// `num_oom_rejections`) alone, against its documentation ("`num_*`
/// counters go to 0") and PyTorch's rule that every accumulated counter
/// restarts. The trace itself keeps the total since `trace_start` (its
/// END block, `trace_stop`'s summary).
#[test]
fn reset_accumulated_zeroes_num_trace_dropped() {
    let mut d = DeviceStats {
        num_trace_dropped: 3,
        num_oom_rejections: 2,
        ..DeviceStats::default()
    };
    d.reset_accumulated();
    assert_eq!((d.num_trace_dropped, d.num_oom_rejections), (0, 0));
}

/// docs/stats.md is the table rendered (python-shim/tests reads it too).
/// `UPDATE_DOCS=1 cargo test -p gpualloc --lib stats::` rewrites it.
#[test]
fn docs_table_is_up_to_date() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/stats.md");
    let generated = render_docs();
    if std::env::var_os("UPDATE_DOCS").is_some() {
        std::fs::write(path, &generated).expect("write docs/stats.md");
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == generated,
        "docs/stats.md is stale: run `UPDATE_DOCS=1 cargo test -p gpualloc --lib stats::`"
    );
}

fn render_docs() -> String {
    let mut out = String::from(
        "# Stats\n\n\
         Every stat gpualloc keeps, one row each. Generated from the table in\n\
         `allocator/src/stats.rs` (Note [One table for stats]) by\n\
         `UPDATE_DOCS=1 cargo test -p gpualloc --lib stats::`; do not edit by hand.\n\
         The Python tests read it to check the ctypes mirror and the torch bridge.\n\n\
         - Kind: `array` is one gauge per pool, keys\n  \
         `NAME.{all,small_pool,large_pool}.{current,peak,allocated,freed}`;\n  \
         `gauge` has keys `NAME.{current,peak,allocated,freed}`; `counter` and\n  \
         `setting` are one key, `NAME`.\n\
         - `reset_peak` (`torch.cuda.reset_peak_memory_stats`): `peak` sets every\n  \
         peak to its current value.\n\
         - `reset_accumulated` (`torch.cuda.reset_accumulated_memory_stats`):\n  \
         `totals` zeroes `allocated` and `freed`, `zero` zeroes the counter.\n  \
         As in PyTorch, every counter restarts, gauges keep `current` and\n  \
         `peak`, the configured `max_split_size` stays.\n\
         - torch: whether torch's C++ `DeviceStats` has the field (`newer`: only\n  \
         some versions, so the bridge leaves torch's 0).\n\
         - C: the `GpuallocStats` version that appended the field.\n\n\
         | Stat | Kind | reset_peak | reset_accumulated | torch | C | Meaning |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for d in STATS {
        let kind = match d.kind {
            StatKind::Array => "array",
            StatKind::Gauge => "gauge",
            StatKind::Counter => "counter",
            StatKind::Setting => "setting",
        };
        let peak = if d.reset_peak { "peak" } else { "-" };
        let acc = match (d.reset_accumulated, d.kind) {
            (false, _) => "-",
            (true, StatKind::Array | StatKind::Gauge) => "totals",
            (true, _) => "zero",
        };
        let torch = match d.torch {
            InTorch::Yes => "yes",
            InTorch::Newer => "newer",
            InTorch::No => "no",
        };
        let c = match d.c_version {
            0 => "-".to_string(),
            v => format!("v{v}"),
        };
        let doc = d.doc.split_whitespace().collect::<Vec<_>>().join(" ");
        let doc = doc.replace('\\', "");
        out.push_str(&format!(
            "| `{}` | {kind} | {peak} | {acc} | {torch} | {c} | {doc} |\n",
            d.name
        ));
    }
    out.push_str(
        "\nThe driver counters split by kind (`cuMemSetAccess`, `cuMemCreate`,\n\
         `cuEventSynchronize`, ...: calls, handles, bytes and the time measured in\n\
         them) come from `gpualloc.driver_calls()` (C: `gpualloc_driver_calls`), in\n\
         the shape of `gpualloc replay --json`'s `driver_calls_by_kind`, so that a\n\
         run on the GPU and the replay of its trace can be set side by side. The\n\
         accumulated reset moves their baseline too. Their time is the allocating\n\
         thread's: unmapping handed to the helper thread (`unmap_thread`) counts\n\
         once, when given, with only the time spent waiting for it.\n\
         `gpualloc.driver_calls(helper=True)` (C: `gpualloc_helper_driver_calls`)\n\
         gives what that thread did, with its time, a call a handle.\n\
         \n\
         `gpualloc.held()` (C: `gpualloc_held`) splits reserved memory by the unit\n\
         it can be given back in (Note [Held memory by unit] in\n\
         `allocator/src/held.rs`):\n\
         \n\
         - physical handles or plain segments that back a byte in use, and how\n  \
         much of those no allocation holds;\n\
         - free units of the default pools, the cache;\n\
         - free units of private pools still held;\n\
         - pooled handles.\n\
         \n\
         The four parts add up to `reserved_bytes.all.current`. `gpualloc replay`\n\
         gives the same split at the peak of a trace's reserved memory.\n\
         \n\
         Pooled handles are device memory gpualloc holds unmapped (the page pool,\n\
         Note [Page pool] in `allocator/src/page_pool.rs`: pages kept for reuse\n\
         after defragmentation moved them, a private pool's pages after its graph\n\
         was released, pages waiting for their kernels before they are\n\
         unmapped). They count in `reserved_bytes` and `memory_reserved()`, since\n\
         the device has them, but no segment of `memory_snapshot()` lists them,\n\
         having no address: where PyTorch's reserved bytes always equal the sum\n\
         of the snapshot's segment sizes, gpualloc's exceed it by the pooled\n\
         bytes, which `held()` gives (`empty_cache` returns them to the driver).\n\
         \n\
         Two counters differ from PyTorch's for pages that change pools: a pooled\n\
         handle mapped again for the other pool (small or large) counts as freed\n\
         by the one and allocated by the other, in `all` too, so that `all` stays\n\
         the sum of the two pools in every field; `reserved_bytes.all.allocated`\n\
         then exceeds what was obtained from the driver, which\n\
         `num_device_alloc` and the trace's `pages_create` records count.\n",
    );
    out
}

impl DeviceStats {
    fn update_noop(&mut self) {
        self.reset_peak();
        assert_eq!(self.allocated_bytes.all.peak, 512);
        assert_eq!(self.allocated_bytes.all.allocated, 0);
    }
}
