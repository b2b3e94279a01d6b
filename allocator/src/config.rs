//! Allocator configuration, parsed from PyTorch's `key:value,key:[a:b,>:c]` syntax.
//!
//! The string comes from `GPUALLOC_CONF` (or `install(config=...)`). Every key
//! the allocator understands is listed in [`KEYS`], with its meaning; an
//! unknown key or a bad value is a [`ConfigError`] that names it. Nothing is
//! silently ignored.
//!
//! Two policies exist. The default, `policy:gpualloc`, is expandable segments
//! with the page pool and defragmentation (Note \[Defragmentation\] in
//! `expandable.rs`): reserved memory stays within about 1% of live memory.
//! `policy:pytorch` is PyTorch's caching allocator, rule for rule, so that
//! results compare like with like; its peaks match PyTorch's to the byte.
//! `policy` sets the defaults of every other key, wherever it appears in the
//! string; the other keys then override them.
//!
//! | key | value | default | meaning |
//! | --- | --- | --- | --- |
//! | `policy` | `gpualloc` / `pytorch` | gpualloc | the set of defaults below (pytorch: expandable segments, cross-stream reuse, defragmentation and stitching off, 20 MiB expandable pages) |
//! | `max_split_size_mb` | integer, 20–16777216 | unlimited | blocks at least this large are never split ("oversize") |
//! | `max_non_split_rounding_mb` | integer, 0–16777216 | 20 | how much larger than an oversize request a cached oversize block may be |
//! | `garbage_collection_threshold` | 0 < x < 1 | off | with a memory limit set, free old cached plain segments (not expandable ones, as PyTorch) once reserved passes x × limit |
//! | `roundup_power2_divisions` | d, or `[256:1,512:2,>:8]` | 0 | round sizes to one of d steps per power-of-two interval (sizes in MB, increasing, each once, `>` last; d a power of two up to 1024, or 0) |
//! | `large_segment_size_mb` | even integer, 2–1024 | 20 | segment size for requests of 1–10 MiB |
//! | `per_process_memory_fraction` | 0 < x ≤ 1 | 1 | cap reserved memory at x × device memory |
//! | `memory_limit` | bytes, with K/M/G/T/P(iB) suffix, 1 B–1 PiB | none | cap reserved memory at this many bytes (omit the key for no limit; 0 is refused, as ambiguous) |
//! | `cross_stream_reuse` | `true`/`false` | true | let a stream take another stream's cached block (ordered by an event) instead of growing |
//! | `graph_capture_record_stream_reuse` | `true`/`false` | false | during a CUDA graph capture, reuse a block freed while other streams used it once the graph orders every later use after its last ones, instead of at the capture's end (PyTorch's setting of the same name turns it on too; Note [Reuse inside a capture]) |
//! | `expandable_segments` | `true`/`false` | true (false under WSL: the C library's Note [Plain memory on WSL]) | map pages into growing address ranges per (pool, stream) instead of separate segments |
//! | `expandable_page_mb` | even integer, 2–1024 | 2 | mapping granularity of large-pool expandable segments (PyTorch uses the 20 MiB segment size) |
//! | `expandable_handle_mb` | power of two, 2–1024 | 16 | largest physical handle created at once; a mapping of n bytes uses handles of at most n/8 (fewer driver calls, coarser unmapping); re-creating what `empty_cache` gave back, up to twice this whatever n |
//! | `defragment` | `true`/`false` | true | with expandable segments: rather than hold more than `1 + defragment_headroom` times peak allocated memory (at least 1.05 times past `defragment_pressure` of a memory limit), unmap free pages and map them where the request fits |
//! | `defragment_headroom` | 0 ≤ x ≤ 1 | 0.005 | how far held memory may exceed peak allocated memory before defragmenting |
//! | `defragment_pressure` | 0 ≤ x ≤ 1 | 0.5 | once peak allocated memory passes x × the memory limit in force (none: never; the device is not a limit), the headroom is at least 5%: the run grows in place and the out-of-memory path packs it at the limit (1: never; Note [Headroom under pressure]) |
//! | `defragment_budget` | 0 ≤ x ≤ 1 | 0.03 | with `defragment`: the share of elapsed time that defragmenting and stitching may spend in driver calls before defragmentation stops taking the pages cached stitches alias, unless growing instead would raise the most memory ever reserved (0: never; 1: no limit; Note [Defragmentation budget]) |
//! | `unmap_thread` | `true`/`false` | true | with expandable segments: ranges given up (old places of moved pages, stitches torn down) are unmapped by a helper thread (held back while a request maps memory) rather than on the allocating thread (Note [Unmapping off the allocating thread]) |
//! | `defer_unmap` | `true`/`false` | true | with `defragment`: pages taken from a free block whose work may still run are mapped where the request fits at once and unmapped from the old place once that work is done, when the request is on the same stream (Note [Unmapping behind the work]); `false`: the host waits for that work first |
//! | `stitch_min_mb` | integer, 0–1048576 | 32 | with `defragment`: requests of at least this many MiB may be served by stitching free pages into a fresh range (0: never) |
//! | `stitch_budget` | 0 ≤ x ≤ 1 | 0.05 | with `defragment`: the share of elapsed time that defragmenting and stitching may spend in driver calls before stitches are built or repaired only for requests that could not grow instead (1: no limit; Note [Stitch budget]); while it has no credit, defragmentation takes the smallest free runs first (0: always; Note [Reclaim order]) |
//! | `stitch_short_share` | integer, 0–1024 | 0 | with stitching: a request that lacks less than 1/N of its size in its window builds or repairs a stitch only while cached stitches have been taken whole at least as often as built, after the first two (0: off; Note [When a stitch pays]) |
//!
//! A key may appear once. Numbers are plain decimal; a value outside its
//! range is an error, never clamped or wrapped, so no accepted value can
//! overflow the size arithmetic.

