//! The core crate's shape: no import cycles between its modules, so each
//! piece of state (heap, page pool, fences, limits, private pools, stitch
//! cache, pending frees) can be read and tested without the allocator that
//! uses it; and the C ABI's backend dispatcher forwards every method.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("allocator/src is readable") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Top-level module of a file: `backend/sim.rs` is in `backend`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("file under src");
    let first = rel.components().next().expect("non-empty path");
    let name = first.as_os_str().to_string_lossy();
    name.trim_end_matches(".rs").to_string()
}

/// Module → the modules it names as `crate::name` outside comments.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../allocator/src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let module = module_of(&src, &file);
        if module == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("source is readable");
        let deps = graph.entry(module.clone()).or_default();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                let name: String = line[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    deps.insert(name);
                }
            }
        }
    }
    graph
}

/// A cycle through `node`, as the path of modules, if any.
fn cycle_from(
    graph: &BTreeMap<String, BTreeSet<String>>,
    node: &str,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(at) = path.iter().position(|m| m == node) {
        let mut cycle = path[at..].to_vec();
        cycle.push(node.to_string());
        return Some(cycle);
    }
    if done.contains(node) {
        return None;
    }
    path.push(node.to_string());
    for next in graph.get(node).into_iter().flatten() {
        if let Some(c) = cycle_from(graph, next, path, done) {
            return Some(c);
        }
    }
    path.pop();
    done.insert(node.to_string());
    None
}

#[test]
fn the_core_crate_has_no_import_cycles() {
    let graph = imports();
    assert!(graph.len() > 20, "read {} modules", graph.len());
    assert!(graph["device"].contains("heap"), "the scan sees imports");
    let mut done = BTreeSet::new();
    for module in graph.keys() {
        if let Some(c) = cycle_from(&graph, module, &mut Vec::new(), &mut done) {
            panic!("import cycle in allocator/src: {}", c.join(" -> "));
        }
    }
}

#[test]
fn state_pieces_do_not_depend_on_the_device_allocator() {
    let graph = imports();
    for piece in [
        "heap",
        "page_pool",
        "fence",
        "limits",
        "private_pool",
        "stitch_cache",
        "pending",
        "capture_markers",
    ] {
        assert!(
            !graph[piece].contains("device"),
            "{piece} imports device: {:?}",
            graph[piece]
        );
    }
}

/// Note [Typed trace events]: what a record's `size` and `aux` mean is
/// decoded once, by `TraceEvent::kind` in `allocator/src/trace/`; every
/// other reader matches on `EventKind`. So no Rust file outside that module
/// reads the positional field (building records in tests and importers, as
/// `aux: ...`, is writing, not reading).
#[test]
fn only_the_trace_module_reads_aux_by_position() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let trace = root.join("allocator/src/trace");
    let needle = [".", "aux"].concat();
    let mut files = Vec::new();
    for dir in [
        "allocator/src",
        "allocator/tests",
        "allocator/benches",
        "cli/src",
        "cli/tests",
        "capi/src",
        "capi/tests",
        "benches",
        "tests/src",
        "tests/tests",
    ] {
        let dir = root.join(dir);
        if dir.is_dir() {
            sources(&dir, &mut files);
        }
    }
    assert!(files.len() > 50, "found only {} sources", files.len());
    let mut readers = Vec::new();
    for file in files.iter().filter(|f| !f.starts_with(&trace)) {
        let text = std::fs::read_to_string(file).expect("source is readable");
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let reads = code.match_indices(&needle).any(|(i, _)| {
                !code[i + needle.len()..]
                    .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
            });
            if reads {
                readers.push(format!(
                    "{}:{}: {}",
                    file.strip_prefix(&root).unwrap_or(file).display(),
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        readers.is_empty(),
        "read `TraceEvent::kind()` instead of aux by position:\n{}",
        readers.join("\n")
    );
}

/// Names of the `fn` items of the block that opens with `start` (a trait
/// or an impl at the top level): lines indented by exactly four spaces,
/// with any qualifiers (`pub`, `unsafe`, `const`, `async`, `extern "C"`),
/// up to the block's closing `}` in the first column. Functions nested in
/// method bodies are indented further and not counted.
fn fns_in(text: &str, start: &str) -> BTreeSet<String> {
    let from = text
        .find(start)
        .unwrap_or_else(|| panic!("{start} not found"));
    let body = &text[from..];
    let end = body.find("\n}").expect("the block ends");
    let mut names = BTreeSet::new();
    for line in body[..end].lines() {
        let Some(item) = line.strip_prefix("    ") else {
            continue;
        };
        if item.starts_with(char::is_whitespace) || item.starts_with("//") {
            continue;
        }
        let words: Vec<&str> = item.split_whitespace().collect();
        if let Some(i) = words.iter().position(|w| *w == "fn")
            && words[..i].iter().all(|w| {
                [
                    "pub",
                    "pub(crate)",
                    "unsafe",
                    "const",
                    "async",
                    "extern",
                    "\"C\"",
                ]
                .contains(w)
            })
            && let Some(name) = words.get(i + 1)
        {
            names.insert(name.split(['(', '<']).next().unwrap_or("").to_string());
        }
    }
    names
}

/// `AnyBackend` (the C ABI's choice of backend) must forward every method
/// of the `Backend` trait: a method it forgets would silently take the
/// trait's default for the CUDA backend too.
#[test]
fn the_backend_dispatcher_forwards_every_method() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |p: &str| std::fs::read_to_string(root.join(p)).expect("source is readable");
    let trait_fns = fns_in(&read("allocator/src/backend/mod.rs"), "pub trait Backend");
    let forwarded = fns_in(&read("capi/src/global.rs"), "impl Backend for AnyBackend");
    assert!(trait_fns.len() > 20, "{trait_fns:?}");
    assert_eq!(
        fns_in(
            "trait T {\n    fn a(&self) {\n        fn nested() {}\n    }\n    unsafe fn b<X>();\n    /// fn c\n}\n",
            "trait T"
        ),
        BTreeSet::from(["a".to_string(), "b".to_string()]),
        "the parser counts items, not nested fns or comments"
    );
    let missing: Vec<_> = trait_fns.difference(&forwarded).collect();
    assert!(
        missing.is_empty(),
        "AnyBackend does not forward {missing:?}"
    );
}
