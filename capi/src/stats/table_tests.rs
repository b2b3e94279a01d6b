//! `GpuallocStats` against the stats table (Note [One table for stats] in
//! allocator/src/stats.rs). cbindgen cannot expand the table's macro, so
//! the C struct is written by hand; these tests read the committed header
//! (tests/header.rs keeps it equal to what cbindgen makes of the struct, and
//! the Python package's copy equal to it) and check, for every stat of the
//! table: the field exists, in the right place, with the right type and the
//! table's doc, and `to_c` copies the right value into it.

use gpualloc::{DeviceStats, STAT_FIELDS, STAT_POOLS, STATS, StatKind, StatValue};

use super::{GPUALLOC_STATS_VERSION, GpuallocStats, to_c};

/// Fields of `GpuallocStats` that are not stats of the table (the struct's
/// header, and fragmentation figures computed from the blocks), with the
/// version that appended them. They follow that version's stats.
const NOT_IN_TABLE: [(&str, u32, &str); 6] = [
    ("size", 0, "uint32_t"),
    ("version", 0, "uint32_t"),
    ("largest_free_block", 1, "uint64_t"),
    ("cached_free_bytes", 1, "uint64_t"),
    ("external_fragmentation", 1, "double"),
    ("unallocated_fraction", 1, "double"),
];

/// One field of a C struct in the header: its doc (comment lines joined),
/// C type and name.
#[derive(Debug, PartialEq)]
struct Field {
    doc: String,
    ty: String,
    name: String,
}

/// The fields of `typedef struct NAME { ... } NAME;` in `header`.
fn c_struct(header: &str, name: &str) -> Vec<Field> {
    let open = format!("typedef struct {name} {{");
    let start = header
        .find(&open)
        .unwrap_or_else(|| panic!("{name} not in the header"))
        + open.len();
    let end = start
        + header[start..]
            .find(&format!("}} {name};"))
            .expect("struct end");
    let mut fields = Vec::new();
    let mut doc = Vec::new();
    for line in header[start..end].lines().map(str::trim) {
        if let Some(c) = line.strip_prefix("//") {
            doc.push(c.trim().to_string());
        } else if let Some(decl) = line.strip_suffix(';') {
            let (ty, field) = decl.rsplit_once(' ').expect("`type name;`");
            fields.push(Field {
                doc: normalise(&doc.join(" ")),
                ty: ty.trim().to_string(),
                name: field.to_string(),
            });
            doc.clear();
        }
    }
    fields
}

fn normalise(doc: &str) -> String {
    doc.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn header() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/include/gpualloc.h");
    std::fs::read_to_string(path).expect("read include/gpualloc.h")
}

fn c_type(kind: StatKind) -> &'static str {
    match kind {
        StatKind::Array => "struct GpuallocStatArray",
        StatKind::Gauge => "struct GpuallocStat",
        StatKind::Counter | StatKind::Setting => "int64_t",
    }
}

/// `(name, type)` of every field `GpuallocStats` must have, in order: per
/// version, the table's stats of that version in table order, then the
/// other fields of that version.
fn expected_fields() -> Vec<(&'static str, &'static str)> {
    let mut out = Vec::new();
    for v in 0..=GPUALLOC_STATS_VERSION {
        out.extend(
            STATS
                .iter()
                .filter(|d| d.c_version == v && v > 0)
                .map(|d| (d.name, c_type(d.kind))),
        );
        out.extend(
            NOT_IN_TABLE
                .iter()
                .filter(|(_, fv, _)| *fv == v)
                .map(|&(n, _, t)| (n, t)),
        );
    }
    out
}

#[test]
fn c_struct_has_every_stat_in_table_order() {
    let got: Vec<(String, String)> = c_struct(&header(), "GpuallocStats")
        .into_iter()
        .map(|f| (f.name, f.ty))
        .collect();
    let want: Vec<(String, String)> = expected_fields()
        .into_iter()
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect();
    assert_eq!(
        got, want,
        "GpuallocStats and the stats table disagree: append new stats at the \
         end of both, with the next c_version (docs/stats.md)"
    );
    let newest = STATS.iter().map(|d| d.c_version).max().unwrap();
    assert_eq!(
        newest, GPUALLOC_STATS_VERSION,
        "a stat of a new C version needs GPUALLOC_STATS_VERSION raised"
    );
}