use std::fmt;

/// Number of `roundup_power2_divisions` buckets, from 1 MiB up (`kRoundUpPowerOfTwoIntervals`).
pub const POWER2_INTERVALS: usize = 16;

/// Index of the `roundup_power2_divisions` bucket of a size: `log2(size) - 20`,
/// clamped to `[0, 15]`.
pub fn power2_bucket(size: u64) -> usize {
    let log2 = 63 - size.max(1).leading_zeros() as i64;
    (log2 - 20).clamp(0, POWER2_INTERVALS as i64 - 1) as usize
}

/// Every key [`Config::parse`] accepts, with a one-line description.
pub const KEYS: &[(&str, &str)] = &[
    (
        "policy",
        "gpualloc (expandable segments, page pool, defragmentation) or pytorch (PyTorch's exact rules)",
    ),
    (
        "max_split_size_mb",
        "blocks of at least this many MiB are never split (>= 20)",
    ),
    (
        "max_non_split_rounding_mb",
        "slack allowed when an oversize block serves an oversize request (MiB)",
    ),
    (
        "garbage_collection_threshold",
        "fraction of the memory limit above which old cached segments are freed (0 < x < 1)",
    ),
    (
        "roundup_power2_divisions",
        "steps per power-of-two interval: one value or [MB:d,...,>:d]",
    ),
    (
        "large_segment_size_mb",
        "segment size for requests between 1 and 10 MiB (MiB, even, >= 2)",
    ),
    (
        "per_process_memory_fraction",
        "cap on reserved memory as a fraction of the device (0 < x <= 1)",
    ),
    (
        "memory_limit",
        "cap on reserved memory in bytes (suffixes K, M, G, T, KiB, MiB, GiB, TiB)",
    ),
    (
        "cross_stream_reuse",
        "reuse another stream's cached blocks, ordered by an event, before growing (true/false)",
    ),
    (
        "graph_capture_record_stream_reuse",
        "during a CUDA graph capture, reuse a block freed while other streams used it once the graph orders later work after its last uses (true/false)",
    ),
    (
        "expandable_page_mb",
        "page size of large-pool expandable segments in MiB (even, >= 2)",
    ),
    (
        "expandable_handle_mb",
        "largest physical handle created at once, in MiB (a power of two, 2 to 1024)",
    ),
    (
        "defragment",
        "with expandable segments, remap free pages rather than hold more than peak allocated memory plus the headroom (true/false)",
    ),
    (
        "defer_unmap",
        "with defragment, move pages whose work may still run at once and unmap their old place once it is done, rather than wait (true/false)",
    ),
    (
        "unmap_thread",
        "with expandable segments, unmap ranges given up on a helper thread rather than the allocating thread (true/false)",
    ),
    (
        "stitch_min_mb",
        "requests of at least this many MiB may be stitched from free pages (0: never)",
    ),
    (
        "defragment_headroom",
        "fraction by which held memory may exceed peak allocated memory before defragmenting (0 to 1)",
    ),
    (
        "defragment_pressure",
        "share of the memory limit that peak allocated memory passes before the headroom is at least 5% (0 to 1; 1: never; no limit: never)",
    ),
    (
        "defragment_budget",
        "share of elapsed time defragmenting may spend in driver calls before it stops taking pages that cached stitches alias (0 to 1; 1: no limit)",
    ),
    (
        "stitch_budget",
        "share of elapsed time defragmenting may spend in driver calls before stitches are built or repaired only for requests that cannot grow instead and the smallest free runs are moved first (0 to 1; 1: no limit)",
    ),
    (
        "stitch_short_share",
        "with stitching, a request lacking less than 1/N of its size builds or repairs a stitch only while cached stitches are taken whole as often as built (0 to 1024; 0: off)",
    ),
    (
        "expandable_segments",
        "grow one virtual address range per pool and stream by mapping pages (true/false)",
    ),
];

