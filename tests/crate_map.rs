//! The crate map the docs draw, checked against `cargo metadata`: README's
//! crate table and layout, docs/architecture.md's crate graph and the files
//! it names, each crate's `Depends on:` line, and the facade's re-exports.
//!
//! One format names a crate's workspace dependencies everywhere: the
//! dependency names joined by `, ` (order free; the expected text lists
//! them alphabetically), `nothing` when there are none. A dependency that
//! only a feature turns on carries the feature: `lb-policies (feature
//! kv-block-index)`, or `(default feature tokens)` when the crate's default
//! features include it. Only normal dependencies count (target-specific
//! ones included); dev-dependencies are not part of the map.
//!
//! On a mismatch the test prints the exact text to paste, so adding a
//! dependency (or a crate) and updating the map is one step.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A workspace package as the map describes it.
struct Member {
    name: String,
    /// Its directory relative to the workspace root (empty for the facade).
    dir: PathBuf,
    /// Its workspace dependencies, rendered, by dependency name.
    deps: BTreeMap<String, String>,
}

impl Member {
    fn is_facade(&self) -> bool {
        self.dir.as_os_str().is_empty()
    }

    /// The expected "depends on" text.
    fn rendered(&self) -> String {
        if self.deps.is_empty() {
            "nothing".to_owned()
        } else {
            self.deps.values().cloned().collect::<Vec<_>>().join(", ")
        }
    }

    /// The dependencies as a set of rendered entries, for comparison.
    fn entries(&self) -> BTreeSet<String> {
        self.deps.values().cloned().collect()
    }
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `cargo metadata` of the workspace, without resolving anything outside it.
fn metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(&cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("running `{cargo} metadata`: {e}"));
    assert!(
        output.status.success(),
        "`cargo metadata` failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("`cargo metadata` prints JSON")
}

/// The features `feature` turns on (itself included), and the optional
/// dependencies they enable.
fn closure(
    features: &BTreeMap<String, Vec<String>>,
    optional: &BTreeSet<String>,
    feature: &str,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut seen, mut deps) = (BTreeSet::new(), BTreeSet::new());
    let mut todo = vec![feature.to_owned()];
    while let Some(next) = todo.pop() {
        if !seen.insert(next.clone()) {
            continue;
        }
        for value in features.get(&next).into_iter().flatten() {
            if let Some(dep) = value.strip_prefix("dep:") {
                deps.insert(dep.to_owned());
            } else if let Some((dep, _)) = value.split_once('/') {
                // `dep?/feature` leaves `dep` off; `dep/feature` turns it on.
                if !dep.ends_with('?') && optional.contains(dep) {
                    deps.insert(dep.to_owned());
                }
            } else if features.contains_key(value) {
                todo.push(value.clone());
            } else if optional.contains(value) {
                deps.insert(value.clone());
            }
        }
    }
    (seen, deps)
}

/// How `dep` is named in the map: bare, or with the feature that turns it
/// on. The feature named is the smallest: one that turns `dep` on without
/// going through another feature that does (`discovery`, not `cli`).
fn render(
    dep: &str,
    features: &BTreeMap<String, Vec<String>>,
    optional: &BTreeSet<String>,
) -> String {
    if !optional.contains(dep) {
        return dep.to_owned();
    }
    let closures: BTreeMap<&str, _> = features
        .keys()
        .filter(|f| f.as_str() != "default")
        .map(|f| (f.as_str(), closure(features, optional, f)))
        .collect();
    let enabling: BTreeSet<&str> = closures
        .iter()
        .filter(|(_, (_, deps))| deps.contains(dep))
        .map(|(f, _)| *f)
        .collect();
    let smallest: Vec<&str> = enabling
        .iter()
        .copied()
        .filter(|f| {
            let (reached, _) = &closures[f];
            !enabling.iter().any(|g| g != f && reached.contains(*g))
        })
        .collect();
    let named = if smallest.is_empty() {
        enabling.iter().copied().collect::<Vec<_>>()
    } else {
        smallest
    };
    let by_default = closure(features, optional, "default").1.contains(dep);
    format!(
        "{dep} ({}feature {})",
        if by_default { "default " } else { "" },
        named.join(" or ")
    )
}

