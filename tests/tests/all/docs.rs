//! `docs/configuration.md` against the code: the key table lists exactly
//! [`gpualloc::config::KEYS`], with the defaults of [`Config::default`], and
//! the environment tables list exactly the `GPUALLOC_*` variables the
//! library, the Python package and the test scripts read.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpualloc::Config;
use gpualloc::config::KEYS;
use gpualloc::env_vars;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn doc() -> String {
    let path = root().join("docs/configuration.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The rows of the first table under `heading` (up to the next heading):
/// cells with their backticks removed, header and rule left out.
fn table(doc: &str, heading: &str) -> Vec<Vec<String>> {
    let start = doc
        .lines()
        .position(|l| l.trim() == heading)
        .unwrap_or_else(|| panic!("docs/configuration.md lacks the heading {heading:?}"));
    doc.lines()
        .skip(start + 1)
        .take_while(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with('|'))
        .skip(2)
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().trim_matches('`').to_string())
                .collect()
        })
        .collect()
}

fn first_cells(rows: &[Vec<String>]) -> BTreeSet<String> {
    rows.iter().map(|r| r[0].clone()).collect()
}

fn compare(what: &str, documented: &BTreeSet<String>, real: &BTreeSet<String>) {
    let missing: Vec<_> = real.difference(documented).collect();
    let extra: Vec<_> = documented.difference(real).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/configuration.md, {what}: not documented {missing:?}; documented but not in the code {extra:?}"
    );
}

#[test]
fn configuration_doc_lists_every_key_and_no_other() {
    let rows = table(&doc(), "## Keys");
    let real: BTreeSet<String> = KEYS.iter().map(|(k, _)| k.to_string()).collect();
    compare("## Keys", &first_cells(&rows), &real);
    assert_eq!(rows.len(), KEYS.len(), "a key is listed twice");
    for r in &rows {
        assert_eq!(r.len(), 4, "key, values, default, meaning: {r:?}");
        assert!(r.iter().all(|c| !c.is_empty()), "an empty cell: {r:?}");
    }
}

#[test]
fn configuration_doc_defaults_are_the_code_defaults() {
    let mut checked = 0;
    for r in table(&doc(), "## Keys") {
        let (key, default) = (&r[0], &r[2]);
        // Words (`unlimited`, `none`, `off`) name the absence of a value.
        if ["unlimited", "none", "off"].contains(&default.as_str()) {
            continue;
        }
        let parsed = Config::parse(&format!("{key}:{default}"))
            .unwrap_or_else(|e| panic!("{key}: the documented default does not parse: {e}"));
        let expected = Config {
            source: parsed.source.clone(),
            ..Config::default()
        };
        assert_eq!(parsed, expected, "{key}: documented default {default}");
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} defaults checked");
}

/// Every `"GPUALLOC_..."` string literal in the files under `dirs`.
fn variables_read(dirs: &[&str], exts: &[&str]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut stack: Vec<PathBuf> = dirs.iter().map(|d| root().join(d)).collect();
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
            continue;
        }
        let ext = p.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !exts.contains(&ext) {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        for (i, _) in text.match_indices("GPUALLOC_") {
            let quoted = i > 0 && matches!(text.as_bytes()[i - 1], b'"' | b'\'' | b'{');
            let name: String = text[i..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let closed = text[i + name.len()..].starts_with(['"', '\'', ':', '}']);
            if quoted && closed {
                out.insert(name);
            }
        }
    }
    out
}

#[test]
fn configuration_doc_lists_every_environment_variable() {
    let doc = doc();
    let product = variables_read(
        &[
            "allocator/src",
            "capi/src",
            "cli/src",
            "python-shim/gpualloc",
        ],
        &["rs", "py"],
    );
    compare(
        "## Environment variables",
        &first_cells(&table(&doc, "## Environment variables")),
        &product,
    );
    // The header's constants (`GPUALLOC_ERR_...`) are named in the ABI tests too.
    let header = std::fs::read_to_string(root().join("capi/include/gpualloc.h")).unwrap();
    let constants: BTreeSet<String> = header
        .lines()
        .filter_map(|l| l.strip_prefix("#define "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    let scripts: BTreeSet<String> = variables_read(
        &["tests/gpu", "capi/tests", "tools"],
        &["rs", "py", "sh", "c"],
    )
    .into_iter()
    .filter(|v| !product.contains(v) && !constants.contains(v))
    .collect();
    compare(
        "### Used by the test scripts",
        &first_cells(&table(&doc, "### Used by the test scripts")),
        &scripts,
    );
    // The names the library knows, to warn about any other
    // (`allocator/src/env_vars.rs`), are the documented ones.
    let known: BTreeSet<String> = env_vars::LIBRARY
        .iter()
        .chain(env_vars::PACKAGE)
        .map(|s| s.to_string())
        .collect();
    compare(
        "## Environment variables (env_vars::LIBRARY and PACKAGE)",
        &first_cells(&table(&doc, "## Environment variables")),
        &known,
    );
    let known: BTreeSet<String> = env_vars::SCRIPTS
        .iter()
        .map(|s| format!("GPUALLOC_{s}"))
        .collect();
    compare(
        "### Used by the test scripts (env_vars::SCRIPTS)",
        &first_cells(&table(&doc, "### Used by the test scripts")),
        &known,
    );
}