const MIB: u64 = 1 << 20;

/// The largest MiB count a size key accepts (16 TiB).
const MAX_MB: u64 = 1 << 24;

/// The largest byte count a byte key accepts (1 PiB).
pub const MAX_BYTES: u64 = 1 << 50;

/// The largest `roundup_power2_divisions` divisor.
const MAX_DIVISIONS: u64 = 1024;

/// How much of a user-supplied value an error message repeats.
const SHOW_MAX: usize = 64;

/// A validated allocator configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Blocks at least this large are "oversize": never split. `u64::MAX` when unset.
    pub max_split_size: u64,
    /// Slack allowed between an oversize request and the cached block serving it.
    pub max_non_split_rounding: u64,
    /// `garbage_collection_threshold`, 0 when off.
    pub gc_threshold: f64,
    /// `roundup_power2_divisions` per bucket (1 MiB, 2 MiB, ... 32 GiB and up).
    pub power2_divisions: [u64; POWER2_INTERVALS],
    /// Segment size for requests of 1–10 MiB.
    pub large_segment_size: u64,
    /// Fraction of device memory that reserved memory may reach.
    pub memory_fraction: Option<f64>,
    /// Absolute cap on reserved memory.
    pub memory_limit: Option<u64>,
    /// Whether a stream may take another stream's cached block before growing.
    pub cross_stream_reuse: bool,
    /// Whether the default pools use expandable segments.
    pub expandable_segments: bool,
    /// Whether a capture reuses cross-stream blocks once its graph orders
    /// them (Note [Reuse inside a capture]).
    pub graph_capture_record_stream_reuse: bool,
    /// With expandable segments: remap free pages instead of growing past the headroom.
    pub defragment: bool,
    /// With defragmentation: move pages whose work may still run without
    /// waiting, and unmap their old place later (Note [Unmapping behind the work]).
    pub defer_unmap: bool,
    /// With expandable segments: unmap ranges given up on a helper thread
    /// (Note [Unmapping off the allocating thread]).
    pub unmap_thread: bool,
    /// How far held memory may exceed peak allocated memory before defragmenting.
    pub defragment_headroom: f64,
    /// The share of the memory limit in force (`memory_limit`, the
    /// fraction) that peak allocated memory passes before the headroom is
    /// at least 5% (Note [Headroom under pressure] in `expandable.rs`; 1:
    /// never).
    pub defragment_pressure: f64,
    /// The share of elapsed time defragmenting may spend in driver calls.
    pub defragment_budget: f64,
    /// The share of elapsed time defragmenting may spend in driver calls
    /// before stitches are built only where growing cannot serve.
    pub stitch_budget: f64,
    /// Requests of at least this many bytes may be stitched (`u64::MAX`: never).
    pub stitch_min: u64,
    /// A request lacking less than 1/N of its size builds or repairs a
    /// stitch only where stitches have paid (0: off; Note [When a stitch
    /// pays] in `stitch_cache.rs`).
    pub stitch_short_share: u64,
    /// Mapping granularity of large-pool expandable segments.
    pub expandable_page: u64,
    /// Largest physical handle created at once.
    pub expandable_handle: u64,
    /// The string this configuration was parsed from.
    pub source: String,
}