/// Every workspace package with its workspace dependencies.
fn members() -> Vec<Member> {
    let metadata = metadata();
    let packages = metadata["packages"].as_array().expect("packages");
    let names: BTreeSet<&str> = packages
        .iter()
        .map(|p| p["name"].as_str().expect("package name"))
        .collect();
    let mut members: Vec<Member> = packages
        .iter()
        .map(|package| {
            let name = package["name"].as_str().expect("package name").to_owned();
            let manifest = PathBuf::from(package["manifest_path"].as_str().expect("manifest"));
            let dir = manifest
                .parent()
                .expect("a manifest's directory")
                .strip_prefix(root())
                .unwrap_or_else(|_| panic!("{name} lies outside the workspace"))
                .to_owned();
            let features: BTreeMap<String, Vec<String>> =
                serde_json::from_value(package["features"].clone()).expect("features");
            // A dependency may be listed more than once (per target): it
            // is optional only if every listing is.
            let mut listed: BTreeMap<String, bool> = BTreeMap::new();
            for dep in package["dependencies"].as_array().expect("dependencies") {
                let dep_name = dep["name"].as_str().expect("dependency name");
                let normal = dep["kind"].is_null();
                if !normal || !names.contains(dep_name) || dep["path"].is_null() {
                    continue;
                }
                let optional = dep["optional"].as_bool() == Some(true);
                let entry = listed.entry(dep_name.to_owned()).or_insert(true);
                *entry &= optional;
            }
            let optional: BTreeSet<String> = listed
                .iter()
                .filter(|(_, optional)| **optional)
                .map(|(dep, _)| dep.clone())
                .collect();
            let deps = listed
                .keys()
                .map(|dep| (dep.clone(), render(dep, &features, &optional)))
                .collect();
            Member { name, dir, deps }
        })
        .collect();
    members.sort_by_key(|m| m.name.clone());
    assert!(
        members.iter().filter(|m| m.is_facade()).count() == 1,
        "exactly one package at the workspace root (the facade)"
    );
    members
}

/// The members leaves first: by the length of their longest dependency
/// chain, then by name (the order of the expected graph).
fn bottom_up(members: &[Member]) -> Vec<&Member> {
    fn depth<'a>(
        name: &'a str,
        by_name: &BTreeMap<&'a str, &'a Member>,
        memo: &mut BTreeMap<&'a str, usize>,
    ) -> usize {
        if let Some(d) = memo.get(name) {
            return *d;
        }
        memo.insert(name, 0); // a cycle would be cargo's error, not ours
        let d = by_name[name]
            .deps
            .keys()
            .map(|dep| 1 + depth(dep, by_name, memo))
            .max()
            .unwrap_or(0);
        memo.insert(name, d);
        d
    }
    let by_name: BTreeMap<&str, &Member> = members.iter().map(|m| (m.name.as_str(), m)).collect();
    let mut memo = BTreeMap::new();
    let mut order: Vec<(usize, &Member)> = members
        .iter()
        .map(|m| (depth(&m.name, &by_name, &mut memo), m))
        .collect();
    order.sort_by(|a, b| (a.0, &a.1.name).cmp(&(b.0, &b.1.name)));
    order.into_iter().map(|(_, m)| m).collect()
}

/// A "depends on" text split into entries; `nothing` is none.
fn parse_entries(text: &str) -> BTreeSet<String> {
    let text = text.trim();
    if text == "nothing" {
        return BTreeSet::new();
    }
    text.split(',')
        .map(|entry| entry.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}

fn read(relative: &str) -> String {
    std::fs::read_to_string(root().join(relative))
        .unwrap_or_else(|e| panic!("reading {relative}: {e}"))
}

/// The lines of the section under `heading` (up to the next heading of
/// the same or a higher level).
fn section<'a>(text: &'a str, heading: &str) -> Vec<&'a str> {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let mut lines = text.lines().skip_while(|line| line.trim() != heading);
    assert!(lines.next().is_some(), "no `{heading}` heading");
    lines
        .take_while(|line| {
            let hashes = line.chars().take_while(|c| *c == '#').count();
            !(hashes > 0 && hashes <= level && line[hashes..].starts_with(' '))
        })
        .collect()
}

