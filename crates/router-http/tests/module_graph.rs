//! The crate's modules form no import cycle: the router does not know the
//! admin routes, the P/D glue does not know the router, and so on. Read
//! from the sources (`crate::module` paths outside comments, and the
//! crate-root re-exports they go through), so a change that closes a cycle
//! fails here with the cycle named.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module name -> its source, for every file under `src/`.
fn modules() -> BTreeMap<String, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let relative = path.strip_prefix(&src).unwrap().with_extension("");
            let mut name = relative.to_string_lossy().replace('/', "::");
            if let Some(parent) = name.strip_suffix("::mod") {
                name = parent.to_owned();
            }
            out.insert(name, std::fs::read_to_string(&path).unwrap());
        }
    }
    out
}

/// The top-level module each public name of the crate root comes from
/// (`pub use admin::{A, B};` maps `A` and `B` to `admin`).
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for statement in lib.split(';') {
        let statement = statement.trim();
        let Some(rest) = statement.strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        let names = names.trim_matches(|c| c == '{' || c == '}');
        for name in names.split(',') {
            let name = name.trim();
            if !name.is_empty() {
                out.insert(name.to_owned(), module.to_owned());
            }
        }
    }
    out
}

/// The top-level modules `source` refers to through `crate::`, comments
/// left out.
fn uses(source: &str, roots: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            match roots.get(&name) {
                Some(module) => out.insert(module.clone()),
                None => out.insert(name),
            };
        }
    }
    out
}

#[test]
fn the_module_graph_has_no_cycle() {
    let modules = modules();
    let roots = reexports(&modules["lib"]);
    // Edges between top-level modules (a submodule counts as its parent).
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, source) in &modules {
        let top = name.split("::").next().unwrap().to_owned();
        if top == "lib" || top == "fuzzing" {
            continue;
        }
        let edges = graph.entry(top.clone()).or_default();
        for used in uses(source, &roots) {
            if used != top && modules.contains_key(&used) && used != "lib" {
                edges.insert(used);
            }
        }
    }
    assert!(
        graph["router"].contains("pd"),
        "the graph was read: {graph:?}"
    );
    // Depth-first search for a back edge.
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) {
        if done.contains(node) {
            return;
        }
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            panic!("import cycle: {}", cycle.join(" -> "));
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, path, done);
        }
        path.pop();
        done.insert(node.to_owned());
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        visit(node, &graph, &mut Vec::new(), &mut done);
    }
}