impl Default for Config {
    /// gpualloc's policy (see the module docs).
    fn default() -> Self {
        Config {
            max_split_size: u64::MAX,
            max_non_split_rounding: 20 * MIB,
            gc_threshold: 0.0,
            power2_divisions: [0; POWER2_INTERVALS],
            large_segment_size: 20 * MIB,
            memory_fraction: None,
            memory_limit: None,
            cross_stream_reuse: true,
            expandable_segments: true,
            graph_capture_record_stream_reuse: false,
            defragment: true,
            defer_unmap: true,
            unmap_thread: true,
            defragment_headroom: 0.005,
            defragment_pressure: 0.5,
            defragment_budget: 0.03,
            stitch_budget: 0.05,
            stitch_min: 32 * MIB,
            stitch_short_share: 0,
            expandable_page: 2 * MIB,
            expandable_handle: 16 * MIB,
            source: String::new(),
        }
    }
}

/// A configuration string that could not be used; names the key and the value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The offending key (or the whole entry when no key could be read).
    pub key: String,
    /// What was wrong with it.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gpualloc config: `{}`: {}", self.key, self.reason)
    }
}

impl std::error::Error for ConfigError {}

fn err(key: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        key: show(key),
        reason: reason.into(),
    }
}

/// `v` for an error message: at most [`SHOW_MAX`] characters, so that a huge
/// configuration string cannot make a huge message.
fn show(v: &str) -> String {
    match v.char_indices().nth(SHOW_MAX) {
        None => v.to_string(),
        Some((i, _)) => format!("{}... ({} bytes)", &v[..i], v.len()),
    }
}