/// The lines of the first fenced block among `lines`.
fn first_fence<'a>(lines: &[&'a str], what: &str) -> Vec<&'a str> {
    let start = lines
        .iter()
        .position(|line| line.trim_start().starts_with("```"))
        .unwrap_or_else(|| panic!("{what}: no fenced block"));
    lines[start + 1..]
        .iter()
        .copied()
        .take_while(|line| !line.trim_start().starts_with("```"))
        .collect()
}

/// README.md's `| crate | what it is | depends on |` table: one row per
/// package, naming exactly its workspace dependencies.
fn check_readme_table(members: &[Member], problems: &mut Vec<String>) {
    let readme = read("README.md");
    let mut rows = readme
        .lines()
        .skip_while(|line| !line.starts_with("| crate | what it is | depends on |"))
        .skip(2)
        .take_while(|line| line.starts_with('|'));
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut said: BTreeMap<String, String> = BTreeMap::new();
    for row in rows.by_ref() {
        let cells: Vec<&str> = row.trim().trim_matches('|').split('|').collect();
        let Some(name) = cells.first().and_then(|c| c.split('`').nth(1)) else {
            problems.push(format!(
                "README.md, crate table: a row names no `crate`: {row}"
            ));
            continue;
        };
        *seen.entry(name.to_owned()).or_default() += 1;
        said.insert(
            name.to_owned(),
            cells.last().unwrap_or(&"").trim().to_owned(),
        );
    }
    if seen.is_empty() {
        problems.push(
            "README.md: no `| crate | what it is | depends on |` table (with rows)".to_owned(),
        );
        return;
    }
    for member in members {
        let expected = member.rendered();
        match (seen.get(&member.name), said.get(&member.name)) {
            (None, _) | (_, None) => problems.push(format!(
                "README.md, crate table: no row for `{}`; its \"depends on\" cell is: {expected}",
                member.name
            )),
            (Some(n), _) if *n > 1 => problems.push(format!(
                "README.md, crate table: {n} rows for `{}`; keep one",
                member.name
            )),
            (_, Some(cell)) if parse_entries(cell) != member.entries() => problems.push(format!(
                "README.md, crate table, row `{}`: \"depends on\" says `{cell}`; \
                 it depends on: {expected}",
                member.name
            )),
            _ => {}
        }
    }
    for name in seen.keys() {
        if !members.iter().any(|m| &m.name == name) {
            problems.push(format!(
                "README.md, crate table: row `{name}` is not a workspace package; remove it"
            ));
        }
    }
}

/// `one` to `twenty` (and digits) as a number.
fn number(word: &str) -> Option<usize> {
    const WORDS: [&str; 21] = [
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
        "twenty",
    ];
    word.parse()
        .ok()
        .or_else(|| WORDS.iter().position(|w| w.eq_ignore_ascii_case(word)))
}

/// Every path `src/…` or `crates/…` that `text` mentions (with `{a,b}`
/// alternatives expanded), as written.
fn mentioned_paths(text: &str, prefixes: &[&str]) -> Vec<String> {
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "_-./".contains(c);
    let mut found = Vec::new();
    let mut rest = text;
    while let Some((at, prefix)) = prefixes
        .iter()
        .filter_map(|p| rest.find(p).map(|at| (at, *p)))
        .min()
    {
        let starts_word = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !is_path_char(c));
        let mut end = at + prefix.len();
        if starts_word {
            let bytes = rest.as_bytes();
            while end < rest.len() {
                let c = bytes[end] as char;
                if is_path_char(c) {
                    end += 1;
                } else if c == '{' {
                    match rest[end..].find('}') {
                        Some(close) => end += close + 1,
                        None => break,
                    }
                } else {
                    break;
                }
            }
            let token = rest[at..end].trim_end_matches('.');
            found.extend(expand(token));
        }
        rest = &rest[end..];
    }
    found
}

/// `a/{b,c}.rs` as `a/b.rs` and `a/c.rs` (one pair of braces).
fn expand(token: &str) -> Vec<String> {
    match (token.find('{'), token.find('}')) {
        (Some(open), Some(close)) if open < close => token[open + 1..close]
            .split(',')
            .map(|alt| format!("{}{}{}", &token[..open], alt.trim(), &token[close + 1..]))
            .collect(),
        _ => vec![token.to_owned()],
    }
}

