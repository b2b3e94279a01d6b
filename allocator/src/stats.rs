//! Statistics with PyTorch's names (`torch.cuda.memory_stats`).
//!
//! Gauges ([`Stat`]: current and peak, with the cumulative `allocated` and
//! `freed` beside them) are kept per pool kind in a [`StatArray`] indexed by
//! `all`, `small_pool` and `large_pool`. Monotonic counters (`num_*`) are
//! plain integers. Ratios such as fragmentation are never stored: they are
//! computed by methods on the allocator from its blocks.

use crate::size_class::PoolKind;

/// One gauge: PyTorch's `Stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: i64,
    /// Highest value since the last peak reset.
    pub peak: i64,
    /// Sum of all increases since the last accumulated reset.
    pub allocated: i64,
    /// Sum of all decreases since the last accumulated reset.
    pub freed: i64,
}

impl Stat {
    /// Adds `amount` (which may be negative).
    #[inline]
    pub fn update(&mut self, amount: i64) {
        self.current += amount;
        if amount > 0 {
            self.allocated += amount;
            self.peak = self.peak.max(self.current);
        } else {
            self.freed -= amount;
        }
    }
}

/// The pools of a [`StatArray`], in field order.
pub const STAT_POOLS: [&str; 3] = ["all", "small_pool", "large_pool"];

/// A gauge for `all`, `small_pool` and `large_pool`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    /// Both pools together.
    pub all: Stat,
    /// The small pool (requests ≤ 1 MiB).
    pub small_pool: Stat,
    /// The large pool.
    pub large_pool: Stat,
}

impl StatArray {
    /// Adds `amount` to `all` and to the pool's own stat.
    #[inline]
    pub fn update(&mut self, kind: PoolKind, amount: i64) {
        self.all.update(amount);
        match kind {
            PoolKind::Small => self.small_pool.update(amount),
            PoolKind::Large => self.large_pool.update(amount),
        }
    }

    /// The three stats with PyTorch's pool names.
    pub fn named(&self) -> [(&'static str, &Stat); 3] {
        let [all, small, large] = STAT_POOLS;
        [
            (all, &self.all),
            (small, &self.small_pool),
            (large, &self.large_pool),
        ]
    }

    fn for_each(&mut self, f: impl Fn(&mut Stat)) {
        f(&mut self.all);
        f(&mut self.small_pool);
        f(&mut self.large_pool);
    }
}

/// What a stat is: how `DeviceStats` stores it and which keys it flattens to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatKind {
    /// A [`StatArray`]: keys `name.{all,small_pool,large_pool}.{current,peak,allocated,freed}`.
    Array,
    /// One [`Stat`]: keys `name.{current,peak,allocated,freed}`.
    Gauge,
    /// A plain `i64` that only grows between resets (`num_*`): key `name`.
    Counter,
    /// A plain `i64` read from the configuration: key `name`.
    Setting,
}

/// Whether torch's own C++ `DeviceStats` has a field of this name (what
/// the bridge's `getDeviceStats` must fill from `GpuallocStats`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InTorch {
    /// Every torch the bridge supports (2.6 on) has it: the bridge fills it.
    Yes,
    /// Only newer torch has it, so the bridge cannot name it; torch's
    /// default (0) stands, which is gpualloc's value too.
    Newer,
    /// gpualloc's addition, reported through `memory_stats()` only.
    No,
}

/// One row of [`STATS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatDef {
    /// The field of [`DeviceStats`] and of `GpuallocStats`, and the key (or
    /// key prefix) in `torch.cuda.memory_stats()`.
    pub name: &'static str,
    /// How it is stored.
    pub kind: StatKind,
    /// `reset_peak` sets its peaks to their current values.
    pub reset_peak: bool,
    /// `reset_accumulated` zeroes it (a counter) or its `allocated` and
    /// `freed` (a gauge).
    pub reset_accumulated: bool,
    /// In torch's `DeviceStats`.
    pub torch: InTorch,
    /// The `GpuallocStats` version that appended the field (0: not in the
    /// C struct). Within a version, C fields follow this table's order.
    pub c_version: u32,
    /// The field's documentation (the same words in every language).
    pub doc: &'static str,
}