#[test]
fn c_struct_docs_are_the_tables() {
    let fields = c_struct(&header(), "GpuallocStats");
    for d in STATS.iter().filter(|d| d.c_version > 0) {
        let f = fields
            .iter()
            .find(|f| f.name == d.name)
            .expect("checked above");
        assert_eq!(f.doc, normalise(d.doc), "doc of GpuallocStats.{}", d.name);
    }
}

#[test]
fn stat_and_array_fields_match() {
    let names =
        |s: &str| -> Vec<String> { c_struct(&header(), s).into_iter().map(|f| f.name).collect() };
    assert_eq!(names("GpuallocStat"), STAT_FIELDS);
    assert_eq!(names("GpuallocStatArray"), STAT_POOLS);
}

/// The header's layout, computed from its field types, is the Rust struct's;
/// and reading each stat at its offset in `to_c`'s bytes gives the value the
/// table's accessor gives (a field `to_c` forgets or crosses shows here).
#[test]
fn to_c_copies_every_stat_into_its_field() {
    let stats = DeviceStats::numbered();
    let c = to_c(&stats);
    // SAFETY: GpuallocStats is repr(C) plain old data (integers and
    // doubles, no padding: checked by the size below), so its bytes are
    // initialised.
    let bytes: &[u8] = unsafe {
        std::slice::from_raw_parts(
            (&c as *const GpuallocStats).cast::<u8>(),
            std::mem::size_of::<GpuallocStats>(),
        )
    };
    let i64_at = |off: usize| i64::from_ne_bytes(bytes[off..off + 8].try_into().unwrap());
    let mut offset = 0;
    let mut checked = 0;
    for f in c_struct(&header(), "GpuallocStats") {
        let size = match f.ty.as_str() {
            "uint32_t" => 4,
            "int64_t" | "uint64_t" | "double" => 8,
            "struct GpuallocStat" => 32,
            "struct GpuallocStatArray" => 96,
            t => panic!("unknown C type {t}"),
        };
        assert_eq!(offset % size.min(8), 0, "{} unaligned", f.name);
        if let Some(i) = STATS.iter().position(|d| d.name == f.name) {
            let want: Vec<i64> = match stats.get(i).unwrap() {
                StatValue::Array(a) => a
                    .named()
                    .iter()
                    .flat_map(|(_, s)| [s.current, s.peak, s.allocated, s.freed])
                    .collect(),
                StatValue::Gauge(s) => vec![s.current, s.peak, s.allocated, s.freed],
                StatValue::Value(v) => vec![v],
            };
            let got: Vec<i64> = (0..want.len()).map(|k| i64_at(offset + 8 * k)).collect();
            assert_eq!(got, want, "GpuallocStats.{} from to_c", f.name);
            checked += 1;
        }
        offset += size;
    }
    assert_eq!(
        offset,
        std::mem::size_of::<GpuallocStats>(),
        "header layout"
    );
    let in_c = STATS.iter().filter(|d| d.c_version > 0).count();
    assert_eq!(checked, in_c);
    assert_eq!(
        (c.size as usize, c.version),
        (offset, GPUALLOC_STATS_VERSION)
    );
}

/// The checks above can fail: a header with a field missing, or two fields
/// swapped, is refused.
#[test]
fn a_drifted_header_is_caught() {
    let h = header();
    let missing = h.replacen("  int64_t num_stitch;\n", "", 1);
    assert_ne!(missing, h);
    let names = |h: &str| -> Vec<String> {
        c_struct(h, "GpuallocStats")
            .into_iter()
            .map(|f| f.name)
            .collect()
    };
    let want: Vec<&str> = expected_fields().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names(&h), want);
    assert_ne!(names(&missing), want);
    let swapped = h
        .replacen("int64_t num_ooms;", "int64_t TMP;", 1)
        .replacen("int64_t num_alloc_retries;", "int64_t num_ooms;", 1)
        .replacen("int64_t TMP;", "int64_t num_alloc_retries;", 1);
    assert_ne!(names(&swapped), want);
}