/// README.md's layout: the number of library crates, and `src/` described
/// by what it holds (each directory under src/ named, every path named
/// existing).
fn check_readme_layout(members: &[Member], problems: &mut Vec<String>) {
    let readme = read("README.md");
    let layout = first_fence(&section(&readme, "## Layout"), "README.md, ## Layout");
    let libraries = members
        .iter()
        .filter(|m| m.dir.starts_with("crates"))
        .count();
    let crates_line = layout.iter().find(|line| line.starts_with("crates/"));
    let stated = crates_line.and_then(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        words
            .windows(3)
            .find(|w| w[1] == "library" && w[2] == "crates")
            .and_then(|w| number(w[0]))
    });
    if stated != Some(libraries) {
        problems.push(format!(
            "README.md, ## Layout: the `crates/` line must say \"the {libraries} library \
             crates\" (in words or digits); it says: {}",
            crates_line.unwrap_or(&"(no crates/ line)")
        ));
    }
    // The src/ entry: its first line and the indented lines under it.
    let mut src_entry = String::new();
    let mut in_src = false;
    for line in &layout {
        if line.starts_with("src/") {
            in_src = true;
        } else if !line.starts_with(' ') {
            in_src = false;
        }
        if in_src {
            src_entry.push_str(line);
            src_entry.push('\n');
        }
    }
    if src_entry.is_empty() {
        problems.push("README.md, ## Layout: no `src/` line".to_owned());
        return;
    }
    let mut dirs: Vec<String> = std::fs::read_dir(root().join("src"))
        .expect("src/")
        .map(|entry| entry.expect("src/ entry").path())
        .filter(|path| path.is_dir())
        .map(|path| format!("src/{}", path.file_name().unwrap().to_string_lossy()))
        .collect();
    dirs.sort();
    let named = mentioned_paths(&src_entry, &["src/"]);
    for dir in &dirs {
        if !named.iter().any(|n| n.trim_end_matches('/') == dir) {
            problems.push(format!(
                "README.md, ## Layout: the `src/` entry does not say what {dir} holds \
                 (name it as `{dir}`)"
            ));
        }
    }
    for path in named {
        if !root().join(&path).exists() {
            problems.push(format!(
                "README.md, ## Layout: the `src/` entry names {path}, which does not exist"
            ));
        }
    }
}

/// docs/architecture.md's crate graph: one line per package, `crate ->
/// deps`, in the first fenced block under "## The crate graph" (an indented
/// line continues the one above).
fn check_architecture_graph(members: &[Member], problems: &mut Vec<String>) {
    let doc = read("docs/architecture.md");
    let block = first_fence(
        &section(&doc, "## The crate graph"),
        "docs/architecture.md, ## The crate graph",
    );
    let mut lines: Vec<String> = Vec::new();
    for line in block {
        if line.trim().is_empty() {
            continue;
        }
        match lines.last_mut() {
            Some(last) if line.starts_with(char::is_whitespace) => {
                last.push(' ');
                last.push_str(line.trim());
            }
            _ => lines.push(line.trim().to_owned()),
        }
    }
    let mut said: BTreeMap<String, Vec<BTreeSet<String>>> = BTreeMap::new();
    let mut wrong = false;
    for line in &lines {
        let Some((name, deps)) = line.split_once("->") else {
            problems.push(format!(
                "docs/architecture.md, crate graph: `{line}` is not `crate -> deps`"
            ));
            wrong = true;
            continue;
        };
        said.entry(name.trim().to_owned())
            .or_default()
            .push(parse_entries(deps));
    }
    for member in members {
        let line = format!("{} -> {}", member.name, member.rendered());
        match said.get(&member.name).map(Vec::as_slice) {
            None | Some([]) => {
                problems.push(format!(
                    "docs/architecture.md, crate graph: no line for `{}`: {line}",
                    member.name
                ));
                wrong = true;
            }
            Some([deps]) if *deps == member.entries() => {}
            Some([_]) => {
                problems.push(format!(
                    "docs/architecture.md, crate graph: the line of `{}` must be: {line}",
                    member.name
                ));
                wrong = true;
            }
            Some(_) => {
                problems.push(format!(
                    "docs/architecture.md, crate graph: `{}` has several lines; keep: {line}",
                    member.name
                ));
                wrong = true;
            }
        }
    }
    for name in said.keys() {
        if !members.iter().any(|m| &m.name == name) {
            problems.push(format!(
                "docs/architecture.md, crate graph: `{name}` is not a workspace package"
            ));
            wrong = true;
        }
    }
    if wrong {
        let mut block = String::from("```\n");
        for member in bottom_up(members) {
            block.push_str(&wrapped_graph_line(member));
        }
        block.push_str("```");
        problems.push(format!(
            "docs/architecture.md, crate graph: the whole block, to paste:\n{block}"
        ));
    }
}