/// A stat read through the table ([`DeviceStats::get`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatValue<'a> {
    /// [`StatKind::Array`].
    Array(&'a StatArray),
    /// [`StatKind::Gauge`].
    Gauge(&'a Stat),
    /// [`StatKind::Counter`] and [`StatKind::Setting`].
    Value(i64),
}

/// A stat changed through the table ([`DeviceStats::get_mut`]).
#[derive(Debug)]
pub enum StatMut<'a> {
    /// [`StatKind::Array`].
    Array(&'a mut StatArray),
    /// [`StatKind::Gauge`].
    Gauge(&'a mut Stat),
    /// [`StatKind::Counter`] and [`StatKind::Setting`].
    Value(&'a mut i64),
}

// Note [One table for stats]
//
// Every stat is defined once, below: its doc, kind, what the two resets do,
// whether torch's DeviceStats has it and the C struct version that added it.
// The macro makes the `DeviceStats` struct, the `STATS` table and the
// accessors from it; `flat`, `flat_keys`, `reset_peak` and
// `reset_accumulated` walk the table. What cannot be generated from Rust is
// checked against it by tests: the C struct and its header
// (capi/src/stats/table_tests.rs), the Python ctypes mirror, the key list and
// the bridge (python-shim/tests/test_stats_table.py, through
// docs/stats.md, which is this table rendered and kept up to date by
// `docs_table_is_up_to_date`). Adding a stat: add a row here with the next
// `c_version`; append the field to `GpuallocStats` (and `to_c`) and to the
// Python `Stats`; regenerate the header (UPDATE_HEADER=1) and docs/stats.md
// (UPDATE_DOCS=1). Each list forgotten fails a test that names it.
macro_rules! stats_table {
    ($(
        $(#[doc = $doc:literal])+
        $name:ident: $kind:ident, peak: $peak:literal, accumulated: $acc:literal,
            torch: $torch:ident, c: $c:literal;
    )*) => {
        /// PyTorch's `DeviceStats`, key for key, plus gpualloc's counters.
        /// Generated from the table of Note \[One table for stats\].
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct DeviceStats {
            $( $(#[doc = $doc])+ pub $name: stats_table!(@type $kind), )*
        }

        /// Every stat of [`DeviceStats`], in field order (Note \[One table for stats\]).
        pub const STATS: &[StatDef] = &[$(
            StatDef {
                name: stringify!($name),
                kind: StatKind::$kind,
                reset_peak: $peak,
                reset_accumulated: $acc,
                torch: InTorch::$torch,
                c_version: $c,
                doc: concat!($($doc, "\n"),+),
            },
        )*];

        impl DeviceStats {
            /// The stat of `STATS[index]`; `None` past the end.
            pub fn get(&self, index: usize) -> Option<StatValue<'_>> {
                let mut i = 0;
                $(
                    if i == index {
                        return Some(stats_table!(@value $kind, self.$name));
                    }
                    i += 1;
                )*
                let _ = i;
                None
            }

            /// The stat of `STATS[index]`, mutably; `None` past the end.
            pub fn get_mut(&mut self, index: usize) -> Option<StatMut<'_>> {
                let mut i = 0;
                $(
                    if i == index {
                        return Some(stats_table!(@mut $kind, self.$name));
                    }
                    i += 1;
                )*
                let _ = i;
                None
            }
        }
    };
    (@type Array) => { StatArray };
    (@type Gauge) => { Stat };
    (@type Counter) => { i64 };
    (@type Setting) => { i64 };
    (@value Array, $e:expr) => { StatValue::Array(&$e) };
    (@value Gauge, $e:expr) => { StatValue::Gauge(&$e) };
    (@value Counter, $e:expr) => { StatValue::Value($e) };
    (@value Setting, $e:expr) => { StatValue::Value($e) };
    (@mut Array, $e:expr) => { StatMut::Array(&mut $e) };
    (@mut Gauge, $e:expr) => { StatMut::Gauge(&mut $e) };
    (@mut Counter, $e:expr) => { StatMut::Value(&mut $e) };
    (@mut Setting, $e:expr) => { StatMut::Value(&mut $e) };
}

stats_table! {
    /// Live allocations.
    allocation: Array, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Bytes of live allocations (rounded block sizes).
    allocated_bytes: Array, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Bytes the callers asked for, until the free completes.
    requested_bytes: Array, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Blocks allocated or waiting on events.
    active: Array, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Bytes of active blocks.
    active_bytes: Array, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Segments obtained from the backend.
    segment: Array, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Bytes obtained from the backend.
    reserved_bytes: Array, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Free pieces of split segments.
    inactive_split: Array, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Bytes of free pieces of split segments.
    inactive_split_bytes: Array, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Allocations of at least `max_split_size`.
    oversize_allocations: Gauge, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Segments of at least `max_split_size`.
    oversize_segments: Gauge, peak: true, accumulated: true, torch: Yes, c: 1;
    /// Backend allocations retried after releasing every cached segment.
    num_alloc_retries: Counter, peak: false, accumulated: true, torch: Yes, c: 1;
    /// Out-of-memory errors returned.
    num_ooms: Counter, peak: false, accumulated: true, torch: Yes, c: 1;
    /// Times every outstanding event was waited for.
    num_sync_all_streams: Counter, peak: false, accumulated: true, torch: Yes, c: 1;
    /// Backend allocations: creations of physical memory (a batch of
    /// handles counts one; pages mapped again from the pool count none,
    /// where PyTorch counts every map of expandable segments).
    num_device_alloc: Counter, peak: false, accumulated: true, torch: Yes, c: 1;
    /// Backend releases: physical memory handed back (one `empty_cache`
    /// counts one, however many ranges it unmaps).
    num_device_free: Counter, peak: false, accumulated: true, torch: Yes, c: 1;
    /// Requests rejected before any driver call (PyTorch's
    /// `throw_on_cudamalloc_oom`; gpualloc never rejects, so always 0).
    num_oom_rejections: Counter, peak: false, accumulated: true, torch: Newer, c: 2;
    /// Blocks taken from another stream's cache (gpualloc's addition).
    num_cross_stream_reuse: Counter, peak: false, accumulated: true, torch: No, c: 1;
    /// Trace records that could not be written since the last accumulated
    /// reset (gpualloc's addition; the trace's own END block and
    /// `trace_stop` count every loss since `trace_start`).
    num_trace_dropped: Counter, peak: false, accumulated: true, torch: No, c: 1;
    /// Times free pages were unmapped to be mapped where a request fits,
    /// instead of growing (Note \[Defragmentation\]; gpualloc's addition).
    num_defragment: Counter, peak: false, accumulated: true, torch: No, c: 2;
    /// Stitched ranges built (Note \[Stitching\]; gpualloc's addition).
    num_stitch: Counter, peak: false, accumulated: true, torch: No, c: 2;
    /// Driver calls of every kind (filled in when stats are read; the
    /// accumulated reset moves their baseline).
    num_driver_calls: Counter, peak: false, accumulated: true, torch: No, c: 2;
    /// Driver calls that obtain, map, unmap or return memory.
    num_driver_memory_calls: Counter, peak: false, accumulated: true, torch: No, c: 2;
    /// Nanoseconds spent in driver calls, where the backend measures it.
    driver_time_ns: Counter, peak: false, accumulated: true, torch: No, c: 2;
    /// The configured `max_split_size` (-1 when unlimited, as PyTorch reports it).
    max_split_size: Setting, peak: false, accumulated: false, torch: Yes, c: 1;
}

/// The four fields of a [`Stat`], in field order (`current` first).
pub const STAT_FIELDS: [&str; 4] = ["current", "peak", "allocated", "freed"];

fn stat_values(s: &Stat) -> [i64; 4] {
    [s.current, s.peak, s.allocated, s.freed]
}

impl DeviceStats {
    /// All-zero stats of a device under `config` (`max_split_size` filled in).
    pub fn for_config(config: &crate::config::Config) -> DeviceStats {
        DeviceStats {
            max_split_size: if config.max_split_size == u64::MAX {
                -1
            } else {
                config.max_split_size as i64
            },
            ..DeviceStats::default()
        }
    }

    /// The stats the table marks [`StatKind::Array`], with their PyTorch names.
    pub fn arrays(&self) -> Vec<(&'static str, &StatArray)> {
        (0..STATS.len())
            .filter_map(|i| match self.get(i) {
                Some(StatValue::Array(a)) => Some((STATS[i].name, a)),
                _ => None,
            })
            .collect()
    }

    /// Every stat as flat `(key, value)` pairs, named exactly as
    /// `torch.cuda.memory_stats()` names them (`allocated_bytes.all.peak`, ...),
    /// sorted by key.
    pub fn flat(&self) -> Vec<(String, i64)> {
        let mut out = Vec::with_capacity(128);
        for (i, def) in STATS.iter().enumerate() {
            let name = def.name;
            match self.get(i).expect("STATS and DeviceStats agree") {
                StatValue::Array(a) => {
                    for (pool, s) in a.named() {
                        for (field, v) in STAT_FIELDS.into_iter().zip(stat_values(s)) {
                            out.push((format!("{name}.{pool}.{field}"), v));
                        }
                    }
                }
                StatValue::Gauge(s) => {
                    for (field, v) in STAT_FIELDS.into_iter().zip(stat_values(s)) {
                        out.push((format!("{name}.{field}"), v));
                    }
                }
                StatValue::Value(v) => out.push((name.to_string(), v)),
            }
        }
        out.sort();
        out
    }

    /// The keys of [`flat`](Self::flat), in its order.
    pub fn flat_keys() -> Vec<String> {
        DeviceStats::default()
            .flat()
            .into_iter()
            .map(|(k, _)| k)
            .collect()
    }

    /// Distinct non-zero values in every field (field `i` of stat `n` gets
    /// about `100 * n + i`), for tests that check a copy or a reset touches
    /// the right fields.
    #[doc(hidden)]
    pub fn numbered() -> DeviceStats {
        let mut d = DeviceStats::default();
        for n in 0..STATS.len() {
            let base = 100 * n as i64;
            let fill = |s: &mut Stat, off: i64| {
                *s = Stat {
                    current: base + off + 1,
                    peak: base + off + 2,
                    allocated: base + off + 3,
                    freed: base + off + 4,
                }
            };
            match d.get_mut(n).expect("STATS and DeviceStats agree") {
                StatMut::Array(a) => {
                    fill(&mut a.all, 0);
                    fill(&mut a.small_pool, 10);
                    fill(&mut a.large_pool, 20);
                }
                StatMut::Gauge(s) => fill(s, 0),
                StatMut::Value(v) => *v = base + 1,
            }
        }
        d
    }

    /// Applies `f` to every stat the table marks with `pick`.
    fn for_each_marked(&mut self, pick: impl Fn(&StatDef) -> bool, f: impl Fn(StatMut<'_>)) {
        for (i, def) in STATS.iter().enumerate() {
            if pick(def) {
                f(self.get_mut(i).expect("STATS and DeviceStats agree"));
            }
        }
    }

    /// `reset_peak_memory_stats`: every peak becomes its current value (the
    /// stats marked `peak: true`).
    pub fn reset_peak(&mut self) {
        let reset = |s: &mut Stat| s.peak = s.current;
        self.for_each_marked(
            |d| d.reset_peak,
            |m| match m {
                StatMut::Array(a) => a.for_each(reset),
                StatMut::Gauge(s) => reset(s),
                StatMut::Value(_) => unreachable!("a plain value has no peak"),
            },
        );
    }

    /// `reset_accumulated_memory_stats`: cumulative fields and `num_*`
    /// counters go to 0 (the stats marked `accumulated: true`).
    pub fn reset_accumulated(&mut self) {
        let reset = |s: &mut Stat| {
            s.allocated = 0;
            s.freed = 0;
        };
        self.for_each_marked(
            |d| d.reset_accumulated,
            |m| match m {
                StatMut::Array(a) => a.for_each(reset),
                StatMut::Gauge(s) => reset(s),
                StatMut::Value(v) => *v = 0,
            },
        );
    }
}

#[cfg(test)]
mod tests;