impl Config {
    /// Reads `GPUALLOC_CONF`; an unset or empty variable gives the defaults,
    /// a value that is not UTF-8 is an error.
    pub fn from_env() -> Result<Config, ConfigError> {
        match std::env::var("GPUALLOC_CONF") {
            Ok(s) => Config::parse(&s),
            Err(std::env::VarError::NotPresent) => Config::parse(""),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(err("GPUALLOC_CONF", "the value is not valid UTF-8"))
            }
        }
    }

    /// PyTorch's caching allocator, rule for rule (`policy:pytorch`). With
    /// `expandable_segments:true` as well, PyTorch's expandable segments as
    /// closely as gpualloc's keys allow: large-pool pages of its 20 MiB
    /// segment size, and neither defragmentation nor stitching, which
    /// PyTorch does not do (keys inert without expandable segments).
    pub fn pytorch() -> Config {
        Config {
            cross_stream_reuse: false,
            expandable_segments: false,
            defragment: false,
            stitch_min: u64::MAX,
            expandable_page: 20 * MIB,
            ..Config::default()
        }
    }

    /// Whether the string this configuration was parsed from gives `key`
    /// itself (rather than leaving it to the defaults or a `policy`).
    pub fn states(&self, key: &str) -> bool {
        split_top_level(&self.source).is_ok_and(|entries| {
            entries
                .iter()
                .any(|e| e.split_once(':').is_some_and(|(k, _)| k.trim() == key))
        })
    }

    /// Parses `key:value,key:[a:b,>:c]`. Whitespace around tokens is ignored.
    pub fn parse(s: &str) -> Result<Config, ConfigError> {
        if s.contains('\0') {
            return Err(err(s, "contains a NUL byte"));
        }
        let mut entries: Vec<(&str, &str)> = Vec::new();
        for entry in split_top_level(s)? {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            let (key, value) = entry
                .split_once(':')
                .ok_or_else(|| err(entry, "expected key:value"))?;
            let key = key.trim();
            if entries.iter().any(|e| e.0 == key) {
                return Err(err(key, "given more than once"));
            }
            entries.push((key, value.trim()));
        }
        let mut c = Config::default();
        // `policy` sets the defaults, wherever it is written.
        for &(key, value) in entries.iter().filter(|e| e.0 == "policy") {
            c = match value {
                "gpualloc" => Config::default(),
                "pytorch" => Config::pytorch(),
                other => {
                    return Err(err(
                        key,
                        format!("`{}` is not a policy (gpualloc or pytorch)", show(other)),
                    ));
                }
            };
        }
        c.source = s.to_string();
        for (key, value) in entries.into_iter().filter(|e| e.0 != "policy") {
            c.set(key, value)?;
        }
        Ok(c)
    }

    fn set(&mut self, key: &str, v: &str) -> Result<(), ConfigError> {
        match key {
            "max_split_size_mb" => {
                let mb = parse_u64(key, v)?;
                if !(20..=MAX_MB).contains(&mb) {
                    return Err(err(key, format!("{mb} is not in 20..={MAX_MB} (MiB)")));
                }
                self.max_split_size = mb * MIB;
            }
            "max_non_split_rounding_mb" => {
                let mb = parse_u64(key, v)?;
                if mb > MAX_MB {
                    return Err(err(key, format!("{mb} is above {MAX_MB} (MiB)")));
                }
                self.max_non_split_rounding = mb * MIB;
            }
            "garbage_collection_threshold" => {
                let x = parse_f64(key, v)?;
                if !(x > 0.0 && x < 1.0) {
                    return Err(err(key, format!("{x} is not strictly between 0 and 1")));
                }
                self.gc_threshold = x;
            }
            "roundup_power2_divisions" => self.power2_divisions = parse_divisions(key, v)?,
            "large_segment_size_mb" => {
                let mb = parse_u64(key, v)?;
                if !(2..=1024).contains(&mb) || mb % 2 != 0 {
                    return Err(err(
                        key,
                        format!("{mb} must be an even number of MiB from 2 to 1024"),
                    ));
                }
                self.large_segment_size = mb * MIB;
            }
            "per_process_memory_fraction" => {
                let x = parse_f64(key, v)?;
                if !(x > 0.0 && x <= 1.0) {
                    return Err(err(key, format!("{x} is not in (0, 1]")));
                }
                self.memory_fraction = Some(x);
            }
            "memory_limit" => {
                let bytes = parse_bytes(key, v)?;
                if bytes == 0 {
                    return Err(err(
                        key,
                        "0 is refused: omit the key for no limit (gpualloc_set_memory_limit(0) also means no limit)",
                    ));
                }
                self.memory_limit = Some(bytes);
            }
            "cross_stream_reuse" => self.cross_stream_reuse = parse_bool(key, v)?,
            "expandable_segments" => self.expandable_segments = parse_bool(key, v)?,
            "graph_capture_record_stream_reuse" => {
                self.graph_capture_record_stream_reuse = parse_bool(key, v)?;
            }
            "defragment" => self.defragment = parse_bool(key, v)?,
            "defer_unmap" => self.defer_unmap = parse_bool(key, v)?,
            "unmap_thread" => self.unmap_thread = parse_bool(key, v)?,
            "expandable_page_mb" => {
                let mb = parse_u64(key, v)?;
                if !(2..=1024).contains(&mb) || mb % 2 != 0 {
                    return Err(err(
                        key,
                        format!("{mb} must be an even number of MiB from 2 to 1024"),
                    ));
                }
                self.expandable_page = mb * MIB;
            }
            "expandable_handle_mb" => {
                let mb = parse_u64(key, v)?;
                if !(2..=1024).contains(&mb) || !mb.is_power_of_two() {
                    return Err(err(
                        key,
                        format!("{mb} must be a power of two from 2 to 1024"),
                    ));
                }
                self.expandable_handle = mb * MIB;
            }
            "stitch_min_mb" => {
                let mb = parse_u64(key, v)?;
                if mb > (1 << 20) {
                    return Err(err(key, format!("{mb} is above 1048576")));
                }
                self.stitch_min = if mb == 0 { u64::MAX } else { mb * MIB };
            }
            "stitch_short_share" => {
                let n = parse_u64(key, v)?;
                if n > 1024 {
                    return Err(err(key, format!("{n} is above 1024")));
                }
                self.stitch_short_share = n;
            }
            "defragment_headroom" => {
                let x = parse_f64(key, v)?;
                if !(0.0..=1.0).contains(&x) {
                    return Err(err(key, format!("{x} is not in [0, 1]")));
                }
                self.defragment_headroom = x;
            }
            "defragment_pressure" => {
                let x = parse_f64(key, v)?;
                if !(0.0..=1.0).contains(&x) {
                    return Err(err(key, format!("{x} is not in [0, 1]")));
                }
                self.defragment_pressure = x;
            }
            "defragment_budget" => {
                let x = parse_f64(key, v)?;
                if !(0.0..=1.0).contains(&x) {
                    return Err(err(key, format!("{x} is not in [0, 1]")));
                }
                self.defragment_budget = x;
            }
            "stitch_budget" => {
                let x = parse_f64(key, v)?;
                if !(0.0..=1.0).contains(&x) {
                    return Err(err(key, format!("{x} is not in [0, 1]")));
                }
                self.stitch_budget = x;
            }
            _ => {
                let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
                return Err(err(
                    key,
                    format!("unknown key; known keys: {}", known.join(", ")),
                ));
            }
        }
        Ok(())
    }

    /// The `roundup_power2_divisions` value for a size's bucket.
    pub fn power2_divisions_for(&self, size: u64) -> u64 {
        self.power2_divisions[power2_bucket(size)]
    }
}