/// `crate -> deps`, wrapped at 78 columns with the dependencies aligned.
fn wrapped_graph_line(member: &Member) -> String {
    let head = format!("{} -> ", member.name);
    let indent = " ".repeat(head.len());
    let mut out = head.clone();
    let mut width = head.len();
    let rendered = member.rendered();
    let entries: Vec<&str> = rendered.split(", ").collect();
    for (i, entry) in entries.iter().enumerate() {
        let piece = if i + 1 < entries.len() {
            format!("{entry},")
        } else {
            (*entry).to_owned()
        };
        if i > 0 {
            if width + 1 + piece.len() > 78 {
                out.push('\n');
                out.push_str(&indent);
                width = indent.len();
            } else {
                out.push(' ');
                width += 1;
            }
        }
        out.push_str(&piece);
        width += piece.len();
    }
    out.push('\n');
    out
}

/// Each library crate's README: one `Depends on: …` line, after its first
/// paragraph and before its first section or code block.
fn check_crate_readmes(members: &[Member], problems: &mut Vec<String>) {
    for member in members.iter().filter(|m| !m.is_facade()) {
        let path = member.dir.join("README.md");
        let shown = path.display();
        let expected = format!("Depends on: {}", member.rendered());
        let Ok(text) = std::fs::read_to_string(root().join(&path)) else {
            problems.push(format!("{shown} is missing; it needs the line: {expected}"));
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        let at: Vec<usize> = (0..lines.len())
            .filter(|i| lines[*i].starts_with("Depends on:"))
            .collect();
        let [at] = at[..] else {
            problems.push(format!(
                "{shown}: {} `Depends on:` lines; it needs exactly one, after the first \
                 paragraph: {expected}",
                at.len()
            ));
            continue;
        };
        let said = lines[at].trim_start_matches("Depends on:");
        if parse_entries(said) != member.entries() {
            problems.push(format!("{shown}: `{}`; it must be: {expected}", lines[at]));
        }
        let before = &lines[..at];
        let paragraph_before = before
            .iter()
            .any(|line| !line.trim().is_empty() && !line.starts_with('#'));
        let section_before = before
            .iter()
            .any(|line| line.starts_with("##") || line.trim_start().starts_with("```"));
        let own_paragraph = at > 0
            && lines[at - 1].trim().is_empty()
            && lines.get(at + 1).is_none_or(|line| line.trim().is_empty());
        if !paragraph_before || section_before || !own_paragraph {
            problems.push(format!(
                "{shown}: the `Depends on:` line must be a paragraph of its own right after \
                 the first paragraph (before any section or code block)"
            ));
        }
    }
}

/// src/lib.rs re-exports every library crate (`pub use name` or `pub use
/// name as module`), or a module of the facade does it whole (`pub use
/// name::*` in `src/<module>.rs`, declared `pub mod` in src/lib.rs: the
/// facade's `sim` adds one function to engine-sim's items).
fn check_reexports(members: &[Member], problems: &mut Vec<String>) {
    let lib = read("src/lib.rs");
    let mut sources = vec![lib.clone()];
    for module in lib
        .lines()
        .filter_map(|line| line.trim().strip_prefix("pub mod "))
        .filter_map(|rest| rest.strip_suffix(';'))
    {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("src/{module}.rs"));
        if let Ok(text) = std::fs::read_to_string(path) {
            sources.push(
                text.lines()
                    .filter(|line| line.trim().starts_with("pub use ") && line.contains("::*"))
                    .collect::<Vec<_>>()
                    .join("\n"),
            );
        }
    }
    let reexported: BTreeSet<&str> = sources
        .iter()
        .flat_map(|text| text.lines())
        .filter_map(|line| line.trim().strip_prefix("pub use "))
        .filter_map(|rest| rest.split([' ', ';', ':']).next())
        .collect();
    for member in members.iter().filter(|m| !m.is_facade()) {
        let ident = member.name.replace('-', "_");
        if !reexported.contains(ident.as_str()) {
            problems.push(format!(
                "src/lib.rs does not re-export `{}`: add `pub use {ident} as <module>;` (behind \
                 the facade's feature when the facade's dependency is optional) and a row in the \
                 module table of its docs",
                member.name
            ));
        }
    }
}

/// Every `crates/<name>/….rs` and `src/….rs` path docs/architecture.md
/// names exists.
fn check_architecture_paths(problems: &mut Vec<String>) {
    let doc = read("docs/architecture.md");
    let files: Vec<String> = mentioned_paths(&doc, &["crates/", "src/"])
        .into_iter()
        .filter(|path| path.ends_with(".rs"))
        .collect();
    // The request path names a dozen files: finding none means this
    // scanner no longer reads the page, not that the page is right.
    if files.len() < 10 {
        problems.push(format!(
            "docs/architecture.md: only {} source paths found; the request path names each \
             file it goes through as `crates/<crate>/src/….rs`",
            files.len()
        ));
    }
    for path in files {
        if !root().join(&path).is_file() {
            problems.push(format!(
                "docs/architecture.md names {path}, which does not exist"
            ));
        }
    }
}

#[test]
fn the_docs_draw_the_crate_map_cargo_metadata_reports() {
    let members = members();
    let mut problems = Vec::new();
    check_readme_table(&members, &mut problems);
    check_readme_layout(&members, &mut problems);
    check_architecture_graph(&members, &mut problems);
    check_crate_readmes(&members, &mut problems);
    check_reexports(&members, &mut problems);
    check_architecture_paths(&mut problems);
    assert!(
        problems.is_empty(),
        "the crate map in the docs disagrees with `cargo metadata` (the expected text \
         can be pasted as it is):\n\n{}\n",
        problems.join("\n\n")
    );
}

#[test]
fn a_dependency_behind_a_feature_names_the_smallest_feature_that_turns_it_on() {
    let features: BTreeMap<String, Vec<String>> = [
        ("default", vec!["cli"]),
        ("cli", vec!["discovery", "kubernetes", "dep:clap"]),
        ("discovery", vec!["dep:worker-discovery"]),
        (
            "kubernetes",
            vec!["discovery", "worker-discovery/kubernetes"],
        ),
        ("extra", vec!["prom-text?/x"]),
        ("metrics", vec!["prom-text"]),
        ("prom-text", vec!["dep:prom-text"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    let optional: BTreeSet<String> = ["worker-discovery", "prom-text", "clap"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(
        render("worker-discovery", &features, &optional),
        "worker-discovery (default feature discovery)"
    );
    assert_eq!(
        render("prom-text", &features, &optional),
        "prom-text (feature prom-text)",
        "`metrics` goes through `prom-text`, and `dep?/feature` turns nothing on"
    );
    assert_eq!(
        render("radix-affinity", &features, &optional),
        "radix-affinity"
    );
}

#[test]
fn paths_are_found_in_prose_with_alternatives_expanded() {
    let text = "see `crates/router-http/src/{server,service}.rs`, src/cli/app.rs. \
                and not xsrc/a.rs nor tests/b.rs";
    assert_eq!(
        mentioned_paths(text, &["crates/", "src/"]),
        [
            "crates/router-http/src/server.rs",
            "crates/router-http/src/service.rs",
            "src/cli/app.rs"
        ]
    );
    assert_eq!(
        parse_entries(" a,  b (feature  x) "),
        BTreeSet::from(["a".to_owned(), "b (feature x)".to_owned()])
    );
    assert!(parse_entries("nothing").is_empty());
}