/// Splits on commas that are not inside brackets (also PyTorch's strings,
/// `torch_settings.rs`).
pub(crate) fn split_top_level(s: &str) -> Result<Vec<&str>, ConfigError> {
    let (mut depth, mut start, mut out) = (0i32, 0usize, Vec::new());
    for (i, ch) in s.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => {
                depth -= 1;
                if depth < 0 {
                    return Err(err(s, "unbalanced ']'"));
                }
            }
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(err(s, "unbalanced '['"));
    }
    out.push(&s[start..]);
    Ok(out)
}

fn parse_u64(key: &str, v: &str) -> Result<u64, ConfigError> {
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(err(
            key,
            format!("`{}` is not a non-negative integer", show(v)),
        ));
    }
    v.parse()
        .map_err(|_| err(key, format!("`{}` is too large", show(v))))
}

/// A plain decimal such as `0.5` or `1` (no sign, exponent, inf or nan).
fn parse_f64(key: &str, v: &str) -> Result<f64, ConfigError> {
    let plain = v.bytes().any(|b| b.is_ascii_digit())
        && v.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && v.bytes().filter(|&b| b == b'.').count() <= 1;
    match v.parse::<f64>() {
        Ok(x) if plain => Ok(x),
        _ => Err(err(
            key,
            format!(
                "`{}` is not a plain decimal number (digits with at most one point, such as 0.005: no sign or exponent)",
                show(v)
            ),
        )),
    }
}

fn parse_bool(key: &str, v: &str) -> Result<bool, ConfigError> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        _ => Err(err(key, format!("`{}` is not true or false", show(v)))),
    }
}

/// Parses a byte count such as `40000000`, `24GiB`, `512M`, `1.5G` or `1PiB`: a
/// whole number of bytes up to [`MAX_BYTES`]. A fraction of a byte, a sign
/// or a larger count is an error naming `key`.
pub fn parse_bytes(key: &str, v: &str) -> Result<u64, ConfigError> {
    let t = v.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        // The largest count, named as its messages name it.
        "p" | "pb" | "pib" => 1 << 50,
        other => {
            return Err(err(
                key,
                format!("unknown unit `{}` in `{}`", show(other), show(v)),
            ));
        }
    };
    let x = parse_f64(key, num.trim())
        .map_err(|_| err(key, format!("`{}` is not a byte count", show(v))))?;
    let bytes = x * scale as f64;
    if bytes > MAX_BYTES as f64 {
        return Err(err(
            key,
            format!("`{}` is above the largest byte count, 1 PiB", show(v)),
        ));
    }
    if bytes.fract() != 0.0 {
        return Err(err(
            key,
            format!("`{}` is not a whole number of bytes ({bytes})", show(v)),
        ));
    }
    Ok(bytes as u64)
}

fn parse_divisions(key: &str, v: &str) -> Result<[u64; POWER2_INTERVALS], ConfigError> {
    let check = |d: u64| -> Result<u64, ConfigError> {
        if d == 0 || (d.is_power_of_two() && d <= MAX_DIVISIONS) {
            Ok(d)
        } else {
            Err(err(
                key,
                format!("divisor {d} is not 0 or a power of two up to {MAX_DIVISIONS}"),
            ))
        }
    };
    let mut out = [0u64; POWER2_INTERVALS];
    if let Some(list) = v.strip_prefix('[') {
        let list = list
            .strip_suffix(']')
            .ok_or_else(|| err(key, format!("`{}` lacks a closing ']'", show(v))))?;
        let mut last_set: Option<usize> = None;
        for item in list.split(',') {
            let (k, d) = item.split_once(':').ok_or_else(|| {
                err(
                    key,
                    format!("list entry `{}` is not size:divisor", show(item)),
                )
            })?;
            let d = check(parse_u64(key, d.trim())?)?;
            if last_set == Some(POWER2_INTERVALS - 1) {
                return Err(err(
                    key,
                    format!(
                        "entry `{}` follows the last interval (`>` or the largest size)",
                        show(item.trim())
                    ),
                ));
            }
            if k.trim() == ">" {
                let from = last_set.map_or(0, |i| i + 1);
                for slot in out.iter_mut().skip(from) {
                    *slot = d;
                }
                last_set = Some(POWER2_INTERVALS - 1);
            } else {
                let mb = parse_u64(key, k.trim())?;
                if !mb.is_power_of_two() || mb > MAX_MB {
                    return Err(err(
                        key,
                        format!("size {mb} MB is not a power of two up to {MAX_MB}"),
                    ));
                }
                let idx = power2_bucket(mb * MIB);
                if last_set.is_some_and(|last| idx <= last) {
                    return Err(err(
                        key,
                        format!(
                            "size {mb} MB is not in a later interval than the previous entry (sizes increase; 32768 MB and up share one interval)"
                        ),
                    ));
                }
                if last_set.is_none() {
                    // As PyTorch: the first entry also covers the smaller buckets.
                    out[..idx].fill(d);
                }
                out[idx] = d;
                last_set = Some(idx);
            }
        }
    } else {
        out = [check(parse_u64(key, v)?)?; POWER2_INTERVALS];
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
